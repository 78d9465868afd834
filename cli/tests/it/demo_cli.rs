//! `kvroute demo` end to end: the comparison runs, prints both policies'
//! figures, and kvroute caches more of the prompts than round robin; a
//! taken port and a bad flag fail with one line.

use std::process::Command;
use std::time::Instant;

fn kvroute(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(args)
        .output()
        .unwrap()
}

/// The table row of `policy`: its whitespace-separated fields.
fn row<'a>(stdout: &'a str, policy: &str) -> Vec<&'a str> {
    stdout
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|fields| fields.first() == Some(&policy) && fields.len() > 2)
        .unwrap_or_else(|| panic!("no {policy} row in:\n{stdout}"))
}

/// The `column` field of `policy`'s row, by the table's header.
fn figure(stdout: &str, policy: &str, column: &str) -> f64 {
    let header = row(stdout, "policy");
    let i = header
        .iter()
        .position(|h| *h == column)
        .unwrap_or_else(|| panic!("no {column} column in:\n{stdout}"));
    row(stdout, policy)[i]
        .parse()
        .unwrap_or_else(|e| panic!("{policy} {column}: {e}\n{stdout}"))
}

#[test]
fn once_compares_round_robin_with_kvroute() {
    let started = Instant::now();
    let out = kvroute(&["demo", "--once"]);
    let stdout = String::from_utf8(out.stdout).unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    // Reported, never asserted: the demo should take well under a minute.
    println!(
        "kvroute demo --once took {:.1} s",
        started.elapsed().as_secs_f64()
    );
    println!("{stdout}");
    assert!(out.status.success(), "{stdout}\n{stderr}");

    for policy in ["round-robin", "kvroute"] {
        assert_eq!(figure(&stdout, policy, "requests"), 108.0, "{stdout}");
    }
    let rr = figure(&stdout, "round-robin", "cached_ratio");
    let kv = figure(&stdout, "kvroute", "cached_ratio");
    assert!(
        (0.0..=1.0).contains(&rr) && (0.0..=1.0).contains(&kv),
        "{stdout}"
    );
    assert!(
        kv > rr,
        "kvroute's cached ratio {kv} is not above round robin's {rr}:\n{stdout}"
    );
    assert!(stdout.contains("kvroute vs round-robin: "), "{stdout}");
}

#[test]
fn a_taken_port_is_one_line_and_exit_1() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let out = kvroute(&["demo", "--listen", &addr]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.starts_with(&format!("error: --listen {addr} cannot be bound")),
        "{stderr}"
    );
    // It fails before running the comparison.
    assert!(
        out.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

#[test]
fn a_bad_listen_address_is_a_usage_error() {
    let out = kvroute(&["demo", "--listen", "nowhere"]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(
        stderr.starts_with("error: invalid value 'nowhere' for --listen"),
        "{stderr}"
    );
}
