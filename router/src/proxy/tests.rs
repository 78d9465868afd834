//! The request parser and the salt rule over arbitrary bodies.

use proptest::prelude::*;
use serde_json::{Value, json};

use super::*;
use crate::config::{self, ClientSalt, TenancyMode};
use crate::settings::Settings;

fn tenancy(mode: TenancyMode, client_salt: ClientSalt) -> Tenancy {
    let dir = std::env::temp_dir().join(format!("kvroute-proxy-tests-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    static CALLS: AtomicUsize = AtomicUsize::new(0);
    let secret = dir.join(format!("secret-{}", CALLS.fetch_add(1, Ordering::SeqCst)));
    std::fs::write(&secret, "s3cret").unwrap();
    let tenancy = Tenancy::load(&config::Tenancy {
        mode,
        tenant_header: Some(crate::config::Header::from_static("x-tenant")),
        secret_file: Some(secret.clone()),
        client_salt,
        ..config::Tenancy::default()
    })
    .unwrap();
    let _ = std::fs::remove_file(secret);
    tenancy
}

/// JSON values biased toward what the parser looks at.
fn value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        "[a-z <>|{}\"\\\\]{0,12}".prop_map(Value::from),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
            proptest::collection::vec(
                (
                    prop_oneof![
                        Just("role".to_owned()),
                        Just("content".to_owned()),
                        Just("text".to_owned()),
                        Just("type".to_owned()),
                        "[a-z]{1,6}",
                    ],
                    inner
                ),
                0..4
            )
            .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

/// A request body: a JSON object with the fields routing reads, or any
/// other JSON, or arbitrary bytes.
fn body() -> impl Strategy<Value = Vec<u8>> {
    let field = prop_oneof![
        Just("model"),
        Just("stream"),
        Just("messages"),
        Just("prompt"),
        Just("input"),
        Just("cache_salt"),
        Just("prompt_cache_key"),
    ];
    prop_oneof![
        proptest::collection::vec((field, value()), 0..6).prop_map(|kv| {
            let obj: serde_json::Map<String, Value> =
                kv.into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
            serde_json::to_vec(&obj).unwrap()
        }),
        value().prop_map(|v| serde_json::to_vec(&v).unwrap()),
        proptest::collection::vec(any::<u8>(), 0..64),
        Just(br#"{"input": "hi", "cache_salt": "mine", "t": NaN}"#.to_vec()),
    ]
}

fn api() -> impl Strategy<Value = Api> {
    prop_oneof![Just(Api::Chat), Just(Api::Completion), Just(Api::Other)]
}

proptest! {
    /// Salted: nothing is forwarded unless it is a JSON object carrying
    /// exactly the tenant's salt.
    #[test]
    fn salted_bodies_are_forwarded_only_with_the_tenants_salt(
        api in api(),
        body in body(),
        overwrite in any::<bool>(),
    ) {
        let client_salt = if overwrite { ClientSalt::Overwrite } else { ClientSalt::Reject };
        let t = tenancy(TenancyMode::Salted, client_salt);
        let s = Settings::test();
        let input = Input { api, tenant: Some("acme".into()), conversation: None, tokenize: true, keep_tokens: false };
        match analyze(Bytes::from(body), input, &t, &s, &ModelList::default()) {
            Ok(a) => {
                let forwarded: Value = serde_json::from_slice(&a.bytes).unwrap();
                prop_assert_eq!(&forwarded["cache_salt"], &json!(t.salt("acme")));
            }
            Err(e) => prop_assert_eq!(e.status().as_u16(), 400, "{}", e),
        }
    }

    /// Shared: a body is forwarded byte for byte, or refused with 400.
    #[test]
    fn shared_bodies_pass_unchanged_or_are_400(api in api(), body in body()) {
        let t = tenancy(TenancyMode::Shared, ClientSalt::Reject);
        let s = Settings::test();
        let input = Input { api, tenant: None, conversation: None, tokenize: true, keep_tokens: false };
        match analyze(Bytes::from(body.clone()), input, &t, &s, &ModelList::default()) {
            Ok(a) => prop_assert_eq!(&a.bytes[..], &body[..]),
            Err(e) => prop_assert_eq!(e.status().as_u16(), 400, "{}", e),
        }
    }
}
