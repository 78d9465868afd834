//! The fake API server driven by a real `kube::Client` (kube-rs, rustls
//! build) over plain HTTP: typed CRUD on pods, a kube-runtime watcher, and a
//! lease, as the real controllers use them; and the same server in
//! process, without HTTP ([`FakeApiServer::service`]).

use std::collections::BTreeMap;
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::{Container, Pod, PodSpec, PodStatus};
use kube::api::{DeleteParams, ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::watcher;
use kube::{Api, Client, Config, ResourceExt};
use kvroute_testkit::FakeApiServer;
use serde_json::json;

const DEADLINE: Duration = Duration::from_secs(10);

async fn client(server: &FakeApiServer) -> Client {
    let kubeconfig = Kubeconfig::from_yaml(&server.kubeconfig_yaml()).expect("parse kubeconfig");
    let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .expect("config from kubeconfig");
    assert_eq!(config.default_namespace, "default");
    Client::try_from(config).expect("build client")
}

fn pod(name: &str, labels: &[(&str, &str)]) -> Pod {
    Pod {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            labels: Some(
                labels
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect::<BTreeMap<_, _>>(),
            ),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            containers: vec![Container {
                name: "main".to_owned(),
                image: Some("example/engine:1".to_owned()),
                ..Container::default()
            }],
            ..PodSpec::default()
        }),
        status: None,
    }
}

fn api_code(err: &kube::Error) -> Option<u16> {
    match err {
        kube::Error::Api(status) => Some(status.code),
        _ => None,
    }
}

#[tokio::test]
async fn pod_crud_through_kube_client() {
    let server = FakeApiServer::start().await;
    let pods: Api<Pod> = Api::default_namespaced(client(&server).await);

    // create
    let created = pods
        .create(
            &PostParams::default(),
            &pod("engine-0", &[("app", "engine")]),
        )
        .await
        .expect("create pod");
    assert_eq!(created.metadata.name.as_deref(), Some("engine-0"));
    assert_eq!(created.metadata.namespace.as_deref(), Some("default"));
    assert!(created.metadata.uid.is_some());
    assert!(created.metadata.creation_timestamp.is_some());
    let rv1 = created.metadata.resource_version.clone().expect("rv");
    pods.create(&PostParams::default(), &pod("other", &[("app", "other")]))
        .await
        .expect("create second pod");

    // a second create of the same name is 409 AlreadyExists
    let dup = pods
        .create(&PostParams::default(), &pod("engine-0", &[]))
        .await
        .expect_err("duplicate create");
    assert_eq!(api_code(&dup), Some(409), "{dup:?}");

    // get
    let got = pods.get("engine-0").await.expect("get pod");
    assert_eq!(got.metadata.resource_version.as_deref(), Some(rv1.as_str()));
    let missing = pods.get("nope").await.expect_err("get missing");
    assert_eq!(api_code(&missing), Some(404), "{missing:?}");
    assert!(pods.get_opt("nope").await.expect("get_opt").is_none());

    // list with a label selector
    let listed = pods
        .list(&ListParams::default().labels("app=engine"))
        .await
        .expect("list pods");
    let names: Vec<_> = listed
        .items
        .iter()
        .filter_map(|p| p.metadata.name.as_deref())
        .collect();
    assert_eq!(names, ["engine-0"]);
    assert!(listed.metadata.resource_version.is_some());
    let all = pods.list(&ListParams::default()).await.expect("list all");
    assert_eq!(all.items.len(), 2);

    // replace, then a replace with the now-stale resourceVersion is a 409
    let mut changed = got.clone();
    changed
        .metadata
        .labels
        .get_or_insert_with(BTreeMap::new)
        .insert("tier".to_owned(), "gold".to_owned());
    let replaced = pods
        .replace("engine-0", &PostParams::default(), &changed)
        .await
        .expect("replace pod");
    assert_ne!(
        replaced.metadata.resource_version.as_deref(),
        Some(rv1.as_str())
    );
    assert_eq!(
        replaced.labels().get("tier").map(String::as_str),
        Some("gold")
    );
    let stale = pods
        .replace("engine-0", &PostParams::default(), &changed)
        .await
        .expect_err("stale replace");
    assert_eq!(api_code(&stale), Some(409), "{stale:?}");

    // merge patch
    let patched = pods
        .patch(
            "engine-0",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {"kvroute.dev/x": "1"}}})),
        )
        .await
        .expect("merge patch");
    assert_eq!(
        patched
            .annotations()
            .get("kvroute.dev/x")
            .map(String::as_str),
        Some("1")
    );
    assert_eq!(
        patched.labels().get("tier").map(String::as_str),
        Some("gold")
    );

    // patch_status changes only status
    let status = Patch::Merge(json!({
        "metadata": {"labels": {"ignored": "yes"}},
        "status": {"phase": "Running", "podIP": "10.0.0.7"},
    }));
    let with_status = pods
        .patch_status("engine-0", &PatchParams::default(), &status)
        .await
        .expect("patch status");
    let st: &PodStatus = with_status.status.as_ref().expect("status");
    assert_eq!(st.phase.as_deref(), Some("Running"));
    assert_eq!(st.pod_ip.as_deref(), Some("10.0.0.7"));
    assert!(!with_status.labels().contains_key("ignored"));
    let fetched = pods.get_status("engine-0").await.expect("get status");
    assert_eq!(
        fetched.status.and_then(|s| s.phase).as_deref(),
        Some("Running")
    );

    // delete
    let deleted = pods
        .delete("engine-0", &DeleteParams::default())
        .await
        .expect("delete pod");
    // the fake returns the deleted object (no grace periods)
    assert!(deleted.left().is_some());
    let gone = pods.get("engine-0").await.expect_err("get deleted");
    assert_eq!(api_code(&gone), Some(404), "{gone:?}");
    let again = pods
        .delete("engine-0", &DeleteParams::default())
        .await
        .expect_err("delete deleted");
    assert_eq!(api_code(&again), Some(404), "{again:?}");
}

async fn next<S>(stream: &mut S) -> watcher::Event<Pod>
where
    S: futures_util::Stream<Item = watcher::Result<watcher::Event<Pod>>> + Unpin,
{
    tokio::time::timeout(DEADLINE, stream.next())
        .await
        .expect("watch event before the deadline")
        .expect("watch stream ended")
        .expect("watch error")
}

#[tokio::test]
async fn watcher_sees_init_apply_and_delete() {
    let server = FakeApiServer::start().await;
    server
        .put(json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "existing", "namespace": "default"},
            "spec": {"containers": [{"name": "main"}]},
        }))
        .expect("put existing pod");
    let pods: Api<Pod> = Api::default_namespaced(client(&server).await);
    let mut stream = watcher(pods, watcher::Config::default()).boxed();

    assert!(matches!(next(&mut stream).await, watcher::Event::Init));
    match next(&mut stream).await {
        watcher::Event::InitApply(p) => assert_eq!(p.metadata.name.as_deref(), Some("existing")),
        other => panic!("expected InitApply, got {other:?}"),
    }
    assert!(matches!(next(&mut stream).await, watcher::Event::InitDone));

    server
        .put(json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "fresh", "namespace": "default"},
            "spec": {"containers": [{"name": "main"}]},
        }))
        .expect("put fresh pod");
    match next(&mut stream).await {
        watcher::Event::Apply(p) => assert_eq!(p.metadata.name.as_deref(), Some("fresh")),
        other => panic!("expected Apply, got {other:?}"),
    }

    server
        .delete("v1", "Pod", "default", "existing")
        .expect("delete existing pod");
    match next(&mut stream).await {
        watcher::Event::Delete(p) => assert_eq!(p.metadata.name.as_deref(), Some("existing")),
        other => panic!("expected Delete, got {other:?}"),
    }
}

#[tokio::test]
async fn lease_create_and_replace() {
    let server = FakeApiServer::start().await;
    let leases: Api<Lease> = Api::namespaced(client(&server).await, "kvroute-system");

    let lease = Lease {
        metadata: ObjectMeta {
            name: Some("kvroute-leader".to_owned()),
            ..ObjectMeta::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some("replica-a".to_owned()),
            lease_duration_seconds: Some(15),
            lease_transitions: Some(0),
            ..LeaseSpec::default()
        }),
    };
    let created = leases
        .create(&PostParams::default(), &lease)
        .await
        .expect("create lease");
    assert_eq!(
        created.metadata.namespace.as_deref(),
        Some("kvroute-system")
    );

    let mut takeover = created.clone();
    let spec = takeover.spec.get_or_insert_with(LeaseSpec::default);
    spec.holder_identity = Some("replica-b".to_owned());
    spec.lease_transitions = Some(1);
    let replaced = leases
        .replace("kvroute-leader", &PostParams::default(), &takeover)
        .await
        .expect("replace lease");
    assert_eq!(
        replaced
            .spec
            .as_ref()
            .and_then(|s| s.holder_identity.as_deref()),
        Some("replica-b")
    );
    assert_ne!(
        replaced.metadata.resource_version,
        created.metadata.resource_version
    );

    // the loser of a race replaces with the old version and gets a 409
    let stale = leases
        .replace("kvroute-leader", &PostParams::default(), &created)
        .await
        .expect_err("stale lease replace");
    assert_eq!(api_code(&stale), Some(409), "{stale:?}");

    let stored = server
        .get(
            "coordination.k8s.io/v1",
            "Lease",
            "kvroute-system",
            "kvroute-leader",
        )
        .expect("lease in the store");
    assert_eq!(stored["spec"]["holderIdentity"], "replica-b");
}

#[tokio::test]
async fn streaming_list_watcher_with_a_selector() {
    let server = FakeApiServer::start().await;
    let pods: Api<Pod> = Api::default_namespaced(client(&server).await);
    pods.create(&PostParams::default(), &pod("a", &[("app", "engine")]))
        .await
        .expect("create a");
    pods.create(&PostParams::default(), &pod("b", &[("app", "other")]))
        .await
        .expect("create b");
    let config = watcher::Config::default()
        .labels("app=engine")
        .streaming_lists();
    let mut stream = watcher(pods.clone(), config).boxed();

    assert!(matches!(next(&mut stream).await, watcher::Event::Init));
    match next(&mut stream).await {
        watcher::Event::InitApply(p) => assert_eq!(p.metadata.name.as_deref(), Some("a")),
        other => panic!("expected InitApply, got {other:?}"),
    }
    assert!(matches!(next(&mut stream).await, watcher::Event::InitDone));

    // a pod entering the selector is an Apply, one leaving it a Delete
    pods.patch(
        "b",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {"app": "engine"}}})),
    )
    .await
    .expect("relabel b");
    match next(&mut stream).await {
        watcher::Event::Apply(p) => assert_eq!(p.metadata.name.as_deref(), Some("b")),
        other => panic!("expected Apply, got {other:?}"),
    }
    pods.patch(
        "a",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {"app": null}}})),
    )
    .await
    .expect("unlabel a");
    match next(&mut stream).await {
        watcher::Event::Delete(p) => assert_eq!(p.metadata.name.as_deref(), Some("a")),
        other => panic!("expected Delete, got {other:?}"),
    }
}

#[tokio::test]
async fn server_side_apply_creates_and_updates() {
    let server = FakeApiServer::start().await;
    let pods: Api<Pod> = Api::default_namespaced(client(&server).await);
    let params = PatchParams::apply("kvroute-test").force();

    let mut desired = pod("applied", &[("app", "engine")]);
    desired.metadata.name = None;
    let applied = pods
        .patch("applied", &params, &Patch::Apply(&desired))
        .await
        .expect("apply creates");
    assert_eq!(applied.metadata.name.as_deref(), Some("applied"));
    assert_eq!(applied.metadata.generation, Some(1));

    let status = Patch::Apply(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "status": {"phase": "Pending"},
    }));
    let with_status = pods
        .patch_status("applied", &params, &status)
        .await
        .expect("apply status");
    assert_eq!(
        with_status.status.and_then(|s| s.phase).as_deref(),
        Some("Pending")
    );
    assert_eq!(with_status.metadata.generation, Some(1));
}

#[tokio::test]
async fn watcher_relists_after_an_expired_watch() {
    let server = FakeApiServer::start().await;
    let pods: Api<Pod> = Api::default_namespaced(client(&server).await);
    // A non-zero list version: a watch from "0" means "from any version" and
    // starts with a fresh snapshot, which can never be expired.
    pods.create(&PostParams::default(), &pod("seed", &[]))
        .await
        .expect("create seed");
    let mut stream = watcher(pods, watcher::Config::default()).boxed();
    assert!(matches!(next(&mut stream).await, watcher::Event::Init));
    assert!(matches!(
        next(&mut stream).await,
        watcher::Event::InitApply(_)
    ));
    assert!(matches!(next(&mut stream).await, watcher::Event::InitDone));

    // Without polling the watcher, write more changes than the fake keeps:
    // its watch falls behind and ends with a 410 Expired ERROR event.
    let writes = kvroute_testkit::HISTORY_LEN + 200;
    for i in 0..writes {
        server
            .put(json!({
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "churn", "namespace": "default",
                             "labels": {"n": i.to_string()}},
                "spec": {"containers": [{"name": "main"}]},
            }))
            .expect("put churn");
    }

    let mut saw_expired = false;
    let relisted = tokio::time::timeout(DEADLINE, async {
        while let Some(item) = stream.next().await {
            match item {
                Err(watcher::Error::WatchError(status)) => {
                    assert_eq!(status.code, 410, "{status:?}");
                    saw_expired = true;
                }
                Err(e) => panic!("unexpected watch error {e:?}"),
                Ok(watcher::Event::Init) if saw_expired => return true,
                Ok(_) => {}
            }
        }
        false
    })
    .await
    .expect("relist before the deadline");
    assert!(relisted, "the watcher relisted after a 410");
    let mut relisted_names = Vec::new();
    loop {
        match next(&mut stream).await {
            watcher::Event::InitApply(p) => {
                if p.name_any() == "churn" {
                    assert_eq!(
                        p.labels().get("n").map(String::as_str),
                        Some((writes - 1).to_string().as_str())
                    );
                }
                relisted_names.push(p.name_any());
            }
            watcher::Event::InitDone => break,
            other => panic!("expected InitApply or InitDone, got {other:?}"),
        }
    }
    relisted_names.sort();
    assert_eq!(relisted_names, ["churn", "seed"]);
}

#[tokio::test]
async fn the_in_process_service_shares_the_servers_objects() {
    let server = FakeApiServer::start().await;
    let in_process: Api<Pod> = Api::default_namespaced(Client::new(server.service(), "default"));
    let over_http: Api<Pod> = Api::default_namespaced(client(&server).await);

    let created = in_process
        .create(
            &PostParams::default(),
            &pod("engine-0", &[("app", "engine")]),
        )
        .await
        .expect("create through the service");
    let read = over_http.get("engine-0").await.expect("read over HTTP");
    assert_eq!(read.resource_version(), created.resource_version());
    let mut edited = created.clone();
    edited.metadata.labels = None;
    in_process
        .replace("engine-0", &PostParams::default(), &edited)
        .await
        .expect("replace at the version read");
    let conflict = in_process
        .replace("engine-0", &PostParams::default(), &created)
        .await
        .expect_err("a stale resourceVersion conflicts");
    assert_eq!(api_code(&conflict), Some(409));
    assert_eq!(
        server.get("v1", "Pod", "default", "engine-0").unwrap()["metadata"].get("labels"),
        None
    );
}
