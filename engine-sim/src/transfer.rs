//! Disaggregated prefill with vLLM's protocol (NixlConnector's
//! `kv_transfer_params`), so a router drives the simulator exactly as it
//! drives vLLM:
//! - a **producer** (`--kv-role producer` or `both`) given a non-streamed
//!   request with `kv_transfer_params.do_remote_decode` prefills it (the
//!   proxy sets `max_tokens: 1`), keeps its blocks when it finishes, and
//!   answers `kv_transfer_params` naming itself and them
//!   ([`answer`]). It frees them once read, or after
//!   `--kv-transfer-timeout-s` unread (counted `expired`), as vLLM does;
//! - a **consumer** (`consumer` or `both`) given `do_remote_prefill` with
//!   those fields reads the blocks from the named producer before queueing
//!   the request ([`load`]): the prompt is then admitted computed but its
//!   last token, its blocks enter the prefix cache (and WatchCache), and
//!   `cached_tokens` counts them, as vLLM counts externally computed
//!   tokens. A read that fails (unreachable, unknown, expired, other
//!   blocks) is counted `failed` and the consumer prefills itself, as vLLM
//!   falls back.
//!
//! Where vLLM reads the blocks over NIXL (RDMA), the simulator reads their
//! hashes over HTTP, `GET /v1/kv/{engine_id}/{request_id}` on the
//! producer's `--kv-transfer-listen` ([`router`]), which answers after
//! `--kv-transfer-ms-per-block` per block; the consumer checks them
//! against its own hashes of the prompt. Unlike vLLM, a consumer holds no
//! blocks while it reads.
//!
//! The transfer port is open to whoever reaches the pod, so it is served
//! with bounds ([`serve`]): a request's headers within
//! [`HEADER_READ_TIMEOUT`], at most `--kv-transfer-max-connections`
//! connections.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use hyper_util::rt::{TokioIo, TokioTimer};
use kvroute_core::engine::RequestId;
use kvroute_core::hash::{BlockDigest, BlockExtras};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tower::ServiceExt as _;

use crate::engine::Engine;
use crate::metrics::TransferResult;

/// What disaggregated requests an engine serves (vLLM's `kv_role`).
/// Ordinary requests run on every role.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Role {
    /// Prefills for consumers and reads from producers (`kv_both`).
    #[value(alias = "kv_both")]
    Both,
    /// Prefills for consumers (`kv_producer`).
    #[value(alias = "kv_producer")]
    Producer,
    /// Reads from producers (`kv_consumer`).
    #[value(alias = "kv_consumer")]
    Consumer,
}

impl Role {
    /// Whether it holds blocks for `do_remote_decode` requests.
    pub fn produces(self) -> bool {
        self != Role::Consumer
    }

    /// Whether it reads blocks for `do_remote_prefill` requests.
    pub fn consumes(self) -> bool {
        self != Role::Producer
    }
}

/// A request's `kv_transfer_params`, as vLLM's proxy sends them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Params {
    /// `do_remote_decode`: the prefill leg.
    pub remote_decode: bool,
    /// `do_remote_prefill` and where to read: the decode leg.
    pub remote_prefill: Option<Remote>,
}

/// The producer and the blocks a decode leg names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Remote {
    /// `remote_engine_id`.
    pub engine_id: String,
    /// `remote_request_id`.
    pub request_id: String,
    /// `remote_host`.
    pub host: String,
    /// `remote_port`.
    pub port: u16,
}

/// Parses `kv_transfer_params`; the error names the field.
pub fn parse(value: &Value) -> Result<Option<Params>, String> {
    let obj = match value {
        Value::Null => return Ok(None),
        Value::Object(obj) => obj,
        _ => return Err("'kv_transfer_params' must be an object".to_owned()),
    };
    let flag = |name: &str| match obj.get(name) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(format!("kv_transfer_params.{name} must be a boolean")),
    };
    let text = |name: &str| match obj.get(name) {
        Some(Value::String(s)) if !s.is_empty() => Ok(s.clone()),
        Some(Value::Number(n)) => Ok(n.to_string()),
        _ => Err(format!(
            "kv_transfer_params.{name} is required with do_remote_prefill"
        )),
    };
    let remote_decode = flag("do_remote_decode")?;
    let remote_prefill = if flag("do_remote_prefill")? {
        let port = obj.get("remote_port").and_then(Value::as_u64);
        let Some(port) = port.and_then(|p| u16::try_from(p).ok()).filter(|&p| p > 0) else {
            return Err(
                "kv_transfer_params.remote_port must be a port number with do_remote_prefill"
                    .to_owned(),
            );
        };
        Some(Remote {
            engine_id: text("remote_engine_id")?,
            request_id: text("remote_request_id")?,
            host: text("remote_host")?,
            port,
        })
    } else {
        None
    };
    Ok(Some(Params {
        remote_decode,
        remote_prefill,
    }))
}

/// The `kv_transfer_params` a producer answers for request `id`, whose
/// blocks it holds; the transfer server is `host:port`. `None` when it
/// holds nothing (the request did not finish).
pub fn answer(engine: &Engine, id: RequestId, host: &str, port: u16) -> Option<Value> {
    let hold = engine.hold(id)?;
    Some(json!({
        "do_remote_prefill": true,
        "do_remote_decode": false,
        "remote_block_ids": hold.blocks,
        "remote_engine_id": engine.engine_id(),
        "remote_request_id": id.to_string(),
        "remote_host": host,
        "remote_port": port,
        "tp_size": 1,
    }))
}

/// The transfer server's routes.
pub fn router(engine: Arc<Engine>) -> Router {
    Router::new()
        .route("/v1/kv/{engine_id}/{request_id}", get(read))
        .with_state(engine)
}

/// How long a connection to the transfer port may take to send a
/// request's headers, and stay idle between requests: a consumer's
/// request is one short line and a few headers.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);

/// Serves [`router`] over HTTP/1 on `listener` until `stopped` turns
/// true, then lets open connections finish their requests. A connection
/// has [`HEADER_READ_TIMEOUT`] for each request's headers; one past
/// `--kv-transfer-max-connections` open is closed at once, counted.
pub async fn serve(listener: TcpListener, engine: Arc<Engine>, mut stopped: watch::Receiver<bool>) {
    let max = engine.config().kv_transfer_max_connections as usize;
    let app = router(engine.clone());
    let mut http1 = hyper::server::conn::http1::Builder::new();
    // Without a timer hyper has no header-read timeout at all.
    http1
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT);
    let mut open = tokio::task::JoinSet::new();
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = stopped.wait_for(|s| *s) => break,
        };
        while open.try_join_next().is_some() {}
        let tcp = match accepted {
            Ok((tcp, _)) => tcp,
            Err(error) => {
                // Out of descriptors, most likely: back off, not spin.
                tracing::warn!(%error, "KV transfer port: accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        if open.len() >= max {
            // Dropped: closed at once.
            engine.count_transfer(TransferResult::Refused);
            continue;
        }
        let app = app.clone();
        let service = hyper::service::service_fn(move |request: Request<hyper::body::Incoming>| {
            app.clone().oneshot(request.map(Body::new))
        });
        let conn = http1.serve_connection(TokioIo::new(tcp), service);
        let mut stopped = stopped.clone();
        open.spawn(async move {
            tokio::pin!(conn);
            tokio::select! {
                r = conn.as_mut() => {
                    if let Err(error) = r {
                        tracing::debug!(%error, "KV transfer connection ended with an error");
                    }
                    return;
                }
                _ = stopped.wait_for(|s| *s) => {}
            }
            conn.as_mut().graceful_shutdown();
            let _ = conn.await;
        });
    }
    while open.join_next().await.is_some() {}
}

/// Frees a hold's blocks however the read ends (a consumer that leaves
/// mid-read included).
struct Release(Arc<Engine>, RequestId);

impl Drop for Release {
    fn drop(&mut self) {
        self.0.release(self.1);
    }
}

async fn read(
    State(engine): State<Arc<Engine>>,
    Path((engine_id, request_id)): Path<(String, String)>,
) -> Response {
    let hold = request_id
        .parse()
        .ok()
        .filter(|_| engine_id == engine.engine_id())
        .and_then(|id| Some((id, engine.take_hold(id)?)));
    let Some((id, hold)) = hold else {
        let message = format!(
            "engine {} holds no blocks for request {request_id:?} of engine {engine_id:?}: never held, already read, or expired",
            engine.engine_id()
        );
        return (StatusCode::NOT_FOUND, message).into_response();
    };
    let _release = Release(engine.clone(), id);
    let per_block = engine.config().kv_transfer_ms_per_block / 1000.0;
    tokio::time::sleep(engine.scaled_s(per_block * hold.blocks.len() as f64)).await;
    axum::Json(json!({"block_hashes": hold.hashes, "num_tokens": hold.tokens})).into_response()
}

/// Reads the blocks `remote` names for `prompt` (hashed with `extras`);
/// returns the prompt tokens loaded: all of them, or 0 when the read
/// failed (counted either way).
pub async fn load(
    engine: &Engine,
    client: &reqwest::Client,
    remote: &Remote,
    prompt: &[u32],
    extras: BlockExtras<'_>,
) -> usize {
    let hashes: Vec<u64> = (engine.hasher().digests(prompt, extras).iter())
        .map(BlockDigest::to_u64)
        .collect();
    let timeout = engine.scaled_s(engine.config().kv_transfer_timeout_s);
    let result = read_remote(client, remote, timeout, hashes.len()).await;
    let result = result.and_then(|(read, tokens)| {
        if read == hashes && tokens == prompt.len() {
            Ok(())
        } else {
            Err(format!(
                "the producer holds {} blocks of a {tokens}-token prompt, not this {}-token prompt's",
                read.len(),
                prompt.len()
            ))
        }
    });
    match result {
        Ok(()) => {
            engine.count_transfer(TransferResult::Ok);
            prompt.len()
        }
        Err(error) => {
            tracing::warn!(%error, engine = %remote.engine_id, host = %remote.host, port = remote.port, "KV transfer failed; prefilling locally");
            engine.count_transfer(TransferResult::Failed);
            0
        }
    }
}

/// The hashes and token count a producer answers, its body bounded by
/// what `blocks` hashes take.
async fn read_remote(
    client: &reqwest::Client,
    remote: &Remote,
    timeout: Duration,
    blocks: usize,
) -> Result<(Vec<u64>, usize), String> {
    let host = match remote.host.parse::<std::net::Ipv6Addr>() {
        Ok(v6) => format!("[{v6}]"),
        Err(_) => remote.host.clone(),
    };
    let mut url = reqwest::Url::parse(&format!("http://{host}:{}/", remote.port))
        .map_err(|e| format!("remote_host {:?}: {e}", remote.host))?;
    url.path_segments_mut()
        .map_err(|()| "not a base URL".to_owned())?
        .extend(["v1", "kv", &remote.engine_id, &remote.request_id]);
    let mut response = client
        .get(url)
        .timeout(timeout)
        .send()
        .await
        .map_err(|e| e.to_string())?;
    if !response.status().is_success() {
        return Err(format!("the producer answered {}", response.status()));
    }
    // A hash is at most 20 digits and a comma.
    let limit = 21 * blocks + 64;
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await.map_err(|e| e.to_string())? {
        body.extend_from_slice(&chunk);
        if body.len() > limit {
            return Err(format!("the producer's answer exceeds {limit} bytes"));
        }
    }
    let value: Value = serde_json::from_slice(&body).map_err(|e| e.to_string())?;
    let hashes = value
        .get("block_hashes")
        .and_then(Value::as_array)
        .and_then(|a| a.iter().map(Value::as_u64).collect::<Option<Vec<_>>>());
    let tokens = value.get("num_tokens").and_then(Value::as_u64);
    match (hashes, tokens) {
        (Some(hashes), Some(tokens)) => Ok((hashes, tokens as usize)),
        _ => Err("the producer's answer lacks block_hashes or num_tokens".to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_vllms_two_legs_and_names_a_bad_field() {
        let prefill = json!({"do_remote_decode": true, "do_remote_prefill": false,
            "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null});
        assert_eq!(
            parse(&prefill).unwrap(),
            Some(Params {
                remote_decode: true,
                remote_prefill: None
            })
        );
        let decode = json!({"do_remote_prefill": true, "do_remote_decode": false,
            "remote_block_ids": [1, 2], "remote_engine_id": "e", "remote_request_id": "7",
            "remote_host": "10.0.0.1", "remote_port": 5600, "tp_size": 1});
        let remote = parse(&decode).unwrap().unwrap().remote_prefill.unwrap();
        assert_eq!((remote.host.as_str(), remote.port), ("10.0.0.1", 5600));
        assert_eq!(parse(&Value::Null).unwrap(), None);
        let e = parse(&json!({"do_remote_prefill": true, "remote_engine_id": "e"})).unwrap_err();
        assert!(e.contains("remote_port"), "{e}");
        let e = parse(&json!({"do_remote_prefill": true, "remote_port": 1})).unwrap_err();
        assert!(e.contains("remote_engine_id"), "{e}");
        assert!(parse(&json!([])).is_err());
    }
}
