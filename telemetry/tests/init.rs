//! `init` against the real process-wide subscriber. One test, in its own
//! binary: the subscriber can be installed once per process.

use kvroute_telemetry::{Error, LogFormat, init};

#[tokio::test]
async fn init_reports_a_bad_endpoint_and_a_second_install_instead_of_panicking() {
    let bad = init("kvroute-test", LogFormat::Text, Some("not a uri"));
    assert!(matches!(bad, Err(Error::Exporter(_))), "{bad:?}");

    // Nothing listens there: spans are dropped, but the exporter is built.
    let guard = init("kvroute-test", LogFormat::Json, Some("http://127.0.0.1:9")).unwrap();

    let again = init("kvroute-test", LogFormat::Text, None);
    assert!(matches!(again, Err(Error::Subscriber(_))), "{again:?}");
    drop(guard);
}
