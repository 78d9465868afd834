//! `kvroute explain`: asks a running router what it would do with a request
//! (`POST /debug/explain` on its admin port) and prints the answer: the
//! tokens and block chain the router computes, which endpoints hold how
//! many of its leading blocks, each endpoint's contract, load and predicted
//! TTFT, and the decision with its reason. Nothing is sent to an engine and
//! no state changes.
//!
//! With `--request-id ID`, it shows instead where a served request's
//! missed prompt tokens went (`GET /debug/requests/{id}`): the id is the
//! request's `x-request-id` or the engine's response `id`. With `--prefix
//! NAME`, a warmed prefix's last period (`GET /debug/warmup`): its owners,
//! whether each held it, and what its warm-up did there.

use std::fmt::Write as _;
use std::io::{Read, Write};
use std::path::PathBuf;

use anyhow::{Context, bail};
use kvroute_router::explain::{Explanation, Recorded};
use serde_json::{Value, json};

/// Flags of `kvroute explain`.
#[derive(Debug, clap::Args)]
pub struct ExplainArgs {
    /// The router's admin address, e.g. http://localhost:9090.
    #[arg(long, env = "KVROUTE_ADMIN")]
    admin: String,
    /// The API path the request would be sent to.
    #[arg(long, default_value = "/v1/chat/completions")]
    path: String,
    /// A request header, `Name: value` (repeatable): the API key, the
    /// tenant or conversation header.
    #[arg(long = "header", short = 'H', value_parser = parse_header)]
    headers: Vec<(String, String)>,
    /// The admin port's bearer token (the router's adminTokenFile), when
    /// /debug is protected.
    #[arg(long, env = "KVROUTE_ADMIN_TOKEN", hide_env_values = true)]
    admin_token: Option<String>,
    /// Print the router's JSON answer as it is.
    #[arg(long)]
    json: bool,
    /// Show a served request's missed tokens by cause instead, by its
    /// `x-request-id` or the engine's response `id` (the router keeps the
    /// last 1024).
    #[arg(long, conflicts_with = "body")]
    request_id: Option<String>,
    /// Show a named prefix of the router's `routing.warmup` instead: its
    /// owners, whether each held it, its last warm-up there.
    #[arg(long, conflicts_with_all = ["body", "request_id"])]
    prefix: Option<String>,
    /// The request body (JSON): a file, or - for standard input.
    #[arg(default_value = "-")]
    body: PathBuf,
}

fn parse_header(s: &str) -> Result<(String, String), String> {
    match s.split_once(':') {
        Some((name, value)) if !name.trim().is_empty() => {
            Ok((name.trim().to_owned(), value.trim().to_owned()))
        }
        _ => Err(format!("expected 'Name: value', got {s:?}")),
    }
}

/// Runs `kvroute explain`.
pub fn run(args: &ExplainArgs, out: &mut impl Write) -> anyhow::Result<()> {
    if let Some(id) = &args.request_id {
        return recorded(args, id, out);
    }
    if let Some(name) = &args.prefix {
        let url = format!("{}/debug/warmup", args.admin.trim_end_matches('/'));
        let render = |v: &Value| render_prefix(v, name);
        return ask(args, &url, None, "warm-up status", &render, out);
    }
    let body = if args.body.as_os_str() == "-" {
        let mut body = String::new();
        std::io::stdin()
            .read_to_string(&mut body)
            .context("reading the request body from standard input")?;
        body
    } else {
        std::fs::read_to_string(&args.body)
            .with_context(|| format!("reading {}", args.body.display()))?
    };
    let headers: serde_json::Map<String, Value> = args
        .headers
        .iter()
        .map(|(n, v)| (n.clone(), Value::String(v.clone())))
        .collect();
    let request = json!({"path": args.path, "headers": headers, "body": body});
    let url = format!("{}/debug/explain", args.admin.trim_end_matches('/'));
    let render = |v: &Explanation| Ok(render(v));
    ask(args, &url, Some(request), "explanation", &render, out)
}

/// Asks the router's admin port at `url` (a POST of `body` when given,
/// else a GET) and prints the answer, a `what`: as the router's JSON with
/// `--json`, else `render`ed.
fn ask<T: serde::de::DeserializeOwned>(
    args: &ExplainArgs,
    url: &str,
    body: Option<Value>,
    what: &str,
    render: &dyn Fn(&T) -> anyhow::Result<String>,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (status, answer) = runtime.block_on(async {
        let client = reqwest::Client::new();
        let mut request = match &body {
            Some(body) => client.post(url).json(body),
            None => client.get(url),
        };
        if let Some(token) = &args.admin_token {
            request = request.bearer_auth(token);
        }
        let response = request
            .send()
            .await
            .with_context(|| format!("asking {url}"))?;
        let status = response.status();
        anyhow::Ok((status, response.text().await?))
    })?;
    let value: Value = serde_json::from_str(&answer)
        .with_context(|| format!("{url} answered {status} with no JSON: {answer}"))?;
    if !status.is_success() {
        let message = value["error"]["message"].as_str().unwrap_or(&answer);
        bail!("the router refused the request ({status}): {message}");
    }
    if args.json {
        writeln!(out, "{}", serde_json::to_string_pretty(&value)?)?;
    } else {
        let answer: T = serde_json::from_value(value)
            .with_context(|| format!("{url} answered with no {what}: {answer}"))?;
        out.write_all(render(&answer)?.as_bytes())?;
    }
    Ok(())
}

/// `kvroute explain --request-id ID`.
fn recorded(args: &ExplainArgs, id: &str, out: &mut impl Write) -> anyhow::Result<()> {
    let mut url = reqwest::Url::parse(args.admin.trim_end_matches('/'))
        .with_context(|| format!("--admin {}", args.admin))?;
    url.path_segments_mut()
        .map_err(|()| anyhow::anyhow!("--admin {} is not an http URL", args.admin))?
        .extend(["debug", "requests", id]);
    let render = |r: &Recorded| Ok(render_recorded(r));
    ask(args, url.as_str(), None, "request record", &render, out)
}

/// The prefix `name` of `/debug/warmup`'s answer `v`, for people.
fn render_prefix(v: &Value, name: &str) -> anyhow::Result<String> {
    let prefixes = v["prefixes"].as_array().cloned().unwrap_or_default();
    let Some(p) = prefixes.iter().find(|p| p["name"] == name) else {
        let names: Vec<&str> = prefixes.iter().filter_map(|p| p["name"].as_str()).collect();
        bail!("the router warms no prefix {name:?}; it warms {names:?}");
    };
    let when = |field: &str| match p[field].as_u64() {
        Some(ms) => {
            let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
            let now = now.map_or(0, |d| d.as_millis() as i128);
            format!("{:+.1} s", (i128::from(ms) - now) as f64 / 1000.0)
        }
        None => "-".into(),
    };
    let mut s = String::new();
    let _ = writeln!(s, "prefix    {name}, {} tokens", p["prompt_tokens"]);
    let _ = writeln!(
        s,
        "due       last {}, next {}",
        when("last_due_unix_ms"),
        when("next_due_unix_ms")
    );
    if let Some(e) = p["error"].as_str() {
        let _ = writeln!(s, "error     {e}");
    }
    for o in p["owners"].as_array().into_iter().flatten() {
        let resident = if o["resident"] == true {
            "resident"
        } else {
            "not resident"
        };
        let _ = write!(
            s,
            "owner     {:<24} {resident:<13} last warm-up: {}",
            o["endpoint"].as_str().unwrap_or("-"),
            o["result"].as_str().unwrap_or("-")
        );
        match o["sender"].as_str() {
            Some(router) => writeln!(s, " (sent by router {router})"),
            None => writeln!(s),
        }
        .ok();
    }
    Ok(s)
}

/// A request's record for people.
fn render_recorded(r: &Recorded) -> String {
    let mut s = String::new();
    let missed = r.prompt_tokens.saturating_sub(r.cached_tokens);
    let _ = writeln!(
        s,
        "request   {} (response {})",
        r.request_id,
        r.response_id.as_deref().unwrap_or("-")
    );
    let _ = writeln!(
        s,
        "served    by {}; model {}, tenant {}; key {}, first block {}",
        r.endpoint,
        r.model,
        r.tenant,
        r.key,
        r.first_block.as_deref().unwrap_or("-")
    );
    let _ = writeln!(
        s,
        "prompt    {} tokens ({} as the router counted, blocks of {})",
        r.prompt_tokens, r.router_prompt_tokens, r.block_size
    );
    let _ = writeln!(
        s,
        "cached    {} tokens (expected {})",
        r.cached_tokens, r.expected_cached_tokens
    );
    if let Some(held) = r.held_seconds {
        let because = r.held_because.as_deref().unwrap_or("-");
        let _ = writeln!(s, "held      {:.3} s at the router ({because})", held);
    }
    let _ = writeln!(s, "missed    {missed} tokens");
    for (cause, tokens) in &r.missed {
        let why = match (cause.as_str(), &r.routed_elsewhere_reason) {
            ("routed_elsewhere", Some(reason)) => format!(" (lost on {reason})"),
            _ => String::new(),
        };
        let _ = writeln!(s, "  {cause:<17} {tokens:>8}{why}");
    }
    s
}

/// The answer for people.
fn render(v: &Explanation) -> String {
    let mut s = String::new();
    let d = &v.decision;
    let chain = &v.chain;
    let _ = writeln!(
        s,
        "request   POST {}  model {}{}",
        v.path,
        v.model.as_deref().unwrap_or("-"),
        v.lora
            .as_ref()
            .map_or(String::new(), |l| format!("  (LoRA adapter {l})"))
    );
    if v.tokenized {
        let _ = writeln!(
            s,
            "prompt    {} tokens, {} full blocks of {} ({}), key {}",
            v.prompt_tokens,
            chain.len(),
            v.block_size,
            v.hash_algo,
            v.key
        );
    } else if v.mode == "approximate" && !chain.is_empty() {
        let _ = writeln!(
            s,
            "prompt    approximate mode: about {} tokens (4 bytes each), {} full blocks of {}, key {}",
            v.prompt_tokens,
            chain.len(),
            v.block_size,
            v.key
        );
    } else {
        let _ = writeln!(
            s,
            "prompt    not tokenized (about {} tokens), key {}",
            v.prompt_tokens, v.key
        );
    }
    let tokens: Vec<String> = v.tokens.iter().map(u32::to_string).collect();
    wrapped(&mut s, "tokens", &tokens);
    wrapped(&mut s, "chain", chain);
    let _ = writeln!(
        s,
        "decision  {} → {} ({}, {} cached blocks); ranked {}",
        d.policy,
        d.ranked.first().map_or("no endpoint", String::as_str),
        d.reason,
        d.cached_blocks,
        d.ranked.join(", ")
    );
    let _ = writeln!(
        s,
        "\n{:<24} {:>8} {:>9} {:>8} {:>9} {:>9} {:>9} {:>11}",
        "endpoint",
        "routable",
        "contract",
        "cached",
        "in flight",
        "queue ms",
        "memory ms",
        "pred. TTFT"
    );
    for e in &d.endpoints {
        let ms = |seconds: f64| format!("{:.1}", seconds * 1e3);
        let routable = match (e.routable, e.full) {
            (true, true) => "full",
            (true, false) => "yes",
            (false, _) => "no",
        };
        let _ = writeln!(
            s,
            "{:<24} {:>8} {:>9} {:>8} {:>9} {:>9} {:>9} {:>8} ms",
            e.name,
            routable,
            e.contract,
            format!("{}/{}", e.cached_blocks, chain.len()),
            e.in_flight,
            ms(e.queue_seconds),
            ms(e.memory_wait_seconds),
            ms(e.predicted_ttft_seconds),
        );
    }
    s
}

/// `label` and `items`, wrapped at about 100 columns under the label.
fn wrapped(s: &mut String, label: &str, items: &[String]) {
    let _ = write!(s, "{label:<9} ({})", items.len());
    let mut column = 100;
    for item in items {
        if column + item.len() > 100 {
            s.push_str("\n          ");
            column = 10;
        }
        s.push(' ');
        s.push_str(item);
        column += item.len() + 1;
    }
    s.push('\n');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_parse_as_curl_writes_them() {
        assert_eq!(
            parse_header("x-tenant: acme").unwrap(),
            ("x-tenant".into(), "acme".into())
        );
        assert_eq!(
            parse_header("Authorization:Bearer k").unwrap(),
            ("Authorization".into(), "Bearer k".into())
        );
        assert!(parse_header("no colon").is_err());
        assert!(parse_header(": v").is_err());
    }

    #[test]
    fn items_wrap_under_their_label() {
        let mut s = String::new();
        let items: Vec<String> = (0..40).map(|i| format!("{i:05}")).collect();
        wrapped(&mut s, "tokens", &items);
        assert!(s.starts_with("tokens    (40)\n           00000 00001"));
        assert!(s.lines().all(|l| l.len() <= 101), "{s}");
        assert_eq!(s.split_whitespace().count(), 42);
    }
}
