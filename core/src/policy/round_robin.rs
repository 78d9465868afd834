//! `round-robin`: each endpoint in turn, ignoring keys, caches and load.

use super::*;

/// Round robin over the candidates in the order given.
#[derive(Clone, Debug, Default)]
pub struct RoundRobin {
    next: usize,
}

impl Policy for RoundRobin {
    fn name(&self) -> &'static str {
        "round-robin"
    }

    fn rank(&mut self, _: &Request<'_>, endpoints: &[Endpoint], _: &Context<'_>) -> Decision {
        let n = endpoints.len();
        if n == 0 {
            return Decision::cold(Vec::new());
        }
        let start = self.next % n;
        self.next = self.next.wrapping_add(1);
        Decision::cold((0..n).map(|i| (start + i) % n).collect())
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
    fn takes_each_endpoint_in_turn() {
        let pool = Pool::test().replicas(3);
        let mut p = RoundRobin::default();
        let firsts: Vec<usize> = (0..6)
            .map(|_| p.rank(&request(1, &[]), &pool.endpoints, &pool.cx()).ranked[0])
            .collect();
        assert_eq!(firsts, vec![0, 1, 2, 0, 1, 2]);
        let d = p.rank(&request(1, &[]), &pool.endpoints, &pool.cx());
        assert_eq!(d.ranked, vec![0, 1, 2]);
        assert_eq!(d.reason, Reason::Cold);
    }
}
