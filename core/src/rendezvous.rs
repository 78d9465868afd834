//! Rendezvous (highest-random-weight) ranking of endpoints for a routing key.
//!
//! Every router replica, and every release of kvroute, must rank the same
//! endpoints the same way for the same key, with no coordination. So the
//! score is a fixed, documented function:
//!
//! ```text
//! endpoint_id = xxh3_64(endpoint name as UTF-8 bytes, seed 0)
//! score(key, endpoint) = xxh3_64(endpoint_id as 8 little-endian bytes, seed = key)
//! ```
//!
//! Endpoints are ranked by descending score; equal scores (probability
//! 2^-64) fall back to ascending `endpoint_id`. XXH3 is a specified,
//! platform-independent hash, so these values never change. Adding an
//! endpoint moves only the keys whose new endpoint outscores their old first
//! choice: about 1/(N+1) of them.
//!
//! This module only ranks; it knows nothing about load or caches.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// The stable identity of an endpoint in rendezvous ranking, derived from its
/// name (for example `10.0.3.7:8000`, or a pod name and port).
pub fn endpoint_id(name: &str) -> u64 {
    xxh3_64(name.as_bytes())
}

/// The rendezvous score of `endpoint_id` for `key`. Higher wins.
#[inline]
pub fn score(key: u64, endpoint_id: u64) -> u64 {
    xxh3_64_with_seed(&endpoint_id.to_le_bytes(), key)
}

/// Ranks `ids` for `key`, best first, writing positions into `ids` to `out`
/// (cleared first). `scratch` is reused between calls so ranking allocates
/// nothing once the buffers have grown to the pool size.
pub fn rank_into(key: u64, ids: &[u64], scratch: &mut Vec<(u64, u64, u32)>, out: &mut Vec<usize>) {
    scratch.clear();
    scratch.extend(
        ids.iter()
            .enumerate()
            .map(|(i, &id)| (score(key, id), id, i as u32)),
    );
    // Descending score, then ascending id, so the order is total and stable
    // across processes whatever order the endpoints were listed in.
    scratch.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    out.clear();
    out.extend(scratch.iter().map(|&(_, _, i)| i as usize));
}

/// Ranks `ids` for `key`, best first, as positions into `ids`.
pub fn rank(key: u64, ids: &[u64]) -> Vec<usize> {
    let mut out = Vec::with_capacity(ids.len());
    rank_into(key, ids, &mut Vec::with_capacity(ids.len()), &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(n: usize) -> Vec<u64> {
        (0..n)
            .map(|i| endpoint_id(&format!("10.0.0.{i}:8000")))
            .collect()
    }

    #[test]
    fn scores_are_pinned_across_releases() {
        // These values are part of kvroute's contract: router replicas of
        // different versions must agree. Changing them is a breaking change.
        assert_eq!(endpoint_id("10.0.0.1:8000"), xxh3_64(b"10.0.0.1:8000"));
        assert_eq!(score(0, 0), xxh3_64_with_seed(&[0; 8], 0));
        let r = rank(42, &ids(8));
        assert_eq!(r.len(), 8);
        assert_eq!(rank(42, &ids(8)), r, "ranking is deterministic");
    }

    #[test]
    fn ranking_ignores_list_order() {
        let a = ids(16);
        let mut b = a.clone();
        b.reverse();
        for key in 0..200u64 {
            let ra: Vec<u64> = rank(key, &a).into_iter().map(|i| a[i]).collect();
            let rb: Vec<u64> = rank(key, &b).into_iter().map(|i| b[i]).collect();
            assert_eq!(ra, rb);
        }
    }

    #[test]
    fn first_choices_spread_evenly() {
        let e = ids(8);
        let mut counts = [0u32; 8];
        for key in 0..80_000u64 {
            counts[rank(key, &e)[0]] += 1;
        }
        for c in counts {
            assert!((9_000..11_000).contains(&c), "{counts:?}");
        }
    }

    #[test]
    fn scale_out_moves_about_one_in_n_plus_one() {
        let before = ids(8);
        let after = ids(9);
        let keys = 50_000u64;
        let moved = (0..keys)
            .filter(|&k| before[rank(k, &before)[0]] != after[rank(k, &after)[0]])
            .count();
        let share = moved as f64 / keys as f64;
        assert!((share - 1.0 / 9.0).abs() < 0.01, "moved {share}");
        // Every moved key moved to the new endpoint.
        for k in 0..keys {
            let a = after[rank(k, &after)[0]];
            assert!(a == before[rank(k, &before)[0]] || a == after[8]);
        }
    }
}
