//! TLS and mTLS on the API listener, and the admin port's `/debug/*` token,
//! with the test certificates in `tests/fixtures/tls`.

use std::path::PathBuf;
use std::sync::Arc;

use crate::support::*;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use kvroute_router::config::Tls;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tls")
        .join(name)
}

/// A TLS client trusting the test CA, presenting the client certificate
/// when `with_cert`.
fn connector(with_cert: bool) -> TlsConnector {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(fixture("ca.crt")).unwrap() {
        roots.add(cert.unwrap()).unwrap();
    }
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots);
    let config = if with_cert {
        let certs = CertificateDer::pem_file_iter(fixture("client.crt"))
            .unwrap()
            .collect::<Result<Vec<_>, _>>()
            .unwrap();
        let key = PrivateKeyDer::from_pem_file(fixture("client.key")).unwrap();
        builder.with_client_auth_cert(certs, key).unwrap()
    } else {
        builder.with_no_client_auth()
    };
    TlsConnector::from(Arc::new(config))
}

/// `GET path` over TLS with HTTP/1.1; the status, or the error's text.
async fn get(addr: std::net::SocketAddr, path: &str, with_cert: bool) -> Result<u16, String> {
    let tcp = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    let server = ServerName::try_from("localhost").unwrap();
    let tls = connector(with_cert)
        .connect(server, tcp)
        .await
        .map_err(|e| e.to_string())?;
    let (mut send, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let request = hyper::Request::get(path)
        .header("host", "localhost")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let response = send
        .send_request(request)
        .await
        .map_err(|e| e.to_string())?;
    let status = response.status().as_u16();
    let _ = response.into_body().collect().await;
    Ok(status)
}

#[tokio::test]
async fn the_api_speaks_tls_and_requires_client_certificates_with_a_client_ca() {
    for mtls in [false, true] {
        let stack = Stack::start(
            "tls",
            1,
            false,
            |_| {},
            |c| {
                c.resilience.health_check = None;
                c.tls = Some(Tls {
                    cert_file: fixture("server.crt"),
                    key_file: fixture("server.key"),
                    client_ca_file: mtls.then(|| fixture("ca.crt")),
                });
            },
        )
        .await;
        let addr = stack.router.addr();
        assert_eq!(get(addr, "/healthz", true).await, Ok(200));
        let without_cert = get(addr, "/healthz", false).await;
        if mtls {
            assert!(without_cert.is_err(), "no client certificate: refused");
        } else {
            assert_eq!(without_cert, Ok(200));
        }
        // Plaintext is not served on a TLS listener.
        let plain = reqwest::get(stack.url("/healthz")).await;
        assert!(plain.is_err(), "{plain:?}");
        stack.stop().await;
    }
}

#[tokio::test]
async fn a_bad_key_file_fails_the_start_naming_the_field() {
    let dir = temp_dir("tls-bad");
    std::fs::write(dir.join("endpoints.yaml"), "endpoints: []\n").unwrap();
    let mut config = router_config(&dir);
    config.tls = Some(Tls {
        cert_file: fixture("server.crt"),
        key_file: fixture("README.md"),
        client_ca_file: None,
    });
    let err = kvroute_router::start(config).await.unwrap_err().to_string();
    assert!(
        err.starts_with("tls: ") && err.contains("README.md"),
        "{err}"
    );
}

#[tokio::test]
async fn debug_endpoints_need_the_admin_token() {
    let dir = temp_dir("admin-token");
    std::fs::write(dir.join("token"), "t0ken\n").unwrap();
    let token = dir.join("token");
    let stack = Stack::start(
        "admin-token",
        1,
        false,
        |_| {},
        |c| {
            c.resilience.health_check = None;
            c.admin_token_file = Some(token.clone());
        },
    )
    .await;
    let admin = format!("http://{}", stack.router.admin_addr);
    let get = |path: &str, token: Option<&str>| {
        let mut r = stack.client.get(format!("{admin}{path}"));
        if let Some(t) = token {
            r = r.bearer_auth(t);
        }
        r.send()
    };
    assert_eq!(get("/debug/pool", None).await.unwrap().status(), 401);
    assert_eq!(
        get("/debug/pool", Some("wrong")).await.unwrap().status(),
        401
    );
    assert_eq!(
        get("/debug/pool", Some("t0ken")).await.unwrap().status(),
        200
    );
    assert_eq!(get("/metrics", None).await.unwrap().status(), 200);
    assert_eq!(get("/healthz", None).await.unwrap().status(), 200);
    stack.stop().await;
    let _ = std::fs::remove_dir_all(dir);
}

/// Without a token, `/debug/*` answers only on a loopback admin address
/// or when `debug.open` says so: it is an oracle of which prompts are
/// cached.
#[tokio::test]
async fn debug_endpoints_without_a_token_answer_only_on_loopback_or_when_open() {
    for (open, expected) in [(false, 401), (true, 200)] {
        let stack = Stack::start(
            "admin-wildcard",
            1,
            false,
            |_| {},
            |c| {
                c.resilience.health_check = None;
                c.admin_listen = "0.0.0.0:0".parse().unwrap();
                c.debug.open = open;
            },
        )
        .await;
        let port = stack.router.admin_addr.port();
        for path in ["/debug/pool", "/debug/prefixes"] {
            let r = stack
                .client
                .get(format!("http://127.0.0.1:{port}{path}"))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), expected, "{path} with debug.open {open}");
        }
        let explain = stack
            .client
            .post(format!("http://127.0.0.1:{port}/debug/explain"))
            .json(&chat("guess", "a prompt", 1))
            .send()
            .await
            .unwrap();
        assert_eq!(explain.status(), expected);
        let probe = format!("http://127.0.0.1:{port}/healthz");
        assert_eq!(stack.client.get(probe).send().await.unwrap().status(), 200);
        stack.stop().await;
    }
}

#[tokio::test]
async fn watch_cache_streams_run_over_mutual_tls() {
    let stack = Stack::start(
        "grpc-tls",
        2,
        true,
        |c| {
            c.tls.tls_cert_file = Some(fixture("server.crt"));
            c.tls.tls_key_file = Some(fixture("server.key"));
            c.tls.tls_client_ca_file = Some(fixture("ca.crt"));
        },
        |c| {
            c.resilience.health_check = None;
            c.grpc_tls = Some(kvroute_router::config::GrpcTls {
                ca_file: fixture("ca.crt"),
                cert_file: Some(fixture("client.crt")),
                key_file: Some(fixture("client.key")),
                server_name: Some("localhost".into()),
            });
        },
    )
    .await;
    stack.wait_live().await;
    let holder = stack.warm(&long_text(3)).await;
    assert!(holder.starts_with("sim-"));
    stack.stop().await;
}

#[tokio::test]
async fn grpc_tls_settings_are_checked_at_start() {
    let dir = temp_dir("grpc-tls-bad");
    std::fs::write(dir.join("endpoints.yaml"), "endpoints: []\n").unwrap();
    let mut config = router_config(&dir);
    config.grpc_tls = Some(kvroute_router::config::GrpcTls {
        ca_file: fixture("README.md"),
        cert_file: None,
        key_file: None,
        server_name: None,
    });
    let err = kvroute_router::start(config).await.unwrap_err().to_string();
    assert!(err.starts_with("grpcTls: "), "{err}");
}
