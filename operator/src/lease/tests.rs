//! The decision alone (no API); [`run`] against a scripted API whose every
//! request is asserted (tower-test); and two replicas against the stateful
//! fake API server, served in process. All on tokio's paused clock, so every
//! timing asserted is exact and no test waits in real time.

use std::sync::Arc;
use std::time::Duration;

use http::Method;
use k8s_openapi::jiff::Timestamp;
use kube::client::Body;
use kvroute_testkit::FakeApiServer;
use serde_json::{Value, json};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tower_test::mock::{self, SendResponse};

use super::*;

const ME: &str = "operator-0";
const OTHER: &str = "operator-1";
const DEFAULT: Duration = DEFAULT_LEASE_DURATION;

// ---- the decision ----

/// A lease as read: held by `holder` (`None` = released), at
/// `resource_version`, renewed at second `renewed`.
fn lease(holder: Option<&str>, resource_version: &str, renewed: i64) -> Lease {
    Lease {
        metadata: ObjectMeta {
            name: Some("kvroute-operator".into()),
            namespace: Some("ns".into()),
            resource_version: Some(resource_version.into()),
            ..ObjectMeta::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: holder.map(str::to_owned),
            lease_duration_seconds: Some(15),
            renew_time: Some(MicroTime(Timestamp::from_second(renewed).unwrap())),
            ..LeaseSpec::default()
        }),
    }
}

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

#[tokio::test(start_paused = true)]
async fn no_lease_is_created() {
    let mut memory = Memory::default();
    assert_eq!(
        memory.decide(None, ME, DEFAULT, Instant::now()),
        Action::Create
    );
}

#[tokio::test(start_paused = true)]
async fn our_lease_is_renewed() {
    let mut memory = Memory::default();
    let ours = lease(Some(ME), "5", 100);
    assert_eq!(
        memory.decide(Some(&ours), ME, DEFAULT, Instant::now()),
        Action::Renew
    );
}

#[tokio::test(start_paused = true)]
async fn another_holders_lease_is_followed_until_unchanged_for_its_duration() {
    let mut memory = Memory::default();
    let theirs = lease(Some(OTHER), "5", 100);
    let t0 = Instant::now();
    let decide = |memory: &mut Memory, at| memory.decide(Some(&theirs), ME, DEFAULT, at);
    assert_eq!(decide(&mut memory, t0), Action::Follow);
    assert_eq!(
        decide(&mut memory, t0 + secs(15) - Duration::from_millis(1)),
        Action::Follow
    );
    assert_eq!(decide(&mut memory, t0 + secs(15)), Action::TakeOver);
}

#[tokio::test(start_paused = true)]
async fn expiry_counts_from_when_we_first_saw_the_record_not_from_its_renew_time() {
    // renewTime is a year in the past by our wall clock; it does not matter.
    let mut memory = Memory::default();
    let theirs = lease(Some(OTHER), "5", 1_600_000_000);
    let t0 = Instant::now();
    assert_eq!(
        memory.decide(Some(&theirs), ME, DEFAULT, t0),
        Action::Follow
    );
    assert_eq!(
        memory.decide(Some(&theirs), ME, DEFAULT, t0 + secs(14)),
        Action::Follow
    );
}

#[tokio::test(start_paused = true)]
async fn a_changed_record_restarts_the_observation() {
    let mut memory = Memory::default();
    let t0 = Instant::now();
    let first = lease(Some(OTHER), "5", 100);
    assert_eq!(memory.decide(Some(&first), ME, DEFAULT, t0), Action::Follow);

    // Renewed at t0 + 10 s: a new renewTime and resourceVersion.
    let renewed = lease(Some(OTHER), "6", 110);
    let t10 = t0 + secs(10);
    assert_eq!(
        memory.decide(Some(&renewed), ME, DEFAULT, t10),
        Action::Follow
    );
    assert_eq!(
        memory.decide(Some(&renewed), ME, DEFAULT, t0 + secs(16)),
        Action::Follow
    );
    assert_eq!(
        memory.decide(Some(&renewed), ME, DEFAULT, t10 + secs(15)),
        Action::TakeOver
    );

    // Each part of the record counts on its own.
    for changed in [
        lease(Some(OTHER), "7", 110),
        lease(Some(OTHER), "6", 111),
        lease(Some("operator-2"), "6", 110),
    ] {
        let t = t10 + secs(30);
        assert_eq!(
            memory.decide(Some(&changed), ME, DEFAULT, t),
            Action::Follow
        );
    }
}

#[tokio::test(start_paused = true)]
async fn a_released_lease_is_taken_at_once() {
    let mut memory = Memory::default();
    let released = lease(None, "9", 100);
    assert_eq!(
        memory.decide(Some(&released), ME, DEFAULT, Instant::now()),
        Action::TakeOver
    );
    let mut empty_holder = lease(None, "9", 100);
    empty_holder.spec.as_mut().unwrap().holder_identity = Some(String::new());
    assert_eq!(
        memory.decide(Some(&empty_holder), ME, DEFAULT, Instant::now()),
        Action::TakeOver
    );
}

#[tokio::test(start_paused = true)]
async fn expiry_uses_the_leases_own_duration_else_ours() {
    let t0 = Instant::now();
    let mut short = lease(Some(OTHER), "5", 100);
    short.spec.as_mut().unwrap().lease_duration_seconds = Some(3);
    let mut memory = Memory::default();
    memory.decide(Some(&short), ME, DEFAULT, t0);
    assert_eq!(
        memory.decide(Some(&short), ME, DEFAULT, t0 + secs(3)),
        Action::TakeOver
    );

    for missing in [None, Some(0), Some(-1)] {
        let mut odd = lease(Some(OTHER), "5", 100);
        odd.spec.as_mut().unwrap().lease_duration_seconds = missing;
        let mut memory = Memory::default();
        memory.decide(Some(&odd), ME, secs(20), t0);
        assert_eq!(
            memory.decide(Some(&odd), ME, secs(20), t0 + secs(19)),
            Action::Follow,
            "{missing:?}"
        );
        assert_eq!(
            memory.decide(Some(&odd), ME, secs(20), t0 + secs(20)),
            Action::TakeOver,
            "{missing:?}"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn a_deleted_lease_forgets_the_observation() {
    let t0 = Instant::now();
    let theirs = lease(Some(OTHER), "5", 100);
    let mut memory = Memory::default();
    memory.decide(Some(&theirs), ME, DEFAULT, t0);
    assert_eq!(
        memory.decide(None, ME, DEFAULT, t0 + secs(10)),
        Action::Create
    );
    // Seen again after it came back: a fresh observation.
    assert_eq!(
        memory.decide(Some(&theirs), ME, DEFAULT, t0 + secs(16)),
        Action::Follow
    );
}

// ---- config and identity ----

#[test]
fn config_defaults_and_validation() {
    let config = LeaseConfig::new("ns", "kvroute-operator", ME);
    assert_eq!(config.lease_duration, secs(15));
    assert_eq!(config.renew_period, secs(5));
    assert_eq!(config.retry_period, secs(2));
    assert_eq!(config.validate(), Ok(()));

    let with = |f: fn(&mut LeaseConfig)| {
        let mut c = config.clone();
        f(&mut c);
        c.validate()
    };
    assert_eq!(
        with(|c| c.identity.clear()),
        Err(ConfigError::Empty { field: "identity" })
    );
    assert_eq!(
        with(|c| c.namespace.clear()),
        Err(ConfigError::Empty { field: "namespace" })
    );
    assert_eq!(
        with(|c| c.retry_period = Duration::ZERO),
        Err(ConfigError::Zero {
            field: "retry_period"
        })
    );
    assert_eq!(
        with(|c| c.renew_period = secs(10)),
        Err(ConfigError::RenewTooSlow {
            renew_period: secs(10),
            lease_duration: secs(15)
        })
    );
    let message = with(|c| c.renew_period = secs(10)).unwrap_err().to_string();
    assert!(message.contains("renew_period (10s)"), "{message}");
}

#[test]
fn lease_duration_seconds_round_up() {
    let mut config = LeaseConfig::new("ns", "kvroute-operator", ME);
    assert_eq!(config.lease_duration_seconds(), 15);
    config.lease_duration = Duration::from_millis(2500);
    assert_eq!(config.lease_duration_seconds(), 3);
    config.lease_duration = Duration::from_millis(10);
    assert_eq!(config.lease_duration_seconds(), 1);
    config.lease_duration = Duration::MAX;
    assert_eq!(config.lease_duration_seconds(), i32::MAX);
}

#[test]
fn identity_is_the_pod_name_else_host_and_pid() {
    let some = |s: &str| Some(s.to_owned());
    assert_eq!(identity_from(some("op-7d9f"), some("node"), 42), "op-7d9f");
    assert_eq!(identity_from(some(""), some("node\n"), 42), "node-42");
    assert_eq!(identity_from(None, some("  "), 42), "kvroute-operator-42");
    assert_eq!(identity_from(None, None, 42), "kvroute-operator-42");
    assert!(!default_identity().is_empty());
}

// ---- run, against a scripted API ----

const LEASE: &str = "/apis/coordination.k8s.io/v1/namespaces/ns/leases/kvroute-operator";
const PUT_LEASE: &str = "/apis/coordination.k8s.io/v1/namespaces/ns/leases/kvroute-operator?";
const POST_LEASE: &str = "/apis/coordination.k8s.io/v1/namespaces/ns/leases?";

type Request = http::Request<Body>;
type Response = http::Response<Body>;

/// One [`run`] against a scripted API.
struct Scripted {
    api: mock::Handle<Request, Response>,
    leader: watch::Receiver<bool>,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
}

impl Scripted {
    /// `run` as [`ME`] for `ns/kvroute-operator` with the default periods.
    fn start() -> Scripted {
        let (service, api) = mock::pair::<Request, Response>();
        let client = Client::new(service, "default");
        let (leader_tx, leader) = watch::channel(false);
        let (stop, stopped) = oneshot::channel::<()>();
        let config = LeaseConfig::new("ns", "kvroute-operator", ME);
        let (writer, _) = watch::channel(None);
        let task = tokio::spawn(run(
            client,
            config,
            leader_tx,
            writer,
            Arc::default(),
            async {
                let _ = stopped.await;
            },
        ));
        Scripted {
            api,
            leader,
            stop: Some(stop),
            task,
        }
    }

    /// The next request, asserted to be `method uri`, and its JSON body
    /// (`Null` when empty).
    async fn expect(&mut self, method: Method, uri: &str) -> (Value, SendResponse<Response>) {
        let (request, send) = self.api.next_request().await.expect("a request");
        assert_eq!(request.method(), method);
        assert_eq!(request.uri().to_string(), uri);
        (body(request).await, send)
    }

    fn leading(&self) -> bool {
        *self.leader.borrow()
    }

    /// GET → 404, POST → 201: we lead, holding the returned lease (rv "1").
    async fn acquire(&mut self) -> Value {
        let (_, send) = self.expect(Method::GET, LEASE).await;
        respond(send, 404, &status(404, "NotFound"));
        let (created, send) = self.expect(Method::POST, POST_LEASE).await;
        let created = stored(created, "1");
        respond(send, 201, &created);
        self.leader.wait_for(|l| *l).await.expect("leader");
        created
    }

    /// Completes `shutdown` and waits for `run` to return.
    async fn stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        (&mut self.task).await.expect("run returns");
    }
}

async fn body(request: Request) -> Value {
    let bytes = request
        .into_body()
        .collect_bytes()
        .await
        .expect("request body");
    if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes).expect("JSON body")
    }
}

fn respond(send: SendResponse<Response>, code: u16, body: &Value) {
    let bytes = serde_json::to_vec(body).expect("serialize");
    send.send_response(
        http::Response::builder()
            .status(code)
            .header("content-type", "application/json")
            .body(Body::from(bytes))
            .expect("response"),
    );
}

fn status(code: u16, reason: &str) -> Value {
    json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {},
        "status": "Failure", "message": reason, "reason": reason, "code": code,
    })
}

/// `object` as the server returns it after a write: at `resource_version`.
fn stored(mut object: Value, resource_version: &str) -> Value {
    object["metadata"]["resourceVersion"] = json!(resource_version);
    object
}

fn time(value: &Value) -> Timestamp {
    value
        .as_str()
        .expect("a timestamp string")
        .parse()
        .expect("RFC 3339")
}

/// [`OTHER`]'s lease at resourceVersion "7", with 3 transitions so far.
fn others_lease() -> Value {
    json!({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": "kvroute-operator", "namespace": "ns", "resourceVersion": "7"},
        "spec": {
            "holderIdentity": OTHER, "leaseDurationSeconds": 15, "leaseTransitions": 3,
            "acquireTime": "2020-01-01T00:00:00.000000Z",
            "renewTime": "2020-01-01T00:00:10.000000Z",
        },
    })
}

#[tokio::test(start_paused = true)]
async fn creates_a_missing_lease_then_renews_it() {
    let mut api = Scripted::start();
    let (_, send) = api.expect(Method::GET, LEASE).await;
    assert!(!api.leading());
    respond(send, 404, &status(404, "NotFound"));

    let (created, send) = api.expect(Method::POST, POST_LEASE).await;
    assert_eq!(created["metadata"]["name"], "kvroute-operator");
    assert_eq!(created["metadata"]["namespace"], "ns");
    assert_eq!(created["metadata"].get("resourceVersion"), None);
    let spec = &created["spec"];
    assert_eq!(spec["holderIdentity"], ME);
    assert_eq!(spec["leaseDurationSeconds"], 15);
    assert_eq!(spec["leaseTransitions"], 0);
    assert_eq!(spec["acquireTime"], spec["renewTime"]);
    let created = stored(created, "1");
    respond(send, 201, &created);
    api.leader.wait_for(|l| *l).await.expect("leader");
    let acquired = Instant::now();

    // One renew period later: read, then replace at the version read.
    let (_, send) = api.expect(Method::GET, LEASE).await;
    assert_eq!(acquired.elapsed(), DEFAULT_RENEW_PERIOD);
    respond(send, 200, &created);
    let (renewed, send) = api.expect(Method::PUT, PUT_LEASE).await;
    assert_eq!(renewed["metadata"]["resourceVersion"], "1");
    assert_eq!(renewed["spec"]["holderIdentity"], ME);
    assert_eq!(renewed["spec"]["leaseTransitions"], 0);
    assert_eq!(
        renewed["spec"]["acquireTime"],
        created["spec"]["acquireTime"]
    );
    assert!(time(&renewed["spec"]["renewTime"]) > time(&created["spec"]["renewTime"]));
    respond(send, 200, &stored(renewed, "2"));

    // Still leading at the next renewal, which is made at the new version.
    let (_, send) = api.expect(Method::GET, LEASE).await;
    assert!(api.leading());
    assert_eq!(acquired.elapsed(), 2 * DEFAULT_RENEW_PERIOD);
    api.task.abort();
    drop(send);
}

#[tokio::test(start_paused = true)]
async fn follows_a_fresh_lease_and_takes_it_over_once_unchanged_for_its_duration() {
    let mut api = Scripted::start();
    let theirs = others_lease();
    let first_read = Instant::now();
    let mut reads = 0;
    let (taken, send) = loop {
        let (request, send) = api.api.next_request().await.expect("a request");
        if request.method() != Method::GET {
            assert_eq!(request.method(), Method::PUT);
            assert_eq!(request.uri().to_string(), PUT_LEASE);
            break (body(request).await, send);
        }
        assert_eq!(request.uri().to_string(), LEASE);
        assert!(!api.leading(), "leading on someone else's fresh lease");
        // A follower reads every retry period.
        assert_eq!(first_read.elapsed(), reads * DEFAULT_RETRY_PERIOD);
        reads += 1;
        respond(send, 200, &theirs);
    };
    // Reads at 0, 2, …, 16 s: the record was 16 s unchanged at the last one,
    // and 14 s (too young) at the one before.
    assert_eq!(reads, 9);
    assert_eq!(taken["metadata"]["resourceVersion"], "7");
    assert_eq!(taken["spec"]["holderIdentity"], ME);
    assert_eq!(taken["spec"]["leaseTransitions"], 4);
    assert_eq!(taken["spec"]["leaseDurationSeconds"], 15);
    assert_eq!(taken["spec"]["acquireTime"], taken["spec"]["renewTime"]);
    assert!(time(&taken["spec"]["renewTime"]) > time(&theirs["spec"]["renewTime"]));
    assert!(!api.leading());
    respond(send, 200, &stored(taken, "8"));
    api.leader.wait_for(|l| *l).await.expect("leader");
    api.task.abort();
}

#[tokio::test(start_paused = true)]
async fn a_conflicting_renewal_steps_down() {
    let mut api = Scripted::start();
    let created = api.acquire().await;

    let (_, send) = api.expect(Method::GET, LEASE).await;
    respond(send, 200, &created);
    let (_, send) = api.expect(Method::PUT, PUT_LEASE).await;
    respond(send, 409, &status(409, "Conflict"));
    api.leader.wait_for(|l| !*l).await.expect("follower");
    let stepped_down = Instant::now();

    // Now a follower: the next read comes a retry period later.
    let (_, send) = api.expect(Method::GET, LEASE).await;
    assert_eq!(stepped_down.elapsed(), DEFAULT_RETRY_PERIOD);
    respond(send, 200, &others_lease());
    let (_, send) = api.expect(Method::GET, LEASE).await;
    assert!(!api.leading());
    drop(send);
    api.task.abort();
}

#[tokio::test(start_paused = true)]
async fn losing_the_race_to_create_follows() {
    let mut api = Scripted::start();
    let (_, send) = api.expect(Method::GET, LEASE).await;
    respond(send, 404, &status(404, "NotFound"));
    let (_, send) = api.expect(Method::POST, POST_LEASE).await;
    respond(send, 409, &status(409, "AlreadyExists"));
    let lost = Instant::now();

    let (_, send) = api.expect(Method::GET, LEASE).await;
    assert_eq!(lost.elapsed(), DEFAULT_RETRY_PERIOD);
    assert!(!api.leading());
    assert!(!api.leader.has_changed().expect("sender alive"));
    drop(send);
    api.task.abort();
}

#[tokio::test(start_paused = true)]
async fn failing_renewals_step_down_at_two_thirds_of_the_lease_duration() {
    let mut api = Scripted::start();
    api.acquire().await;
    let acquired = Instant::now();

    let (_, send) = api.expect(Method::GET, LEASE).await;
    respond(send, 500, &status(500, "InternalError"));
    // The next try is due at 10 s, the renew deadline: a follower makes it.
    let (_, send) = api.expect(Method::GET, LEASE).await;
    assert_eq!(acquired.elapsed(), secs(10));
    assert!(!api.leading());
    drop(send);
    api.task.abort();
}

#[tokio::test(start_paused = true)]
async fn a_hung_renewal_steps_down_at_the_deadline() {
    let mut api = Scripted::start();
    api.acquire().await;
    let acquired = Instant::now();

    let (_, hung) = api.expect(Method::GET, LEASE).await;
    api.leader.wait_for(|l| !*l).await.expect("follower");
    assert_eq!(acquired.elapsed(), secs(10));
    drop(hung);
    api.task.abort();
}

#[tokio::test(start_paused = true)]
async fn shutdown_releases_the_lease_after_stepping_down() {
    let mut api = Scripted::start();
    let created = api.acquire().await;

    let stop = api.stop.take().expect("not stopped");
    let _ = stop.send(());
    let (released, send) = api.expect(Method::PUT, PUT_LEASE).await;
    assert!(!api.leading(), "still leading while releasing");
    assert_eq!(released["metadata"]["resourceVersion"], "1");
    assert_eq!(released["spec"].get("holderIdentity"), None);
    assert_eq!(released["spec"]["leaseDurationSeconds"], 1);
    assert_eq!(released["spec"]["leaseTransitions"], 0);
    assert!(time(&released["spec"]["renewTime"]) > time(&created["spec"]["renewTime"]));
    respond(send, 200, &stored(released, "2"));
    api.stop().await;
    assert!(!api.leading());
}

#[tokio::test(start_paused = true)]
async fn shutdown_as_a_follower_releases_nothing() {
    let mut api = Scripted::start();
    let (_, send) = api.expect(Method::GET, LEASE).await;
    respond(send, 200, &others_lease());
    api.stop().await;
    // `run` returned and dropped its client: no request came, or will.
    assert!(api.api.next_request().await.is_none());
    assert!(!api.leading());
}

// ---- two replicas, against the fake API server ----

/// The replicas' periods: the operator's defaults, which the paused clock
/// makes no slower to test than short ones.
const LEASE_DURATION: Duration = DEFAULT_LEASE_DURATION;
const RENEW: Duration = DEFAULT_RENEW_PERIOD;
const RETRY: Duration = DEFAULT_RETRY_PERIOD;

/// One `run` with its own identity, against a real client.
struct Replica {
    identity: &'static str,
    leader: watch::Receiver<bool>,
    /// The status writer's address, as this replica sees it.
    writer: watch::Receiver<Option<String>>,
    stop: oneshot::Sender<()>,
    task: JoinHandle<()>,
}

impl Replica {
    fn start(client: &Client, identity: &'static str) -> Replica {
        let config = LeaseConfig {
            lease_duration: LEASE_DURATION,
            renew_period: RENEW,
            retry_period: RETRY,
            advertise: Some(format!("{identity}:9443")),
            ..LeaseConfig::new("default", "kvroute-operator", identity)
        };
        let (leader_tx, leader) = watch::channel(false);
        let (writer_tx, writer) = watch::channel(None);
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(run(
            client.clone(),
            config,
            leader_tx,
            writer_tx,
            Arc::default(),
            async {
                let _ = stopped.await;
            },
        ));
        Replica {
            identity,
            leader,
            writer,
            stop,
            task,
        }
    }

    fn leading(&self) -> bool {
        *self.leader.borrow()
    }

    async fn stop(self) {
        let _ = self.stop.send(());
        self.task.await.expect("run returns");
    }
}

/// A client of `server` served in process: no socket, so on the paused
/// clock time passes only while every task waits on a timer.
fn fake_client(server: &FakeApiServer) -> Client {
    Client::new(server.service(), "default")
}

/// Watches two leader channels until both senders are gone; true if both
/// ever said `true` at once. A replica whose sender is gone (it crashed)
/// leads no more, whatever it last said.
async fn ever_both(mut a: watch::Receiver<bool>, mut b: watch::Receiver<bool>) -> bool {
    let (mut a_open, mut b_open) = (true, true);
    while a_open || b_open {
        let a_leads = a_open && *a.borrow_and_update();
        let b_leads = b_open && *b.borrow_and_update();
        if a_leads && b_leads {
            return true;
        }
        tokio::select! {
            changed = a.changed(), if a_open => a_open = changed.is_ok(),
            changed = b.changed(), if b_open => b_open = changed.is_ok(),
        }
    }
    false
}

/// Waits for one of two fresh replicas to lead: (leader, follower). Both
/// start with no lease; one creates it, the other loses the race to, so
/// a leader is there before any period has passed.
async fn first_leader(a: Replica, b: Replica) -> (Replica, Replica) {
    let started = Instant::now();
    let mut either = (a.leader.clone(), b.leader.clone());
    while !*either.0.borrow_and_update() && !*either.1.borrow_and_update() {
        tokio::select! {
            _ = either.0.changed() => {}
            _ = either.1.changed() => {}
        }
    }
    assert!(
        started.elapsed() < RETRY,
        "a leader only after {:?}",
        started.elapsed()
    );
    if a.leading() { (a, b) } else { (b, a) }
}

fn stored_lease(server: &FakeApiServer) -> Value {
    server
        .get(
            "coordination.k8s.io/v1",
            "Lease",
            "default",
            "kvroute-operator",
        )
        .expect("the lease exists")
}

#[tokio::test(start_paused = true)]
async fn two_replicas_elect_one_leader_and_hand_over_on_shutdown() {
    let server = FakeApiServer::start().await;
    let client = fake_client(&server);
    let a = Replica::start(&client, "replica-a");
    let b = Replica::start(&client, "replica-b");
    let overlap = tokio::spawn(ever_both(a.leader.clone(), b.leader.clone()));

    let (leader, mut follower) = first_leader(a, b).await;

    // Several renewals and retries later (and longer than the lease lasts,
    // so a follower that missed the renewals would have taken it), the same
    // one leads, and the lease says so. Half a retry period more puts the
    // shutdown between two of the follower's reads, so that taking over at
    // the next one shows the lease was released: waiting out even the
    // released lease's 1 s would take a read more.
    tokio::time::sleep(2 * LEASE_DURATION + RETRY / 2).await;
    assert!(leader.leading() && !follower.leading());
    let lease = stored_lease(&server);
    assert_eq!(lease["spec"]["holderIdentity"], leader.identity);
    assert_eq!(lease["spec"]["leaseTransitions"], 0);
    // Both know where the status writer is: the leader's advertised address.
    let address = format!("{}:9443", leader.identity);
    assert_eq!(lease["metadata"]["annotations"][WRITER_ANNOTATION], address);
    assert_eq!(leader.writer.borrow().as_deref(), Some(&*address));
    assert_eq!(follower.writer.borrow().as_deref(), Some(&*address));

    // Shutting the leader down releases the lease: the follower takes it at
    // its next read, within a retry period, long before the lease could
    // expire.
    let stopped = Instant::now();
    leader.stop().await;
    follower
        .leader
        .wait_for(|l| *l)
        .await
        .expect("follower running");
    assert!(
        stopped.elapsed() <= RETRY,
        "the follower took {:?} to lead",
        stopped.elapsed()
    );
    let lease = stored_lease(&server);
    assert_eq!(lease["spec"]["holderIdentity"], follower.identity);
    assert_eq!(lease["spec"]["leaseTransitions"], 1);
    let address = format!("{}:9443", follower.identity);
    assert_eq!(lease["metadata"]["annotations"][WRITER_ANNOTATION], address);
    assert_eq!(follower.writer.borrow().as_deref(), Some(&*address));

    follower.stop().await;
    let lease = stored_lease(&server);
    assert_eq!(lease["spec"].get("holderIdentity"), None);
    assert_eq!(lease["spec"]["leaseDurationSeconds"], 1);
    assert!(!overlap.await.expect("monitor"), "two leaders at once");
}

#[tokio::test(start_paused = true)]
async fn a_crashed_leaders_lease_is_taken_over_once_it_expires() {
    let server = FakeApiServer::start().await;
    let client = fake_client(&server);
    let a = Replica::start(&client, "replica-a");
    let b = Replica::start(&client, "replica-b");
    let overlap = tokio::spawn(ever_both(a.leader.clone(), b.leader.clone()));
    let (leader, mut follower) = first_leader(a, b).await;
    // Past the first renewals, so the crash falls between two of them.
    tokio::time::sleep(LEASE_DURATION + RENEW / 2).await;
    assert!(!follower.leading());

    // A crash: no release, the lease just stops being renewed.
    leader.task.abort();
    let crashed = Instant::now();
    let _ = leader.task.await;
    follower
        .leader
        .wait_for(|l| *l)
        .await
        .expect("follower running");
    // The last renewal was at most a renew period before the crash, and the
    // lease runs from when the follower first saw that renewal (within a
    // retry period of it); it reads every retry period.
    let took = crashed.elapsed();
    assert!(
        took >= LEASE_DURATION - RENEW,
        "taken over {took:?} after the crash: before the lease expired"
    );
    assert!(
        took <= LEASE_DURATION + 2 * RETRY,
        "taken over only {took:?} after the crash"
    );
    let lease = stored_lease(&server);
    assert_eq!(lease["spec"]["holderIdentity"], follower.identity);
    assert_eq!(lease["spec"]["leaseTransitions"], 1);

    follower.stop().await;
    assert!(!overlap.await.expect("monitor"), "two leaders at once");
}
