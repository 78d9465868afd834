//! The system suite: kvroute's real binaries on loopback, under load,
//! through scale-out and failures (see `docs/suite.md`).

pub mod balance;
pub mod disaggregated;
pub mod flow;
pub mod inference_perf;
pub mod load;
pub mod missed;
pub mod missed_causes;
pub mod procs;
pub mod redis;
pub mod repeat;
pub mod report;
pub mod response_cache;
pub mod router_killed;
pub mod scenarios;
pub mod semantic_cache;
pub mod system;
pub mod warmup;
pub mod warmup_routers;
