//! `kvroute-e2e semantic-pairs`: the labelled question pairs
//! (`e2e/data/semantic-pairs/pairs.jsonl`) scored offline with
//! engine-sim's embeddings test double, the vectors the router's semantic
//! cache gets from the sim. Per threshold: the hit rate (pairs meaning
//! the same whose similarity reaches it) and the false-hit rate (pairs
//! meaning something else that do). Not through the router: a first
//! measure of the double, not of the cache.

use std::path::PathBuf;

use anyhow::Context;
use kvroute_engine_sim::embeddings::{cosine, embed};

/// The command's arguments.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The labelled pairs, one JSON object a line.
    #[arg(long, default_value = "e2e/data/semantic-pairs/pairs.jsonl")]
    pairs: PathBuf,
    /// The thresholds to score.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "0.8,0.85,0.9,0.95,0.98,0.99,1.0"
    )]
    thresholds: Vec<f32>,
}

#[derive(serde::Deserialize)]
struct Pair {
    a: String,
    b: String,
    same: bool,
}

/// Prints the table.
pub fn run(args: &Args) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(&args.pairs)
        .with_context(|| format!("reading {}", args.pairs.display()))?;
    let mut scored = Vec::new();
    for (i, line) in text.lines().filter(|l| !l.trim().is_empty()).enumerate() {
        let pair: Pair = serde_json::from_str(line).with_context(|| format!("line {}", i + 1))?;
        let (Some(a), Some(b)) = (embed(&pair.a), embed(&pair.b)) else {
            anyhow::bail!("line {}: a question without words", i + 1);
        };
        scored.push((pair.same, cosine(&a, &b)));
    }
    let same = scored.iter().filter(|(s, _)| *s).count();
    let other = scored.len() - same;
    println!(
        "{} pairs ({same} same meaning, {other} not), engine-sim's embeddings test double\n",
        scored.len()
    );
    println!("| threshold | hit rate | false-hit rate |");
    println!("|---|---|---|");
    for t in &args.thresholds {
        let hits = scored.iter().filter(|(s, c)| *s && *c >= *t).count();
        let false_hits = scored.iter().filter(|(s, c)| !*s && *c >= *t).count();
        println!(
            "| {t:.2} | {:.1} % ({hits}/{same}) | {:.1} % ({false_hits}/{other}) |",
            100.0 * hits as f64 / same.max(1) as f64,
            100.0 * false_hits as f64 / other.max(1) as f64,
        );
    }
    Ok(())
}
