//! WatchPool server (being written).
