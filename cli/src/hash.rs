//! `kvroute hash`: print the block hashes a vLLM pod would compute for a
//! token sequence, to check a router's configuration against a pod's KV
//! events by hand or from scripts.
//!
//! Its flags and output formats are an interface other tools rely on.

use std::io::Write;

use anyhow::Context as _;
use clap::builder::{PossibleValuesParser, TypedValueParser as _};
use kvroute_core::hash::{
    BlockExtras, BlockHasher, ExtraKeysForm, HashAlgo, HashConfig, HashError, Lora,
    validate_cache_salt,
};

/// Flags of `kvroute hash`.
#[derive(Debug, clap::Args)]
pub struct HashArgs {
    /// The pods' --prefix-caching-hash-algo.
    #[arg(
        long,
        value_name = "ALGO",
        value_parser = PossibleValuesParser::new(HashAlgo::ALL.map(HashAlgo::as_str))
            .try_map(|name| name.parse::<HashAlgo>()),
    )]
    algo: HashAlgo,

    /// Tokens per KV-cache block (the pods' --block-size).
    #[arg(long, value_name = "N", value_parser = parse_block_size)]
    block_size: usize,

    /// Token ids, comma-separated (e.g. 1,2,3).
    #[arg(long, value_name = "IDS", required = true, value_delimiter = ',', value_parser = parse_token)]
    tokens: Vec<u32>,

    /// The pods' PYTHONHASHSEED; omit when it is unset ("vllm-none-hash").
    #[arg(long, value_name = "S")]
    seed: Option<String>,

    /// The request's cache_salt (hashed into block 0).
    #[arg(long, value_name = "S", value_parser = parse_cache_salt)]
    cache_salt: Option<String>,

    /// Served name of the request's LoRA adapter.
    #[arg(long, value_name = "N", requires = "lora_path")]
    lora_name: Option<String>,

    /// Path of the LoRA adapter on the pods.
    #[arg(long, value_name = "P", requires = "lora_name")]
    lora_path: Option<String>,

    /// Use the untagged extra-key form of vLLM 0.15 to 0.30.
    #[arg(long)]
    legacy_extra_keys: bool,

    /// Print one JSON object instead of one line per block.
    #[arg(long)]
    json: bool,
}

/// The `--json` output; field order is part of the interface.
#[derive(Debug, serde::Serialize)]
struct HashOutput {
    none_hash_hex: String,
    block_hashes_hex: Vec<String>,
    event_block_hashes_u64: Vec<u64>,
}

/// Hashes `args.tokens` and prints the result to `out`.
pub fn run(args: &HashArgs, out: &mut impl Write) -> anyhow::Result<()> {
    let hasher = BlockHasher::new(HashConfig {
        algo: args.algo,
        block_size: args.block_size,
        seed: args.seed.clone(),
        extra_keys: if args.legacy_extra_keys {
            ExtraKeysForm::Legacy
        } else {
            ExtraKeysForm::Tagged
        },
    })?;
    // clap's `requires` guarantees name and path come together.
    let lora = args
        .lora_name
        .as_ref()
        .zip(args.lora_path.as_ref())
        .map(|(n, p)| Lora::new(n, p));
    let extras = BlockExtras {
        lora: lora.as_ref(),
        cache_salt: args.cache_salt.as_deref(),
    };
    let digests = hasher.digests(&args.tokens, extras);

    if args.json {
        let output = HashOutput {
            none_hash_hex: hasher.none_hash().to_hex(),
            block_hashes_hex: digests.iter().map(|d| d.to_hex()).collect(),
            event_block_hashes_u64: digests.iter().map(|d| d.to_u64()).collect(),
        };
        serde_json::to_writer(&mut *out, &output)?;
        writeln!(out)
    } else {
        digests
            .iter()
            .enumerate()
            .try_for_each(|(index, d)| writeln!(out, "{index} {} {}", d.to_hex(), d.to_u64()))
    }
    .context("writing to stdout")
}

fn parse_block_size(value: &str) -> Result<usize, String> {
    match value.trim().parse::<usize>() {
        Ok(0) => Err("block size must be at least 1".to_owned()),
        Ok(size) => Ok(size),
        Err(_) => Err("expected a positive integer".to_owned()),
    }
}

fn parse_token(value: &str) -> Result<u32, String> {
    value
        .trim()
        .parse::<u32>()
        .map_err(|_| format!("expected comma-separated token ids in 0..={}", u32::MAX))
}

fn parse_cache_salt(value: &str) -> Result<String, String> {
    match validate_cache_salt(value) {
        Ok(()) => Ok(value.to_owned()),
        Err(HashError::InvalidCacheSalt { reason, .. }) => Err(reason.to_owned()),
        Err(other) => Err(other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn value_parsers() {
        assert_eq!(parse_block_size("16"), Ok(16));
        assert!(parse_block_size("0").unwrap_err().contains("at least 1"));
        assert!(parse_block_size("-1").is_err());
        assert_eq!(parse_token(" 128000"), Ok(128_000));
        assert_eq!(parse_token("4294967295"), Ok(u32::MAX));
        assert!(parse_token("4294967296").is_err());
        assert!(parse_token("x").is_err());
        assert_eq!(parse_cache_salt("tenant-a").as_deref(), Ok("tenant-a"));
        assert!(parse_cache_salt("a/b").unwrap_err().contains("'/'"));
    }

    #[test]
    fn text_lines_are_index_hex_u64() {
        let args = HashArgs {
            algo: HashAlgo::Sha256Cbor,
            block_size: 2,
            tokens: vec![1, 2, 3, 4, 5],
            seed: None,
            cache_salt: None,
            lora_name: None,
            lora_path: None,
            legacy_extra_keys: false,
            json: false,
        };
        let mut out = Vec::new();
        run(&args, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        let lines: Vec<Vec<&str>> = text.lines().map(|l| l.split(' ').collect()).collect();
        assert_eq!(lines.len(), 2);
        for (index, fields) in lines.iter().enumerate() {
            assert_eq!(fields[0], index.to_string());
            assert_eq!(fields[1].len(), 64);
            assert_eq!(
                fields[2].parse::<u64>().unwrap(),
                u64::from_str_radix(&fields[1][48..], 16).unwrap()
            );
        }
    }
}
