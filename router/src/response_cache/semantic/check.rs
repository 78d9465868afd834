//! The embedder's check: whether its vectors can be trusted to tell
//! questions apart. A vector can be finite, non-zero and normalized and
//! still carry no information (an embedder answering one constant vector
//! makes every question a hit). Pure: no I/O, no clock; the level
//! ([`super::Semantic`]) embeds the probes, and acts on what
//! [`Health::checked`] returns.
//!
//! The rules:
//! 1. The [`PROBES`], texts about unrelated things in no common word, are
//!    embedded. The check fails when one gets no vector (the reason is
//!    the embedding's: `timeout`, `transport`, `status`, `garbage`), when
//!    one is not finite or is zero (`garbage`), when their dimensions
//!    differ (`dimension`), or when any two are similar at or above the
//!    threshold (`similar`).
//! 2. A check that passes establishes the embedder's dimension. One of
//!    another dimension than the last established (the embedding model
//!    changed) replaces it, and the index is emptied: vectors of two
//!    models are not comparable.
//! 3. Until a check passes, and while the last one failed, the level is
//!    off: lookups are plain misses, nothing is remembered. A vector of
//!    another dimension than the established one is refused.
//! 4. The next check is `checkIntervalS` after one that passed, and at
//!    most [`RETRY`] after one that failed, so that the level comes back
//!    soon after its embedder was briefly down.
//!
//! Not here: the embedding ([`super::embeddings`]), the loop that runs
//! the checks ([`super::Semantic::run_checks`]).

use std::time::Duration;

use super::ROUNDING;
use super::embeddings::EmbedError;

/// Unrelated texts, no two sharing a word: any embedding model worth
/// using puts them far apart (real models score such pairs well below
/// 0.9; engine-sim's test double about 0).
pub const PROBES: [&str; 4] = [
    "The capital of Australia is Canberra.",
    "Whisk two eggs with flour and sugar.",
    "A TCP handshake takes three packets.",
    "Photosynthesis turns sunlight into chemical energy.",
];

/// The longest wait for the next check after one that failed.
pub const RETRY: Duration = Duration::from_secs(5);

/// Why a check failed: its `reason` label.
#[derive(Clone, Debug, PartialEq)]
pub enum Failure {
    /// A probe got no vector: the embedding's reason.
    Embedding(&'static str),
    /// A vector not finite, or zero.
    Garbage,
    /// The probes' vectors differ in dimension.
    Dimension,
    /// Two probes' vectors are this similar, at least the threshold.
    Similar(f32),
}

impl Failure {
    /// The `reason` label.
    pub fn reason(&self) -> &'static str {
        match self {
            Failure::Embedding(reason) => reason,
            Failure::Garbage => "garbage",
            Failure::Dimension => "dimension",
            Failure::Similar(_) => "similar",
        }
    }
}

/// The verdict on the probes' embeddings (rule 1): the dimension when
/// they pass.
pub fn verdict(
    embedded: &[Result<Vec<f32>, EmbedError>],
    threshold: f32,
) -> Result<usize, Failure> {
    let mut vectors = Vec::with_capacity(embedded.len());
    for e in embedded {
        match e {
            Ok(v) => vectors.push(v),
            Err(e) => return Err(Failure::Embedding(e.reason())),
        }
    }
    let dimension = vectors.first().map_or(0, |v| v.len());
    if vectors.iter().any(|v| v.len() != dimension) {
        return Err(Failure::Dimension);
    }
    let usable = |v: &Vec<f32>| v.iter().all(|x| x.is_finite()) && v.iter().any(|x| *x != 0.0);
    if dimension == 0 || !vectors.iter().all(|v| usable(v)) {
        return Err(Failure::Garbage);
    }
    for (i, a) in vectors.iter().enumerate() {
        for b in &vectors[i + 1..] {
            let similarity = cosine(a, b);
            if similarity + ROUNDING >= threshold {
                return Err(Failure::Similar(similarity));
            }
        }
    }
    Ok(dimension)
}

fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let dot = |x: &[f32], y: &[f32]| x.iter().zip(y).map(|(x, y)| x * y).sum::<f32>();
    dot(a, b) / (dot(a, a).sqrt() * dot(b, b).sqrt())
}

/// What the checks established (rules 2 and 3).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Health {
    /// The dimension of the last check that passed.
    dimension: Option<usize>,
    /// Whether the last check passed.
    healthy: bool,
}

/// What a check changed, for the caller to act on, log and count.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// It passed: the level is on, at `dimension`; `changed` when another
    /// was established before (empty the index).
    Passed {
        /// The embedder's dimension.
        dimension: usize,
        /// Whether it replaced another.
        changed: bool,
        /// Whether the level was off before.
        recovered: bool,
    },
    /// It failed: the level is off.
    Failed(Failure),
}

impl Health {
    /// Takes a check's verdict.
    pub fn checked(&mut self, verdict: Result<usize, Failure>) -> Event {
        match verdict {
            Ok(dimension) => {
                let changed = self.dimension.is_some_and(|d| d != dimension);
                let recovered = !self.healthy;
                (self.dimension, self.healthy) = (Some(dimension), true);
                Event::Passed {
                    dimension,
                    changed,
                    recovered,
                }
            }
            Err(failure) => {
                self.healthy = false;
                Event::Failed(failure)
            }
        }
    }

    /// The dimension vectors must have while the level is on; `None`
    /// while it is off.
    pub fn dimension(&self) -> Option<usize> {
        self.dimension.filter(|_| self.healthy)
    }

    /// When the next check is due after this one, `interval` the
    /// configured one (rule 4).
    pub fn next_check(&self, interval: Duration) -> Duration {
        if self.healthy {
            interval
        } else {
            interval.min(RETRY)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unit(v: &[f32]) -> Vec<f32> {
        let n = v.iter().map(|x| x * x).sum::<f32>().sqrt();
        v.iter().map(|x| x / n).collect()
    }

    fn probes(vectors: &[&[f32]]) -> Vec<Result<Vec<f32>, EmbedError>> {
        vectors.iter().map(|v| Ok(unit(v))).collect()
    }

    #[test]
    fn a_constant_embedder_fails_and_unrelated_vectors_pass() {
        let constant = probes(&[&[1.0, 2.0], &[1.0, 2.0], &[1.0, 2.0]]);
        assert!(matches!(verdict(&constant, 0.99), Err(Failure::Similar(s)) if s > 0.999));
        let apart = probes(&[&[1.0, 0.0, 0.0], &[0.0, 1.0, 0.0], &[0.0, 0.0, 1.0]]);
        assert_eq!(verdict(&apart, 0.99), Ok(3));
        // Near each other, but below the threshold: the threshold decides.
        let near = probes(&[&[1.0, 0.1], &[1.0, -0.1]]);
        assert_eq!(verdict(&near, 0.99), Ok(2));
        assert_eq!(verdict(&near, 0.95).unwrap_err().reason(), "similar");
    }

    #[test]
    fn disagreeing_or_unusable_vectors_fail() {
        let dims = probes(&[&[1.0, 0.0], &[0.0, 1.0, 0.0]]);
        assert_eq!(verdict(&dims, 0.99), Err(Failure::Dimension));
        let zero: Vec<Result<Vec<f32>, EmbedError>> = vec![Ok(vec![1.0, 0.0]), Ok(vec![0.0, 0.0])];
        assert_eq!(verdict(&zero, 0.99), Err(Failure::Garbage));
        let nan = vec![Ok(vec![1.0, 0.0]), Ok(vec![f32::NAN, 1.0])];
        assert_eq!(verdict(&nan, 0.99), Err(Failure::Garbage));
        let down = vec![Ok(vec![1.0, 0.0]), Err(EmbedError::Timeout(200))];
        assert_eq!(verdict(&down, 0.99).unwrap_err().reason(), "timeout");
    }

    #[test]
    fn the_dimension_is_established_by_a_pass_and_replaced_by_another() {
        let mut health = Health::default();
        assert_eq!(health.dimension(), None, "off until a check passes");
        let interval = Duration::from_secs(60);
        assert_eq!(health.next_check(interval), RETRY);
        let first = health.checked(Ok(256));
        assert_eq!(
            first,
            Event::Passed {
                dimension: 256,
                changed: false,
                recovered: true
            }
        );
        assert_eq!(health.dimension(), Some(256));
        assert_eq!(health.next_check(interval), interval);
        // A failure turns the level off; the dimension is kept for later.
        let failed = health.checked(Err(Failure::Similar(1.0)));
        assert_eq!(failed, Event::Failed(Failure::Similar(1.0)));
        assert_eq!(health.dimension(), None);
        assert_eq!(
            health.next_check(Duration::from_secs(1)),
            Duration::from_secs(1)
        );
        // The same dimension again: nothing to empty.
        let back = health.checked(Ok(256));
        assert!(matches!(
            back,
            Event::Passed {
                changed: false,
                recovered: true,
                ..
            }
        ));
        // Another model: the index is emptied.
        let other = health.checked(Ok(1024));
        assert!(matches!(
            other,
            Event::Passed {
                dimension: 1024,
                changed: true,
                recovered: false
            }
        ));
        assert_eq!(health.dimension(), Some(1024));
    }
}
