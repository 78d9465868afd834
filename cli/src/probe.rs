//! `kvroute probe`: checks a running router end to end, for `helm test` and
//! smoke tests where the image has no shell or curl. Waits for the
//! router's `/readyz`, then sends one completion through it and checks the
//! answer. Exit 0 when both pass; the error names the step that
//! failed.

use std::io::Write;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::{Value, json};

/// Flags of `kvroute probe`.
#[derive(Debug, clap::Args)]
pub struct ProbeArgs {
    /// The router's API base URL, e.g. http://kvroute-llama:8080.
    #[arg(long, env = "KVROUTE_URL")]
    url: String,
    /// The model to ask for.
    #[arg(long, env = "KVROUTE_PROBE_MODEL")]
    model: String,
    /// An API key, sent as `Authorization: Bearer`.
    #[arg(long, env = "KVROUTE_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// How long to wait for readiness, seconds.
    #[arg(long, default_value_t = 60)]
    wait_s: u64,
}

/// Runs `kvroute probe`.
pub fn run(args: &ProbeArgs, out: &mut impl Write) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(probe(args, out))
}

async fn probe(args: &ProbeArgs, out: &mut impl Write) -> anyhow::Result<()> {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()?;
    let readyz = format!("{}/readyz", args.url.trim_end_matches('/'));
    let deadline = Instant::now() + Duration::from_secs(args.wait_s);
    loop {
        let last = match client.get(&readyz).send().await {
            Ok(r) if r.status().is_success() => break,
            Ok(r) => format!(
                "{}: {}",
                r.status(),
                r.text().await.unwrap_or_default().trim()
            ),
            Err(e) => e.to_string(),
        };
        if Instant::now() >= deadline {
            bail!("{readyz} not ready after {} s: {last}", args.wait_s);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    writeln!(out, "ok   {readyz}")?;
    let url = format!("{}/v1/completions", args.url.trim_end_matches('/'));
    let mut post = client.post(&url).json(&json!({
        "model": args.model,
        "prompt": "kvroute probe: say something.",
        "max_tokens": 4,
    }));
    if let Some(key) = &args.api_key {
        post = post.bearer_auth(key);
    }
    let response = post.send().await.with_context(|| format!("POST {url}"))?;
    let status = response.status();
    let endpoint = response
        .headers()
        .get("x-kvroute-endpoint")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("?")
        .to_owned();
    let body: Value = response
        .json()
        .await
        .with_context(|| format!("POST {url}: the answer is not JSON"))?;
    if !status.is_success() {
        bail!("POST {url}: {status}: {body}");
    }
    if body["choices"][0]["text"].as_str().is_none() {
        bail!("POST {url}: no choices[0].text in {body}");
    }
    writeln!(out, "ok   POST {url} (served by {endpoint})")?;
    Ok(())
}
