//! `rendezvous`: highest-random-weight hashing of the routing key, ignoring
//! load. Perfect affinity, and hot spots when keys are skewed.

use super::*;

/// Rendezvous ranking of the key.
#[derive(Clone, Debug, Default)]
pub struct Rendezvous {
    scores: Vec<u64>,
}

impl Policy for Rendezvous {
    fn name(&self) -> &'static str {
        "rendezvous"
    }

    fn rank(&mut self, request: &Request<'_>, endpoints: &[Endpoint], _: &Context<'_>) -> Decision {
        scores(request.key, endpoints, &mut self.scores);
        let mut ranked: Vec<usize> = (0..endpoints.len()).collect();
        ranked.sort_unstable_by_key(|&i| (std::cmp::Reverse(self.scores[i]), endpoints[i].id));
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
    fn follows_the_rendezvous_ranking_whatever_the_load() {
        let pool = Pool::test().replicas(5);
        let mut p = Rendezvous::default();
        for key in 0..50 {
            let first = pool.rendezvous_first(key);
            let busy = Pool::test().replicas(5).in_flight(first, 100);
            let d = p.rank(&request(key, &[]), &busy.endpoints, &busy.cx());
            assert_eq!(d.ranked[0], first);
            let ids: Vec<u64> = pool.endpoints.iter().map(|e| e.id).collect();
            assert_eq!(d.ranked, crate::rendezvous::rank(key, &ids));
        }
    }
}
