//! The binary's flags: a mistake fails at start, in one line that names the
//! flag and the bad value.

use std::process::Command;

fn agent(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvroute-agent"))
        .args([
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--log-format",
            "text",
        ])
        .args(args)
        .env_remove("PYTHONHASHSEED")
        .output()
        .expect("the agent binary runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn a_url_flag_that_is_not_a_url_fails_at_start_naming_the_flag() {
    let cases = [
        (["--engine-url", "not a url"], "--engine-url \"not a url\""),
        (["--engine-url", "ftp://127.0.0.1:8000"], "--engine-url"),
        (["--engine-url", "http://"], "--engine-url"),
        (
            ["--kv-events-endpoint", "not a url"],
            "--kv-events-endpoint \"not a url\"",
        ),
        (
            ["--kv-events-endpoint", "tcp://*:5557"],
            "--kv-events-endpoint \"tcp://*:5557\"",
        ),
        (
            ["--kv-events-replay-endpoint", "not a url"],
            "--kv-events-replay-endpoint \"not a url\"",
        ),
    ];
    for (args, names) in cases {
        let (ok, stderr) = agent(&args);
        assert!(!ok, "{args:?} started");
        let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(lines.len(), 1, "{args:?}: one line, got {stderr:?}");
        assert!(lines[0].contains(names), "{args:?}: {stderr:?}");
    }
}
