//! `approx-prefix`: SGLang router's cache-aware policy. The router remembers
//! which prefix blocks it sent where ([`PrefixMemory`]); a request goes to
//! the endpoint it matches best when the match covers more than
//! `cache_threshold` of the prompt, else to the endpoint with the least
//! remembered blocks. When the pool is imbalanced, the shortest queue wins
//! over both.

use super::memory::PrefixMemory;
use super::*;

/// Configuration of [`ApproxPrefix`]. Defaults are SGLang router's.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct Config {
    /// Minimum share of the prompt's blocks the best endpoint must have
    /// been sent for the request to follow it. Default: 0.5.
    pub cache_threshold: f64,
    /// The pool is imbalanced when the busiest endpoint has more than this
    /// many in-flight requests above the idlest... Default: 32.
    pub balance_abs_threshold: u32,
    /// ...and more than this times as many. Default: 1.0001.
    pub balance_rel_threshold: f64,
    /// Blocks remembered per endpoint, least recently routed dropped first.
    /// Default: 32768 (512k tokens at 16 per block).
    pub capacity_blocks: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            cache_threshold: 0.5,
            balance_abs_threshold: 32,
            balance_rel_threshold: 1.0001,
            capacity_blocks: 32768,
        }
    }
}

/// SGLang-style approximate prefix routing.
#[derive(Clone, Debug)]
pub struct ApproxPrefix {
    config: Config,
    memory: PrefixMemory,
    by_slot: Vec<u32>,
    matched: Vec<u32>,
}

impl ApproxPrefix {
    /// A policy with `config` and an empty memory.
    pub fn new(config: Config) -> Self {
        ApproxPrefix {
            memory: PrefixMemory::new(config.capacity_blocks),
            config,
            by_slot: Vec::new(),
            matched: Vec::new(),
        }
    }
}

impl Policy for ApproxPrefix {
    fn name(&self) -> &'static str {
        "approx-prefix"
    }

    fn rank(&mut self, request: &Request<'_>, endpoints: &[Endpoint], _: &Context<'_>) -> Decision {
        let n = endpoints.len();
        if n == 0 {
            return Decision::cold(Vec::new());
        }
        self.memory.longest_prefix(request.chain, &mut self.by_slot);
        per_candidate(&self.by_slot, endpoints, &mut self.matched);
        let matched = &self.matched;
        let load = |i: usize| endpoints[i].load.in_flight;
        let best = (0..n)
            .max_by_key(|&i| (matched[i], std::cmp::Reverse(load(i)), std::cmp::Reverse(i)))
            .expect("non-empty");
        let idlest = (0..n).min_by_key(|&i| (load(i), i)).expect("non-empty");
        let busiest = (0..n).map(load).max().unwrap_or(0);
        let imbalanced = busiest - load(idlest) > self.config.balance_abs_threshold
            && f64::from(busiest) > f64::from(load(idlest)) * self.config.balance_rel_threshold;
        let rate = if request.chain.is_empty() {
            0.0
        } else {
            f64::from(matched[best]) / request.chain.len() as f64
        };
        let (choice, reason) = if imbalanced {
            let spilled = matched[best] > 0 && matched[idlest] < matched[best];
            (idlest, if spilled { Reason::Spill } else { Reason::Cold })
        } else if rate > self.config.cache_threshold {
            (best, Reason::Warm)
        } else {
            let smallest = (0..n)
                .min_by_key(|&i| (self.memory.held(endpoints[i].slot), load(i), i))
                .expect("non-empty");
            (smallest, Reason::Cold)
        };
        let mut ranked: Vec<usize> = (0..n).filter(|&i| i != choice).collect();
        ranked.sort_by_key(|&i| (std::cmp::Reverse(matched[i]), load(i)));
        ranked.insert(0, choice);
        Decision {
            ranked,
            reason,
            cached_blocks: matched[choice],
        }
    }

    fn routed(&mut self, request: &Request<'_>, endpoint: &Endpoint) {
        self.memory.record(endpoint.slot, request.chain);
    }

    fn endpoint_removed(&mut self, slot: Slot) {
        self.memory.forget(slot);
    }

    fn boxed_clone(&self) -> Box<dyn Policy> {
        Box::new(self.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::*;

    fn route(p: &mut ApproxPrefix, pool: &Pool, chain: &[u64]) -> Decision {
        let req = request(1, chain);
        let d = p.rank(&req, &pool.endpoints, &pool.cx());
        p.routed(&req, &pool.endpoints[d.ranked[0]]);
        d
    }

    #[test]
    fn follows_its_own_history_above_the_threshold() {
        let pool = Pool::test().replicas(3);
        let mut p = ApproxPrefix::new(Config::default());
        let first = route(&mut p, &pool, &[1, 2, 3, 4]);
        assert_eq!(first.reason, Reason::Cold);
        let again = route(&mut p, &pool, &[1, 2, 3, 9]);
        assert_eq!(again.ranked[0], first.ranked[0]);
        assert_eq!((again.reason, again.cached_blocks), (Reason::Warm, 3));
        // Sharing 1 block of 4 is under the 0.5 threshold: the endpoint
        // with the least remembered blocks takes it instead.
        let other = route(&mut p, &pool, &[1, 7, 8, 9]);
        assert_ne!(other.ranked[0], first.ranked[0]);
        assert_eq!(other.reason, Reason::Cold);
        assert_permutation(&other, 3);
    }

    #[test]
    fn shortest_queue_wins_when_imbalanced() {
        let pool = Pool::test().replicas(2);
        let mut p = ApproxPrefix::new(Config::default());
        let first = route(&mut p, &pool, &[1, 2]).ranked[0];
        let busy = Pool::test().replicas(2).in_flight(first, 40);
        let d = p.rank(&request(1, &[1, 2]), &busy.endpoints, &busy.cx());
        assert_eq!(d.ranked, vec![1 - first, first]);
        assert_eq!(d.reason, Reason::Spill);
    }

    #[test]
    fn forgets_removed_endpoints() {
        let pool = Pool::test().replicas(2);
        let mut p = ApproxPrefix::new(Config::default());
        let first = route(&mut p, &pool, &[1, 2]).ranked[0];
        p.endpoint_removed(pool.endpoints[first].slot);
        let d = p.rank(&request(1, &[1, 2]), &pool.endpoints, &pool.cx());
        assert_eq!(d.reason, Reason::Cold);
    }
}
