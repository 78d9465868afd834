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
//! Not here: the HTTP proxy ([`crate::proxy`]), whose decision this shares.

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
use tonic::transport::{Certificate, Identity, ServerTlsConfig};
use tonic::{Request, Response, Status, Streaming};
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

use crate::config::Limits;
use crate::proxy::Proxy;

/// Answers queued per exchange before the picker waits for the gateway to
/// read them (a large body goes back in many chunks).
const ANSWERS_QUEUED: usize = 16;

/// The `ExternalProcessor` service: one exchange per request stream.
#[derive(Clone, Debug)]
pub struct Picker {
    proxy: Arc<Proxy>,
}

impl Picker {
    /// A picker deciding with `proxy`'s pool, policy, tenancy and limits.
    pub fn new(proxy: Arc<Proxy>) -> Self {
        Picker { proxy }
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
        tokio::spawn(exchange::run(self.proxy.clone(), request.into_inner(), out));
        Ok(Response::new(ReceiverStream::new(answers)))
    }
}

/// The picker's TLS settings from `tls`'s PEM files, checked as the API
/// listener's are (an unreadable or invalid file is an error naming it).
pub fn tls(tls: &crate::config::Tls) -> Result<ServerTlsConfig, kvroute_proto::tls::TlsError> {
    let ca = tls.client_ca_file.as_deref();
    kvroute_proto::tls::https_server(&tls.cert_file, &tls.key_file, ca)?;
    let read = |path: &std::path::Path| {
        std::fs::read(path)
            .map_err(|e| kvroute_proto::tls::TlsError::Invalid(format!("{}: {e}", path.display())))
    };
    let mut config = ServerTlsConfig::new().identity(Identity::from_pem(
        read(&tls.cert_file)?,
        read(&tls.key_file)?,
    ));
    if let Some(ca) = ca {
        config = config.client_ca_root(Certificate::from_pem(read(ca)?));
    }
    Ok(config)
}

/// Serves the picker and its health on `listener` (over `tls` when set)
/// until `stopped` turns true, then lets the open exchanges finish.
pub async fn serve(
    listener: TcpListener,
    tls: Option<ServerTlsConfig>,
    proxy: Arc<Proxy>,
    limits: &Limits,
    mut stopped: watch::Receiver<bool>,
) {
    let (reporter, health) = tonic_health::server::health_reporter();
    let readiness = tokio::spawn(report_health(proxy.clone(), reporter));
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = tls {
        builder = match builder.tls_config(tls) {
            Ok(b) => b,
            Err(e) => {
                readiness.abort();
                tracing::error!(error = %e, "the ext_proc listener's TLS settings failed");
                return;
            }
        };
    }
    let served = builder
        .max_concurrent_streams(limits.http2_max_concurrent_streams)
        .add_service(health)
        .add_service(ExternalProcessorServer::new(Picker::new(proxy)))
        .serve_with_incoming_shutdown(incoming, async move {
            let _ = stopped.wait_for(|s| *s).await;
        })
        .await;
    readiness.abort();
    if let Err(e) = served {
        tracing::error!(error = %e, "the ext_proc listener failed");
    }
}

/// Keeps the gRPC health services current: `liveness` always serving;
/// `readiness`, the ext_proc service and the server as a whole serving
/// while the router is ready (see [`Proxy::readiness`]).
async fn report_health(proxy: Arc<Proxy>, reporter: HealthReporter) {
    reporter
        .set_service_status("liveness", ServingStatus::Serving)
        .await;
    let mut ready = proxy.pool.ready();
    loop {
        let status = match proxy.readiness() {
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
