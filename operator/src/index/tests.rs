//! Index tests: plain inputs in, published pool states and statuses out; no
//! Kubernetes API. The index's clock is 0, so every change adds exactly 1 to
//! the version.

mod builders;
mod endpoints;
mod engines;
mod objectives;
mod policies;
mod publishing;
mod warmups;

use kvroute_proto::v1::PoolState;
use tokio::sync::watch;

use self::builders::NS;
use super::*;

fn index() -> Index {
    Index::with_clock(|| 0)
}

/// `(name, ready, draining)` of every endpoint.
fn endpoints(rx: &watch::Receiver<PoolState>) -> Vec<(String, bool, bool)> {
    rx.borrow()
        .endpoints
        .iter()
        .map(|e| (e.name.clone(), e.ready, e.draining))
        .collect()
}

fn ep(name: &str, ready: bool, draining: bool) -> (String, bool, bool) {
    (name.to_owned(), ready, draining)
}

fn version(rx: &watch::Receiver<PoolState>) -> u64 {
    rx.borrow().version
}

fn policy_name(rx: &watch::Receiver<PoolState>) -> String {
    rx.borrow().policy.as_ref().unwrap().policy.clone()
}

/// Whether the receiver was notified since it last looked, marking it seen.
fn notified(rx: &mut watch::Receiver<PoolState>) -> bool {
    let changed = rx.has_changed().unwrap();
    rx.borrow_and_update();
    changed
}

/// An index with pool `llama` and a receiver of its state.
fn with_pool(pool: PoolSpec) -> (Index, watch::Receiver<PoolState>) {
    let mut index = index();
    index.apply_pool(pool.clone());
    let rx = index.watch_pool(&pool.namespace, &pool.name);
    (index, rx)
}
