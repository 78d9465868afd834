//! The router's listeners other than the API port's address: TLS of the API
//! listener, the endpoint picker (`extProc`), the admin port's `/debug`
//! endpoints, and TLS of the router's own gRPC clients.
//!
//! Not here: binding the listeners ([`crate::server`]).

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// TLS of the router's gRPC clients, from PEM files.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GrpcTls {
    /// The CA that signed the engines' and the operator's certificates.
    pub ca_file: PathBuf,
    /// The router's certificate chain, for servers that require one (mTLS);
    /// with `keyFile`.
    #[serde(default)]
    pub cert_file: Option<PathBuf>,
    /// Its private key.
    #[serde(default)]
    pub key_file: Option<PathBuf>,
    /// The name the servers' certificates are checked against, when not
    /// the address dialled (engines are dialled by pod IP: give the name
    /// their certificates carry).
    #[serde(default)]
    pub server_name: Option<String>,
}

/// TLS for the API listener, from PEM files (a mounted `kubernetes.io/tls`
/// Secret has them as `tls.crt` and `tls.key`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Tls {
    /// The certificate chain, leaf first.
    pub cert_file: PathBuf,
    /// Its private key (PKCS#8, PKCS#1 or SEC1).
    pub key_file: PathBuf,
    /// With it, clients must present a certificate this CA signed (mTLS).
    #[serde(default)]
    pub client_ca_file: Option<PathBuf>,
}

/// The endpoint picker's listener (Envoy `ext_proc` over gRPC).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct ExtProc {
    /// Its address. Default: `0.0.0.0:9002` (the Gateway API Inference
    /// Extension's conventional picker port).
    pub listen: SocketAddr,
    /// TLS (gRPC over HTTP/2 with TLS), with client certificates required
    /// when `clientCaFile` is set; unset: plaintext (h2c).
    pub tls: Option<Tls>,
    /// Gateway connections at most; at the cap a new one closes the oldest
    /// with no stream open, or is closed itself. Lowered at start, with
    /// `limits.maxConnections`, to fit the open-file limit. Default: 1024.
    pub max_connections: usize,
    /// Time from a stream's start to its first message (the request
    /// headers), milliseconds; a stream that sends none is ended. Default:
    /// 10000.
    pub first_message_timeout_ms: u64,
    /// A connection with no stream open is closed after this long,
    /// milliseconds. Default: 60000.
    pub idle_timeout_ms: u64,
    /// Whether only the gateways can reach the picker's port (a
    /// NetworkPolicy, the chart's `router.picker.allowedFrom`). Only a
    /// trusted picker, or one whose gateways present a certificate
    /// (`tls.clientCaFile`), has the statuses it reports feed ejection
    /// and may serve salted tenancy with the tenant from
    /// `tenancy.tenantHeader`. Default: false.
    pub trusted_network: bool,
}

impl ExtProc {
    /// Whether what the gateways say can be trusted: their network is
    /// declared trusted, or they are authenticated by certificate.
    pub fn trusted(&self) -> bool {
        self.trusted_network
            || self
                .tls
                .as_ref()
                .is_some_and(|t| t.client_ca_file.is_some())
    }
}

/// The admin port's `/debug` endpoints.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct DebugEndpoints {
    /// Serve them without `adminTokenFile`'s token on a non-loopback admin
    /// address (they show which prompts' blocks are cached). Without a
    /// token they are served only when `adminListen` is a loopback
    /// address, or with this. Default: false.
    pub open: bool,
}

impl Default for ExtProc {
    fn default() -> Self {
        ExtProc {
            listen: "0.0.0.0:9002".parse().expect("a valid address"),
            tls: None,
            max_connections: 1024,
            first_message_timeout_ms: 10_000,
            idle_timeout_ms: 60_000,
            trusted_network: false,
        }
    }
}
