use super::*;

fn policy() -> RoutingPolicy {
    RoutingPolicy {
        policy: "kvroute".into(),
        key_mode: v1::KeyMode::Conversation.into(),
        prefix_tokens: 256,
        load_bound: 0.0,
        block_size: 16,
        hash_algorithm: v1::HashAlgorithm::Sha256.into(),
        hash_seed: None,
        cache_port: 0,
        tenancy: v1::TenancyMode::Shared.into(),
        tenant_header: String::new(),
        latency_slack: None,
        prefill_tokens_per_second: None,
        prefill_overhead_ms: None,
        offload_weight: None,
        slow_start_seconds: None,
        disaggregation: None,
        warmup: None,
    }
}

fn ep(name: &str, address: &str, http_port: u32, cache_port: u32) -> v1::Endpoint {
    v1::Endpoint {
        name: name.into(),
        address: address.into(),
        http_port,
        cache_port,
        ready: true,
        draining: false,
        ready_since_unix_ms: None,
        role: 0,
    }
}

#[test]
fn endpoints_take_the_policy_cache_port_when_they_have_none() {
    let state = PoolState {
        endpoints: vec![
            ep("a:8000", "10.0.0.1", 8000, 0),
            ep("b:8000", "fd00::2", 8000, 7000),
        ],
        ..Default::default()
    };
    let mut p = policy();
    let specs = endpoints(&state, &p);
    assert_eq!(specs[0].http, "10.0.0.1:8000".parse().unwrap());
    assert_eq!(specs[0].cache, None);
    assert_eq!(specs[1].cache, Some("[fd00::2]:7000".parse().unwrap()));
    p.cache_port = 50051;
    let specs = endpoints(&state, &p);
    assert_eq!(specs[0].cache, Some("10.0.0.1:50051".parse().unwrap()));
    assert_eq!(specs[1].cache, Some("[fd00::2]:7000".parse().unwrap()));
}

#[test]
fn an_endpoints_ready_time_is_the_operators() {
    let mut e = ep("a:8000", "10.0.0.1", 8000, 0);
    e.ready_since_unix_ms = Some(1_767_323_045_000);
    let state = PoolState {
        endpoints: vec![e, ep("b:8000", "10.0.0.2", 8000, 0)],
        ..Default::default()
    };
    let specs = endpoints(&state, &policy());
    assert_eq!(specs[0].ready_since_ms, Some(1_767_323_045_000));
    assert_eq!(specs[1].ready_since_ms, None);
}

#[test]
fn an_endpoints_role_is_the_operators_and_unspecified_or_unknown_is_both() {
    use kvroute_core::role::Role;
    let with = |role: i32| {
        let mut e = ep(&format!("{role}:8000"), "10.0.0.1", 8000, 0);
        e.role = role;
        e
    };
    let state = PoolState {
        endpoints: vec![
            with(v1::EndpointRole::Prefill.into()),
            with(v1::EndpointRole::Decode.into()),
            with(0),
            with(99),
        ],
        ..Default::default()
    };
    let roles: Vec<Role> = (endpoints(&state, &policy()).iter())
        .map(|s| s.role)
        .collect();
    assert_eq!(roles, [Role::Prefill, Role::Decode, Role::Both, Role::Both]);
}

#[test]
fn unaddressable_endpoints_are_skipped() {
    let state = PoolState {
        endpoints: vec![
            ep("host", "pod.example", 8000, 0),
            ep("no-port", "10.0.0.1", 0, 0),
            ep("big-port", "10.0.0.1", 70000, 0),
            ep("big-cache-port", "10.0.0.1", 8000, 70000),
            ep("", "10.0.0.1", 8000, 0),
            ep("ok", "10.0.0.3", 8000, 0),
        ],
        ..Default::default()
    };
    let names: Vec<String> = endpoints(&state, &policy())
        .into_iter()
        .map(|s| s.name)
        .collect();
    assert_eq!(names, vec!["ok"]);
}
