//! `min-ttft`: lowest predicted time to first token. For each endpoint the
//! prediction is the prefill queued there plus this request's own prefill
//! (overhead and uncached tokens), by [`PrefillModel`] at the pool's one
//! rate ([`PrefillModel::pool_rate`]); the lowest wins, ties by fewest requests in flight,
//! then by rendezvous rank. It is the reference rule the replay's figures
//! are checked against, and the `kvroute` policy with no latency slack.

use super::*;
use crate::load::{PrefillModel, demand_blocks};

/// Configuration of [`MinTtft`].
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct Config {
    /// How prefill time is predicted. Default: [`PrefillModel::default`].
    pub engine: PrefillModel,
}

/// Lowest predicted time to first token first.
#[derive(Clone, Debug)]
pub struct MinTtft {
    config: Config,
    by_slot: Vec<u32>,
    cached: Vec<u32>,
    scores: Vec<u64>,
    predicted: Vec<Predicted>,
}

impl MinTtft {
    /// A policy with `config`.
    pub fn new(config: Config) -> Self {
        MinTtft {
            config,
            by_slot: Vec::new(),
            cached: Vec::new(),
            scores: Vec::new(),
            predicted: Vec::new(),
        }
    }
}

/// What [`PrefillModel`] predicts for a request at one endpoint, seconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Predicted {
    /// The wait before its own prefill: queued prefill, or KV memory.
    pub queued: f64,
    /// Time to first token: the longer of the queue and the wait for KV
    /// memory, then its own prefill.
    pub ttft: f64,
}

/// Predictions for `request` at each of `endpoints` (with `cached` leading
/// blocks each), all at the pool's prefill `rate` (tokens per second, see
/// [`PrefillModel::pool_rate`]), into `out`. The wait for memory is for
/// every block the request takes from the free pool ([`demand_blocks`]):
/// its cached blocks too, unless a request in flight there holds them
/// ([`Context::pinned`]).
pub(super) fn predict_ttft(
    model: &PrefillModel,
    rate: f64,
    request: &Request<'_>,
    endpoints: &[Endpoint],
    cached: &[u32],
    cx: &Context<'_>,
    out: &mut Vec<Predicted>,
) {
    out.clear();
    out.extend(endpoints.iter().zip(cached).map(|(e, &c)| {
        let uncached = uncached_tokens(request, c, cx.block_tokens);
        let pinned = cx.pinned.map_or(0, |p| p.leading(e.slot, request.chain));
        let (blocks, _) = demand_blocks(
            request.prompt_tokens,
            pinned,
            request.output_tokens,
            cx.block_tokens,
        );
        let queued = model.queued_s_at(&e.load, cx.now, rate);
        let memory = model.memory_wait_s(&e.load, blocks, cx.now);
        let wait = queued.max(memory);
        Predicted {
            queued: wait,
            ttft: wait + model.prefill_s_at(uncached, rate),
        }
    }));
}

impl Policy for MinTtft {
    fn name(&self) -> &'static str {
        "min-ttft"
    }

    fn rank(
        &mut self,
        request: &Request<'_>,
        endpoints: &[Endpoint],
        cx: &Context<'_>,
    ) -> Decision {
        indexed_prefixes(request, endpoints, cx, &mut self.by_slot, &mut self.cached);
        scores(request.key, endpoints, &mut self.scores);
        let rate = self
            .config
            .engine
            .pool_rate(endpoints.iter().map(|e| &e.load));
        predict_ttft(
            &self.config.engine,
            rate,
            request,
            endpoints,
            &self.cached,
            cx,
            &mut self.predicted,
        );
        let (predicted, scores) = (&self.predicted, &self.scores);
        let mut ranked: Vec<usize> = (0..endpoints.len()).collect();
        ranked.sort_by(|&a, &b| {
            predicted[a]
                .ttft
                .total_cmp(&predicted[b].ttft)
                .then(
                    endpoints[a]
                        .load
                        .in_flight
                        .cmp(&endpoints[b].load.in_flight),
                )
                .then(scores[b].cmp(&scores[a]))
        });
        Decision::by_cost(ranked, &self.cached)
    }

    fn predicted(&self, candidate: usize) -> Option<Predicted> {
        self.predicted.get(candidate).copied()
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
    fn the_reference_rule_worked_by_hand() {
        // 64 blocks of 16 tokens plus 5: 1,029 tokens. Endpoint 0 holds 48
        // blocks and has 5,000 tokens queued in one request: 0.52 + 0.02 +
        // 261 / 10,000 = 0.5661 s. Endpoint 1 is idle and cold: 0.02 +
        // 0.1029 = 0.1229 s. Endpoint 2 holds 16 blocks and has 500 queued:
        // 0.07 + 0.02 + 0.0773 = 0.1673 s.
        let chain: Vec<u64> = (1..=64).collect();
        let pool = Pool::test()
            .replicas(3)
            .holds(0, &chain[..48])
            .prefill(0, 5000)
            .holds(2, &chain[..16])
            .prefill(2, 500);
        let mut p = MinTtft::new(Config::default());
        let d = p.rank(&request(1, &chain), &pool.endpoints, &pool.cx());
        assert_eq!(d.ranked, vec![1, 2, 0]);
        assert_eq!((d.reason, d.cached_blocks), (Reason::Spill, 0));

        // With the queue gone, the longest prefix is also the fastest.
        let pool = Pool::test().replicas(3).holds(0, &chain[..48]);
        let d = p.rank(&request(1, &chain), &pool.endpoints, &pool.cx());
        assert_eq!(
            (d.ranked[0], d.reason, d.cached_blocks),
            (0, Reason::Warm, 48)
        );
    }

    #[test]
    fn ties_go_to_the_fewest_in_flight_then_rendezvous() {
        let mut p = MinTtft::new(Config::default());
        // Equal predictions (no prefill queued), endpoint 2 has fewer
        // requests in flight (all decoding).
        let mut pool = Pool::test().replicas(3);
        for (i, n) in [(0, 3), (1, 2), (2, 1)] {
            pool.endpoints[i].load.in_flight = n;
            pool.endpoints[i].load.decoding = n;
        }
        let d = p.rank(&request(7, &[1, 2]), &pool.endpoints, &pool.cx());
        assert_eq!(d.ranked, vec![2, 1, 0]);
        let idle = Pool::test().replicas(5);
        for key in 0..20 {
            let d = p.rank(&request(key, &[1, 2]), &idle.endpoints, &idle.cx());
            assert_eq!(d.ranked[0], idle.rendezvous_first(key));
            assert_permutation(&d, 5);
        }
        assert!(p.rank(&request(1, &[]), &[], &idle.cx()).ranked.is_empty());
    }
}
