//! The demo's fleet: engine sims with realistic (optionally sped-up)
//! timing, and a kvroute router in front of them that reads a static
//! endpoints file naming each sim's WatchCache port, so routing sees the
//! engines' exact cache contents. With vLLM's events, each sim publishes
//! ZMQ KV events instead and a `kvroute-agent` bridges them, as beside a
//! real vLLM. All in this process.
//!
//! Not here: what is sent to the fleet ([`super::workload`]) or what is made
//! of the answers ([`super::report`]).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context as _;
use kvroute_core::policy::PolicyConfig;
use kvroute_engine_sim::{Config as SimConfig, Sim};
use kvroute_proto::feed::Source as _;
use kvroute_proto::v1::cache_update::Update;
use kvroute_router::Running;
use kvroute_router::config::{
    Config as RouterConfig, Discovery, Header, Routing, StaticDiscovery, Tenancy,
};

/// Engines behind the router.
pub const ENGINES: usize = 4;

/// The header carrying the tenant, as an authenticating gateway would set
/// it (tenancy stays shared: the router only labels requests with it).
pub const TENANT_HEADER: &str = "x-tenant";

/// How every engine is configured: vLLM-like figures in real time (10,000
/// prefill tokens per second plus 20 ms per prefill, 20 ms per output
/// token), a small KV cache (1,024 blocks of 16 tokens) so that duplicated
/// prefixes evict each other, and 16 sequences at a time.
pub fn sim_config() -> SimConfig {
    let mut c = SimConfig::test();
    c.num_gpu_blocks = 1024;
    c.max_num_seqs = 16;
    c.prefill_tokens_per_s = 10_000.0;
    c.prefill_overhead_ms = 20.0;
    c.itl_ms = 20.0;
    c
}

/// Sims and a router over them; [`Fleet::stop`] shuts both down.
#[derive(Debug)]
pub struct Fleet {
    sims: Vec<Sim>,
    agents: Vec<kvroute_agent::Agent>,
    router: Running,
    dir: PathBuf,
    evicted: Arc<AtomicU64>,
}

impl Fleet {
    /// Starts [`ENGINES`] sims on free loopback ports (with an agent each
    /// when `vllm_events`) and a router with `policy` on `listen` and
    /// `admin_listen`, and waits until the router follows every engine's
    /// cache.
    pub async fn start(
        policy: PolicyConfig,
        listen: SocketAddr,
        admin_listen: SocketAddr,
        vllm_events: bool,
    ) -> anyhow::Result<Fleet> {
        let mut sims = Vec::with_capacity(ENGINES);
        let mut agents = Vec::new();
        let mut endpoints = Vec::new();
        let evicted = Arc::new(AtomicU64::new(0));
        for _ in 0..ENGINES {
            let mut config = sim_config();
            if vllm_events {
                config.kv_events_endpoint = Some("tcp://127.0.0.1:0".into());
                config.kv_events_replay_endpoint = Some("tcp://127.0.0.1:0".into());
            }
            let sim = kvroute_engine_sim::start(config)
                .await
                .context("starting an engine sim")?;
            count_evictions(&sim, evicted.clone());
            let mut cache_port = sim.cache_addr.port();
            if let Some(kv) = &sim.kv_events {
                let mut config = kvroute_agent::Config::loopback(
                    kv.bound.0.clone(),
                    format!("http://{}", sim.http_addr),
                );
                config.kv_events_replay_endpoint = kv.bound.1.clone();
                config.load_interval_ms = 100;
                let agent = kvroute_agent::start(config)
                    .await
                    .context("starting a kvroute-agent")?;
                cache_port = agent.cache_addrs[0].port();
                agents.push(agent);
            }
            endpoints.push((sim.http_addr, cache_port));
            sims.push(sim);
        }
        let dir = temp_dir()?;
        let file = dir.join("endpoints.yaml");
        std::fs::write(&file, endpoints_yaml(&endpoints))
            .with_context(|| format!("writing {}", file.display()))?;
        let defaults = RouterConfig::default();
        let config = RouterConfig {
            listen: Some(listen),
            admin_listen,
            discovery: Discovery::Static(StaticDiscovery {
                file,
                reload_ms: 1000,
            }),
            routing: Routing {
                policy,
                ..defaults.routing
            },
            tenancy: Tenancy {
                tenant_header: Some(Header::from_static(TENANT_HEADER)),
                ..defaults.tenancy
            },
            ..defaults
        };
        let router = match kvroute_router::start(config).await {
            Ok(router) => router,
            Err(e) => {
                for agent in agents {
                    agent.shutdown().await;
                }
                for sim in sims {
                    sim.shutdown().await;
                }
                let _ = std::fs::remove_dir_all(&dir);
                return Err(e.into());
            }
        };
        let fleet = Fleet {
            sims,
            agents,
            router,
            dir,
            evicted,
        };
        fleet.wait_live().await?;
        Ok(fleet)
    }

    /// The router's API address.
    pub fn addr(&self) -> SocketAddr {
        self.router.addr()
    }

    /// The router's admin address (`/metrics`, `/debug/pool`).
    pub fn admin_addr(&self) -> SocketAddr {
        self.router.admin_addr
    }

    /// Blocks the engines evicted from their prefix caches so far.
    pub fn evicted_blocks(&self) -> u64 {
        self.evicted.load(Ordering::Relaxed)
    }

    /// Waits until every WatchCache stream is live, so the first requests
    /// are already routed on the engines' reports.
    async fn wait_live(&self) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let status = self.router.pool.status();
            if status.len() == ENGINES && status.iter().all(|e| e.stream == "live") {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                let states: Vec<_> = status.iter().map(|e| (&e.name, e.stream)).collect();
                anyhow::bail!(
                    "the router did not follow the engines' caches within 10 s: {states:?}"
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Stops the router (letting in-flight streams finish), then the sims.
    pub async fn stop(self) {
        self.router.shutdown().await;
        for agent in self.agents {
            agent.shutdown().await;
        }
        for sim in self.sims {
            sim.shutdown().await;
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Adds the blocks `sim` evicts to `counter`, from its own cache event
/// stream (the one the router follows), until the sim stops.
fn count_evictions(sim: &Sim, counter: Arc<AtomicU64>) {
    let Ok(mut events) = sim.engine.subscribe() else {
        return; // the simulator always serves
    };
    tokio::spawn(async move {
        while let Some(message) = events.recv().await {
            if let Some(Update::Removed(r)) = &message.update {
                counter.fetch_add(r.block_hashes.len() as u64, Ordering::Relaxed);
            }
        }
    });
}

/// The static endpoints file: `sim-<i>` at each sim's HTTP address, with
/// its WatchCache port (the sim's, or its agent's).
fn endpoints_yaml(endpoints: &[(SocketAddr, u16)]) -> String {
    let mut yaml = String::from("endpoints:\n");
    for (i, (http, cache_port)) in endpoints.iter().enumerate() {
        yaml += &format!("  - name: sim-{i}\n    address: {http}\n    cachePort: {cache_port}\n");
    }
    yaml
}

/// A fresh directory for one fleet's endpoints file.
fn temp_dir() -> anyhow::Result<PathBuf> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("kvroute-demo-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}
