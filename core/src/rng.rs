//! The project's one seeded pseudo-random generator, SplitMix64: the random
//! policy, reconnect jitter, synthetic workloads and test data all draw
//! from it.
//!
//! Hand-written, not a dependency, because it is a few lines and its
//! sequence must never change: a seed names the same numbers on every
//! machine and in every release, which deterministic tests, demo workloads
//! and benchmark figures rely on, and which a crate's generator does not
//! promise across versions. Not for anything secret.

/// SplitMix64 (Steele, Lea and Flood, 2014): the state advances by a fixed
/// odd constant; each output is that state, mixed.
#[derive(Clone, Debug)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator whose sequence `seed` fixes.
    pub const fn new(seed: u64) -> Self {
        SplitMix64 { state: seed }
    }

    /// The next value, uniform over `u64`.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi`, by modulo (biased by at most
    /// `(hi - lo + 1) / 2^64`, nothing for the small ranges it serves).
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo + 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_reference_sequence() {
        // The first outputs of the reference implementation seeded with 0.
        let mut rng = SplitMix64::new(0);
        assert_eq!(rng.next_u64(), 0xe220_a839_7b1d_cdaf);
        assert_eq!(rng.next_u64(), 0x6e78_9e6a_a1b9_65f4);
        assert_eq!(rng.next_u64(), 0x06c4_5d18_8009_454f);
    }

    #[test]
    fn range_stays_within_its_bounds() {
        let mut rng = SplitMix64::new(7);
        let draws: Vec<u64> = (0..1000).map(|_| rng.range(6, 16)).collect();
        assert!(draws.iter().all(|d| (6..=16).contains(d)));
        assert!(draws.contains(&6) && draws.contains(&16));
    }
}
