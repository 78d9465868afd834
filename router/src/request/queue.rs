//! The bounded queue of requests waiting for an endpoint under its
//! concurrency limit: at most `limits.queueSize` wait, each at most
//! `limits.queueTimeoutMs`; beyond either, 429.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use kvroute_core::policy::Request;
use tokio::time::Instant;

use super::Among;
use crate::config::Limits;
use crate::errors::ApiError;
use crate::pool::{Plan, Pool};

/// Requests waiting.
#[derive(Debug, Default)]
pub(crate) struct Queue {
    queued: AtomicUsize,
}

impl Queue {
    /// A plan with at least one target among the endpoints `among` accepts,
    /// waiting in the queue while every one is at its concurrency limit;
    /// 503 when none is routable.
    pub(crate) async fn plan(
        &self,
        pool: &Pool,
        limits: &Limits,
        request: &Request<'_>,
        readable: bool,
        among: Among<'_>,
    ) -> Result<Plan, ApiError> {
        let deadline = Instant::now() + Duration::from_millis(limits.queue_timeout_ms);
        let retry_after = limits.retry_after_s;
        // Registered for releases only once every endpoint was full, then
        // planned again, so no release in between is missed.
        let mut released = None;
        loop {
            let plan = pool.plan_among(request, readable, among);
            if !plan.targets.is_empty() {
                return Ok(plan);
            }
            if plan.full == 0 {
                return Err(ApiError::Unavailable { retry_after });
            }
            let Some(waiting) = released.as_mut() else {
                let mut r = Box::pin(pool.released());
                r.as_mut().enable();
                released = Some(r);
                continue;
            };
            if self.queued.fetch_add(1, Ordering::SeqCst) >= limits.queue_size {
                self.queued.fetch_sub(1, Ordering::SeqCst);
                return Err(ApiError::Overloaded { retry_after });
            }
            let woke = tokio::time::timeout_at(deadline, waiting.as_mut()).await;
            self.queued.fetch_sub(1, Ordering::SeqCst);
            if woke.is_err() {
                return Err(ApiError::Overloaded { retry_after });
            }
            released = None;
        }
    }
}
