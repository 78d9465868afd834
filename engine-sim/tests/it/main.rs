//! kvroute-engine-sim's integration tests, one module per area, linked as one test
//! binary (one link instead of one per file).

mod cli;
mod embeddings;
mod http;
mod transfer;
mod watch_cache;
