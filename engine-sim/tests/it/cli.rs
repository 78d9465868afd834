//! The `kvroute-engine-sim` binary: its help and its start-up line.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

const BIN: &str = env!("CARGO_BIN_EXE_kvroute-engine-sim");

#[test]
fn help_explains_every_flag_with_its_default() {
    let out = Command::new(BIN).arg("--help").output().unwrap();
    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).unwrap();
    for flag in [
        "--listen",
        "--cache-listen",
        "--model",
        "--block-size",
        "--hash-algo",
        "--hash-seed",
        "--num-gpu-blocks",
        "--max-model-len",
        "--prefill-tokens-per-s",
        "--prefill-overhead-ms",
        "--itl-ms",
        "--max-num-seqs",
        "--default-max-tokens",
        "--time-scale",
        "--load-interval-ms",
        "--subscriber-buffer",
        "--tokenizer",
        "--tokenizer-config",
        "--fail-rate",
        "--stop-after",
        "--extra-latency-ms",
        "--kv-role",
        "--kv-transfer-listen",
        "--kv-transfer-host",
        "--kv-transfer-ms-per-block",
        "--kv-transfer-timeout-s",
    ] {
        assert!(help.contains(flag), "{flag} missing from --help:\n{help}");
    }
    assert!(help.contains("[default: 127.0.0.1:8000]"));
    assert!(help.contains("[env: SIM_MODEL="));
}

/// The sim on free ports, and the first line it prints.
fn spawn() -> (std::process::Child, String) {
    let mut child = Command::new(BIN)
        .args(["--listen", "127.0.0.1:0", "--cache-listen", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    (child, line)
}

#[test]
fn starts_on_free_ports_and_reports_them() {
    let (mut child, line) = spawn();
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(
        line.starts_with("kvroute-engine-sim: HTTP on http://127.0.0.1:"),
        "{line}"
    );
    assert!(!line.contains(":0,"), "a real port is reported: {line}");
}

#[cfg(unix)]
#[test]
fn sigterm_stops_it_cleanly() {
    let (mut child, line) = spawn();
    assert!(line.starts_with("kvroute-engine-sim:"), "{line}");
    // As Kubernetes stops a pod.
    let sent = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
    let started = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(
            started.elapsed() < std::time::Duration::from_secs(10),
            "still running 10 s after SIGTERM"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    assert!(status.success(), "a clean exit on SIGTERM, got {status}");
}

#[test]
fn bad_flags_are_refused_by_name() {
    let out = Command::new(BIN)
        .args(["--fail-rate", "2"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(stderr.contains("--fail-rate"), "{stderr}");
}
