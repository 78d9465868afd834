//! The exact response cache's coalescing against hostile or slow clients,
//! and the engine's `Cache-Control`, over an engine double on loopback: a
//! leader whose client does not read does not hold its followers, a
//! streamed request never waits behind another, and an answer the engine
//! marks `no-store` or `private` is not stored.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::support::*;
use kvroute_router::config::ResponseCache;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::watch;

const HEADER: &str = "x-kvroute-response-cache";

/// What the double does with a chat `POST`.
enum Reply {
    /// Answers at once with this response (head and body).
    Now(Vec<u8>),
    /// Answers with this once released.
    Held(Vec<u8>),
}

/// An engine double: each chat `POST` gets what its `reply` makes of its
/// body; `GET /v1/models` lists `kvroute-sim`. Counts chat `POST`s.
struct Double {
    addr: SocketAddr,
    posts: Arc<AtomicUsize>,
    release: watch::Sender<bool>,
}

impl Double {
    async fn start(reply: fn(&[u8]) -> Reply) -> Double {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let posts = Arc::new(AtomicUsize::new(0));
        let (release, released) = watch::channel(false);
        let counted = posts.clone();
        tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                let (posts, released) = (counted.clone(), released.clone());
                tokio::spawn(serve(socket, reply, posts, released));
            }
        });
        Double {
            addr,
            posts,
            release,
        }
    }

    fn posts(&self) -> usize {
        self.posts.load(Ordering::SeqCst)
    }
}

/// Serves one connection's requests, one after another.
async fn serve(
    mut socket: tokio::net::TcpStream,
    reply: fn(&[u8]) -> Reply,
    posts: Arc<AtomicUsize>,
    mut released: watch::Receiver<bool>,
) {
    let mut buf = Vec::new();
    loop {
        let head_end = loop {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            let mut more = [0u8; 65536];
            match socket.read(&mut more).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&more[..n]),
            }
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).to_lowercase();
        let length: usize = (head.lines())
            .find_map(|l| l.strip_prefix("content-length:"))
            .map_or(0, |v| v.trim().parse().unwrap());
        while buf.len() < head_end + length {
            let mut more = [0u8; 65536];
            match socket.read(&mut more).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&more[..n]),
            }
        }
        let body: Vec<u8> = buf.drain(..head_end + length).skip(head_end).collect();
        let response = if head.starts_with("post ") {
            posts.fetch_add(1, Ordering::SeqCst);
            match reply(&body) {
                Reply::Now(r) => r,
                Reply::Held(r) => {
                    if released.wait_for(|r| *r).await.is_err() {
                        return;
                    }
                    r
                }
            }
        } else {
            json_response(
                "",
                &json!({"object": "list", "data": [{"id": "kvroute-sim", "object": "model"}]}),
            )
        };
        // Written in pieces, so a client that stops reading stops the writer.
        for piece in response.chunks(64 * 1024) {
            if socket.write_all(piece).await.is_err() {
                return;
            }
        }
    }
}

/// A `200` JSON response with `extra` header lines.
fn json_response(extra: &str, body: &Value) -> Vec<u8> {
    let body = body.to_string();
    format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n{extra}\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// A storable chat completion saying `content`.
fn completion(content: &str) -> Value {
    json!({
        "id": "chatcmpl-double", "object": "chat.completion", "model": "kvroute-sim",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
            "logprobs": null, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 1},
    })
}

/// A `200` event stream, chunked, of `n` one-token chunks saying `x`,
/// its finish, its usage and `[DONE]`.
fn stream_response(n: usize) -> Vec<u8> {
    let chunk = |content: &str, finish: Option<&str>| {
        let v = json!({"id": "chatcmpl-double", "object": "chat.completion.chunk",
            "model": "kvroute-sim", "choices": [{"index": 0, "delta": {"content": content},
            "logprobs": null, "finish_reason": finish}]});
        format!("data: {v}\n\n")
    };
    let mut events = String::new();
    for _ in 0..n {
        events += &chunk("x", None);
    }
    events += &chunk("", Some("stop"));
    events += "data: {\"id\":\"chatcmpl-double\",\"object\":\"chat.completion.chunk\",\"model\":\"kvroute-sim\",\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":1}}\n\n";
    events += "data: [DONE]\n\n";
    let mut out = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n".to_vec();
    for piece in events.as_bytes().chunks(16 * 1024) {
        out.extend_from_slice(format!("{:x}\r\n", piece.len()).as_bytes());
        out.extend_from_slice(piece);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"0\r\n\r\n");
    out
}

fn streamed(body: &[u8]) -> bool {
    serde_json::from_slice::<Value>(body).is_ok_and(|v| v["stream"] == true)
}

/// A router over `double` with the response cache `cache` describes.
async fn router(
    name: &str,
    double: &Double,
    cache: impl FnOnce(&mut ResponseCache),
) -> kvroute_router::Running {
    let dir = upstream_dir(name, double.addr);
    let mut config = router_config(&dir);
    config.resilience.health_check = None;
    let mut c = ResponseCache {
        coalesce_wait_ms: 60_000,
        ..ResponseCache::default()
    };
    cache(&mut c);
    config.response_cache = Some(c);
    kvroute_router::start(config).await.unwrap()
}

fn question(user: &str, stream: bool) -> Value {
    json!({
        "model": "kvroute-sim", "temperature": 0, "max_tokens": 64, "stream": stream,
        "messages": [{"role": "user", "content": user}],
    })
}

/// Sends `body` from a client that never reads its answer; the socket
/// is kept open as long as the returned value is (and the router's
/// shutdown waits for it).
async fn never_reading(router: &kvroute_router::Running, body: &Value) -> tokio::net::TcpStream {
    let body = body.to_string();
    let mut socket = tokio::net::TcpStream::connect(router.addr()).await.unwrap();
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: kvroute\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    socket.write_all(request.as_bytes()).await.unwrap();
    socket
}

/// `n` identical non-streamed requests, spawned; polled until every one
/// has its whole answer (long before `coalesceWaitMs`), then their cache
/// header and `content`.
async fn followers(
    router: &kvroute_router::Running,
    body: &Value,
    n: usize,
) -> Vec<(String, String)> {
    let client = reqwest::Client::new();
    let url = format!("http://{}/v1/chat/completions", router.addr());
    let asks: Vec<_> = (0..n)
        .map(|_| {
            let (client, url, body) = (client.clone(), url.clone(), body.clone());
            tokio::spawn(async move {
                let r = client.post(url).json(&body).send().await.unwrap();
                assert_eq!(r.status(), 200);
                let result = r.headers()[HEADER].to_str().unwrap().to_owned();
                let v: Value = r.json().await.unwrap();
                let content = v["choices"][0]["message"]["content"].as_str().unwrap();
                (result, content.to_owned())
            })
        })
        .collect();
    eventually("every follower has its answer", || {
        asks.iter().all(|a| a.is_finished())
    })
    .await;
    let mut out = Vec::new();
    for a in asks {
        out.push(a.await.unwrap());
    }
    out
}

/// 80,000 chunks: about 14 MB of events, more than loopback's socket
/// buffers hold for a client that does not read, over 80 kB of content.
const LONG: usize = 80_000;

/// An engine double that streams [`LONG`] chunks, and answers a request
/// that is not streamed with "fresh".
async fn long_streams() -> Double {
    Double::start(|body| {
        Reply::Now(if streamed(body) {
            stream_response(LONG)
        } else {
            json_response("", &completion("fresh"))
        })
    })
    .await
}

#[tokio::test]
async fn a_leader_whose_client_never_reads_does_not_hold_its_followers() {
    let double = long_streams().await;
    // The whole stream fits the bound: read at the engine's pace, stored.
    let router = router("co-never-reads", &double, |c| {
        c.max_entry_bytes = 64 << 20;
        c.max_bytes = 256 << 20;
    })
    .await;
    let leader = never_reading(&router, &question("long", true)).await;
    eventually("the leader reached the engine", || double.posts() == 1).await;
    for (result, content) in followers(&router, &question("long", false), 4).await {
        assert_eq!(result, "hit");
        assert_eq!(content.len(), LONG, "the leader's whole answer");
    }
    assert_eq!(double.posts(), 1, "one engine call");
    drop(leader);
    router.shutdown().await;
}

#[tokio::test]
async fn followers_of_a_leader_whose_client_lags_past_max_entry_bytes_go_to_an_engine() {
    let double = long_streams().await;
    // The default 1 MiB bound: the client falls that far behind.
    let router = router("co-lags", &double, |_| {}).await;
    let leader = never_reading(&router, &question("long", true)).await;
    eventually("the leader reached the engine", || double.posts() == 1).await;
    for (result, content) in followers(&router, &question("long", false), 4).await {
        assert_eq!((result.as_str(), content.as_str()), ("miss", "fresh"));
    }
    assert_eq!(double.posts(), 5);
    let metrics = get_text(&format!("http://{}/metrics", router.admin_addr)).await;
    assert_eq!(
        sum_of(&metrics, "kvroute_response_cache_slow_leaders_total"),
        1.0
    );
    drop(leader);
    router.shutdown().await;
}

#[tokio::test]
async fn a_streamed_request_does_not_wait_behind_an_identical_one_in_flight() {
    let double = Double::start(|body| {
        if streamed(body) {
            Reply::Now(stream_response(3))
        } else {
            Reply::Held(json_response("", &completion("late")))
        }
    })
    .await;
    let router = router("co-streamed", &double, |_| {}).await;
    let client = reqwest::Client::new();
    let url = format!("http://{}/v1/chat/completions", router.addr());
    let leader = tokio::spawn((client.post(&url)).json(&question("held", false)).send());
    eventually("the leader reached the engine", || double.posts() == 1).await;

    let first_event = async {
        let mut r = (client.post(&url))
            .json(&question("held", true))
            .send()
            .await
            .unwrap();
        assert_eq!(r.headers()[HEADER], "miss");
        String::from_utf8(r.chunk().await.unwrap().unwrap().to_vec()).unwrap()
    };
    let event = tokio::time::timeout(Duration::from_secs(10), first_event)
        .await
        .expect("a streamed request waits behind its leader");
    assert!(event.starts_with("data: "), "{event}");
    assert_eq!(double.posts(), 2, "it went to an engine");

    double.release.send_replace(true);
    let answer: Value = leader.await.unwrap().unwrap().json().await.unwrap();
    assert_eq!(answer["choices"][0]["message"]["content"], "late");
    router.shutdown().await;
}

#[tokio::test]
async fn an_answer_the_engine_marks_no_store_or_private_is_not_stored() {
    let double = Double::start(|body| {
        let text = String::from_utf8_lossy(body);
        let header = if text.contains("no-store") {
            "cache-control: no-store\r\n"
        } else if text.contains("private") {
            "cache-control: private, max-age=60\r\n"
        } else {
            ""
        };
        Reply::Now(json_response(header, &completion("answer")))
    })
    .await;
    let router = router("co-cache-control", &double, |_| {}).await;
    let client = reqwest::Client::new();
    let ask = |user: &'static str| {
        let request = client
            .post(format!("http://{}/v1/chat/completions", router.addr()))
            .json(&question(user, false));
        async move {
            let r = request.send().await.unwrap();
            assert_eq!(r.status(), 200);
            r.headers()[HEADER].to_str().unwrap().to_owned()
        }
    };
    assert_eq!(ask("storable").await, "miss");
    assert_eq!(
        ask("storable").await,
        "hit",
        "the double's answer is storable"
    );
    for user in ["no-store", "private"] {
        assert_eq!(ask(user).await, "miss");
        assert_eq!(ask(user).await, "miss", "{user} is not stored");
    }
    assert_eq!(double.posts(), 5);
    let metrics = get_text(&format!("http://{}/metrics", router.admin_addr)).await;
    assert_eq!(
        sum_of(
            &metrics,
            "kvroute_response_cache_stores_total{reason=\"cache_control\"}"
        ),
        4.0
    );
    router.shutdown().await;
}

/// The figure: a streamed request identical to one in flight (a
/// 150-token answer at 20 ms a token) against a fresh one, time to its
/// first event, printed. Run with `--nocapture` to see it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_request_identical_to_one_in_flight_gets_its_first_event_from_an_engine() {
    let stack = Stack::start(
        "co-ttft",
        1,
        false,
        |c| c.itl_ms = 20.0,
        |c| c.response_cache = Some(ResponseCache::default()),
    )
    .await;
    let body = |user: &str, stream: bool| {
        let mut b = question(user, stream);
        b["max_tokens"] = json!(150);
        b
    };
    let engine_requests = || {
        sum_of(
            &stack.sims[0].engine.metrics_text(),
            "vllm:request_success_total",
        )
    };
    let running = || {
        sum_of(
            &stack.sims[0].engine.metrics_text(),
            "vllm:num_requests_running",
        )
    };
    let ttft = |b: Value| {
        let request = stack
            .client
            .post(stack.url("/v1/chat/completions"))
            .json(&b);
        async move {
            let started = Instant::now();
            let mut r = request.send().await.unwrap();
            assert_eq!(r.status(), 200);
            r.chunk().await.unwrap().unwrap();
            let first = started.elapsed();
            while r.chunk().await.unwrap().is_some() {}
            first
        }
    };
    let leader = tokio::spawn(
        (stack.client.post(stack.url("/v1/chat/completions")))
            .json(&body("in flight", false))
            .send(),
    );
    eventually("the leader is running", || running() == 1.0).await;
    let follower = ttft(body("in flight", true)).await;
    let fresh = ttft(body("fresh", true)).await;
    eprintln!(
        "time to first event, 150-token answer at 20 ms/token: streamed request identical to one in flight {:.3} s, fresh {:.3} s",
        follower.as_secs_f64(),
        fresh.as_secs_f64()
    );
    assert_eq!(leader.await.unwrap().unwrap().status(), 200);
    assert_eq!(
        engine_requests(),
        3.0,
        "the streamed request went to an engine"
    );
    stack.stop().await;
}
