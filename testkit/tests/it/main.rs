//! kvroute-testkit's integration tests, one module per area, linked as one test
//! binary (one link instead of one per file).

mod fake_api;
mod kube_client;
