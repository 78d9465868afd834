//! What the API server last said of an object, beyond its spec: the
//! identifiers and the status the status writer needs to decide whether to
//! write, and to write safely.
//!
//! The index stores it beside each pool and policy and never reads it: it
//! does not change endpoints or policies, only what the writer compares with.

/// An object's `metadata.uid`, `metadata.resourceVersion` and `status` as
/// last watched.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Observed<S> {
    /// `metadata.uid`, for the Events that name the object.
    pub uid: Option<String>,
    /// `metadata.resourceVersion`: a status patch carries it as a
    /// precondition, so it cannot overwrite a newer status it has not seen.
    pub resource_version: Option<String>,
    /// The object's status, if it has one.
    pub status: Option<S>,
}
