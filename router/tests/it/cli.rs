//! The binary as an operator of it sees it: a configuration mistake fails
//! at start, in one line naming the field, with status 2; a background task
//! that dies ends the process with status 1 and one log line naming it.

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::support::temp_dir;

/// Runs the router on `config` (written to `dir`) until it exits, with
/// `env` set; kills it after 20 s.
fn router(dir: &Path, config: &str, env: &[(&str, &str)]) -> Output {
    let path = dir.join("router.yaml");
    std::fs::write(&path, config).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute-router"))
        .arg("--config")
        .arg(&path)
        .args(["--log-format", "json"])
        .env_remove("RUST_BACKTRACE")
        .env_remove("RUST_LOG")
        .env_remove("KVROUTE_TEST_KILL_TASK")
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the router binary runs");
    let deadline = Instant::now() + Duration::from_secs(20);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            child.kill().unwrap();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

/// A valid configuration on free ports over an empty endpoints file in
/// `dir`, followed by `extra` (top-level YAML).
fn config(dir: &Path, extra: &str) -> String {
    std::fs::write(dir.join("endpoints.yaml"), "endpoints: []\n").unwrap();
    format!(
        "listen: 127.0.0.1:0\nadminListen: 127.0.0.1:0\n{extra}\n",
        extra = extra.replace(
            "ENDPOINTS",
            &dir.join("endpoints.yaml").display().to_string()
        )
    )
}

fn lines(text: &[u8]) -> Vec<String> {
    String::from_utf8_lossy(text)
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(str::to_owned)
        .collect()
}

#[test]
fn each_configuration_mistake_fails_at_start_in_one_line_naming_the_field() {
    let dir = temp_dir("cli-mistakes");
    let static_file = "discovery: {static: {file: ENDPOINTS, reloadMs: 0}}";
    let cases = [
        (
            static_file.to_owned(),
            "discovery.static.reloadMs: must be 1 to 86400000 (one day) (got 0)",
        ),
        (
            "routing: {policy: {name: round-robin, slack: 2}}".to_owned(),
            "routing.policy: unknown field `slack`",
        ),
        (
            "discovery: {static: {file: ENDPOINTS}}\nadminTokenFile: /nonexistent/kvroute-token"
                .to_owned(),
            "adminTokenFile: cannot read /nonexistent/kvroute-token",
        ),
        (
            "discovery: {operator: {url: not a url, namespace: ml, pool: p}}".to_owned(),
            "discovery.operator.url: is not an http(s) URL with a host (got \"not a url\")",
        ),
        (
            "telemetry: {otlpEndpoint: not a url}".to_owned(),
            "telemetry.otlpEndpoint: is not an http(s) URL with a host",
        ),
        (
            "routing: {blockSize: 4294967295}".to_owned(),
            "routing.blockSize: must be 1 to 4096",
        ),
        (
            "routing: {loraAdapters: {a: 5}}".to_owned(),
            "routing.loraAdapters.a: invalid type: integer `5`",
        ),
        (
            "discovery: {static: {file: ENDPOINTS}}\ntenancy: {apiKeysFile: /nonexistent/keys}"
                .to_owned(),
            "tenancy.apiKeysFile: cannot read /nonexistent/keys",
        ),
        (
            "discovery: {static: {file: /nonexistent/endpoints.yaml}}".to_owned(),
            "discovery.static.file: reading /nonexistent/endpoints.yaml",
        ),
    ];
    for (extra, names) in cases {
        let out = router(&dir, &config(&dir, &extra), &[]);
        let stderr = lines(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{extra}: {stderr:?}");
        assert_eq!(stderr.len(), 1, "{extra}: one line, got {stderr:?}");
        assert!(stderr[0].starts_with("error: "), "{extra}: {stderr:?}");
        assert!(stderr[0].contains(names), "{extra}: {stderr:?}");
        assert!(lines(&out.stdout).is_empty(), "{extra}: nothing started");
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// The task is killed through a hook of debug builds (a task dies only by
/// a bug, which a test cannot cause otherwise).
#[cfg(debug_assertions)]
#[test]
fn a_dead_background_task_ends_the_process_naming_it() {
    let dir = temp_dir("cli-task-death");
    let config = config(&dir, "discovery: {static: {file: ENDPOINTS}}");
    for task in ["discovery", "health-checks", "admin", "api"] {
        let out = router(&dir, &config, &[("KVROUTE_TEST_KILL_TASK", task)]);
        let stderr = lines(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{task}: {stderr:?}");
        let errors: Vec<serde_json::Value> = stderr
            .iter()
            .map(|l| serde_json::from_str(l).expect("a JSON log line"))
            .filter(|l: &serde_json::Value| l["level"] == "ERROR")
            .collect();
        assert_eq!(errors.len(), 1, "{task}: one error line, got {stderr:?}");
        let fields = &errors[0]["fields"];
        assert_eq!(fields["task"], task, "{task}: {fields}");
        assert_eq!(fields["why"], "was cancelled", "{task}: {fields}");
        let message = fields["message"].as_str().unwrap();
        assert!(message.contains("a background task died"), "{message}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn an_embedding_program_learns_which_task_died() {
    let dir = temp_dir("embedded-task-death");
    std::fs::write(dir.join("endpoints.yaml"), "endpoints: []\n").unwrap();
    let mut running = kvroute_router::start(crate::support::router_config(&dir))
        .await
        .unwrap();
    let alive = tokio::time::timeout(Duration::from_millis(300), running.died()).await;
    assert!(alive.is_err(), "nothing died: {alive:?}");
    assert!(!running.kill_task_for_tests("nope"));
    assert!(running.kill_task_for_tests("discovery"));
    let died = tokio::time::timeout(Duration::from_secs(5), running.died())
        .await
        .expect("the death is reported");
    assert_eq!(died.to_string(), "the discovery task was cancelled");
    running.shutdown().await;
    let _ = std::fs::remove_dir_all(dir);
}
