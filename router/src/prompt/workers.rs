//! The tokenizer pool: large prompts are read on blocking threads, at most
//! one per core at once and a bounded number waiting, so a large prompt
//! never stalls the async workers that carry streams.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::Semaphore;

use crate::errors::ApiError;

/// The tokenizer pool: at most one job per core at once, at most `queue`
/// waiting; more are refused with 503.
#[derive(Debug)]
pub(crate) struct Workers {
    running: Arc<Semaphore>,
    waiting: AtomicUsize,
    queue: usize,
}

impl Workers {
    pub(crate) fn new(queue: usize) -> Self {
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        Workers {
            running: Arc::new(Semaphore::new(cores)),
            waiting: AtomicUsize::new(0),
            queue,
        }
    }

    pub(crate) async fn run<T: Send + 'static>(
        &self,
        retry_after: u64,
        job: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, ApiError> {
        struct Waiting<'a>(&'a AtomicUsize);
        impl Drop for Waiting<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::SeqCst);
            }
        }
        if self.waiting.fetch_add(1, Ordering::SeqCst) >= self.queue {
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(ApiError::Saturated(
                "prompts waiting to be tokenized",
                retry_after,
            ));
        }
        let waiting = Waiting(&self.waiting);
        let permit = self
            .running
            .clone()
            .acquire_owned()
            .await
            .expect("the semaphore is never closed");
        drop(waiting);
        tokio::task::spawn_blocking(move || {
            let _permit = permit;
            job()
        })
        .await
        .map_err(|e| ApiError::Internal(format!("tokenizing the prompt failed: {e}")))
    }
}
