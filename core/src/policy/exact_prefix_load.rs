//! `exact-prefix-load`: the cost function of Dynamo's KV router, `cost =
//! overlap_score_weight × prefill + decode`, in tokens rather than blocks
//! (the same order). Prefill is the uncached prompt tokens queued at the
//! endpoint plus this request's own (prompt minus its reported cached
//! prefix); decode is the KV the endpoint's active requests hold (their
//! prompt tokens). The cheapest wins. llm-d's default scorers weigh the same
//! two things, cached prefix against queue. Dynamo also adds the new
//! request's own blocks to decode; they are the same everywhere, so they
//! are left out. Without an occupancy index (approximate mode) every prefix
//! counts as cold and this is least-work routing.

use super::*;

/// Configuration of [`ExactPrefixLoad`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct Config {
    /// Weight of prefill against decode. Default: 1.0 (Dynamo's
    /// `overlap_score_weight`).
    pub prefill_weight: f64,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            prefill_weight: 1.0,
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
        indexed_prefixes(request, endpoints, cx, &mut self.by_slot, &mut self.cached);
        scores(request.key, endpoints, &mut self.scores);
        let cost = |i: usize| {
            let load = &endpoints[i].load;
            let uncached = uncached_tokens(request, self.cached[i], cx.block_tokens);
            let prefill = (load.prefill_tokens + uncached) as f64;
            self.config.prefill_weight * prefill + load.active_tokens as f64
        };
        let mut ranked: Vec<usize> = (0..endpoints.len()).collect();
        ranked.sort_by(|&a, &b| {
            cost(a)
                .total_cmp(&cost(b))
                .then(self.scores[b].cmp(&self.scores[a]))
        });
        Decision::by_cost(ranked, &self.cached)
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
        // cheaper: cost 2 = 1000 + 261 > cost 0 = 1029.
        let pool = Pool::test()
            .replicas(3)
            .holds(2, &chain[..48])
            .prefill(2, 1000);
        let d = p.rank(&request(1, &chain), &pool.endpoints, &pool.cx());
        assert_ne!(d.ranked[0], 2);
        assert_eq!(d.reason, Reason::Spill);
        assert_eq!(*d.ranked.last().unwrap(), 2);

        // Decode counts too: 800 tokens of active KV on the idle holder
        // outweigh the 768 tokens it saves.
        let mut pool = Pool::test().replicas(3).holds(2, &chain[..48]);
        pool.endpoints[2].load.active_tokens = 800;
        let d = p.rank(&request(1, &chain), &pool.endpoints, &pool.cx());
        assert_ne!(d.ranked[0], 2);
        pool.endpoints[2].load.active_tokens = 700;
        let d = p.rank(&request(1, &chain), &pool.endpoints, &pool.cx());
        assert_eq!(d.ranked[0], 2);
    }

    #[test]
    fn without_an_index_it_is_least_work_with_rendezvous_ties() {
        let pool = Pool::test().replicas(4).prefill(1, 10);
        let mut p = ExactPrefixLoad::new(Config::default());
        let cx = Context {
            index: None,
            block_tokens: 16,
            now: std::time::Instant::now(),
            pinned: None,
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
