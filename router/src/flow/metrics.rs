//! Flow control's metrics. `priority` comes from configured objectives (or
//! 0), so the series are bounded by the configuration.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Wait buckets, seconds.
const BUCKETS: [f64; 12] = [
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 30.0,
];

/// `{priority}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Priority {
    /// The request's priority.
    pub priority: i32,
}

/// `{priority, reason}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PriorityReason {
    /// The request's priority.
    pub priority: i32,
    /// `flow_queue_full`, `flow_wait_limit` or `flow_sheddable`.
    pub reason: &'static str,
}

/// `{reason}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Reason {
    /// `immediate`, `after_wait` or `spilled`.
    pub reason: &'static str,
}

/// Flow control's families.
#[derive(Debug)]
pub struct FlowMetrics {
    /// `kvroute_flow_queued{priority}`.
    pub queued: Family<Priority, Gauge>,
    /// `kvroute_flow_wait_seconds{priority}`.
    pub wait_seconds: Family<Priority, Histogram>,
    /// `kvroute_flow_shed_total{priority,reason}`.
    pub shed: Family<PriorityReason, Counter>,
    /// `kvroute_flow_dispatched_total{reason}`.
    pub dispatched: Family<Reason, Counter>,
}

impl Default for FlowMetrics {
    fn default() -> Self {
        FlowMetrics {
            queued: Family::default(),
            wait_seconds: Family::new_with_constructor(|| Histogram::new(BUCKETS)),
            shed: Family::default(),
            dispatched: Family::default(),
        }
    }
}

impl FlowMetrics {
    /// Registers the families in `r`.
    pub fn register(&self, r: &mut Registry) {
        r.register(
            "kvroute_flow_queued",
            "Requests held at the router until an endpoint can start them (flowControl), by priority",
            self.queued.clone(),
        );
        r.register(
            "kvroute_flow_wait_seconds",
            "How long requests that were held waited at the router before they were sent, by priority",
            self.wait_seconds.clone(),
        );
        r.register(
            "kvroute_flow_shed",
            "Requests answered 429 by flow control, by priority and reason: flow_queue_full (flowControl.maxQueued or maxQueuedBytes), flow_wait_limit (maxWaitMs), flow_sheddable (negative priority with no endpoint to start it); answered 503 at shutdown: shutdown",
            self.shed.clone(),
        );
        r.register(
            "kvroute_flow_dispatched",
            "Requests sent to an endpoint by flow control, by reason: immediate (an endpoint could start it on arrival), after_wait (held first), spilled (held, then sent past a first choice that could not start it, once waiting for it cost what it saves)",
            self.dispatched.clone(),
        );
    }
}
