//! `kvroute-router`: kvroute's data plane. An OpenAI-compatible HTTP proxy
//! that sends each request to the engine holding its longest cached prefix
//! (from the engines' WatchCache streams, or its own routing history), keeps
//! load bounded, and streams responses through as the engine sends them.
//!
//! The request path is [`proxy`]; routing state is [`pool`]; endpoints come
//! from [`discovery`]; engines' caches from [`pool::cache_watch`]. Every
//! routing decision is made by `kvroute-core`.

pub mod body;
pub mod chunks;
pub mod config;
pub mod conversations;
pub mod discovery;
pub mod errors;
pub mod explain;
pub mod ext_proc;
pub mod features;
pub mod hang;
pub mod hit_rate;
mod json_skim;
pub mod listener;
pub mod metrics;
pub mod models;
pub mod pool;
pub mod prefixes;
pub mod proxy;
pub mod reconnect;
pub mod server;
pub mod settings;
pub mod tasks;
pub mod telemetry;
pub mod tenancy;
pub mod throttle;

pub use config::Config;

pub use server::{Running, StartError, start};
pub use tasks::TaskDied;
