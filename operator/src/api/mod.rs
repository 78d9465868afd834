//! The Kubernetes API kvroute reads and writes, in one place: the
//! `InferencePool` and `InferenceObjective` of the Gateway API Inference
//! Extension (`inference.networking.k8s.io/v1` and
//! `inference.networking.x-k8s.io/v1alpha2`, upstream's schemas) and
//! kvroute's own `CacheRoutingPolicy` (`kvroute.dev/v1alpha1`), their CRDs,
//! and the Rust-side checks of the rules their schemas express.
//!
//! The checked-in `crds/*.yaml` are generated from these types
//! ([`write_crds`]); `tests/it/crds.rs` fails when they drift.
//!
//! Not here: watching the API, turning objects into the index's inputs, or
//! writing status.

mod crdgen;
pub mod inference_objective;
pub mod inference_pool;
pub mod policy;
mod schema;
mod spelling;
mod validation;

pub use self::crdgen::{CrdFile, crd_files, crds, render, write_crds};
pub use self::inference_objective::{
    InferenceObjective, InferenceObjectiveSpec, InferenceObjectiveStatus, PoolObjectReference,
};
pub use self::inference_pool::{
    AppProtocol, EndpointPickerRef, FailureMode, InferencePool, InferencePoolSpec,
    InferencePoolStatus, LabelSelector, ParentReference, ParentStatus, Port,
};
pub use self::policy::{
    CacheRoutingPolicy, CacheRoutingPolicySpec, CacheRoutingPolicyStatus, Engine, HashAlgorithm,
    KeyMode, OwnerWarmupStatus, PolicyName, PolicyTargetReference, PrefixWarmupStatus, RoutingKey,
    Tenancy, WarmupStatus,
};
pub use self::validation::ValidationError;
/// A policy's tenancy mode: the core's, spelled `Shared` and `Salted` in the
/// CRD.
pub use kvroute_core::spec::TenancyMode;
