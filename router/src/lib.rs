//! `kvroute-router`: kvroute's data plane (being written).

pub mod cache_watch;
pub mod config;
pub mod discovery;
pub mod errors;
pub mod pool;
pub mod settings;
