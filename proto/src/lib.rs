//! kvroute's gRPC protocols, package `kvroute.v1`, and the small pieces of
//! logic both ends of them share.
//!
//! - [`v1`]: the messages and the tonic clients and servers of
//!   `CacheReporter.WatchCache` (engine → router) and
//!   `EndpointDiscovery.WatchPool` (operator → router), generated from
//!   `proto/kvroute/v1/*.proto`. Those files are the contract; their comments
//!   are the documentation.
//! - Conversions between the wire's [`v1::HashAlgorithm`] and the core's
//!   [`HashAlgo`](kvroute_core::hash::HashAlgo).
//! - The one pair of conversions between the wire's [`v1::RoutingPolicy`]
//!   and the core's [`RoutingSpec`](kvroute_core::spec::RoutingSpec)
//!   ([`Unusable`] names what a router cannot use of one).
//! - [`SequenceCheck`], the incarnation and sequence rules a `WatchCache`
//!   subscriber applies to every update.
//!
//! - [`feed`]: serving `WatchCache` — numbering an engine's cache changes
//!   and fanning them out, for every reporter alike.
//! - [`tls`]: loading the streams' mutual-TLS files, for servers and clients.
//!
//! Not here: consuming the streams (the router owns that), WatchPool's
//! server (the operator's); applying updates to an index.
//!
//! The generated code is checked in (`src/gen/`), so building this crate needs
//! no protobuf compiler; `tests/bootstrap.rs` regenerates it and fails when the
//! checked-in copy is stale.

#![warn(missing_docs)]

pub mod feed;
mod hash_algorithm;
pub mod load;
mod routing_policy;
mod sequence;
pub mod tls;

pub use hash_algorithm::hash_algo_from_i32;
pub use routing_policy::Unusable;
pub use sequence::{ResyncReason, SequenceCheck, Verdict};

/// Generated messages, clients and servers of package `kvroute.v1`.
pub mod v1 {
    include!("gen/kvroute.v1.rs");
}

impl From<kvroute_core::role::Role> for v1::EndpointRole {
    fn from(role: kvroute_core::role::Role) -> Self {
        use kvroute_core::role::Role;
        match role {
            Role::Both => v1::EndpointRole::Both,
            Role::Prefill => v1::EndpointRole::Prefill,
            Role::Decode => v1::EndpointRole::Decode,
        }
    }
}

impl From<v1::EndpointRole> for kvroute_core::role::Role {
    /// Unspecified (an operator before roles) is `both`.
    fn from(role: v1::EndpointRole) -> Self {
        use kvroute_core::role::Role;
        match role {
            v1::EndpointRole::Unspecified | v1::EndpointRole::Both => Role::Both,
            v1::EndpointRole::Prefill => Role::Prefill,
            v1::EndpointRole::Decode => Role::Decode,
        }
    }
}

/// An error converting a protocol value into a core type.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// A `HashAlgorithm` field was `HASH_ALGORITHM_UNSPECIFIED` (or not set).
    #[error("hash algorithm is unspecified")]
    UnspecifiedHashAlgorithm,
    /// A `HashAlgorithm` field held a value this build does not know (a newer
    /// peer's algorithm).
    #[error("unknown hash algorithm {0}")]
    UnknownHashAlgorithm(i32),
}
