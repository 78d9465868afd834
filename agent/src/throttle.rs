//! Log lines about what a peer controls, at most one per kind and rank per
//! [`INTERVAL`]: a peer that sends a million bad messages gets a million
//! counts in the metrics and a few lines in the log, each saying how many
//! like it were left out before it.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The least time between two lines of one kind.
pub const INTERVAL: Duration = Duration::from_secs(10);

/// A rank and a kind of line (a fixed set named by the callers).
type Key = (u32, &'static str);

/// When each kind of line was last logged, and how many were left out
/// since.
#[derive(Debug, Default)]
pub struct Throttle {
    last: Mutex<HashMap<Key, (Instant, u64)>>,
}

impl Throttle {
    /// Whether a line of `kind` for `rank` may be logged now; if so, how
    /// many were left out since the last one.
    pub fn allow(&self, rank: u32, kind: &'static str) -> Option<u64> {
        let now = Instant::now();
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        match last.get_mut(&(rank, kind)) {
            Some((at, left_out)) if now.duration_since(*at) < INTERVAL => {
                *left_out += 1;
                None
            }
            Some((at, left_out)) => {
                *at = now;
                Some(std::mem::take(left_out))
            }
            None => {
                last.insert((rank, kind), (now, 0));
                Some(0)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_kind_and_rank_per_interval() {
        let t = Throttle::default();
        assert_eq!(t.allow(0, "a"), Some(0));
        assert_eq!(t.allow(0, "a"), None);
        assert_eq!(t.allow(0, "a"), None);
        assert_eq!(t.allow(0, "b"), Some(0), "another kind");
        assert_eq!(t.allow(1, "a"), Some(0), "another rank");
        let mut last = t.last.lock().unwrap();
        last.get_mut(&(0, "a")).unwrap().0 -= INTERVAL;
        drop(last);
        assert_eq!(t.allow(0, "a"), Some(2), "two left out");
    }
}
