//! `random`: a uniformly random endpoint from a seeded generator, so runs
//! repeat exactly.

use super::*;
use crate::rng::SplitMix64;

/// Configuration of [`Random`].
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Seed of the generator. Default: 0.
    pub seed: u64,
}

/// A random permutation per request, from a seeded [`SplitMix64`].
#[derive(Clone, Debug)]
pub struct Random {
    rng: SplitMix64,
}

impl Random {
    /// A generator seeded from `config`.
    pub fn new(config: Config) -> Self {
        Random {
            rng: SplitMix64::new(config.seed),
        }
    }

    /// Uniform in `0..n` (Lemire's multiply-shift; bias below 2^-32 for the
    /// pool sizes routers see).
    fn below(&mut self, n: usize) -> usize {
        ((u128::from(self.rng.next_u64()) * n as u128) >> 64) as usize
    }
}

impl Policy for Random {
    fn name(&self) -> &'static str {
        "random"
    }

    fn rank(&mut self, _: &Request<'_>, endpoints: &[Endpoint], _: &Context<'_>) -> Decision {
        let mut ranked: Vec<usize> = (0..endpoints.len()).collect();
        // Fisher-Yates.
        for i in (1..ranked.len()).rev() {
            let j = self.below(i + 1);
            ranked.swap(i, j);
        }
        Decision::cold(ranked)
    }

    fn boxed_clone(&self) -> Box<dyn Policy> {
        Box::new(self.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::*;

    #[test]
    fn same_seed_same_choices_and_uniform() {
        let pool = Pool::test().replicas(4);
        let mut a = Random::new(Config { seed: 7 });
        let mut b = Random::new(Config { seed: 7 });
        let mut counts = [0u32; 4];
        for _ in 0..8000 {
            let da = a.rank(&request(1, &[]), &pool.endpoints, &pool.cx());
            let db = b.rank(&request(1, &[]), &pool.endpoints, &pool.cx());
            assert_eq!(da, db);
            assert_permutation(&da, 4);
            counts[da.ranked[0]] += 1;
        }
        for c in counts {
            assert!((1800..2200).contains(&c), "{counts:?}");
        }
        let mut c = Random::new(Config { seed: 8 });
        let firsts_a: Vec<usize> = (0..20)
            .map(|_| a.rank(&request(1, &[]), &pool.endpoints, &pool.cx()).ranked[0])
            .collect();
        let firsts_c: Vec<usize> = (0..20)
            .map(|_| c.rank(&request(1, &[]), &pool.endpoints, &pool.cx()).ranked[0])
            .collect();
        assert_ne!(firsts_a, firsts_c);
    }
}
