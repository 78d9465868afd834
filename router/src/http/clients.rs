//! Upstream clients: one per API thread, so that a request and the pooled
//! connection it is sent on live on one thread's runtime, and one for every
//! other thread.

use crate::config::Limits;
use crate::upstream::{Upstream, upstream};

thread_local! {
    /// The API thread this thread is ([`on_api_thread`]); `None` on every
    /// other thread.
    static API_THREAD: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}

/// Marks this thread as API thread `k` (of `limits.apiThreads`): its
/// requests then use an upstream client of their own.
pub fn on_api_thread(k: usize) {
    API_THREAD.with(|t| t.set(Some(k)));
}

/// The clients of every API thread, and of the rest.
#[derive(Debug)]
pub(crate) struct Clients(Vec<Upstream>);

impl Clients {
    pub(crate) fn new(limits: &Limits) -> Self {
        Clients(
            (0..=limits.api_threads())
                .map(|_| upstream(limits))
                .collect(),
        )
    }

    /// This thread's client.
    pub(crate) fn get(&self) -> &Upstream {
        let last = self.0.len() - 1;
        let k = API_THREAD
            .with(std::cell::Cell::get)
            .map_or(last, |k| k.min(last));
        &self.0[k]
    }
}
