//! Endpoint discovery: where the pool's endpoint set (and, from the
//! operator, its routing policy) comes from. Two sources, one per
//! deployment: a static YAML file re-read when it changes
//! ([`static_file`]), or the kvroute operator's `WatchPool` stream
//! ([`operator`]). Both replace the pool's whole endpoint set with
//! [`Pool::set_endpoints`](crate::pool::Pool::set_endpoints), keep the
//! last good set when their source breaks, and own the pool's WatchCache
//! watcher tasks ([`Watchers`](crate::pool::Watchers)), starting and
//! stopping them as each change says.
//!
//! Not here: health checking, ejection, or what a watcher does (the pool
//! and [`crate::pool::cache_watch`] do those).

pub mod operator;
pub mod static_file;

pub use static_file::{StaticEndpoint, StaticFile};

/// Why an endpoint source could not be read.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    /// The static file could not be read.
    #[error("reading {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The static file is not valid YAML or has an unknown or missing
    /// field.
    #[error("{path}: {source}")]
    Parse {
        /// The file.
        path: String,
        /// Why, with the line and column.
        #[source]
        source: serde_yaml::Error,
    },
    /// An entry's field has a bad value.
    #[error("{path}: endpoints[{index}].{field}: {value:?} {reason}")]
    Invalid {
        /// The file.
        path: String,
        /// The entry's position in `endpoints`, from 0.
        index: usize,
        /// The field, as written in YAML.
        field: &'static str,
        /// The bad value.
        value: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Two entries have the same name.
    #[error("{path}: endpoint name {name:?} is used by endpoints[{first}] and endpoints[{second}]")]
    DuplicateName {
        /// The file.
        path: String,
        /// The name.
        name: String,
        /// The first entry with it.
        first: usize,
        /// The second entry with it.
        second: usize,
    },
}
