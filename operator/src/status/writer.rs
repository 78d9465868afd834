//! The status writer: the one task that writes status and publishes Events.
//!
//! It runs on every replica but acts only while its replica holds the lease
//! ([`crate::lease`]) and the index has its initial lists. Then it makes a
//! pass ([`plan`]) whenever the index changes, sends the patches one by one
//! and publishes the Events. A failed patch (other than a 409, which the
//! next watch event resolves, or a 404 for an object just deleted) is
//! retried by a new pass after a backoff, from 500 ms doubling to 30 s.
//!
//! Not here: deciding what to write ([`plan`]), leader election.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::{Client, Resource};
use tokio::sync::watch;

use super::plan::{Kind, Memory, Notice, StatusWrite, plan};
use crate::api::{CacheRoutingPolicy, InferencePool};
use crate::index::Index;
use crate::metrics::Metrics;

/// The field manager of kvroute's status writes, as `managedFields` show it.
pub const FIELD_MANAGER: &str = "kvroute-operator";

const MIN_BACKOFF: Duration = Duration::from_millis(500);
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// Writes the index's statuses to the API; see the module docs.
pub struct StatusWriter {
    client: Client,
    index: Arc<Mutex<Index>>,
    metrics: Arc<Metrics>,
    recorder: Recorder,
    memory: Memory,
}

impl std::fmt::Debug for StatusWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StatusWriter")
            .field("memory", &self.memory)
            .finish_non_exhaustive()
    }
}

impl StatusWriter {
    /// A writer for `index`; its Events name `instance` (the replica's
    /// identity) as the reporting instance.
    pub fn new(
        client: Client,
        index: Arc<Mutex<Index>>,
        metrics: Arc<Metrics>,
        instance: String,
    ) -> Self {
        let reporter = Reporter {
            controller: FIELD_MANAGER.to_owned(),
            instance: Some(instance),
        };
        StatusWriter {
            recorder: Recorder::new(client.clone(), reporter),
            client,
            index,
            metrics,
            memory: Memory::default(),
        }
    }

    /// Writes until the index is dropped: a pass on every index change
    /// while `leader` and `ready` are both true.
    pub async fn run(
        mut self,
        mut leader: watch::Receiver<bool>,
        mut ready: watch::Receiver<bool>,
    ) {
        let mut changes = self
            .index
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .changes();
        if ready.wait_for(|r| *r).await.is_err() {
            return;
        }
        let mut backoff = MIN_BACKOFF;
        loop {
            if !*leader.borrow_and_update() {
                // A new term starts from what the API says.
                self.memory = Memory::default();
                if leader.changed().await.is_err() {
                    return;
                }
                continue;
            }
            changes.borrow_and_update();
            let retry = if self.pass().await {
                backoff = MIN_BACKOFF;
                None
            } else {
                let wait = backoff;
                backoff = (backoff * 2).min(MAX_BACKOFF);
                Some(wait)
            };
            let retry = async {
                match retry {
                    Some(wait) => tokio::time::sleep(wait).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                changed = changes.changed() => if changed.is_err() { return },
                _ = leader.changed() => {}
                () = retry => {}
            }
        }
    }

    /// One pass: plans under the index lock, then sends. Returns whether
    /// every request that should be retried succeeded. Traced as a span
    /// (exported when the operator runs with `--otlp-endpoint`).
    #[tracing::instrument(name = "status_pass", skip(self))]
    pub async fn pass(&mut self) -> bool {
        let now = Time(Timestamp::now());
        let plan = {
            let index = self.index.lock().unwrap_or_else(PoisonError::into_inner);
            plan(&index, &mut self.memory, &now)
        };
        self.metrics.reconcile();
        let mut ok = true;
        for write in &plan.writes {
            ok &= self.send(write).await;
        }
        for notice in &plan.notices {
            self.publish(notice).await;
        }
        ok
    }

    /// Sends one patch; false when it failed and should be retried.
    async fn send(&mut self, write: &StatusWrite) -> bool {
        let object = &write.object;
        let params = PatchParams {
            field_manager: Some(FIELD_MANAGER.to_owned()),
            ..PatchParams::default()
        };
        let patch = Patch::Merge(&write.body);
        let (ns, name) = (&object.namespace, &object.name);
        let sent = match object.kind {
            Kind::Pool => Api::<InferencePool>::namespaced(self.client.clone(), ns)
                .patch_status(name, &params, &patch)
                .await
                .map(drop),
            Kind::Policy => Api::<CacheRoutingPolicy>::namespaced(self.client.clone(), ns)
                .patch_status(name, &params, &patch)
                .await
                .map(drop),
        };
        let kind = object.kind.as_str();
        match sent {
            Ok(()) => {
                self.metrics.status_patch(kind);
                tracing::info!(kind, namespace = %ns, name = %name, "status written");
                true
            }
            // Written meanwhile by someone else: the watch brings the newer
            // object, and with it a new pass.
            Err(kube::Error::Api(status)) if status.is_conflict() => {
                tracing::debug!(kind, namespace = %ns, name = %name, "status changed meanwhile; waiting for the watch");
                true
            }
            // Deleted meanwhile: the watch removes it from the index.
            Err(kube::Error::Api(status)) if status.is_not_found() => true,
            Err(error) => {
                self.metrics.error("status_patch");
                tracing::warn!(kind, namespace = %ns, name = %name, %error, "status write failed; will retry");
                self.memory.failed(write);
                false
            }
        }
    }

    /// Publishes one Event; a failure is logged and counted, not retried
    /// (Events are best effort, as in Kubernetes itself).
    async fn publish(&self, notice: &Notice) {
        let object = &notice.object;
        let (api_version, kind) = match object.kind {
            Kind::Pool => (
                InferencePool::api_version(&()).into_owned(),
                InferencePool::kind(&()).into_owned(),
            ),
            Kind::Policy => (
                CacheRoutingPolicy::api_version(&()).into_owned(),
                CacheRoutingPolicy::kind(&()).into_owned(),
            ),
        };
        let reference = ObjectReference {
            api_version: Some(api_version),
            kind: Some(kind),
            namespace: Some(object.namespace.clone()),
            name: Some(object.name.clone()),
            uid: notice.uid.clone(),
            ..ObjectReference::default()
        };
        let event = Event {
            type_: if notice.warning {
                EventType::Warning
            } else {
                EventType::Normal
            },
            reason: notice.reason.to_owned(),
            note: Some(notice.note.clone()),
            action: "Reconcile".to_owned(),
            secondary: None,
        };
        match self.recorder.publish(&event, &reference).await {
            Ok(()) => {
                self.metrics.event(notice.reason);
                tracing::info!(kind = object.kind.as_str(), namespace = %object.namespace,
                    name = %object.name, reason = notice.reason, note = %notice.note, "event");
            }
            Err(error) => {
                self.metrics.error("event");
                tracing::warn!(reason = notice.reason, %error, "publishing an Event failed");
            }
        }
    }
}
