//! A request as a front end hands it to the decision service.

use std::net::SocketAddr;

use axum::http::HeaderMap;
use bytes::Bytes;

use super::RequestId;
use super::admitted::Admitted;

/// The endpoints a request may go to.
pub(crate) type Among<'a> = &'a (dyn Fn(&SocketAddr) -> bool + Sync);

/// A request as a front end hands it over.
pub(crate) struct Ask<'a> {
    /// The path, without the query.
    pub(crate) path: &'a str,
    pub(crate) headers: &'a HeaderMap,
    pub(crate) body: Payload,
    /// The endpoints it may go to.
    pub(crate) among: Among<'a>,
    /// Its flow for flow control when a trusted gateway names one
    /// ([`crate::flow::FAIRNESS_HEADER`]); else its tenant's.
    pub(crate) fairness: Option<&'a str>,
    /// Its id.
    pub(crate) id: RequestId,
}

/// A request's body as a front end has it.
pub(crate) enum Payload {
    /// Still to be read, within its limits (the HTTP forwarder).
    Stream(axum::body::Body),
    /// Admitted at its headers and received (the picker).
    Received(Box<Admitted>),
    /// Read by the caller (explain, [`Service::measure`]).
    Read(Bytes),
    /// None (the picker: headers that end the request): nothing to read,
    /// so the least loaded endpoint.
    Bodiless,
}
