//! kvroute-router's integration tests, one module per area, linked as one test
//! binary (one link instead of one per file).

mod admission;
mod cache_watch;
mod chart_schema;
mod cli;
mod coalescing;
mod debug_pool;
mod disaggregation;
mod discovery;
mod explain;
mod ext_proc;
mod flow;
mod hardening;
mod hit_rate;
mod hostile;
mod hostile_cache;
mod hung;
mod identity;
mod index_bounds;
mod memory;
mod missed;
mod open_files;
mod prefixes;
mod proxy;
mod reliability;
mod response_cache;
mod response_cache_redis;
mod semantic_cache;
mod shared_prefix;
mod startup;
mod support;
mod tls;
mod warmup;
