//! The health task: every interval it ends the ejections whose time has
//! passed (so each restoration is logged when it happens) and, when
//! `resilience.healthCheck` is set, sends `GET path` to every endpoint at
//! once and reports each result to the pool's state machine
//! ([`super::outliers`]), which decides what a result means; the events
//! that come back go to `report` (the router logs and counts them).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use crate::config::HealthCheck;
use crate::pool::{HealthEvents, Pool};

/// How often ejections are expired when there are no health checks.
const TICK: Duration = Duration::from_secs(1);

/// Runs until aborted.
pub async fn run(pool: Arc<Pool>, check: Option<HealthCheck>, report: impl Fn(HealthEvents)) {
    let mut connector = HttpConnector::new();
    let timeout = Duration::from_millis(check.as_ref().map_or(1000, |c| c.timeout_ms));
    connector.set_connect_timeout(Some(timeout));
    // A fresh connection per check would cost a handshake; keep-alive
    // reuses one per endpoint.
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build(connector);
    let every = check
        .as_ref()
        .map_or(TICK, |c| Duration::from_millis(c.interval_ms));
    let mut interval = tokio::time::interval(every);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        interval.tick().await;
        report(pool.tick());
        let Some(check) = &check else {
            continue;
        };
        let probes = pool.members().into_iter().map(|(name, addr)| {
            let client = client.clone();
            async move {
                let uri = format!("http://{addr}{}", check.path);
                let passed = probe(&client, &uri, timeout).await;
                (name, passed)
            }
        });
        for (name, passed) in futures_util::future::join_all(probes).await {
            report(pool.checked(&name, passed));
        }
    }
}

/// One check: a 2xx within `timeout`.
async fn probe(client: &Client<HttpConnector, Full<Bytes>>, uri: &str, timeout: Duration) -> bool {
    let Ok(request) = hyper::Request::get(uri).body(Full::new(Bytes::new())) else {
        return false;
    };
    match tokio::time::timeout(timeout, client.request(request)).await {
        Ok(Ok(response)) => response.status().is_success(),
        _ => false,
    }
}
