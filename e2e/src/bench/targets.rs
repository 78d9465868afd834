//! The proxies under test and the fixed upstream they share, each started
//! as its own process tree so its CPU time and memory can be read from
//! `/proc`: nginx with fixed responses as the engines, nginx as a
//! round-robin reverse proxy, a bare hyper proxy (the HTTP stack's floor),
//! SGLang's gateway (`smg`), and `kvroute-router` in three modes and with
//! its response cache.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};

use crate::suite::procs::{Bins, Proc};
use crate::suite::system::free_ports;

/// The model the fixed upstream serves.
pub const MODEL: &str = "bench";

/// Upstream ports (the engines behind every proxy).
const ENGINES: usize = 4;

/// A proxy under test, or none (`Direct`: straight to one upstream port).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Target {
    /// No proxy: the upstream itself, for the added latency's baseline.
    Direct,
    /// nginx, round robin with upstream keepalive.
    Nginx,
    /// `kvroute-e2e bare-proxy`: hyper's server and client, round robin,
    /// nothing else (see `bare.rs`).
    Hyper,
    /// SGLang's gateway, `--policy round_robin`.
    SmgRoundRobin,
    /// SGLang's gateway, `--policy cache_aware`.
    SmgCacheAware,
    /// kvroute-router, `round-robin` policy.
    KvrouteRoundRobin,
    /// kvroute-router, the default policy, approximate mode (no
    /// WatchCache: the router's own memory of where prefixes went).
    KvrouteApprox,
    /// kvroute-router, the default policy, exact mode (WatchCache streams
    /// from engine sims, one per upstream).
    KvrouteExact,
    /// kvroute-router, `round-robin` policy, with `responseCache: {backend:
    /// embedded}`, sent temperature-0 bodies ([`Target::greedy`]): every
    /// request after the first of its body is answered from the cache.
    /// Its engines are the upstream's storable ports.
    KvrouteResponseCache,
}

impl Target {
    /// Every target, in report order.
    pub const ALL: [Target; 9] = [
        Target::Direct,
        Target::Nginx,
        Target::Hyper,
        Target::SmgRoundRobin,
        Target::SmgCacheAware,
        Target::KvrouteRoundRobin,
        Target::KvrouteApprox,
        Target::KvrouteExact,
        Target::KvrouteResponseCache,
    ];

    /// Its name in flags and reports.
    pub fn name(self) -> &'static str {
        match self {
            Target::Direct => "direct",
            Target::Nginx => "nginx",
            Target::Hyper => "hyper-floor",
            Target::SmgRoundRobin => "smg-round-robin",
            Target::SmgCacheAware => "smg-cache-aware",
            Target::KvrouteRoundRobin => "kvroute-round-robin",
            Target::KvrouteApprox => "kvroute-approx",
            Target::KvrouteExact => "kvroute-exact",
            Target::KvrouteResponseCache => "kvroute-response-cache",
        }
    }

    /// Whether its bodies ask for `temperature: 0`: deterministic answers,
    /// the ones the response cache keeps.
    pub fn greedy(self) -> bool {
        self == Target::KvrouteResponseCache
    }

    fn smg_policy(self) -> Option<&'static str> {
        match self {
            Target::SmgRoundRobin => Some("round_robin"),
            Target::SmgCacheAware => Some("cache_aware"),
            _ => None,
        }
    }
}

/// What every target shares: the binaries, the fixed upstream, the engine
/// sims exact mode subscribes to, and SGLang's gateway if it could be had.
pub struct Bed {
    bins: Bins,
    dir: PathBuf,
    logs: PathBuf,
    upstream: Vec<u16>,
    /// The same upstream on other ports, its streams storable by the
    /// response cache (see [`upstream_conf`]); only
    /// [`Target::KvrouteResponseCache`] uses them, so the other targets'
    /// streams stay as they were measured.
    storable: Vec<u16>,
    /// WatchCache ports of the sims, one per upstream port.
    sim_cache: Vec<u16>,
    /// `smg`, or why it cannot be run.
    pub smg: Result<PathBuf, String>,
    _procs: Vec<Proc>,
}

/// A started target.
pub struct Running {
    /// Where requests go.
    pub url: String,
    /// The proxy's root process (none for `Direct`).
    pub root: Option<u32>,
    /// kvroute-router's admin API.
    pub admin: Option<String>,
    _procs: Vec<Proc>,
}

impl Bed {
    /// Starts the fixed upstream and, if `sims`, the engine sims; `smg` is
    /// SGLang's gateway or why not.
    pub fn start(
        bins: Bins,
        dir: &Path,
        sims: bool,
        smg: Result<PathBuf, String>,
    ) -> anyhow::Result<Bed> {
        let logs = dir.join("logs");
        std::fs::create_dir_all(logs.join("tmp"))
            .with_context(|| format!("creating {}", logs.display()))?;
        // Absolute: nginx resolves relative paths against its prefix.
        let dir = &dir.canonicalize()?;
        let logs = logs.canonicalize()?;
        let mut ports = free_ports(ENGINES * 4)?;
        let upstream: Vec<u16> = ports.by_ref().take(ENGINES).collect();
        let storable: Vec<u16> = ports.by_ref().take(ENGINES).collect();
        let conf = logs.join("upstream.conf");
        std::fs::write(&conf, upstream_conf(&logs, &upstream, &storable))?;
        let mut procs = vec![nginx(&logs, "upstream", &conf)?];
        let mut sim_cache = Vec::new();
        if sims {
            for k in 0..ENGINES {
                let (http, cache) = (ports.next(), ports.next());
                let (Some(http), Some(cache)) = (http, cache) else {
                    bail!("not enough free ports");
                };
                let args = [
                    format!("--listen=127.0.0.1:{http}"),
                    format!("--cache-listen=127.0.0.1:{cache}"),
                    format!("--model={MODEL}"),
                ];
                procs.push(Proc::spawn(
                    &bins,
                    &logs,
                    &format!("sim-{k}"),
                    "kvroute-engine-sim",
                    &args,
                    &[],
                )?);
                sim_cache.push(cache);
            }
        }
        let bed = Bed {
            bins,
            dir: dir.to_owned(),
            logs,
            upstream,
            storable,
            sim_cache,
            smg,
            _procs: procs,
        };
        for port in [bed.upstream[0], bed.storable[0]] {
            let url = format!("http://127.0.0.1:{port}/v1/models");
            wait_ok(&url, None, "the fixed upstream (nginx)")?;
        }
        Ok(bed)
    }

    /// Starts `target`, ready for load when this returns.
    pub fn run(&self, target: Target, probe_body: &str) -> anyhow::Result<Running> {
        let mut ports = free_ports(2)?;
        let (port, admin) = (ports.next().unwrap_or(0), ports.next().unwrap_or(0));
        let name = target.name();
        let mut procs = Vec::new();
        let port = match target {
            Target::Direct => self.upstream[0],
            Target::Nginx => {
                let conf = self.logs.join("nginx-proxy.conf");
                std::fs::write(&conf, proxy_conf(&self.logs, port, &self.upstream))?;
                procs.push(nginx(&self.logs, name, &conf)?);
                port
            }
            Target::Hyper => {
                let upstream: Vec<String> = self
                    .upstream
                    .iter()
                    .map(|p| format!("127.0.0.1:{p}"))
                    .collect();
                let args = [
                    "bare-proxy".to_owned(),
                    format!("--listen=127.0.0.1:{port}"),
                    format!("--upstream={}", upstream.join(",")),
                ];
                procs.push(Proc::spawn(
                    &self.bins,
                    &self.logs,
                    name,
                    "kvroute-e2e",
                    &args,
                    &[],
                )?);
                port
            }
            Target::SmgRoundRobin | Target::SmgCacheAware => {
                let smg = self.smg.as_ref().map_err(|e| anyhow::anyhow!("{e}"))?;
                let workers: Vec<String> = self
                    .upstream
                    .iter()
                    .map(|p| format!("http://127.0.0.1:{p}"))
                    .collect();
                let policy = target.smg_policy().unwrap_or("round_robin");
                let args = smg_args(port, admin, policy, &workers);
                let smg = Proc::spawn_program(&self.logs, name, smg, &args, &[])?;
                procs.push(smg.graceful());
                port
            }
            Target::KvrouteRoundRobin
            | Target::KvrouteApprox
            | Target::KvrouteExact
            | Target::KvrouteResponseCache => {
                let config = self.logs.join(format!("{name}.yaml"));
                std::fs::write(&config, self.router_config(target, port, admin))?;
                let args = [format!("--config={}", config.display())];
                procs.push(Proc::spawn(
                    &self.bins,
                    &self.logs,
                    name,
                    "kvroute-router",
                    &args,
                    &[],
                )?);
                port
            }
        };
        let url = format!("http://127.0.0.1:{port}/v1/chat/completions");
        let root = procs.first().map(Proc::id);
        wait_ok(&url, Some(probe_body), name)?;
        let admin = name
            .starts_with("kvroute")
            .then(|| format!("http://127.0.0.1:{admin}"));
        Ok(Running {
            url,
            root,
            admin,
            _procs: procs,
        })
    }

    fn router_config(&self, target: Target, port: u16, admin: u16) -> String {
        let endpoints = self
            .dir
            .join("logs")
            .join(format!("{}-endpoints.yaml", target.name()));
        let ports = match target {
            Target::KvrouteResponseCache => &self.storable,
            _ => &self.upstream,
        };
        let mut yaml = String::from("endpoints:\n");
        for (k, p) in ports.iter().enumerate() {
            let cache = match target {
                Target::KvrouteExact => format!(", cachePort: {}", self.sim_cache[k]),
                _ => String::new(),
            };
            let _ = writeln!(
                yaml,
                "  - {{address: 127.0.0.1:{p}, name: engine-{k}{cache}}}"
            );
        }
        // The file is written before the config that names it.
        let _ = std::fs::write(&endpoints, yaml);
        let (policy, cache) = match target {
            Target::KvrouteRoundRobin => ("round-robin", ""),
            Target::KvrouteResponseCache => ("round-robin", "responseCache: {backend: embedded}\n"),
            _ => ("kvroute", ""),
        };
        format!(
            "listen: 127.0.0.1:{port}\nadminListen: 127.0.0.1:{admin}\n\
             discovery: {{static: {{file: {}}}}}\nrouting: {{policy: {{name: {policy}}}}}\n{cache}",
            endpoints.display()
        )
    }
}

/// `smg`'s arguments: one gateway on `127.0.0.1:port` (Prometheus on
/// `prometheus`), `policy` (`round_robin`, `cache_aware`, …) with its
/// defaults, over `workers` (engine URLs), logging warnings only.
pub fn smg_args(port: u16, prometheus: u16, policy: &str, workers: &[String]) -> Vec<String> {
    let mut args = vec![
        "launch".to_owned(),
        "--host=127.0.0.1".into(),
        format!("--port={port}"),
        "--prometheus-host=127.0.0.1".into(),
        format!("--prometheus-port={prometheus}"),
        "--log-level=warn".into(),
        format!("--policy={policy}"),
        "--worker-urls".into(),
    ];
    args.extend(workers.iter().cloned());
    args
}

/// nginx in the foreground with `conf`, its error log in `logs`.
fn nginx(logs: &Path, name: &str, conf: &Path) -> anyhow::Result<Proc> {
    let args = [
        "-p".to_owned(),
        logs.display().to_string(),
        "-c".into(),
        conf.display().to_string(),
        "-e".into(),
        logs.join(format!("{name}.err")).display().to_string(),
    ];
    Proc::spawn_program(logs, name, Path::new("nginx"), &args, &[])
        .map(Proc::graceful)
        .context("starting nginx (apt-get install nginx-light)")
}

/// Settings both nginx configurations share: foreground, no access log,
/// bodies up to 64 MiB kept in memory, unlimited keep-alive requests.
fn nginx_common(logs: &Path, name: &str, workers: &str) -> String {
    let logs = logs.display();
    format!(
        "daemon off;\nworker_processes {workers};\npid {logs}/{name}.pid;\n\
         events {{ worker_connections 4096; }}\n\
         http {{\n  access_log off;\n  client_body_buffer_size 1m;\n  client_max_body_size 64m;\n  \
         keepalive_requests 1000000;\n  client_body_temp_path {logs}/tmp;\n  proxy_temp_path {logs}/tmp;\n"
    )
}

/// The engines: nginx answering every completion with a fixed body (an
/// event stream when the request has `x-bench-stream`), `/health` and
/// `/v1/models`. One worker, on every upstream port; on the `storable`
/// ports the stream's last content chunk also carries a finish reason, as
/// an engine's does, so the response cache can store a streamed answer
/// (the JSON answer is storable on every port: one choice, a finish
/// reason, usage).
fn upstream_conf(logs: &Path, ports: &[u16], storable: &[u16]) -> String {
    let mut conf = nginx_common(logs, "upstream", "1");
    conf.push_str(&upstream_server(ports, false));
    conf.push_str(&upstream_server(storable, true));
    conf.push_str("}\n");
    conf
}

/// One `server` of [`upstream_conf`] on `ports`; `finish`: the stream ends
/// with a finish reason.
fn upstream_server(ports: &[u16], finish: bool) -> String {
    let mut conf = String::from("  server {\n");
    for p in ports {
        let _ = writeln!(conf, "    listen 127.0.0.1:{p};");
    }
    let chunk = r#"{\"id\":\"b\",\"object\":\"chat.completion.chunk\",\"model\":\"bench\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"ok\"}}]}"#;
    let last = if finish {
        r#"{\"id\":\"b\",\"object\":\"chat.completion.chunk\",\"model\":\"bench\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"ok\"},\"finish_reason\":\"stop\"}]}"#
    } else {
        chunk
    };
    let usage = r#"{\"id\":\"b\",\"object\":\"chat.completion.chunk\",\"model\":\"bench\",\"choices\":[],\"usage\":{\"prompt_tokens\":250,\"completion_tokens\":4,\"total_tokens\":254,\"prompt_tokens_details\":{\"cached_tokens\":0}}}"#;
    let _ = write!(
        conf,
        r#"    location = /health {{ return 200 ""; }}
    location = /v1/models {{ default_type application/json; return 200 '{{"object":"list","data":[{{"id":"{MODEL}","object":"model"}}]}}'; }}
    location = /_sse {{ internal; default_type text/event-stream; return 200 "data: {chunk}\n\ndata: {chunk}\n\ndata: {chunk}\n\ndata: {last}\n\ndata: {usage}\n\ndata: [DONE]\n\n"; }}
    location / {{
      if ($http_x_bench_stream) {{ rewrite ^ /_sse last; }}
      default_type application/json;
      return 200 '{{"id":"b","object":"chat.completion","model":"{MODEL}","choices":[{{"index":0,"message":{{"role":"assistant","content":"ok"}},"finish_reason":"stop"}}],"usage":{{"prompt_tokens":250,"completion_tokens":1,"total_tokens":251,"prompt_tokens_details":{{"cached_tokens":0}}}}}}';
    }}
  }}
"#
    );
    conf
}

/// nginx as a round-robin reverse proxy over the upstream, with keep-alive
/// connections to it and response buffering off (as for event streams).
fn proxy_conf(logs: &Path, port: u16, upstream: &[u16]) -> String {
    let mut conf = nginx_common(logs, "nginx-proxy", "auto");
    conf.push_str("  upstream engines {\n");
    for p in upstream {
        let _ = writeln!(conf, "    server 127.0.0.1:{p};");
    }
    let _ = write!(
        conf,
        "    keepalive 256;\n  }}\n  server {{\n    listen 127.0.0.1:{port};\n    location / {{\n      \
         proxy_pass http://engines;\n      proxy_http_version 1.1;\n      \
         proxy_set_header Connection \"\";\n      proxy_buffering off;\n    }}\n  }}\n}}\n"
    );
    conf
}

/// The body of `GET url`.
pub fn get_text(url: &str) -> anyhow::Result<String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let r = reqwest::get(url).await?.error_for_status()?;
        Ok(r.text().await?)
    })
}

/// Waits up to 60 s until `url` answers 200 (to a POST of `body` if given).
fn wait_ok(url: &str, body: Option<&str>, what: &str) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let client = reqwest::Client::new();
    let start = Instant::now();
    runtime.block_on(async {
        loop {
            let request = match body {
                Some(b) => client
                    .post(url)
                    .header("content-type", "application/json")
                    .body(b.to_owned()),
                None => client.get(url),
            };
            if let Ok(r) = request.send().await
                && r.status().is_success()
            {
                return Ok(());
            }
            if start.elapsed() > Duration::from_secs(60) {
                bail!("{what} did not answer {url} with 200 within 60 s; see its log in the output's logs/");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
}
