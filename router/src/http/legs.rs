//! A disaggregated request's prefill leg, run by the HTTP front end before
//! its decode leg, with vLLM's disaggregated-prefill protocol (its
//! NixlConnector proxy's legs, so unmodified vLLM works):
//! - the prefill leg is the client's body with `kv_transfer_params`
//!   `{do_remote_decode: true, do_remote_prefill: false, remote_*: null}`,
//!   `stream: false`, `max_tokens: 1` (and `max_completion_tokens: 1`
//!   when present), without `stream_options`, `min_tokens` and
//!   `min_completion_tokens` ([`prefill_body`]);
//! - the prefill endpoint answers `kv_transfer_params` naming itself and
//!   the blocks it holds;
//! - the decode leg is the client's body with those `kv_transfer_params`,
//!   sent as any request is (streamed back, retried).
//!
//! Both legs' bodies are the client's edited as bytes, never parsed into a
//! tree: a 2 MB prompt of token ids costs two more copies of 2 MB, not a
//! tree twenty times its size. Both legs carry the request's
//! `X-Request-Id`. A prefill leg is cut at the hang deadline of a one-token
//! request ([`crate::request::hang`]) and retried on the next prefill
//! endpoint; when none answers, the decode endpoint prefills itself
//! (counted `fallback_local`). An answer is read only up to a bound in
//! proportion to the prompt ([`Bound`]); one out of proportion, or naming a
//! host other than the prefill endpoint's own, is not relayed: the decode
//! endpoint prefills itself. An answer without `kv_transfer_params` (an
//! engine without a KV connector) sends the client's request as it is
//! (`no_connector`). Then the decode leg is planned again through flow
//! control ([`crate::request::Service::plan_decode`]): its endpoint's seat
//! is taken when it starts, not while its prefill ran.

use std::borrow::Cow;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use axum::http::request::Parts;
use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use serde::Deserialize;
use serde::de::IgnoredAny;
use serde_json::value::RawValue;
use tokio::time::Instant;

use super::{Forwarder, upstream};
use crate::errors::ApiError;
use crate::pool::{Fault, Target};
use crate::prompt::body::KV_TRANSFER_PARAMS;
use crate::prompt::json_skim::{Object, Rejected, replaced};
use crate::request::hit_rate::Usage;
use crate::request::split::{Fallback, Prefill};
use crate::request::{Decision, SplitOutcome};

/// The prefill leg's `kv_transfer_params`.
const PREFILL_PARAMS: &[u8] = br#"{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}"#;

/// The client's members the prefill leg replaces or leaves out.
const REPLACED: [&str; 7] = [
    KV_TRANSFER_PARAMS,
    "stream",
    "max_tokens",
    "max_completion_tokens",
    "stream_options",
    "min_tokens",
    "min_completion_tokens",
];

/// The prefill leg's body for the client's `body`, a JSON object.
fn prefill_body(body: &[u8]) -> Result<Vec<u8>, Rejected> {
    let mut leg = Object::with_capacity(body.len() + PREFILL_PARAMS.len() + 64);
    let mut completion_tokens = false;
    leg.keep(body, |k| {
        completion_tokens |= k == "max_completion_tokens";
        !REPLACED.contains(&k)
    })?;
    leg.member(KV_TRANSFER_PARAMS, PREFILL_PARAMS)?;
    leg.member("stream", b"false")?;
    leg.member("max_tokens", b"1")?;
    if completion_tokens {
        leg.member("max_completion_tokens", b"1")?;
    }
    Ok(leg.end())
}

/// How much of a prefill answer is believed, for a prompt of `blocks`
/// blocks: one block id per block (one more when the router only
/// estimated the prompt's tokens: twice as many), and a few KB of the
/// other fields (engine and request ids, host, port). A hostile or broken
/// engine's answer beyond it is never read whole nor relayed.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Bound {
    block_ids: usize,
}

impl Bound {
    /// The `kv_transfer_params` fields besides `remote_block_ids`, bytes.
    const OTHER_PARAMS: usize = 4 << 10;
    /// The rest of a one-token answer (choices, usage, logprobs), bytes.
    const REST: usize = 64 << 10;
    /// A block id's text with its comma at most (`u64::MAX`).
    const ID_BYTES: usize = 21;

    fn new(prompt_tokens: u64, block_tokens: u64, exact: bool) -> Self {
        let blocks = prompt_tokens.div_ceil(block_tokens.max(1));
        let blocks = usize::try_from(blocks).unwrap_or(usize::MAX);
        let block_ids = if exact {
            blocks
        } else {
            blocks.saturating_mul(2)
        };
        Bound {
            block_ids: block_ids.saturating_add(1),
        }
    }

    /// The most of the answer read, bytes.
    fn answer_bytes(self) -> usize {
        (self.block_ids.saturating_mul(Self::ID_BYTES))
            .saturating_add(Self::OTHER_PARAMS + Self::REST)
    }
}

/// A prefill answer as read: only what the router uses, the
/// `kv_transfer_params` as their text.
#[derive(Deserialize)]
struct Wire<'a> {
    #[serde(borrow, default)]
    kv_transfer_params: Option<&'a RawValue>,
    #[serde(default)]
    usage: Option<WireUsage>,
}

#[derive(Default, Deserialize)]
struct WireUsage {
    #[serde(default)]
    prompt_tokens: Option<u64>,
    #[serde(default)]
    prompt_tokens_details: Option<WireDetails>,
}

#[derive(Deserialize)]
struct WireDetails {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

/// The fields of `kv_transfer_params` checked before they are relayed.
#[derive(Deserialize)]
struct Params<'a> {
    #[serde(borrow, default)]
    remote_block_ids: Option<&'a RawValue>,
    #[serde(borrow, default)]
    remote_host: Option<Cow<'a, str>>,
}

/// Why a prefill answer's `kv_transfer_params` are not relayed.
fn refused(params: &RawValue, bound: Bound, prefill: SocketAddr) -> Option<Fallback> {
    let Ok(p) = serde_json::from_str::<Params>(params.get()) else {
        return Some(Fallback::BadParams);
    };
    let ids = p.remote_block_ids.map_or(0, |ids| ids.get().len());
    let counted =
        (p.remote_block_ids).map(|ids| serde_json::from_str::<Option<Vec<IgnoredAny>>>(ids.get()));
    match counted {
        Some(Err(_)) => return Some(Fallback::BadParams),
        Some(Ok(Some(ids))) if ids.len() > bound.block_ids => {
            return Some(Fallback::TooManyBlocks);
        }
        _ => {}
    }
    if params.get().len() - ids > Bound::OTHER_PARAMS {
        return Some(Fallback::ParamsTooLarge);
    }
    let host = p.remote_host.as_deref();
    (host.is_some_and(|h| !own_host(h, prefill.ip()))).then_some(Fallback::ForeignHost)
}

/// Whether `host`, a prefill answer's `remote_host`, is the prefill
/// endpoint's own `ip` (vLLM's default, `localhost`, only when that is a
/// loopback address).
fn own_host(host: &str, ip: IpAddr) -> bool {
    match host.parse::<IpAddr>() {
        Ok(h) => h == ip,
        Err(_) => host.eq_ignore_ascii_case("localhost") && ip.is_loopback(),
    }
}

/// What a prefill leg's answer said.
struct Answer {
    /// Its `kv_transfer_params`' text, when checked.
    params: Result<Option<Box<RawValue>>, Fallback>,
    usage: Usage,
}

/// A prefill leg that was answered.
enum Prefilled {
    /// By `on` in `took`: `body` (with its `kv_transfer_params`) is the
    /// decode leg's.
    Relayed {
        on: SocketAddr,
        took: Duration,
        body: Bytes,
    },
    /// Without `kv_transfer_params`: the client's request goes as it is.
    NoConnector,
}

impl Forwarder {
    /// Runs `decision`'s prefill leg when it is disaggregated
    /// ([`crate::request::Service::split`]); its body is then the decode
    /// leg's. A request that had one then plans its decode leg again; an
    /// error is the client's answer (shed, or the router shutting down).
    pub(super) async fn prefill(
        self: &Arc<Self>,
        parts: &Parts,
        decision: &mut Decision,
    ) -> Result<(), ApiError> {
        let Some(prefill) = self.service.split(parts.uri.path(), decision).await else {
            return Ok(());
        };
        let outcome = self.legs(parts, decision, &prefill).await;
        let on = match &outcome {
            Ok(Prefilled::Relayed { on, .. }) => Some(*on),
            _ => None,
        };
        self.service.plan_decode(decision, on).await?;
        let metrics = &self.service.accounting.metrics.split;
        match outcome {
            Ok(Prefilled::Relayed { took, body, .. }) => {
                decision.prefilled(body, took);
                metrics.count(SplitOutcome::Disaggregated);
            }
            Ok(Prefilled::NoConnector) => metrics.count(SplitOutcome::NoConnector),
            Err(why) => metrics.fallback(why),
        }
        Ok(())
    }

    /// Sends the prefill leg to `prefill`'s targets in turn until one
    /// answers, or says why the decode endpoint prefills itself.
    async fn legs(
        &self,
        parts: &Parts,
        decision: &Decision,
        prefill: &Prefill,
    ) -> Result<Prefilled, Fallback> {
        let metrics = &self.service.accounting.metrics.split;
        let bytes = prefill_body(decision.body()).map_err(|Rejected| Fallback::BodyUnreadable)?;
        let bytes = Bytes::from(bytes);
        let (pool, accounting) = (&self.service.pool, &self.service.accounting);
        let a = decision.analysis();
        let request = a.request();
        let bound = Bound::new(a.prompt_tokens, a.block_tokens, a.tokenized);
        let targets = prefill.plan.targets.iter().take(self.attempts as usize);
        for (n, target) in targets.enumerate() {
            let cached = if n == 0 { prefill.cached } else { 0 };
            let uncached = request.prompt_tokens - cached;
            let ttft = pool.predicted_ttft(&request, target, uncached);
            let Some(load) = pool.start(&request, target, uncached) else {
                continue;
            };
            let sent = Instant::now();
            let deadline = sent + accounting.prefill_leg_deadline(ttft);
            let answer = self.leg(parts, &bytes, target, decision, (deadline, bound));
            let answer = answer.await;
            drop(load);
            let answer = match answer {
                Ok(answer) => answer,
                Err((error, fault)) => {
                    let kind = fault.map_or("transport", Fault::as_str);
                    accounting.failure(pool, &target.name, kind, fault);
                    tracing::info!(endpoint = %target.name, %error, "prefill leg failed");
                    continue;
                }
            };
            let took = sent.elapsed();
            metrics.prefill_seconds.observe(took.as_secs_f64());
            let usage = answer.usage;
            metrics.prompt_tokens.inc_by(usage.prompt_tokens);
            metrics.cached_tokens.inc_by(usage.cached_tokens);
            let params = answer.params.inspect_err(|why| {
                let reason = why.as_str();
                tracing::info!(endpoint = %target.name, reason, "a prefill answer not relayed");
            })?;
            let Some(params) = params else {
                return Ok(Prefilled::NoConnector);
            };
            if usage.prompt_tokens > 0 {
                decision.prefill_answered(&prefill.plan, n, cached, usage);
            }
            let body = replaced(decision.body(), KV_TRANSFER_PARAMS, params.get().as_bytes())
                .map_err(|Rejected| Fallback::BodyUnreadable)?;
            return Ok(Prefilled::Relayed {
                on: target.http,
                took,
                body: Bytes::from(body),
            });
        }
        Err(Fallback::PrefillFailed)
    }

    /// Sends the prefill leg `bytes` to `target` and reads its answer, by
    /// `deadline`, at most `bound`'s bytes of it.
    async fn leg(
        &self,
        parts: &Parts,
        bytes: &Bytes,
        target: &Target,
        decision: &Decision,
        (deadline, bound): (Instant, Bound),
    ) -> Result<Answer, (String, Option<Fault>)> {
        let id = decision.id();
        let request = upstream::request(parts, bytes, target, id, None, &self.private_headers)
            .map_err(|(e, fault)| (e.to_string(), fault))?;
        let hung = || ("no whole answer in time".to_owned(), Some(Fault::Timeout));
        let send = self.clients.get().request(request);
        let response = match tokio::time::timeout_at(deadline, send).await {
            Err(_) => return Err(hung()),
            Ok(Err(e)) => return Err((e.to_string(), Some(Fault::Connect))),
            Ok(Ok(response)) => response,
        };
        let status = response.status();
        if !status.is_success() {
            let fault = status.is_server_error().then_some(Fault::Status);
            return Err((format!("answered {status}"), fault));
        }
        let body = Limited::new(response.into_body(), bound.answer_bytes()).collect();
        let body = match tokio::time::timeout_at(deadline, body).await {
            Err(_) => return Err(hung()),
            Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
                let usage = Usage {
                    prompt_tokens: 0,
                    cached_tokens: 0,
                };
                let params = Err(Fallback::AnswerTooLarge);
                return Ok(Answer { params, usage });
            }
            Ok(Err(e)) => return Err((e.to_string(), Some(Fault::Stream))),
            Ok(Ok(body)) => body.to_bytes(),
        };
        let answer: Wire = serde_json::from_slice(&body)
            .map_err(|e| (format!("the answer is not JSON: {e}"), Some(Fault::Status)))?;
        let usage = answer.usage.unwrap_or_default();
        let usage = Usage {
            prompt_tokens: usage.prompt_tokens.unwrap_or(0),
            cached_tokens: (usage.prompt_tokens_details.and_then(|d| d.cached_tokens)).unwrap_or(0),
        };
        let params = match answer.kv_transfer_params {
            Some(p) if p.get().starts_with('{') => match refused(p, bound, target.http) {
                Some(why) => Err(why),
                None => Ok(Some(p.to_owned())),
            },
            _ => Ok(None),
        };
        Ok(Answer { params, usage })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(text: &str) -> Box<RawValue> {
        RawValue::from_string(text.to_owned()).unwrap()
    }

    const PREFILL: SocketAddr =
        SocketAddr::new(IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 9)), 8000);

    #[test]
    fn the_prefill_body_is_the_clients_edited_as_bytes() {
        let client = br#"{"model":"m","stream":true,"max_tokens":9,"max_completion_tokens":9,"stream_options":{"include_usage":true},"min_tokens":2,"kv_transfer_par\u0061ms":{"x":1},"messages":[{"role":"user","content":"hi"}]}"#;
        let leg: serde_json::Value =
            serde_json::from_slice(&prefill_body(client).unwrap()).unwrap();
        assert_eq!(
            leg,
            serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false,
                    "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null},
                "stream": false, "max_tokens": 1, "max_completion_tokens": 1})
        );
        let plain: serde_json::Value =
            serde_json::from_slice(&prefill_body(br#"{"prompt":"p"}"#).unwrap()).unwrap();
        assert!(plain.get("max_completion_tokens").is_none());
        assert_eq!(prefill_body(b"[1]"), Err(Rejected));
    }

    #[test]
    fn an_answer_out_of_proportion_to_the_prompt_or_naming_another_host_is_refused() {
        // 100 tokens of 16: 7 blocks, 8 ids at most when counted exactly.
        let bound = Bound::new(100, 16, true);
        assert_eq!(bound.block_ids, 8);
        assert_eq!(Bound::new(100, 16, false).block_ids, 15);
        let ok = params(
            r#"{"remote_block_ids":[1,2,3,4,5,6,7],"remote_host":"10.0.0.9","remote_port":5600}"#,
        );
        assert_eq!(refused(&ok, bound, PREFILL), None);
        let ids = (0..9).map(|i| i.to_string()).collect::<Vec<_>>().join(",");
        let many = params(&format!(r#"{{"remote_block_ids":[{ids}]}}"#));
        assert_eq!(
            refused(&many, bound, PREFILL),
            Some(Fallback::TooManyBlocks)
        );
        let padded = params(&format!(r#"{{"pad":"{}"}}"#, "x".repeat(5000)));
        assert_eq!(
            refused(&padded, bound, PREFILL),
            Some(Fallback::ParamsTooLarge)
        );
        let elsewhere = params(r#"{"remote_host":"10.0.0.10"}"#);
        assert_eq!(
            refused(&elsewhere, bound, PREFILL),
            Some(Fallback::ForeignHost)
        );
        let named = params(r#"{"remote_host":"localhost"}"#);
        assert_eq!(refused(&named, bound, PREFILL), Some(Fallback::ForeignHost));
        let loopback = SocketAddr::from(([127, 0, 0, 1], 8000));
        assert_eq!(refused(&named, bound, loopback), None);
        let odd = params(r#"{"remote_block_ids":"all"}"#);
        assert_eq!(refused(&odd, bound, PREFILL), Some(Fallback::BadParams));
        assert!(bound.answer_bytes() < 100 << 10);
        assert_eq!(Bound::new(u64::MAX, 1, false).answer_bytes(), usize::MAX);
    }
}
