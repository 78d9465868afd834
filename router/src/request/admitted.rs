//! A request admitted at its headers ([`super::Service::admit`]): its
//! labels, tenant and body as it arrives, until it is decided, refused or
//! answered by the router itself.

use std::sync::Arc;

use axum::http::{HeaderMap, header};
use tokio::time::Instant;

use super::body::Received;
use super::{Labels, Service};
use crate::errors::ApiError;

impl Service {
    /// Admits a request to one of the router's own routes on the API port
    /// (not proxied, not counted as a request) whose body is at most
    /// `cap` bytes: the credentials in `headers` first, then the body
    /// within the same limits as a proxied one ([`super::body`]: the
    /// budgets, the read timeout and minimum rate) and `cap`. A declared
    /// length over `cap` is refused (413) before any byte is read.
    pub(crate) fn admit_control(
        self: &Arc<Self>,
        headers: &HeaderMap,
        cap: usize,
    ) -> Result<Admitted, ApiError> {
        let started = Instant::now();
        let mut labels = Labels::uncounted(&self.accounting);
        let tenant = self.identify(headers, &mut labels)?;
        let declared = headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse().ok());
        let received = Received::capped(&self.bodies, declared, tenant.as_deref(), cap)?;
        Ok(Admitted {
            labels,
            tenant,
            received,
            started,
        })
    }
}

/// A request admitted at its headers, its body arriving.
pub(crate) struct Admitted {
    pub(super) labels: Labels,
    pub(super) tenant: Option<String>,
    /// The body, within its limits.
    pub(crate) received: Received,
    /// When it was admitted.
    pub(super) started: Instant,
}

impl Admitted {
    /// Refuses it: counted with the error's status.
    pub(crate) fn refuse(mut self, error: ApiError) -> ApiError {
        self.labels.count(error.status().as_str());
        error
    }

    /// The tenant its credentials name.
    pub(crate) fn tenant(&self) -> Option<&str> {
        self.tenant.as_deref()
    }

    /// Counts it answered 200 by the router itself (a response cache
    /// hit), under `model`, a metric label.
    pub(crate) fn answered(mut self, model: &str) {
        model.clone_into(&mut self.labels.model);
        self.labels.count("200");
    }

    /// Reads `body` into it within its limits.
    pub(crate) async fn read(&mut self, mut body: axum::body::Body) -> Result<(), ApiError> {
        use http_body_util::BodyExt;
        loop {
            let (deadline, _) = self.received.deadline();
            let frame = match tokio::time::timeout_at(deadline, body.frame()).await {
                Ok(Some(frame)) => frame
                    .map_err(|e| ApiError::BadRequest(format!("reading the request body: {e}")))?,
                Ok(None) => return Ok(()),
                Err(_) => return Err(self.received.expired()),
            };
            if let Ok(data) = frame.into_data() {
                self.received.push(data)?;
            }
        }
    }
}
