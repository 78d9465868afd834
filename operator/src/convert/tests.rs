//! Objects written as manifests (JSON), converted, checked field by field.

use k8s_openapi::api::core::v1::Pod;
use kvroute_core::hash::HashAlgo;
use kvroute_core::keys::KeyMode;
use kvroute_core::spec::TenancyMode;
use serde_json::json;

use crate::index;

use super::*;

fn pool_object(ports: serde_json::Value) -> InferencePool {
    serde_json::from_value(json!({
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"namespace": "ml", "name": "llama"},
        "spec": {"selector": {"matchLabels": {"app": "llama"}}, "targetPorts": ports},
    }))
    .unwrap()
}

fn pod_object(metadata: serde_json::Value, status: serde_json::Value) -> Pod {
    let mut meta = json!({"namespace": "ml", "name": "llama-0", "labels": {"app": "llama"}});
    meta.as_object_mut()
        .unwrap()
        .extend(metadata.as_object().unwrap().clone());
    serde_json::from_value(json!({"metadata": meta, "status": status})).unwrap()
}

fn serving_status() -> serde_json::Value {
    json!({
        "phase": "Running",
        "podIP": "10.0.0.7",
        "conditions": [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Ready", "status": "True"},
        ],
    })
}

fn policy_object(spec: serde_json::Value) -> CacheRoutingPolicy {
    serde_json::from_value(json!({
        "apiVersion": "kvroute.dev/v1alpha1",
        "kind": "CacheRoutingPolicy",
        "metadata": {
            "namespace": "ml",
            "name": "fast",
            "generation": 3,
            "creationTimestamp": "2025-01-02T03:04:05Z",
        },
        "spec": spec,
    }))
    .unwrap()
}

#[test]
fn a_pool_keeps_its_selector_and_ports() {
    let spec = pool(&pool_object(json!([{"number": 8000}, {"number": 8001}]))).unwrap();
    assert_eq!(
        spec,
        PoolSpec {
            namespace: "ml".into(),
            name: "llama".into(),
            selector: [("app".to_owned(), "llama".to_owned())].into(),
            target_ports: vec![8000, 8001],
            ..PoolSpec::default()
        }
    );
    assert_eq!(spec.validate(), Ok(()));
}

#[test]
fn a_pool_with_only_out_of_range_ports_is_invalid() {
    let spec = pool(&pool_object(
        json!([{"number": 0}, {"number": -1}, {"number": 70000}]),
    ))
    .unwrap();
    assert_eq!(spec.target_ports, Vec::<u16>::new());
    assert!(spec.validate().is_err());

    let spec = pool(&pool_object(json!([{"number": 70000}, {"number": 8000}]))).unwrap();
    assert_eq!(spec.target_ports, vec![8000]);
}

#[test]
fn a_pool_without_namespace_is_skipped() {
    let mut object = pool_object(json!([{"number": 8000}]));
    object.metadata.namespace = None;
    assert_eq!(pool(&object), None);
}

#[test]
fn a_pods_role_comes_from_its_label_and_an_unknown_value_is_both() {
    let role = |labels: serde_json::Value| {
        pod(&pod_object(json!({ "labels": labels }), serving_status()))
            .unwrap()
            .role
    };
    assert_eq!(role(json!({"kvroute.dev/role": "prefill"})), Role::Prefill);
    assert_eq!(role(json!({"llm-d.ai/role": "decode"})), Role::Decode);
    assert_eq!(role(json!({"kvroute.dev/role": "prefiller"})), Role::Both);
    assert_eq!(role(json!({"app": "llama"})), Role::Both);
}

#[test]
fn a_running_ready_pod_serves() {
    let info = pod(&pod_object(json!({}), serving_status())).unwrap();
    assert_eq!(
        info,
        PodInfo {
            namespace: "ml".into(),
            name: "llama-0".into(),
            labels: [("app".to_owned(), "llama".to_owned())].into(),
            ip: Some("10.0.0.7".parse().unwrap()),
            phase_running: true,
            ready: true,
            deleting: false,
            ready_since_ms: None,
            role: Role::Both,
        }
    );
    assert!(info.serves());
}

#[test]
fn a_ready_pod_is_ready_since_its_conditions_last_transition() {
    let mut status = serving_status();
    status["conditions"][1]["lastTransitionTime"] = json!("2025-01-02T03:04:05Z");
    let info = pod(&pod_object(json!({}), status.clone())).unwrap();
    assert_eq!(info.ready_since_ms, Some(1_735_787_045_000));

    // Not ready since then: unready since then.
    status["conditions"][1]["status"] = json!("False");
    let info = pod(&pod_object(json!({}), status)).unwrap();
    assert_eq!(info.ready_since_ms, None);
}

#[test]
fn a_terminating_pod_is_deleting() {
    let object = pod_object(
        json!({"deletionTimestamp": "2025-01-02T03:04:05Z"}),
        serving_status(),
    );
    let info = pod(&object).unwrap();
    assert!(info.deleting);
    assert!(!info.serves());
}

#[test]
fn an_unready_pod_does_not_serve() {
    let mut status = serving_status();
    status["conditions"][1]["status"] = json!("False");
    let info = pod(&pod_object(json!({}), status)).unwrap();
    assert!(info.phase_running);
    assert!(!info.ready);
    assert!(!info.serves());

    let info = pod(&pod_object(json!({}), json!({"phase": "Pending"}))).unwrap();
    assert!(!info.phase_running);
    assert!(!info.ready);
}

#[test]
fn a_pod_without_a_usable_ip_has_none() {
    let mut status = serving_status();
    status.as_object_mut().unwrap().remove("podIP");
    let info = pod(&pod_object(json!({}), status.clone())).unwrap();
    assert_eq!(info.ip, None);
    assert!(!info.serves());

    status["podIP"] = json!("not-an-ip");
    assert_eq!(pod(&pod_object(json!({}), status)).unwrap().ip, None);

    let v6 = pod(&pod_object(json!({}), json!({"podIP": "fd00::7"}))).unwrap();
    assert_eq!(v6.ip, Some("fd00::7".parse().unwrap()));
}

#[test]
fn a_pod_without_status_or_name_is_handled() {
    let object: Pod =
        serde_json::from_value(json!({"metadata": {"namespace": "ml", "name": "p"}})).unwrap();
    let info = pod(&object).unwrap();
    assert_eq!(
        (info.ip, info.phase_running, info.ready),
        (None, false, false)
    );

    let object: Pod = serde_json::from_value(json!({"metadata": {"namespace": "ml"}})).unwrap();
    assert_eq!(pod(&object), None);
}

#[test]
fn a_policy_maps_every_field() {
    let object = policy_object(json!({
        "targetRef": {
            "group": "inference.networking.k8s.io",
            "kind": "InferencePool",
            "name": "llama",
        },
        "routingKey": {"mode": "Tenant", "prefixTokens": 512},
        "policy": "rendezvous-bounded",
        "loadBound": 1.25,
        "latencySlack": 2.0,
        "engine": {
            "blockSize": 32,
            "hashAlgorithm": "xxhash_cbor",
            "hashSeed": "42",
            "cachePort": 5557,
            "prefillTokensPerSecond": 25000.0,
            "prefillOverheadMs": 8.0,
        },
        "tenancy": {"mode": "Salted", "tenantHeader": "x-tenant"},
        "slowStartSeconds": 5,
    }));
    let spec = policy(&object).unwrap();
    assert_eq!(
        spec,
        PolicySpec {
            namespace: "ml".into(),
            name: "fast".into(),
            created: 1_735_787_045,
            generation: 3,
            target_pool: "llama".into(),
            policy: Some("rendezvous-bounded".into()),
            key_mode: Some(KeyMode::Tenant),
            prefix_tokens: Some(512),
            load_bound: Some(1.25),
            latency_slack: Some(2.0),
            prefill_tokens_per_second: Some(25_000.0),
            prefill_overhead_ms: Some(8.0),
            block_size: Some(32),
            hash_algorithm: Some(HashAlgo::XxhashCbor),
            hash_seed: Some("42".into()),
            cache_port: Some(5557),
            tenancy_mode: Some(TenancyMode::Salted),
            tenant_header: Some("x-tenant".into()),
            slow_start_seconds: Some(5),
            disaggregation: Some(kvroute_core::spec::Disaggregation::default()),
            ..PolicySpec::default()
        }
    );
    assert_eq!(spec.validate(), Ok(()));
}

#[test]
fn a_policy_of_defaults_gets_the_index_defaults() {
    let mut object = policy_object(json!({"targetRef": {"name": "llama"}}));
    object.metadata.creation_timestamp = None;
    object.metadata.generation = None;
    let spec = policy(&object).unwrap();
    assert_eq!((spec.created, spec.generation), (0, 0));
    assert_eq!(spec.target_pool, "llama");
    assert_eq!(spec.routing_policy(), index::default_policy());
}

#[test]
fn a_policy_targeting_another_kind_never_finds_it() {
    let object =
        policy_object(json!({"targetRef": {"group": "", "kind": "Service", "name": "llama"}}));
    let spec = policy(&object).unwrap();
    assert_eq!(spec.target_pool, "Service/llama");

    let object = policy_object(json!({
        "targetRef": {"group": "gateway.networking.k8s.io", "kind": "InferencePool", "name": "llama"},
    }));
    let spec = policy(&object).unwrap();
    assert_eq!(
        spec.target_pool,
        "InferencePool.gateway.networking.k8s.io/llama"
    );

    // The index then reports the target missing, naming the reference.
    let mut index = index::Index::with_clock(|| 0);
    index.apply_pool(pool(&pool_object(json!([{"number": 8000}]))).unwrap());
    index.apply_policy(spec);
    let status = index.policy_status("ml", "fast").unwrap();
    assert!(!status.target_found.status);
    assert_eq!(status.accepted.reason, index::Reason::TargetNotFound);
}

#[test]
fn out_of_range_policy_numbers_are_rejected_by_the_index() {
    let object = policy_object(json!({
        "targetRef": {"name": "llama"},
        "routingKey": {"prefixTokens": -1},
    }));
    let spec = policy(&object).unwrap();
    assert_eq!(spec.prefix_tokens, Some(0));
    assert!(spec.validate().is_err());

    let object = policy_object(json!({
        "targetRef": {"name": "llama"},
        "engine": {"blockSize": -16},
    }));
    let spec = policy(&object).unwrap();
    assert_eq!(spec.block_size, Some(0));
    assert!(spec.validate().is_err());

    for port in [-1, 70000] {
        let object = policy_object(json!({
            "targetRef": {"name": "llama"},
            "engine": {"cachePort": port},
        }));
        let spec = policy(&object).unwrap();
        assert_eq!(spec.cache_port, Some(0));
        assert!(spec.validate().is_err());
    }

    let object = policy_object(json!({"targetRef": {"name": "llama"}, "slowStartSeconds": -1}));
    let spec = policy(&object).unwrap();
    assert_eq!(spec.slow_start_seconds, Some(u32::MAX));
    assert!(spec.validate().unwrap_err().contains("slow start seconds"));
}

fn objective_object(spec: serde_json::Value) -> Result<InferenceObjective, serde_json::Error> {
    serde_json::from_value(json!({
        "apiVersion": "inference.networking.x-k8s.io/v1alpha2",
        "kind": "InferenceObjective",
        "metadata": {"namespace": "ml", "name": "chat"},
        "spec": spec,
    }))
}

#[test]
fn an_objective_names_its_pool_and_priority() {
    let with = |spec| objective(&objective_object(spec).unwrap()).unwrap();
    assert_eq!(
        with(json!({"priority": -5, "poolRef": {"name": "llama"}})),
        ObjectiveSpec {
            namespace: "ml".into(),
            name: "chat".into(),
            pool: Some("llama".into()),
            priority: -5,
        }
    );
    let unset = with(json!({"poolRef": {"name": "llama"}}));
    assert_eq!(unset.priority, 0, "unset means 0");
    let spelled_out = json!({"poolRef": {
        "group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "llama",
    }});
    assert_eq!(with(spelled_out).pool.as_deref(), Some("llama"));
    let empty_group = json!({"poolRef": {"group": "", "name": "llama"}});
    assert_eq!(with(empty_group).pool.as_deref(), Some("llama"));
}

#[test]
fn an_objective_referencing_another_kind_names_no_pool() {
    for pool_ref in [
        json!({"group": "inference.networking.x-k8s.io", "name": "llama"}),
        json!({"kind": "Service", "name": "llama"}),
        json!({"group": "example.com", "kind": "InferencePool", "name": "llama"}),
    ] {
        let object = objective_object(json!({"priority": 3, "poolRef": pool_ref})).unwrap();
        assert_eq!(objective(&object).unwrap().pool, None, "{pool_ref}");
    }
}

#[test]
fn a_priority_outside_i32_cannot_be_read() {
    for priority in [
        json!(2_147_483_648_i64),
        json!(-2_147_483_649_i64),
        json!(1.5),
    ] {
        let object = objective_object(json!({"priority": priority, "poolRef": {"name": "p"}}));
        assert!(object.is_err(), "{priority}");
    }
    let edge = objective_object(json!({"priority": i32::MIN, "poolRef": {"name": "p"}}));
    assert_eq!(objective(&edge.unwrap()).unwrap().priority, i32::MIN);
}
