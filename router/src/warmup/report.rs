//! Reports of the warm-ups this router sent, for the CacheRoutingPolicy's
//! `status.warmup`: when a prefix's period ends, what it sent (results
//! `sent` and `repaired`) goes to the operator replica that writes status,
//! whose address the operator's pool state names (`status_writer`), with
//! the TLS settings of the WatchPool connection.
//!
//! Best effort, never in the warm-ups' way: each report is sent by its own
//! task with a timeout and not retried (the next period reports again);
//! failures are counted (`kvroute_warmup_reports_total{result="failed"}`)
//! and logged at most once a minute.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvroute_proto::v1::endpoint_discovery_client::EndpointDiscoveryClient;
use kvroute_proto::v1::{WarmupReport, WarmupSent};
use kvroute_telemetry::throttle::Throttle;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};

/// How long a report may take.
const TIMEOUT: Duration = Duration::from_secs(5);
/// Failures are logged at most this often.
const LOG_EVERY: Duration = Duration::from_secs(60);

/// Where reports go: set by the operator source from each pool state.
#[derive(Clone, Debug)]
pub struct Target {
    /// The status writer's URL (`http(s)://host:port`).
    pub url: String,
    /// The WatchPool connection's TLS (the same for every URL).
    pub tls: Option<ClientTlsConfig>,
    /// The pool reported on.
    pub namespace: String,
    pub pool: String,
}

/// `{result}` of `kvroute_warmup_reports_total`: `ok` or `failed`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ReportResult {
    result: &'static str,
}

pub(crate) type Results = Family<ReportResult, Counter>;

/// Sends reports to the current [`Target`], over one channel per URL.
pub(super) struct Reporter {
    channel: Option<(String, EndpointDiscoveryClient<Channel>)>,
    failures: Arc<Mutex<Throttle<()>>>,
}

impl Reporter {
    pub(super) fn new() -> Self {
        Reporter {
            channel: None,
            failures: Arc::new(Mutex::new(Throttle::new(LOG_EVERY))),
        }
    }

    /// Sends `sent` (from `router`) to `target` in the background.
    pub(super) fn send(
        &mut self,
        target: Target,
        router: &str,
        sent: Vec<WarmupSent>,
        results: &Results,
    ) {
        if self
            .channel
            .as_ref()
            .is_none_or(|(url, _)| *url != target.url)
        {
            let endpoint =
                Endpoint::from_shared(target.url.clone()).and_then(|e| match &target.tls {
                    Some(tls) => e.tls_config(tls.clone()),
                    None => Ok(e),
                });
            match endpoint {
                Ok(e) => {
                    let client = EndpointDiscoveryClient::new(
                        e.connect_timeout(TIMEOUT).timeout(TIMEOUT).connect_lazy(),
                    );
                    self.channel = Some((target.url.clone(), client));
                }
                Err(error) => {
                    self.channel = None;
                    failed(results, &self.failures, &target.url, &error);
                    return;
                }
            }
        }
        let Some((_, client)) = &self.channel else {
            return;
        };
        let mut client = client.clone();
        let report = WarmupReport {
            namespace: target.namespace,
            pool: target.pool,
            router: router.to_owned(),
            sent,
        };
        let (results, failures) = (results.clone(), self.failures.clone());
        tokio::spawn(async move {
            match client.report_warmups(report).await {
                Ok(_) => {
                    results.get_or_create(&ReportResult { result: "ok" }).inc();
                }
                Err(error) => failed(&results, &failures, &target.url, &error),
            }
        });
    }
}

/// Counts a failed report and logs it, at most once a minute.
fn failed(
    results: &Results,
    failures: &Mutex<Throttle<()>>,
    url: &str,
    error: &dyn std::fmt::Display,
) {
    let now = std::time::Instant::now();
    let admitted = (failures.lock().unwrap_or_else(|e| e.into_inner())).admit((), now);
    if let Some(times) = admitted {
        tracing::warn!(url, %error, times, "reporting warm-ups to the operator failed");
    }
    results
        .get_or_create(&ReportResult { result: "failed" })
        .inc();
}
