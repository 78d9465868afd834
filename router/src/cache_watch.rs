//! WatchCache subscriptions (being written).
