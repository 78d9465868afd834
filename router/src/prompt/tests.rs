//! The prompt reader and the salt rule over arbitrary bodies.

use std::sync::atomic::{AtomicUsize, Ordering};

use proptest::prelude::*;
use serde_json::{Value, json};

use super::*;
use crate::config::{self, ClientSalt, TenancyMode};

/// [`read_whole`], as the tests call it.
use super::read_whole as analyze;

/// [`read`] of a chat resuming a conversation with at most `within` new
/// body bytes.
fn analyze_resumed(
    bytes: Bytes,
    input: Input,
    tenancy: &Tenancy,
    settings: &Settings,
    models: &ModelList,
    conversations: &Conversations,
    within: usize,
) -> Result<Option<Analysis>, ApiError> {
    let input = Input {
        scope: Scope::ResumedWithin(within),
        ..input
    };
    read(bytes, input, tenancy, settings, models, conversations)
}

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

fn conversations() -> Conversations {
    Conversations::new(Default::default())
}

/// JSON values biased toward what the parser looks at.
pub(crate) fn value() -> impl Strategy<Value = Value> {
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
        let input = Input { api, tenant: Some("acme".into()), conversation: None, reader: Reader::Tokens, scope: Scope::Whole, held: None };
        match analyze(Bytes::from(body), input, &t, &s, &ModelList::default(), &conversations()) {
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
        let input = Input { api, tenant: None, conversation: None, reader: Reader::Tokens, scope: Scope::Whole, held: None };
        match analyze(Bytes::from(body.clone()), input, &t, &s, &ModelList::default(), &conversations()) {
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
        let parsed = body::parse(api, &body, false);
        let scanned = body::scan(api, &body, false).map(|s| s.map(|s| s.fields));
        match (parsed, scanned) {
            (Ok(p), Ok(s)) => {
                let f = |o: Option<serde_json::Map<String, Value>>| {
                    o.as_ref().map(body::features).transpose().map(|f| f.map(|f| format!("{f:?}"))).map_err(|e| e.to_string())
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
    let input = |s: &Settings| Input {
        api: Api::Chat,
        tenant: None,
        conversation: None,
        reader: Reader::of(s, true, 0, usize::MAX),
        scope: Scope::KeepTokens,
        held: None,
    };
    let bytes = Bytes::from(body.to_string());
    let a = analyze(
        bytes.clone(),
        input(&s),
        &t,
        &s,
        &ModelList::default(),
        &conversations(),
    )
    .unwrap();
    assert!(a.readable && !a.tokenized);
    assert!(a.chain.is_empty() && a.tokens.is_empty());
    assert_eq!(a.model.as_deref(), Some("m"));
    assert_eq!(a.prompt_tokens, bytes.len() as u64 / 4);
    // The default policy reads the prompt.
    let a = analyze(
        bytes,
        input(&Settings::test()),
        &t,
        &Settings::test(),
        &ModelList::default(),
        &conversations(),
    )
    .unwrap();
    assert!(a.readable && a.tokenized && !a.chain.is_empty());
    // The scan still refuses what is not an object, and mistyped fields.
    for bad in [&b"[1]"[..], b"{\"stream\": 1}", b"{\"model\": "] {
        let e = analyze(
            Bytes::from_static(bad),
            input(&s),
            &t,
            &s,
            &ModelList::default(),
            &conversations(),
        )
        .unwrap_err();
        assert_eq!(e.status().as_u16(), 400, "{e}");
    }
}

/// A chat body (keys in serde_json's sorted order: `messages` first, so a
/// longer history starts with the shorter one's bytes).
fn chat(messages: &[(String, String)], conversation: &str) -> Bytes {
    let messages: Vec<Value> = messages
        .iter()
        .map(|(role, content)| json!({"role": role, "content": content}))
        .collect();
    let body = json!({"messages": messages, "model": "m", "prompt_cache_key": conversation});
    Bytes::from(body.to_string())
}

/// [`chat`] of conversation `c`, with `cache_salt` when given.
fn salted_chat(messages: &[(String, String)], salt: Option<&str>) -> Value {
    let mut body: Value = serde_json::from_slice(&chat(messages, "c")).unwrap();
    if let Some(salt) = salt {
        body["cache_salt"] = json!(salt);
    }
    body
}

fn chat_input() -> Input {
    Input {
        api: Api::Chat,
        tenant: None,
        conversation: None,
        reader: Reader::Tokens,
        scope: Scope::Whole,
        held: None,
    }
}

proptest! {
    /// Each turn of a growing conversation resumes the previous one and
    /// computes exactly what a whole computation does.
    #[test]
    fn resumed_conversations_equal_whole_ones(
        turns in proptest::collection::vec(("(user|assistant|system)", "[a-z \\n\"é日🦀]{0,40}"), 1..6),
        salt in proptest::option::of("[a-z]{1,4}"),
        exact in any::<bool>(),
    ) {
        let reader = if exact { Reader::Tokens } else { Reader::Chunks };
        let chat_input = || Input { reader, ..chat_input() };
        let t = tenancy(TenancyMode::Shared, ClientSalt::Reject);
        let s = Settings::test();
        let shared = conversations();
        for n in 1..=turns.len() {
            let mut body = salted_chat(&turns[..n], salt.as_deref());
            let bytes = Bytes::from(body.to_string());
            let a = analyze(bytes.clone(), chat_input(), &t, &s, &ModelList::default(), &shared).unwrap();
            let whole = analyze(bytes.clone(), chat_input(), &t, &s, &ModelList::default(), &conversations()).unwrap();
            prop_assert_eq!(a.memo, Some(if n == 1 { Memo::Miss } else { Memo::Hit }));
            prop_assert_eq!(whole.memo, Some(Memo::Miss));
            body.as_object_mut().unwrap().remove("prompt_cache_key");
            let keyless = analyze(Bytes::from(body.to_string()), chat_input(), &t, &s, &ModelList::default(), &shared).unwrap();
            prop_assert_eq!(keyless.memo, None);
            prop_assert_eq!(&keyless.chain, &a.chain);
            // The full parse computes the same prompt.
            let mut obj = body::parse(Api::Chat, &bytes, false).unwrap().unwrap();
            let extras = BlockExtras { lora: None, cache_salt: salt.as_deref() };
            let parsed = if exact {
                tokens::prompt(Api::Chat, &mut obj, &s, extras, false, None)
            } else {
                chunks::prompt(Api::Chat, &mut obj, &s, extras)
            };
            let parsed = parsed.unwrap().unwrap();
            for x in [&a, &whole] {
                prop_assert_eq!(&x.chain, &parsed.chain);
                prop_assert_eq!(x.prompt_tokens, parsed.tokens);
                prop_assert_eq!(&x.contents, &parsed.contents);
                prop_assert_eq!(x.key, a.key);
            }
        }
    }
}

/// A byte-level BPE with ChatML's special tokens, trained here (no model
/// can be downloaded), and Qwen2.5's chat template.
fn hf_settings() -> Settings {
    use tokenizers::models::TrainerWrapper;
    use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    static JSON: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    let json = JSON.get_or_init(|| {
        let specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
        let mut trainer = TrainerWrapper::BpeTrainer(
            BpeTrainerBuilder::new()
                .vocab_size(600)
                .show_progress(false)
                .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
                .special_tokens(
                    specials
                        .iter()
                        .map(|t| tokenizers::AddedToken::from(*t, true))
                        .collect(),
                )
                .build(),
        );
        let mut tokenizer = tokenizers::Tokenizer::new(BPE::default());
        tokenizer.with_pre_tokenizer(Some(ByteLevel::default()));
        let corpus = (0..400).map(|i| {
            format!("the cache holds block {i} of the prompt, and the router routes it there\n")
        });
        tokenizer.train(&mut trainer, corpus).unwrap();
        tokenizer.to_string(false).unwrap()
    });
    const QWEN: &str = include_str!(
        "../../../core/tests/fixtures/tokenize/qwen2.5-instruct.tokenizer_config.json"
    );
    let mut s = Settings::test();
    s.tokenizer =
        Arc::new(kvroute_core::tokenize::Tokenizer::from_tokenizer_json(json.as_bytes()).unwrap());
    s.template = Arc::new(
        kvroute_core::tokenize::ChatTemplate::from_tokenizer_config(QWEN.as_bytes()).unwrap(),
    );
    s
}

proptest! {
    /// With a model's tokenizer and template, each turn of a growing
    /// conversation resumes the previous one's rendered prompt and computes
    /// exactly what a whole computation does.
    #[test]
    fn rendered_conversations_equal_whole_ones(
        turns in proptest::collection::vec(
            ("(user|assistant|system)", "([a-z \n\"é日🦀]|<\\|im_start\\|>|<\\|im_end\\|>){0,40}"),
            1..6,
        ),
        salt in proptest::option::of("[a-z]{1,4}"),
    ) {
        let t = tenancy(TenancyMode::Shared, ClientSalt::Reject);
        let s = hf_settings();
        let shared = conversations();
        for n in 1..=turns.len() {
            let mut body = salted_chat(&turns[..n], salt.as_deref());
            let bytes = Bytes::from(body.to_string());
            let run = |bytes: Bytes, c: &Conversations| {
                let input = Input { reader: Reader::Rendered, ..chat_input() };
                analyze(bytes, input, &t, &s, &ModelList::default(), c).unwrap()
            };
            let a = run(bytes.clone(), &shared);
            let whole = run(bytes, &conversations());
            prop_assert_eq!(a.memo, Some(if n == 1 { Memo::Miss } else { Memo::Hit }));
            prop_assert_eq!(whole.memo, Some(Memo::Miss));
            body.as_object_mut().unwrap().remove("prompt_cache_key");
            let keyless = run(Bytes::from(body.to_string()), &shared);
            prop_assert_eq!(keyless.memo, None);
            prop_assert!(keyless.prompt_tokens > 0);
            for x in [&a, &whole] {
                prop_assert_eq!(&x.chain, &keyless.chain);
                prop_assert_eq!(x.prompt_tokens, keyless.prompt_tokens);
                prop_assert_eq!(&x.contents, &keyless.contents);
            }
        }
    }
}

#[test]
fn an_edited_history_or_another_conversation_misses() {
    let t = tenancy(TenancyMode::Shared, ClientSalt::Reject);
    let s = Settings::test();
    let cache = conversations();
    let turn = |role: &str, text: &str| (role.to_owned(), text.to_owned());
    let history = vec![turn("system", "Be brief."), turn("user", "Hi")];
    let run = |body: Bytes| {
        analyze(body, chat_input(), &t, &s, &ModelList::default(), &cache)
            .unwrap()
            .memo
    };
    assert_eq!(run(chat(&history, "c")), Some(Memo::Miss));
    let mut next = history.clone();
    next.extend([turn("assistant", "Hello."), turn("user", "More")]);
    assert_eq!(run(chat(&next, "c")), Some(Memo::Hit));
    // The same turn again: resumed too.
    assert_eq!(run(chat(&next, "c")), Some(Memo::Hit));
    // An edited first message: computed whole.
    let mut edited = next.clone();
    edited[0].1 = "Be long.".into();
    assert_eq!(run(chat(&edited, "c")), Some(Memo::Miss));
    // Another conversation key with the same history: its own entry.
    assert_eq!(run(chat(&next, "d")), Some(Memo::Miss));
    // A shorter history than remembered: computed whole.
    assert_eq!(run(chat(&history, "c")), Some(Memo::Miss));
    // No conversation key: nothing remembered.
    let body = json!({"messages": [{"role": "user", "content": "x"}]}).to_string();
    assert_eq!(run(Bytes::from(body)), None);
}

#[test]
fn only_a_short_resumption_is_analyzed_inline() {
    let t = tenancy(TenancyMode::Shared, ClientSalt::Reject);
    let s = Settings::test();
    let cache = conversations();
    let turn = |role: &str, text: &str| (role.to_owned(), text.to_owned());
    let within = |body: &Bytes, n: usize| {
        let m = ModelList::default();
        analyze_resumed(body.clone(), chat_input(), &t, &s, &m, &cache, n).unwrap()
    };
    let history = vec![
        turn("system", &"long context ".repeat(2000)),
        turn("user", "Hi"),
    ];
    // Not seen yet: left for the pool, and nothing remembered.
    assert!(within(&chat(&history, "c"), 1 << 14).is_none());
    assert_eq!(
        analyze(
            chat(&history, "c"),
            chat_input(),
            &t,
            &s,
            &ModelList::default(),
            &cache
        )
        .unwrap()
        .memo,
        Some(Memo::Miss)
    );
    let mut next = history.clone();
    next.extend([turn("assistant", "Hello."), turn("user", "More")]);
    let body = chat(&next, "c");
    let inline = within(&body, 1 << 14).expect("a short follow-up is analyzed");
    assert_eq!(inline.memo, Some(Memo::Hit));
    let whole = analyze(
        body.clone(),
        chat_input(),
        &t,
        &s,
        &ModelList::default(),
        &conversations(),
    )
    .unwrap();
    assert_eq!(
        (&inline.chain, inline.prompt_tokens),
        (&whole.chain, whole.prompt_tokens)
    );
    // More new bytes than allowed, another conversation, no key: the pool.
    assert!(within(&body, 10).is_none());
    assert!(within(&chat(&next, "d"), 1 << 14).is_none());
    let keyless = json!({"messages": [{"role": "user", "content": "x"}]}).to_string();
    assert!(within(&Bytes::from(keyless), 1 << 14).is_none());
    // Approximate mode keeps snapshots of its own.
    let approx = || Input {
        reader: Reader::Chunks,
        ..chat_input()
    };
    let m = ModelList::default();
    let resumed = |body: &Bytes| {
        analyze_resumed(body.clone(), approx(), &t, &s, &m, &cache, 1 << 14).unwrap()
    };
    assert!(resumed(&body).is_none());
    let first = analyze(chat(&history, "c"), approx(), &t, &s, &m, &cache).unwrap();
    assert_eq!(first.memo, Some(Memo::Miss));
    let inline = resumed(&body).expect("a short follow-up is analyzed");
    assert_eq!(inline.memo, Some(Memo::Hit));
    let whole = analyze(body.clone(), approx(), &t, &s, &m, &conversations()).unwrap();
    assert_eq!(
        (&inline.chain, inline.prompt_tokens),
        (&whole.chain, whole.prompt_tokens)
    );
    assert_ne!(inline.chain, within(&body, 1 << 14).unwrap().chain);
}

#[test]
fn conversations_are_bounded() {
    let t = tenancy(TenancyMode::Shared, ClientSalt::Reject);
    let s = Settings::test();
    let evictions = prometheus_client::metrics::counter::Counter::default();
    let cache = Conversations::new(evictions.clone());
    let history = vec![("user".to_owned(), "Hello there".to_owned())];
    let n = conversations::MAX_CONVERSATIONS + 10;
    for i in 0..n {
        let body = chat(&history, &format!("c{i}"));
        analyze(body, chat_input(), &t, &s, &ModelList::default(), &cache).unwrap();
    }
    assert_eq!(evictions.get(), 10);
    // The oldest were forgotten, the newest kept.
    let memo = |i: usize| {
        analyze(
            chat(&history, &format!("c{i}")),
            chat_input(),
            &t,
            &s,
            &ModelList::default(),
            &cache,
        )
        .unwrap()
        .memo
    };
    assert_eq!(memo(n - 1), Some(Memo::Hit));
    assert_eq!(memo(0), Some(Memo::Miss));
}

#[test]
fn approximate_mode_chunks_the_text_without_tokenizing() {
    let t = tenancy(TenancyMode::Shared, ClientSalt::Reject);
    let s = Settings::test();
    let approx = || Input {
        reader: Reader::Chunks,
        ..chat_input()
    };
    let turn = |role: &str, text: &str| (role.to_owned(), text.to_owned());
    let system = turn("system", &"You route requests. ".repeat(40));
    let one = chat(&[system.clone(), turn("user", &"Hi ".repeat(50))], "c");
    let two = chat(&[system.clone(), turn("user", &"Bye ".repeat(40))], "c");
    let run = |body: &Bytes| {
        analyze(
            body.clone(),
            approx(),
            &t,
            &s,
            &ModelList::default(),
            &conversations(),
        )
        .unwrap()
    };
    let (a, b) = (run(&one), run(&two));
    assert!(a.readable && !a.tokenized && a.memo == Some(Memo::Miss));
    // 4 bytes a pseudo-token, 16 a block: the system prompt's 800 bytes and
    // its role make 12 full blocks, the same in both.
    let text = "system\n".len() + system.1.len() + 1 + "user\n\0".len() + 150;
    assert_eq!(a.prompt_tokens, text.div_ceil(4) as u64);
    assert_eq!(a.chain.len(), text / 64);
    assert_eq!(a.chain[..12], b.chain[..12]);
    assert_ne!(a.chain[12], b.chain[12]);
    assert_eq!(a.contents.len(), a.chain.len());
    // The parsed-body path (salted tenancy) reads the same text.
    let salted = tenancy(TenancyMode::Salted, ClientSalt::Reject);
    let input = Input {
        tenant: Some("acme".into()),
        ..approx()
    };
    let c = analyze(
        one.clone(),
        input,
        &salted,
        &s,
        &ModelList::default(),
        &conversations(),
    )
    .unwrap();
    assert_eq!(c.prompt_tokens, a.prompt_tokens);
    // Another salt: another chain.
    assert_ne!(c.chain[0], a.chain[0]);
}
