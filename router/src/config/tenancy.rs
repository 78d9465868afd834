//! `tenancy`: tenant identity and isolation.
//!
//! Not here: telling tenants apart and salting their requests
//! ([`crate::tenancy`]).

use std::path::PathBuf;

use kvroute_core::spec::RoutingSpec;
use serde::{Deserialize, Serialize};

use super::Header;

/// Whether tenants share the engines' caches: the core's, written `shared`
/// or `salted`.
pub use kvroute_core::spec::TenancyMode;

/// What to do with a client's own `cache_salt` in salted mode.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ClientSalt {
    /// Refuse the request with 400 (the default).
    #[default]
    Reject,
    /// Replace it with the tenant's salt.
    Overwrite,
}

/// Tenant identity and isolation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct Tenancy {
    /// `shared` or `salted`. Default: shared.
    pub mode: TenancyMode,
    /// A header naming the tenant. Without `apiKeysFile` it is the sole
    /// source and trusted as is (an authenticating gateway sets it; clients
    /// must not reach the router directly). With `apiKeysFile` it may only
    /// repeat the key's tenant: another tenant is 403.
    pub tenant_header: Option<Header>,
    /// A YAML map of API key → tenant (a mounted Secret); the key comes
    /// from `Authorization: Bearer <key>`. When set, every request needs a
    /// valid key (401 without one) and its tenant is the key's.
    pub api_keys_file: Option<PathBuf>,
    /// The HMAC-SHA256 key salting tenants' caches (a mounted Secret).
    /// Required in salted mode.
    pub secret_file: Option<PathBuf>,
    /// A client-supplied `cache_salt` in salted mode: `reject` or
    /// `overwrite`. Default: reject.
    pub client_salt: ClientSalt,
}

impl Default for Tenancy {
    fn default() -> Self {
        Tenancy {
            mode: RoutingSpec::default().tenancy,
            tenant_header: None,
            api_keys_file: None,
            secret_file: None,
            client_salt: ClientSalt::default(),
        }
    }
}
