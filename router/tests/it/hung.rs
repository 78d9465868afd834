//! Engines that hang while their `/health` answers (#30 item 8), engines
//! that are slow but alive, and the log volume of a failing fleet (#30
//! item 12), against engine sims and raw upstreams on loopback.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::support::*;
use kvroute_core::policy::PolicyConfig;
use kvroute_router::config::HealthCheck;
use serde_json::json;
use tokio::time::Instant;

/// Active checks often enough that a passing `/health` would restore the
/// hung engine many times over, were that allowed.
fn frequent_checks() -> Option<HealthCheck> {
    Some(HealthCheck {
        interval_ms: 100,
        timeout_ms: 1000,
        ..HealthCheck::default()
    })
}

/// Four sims; the first (`sim-0`) accepts requests and never answers them
/// while its `/health` answers 200.
async fn one_of_four_hung(name: &str, router: impl FnOnce(&mut kvroute_router::Config)) -> Stack {
    let k = Cell::new(0);
    Stack::start(
        name,
        4,
        false,
        |c| {
            if k.get() == 0 {
                c.stop_after = Some(0);
            }
            k.set(k.get() + 1);
        },
        router,
    )
    .await
}

fn is_ejected(stack: &Stack, name: &str) -> bool {
    stack
        .router
        .pool
        .status()
        .iter()
        .any(|e| e.name == name && e.ejected)
}

/// One request of steady traffic: when it was sent (since the start),
/// whether it succeeded within the client's timeout.
#[derive(Clone, Copy, Debug)]
struct Sent {
    at: Duration,
    ok: bool,
}

/// Sends a distinct request every `every` until `stop`, each with
/// `client_timeout`; returns them all once answered.
async fn steady(
    stack: &Stack,
    every: Duration,
    client_timeout: Duration,
    start: Instant,
    stop: &AtomicBool,
) -> Vec<Sent> {
    let url = stack.url("/v1/completions");
    let mut pending = Vec::new();
    let mut tick = tokio::time::interval(every);
    let mut i = 0;
    while !stop.load(Ordering::SeqCst) {
        tick.tick().await;
        i += 1;
        let client = stack.client.clone();
        let url = url.clone();
        // Distinct from the first bytes, so that routing keys spread.
        let key = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let body = json!({"prompt": format!("{key:016x} steady traffic"), "max_tokens": 2});
        pending.push(tokio::spawn(async move {
            let at = start.elapsed();
            let send = async {
                let r = client.post(url).json(&body).send().await?;
                let status = r.status();
                r.bytes().await.map(|_| status)
            };
            let ok = matches!(
                tokio::time::timeout(client_timeout, send).await,
                Ok(Ok(s)) if s == 200
            );
            Sent { at, ok }
        }));
    }
    let mut sent = Vec::new();
    for p in pending {
        sent.push(p.await.unwrap());
    }
    sent
}

fn share(sent: &[Sent], from: Duration) -> (usize, usize) {
    let after: Vec<_> = sent.iter().filter(|s| s.at >= from).collect();
    (after.iter().filter(|s| s.ok).count(), after.len())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_engine_is_cut_retried_and_ejected_and_checks_do_not_restore_it() {
    let stack = one_of_four_hung("hung-scaled", |c| {
        c.resilience.hung_after_ms = 500;
        c.resilience.ejection_base_ms = 1000;
        c.resilience.health_check = frequent_checks();
    })
    .await;
    let start = Instant::now();
    let stop = AtomicBool::new(false);
    let traffic = steady(
        &stack,
        Duration::from_millis(50),
        Duration::from_secs(30),
        start,
        &stop,
    );
    let watch = async {
        eventually("the hung engine is ejected", || is_ejected(&stack, "sim-0")).await;
        let detected = start.elapsed();
        // Traffic goes on, with health checks passing, until the ejection
        // ends and the half-open engine's trial request fails.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let m = stack.metrics().await;
            if sum_of(&m, "kvroute_restorations_total{reason=\"half_open\"}") >= 1.0
                && sum_of(&m, "kvroute_ejections_total{reason=\"timeout\"}") >= 2.0
            {
                break;
            }
            assert!(Instant::now() < deadline, "no trial: {m}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        stop.store(true, Ordering::SeqCst);
        detected
    };
    let (sent, detected) = tokio::join!(traffic, watch);
    let (ok, n) = share(&sent, Duration::ZERO);
    let (ok_after, n_after) = share(&sent, detected);
    eprintln!(
        "hung engine (hungAfterMs 500): ejected after {:.2} s; {ok} of {n} requests succeeded, \
         {ok_after} of {n_after} sent after detection",
        detected.as_secs_f64()
    );
    // Requests it held were cut and retried elsewhere: none was lost.
    assert_eq!(ok, n, "every request succeeded");
    assert!(n_after > 0);
    let metrics = stack.metrics().await;
    assert!(
        metrics.contains("kvroute_ejections_total{reason=\"timeout\"}"),
        "{metrics}"
    );
    assert!(
        metrics.contains("endpoint=\"sim-0\",kind=\"timeout\""),
        "{metrics}"
    );
    assert!(
        !metrics.contains("kvroute_restorations_total{reason=\"health_check\"}"),
        "a passing /health restored the hung engine: {metrics}"
    );
    stack.stop().await;
}

/// The scenario with every default (a 10 s hang floor, 5 s health
/// checks): a benchmark that prints the detection time and the success
/// share from 30 s on under an 8 s client timeout. About 70 s:
/// `cargo test -p kvroute-router --test it hung:: -- --ignored --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a benchmark: runs for about 70 s"]
async fn bench_one_of_four_hung_with_defaults() {
    let stack = one_of_four_hung("hung-defaults", |_| {}).await;
    let start = Instant::now();
    let stop = AtomicBool::new(false);
    let traffic = steady(
        &stack,
        Duration::from_millis(100),
        Duration::from_secs(8),
        start,
        &stop,
    );
    let watch = async {
        let mut detected = None;
        while start.elapsed() < Duration::from_secs(60) {
            if detected.is_none() && is_ejected(&stack, "sim-0") {
                detected = Some(start.elapsed());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        stop.store(true, Ordering::SeqCst);
        detected
    };
    let (sent, detected) = tokio::join!(traffic, watch);
    let (ok, n) = share(&sent, Duration::ZERO);
    let (ok30, n30) = share(&sent, Duration::from_secs(30));
    eprintln!(
        "defaults, 1 of 4 engines hung, 10 requests/s for 60 s, 8 s client timeout: \
         ejected after {}; {ok} of {n} succeeded overall; from 30 s on {ok30} of {n30} ({:.1} %)",
        detected.map_or("never".into(), |d| format!("{:.1} s", d.as_secs_f64())),
        100.0 * ok30 as f64 / n30.max(1) as f64,
    );
    eprintln!(
        "{}",
        stack
            .metrics()
            .await
            .lines()
            .filter(|l| l.starts_with("kvroute_ejections_total")
                || l.starts_with("kvroute_restorations_total"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert!(detected.is_some(), "never ejected");
    stack.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_engine_within_its_predicted_ttft_is_not_cut() {
    // Prefill at 1,000 tokens/s: a long prompt takes well over the floor,
    // and the engines report that rate, so the router predicts it.
    let rate = 1000.0;
    let floor_ms = 200;
    let stack = Stack::start(
        "slow-not-hung",
        2,
        true,
        |c| c.prefill_tokens_per_s = rate,
        |c| {
            c.resilience.hung_after_ms = floor_ms;
            c.resilience.health_check = None;
        },
    )
    .await;
    stack.wait_live().await;
    eventually("the engines' load reports arrive", || {
        stack
            .router
            .pool
            .status()
            .iter()
            .all(|e| e.load_report_age_seconds.is_some())
    })
    .await;
    for (i, stream) in [(1, true), (2, false), (3, true), (4, false)] {
        let mut body = chat(&long_text(i), "summarize", 2);
        body["stream"] = json!(stream);
        let sent = Instant::now();
        let r = stack.post("/v1/chat/completions", body).await;
        assert_eq!(r.status(), 200);
        let text = r.text().await.unwrap();
        let took = sent.elapsed();
        // The prompt's prefill alone exceeds the floor.
        let explained: serde_json::Value = stack
            .client
            .post(format!("http://{}/debug/explain", stack.router.admin_addr))
            .json(&chat(&long_text(i), "summarize", 2))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let prompt_tokens = explained["prompt_tokens"].as_u64().unwrap();
        let prefill_ms = prompt_tokens as f64 / rate * 1000.0;
        assert!(
            prefill_ms > 2.0 * floor_ms as f64,
            "the test's prompt is too short to be slow: {prompt_tokens} tokens"
        );
        assert!(!text.contains("upstream_stream_error"), "{text}");
        eprintln!(
            "slow engine: {prompt_tokens} prompt tokens ({prefill_ms:.0} ms of prefill), \
             stream {stream}, answered in {} ms",
            took.as_millis()
        );
    }
    let metrics = stack.metrics().await;
    assert!(!metrics.contains("kind=\"timeout\""), "{metrics}");
    assert!(!metrics.contains("kvroute_ejections_total"), "{metrics}");
    stack.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_engine_is_readmitted_by_one_trial_request_at_a_time() {
    let StuckBesideHealthy {
        hung,
        posts,
        healthy,
        dir,
        mut config,
    } = StuckBesideHealthy::start("hung-trial", |head| head.starts_with(b"POST ")).await;
    config.routing.policy = PolicyConfig::by_name("round-robin").unwrap();
    config.resilience.hung_after_ms = 1000;
    config.resilience.eject_after_failures = 1;
    config.resilience.ejection_base_ms = 1000;
    config.resilience.health_check = frequent_checks();
    let router = kvroute_router::start(config).await.unwrap();
    let client = reqwest::Client::new();
    let url = format!("http://{}/v1/completions", router.addr());
    let metrics_url = format!("http://{}/metrics", router.admin_addr);
    let send = |i: usize| {
        let client = client.clone();
        let url = url.clone();
        async move {
            let r = client
                .post(url)
                .json(&json!({"prompt": format!("trial {i}"), "max_tokens": 1}))
                .send()
                .await
                .unwrap();
            let endpoint = r.headers()["x-kvroute-endpoint"]
                .to_str()
                .unwrap()
                .to_owned();
            (r.status(), endpoint)
        }
    };
    let restorations = |why: &'static str| {
        let url = metrics_url.clone();
        async move {
            let m = get_text(&url).await;
            sum_of(
                &m,
                &format!("kvroute_restorations_total{{reason=\"{why}\"}}"),
            )
        }
    };
    let stuck_ejected = || {
        router
            .pool
            .status()
            .iter()
            .any(|e| e.name == "a-stuck" && e.ejected)
    };
    // Round robin sends one of two requests to the hung engine: cut at
    // the hang deadline, retried on the healthy one, and ejected.
    let first = futures_util::future::join_all((0..2).map(send)).await;
    assert!(first.iter().all(|(s, e)| *s == 200 && e == "b-healthy"));
    assert!(stuck_ejected());
    // Its time passes (the passing checks restore nothing): half-open.
    kvroute_testkit::eventually("half-open", Duration::from_secs(10), || async {
        (restorations("half_open").await >= 1.0).then_some(())
    })
    .await;
    assert_eq!(restorations("health_check").await, 0.0);
    // Half-open and still hung: of a burst, one request is its trial.
    let before = posts.load(Ordering::SeqCst);
    let burst = futures_util::future::join_all((10..30).map(send)).await;
    assert!(burst.iter().all(|(s, e)| *s == 200 && e == "b-healthy"));
    assert_eq!(
        posts.load(Ordering::SeqCst) - before,
        1,
        "one trial at a time"
    );
    assert!(stuck_ejected(), "the failed trial ejects it again");
    // It recovers: the next trial succeeds and it takes traffic again.
    hung.store(false, Ordering::SeqCst);
    let mut numbers = 100..;
    kvroute_testkit::eventually("re-admitted", Duration::from_secs(20), || {
        let i = numbers.next().expect("endless");
        let (send, restorations) = (&send, &restorations);
        async move {
            if restorations("trial").await >= 1.0 {
                return Some(());
            }
            let (status, _) = send(i).await;
            assert_eq!(status, 200);
            None
        }
    })
    .await;
    let after = futures_util::future::join_all((1000..1004).map(send)).await;
    assert!(
        after.iter().any(|(_, e)| e == "a-stuck"),
        "re-admitted: {after:?}"
    );
    assert_eq!(restorations("health_check").await, 0.0);
    router.shutdown().await;
    healthy.shutdown().await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn half_the_requests_failing_write_a_bounded_number_of_log_lines() {
    let (logs, _guard) = Logs::capture();
    let stack = Stack::start(
        "log-volume",
        4,
        false,
        |c| c.fail_rate = 0.5,
        |c| {
            c.routing.policy = PolicyConfig::by_name("round-robin").unwrap();
            c.resilience.health_check = None;
        },
    )
    .await;
    let start = Instant::now();
    let url = stack.url("/v1/completions");
    for round in 0..40 {
        let sends = (0..8).map(|k| {
            let body = json!({"prompt": format!("p{round}-{k}"), "max_tokens": 1});
            let client = stack.client.clone();
            let url = url.clone();
            async move { client.post(url).json(&body).send().await.unwrap().status() }
        });
        futures_util::future::join_all(sends).await;
    }
    let elapsed = start.elapsed();
    let metrics = stack.metrics().await;
    let failures = sum_of(&metrics, "kvroute_upstream_failures_total");
    let lines = |needle| logs.count(needle);
    let repeated = lines("retrying on the next endpoint")
        + lines("attempt failed")
        + lines("endpoint not ejected");
    let all = logs
        .text()
        .lines()
        .filter(|l| l.contains(" INFO ") || l.contains(" WARN "))
        .count();
    // One line per endpoint, message and 10 s interval begun.
    let intervals = 1 + elapsed.as_secs() as usize / 10;
    let bound = 4 * 3 * intervals;
    eprintln!(
        "50 % failure, 320 requests in {:.1} s: {failures} failed attempts, {repeated} repeated \
         warning lines (bound {bound}), {all} info and warn lines in all",
        elapsed.as_secs_f64()
    );
    assert!(failures >= 100.0, "{metrics}");
    assert!(repeated <= bound, "{}", logs.text());
    assert!(
        logs.text().contains("times="),
        "lines carry their count: {}",
        logs.text()
    );
    stack.stop().await;
}
