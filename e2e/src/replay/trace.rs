//! A Mooncake-format trace as the live replay sends it: the requests of a
//! slice, each block id turned into a deterministic run of token ids, and
//! the engines sized to the slice.
//!
//! Token mapping: block id `b` becomes `T` (`--block-tokens`) token ids
//! drawn from a SplitMix64 stream seeded by `b`, so equal ids at equal
//! positions give equal tokens (the prefix an engine reuses) and different
//! ids give different ones. A prompt is its blocks' runs cut to
//! `input_length` (the last block may be partial). Engines hash these
//! tokens in blocks of 16; with `T` a multiple of 16 a trace block is a
//! whole number of engine blocks, so an engine's cached tokens are the
//! replay's `min(m × T, input_length)`, less what vLLM's rules withhold: a
//! partial last block only caches its full engine blocks, and a prompt
//! never hits its own last token.
//!
//! Not here: sending the requests ([`super::drive`]) or the model
//! ([`super::model`]).

use std::collections::HashSet;
use std::io::{BufRead, Write as _};
use std::path::Path;

use anyhow::{Context as _, bail};
use kvroute_core::rng::SplitMix64;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::suite::system::MODEL;

/// Token ids are below this: 5 digits in JSON, and in every real model's
/// vocabulary range.
const VOCAB: u64 = 100_000;

/// One request, as a trace line has it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Request {
    /// Arrival, milliseconds from the trace's start.
    pub timestamp: f64,
    /// Prompt tokens.
    pub input_length: u64,
    /// Generated tokens.
    pub output_length: u64,
    /// One id per block of the prompt.
    pub hash_ids: Vec<u64>,
}

/// Reads the first `limit` requests by arrival (all when `None`) of the
/// JSON lines in `reader`, and checks that each request's ids cover its
/// prompt in blocks of `block_tokens`.
pub fn parse(
    reader: impl BufRead,
    limit: Option<usize>,
    block_tokens: u64,
) -> anyhow::Result<Vec<Request>> {
    let mut requests = Vec::new();
    for (n, line) in reader.lines().enumerate() {
        let line = line.with_context(|| format!("line {}", n + 1))?;
        if line.trim().is_empty() {
            continue;
        }
        let r: Request = serde_json::from_str(&line).with_context(|| format!("line {}", n + 1))?;
        if !r.timestamp.is_finite() || r.timestamp < 0.0 {
            bail!("line {}: timestamp {} is not a time", n + 1, r.timestamp);
        }
        let blocks = r.input_length.div_ceil(block_tokens);
        if r.input_length == 0 || r.hash_ids.len() as u64 != blocks {
            bail!(
                "line {}: {} hash_ids for {} prompt tokens, where blocks of {block_tokens} \
                 (--block-tokens) need {blocks}: is --block-tokens the trace's block size?",
                n + 1,
                r.hash_ids.len(),
                r.input_length
            );
        }
        requests.push(r);
    }
    if requests.is_empty() {
        bail!("the trace has no requests");
    }
    // Stable, as `kvroute replay` orders them.
    requests.sort_by(|a, b| a.timestamp.total_cmp(&b.timestamp));
    requests.truncate(limit.unwrap_or(usize::MAX));
    Ok(requests)
}

/// Reads a trace file (see [`parse`]).
pub fn load(path: &Path, limit: Option<usize>, block_tokens: u64) -> anyhow::Result<Vec<Request>> {
    let file =
        std::fs::File::open(path).with_context(|| format!("opening trace {}", path.display()))?;
    parse(std::io::BufReader::new(file), limit, block_tokens)
        .with_context(|| format!("reading trace {}", path.display()))
}

/// Writes `requests` as a trace file, for the model to read.
pub fn write(path: &Path, requests: &[Request]) -> anyhow::Result<()> {
    let mut out = std::io::BufWriter::new(
        std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?,
    );
    for r in requests {
        serde_json::to_writer(&mut out, r)?;
        out.write_all(b"\n")?;
    }
    out.flush()
        .with_context(|| format!("writing {}", path.display()))
}

/// The prompt of `request`: its blocks' token runs, cut to its length.
pub fn prompt(request: &Request, block_tokens: u64) -> Vec<u32> {
    let mut tokens = Vec::with_capacity(request.input_length as usize);
    for &id in &request.hash_ids {
        let mut rng =
            SplitMix64::new(id.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x6b76_726f_7574_6521);
        let left = request.input_length - tokens.len() as u64;
        tokens.extend((0..block_tokens.min(left)).map(|_| (rng.next_u64() % VOCAB) as u32));
    }
    tokens
}

/// The `/v1/completions` body of `request`: its token-id prompt, its
/// output length (at least 1, as the API requires), streamed with usage.
pub fn body(request: &Request, block_tokens: u64) -> Value {
    json!({
        "model": MODEL,
        "prompt": prompt(request, block_tokens),
        "max_tokens": request.output_length.max(1),
        "stream": true,
        "stream_options": {"include_usage": true},
    })
}

/// The engines' size for a slice, the same in the live system and the
/// model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Sizing {
    /// Distinct block ids in the slice (D).
    pub distinct_blocks: usize,
    /// Trace blocks per pod as `kvroute replay` sizes its replicas:
    /// `floor(floor(cache_frac × D) / pods)`.
    pub trace_blocks_per_pod: usize,
    /// Each engine's KV cache in engine blocks: the above in tokens over
    /// the block size, raised to hold the slice's largest request.
    pub num_gpu_blocks: u32,
    /// The largest prompt plus output of the slice, tokens.
    pub longest: u64,
}

impl Sizing {
    /// Sizes the engines of `pods` pods for `requests`.
    pub fn of(
        requests: &[Request],
        pods: usize,
        cache_frac: f64,
        block_tokens: u64,
        block_size: u32,
    ) -> anyhow::Result<Sizing> {
        let distinct = requests
            .iter()
            .flat_map(|r| r.hash_ids.iter())
            .collect::<HashSet<_>>()
            .len();
        let pooled = (cache_frac * distinct as f64).floor() as usize;
        let per_pod = pooled / pods.max(1);
        let longest = requests
            .iter()
            .map(|r| r.input_length + r.output_length.max(1))
            .max()
            .unwrap_or(0);
        let bs = u64::from(block_size);
        let blocks = (per_pod as u64 * block_tokens / bs).max(longest.div_ceil(bs));
        Ok(Sizing {
            distinct_blocks: distinct,
            trace_blocks_per_pod: per_pod,
            num_gpu_blocks: u32::try_from(blocks)
                .with_context(|| format!("{blocks} KV blocks per engine is too many"))?,
            longest,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(ids: &[u64], input_length: u64) -> Request {
        Request {
            timestamp: 0.0,
            input_length,
            output_length: 4,
            hash_ids: ids.to_vec(),
        }
    }

    #[test]
    fn equal_ids_at_equal_positions_are_equal_tokens() {
        let a = prompt(&request(&[1, 2, 3], 80), 32);
        let b = prompt(&request(&[1, 2, 4], 96), 32);
        assert_eq!((a.len(), b.len()), (80, 96));
        assert_eq!(a[..64], b[..64]);
        assert_ne!(a[64..80], b[64..80]);
        assert_ne!(
            prompt(&request(&[5], 32), 32),
            prompt(&request(&[6], 32), 32)
        );
        assert!(a.iter().all(|&t| u64::from(t) < VOCAB));
    }

    #[test]
    fn parse_orders_slices_and_checks_the_blocks() {
        let text = "{\"timestamp\": 20, \"input_length\": 5, \"output_length\": 1, \"hash_ids\": [1]}\n\n\
                    {\"timestamp\": 10, \"input_length\": 513, \"output_length\": 2, \"hash_ids\": [1, 2]}\n";
        let all = parse(text.as_bytes(), None, 512).unwrap();
        assert_eq!(
            all.iter().map(|r| r.input_length).collect::<Vec<_>>(),
            [513, 5]
        );
        assert_eq!(parse(text.as_bytes(), Some(1), 512).unwrap().len(), 1);
        let err = format!("{:#}", parse(text.as_bytes(), None, 256).unwrap_err());
        assert!(
            err.contains("line 3: 2 hash_ids for 513 prompt tokens"),
            "{err}"
        );
        assert!(parse("".as_bytes(), None, 512).is_err());
    }

    #[test]
    fn sizing_follows_the_replay_and_fits_the_largest_request() {
        // 10 distinct ids, 0.5 of them over 2 pods: 2 trace blocks each,
        // 2 × 512 / 16 = 64 engine blocks, unless a request needs more.
        let small: Vec<Request> = (0..5).map(|i| request(&[2 * i, 2 * i + 1], 1024)).collect();
        let s = Sizing::of(&small, 2, 0.5, 512, 16).unwrap();
        assert_eq!((s.distinct_blocks, s.trace_blocks_per_pod), (10, 2));
        assert_eq!((s.num_gpu_blocks, s.longest), (65, 1028));
        let big = [request(&(0..10).collect::<Vec<_>>(), 5000)];
        assert_eq!(
            Sizing::of(&big, 8, 0.3, 512, 16).unwrap().num_gpu_blocks,
            313
        );
    }
}
