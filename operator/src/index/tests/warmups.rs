//! A policy's warm-ups in its pool's state: ConfigMap references resolved
//! (or left out and named in `WarmupReady`), the rules checked, and the
//! pool's router pods named.

use kvroute_core::warmup::{ConfigMapRef, Prefix, Warmup};
use kvroute_proto::v1::warmup_prefix::Text;

use super::*;

fn prefix(name: &str) -> Prefix {
    Prefix {
        name: name.into(),
        model: None,
        tenant: None,
        messages: None,
        prompt: None,
        config_map_ref: Some(ConfigMapRef {
            name: "prompts".into(),
            key: name.into(),
        }),
    }
}

fn with_warmup(prefixes: Vec<Prefix>) -> PolicySpec {
    PolicySpec {
        warmup: Some(Warmup {
            prefixes,
            ..Warmup::default()
        }),
        ..PolicySpec::test("fast", "llama")
    }
}

fn prompts(data: &[(&str, &str)]) -> ConfigMapInfo {
    ConfigMapInfo {
        namespace: NS.into(),
        name: "prompts".into(),
        data: data
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    }
}

/// `(name, text)` of every prefix routers receive.
fn sent(rx: &watch::Receiver<PoolState>) -> Vec<(String, String)> {
    let state = rx.borrow();
    let Some(w) = state.policy.as_ref().and_then(|p| p.warmup.as_ref()) else {
        return Vec::new();
    };
    (w.prefixes.iter())
        .map(|p| {
            let text = match &p.text {
                Some(Text::MessagesJson(m)) => m.clone(),
                Some(Text::Prompt(p)) => p.clone(),
                None => String::new(),
            };
            (p.name.clone(), text)
        })
        .collect()
}

fn warmup_condition(index: &Index) -> Option<Condition> {
    index.policy_status(NS, "fast").unwrap().warmup
}

#[test]
fn a_config_map_key_becomes_a_system_message_and_a_missing_one_is_named() {
    let (mut index, rx) = with_pool(PoolSpec::test("llama"));
    let literal = Prefix {
        prompt: Some("You are helpful.".into()),
        config_map_ref: None,
        ..prefix("literal")
    };
    index.apply_policy(with_warmup(vec![prefix("support"), literal]));
    assert_eq!(sent(&rx), [("literal".into(), "You are helpful.".into())]);
    let c = warmup_condition(&index).unwrap();
    assert!(!c.status);
    assert_eq!(c.reason, Reason::WarmupRefNotFound);
    assert_eq!(
        c.message,
        "left out: spec.warmup.prefixes[0].configMapRef: ConfigMap ml/prompts labelled kvroute.dev/warmup=true does not exist"
    );

    index.apply_config_map(prompts(&[("other", "x")]));
    assert!(
        warmup_condition(&index)
            .unwrap()
            .message
            .contains("has no key \"support\"")
    );

    index.apply_config_map(prompts(&[("support", "Answer as Acme support.")]));
    let system = r#"[{"content":"Answer as Acme support.","role":"system"}]"#;
    assert_eq!(sent(&rx)[0], ("support".into(), system.into()));
    let c = warmup_condition(&index).unwrap();
    assert_eq!((c.status, c.reason), (true, Reason::WarmupReady));

    // An edit of the ConfigMap reaches the routers.
    index.apply_config_map(prompts(&[("support", "v2")]));
    assert!(sent(&rx)[0].1.contains("v2"));
    index.delete_config_map(NS, "prompts");
    assert_eq!(sent(&rx).len(), 1);
}

#[test]
fn a_warmup_breaking_a_rule_makes_the_policy_invalid_naming_the_field() {
    let (mut index, rx) = with_pool(PoolSpec::test("llama"));
    let both = Prefix {
        prompt: Some("x".into()),
        ..prefix("a")
    };
    index.apply_policy(with_warmup(vec![both]));
    let status = index.policy_status(NS, "fast").unwrap();
    assert!(!status.accepted.status);
    assert_eq!(
        status.accepted.message,
        "spec.warmup.prefixes[].messages a: give exactly one of messages, prompt and configMapRef"
    );
    assert_eq!(status.warmup, None);
    assert_eq!(sent(&rx), []);

    let salted = PolicySpec {
        tenancy_mode: Some(kvroute_core::spec::TenancyMode::Salted),
        ..with_warmup(vec![prefix("a")])
    };
    index.apply_policy(salted);
    let status = index.policy_status(NS, "fast").unwrap();
    assert_eq!(
        status.accepted.message,
        "spec.warmup.prefixes[].tenant a: is required under salted tenancy"
    );
}

#[test]
fn the_pools_serving_router_pods_are_named_sorted() {
    let (mut index, rx) = with_pool(PoolSpec::test("llama"));
    let router = |name: &str| {
        PodInfo::test(name)
            .ip("10.0.9.1")
            .running()
            .ready()
            .label("kvroute.dev/router-for", "llama")
    };
    index.apply_pod(router("router-b"));
    index.apply_pod(router("router-a"));
    // Of another pool, not ready, and in another namespace for this one.
    index.apply_pod(router("router-c").label("kvroute.dev/router-for", "mistral"));
    index.apply_pod(router("router-d").unready());
    index.apply_pod(
        router("router-e")
            .in_namespace("kvroute")
            .label("kvroute.dev/router-for-namespace", NS),
    );
    assert_eq!(rx.borrow().routers, ["router-a", "router-b", "router-e"]);
    index.delete_pod(NS, "router-a");
    assert_eq!(rx.borrow().routers, ["router-b", "router-e"]);
    index.apply_pod(router("router-b").deleting());
    assert_eq!(rx.borrow().routers, ["router-e"]);
}

/// A ready router pod of pool `llama`, at `ip`.
fn router_at(name: &str, ip: &str) -> PodInfo {
    PodInfo::test(name)
        .ip(ip)
        .running()
        .ready()
        .label("kvroute.dev/router-for", "llama")
}

fn ip(s: &str) -> Option<std::net::IpAddr> {
    Some(s.parse().unwrap())
}

#[test]
fn routers_reports_keep_the_newest_send_per_prefix_and_owner_of_the_pool() {
    let (mut index, rx) = with_pool(PoolSpec::test("llama"));
    let literal = |name: &str| Prefix {
        prompt: Some("You are helpful.".into()),
        config_map_ref: None,
        ..prefix(name)
    };
    index.apply_policy(with_warmup(vec![literal("b"), literal("a")]));
    index.apply_pod(PodInfo::test("pod-1").ip("10.0.0.1").running().ready());
    index.apply_pod(router_at("router-0", "10.0.9.0"));
    index.apply_pod(router_at("router-1", "10.0.9.1"));
    let report = |entries: &[(&str, &str, u64)]| -> Vec<(String, String, u64)> {
        (entries.iter())
            .map(|(p, e, t)| (p.to_string(), e.to_string(), *t))
            .collect()
    };
    // Unknown prefixes, endpoints and pools are dropped.
    let taken = index.record_warmups(
        NS,
        "llama",
        "router-0",
        ip("10.0.9.0"),
        report(&[
            ("a", "pod-1:8000", 5_000),
            ("z", "pod-1:8000", 1),
            ("a", "gone:8000", 1),
        ]),
    );
    assert_eq!(taken, Ok(1));
    assert_eq!(
        index.record_warmups(
            NS,
            "nope",
            "r",
            ip("10.0.9.0"),
            report(&[("a", "pod-1:8000", 1)])
        ),
        Err(WarmupRefused::UnknownRouter)
    );
    // An older send from another router changes nothing; a newer one wins.
    let mut changes = index.changes();
    changes.borrow_and_update();
    let router_1 = |index: &mut Index, sent| {
        index.record_warmups(NS, "llama", "router-1", ip("10.0.9.1"), sent)
    };
    router_1(&mut index, report(&[("a", "pod-1:8000", 4_000)])).unwrap();
    assert!(!changes.has_changed().unwrap());
    router_1(&mut index, report(&[("b", "pod-1:8000", 7_000)])).unwrap();
    assert!(changes.has_changed().unwrap());
    let status = index.policy_status(NS, "fast").unwrap();
    let sent: Vec<(&str, &str, u64, &str)> = (status.warmups_sent.iter())
        .map(|s| (&*s.prefix, &*s.endpoint, s.unix_ms, &*s.router))
        .collect();
    assert_eq!(
        sent,
        [
            ("b", "pod-1:8000", 7_000, "router-1"),
            ("a", "pod-1:8000", 5_000, "router-0"),
        ]
    );
    assert_eq!(status.warmup_prefixes, ["b", "a"]);

    // Routers learn where to report.
    assert_eq!(rx.borrow().status_writer, "");
    index.set_status_writer(Some("10.0.0.9:9443".into()));
    assert_eq!(rx.borrow().status_writer, "10.0.0.9:9443");

    // A prefix removed from the policy leaves the report with the next one.
    index.apply_policy(with_warmup(vec![literal("a")]));
    router_1(&mut index, Vec::new()).unwrap();
    let status = index.policy_status(NS, "fast").unwrap();
    assert_eq!(status.warmups_sent.len(), 1);
}

#[test]
fn only_the_pools_named_routers_report_and_each_from_its_pods_ip() {
    let (mut index, _rx) = with_pool(PoolSpec::test("llama"));
    index.apply_policy(with_warmup(vec![Prefix {
        prompt: Some("You are helpful.".into()),
        config_map_ref: None,
        ..prefix("a")
    }]));
    index.apply_pod(PodInfo::test("pod-1").ip("10.0.0.1").running().ready());
    index.apply_pod(router_at("router-0", "10.0.9.0"));
    index.apply_pod(router_at("router-1", "10.0.9.1"));
    // Of another pool, and not ready.
    index.apply_pod(router_at("other", "10.0.9.2").label("kvroute.dev/router-for", "mistral"));
    index.apply_pod(router_at("unready", "10.0.9.3").unready());
    let mut from = |router: &str, peer: &str| {
        let sent = vec![("a".to_owned(), "pod-1:8000".to_owned(), 1_000)];
        index.record_warmups(NS, "llama", router, ip(peer), sent)
    };
    use WarmupRefused::{UnknownRouter, WrongAddress};
    assert_eq!(from("evil-router", "10.0.9.0"), Err(UnknownRouter));
    assert_eq!(from("other", "10.0.9.2"), Err(UnknownRouter));
    assert_eq!(from("unready", "10.0.9.3"), Err(UnknownRouter));
    // A router's name from another router's address, or another host's.
    assert_eq!(from("router-0", "10.0.9.1"), Err(WrongAddress));
    assert_eq!(from("router-0", "10.6.6.6"), Err(WrongAddress));
    // An IPv4 client seen by a dual-stack listener is still itself.
    assert_eq!(from("router-0", "::ffff:10.0.9.0"), Ok(1));
    assert_eq!(
        index.record_warmups(NS, "llama", "router-1", None, Vec::new()),
        Err(WrongAddress)
    );
    // Refused reports changed nothing.
    let status = index.policy_status(NS, "fast").unwrap();
    let by: Vec<&str> = status.warmups_sent.iter().map(|s| &*s.router).collect();
    assert_eq!(by, ["router-0"]);
}
