//! Which pods become which endpoints, flagged how, in what order.

use super::*;

#[test]
fn a_pod_becoming_ready_serves() {
    let (mut index, mut rx) = with_pool(PoolSpec::test("llama"));
    index.apply_pod(PodInfo::test("a"));
    assert!(endpoints(&rx).is_empty(), "no IP, no endpoint");

    index.apply_pod(PodInfo::test("a").ip("10.0.0.1").running());
    assert_eq!(endpoints(&rx), [ep("a:8000", false, false)]);
    let before = version(&rx);
    notified(&mut rx);

    index.apply_pod(PodInfo::test("a").ip("10.0.0.1").ready());
    assert!(notified(&mut rx));
    assert_eq!(endpoints(&rx), [ep("a:8000", true, false)]);
    assert_eq!(version(&rx), before + 1);
    let e = &rx.borrow().endpoints[0];
    assert_eq!((e.address.as_str(), e.http_port), ("10.0.0.1", 8000));
}

#[test]
fn a_pod_turning_unready_stays_listed_unready() {
    let (mut index, rx) = with_pool(PoolSpec::test("llama"));
    let pod = PodInfo::test("a").ip("10.0.0.1").ready();
    index.apply_pod(pod.clone());
    index.apply_pod(pod.unready());
    assert_eq!(endpoints(&rx), [ep("a:8000", false, false)]);
}

#[test]
fn a_terminating_pod_drains_then_goes() {
    let (mut index, rx) = with_pool(PoolSpec::test("llama"));
    let pod = PodInfo::test("a").ip("10.0.0.1").ready();
    index.apply_pod(pod.clone());
    index.apply_pod(PodInfo::test("b").ip("10.0.0.2").ready());

    index.apply_pod(pod.clone().deleting());
    assert_eq!(
        endpoints(&rx),
        [ep("a:8000", false, true), ep("b:8000", true, false)]
    );

    index.delete_pod(NS, "a");
    assert_eq!(endpoints(&rx), [ep("b:8000", true, false)]);
}

#[test]
fn a_terminating_pod_without_an_ip_is_not_listed() {
    let (mut index, rx) = with_pool(PoolSpec::test("llama"));
    index.apply_pod(PodInfo::test("a").ready().deleting());
    assert!(endpoints(&rx).is_empty());
}

#[test]
fn pods_of_other_namespaces_or_labels_are_not_in_the_pool() {
    let (mut index, rx) = with_pool(PoolSpec::test("llama").also_select("tier", "gpu"));
    index.apply_pod(
        PodInfo::test("a")
            .ip("10.0.0.1")
            .ready()
            .label("tier", "gpu"),
    );
    index.apply_pod(PodInfo::test("b").ip("10.0.0.2").ready());
    index.apply_pod(
        PodInfo::test("c")
            .ip("10.0.0.3")
            .ready()
            .label("tier", "cpu"),
    );
    let other = PodInfo::test("d")
        .ip("10.0.0.4")
        .ready()
        .label("tier", "gpu");
    index.apply_pod(other.in_namespace("other"));
    assert_eq!(endpoints(&rx), [ep("a:8000", true, false)]);
}

#[test]
fn a_selector_edit_changes_the_endpoints() {
    let (mut index, rx) = with_pool(PoolSpec::test("llama"));
    index.apply_pod(PodInfo::test("a").ip("10.0.0.1").ready());
    let mistral = PodInfo::test("m").ip("10.0.0.9").ready();
    index.apply_pod(mistral.label("app", "mistral"));
    assert_eq!(endpoints(&rx), [ep("a:8000", true, false)]);

    index.apply_pool(PoolSpec::test("llama").selector("app", "mistral"));
    assert_eq!(endpoints(&rx), [ep("m:8000", true, false)]);
}

#[test]
fn a_target_port_edit_changes_the_endpoints() {
    let (mut index, rx) = with_pool(PoolSpec::test("llama"));
    index.apply_pod(PodInfo::test("a").ip("10.0.0.1").ready());
    index.apply_pool(PoolSpec::test("llama").target_ports(&[8001, 8000, 8001]));
    assert_eq!(
        endpoints(&rx),
        [ep("a:8000", true, false), ep("a:8001", true, false)]
    );
    index.apply_pool(PoolSpec::test("llama").target_ports(&[9000]));
    assert_eq!(endpoints(&rx), [ep("a:9000", true, false)]);
}

#[test]
fn endpoints_are_sorted_by_name() {
    let (mut index, rx) = with_pool(PoolSpec::test("llama"));
    for (name, ip) in [("b", "10.0.0.2"), ("a-b", "10.0.0.3"), ("a", "fd00::1")] {
        index.apply_pod(PodInfo::test(name).ip(ip).ready());
    }
    let names: Vec<String> = endpoints(&rx).into_iter().map(|e| e.0).collect();
    assert_eq!(names, ["a-b:8000", "a:8000", "b:8000"]);
    let ipv6 = rx.borrow().endpoints[1].address.clone();
    assert_eq!(ipv6, "fd00::1", "IPv6 without brackets");
}

#[test]
fn pool_status_counts_ready_endpoints() {
    let (mut index, _rx) = with_pool(PoolSpec::test("llama").target_ports(&[8000, 8001]));
    index.apply_pod(PodInfo::test("a").ip("10.0.0.1").ready());
    index.apply_pod(PodInfo::test("b").ip("10.0.0.2").running());
    index.apply_pod(PodInfo::test("c").ip("10.0.0.3").ready().deleting());
    let status = index.pool_status(NS, "llama").unwrap();
    assert!(status.accepted.status && status.resolved_refs.status);
    assert_eq!(status.ready_endpoints, 2, "a:8000 and a:8001");
    assert_eq!(status.policy, None);
}

#[test]
fn a_pool_that_can_select_nothing_is_not_accepted() {
    let mut pool = PoolSpec::test("llama");
    pool.selector.clear();
    let (mut index, rx) = with_pool(pool);
    index.apply_pod(PodInfo::test("a").ip("10.0.0.1").ready());
    assert!(rx.borrow().pool_exists);
    assert!(
        endpoints(&rx).is_empty(),
        "an empty selector selects nothing"
    );
    let status = index.pool_status(NS, "llama").unwrap();
    assert_eq!(status.accepted.reason, Reason::Invalid);

    index.apply_pool(PoolSpec::test("llama").target_ports(&[0]));
    assert_eq!(
        index.pool_status(NS, "llama").unwrap().accepted.reason,
        Reason::Invalid
    );
}

#[test]
fn the_endpoint_picker_reference_resolves_to_a_service_port() {
    let picker = |kind: &str, port: Option<u16>| PickerRef {
        group: String::new(),
        kind: kind.into(),
        name: "kvroute-picker".into(),
        port,
    };
    let mut pool = PoolSpec::test("llama");
    pool.picker = Some(picker("Service", Some(9002)));
    let (mut index, _rx) = with_pool(pool.clone());
    let refs = |index: &Index| index.pool_status(NS, "llama").unwrap().resolved_refs;

    let missing = refs(&index);
    assert!(!missing.status);
    assert_eq!(missing.reason, Reason::InvalidExtensionRef);
    assert!(
        missing.message.contains("does not exist"),
        "{}",
        missing.message
    );

    let changes = index.changes();
    let seen = *changes.borrow();
    index.apply_service(ServiceInfo {
        namespace: NS.into(),
        name: "kvroute-picker".into(),
        ports: vec![9002, 9090],
        external_name: false,
    });
    assert!(*changes.borrow() > seen, "the status writer wakes up");
    let resolved = refs(&index);
    assert!(resolved.status);
    assert_eq!(resolved.reason, Reason::ResolvedRefs);

    pool.picker = Some(picker("Service", Some(9003)));
    index.apply_pool(pool.clone());
    let wrong_port = refs(&index);
    assert_eq!(
        (wrong_port.status, wrong_port.reason),
        (false, Reason::InvalidExtensionRef)
    );
    assert!(
        wrong_port.message.contains("no port 9003"),
        "{}",
        wrong_port.message
    );

    pool.picker = Some(picker("Deployment", Some(9002)));
    index.apply_pool(pool);
    assert!(refs(&index).message.contains("not supported"));

    // A Service no pool names changes no status.
    let seen = *changes.borrow();
    index.apply_service(ServiceInfo {
        namespace: NS.into(),
        name: "unrelated".into(),
        ..ServiceInfo::default()
    });
    assert_eq!(*changes.borrow(), seen);
    index.delete_service(NS, "kvroute-picker");
    assert!(*changes.borrow() > seen);
}
