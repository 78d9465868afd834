//! kvroute-cli's integration tests, one module per area, linked as one test
//! binary (one link instead of one per file).

mod demo_cli;
mod explain_cli;
mod hash_cli;
mod probe_cli;
mod replay_cli;
mod replay_goal;
