//! `kvroute demo`: kvroute's value in under a minute, on one machine. It
//! starts engine sims and a router in this process, sends the same
//! multi-tenant chat workload under round robin and under kvroute (fresh
//! engines and router each time), prints what the engines reported, and
//! then keeps a kvroute router with its engines serving on `--listen` until
//! Ctrl-C (unless `--once`).
//!
//! The fleet is [`stack`]; the workload and its measurement [`workload`];
//! the figures [`report`].

mod report;
mod stack;
mod workload;

use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use kvroute_core::policy::PolicyConfig;

use report::Summary;
use stack::{ENGINES, Fleet};
use workload::{Shape, Workload};

/// Flags of `kvroute demo`.
#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// Where the router listens after the comparison; its metrics are on
    /// the next port (or a free one when that is taken).
    #[arg(
        long,
        value_name = "ADDR",
        env = "KVROUTE_DEMO_LISTEN",
        default_value = "127.0.0.1:8080"
    )]
    listen: SocketAddr,

    /// Exit after the comparison instead of serving.
    #[arg(long)]
    once: bool,

    /// The engines report their caches as vLLM does (ZMQ KV events),
    /// bridged to the router by a kvroute-agent each, instead of over
    /// WatchCache directly.
    #[arg(long)]
    vllm_events: bool,
}

/// The comparison's policies, the baseline first.
const POLICIES: [&str; 2] = ["round-robin", "kvroute"];

/// The comparison's workload: 108 requests, about 8 s per policy with the
/// engines in real time. (Not sped up: below ~40 ms, TTFTs are dominated by
/// the Nagle / delayed-ACK stall the HTTP hops add to a stream's second
/// write, which would hide the prefill the policies save.)
const SHAPE: Shape = Shape {
    conversations: 24,
    turns: 4,
    one_offs: 12,
    in_flight: 12,
    arrival_gap: Duration::from_millis(150),
    seed: 2024,
};

/// Runs the demo, printing to `out`.
pub fn run(args: &DemoArgs, out: &mut impl Write) -> anyhow::Result<()> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?
        .block_on(demo(args, out))
}

async fn demo(args: &DemoArgs, out: &mut impl Write) -> anyhow::Result<()> {
    let started = Instant::now();
    if !args.once {
        // Fail before the comparison, not after it.
        check_free(args.listen)?;
    }
    let workload = Workload::new(SHAPE);
    describe(out, &workload)?;
    let client = reqwest::Client::builder()
        .no_proxy()
        .build()
        .context("building the HTTP client")?;
    let loopback = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0);
    let mut rows = Vec::new();
    for (i, name) in POLICIES.iter().enumerate() {
        let step = format!("[{}/{}] {name}", i + 1, POLICIES.len());
        writeln!(out, "{step}: starting {ENGINES} fresh engines and a router")?;
        let policy = PolicyConfig::by_name(name).expect("a known policy");
        let fleet = Fleet::start(policy, loopback, loopback, args.vllm_events).await?;
        writeln!(out, "{step}: sending {} requests", workload.requests())?;
        let t = Instant::now();
        let samples = workload
            .run(&client, &format!("http://{}", fleet.addr()))
            .await;
        let wall = t.elapsed();
        let evicted = fleet.evicted_blocks();
        fleet.stop().await;
        let samples = samples.with_context(|| format!("the {name} run"))?;
        writeln!(out, "{step}: done in {:.1} s", wall.as_secs_f64())?;
        rows.push(Summary::new(name, &samples, wall, evicted));
    }

    writeln!(out)?;
    report::print_table(out, &rows, ENGINES)?;
    writeln!(out)?;
    writeln!(out, "{}", report::improvement(&rows[0], &rows[1]))?;
    writeln!(
        out,
        "comparison done in {:.1} s",
        started.elapsed().as_secs_f64()
    )?;
    if args.once {
        return Ok(());
    }
    serve(args, out).await
}

/// Says what is about to run.
fn describe(out: &mut impl Write, workload: &Workload) -> std::io::Result<()> {
    let sim = stack::sim_config();
    writeln!(
        out,
        "engines: {ENGINES} kvroute-engine-sims, each {} KV blocks of {} tokens, {} sequences at a time, \
         prefill {} tokens/s + {} ms, {} ms per output token (real time)",
        sim.num_gpu_blocks,
        sim.block_size,
        sim.max_num_seqs,
        sim.prefill_tokens_per_s,
        sim.prefill_overhead_ms,
        sim.itl_ms,
    )?;
    let system_tokens: Vec<String> = workload
        .system_tokens()
        .iter()
        .map(usize::to_string)
        .collect();
    writeln!(
        out,
        "workload: {} tenants chatting with {} assistants (system prompts of {} tokens), \
         {} conversations x {} turns + {} one-off questions, streamed, {} sessions at a time, \
         one starting every {} ms",
        workload.tenants(),
        workload.systems.len(),
        system_tokens.join("/"),
        SHAPE.conversations,
        SHAPE.turns,
        SHAPE.one_offs,
        SHAPE.in_flight,
        SHAPE.arrival_gap.as_millis(),
    )
}

/// Serves kvroute over fresh engines until Ctrl-C.
async fn serve(args: &DemoArgs, out: &mut impl Write) -> anyhow::Result<()> {
    let fleet = Fleet::start(
        PolicyConfig::default(),
        args.listen,
        admin_addr(args.listen),
        args.vllm_events,
    )
    .await?;
    let api = reachable(fleet.addr());
    let admin = reachable(fleet.admin_addr());
    writeln!(out)?;
    writeln!(
        out,
        "kvroute is serving on http://{api}, in front of {ENGINES} engine sims; try:"
    )?;
    writeln!(
        out,
        "  curl -s http://{api}/v1/chat/completions -H 'content-type: application/json' \
         -d '{{\"model\": \"{}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Why route by prefix?\"}}], \
         \"max_tokens\": 16}}' -D -",
        workload::MODEL
    )?;
    writeln!(
        out,
        "metrics: http://{admin}/metrics (endpoints: http://{admin}/debug/pool)"
    )?;
    let stop = kvroute_telemetry::shutdown_signal();
    writeln!(out, "press Ctrl-C to stop")?;
    out.flush()?;
    stop.await;
    writeln!(out, "stopping (Ctrl-C again to stop at once)")?;
    out.flush()?;
    tokio::select! {
        () = fleet.stop() => writeln!(out, "stopped")?,
        () = kvroute_telemetry::shutdown_signal() => writeln!(out, "stopped without waiting for open requests")?,
    }
    Ok(())
}

/// Fails with a one-line error when `addr` cannot be bound.
fn check_free(addr: SocketAddr) -> anyhow::Result<()> {
    std::net::TcpListener::bind(addr)
        .map(drop)
        .with_context(|| {
            format!(
                "--listen {addr} cannot be bound (another kvroute demo running? \
             pick another address with --listen)"
            )
        })
}

/// The admin address: the port after `listen`'s when it is free, else any
/// free port.
fn admin_addr(listen: SocketAddr) -> SocketAddr {
    let next = match listen.port() {
        0 | u16::MAX => None,
        p => Some(SocketAddr::new(listen.ip(), p + 1)),
    };
    next.filter(|a| std::net::TcpListener::bind(a).is_ok())
        .unwrap_or(SocketAddr::new(listen.ip(), 0))
}

/// `addr` as a client can reach it: an unspecified IP becomes loopback.
fn reachable(addr: SocketAddr) -> SocketAddr {
    match addr.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => {
            SocketAddr::new(Ipv4Addr::LOCALHOST.into(), addr.port())
        }
        IpAddr::V6(ip) if ip.is_unspecified() => {
            SocketAddr::new(Ipv6Addr::LOCALHOST.into(), addr.port())
        }
        _ => addr,
    }
}
