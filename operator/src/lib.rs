//! `kvroute-operator`: turns `InferencePool`s, `CacheRoutingPolicy`s and pod
//! health into per-pool endpoint sets that routers receive over
//! `EndpointDiscovery.WatchPool`.
//!
//! Being built: the API types ([`api`]), their conversion into index inputs
//! ([`convert`]), the synchronous index ([`index`]), status patches computed
//! from it ([`status`]), the WatchPool server ([`grpc`]) and the Kubernetes
//! watchers feeding the index ([`watch`]) exist; the status writer and
//! leader election do not yet.

pub mod admin;
pub mod api;
pub mod convert;
pub mod grpc;
pub mod index;
pub mod lease;
pub mod metrics;
pub mod status;
pub mod watch;
