//! Tenants and cache isolation. A shared prefix cache is a timing side
//! channel between tenants, so in salted mode each tenant's requests carry a
//! `cache_salt` derived from the tenant (HMAC-SHA256 under a secret), which
//! vLLM hashes into the first block: tenants never share blocks, and their
//! routing keys are scoped apart too.
//!
//! The tenant comes only from trusted sources, by one rule:
//! 1. With an API-key map, the tenant is the key's. A request without a
//!    valid `Authorization: Bearer` key is 401 whatever its other headers
//!    say; a tenant header naming another tenant is 403. Keys are compared
//!    in constant time (every entry's SHA-256 digest, no early exit).
//! 2. Without one, the tenant header is the sole source and trusted as is:
//!    an authenticating gateway in front sets it.
//! 3. In salted mode a request with no tenant is 401.
//! 4. Before any of these, a request whose identity is ambiguous is 400,
//!    whatever the mode: the tenant header twice or holding a list (a
//!    comma: `x-tenant: a, b` is how proxies join two), or `Authorization`
//!    twice. Choosing one value would let a client steer which one counts
//!    where: the router might read the first, a gateway or the engine the
//!    other. So a tenant name never contains a comma.
//!
//! Never from the body.

use std::collections::HashMap;
use std::path::Path;

use axum::http::{HeaderMap, HeaderName, HeaderValue, header};
use hmac::{Hmac, Mac};
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::config::{self, ClientSalt, ConfigError, TenancyMode};
use crate::errors::ApiError;

/// Tenancy as configured, with its files loaded.
#[derive(Clone)]
pub struct Tenancy {
    mode: TenancyMode,
    header: Option<HeaderName>,
    /// (SHA-256 of the key, tenant).
    api_keys: Vec<([u8; 32], String)>,
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

/// The file at `path`, which the configuration's `field` names.
fn read(field: &'static str, path: &Path) -> Result<String, ConfigError> {
    std::fs::read_to_string(path).map_err(|source| ConfigError::file(field, path, source))
}

impl Tenancy {
    /// Loads the configured key map and secret.
    pub fn load(config: &config::Tenancy) -> Result<Self, ConfigError> {
        let api_keys = match &config.api_keys_file {
            Some(path) => {
                let map: HashMap<String, String> =
                    serde_yaml::from_str(&read("tenancy.apiKeysFile", path)?).map_err(
                        |source| ConfigError::Parse {
                            path: format!("tenancy.apiKeysFile: {}", path.display()),
                            source,
                        },
                    )?;
                if map.is_empty() {
                    return Err(ConfigError::Invalid {
                        field: "tenancy.apiKeysFile",
                        value: path.display().to_string(),
                        reason: "the key map is empty: no request could authenticate",
                    });
                }
                map.into_iter()
                    .map(|(key, tenant)| (digest(&key), tenant))
                    .collect()
            }
            None => Vec::new(),
        };
        let secret = match &config.secret_file {
            Some(path) => read("tenancy.secretFile", path)?
                .trim_end()
                .as_bytes()
                .to_vec(),
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
            header: config.tenant_header.as_ref().map(|h| h.0.clone()),
            api_keys,
            secret,
            client_salt: config.client_salt,
        })
    }

    /// The tenants of the API-key map.
    pub fn tenants(&self) -> impl Iterator<Item = String> + '_ {
        self.api_keys.iter().map(|(_, tenant)| tenant.clone())
    }

    /// The key material of `tenancy.secretFile` (empty without one).
    pub fn secret(&self) -> &[u8] {
        &self.secret
    }

    /// Whether tenants are salted apart.
    pub fn salted(&self) -> bool {
        self.mode == TenancyMode::Salted
    }

    /// The request's tenant from the trusted sources, if any (see the
    /// module docs for the rule).
    pub fn tenant(&self, headers: &HeaderMap) -> Result<Option<String>, ApiError> {
        single(headers, &header::AUTHORIZATION)?;
        let claimed = match &self.header {
            Some(name) => match single(headers, name)? {
                Some(v) if v.as_bytes().contains(&b',') => {
                    return Err(ApiError::BadRequest(format!(
                        "the {name} header holds a list (a comma): name one tenant"
                    )));
                }
                Some(v) => Some(v.to_str().map_err(|_| {
                    ApiError::Unauthenticated(format!("the {name} header is not valid text"))
                })?),
                None => None,
            },
            None => None,
        }
        .filter(|t| !t.is_empty());
        let tenant = if self.api_keys.is_empty() {
            claimed.map(str::to_owned)
        } else {
            let key = bearer(headers).ok_or_else(|| {
                ApiError::Unauthenticated(
                    "an API key is required: Authorization: Bearer <key>".into(),
                )
            })?;
            let tenant = self
                .lookup(key)
                .ok_or_else(|| ApiError::Unauthenticated("unknown API key".into()))?;
            if claimed.is_some_and(|c| c != tenant) {
                return Err(ApiError::Forbidden(
                    "the tenant header names another tenant than the API key's".into(),
                ));
            }
            Some(tenant.to_owned())
        };
        if tenant.is_none() && self.salted() {
            return Err(ApiError::Unauthenticated(
                "this router isolates tenants and the request names none: authenticate".into(),
            ));
        }
        Ok(tenant)
    }

    /// The tenant of `key`, comparing with every entry in constant time.
    fn lookup(&self, key: &str) -> Option<&str> {
        let presented = digest(key);
        let mut found = None;
        for (d, tenant) in &self.api_keys {
            if bool::from(d.ct_eq(&presented)) {
                found = Some(tenant.as_str());
            }
        }
        found
    }

    /// The configured tenant header, if any.
    pub fn header(&self) -> Option<&HeaderName> {
        self.header.as_ref()
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

/// The value of header `name`, which a request may carry once at most:
/// twice is 400, naming it (rule 4).
fn single<'h>(
    headers: &'h HeaderMap,
    name: &HeaderName,
) -> Result<Option<&'h HeaderValue>, ApiError> {
    let mut values = headers.get_all(name).iter();
    let first = values.next();
    if values.next().is_some() {
        return Err(ApiError::BadRequest(format!(
            "the {name} header is repeated: send it once"
        )));
    }
    Ok(first)
}

/// The token of an `Authorization: Bearer <token>` header, if any; none
/// when the header is repeated.
pub fn bearer(headers: &HeaderMap) -> Option<&str> {
    single(headers, &header::AUTHORIZATION)
        .ok()
        .flatten()
        .and_then(|a| a.to_str().ok())
        .and_then(|a| a.strip_prefix("Bearer "))
        .map(str::trim)
}

fn digest(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn tenancy(mode: TenancyMode, client_salt: ClientSalt) -> Tenancy {
        Tenancy {
            mode,
            header: Some(HeaderName::from_static("x-tenant")),
            api_keys: vec![(digest("k1"), "acme".to_owned())],
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

    fn tenant_of(t: &Tenancy, pairs: &[(&str, &str)]) -> Result<Option<String>, u16> {
        t.tenant(&headers(pairs)).map_err(|e| e.status().as_u16())
    }

    #[test]
    fn with_api_keys_the_tenant_is_the_keys() {
        let t = tenancy(TenancyMode::Salted, ClientSalt::Reject);
        let acme = Ok(Some("acme".to_owned()));
        assert_eq!(tenant_of(&t, &[("authorization", "Bearer k1")]), acme);
        assert_eq!(
            tenant_of(&t, &[("authorization", "Bearer k1"), ("x-tenant", "acme")]),
            acme,
            "a header repeating the key's tenant is fine"
        );
        assert_eq!(
            tenant_of(&t, &[("authorization", "Bearer k1"), ("x-tenant", "bob")]),
            Err(403)
        );
        assert_eq!(
            tenant_of(&t, &[("authorization", "Bearer nope"), ("x-tenant", "bob")]),
            Err(401)
        );
        assert_eq!(tenant_of(&t, &[("x-tenant", "bob")]), Err(401));
        assert_eq!(tenant_of(&t, &[("authorization", "Basic k1")]), Err(401));
        assert_eq!(tenant_of(&t, &[]), Err(401));
        let shared = tenancy(TenancyMode::Shared, ClientSalt::Reject);
        assert_eq!(tenant_of(&shared, &[("x-tenant", "bob")]), Err(401));
    }

    #[test]
    fn without_api_keys_the_header_is_the_sole_source() {
        let mut t = tenancy(TenancyMode::Salted, ClientSalt::Reject);
        t.api_keys.clear();
        assert_eq!(
            tenant_of(&t, &[("x-tenant", "blue")]),
            Ok(Some("blue".to_owned()))
        );
        assert_eq!(tenant_of(&t, &[("x-tenant", "")]), Err(401));
        assert_eq!(tenant_of(&t, &[]), Err(401));
        let mut shared = tenancy(TenancyMode::Shared, ClientSalt::Reject);
        shared.api_keys.clear();
        assert_eq!(tenant_of(&shared, &[]), Ok(None));
    }

    #[test]
    fn an_ambiguous_identity_is_400_naming_the_header() {
        let mut keyless = tenancy(TenancyMode::Shared, ClientSalt::Reject);
        keyless.api_keys.clear();
        let keyed = tenancy(TenancyMode::Salted, ClientSalt::Reject);
        let cases: [&[(&str, &str)]; 5] = [
            &[("x-tenant", "acme"), ("x-tenant", "bob")],
            &[("x-tenant", "acme"), ("x-tenant", "acme")],
            &[("x-tenant", "acme, bob")],
            &[("x-tenant", ",")],
            &[
                ("authorization", "Bearer k1"),
                ("authorization", "Bearer k2"),
            ],
        ];
        for t in [&keyless, &keyed] {
            for pairs in cases {
                let mut given = headers(pairs);
                if t.api_keys.len() == 1 && !given.contains_key("authorization") {
                    given.insert("authorization", "Bearer k1".parse().unwrap());
                }
                let err = t.tenant(&given).unwrap_err();
                assert_eq!(err.status().as_u16(), 400, "{pairs:?}");
                assert!(err.to_string().contains(pairs[0].0), "{pairs:?}: {err}");
            }
        }
        let two = headers(&[
            ("authorization", "Bearer k1"),
            ("authorization", "Bearer k1"),
        ]);
        assert_eq!(
            bearer(&two),
            None,
            "the admin token is not read from either"
        );
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

    /// Random headers against the rule written as a table: the API key
    /// decides; a header naming another tenant is 403; no valid key is 401.
    mod rule {
        use axum::http::HeaderValue;
        use proptest::prelude::*;

        use super::*;

        fn header_value() -> impl Strategy<Value = Option<Vec<u8>>> {
            prop_oneof![
                Just(None),
                Just(Some(b"acme".to_vec())),
                Just(Some(b"bob".to_vec())),
                Just(Some(Vec::new())),
                proptest::collection::vec(any::<u8>(), 0..12).prop_map(Some),
            ]
        }

        fn authorization() -> impl Strategy<Value = Option<Vec<u8>>> {
            prop_oneof![
                Just(None),
                Just(Some(b"Bearer k1".to_vec())),
                Just(Some(b"Bearer k2".to_vec())),
                Just(Some(b"Basic k1".to_vec())),
                Just(Some(b"Bearer ".to_vec())),
                proptest::collection::vec(any::<u8>(), 0..12).prop_map(Some),
            ]
        }

        proptest! {
            #[test]
            fn the_key_decides(
                auth in authorization(),
                claimed in header_value(),
                salted in any::<bool>(),
            ) {
                let mode = if salted { TenancyMode::Salted } else { TenancyMode::Shared };
                let t = tenancy(mode, ClientSalt::Reject);
                let mut headers = HeaderMap::new();
                if let Some(v) = auth.as_deref().and_then(|v| HeaderValue::from_bytes(v).ok()) {
                    headers.insert(header::AUTHORIZATION, v);
                }
                let claimed = claimed
                    .as_deref()
                    .and_then(|v| HeaderValue::from_bytes(v).ok());
                if let Some(v) = &claimed {
                    headers.insert("x-tenant", v.clone());
                }
                let key_ok = headers
                    .get(header::AUTHORIZATION)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.strip_prefix("Bearer "))
                    .is_some_and(|k| k.trim() == "k1");
                let other = claimed
                    .as_ref()
                    .is_some_and(|v| !v.is_empty() && v.as_bytes() != b"acme");
                let listed = claimed.as_ref().is_some_and(|v| v.as_bytes().contains(&b','));
                let expected = match (key_ok, other) {
                    _ if listed => Err(400),
                    (false, _) => Err(401),
                    (true, true) => Err(if claimed.as_ref().is_some_and(|v| v.to_str().is_err()) { 401 } else { 403 }),
                    (true, false) => Ok(Some("acme".to_owned())),
                };
                prop_assert_eq!(
                    t.tenant(&headers).map_err(|e| e.status().as_u16()),
                    expected
                );
            }
        }
    }
}
