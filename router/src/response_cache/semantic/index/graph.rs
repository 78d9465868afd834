//! The immutable graphs of the index ([`super`]): the entries they hold,
//! their distance, and the builds the index hands out to make them.
//!
//! Not here: which entries go into a build, or when ([`super`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use instant_distance::{Builder, Hnsw};

use crate::response_cache::key::Key;

/// Bytes an entry costs in a graph besides itself: 64 neighbour links of
/// 4 bytes in the bottom layer, 32 in each upper layer for about 0.4 of the
/// entries (instant-distance's M = 32, mL = 1/ln 32), its slot and its
/// sequence number.
pub(super) const GRAPH_BYTES: usize = 64 * 4 + 52 + size_of::<Point>() + 8;

/// Bytes an entry costs besides its vector and model name: itself, its
/// reference counts and its slot in `fresh`.
pub(super) const ENTRY_BYTES: usize = size_of::<Entry>() + 2 * size_of::<usize>() + 8;

/// A stored question.
#[derive(Debug)]
pub(super) struct Entry {
    /// Unit length, the index's dimension.
    pub vector: Box<[f32]>,
    /// Where its answer is stored.
    pub key: Key,
    /// The digest of the rest of its request.
    pub context: [u8; 32],
    /// Its place in the order of insertion, over all partitions.
    pub seq: u64,
}

impl Entry {
    /// What it costs, besides what a graph adds (see the module doc of
    /// [`super`]).
    pub fn bytes(&self) -> usize {
        ENTRY_BYTES + 4 * self.vector.len() + self.key.model.len()
    }
}

/// A point of a graph: an entry, or the query a search is for.
#[derive(Clone, Debug)]
pub(super) enum Point {
    Entry(Arc<Entry>),
    Query(Box<[f32]>),
}

impl Point {
    fn vector(&self) -> &[f32] {
        match self {
            Point::Entry(e) => &e.vector,
            Point::Query(v) => v,
        }
    }

    /// The entry, for a point of a graph.
    pub fn entry(&self) -> Option<&Entry> {
        match self {
            Point::Entry(e) => Some(e),
            Point::Query(_) => None,
        }
    }
}

impl instant_distance::Point for Point {
    /// The cosine distance of unit vectors. Not a metric (no triangle
    /// inequality), which HNSW does not need.
    fn distance(&self, other: &Self) -> f32 {
        1.0 - dot(self.vector(), other.vector())
    }
}

/// The dot product of `a` and `b` (of one length), summed in 8 lanes so
/// that the compiler vectorizes it; indexed, not through iterator
/// adaptors, which debug builds (the tests') do not inline.
pub(super) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut lanes = [0.0f32; 8];
    let mut i = 0;
    while i + 8 <= n {
        let (x, y) = (&a[i..i + 8], &b[i..i + 8]);
        lanes[0] += x[0] * y[0];
        lanes[1] += x[1] * y[1];
        lanes[2] += x[2] * y[2];
        lanes[3] += x[3] * y[3];
        lanes[4] += x[4] * y[4];
        lanes[5] += x[5] * y[5];
        lanes[6] += x[6] * y[6];
        lanes[7] += x[7] * y[7];
        i += 8;
    }
    let mut sum = (lanes[0] + lanes[4])
        + (lanes[1] + lanes[5])
        + (lanes[2] + lanes[6])
        + (lanes[3] + lanes[7]);
    while i < n {
        sum += a[i] * b[i];
        i += 1;
    }
    sum
}

/// An immutable graph of some of a partition's entries: a contiguous run
/// of them in the order of insertion.
pub(super) struct Graph {
    /// Unique in the index.
    pub id: u64,
    pub hnsw: Hnsw<Point>,
    /// Its entries' sequence numbers, ascending.
    pub seqs: Box<[u64]>,
    /// What it costs (entries and links).
    pub bytes: usize,
}

impl std::fmt::Debug for Graph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Graph")
            .field("id", &self.id)
            .field("entries", &self.seqs.len())
            .finish_non_exhaustive()
    }
}

impl Graph {
    /// Entries held, dead ones included.
    pub fn len(&self) -> usize {
        self.seqs.len()
    }

    /// Entries dead when those before `from` are.
    pub fn dead(&self, from: u64) -> usize {
        self.seqs.partition_point(|&s| s < from)
    }

    /// Its size tier: t when it holds fewer than `batch × fanout^(t+1)`
    /// entries.
    pub fn tier(&self, batch: usize, fanout: usize) -> u32 {
        let (mut tier, mut bound) = (0, batch.saturating_mul(fanout));
        while self.len() >= bound {
            tier += 1;
            bound = bound.saturating_mul(fanout);
        }
        tier
    }

    /// Its entries from `from` on.
    pub fn live(&self, from: u64) -> impl Iterator<Item = Arc<Entry>> + '_ {
        (self.hnsw.iter())
            .filter_map(|(_, p)| match p {
                Point::Entry(e) => Some(e),
                Point::Query(_) => None,
            })
            .filter(move |e| e.seq >= from)
            .cloned()
    }
}

/// What a build replaces when installed.
#[derive(Debug)]
pub(super) enum Sources {
    /// The partition's `fresh` entries up to this sequence number.
    Fresh { last: u64 },
    /// These graphs (a contiguous run).
    Graphs(Vec<u64>),
}

/// A graph to build: run it ([`Build::run`], on a blocking thread) and
/// install the result ([`super::Index::install`]). Dropped instead, the
/// index hands it out again the next time its partition changes.
#[must_use = "a build's entries are searched exhaustively until it is installed"]
pub struct Build {
    pub(super) partition: [u8; 32],
    pub(super) ticket: Ticket,
    pub(super) sources: Sources,
    pub(super) entries: Vec<Arc<Entry>>,
    /// HNSW's `ef` and `efConstruction` (see [`super::Shape`]).
    pub(super) ef: (usize, usize),
}

impl std::fmt::Debug for Build {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Build")
            .field("job", &self.ticket.id)
            .field("sources", &self.sources)
            .field("entries", &self.entries.len())
            .finish_non_exhaustive()
    }
}

impl Build {
    /// Entries it builds a graph of.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether it has none (never, as handed out).
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Builds the graph: pure, synchronous, and CPU-bound (about a graph
    /// search per entry; instant-distance spreads it over rayon's global
    /// pool). Deterministic: seeded by the job's id.
    pub fn run(self) -> Built {
        let Build {
            partition,
            ticket,
            sources,
            entries,
            ef: (ef, ef_construction),
        } = self;
        let mut seqs: Vec<u64> = entries.iter().map(|e| e.seq).collect();
        seqs.sort_unstable();
        let bytes = (entries.iter()).map(|e| e.bytes() + GRAPH_BYTES).sum();
        let points = entries.into_iter().map(Point::Entry).collect();
        let (hnsw, _) = Builder::default()
            .ef_search(ef)
            .ef_construction(ef_construction)
            .seed(ticket.id)
            .build_hnsw(points);
        Built {
            partition,
            ticket,
            sources,
            hnsw,
            seqs: seqs.into(),
            bytes,
        }
    }
}

/// A built graph, to install ([`super::Index::install`]).
#[must_use = "a built graph is used once installed"]
pub struct Built {
    pub(super) partition: [u8; 32],
    pub(super) ticket: Ticket,
    pub(super) sources: Sources,
    pub(super) hnsw: Hnsw<Point>,
    pub(super) seqs: Box<[u64]>,
    pub(super) bytes: usize,
}

impl std::fmt::Debug for Built {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Built")
            .field("job", &self.ticket.id)
            .field("sources", &self.sources)
            .field("entries", &self.seqs.len())
            .finish_non_exhaustive()
    }
}

/// A build's claim on its partition: dropped before it is settled (the
/// build or its result dropped), it flags the job abandoned, so the index
/// hands the work out again instead of waiting for it forever.
#[derive(Debug)]
pub(super) struct Ticket {
    pub id: u64,
    abandoned: Arc<AtomicBool>,
    settled: bool,
}

impl Ticket {
    /// A ticket for job `id`, and the flag its drop raises.
    pub fn new(id: u64) -> (Ticket, Arc<AtomicBool>) {
        let abandoned = Arc::new(AtomicBool::new(false));
        let ticket = Ticket {
            id,
            abandoned: abandoned.clone(),
            settled: false,
        };
        (ticket, abandoned)
    }

    /// The result reached the index.
    pub fn settle(&mut self) {
        self.settled = true;
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if !self.settled {
            self.abandoned.store(true, Ordering::Relaxed);
        }
    }
}
