//! Errors of the fake API server and their Kubernetes `Status` form.
//!
//! Each variant maps to one HTTP status code and one `Status.reason`, in one
//! place, the way the real API server reports failures.

use serde_json::{Value, json};

/// A failed API request, reported to clients as a Kubernetes `Status`.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The object, or the URL's resource type, does not exist.
    #[error("{what} not found")]
    NotFound {
        /// What was looked up, e.g. `pods "web-0"`.
        what: String,
    },
    /// A create named an object that already exists.
    #[error("{what} already exists")]
    AlreadyExists {
        /// The object, e.g. `pods "web-0"`.
        what: String,
    },
    /// A write carried a stale `metadata.resourceVersion`.
    #[error(
        "Operation cannot be fulfilled on {what}: the object has been modified; please apply your changes to the latest version and try again"
    )]
    Conflict {
        /// The object, e.g. `pods "web-0"`.
        what: String,
    },
    /// A watch asked for a `resourceVersion` older than the retained history.
    #[error("too old resource version: {requested} ({oldest})")]
    Gone {
        /// The requested version.
        requested: u64,
        /// The oldest version that can still be replayed.
        oldest: u64,
    },
    /// The body or a parameter is malformed.
    #[error("{0}")]
    BadRequest(String),
    /// The request is well-formed but cannot be applied, e.g. a failed
    /// JSON patch `test`.
    #[error("{0}")]
    Invalid(String),
    /// The body is not JSON.
    #[error("invalid JSON body")]
    InvalidJson(#[source] serde_json::Error),
    /// The verb is not supported on this URL.
    #[error("the server does not allow this method on the requested resource")]
    MethodNotAllowed,
    /// The patch content type is not implemented by the fake.
    #[error(
        "the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/strategic-merge-patch+json, application/apply-patch+yaml (got {0:?})"
    )]
    UnsupportedMediaType(String),
}

impl ApiError {
    /// HTTP status code, also `Status.code`.
    pub fn code(&self) -> u16 {
        match self {
            Self::NotFound { .. } => 404,
            Self::AlreadyExists { .. } | Self::Conflict { .. } => 409,
            Self::Gone { .. } => 410,
            Self::BadRequest(_) | Self::InvalidJson(_) => 400,
            Self::MethodNotAllowed => 405,
            Self::Invalid(_) => 422,
            Self::UnsupportedMediaType(_) => 415,
        }
    }

    /// `Status.reason`.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::NotFound { .. } => "NotFound",
            Self::AlreadyExists { .. } => "AlreadyExists",
            Self::Conflict { .. } => "Conflict",
            Self::Gone { .. } => "Expired",
            Self::BadRequest(_) | Self::InvalidJson(_) => "BadRequest",
            Self::MethodNotAllowed => "MethodNotAllowed",
            Self::Invalid(_) => "Invalid",
            Self::UnsupportedMediaType(_) => "UnsupportedMediaType",
        }
    }

    /// The Kubernetes `Status` object describing this error.
    pub fn to_status(&self) -> Value {
        let mut message = self.to_string();
        if let Self::InvalidJson(e) = self {
            message = format!("{message}: {e}");
        }
        json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": message,
            "reason": self.reason(),
            "code": self.code(),
        })
    }
}
