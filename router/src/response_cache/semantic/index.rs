//! The semantic cache's index: for a query vector, the most similar stored
//! question of one partition (a tenant and model) whose context (a digest
//! of the rest of its request) is the query's. Approximate (HNSW graphs,
//! from `instant-distance`), bounded, in this router's memory. Pure: no
//! I/O, no clock, no lock; the caller keeps it behind one, and runs the
//! graph builds it hands out on a blocking thread.
//!
//! The rules:
//! 1. Vectors are `f32`, L2-normalized by the caller: the similarity is
//!    their dot product (the cosine), a graph's distance `1 - dot`. The
//!    dimension is the caller's ([`Index::set_dimension`], which empties
//!    the index when it changes), else the first entry's. A vector of
//!    another dimension, with
//!    a component not finite, or not of unit length (±[`UNIT_TOLERANCE`])
//!    is refused with an [`IndexError`] and changes nothing.
//! 2. Each partition ([`partition`] of the tenant and model) is searched
//!    on its own: an entry is never found from another partition.
//! 3. A partition's newest entries, its `fresh` ones, are searched
//!    exhaustively. When there are `batch` of them ([`Shape`]: 1,024 by
//!    default) they are handed out as a [`Build`]: the caller runs it
//!    ([`Build::run`], pure and synchronous) and installs the result
//!    ([`Index::install`]), an immutable graph. Until then they stay in
//!    `fresh`, found as before.
//! 4. Graphs are merged by size tier: a graph of fewer than `batch ×
//!    fanout^(t+1)` entries is of tier t, and when a partition's newest
//!    `fanout` graphs (8 by default) share a tier they are merged into one
//!    (a build). A partition so holds up to `fanout - 1` graphs of each
//!    tier, tiers 0 to ⌊log_fanout(max_entries / batch)⌋ (0 and 1 at
//!    10,000 entries: at most 14 graphs), and an entry is built into a
//!    graph about once per tier.
//! 5. At most one build per partition at a time, the first that applies:
//!    its oldest graph, when more than half dead, is rebuilt of its live
//!    entries; else graphs due a merge are merged; else `fresh` is built.
//!    A build dropped uninstalled (or its result) is handed out again the
//!    next time its partition changes; one kept and never run leaves the
//!    partition's newer entries in `fresh`, searched exhaustively.
//! 6. At most `max_entries` live entries over all partitions, and at most
//!    `max_bytes` held ([`Index::bytes`], dead entries in graphs
//!    included): an insert beyond either evicts the oldest, by insertion
//!    over all partitions, until both hold. An evicted entry leaves
//!    `fresh` at once; in a graph it is dead, skipped by searches, and a
//!    graph all dead is dropped at once. So the byte bound may evict
//!    several entries at once, up to a whole graph's, to free memory
//!    that dead entries hold.
//! 7. A search returns the most similar live entry with the query's
//!    context: over `fresh` exhaustively, and in each graph among the `ef`
//!    entries (16 by default) its HNSW search returns, nearest first. An
//!    entry of another context, or dead, is never returned. A matching
//!    entry ranked below `ef` others in its graph (the same question asked
//!    in many other contexts) is not found: a miss, never a wrong hit.
//!
//! ## Memory
//!
//! An entry costs its vector (4 bytes a dimension: 1 KiB at 256), about
//! 150 bytes of its own (key, context, sequence number, reference counts,
//! its slot) and its model name, and a slot of 32 bytes in the eviction
//! queue; in a graph, about 340 bytes more (64 neighbour links of 4 bytes
//! in the bottom layer, 32 in each upper layer for about 0.4 of the
//! entries, its slot and sequence number). So about 1.5 KiB an entry at
//! dimension 256; [`Index::bytes`] adds these up as entries come and go,
//! and `max_bytes` bounds that sum (rule 6): at 16,384 dimensions an entry
//! is about 65 KiB, so 64 MiB holds about 1,000 of them.
//!
//! Entries held, dead ones included ([`Index::held`]), are at most 2 ×
//! `max_entries`, whatever the caller does with builds: a build takes only
//! live entries, so when it is handed out its entries are among the last
//! `max_entries` inserted; a graph is kept only while one of its entries
//! is live, so it was handed out within the last `max_entries` inserts;
//! so every entry held is among the last 2 × `max_entries` inserted.
//! Rebuilding a graph past half dead (rule 5) is for searches: a dead
//! entry costs time and takes one of a graph search's `ef` places.
//!
//! A build in flight holds, until installed or dropped, its own graph
//! (about 340 bytes an entry) of entries it shares with the index: one per
//! partition, of at most the partition's entries.
//!
//! A search costs the scan of `fresh` (fewer than `batch` entries while
//! builds keep up) and an HNSW search per graph. A build costs about a
//! graph search per entry, and instant-distance spreads it over rayon's
//! global thread pool (one thread per core), whichever thread runs it.
//! instant-distance links each entry to 64 others in its bottom layer (a
//! constant), so a graph search visits hundreds of entries: a small graph
//! costs as much as scanning it, hence large batches and few graphs. The
//! decision bench's `semantic` group measures searches and inserts; its
//! figures are in `docs/response-cache.md` ("What it costs").
//!
//! Not here: embedding, the similarity threshold, answers (the exact
//! store's, by the [`Key`] a hit returns), expiry: the caller's.

mod graph;

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use instant_distance::Search;
use sha2::{Digest, Sha256};

pub use self::graph::{Build, Built};
use self::graph::{Entry, Graph, Point, Sources, Ticket, dot};
use crate::response_cache::key::Key;

/// How the index arranges its entries. The defaults were chosen on the
/// decision bench (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    /// Entries of a partition searched exhaustively before they are built
    /// into a graph: 1,024.
    pub batch: usize,
    /// Graphs of one size tier merged into one: 8.
    pub fanout: usize,
    /// Candidates a graph search returns, nearest first (HNSW's `ef`): 16.
    pub ef: usize,
    /// Candidates a build weighs for an entry's neighbours (HNSW's
    /// `efConstruction`): 40.
    pub ef_construction: usize,
}

impl Default for Shape {
    fn default() -> Self {
        Shape {
            batch: 1024,
            fanout: 8,
            ef: 16,
            ef_construction: 40,
        }
    }
}

/// How far from 1 a vector's length may be.
pub const UNIT_TOLERANCE: f32 = 1e-3;

/// A vector refused.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum IndexError {
    /// Not of the index's dimension (its first entry's).
    #[error("a vector of {got} dimensions, in an index of {expected}")]
    Dimension {
        /// The index's.
        expected: usize,
        /// The vector's.
        got: usize,
    },
    /// A component is infinite or NaN.
    #[error("a vector with a component that is not finite")]
    NotFinite,
    /// Not L2-normalized.
    #[error("a vector of length {norm}, not 1: it must be L2-normalized")]
    NotUnit {
        /// Its length.
        norm: f32,
    },
}

/// The entry a search found.
#[derive(Clone, Debug, PartialEq)]
pub struct Hit {
    /// Where its answer is stored.
    pub key: Key,
    /// Its cosine similarity to the query, in [-1, 1].
    pub similarity: f32,
}

/// The partition of `tenant`'s requests to `model`: a SHA-256 of both,
/// length-prefixed, and of the tenant's presence (no tenant and an empty
/// one are two partitions).
pub fn partition(tenant: Option<&str>, model: &str) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(b"kvroute-semantic-partition/1");
    h.update([u8::from(tenant.is_some())]);
    for part in [tenant.unwrap_or(""), model] {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part.as_bytes());
    }
    h.finalize().into()
}

/// The index. See the module doc.
#[derive(Debug)]
pub struct Index {
    max_entries: usize,
    max_bytes: usize,
    /// What it holds ([`Index::bytes`]), kept as entries come and go.
    bytes: usize,
    shape: Shape,
    /// The caller's, else fixed by the first entry.
    dimension: Option<usize>,
    partitions: HashMap<[u8; 32], Partition>,
    /// The partition of each entry inserted, oldest first: the first's
    /// sequence number is `floor`.
    order: VecDeque<[u8; 32]>,
    /// Entries before it are evicted.
    floor: u64,
    live: usize,
    held: usize,
    /// The next graph's or job's id.
    next_id: u64,
}

/// One tenant's and model's entries.
#[derive(Debug)]
struct Partition {
    /// Oldest first, each a contiguous run of the partition's entries in
    /// the order of insertion; only the first can be partly dead.
    graphs: Vec<Graph>,
    /// The newest entries, oldest first, all live.
    fresh: VecDeque<Arc<Entry>>,
    /// The build in flight.
    job: Option<Job>,
}

/// A build handed out.
#[derive(Debug)]
struct Job {
    id: u64,
    abandoned: Arc<AtomicBool>,
}

/// What a partition costs besides its entries and graphs.
const PARTITION_BYTES: usize = size_of::<Partition>() + 64;
/// What an entry costs in the eviction queue.
const SLOT_BYTES: usize = size_of::<[u8; 32]>();

impl Partition {
    /// Drops the oldest graphs while all dead, entries before `from`;
    /// returns how many entries they held, and their bytes.
    fn drop_dead(&mut self, from: u64) -> (usize, usize) {
        let all_dead = (self.graphs.iter())
            .take_while(|g| g.dead(from) == g.len())
            .count();
        (self.graphs.drain(..all_dead)).fold((0, 0), |(n, b), g| (n + g.len(), b + g.bytes))
    }

    fn is_empty(&self) -> bool {
        self.graphs.is_empty() && self.fresh.is_empty()
    }
}

impl Index {
    /// An index of at most `max_entries` live entries (none when 0), of
    /// the default [`Shape`].
    pub fn new(max_entries: usize) -> Self {
        Self::with_shape(max_entries, Shape::default())
    }

    /// An index of at most `max_entries` live entries, of `shape` (its
    /// sizes at least 1, 2 for `fanout`).
    pub fn with_shape(max_entries: usize, shape: Shape) -> Self {
        let shape = Shape {
            batch: shape.batch.max(1),
            fanout: shape.fanout.max(2),
            ef: shape.ef.max(1),
            ef_construction: shape.ef_construction.max(1),
        };
        Index {
            max_entries,
            max_bytes: usize::MAX,
            bytes: 0,
            shape,
            dimension: None,
            partitions: HashMap::new(),
            order: VecDeque::new(),
            floor: 0,
            live: 0,
            held: 0,
            next_id: 0,
        }
    }

    /// The index bounded to `max_bytes` as well ([`Index::bytes`]).
    pub fn with_max_bytes(mut self, max_bytes: usize) -> Self {
        self.max_bytes = max_bytes;
        self
    }

    /// Makes `dimension` the index's: the vectors of another are refused.
    /// When it had another, every entry is dropped first (the embedding
    /// model changed: its vectors mean nothing to the new one's); returns
    /// whether it had.
    pub fn set_dimension(&mut self, dimension: usize) -> bool {
        if self.dimension == Some(dimension) {
            return false;
        }
        let changed = self.dimension.is_some();
        // Sequence numbers and job ids go on: a build of the old entries
        // still running is dropped when it comes to be installed.
        self.floor += self.order.len() as u64;
        self.order.clear();
        self.partitions.clear();
        (self.live, self.held, self.bytes) = (0, 0, 0);
        self.dimension = Some(dimension);
        changed
    }

    /// Stores the question of unit `vector` in `partition`, found with
    /// `context`, answered under `key`; evicts the oldest entry beyond
    /// `max_entries`. Returns the builds now due (see the module doc).
    pub fn insert(
        &mut self,
        partition: [u8; 32],
        vector: &[f32],
        context: [u8; 32],
        key: Key,
    ) -> Result<Vec<Build>, IndexError> {
        self.check(vector)?;
        if self.max_entries == 0 {
            return Ok(Vec::new());
        }
        self.dimension = Some(vector.len());
        let seq = self.floor + self.order.len() as u64;
        self.order.push_back(partition);
        let p = (self.partitions).entry(partition).or_insert_with(|| {
            self.bytes += PARTITION_BYTES;
            Partition {
                graphs: Vec::new(),
                fresh: VecDeque::new(),
                job: None,
            }
        });
        let entry = Arc::new(Entry {
            vector: vector.into(),
            key,
            context,
            seq,
        });
        self.bytes += entry.bytes() + SLOT_BYTES;
        p.fresh.push_back(entry);
        self.live += 1;
        self.held += 1;
        let mut touched = vec![partition];
        while self.order.len() > self.max_entries
            || (self.bytes > self.max_bytes && !self.order.is_empty())
        {
            touched.extend(self.evict_oldest());
        }
        Ok(self.plan_all(touched))
    }

    /// Installs a graph built from a [`Build`] this index handed out;
    /// returns the builds now due. A result its partition no longer
    /// waits for (evicted meanwhile, or the build handed out again) is
    /// dropped.
    pub fn install(&mut self, built: Built) -> Vec<Build> {
        let Built {
            partition,
            mut ticket,
            sources,
            hnsw,
            seqs,
            bytes,
        } = built;
        ticket.settle();
        let floor = self.floor;
        let Some(p) = self.partitions.get_mut(&partition) else {
            return Vec::new();
        };
        if p.job.as_ref().map(|j| j.id) != Some(ticket.id) {
            return Vec::new();
        }
        p.job = None;
        let graph = Graph {
            id: self.next_id,
            hnsw,
            seqs,
            bytes,
        };
        self.next_id += 1;
        let added = (graph.len(), graph.bytes);
        match sources {
            Sources::Fresh { last } => {
                let built = (p.fresh.iter()).take_while(|e| e.seq <= last).count();
                let freed: usize = p.fresh.drain(..built).map(|e| e.bytes()).sum();
                p.graphs.push(graph);
                self.held = self.held - built + added.0;
                self.bytes = self.bytes - freed + added.1;
            }
            Sources::Graphs(ids) => {
                // Sources dropped meanwhile were all dead: so are their
                // entries in the new graph.
                if let Some(at) = p.graphs.iter().position(|g| ids.contains(&g.id)) {
                    let n = (p.graphs[at..].iter())
                        .take_while(|g| ids.contains(&g.id))
                        .count();
                    let replaced = (p.graphs.splice(at..at + n, [graph]))
                        .fold((0, 0), |(n, b), g| (n + g.len(), b + g.bytes));
                    self.held = self.held - replaced.0 + added.0;
                    self.bytes = self.bytes - replaced.1 + added.1;
                }
            }
        }
        let (dead, freed) = p.drop_dead(floor);
        (self.held, self.bytes) = (self.held - dead, self.bytes - freed);
        self.plan(&partition).into_iter().collect()
    }

    /// The most similar live entry of `partition` stored with `context`
    /// to the unit `vector`, with its similarity (see the module doc).
    pub fn nearest(
        &self,
        partition: &[u8; 32],
        vector: &[f32],
        context: &[u8; 32],
    ) -> Result<Option<Hit>, IndexError> {
        self.check(vector)?;
        let Some(p) = self.partitions.get(partition) else {
            return Ok(None);
        };
        let from = self.floor;
        let query = Point::Query(vector.into());
        let mut search = Search::default();
        let in_graphs = p.graphs.iter().filter_map(|g| {
            (g.hnsw.search(&query, &mut search))
                .filter_map(|item| item.point.entry())
                .find(|e| e.seq >= from && e.context == *context)
        });
        let in_fresh = (p.fresh.iter())
            .filter(|e| e.context == *context)
            .map(|e| &**e);
        // Ties go to the newest: graphs oldest first, then `fresh`.
        let best = (in_graphs.chain(in_fresh))
            .map(|e| (dot(vector, &e.vector), e))
            .reduce(|best, next| if next.0 >= best.0 { next } else { best });
        Ok(best.map(|(similarity, e)| Hit {
            key: e.key.clone(),
            similarity: similarity.clamp(-1.0, 1.0),
        }))
    }

    /// Live entries.
    pub fn len(&self) -> usize {
        self.live
    }

    /// Whether it holds no live entry.
    pub fn is_empty(&self) -> bool {
        self.live == 0
    }

    /// Entries held, dead ones included (see the module doc's bounds).
    pub fn held(&self) -> usize {
        self.held
    }

    /// Partitions holding entries.
    pub fn partitions(&self) -> usize {
        self.partitions.len()
    }

    /// Graphs over all partitions.
    pub fn graphs(&self) -> usize {
        self.partitions.values().map(|p| p.graphs.len()).sum()
    }

    /// About how many bytes it holds (see the module doc), dead entries
    /// included, builds in flight not: at most `max_bytes`.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// [`Index::bytes`] added up afresh.
    #[cfg(test)]
    fn bytes_counted(&self) -> usize {
        let partitions = self.partitions.values().map(|p| {
            PARTITION_BYTES
                + p.fresh.iter().map(|e| e.bytes()).sum::<usize>()
                + p.graphs.iter().map(|g| g.bytes).sum::<usize>()
        });
        self.order.len() * SLOT_BYTES + partitions.sum::<usize>()
    }

    /// Refuses a vector of another dimension, not finite, or not of unit
    /// length.
    fn check(&self, vector: &[f32]) -> Result<(), IndexError> {
        if let Some(expected) = self.dimension
            && vector.len() != expected
        {
            return Err(IndexError::Dimension {
                expected,
                got: vector.len(),
            });
        }
        if !vector.iter().all(|x| x.is_finite()) {
            return Err(IndexError::NotFinite);
        }
        let norm = dot(vector, vector).sqrt();
        if (norm - 1.0).abs() > UNIT_TOLERANCE {
            return Err(IndexError::NotUnit { norm });
        }
        Ok(())
    }

    /// Evicts the oldest entry; returns its partition if it still holds
    /// entries.
    fn evict_oldest(&mut self) -> Option<[u8; 32]> {
        let id = self.order.pop_front()?;
        self.bytes -= SLOT_BYTES;
        let seq = self.floor;
        self.floor += 1;
        let p = self.partitions.get_mut(&id)?;
        self.live -= 1;
        if p.fresh.front().is_some_and(|e| e.seq == seq)
            && let Some(e) = p.fresh.pop_front()
        {
            self.held -= 1;
            self.bytes -= e.bytes();
        }
        let (dead, freed) = p.drop_dead(self.floor);
        (self.held, self.bytes) = (self.held - dead, self.bytes - freed);
        if p.is_empty() {
            self.partitions.remove(&id);
            self.bytes -= PARTITION_BYTES;
            return None;
        }
        Some(id)
    }

    /// The builds due in the `touched` partitions.
    fn plan_all(&mut self, mut touched: Vec<[u8; 32]>) -> Vec<Build> {
        touched.sort_unstable();
        touched.dedup();
        touched.iter().filter_map(|id| self.plan(id)).collect()
    }

    /// The build due in partition `id`, if none is in flight (rule 5).
    fn plan(&mut self, id: &[u8; 32]) -> Option<Build> {
        let from = self.floor;
        let p = self.partitions.get_mut(id)?;
        if let Some(job) = &p.job {
            if !job.abandoned.load(Ordering::Relaxed) {
                return None;
            }
            p.job = None;
        }
        let Shape { batch, fanout, .. } = self.shape;
        let newest = p.graphs.len().saturating_sub(fanout);
        let newest = &p.graphs[newest..];
        let (sources, entries): (Sources, Vec<_>) = if let Some(g) = p.graphs.first()
            && 2 * g.dead(from) > g.len()
        {
            (Sources::Graphs(vec![g.id]), g.live(from).collect())
        } else if newest.len() == fanout
            && (newest.iter()).all(|g| g.tier(batch, fanout) == newest[0].tier(batch, fanout))
        {
            let ids = newest.iter().map(|g| g.id).collect();
            (
                Sources::Graphs(ids),
                newest.iter().flat_map(|g| g.live(from)).collect(),
            )
        } else if p.fresh.len() >= batch {
            let last = p.fresh.back().map_or(0, |e| e.seq);
            (Sources::Fresh { last }, p.fresh.iter().cloned().collect())
        } else {
            return None;
        };
        if entries.is_empty() {
            return None;
        }
        let (ticket, abandoned) = Ticket::new(self.next_id);
        p.job = Some(Job {
            id: self.next_id,
            abandoned,
        });
        self.next_id += 1;
        Some(Build {
            partition: *id,
            ticket,
            sources,
            entries,
            ef: (self.shape.ef, self.shape.ef_construction),
        })
    }
}

#[cfg(test)]
mod tests;
