//! `rendezvous-bounded`: consistent hashing with bounded loads (Mirrokni,
//! Thorup and Zadimoghaddam) over rendezvous ranking: an endpoint may take a
//! request only while its in-flight count stays within `slack` times the
//! mean. It counts requests, not work, and knows nothing of caches.

use super::*;

/// Configuration of [`RendezvousBounded`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// c in `cap = ceil(c × (in-flight requests + 1) / N)`. Default: 1.25,
    /// the usual choice for bounded-load consistent hashing (at most 25 %
    /// over the mean).
    pub slack: f64,
}

impl Default for Config {
    fn default() -> Self {
        Config { slack: 1.25 }
    }
}

/// Rendezvous ranking, skipping endpoints at their cap.
#[derive(Clone, Debug)]
pub struct RendezvousBounded {
    config: Config,
    scores: Vec<u64>,
}

impl RendezvousBounded {
    /// A policy with `config`.
    pub fn new(config: Config) -> Self {
        RendezvousBounded {
            config,
            scores: Vec::new(),
        }
    }
}

impl Policy for RendezvousBounded {
    fn name(&self) -> &'static str {
        "rendezvous-bounded"
    }

    fn rank(&mut self, request: &Request<'_>, endpoints: &[Endpoint], _: &Context<'_>) -> Decision {
        let n = endpoints.len();
        scores(request.key, endpoints, &mut self.scores);
        let total: u64 = endpoints.iter().map(|e| u64::from(e.load.in_flight)).sum();
        let cap = (self.config.slack * (total + 1) as f64 / n.max(1) as f64).ceil();
        let over = |i: usize| f64::from(endpoints[i].load.in_flight) + 1.0 > cap;
        let mut ranked: Vec<usize> = (0..n).collect();
        ranked.sort_unstable_by_key(|&i| (std::cmp::Reverse(self.scores[i]), endpoints[i].id));
        let first = ranked.first().copied();
        // Stable: within and over the cap, rendezvous order is kept.
        ranked.sort_by_key(|&i| over(i));
        let reason = if ranked.first() == first.as_ref() {
            Reason::Cold
        } else {
            Reason::Spill
        };
        Decision {
            ranked,
            reason,
            cached_blocks: 0,
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
    fn skips_endpoints_at_the_cap_in_rendezvous_order() {
        let key = 3;
        let pool = Pool::test().replicas(4);
        let ids: Vec<u64> = pool.endpoints.iter().map(|e| e.id).collect();
        let order = crate::rendezvous::rank(key, &ids);
        let mut p = RendezvousBounded::new(Config::default());

        let d = p.rank(&request(key, &[]), &pool.endpoints, &pool.cx());
        assert_eq!((d.ranked.clone(), d.reason), (order.clone(), Reason::Cold));

        // 8 in flight on the first choice: cap = ceil(1.25 × 9 / 4) = 3.
        let busy = Pool::test().replicas(4).in_flight(order[0], 8);
        let d = p.rank(&request(key, &[]), &busy.endpoints, &busy.cx());
        assert_eq!(d.ranked, vec![order[1], order[2], order[3], order[0]]);
        assert_eq!(d.reason, Reason::Spill);

        // One in flight everywhere: cap = ceil(1.25 × 5 / 4) = 2, it stays.
        let pool = Pool::test()
            .replicas(4)
            .in_flight(order[0], 1)
            .in_flight(order[1], 1)
            .in_flight(order[2], 1)
            .in_flight(order[3], 1);
        let d = p.rank(&request(key, &[]), &pool.endpoints, &pool.cx());
        assert_eq!(d.ranked[0], order[0]);
    }
}
