//! The router end to end over real engine sims: routing, streaming,
//! retries, errors.

use std::time::Duration;

use crate::support::*;
use serde_json::{Value, json};

#[tokio::test]
async fn proxies_chat_and_names_the_endpoint() {
    let stack = Stack::start("basic", 2, true, |_| {}, |_| {}).await;
    let r = stack
        .post("/v1/chat/completions", chat(&long_text(1), "hi", 4))
        .await;
    assert_eq!(r.status(), 200);
    let endpoint = r.headers()["x-kvroute-endpoint"]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(endpoint.starts_with("sim-"));
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["usage"]["completion_tokens"], 4);
    let models = get_json(&stack.url("/v1/models")).await;
    assert_eq!(models["data"][0]["id"], "kvroute-sim");
    let ready = reqwest::get(stack.url("/readyz")).await.unwrap();
    assert_eq!(ready.status(), 200);
    stack.stop().await;
}

#[tokio::test]
async fn exact_mode_follows_the_cache_and_keeps_load_bounded() {
    let stack = Stack::start("exact", 4, true, |_| {}, |_| {}).await;
    stack.wait_live().await;
    let system = long_text(7);
    let holder = stack.warm(&system).await;
    for i in 0..6 {
        // Two other groups' requests between the group's: a third of the
        // traffic, a group one endpoint serves best (a prefix most of the
        // traffic carries is spread instead, see `shared_prefix.rs`).
        for other in 0..2 {
            let r = stack
                .post(
                    "/v1/chat/completions",
                    chat(&long_text(100 + 2 * i + other), "q", 1),
                )
                .await;
            assert_eq!(r.status(), 200);
        }
        let r = stack
            .post(
                "/v1/chat/completions",
                chat(&system, &format!("question {i}"), 2),
            )
            .await;
        assert_eq!(
            r.headers()["x-kvroute-endpoint"],
            holder.as_str(),
            "request {i}"
        );
        let body: Value = r.json().await.unwrap();
        let cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        let prompt = body["usage"]["prompt_tokens"].as_u64().unwrap();
        assert!(cached * 10 >= prompt * 9, "cached {cached} of {prompt}");
    }
    let metrics = stack.metrics().await;
    assert!(
        metrics.contains("kvroute_routing_decisions_total{reason=\"warm\"} 6"),
        "{metrics}"
    );
    // The engines' load reports reach the router (within their 100 ms
    // interval): the predicted queue and the reports' age are exported per
    // endpoint.
    let series = [
        format!("kvroute_endpoint_queue_seconds{{endpoint=\"{holder}\"}}"),
        format!("kvroute_endpoint_load_report_age_seconds{{endpoint=\"{holder}\"}}"),
    ];
    let started = std::time::Instant::now();
    loop {
        let metrics = stack.metrics().await;
        if series.iter().all(|s| metrics.contains(s.as_str())) {
            break;
        }
        assert!(
            started.elapsed() < std::time::Duration::from_secs(10),
            "{series:?} missing: {metrics}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    stack.stop().await;
}

#[tokio::test]
async fn salted_tenants_never_share_cached_blocks() {
    let dir = temp_dir("salted-secret");
    let secret = dir.join("secret");
    std::fs::write(&secret, "test-secret\n").unwrap();
    let stack = Stack::start(
        "salted",
        1,
        true,
        |_| {},
        |c| {
            c.tenancy.mode = kvroute_router::config::TenancyMode::Salted;
            c.tenancy.tenant_header = Some(kvroute_router::config::Header::from_static("x-tenant"));
            c.tenancy.secret_file = Some(secret.clone());
        },
    )
    .await;
    let ask = |tenant: Option<&'static str>, body: Value| {
        let mut r = stack
            .client
            .post(stack.url("/v1/chat/completions"))
            .json(&body);
        if let Some(t) = tenant {
            r = r.header("x-tenant", t);
        }
        async move {
            let r = r.send().await.unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap())
        }
    };
    let cached = |v: &Value| {
        v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
    };
    let body = chat(&long_text(3), "same question", 2);
    let (s, a1) = ask(Some("acme"), body.clone()).await;
    assert_eq!(s, 200);
    assert_eq!(cached(&a1), 0);
    let (_, a2) = ask(Some("acme"), body.clone()).await;
    assert!(cached(&a2) > 0, "within one tenant the prefix is shared");
    let (_, b1) = ask(Some("globex"), body.clone()).await;
    assert_eq!(cached(&b1), 0, "across tenants nothing is shared");
    let (s, e) = ask(None, body.clone()).await;
    assert_eq!(s, 401);
    assert_eq!(e["error"]["code"], "unauthenticated");
    let mut salted = body.clone();
    salted["cache_salt"] = json!("client-choice");
    let (s, e) = ask(Some("acme"), salted).await;
    assert_eq!(s, 400, "{e}");
    stack.stop().await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn a_hot_prefix_spills_instead_of_piling_up() {
    // Two sequences at a time: the rest wait in the engine's queue, which
    // its load reports show.
    let stack = Stack::start(
        "hot",
        4,
        true,
        |c| {
            c.itl_ms = 100.0;
            c.max_num_seqs = 2;
        },
        |_| {},
    )
    .await;
    stack.wait_live().await;
    let system = long_text(9);
    // Warm one endpoint first.
    stack
        .post("/v1/chat/completions", chat(&system, "warm", 1))
        .await;
    let mut tasks = Vec::new();
    for i in 0..16 {
        let client = stack.client.clone();
        let url = stack.url("/v1/chat/completions");
        let body = chat(&system, &format!("concurrent {i}"), 10);
        tasks.push(tokio::spawn(async move {
            let r = client.post(url).json(&body).send().await.unwrap();
            r.headers()["x-kvroute-endpoint"]
                .to_str()
                .unwrap()
                .to_owned()
        }));
        // Not a wait for anything: it staggers the arrivals, as concurrent
        // users' requests are, which is what this test sends.
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut per_endpoint = std::collections::BTreeMap::<String, u32>::new();
    for t in tasks {
        *per_endpoint.entry(t.await.unwrap()).or_default() += 1;
    }
    let max = *per_endpoint.values().max().unwrap();
    assert!(max < 16, "the bound spread the load: {per_endpoint:?}");
    assert!(per_endpoint.len() >= 2, "{per_endpoint:?}");
    stack.stop().await;
}

#[tokio::test]
async fn approximate_mode_follows_its_own_history() {
    // No WatchCache ports: the router remembers where it sent prefixes.
    let stack = Stack::start("approx", 4, false, |_| {}, |_| {}).await;
    let system = long_text(11);
    let first = stack
        .post("/v1/chat/completions", chat(&system, "one", 2))
        .await;
    let holder = first.headers()["x-kvroute-endpoint"]
        .to_str()
        .unwrap()
        .to_owned();
    for i in 0..4 {
        let r = stack
            .post("/v1/chat/completions", chat(&system, &format!("q{i}"), 2))
            .await;
        assert_eq!(r.headers()["x-kvroute-endpoint"], holder.as_str());
        let body: Value = r.json().await.unwrap();
        assert!(
            body["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap()
                > 0
        );
    }
    let metrics = stack.metrics().await;
    assert!(
        metrics.contains("kvroute_routing_decisions_total{reason=\"warm\"} 4"),
        "{metrics}"
    );
    assert!(metrics.contains("kvroute_watch_cache_stream{endpoint=\"sim-0\",state=\"none\"} 1"));
    stack.stop().await;
}

#[tokio::test]
async fn exact_mode_with_a_hugging_face_tokenizer_and_chat_template() {
    let fixtures =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../core/tests/fixtures/tokenize");
    // The word-level fixture with ChatML's markers as special tokens, as a
    // Qwen tokenizer has them.
    let mut json: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures.join("wordlevel.tokenizer.json")).unwrap(),
    )
    .unwrap();
    for (id, content) in [(9, "<|im_start|>"), (10, "<|im_end|>")] {
        json["added_tokens"].as_array_mut().unwrap().push(json!({
            "id": id, "content": content, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true
        }));
        json["model"]["vocab"][content] = json!(id);
    }
    let tokenizer =
        std::env::temp_dir().join(format!("kvroute-chatml-{}.json", std::process::id()));
    std::fs::write(&tokenizer, json.to_string()).unwrap();
    let template = fixtures.join("qwen2.5-instruct.tokenizer_config.json");
    let written = tokenizer.clone();
    let (t1, c1) = (tokenizer.clone(), template.clone());
    let stack = Stack::start(
        "hf",
        3,
        true,
        move |c| {
            c.tokenizer = Some(t1.clone());
            c.tokenizer_config = Some(c1.clone());
        },
        move |c| {
            c.routing.tokenizer = Some(tokenizer);
            c.routing.tokenizer_config = Some(template);
        },
    )
    .await;
    stack.wait_live().await;
    let system = long_text(5);
    let holder = stack.warm(&system).await;
    let r = stack
        .post("/v1/chat/completions", chat(&system, "hello again", 2))
        .await;
    assert_eq!(r.headers()["x-kvroute-endpoint"], holder.as_str());
    let metrics = stack.metrics().await;
    assert!(
        metrics.contains("kvroute_routing_decisions_total{reason=\"warm\"} 1"),
        "the router's chain matched the engine's blocks: {metrics}"
    );
    // A conversation: its second turn resumes the first's rendered prompt
    // and still matches the engine's blocks.
    let mut turn = chat(&system, "hello again", 2);
    turn["prompt_cache_key"] = json!("c-1");
    let r = stack.post("/v1/chat/completions", turn.clone()).await;
    assert_eq!(r.status(), 200);
    turn["messages"].as_array_mut().unwrap().extend([
        json!({"role": "assistant", "content": "hello"}),
        json!({"role": "user", "content": "world"}),
    ]);
    let r = stack.post("/v1/chat/completions", turn).await;
    assert_eq!(r.headers()["x-kvroute-endpoint"], holder.as_str());
    let metrics = stack.metrics().await;
    for (result, n) in [("miss", 1), ("hit", 1)] {
        assert_eq!(
            sum_of(
                &metrics,
                &format!("kvroute_conversation_prompts_total{{result=\"{result}\"}}")
            ),
            f64::from(n),
            "{metrics}"
        );
    }
    assert!(
        metrics.contains("kvroute_routing_decisions_total{reason=\"warm\"} 3"),
        "{metrics}"
    );
    let _ = std::fs::remove_file(&written);
    stack.stop().await;
}

#[tokio::test]
async fn headers_pass_through_and_traceparent_is_untouched_without_tracing() {
    let (upstream, mut heads) = recording_upstream().await;
    let dir = upstream_dir("passthrough", upstream);
    let router = kvroute_router::start(router_config(&dir)).await.unwrap();
    let parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let body = r#"{"prompt":  "spaced   exactly", "extra": [1, 2]}"#;
    let r = reqwest::Client::new()
        .post(format!("http://{}/v1/completions", router.addr()))
        .header("traceparent", parent)
        .header("x-custom", "kept")
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let head = next_post(&mut heads).await;
    assert_eq!(header_of(&head, "traceparent").as_deref(), Some(parent));
    assert_eq!(header_of(&head, "x-custom").as_deref(), Some("kept"));
    assert!(
        head.ends_with(body),
        "the body is forwarded byte for byte: {head}"
    );
    router.shutdown().await;
}

/// `kvroute_expected_cached_tokens_total` now, over every series.
async fn expected_cached(stack: &Stack) -> f64 {
    sum_of(
        &stack.metrics().await,
        "kvroute_expected_cached_tokens_total",
    )
}

#[tokio::test]
async fn requests_naming_a_lora_adapter_hit_its_blocks() {
    let stack = Stack::start(
        "lora",
        3,
        true,
        |c| c.lora_modules = vec![kvroute_core::hash::Lora::new("sql-lora", "/adapters/sql")],
        |_| {},
    )
    .await;
    stack.wait_live().await;
    let models = get_json(&stack.url("/v1/models")).await;
    assert_eq!(models["data"][1]["id"], "sql-lora");
    assert_eq!(models["data"][1]["parent"], "kvroute-sim");

    let system = long_text(11);
    let mut body = chat(&system, "first", 2);
    body["model"] = json!("sql-lora");
    let before = stack.router.pool.index_entries();
    let r = stack.post("/v1/chat/completions", body.clone()).await;
    assert_eq!(r.status(), 200);
    let holder = r.headers()["x-kvroute-endpoint"].clone();
    eventually("the adapter's blocks are indexed", || {
        stack.router.pool.index_entries() > before
    })
    .await;

    // The same prompt through the adapter: the router expects the blocks
    // the engine then reports cached.
    let expected = expected_cached(&stack).await;
    let r = stack.post("/v1/chat/completions", body.clone()).await;
    assert_eq!(r.headers()["x-kvroute-endpoint"], holder);
    let usage = r.json::<Value>().await.unwrap()["usage"].clone();
    let cached = usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached * 10 >= usage["prompt_tokens"].as_u64().unwrap() * 9);
    assert_eq!(expected_cached(&stack).await - expected, cached as f64);

    // Through the base model the adapter's blocks are no hit, for the
    // engine and for the router alike.
    body["model"] = json!("kvroute-sim");
    let expected = expected_cached(&stack).await;
    let r = stack.post("/v1/chat/completions", body).await;
    let usage = r.json::<Value>().await.unwrap()["usage"].clone();
    assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(expected_cached(&stack).await, expected);
    stack.stop().await;
}
