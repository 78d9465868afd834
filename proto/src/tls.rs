//! TLS from PEM files, one way for every listener and stream of kvroute:
//! mutual TLS for the WatchCache and WatchPool streams (every server —
//! engine-sim, the operator, the agent — and every client — the router),
//! and the rustls configuration of an HTTPS listener (the router's API). Files are read once, at start, and
//! checked there: malformed ones fail the start, naming the file. The
//! servers take their files from one set of flags, [`TlsArgs`].

use std::marker::PhantomData;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity, Server, ServerTlsConfig};

/// A TLS file that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// The file could not be read.
    #[error("reading {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The certificates or key are not valid PEM, or do not fit together.
    #[error("{0}")]
    Invalid(String),
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.to_owned(),
        source,
    })
}

/// A PEM file of one or more certificates. Checked here: tonic accepts a
/// file without any, and every handshake then fails.
fn certificates(path: &Path) -> Result<Vec<u8>, TlsError> {
    let pem = read(path)?;
    let invalid = |why: String| TlsError::Invalid(format!("{}: {why}", path.display()));
    let mut n = 0;
    for cert in CertificateDer::pem_slice_iter(&pem) {
        cert.map_err(|e| invalid(e.to_string()))?;
        n += 1;
    }
    if n == 0 {
        return Err(invalid("no PEM certificate in the file".into()));
    }
    Ok(pem)
}

/// An HTTPS listener's rustls configuration (ring; TLS 1.2 and 1.3; ALPN
/// `h2` and `http/1.1`): its certificate chain and key, and, with
/// `client_ca`, client certificates required and checked against that CA.
pub fn https_server(
    cert: &Path,
    key: &Path,
    client_ca: Option<&Path>,
) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    let invalid = |path: &Path, e: &dyn std::fmt::Display| {
        TlsError::Invalid(format!("{}: {e}", path.display()))
    };
    let parse = |path: &Path| -> Result<Vec<CertificateDer<'static>>, TlsError> {
        CertificateDer::pem_slice_iter(&certificates(path)?)
            .collect::<Result<_, _>>()
            .map_err(|e| invalid(path, &e))
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let key_der = PrivateKeyDer::from_pem_slice(&read(key)?).map_err(|e| invalid(key, &e))?;
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| invalid(cert, &e))?;
    let builder = match client_ca {
        Some(ca) => {
            let mut roots = rustls::RootCertStore::empty();
            for c in parse(ca)? {
                roots.add(c).map_err(|e| invalid(ca, &e))?;
            }
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(roots),
                provider,
            )
            .build()
            .map_err(|e| invalid(ca, &e))?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder
        .with_single_cert(parse(cert)?, key_der)
        .map_err(|e| invalid(key, &e))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// A server's TLS: its certificate chain and key, and, with `client_ca`,
/// client certificates required and checked against that CA (mTLS).
pub fn server(
    cert: &Path,
    key: &Path,
    client_ca: Option<&Path>,
) -> Result<ServerTlsConfig, TlsError> {
    let mut tls =
        ServerTlsConfig::new().identity(Identity::from_pem(certificates(cert)?, read(key)?));
    if let Some(ca) = client_ca {
        tls = tls.client_ca_root(Certificate::from_pem(certificates(ca)?));
    }
    // Applying it once checks the files now rather than at serve time.
    Server::builder()
        .tls_config(tls.clone())
        .map_err(|e| TlsError::Invalid(format!("{}: {e}", cert.display())))?;
    Ok(tls)
}

/// The environment variables a server binary reads its [`TlsArgs`] from:
/// each binary has always had its own (`KVROUTE_TLS_CERT_FILE` for the
/// operator, `SIM_TLS_CERT_FILE` for engine-sim, …), and keeps them.
pub trait TlsEnv {
    /// The variable of `--tls-cert-file`.
    const CERT_FILE: &'static str;
    /// The variable of `--tls-key-file`.
    const KEY_FILE: &'static str;
    /// The variable of `--tls-client-ca-file`.
    const CLIENT_CA_FILE: &'static str;
}

/// A gRPC server's TLS flags, flattened into the flags of every binary
/// that serves WatchCache or WatchPool; `E` names their environment
/// variables.
#[derive(Clone, Debug, clap::Args)]
pub struct TlsArgs<E: TlsEnv> {
    /// PEM certificate chain of the gRPC server (WatchCache or WatchPool);
    /// with `--tls-key-file` it serves TLS. Unset: plaintext.
    #[arg(long, env = E::CERT_FILE, requires = "tls_key_file")]
    pub tls_cert_file: Option<PathBuf>,

    /// PEM private key of `--tls-cert-file`.
    #[arg(long, env = E::KEY_FILE, requires = "tls_cert_file")]
    pub tls_key_file: Option<PathBuf>,

    /// PEM CA: the server's subscribers must present a certificate it
    /// signed (mTLS).
    #[arg(long, env = E::CLIENT_CA_FILE, requires = "tls_cert_file")]
    pub tls_client_ca_file: Option<PathBuf>,

    #[arg(skip)]
    env: PhantomData<E>,
}

impl<E: TlsEnv> Default for TlsArgs<E> {
    /// Plaintext.
    fn default() -> Self {
        TlsArgs {
            tls_cert_file: None,
            tls_key_file: None,
            tls_client_ca_file: None,
            env: PhantomData,
        }
    }
}

impl<E: TlsEnv> TlsArgs<E> {
    /// The server's TLS ([`server`]) when both the certificate and the key
    /// are set; `None` (plaintext) otherwise.
    pub fn server(&self) -> Result<Option<ServerTlsConfig>, TlsError> {
        match (&self.tls_cert_file, &self.tls_key_file) {
            (Some(cert), Some(key)) => {
                server(cert, key, self.tls_client_ca_file.as_deref()).map(Some)
            }
            _ => Ok(None),
        }
    }
}

/// A client's TLS: servers verified against `ca`, under `server_name` when
/// given (else the host of the URL dialled), presenting `identity` (a
/// certificate chain and key) when the servers require one.
pub fn client(
    ca: &Path,
    identity: Option<(&Path, &Path)>,
    server_name: Option<&str>,
) -> Result<ClientTlsConfig, TlsError> {
    let mut tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(certificates(ca)?));
    if let Some((cert, key)) = identity {
        tls = tls.identity(Identity::from_pem(certificates(cert)?, read(key)?));
    }
    if let Some(name) = server_name {
        tls = tls.domain_name(name);
    }
    // Applying it once checks the files now rather than at the first
    // connection.
    Endpoint::from_static("https://localhost")
        .tls_config(tls.clone())
        .map_err(|e| TlsError::Invalid(format!("{}: {e}", ca.display())))?;
    Ok(tls)
}
