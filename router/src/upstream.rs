//! The HTTP/1 client the router talks to engines with: requests forwarded
//! ([`crate::http`]) and the served models fetched ([`crate::models`]).

use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use crate::config::Limits;

/// A pooled client to the engines.
pub(crate) type Upstream = Client<HttpConnector, Full<Bytes>>;

/// An upstream client connecting within `limits.connectTimeoutMs`.
pub(crate) fn upstream(limits: &Limits) -> Upstream {
    let mut connector = HttpConnector::new();
    connector.set_connect_timeout(Some(Duration::from_millis(limits.connect_timeout_ms)));
    connector.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(60))
        .build(connector)
}
