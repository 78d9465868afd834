//! The index (being written).
