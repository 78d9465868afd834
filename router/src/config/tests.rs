use super::*;

#[test]
fn an_empty_file_is_the_defaults() {
    let c: Config = serde_yaml::from_str("{}").unwrap();
    assert_eq!(c, Config::default());
    c.validate().unwrap();
}

#[test]
fn a_full_file_parses() {
    let yaml = r#"
listen: 127.0.0.1:8080
adminListen: 127.0.0.1:9090
discovery:
  operator: {url: "http://op:9443", namespace: ml, pool: llama}
routing:
  policy: {name: kvroute, latencySlack: 2, engine: {prefillTokensPerSecond: 20000}}
  key: {mode: prefix, prefixTokens: 128}
  blockSize: 32
  hashAlgo: sha256_cbor
  hashSeed: "0"
tenancy:
  mode: salted
  tenantHeader: x-tenant
  secretFile: /secrets/salt
  clientSalt: overwrite
limits: {maxBodyBytes: 1024}
resilience: {attempts: 2}
telemetry: {logFormat: json, endpointHeader: ""}
"#;
    let c: Config = serde_yaml::from_str(yaml).unwrap();
    c.validate().unwrap();
    assert_eq!(c.routing.block_size, 32);
    assert_eq!(c.tenancy.client_salt, ClientSalt::Overwrite);
    assert!(matches!(c.discovery, Discovery::Operator(_)));
}

#[test]
fn operator_urls_fail_over_in_order_and_need_one() {
    let parse = |discovery: &str| {
        let c: Config =
            serde_yaml::from_str(&format!("discovery:\n  operator: {discovery}\n")).unwrap();
        c.validate().map(|()| c)
    };
    let c = parse("{url: http://a:9443, urls: [http://b:9443], namespace: ml, pool: p}").unwrap();
    let Discovery::Operator(o) = &c.discovery else {
        panic!("operator discovery")
    };
    assert_eq!(o.all_urls(), ["http://a:9443", "http://b:9443"]);
    assert!(parse("{urls: [http://b:9443], namespace: ml, pool: p}").is_ok());
    let none = parse("{namespace: ml, pool: p}").unwrap_err().to_string();
    assert!(none.contains("discovery.operator.url"), "{none}");
    let tls = parse("{urls: [http://a:9443, https://b:9443], namespace: ml, pool: p}")
        .unwrap_err()
        .to_string();
    assert!(tls.contains("https://b:9443"), "{tls}");
}

#[test]
fn header_names_are_checked_while_parsing() {
    for (yaml, field) in [
        (
            "tenancy: {tenantHeader: 'x tenant'}",
            "tenancy: \"x tenant\"",
        ),
        ("routing: {conversationHeader: 'a:b'}", "routing: \"a:b\""),
    ] {
        let err = serde_yaml::from_str::<Config>(yaml)
            .unwrap_err()
            .to_string();
        assert!(err.starts_with(field), "{err}");
        assert!(err.contains("is not a valid header name"), "{err}");
    }
    let c: Config = serde_yaml::from_str("tenancy: {tenantHeader: X-Tenant}").unwrap();
    assert_eq!(
        c.tenancy.tenant_header,
        Some(Header::from_static("x-tenant"))
    );
}

#[test]
fn salted_header_tenancy_needs_a_trusted_picker() {
    let base = "tenancy: {mode: salted, tenantHeader: x-t, secretFile: s}\n";
    let parse = |picker: &str| {
        let c: Config = serde_yaml::from_str(&format!("{base}extProc: {picker}")).unwrap();
        c.validate().map_err(|e| e.to_string())
    };
    let err = parse("{listen: '127.0.0.1:9002'}").unwrap_err();
    assert!(err.starts_with("extProc.trustedNetwork: "), "{err}");
    assert!(err.contains("tenancy.tenantHeader"), "{err}");
    parse("{listen: '127.0.0.1:9002', trustedNetwork: true}").unwrap();
    parse("{listen: '127.0.0.1:9002', tls: {certFile: c, keyFile: k, clientCaFile: ca}}").unwrap();
    // Without a picker, the API port's rule stands (an authenticating
    // gateway sets the header).
    let c: Config = serde_yaml::from_str(base).unwrap();
    c.validate().unwrap();
}

#[test]
fn discovery_is_one_source() {
    let c: Config = serde_yaml::from_str("discovery: {static: {file: e.yaml}}").unwrap();
    assert_eq!(
        c.discovery,
        Discovery::Static(StaticDiscovery::file("e.yaml".into()))
    );
    for two in [
        "discovery: {static: {file: e.yaml}, operator: {url: 'http://o', namespace: n, pool: p}}",
        "discovery: {}",
    ] {
        let err = serde_yaml::from_str::<Config>(two).unwrap_err().to_string();
        assert!(
            err.starts_with("discovery: set exactly one of static and operator"),
            "{two}: {err}"
        );
    }
}

#[test]
fn errors_name_the_field_and_value() {
    let err = serde_yaml::from_str::<Config>("routing: {blockSzie: 16}")
        .unwrap_err()
        .to_string();
    assert!(err.contains("blockSzie"), "{err}");
    let c: Config = serde_yaml::from_str("routing: {blockSize: 0}").unwrap();
    let err = c.validate().unwrap_err().to_string();
    assert_eq!(
        err,
        "routing.blockSize: must be 1 to 4096 (the engines' block size in tokens) (got 0)"
    );
    let c: Config = serde_yaml::from_str("limits: {apiThreads: 5000}").unwrap();
    let err = c.validate().unwrap_err().to_string();
    assert_eq!(
        err,
        "limits.apiThreads: must be at most 1024 (0: one per CPU) (got 5000)"
    );
    let c: Config = serde_yaml::from_str("limits: {apiThreads: 3}").unwrap();
    assert_eq!(c.limits.api_threads(), 3);
    assert!(Config::default().limits.api_threads() >= 1);
    let c: Config = serde_yaml::from_str("tenancy: {mode: salted, tenantHeader: x-t}").unwrap();
    assert!(
        c.validate()
            .unwrap_err()
            .to_string()
            .starts_with("tenancy.secretFile")
    );
    let c: Config =
        serde_yaml::from_str("routing: {policy: {name: kvroute, latencySlack: -1}}").unwrap();
    let err = c.validate().unwrap_err().to_string();
    assert_eq!(
        err,
        "routing.policy: latencySlack must be 0 or more, got -1"
    );
    let c: Config = serde_yaml::from_str("routing: {slowStartSeconds: 3601}").unwrap();
    let err = c.validate().unwrap_err().to_string();
    assert!(err.starts_with("routing.slowStartSeconds"), "{err}");
    assert!(err.contains("3601"), "{err}");
    let err = serde_yaml::from_str::<Config>("telemetry: {endpointHeader: 'bad header'}")
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("telemetry: \"bad header\" is not a valid header name"),
        "{err}"
    );
    let off: Config = serde_yaml::from_str("telemetry: {endpointHeader: ''}").unwrap();
    assert_eq!(off.telemetry.endpoint_header, OptionalHeader(None));
}

#[test]
fn the_hang_deadline_settings_are_checked() {
    for (yaml, err) in [
        (
            "resilience: {hungAfterMs: 0}",
            "resilience.hungAfterMs: must be 1 to 86400000 (one day) (got 0)",
        ),
        (
            "resilience: {hungTtftMultiple: 0.5}",
            "resilience.hungTtftMultiple: must be a number of at least 1 (got 0.5)",
        ),
    ] {
        let c: Config = serde_yaml::from_str(yaml).unwrap();
        assert_eq!(c.validate().unwrap_err().to_string(), err);
    }
}

/// The error a file gets, whether parsing or validation finds it.
fn error_of(yaml: &str) -> String {
    match serde_yaml::from_str::<Config>(yaml) {
        Ok(c) => c
            .validate()
            .map_or_else(|e| e.to_string(), |()| "valid".into()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn every_duration_and_count_is_in_range() {
    let cases = [
        (
            "discovery: {static: {file: e.yaml, reloadMs: 0}}",
            "discovery.static.reloadMs: must be 1 to 86400000 (one day) (got 0)",
        ),
        (
            "discovery: {static: {file: e.yaml, reloadMs: 18446744073709551615}}",
            "discovery.static.reloadMs: must be 1 to 86400000 (one day) (got 18446744073709551615)",
        ),
        (
            "limits: {queueTimeoutMs: 5000}",
            "limits.queueTimeoutMs was replaced by flowControl.maxWaitMs: see docs/configuration.md, flow control",
        ),
        (
            "limits: {queueSize: 0}",
            "limits.queueSize was replaced by flowControl.maxQueued: see docs/configuration.md, flow control",
        ),
        (
            "flowControl: {maxWaitMs: 0}",
            "flowControl.maxWaitMs: must be 1 to 86400000 (one day) (got 0)",
        ),
        (
            "flowControl: {reserveWindowMs: 86400001}",
            "flowControl.reserveWindowMs: must be 0 to 86400000 (one day) (got 86400001)",
        ),
        (
            "flowControl: {holdAboveMs: -1}",
            "flowControl.holdAboveMs: must be 0 to 86400000 (one day) (got -1)",
        ),
        (
            "flowControl: {bands: [{priority: 1, maxWaitMs: 10}, {priority: 1, maxWaitMs: 20}]}",
            "flowControl.bands[1].priority: is named by an earlier band (got 1)",
        ),
        (
            "flowControl: {bands: [{priority: 1, maxWaitMs: 86400001}]}",
            "flowControl.bands[0].maxWaitMs: must be 1 to 86400000 (one day) (got 86400001)",
        ),
        (
            "objectives: [{name: chat, priority: 1}, {name: chat, priority: 2}]",
            "objectives[1].name: is named by an earlier objective (got chat)",
        ),
        (
            "limits: {retryAfterS: 18446744073709551615}",
            "limits.retryAfterS: must be at most one day (got 18446744073709551615)",
        ),
        (
            "limits: {connectTimeoutMs: 0}",
            "limits.connectTimeoutMs: must be 1 to 86400000 (one day) (got 0)",
        ),
        (
            "limits: {firstByteTimeoutMs: 0}",
            "limits.firstByteTimeoutMs: must be 1 to 86400000 (one day) (got 0)",
        ),
        (
            "limits: {tokenizeQueue: 0}",
            "limits.tokenizeQueue: must be at least 1 (got 0)",
        ),
        (
            "limits: {maxTokenizeBytes: 0}",
            "limits.maxTokenizeBytes: must be at least 1 (got 0)",
        ),
        (
            "resilience: {ejectionBaseMs: 0}",
            "resilience.ejectionBaseMs: must be 1 to 86400000 (one day) (got 0)",
        ),
        (
            "resilience: {ejectionBaseMs: 10000, ejectionMaxMs: 5000}",
            "resilience.ejectionMaxMs: must be at least resilience.ejectionBaseMs (got 5000)",
        ),
        (
            "resilience: {healthCheck: {intervalMs: 0}}",
            "resilience.healthCheck.intervalMs: must be 1 to 86400000 (one day) (got 0)",
        ),
        (
            "resilience: {healthCheck: {timeoutMs: 0}}",
            "resilience.healthCheck.timeoutMs: must be 1 to 86400000 (one day) (got 0)",
        ),
        (
            "resilience: {healthCheck: {unhealthyThreshold: 0}}",
            "resilience.healthCheck.unhealthyThreshold: must be at least 1 (got 0)",
        ),
        (
            "extProc: {idleTimeoutMs: 0}",
            "extProc.idleTimeoutMs: must be 1 to 86400000 (one day) (got 0)",
        ),
        (
            "routing: {blockSize: 4294967295}",
            "routing.blockSize: must be 1 to 4096 (the engines' block size in tokens) (got 4294967295)",
        ),
        (
            "routing: {blockSize: 4097}",
            "routing.blockSize: must be 1 to 4096 (the engines' block size in tokens) (got 4097)",
        ),
    ];
    for (yaml, error) in cases {
        assert_eq!(error_of(yaml), error, "{yaml}");
    }
    for fine in [
        "discovery: {static: {file: e.yaml, reloadMs: 1}}",
        "limits: {retryAfterS: 0}",
        "flowControl: {enabled: false, holdAboveMs: 0, maxQueued: 0, bands: [{priority: -1, maxWaitMs: 1}]}",
        "objectives: [{name: chat, priority: 10, tenants: [a]}, {name: batch, priority: -1}]",
        "routing: {blockSize: 4096}",
        "resilience: {healthCheck: null, ejectionBaseMs: 86400000, ejectionMaxMs: 86400000}",
    ] {
        assert_eq!(error_of(fine), "valid", "{fine}");
    }
}

#[test]
fn urls_must_be_http_urls_with_a_host() {
    let op =
        |url: &str| format!("discovery: {{operator: {{url: '{url}', namespace: ml, pool: p}}}}");
    assert_eq!(
        error_of(&op("not a url")),
        "discovery.operator.url: is not an http(s) URL with a host (got \"not a url\")"
    );
    for bad in ["kvroute-operator:9443", "ftp://op:9443", "http://"] {
        let err = error_of(&op(bad));
        assert!(
            err.starts_with("discovery.operator.url: is not an http(s) URL"),
            "{bad}: {err}"
        );
    }
    assert_eq!(
        error_of(
            "discovery: {operator: {url: 'http://a:1', urls: [nope], namespace: ml, pool: p}}"
        ),
        "discovery.operator.urls: is not an http(s) URL with a host (got \"nope\")"
    );
    assert_eq!(
        error_of("discovery: {operator: {url: 'http://a:1', namespace: '', pool: p}}"),
        "discovery.operator.namespace: must not be empty (got )"
    );
    assert_eq!(
        error_of("telemetry: {otlpEndpoint: 'otel:4317'}"),
        "telemetry.otlpEndpoint: is not an http(s) URL with a host (got \"otel:4317\")"
    );
    assert_eq!(error_of(&op("http://op.kvroute:9443")), "valid");
    assert_eq!(
        error_of("telemetry: {otlpEndpoint: 'http://otel:4317'}"),
        "valid"
    );
}

#[test]
fn pricing_is_checked_naming_the_field() {
    let priced = |p: &str| error_of(&format!("telemetry: {{pricing: {p}}}"));
    assert_eq!(priced("{gpuHourCost: 2.5, currency: USD}"), "valid");
    let c: Config = serde_yaml::from_str(
        "telemetry: {pricing: {gpuHourCost: 2.5, currency: USD, gpusPerEngine: 8}}",
    )
    .unwrap();
    assert_eq!(c.telemetry.pricing.unwrap().engine_hour_cost(), 20.0);
    assert_eq!(
        priced("{gpuHourCost: 0, currency: USD}"),
        "telemetry.pricing.gpuHourCost: must be a positive number (got 0)"
    );
    assert_eq!(
        priced("{gpuHourCost: 1, currency: 'US$'}"),
        "telemetry.pricing.currency: must be 1 to 16 ASCII letters or digits (got \"US$\")"
    );
    assert_eq!(
        priced("{gpuHourCost: 1, currency: USD, gpusPerEngine: 0}"),
        "telemetry.pricing.gpusPerEngine: must be at least 1 (got 0)"
    );
    assert!(priced("{currency: USD}").contains("missing field `gpuHourCost`"));
}

#[test]
fn parameters_a_policy_does_not_have_are_refused() {
    let err = error_of("routing: {policy: {name: round-robin, slack: 2}}");
    assert!(
        err.starts_with("routing.policy: unknown field `slack`"),
        "{err}"
    );
    let err = error_of("routing: {policy: {name: kvroute, slack: 2}}");
    assert!(
        err.starts_with("routing.policy: unknown field `slack`"),
        "{err}"
    );
    assert_eq!(error_of("routing: {policy: {name: round-robin}}"), "valid");
}

#[test]
fn lora_paths_are_strings() {
    for (yaml, shown) in [
        ("routing: {loraAdapters: {a: 5}}", "integer `5`"),
        ("routing: {loraAdapters: {a: true}}", "boolean `true`"),
        ("routing: {loraAdapters: {a: ~}}", "unit value"),
        ("routing: {loraAdapters: {a: [x]}}", "sequence"),
    ] {
        let err = error_of(yaml);
        assert!(
            err.starts_with("routing.loraAdapters.a: invalid type"),
            "{yaml}: {err}"
        );
        assert!(err.contains(shown), "{yaml}: {err}");
        assert!(
            err.contains("the adapter's path as a string"),
            "{yaml}: {err}"
        );
    }
    let c: Config =
        serde_yaml::from_str("routing: {loraAdapters: {a: '5', b: /models/b}}").unwrap();
    c.validate().unwrap();
    assert_eq!(c.routing.lora_adapters["a"], "5");
    assert_eq!(c.routing.lora_adapters["b"], "/models/b");
}

#[test]
fn the_routing_spec_is_the_cores_by_default_and_read_in_one_place() {
    use kvroute_core::spec::RoutingSpec;
    assert_eq!(Config::default().routing_spec(), RoutingSpec::default());
    let c: Config = serde_yaml::from_str(
        "routing: {policy: {name: round-robin}, blockSize: 32, hashSeed: '0', offloadWeight: 0.25, slowStartSeconds: 5}\ntenancy: {mode: salted, tenantHeader: x-t, secretFile: s}",
    )
    .unwrap();
    let spec = c.routing_spec();
    assert_eq!(spec.policy.name(), "round-robin");
    assert_eq!(
        (spec.hash.block_size, spec.hash.seed.as_deref()),
        (32, Some("0"))
    );
    assert_eq!(spec.offload_weight, 0.25);
    assert_eq!(spec.slow_start_seconds, 5);
    assert_eq!(spec.tenancy, TenancyMode::Salted);
    assert!(spec.key.scope_by_tenant, "salted tenancy scopes keys");
}

#[test]
fn the_response_cache_is_off_unless_configured_and_checked_when_it_is() {
    assert_eq!(Config::default().response_cache, None);
    let c: Config = serde_yaml::from_str("responseCache: {backend: embedded}").unwrap();
    assert_eq!(c.response_cache, Some(ResponseCache::default()));
    c.validate().unwrap();
    let c: Config = serde_yaml::from_str("responseCache: {}").unwrap();
    assert_eq!(
        c.response_cache,
        Some(ResponseCache::default()),
        "embedded by default"
    );
    let redis = "responseCache: {backend: redis, url: 'rediss://cache.example:6380'}";
    assert_eq!(error_of(redis), "valid");
    for (yaml, error) in [
        (
            "responseCache: {backend: redis}",
            "responseCache.url: is required",
        ),
        (
            "responseCache: {backend: redis, url: 'http://x:6379'}",
            "responseCache.url: must be redis://host:port or rediss://host:port (got http://x:6379)",
        ),
        (
            "responseCache: {url: 'redis://x:6379'}",
            "responseCache.url: is only for backend: redis",
        ),
        ("responseCache: {ttlS: 0}", "responseCache.ttlS: must be 1"),
        (
            "responseCache: {timeoutMs: 0}",
            "responseCache.timeoutMs: must be 1",
        ),
        (
            "responseCache: {maxBytes: 1000, maxEntryBytes: 2000}",
            "responseCache.maxEntryBytes: must be at least 1 and at most maxBytes",
        ),
        (
            "responseCache: {backend: memcached}",
            "responseCache.backend: unknown variant",
        ),
        ("responseCache: {ttl: 5}", "unknown field `ttl`"),
    ] {
        let got = error_of(yaml);
        assert!(got.contains(error), "{yaml}: {got}");
    }
}

#[test]
fn warmup_is_checked_naming_the_field() {
    let warm = |w: &str| error_of(&format!("routing: {{warmup: {w}}}"));
    let one = "prefixes: [{name: support-v3, messages: [{role: system, content: hi}]}]";
    assert_eq!(warm(&format!("{{{one}}}")), "valid");
    let c: Config = serde_yaml::from_str(&format!("routing: {{warmup: {{{one}}}}}")).unwrap();
    let w = c.routing.warmup.unwrap();
    assert_eq!(
        (w.every_seconds, w.owners, w.max_share_of_prefill),
        (240, 1, 0.02)
    );
    for (yaml, error) in [
        (
            format!("{{everySeconds: 0, {one}}}"),
            "routing.warmup.everySeconds: must be at least 1 (got 0)",
        ),
        (
            format!("{{owners: 0, {one}}}"),
            "routing.warmup.owners: must be at least 1 (got 0)",
        ),
        (
            format!("{{maxShareOfPrefill: 0, {one}}}"),
            "routing.warmup.maxShareOfPrefill: must be in (0, 1] (got 0)",
        ),
        (
            "{prefixes: []}".into(),
            "routing.warmup.prefixes: must name 1 to 64 prefixes (got 0)",
        ),
        (
            "{prefixes: [{name: a, prompt: x}, {name: a, prompt: y}]}".into(),
            "routing.warmup.prefixes[].name: is named twice (got a)",
        ),
        (
            "{prefixes: [{name: 'a b', prompt: x}]}".into(),
            "routing.warmup.prefixes[].name: must be 1 to 63 letters, digits, '.', '_' or '-' (got \"a b\")",
        ),
        (
            "{prefixes: [{name: a, prompt: x, messages: [{role: user, content: y}]}]}".into(),
            "routing.warmup.prefixes[].messages: give exactly one of messages and prompt (got a)",
        ),
        (
            "{prefixes: [{name: a}]}".into(),
            "routing.warmup.prefixes[].messages: give exactly one of messages and prompt (got a)",
        ),
        (
            "{prefixes: [{name: a, configMapRef: {name: prompts, key: support}}]}".into(),
            "routing.warmup.prefixes[].configMapRef: needs the operator: give messages or prompt (got a)",
        ),
    ] {
        assert_eq!(warm(&yaml), error, "{yaml}");
    }
    let salted = "tenancy: {mode: salted, tenantHeader: x-tenant, secretFile: /s}\nrouting: {warmup: {prefixes: [{name: a, prompt: x}]}}";
    assert_eq!(
        error_of(salted),
        "routing.warmup.prefixes[].tenant: is required under salted tenancy (got a)"
    );
    assert!(warm("{prefixes: [{name: a, prompt: x, tenat: b}]}").contains("unknown field `tenat`"));
}
