//! `kvroute-operator`: turns `InferencePool`s, `CacheRoutingPolicy`s and pod
//! health into per-pool endpoint sets that routers receive over
//! `EndpointDiscovery.WatchPool`.
//!
//! Being built: the API types ([`api`]), the synchronous index ([`index`])
//! and the WatchPool server ([`grpc`]) exist; the Kubernetes watchers,
//! status writer and leader election do not yet.

pub mod api;
pub mod grpc;
pub mod index;
