//! Header names in the configuration, checked while it is parsed.

use axum::http::HeaderName;
use serde::{Deserialize, Serialize};

/// A header name, checked when the configuration is read.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Header(pub HeaderName);

impl Header {
    /// A header name known to be valid (panics otherwise, like
    /// [`HeaderName::from_static`]).
    pub fn from_static(name: &'static str) -> Self {
        Header(HeaderName::from_static(name))
    }
}

impl TryFrom<String> for Header {
    type Error = String;

    fn try_from(name: String) -> Result<Self, String> {
        HeaderName::from_bytes(name.as_bytes())
            .map(Header)
            .map_err(|_| format!("{name:?} is not a valid header name"))
    }
}

impl From<Header> for String {
    fn from(h: Header) -> String {
        h.0.as_str().to_owned()
    }
}

/// A header name that the empty string turns off.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct OptionalHeader(pub Option<Header>);

impl TryFrom<String> for OptionalHeader {
    type Error = String;

    fn try_from(name: String) -> Result<Self, String> {
        if name.is_empty() {
            return Ok(OptionalHeader(None));
        }
        Header::try_from(name).map(|h| OptionalHeader(Some(h)))
    }
}

impl From<OptionalHeader> for String {
    fn from(h: OptionalHeader) -> String {
        h.0.map(String::from).unwrap_or_default()
    }
}
