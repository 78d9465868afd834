//! The pool's side of outlier detection: request outcomes and health
//! checks go into the [`Outlier`] state machine under the pool's lock,
//! readiness is published when routability changed, and the events come
//! back as [`HealthEvents`] for the caller to log and count (the pool has
//! no metrics of its own).
//!
//! Not here: the rules ([`super::outliers`]), or the checks themselves
//! ([`super::health_checks`]).

use super::outliers::{Event, Fault, Outlier};
use super::{Pool, now};

/// What a step of outlier detection changed: ejections, refused
/// ejections and restorations, in order. The pool neither logs nor counts
/// them; its caller does, once each.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[must_use = "the caller logs and counts the health events"]
pub struct HealthEvents(Vec<Event>);

impl HealthEvents {
    /// Whether one of them is an ejection.
    pub fn ejected(&self) -> bool {
        self.0.iter().any(|e| matches!(e, Event::Ejected { .. }))
    }

    /// Whether nothing changed.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The events, in order.
    pub fn iter(&self) -> std::slice::Iter<'_, Event> {
        self.0.iter()
    }
}

impl IntoIterator for HealthEvents {
    type Item = Event;
    type IntoIter = std::vec::IntoIter<Event>;

    fn into_iter(self) -> Self::IntoIter {
        self.0.into_iter()
    }
}

impl Pool {
    /// The endpoint answered well.
    pub fn succeeded(&self, name: &str) -> HealthEvents {
        self.health(|o, now| o.success(name, now))
    }

    /// The endpoint failed by its own fault (see [`super::outliers`]).
    pub fn failed(&self, name: &str, fault: Fault) -> HealthEvents {
        self.health(|o, now| o.failure(name, fault, now))
    }

    /// An active health check of `name` passed or failed.
    pub fn checked(&self, name: &str, passed: bool) -> HealthEvents {
        self.health(|o, now| o.check(name, passed, now))
    }

    /// Ends the ejections whose time has passed.
    pub fn tick(&self) -> HealthEvents {
        self.health(Outlier::tick)
    }

    /// Runs one step of the health state machine and publishes readiness;
    /// returns its events for the caller to log and count.
    fn health(
        &self,
        step: impl FnOnce(&mut Outlier, std::time::Instant) -> Vec<Event>,
    ) -> HealthEvents {
        let mut inner = self.lock();
        let events = step(&mut inner.outlier, now());
        // Routability changes only with an event (an ejection whose time
        // passed is ended, with an event, by the step's tick).
        if !events.is_empty() {
            self.publish_ready(&inner);
        }
        HealthEvents(events)
    }
}
