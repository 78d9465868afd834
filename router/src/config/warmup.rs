//! `routing.warmup`: named prefixes the router keeps warm on their owners
//! (`docs/warmup.md`). The fields and their rules are the core's
//! ([`kvroute_core::warmup::Warmup`]), shared with the operator's
//! `CacheRoutingPolicy.spec.warmup`; the schedule is the core's too, and
//! the sending is [`crate::warmup`]'s.

pub use kvroute_core::warmup::{Prefix, Warmup};

use super::ConfigError;

/// Checks `routing.warmup`'s rules (`salted`: tenancy is salted), naming
/// the field of the first it breaks.
pub(super) fn validate(warmup: &Warmup, salted: bool) -> Result<(), ConfigError> {
    warmup
        .validate(salted, false)
        .map_err(|e| ConfigError::InvalidEntry {
            field: format!("routing.warmup.{}", e.field),
            value: e.value,
            reason: e.reason,
        })
}
