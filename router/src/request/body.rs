//! Request bodies in memory, for the HTTP proxy and the endpoint picker
//! alike. The rules:
//!
//! 1. A body is held within `limits.maxBodyBytes`; a declared length over
//!    it is refused (413) before any byte is read.
//! 2. The budget (`limits.maxBodyBytesInFlight`, all requests together) is
//!    reserved as bytes arrive, never from a declared length: a client
//!    that declares 32 MiB and sends one byte holds one KiB. What would
//!    exceed it is refused at once (503 with `Retry-After`).
//! 3. A tenant known from the request's credentials holds at most
//!    `limits.maxBodyBytesPerTenant` of it, so one tenant cannot take the
//!    budget from the others (429 with `Retry-After`).
//! 4. A body must arrive within `limits.bodyReadTimeoutMs`, and, after its
//!    first [`RATE_GRACE`], at `limits.bodyMinBytesPerS` on average since
//!    its headers: a sender that trickles cannot hold its share for the
//!    whole timeout (408).
//!
//! Every refusal is counted in `kvroute_request_bodies_refused_total` by
//! reason; what is held shows in `kvroute_request_body_bytes`. Not here:
//! reading frames off a connection (the proxy and the picker do, and ask
//! [`Received::deadline`] when to give up).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use crate::config::Limits;
use crate::errors::ApiError;
use crate::metrics::{Metrics, Why};

/// How long a body may take before its average rate is checked: a new
/// connection's first round trips and TCP's slow start.
pub const RATE_GRACE: Duration = Duration::from_secs(2);

/// The budget of request bodies in memory, all requests together and per
/// tenant, in KiB.
#[derive(Debug)]
pub struct BodyBudget {
    /// All bodies: a permit per KiB.
    all: Arc<Semaphore>,
    /// KiB each tenant holds; a tenant holding nothing has no entry, so
    /// the map is bounded by the requests in progress.
    tenants: Mutex<HashMap<Arc<str>, usize>>,
    per_tenant_kib: usize,
    limits: Limits,
    refused: Family<Why, Counter>,
    held_bytes: Gauge,
}

impl BodyBudget {
    /// The budget `limits` sets, counted in `metrics`.
    pub fn new(limits: &Limits, metrics: &Metrics) -> Arc<Self> {
        let kib = |bytes: usize| bytes.div_ceil(1024).min(Semaphore::MAX_PERMITS);
        Arc::new(BodyBudget {
            all: Arc::new(Semaphore::new(kib(limits.max_body_bytes_in_flight))),
            tenants: Mutex::default(),
            per_tenant_kib: kib(limits.max_body_bytes_per_tenant),
            limits: limits.clone(),
            refused: metrics.bodies_refused.clone(),
            held_bytes: metrics.body_bytes.clone(),
        })
    }

    /// Counts a refusal and returns it.
    fn refuse(&self, reason: &'static str, error: ApiError) -> ApiError {
        self.refused.get_or_create(&Why { reason }).inc();
        error
    }

    /// Gives back a tenant's `kib` (the global permits go back with
    /// their permit).
    fn release(&self, tenant: Option<&Arc<str>>, kib: usize) {
        let Some(tenant) = tenant else { return };
        let mut tenants = self.tenants.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(holds) = tenants.get_mut(tenant) {
            *holds = holds.saturating_sub(kib);
            if *holds == 0 {
                tenants.remove(tenant);
            }
        }
    }
}

/// A request's share of the [`BodyBudget`], given back when dropped.
#[derive(Debug)]
#[must_use = "dropping it gives the body's budget back"]
pub struct Held {
    budget: Arc<BodyBudget>,
    tenant: Option<Arc<str>>,
    permit: Option<OwnedSemaphorePermit>,
    kib: usize,
}

impl Held {
    /// `bytes` more of the budget for the same tenant, held apart and
    /// given back when the returned share is dropped (what parsing the
    /// body may cost while it does), or refused at once.
    pub fn more(&self, bytes: usize) -> Result<Held, ApiError> {
        let mut more = Held {
            budget: self.budget.clone(),
            tenant: self.tenant.clone(),
            permit: None,
            kib: 0,
        };
        more.reserve(bytes.div_ceil(1024))?;
        Ok(more)
    }

    /// Takes `kib` more of the budget, or refuses at once.
    fn reserve(&mut self, kib: usize) -> Result<(), ApiError> {
        let Held {
            budget,
            tenant,
            permit: held,
            kib: held_kib,
        } = self;
        let retry_after = budget.limits.retry_after_s;
        if let Some(tenant) = tenant {
            let mut tenants = budget.tenants.lock().unwrap_or_else(|e| e.into_inner());
            let holds = tenants.entry(tenant.clone()).or_default();
            if *holds + kib > budget.per_tenant_kib {
                if *holds == 0 {
                    tenants.remove(tenant);
                }
                let error = ApiError::TenantSaturated(retry_after);
                return Err(budget.refuse("tenant_budget", error));
            }
            *holds += kib;
        }
        let permit = u32::try_from(kib)
            .ok()
            .and_then(|n| budget.all.clone().try_acquire_many_owned(n).ok());
        let Some(permit) = permit else {
            budget.release(tenant.as_ref(), kib);
            let error = ApiError::Saturated("request bodies in memory", retry_after);
            return Err(budget.refuse("budget", error));
        };
        match held {
            Some(p) => p.merge(permit),
            None => *held = Some(permit),
        }
        *held_kib += kib;
        budget.held_bytes.inc_by(kib as i64 * 1024);
        Ok(())
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.budget.release(self.tenant.as_ref(), self.kib);
        self.budget.held_bytes.dec_by(self.kib as i64 * 1024);
    }
}

/// A request body as it arrives, within its limits (see the module doc).
#[derive(Debug)]
pub struct Received {
    /// The body while it is one frame: forwarded as hyper read it, with
    /// no copy.
    first: Option<Bytes>,
    /// The body once a second frame came: one contiguous copy, as the
    /// JSON scan and the tokenizer read it.
    buf: BytesMut,
    /// The declared length, bounding the copy's capacity.
    declared: usize,
    /// The most bytes it may hold: `limits.maxBodyBytes`, or less for a
    /// control route ([`Received::capped`]).
    limit: usize,
    held: Held,
    /// When the headers arrived.
    started: Instant,
}

impl Received {
    /// A body of `declared` length (when the headers say), for `tenant`;
    /// refused when the declared length is over `limits.maxBodyBytes`.
    /// Nothing is reserved yet.
    pub fn new(
        budget: &Arc<BodyBudget>,
        declared: Option<usize>,
        tenant: Option<&str>,
    ) -> Result<Self, ApiError> {
        Self::capped(budget, declared, tenant, usize::MAX)
    }

    /// [`Received::new`] for a body of at most `cap` bytes (a control
    /// route's, which carries a few fields), or `limits.maxBodyBytes` if
    /// lower: every other limit holds as for a proxied body.
    pub fn capped(
        budget: &Arc<BodyBudget>,
        declared: Option<usize>,
        tenant: Option<&str>,
        cap: usize,
    ) -> Result<Self, ApiError> {
        let limit = budget.limits.max_body_bytes.min(cap);
        if declared.is_some_and(|n| n > limit) {
            return Err(budget.refuse("too_large", ApiError::TooLarge { limit }));
        }
        Ok(Received {
            first: None,
            buf: BytesMut::new(),
            declared: declared.unwrap_or(0),
            limit,
            held: Held {
                budget: budget.clone(),
                tenant: tenant.map(Arc::from),
                permit: None,
                kib: 0,
            },
            started: Instant::now(),
        })
    }

    /// Bytes received so far.
    fn len(&self) -> usize {
        self.first.as_ref().map_or(self.buf.len(), Bytes::len)
    }

    /// Appends `data`, reserving the budget for it.
    pub fn push(&mut self, data: Bytes) -> Result<(), ApiError> {
        let limit = self.limit;
        let len = self.len() + data.len();
        if len > limit {
            let error = ApiError::TooLarge { limit };
            return Err(self.held.budget.refuse("too_large", error));
        }
        let more = len.div_ceil(1024).saturating_sub(self.held.kib);
        if more > 0 {
            self.held.reserve(more)?;
        }
        if self.first.is_none() && self.buf.is_empty() {
            self.first = Some(data);
            return Ok(());
        }
        if let Some(first) = self.first.take() {
            // Room for the declared length, but never more than twice
            // what arrived: a declared length reserves no memory.
            self.buf.reserve(self.declared.min(2 * len).max(len));
            self.buf.extend_from_slice(&first);
        }
        self.buf.extend_from_slice(&data);
        Ok(())
    }

    /// When the body must have grown, and what to answer if it has not:
    /// the body timeout, or sooner the minimum rate's deadline for one
    /// more byte.
    pub fn deadline(&self) -> (Instant, ApiError) {
        let limits = &self.held.budget.limits;
        let timeout = self.started + Duration::from_millis(limits.body_read_timeout_ms);
        let rate = limits.body_min_bytes_per_s.max(1) as f64;
        let slow = self.started + RATE_GRACE + Duration::from_secs_f64(self.len() as f64 / rate);
        if slow < timeout {
            let error = ApiError::BodyTooSlow {
                min_bytes_per_s: limits.body_min_bytes_per_s,
            };
            (slow, error)
        } else {
            let ms = limits.body_read_timeout_ms;
            (timeout, ApiError::BodyTimeout { ms })
        }
    }

    /// The answer once [`deadline`](Self::deadline) passed, counted.
    pub fn expired(&self) -> ApiError {
        let (_, error) = self.deadline();
        let reason = match error {
            ApiError::BodyTooSlow { .. } => "too_slow",
            _ => "timeout",
        };
        self.held.budget.refuse(reason, error)
    }

    /// The body so far, made one piece (a view, not a copy, once it is).
    pub fn bytes(&mut self) -> Bytes {
        if self.first.is_none() {
            self.first = Some(std::mem::take(&mut self.buf).freeze());
        }
        self.first.clone().unwrap_or_default()
    }

    /// Replaces the body with `body` (the router's rewrite of it),
    /// reserving the budget for any growth.
    pub fn replace(&mut self, body: Bytes) -> Result<(), ApiError> {
        let more = body.len().div_ceil(1024).saturating_sub(self.held.kib);
        if more > 0 {
            self.held.reserve(more)?;
        }
        self.buf = BytesMut::new();
        self.first = Some(body);
        Ok(())
    }

    /// The whole body and its share of the budget.
    pub fn finish(self) -> (Bytes, Held) {
        let body = self.first.unwrap_or_else(|| self.buf.freeze());
        (body, self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(f: impl FnOnce(&mut Limits)) -> (Arc<BodyBudget>, Metrics) {
        let mut limits = Limits::default();
        f(&mut limits);
        let metrics = Metrics::default();
        (BodyBudget::new(&limits, &metrics), metrics)
    }

    fn held(budget: &BodyBudget) -> usize {
        budget.all.available_permits()
    }

    #[test]
    fn a_body_read_in_one_frame_is_forwarded_without_a_copy() {
        let (budget, _) = budget(|l| l.max_body_bytes = 10_000);
        let frame = Bytes::from(vec![b'x'; 4_000]);
        for declared in [Some(4_000), None] {
            let mut one = Received::new(&budget, declared, None).unwrap();
            one.push(frame.clone()).unwrap();
            let (body, held) = one.finish();
            assert_eq!(body.as_ptr(), frame.as_ptr(), "the frame itself");
            assert_eq!(body.len(), 4_000);
            assert_eq!(held.kib, 4);
        }
        // More frames are joined into one buffer, in order.
        let mut two = Received::new(&budget, Some(8_000), None).unwrap();
        two.push(frame.clone()).unwrap();
        two.push(Bytes::from(vec![b'y'; 4_000])).unwrap();
        let (body, _) = two.finish();
        assert_eq!(&body[..4_000], &frame[..]);
        assert!(body[4_000..].iter().all(|&b| b == b'y'));
        // The limit counts every frame, the first one held too.
        let mut three = Received::new(&budget, None, None).unwrap();
        three.push(frame.clone()).unwrap();
        three.push(frame.clone()).unwrap();
        let e = three.push(frame).unwrap_err();
        assert_eq!(e.status().as_u16(), 413, "{e}");
    }

    #[test]
    fn the_budget_is_held_as_bytes_arrive_and_given_back_on_drop() {
        let (budget, metrics) = budget(|l| {
            l.max_body_bytes = 64 << 10;
            l.max_body_bytes_in_flight = 128 << 10;
        });
        let total = held(&budget);
        assert_eq!(total, 128);
        // A declared length reserves nothing; a declared length over the
        // limit is refused before any byte.
        let mut big = Received::new(&budget, Some(64 << 10), None).unwrap();
        assert_eq!(held(&budget), total);
        let e = Received::new(&budget, Some((64 << 10) + 1), None).unwrap_err();
        assert_eq!(e.status().as_u16(), 413);
        big.push(Bytes::from_static(b"x")).unwrap();
        assert_eq!(held(&budget), total - 1, "one byte holds one KiB");
        // Two full bodies fill the budget; a third byte is refused.
        big.push(Bytes::from(vec![0; (64 << 10) - 1])).unwrap();
        let mut other = Received::new(&budget, None, None).unwrap();
        other.push(Bytes::from(vec![0; 64 << 10])).unwrap();
        let mut third = Received::new(&budget, None, None).unwrap();
        let e = third.push(Bytes::from_static(b"x")).unwrap_err();
        assert_eq!(e.status().as_u16(), 503, "{e}");
        assert!(
            metrics
                .render_text()
                .contains("kvroute_request_body_bytes 131072")
        );
        drop(big);
        third.push(Bytes::from_static(b"x")).unwrap();
        drop((other, third));
        assert_eq!(held(&budget), total);
        let text = metrics.render_text();
        assert!(text.contains("kvroute_request_body_bytes 0"), "{text}");
        assert!(
            text.contains("kvroute_request_bodies_refused_total{reason=\"budget\"} 1"),
            "{text}"
        );
        assert!(text.contains("reason=\"too_large\"} 1"), "{text}");
    }

    #[test]
    fn a_tenant_holds_at_most_its_share() {
        let (budget, _) = budget(|l| {
            l.max_body_bytes = 8 << 10;
            l.max_body_bytes_per_tenant = 16 << 10;
        });
        let fill = |tenant| {
            let mut r = Received::new(&budget, None, tenant).unwrap();
            r.push(Bytes::from(vec![0; 8 << 10])).map(|()| r)
        };
        let a1 = fill(Some("a")).unwrap();
        let a2 = fill(Some("a")).unwrap();
        let e = fill(Some("a")).unwrap_err();
        assert_eq!(e.status().as_u16(), 429, "{e}");
        // Other tenants, and requests without one, are not held back.
        let _b = fill(Some("b")).unwrap();
        let _none = fill(None).unwrap();
        drop(a1);
        let _a3 = fill(Some("a")).unwrap();
        drop(a2);
        drop(_a3);
        assert!(
            budget.tenants.lock().unwrap().get("a").is_none(),
            "no entry left"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_trickling_body_is_cut_at_the_minimum_rate() {
        let (budget, _) = budget(|l| {
            l.body_min_bytes_per_s = 1024;
            l.body_read_timeout_ms = 60_000;
        });
        let start = Instant::now();
        let mut r = Received::new(&budget, Some(1 << 20), None).unwrap();
        // Nothing yet: one more byte is due after the grace.
        let (at, e) = r.deadline();
        assert_eq!(at - start, RATE_GRACE);
        assert_eq!(e.status().as_u16(), 408);
        // 4 KiB buys four more seconds.
        r.push(Bytes::from(vec![0; 4096])).unwrap();
        assert_eq!(r.deadline().0 - start, RATE_GRACE + Duration::from_secs(4));
        // Past what the timeout allows, the timeout answers.
        r.push(Bytes::from(vec![0; 100 << 10])).unwrap();
        let (at, e) = r.deadline();
        assert_eq!(at - start, Duration::from_secs(60));
        assert!(matches!(e, ApiError::BodyTimeout { ms: 60_000 }), "{e}");
    }
}
