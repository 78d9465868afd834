//! A request admitted at its headers ([`super::Service::admit`]): its
//! labels, tenant and body as it arrives, until it is decided, refused or
//! answered by the router itself.

use tokio::time::Instant;

use super::Labels;
use super::body::Received;
use crate::errors::ApiError;

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
