//! `kvroute-router`: kvroute's data plane. An OpenAI-compatible HTTP proxy
//! that sends each request to the engine holding its longest cached prefix
//! (from the engines' WatchCache streams, or its own routing history), keeps
//! load bounded, and streams responses through as the engine sends them.
//!
//! A request is decided by [`request`] (reading its prompt with
//! [`prompt`]) for either front end: the HTTP forwarder [`http`] or the
//! Envoy endpoint picker [`ext_proc`]. Routing state is [`pool`]; endpoints
//! come from [`discovery`]; engines' caches from [`pool::cache_watch`].
//! Every routing decision is made by `kvroute-core`.

pub mod admin;
pub mod config;
pub mod discovery;
pub mod errors;
pub mod explain;
pub mod ext_proc;
pub mod flow;
pub mod http;
pub mod listener;
pub mod metrics;
pub mod models;
pub mod pool;
pub mod prompt;
pub mod reconnect;
pub mod request;
pub mod response_cache;
pub mod server;
pub mod settings;
pub mod tasks;
pub mod telemetry;
pub mod tenancy;
pub mod throttle;
mod upstream;
mod warmup;

pub use config::Config;

pub use server::{Running, StartError, start};
pub use tasks::TaskDied;
