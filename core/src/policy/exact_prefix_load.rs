//! `exact-prefix-load`: the cost model of Dynamo's KV router and llm-d's
//! scorers. Each endpoint's cost is the prefill it would have to do for this
//! request (prompt tokens minus its reported cached prefix) weighted by
//! `prefill_weight`, plus the work already queued on it; the cheapest wins.
//! Without an occupancy index (approximate mode) it is least-work routing.

use super::*;
use crate::load::WorkModel;

/// Configuration of [`ExactPrefixLoad`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct Config {
    /// Weight of the request's own uncached prefill against queued work.
    /// Default: 1.0 (Dynamo's `overlap_score_weight`): cost is then the
    /// estimated time to first token, in tokens.
    pub prefill_weight: f64,
    /// How queued requests become work. Default: [`WorkModel::default`].
    pub work: WorkModel,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            prefill_weight: 1.0,
            work: WorkModel::default(),
        }
    }
}

/// Lowest estimated cost first.
#[derive(Clone, Debug)]
pub struct ExactPrefixLoad {
    config: Config,
    by_slot: Vec<u32>,
    cached: Vec<u32>,
    scores: Vec<u64>,
}

impl ExactPrefixLoad {
    /// A policy with `config`.
    pub fn new(config: Config) -> Self {
        ExactPrefixLoad {
            config,
            by_slot: Vec::new(),
            cached: Vec::new(),
            scores: Vec::new(),
        }
    }
}

impl Policy for ExactPrefixLoad {
    fn name(&self) -> &'static str {
        "exact-prefix-load"
    }

    fn rank(
        &mut self,
        request: &Request<'_>,
        endpoints: &[Endpoint],
        cx: &Context<'_>,
    ) -> Decision {
        match cx.index {
            Some(index) => index.longest_prefix(request.chain, &mut self.by_slot),
            None => self.by_slot.clear(),
        }
        per_candidate(&self.by_slot, endpoints, &mut self.cached);
        scores(request.key, endpoints, &mut self.scores);
        let cost = |i: usize| {
            let uncached = uncached_tokens(request, self.cached[i], cx.block_tokens);
            self.config.prefill_weight * self.config.work.cost(uncached) as f64
                + self.config.work.work(&endpoints[i].load) as f64
        };
        let mut ranked: Vec<usize> = (0..endpoints.len()).collect();
        ranked.sort_by(|&a, &b| {
            cost(a)
                .total_cmp(&cost(b))
                .then(self.scores[b].cmp(&self.scores[a]))
        });
        let best_cached = self.cached.iter().copied().max().unwrap_or(0);
        let cached_blocks = ranked.first().map_or(0, |&i| self.cached[i]);
        let reason = if best_cached == 0 {
            Reason::Cold
        } else if cached_blocks == best_cached {
            Reason::Warm
        } else {
            Reason::Spill
        };
        Decision {
            ranked,
            reason,
            cached_blocks,
        }
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
    fn trades_cached_prefix_against_queued_work() {
        let chain: Vec<u64> = (1..=64).collect(); // 64 blocks, 1029 tokens
        let mut p = ExactPrefixLoad::new(Config::default());

        // Endpoint 2 holds 48 blocks (768 tokens) and is idle: it wins.
        let pool = Pool::test().replicas(3).holds(2, &chain[..48]);
        let d = p.rank(&request(1, &chain), &pool.endpoints, &pool.cx());
        assert_eq!(
            (d.ranked[0], d.reason, d.cached_blocks),
            (2, Reason::Warm, 48)
        );

        // With 1000 tokens queued there, recomputing 768 tokens elsewhere is
        // cheaper: cost 2 = 261 + 200 + 1000 + 200 > cost 0 = 1029 + 200.
        let pool = Pool::test()
            .replicas(3)
            .holds(2, &chain[..48])
            .prefill(2, 1000);
        let d = p.rank(&request(1, &chain), &pool.endpoints, &pool.cx());
        assert_ne!(d.ranked[0], 2);
        assert_eq!(d.reason, Reason::Spill);
        assert_eq!(*d.ranked.last().unwrap(), 2);
    }

    #[test]
    fn without_an_index_it_is_least_work_with_rendezvous_ties() {
        let pool = Pool::test().replicas(4).prefill(1, 10);
        let mut p = ExactPrefixLoad::new(Config::default());
        let cx = Context {
            index: None,
            block_tokens: 16,
        };
        for key in 0..20 {
            let d = p.rank(&request(key, &[1, 2]), &pool.endpoints, &cx);
            assert_eq!(d.reason, Reason::Cold);
            assert_eq!(*d.ranked.last().unwrap(), 1);
            let idle = Pool::test().replicas(4);
            let d = p.rank(&request(key, &[1, 2]), &idle.endpoints, &cx);
            assert_eq!(d.ranked[0], idle.rendezvous_first(key));
        }
    }
}
