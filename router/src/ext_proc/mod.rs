//! kvroute as a Gateway API InferencePool's endpoint picker: Envoy's
//! `envoy.service.ext_proc.v3.ExternalProcessor`, as the Gateway API
//! Inference Extension's gateways (Istio, kgateway, Envoy Gateway, GKE)
//! call it. The gateway keeps the client connection, TLS, auth and rate
//! limits; for each request it streams headers and body here and routes to
//! the endpoints this picker names. [`exchange`] holds the per-request
//! rules; [`envoy`] the message shapes.
//!
//! The gateway's filter must send request and response headers
//! (`SEND`), the request body `FULL_DUPLEX_STREAMED` with request trailers
//! `SEND`, and should forward the `envoy.lb.subset_hint` and `envoy.lb`
//! metadata namespaces and accept `envoy.lb` back. Also served: gRPC health
//! (`grpc.health.v1`) for `liveness`, `readiness` and the ext_proc service.
//!
//! Whoever reaches the port can say which endpoint served and with what
//! status: only a trusted picker (`extProc.trustedNetwork`, or gateways
//! authenticated by certificate) has those statuses feed ejection.
//!
//! The listener has the limits of [`crate::listener`] (a connection cap,
//! an idle timeout, HTTP/2 stream limits); a stream must send its first
//! message within `extProc.firstMessageTimeoutMs`, and a message may be as
//! large as `limits.maxBodyBytes` (a larger or malformed one ends the
//! stream with the gRPC error that says so).
//! Not here: the decision ([`crate::request`], which the HTTP forwarder
//! shares).

pub mod envoy;
mod exchange;

use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::server::NamedService;
use tonic::{Request, Response, Status, Streaming};
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

use crate::config::{ExtProc, Limits};
use crate::listener::{self, ConnLimits};
use crate::metrics::Metrics;
use crate::request::Service;

/// Answers queued per exchange before the picker waits for the gateway to
/// read them (a large body goes back in many chunks).
const ANSWERS_QUEUED: usize = 16;

/// Room in a message beside its body chunk: headers and metadata.
const MESSAGE_OVERHEAD: usize = 256 << 10;

/// The `ExternalProcessor` service: one exchange per request stream.
#[derive(Clone, Debug)]
pub struct Picker {
    service: Arc<Service>,
    rules: exchange::Rules,
}

impl Picker {
    /// A picker deciding with `service`'s pool, policy, tenancy and limits,
    /// as `config` says.
    pub fn new(service: Arc<Service>, config: &ExtProc) -> Self {
        let rules = exchange::Rules {
            first_message: Duration::from_millis(config.first_message_timeout_ms),
            trusted: config.trusted(),
        };
        Picker { service, rules }
    }
}

#[tonic::async_trait]
impl ExternalProcessor for Picker {
    type ProcessStream = ReceiverStream<Result<ProcessingResponse, Status>>;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let (out, answers) = mpsc::channel(ANSWERS_QUEUED);
        let inbound = request.into_inner();
        tokio::spawn(exchange::run(
            self.service.clone(),
            inbound,
            out,
            self.rules,
        ));
        Ok(Response::new(ReceiverStream::new(answers)))
    }
}

/// The picker's TLS settings from `tls`'s PEM files, checked as the API
/// listener's are (an unreadable or invalid file is an error naming it).
pub fn tls(
    tls: &crate::config::Tls,
) -> Result<Arc<rustls::ServerConfig>, kvroute_proto::tls::TlsError> {
    kvroute_proto::tls::https_server(&tls.cert_file, &tls.key_file, tls.client_ca_file.as_deref())
}

/// Serves the picker and its health on `listener` within `conn` (its
/// connection cap, TLS and timeouts; see [`crate::listener`]) until
/// `stopped` turns true, then lets the open exchanges finish.
pub async fn serve(
    listener: TcpListener,
    conn: ConnLimits,
    picker: &ExtProc,
    service: Arc<Service>,
    limits: &Limits,
    stopped: watch::Receiver<bool>,
    metrics: Arc<Metrics>,
) {
    let (reporter, health) = tonic_health::server::health_reporter();
    let readiness = tokio::spawn(report_health(service.clone(), reporter));
    let processor = ExternalProcessorServer::new(Picker::new(service, picker))
        .max_decoding_message_size(limits.max_body_bytes.saturating_add(MESSAGE_OVERHEAD));
    let app = tonic::service::Routes::new(health)
        .add_service(processor)
        .into_axum_router();
    listener::serve(listener, app, conn, stopped, metrics, "picker").await;
    readiness.abort();
}

/// Keeps the gRPC health services current: `liveness` always serving;
/// `readiness`, the ext_proc service and the server as a whole serving
/// while the router is ready (see [`Service::readiness`]).
async fn report_health(service: Arc<Service>, reporter: HealthReporter) {
    reporter
        .set_service_status("liveness", ServingStatus::Serving)
        .await;
    let mut ready = service.pool.ready();
    loop {
        let status = match service.readiness() {
            Ok(_) => ServingStatus::Serving,
            Err(_) => ServingStatus::NotServing,
        };
        for service in [
            "",
            "readiness",
            <ExternalProcessorServer<Picker> as NamedService>::NAME,
        ] {
            reporter.set_service_status(service, status).await;
        }
        // The endpoint count wakes it; the policy's tenancy demand is
        // re-read every second.
        let changed = tokio::time::timeout(Duration::from_secs(1), ready.changed()).await;
        if let Ok(Err(_)) = changed {
            // The pool is gone: poll.
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }
}
