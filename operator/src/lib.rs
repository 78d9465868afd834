//! `kvroute-operator`: turns `InferencePool`s, `CacheRoutingPolicy`s and pod
//! health into per-pool endpoint sets that routers receive over
//! `EndpointDiscovery.WatchPool`.
//!
//! The layers, data in and data out: the API types ([`api`]); their
//! conversion into index inputs ([`convert`]); the synchronous index
//! ([`index`]); the Kubernetes watchers feeding it ([`watch`]); the
//! WatchPool server ([`grpc`]); status patches and Events computed from the
//! index and written by one task while this replica holds the Lease
//! ([`status`], [`lease`]); `/metrics`, `/healthz` and `/readyz`
//! ([`metrics`], [`admin`]).

pub mod admin;
pub mod api;
pub mod convert;
pub mod engines;
pub mod grpc;
pub mod index;
pub mod lease;
pub mod metrics;
pub mod status;
pub mod watch;
