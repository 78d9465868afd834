//! The CRDs and the API types: the checked-in `crds/*.yaml` match the types,
//! manifests written for the upstream Gateway API Inference Extension
//! (InferencePool, InferenceObjective) parse unchanged, policies get their
//! defaults, and `validate()` names the field that breaks a rule.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kvroute_operator::api::{
    self, AppProtocol, CacheRoutingPolicy, FailureMode, InferenceObjective, InferencePool,
    PolicyName, Port, ValidationError,
};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

const REGENERATE: &str = "run `cargo run -p kvroute-operator -- crdgen`";

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("operator/ has a parent")
        .to_owned()
}

fn fixture(name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Parses fixture `name` as a `T` and as plain JSON.
fn parse<T: DeserializeOwned>(name: &str) -> (T, Value) {
    let text = fixture(name);
    let object = serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{name}: {e}"));
    let raw = serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{name}: {e}"));
    (object, raw)
}

/// Where `original` is not contained in `reserialized`: a field dropped (an
/// unknown name serde ignored) or changed. Fields only in `reserialized` are
/// fine: they are defaults filled in.
fn lost_in_round_trip(path: &str, original: &Value, reserialized: &Value) -> Option<String> {
    match (original, reserialized) {
        (Value::Object(a), Value::Object(b)) => a.iter().find_map(|(k, v)| match b.get(k) {
            Some(w) => lost_in_round_trip(&format!("{path}.{k}"), v, w),
            None => Some(format!("{path}.{k} dropped")),
        }),
        (Value::Array(a), Value::Array(b)) if a.len() == b.len() => a
            .iter()
            .zip(b)
            .enumerate()
            .find_map(|(i, (v, w))| lost_in_round_trip(&format!("{path}[{i}]"), v, w)),
        (Value::Number(a), Value::Number(b)) if a.as_f64() == b.as_f64() => None,
        (a, b) if a == b => None,
        (a, b) => Some(format!("{path}: {a} became {b}")),
    }
}

/// `object` serializes to everything `raw` holds, and parses back equal.
fn assert_round_trips<T: Serialize + DeserializeOwned + PartialEq + std::fmt::Debug>(
    name: &str,
    object: &T,
    raw: &Value,
) {
    let reserialized = serde_json::to_value(object).unwrap();
    if let Some(lost) = lost_in_round_trip("", raw, &reserialized) {
        panic!("{name}: {lost}");
    }
    let again: T = serde_json::from_value(reserialized).unwrap();
    assert_eq!(&again, object, "{name}");
}

/// Both checked-in copies: `crds/` (for `kubectl apply`) and the Helm
/// chart's `crds/`.
const CRD_DIRS: [&str; 2] = ["crds", "charts/kvroute/crds"];

#[test]
fn checked_in_crds_match_the_types() {
    let generated = api::crd_files().unwrap();
    for dir in CRD_DIRS {
        let path = repo_root().join(dir);
        for file in &generated {
            let on_disk = std::fs::read_to_string(path.join(&file.file_name)).unwrap_or_else(|e| {
                panic!("{dir}/{} unreadable ({e}): {REGENERATE}", file.file_name)
            });
            assert!(
                on_disk == file.yaml,
                "{dir}/{} differs from the Rust types: {REGENERATE}",
                file.file_name
            );
        }
        let mut stale: Vec<String> = std::fs::read_dir(&path)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".yaml") && !generated.iter().any(|f| &f.file_name == n))
            .collect();
        stale.sort();
        assert!(
            stale.is_empty(),
            "{dir}/ has files no type generates: {stale:?}; remove them and {REGENERATE}"
        );
    }
}

#[test]
fn crds_have_status_subresources_and_upstream_names() {
    let crds = api::crds();
    let names: Vec<&str> = crds
        .iter()
        .filter_map(|c| c.metadata.name.as_deref())
        .collect();
    assert_eq!(
        names,
        [
            "inferencepools.inference.networking.k8s.io",
            "cacheroutingpolicies.kvroute.dev",
            "inferenceobjectives.inference.networking.x-k8s.io",
        ]
    );
    for crd in &crds {
        assert_eq!(crd.spec.scope, "Namespaced");
        let version = &crd.spec.versions[0];
        assert!(version.served && version.storage);
        let status = version
            .subresources
            .as_ref()
            .and_then(|s| s.status.as_ref());
        assert!(status.is_some(), "{names:?}: no status subresource");
    }
    let pool = &crds[0];
    assert_eq!(pool.spec.versions[0].name, "v1");
    assert_eq!(
        pool.spec.names.short_names.as_deref(),
        Some(&["infpool".to_owned()][..])
    );
    // The API server refuses CRDs of *.k8s.io groups without this annotation.
    let annotations = pool.metadata.annotations.as_ref().unwrap();
    assert!(annotations.contains_key("api-approved.kubernetes.io"));
    let policy = &crds[1];
    assert_eq!(policy.spec.versions[0].name, "v1alpha1");
    assert_eq!(
        policy.spec.names.short_names.as_deref(),
        Some(&["crp".to_owned()][..])
    );
    let columns: Vec<&str> = policy.spec.versions[0]
        .additional_printer_columns
        .iter()
        .flatten()
        .map(|c| c.name.as_str())
        .collect();
    assert_eq!(
        columns,
        ["Target", "Policy", "Slack", "Ready", "Accepted", "Age"]
    );
    let objective = &crds[2];
    assert_eq!(objective.spec.versions[0].name, "v1alpha2");
    // An x-k8s.io group needs no API approval.
    assert_eq!(objective.metadata.annotations, None);
}

#[test]
fn minimal_upstream_pool_parses_with_defaults() {
    let (pool, raw): (InferencePool, Value) = parse("inferencepool-minimal.yaml");
    assert_round_trips("inferencepool-minimal.yaml", &pool, &raw);
    assert_eq!(pool.validate(), Ok(()));
    assert_eq!(pool.spec.target_ports, [Port { number: 8000 }]);
    assert_eq!(pool.spec.app_protocol, AppProtocol::Http);
    assert_eq!(pool.spec.endpoint_picker_ref, None);
    assert_eq!(pool.status, None);
}

#[test]
fn upstream_pool_with_an_endpoint_picker_parses_with_defaults() {
    let (pool, raw): (InferencePool, Value) = parse("inferencepool-epp.yaml");
    assert_round_trips("inferencepool-epp.yaml", &pool, &raw);
    assert_eq!(pool.validate(), Ok(()));
    let picker = pool.spec.endpoint_picker_ref.unwrap();
    assert_eq!(picker.group, "");
    assert_eq!(picker.kind, "Service");
    assert_eq!(picker.name, "llama-pool-epp");
    assert_eq!(picker.port, Some(Port { number: 9002 }));
    assert_eq!(picker.failure_mode, FailureMode::FailClose);
}

#[test]
fn upstream_pool_with_several_ports_parses() {
    let (pool, raw): (InferencePool, Value) = parse("inferencepool-multiport.yaml");
    assert_round_trips("inferencepool-multiport.yaml", &pool, &raw);
    assert_eq!(pool.validate(), Ok(()));
    let ports: Vec<i32> = pool.spec.target_ports.iter().map(|p| p.number).collect();
    assert_eq!(ports, [8000, 8001, 8002, 8003]);
    assert_eq!(pool.spec.app_protocol, AppProtocol::H2c);
    assert_eq!(pool.spec.selector.match_labels.len(), 3);
    let picker = pool.spec.endpoint_picker_ref.unwrap();
    assert_eq!(picker.failure_mode, FailureMode::FailOpen);
}

#[test]
fn upstream_pool_status_round_trips_exactly() {
    let (pool, raw): (InferencePool, Value) = parse("inferencepool-status.yaml");
    assert_round_trips("inferencepool-status.yaml", &pool, &raw);
    // Every field is spelled out, so nothing is added either.
    assert_eq!(serde_json::to_value(&pool).unwrap(), raw);
    let parents = &pool.status.as_ref().unwrap().parents;
    assert_eq!(parents.len(), 1);
    assert_eq!(parents[0].parent_ref.kind, "Gateway");
    let types: Vec<&str> = parents[0]
        .conditions
        .iter()
        .map(|c| c.type_.as_str())
        .collect();
    assert_eq!(
        types,
        [
            api::inference_pool::conditions::ACCEPTED,
            api::inference_pool::conditions::RESOLVED_REFS
        ]
    );
}

#[test]
fn policy_defaults_fill_in_and_round_trip() {
    let (minimal, _): (CacheRoutingPolicy, Value) = parse("cacheroutingpolicy-minimal.yaml");
    let (defaults, raw): (CacheRoutingPolicy, Value) = parse("cacheroutingpolicy-defaults.yaml");
    // Rust fills in the same defaults the schema makes the API server store.
    assert_eq!(minimal, defaults);
    assert_eq!(serde_json::to_value(&minimal).unwrap(), raw);
    assert_eq!(minimal.validate(), Ok(()));
    assert_eq!(minimal.spec.policy, PolicyName::Kvroute);
}

#[test]
fn full_policy_round_trips_exactly() {
    let (policy, raw): (CacheRoutingPolicy, Value) = parse("cacheroutingpolicy-full.yaml");
    assert_eq!(serde_json::to_value(&policy).unwrap(), raw);
    assert_eq!(policy.validate(), Ok(()));
    assert_eq!(policy.spec.engine.cache_port, Some(9100));
    assert_eq!(policy.status.unwrap().ready_endpoints, Some(8));
}

#[test]
fn schema_defaults_equal_the_rust_defaults() {
    let policy = &api::crds()[1];
    let schema = serde_json::to_value(&policy.spec.versions[0].schema).unwrap();
    let spec = &schema["openAPIV3Schema"]["properties"]["spec"]["properties"];
    let (minimal, _): (CacheRoutingPolicy, Value) = parse("cacheroutingpolicy-minimal.yaml");
    let rust = serde_json::to_value(&minimal.spec).unwrap();
    for field in [
        "routingKey",
        "policy",
        "latencySlack",
        "engine",
        "tenancy",
        "slowStartSeconds",
    ] {
        assert_eq!(spec[field]["default"], rust[field], "spec.{field}");
    }
}

/// The generated `openAPIV3Schema` of CRD `index` of [`api::crds`].
fn schema_of(index: usize) -> Value {
    let crd = &api::crds()[index];
    serde_json::to_value(&crd.spec.versions[0].schema).unwrap()["openAPIV3Schema"].clone()
}

/// Where `value` breaks `schema`, as the API server would check it, less
/// `pattern`s and CEL rules: unknown fields (the server would prune them),
/// types, enums, required fields, and the numeric, item and property bounds.
/// `apiVersion`, `kind` and `metadata` at the root are the server's own.
fn schema_errors(path: &str, schema: &Value, value: &Value) -> Vec<String> {
    let mut errors = Vec::new();
    let bound = |key: &str| schema.get(key).and_then(Value::as_f64);
    let fail = |errors: &mut Vec<String>, what: String| errors.push(format!("{path}: {what}"));
    if let Some(allowed) = schema.get("enum").and_then(Value::as_array)
        && !allowed.contains(value)
    {
        fail(&mut errors, format!("{value} not in {allowed:?}"));
    }
    match (schema["type"].as_str(), value) {
        (Some("object"), Value::Object(map)) => {
            let n = map.len() as f64;
            if bound("minProperties").is_some_and(|min| n < min)
                || bound("maxProperties").is_some_and(|max| n > max)
            {
                fail(&mut errors, format!("{n} properties out of bounds"));
            }
            for required in schema["required"].as_array().into_iter().flatten() {
                if !map.contains_key(required.as_str().unwrap()) {
                    fail(&mut errors, format!("missing {required}"));
                }
            }
            for (key, sub) in map {
                let at = format!("{path}.{key}");
                if let Some(field) = schema["properties"].get(key) {
                    errors.extend(schema_errors(&at, field, sub));
                } else if let Some(values) = schema.get("additionalProperties") {
                    errors.extend(schema_errors(&at, values, sub));
                } else if !(path.is_empty()
                    && ["apiVersion", "kind", "metadata"].contains(&key.as_str()))
                {
                    errors.push(format!("{at}: unknown field"));
                }
            }
        }
        (Some("array"), Value::Array(items)) => {
            let n = items.len() as f64;
            if bound("minItems").is_some_and(|min| n < min)
                || bound("maxItems").is_some_and(|max| n > max)
            {
                fail(&mut errors, format!("{n} items out of bounds"));
            }
            for (i, item) in items.iter().enumerate() {
                errors.extend(schema_errors(
                    &format!("{path}[{i}]"),
                    &schema["items"],
                    item,
                ));
            }
        }
        (Some("integer" | "number"), Value::Number(n)) => {
            let n = n.as_f64().unwrap();
            if schema["type"] == "integer" && n.fract() != 0.0 {
                fail(&mut errors, format!("{n} is not an integer"));
            }
            if bound("minimum").is_some_and(|min| n < min)
                || bound("maximum").is_some_and(|max| n > max)
            {
                fail(&mut errors, format!("{n} out of bounds"));
            }
        }
        (Some("string"), Value::String(s)) => {
            let n = s.chars().count() as f64;
            if bound("minLength").is_some_and(|min| n < min)
                || bound("maxLength").is_some_and(|max| n > max)
            {
                fail(&mut errors, format!("{s:?} length out of bounds"));
            }
        }
        (Some("boolean"), Value::Bool(_)) => {}
        (t, v) => fail(&mut errors, format!("{v} is not of type {t:?}")),
    }
    errors
}

#[test]
fn every_fixture_conforms_to_the_generated_schema() {
    for (index, prefix) in [
        (0, "inferencepool-"),
        (1, "cacheroutingpolicy-"),
        (2, "inferenceobjective-"),
    ] {
        let schema = schema_of(index);
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
        let mut seen = 0;
        for entry in std::fs::read_dir(dir).unwrap() {
            let name = entry.unwrap().file_name().to_string_lossy().into_owned();
            if !name.starts_with(prefix) {
                continue;
            }
            let raw: Value = serde_yaml::from_str(&fixture(&name)).unwrap();
            assert_eq!(
                schema_errors("", &schema, &raw),
                Vec::<String>::new(),
                "{name}"
            );
            seen += 1;
        }
        assert!(seen >= 3, "{prefix}*: only {seen} fixtures");
    }
}

fn pool_with(ports: &[i32], labels: usize) -> InferencePool {
    let (mut pool, _): (InferencePool, Value) = parse("inferencepool-minimal.yaml");
    pool.spec.target_ports = ports.iter().map(|&number| Port { number }).collect();
    pool.spec.selector.match_labels = (0..labels)
        .map(|i| (format!("label-{i}"), "x".to_owned()))
        .collect::<BTreeMap<_, _>>();
    pool
}

/// The error `validate()` gives for `pool`, after checking that the
/// generated schema rejects it too, unless the rule is a CEL one (`cel`),
/// which the schema check here cannot evaluate.
fn error_of(pool: &InferencePool) -> ValidationError {
    let err = pool.validate().expect_err("the pool is invalid");
    let raw = serde_json::to_value(pool).unwrap();
    let schema_errors = schema_errors("", &schema_of(0), &raw);
    let by_cel = err.rule.contains("unique") || err.field.ends_with(".port");
    assert_eq!(
        schema_errors.is_empty(),
        by_cel,
        "{err}; schema: {schema_errors:?}"
    );
    err
}

#[test]
fn validate_names_the_field_of_a_bad_port_count() {
    let none = error_of(&pool_with(&[], 1));
    assert_eq!(
        (none.field.as_str(), none.value.as_str()),
        ("spec.targetPorts", "0 items")
    );

    let nine: Vec<i32> = (8000..8009).collect();
    let err = error_of(&pool_with(&nine, 1));
    assert_eq!(
        (err.field.as_str(), err.value.as_str()),
        ("spec.targetPorts", "9 items")
    );
    assert!(err.to_string().contains("1 to 8"), "{err}");

    assert_eq!(pool_with(&nine[..8], 1).validate(), Ok(()));
}

#[test]
fn validate_names_a_duplicate_port() {
    let err = error_of(&pool_with(&[8000, 8001, 8000], 1));
    assert_eq!(err.field, "spec.targetPorts[2].number");
    assert_eq!(err.value, "8000");
    assert!(err.to_string().contains("unique"), "{err}");
}

#[test]
fn validate_names_a_port_out_of_range() {
    let zero = error_of(&pool_with(&[8000, 0], 1));
    assert_eq!(
        (zero.field.as_str(), zero.value.as_str()),
        ("spec.targetPorts[1].number", "0")
    );

    let high = error_of(&pool_with(&[70000], 1));
    assert_eq!(
        (high.field.as_str(), high.value.as_str()),
        ("spec.targetPorts[0].number", "70000")
    );
    assert!(high.to_string().contains("1 to 65535"), "{high}");

    assert_eq!(pool_with(&[1, 65535], 1).validate(), Ok(()));
}

#[test]
fn validate_names_the_field_of_a_bad_label_count() {
    let none = error_of(&pool_with(&[8000], 0));
    assert_eq!(
        (none.field.as_str(), none.value.as_str()),
        ("spec.selector.matchLabels", "0 labels")
    );

    let many = error_of(&pool_with(&[8000], 65));
    assert_eq!(
        (many.field.as_str(), many.value.as_str()),
        ("spec.selector.matchLabels", "65 labels")
    );
    assert!(many.to_string().contains("1 to 64"), "{many}");

    assert_eq!(pool_with(&[8000], 64).validate(), Ok(()));
}

#[test]
fn validate_requires_a_port_for_a_service_picker() {
    let (mut pool, _): (InferencePool, Value) = parse("inferencepool-epp.yaml");
    pool.spec.endpoint_picker_ref.as_mut().unwrap().port = None;
    let err = error_of(&pool);
    assert_eq!(err.field, "spec.endpointPickerRef.port");
}

#[test]
fn upstream_objectives_parse_with_defaults() {
    let (minimal, raw): (InferenceObjective, Value) = parse("inferenceobjective-minimal.yaml");
    assert_round_trips("inferenceobjective-minimal.yaml", &minimal, &raw);
    assert_eq!(minimal.validate(), Ok(()));
    assert_eq!(minimal.spec.priority, None);
    let pool_ref = &minimal.spec.pool_ref;
    assert_eq!(
        (pool_ref.group.as_str(), pool_ref.kind.as_str()),
        ("inference.networking.k8s.io", "InferencePool")
    );
    assert_eq!(pool_ref.pool(), Some("qwen-pool"));

    let (sheddable, raw): (InferenceObjective, Value) = parse("inferenceobjective-priority.yaml");
    assert_round_trips("inferenceobjective-priority.yaml", &sheddable, &raw);
    assert_eq!(sheddable.spec.priority, Some(-10));
    assert_eq!(sheddable.spec.pool_ref, minimal.spec.pool_ref);

    let (reported, raw): (InferenceObjective, Value) = parse("inferenceobjective-status.yaml");
    assert_eq!(serde_json::to_value(&reported).unwrap(), raw);
    let conditions = &reported.status.unwrap().conditions;
    assert_eq!(conditions[0].reason, "Pending");
}

#[test]
fn the_objective_schema_defaults_its_pool_ref_and_takes_any_integer() {
    let schema = schema_of(2);
    let spec = &schema["properties"]["spec"];
    assert_eq!(spec["required"], serde_json::json!(["poolRef"]));
    let pool_ref = &spec["properties"]["poolRef"]["properties"];
    assert_eq!(pool_ref["group"]["default"], "inference.networking.k8s.io");
    assert_eq!(pool_ref["kind"]["default"], "InferencePool");
    // Upstream's priority is any integer: kvroute's i32 is the watcher's
    // reading, not a schema rule.
    let priority = &spec["properties"]["priority"];
    assert_eq!(priority["type"], "integer");
    assert_eq!(priority.get("format"), None);
}

#[test]
fn validate_names_a_bad_pool_ref() {
    let (objective, _): (InferenceObjective, Value) = parse("inferenceobjective-minimal.yaml");
    let with = |edit: fn(&mut InferenceObjective)| {
        let mut bad = objective.clone();
        edit(&mut bad);
        let err = bad.validate().expect_err("the objective is invalid");
        let raw = serde_json::to_value(&bad).unwrap();
        let by_pattern = err.rule.starts_with("must be") && !err.rule.contains("long");
        // The schema check here skips patterns; lengths it sees.
        assert_eq!(
            schema_errors("", &schema_of(2), &raw).is_empty(),
            by_pattern,
            "{err}"
        );
        err
    };
    let empty = with(|o| o.spec.pool_ref.name.clear());
    assert_eq!(empty.field, "spec.poolRef.name");
    let kind = with(|o| o.spec.pool_ref.kind = "Inference Pool".into());
    assert_eq!(kind.field, "spec.poolRef.kind");
    let group = with(|o| o.spec.pool_ref.group = "Not_A.Group".into());
    assert_eq!(group.field, "spec.poolRef.group");

    // Another kind is valid; it just names no pool of kvroute's.
    let mut service = objective.clone();
    service.spec.pool_ref.kind = "Service".into();
    assert_eq!(service.validate(), Ok(()));
    assert_eq!(service.spec.pool_ref.pool(), None);
}
