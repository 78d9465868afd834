//! `least-loaded`: the endpoint with the fewest requests in flight.

use super::*;

/// Fewest in-flight requests first, then least outstanding prefill; ties
/// rotate so an idle pool is not served by its first endpoint alone.
#[derive(Clone, Debug, Default)]
pub struct LeastLoaded {
    rotation: usize,
}

impl Policy for LeastLoaded {
    fn name(&self) -> &'static str {
        "least-loaded"
    }

    fn rank(&mut self, _: &Request<'_>, endpoints: &[Endpoint], _: &Context<'_>) -> Decision {
        let n = endpoints.len();
        let start = if n == 0 { 0 } else { self.rotation % n };
        self.rotation = self.rotation.wrapping_add(1);
        let mut ranked: Vec<usize> = (0..n).collect();
        ranked.sort_by_key(|&i| {
            let load = &endpoints[i].load;
            (
                load.in_flight,
                load.prefill_tokens,
                (i + n - start) % n.max(1),
            )
        });
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
    fn picks_fewest_in_flight_then_least_prefill() {
        let pool = Pool::test()
            .replicas(4)
            .in_flight(0, 3)
            .in_flight(1, 1)
            .prefill(2, 500)
            .in_flight(3, 1);
        let mut p = LeastLoaded::default();
        let d = p.rank(&request(1, &[]), &pool.endpoints, &pool.cx());
        // 1 and 3 have one request and no prefill; 2 has one with prefill.
        assert!(d.ranked[0] == 1 || d.ranked[0] == 3);
        assert_eq!(d.ranked[2], 2);
        assert_eq!(d.ranked[3], 0);
    }

    #[test]
    fn ties_rotate() {
        let pool = Pool::test().replicas(3);
        let mut p = LeastLoaded::default();
        let firsts: Vec<usize> = (0..3)
            .map(|_| p.rank(&request(1, &[]), &pool.endpoints, &pool.cx()).ranked[0])
            .collect();
        assert_eq!(firsts, vec![0, 1, 2]);
    }
}
