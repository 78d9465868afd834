//! Leader election on a `coordination.k8s.io/v1` `Lease`, the way client-go's
//! `leaderelection` package does it, so that of several operator replicas
//! exactly one writes status at a time.
//!
//! [`run`] loops: read the lease, decide what to do with it (create it,
//! renew it, take it over, or follow its holder; a pure function of the
//! lease, what we saw before and our clock), do that with an
//! optimistic-concurrency write, and publish the outcome on a `watch`
//! channel (`true` while leading). Two safety rules, both from
//! client-go:
//!
//! - **Expiry is measured on our own monotonic clock.** Another holder's
//!   lease is expired when its record has not changed for
//!   `leaseDurationSeconds` since *we* first saw it; the server's
//!   timestamps are never compared with our wall clock, so clock skew
//!   between nodes cannot make two leaders.
//! - **A leader stops before anyone may take over.** It steps down when a
//!   write loses a race (409), or when its last successful renewal was sent
//!   more than two thirds of the lease duration ago ([`LeaseConfig::validate`]
//!   keeps the renew period below that).
//!
//! Not here: what the leader does (callers watch the channel), coordinated
//! leader election (`preferredHolder` and `strategy` are left as they are),
//! or fencing writes made by a leader that has not yet noticed it stepped
//! down; like client-go, this bounds that window, it does not close it.

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{ObjectMeta, PostParams};
use kube::{Api, Client};
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::Instrument as _;

use crate::metrics::Metrics;

#[cfg(test)]
mod tests;

/// Default [`LeaseConfig::lease_duration`], client-go's default.
pub const DEFAULT_LEASE_DURATION: Duration = Duration::from_secs(15);
/// Default [`LeaseConfig::renew_period`].
pub const DEFAULT_RENEW_PERIOD: Duration = Duration::from_secs(5);
/// Default [`LeaseConfig::retry_period`], client-go's default.
pub const DEFAULT_RETRY_PERIOD: Duration = Duration::from_secs(2);

/// Which lease to contend for, as whom, and how often.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseConfig {
    /// Namespace of the `Lease`.
    pub namespace: String,
    /// Name of the `Lease`; every replica of one operator uses the same.
    pub name: String,
    /// This replica's `holderIdentity`; unique per process (see
    /// [`default_identity`]). Must not be empty: an empty holder means the
    /// lease is released.
    pub identity: String,
    /// How long a lease record must stay unchanged before another replica
    /// may take it over; written to `leaseDurationSeconds` (rounded up to
    /// whole seconds). Default [`DEFAULT_LEASE_DURATION`].
    pub lease_duration: Duration,
    /// How often the leader renews. Must be shorter than two thirds of
    /// `lease_duration`. Default [`DEFAULT_RENEW_PERIOD`].
    pub renew_period: Duration,
    /// How often a follower reads the lease to see whether it may take it.
    /// Default [`DEFAULT_RETRY_PERIOD`].
    pub retry_period: Duration,
    /// This replica's `host:port` for routers' warm-up reports, written to
    /// the lease's [`WRITER_ANNOTATION`] while it leads; `None`: none.
    pub advertise: Option<String>,
}

/// The lease annotation in which the holder advertises its `host:port`, so
/// that every replica can tell routers where the status writer is.
pub const WRITER_ANNOTATION: &str = "kvroute.dev/status-writer";

/// A [`LeaseConfig`] that [`run`] refuses to campaign with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// `namespace`, `name` or `identity` is empty.
    #[error("lease config: {field} must not be empty")]
    Empty {
        /// The empty field.
        field: &'static str,
    },
    /// A duration is zero.
    #[error("lease config: {field} must be greater than zero")]
    Zero {
        /// The zero field.
        field: &'static str,
    },
    /// The leader would step down between two renewals.
    #[error(
        "lease config: renew_period ({renew_period:?}) must be shorter than two thirds of \
         lease_duration ({lease_duration:?})"
    )]
    RenewTooSlow {
        /// The configured renew period.
        renew_period: Duration,
        /// The configured lease duration.
        lease_duration: Duration,
    },
}

impl LeaseConfig {
    /// The lease `namespace/name`, contended for as `identity`, with the
    /// default durations.
    pub fn new(
        namespace: impl Into<String>,
        name: impl Into<String>,
        identity: impl Into<String>,
    ) -> Self {
        LeaseConfig {
            namespace: namespace.into(),
            name: name.into(),
            identity: identity.into(),
            lease_duration: DEFAULT_LEASE_DURATION,
            renew_period: DEFAULT_RENEW_PERIOD,
            retry_period: DEFAULT_RETRY_PERIOD,
            advertise: None,
        }
    }

    /// Checks the config; [`run`] does not campaign with an invalid one, so
    /// callers should check at startup and fail there.
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (field, value) in [
            ("namespace", &self.namespace),
            ("name", &self.name),
            ("identity", &self.identity),
        ] {
            if value.is_empty() {
                return Err(ConfigError::Empty { field });
            }
        }
        for (field, value) in [
            ("lease_duration", self.lease_duration),
            ("renew_period", self.renew_period),
            ("retry_period", self.retry_period),
        ] {
            if value.is_zero() {
                return Err(ConfigError::Zero { field });
            }
        }
        if self.renew_period >= self.renew_deadline() {
            return Err(ConfigError::RenewTooSlow {
                renew_period: self.renew_period,
                lease_duration: self.lease_duration,
            });
        }
        Ok(())
    }

    /// How long after sending its last successful write a leader steps down.
    ///
    /// Another replica can consider the lease expired no sooner than
    /// `lease_duration` after that write reached the server, which is after
    /// we sent it; stepping down at two thirds leaves a third for our
    /// step-down to take effect and for clocks running at different rates.
    fn renew_deadline(&self) -> Duration {
        self.lease_duration * 2 / 3
    }

    /// `lease_duration` as `leaseDurationSeconds`, rounded up: rounding down
    /// would let others take over before we step down.
    fn lease_duration_seconds(&self) -> i32 {
        let nanos = self.lease_duration.as_nanos();
        let seconds = nanos.div_ceil(1_000_000_000).max(1);
        i32::try_from(seconds).unwrap_or(i32::MAX)
    }
}

/// This process's lease identity: env `POD_NAME` if set and non-empty, else
/// `{hostname}-{pid}` (hostname from env `HOSTNAME`, else `/etc/hostname`,
/// else `kvroute-operator`).
///
/// The pid is there because a hostname alone is not unique: two operator
/// processes on one host (or in one pod's network namespace) would share an
/// identity, each would take the other's renewals for its own, and both
/// would lead.
pub fn default_identity() -> String {
    let env = |name| std::env::var(name).ok();
    let hostname = env("HOSTNAME")
        .filter(|h| !h.trim().is_empty())
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok());
    identity_from(env("POD_NAME"), hostname, std::process::id())
}

/// [`default_identity`] from its inputs.
fn identity_from(pod_name: Option<String>, hostname: Option<String>, pid: u32) -> String {
    if let Some(pod_name) = pod_name.filter(|p| !p.trim().is_empty()) {
        return pod_name.trim().to_owned();
    }
    let hostname = hostname
        .as_deref()
        .map(str::trim)
        .filter(|h| !h.is_empty())
        .unwrap_or("kvroute-operator");
    format!("{hostname}-{pid}")
}

/// Contends for the lease in `config` until `shutdown` completes, publishing
/// on `leader` whether this replica leads (sent only when it changes), and
/// on `writer` the address the holder advertises (ours while we lead).
///
/// Never fails and never returns before `shutdown`: API errors are logged
/// (counted as `errors_total{what="lease"}`) and retried after the next
/// period. On shutdown a leader first publishes
/// `false` and then releases the lease (empty holder,
/// `leaseDurationSeconds: 1`) so a standby takes over at once rather than
/// after the lease expires. Errors releasing are logged; the lease then
/// expires as if we had crashed (this happens when shutdown interrupts a
/// renewal that reached the server, leaving us a stale `resourceVersion`).
/// With an invalid config (see [`LeaseConfig::validate`]) it logs the error
/// and only waits for `shutdown`, never leading.
pub async fn run(
    client: Client,
    config: LeaseConfig,
    leader: watch::Sender<bool>,
    writer: watch::Sender<Option<String>>,
    metrics: Arc<Metrics>,
    shutdown: impl Future<Output = ()>,
) {
    // Every log line of the elector names the lease and the identity.
    let span = tracing::info_span!("lease", identity = %config.identity,
        namespace = %config.namespace, lease = %config.name);
    campaign(client, config, leader, writer, metrics, shutdown)
        .instrument(span)
        .await;
}

/// [`run`], inside its span.
async fn campaign(
    client: Client,
    config: LeaseConfig,
    leader: watch::Sender<bool>,
    writer: watch::Sender<Option<String>>,
    metrics: Arc<Metrics>,
    shutdown: impl Future<Output = ()>,
) {
    leader.send_if_modified(|leading| std::mem::replace(leading, false));
    if let Err(error) = config.validate() {
        tracing::error!(%error, "not campaigning for leadership");
        shutdown.await;
        return;
    }
    let mut elector = Elector {
        api: Api::namespaced(client, &config.namespace),
        config,
        leader,
        writer,
        metrics,
        memory: Memory::default(),
        leadership: None,
    };
    let mut shutdown = pin!(shutdown);
    loop {
        elector.check_deadline();
        let deadline = elector.attempt_deadline();
        let attempt = tokio::select! {
            () = &mut shutdown => break,
            attempt = tokio::time::timeout_at(deadline, elector.attempt()) => attempt,
        };
        match attempt {
            Ok(Ok(())) => {}
            Ok(Err(error)) => elector.warn("lease request failed; retrying", &error),
            Err(_) => elector.warn("lease request failed; retrying", &"no answer in time"),
        }
        elector.check_deadline();
        let wake = elector.next_attempt();
        tokio::select! {
            () = &mut shutdown => break,
            () = tokio::time::sleep_until(wake) => {}
        }
    }
    elector.release().await;
}

/// What one attempt does with the lease it read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Action {
    /// There is no lease: create one held by us.
    Create,
    /// We hold it: renew it.
    Renew,
    /// It is released or expired: take it.
    TakeOver,
    /// Someone else holds it: wait.
    Follow,
}

/// The parts of a lease whose change shows its holder is alive.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Record {
    holder: Option<String>,
    renew_time: Option<MicroTime>,
    resource_version: Option<String>,
}

impl Record {
    fn of(lease: &Lease) -> Record {
        let spec = lease.spec.as_ref();
        Record {
            holder: spec.and_then(|s| s.holder_identity.clone()),
            renew_time: spec.and_then(|s| s.renew_time.clone()),
            resource_version: lease.metadata.resource_version.clone(),
        }
    }
}

/// The lease record last read and when we first read it, on our clock:
/// what expiry is judged by.
#[derive(Debug, Default)]
struct Memory {
    seen: Option<(Record, Instant)>,
}

impl Memory {
    /// What to do with `lease` as read at `now`, contending as `identity`;
    /// `default_duration` applies when the lease states no valid
    /// `leaseDurationSeconds`.
    fn decide(
        &mut self,
        lease: Option<&Lease>,
        identity: &str,
        default_duration: Duration,
        now: Instant,
    ) -> Action {
        let Some(lease) = lease else {
            self.seen = None;
            return Action::Create;
        };
        let record = Record::of(lease);
        let since = match &self.seen {
            Some((seen, since)) if *seen == record => *since,
            _ => {
                self.seen = Some((record, now));
                now
            }
        };
        match holder(lease) {
            None => Action::TakeOver,
            Some(holder) if holder == identity => Action::Renew,
            Some(_) => {
                let duration = lease
                    .spec
                    .as_ref()
                    .and_then(|s| s.lease_duration_seconds)
                    .and_then(|s| u64::try_from(s).ok())
                    .filter(|s| *s > 0)
                    .map_or(default_duration, Duration::from_secs);
                if now.duration_since(since) >= duration {
                    Action::TakeOver
                } else {
                    Action::Follow
                }
            }
        }
    }
}

/// Sets `*slot` to `new`; whether that changed it.
fn replace_if_new(slot: &mut Option<String>, new: Option<String>) -> bool {
    if *slot == new {
        return false;
    }
    *slot = new;
    true
}

/// The lease's holder; an empty one means released.
fn holder(lease: &Lease) -> Option<&str> {
    lease
        .spec
        .as_ref()
        .and_then(|s| s.holder_identity.as_deref())
        .filter(|h| !h.is_empty())
}

/// While leading: our lease as last written, and when that write was sent.
#[derive(Debug)]
struct Leadership {
    lease: Lease,
    renewed_at: Instant,
}

/// [`run`]'s state.
struct Elector {
    api: Api<Lease>,
    config: LeaseConfig,
    leader: watch::Sender<bool>,
    /// The holder's advertised address, as last read or written.
    writer: watch::Sender<Option<String>>,
    /// Counts failed lease requests (`errors_total{what="lease"}`).
    metrics: Arc<Metrics>,
    memory: Memory,
    leadership: Option<Leadership>,
}

impl Elector {
    /// Reads the lease and acts on it. Cancel-safe: state changes only
    /// after a request completes.
    async fn attempt(&mut self) -> Result<(), kube::Error> {
        let current = match self.api.get(&self.config.name).await {
            Ok(lease) => Some(lease),
            Err(kube::Error::Api(status)) if status.code == 404 => None,
            Err(error) => return Err(error),
        };
        let action = self.memory.decide(
            current.as_ref(),
            &self.config.identity,
            self.config.lease_duration,
            Instant::now(),
        );
        let now = MicroTime(Timestamp::now());
        let sent = Instant::now();
        let written = match (action, current) {
            (Action::Follow, current) => {
                let holder = current.as_ref().and_then(holder).unwrap_or_default();
                self.step_down(format_args!("{holder} holds the lease"));
                let address = current
                    .as_ref()
                    .filter(|_| !holder.is_empty())
                    .and_then(|l| l.metadata.annotations.as_ref()?.get(WRITER_ANNOTATION))
                    .cloned();
                self.writer.send_if_modified(|w| replace_if_new(w, address));
                return Ok(());
            }
            (Action::Create, _) => {
                let mut metadata = ObjectMeta {
                    name: Some(self.config.name.clone()),
                    namespace: Some(self.config.namespace.clone()),
                    ..ObjectMeta::default()
                };
                self.advertise(&mut metadata);
                let lease = Lease {
                    metadata,
                    spec: Some(LeaseSpec {
                        holder_identity: Some(self.config.identity.clone()),
                        lease_duration_seconds: Some(self.config.lease_duration_seconds()),
                        acquire_time: Some(now.clone()),
                        renew_time: Some(now),
                        lease_transitions: Some(0),
                        ..LeaseSpec::default()
                    }),
                };
                self.api.create(&PostParams::default(), &lease).await
            }
            (Action::Renew, Some(mut lease)) => {
                self.advertise(&mut lease.metadata);
                let spec = lease.spec.get_or_insert_default();
                spec.lease_duration_seconds = Some(self.config.lease_duration_seconds());
                spec.renew_time = Some(now);
                self.replace(&lease).await
            }
            (Action::TakeOver, Some(mut lease)) => {
                self.advertise(&mut lease.metadata);
                let spec = lease.spec.get_or_insert_default();
                spec.holder_identity = Some(self.config.identity.clone());
                spec.lease_duration_seconds = Some(self.config.lease_duration_seconds());
                spec.acquire_time = Some(now.clone());
                spec.renew_time = Some(now);
                spec.lease_transitions =
                    Some(spec.lease_transitions.unwrap_or(0).saturating_add(1));
                self.replace(&lease).await
            }
            // `decide` asks to renew or take over only a lease it was given.
            (Action::Renew | Action::TakeOver, None) => return Ok(()),
        };
        match written {
            Ok(lease) => {
                self.lead(lease, sent);
                Ok(())
            }
            // Someone else wrote the lease between our read and our write.
            Err(kube::Error::Api(status)) if status.code == 409 => {
                self.step_down(format_args!("lost a race to write the lease"));
                Ok(())
            }
            Err(error) => Err(error),
        }
    }

    /// PUT `lease`, its `resourceVersion` the precondition.
    async fn replace(&self, lease: &Lease) -> Result<Lease, kube::Error> {
        self.api
            .replace(&self.config.name, &PostParams::default(), lease)
            .await
    }

    /// Sets or removes our [`WRITER_ANNOTATION`] on a lease we write.
    fn advertise(&self, metadata: &mut ObjectMeta) {
        let annotations = metadata.annotations.get_or_insert_default();
        match &self.config.advertise {
            Some(address) => annotations.insert(WRITER_ANNOTATION.to_owned(), address.clone()),
            None => annotations.remove(WRITER_ANNOTATION),
        };
    }

    /// We hold `lease`, written by a request sent at `sent`.
    fn lead(&mut self, lease: Lease, sent: Instant) {
        let address = self.config.advertise.clone();
        self.writer.send_if_modified(|w| replace_if_new(w, address));
        self.leadership = Some(Leadership {
            lease,
            renewed_at: sent,
        });
        if self
            .leader
            .send_if_modified(|l| !std::mem::replace(l, true))
        {
            tracing::info!("acquired leadership");
        }
    }

    /// We do not lead (any more), because of `reason`.
    fn step_down(&mut self, reason: std::fmt::Arguments<'_>) {
        self.leadership = None;
        if self
            .leader
            .send_if_modified(|l| std::mem::replace(l, false))
        {
            tracing::info!(
                %reason,
                "lost leadership"
            );
        }
    }

    /// Steps down if renewals have failed for too long (see
    /// [`LeaseConfig::renew_deadline`]).
    fn check_deadline(&mut self) {
        if let Some(leadership) = &self.leadership
            && Instant::now() >= leadership.renewed_at + self.config.renew_deadline()
        {
            self.step_down(format_args!("could not renew the lease in time"));
        }
    }

    /// When the next attempt must have finished: a leader's renew deadline;
    /// a follower's stuck request is abandoned after a lease duration.
    fn attempt_deadline(&self) -> Instant {
        match &self.leadership {
            Some(l) => l.renewed_at + self.config.renew_deadline(),
            None => Instant::now() + self.config.lease_duration,
        }
    }

    /// When to attempt next: a renew period for a leader (but no later than
    /// its renew deadline, so it steps down on time), a retry period for a
    /// follower.
    fn next_attempt(&self) -> Instant {
        let now = Instant::now();
        match &self.leadership {
            Some(l) => {
                (now + self.config.renew_period).min(l.renewed_at + self.config.renew_deadline())
            }
            None => now + self.config.retry_period,
        }
    }

    /// If leading: publishes `false`, then releases the lease. In that order,
    /// so that a standby taking the released lease never leads alongside us.
    async fn release(mut self) {
        let Some(Leadership {
            mut lease,
            renewed_at,
        }) = self.leadership.take()
        else {
            return;
        };
        self.step_down(format_args!("shutting down"));
        let spec = lease.spec.get_or_insert_default();
        spec.holder_identity = None;
        spec.lease_duration_seconds = Some(1);
        spec.renew_time = Some(MicroTime(Timestamp::now()));
        // Past the renew deadline the lease is as good as expired; waiting
        // longer for the release only delays shutdown.
        let deadline = renewed_at + self.config.renew_deadline();
        match tokio::time::timeout_at(deadline, self.replace(&lease)).await {
            Ok(Ok(_)) => tracing::info!("released the lease"),
            Ok(Err(error)) => self.warn("releasing the lease failed", &error),
            Err(_) => self.warn("releasing the lease failed", &"no answer in time"),
        }
    }

    fn warn(&self, message: &str, error: &dyn std::fmt::Display) {
        self.metrics.error("lease");
        tracing::warn!(
            %error,
            "{message}"
        );
    }
}
