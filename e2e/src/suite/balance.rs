//! How evenly a fleet's pods share the requests: the one owner of
//! `pod_requests_max_over_mean` and `idle_pods`, used by the suite's
//! report and by `kvroute-e2e compare`.
//!
//! Both divide by the number of pods in the fleet, not by the pods that
//! served: a pod no request reached is the worst imbalance, not an
//! absent one.
//!
//! Not here: where the counts come from (the routers' response header in
//! the suite, each engine's own `/metrics` in `compare`).

use super::load::{Outcome, Sample};
use super::report::{self, Scenario};

/// A pod is idle below this fraction of the mean pod's requests.
pub const IDLE_BELOW: f64 = 0.25;

/// Requests per pod, summed up.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Balance {
    /// The busiest pod's requests over the mean per pod (1 when even; 0
    /// when no pod served any).
    pub max_over_mean: f64,
    /// Pods with under [`IDLE_BELOW`] of the mean pod's requests.
    pub idle_pods: usize,
}

impl Balance {
    /// The balance of `counts`, one per pod of the fleet (zeros included).
    pub fn of(counts: &[u64]) -> Balance {
        let total: u64 = counts.iter().sum();
        if total == 0 {
            return Balance {
                max_over_mean: 0.0,
                idle_pods: 0,
            };
        }
        let mean = total as f64 / counts.len() as f64;
        let max = counts.iter().copied().max().unwrap_or(0);
        Balance {
            max_over_mean: max as f64 / mean,
            idle_pods: counts
                .iter()
                .filter(|&&c| (c as f64) < IDLE_BELOW * mean)
                .count(),
        }
    }
}

/// Records, under `prefix`, the balance of `samples` over `pods` (the
/// fleet's pod names; a sample's pod is the one its router named) as
/// `pod_requests_max_over_mean` and `idle_pods`, and each pod's TTFT p99
/// as `ttft_p99_ms_<pod>` (0 for a pod that served none).
pub fn figures(s: &mut Scenario, prefix: &str, samples: &[Sample], pods: &[String]) {
    let counts: Vec<u64> = pods
        .iter()
        .map(|pod| served_by(samples, pod).count() as u64)
        .collect();
    let balance = Balance::of(&counts);
    s.figure(
        &format!("{prefix}pod_requests_max_over_mean"),
        balance.max_over_mean,
    );
    s.figure(&format!("{prefix}idle_pods"), balance.idle_pods as f64);
    for pod in pods {
        let mut ttfts: Vec<f64> = served_by(samples, pod)
            .filter(|x| x.outcome == Outcome::Ok)
            .filter_map(|x| x.ttft)
            .collect();
        s.figure(
            &format!("{prefix}ttft_p99_ms_{pod}"),
            report::quantile(&mut ttfts, 0.99) * 1e3,
        );
    }
}

fn served_by<'a>(samples: &'a [Sample], pod: &'a str) -> impl Iterator<Item = &'a Sample> {
    samples
        .iter()
        .filter(move |x| x.endpoint.as_deref() == Some(pod))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn balance_divides_by_every_pod_not_the_ones_that_served() {
        assert_eq!(
            Balance::of(&[10, 10, 10, 10]),
            Balance {
                max_over_mean: 1.0,
                idle_pods: 0
            }
        );
        // Two of four served: the mean is 5, not 10.
        assert_eq!(
            Balance::of(&[10, 10, 0, 0]),
            Balance {
                max_over_mean: 2.0,
                idle_pods: 2
            }
        );
        // Idle is under a quarter of the mean (mean 10: under 2.5).
        let b = Balance::of(&[2, 3, 15, 20]);
        assert_eq!(b.idle_pods, 1);
        assert_eq!(b.max_over_mean, 2.0);
        assert_eq!(Balance::of(&[0, 0]).max_over_mean, 0.0);
        assert_eq!(Balance::of(&[]).idle_pods, 0);
    }

    #[test]
    fn figures_count_each_pod_of_the_fleet() {
        let sample = |pod: &str, ttft: f64| Sample {
            t: 0.0,
            endpoint: Some(pod.to_owned()),
            id: None,
            outcome: Outcome::Ok,
            prompt_tokens: 100,
            cached_tokens: 0,
            ttft: Some(ttft),
            itl: Vec::new(),
        };
        let samples = [
            sample("pod-0", 0.010),
            sample("pod-0", 0.030),
            sample("pod-1", 0.020),
            sample("pod-1", 0.020),
        ];
        let pods: Vec<String> = (0..4).map(|k| format!("pod-{k}")).collect();
        let mut s = Scenario::new("t");
        figures(&mut s, "rr_", &samples, &pods);
        assert_eq!(s.figures["rr_pod_requests_max_over_mean"], 2.0);
        assert_eq!(s.figures["rr_idle_pods"], 2.0);
        assert_eq!(s.figures["rr_ttft_p99_ms_pod-0"], 30.0);
        assert_eq!(s.figures["rr_ttft_p99_ms_pod-3"], 0.0);
    }
}
