//! `kvroute-e2e bench-semantic`: the semantic response cache's risk and
//! memory, measured through a running router (see
//! `docs/response-cache.md`), its questions embedded by engine-sim's
//! embeddings test double, or by the server `--embeddings-url` names (a
//! user's own model, with `--pairs` their own labelled questions).
//!
//! 1. **Thresholds.** Per threshold, a system of its own (one engine, the
//!    routers at that threshold) replays the labelled pairs as the
//!    `semantic_cache` scenario does ([`semantic_cache::replay`]): the hit
//!    rate of pairs meaning the same and the false-hit rate of the others.
//!    Beside them, with engine-sim's double, the same pairs scored offline
//!    (the double's cosine against the threshold): a router rate below its
//!    offline rate is a hit its approximate index missed. Then the
//!    semantic hits per kind of pair (the `kind` label) and threshold.
//! 2. **Memory at the bound.** One system at the default threshold with
//!    `maxEntries` from `--max-entries`: 4 × that many distinct questions
//!    of one tenant; after each half `maxEntries`, the entries and bytes the router
//!    reports for the index, the exact cache's bytes, and router-0's
//!    resident memory; beside it, router-0's resident memory under the
//!    same traffic with the semantic level off (the exact cache only).
//!
//! The engines answer fast (1 ms a token) so misses cost little.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use futures_util::StreamExt as _;
use kvroute_engine_sim::embeddings::{cosine, embed};

use super::measure::memory_kib;
use crate::suite::procs::Bins;
use crate::suite::response_cache::sum;
use crate::suite::semantic_cache::{
    self as semantic_cache, Embedder, PAIRS, PAIRS_FILE, Pair, Replayed, ask, pairs, rates,
};
use crate::suite::system::{EngineSetup, Setup, System, TENANT_HEADER};

/// The command's arguments.
#[derive(Debug, clap::Args)]
pub struct SemanticArgs {
    /// The thresholds to replay the pairs at.
    #[arg(long, value_delimiter = ',', default_value = "0.9,0.95,0.98,0.99,1.0")]
    thresholds: Vec<f32>,
    /// `maxEntries` of the memory run (0: no memory run).
    #[arg(long, default_value_t = 10_000)]
    max_entries: usize,
    /// Where logs go.
    #[arg(long, default_value = "target/bench-semantic")]
    out: PathBuf,
    /// Where the binaries are (default: built beside this one).
    #[arg(long)]
    bin_dir: Option<PathBuf>,
    /// Labelled pairs, JSON lines `{"id", "a", "b", "same"}` (default:
    /// e2e/data/semantic-pairs/pairs.jsonl).
    #[arg(long)]
    pairs: Option<PathBuf>,
    /// An OpenAI-compatible embeddings server to measure instead of
    /// engine-sim's test double (its base URL, as
    /// responseCache.semantic.embeddings.url).
    #[arg(long, requires = "embeddings_model")]
    embeddings_url: Option<String>,
    /// Its embedding model.
    #[arg(long, requires = "embeddings_url")]
    embeddings_model: Option<String>,
}

/// Requests in flight at once in the memory run.
const FILL_CONCURRENCY: usize = 16;

/// Runs the benchmark, printing its tables.
pub fn semantic(args: &SemanticArgs) -> anyhow::Result<()> {
    let bins = Bins::locate(args.bin_dir.clone())?;
    let runtime = tokio::runtime::Runtime::new().context("starting the tokio runtime")?;
    runtime.block_on(async {
        let logs = args.out.join("logs");
        std::fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;
        let embedder = match (&args.embeddings_url, &args.embeddings_model) {
            (Some(url), Some(model)) => Embedder::external(url, model),
            _ => Embedder::start(&bins, &logs).await?,
        };
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(30))
            .build()?;
        thresholds(args, &bins, &embedder, &client).await?;
        if args.max_entries > 0 {
            memory(args, &bins, &embedder, &client).await?;
        }
        Ok(())
    })
}

/// A system whose routers run the semantic level at `threshold` with
/// `max_entries`, its engines fast.
async fn start(
    bins: &Bins,
    args: &SemanticArgs,
    name: &str,
    yaml: String,
) -> anyhow::Result<System> {
    let setup = Setup {
        router_yaml: yaml,
        engine: EngineSetup {
            itl_ms: 1,
            prefill_overhead_ms: 1,
            ..EngineSetup::suite()
        },
        ..Setup::new(1)
    };
    let semantic = setup.router_yaml.contains("semantic:");
    let system = System::start(bins, &args.out.join("logs").join(name), setup).await?;
    if semantic {
        semantic_cache::embedder_checked(&system).await?;
    }
    Ok(system)
}

/// Part 1: the pairs per threshold.
async fn thresholds(
    args: &SemanticArgs,
    bins: &Bins,
    embedder: &Embedder,
    client: &reqwest::Client,
) -> anyhow::Result<()> {
    let pairs = match &args.pairs {
        None => pairs(PAIRS, PAIRS_FILE)?,
        Some(file) => {
            let text = std::fs::read_to_string(file)
                .with_context(|| format!("reading {}", file.display()))?;
            pairs(&text, &file.display().to_string())?
        }
    };
    // The double's own scores, when it is what the router asks.
    let offline: Option<Vec<(bool, f32)>> = (!embedder.external).then(|| {
        (pairs.iter())
            .map(|p| match (embed(&p.a), embed(&p.b)) {
                (Some(a), Some(b)) => (p.same, cosine(&a, &b)),
                _ => (p.same, 0.0),
            })
            .collect()
    });
    let same = pairs.iter().filter(|p| p.same).count();
    let by = match embedder.external {
        true => format!("{} at {}", embedder.model, embedder.url),
        false => "engine-sim's test double".to_owned(),
    };
    println!(
        "{} labelled pairs ({same} meaning the same, {} not), embedded by {by}\n",
        pairs.len(),
        pairs.len() - same,
    );
    println!(
        "| threshold | hit rate | false-hit rate | offline hit rate | offline false-hit rate |"
    );
    println!("|---|---|---|---|---|");
    let rate =
        |n: usize, of: usize| format!("{:.1} % ({n}/{of})", 100.0 * n as f64 / of.max(1) as f64);
    let mut runs = Vec::new();
    for &t in &args.thresholds {
        let yaml = semantic_cache::router_yaml(embedder, Some(t), None);
        let system = start(bins, args, &format!("threshold-{t}"), yaml).await?;
        let replayed = semantic_cache::replay(client, system.router_addrs()[0], &pairs).await;
        if let Some(e) = replayed.iter().find_map(|r| r.answers.as_ref().err()) {
            anyhow::bail!("at threshold {t}, a pair's request failed: {e}");
        }
        let ((hits, same), (false_hits, other)) = rates(&replayed);
        let offline_rate = |meaning: bool, of: usize| match &offline {
            Some(scored) => {
                let n = (scored.iter())
                    .filter(|(s, c)| *s == meaning && *c >= t)
                    .count();
                rate(n, of)
            }
            None => "—".to_owned(),
        };
        println!(
            "| {t:.2} | {} | {} | {} | {} |",
            rate(hits, same),
            rate(false_hits, other),
            offline_rate(true, same),
            offline_rate(false, other),
        );
        runs.push(replayed);
    }
    by_kind(&args.thresholds, &pairs, &runs);
    Ok(())
}

/// The semantic hits of each kind of pair per threshold (`runs`: the
/// pairs replayed at each of `thresholds`, in order).
fn by_kind(thresholds: &[f32], pairs: &[Pair], runs: &[Vec<Replayed>]) {
    let mut kinds: Vec<(bool, &str)> = (pairs.iter())
        .map(|p| (p.same, p.kind.as_deref().unwrap_or("-")))
        .collect();
    kinds.sort_unstable_by_key(|(same, kind)| (!same, *kind));
    kinds.dedup();
    let heads: Vec<String> = thresholds.iter().map(|t| format!("{t:.2}")).collect();
    println!("\nsemantic hits by kind of pair\n");
    println!("| kind | same meaning | pairs | {} |", heads.join(" | "));
    println!("|---|---|---|{}", "---|".repeat(thresholds.len()));
    for (same, kind) in kinds {
        let of = |p: &Pair| p.same == same && p.kind.as_deref().unwrap_or("-") == kind;
        let hits: Vec<String> = (runs.iter())
            .map(|run| {
                let n = (pairs.iter().zip(run))
                    .filter(|(p, r)| of(p) && r.semantic_hit())
                    .count();
                n.to_string()
            })
            .collect();
        let n = pairs.iter().filter(|p| of(p)).count();
        let same = if same { "yes" } else { "no" };
        println!("| {kind} | {same} | {n} | {} |", hits.join(" | "));
    }
}

/// Part 2: memory at the bound, beside the same traffic with the
/// semantic level off.
async fn memory(
    args: &SemanticArgs,
    bins: &Bins,
    embedder: &Embedder,
    client: &reqwest::Client,
) -> anyhow::Result<()> {
    let max = args.max_entries;
    let on = semantic_cache::router_yaml(embedder, None, Some(max));
    let on = fill(args, bins, client, "memory", on).await?;
    let off = format!(
        "tenancy:\n  tenantHeader: {TENANT_HEADER}\nresponseCache: {{backend: embedded}}\n"
    );
    let off = fill(args, bins, client, "memory-off", off).await?;
    println!(
        "\nmemory: maxEntries {max}, {} distinct questions of one tenant, {FILL_CONCURRENCY} at once\n",
        4 * max
    );
    println!(
        "| questions | entries | index bytes (reported) | exact cache bytes | router RSS | router RSS, semantic off | difference |"
    );
    println!("|---|---|---|---|---|---|---|");
    let mib = |bytes: f64| format!("{:.1} MiB", bytes / (1 << 20) as f64);
    for (row, off) in on.iter().zip(&off) {
        println!(
            "| {} | {} | {} | {} | {} | {} | {} |",
            row.sent,
            row.entries,
            mib(row.index_bytes),
            mib(row.exact_bytes),
            mib(row.rss),
            mib(off.rss),
            mib(row.rss - off.rss)
        );
    }
    Ok(())
}

/// What a router reported after some questions.
struct Row {
    sent: usize,
    entries: f64,
    index_bytes: f64,
    exact_bytes: f64,
    /// Router-0's resident memory, bytes.
    rss: f64,
}

/// 4 × `--max-entries` distinct questions of one tenant through a system
/// whose routers are configured with `yaml`; a row at the start and after
/// each half `--max-entries`.
async fn fill(
    args: &SemanticArgs,
    bins: &Bins,
    client: &reqwest::Client,
    name: &str,
    yaml: String,
) -> anyhow::Result<Vec<Row>> {
    let max = args.max_entries;
    let system = start(bins, args, name, yaml).await?;
    let (addr, pid) = (system.router_addrs()[0], system.router_pid(0));
    let pid = pid.context("router-0 is not running")?;
    let row = async |sent: usize| -> anyhow::Result<Row> {
        let text = system.router_metrics(0).await?;
        Ok(Row {
            sent,
            entries: sum(&text, "kvroute_semantic_cache_entries"),
            index_bytes: sum(&text, "kvroute_semantic_cache_bytes"),
            exact_bytes: sum(&text, "kvroute_response_cache_bytes"),
            rss: memory_kib(&[pid], "VmRSS") as f64 * 1024.0,
        })
    };
    let mut rows = vec![row(0).await?];
    let step = (max / 2).max(1);
    let mut sent = 0;
    while sent < 4 * max {
        let questions: Vec<String> = (sent..(sent + step).min(4 * max))
            .map(|n| format!("Fill question {n}: what is the answer to riddle {n}?"))
            .collect();
        let failed = futures_util::stream::iter(&questions)
            .map(|q| ask(client, addr, "fill", q))
            .buffer_unordered(FILL_CONCURRENCY)
            .filter(|r| std::future::ready(r.is_err()))
            .count()
            .await;
        anyhow::ensure!(failed == 0, "{failed} requests of {name} failed");
        sent += questions.len();
        rows.push(row(sent).await?);
    }
    Ok(rows)
}
