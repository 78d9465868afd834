//! The semantic level of the response cache (experimental, opt-in): a
//! cacheable request whose exact key missed is answered with the answer
//! of an earlier, similar question. Its risk is a wrong answer: two
//! questions that embed close together may not mean the same thing
//! (docs/response-cache.md measures it).
//!
//! 1. Only a request the exact cache would store, whose question (the
//!    last user message, or the prompt) is text of at most
//!    [`MAX_QUESTION_BYTES`], is looked up ([`super::key::Question`]).
//! 2. The question is embedded ([`embeddings`]); any failure is a plain
//!    miss, counted, never an error for the client. The embedder is
//!    checked at start and periodically ([`check`]): until a check
//!    passes, and while the last failed, the level is off (a plain miss,
//!    counted, and nothing remembered), and a vector of another dimension
//!    than the check established is refused.
//! 3. The nearest question stored for the same tenant and model
//!    ([`index`]) serves when its cosine similarity is at least
//!    `threshold` **and** everything else in the request is byte-identical
//!    (its context digest is equal). Its answer is read from the exact
//!    store; an answer gone from there is a miss, whose question is
//!    remembered afresh.
//! 4. A miss's question is remembered once its answer is stored.
//! 5. Each semantic hit's response id is kept with its tenant (the last
//!    [`RECENT_HITS`]) so a client can report it wrong
//!    ([`Semantic::report_false_hit`]): only the hit's own tenant, and
//!    only once; another tenant's report is answered as an unknown id's,
//!    so ids cannot be probed across tenants.
//!
//! Not here: the exact cache, and the HTTP glue (`crate::http`).

pub mod check;
pub mod embeddings;
pub mod index;

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Duration;

use tokio::time::Instant;

use self::check::{Event, Failure, Health, PROBES};
use self::embeddings::Embedder;
use self::index::{Build, Hit, Index};
use super::key::{Key, Question};
use super::metrics::CacheMetrics;
use crate::config::{ConfigError, Limits, Semantic as Config};
use crate::metrics::{Model, Why};

/// The header carrying a semantic hit's similarity.
pub const SIMILARITY_HEADER: &str = "x-kvroute-similarity";
/// The longest question embedded, bytes; longer ones are not looked up.
pub const MAX_QUESTION_BYTES: usize = 8192;
/// The `f32` rounding a similarity is compared to the threshold with: a
/// question embedded exactly as a stored one has similarity 1 only to
/// within it (threshold 1 means "the same embedding").
const ROUNDING: f32 = 1e-5;
/// Semantic hits remembered for false-hit reports.
pub const RECENT_HITS: usize = 1024;

/// The semantic level. See the module doc.
#[derive(Debug)]
pub struct Semantic {
    embedder: Embedder,
    /// Lookups read it at once; inserts and installs write.
    index: RwLock<Index>,
    threshold: f32,
    metrics: Arc<CacheMetrics>,
    /// Recent semantic hits, oldest first.
    hits: Mutex<VecDeque<RecentHit>>,
    /// What the embedder's checks established. Locked after `index`
    /// when both are.
    health: Mutex<Health>,
    /// `checkIntervalS`.
    check_interval: Duration,
}

/// What a lookup found.
#[derive(Debug)]
pub enum Found {
    /// A similar question with the same context, and what to remember
    /// instead if its answer is gone from the exact store (expired,
    /// evicted or purged).
    Similar(Hit, Remember),
    /// None: what to remember once the answer is stored, if anything.
    Unmatched(Option<Remember>),
}

/// A question to remember with its answer's key.
#[derive(Debug)]
pub struct Remember {
    partition: [u8; 32],
    vector: Vec<f32>,
    context: [u8; 32],
    /// Who asked it: the tenant a hit on it is reported by.
    tenant: Option<String>,
}

/// A semantic hit served, kept for a false-hit report.
#[derive(Debug)]
struct RecentHit {
    /// The response id it was answered as.
    id: String,
    /// The model label it is counted under.
    model: String,
    /// The tenant it was served to: the only one that may report it.
    tenant: Option<String>,
    /// Whether it was reported (it counts once).
    reported: bool,
}

/// What became of a false-hit report.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Report {
    /// Counted.
    Counted,
    /// The hit was reported before: not counted again.
    Again,
    /// Not a recent semantic hit of the reporting tenant.
    Unknown,
}

impl Semantic {
    /// The level `config` describes.
    pub fn new(
        config: &Config,
        limits: &Limits,
        metrics: Arc<CacheMetrics>,
    ) -> Result<Self, ConfigError> {
        Ok(Semantic {
            embedder: Embedder::new(&config.embeddings, limits)?,
            index: RwLock::new(
                Index::new(config.max_entries)
                    .with_max_bytes(usize::try_from(config.max_bytes).unwrap_or(usize::MAX)),
            ),
            threshold: config.threshold,
            metrics,
            hits: Mutex::default(),
            health: Mutex::default(),
            check_interval: Duration::from_secs(config.check_interval_s),
        })
    }

    /// Checks the embedder now and then every `checkIntervalS` (sooner
    /// while it fails), for ever: see [`check`].
    pub async fn run_checks(self: Arc<Self>) {
        loop {
            let mut embedded = Vec::with_capacity(PROBES.len());
            for probe in PROBES {
                embedded.push(self.embedder.embed(probe).await);
            }
            let next = self.checked(check::verdict(&embedded, self.threshold));
            tokio::time::sleep(next).await;
        }
    }

    /// Takes a check's verdict: turns the level on or off, establishes
    /// the dimension (emptying the index for another); returns when the
    /// next check is due.
    pub fn checked(&self, verdict: Result<usize, Failure>) -> Duration {
        let mut index = self.write();
        let mut health = self.health.lock().unwrap_or_else(|e| e.into_inner());
        let was_on = health.dimension().is_some();
        match health.checked(verdict) {
            Event::Passed {
                dimension,
                changed,
                recovered,
            } => {
                index.set_dimension(dimension);
                if changed {
                    tracing::warn!(
                        dimension,
                        "the embedder's dimension changed: the semantic index is emptied"
                    );
                } else if recovered {
                    tracing::info!(
                        dimension,
                        "the embedder's check passed: the semantic level is on"
                    );
                }
            }
            Event::Failed(failure) => {
                let reason = failure.reason();
                let why = Why { reason };
                self.metrics.check_failures.get_or_create(&why).inc();
                if was_on {
                    tracing::warn!(
                        reason,
                        ?failure,
                        "the embedder's check failed: the semantic level is off"
                    );
                } else {
                    tracing::debug!(reason, ?failure, "the embedder's check failed");
                }
            }
        }
        let on = health.dimension().is_some();
        self.metrics.embedder_healthy.set(i64::from(on));
        health.next_check(self.check_interval)
    }

    /// The dimension vectors must have, while the level is on.
    fn dimension(&self) -> Option<usize> {
        let health = self.health.lock().unwrap_or_else(|e| e.into_inner());
        health.dimension()
    }

    /// Looks up `question` of `tenant` to `model`.
    pub async fn lookup(&self, tenant: Option<&str>, model: &str, question: &Question) -> Found {
        if question.text.len() > MAX_QUESTION_BYTES {
            return Found::Unmatched(None);
        }
        let Some(dimension) = self.dimension() else {
            self.metrics.semantic_skipped.inc();
            return Found::Unmatched(None);
        };
        let started = Instant::now();
        let embedded = self.embedder.embed(&question.text).await;
        let seconds = started.elapsed().as_secs_f64();
        self.metrics.embedding_seconds.observe(seconds);
        let vector = match embedded {
            Ok(v) => v,
            Err(e) => {
                tracing::debug!(error = %e, "no embedding: a plain miss");
                self.count_error(e.reason());
                return Found::Unmatched(None);
            }
        };
        if vector.len() != dimension {
            tracing::debug!(
                got = vector.len(),
                dimension,
                "an embedding of another dimension: a plain miss"
            );
            self.count_error("dimension");
            return Found::Unmatched(None);
        }
        self.matching(tenant, model, vector, question.context)
    }

    /// The lookup's step after embedding: `vector` (the question's) and
    /// `context` of `tenant` to `model` against the index.
    fn matching(
        &self,
        tenant: Option<&str>,
        model: &str,
        vector: Vec<f32>,
        context: [u8; 32],
    ) -> Found {
        let partition = index::partition(tenant, model);
        let nearest = self.read().nearest(&partition, &vector, &context);
        let remember = Remember {
            partition,
            vector,
            context,
            tenant: tenant.map(str::to_owned),
        };
        match nearest {
            Ok(Some(hit)) => {
                self.metrics.similarity.observe(f64::from(hit.similarity));
                if hit.similarity + ROUNDING >= self.threshold {
                    return Found::Similar(hit, remember);
                }
            }
            Ok(None) => {}
            // Another dimension than the index's: the embedding model
            // changed under it.
            Err(e) => {
                tracing::debug!(error = %e, "an embedding the index refuses: a plain miss");
                self.count_error("garbage");
                return Found::Unmatched(None);
            }
        }
        Found::Unmatched(Some(remember))
    }

    /// Remembers `question`, whose answer is now stored under `key`.
    pub fn remember(self: &Arc<Self>, question: Remember, key: Key) {
        let Remember {
            partition,
            vector,
            context,
            ..
        } = question;
        if self.dimension() != Some(vector.len()) {
            return;
        }
        let inserted = self.write().insert(partition, &vector, context, key);
        match inserted {
            Ok(builds) => self.build(builds),
            Err(e) => tracing::debug!(error = %e, "a question the index refuses"),
        }
    }

    /// Records a semantic hit on `found`'s question ([`Found::Similar`]'s
    /// second part) answered as `id` for `model` (a label).
    pub fn served(&self, found: &Remember, id: String, model: String) {
        let mut hits = self.hits.lock().unwrap_or_else(|e| e.into_inner());
        if hits.len() == RECENT_HITS {
            hits.pop_front();
        }
        hits.push_back(RecentHit {
            id,
            model,
            tenant: found.tenant.clone(),
            reported: false,
        });
    }

    /// Counts `tenant`'s report that the semantic hit answered as `id`
    /// was wrong, once per hit; a hit served to another tenant is
    /// [`Report::Unknown`], as an id never served is.
    pub fn report_false_hit(&self, tenant: Option<&str>, id: &str) -> Report {
        let mut hits = self.hits.lock().unwrap_or_else(|e| e.into_inner());
        let found = (hits.iter_mut()).find(|h| h.id == id && h.tenant.as_deref() == tenant);
        let Some(hit) = found else {
            return Report::Unknown;
        };
        if std::mem::replace(&mut hit.reported, true) {
            return Report::Again;
        }
        let model = Model {
            model: hit.model.clone(),
        };
        self.metrics.false_hits.get_or_create(&model).inc();
        Report::Counted
    }

    /// Sets the entries and bytes gauges (at scrape time).
    pub fn refresh_gauges(&self) {
        let (entries, bytes) = {
            let index = self.read();
            (index.len(), index.bytes())
        };
        self.metrics.semantic_entries.set(entries as i64);
        self.metrics.semantic_bytes.set(bytes as i64);
    }

    /// Runs `builds` on blocking threads, installing each when done.
    fn build(self: &Arc<Self>, builds: Vec<Build>) {
        for build in builds {
            let me = self.clone();
            tokio::task::spawn_blocking(move || {
                let built = build.run();
                let more = me.write().install(built);
                me.build(more);
            });
        }
    }

    fn count_error(&self, reason: &'static str) {
        let why = Why { reason };
        self.metrics.embedding_errors.get_or_create(&why).inc();
    }

    fn read(&self) -> RwLockReadGuard<'_, Index> {
        self.index.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, Index> {
        self.index.write().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests;
