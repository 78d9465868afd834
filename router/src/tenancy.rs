//! Tenants and cache isolation. A shared prefix cache is a timing side
//! channel between tenants, so in salted mode each tenant's requests carry a
//! `cache_salt` derived from the tenant (HMAC-SHA256 under a secret), which
//! vLLM hashes into the first block: tenants never share blocks, and their
//! routing keys are scoped apart too.
//!
//! The tenant comes only from trusted sources: a header set by an
//! authenticating gateway, or the API key in `Authorization: Bearer` looked
//! up in a key → tenant map. Never from the body.

use std::collections::HashMap;
use std::path::Path;

use axum::http::{HeaderMap, HeaderName, header};
use hmac::{Hmac, Mac};
use serde_json::{Map, Value};
use sha2::Sha256;

use crate::config::{self, ClientSalt, ConfigError, TenancyMode};
use crate::errors::ApiError;

/// Tenancy as configured, with its files loaded.
#[derive(Clone)]
pub struct Tenancy {
    mode: TenancyMode,
    header: Option<HeaderName>,
    api_keys: HashMap<String, String>,
    secret: Vec<u8>,
    client_salt: ClientSalt,
}

impl std::fmt::Debug for Tenancy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print keys or the secret.
        f.debug_struct("Tenancy")
            .field("mode", &self.mode)
            .field("header", &self.header)
            .field("api_keys", &self.api_keys.len())
            .finish_non_exhaustive()
    }
}

fn read(path: &Path) -> Result<String, ConfigError> {
    std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.display().to_string(),
        source,
    })
}

impl Tenancy {
    /// Loads the configured key map and secret.
    pub fn load(config: &config::Tenancy) -> Result<Self, ConfigError> {
        let api_keys = match &config.api_keys_file {
            Some(path) => {
                serde_yaml::from_str(&read(path)?).map_err(|source| ConfigError::Parse {
                    path: path.display().to_string(),
                    source,
                })?
            }
            None => HashMap::new(),
        };
        let secret = match &config.secret_file {
            Some(path) => read(path)?.trim_end().as_bytes().to_vec(),
            None => Vec::new(),
        };
        if config.mode == TenancyMode::Salted && secret.is_empty() {
            return Err(ConfigError::Invalid {
                field: "tenancy.secretFile",
                value: config
                    .secret_file
                    .as_ref()
                    .map(|p| p.display().to_string())
                    .unwrap_or_default(),
                reason: "the secret must not be empty",
            });
        }
        Ok(Tenancy {
            mode: config.mode,
            header: config
                .tenant_header
                .as_deref()
                .and_then(|h| HeaderName::from_bytes(h.as_bytes()).ok()),
            api_keys,
            secret,
            client_salt: config.client_salt,
        })
    }

    /// Whether tenants are salted apart.
    pub fn salted(&self) -> bool {
        self.mode == TenancyMode::Salted
    }

    /// The request's tenant from the trusted sources, if any. In salted
    /// mode a request without one is refused (401); so is an unknown API
    /// key whenever a key map is configured.
    pub fn tenant(&self, headers: &HeaderMap) -> Result<Option<String>, ApiError> {
        if let Some(name) = &self.header
            && let Some(v) = headers.get(name)
        {
            let t = v.to_str().map_err(|_| {
                ApiError::Unauthenticated(format!("the {name} header is not valid text"))
            })?;
            if !t.is_empty() {
                return Ok(Some(t.to_owned()));
            }
        }
        if !self.api_keys.is_empty()
            && let Some(auth) = headers.get(header::AUTHORIZATION)
        {
            let key = auth
                .to_str()
                .ok()
                .and_then(|a| a.strip_prefix("Bearer "))
                .map(str::trim);
            return match key.and_then(|k| self.api_keys.get(k)) {
                Some(t) => Ok(Some(t.clone())),
                None => Err(ApiError::Unauthenticated("unknown API key".into())),
            };
        }
        if self.salted() {
            return Err(ApiError::Unauthenticated(
                "this router isolates tenants and the request names none: authenticate".into(),
            ));
        }
        Ok(None)
    }

    /// The `cache_salt` of `tenant`: hex HMAC-SHA256 of the tenant name.
    pub fn salt(&self, tenant: &str) -> String {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.secret).expect("HMAC takes any key");
        mac.update(tenant.as_bytes());
        mac.finalize()
            .into_bytes()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    /// In salted mode, sets the body's `cache_salt` to the tenant's,
    /// refusing or overwriting a client's own. Returns whether the body
    /// changed (and must be re-serialized).
    pub fn apply(
        &self,
        tenant: Option<&str>,
        body: &mut Map<String, Value>,
    ) -> Result<bool, ApiError> {
        let (true, Some(tenant)) = (self.salted(), tenant) else {
            return Ok(false);
        };
        if body.get("cache_salt").is_some_and(|v| !v.is_null())
            && self.client_salt == ClientSalt::Reject
        {
            return Err(ApiError::BadRequest(
                "'cache_salt' is set by the router for tenant isolation; remove it from the request".into(),
            ));
        }
        body.insert("cache_salt".into(), Value::String(self.salt(tenant)));
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn tenancy(mode: TenancyMode, client_salt: ClientSalt) -> Tenancy {
        Tenancy {
            mode,
            header: Some(HeaderName::from_static("x-tenant")),
            api_keys: [("k1".to_owned(), "acme".to_owned())].into(),
            secret: b"s3cret".to_vec(),
            client_salt,
        }
    }

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        pairs
            .iter()
            .map(|(k, v)| {
                (
                    HeaderName::from_bytes(k.as_bytes()).unwrap(),
                    v.parse().unwrap(),
                )
            })
            .collect()
    }

    #[test]
    fn tenants_come_from_the_header_or_the_api_key() {
        let t = tenancy(TenancyMode::Salted, ClientSalt::Reject);
        assert_eq!(
            t.tenant(&headers(&[("x-tenant", "blue")]))
                .unwrap()
                .as_deref(),
            Some("blue")
        );
        assert_eq!(
            t.tenant(&headers(&[("authorization", "Bearer k1")]))
                .unwrap()
                .as_deref(),
            Some("acme")
        );
        assert!(matches!(
            t.tenant(&headers(&[("authorization", "Bearer nope")])),
            Err(ApiError::Unauthenticated(_))
        ));
        assert!(matches!(
            t.tenant(&HeaderMap::new()),
            Err(ApiError::Unauthenticated(_))
        ));
        let shared = tenancy(TenancyMode::Shared, ClientSalt::Reject);
        assert_eq!(shared.tenant(&HeaderMap::new()).unwrap(), None);
    }

    #[test]
    fn salts_are_keyed_stable_and_valid_for_vllm() {
        let t = tenancy(TenancyMode::Salted, ClientSalt::Reject);
        let a = t.salt("acme");
        assert_eq!(a, t.salt("acme"));
        assert_ne!(a, t.salt("blue"));
        assert_eq!(a.len(), 64);
        kvroute_core::hash::validate_cache_salt(&a).unwrap();
        let mut other = t.clone();
        other.secret = b"other".to_vec();
        assert_ne!(a, other.salt("acme"), "the secret keys the salt");
    }

    #[test]
    fn client_salts_are_rejected_or_overwritten() {
        let reject = tenancy(TenancyMode::Salted, ClientSalt::Reject);
        let mut body = json!({"cache_salt": "mine"}).as_object().unwrap().clone();
        assert!(matches!(
            reject.apply(Some("acme"), &mut body),
            Err(ApiError::BadRequest(_))
        ));
        let overwrite = tenancy(TenancyMode::Salted, ClientSalt::Overwrite);
        assert!(overwrite.apply(Some("acme"), &mut body).unwrap());
        assert_eq!(body["cache_salt"], overwrite.salt("acme"));
        let shared = tenancy(TenancyMode::Shared, ClientSalt::Reject);
        let mut untouched = json!({"cache_salt": "mine"}).as_object().unwrap().clone();
        assert!(!shared.apply(Some("acme"), &mut untouched).unwrap());
        assert_eq!(untouched["cache_salt"], "mine");
    }
}
