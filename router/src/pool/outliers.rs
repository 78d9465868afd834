//! Outlier ejection, after Envoy's outlier detection: a pure state machine
//! over the endpoints' names. It reads no clock (every call takes `now`)
//! and does no I/O; the pool calls it under its lock and hands the
//! [`Event`]s it returns to its caller, who logs and counts them.
//!
//! The rules:
//! 1. Only faults of the engine count ([`Fault`]): a refused or failed
//!    connection, a 5xx, no response within the first-byte timeout, a
//!    stream broken by the engine, a failed active health check. A client
//!    that disconnects, a 4xx and an upload the client broke are not the
//!    engine's fault and never reach this module.
//! 2. `ejectAfterFailures` passive faults in a row eject an endpoint for
//!    `ejectionBase × 2^(ejections − 1)`, capped at `ejectionMax`. A broken
//!    stream ejects at once, and so does a timeout: its deadline already
//!    allows for the slowness the router predicts ([`crate::request::hang`]), and a
//!    load-aware policy sends a hung engine so few requests (their load
//!    never drains) that waiting for several would take minutes. When the time passes it is routable again on
//!    probation: one fault ejects it again (for twice as long), one success
//!    ends the probation and resets the doubling.
//! 3. `healthCheck.unhealthyThreshold` failed active checks in a row eject
//!    an endpoint until a check passes. A passing check restores any
//!    ejected endpoint (as Envoy's `successful_active_health_check_uneject_host`)
//!    except a hung one (rule 5).
//! 4. At most `maxEjectedPercent` of the endpoints (rounded down) are
//!    ejected at once. An ejection beyond that is refused and counted: the
//!    endpoint keeps taking traffic, and its retries cover its failures. So
//!    a fleet that fails partially degrades partially, never to an outage;
//!    a single endpoint is never ejected at the default of 50 %.
//! 5. An endpoint ejected by a [`Fault::Timeout`] (no first byte within the
//!    hang deadline) is *hung*: its `/health` may well answer while it
//!    serves nothing, so a passing check does not restore it. When its
//!    time passes it is half-open: it takes one request at a time (the
//!    trial, claimed with [`Outlier::begin`], released unjudged with
//!    [`Outlier::abandon`] when the client leaves) until one succeeds,
//!    which restores it fully, or fails, which ejects it again (rule 2's
//!    probation, for twice as long).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// The settings, from `resilience`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// Passive faults in a row that eject.
    pub eject_after_failures: u32,
    /// The first ejection.
    pub base: Duration,
    /// The longest ejection.
    pub max: Duration,
    /// Largest share of endpoints ejected at once, percent.
    pub max_ejected_percent: u32,
    /// Failed active checks in a row that eject.
    pub unhealthy_threshold: u32,
}

/// A failure that is the engine's fault.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Connection refused, reset or closed before a response.
    Connect,
    /// A 5xx response.
    Status,
    /// No response headers within the first-byte timeout.
    Timeout,
    /// The response stream broke mid-way.
    Stream,
    /// An active health check failed.
    HealthCheck,
}

impl Fault {
    /// As a metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Fault::Connect => "connect",
            Fault::Status => "status",
            Fault::Timeout => "timeout",
            Fault::Stream => "stream",
            Fault::HealthCheck => "health_check",
        }
    }
}

/// Why an ejected endpoint was restored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Restore {
    /// Its ejection time passed (it is on probation).
    Expired,
    /// An active health check passed.
    HealthCheck,
    /// A hung endpoint's time passed: it takes one trial request at a time.
    HalfOpen,
    /// A half-open endpoint's trial request succeeded: it takes all traffic.
    Trial,
}

impl Restore {
    /// As a metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Restore::Expired => "expired",
            Restore::HealthCheck => "health_check",
            Restore::HalfOpen => "half_open",
            Restore::Trial => "trial",
        }
    }
}

/// A transition worth a log line and a counter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// The endpoint was ejected; `until: None` means until a check passes.
    Ejected {
        /// The endpoint.
        endpoint: String,
        /// The fault that tipped it.
        fault: Fault,
        /// How long, when timed.
        duration: Option<Duration>,
    },
    /// It would have been ejected, but the ejected share is at its limit.
    Refused {
        /// The endpoint.
        endpoint: String,
        /// The fault.
        fault: Fault,
    },
    /// An ejected endpoint takes traffic again.
    Restored {
        /// The endpoint.
        endpoint: String,
        /// Why.
        why: Restore,
    },
}

#[derive(Clone, Debug, Default)]
struct State {
    consecutive: u32,
    failed_checks: u32,
    ejections: u32,
    /// `Some(None)`: ejected until a check passes.
    ejected: Option<Option<Instant>>,
    probation: bool,
    /// Ejected for a hang, or half-open after one (rule 5).
    hung: bool,
    /// Half-open with its trial request in flight.
    trial: bool,
}

impl State {
    fn is_ejected(&self, now: Instant) -> bool {
        matches!(self.ejected, Some(until) if until.is_none_or(|t| t > now))
    }

    /// Whether a new request may go to it: not ejected, and when half-open
    /// (whether or not [`Outlier::tick`] has seen its time pass), only
    /// while no trial is in flight.
    fn admits(&self, now: Instant) -> bool {
        !(self.is_ejected(now) || (self.hung && self.trial))
    }
}

/// Every endpoint's health. See the module docs.
#[derive(Clone, Debug)]
pub struct Outlier {
    config: Config,
    states: BTreeMap<String, State>,
}

impl Outlier {
    /// No endpoints yet.
    pub fn new(config: Config) -> Self {
        Outlier {
            config,
            states: BTreeMap::new(),
        }
    }

    /// Makes the tracked set exactly `names`: new ones start healthy,
    /// missing ones are forgotten.
    pub fn set_endpoints<'a>(&mut self, names: impl IntoIterator<Item = &'a str>) {
        let mut states = BTreeMap::new();
        for name in names {
            let state = self.states.remove(name).unwrap_or_default();
            states.insert(name.to_owned(), state);
        }
        self.states = states;
    }

    /// Whether `name` is ejected at `now`.
    pub fn is_ejected(&self, name: &str, now: Instant) -> bool {
        self.states.get(name).is_some_and(|s| s.is_ejected(now))
    }

    /// Whether a new request may go to `name` at `now`: it is not ejected
    /// and, when half-open, its trial is not in flight (rule 5).
    pub fn admits(&self, name: &str, now: Instant) -> bool {
        self.states.get(name).is_none_or(|s| s.admits(now))
    }

    /// A request is sent to `name` at `now`; returns whether it is the
    /// half-open endpoint's trial, which the caller must end with
    /// [`success`](Self::success), [`failure`](Self::failure) or
    /// [`abandon`](Self::abandon).
    pub fn begin(&mut self, name: &str, now: Instant) -> bool {
        match self.states.get_mut(name) {
            Some(s) if s.hung && !s.trial && !s.is_ejected(now) => {
                s.trial = true;
                true
            }
            _ => false,
        }
    }

    /// The trial request to `name` ended unjudged (the client went away):
    /// the next request is the trial.
    pub fn abandon(&mut self, name: &str) {
        if let Some(s) = self.states.get_mut(name) {
            s.trial = false;
        }
    }

    /// How many endpoints are ejected at `now`.
    pub fn ejected(&self, now: Instant) -> usize {
        self.states.values().filter(|s| s.is_ejected(now)).count()
    }

    /// The most endpoints that may be ejected at once.
    pub fn max_ejected(&self) -> usize {
        self.states.len() * self.config.max_ejected_percent as usize / 100
    }

    /// Ends the ejections whose time has passed.
    pub fn tick(&mut self, now: Instant) -> Vec<Event> {
        let mut events = Vec::new();
        for (name, s) in &mut self.states {
            if let Some(Some(until)) = s.ejected
                && until <= now
            {
                s.ejected = None;
                s.probation = true;
                let why = if s.hung {
                    Restore::HalfOpen
                } else {
                    Restore::Expired
                };
                events.push(Event::Restored {
                    endpoint: name.clone(),
                    why,
                });
            }
        }
        events
    }

    /// A request to `name` failed by the engine's fault.
    pub fn failure(&mut self, name: &str, fault: Fault, now: Instant) -> Vec<Event> {
        let mut events = self.tick(now);
        let threshold = self.config.eject_after_failures;
        let Some(s) = self.states.get_mut(name) else {
            return events;
        };
        if s.is_ejected(now) {
            // Requests sent before the ejection are still failing.
            return events;
        }
        s.consecutive += 1;
        // A failed trial is judged; the next request is a trial again
        // unless this one ejects.
        s.trial = false;
        let due = s.probation
            || matches!(fault, Fault::Stream | Fault::Timeout)
            || s.consecutive >= threshold;
        if due {
            let ejections = s.ejections + 1;
            let factor = 1u32 << (ejections - 1).min(20);
            let duration = self.config.base.saturating_mul(factor).min(self.config.max);
            events.push(self.eject(name, fault, Some(now + duration), now));
        }
        events
    }

    /// A request to `name` succeeded.
    pub fn success(&mut self, name: &str, now: Instant) -> Vec<Event> {
        let mut events = self.tick(now);
        if let Some(s) = self.states.get_mut(name) {
            s.consecutive = 0;
            if s.probation && !s.is_ejected(now) {
                s.probation = false;
                s.ejections = 0;
            }
            if s.hung && !s.is_ejected(now) {
                s.hung = false;
                s.trial = false;
                events.push(Event::Restored {
                    endpoint: name.to_owned(),
                    why: Restore::Trial,
                });
            }
        }
        events
    }

    /// An active health check of `name` passed or failed.
    pub fn check(&mut self, name: &str, passed: bool, now: Instant) -> Vec<Event> {
        let mut events = self.tick(now);
        let threshold = self.config.unhealthy_threshold;
        let Some(s) = self.states.get_mut(name) else {
            return events;
        };
        if passed {
            s.failed_checks = 0;
            if s.is_ejected(now) && !s.hung {
                s.ejected = None;
                s.probation = true;
                events.push(Event::Restored {
                    endpoint: name.to_owned(),
                    why: Restore::HealthCheck,
                });
            }
            return events;
        }
        s.failed_checks += 1;
        if s.failed_checks >= threshold && !s.is_ejected(now) {
            events.push(self.eject(name, Fault::HealthCheck, None, now));
        }
        events
    }

    /// Ejects `name` until `until` (`None`: until a check passes), unless
    /// the ejected share is at its limit.
    fn eject(&mut self, name: &str, fault: Fault, until: Option<Instant>, now: Instant) -> Event {
        let room = self.ejected(now) < self.max_ejected();
        let s = self.states.get_mut(name).expect("checked by the caller");
        if !room {
            return Event::Refused {
                endpoint: name.to_owned(),
                fault,
            };
        }
        s.ejected = Some(until);
        s.ejections += 1;
        s.consecutive = 0;
        s.probation = false;
        s.hung = fault == Fault::Timeout;
        s.trial = false;
        Event::Ejected {
            endpoint: name.to_owned(),
            fault,
            duration: until.map(|t| t - now),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    fn outlier(n: usize) -> Outlier {
        let mut o = Outlier::new(Config {
            eject_after_failures: 2,
            base: 5 * S,
            max: 12 * S,
            max_ejected_percent: 50,
            unhealthy_threshold: 2,
        });
        let names: Vec<String> = (0..n).map(|i| format!("e{i}")).collect();
        o.set_endpoints(names.iter().map(String::as_str));
        o
    }

    fn ejected_for(events: &[Event]) -> Option<Duration> {
        events.iter().find_map(|e| match e {
            Event::Ejected { duration, .. } => Some(duration.unwrap_or(Duration::MAX)),
            _ => None,
        })
    }

    #[test]
    fn failures_in_a_row_eject_and_the_time_doubles_on_probation() {
        let t0 = Instant::now();
        let mut o = outlier(4);
        assert!(o.failure("e0", Fault::Status, t0).is_empty());
        o.success("e0", t0);
        assert!(
            o.failure("e0", Fault::Status, t0).is_empty(),
            "a success resets the count"
        );
        assert_eq!(
            ejected_for(&o.failure("e0", Fault::Connect, t0)),
            Some(5 * S)
        );
        assert!(o.is_ejected("e0", t0 + 4 * S));
        assert!(
            o.failure("e0", Fault::Status, t0 + S).is_empty(),
            "ejected: ignored"
        );
        let restored = o.tick(t0 + 5 * S);
        assert_eq!(
            restored,
            vec![Event::Restored {
                endpoint: "e0".into(),
                why: Restore::Expired
            }]
        );
        assert!(!o.is_ejected("e0", t0 + 5 * S));
        // On probation one fault ejects, for twice as long, then capped.
        assert_eq!(
            ejected_for(&o.failure("e0", Fault::Timeout, t0 + 6 * S)),
            Some(10 * S)
        );
        let t1 = t0 + 16 * S;
        assert_eq!(
            ejected_for(&o.failure("e0", Fault::Status, t1)),
            Some(12 * S)
        );
        // A success after probation resets the doubling.
        let t2 = t1 + 12 * S;
        o.tick(t2);
        o.success("e0", t2);
        o.failure("e0", Fault::Status, t2);
        assert_eq!(
            ejected_for(&o.failure("e0", Fault::Status, t2)),
            Some(5 * S)
        );
    }

    #[test]
    fn a_broken_stream_or_a_timeout_ejects_at_once() {
        let t0 = Instant::now();
        let mut o = outlier(4);
        assert_eq!(
            ejected_for(&o.failure("e1", Fault::Stream, t0)),
            Some(5 * S)
        );
        assert_eq!(
            ejected_for(&o.failure("e2", Fault::Timeout, t0)),
            Some(5 * S)
        );
    }

    #[test]
    fn no_more_than_the_maximum_share_is_ejected() {
        let t0 = Instant::now();
        let mut o = outlier(4);
        for name in ["e0", "e1", "e2", "e3"] {
            o.failure(name, Fault::Status, t0);
        }
        let mut ejected = 0;
        let mut refused = 0;
        for name in ["e0", "e1", "e2", "e3"] {
            match o.failure(name, Fault::Status, t0).as_slice() {
                [Event::Ejected { .. }] => ejected += 1,
                [Event::Refused { .. }] => refused += 1,
                other => panic!("{other:?}"),
            }
        }
        assert_eq!((ejected, refused), (2, 2));
        assert_eq!(o.ejected(t0), 2);
        // Once one is back, a refused one can be ejected.
        o.check("e0", true, t0 + S);
        assert_eq!(
            ejected_for(&o.failure("e2", Fault::Status, t0 + S)),
            Some(5 * S)
        );
    }

    #[test]
    fn a_single_endpoint_is_never_ejected_at_half() {
        let t0 = Instant::now();
        let mut o = outlier(1);
        for _ in 0..5 {
            o.failure("e0", Fault::Connect, t0);
        }
        assert!(!o.is_ejected("e0", t0));
        assert!(o.check("e0", false, t0).is_empty());
        assert!(matches!(
            o.check("e0", false, t0).as_slice(),
            [Event::Refused { .. }]
        ));
    }

    #[test]
    fn failed_checks_eject_until_a_check_passes() {
        let t0 = Instant::now();
        let mut o = outlier(2);
        assert!(o.check("e0", false, t0).is_empty());
        assert_eq!(ejected_for(&o.check("e0", false, t0)), Some(Duration::MAX));
        assert!(o.is_ejected("e0", t0 + 1000 * S), "no timed expiry");
        assert!(o.tick(t0 + 1000 * S).is_empty());
        assert_eq!(
            o.check("e0", true, t0 + 1000 * S),
            vec![Event::Restored {
                endpoint: "e0".into(),
                why: Restore::HealthCheck
            }]
        );
        assert!(!o.is_ejected("e0", t0 + 1000 * S));
    }

    #[test]
    fn a_passing_check_restores_a_passively_ejected_endpoint() {
        let t0 = Instant::now();
        let mut o = outlier(2);
        o.failure("e0", Fault::Status, t0);
        o.failure("e0", Fault::Status, t0);
        assert!(o.is_ejected("e0", t0));
        assert_eq!(o.check("e0", true, t0 + S).len(), 1);
        assert!(!o.is_ejected("e0", t0 + S));
    }

    #[test]
    fn a_hung_endpoint_is_readmitted_by_one_trial_request_not_by_checks() {
        let t0 = Instant::now();
        let mut o = outlier(4);
        assert_eq!(
            ejected_for(&o.failure("e0", Fault::Timeout, t0)),
            Some(5 * S)
        );
        assert!(
            o.check("e0", true, t0 + S).is_empty(),
            "a passing check does not restore a hung endpoint"
        );
        assert!(!o.admits("e0", t0 + S));
        // Its time passed: half-open, even before a tick says so.
        let t1 = t0 + 5 * S;
        assert!(o.admits("e0", t1));
        assert!(o.begin("e0", t1), "the first request is the trial");
        assert!(!o.admits("e0", t1), "one trial at a time");
        assert!(!o.begin("e0", t1));
        assert_eq!(
            o.tick(t1),
            vec![Event::Restored {
                endpoint: "e0".into(),
                why: Restore::HalfOpen
            }]
        );
        // The client left: the next request is the trial.
        o.abandon("e0");
        assert!(o.begin("e0", t1));
        // The trial failed: ejected again, for twice as long, still hung.
        assert_eq!(
            ejected_for(&o.failure("e0", Fault::Timeout, t1)),
            Some(10 * S)
        );
        assert!(o.check("e0", true, t1 + S).is_empty());
        let t2 = t1 + 10 * S;
        assert_eq!(o.tick(t2).len(), 1);
        assert!(o.begin("e0", t2));
        assert_eq!(
            o.success("e0", t2),
            vec![Event::Restored {
                endpoint: "e0".into(),
                why: Restore::Trial
            }]
        );
        assert!(o.admits("e0", t2));
        assert!(!o.begin("e0", t2), "restored: no more trials");
        assert!(o.admits("e0", t2), "takes all traffic");
    }

    #[test]
    fn a_refused_hung_ejection_leaves_the_endpoint_taking_traffic() {
        let t0 = Instant::now();
        let mut o = outlier(1);
        for _ in 0..4 {
            o.failure("e0", Fault::Timeout, t0);
        }
        assert!(o.admits("e0", t0));
        assert!(!o.begin("e0", t0), "not hung: no trial");
    }

    #[test]
    fn removed_endpoints_are_forgotten_and_unknown_ones_ignored() {
        let t0 = Instant::now();
        let mut o = outlier(2);
        o.failure("e0", Fault::Stream, t0);
        o.set_endpoints(["e1", "e2"]);
        assert_eq!(o.ejected(t0), 0);
        assert!(o.failure("nope", Fault::Stream, t0).is_empty());
        o.set_endpoints(["e0", "e1"]);
        assert!(
            !o.is_ejected("e0", t0),
            "a returning endpoint starts healthy"
        );
    }
}
