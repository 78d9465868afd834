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

proptest! {
    /// The top-level scan a policy without prompts uses reads the same
    /// fields as the full parse, and refuses the same bodies.
    #[test]
    fn the_scan_reads_what_the_parse_reads(api in api(), body in body()) {
        let parsed = features::parse(api, &body, false);
        let scanned = features::scan(api, &body);
        match (parsed, scanned) {
            (Ok(p), Ok(s)) => {
                let f = |o: Option<serde_json::Map<String, Value>>| {
                    o.as_ref().map(features::features).transpose().map(|f| f.map(|f| format!("{f:?}"))).map_err(|e| e.to_string())
                };
                prop_assert_eq!(f(p), f(s));
            }
            (Err(_), Err(_)) => {}
            (p, s) => prop_assert!(false, "parse {:?}, scan {:?}", p.map(|_| ()), s.map(|_| ())),
        }
    }
}

#[test]
fn round_robin_routes_without_tokenizing() {
    let t = tenancy(TenancyMode::Shared, ClientSalt::Reject);
    let s = Settings::builtin(kvroute_core::policy::PolicyConfig::RoundRobin);
    let body =
        json!({"model": "m", "messages": [{"role": "user", "content": "Hello ".repeat(100)}]});
    let input = || Input {
        api: Api::Chat,
        tenant: None,
        conversation: None,
        tokenize: true,
        keep_tokens: true,
    };
    let bytes = Bytes::from(body.to_string());
    let a = analyze(bytes.clone(), input(), &t, &s, &ModelList::default()).unwrap();
    assert!(a.readable && !a.tokenized);
    assert!(a.chain.is_empty() && a.tokens.is_empty());
    assert_eq!(a.model.as_deref(), Some("m"));
    assert_eq!(a.prompt_tokens, bytes.len() as u64 / 4);
    // The default policy reads the prompt.
    let a = analyze(bytes, input(), &t, &Settings::test(), &ModelList::default()).unwrap();
    assert!(a.readable && a.tokenized && !a.chain.is_empty());
    // The scan still refuses what is not an object, and mistyped fields.
    for bad in [&b"[1]"[..], b"{\"stream\": 1}", b"{\"model\": "] {
        let e = analyze(
            Bytes::from_static(bad),
            input(),
            &t,
            &s,
            &ModelList::default(),
        )
        .unwrap_err();
        assert_eq!(e.status().as_u16(), 400, "{e}");
    }
}
