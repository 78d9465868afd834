use axum::http::{HeaderMap, HeaderValue};
use proptest::prelude::*;

use super::*;

fn keying() -> Keying {
    Keying {
        secret: b"s3cret".to_vec(),
        version: "v1".into(),
        semantic: true,
        credentials: false,
    }
}

fn no_roots(_: &str) -> Vec<String> {
    Vec::new()
}

fn classify_body(tenant: Option<&str>, headers: &HeaderMap, body: &str) -> Classified {
    classify(
        &keying(),
        "/v1/chat/completions",
        headers,
        tenant,
        body.as_bytes(),
        no_roots,
    )
}

fn key(tenant: Option<&str>, body: &str) -> Key {
    match classify_body(tenant, &HeaderMap::new(), body) {
        Classified::Cacheable(c) => c.key,
        Classified::Bypass(r) => panic!("bypassed ({r}): {body}"),
    }
}

fn bypass(headers: &HeaderMap, body: &str) -> Option<&'static str> {
    match classify_body(Some("t"), headers, body) {
        Classified::Bypass(r) => Some(r),
        Classified::Cacheable(_) => None,
    }
}

const CHAT: &str = r#"{"model":"m","temperature":0,"messages":[{"role":"user","content":"hi"}]}"#;

#[test]
fn only_deterministic_requests_are_cacheable() {
    let none = HeaderMap::new();
    assert_eq!(bypass(&none, CHAT), None);
    let sampled = r#"{"model":"m","messages":[]}"#;
    assert_eq!(bypass(&none, sampled), Some("sampled"), "absent is 1");
    let warm = r#"{"model":"m","temperature":0.7,"messages":[]}"#;
    assert_eq!(bypass(&none, warm), Some("sampled"));
    let mut opted = HeaderMap::new();
    opted.insert(SAMPLED_HEADER, HeaderValue::from_static("1"));
    assert_eq!(bypass(&opted, warm), None, "a client may opt in");
    let n2 = r#"{"model":"m","temperature":0,"n":2,"messages":[]}"#;
    assert_eq!(bypass(&opted, n2), Some("n"));
    let n1 = r#"{"model":"m","temperature":0,"n":1,"messages":[]}"#;
    assert_eq!(bypass(&none, n1), None);
    let lp = r#"{"model":"m","temperature":0,"logprobs":true,"messages":[]}"#;
    assert_eq!(bypass(&opted, lp), Some("logprobs"));
    let no_lp = r#"{"model":"m","temperature":0,"logprobs":false,"messages":[]}"#;
    assert_eq!(bypass(&none, no_lp), None);
    assert_eq!(bypass(&none, "not json"), Some("body"));
    assert_eq!(bypass(&none, r#"{"temperature":0}"#), Some("body"));
    let completion = classify(
        &keying(),
        "/v1/completions",
        &none,
        None,
        br#"{"model":"m","temperature":0,"prompt":"x","logprobs":1}"#,
        no_roots,
    );
    assert!(matches!(completion, Classified::Bypass("logprobs")));
    let other = classify(
        &keying(),
        "/v1/embeddings",
        &none,
        None,
        CHAT.as_bytes(),
        no_roots,
    );
    assert!(matches!(other, Classified::Bypass("path")));
}

#[test]
fn cache_control_no_store_and_no_cache() {
    let mut h = HeaderMap::new();
    h.insert(
        "cache-control",
        HeaderValue::from_static("max-age=0, No-Store"),
    );
    assert_eq!(bypass(&h, CHAT), Some("no_store"));
    h.insert("cache-control", HeaderValue::from_static("no-cache"));
    let Classified::Cacheable(c) = classify_body(None, &h, CHAT) else {
        panic!("no-cache still stores")
    };
    assert!(!c.read, "no-cache is not served from the cache");
    let Classified::Cacheable(c) = classify_body(None, &HeaderMap::new(), CHAT) else {
        panic!()
    };
    assert!(c.read);
}

#[test]
fn delivery_fields_are_not_part_of_the_key_and_the_rest_is() {
    let base = key(Some("t"), CHAT);
    let streamed = r#"{"stream":true,"stream_options":{"include_usage":true},"user":"u","model":"m","temperature":0,"messages":[{"role":"user","content":"hi"}]}"#;
    assert_eq!(key(Some("t"), streamed), base, "stream, options and user");
    let reordered = r#"{"messages":[{"content":"hi","role":"user"}],"temperature":0,"model":"m"}"#;
    assert_eq!(key(Some("t"), reordered), base, "key order does not matter");
    let other = r#"{"model":"m","temperature":0,"max_tokens":5,"messages":[{"role":"user","content":"hi"}]}"#;
    assert_ne!(key(Some("t"), other), base, "max_tokens changes the answer");
    assert_ne!(key(None, CHAT), base);
    assert_ne!(
        key(Some(""), CHAT),
        key(None, CHAT),
        "no tenant is not an empty one"
    );
    let v2 = Keying {
        version: "v2".into(),
        ..keying()
    };
    let with = |keying: &Keying, roots: fn(&str) -> Vec<String>| match classify(
        keying,
        "/v1/chat/completions",
        &HeaderMap::new(),
        Some("t"),
        CHAT.as_bytes(),
        roots,
    ) {
        Classified::Cacheable(c) => c.key,
        Classified::Bypass(r) => panic!("{r}"),
    };
    assert_ne!(with(&v2, no_roots), base, "the version");
    assert_ne!(
        with(&keying(), |_| vec!["/models/m-2".into()]),
        base,
        "the root"
    );
    let unkeyed = Keying::default();
    assert_ne!(with(&unkeyed, no_roots), base, "the key material");
}

#[test]
fn a_stream_without_usage_is_forwarded_asking_for_it() {
    let body = r#"{"model":"m","temperature":0,"stream":true,"messages":[]}"#;
    let Classified::Cacheable(c) = classify_body(None, &HeaderMap::new(), body) else {
        panic!()
    };
    assert!(c.form.stream && !c.form.include_usage);
    let forward: serde_json::Value = serde_json::from_slice(&c.forward.unwrap()).unwrap();
    assert_eq!(forward["stream_options"]["include_usage"], true);
    assert_eq!(forward["messages"], serde_json::json!([]));
    let Classified::Cacheable(c) = classify_body(None, &HeaderMap::new(), CHAT) else {
        panic!()
    };
    assert!(c.forward.is_none(), "nothing to add");
}

proptest! {
    /// Two requests from different tenants never share a key, whatever
    /// their bodies; the same request from the same tenant always does.
    #[test]
    fn tenants_never_share_a_key(
        a in proptest::option::of("[a-z0-9,;:=-]{0,12}"),
        b in proptest::option::of("[a-z0-9,;:=-]{0,12}"),
        model in "[a-zA-Z0-9/:.-]{1,20}",
        content in ".{0,40}",
        other in ".{0,40}",
        secret in proptest::collection::vec(any::<u8>(), 0..16),
    ) {
        let k = Keying { secret, version: String::new(), semantic: false, credentials: false };
        let body = |c: &str| serde_json::json!({"model": model, "temperature": 0, "messages": [{"role": "user", "content": c}]}).to_string();
        let key = |t: Option<&str>, c: &str| match classify(&k, "/v1/chat/completions", &HeaderMap::new(), t, body(c).as_bytes(), no_roots) {
            Classified::Cacheable(c) => c.key,
            Classified::Bypass(r) => panic!("{r}"),
        };
        prop_assert_eq!(key(a.as_deref(), &content), key(a.as_deref(), &content));
        if a != b {
            prop_assert_ne!(key(a.as_deref(), &content), key(b.as_deref(), &other));
        }
    }
}

fn question(body: serde_json::Value) -> Option<Question> {
    match classify(
        &keying(),
        "/v1/chat/completions",
        &HeaderMap::new(),
        Some("t"),
        body.to_string().as_bytes(),
        no_roots,
    ) {
        Classified::Cacheable(c) => c.question,
        Classified::Bypass(r) => panic!("{r}"),
    }
}

#[test]
fn the_question_is_the_last_user_message_and_its_context_everything_else() {
    let chat = |system: &str, earlier: &str, last: serde_json::Value| {
        serde_json::json!({"model": "m", "temperature": 0, "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": earlier},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": last},
        ]})
    };
    let q = question(chat("s", "e", "What is a KV cache?".into())).unwrap();
    assert_eq!(q.text, "What is a KV cache?");
    let same_context = question(chat("s", "e", "what is a kv cache".into())).unwrap();
    assert_eq!(q.context, same_context.context, "only the question differs");
    assert_ne!(
        q.context,
        question(chat("s2", "e", "What is a KV cache?".into()))
            .unwrap()
            .context,
        "the system prompt"
    );
    assert_ne!(
        q.context,
        question(chat("s", "e2", "What is a KV cache?".into()))
            .unwrap()
            .context,
        "an earlier turn"
    );
    let parts = serde_json::json!([{"type": "text", "text": "What is "}, {"type": "text", "text": "a KV cache?"}]);
    assert_eq!(
        question(chat("s", "e", parts)).unwrap(),
        q,
        "text parts are the text"
    );
    let image = serde_json::json!([{"type": "image_url", "image_url": {"url": "x"}}]);
    assert_eq!(
        question(chat("s", "e", image)),
        None,
        "not a question in text"
    );
    let mut exact_only = keying();
    exact_only.semantic = false;
    let body = chat("s", "e", "q".into()).to_string();
    let Classified::Cacheable(c) = classify(
        &exact_only,
        "/v1/chat/completions",
        &HeaderMap::new(),
        None,
        body.as_bytes(),
        no_roots,
    ) else {
        panic!()
    };
    assert_eq!(c.question, None, "computed only for the semantic level");
}

#[test]
fn numbers_equal_as_values_give_one_key() {
    let with = |max: &str, temperature: &str| {
        let body = format!(
            r#"{{"model":"m","temperature":{temperature},"max_tokens":{max},"messages":[{{"role":"user","content":"hi"}}]}}"#
        );
        key(Some("t"), &body)
    };
    let base = with("8", "0");
    for (max, temperature) in [
        ("8.0", "0"),
        ("8", "0.0"),
        ("8", "-0"),
        ("8.00", "-0.0"),
        ("8e0", "0e5"),
    ] {
        assert_eq!(with(max, temperature), base, "{max} {temperature}");
    }
    assert_ne!(with("9", "0"), base);
    let seed = |s: &str| {
        key(
            Some("t"),
            &format!(r#"{{"model":"m","temperature":0,"seed":{s},"messages":[]}}"#),
        )
    };
    assert_ne!(seed("0.5"), seed("0.25"));
    assert_eq!(seed("18446744073709551615"), seed("18446744073709551615"));
    // Integral but not exact: its value may have been rounded.
    let huge = r#"{"model":"m","temperature":0,"seed":1e300,"messages":[]}"#;
    assert_eq!(bypass(&HeaderMap::new(), huge), Some("number"));
}

#[test]
fn what_the_stored_answer_cannot_reproduce_is_not_cacheable() {
    let none = HeaderMap::new();
    let body = |field: &str| {
        format!(
            r#"{{"model":"m","temperature":0,{field},"messages":[{{"role":"user","content":"hi"}}]}}"#
        )
    };
    assert_eq!(
        bypass(&none, &body(r#""prompt_logprobs":0"#)),
        Some("logprobs")
    );
    assert_eq!(bypass(&none, &body(r#""prompt_logprobs":null"#)), None);
    assert_eq!(
        bypass(&none, &body(r#""return_token_ids":true"#)),
        Some("unreproducible")
    );
    assert_eq!(bypass(&none, &body(r#""return_token_ids":false"#)), None);
    assert_eq!(
        bypass(
            &none,
            &body(r#""kv_transfer_params":{"do_remote_decode":true}"#)
        ),
        Some("unreproducible")
    );
    // A rule's field far too long to be a flag is present, never parsed.
    let long = format!(r#""n":[{}0]"#, "0,".repeat(10_000));
    assert_eq!(bypass(&none, &body(&long)), Some("n"));
}

#[test]
fn a_repeated_key_or_an_object_too_wide_is_not_cacheable() {
    let none = HeaderMap::new();
    let twice = r#"{"model":"m","temperature":0,"max_tokens":1,"max_tokens":900,"messages":[]}"#;
    assert_eq!(bypass(&none, twice), Some("duplicate_key"));
    let nested =
        r#"{"model":"m","temperature":0,"messages":[{"role":"user","content":"a","content":"b"}]}"#;
    assert_eq!(bypass(&none, nested), Some("duplicate_key"));
    let members: Vec<String> = (0..=canon::MAX_MEMBERS)
        .map(|i| format!(r#""k{i}":0"#))
        .collect();
    let wide = format!(
        r#"{{"model":"m","temperature":0,"x":{{{}}},"messages":[]}}"#,
        members.join(",")
    );
    assert_eq!(bypass(&none, &wide), Some("members"));
}

#[test]
fn a_forwarded_credential_is_part_of_the_key() {
    let keyed = Keying {
        credentials: true,
        ..keying()
    };
    let with = |keying: &Keying, auth: Option<&'static str>| {
        let mut headers = HeaderMap::new();
        if let Some(a) = auth {
            headers.insert("authorization", HeaderValue::from_static(a));
        }
        match classify(
            keying,
            "/v1/chat/completions",
            &headers,
            None,
            CHAT.as_bytes(),
            no_roots,
        ) {
            Classified::Cacheable(c) => c.key,
            Classified::Bypass(r) => panic!("{r}"),
        }
    };
    let good = with(&keyed, Some("Bearer good"));
    assert_eq!(with(&keyed, Some("Bearer good")), good);
    assert_ne!(with(&keyed, Some("Bearer wrong")), good);
    assert_ne!(with(&keyed, None), good);
    assert_eq!(
        with(&keying(), Some("Bearer good")),
        with(&keying(), None),
        "not forwarded: not the engine's business"
    );
}

/// A JSON value with numbers written several ways and objects in any
/// order: what the canonical form must see through.
fn arb_json() -> impl Strategy<Value = serde_json::Value> {
    let leaf = prop_oneof![
        Just(serde_json::Value::Null),
        any::<bool>().prop_map(serde_json::Value::Bool),
        (-1000i64..1000).prop_map(serde_json::Value::from),
        (-1000i64..1000).prop_map(|n| serde_json::Value::from(n as f64 / 8.0)),
        "[a-c\\\\\"é]{0,4}".prop_map(serde_json::Value::String),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(serde_json::Value::Array),
            proptest::collection::btree_map("[a-d]{1,2}", inner, 0..4)
                .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
        ]
    })
}

/// `v` written with its objects' members reversed and whole numbers as
/// floats: the same value to an engine.
fn rewritten(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::Object(m) => {
            let members: Vec<String> = m
                .iter()
                .rev()
                .map(|(k, v)| format!("{}:{}", serde_json::Value::from(k.as_str()), rewritten(v)))
                .collect();
            format!("{{{}}}", members.join(","))
        }
        serde_json::Value::Array(a) => {
            format!(
                "[{}]",
                a.iter().map(rewritten).collect::<Vec<_>>().join(" , ")
            )
        }
        serde_json::Value::Number(n) if n.is_i64() => format!("{}.0", n),
        other => other.to_string(),
    }
}

/// `v` with every number a float: equal exactly when the values are.
fn numbers_as_floats(v: &serde_json::Value) -> serde_json::Value {
    match v {
        serde_json::Value::Number(n) => serde_json::Value::from(n.as_f64().unwrap()),
        serde_json::Value::Array(a) => a.iter().map(numbers_as_floats).collect(),
        serde_json::Value::Object(m) => serde_json::Value::Object(
            m.iter()
                .map(|(k, v)| (k.clone(), numbers_as_floats(v)))
                .collect(),
        ),
        other => other.clone(),
    }
}

proptest! {
    /// Two bodies get one key exactly when they are the same value.
    #[test]
    fn the_key_is_the_bodys_value(a in arb_json(), b in arb_json()) {
        let body = |v: &str| format!(r#"{{"model":"m","temperature":0,"x":{v}}}"#);
        let ka = key(None, &body(&a.to_string()));
        prop_assert_eq!(&key(None, &body(&rewritten(&a))), &ka);
        let kb = key(None, &body(&b.to_string()));
        prop_assert_eq!(numbers_as_floats(&a) == numbers_as_floats(&b), ka == kb, "{} {}", a, b);
    }
}
