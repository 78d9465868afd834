//! The system under test, on loopback: the fake API server (in this
//! process), two `kvroute-operator` replicas sharing a Lease, two
//! `kvroute-router`s discovering the pool from them (each given both
//! operators as a failover list), and pods, each an engine-sim publishing
//! vLLM's ZMQ KV events and a `kvroute-agent` bridging them to WatchCache.
//!
//! Every pod has its own loopback address (`127.A.B.2`, `127.A.B.3`, …,
//! with `A.B` from this process's id and the system's number, so
//! concurrent runs and successive systems do not meet) and
//! the same ports, as an InferencePool's ports are pool-wide. Pods are Pod
//! objects whose status the scenario writes; the InferencePool and the
//! CacheRoutingPolicy are applied as YAML.
//!
//! Ports are chosen free, then given to the processes, so another process
//! may take one in between: a process that exits because its port was
//! taken is started again on the same ports a few times (whoever took it
//! seldom keeps it), and a system whose start still fails so starts again
//! on fresh ports ([`PortTaken`]).
//!
//! Not here: the load ([`super::load`]) or what a scenario does with the
//! system ([`super::scenarios`]).

use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context as _, bail};
use kvroute_testkit::FakeApiServer;
use serde::Deserialize;
use serde_json::{Value, json};

use super::procs::{Bins, Proc};

/// The model the sims serve.
pub const MODEL: &str = "kvroute-sim";
/// The header a gateway sets to the authenticated tenant.
pub const TENANT_HEADER: &str = "x-tenant";
/// The pool's namespace and name (the policy has the same name).
pub const NAMESPACE: &str = "default";
const POOL: &str = "llama";
/// The Lease the operators share.
const LEASE: &str = "kvroute-operator";

/// Each engine's KV cache, blocks of 16 tokens: 4,096 tokens, a third of
/// the workload's shared prefixes at 4 pods, a sixth at 8 (see
/// [`super::load::Shape::standard`]).
pub const NUM_GPU_BLOCKS: u32 = 256;
/// Engine timing: prefill at this many uncached tokens per second ...
pub const PREFILL_TOKENS_PER_S: u32 = 20_000;
/// ... plus this much per prefill ...
pub const PREFILL_OVERHEAD_MS: u32 = 5;
/// ... and this much per output token.
pub const ITL_MS: u32 = 20;
/// The hash seed of the pod that disagrees with the policy (the policy
/// names none).
pub const ODD_SEED: &str = "42";

/// How long a process may take to become ready, or the system to settle.
pub const STARTUP: Duration = Duration::from_secs(30);

/// How many times a process refused its port is started on the same
/// ports, a second apart, before [`PortTaken`].
const PORT_ATTEMPTS: u32 = 5;
/// How many times [`System::start`] tries fresh ports.
const START_ATTEMPTS: u32 = 3;

/// A process that could not listen because another process held a port
/// the suite had chosen for it, even after [`PORT_ATTEMPTS`] starts.
#[derive(Debug)]
pub struct PortTaken {
    name: String,
    log: PathBuf,
}

impl std::fmt::Display for PortTaken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} could not listen: another process holds its port; see {}",
            self.name,
            self.log.display()
        )
    }
}

impl std::error::Error for PortTaken {}

/// How a system is set up.
#[derive(Clone, Debug)]
pub struct Setup {
    /// Pods at the start.
    pub pods: usize,
    /// Routers (2 by default; 0 for pods alone, e.g. behind another
    /// system's gateway).
    pub routers: usize,
    /// The CacheRoutingPolicy's `policy`: `kvroute` or a baseline.
    pub policy: &'static str,
    /// `Salted` tenancy (else `Shared`).
    pub salted: bool,
    /// A pod whose engine and agent hash otherwise than the policy says:
    /// with [`ODD_SEED`], or with `odd_block_size`.
    pub odd_pod: Option<usize>,
    /// The odd pod's block size, instead of another seed.
    pub odd_block_size: Option<u32>,
    /// Every pod's engine.
    pub engine: EngineSetup,
    /// The policy's `routingKey`: `Prefix` mode over this many leading
    /// tokens; `None` leaves the policy's default (`Conversation`, 256).
    pub prefix_tokens: Option<usize>,
    /// How often each agent reads its engine's `/metrics`, milliseconds.
    pub load_interval_ms: u32,
    /// Routers follow engine-sim's own WatchCache (its exact queued
    /// prefill) instead of the agents' (vLLM's metrics, as with a real
    /// vLLM); the agents still run.
    pub watch_engines: bool,
    /// The policy's `slowStartSeconds`; `None` leaves the default (30).
    pub slow_start_seconds: Option<u32>,
    /// YAML appended to every router's configuration file: top-level
    /// sections the setup has no field for, e.g. `responseCache`.
    /// Default: empty.
    pub router_yaml: String,
    /// YAML appended to the CacheRoutingPolicy's `spec`, indented two
    /// spaces, e.g. `  warmup: {...}`. Default: empty.
    pub policy_yaml: String,
    /// Disaggregated pods: the first this many are `prefill` (engine
    /// `--kv-role producer`), the rest `decode` (`consumer`), by their
    /// `kvroute.dev/role` label. `None` (the default): every pod `both`.
    pub prefill_pods: Option<usize>,
    /// The policy's `disaggregation`: `Auto` from this many uncached
    /// tokens; `None` (the default): `Off`.
    pub disaggregate_from: Option<u64>,
}

impl Setup {
    /// `pods` pods under the default policy, shared tenancy, the suite's
    /// engines.
    pub fn new(pods: usize) -> Setup {
        Setup {
            pods,
            routers: 2,
            policy: "kvroute",
            salted: false,
            odd_pod: None,
            odd_block_size: None,
            engine: EngineSetup::suite(),
            prefix_tokens: None,
            load_interval_ms: 100,
            watch_engines: false,
            slow_start_seconds: None,
            router_yaml: String::new(),
            policy_yaml: String::new(),
            prefill_pods: None,
            disaggregate_from: None,
        }
    }
}

/// How each pod's engine-sim is configured (its flags of the same names).
#[derive(Clone, Debug, PartialEq)]
pub struct EngineSetup {
    /// KV cache capacity, blocks of [`block_size`](Self::block_size).
    pub num_gpu_blocks: u32,
    /// Tokens per KV block.
    pub block_size: u32,
    /// Longest prompt plus output, tokens.
    pub max_model_len: u64,
    /// Requests running at once.
    pub max_num_seqs: u32,
    /// Uncached prompt tokens prefilled per second of engine time.
    pub prefill_tokens_per_s: u32,
    /// Fixed cost of each prefill, milliseconds of engine time.
    pub prefill_overhead_ms: u32,
    /// Time per output token, milliseconds of engine time.
    pub itl_ms: u32,
    /// Engine time runs this many times faster than real time.
    pub time_scale: f64,
    /// Delay before each completion's admission, milliseconds: a window
    /// between a router's decision and the engine's prefill.
    pub extra_latency_ms: u64,
}

impl EngineSetup {
    /// The suite's engines: [`NUM_GPU_BLOCKS`] blocks of 16 tokens, the
    /// timing above, 64 running at once, real time.
    pub fn suite() -> EngineSetup {
        EngineSetup {
            num_gpu_blocks: NUM_GPU_BLOCKS,
            block_size: 16,
            max_model_len: 32_768,
            max_num_seqs: 64,
            prefill_tokens_per_s: PREFILL_TOKENS_PER_S,
            prefill_overhead_ms: PREFILL_OVERHEAD_MS,
            itl_ms: ITL_MS,
            time_scale: 1.0,
            extra_latency_ms: 0,
        }
    }
}

/// Ports every pod uses on its own address.
#[derive(Clone, Copy, Debug)]
struct PodPorts {
    http: u16,
    sim_cache: u16,
    cache: u16,
    zmq: u16,
    replay: u16,
    agent_admin: u16,
    transfer: u16,
}

/// One pod: its engine and agent, while they run.
#[derive(Debug)]
pub struct Pod {
    /// Its Pod object's name, and the endpoint's name in the routers.
    pub name: String,
    /// Its address.
    pub ip: Ipv4Addr,
    sim: Option<Proc>,
    agent: Option<Proc>,
    odd: bool,
}

#[derive(Debug)]
struct Operator {
    identity: String,
    grpc: SocketAddr,
    admin: SocketAddr,
    proc: Option<Proc>,
}

#[derive(Debug)]
struct Router {
    name: String,
    api: SocketAddr,
    admin: SocketAddr,
    config: PathBuf,
    proc: Option<Proc>,
}

/// An endpoint as a router's `/debug/pool` shows it.
#[derive(Clone, Debug, Deserialize)]
pub struct Endpoint {
    /// Its pod's name (the router's name for it less `:port`).
    pub name: String,
    /// Ready per discovery.
    pub ready: bool,
    /// The WatchCache stream's state (`live` when following).
    pub stream: String,
    /// Blocks the router's index holds for it.
    pub cached_blocks: u64,
    /// Its engine contract: `unknown`, `match` or `mismatch`.
    pub contract: String,
    /// Its slow-start weight: its share of new keys, 1 once ramped up.
    pub weight: f64,
}

/// The running system; everything it started stops when it is dropped.
#[derive(Debug)]
pub struct System {
    /// When it started: the time axis of samples and marks.
    pub t0: Instant,
    /// The pods, in creation order (deleted ones stay, without processes).
    pub pods: Vec<Pod>,
    /// Moments worth marking on plots: seconds since `t0`, and what.
    pub marks: Vec<(f64, String)>,
    api: FakeApiServer,
    bins: Bins,
    logs: PathBuf,
    kubeconfig: PathBuf,
    net: [u8; 2],
    ports: PodPorts,
    operators: Vec<Operator>,
    routers: Vec<Router>,
    http: reqwest::Client,
    setup: Setup,
}

/// The pod named in a router's endpoint name `pod:port`.
pub fn pod_name(endpoint: &str) -> &str {
    endpoint.rsplit_once(':').map_or(endpoint, |(pod, _)| pod)
}

/// `n` distinct ports, each free on every address right now: all are held
/// until all are chosen, so none is handed out twice.
pub fn free_ports(n: usize) -> anyhow::Result<impl Iterator<Item = u16>> {
    let listeners = (0..n)
        .map(|_| TcpListener::bind("0.0.0.0:0").context("binding a free port"))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let ports = listeners
        .iter()
        .map(|l| Ok(l.local_addr()?.port()))
        .collect::<anyhow::Result<Vec<u16>>>()?;
    Ok(ports.into_iter())
}

impl System {
    /// Starts everything in `setup` and waits until both routers follow
    /// every pod's cache. Logs go to `logs`. When a port it chose was taken
    /// ([`PortTaken`]), it stops what it started and starts again on fresh
    /// ports.
    pub async fn start(bins: &Bins, logs: &Path, setup: Setup) -> anyhow::Result<System> {
        let mut attempt = 1;
        loop {
            let started = Self::start_on_fresh_ports(bins, logs, setup.clone()).await;
            match started.as_ref().map_err(|e| e.downcast_ref::<PortTaken>()) {
                // No log named: the next attempt starts with fresh logs.
                Err(Some(taken)) if attempt < START_ATTEMPTS => eprintln!(
                    "kvroute-e2e: {}'s port stayed taken; starting the system again on fresh ports",
                    taken.name
                ),
                _ => return started,
            }
            attempt += 1;
        }
    }

    /// [`start`](Self::start), once.
    async fn start_on_fresh_ports(
        bins: &Bins,
        logs: &Path,
        setup: Setup,
    ) -> anyhow::Result<System> {
        let _ = std::fs::remove_dir_all(logs);
        std::fs::create_dir_all(logs).with_context(|| format!("creating {}", logs.display()))?;
        // Each system its own addresses: a port a killed process held may
        // linger in TIME_WAIT, and ZMQ binds without SO_REUSEADDR.
        static SYSTEMS: AtomicU32 = AtomicU32::new(0);
        let pid = std::process::id();
        let n = SYSTEMS.fetch_add(1, Ordering::Relaxed);
        let net = [(100 + pid % 100) as u8, (1 + (pid / 100 + n) % 250) as u8];
        // Seven per pod, two per operator, two per router.
        let mut port = free_ports(7 + 2 * 2 + 2 * setup.routers)?;
        let mut next = || port.next().expect("as many ports as asked for");
        let ports = PodPorts {
            http: next(),
            sim_cache: next(),
            cache: next(),
            zmq: next(),
            replay: next(),
            agent_admin: next(),
            transfer: next(),
        };
        let api = FakeApiServer::start().await;
        let kubeconfig = logs.join("kubeconfig.yaml");
        std::fs::write(&kubeconfig, api.kubeconfig_yaml()).context("writing the kubeconfig")?;
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(5))
            .build()
            .context("building an HTTP client")?;
        let mut system = System {
            t0: Instant::now(),
            pods: Vec::new(),
            marks: Vec::new(),
            api,
            bins: bins.clone(),
            logs: logs.to_owned(),
            kubeconfig,
            net,
            ports,
            operators: Vec::new(),
            routers: Vec::new(),
            http,
            setup: setup.clone(),
        };
        system.apply_yaml(&system.pool_yaml())?;
        system.apply_yaml(&system.policy_yaml())?;
        // The pool's first pods have been ready a while: they do not ramp up.
        let an_hour_ago = SystemTime::now() - Duration::from_secs(3600);
        for _ in 0..setup.pods {
            let k = system.start_pod().await?;
            system.write_pod_since(k, true, an_hour_ago)?;
        }
        for i in 0..2 {
            let operator = Operator {
                identity: format!("operator-{i}"),
                grpc: SocketAddr::new(system.host(1).into(), next()),
                admin: SocketAddr::new(system.host(1).into(), next()),
                proc: None,
            };
            system.operators.push(operator);
            system.start_operator(i).await?;
        }
        let urls: Vec<String> = system
            .operators
            .iter()
            .map(|o| format!("http://{}", o.grpc))
            .collect();
        for i in 0..setup.routers {
            let name = format!("router-{i}");
            let config = logs.join(format!("{name}.yaml"));
            let api = SocketAddr::new(system.host(1).into(), next());
            let admin = SocketAddr::new(system.host(1).into(), next());
            // Each router lists the operators starting from a different one.
            let mut order = urls.clone();
            order.rotate_left(i);
            let mut yaml = format!(
                "listen: {api}\nadminListen: {admin}\ndiscovery:\n  operator:\n    urls: [{}]\n    namespace: {NAMESPACE}\n    pool: {POOL}\n",
                order.join(", ")
            );
            // The router decides tenancy (salting needs its secret); the
            // policy says the same for the operator's status.
            if setup.salted {
                let secret = logs.join("tenant-salt.key");
                std::fs::write(&secret, "e2e-secret").context("writing the salt secret")?;
                yaml += &format!(
                    "tenancy:\n  mode: salted\n  tenantHeader: {TENANT_HEADER}\n  secretFile: {}\n",
                    secret.display()
                );
            }
            yaml += &setup.router_yaml;
            std::fs::write(&config, yaml).context("writing a router's configuration")?;
            system.routers.push(Router {
                name,
                api,
                admin,
                config,
                proc: None,
            });
            system.start_router(i).await?;
        }
        system.wait_synced(STARTUP).await?;
        system.t0 = Instant::now();
        Ok(system)
    }

    /// `127.A.B.last`.
    fn host(&self, last: u8) -> Ipv4Addr {
        Ipv4Addr::new(127, self.net[0], self.net[1], last)
    }

    /// Seconds since [`t0`](Self::t0).
    pub fn now(&self) -> f64 {
        self.t0.elapsed().as_secs_f64()
    }

    /// Records a moment to mark on the plots.
    pub fn mark(&mut self, what: &str) {
        let t = self.now();
        self.marks.push((t, what.to_owned()));
    }

    /// The routers' API addresses.
    pub fn router_addrs(&self) -> Vec<SocketAddr> {
        self.routers.iter().map(|r| r.api).collect()
    }

    fn pool_yaml(&self) -> String {
        format!(
            "apiVersion: inference.networking.k8s.io/v1
kind: InferencePool
metadata: {{name: {POOL}, namespace: {NAMESPACE}}}
spec:
  selector:
    matchLabels: {{app: llama}}
  targetPorts:
    - number: {http}
",
            http = self.ports.http
        )
    }

    fn policy_yaml(&self) -> String {
        let e = &self.setup.engine;
        let key = match self.setup.prefix_tokens {
            Some(k) => format!("  routingKey: {{mode: Prefix, prefixTokens: {k}}}\n"),
            None => String::new(),
        };
        let mut slow_start = match self.setup.slow_start_seconds {
            Some(s) => format!("  slowStartSeconds: {s}\n"),
            None => String::new(),
        };
        if let Some(min) = self.setup.disaggregate_from {
            slow_start += &format!("  disaggregation: {{mode: Auto, minUncachedTokens: {min}}}\n");
        }
        // The policy predicts in real time: the engines' rate and overhead
        // as a router sees them, `time_scale` times faster.
        format!(
            "apiVersion: kvroute.dev/v1alpha1
kind: CacheRoutingPolicy
metadata: {{name: {POOL}, namespace: {NAMESPACE}}}
spec:
  targetRef: {{group: inference.networking.k8s.io, kind: InferencePool, name: {POOL}}}
  policy: {policy}
{key}  engine:
    blockSize: {block_size}
    cachePort: {cache}
    prefillTokensPerSecond: {rate}
    prefillOverheadMs: {overhead}
  tenancy: {{mode: {mode}, tenantHeader: {TENANT_HEADER}}}
{slow_start}{extra}",
            extra = self.setup.policy_yaml,
            policy = self.setup.policy,
            block_size = e.block_size,
            rate = f64::from(e.prefill_tokens_per_s) * e.time_scale,
            overhead = f64::from(e.prefill_overhead_ms) / e.time_scale,
            cache = if self.setup.watch_engines {
                self.ports.sim_cache
            } else {
                self.ports.cache
            },
            mode = if self.setup.salted {
                "Salted"
            } else {
                "Shared"
            },
        )
    }

    /// Creates or replaces the object in `yaml`, as `kubectl apply` would.
    pub fn apply_yaml(&self, yaml: &str) -> anyhow::Result<()> {
        let object: Value = serde_yaml::from_str(yaml).context("parsing YAML")?;
        self.api
            .put(object)
            .map_err(|e| anyhow::anyhow!("applying an object: {e}"))?;
        Ok(())
    }

    /// Starts a new pod's engine and agent, waits until both serve, then
    /// creates its Pod object, Running and Ready. Returns its index.
    pub async fn add_pod(&mut self) -> anyhow::Result<usize> {
        let k = self.start_pod().await?;
        self.write_pod(k, true)?;
        Ok(k)
    }

    /// Starts a new pod's engine and agent and waits until both serve,
    /// without a Pod object: the pool gains it when [`write_pod`](Self::write_pod)
    /// makes it Ready (until then [`wait_synced`](Self::wait_synced) would
    /// wait for it in vain). Returns its index.
    pub async fn start_pod(&mut self) -> anyhow::Result<usize> {
        let k = self.pods.len();
        let last = u8::try_from(2 + k).context("too many pods")?;
        let odd = self.setup.odd_pod == Some(k);
        self.pods.push(Pod {
            name: format!("pod-{k}"),
            ip: self.host(last),
            sim: None,
            agent: None,
            odd,
        });
        self.start_sim(k).await?;
        self.start_agent(k).await?;
        Ok(k)
    }

    async fn start_sim(&mut self, k: usize) -> anyhow::Result<()> {
        let (ip, p, e) = (self.pods[k].ip, self.ports, &self.setup.engine);
        let (block_size, seed) = self.hashing(k);
        let mut args: Vec<String> = [
            format!("--listen={ip}:{}", p.http),
            format!("--cache-listen={ip}:{}", p.sim_cache),
            format!("--model={MODEL}"),
            format!("--num-gpu-blocks={}", e.num_gpu_blocks),
            format!("--block-size={block_size}"),
            format!("--max-model-len={}", e.max_model_len),
            format!("--prefill-tokens-per-s={}", e.prefill_tokens_per_s),
            format!("--prefill-overhead-ms={}", e.prefill_overhead_ms),
            format!("--itl-ms={}", e.itl_ms),
            format!("--max-num-seqs={}", e.max_num_seqs),
            format!("--time-scale={}", e.time_scale),
            format!("--kv-events-endpoint=tcp://{ip}:{}", p.zmq),
            format!("--kv-events-replay-endpoint=tcp://{ip}:{}", p.replay),
            format!("--kv-transfer-listen={ip}:{}", p.transfer),
            format!("--kv-role={}", self.kv_role(k)),
        ]
        .into();
        if let Some(seed) = seed {
            args.push(format!("--hash-seed={seed}"));
        }
        if e.extra_latency_ms > 0 {
            args.push(format!("--extra-latency-ms={}", e.extra_latency_ms));
        }
        let name = format!("{}-engine", self.pods[k].name);
        let url = format!("http://{ip}:{}/health", p.http);
        let proc = self
            .launch(&name, "kvroute-engine-sim", &args, &[], &url)
            .await?;
        self.pods[k].sim = Some(proc);
        Ok(())
    }

    /// Pod `k`'s role label: `prefill`, `decode` or `both`.
    pub fn role(&self, k: usize) -> &'static str {
        match self.setup.prefill_pods {
            None => "both",
            Some(n) if k < n => "prefill",
            Some(_) => "decode",
        }
    }

    /// Pod `k`'s engine's `--kv-role`.
    fn kv_role(&self, k: usize) -> &'static str {
        match self.role(k) {
            "prefill" => "producer",
            "decode" => "consumer",
            _ => "both",
        }
    }

    /// Pod `k`'s block size and hash seed (`None`: the default).
    fn hashing(&self, k: usize) -> (u32, Option<&'static str>) {
        let normal = self.setup.engine.block_size;
        match (self.pods[k].odd, self.setup.odd_block_size) {
            (false, _) => (normal, None),
            (true, Some(size)) => (size, None),
            (true, None) => (normal, Some(ODD_SEED)),
        }
    }

    /// Starts pod `k`'s agent and waits until it serves.
    pub async fn start_agent(&mut self, k: usize) -> anyhow::Result<()> {
        let (ip, p) = (self.pods[k].ip, self.ports);
        let (block_size, seed) = self.hashing(k);
        let args: Vec<String> = [
            format!("--kv-events-endpoint=tcp://{ip}:{}", p.zmq),
            format!("--kv-events-replay-endpoint=tcp://{ip}:{}", p.replay),
            format!("--listen={ip}:{}", p.cache),
            format!("--admin-listen={ip}:{}", p.agent_admin),
            format!("--engine-url=http://{ip}:{}", p.http),
            format!("--served-model-name={MODEL}"),
            format!("--block-size={block_size}"),
            format!("--load-interval-ms={}", self.setup.load_interval_ms),
        ]
        .into();
        let env: Vec<_> = seed
            .map(|s| ("PYTHONHASHSEED", s.to_owned()))
            .into_iter()
            .collect();
        let name = format!("{}-agent", self.pods[k].name);
        let url = format!("http://{ip}:{}/readyz", p.agent_admin);
        let proc = self
            .launch(&name, "kvroute-agent", &args, &env, &url)
            .await?;
        self.pods[k].agent = Some(proc);
        Ok(())
    }

    /// SIGKILLs pod `k`'s agent.
    pub fn kill_agent(&mut self, k: usize) {
        if let Some(agent) = self.pods[k].agent.take() {
            agent.kill();
        }
    }

    /// Writes pod `k`'s Pod object, Running, Ready or not, its Ready
    /// condition changed now.
    pub fn write_pod(&self, k: usize, ready: bool) -> anyhow::Result<()> {
        self.write_pod_since(k, ready, SystemTime::now())
    }

    /// [`write_pod`](Self::write_pod) with the Ready condition changed at
    /// `since` (its `lastTransitionTime`: where routers start a ready pod's
    /// slow-start ramp).
    pub fn write_pod_since(&self, k: usize, ready: bool, since: SystemTime) -> anyhow::Result<()> {
        let pod = &self.pods[k];
        let since = jiff::Timestamp::try_from(since).context("a time after 1970")?;
        let object = json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": pod.name,
                "namespace": NAMESPACE,
                "labels": { "app": "llama", "kvroute.dev/role": self.role(k) },
            },
            "spec": { "containers": [{ "name": "engine", "image": "kvroute-engine-sim" }] },
            "status": {
                "phase": "Running",
                "podIP": pod.ip.to_string(),
                "conditions": [{
                    "type": "Ready",
                    "status": if ready { "True" } else { "False" },
                    "lastTransitionTime": since.to_string(),
                }],
            },
        });
        self.api
            .put(object)
            .map_err(|e| anyhow::anyhow!("writing Pod {}: {e}", pod.name))?;
        Ok(())
    }

    /// Deletes pod `k`'s Pod object and SIGKILLs its engine and agent at
    /// the same moment (a node lost, or a pod force-deleted).
    pub fn delete_pod(&mut self, k: usize) {
        let pod = &mut self.pods[k];
        self.api.delete("v1", "Pod", NAMESPACE, &pod.name);
        for proc in [pod.sim.take(), pod.agent.take()].into_iter().flatten() {
            proc.kill();
        }
    }

    async fn start_operator(&mut self, i: usize) -> anyhow::Result<()> {
        let o = &self.operators[i];
        let args: Vec<String> = [
            "run".into(),
            format!("--grpc-listen={}", o.grpc),
            format!("--admin-listen={}", o.admin),
            format!("--namespace={NAMESPACE}"),
            format!("--lease-namespace={NAMESPACE}"),
            format!("--lease-name={LEASE}"),
            format!("--identity={}", o.identity),
            // Fail over in about 2 s rather than client-go's 15.
            "--lease-duration=2".into(),
            "--lease-renew-period=0.5".into(),
            "--lease-retry-period=0.25".into(),
        ]
        .into();
        let env = [("KUBECONFIG", self.kubeconfig.display().to_string())];
        let (name, url) = (o.identity.clone(), format!("http://{}/readyz", o.admin));
        let proc = self
            .launch(&name, "kvroute-operator", &args, &env, &url)
            .await?;
        self.operators[i].proc = Some(proc);
        Ok(())
    }

    /// The index of the operator holding the Lease, if any.
    pub fn leader(&self) -> Option<usize> {
        let lease = self
            .api
            .get("coordination.k8s.io/v1", "Lease", NAMESPACE, LEASE)?;
        let holder = lease["spec"]["holderIdentity"].as_str()?;
        self.operators.iter().position(|o| o.identity == holder)
    }

    /// SIGKILLs operator `i`.
    pub fn kill_operator(&mut self, i: usize) {
        if let Some(proc) = self.operators[i].proc.take() {
            proc.kill();
        }
    }

    /// An object in the pool's namespace, if it exists.
    pub fn object(&self, api_version: &str, kind: &str, name: &str) -> Option<Value> {
        self.api.get(api_version, kind, NAMESPACE, name)
    }

    /// The CacheRoutingPolicy, whole.
    pub fn policy(&self) -> Option<Value> {
        self.object("kvroute.dev/v1alpha1", "CacheRoutingPolicy", POOL)
    }

    /// Starts router `i` (again) and waits until it answers; its Pod
    /// object (labelled as the chart labels a router's, so the operator
    /// names it to the routers) is Running and Ready.
    pub async fn start_router(&mut self, i: usize) -> anyhow::Result<()> {
        let r = &self.routers[i];
        let args = vec![format!("--config={}", r.config.display())];
        let (name, url) = (r.name.clone(), format!("http://{}/healthz", r.admin));
        let env = [("POD_NAME", name.clone())];
        let proc = self
            .launch(&name, "kvroute-router", &args, &env, &url)
            .await?;
        self.routers[i].proc = Some(proc);
        self.write_router_pod(i, true)
    }

    /// Writes router `i`'s Pod object, Ready or not.
    pub fn write_router_pod(&self, i: usize, ready: bool) -> anyhow::Result<()> {
        let r = &self.routers[i];
        let object = json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": r.name,
                "namespace": NAMESPACE,
                "labels": { "app.kubernetes.io/component": "router", "kvroute.dev/router-for": POOL },
            },
            "spec": { "containers": [{ "name": "router", "image": "kvroute" }] },
            "status": {
                "phase": "Running",
                // The address the router's connections come from, which
                // the operator checks its warm-up reports against: Linux
                // gives a connection to any 127/8 address the source
                // 127.0.0.1, whatever address the router listens on.
                "podIP": "127.0.0.1",
                "conditions": [{
                    "type": "Ready",
                    "status": if ready { "True" } else { "False" },
                    "lastTransitionTime": jiff::Timestamp::now().to_string(),
                }],
            },
        });
        self.api
            .put(object)
            .map_err(|e| anyhow::anyhow!("writing Pod {}: {e}", r.name))?;
        Ok(())
    }

    /// Deletes router `i`'s Pod object (the router runs on).
    pub fn delete_router_pod(&self, i: usize) {
        self.api
            .delete("v1", "Pod", NAMESPACE, &self.routers[i].name);
    }

    /// Stops router `i` with SIGTERM, as a rolling restart does: it
    /// finishes what is in flight, then exits.
    pub fn stop_router(&mut self, i: usize) {
        if let Some(proc) = self.routers[i].proc.take() {
            proc.terminate(Duration::from_secs(30));
        }
    }

    /// SIGKILLs router `i`, as a node failure or the OOM killer does: what
    /// it had in flight is cut.
    pub fn kill_router(&mut self, i: usize) {
        if let Some(proc) = self.routers[i].proc.take() {
            proc.kill();
        }
    }

    /// Whether router `i` answers 200 on its admin port's `/readyz`, as a
    /// readiness probe asks.
    pub async fn router_ready(&self, i: usize) -> bool {
        let url = format!("http://{}/readyz", self.routers[i].admin);
        let answer = self.http.get(&url).timeout(Duration::from_secs(1)).send();
        answer.await.is_ok_and(|r| r.status().is_success())
    }

    /// The routers' admin addresses (`/readyz`, `/metrics`, `/debug`).
    pub fn router_admins(&self) -> Vec<SocketAddr> {
        self.routers.iter().map(|r| r.admin).collect()
    }

    /// Router `i`'s `/debug/pool`.
    pub async fn endpoints(&self, i: usize) -> anyhow::Result<Vec<Endpoint>> {
        let url = format!("http://{}/debug/pool", self.routers[i].admin);
        let response = self.http.get(&url).send().await?.error_for_status()?;
        let mut endpoints: Vec<Endpoint> = response.json().await?;
        for e in &mut endpoints {
            e.name = pod_name(&e.name).to_owned();
        }
        Ok(endpoints)
    }

    /// Every pod's name, in creation order (deleted ones too).
    pub fn pod_names(&self) -> Vec<String> {
        self.pods.iter().map(|p| p.name.clone()).collect()
    }

    /// Requests pod `k`'s engine has finished, by its own `/metrics`
    /// (vLLM's `vllm:request_success_total`, every finish reason): the
    /// same count whatever sent them.
    pub async fn engine_requests(&self, k: usize) -> anyhow::Result<u64> {
        let url = format!("http://{}/metrics", self.engine_addr(k));
        let text = self.http.get(&url).send().await?.text().await?;
        Ok(text
            .lines()
            .filter_map(|l| l.strip_prefix("vllm:request_success_total"))
            .filter_map(|rest| rest.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>() as u64)
    }

    /// The sum of `family`'s samples on pod `k`'s engine's `/metrics`.
    pub async fn engine_sum(&self, k: usize, family: &str) -> anyhow::Result<f64> {
        let url = format!("http://{}/metrics", self.engine_addr(k));
        let text = self.http.get(&url).send().await?.text().await?;
        Ok(text
            .lines()
            .filter_map(kvroute_telemetry::metrics::parse_line)
            .filter(|m| m.name == family)
            .map(|m| m.value)
            .sum())
    }

    /// Pod `k`'s engine's HTTP address (to bypass the routers).
    pub fn engine_addr(&self, k: usize) -> SocketAddr {
        SocketAddr::new(self.pods[k].ip.into(), self.ports.http)
    }

    /// Drops every block pod `k`'s engine caches (vLLM's
    /// `POST /reset_prefix_cache`); fails while requests run there.
    pub async fn reset_prefix_cache(&self, k: usize) -> anyhow::Result<()> {
        let url = format!("http://{}/reset_prefix_cache", self.engine_addr(k));
        self.http.post(&url).send().await?.error_for_status()?;
        Ok(())
    }

    /// The routers' name for pod `k`'s endpoint: `pod:port`.
    pub fn endpoint_name(&self, k: usize) -> String {
        format!("{}:{}", self.pods[k].name, self.ports.http)
    }

    /// `Some` when `holds` is true of both routers' endpoints.
    pub async fn on_both_routers(&self, holds: impl Fn(&[Endpoint]) -> bool) -> Option<()> {
        for i in 0..self.routers.len() {
            if !holds(&self.endpoints(i).await.ok()?) {
                return None;
            }
        }
        Some(())
    }

    /// Router `i`'s process id, while it runs.
    pub fn router_pid(&self, i: usize) -> Option<u32> {
        self.routers[i].proc.as_ref().map(Proc::id)
    }

    /// Router `i`'s `/metrics`.
    pub async fn router_metrics(&self, i: usize) -> anyhow::Result<String> {
        let url = format!("http://{}/metrics", self.routers[i].admin);
        Ok(self.http.get(&url).send().await?.text().await?)
    }

    /// Router `i`'s record of a recent request by its `x-request-id`
    /// (`/debug/requests/{id}`: its missed tokens by cause).
    pub async fn recorded(&self, i: usize, id: &str) -> anyhow::Result<Value> {
        let url = format!("http://{}/debug/requests/{id}", self.routers[i].admin);
        let response = self.http.get(&url).send().await?.error_for_status()?;
        Ok(response.json().await?)
    }

    /// Router `i`'s `/debug/explain` of a chat request `body` sent with
    /// `headers`.
    pub async fn explain(
        &self,
        i: usize,
        body: &Value,
        headers: &[(&str, &str)],
    ) -> anyhow::Result<Value> {
        let headers: serde_json::Map<String, Value> = headers
            .iter()
            .map(|(k, v)| ((*k).to_owned(), Value::from(*v)))
            .collect();
        let url = format!("http://{}/debug/explain", self.routers[i].admin);
        let request = json!({ "path": "/v1/chat/completions", "headers": headers, "body": body });
        let response = self.http.post(&url).json(&request).send().await?;
        let status = response.status();
        let text = response.text().await?;
        if !status.is_success() {
            bail!("explain on {}: {status}: {text}", self.routers[i].name);
        }
        Ok(serde_json::from_str(&text)?)
    }

    /// Waits until every live router follows every Ready pod's cache, and
    /// lists no other endpoint.
    pub async fn wait_synced(&self, timeout: Duration) -> anyhow::Result<f64> {
        let ready: Vec<&str> = self
            .pods
            .iter()
            .filter(|p| p.sim.is_some())
            .map(|p| p.name.as_str())
            .collect();
        let live: Vec<usize> = (0..self.routers.len())
            .filter(|i| self.routers[*i].proc.is_some())
            .collect();
        self.wait_for("the routers to follow every pod", timeout, async || {
            for i in &live {
                let endpoints = self.endpoints(*i).await.ok()?;
                let mut names: Vec<&str> = endpoints
                    .iter()
                    .filter(|e| e.ready && e.stream == "live")
                    .map(|e| e.name.as_str())
                    .collect();
                names.sort_unstable();
                if names != ready || endpoints.len() != ready.len() {
                    return None;
                }
            }
            Some(())
        })
        .await
        .map(|(_, s)| s)
    }

    /// Polls `check` every 20 ms until it returns something or `timeout`
    /// passes; the value and the seconds it took.
    pub async fn wait_for<T>(
        &self,
        what: &str,
        timeout: Duration,
        mut check: impl AsyncFnMut() -> Option<T>,
    ) -> anyhow::Result<(T, f64)> {
        let start = Instant::now();
        loop {
            if let Some(found) = check().await {
                return Ok((found, start.elapsed().as_secs_f64()));
            }
            if start.elapsed() >= timeout {
                bail!("timed out after {timeout:?} waiting for {what}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Starts binary `bin` as process `name` and waits until `url` answers
    /// 200. A process that exits because a port it was given is in use is
    /// started again on the same ports, up to [`PORT_ATTEMPTS`] times.
    async fn launch(
        &mut self,
        name: &str,
        bin: &str,
        args: &[String],
        env: &[(&str, String)],
        url: &str,
    ) -> anyhow::Result<Proc> {
        let mut attempt = 1;
        loop {
            let mut proc = Proc::spawn(&self.bins, &self.logs, name, bin, args, env)?;
            let served = self.wait_http(url, &mut proc).await;
            if served.is_ok() || !proc.port_taken() {
                return served.map(|()| proc);
            }
            if attempt == PORT_ATTEMPTS {
                let log = proc.log().to_owned();
                return Err(PortTaken {
                    name: name.to_owned(),
                    log,
                }
                .into());
            }
            eprintln!("kvroute-e2e: {name}'s port is taken; starting it again in a second");
            attempt += 1;
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }

    /// Waits until `url` answers 200; fails early if `proc` or a process
    /// already running exited.
    async fn wait_http(&mut self, url: &str, proc: &mut Proc) -> anyhow::Result<()> {
        let name = proc.name().to_owned();
        let start = Instant::now();
        loop {
            if let Ok(r) = self.http.get(url).send().await
                && r.status().is_success()
            {
                return Ok(());
            }
            if let Some(exited) = proc
                .exited()
                .then(|| name.clone())
                .or_else(|| self.exited())
            {
                bail!(
                    "{exited} exited; see {}",
                    self.logs.join(format!("{exited}.log")).display()
                );
            }
            if start.elapsed() >= STARTUP {
                bail!(
                    "{name} did not answer {url} within {STARTUP:?}; see {}",
                    self.logs.join(format!("{name}.log")).display()
                );
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// The name of a process the suite started that has exited by itself.
    pub fn exited(&mut self) -> Option<String> {
        let pods = self
            .pods
            .iter_mut()
            .flat_map(|p| [p.sim.as_mut(), p.agent.as_mut()]);
        let others = self
            .operators
            .iter_mut()
            .map(|o| o.proc.as_mut())
            .chain(self.routers.iter_mut().map(|r| r.proc.as_mut()));
        pods.chain(others)
            .flatten()
            .find_map(|p| p.exited().then(|| p.name().to_owned()))
    }
}
