//! The router's background tasks, and what the death of one means.
//!
//! Discovery (which owns the WatchCache watchers), the health checks and
//! each listener (`api`, `picker`, `admin`) run until shutdown. One that
//! ends before it, by a panic or otherwise, would leave the router serving
//! degraded while it still reports ready: a dead discovery task freezes the
//! endpoint set and ends every WatchCache stream, which turns cache-aware
//! routing off in silence. The rule:
//!
//! 1. Every background task runs here, under its name.
//! 2. The first one to end before shutdown is fatal, whatever the cause (a
//!    panic, a return, a cancellation): [`Tasks::died`] resolves with its
//!    name and why.
//! 3. The binary then logs one error line naming the task and exits with
//!    status 1, so that the orchestrator restarts it; a new router rebuilds
//!    its soft state from discovery and the engines' snapshots. A program
//!    that embeds the router watches
//!    [`Running::died`](crate::server::Running::died) to the same end.
//!
//! `/readyz` is not involved: a router that lost a task never serves on.
//!
//! Not here: the order of a graceful shutdown ([`crate::server`]).

use std::future::Future;

use tokio::task::JoinHandle;

/// A background task that ended before shutdown.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the {task} task {why}")]
pub struct TaskDied {
    /// The task's name: `discovery`, `health-checks`, `flow`, `api`,
    /// `picker` or `admin`.
    pub task: &'static str,
    /// How it ended: `panicked: <message>`, `returned` or `was cancelled`.
    pub why: String,
}

/// How a task ends at shutdown.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Stop {
    /// It sees the stop signal and returns once its work is done (the
    /// listeners: in-flight requests finish first); shutdown awaits it.
    Drains,
    /// Shutdown aborts it (discovery and the health checks hold no
    /// request).
    Aborted,
}

#[derive(Debug)]
struct Task {
    name: &'static str,
    stop: Stop,
    handle: JoinHandle<()>,
}

/// The background tasks of one router.
#[derive(Debug, Default)]
pub(crate) struct Tasks {
    running: Vec<Task>,
}

impl Tasks {
    /// Runs `task` in the background as `name`.
    pub(crate) fn spawn(
        &mut self,
        name: &'static str,
        stop: Stop,
        task: impl Future<Output = ()> + Send + 'static,
    ) {
        self.running.push(Task {
            name,
            stop,
            handle: tokio::spawn(task),
        });
    }

    /// Resolves when the first task ends, with its name and why; never
    /// while every task runs. Cancel-safe: a task that ended is reported
    /// by the next call if this one was dropped.
    pub(crate) async fn died(&mut self) -> TaskDied {
        if self.running.is_empty() {
            return std::future::pending().await;
        }
        let handles = self.running.iter_mut().map(|t| &mut t.handle);
        let (ended, i, _) = futures_util::future::select_all(handles).await;
        let task = self.running.remove(i);
        let why = match ended {
            Ok(()) => "returned".to_owned(),
            Err(e) if e.is_panic() => {
                let panic = e.into_panic();
                let message = panic
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a non-text payload".to_owned());
                format!("panicked: {message}")
            }
            Err(_) => "was cancelled".to_owned(),
        };
        TaskDied {
            task: task.name,
            why,
        }
    }

    /// Aborts the task `name`, which [`died`](Self::died) then reports;
    /// false when there is none. Only tests kill a task on purpose.
    pub(crate) fn abort(&self, name: &str) -> bool {
        let found = self.running.iter().filter(|t| t.name == name);
        found.map(|t| t.handle.abort()).count() > 0
    }

    /// After the stop signal: waits for the draining tasks and aborts the
    /// others.
    pub(crate) async fn shutdown(self) {
        let (drains, aborted): (Vec<Task>, Vec<Task>) = self
            .running
            .into_iter()
            .partition(|t| t.stop == Stop::Drains);
        for task in drains {
            let _ = task.handle.await;
        }
        for task in aborted {
            task.handle.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    async fn forever() {
        std::future::pending::<()>().await;
    }

    #[tokio::test]
    async fn the_first_task_to_end_is_reported_by_name_and_cause() {
        let mut tasks = Tasks::default();
        tasks.spawn("health-checks", Stop::Aborted, forever());
        tasks.spawn("discovery", Stop::Aborted, async {
            tokio::time::sleep(Duration::from_millis(10)).await;
            panic!("interval must be non-zero");
        });
        tasks.spawn("admin", Stop::Drains, forever());
        let died = tasks.died().await;
        assert_eq!(
            died.to_string(),
            "the discovery task panicked: interval must be non-zero"
        );
        assert!(tasks.abort("admin"));
        assert!(!tasks.abort("discovery"), "it is gone");
        let died = tasks.died().await;
        assert_eq!((died.task, died.why.as_str()), ("admin", "was cancelled"));
        tasks.spawn("api", Stop::Drains, async {});
        assert_eq!(tasks.died().await.why, "returned");
        tasks.shutdown().await;
    }

    #[tokio::test(start_paused = true)]
    async fn no_task_no_death() {
        let mut tasks = Tasks::default();
        tasks.spawn("discovery", Stop::Aborted, forever());
        let waited = tokio::time::timeout(Duration::from_secs(3600), tasks.died()).await;
        assert!(waited.is_err(), "nothing died");
        tasks.shutdown().await;
        assert!(
            tokio::time::timeout(Duration::from_secs(1), Tasks::default().died())
                .await
                .is_err()
        );
    }
}
