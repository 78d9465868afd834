//! API types (being written).
