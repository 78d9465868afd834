//! kvroute-e2e's integration tests, one module per area, linked as one
//! test binary.

mod cli;
