//! Startup readiness: a router that starts (or restarts) says it is ready
//! only once its index holds a snapshot from every engine it should
//! follow, so a Service never sends it traffic it would route cold. The
//! rules, in order:
//!
//! 1. The wait begins when the router first knows a non-empty endpoint
//!    set ([`Startup::start`]); before, nothing is judged (and no endpoint
//!    is routable anyway).
//! 2. The engines waited for are the endpoints that are ready, not
//!    draining and report their cache (a WatchCache port). An endpoint
//!    without one, and every endpoint in approximate mode (no index),
//!    needs no snapshot.
//! 3. Ready once each of them has delivered its first snapshot (its
//!    stream went live once, whatever its contract says).
//! 4. Or once `wait` has passed since rule 1 (`resilience.snapshotWaitMs`;
//!    0 waits for nothing): then ready with the engines still missing named
//!    in one [`GaveUp`], for the caller to log and count, once.
//! 5. Ready for good: a stream lost later, or an endpoint added later,
//!    does not make it unready. Those are the index's business (a lost
//!    engine's entries are dropped, a new one routes cold until its
//!    snapshot), as on any router that has been running for a while.
//!
//! No clock and no I/O: `now` is passed in, the one event is returned.
//!
//! Not here: which endpoints exist and what their streams did (the pool
//! passes them in as [`Engine`]s), `/readyz` itself (the admin port).

use std::fmt;
use std::time::{Duration, Instant};

/// One endpoint as startup readiness sees it.
#[derive(Clone, Copy, Debug)]
pub struct Engine<'a> {
    /// Its name.
    pub name: &'a str,
    /// Waited for (rule 2).
    pub wanted: bool,
    /// Has delivered its first snapshot (rule 3).
    pub delivered: bool,
}

/// Why a starting router is not ready yet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Waiting {
    /// No endpoint set yet (rule 1).
    ForEndpoints,
    /// For the first snapshots of `missing`, among `of` engines waited for.
    ForSnapshots {
        /// The engines whose snapshot has not arrived, by name.
        missing: Vec<String>,
        /// How many engines are waited for.
        of: usize,
    },
}

impl fmt::Display for Waiting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Waiting::ForEndpoints => f.write_str("waiting for the endpoint set"),
            Waiting::ForSnapshots { missing, of } => {
                write!(
                    f,
                    "waiting for cache snapshots from {} of {of} engines: ",
                    missing.len()
                )?;
                names(f, missing)
            }
        }
    }
}

/// The wait ran out with engines still missing (rule 4).
#[derive(Clone, Debug, PartialEq, Eq)]
#[must_use = "the caller logs and counts it"]
pub struct GaveUp {
    /// The engines whose snapshot had not arrived, by name.
    pub missing: Vec<String>,
    /// How long the router waited.
    pub waited: Duration,
}

impl fmt::Display for GaveUp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        names(f, &self.missing)
    }
}

/// At most this many names are written out; the rest are counted.
const NAMED: usize = 5;

fn names(f: &mut fmt::Formatter<'_>, names: &[String]) -> fmt::Result {
    f.write_str(&names[..names.len().min(NAMED)].join(", "))?;
    if names.len() > NAMED {
        write!(f, " and {} more", names.len() - NAMED)?;
    }
    Ok(())
}

/// The state machine. See the module docs.
#[derive(Debug)]
pub struct Startup {
    wait: Duration,
    since: Option<Instant>,
    ready: bool,
}

impl Startup {
    /// Not started; ready at the latest `wait` after [`start`](Self::start).
    pub fn new(wait: Duration) -> Self {
        Startup {
            wait,
            since: None,
            ready: false,
        }
    }

    /// The router knows a non-empty endpoint set at `now`; the first call
    /// starts the wait (rule 1).
    pub fn start(&mut self, now: Instant) {
        self.since.get_or_insert(now);
    }

    /// Whether the router is ready as of `now`, given every endpoint's
    /// state; the [`GaveUp`] the moment the wait runs out (rule 4).
    pub fn check<'a>(
        &mut self,
        now: Instant,
        engines: impl IntoIterator<Item = Engine<'a>>,
    ) -> (Result<(), Waiting>, Option<GaveUp>) {
        if self.ready {
            return (Ok(()), None);
        }
        let Some(since) = self.since else {
            return (Err(Waiting::ForEndpoints), None);
        };
        let mut of = 0;
        let mut missing = Vec::new();
        for e in engines.into_iter().filter(|e| e.wanted) {
            of += 1;
            if !e.delivered {
                missing.push(e.name.to_owned());
            }
        }
        if missing.is_empty() {
            self.ready = true;
            return (Ok(()), None);
        }
        let waited = now.saturating_duration_since(since);
        if waited >= self.wait {
            self.ready = true;
            return (Ok(()), Some(GaveUp { missing, waited }));
        }
        (Err(Waiting::ForSnapshots { missing, of }), None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const WAIT: Duration = Duration::from_secs(15);

    fn engine(name: &str, wanted: bool, delivered: bool) -> Engine<'_> {
        Engine {
            name,
            wanted,
            delivered,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn ready_once_every_wanted_engine_delivered_its_snapshot() {
        let t0 = tokio::time::Instant::now().into_std();
        let mut s = Startup::new(WAIT);
        // Rule 1: nothing known yet.
        assert_eq!(s.check(t0, []), (Err(Waiting::ForEndpoints), None));
        s.start(t0);
        let (verdict, event) = s.check(
            t0,
            [
                engine("a", true, true),
                engine("b", true, false),
                // Rule 2: no cache port, or unready: not waited for.
                engine("c", false, false),
            ],
        );
        let waiting = verdict.unwrap_err();
        assert_eq!(
            waiting,
            Waiting::ForSnapshots {
                missing: vec!["b".into()],
                of: 2
            }
        );
        assert_eq!(
            waiting.to_string(),
            "waiting for cache snapshots from 1 of 2 engines: b"
        );
        assert_eq!(event, None);
        tokio::time::advance(Duration::from_secs(3)).await;
        let now = tokio::time::Instant::now().into_std();
        // Rule 3.
        let all = [engine("a", true, true), engine("b", true, true)];
        assert_eq!(s.check(now, all), (Ok(()), None));
        // Rule 5: a stream lost or an endpoint added later changes nothing.
        let later = [engine("a", true, false), engine("d", true, false)];
        assert_eq!(s.check(now, later), (Ok(()), None));
    }

    #[tokio::test(start_paused = true)]
    async fn the_wait_is_bounded_and_reported_once() {
        let t0 = tokio::time::Instant::now().into_std();
        let mut s = Startup::new(WAIT);
        s.start(t0);
        tokio::time::advance(Duration::from_secs(10)).await;
        // A later endpoint set does not restart the wait.
        s.start(tokio::time::Instant::now().into_std());
        let missing = || [engine("a", true, false), engine("b", true, false)];
        tokio::time::advance(Duration::from_millis(4999)).await;
        let now = tokio::time::Instant::now().into_std();
        assert!(s.check(now, missing()).0.is_err());
        tokio::time::advance(Duration::from_millis(1)).await;
        let now = tokio::time::Instant::now().into_std();
        let (verdict, event) = s.check(now, missing());
        assert_eq!(verdict, Ok(()));
        let event = event.expect("the wait ran out");
        assert_eq!(event.missing, vec!["a", "b"]);
        assert_eq!(event.waited, WAIT);
        assert_eq!(s.check(now, missing()), (Ok(()), None), "once");
    }

    #[test]
    fn nothing_to_wait_for_is_ready_at_once() {
        let t0 = Instant::now();
        // Approximate mode, or no engine with a cache port.
        let mut s = Startup::new(WAIT);
        s.start(t0);
        assert_eq!(s.check(t0, [engine("a", false, false)]), (Ok(()), None));
        // A zero wait gives up at once, naming what is missing.
        let mut s = Startup::new(Duration::ZERO);
        s.start(t0);
        let (verdict, event) = s.check(t0, [engine("a", true, false)]);
        assert_eq!(verdict, Ok(()));
        assert_eq!(event.unwrap().missing, vec!["a"]);
    }

    #[test]
    fn many_missing_engines_are_named_up_to_five() {
        let missing: Vec<String> = (0..7).map(|i| format!("pod-{i}")).collect();
        let w = Waiting::ForSnapshots { missing, of: 8 };
        assert_eq!(
            w.to_string(),
            "waiting for cache snapshots from 7 of 8 engines: pod-0, pod-1, pod-2, pod-3, pod-4 and 2 more"
        );
    }
}
