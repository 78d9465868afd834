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
//! **Weighted** (an endpoint ramping up after it became ready, see
//! [`crate::slow_start`]): the standard weighted highest-random-weight
//! score, `w / -ln(u)` with `u` the score above mapped into (0, 1)
//! ([`weighted_score`]). An endpoint at weight `w` is first for a share
//! `w / Σw` of keys, and raising or lowering one endpoint's weight moves
//! keys only to or from that endpoint. The order is a monotone function of
//! `score` for any one weight, so when every weight is equal it is exactly
//! the unweighted order; policies use the plain `score` when every weight
//! is 1, so pinned values above stay the contract. The weighted score uses
//! `ln_1p`, a floating-point function whose last bit may differ between
//! platforms: replicas on different platforms may differ on a key whose
//! two best weighted scores are within a rounding error, during a ramp
//! only.
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

/// The weighted rendezvous score of an endpoint with plain score `score`
/// ([`score`]) and weight `weight` (0 to 1): `weight / -ln(u)`, with
/// `u = 1 - (!score + 0.5) / 2^64` in (0, 1), computed from `1 - u` so that
/// the high scores, which decide, keep their precision. Higher wins; never
/// negative, so its IEEE bits order as the value does
/// ([`f64::to_bits`]). A weight of 0 scores 0 (last).
#[inline]
pub fn weighted_score(score: u64, weight: f64) -> f64 {
    let one_minus_u = ((!score) as f64 + 0.5) * (1.0 / 18_446_744_073_709_551_616.0);
    // -ln(u) > 0; +inf when u rounds to 0, giving a score of 0.
    let neg_ln_u = -(-one_minus_u).ln_1p();
    let w = if weight.is_nan() {
        0.0
    } else {
        weight.clamp(0.0, 1.0)
    };
    w / neg_ln_u
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

    /// Positions of `ids` for `key` by weighted score, best first.
    fn weighted_first(key: u64, ids: &[u64], weights: &[f64]) -> usize {
        (0..ids.len())
            .max_by(|&a, &b| {
                let s = |i: usize| weighted_score(score(key, ids[i]), weights[i]);
                s(a).total_cmp(&s(b))
            })
            .unwrap()
    }

    #[test]
    fn equal_weights_keep_the_plain_order() {
        let e = ids(8);
        for w in [1.0, 0.5, 0.01] {
            for key in 0..2_000u64 {
                let mut by_weight: Vec<usize> = (0..8).collect();
                by_weight.sort_by(|&a, &b| {
                    let s = |i: usize| weighted_score(score(key, e[i]), w);
                    s(b).total_cmp(&s(a))
                });
                assert_eq!(by_weight, rank(key, &e), "weight {w}, key {key}");
            }
        }
    }

    #[test]
    fn weighted_scores_order_by_their_bits() {
        let mut last = 0.0f64;
        for s in [0, 1, 1 << 20, u64::MAX / 2, u64::MAX - 1, u64::MAX] {
            let w = weighted_score(s, 1.0);
            assert!(
                w >= 0.0 && w >= last && w.to_bits() >= last.to_bits(),
                "{s}: {w}"
            );
            last = w;
        }
        assert_eq!(weighted_score(u64::MAX, 0.0), 0.0);
        assert_eq!(weighted_score(7, f64::NAN), 0.0);
    }

    #[test]
    fn a_weighted_endpoint_is_first_for_its_share() {
        // Four endpoints at 1 and one at w: it is first for w / (4 + w).
        let e = ids(5);
        let keys = 100_000u64;
        for w in [0.05, 0.25, 0.5, 1.0] {
            let weights = [1.0, 1.0, 1.0, 1.0, w];
            let firsts = (0..keys)
                .filter(|&k| weighted_first(k, &e, &weights) == 4)
                .count();
            let share = firsts as f64 / keys as f64;
            let expected = w / (4.0 + w);
            assert!(
                (share - expected).abs() < 0.006,
                "w {w}: {share} vs {expected}"
            );
        }
    }

    #[test]
    fn a_ramp_moves_keys_only_to_the_ramping_endpoint() {
        let e = ids(5);
        let mut before: Vec<usize> = (0..20_000u64)
            .map(|k| weighted_first(k, &e, &[1.0, 1.0, 1.0, 1.0, 0.01]))
            .collect();
        for w in [0.1, 0.3, 0.6, 1.0] {
            let weights = [1.0, 1.0, 1.0, 1.0, w];
            for (k, was) in before.iter_mut().enumerate() {
                let now = weighted_first(k as u64, &e, &weights);
                assert!(
                    now == *was || now == 4,
                    "key {k} moved {was} -> {now} at {w}"
                );
                *was = now;
            }
        }
        // At full weight, the plain ranking's first choices.
        for (k, first) in before.iter().enumerate() {
            assert_eq!(*first, rank(k as u64, &e)[0]);
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
