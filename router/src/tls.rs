//! TLS for the API listener: a rustls server configuration (ring, TLS 1.2
//! and 1.3, ALPN `h2` and `http/1.1`) from PEM files, optionally requiring
//! client certificates signed by a CA (mTLS). Files are read once at start.

use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};

use crate::config::{ConfigError, Tls};

fn invalid(field: &'static str, path: &Path, reason: impl std::fmt::Display) -> ConfigError {
    ConfigError::Tls {
        field,
        path: path.display().to_string(),
        reason: reason.to_string(),
    }
}

fn certificates(
    field: &'static str,
    path: &Path,
) -> Result<Vec<CertificateDer<'static>>, ConfigError> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| invalid(field, path, e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| invalid(field, path, e))?;
    if certs.is_empty() {
        return Err(invalid(field, path, "no PEM certificate in the file"));
    }
    Ok(certs)
}

/// The server configuration `tls` describes.
pub fn server_config(tls: &Tls) -> Result<Arc<ServerConfig>, ConfigError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let certs = certificates("tls.certFile", &tls.cert_file)?;
    let key = PrivateKeyDer::from_pem_file(&tls.key_file)
        .map_err(|e| invalid("tls.keyFile", &tls.key_file, e))?;
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| invalid("tls", &tls.cert_file, e))?;
    let builder = match &tls.client_ca_file {
        Some(ca) => {
            let mut roots = RootCertStore::empty();
            for cert in certificates("tls.clientCaFile", ca)? {
                roots
                    .add(cert)
                    .map_err(|e| invalid("tls.clientCaFile", ca, e))?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| invalid("tls.clientCaFile", ca, e))?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder
        .with_single_cert(certs, key)
        .map_err(|e| invalid("tls.keyFile", &tls.key_file, e))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}
