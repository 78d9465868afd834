//! `modulo`: `key mod N`, the naive hash that remaps most keys when N
//! changes. A baseline, to show why kvroute uses rendezvous hashing.

use super::*;

/// `key mod N` over the candidates in the order given; the retry order
/// continues around the list.
#[derive(Clone, Copy, Debug, Default)]
pub struct Modulo;

impl Policy for Modulo {
    fn name(&self) -> &'static str {
        "modulo"
    }

    fn rank(&mut self, request: &Request<'_>, endpoints: &[Endpoint], _: &Context<'_>) -> Decision {
        let n = endpoints.len();
        if n == 0 {
            return Decision::cold(Vec::new());
        }
        let start = (request.key.0 % n as u64) as usize;
        Decision::cold((0..n).map(|i| (start + i) % n).collect())
    }

    fn boxed_clone(&self) -> Box<dyn Policy> {
        Box::new(*self)
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::*;

    #[test]
    fn key_mod_n() {
        let pool = Pool::test().replicas(4);
        let d = Modulo.rank(&request(10, &[]), &pool.endpoints, &pool.cx());
        assert_eq!(d.ranked, vec![2, 3, 0, 1]);
    }
}
