//! The Redis store's circuit breaker: a pure state machine. It reads no
//! clock (every call takes `now`) and does no I/O; the store asks it before
//! each operation, tells it how the operation ended, and logs and counts
//! the [`Event`]s it returns.
//!
//! The rules:
//! 1. Closed: every operation goes through. [`Config::failures`] failed
//!    operations in a row open it; a success resets the count.
//! 2. Open: every operation is refused at once, for [`Config::open_for`]
//!    after it opened.
//! 3. Half-open, when that time has passed: the first operation is let
//!    through as the probe, and the others are refused while it runs. The
//!    probe succeeding closes the breaker; failing opens it again, for
//!    another [`Config::open_for`]. A probe abandoned without an outcome
//!    (its caller went away) lets the next operation probe.
//! 4. An outcome counts only in the state its operation was let through
//!    in ([`Ticket`]): a failure of an operation let through before the
//!    breaker opened neither extends the open period nor counts against
//!    the next closed period, and only the probe's outcome ends half-open.
//! 5. Each opening, from closed or from half-open, is one
//!    [`Event::Opened`]; each closing one [`Event::Closed`].
//!
//! Not here: what a failure is, or the operations themselves
//! ([`super::redis`]).

use std::time::{Duration, Instant};

/// The breaker's settings. `Default`: open after 5 failures in a row, for
/// 2 s.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config {
    /// Failed operations in a row that open the breaker (at least 1).
    pub failures: u32,
    /// How long it stays open before a probe is let through.
    pub open_for: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            failures: 5,
            open_for: Duration::from_secs(2),
        }
    }
}

/// Where the breaker is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    /// Operations go through; `failures` in a row so far.
    Closed {
        /// Consecutive failures.
        failures: u32,
    },
    /// Operations are refused until `until`.
    Open {
        /// When a probe may go through.
        until: Instant,
    },
    /// One probe at a time goes through.
    HalfOpen {
        /// Whether the probe is running.
        probing: bool,
    },
}

/// A change for the caller to log and count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use = "the caller logs and counts the breaker's events"]
pub enum Event {
    /// The breaker opened; operations are refused until `until`.
    Opened {
        /// When a probe may go through.
        until: Instant,
    },
    /// The probe succeeded: operations go through again.
    Closed,
}

/// An operation the breaker let through: hand it back with its outcome
/// ([`Breaker::finished`]) or, without one, to [`Breaker::abandoned`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use = "a ticket is handed back with its outcome or abandoned"]
pub struct Ticket {
    /// The state's generation it was issued in (rule 4).
    epoch: u64,
}

/// The operation was refused: the breaker is open, or half-open with its
/// probe running.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Refused;

/// The circuit breaker. See the module doc.
#[derive(Debug)]
pub struct Breaker {
    config: Config,
    state: State,
    /// Bumped at every change of state, and at every probe let through:
    /// a ticket of another epoch is stale (rule 4).
    epoch: u64,
}

impl Breaker {
    /// A closed breaker with `config`.
    pub fn new(config: Config) -> Self {
        Breaker {
            config,
            state: State::Closed { failures: 0 },
            epoch: 0,
        }
    }

    /// Where it is.
    #[cfg(test)]
    pub fn state(&self) -> State {
        self.state
    }

    /// Lets an operation through at `now`, or refuses it (rules 1 to 3).
    pub fn admit(&mut self, now: Instant) -> Result<Ticket, Refused> {
        match self.state {
            State::Closed { .. } => Ok(self.ticket()),
            State::Open { until } if now < until => Err(Refused),
            State::HalfOpen { probing: true } => Err(Refused),
            State::Open { .. } | State::HalfOpen { probing: false } => {
                self.go(State::HalfOpen { probing: true });
                Ok(self.ticket())
            }
        }
    }

    /// The operation of `ticket` ended at `now`, well when `ok`.
    #[must_use = "the caller logs and counts the breaker's events"]
    pub fn finished(&mut self, ticket: Ticket, ok: bool, now: Instant) -> Option<Event> {
        if ticket.epoch != self.epoch {
            return None;
        }
        match (self.state, ok) {
            (State::Closed { .. }, true) => {
                self.state = State::Closed { failures: 0 };
                None
            }
            (State::Closed { failures }, false) => {
                let failures = failures.saturating_add(1);
                if failures >= self.config.failures.max(1) {
                    Some(self.open(now))
                } else {
                    self.state = State::Closed { failures };
                    None
                }
            }
            (State::HalfOpen { .. }, true) => {
                self.go(State::Closed { failures: 0 });
                Some(Event::Closed)
            }
            (State::HalfOpen { .. }, false) => Some(self.open(now)),
            // No ticket is issued while open.
            (State::Open { .. }, _) => None,
        }
    }

    /// The operation of `ticket` ended without an outcome (rule 3).
    pub fn abandoned(&mut self, ticket: Ticket) {
        if ticket.epoch == self.epoch && self.state == (State::HalfOpen { probing: true }) {
            self.go(State::HalfOpen { probing: false });
        }
    }

    fn open(&mut self, now: Instant) -> Event {
        let until = now + self.config.open_for;
        self.go(State::Open { until });
        Event::Opened { until }
    }

    fn go(&mut self, state: State) {
        self.state = state;
        self.epoch += 1;
    }

    fn ticket(&self) -> Ticket {
        Ticket { epoch: self.epoch }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: Duration = Duration::from_secs(1);

    fn breaker() -> Breaker {
        Breaker::new(Config::default())
    }

    /// Fails `n` operations let through at `now`; the events.
    fn fail(b: &mut Breaker, n: u32, now: Instant) -> Vec<Event> {
        (0..n)
            .filter_map(|_| {
                let t = b.admit(now).expect("let through");
                b.finished(t, false, now)
            })
            .collect()
    }

    #[test]
    fn opens_after_five_failures_in_a_row() {
        let now = Instant::now();
        let mut b = breaker();
        assert!(fail(&mut b, 4, now).is_empty());
        assert_eq!(b.state(), State::Closed { failures: 4 });
        assert_eq!(
            fail(&mut b, 1, now),
            [Event::Opened {
                until: now + 2 * SEC
            }]
        );
        assert_eq!(b.admit(now + SEC), Err(Refused));
    }

    #[test]
    fn a_success_resets_the_count() {
        let now = Instant::now();
        let mut b = breaker();
        assert!(fail(&mut b, 4, now).is_empty());
        let t = b.admit(now).unwrap();
        assert_eq!(b.finished(t, true, now), None);
        assert!(fail(&mut b, 4, now).is_empty());
        assert_eq!(b.state(), State::Closed { failures: 4 });
    }

    #[test]
    fn half_open_lets_one_probe_through_and_its_success_closes() {
        let now = Instant::now();
        let mut b = breaker();
        let _ = fail(&mut b, 5, now);
        let later = now + 2 * SEC;
        let probe = b.admit(later).expect("the probe");
        assert_eq!(b.admit(later), Err(Refused), "one probe at a time");
        assert_eq!(b.finished(probe, true, later), Some(Event::Closed));
        assert_eq!(b.state(), State::Closed { failures: 0 });
        assert!(b.admit(later).is_ok());
    }

    #[test]
    fn a_failed_probe_opens_it_again_for_another_period() {
        let now = Instant::now();
        let mut b = breaker();
        let _ = fail(&mut b, 5, now);
        let later = now + 3 * SEC;
        let probe = b.admit(later).unwrap();
        assert_eq!(
            b.finished(probe, false, later),
            Some(Event::Opened {
                until: later + 2 * SEC
            })
        );
        assert_eq!(b.admit(later + SEC), Err(Refused));
        assert!(b.admit(later + 2 * SEC).is_ok());
    }

    #[test]
    fn an_abandoned_probe_lets_the_next_operation_probe() {
        let now = Instant::now();
        let mut b = breaker();
        let _ = fail(&mut b, 5, now);
        let later = now + 2 * SEC;
        let probe = b.admit(later).unwrap();
        b.abandoned(probe);
        let next = b.admit(later).expect("a new probe");
        // The abandoned probe's outcome, should it come, is stale.
        assert_eq!(b.finished(probe, true, later), None);
        assert_eq!(b.finished(next, true, later), Some(Event::Closed));
    }

    #[test]
    fn outcomes_of_operations_let_through_before_a_change_are_stale() {
        let now = Instant::now();
        let mut b = breaker();
        let early: Vec<Ticket> = (0..3).map(|_| b.admit(now).unwrap()).collect();
        let _ = fail(&mut b, 5, now);
        // Late failures neither extend the open period nor reopen.
        for &t in &early {
            assert_eq!(b.finished(t, false, now + SEC), None);
        }
        assert_eq!(
            b.state(),
            State::Open {
                until: now + 2 * SEC
            }
        );
        let later = now + 2 * SEC;
        let probe = b.admit(later).unwrap();
        // A late success does not end half-open: only the probe does.
        let stale = b.finished(early[0], true, later);
        assert_eq!(stale, None);
        assert_eq!(b.state(), State::HalfOpen { probing: true });
        assert_eq!(b.finished(probe, true, later), Some(Event::Closed));
        // Nor do late failures count against the new closed period.
        assert_eq!(b.finished(early[1], false, later), None);
        assert_eq!(b.state(), State::Closed { failures: 0 });
    }

    #[test]
    fn abandoning_a_closed_operation_changes_nothing() {
        let now = Instant::now();
        let mut b = breaker();
        let _ = fail(&mut b, 2, now);
        let t = b.admit(now).unwrap();
        b.abandoned(t);
        assert_eq!(b.state(), State::Closed { failures: 2 });
    }
}
