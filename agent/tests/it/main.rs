//! kvroute-agent's integration tests, one module per area, linked as one test
//! binary (one link instead of one per file).

mod bridge;
mod cli;
mod engine;
mod hostile;
mod router;
mod samples;
