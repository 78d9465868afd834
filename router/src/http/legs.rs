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
//! - the decode leg is the client's body with those `kv_transfer_params`
//!   ([`decode_body`]), sent as any request is (streamed back, retried).
//!
//! Both legs carry the request's `X-Request-Id`. A prefill leg that fails
//! is retried on the next prefill endpoint; when none answers, the decode
//! endpoint prefills itself (counted `fallback_local`). An answer without
//! `kv_transfer_params` (an engine without a KV connector) sends the
//! client's request as it is (`no_connector`).

use std::sync::Arc;

use axum::http::request::Parts;
use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use serde_json::{Map, Value, json};
use tokio::time::Instant;

use super::{Forwarder, upstream};
use crate::pool::{Fault, Target};
use crate::prompt::body::KV_TRANSFER_PARAMS;
use crate::request::hit_rate::Usage;
use crate::request::{Decision, SplitOutcome};

/// The most of a prefill leg's answer read: one token and its
/// `kv_transfer_params` (a block id per block of the prompt).
const MAX_ANSWER_BYTES: usize = 4 << 20;

/// The prefill leg's body for the client's `body`.
fn prefill_body(body: &Map<String, Value>) -> Map<String, Value> {
    let mut leg = body.clone();
    leg.insert(
        KV_TRANSFER_PARAMS.into(),
        json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
               "remote_block_ids": null, "remote_host": null, "remote_port": null}),
    );
    leg.insert("stream".into(), json!(false));
    leg.insert("max_tokens".into(), json!(1));
    if leg.contains_key("max_completion_tokens") {
        leg.insert("max_completion_tokens".into(), json!(1));
    }
    for field in ["stream_options", "min_tokens", "min_completion_tokens"] {
        leg.remove(field);
    }
    leg
}

/// The decode leg's body: the client's `body` with the prefill endpoint's
/// `params`.
fn decode_body(body: &Map<String, Value>, params: Value) -> Map<String, Value> {
    let mut leg = body.clone();
    leg.insert(KV_TRANSFER_PARAMS.into(), params);
    leg
}

/// What a prefill leg's answer said.
struct Answer {
    params: Option<Value>,
    usage: Usage,
}

impl Forwarder {
    /// Runs `decision`'s prefill leg when it is disaggregated
    /// ([`crate::request::Service::split`]); its body is then the decode
    /// leg's.
    pub(super) async fn prefill(self: &Arc<Self>, parts: &Parts, decision: &mut Decision) {
        let Some(prefill) = self.service.split(parts.uri.path(), decision).await else {
            return;
        };
        let metrics = &self.service.accounting.metrics.split;
        // Chat and completions bodies were read as JSON objects.
        let Ok(Value::Object(client)) = serde_json::from_slice(decision.body()) else {
            metrics.count(SplitOutcome::FallbackLocal);
            return;
        };
        let bytes = Bytes::from(serde_json::to_vec(&prefill_body(&client)).unwrap_or_default());
        let pool = &self.service.pool;
        let request = decision.analysis().request();
        let prompt_tokens = request.prompt_tokens;
        for (n, target) in (prefill.plan.targets.iter())
            .take(self.attempts as usize)
            .enumerate()
        {
            let cached = if n == 0 { prefill.cached } else { 0 };
            let Some(load) = pool.start(&request, target, prompt_tokens - cached) else {
                continue;
            };
            let sent = Instant::now();
            let answer = self.leg(parts, &bytes, target, decision).await;
            drop(load);
            match answer {
                Ok(answer) => {
                    let took = sent.elapsed();
                    metrics.prefill_seconds.observe(took.as_secs_f64());
                    let usage = answer.usage;
                    metrics.prompt_tokens.inc_by(usage.prompt_tokens);
                    metrics.cached_tokens.inc_by(usage.cached_tokens);
                    let Some(params) = answer.params else {
                        metrics.count(SplitOutcome::NoConnector);
                        return;
                    };
                    if usage.prompt_tokens > 0 {
                        decision.prefill_answered(&prefill.plan, n, cached, usage);
                    }
                    let body = serde_json::to_vec(&decode_body(&client, params));
                    decision.prefilled(Bytes::from(body.unwrap_or_default()), took);
                    metrics.count(SplitOutcome::Disaggregated);
                    return;
                }
                Err((error, fault)) => {
                    let kind = fault.map_or("transport", Fault::as_str);
                    let accounting = &self.service.accounting;
                    accounting.failure(pool, &target.name, kind, fault);
                    tracing::info!(endpoint = %target.name, %error, "prefill leg failed");
                }
            }
        }
        metrics.count(SplitOutcome::FallbackLocal);
    }

    /// Sends the prefill leg `bytes` to `target` and reads its answer.
    async fn leg(
        &self,
        parts: &Parts,
        bytes: &Bytes,
        target: &Target,
        decision: &Decision,
    ) -> Result<Answer, (String, Option<Fault>)> {
        let id = decision.id();
        let request = upstream::request(parts, bytes, target, id, None, &self.private_headers)
            .map_err(|(e, fault)| (e.to_string(), fault))?;
        let timeout = self.service.accounting.hang_cap();
        let send = self.clients.get().request(request);
        let response = match tokio::time::timeout(timeout, send).await {
            Err(_) => return Err(("no answer in time".into(), Some(Fault::Timeout))),
            Ok(Err(e)) => return Err((e.to_string(), Some(Fault::Connect))),
            Ok(Ok(response)) => response,
        };
        let status = response.status();
        let body = Limited::new(response.into_body(), MAX_ANSWER_BYTES).collect();
        let body = match tokio::time::timeout(timeout, body).await {
            Err(_) => {
                return Err((
                    "the answer did not end in time".into(),
                    Some(Fault::Timeout),
                ));
            }
            Ok(Err(e)) => return Err((e.to_string(), Some(Fault::Stream))),
            Ok(Ok(body)) => body.to_bytes(),
        };
        if !status.is_success() {
            let fault = status.is_server_error().then_some(Fault::Status);
            return Err((format!("answered {status}"), fault));
        }
        let answer: Value = serde_json::from_slice(&body)
            .map_err(|e| (format!("the answer is not JSON: {e}"), Some(Fault::Status)))?;
        let usage = &answer["usage"];
        Ok(Answer {
            params: answer
                .get(KV_TRANSFER_PARAMS)
                .filter(|p| p.is_object())
                .cloned(),
            usage: Usage {
                prompt_tokens: usage["prompt_tokens"].as_u64().unwrap_or(0),
                cached_tokens: usage["prompt_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .unwrap_or(0),
            },
        })
    }
}
