//! `kvroute-e2e bare-proxy`: the HTTP stack's floor. A reverse proxy of
//! hyper's server and hyper-util's pooled client, laid out as
//! kvroute-router's API port is (one single-threaded runtime per CPU, each
//! with its own upstream client), that does nothing else: no routing
//! decision, no body read (it streams through), no metrics, no limits.
//! What it costs per request beside nginx is what any router on this stack
//! pays before it reads a byte of the prompt.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};

use anyhow::Context as _;
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};

/// The floor proxy's settings.
#[derive(Debug, clap::Args)]
pub struct BareArgs {
    /// Address to listen on.
    #[arg(long)]
    pub listen: SocketAddr,
    /// Upstream addresses, taken in turn (comma-separated).
    #[arg(long, value_delimiter = ',', required = true)]
    pub upstream: Vec<SocketAddr>,
}

/// Serves until killed.
pub fn bare_proxy(args: &BareArgs) -> anyhow::Result<()> {
    let listener = std::net::TcpListener::bind(args.listen)
        .with_context(|| format!("binding {}", args.listen))?;
    listener.set_nonblocking(true)?;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let upstream: &'static [SocketAddr] = args.upstream.clone().leak();
    let mut handles = Vec::new();
    for k in 0..threads {
        let listener = listener.try_clone()?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        handles.push(std::thread::spawn(move || {
            runtime.block_on(serve(listener, upstream, k))
        }));
    }
    for h in handles {
        h.join()
            .map_err(|_| anyhow::anyhow!("a proxy thread panicked"))??;
    }
    Ok(())
}

/// One thread's accept loop, with its own client and turn.
async fn serve(
    listener: std::net::TcpListener,
    upstream: &'static [SocketAddr],
    first: usize,
) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::from_std(listener)?;
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: Client<_, Incoming> = Client::builder(TokioExecutor::new()).build(connector);
    let turn: &'static AtomicUsize = Box::leak(Box::new(AtomicUsize::new(first)));
    loop {
        let (tcp, _) = listener.accept().await?;
        tcp.set_nodelay(true)?;
        let client = client.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                let k = turn.fetch_add(1, Ordering::Relaxed) % upstream.len();
                forward(client.clone(), upstream[k], req)
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(tcp), service)
                .await;
        });
    }
}

/// `req` sent to `to`, its answer streamed back.
async fn forward(
    client: Client<HttpConnector, Incoming>,
    to: SocketAddr,
    req: Request<Incoming>,
) -> anyhow::Result<Response<Incoming>> {
    let (mut parts, body) = req.into_parts();
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    parts.uri = format!("http://{to}{path}").parse()?;
    Ok(client.request(Request::from_parts(parts, body)).await?)
}
