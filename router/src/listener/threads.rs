//! The API port's threads: its connections are dealt to threads of their
//! own, each with a single-threaded runtime, so a connection, its requests
//! and their upstream connections stay on one thread.
//!
//! Not here: accepting (the accept loop is the listener's) or serving a
//! connection (`connection`).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};

use super::connection::Opener;
use super::limits::ConnLimits;
use super::open::{Connections, Slot};
use super::{accept, serve};
use crate::metrics::Metrics;

/// As [`serve`], with the connections dealt to `limits.threads` threads
/// of their own, each running a single-threaded runtime: a connection, its
/// requests and their upstream connections then stay on one thread, with
/// no hand-off between threads per request (the multi-threaded runtime
/// spent more time waking its workers than proxying small requests). Each
/// new connection goes to the thread with the fewest open ones.
/// `on_thread(k)` runs first on thread `k`.
pub async fn serve_on_threads(
    listener: TcpListener,
    app: Router,
    limits: ConnLimits,
    stopped: watch::Receiver<bool>,
    metrics: Arc<Metrics>,
    name: &'static str,
    on_thread: impl Fn(usize) + Clone + Send + 'static,
) {
    let opener = Arc::new(Opener::new(
        app,
        &limits,
        stopped.clone(),
        metrics.clone(),
        name,
    ));
    let mut workers = Vec::new();
    for k in 0..limits.threads.max(1) {
        match Worker::spawn(k, opener.clone(), on_thread.clone()) {
            Ok(w) => workers.push(w),
            Err(e) if !workers.is_empty() => {
                tracing::warn!(listener = name, error = %e, threads = k, "could not start every API thread; serving on fewer");
                break;
            }
            Err(e) => {
                tracing::error!(listener = name, error = %e, "could not start an API thread; serving on the runtime");
                return serve(listener, opener.app.clone(), limits, stopped, metrics, name).await;
            }
        }
    }
    let open = Arc::new(Connections::new(limits.max_connections));
    accept(listener, &open, stopped, &metrics, name, |tcp, slot| {
        let Some(worker) = workers
            .iter()
            .min_by_key(|w| w.open.load(Ordering::Relaxed))
        else {
            return;
        };
        match tcp.into_std() {
            Ok(tcp) => {
                worker.open.fetch_add(1, Ordering::Relaxed);
                // A worker only stops when its sender is dropped.
                let _ = worker.connections.send((tcp, slot));
            }
            Err(e) => {
                tracing::debug!(listener = name, error = %e, "could not hand a connection over")
            }
        }
    })
    .await;
    // Closing the channels lets each worker finish its connections and end.
    let threads: Vec<_> = workers.into_iter().map(|w| w.thread).collect();
    let _ = tokio::task::spawn_blocking(move || {
        for t in threads {
            let _ = t.join();
        }
    })
    .await;
}

/// A thread serving the connections sent to it.
struct Worker {
    connections: mpsc::UnboundedSender<(std::net::TcpStream, Slot)>,
    /// Its open connections.
    open: Arc<AtomicUsize>,
    thread: std::thread::JoinHandle<()>,
}

impl Worker {
    fn spawn(
        k: usize,
        opener: Arc<Opener>,
        on_thread: impl Fn(usize) + Send + 'static,
    ) -> std::io::Result<Worker> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let (connections, mut received) = mpsc::unbounded_channel::<(std::net::TcpStream, Slot)>();
        let open = Arc::new(AtomicUsize::new(0));
        let counted = open.clone();
        // The caller's subscriber, scoped or global, logs for the thread.
        let logs = tracing::dispatcher::get_default(Clone::clone);
        let thread = std::thread::Builder::new()
            .name(format!("kvroute-{}-{k}", opener.name))
            .spawn(move || {
                let _logs = tracing::dispatcher::set_default(&logs);
                on_thread(k);
                runtime.block_on(async move {
                    let mut running = tokio::task::JoinSet::new();
                    loop {
                        tokio::select! {
                            next = received.recv() => match next {
                                Some((tcp, slot)) => {
                                    let opener = opener.clone();
                                    let counted = counted.clone();
                                    running.spawn(async move {
                                        if let Ok(tcp) = TcpStream::from_std(tcp) {
                                            opener.open(tcp, slot).await;
                                        }
                                        counted.fetch_sub(1, Ordering::Relaxed);
                                    });
                                }
                                None => break,
                            },
                            Some(_) = running.join_next() => {}
                        }
                    }
                    while running.join_next().await.is_some() {}
                });
            })?;
        Ok(Worker {
            connections,
            open,
            thread,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;
    use crate::config::Limits;

    /// Which thread answers a request on `tcp` (a keep-alive connection).
    async fn thread_of(tcp: &mut TcpStream) -> String {
        tcp.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let mut answer = Vec::new();
        let mut buf = [0u8; 1024];
        while !answer.ends_with(b"@") {
            let n = tcp.read(&mut buf).await.unwrap();
            assert!(n > 0, "closed: {}", String::from_utf8_lossy(&answer));
            answer.extend_from_slice(&buf[..n]);
        }
        let text = String::from_utf8(answer).unwrap();
        let body = text.split("\r\n\r\n").nth(1).unwrap();
        body.trim_end_matches('@').to_owned()
    }

    #[tokio::test]
    async fn connections_are_dealt_to_the_least_busy_thread_and_stay_there() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = Router::new().route(
            "/",
            axum::routing::get(|| async {
                let name = std::thread::current().name().unwrap_or("?").to_owned();
                let k = API_THREAD_SEEN.with(std::cell::Cell::get);
                format!("{name}/{k:?}@")
            }),
        );
        let limits = ConnLimits {
            threads: 3,
            ..ConnLimits::admin(&Limits::default())
        };
        let (stop, stopped) = watch::channel(false);
        let server = tokio::spawn(serve_on_threads(
            listener,
            app,
            limits,
            stopped,
            Arc::new(Metrics::default()),
            "test",
            |k| API_THREAD_SEEN.with(|t| t.set(Some(k))),
        ));
        let mut conns = Vec::new();
        let mut seen = std::collections::BTreeMap::<String, usize>::new();
        for _ in 0..6 {
            let mut tcp = TcpStream::connect(addr).await.unwrap();
            *seen.entry(thread_of(&mut tcp).await).or_default() += 1;
            conns.push(tcp);
        }
        let dealt: Vec<_> = seen.iter().map(|(t, n)| format!("{t}={n}")).collect();
        assert_eq!(
            dealt,
            [
                "kvroute-test-0/Some(0)=2",
                "kvroute-test-1/Some(1)=2",
                "kvroute-test-2/Some(2)=2"
            ]
        );
        // A connection's next requests stay on its thread.
        for tcp in &mut conns {
            let first = thread_of(tcp).await;
            assert_eq!(thread_of(tcp).await, first);
        }
        // Stopping waits for the open connections: they close once idle.
        stop.send(true).unwrap();
        drop(conns);
        tokio::time::timeout(Duration::from_secs(10), server)
            .await
            .expect("the threads end")
            .unwrap();
    }

    thread_local! {
        static API_THREAD_SEEN: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
    }
}
