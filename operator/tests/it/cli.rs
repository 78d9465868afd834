//! The binary's flags: a mistake fails at start in one line naming the flag
//! (status 2), before the cluster is reached; other failures are one line
//! too (status 1).

use std::process::Command;

fn operator(args: &[&str]) -> (Option<i32>, Vec<String>) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvroute-operator"))
        .args([
            "run",
            "--grpc-listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
        ])
        .args(args)
        // No cluster: a start that got past the flags fails building the
        // Kubernetes client.
        .env("KUBECONFIG", "/nonexistent/kubeconfig")
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .env_remove("RUST_BACKTRACE")
        .output()
        .expect("the operator binary runs");
    let stderr = String::from_utf8_lossy(&out.stderr)
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(str::to_owned)
        .collect();
    (out.status.code(), stderr)
}

#[test]
fn a_url_flag_that_is_not_a_url_fails_at_start_naming_the_flag() {
    for url in ["not a url", "otel:4317", "ftp://otel:4317"] {
        let (status, stderr) = operator(&["--otlp-endpoint", url]);
        assert_eq!(status, Some(2), "{url}: {stderr:?}");
        assert_eq!(stderr.len(), 1, "{url}: one line, got {stderr:?}");
        assert!(
            stderr[0].starts_with(&format!(
                "error: --otlp-endpoint {url:?} is not an http(s) URL"
            )),
            "{stderr:?}"
        );
    }
}

#[test]
fn other_failures_to_start_are_one_line() {
    let (status, stderr) = operator(&["--otlp-endpoint", "http://127.0.0.1:4317"]);
    assert_eq!(status, Some(1), "{stderr:?}");
    let errors: Vec<&String> = stderr.iter().filter(|l| l.starts_with("error: ")).collect();
    assert_eq!(errors.len(), 1, "{stderr:?}");
    assert!(
        errors[0].starts_with("error: build a Kubernetes client"),
        "{stderr:?}"
    );
}
