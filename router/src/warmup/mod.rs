//! Warm-ups (`routing.warmup`, `docs/warmup.md`): each named prefix sent
//! to its owners once a period as a one-token request, so that other
//! traffic does not evict it. When each falls due, who gets one and what it
//! found are the core's rules ([`kvroute_core::warmup`]); here they are
//! run: the prefix is read as a request from its tenant would be (salted,
//! keyed and hashed alike, [`Service::read_warmup`]), its owners are the
//! first ready endpoints in the rendezvous order the policy places it by
//! ([`Pool::owners`]), and each warm-up is sent straight to its owner.
//!
//! Warm-ups are not requests: they are counted in `kvroute_warmups_total`
//! and `kvroute_warmup_prefill_tokens_total` only, never held by flow
//! control, and not in the request counters, hit rates or missed-token
//! causes.
//!
//! Where they come from ([`Source`]): the router's `routing.warmup`, or the
//! operator's policy (`CacheRoutingPolicy.spec.warmup`) when it sets one.
//! With the operator, which router sends each prefix's warm-ups to each
//! owner is the core's rule 4 ([`warmup::sender`]) over the pool's router
//! pods the operator names; this router finds itself by its pod's name
//! (`POD_NAME`, [`identity`]). Without names each router sends its own.
//! What it sent it reports to the operator ([`report`]).
//!
//! Each warm-up is sent by its own task, bounded and with a deadline
//! scaled to its predicted prefill ([`send`]): an owner that never
//! answers fails its own warm-ups and delays no other owner's. A prefix's
//! period ends, and is reported, when its last warm-up answers.

mod report;
mod send;
mod source;

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use kvroute_core::warmup::{self, Outcome, Schedule};
use kvroute_telemetry::throttle::Throttle;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use serde::Serialize;
use tokio::task::{JoinError, JoinSet};

use crate::config::{Config, Prefix, Warmup};
use crate::metrics::ModelTenant;
use crate::pool::PrefixOwner;
use crate::prompt::Analysis;
use crate::request::Service;
use crate::request::hit_rate::Usage;
use crate::upstream::{Upstream, upstream};

use self::send::Seats;

pub use self::report::Target as ReportTarget;
pub use self::source::Source;

/// An owner's result while its warm-up has not answered
/// ([`OwnerStatus::result`]).
const IN_FLIGHT: &str = "in_flight";
/// `kvroute_warmups_total`'s result for a warm-up not sent because
/// [`send::PER_OWNER`] were in flight to its owner or [`send::IN_ALL`] in
/// all.
const SKIPPED_IN_FLIGHT: &str = "skipped_in_flight";
/// A prefix's failures are logged at most this often.
const LOG_EVERY: Duration = Duration::from_secs(60);

/// `{prefix,result}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PrefixResult {
    prefix: String,
    result: &'static str,
}

/// Warm-ups' metrics.
#[derive(Debug, Default)]
pub(crate) struct WarmupMetrics {
    warmups: Family<PrefixResult, Counter>,
    prefill_tokens: Family<ModelTenant, Counter>,
    reports: report::Results,
}

impl WarmupMetrics {
    /// Registers the families in `r`.
    pub(crate) fn register(&self, r: &mut Registry) {
        r.register(
            "kvroute_warmups",
            "Warm-ups of routing.warmup's named prefixes per owner, by result: sent (the prefix was resident), repaired (it was not: everySeconds is too long for the traffic), skipped_busy, skipped_resident, skipped_budget, skipped_in_flight (4 in flight to the owner or 32 in all), failed",
            self.warmups.clone(),
        );
        r.register(
            "kvroute_warmup_prefill_tokens",
            "Prompt tokens warm-ups made the engines compute (prompt minus cached), by model and tenant: their cost",
            self.prefill_tokens.clone(),
        );
        r.register(
            "kvroute_warmup_reports",
            "Reports of sent warm-ups to the operator's status writer (for the policy's status.warmup), by result: ok, failed",
            self.reports.clone(),
        );
    }
}

/// What each prefix's warm-ups did in its last period: `GET /debug/warmup`
/// and `kvroute explain --prefix`.
#[derive(Clone, Debug, Default)]
pub(crate) struct Statuses(Arc<Mutex<Vec<PrefixStatus>>>);

/// One prefix's last period.
#[derive(Clone, Debug, Serialize)]
pub struct PrefixStatus {
    pub name: String,
    /// When its warm-ups last fell due, and fall due next, Unix ms.
    pub last_due_unix_ms: Option<u64>,
    pub next_due_unix_ms: Option<u64>,
    /// Its tokens, as its warm-up is read.
    pub prompt_tokens: u64,
    /// Its owners then, best first.
    pub owners: Vec<OwnerStatus>,
    /// Why it could not be read, if it could not.
    pub error: Option<String>,
}

/// One owner in a prefix's last period.
#[derive(Clone, Debug, Serialize)]
pub struct OwnerStatus {
    pub endpoint: String,
    /// Whether its engine reported the prefix's blocks before the warm-up.
    pub resident: bool,
    /// `kvroute_warmups_total`'s result, `another_router` when another
    /// router of the pool sends this owner's warm-ups, or `in_flight`
    /// while its warm-up has not answered.
    pub result: &'static str,
    /// The router that sends them, when the operator names the pool's
    /// routers.
    pub sender: Option<String>,
}

/// The name this router is known by among the pool's routers: its pod's
/// (`POD_NAME`, from the downward API), else `kvroute-router`.
pub fn identity() -> String {
    std::env::var("POD_NAME")
        .ok()
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| "kvroute-router".to_owned())
}

impl Statuses {
    /// Empty statuses for `warmup`'s prefixes.
    fn reset(&self, warmup: &Warmup) {
        let each = (warmup.prefixes.iter()).map(|p| PrefixStatus {
            name: p.name.clone(),
            last_due_unix_ms: None,
            next_due_unix_ms: None,
            prompt_tokens: 0,
            owners: Vec::new(),
            error: None,
        });
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = each.collect();
    }

    /// Every prefix's.
    pub(crate) fn get(&self) -> Vec<PrefixStatus> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Sets the prefix at `i`'s status, unless it shows a later period.
    fn set(&self, i: usize, status: &PrefixStatus) {
        if let Some(s) = self.0.lock().unwrap_or_else(|e| e.into_inner()).get_mut(i)
            && s.last_due_unix_ms <= status.last_due_unix_ms
        {
            *s = status.clone();
        }
    }
}

/// The warm-up task of one router.
pub(crate) struct Warmups {
    service: Arc<Service>,
    /// The warm-ups in effect; none: the default, without prefixes.
    config: Arc<Warmup>,
    schedule: Schedule,
    /// This router's name among the pool's routers.
    identity: String,
    /// The flow gate's `holdAboveMs`: an owner whose queue is longer is
    /// busy.
    busy_s: f64,
    client: Upstream,
    /// All prefill counted into the budget so far.
    prefilled: u64,
    /// Each prefix's owners in its last period: a warm-up that finds its
    /// prefix gone from one of them repaired it; a new owner's first is
    /// `sent`.
    last_owners: Vec<Vec<Arc<str>>>,
    failures: Throttle<usize>,
    reporter: report::Reporter,
    /// The warm-ups in flight, and their bounds.
    sending: JoinSet<Answered>,
    seats: Seats,
    /// The periods with warm-ups in flight.
    rounds: Vec<Round>,
    /// Counts the warm-ups set: an answer to older ones counts nothing.
    generation: u64,
}

/// A prefix's period whose warm-ups have not all answered.
struct Round {
    i: usize,
    status: PrefixStatus,
    /// Its warm-ups in flight.
    pending: usize,
}

/// A warm-up's answer, as its task returns it.
struct Answered {
    generation: u64,
    /// The prefix, its period (when it fell due) and the owner's place
    /// among its owners.
    i: usize,
    due: u64,
    k: usize,
    endpoint: Arc<str>,
    model: String,
    /// The owner was one in the prefix's last period too.
    again: bool,
    block_tokens: u64,
    usage: Result<Usage, String>,
}

impl Warmups {
    /// The warm-up task; it sends nothing until warm-ups are set
    /// ([`Source`]).
    pub(crate) fn new(service: Arc<Service>, config: &Config) -> Self {
        let none = Arc::<Warmup>::default();
        Warmups {
            busy_s: service.flow.hold_s(),
            client: upstream(&config.limits),
            last_owners: Vec::new(),
            schedule: schedule(&none),
            config: none,
            identity: identity(),
            service,
            prefilled: 0,
            failures: Throttle::new(LOG_EVERY),
            reporter: report::Reporter::new(),
            sending: JoinSet::new(),
            seats: Seats::default(),
            rounds: Vec::new(),
            generation: 0,
        }
    }

    /// Runs until the router stops: each prefix's warm-ups when they fall
    /// due, with the warm-ups in effect.
    pub(crate) async fn run(mut self) {
        let mut source = self.service.pool.warmup.effective.subscribe();
        // The first warm-ups wait for an endpoint to send them to.
        let mut ready = self.service.pool.ready();
        let _ = ready.wait_for(|&n| n > 0).await;
        loop {
            let current = source.borrow_and_update().clone();
            self.configure(current);
            let now = wall_ms();
            for i in self.schedule.due(now) {
                self.warm(i, now).await;
            }
            let next = self.schedule.next_due_ms(now).unwrap_or(u64::MAX);
            let wait = next.saturating_sub(wall_ms());
            tokio::select! {
                () = tokio::time::sleep(Duration::from_millis(wait.min(3_600_000))) => {}
                Some(answered) = self.sending.join_next() => self.answered(answered),
                changed = source.changed() => {
                    if changed.is_err() {
                        return;
                    }
                }
            }
        }
    }

    /// Starts over with `warmup` when it is not the one in effect.
    fn configure(&mut self, warmup: Option<Arc<Warmup>>) {
        let warmup = warmup.unwrap_or_default();
        if warmup == self.config {
            return;
        }
        tracing::info!(
            prefixes = warmup.prefixes.len(),
            every_seconds = warmup.every_seconds,
            "warm-ups in effect"
        );
        self.schedule = schedule(&warmup);
        self.last_owners = vec![Vec::new(); warmup.prefixes.len()];
        self.service
            .pool
            .warmup
            .reset_touches(warmup.prefixes.len());
        self.service.warmups.reset(&warmup);
        self.config = warmup;
        // Warm-ups in flight finish on their own, their seats with them;
        // their answers are of prefixes no longer set, and not counted.
        self.generation += 1;
        self.rounds.clear();
    }

    /// The warm-ups of the prefix at `i`, due at `now`: those sent run
    /// on their own ([`Self::answered`]).
    async fn warm(&mut self, i: usize, now: u64) {
        let prefix = self.config.prefixes[i].clone();
        let all = self.service.accounting.prefilled.load(Ordering::Relaxed);
        (self.schedule).prefilled(now, all.saturating_sub(self.prefilled));
        self.prefilled = all;
        let every_ms = self.config.every_seconds * 1000;
        let mut status = PrefixStatus {
            name: prefix.name.clone(),
            last_due_unix_ms: Some(now),
            next_due_unix_ms: Some(warmup::next_due_ms(&prefix.name, every_ms, now)),
            prompt_tokens: 0,
            owners: Vec::new(),
            error: None,
        };
        let mut pending = 0;
        match self.read(&prefix).await {
            Err(e) => {
                self.failed(i, &prefix, None, &e);
                status.error = Some(e);
            }
            Ok(read) => {
                status.prompt_tokens = read.2.prompt_tokens;
                let request = read.2.request();
                let n = self.config.owners as usize;
                let owners = self.service.pool.owners(&request, n, self.busy_s);
                let last = std::mem::replace(
                    &mut self.last_owners[i],
                    owners.iter().map(|o| o.target.name.clone()).collect(),
                );
                let full = read.2.prompt_tokens.saturating_sub(1) / read.2.block_tokens.max(1);
                let source = &self.service.pool.warmup;
                let marker = (full as usize).checked_sub(2);
                if let Some((b, hash)) = marker.and_then(|b| Some((b, *read.2.chain.get(b)?))) {
                    let names: Vec<_> = owners.iter().map(|o| o.target.name.clone()).collect();
                    source.watch(i, (b, hash), &names);
                }
                let routers = source.routers();
                for (k, owner) in owners.into_iter().enumerate() {
                    let holds = u64::from(owner.held_blocks) >= full && full > 0;
                    let again = last.contains(&owner.target.name);
                    let sender = warmup::sender(&routers, &prefix.name, &owner.target.name);
                    let result = match sender {
                        Some(other) if other != self.identity => "another_router",
                        _ => {
                            let warm = (i, k, &prefix, now);
                            self.warm_owner(warm, &read, &owner, (holds, again))
                        }
                    };
                    pending += usize::from(result == IN_FLIGHT);
                    status.owners.push(OwnerStatus {
                        endpoint: owner.target.name.to_string(),
                        resident: holds,
                        result,
                        sender: sender.map(str::to_owned),
                    });
                }
            }
        }
        self.service.warmups.set(i, &status);
        if pending == 0 {
            self.report(&status);
        } else {
            // A period outlives its warm-ups' deadlines only when a task
            // ended without an answer: forgotten, not kept forever.
            let stale = now.saturating_sub(2 * send::CAP.as_millis() as u64);
            self.rounds
                .retain(|r| r.status.last_due_unix_ms >= Some(stale));
            self.rounds.push(Round { i, status, pending });
        }
    }

    /// A warm-up answered, or failed to: counts it, and ends its period
    /// when it was the last of it in flight.
    fn answered(&mut self, answered: Result<Answered, JoinError>) {
        let a = match answered {
            Ok(a) => a,
            Err(e) => {
                // Its seat came back as the task ended; its period shows
                // it in flight until the next.
                tracing::error!(error = %e, "a warm-up's task ended without an answer");
                return;
            }
        };
        if a.generation != self.generation {
            return;
        }
        let prefix = self.config.prefixes[a.i].clone();
        let result = match a.usage {
            Err(e) => self.failed(a.i, &prefix, Some(&a.endpoint), &e),
            Ok(usage) => {
                let (prompt, cached) = (usage.prompt_tokens, usage.cached_tokens);
                self.schedule
                    .warmed(a.i, a.due, prompt.saturating_sub(cached));
                self.count_tokens(&prefix, &a.model, prompt.saturating_sub(cached));
                // A new owner's first warm-up found nothing to keep.
                let result = if a.again {
                    warmup::outcome(prompt, cached, a.block_tokens)
                } else {
                    Outcome::Sent
                };
                self.count(&prefix, result.as_str());
                result.as_str()
            }
        };
        let round = self
            .rounds
            .iter()
            .position(|r| r.i == a.i && r.status.last_due_unix_ms == Some(a.due));
        let Some(r) = round else {
            return;
        };
        let round = &mut self.rounds[r];
        if let Some(owner) = round.status.owners.get_mut(a.k) {
            owner.result = result;
        }
        round.pending -= 1;
        self.service.warmups.set(a.i, &round.status);
        if round.pending == 0 {
            let round = self.rounds.swap_remove(r);
            self.report(&round.status);
        }
    }

    /// Reports the owners `status` sent a warm-up to, if any, to the
    /// operator.
    fn report(&mut self, status: &PrefixStatus) {
        let sent = [Outcome::Sent.as_str(), Outcome::Repaired.as_str()];
        let now = wall_ms();
        let sent: Vec<_> = (status.owners.iter())
            .filter(|o| sent.contains(&o.result))
            .map(|o| kvroute_proto::v1::WarmupSent {
                prefix: status.name.clone(),
                endpoint: o.endpoint.clone(),
                unix_ms: now,
            })
            .collect();
        let Some(target) = self
            .service
            .pool
            .warmup
            .report_to()
            .filter(|_| !sent.is_empty())
        else {
            return;
        };
        let results = &self.service.accounting.metrics.warmup.reports;
        (self.reporter).send(target, &self.identity, sent, results);
    }

    /// The warm-up of the prefix at `i` (due at `now`), `read`, on `owner`,
    /// the `k`th of its owners: skipped (the result), or sent in its own
    /// task ([`IN_FLIGHT`]). `holds`: the owner's engine reports the
    /// prefix; `again`: it was an owner in the last period too.
    fn warm_owner(
        &mut self,
        (i, k, prefix, now): (usize, usize, &Prefix, u64),
        (path, model, analysis): &(&'static str, String, Analysis),
        owner: &PrefixOwner,
        (holds, again): (bool, bool),
    ) -> &'static str {
        let view = warmup::Owner {
            busy: owner.busy,
            holds,
            touched_ms: self.service.pool.warmup.last_touch(i, &owner.target.name),
        };
        // What it is expected to cost: the prompt past what the owner holds.
        let block_tokens = analysis.block_tokens.max(1);
        let held = u64::from(owner.held_blocks) * block_tokens;
        let uncached = analysis.prompt_tokens.saturating_sub(held);
        if let Some(skipped) = self.schedule.decide(i, view, now, uncached).skipped() {
            self.count(prefix, skipped);
            return skipped;
        }
        let Some(seat) = self.seats.take(&owner.target.name) else {
            self.count(prefix, SKIPPED_IN_FLIGHT);
            return SKIPPED_IN_FLIGHT;
        };
        let pool = self.service.pool.clone();
        let ttft = pool.predicted_ttft(&analysis.request(), &owner.target, uncached);
        let deadline = send::deadline(ttft);
        let load = pool.hold(&owner.target, analysis.prompt_tokens, uncached);
        let (client, body) = (self.client.clone(), analysis.bytes.clone());
        let (http, path, name) = (owner.target.http, *path, prefix.name.clone());
        let mut answered = Answered {
            generation: self.generation,
            i,
            due: now,
            k,
            endpoint: owner.target.name.clone(),
            model: model.clone(),
            again,
            block_tokens,
            usage: Err(String::new()),
        };
        self.sending.spawn(async move {
            answered.usage = send::send(client, (http, path), body, &name, deadline).await;
            drop((load, seat));
            answered
        });
        IN_FLIGHT
    }

    /// The path, the model and the reading of the prefix's warm-up.
    async fn read(&self, prefix: &Prefix) -> Result<(&'static str, String, Analysis), String> {
        let model = match &prefix.model {
            Some(m) => m.clone(),
            None => {
                let models = self.service.models().await;
                let mut base = (models.ids.iter()).filter(|m| !models.adapters.contains_key(*m));
                match (base.next(), base.next()) {
                    (Some(m), None) => m.clone(),
                    _ => return Err("set its model: the endpoints do not serve exactly one".into()),
                }
            }
        };
        let (path, body) = prefix.request(&model);
        let bytes = Bytes::from(serde_json::to_vec(&body).unwrap_or_default());
        let analysis = (self
            .service
            .read_warmup(path, bytes, prefix.tenant.clone())
            .await)
            .map_err(|e| e.to_string())?;
        Ok((path, model, analysis))
    }

    /// Counts a failed warm-up of the prefix at `i` and logs it, at most
    /// once a minute per prefix: `failed`.
    fn failed(
        &mut self,
        i: usize,
        prefix: &Prefix,
        endpoint: Option<&str>,
        error: &str,
    ) -> &'static str {
        let failed = Outcome::Failed.as_str();
        self.count(prefix, failed);
        let now = tokio::time::Instant::now().into_std();
        if let Some(times) = self.failures.admit(i, now) {
            let endpoint = endpoint.unwrap_or_default();
            tracing::warn!(prefix = %prefix.name, endpoint, error, times, "warm-up failed");
        }
        failed
    }

    fn count(&self, prefix: &Prefix, result: &'static str) {
        let labels = PrefixResult {
            prefix: prefix.name.clone(),
            result,
        };
        let metrics = &self.service.accounting.metrics.warmup;
        metrics.warmups.get_or_create(&labels).inc();
    }

    fn count_tokens(&self, prefix: &Prefix, model: &str, tokens: u64) {
        let accounting = &self.service.accounting;
        let by = ModelTenant {
            model: model.to_owned(),
            tenant: accounting.tenant_label(prefix.tenant.as_deref()),
        };
        (accounting.metrics.warmup.prefill_tokens.get_or_create(&by)).inc_by(tokens);
    }
}

/// The schedule of `warmup`'s prefixes.
fn schedule(warmup: &Warmup) -> Schedule {
    Schedule::new(
        warmup.prefixes.iter().map(|p| p.name.clone()),
        Duration::from_secs(warmup.every_seconds),
        warmup.max_share_of_prefill,
    )
}

fn wall_ms() -> u64 {
    let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    since.map_or(0, |d| d.as_millis() as u64)
}
