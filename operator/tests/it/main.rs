//! kvroute-operator's integration tests, one module per area, linked as one test
//! binary (one link instead of one per file).

mod admin;
mod cli;
mod cluster;
mod crds;
mod engines;
mod objectives;
mod process;
mod status_writer;
mod support;
mod watch_pool;
mod watchers;
