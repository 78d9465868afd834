//! Endpoint discovery (being written).
