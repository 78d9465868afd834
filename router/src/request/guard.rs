//! A served request's response, as either front end follows it: the first
//! byte ends the prefill, the end counts the request and reads the
//! engine's `usage` against what the router expected, a broken stream
//! ejects the endpoint. It counts into the [`Accounting`] it holds with
//! the pool.

use std::sync::Arc;

use axum::http::StatusCode;
use tokio::time::Instant;

use super::labels::Labels;
use super::missed::{self, Known};
use super::{Accounting, RequestId};
use crate::metrics::Model;
use crate::pool::{Fault, InFlight, Pool};
use crate::request::hit_rate::UsageScan;

/// A served request's hold on its endpoint's load; dropping it (the client
/// went away) ends the request and, with the upstream body dropped too,
/// cancels it at the engine. Its labels count the request: with the status
/// when the body completed, `stream_error` when it broke, 499 when the
/// client left first.
pub(crate) struct Guard {
    accounting: Arc<Accounting>,
    pool: Arc<Pool>,
    load: InFlight,
    name: Arc<str>,
    sent: Instant,
    first: bool,
    labels: Labels,
    status: StatusCode,
    expected: Expected,
    /// The body's end, for the engine's usage.
    usage: UsageScan,
}

/// What the router expected of a request at the endpoint it was sent to.
#[derive(Clone, Debug)]
pub(crate) struct Expected {
    /// Prompt tokens it expected cached there.
    pub(crate) cached: u64,
    /// Prompt tokens, as the router computed them.
    pub(crate) prompt_tokens: u64,
    /// What it knew there, to attribute missed tokens by.
    pub(crate) known: Known,
    pub(crate) id: RequestId,
    /// The routing key.
    pub(crate) key: u64,
    /// The first block's hash.
    pub(crate) first_block: Option<u64>,
    /// How long flow control held it, and why.
    pub(crate) held: Option<crate::flow::Held>,
    /// How long its prefill leg took, when it was disaggregated.
    pub(crate) prefill_leg: Option<std::time::Duration>,
}

impl Guard {
    /// Follows the response of a request sent to endpoint `name` at `sent`
    /// holding `load`, answered with `status`, counted into `accounting`.
    pub(crate) fn new(
        (accounting, pool): (&Arc<Accounting>, &Arc<Pool>),
        (load, name): (InFlight, Arc<str>),
        sent: Instant,
        labels: Labels,
        status: StatusCode,
        expected: Expected,
    ) -> Self {
        Guard {
            accounting: accounting.clone(),
            pool: pool.clone(),
            load,
            name,
            sent,
            first: true,
            labels,
            status,
            expected,
            usage: UsageScan::default(),
        }
    }

    /// The request's id.
    pub(crate) fn id(&self) -> &RequestId {
        &self.expected.id
    }

    /// With `telemetry.cacheHeader`, what is expected of the request when
    /// its headers go out: `endpoint=…; expected-cached=N;
    /// expected-missed=cause:N,…`.
    pub(crate) fn cache_header(&self) -> Option<axum::http::HeaderValue> {
        if !self.accounting.cache_header {
            return None;
        }
        let e = &self.expected;
        let split = missed::attribute(&e.known, e.prompt_tokens, e.cached);
        let missed: Vec<String> = (split.causes().iter())
            .map(|(c, n)| format!("{}:{n}", c.as_str()))
            .collect();
        let value = format!(
            "endpoint={}; expected-cached={}; expected-missed={}",
            self.name,
            e.cached,
            missed.join(",")
        );
        axum::http::HeaderValue::from_str(&value).ok()
    }

    /// A body chunk of the response arrived.
    pub(crate) fn data(&mut self, data: &[u8]) {
        if self.first {
            self.first_byte();
        }
        if self.status.is_success() {
            self.usage.push(data);
        }
    }

    fn first_byte(&mut self) {
        self.first = false;
        self.load.first_token();
        let metrics = &self.accounting.metrics;
        let decode = self.sent.elapsed().as_secs_f64();
        metrics.upstream_ttft_seconds.observe(decode);
        if let Some(prefill) = self.expected.prefill_leg {
            let ttft = prefill.as_secs_f64() + decode;
            metrics.split.transfer_share.observe(decode / ttft);
        }
    }

    /// The response ended.
    pub(crate) fn done(&mut self) {
        if self.labels.count(self.status.as_str()) && !self.status.is_server_error() {
            let succeeded = self.pool.succeeded(&self.name);
            self.accounting.metrics.health(succeeded);
            // A disaggregated request's prompt was counted with its
            // prefill leg: the decode leg loaded it.
            if self.status.is_success() && self.expected.prefill_leg.is_none() {
                match self.usage.usage() {
                    Some((usage, id)) => {
                        let by = (&self.labels, &*self.pool);
                        (self.accounting).usage(by, &self.name, &self.expected, usage, id);
                    }
                    None => self.unreported(),
                }
            }
        }
    }

    /// The response broke off.
    pub(crate) fn broke(&mut self, error: &str) {
        let accounting = &self.accounting;
        if let Some(times) = accounting.warnings.admit(&self.name, "stream") {
            tracing::warn!(endpoint = %self.name, error, times, "upstream stream broke");
        }
        accounting.failure(&self.pool, &self.name, "stream", Some(Fault::Stream));
        self.labels.count("stream_error");
    }

    /// Counts the prompt tokens of a response without usage.
    fn unreported(&self) {
        (self.accounting.metrics)
            .unreported_prompt_tokens
            .get_or_create(&Model {
                model: self.labels.model.clone(),
            })
            .inc_by(self.expected.prompt_tokens);
    }
}
