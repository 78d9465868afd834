//! The answer of `POST /debug/explain`: what the router computes from a
//! request and the decision it would make. Plain data, written by the
//! router and read back by `kvroute explain`, so both use this one
//! definition.
//!
//! Not here: computing it ([`crate::request::Service::explain`] and
//! [`crate::pool::Pool::explain`]).

use serde::{Deserialize, Serialize};

/// What `POST /debug/explain` answers: what the router computes from a
/// request, and the decision it would make.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Explanation {
    /// The API path.
    pub path: String,
    /// The request's `model`.
    pub model: Option<String>,
    /// The LoRA adapter the prompt is hashed with.
    pub lora: Option<String>,
    /// The routing key, hex.
    pub key: String,
    /// Prompt tokens (estimated from the body size when not tokenized).
    pub prompt_tokens: u64,
    /// Whether the router read and tokenized the prompt.
    pub tokenized: bool,
    /// `exact` (tokenized as the engines do) or `approximate` (the text in
    /// 4-byte pseudo-tokens: `tokens` is then empty, and `chain` and
    /// `prompt_tokens` count those).
    pub mode: String,
    /// The prompt's token ids.
    pub tokens: Vec<u32>,
    /// Tokens per block.
    pub block_size: usize,
    /// The block hash algorithm.
    pub hash_algo: String,
    /// The block chain, in the u64 form of KV events, hex.
    pub chain: Vec<String>,
    /// The pool's view and decision.
    pub decision: Explained,
}

/// A decision explained ([`Pool::explain`](crate::pool::Pool::explain)).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Explained {
    /// The policy that decided.
    pub policy: String,
    /// Why the first was chosen: `warm`, `cold`, `spill`, or `unreadable`
    /// (no prompt: least loaded).
    pub reason: String,
    /// Leading blocks the policy believes the first holds.
    pub cached_blocks: u32,
    /// Routable endpoints, best first (a full one is skipped when sent).
    pub ranked: Vec<String>,
    /// The prefill rate every endpoint's prediction is at, tokens per
    /// second: the pool's ([`kvroute_core::load::PrefillModel::pool_rate`]).
    pub prefill_tokens_per_second: f64,
    /// Every endpoint's view of the request.
    pub endpoints: Vec<ExplainedEndpoint>,
    /// With disaggregation on: the policy's choice of a prefill endpoint
    /// (used when the first ranked would prefill at least
    /// `minUncachedTokens` uncached tokens and is not its first).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill: Option<ExplainedPrefill>,
}

/// The policy's ranking of the prefill-capable endpoints.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ExplainedPrefill {
    /// Why the first was chosen (as [`Explained::reason`]).
    pub reason: String,
    /// Leading blocks the policy believes the first holds.
    pub cached_blocks: u32,
    /// Prefill-capable routable endpoints, best first.
    pub ranked: Vec<String>,
    /// `minUncachedTokens`.
    pub min_uncached_tokens: u64,
}

/// One endpoint's view of a request.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ExplainedEndpoint {
    /// Name.
    pub name: String,
    /// Ready, not draining, not ejected.
    pub routable: bool,
    /// At its concurrency limit.
    pub full: bool,
    /// Its engine contract (`unknown`, `match`, `mismatch`).
    pub contract: String,
    /// The request's leading blocks it holds, per the index.
    pub cached_blocks: u32,
    /// Requests in flight.
    pub in_flight: u32,
    /// Predicted prefill queued ahead of this request, seconds.
    pub queue_seconds: f64,
    /// Predicted wait for the KV blocks this request needs there (after
    /// the waiting requests'), seconds; 0 when the engine does not report
    /// its memory.
    pub memory_wait_seconds: f64,
    /// Predicted time to first token there: the longer of the two waits,
    /// then its own prefill, seconds.
    pub predicted_ttft_seconds: f64,
}

/// A served request's missed tokens, as `GET /debug/requests/{id}`
/// answers: hashes, counts and causes, never text or token ids.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Recorded {
    /// The request's `x-request-id`.
    pub request_id: String,
    /// The `id` of the engine's response object (`chatcmpl-…`).
    pub response_id: Option<String>,
    /// When the response ended, seconds since the Unix epoch.
    pub at_unix_s: u64,
    /// The `model` label.
    pub model: String,
    /// The `tenant` label.
    pub tenant: String,
    /// The endpoint that served it.
    pub endpoint: String,
    /// The routing key, hex.
    pub key: String,
    /// The prompt's first block hash, hex, when it has a full block.
    pub first_block: Option<String>,
    /// Tokens per block.
    pub block_size: u64,
    /// Prompt tokens as the router counted them.
    pub router_prompt_tokens: u64,
    /// Prompt tokens as the engine counted them.
    pub prompt_tokens: u64,
    /// Cached prompt tokens the router expected there.
    pub expected_cached_tokens: u64,
    /// Cached prompt tokens the engine reported.
    pub cached_tokens: u64,
    /// The missed tokens (`prompt_tokens − cached_tokens`) by cause,
    /// largest first.
    pub missed: Vec<(String, u64)>,
    /// Why an endpoint holding more of the prefix lost, with
    /// `routed_elsewhere` tokens.
    pub routed_elsewhere_reason: Option<String>,
    /// How long flow control held it at the router, seconds; absent when
    /// it was sent at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held_seconds: Option<f64>,
    /// Why it was held when it arrived: `requests_ahead`,
    /// `endpoints_full`, `predicted_wait` or `room_reserved`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held_because: Option<String>,
}
