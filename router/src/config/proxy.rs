//! `proxy`: which paths the API port proxies and which client headers
//! reach the engines.

use serde::{Deserialize, Serialize};

/// What the API port proxies, and which client headers reach the engines.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct Proxy {
    /// `POST` paths proxied to the engines; any other is 404. Default: the
    /// OpenAI inference APIs ([`DEFAULT_ALLOWED_PATHS`]). Engine admin
    /// APIs such as vLLM's `/v1/load_lora_adapter` only when listed.
    pub allowed_paths: Vec<String>,
    /// Forward the client's `Authorization` header (the router's own API
    /// key when `tenancy.apiKeysFile` is set). Default: false.
    pub forward_authorization: bool,
    /// Forward `tenancy.tenantHeader`. Default: false.
    pub forward_tenant_header: bool,
}

/// The paths proxied by default: the OpenAI inference APIs vLLM serves.
pub const DEFAULT_ALLOWED_PATHS: [&str; 8] = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
    "/v1/rerank",
    "/v1/score",
];

impl Default for Proxy {
    fn default() -> Self {
        Proxy {
            allowed_paths: DEFAULT_ALLOWED_PATHS.map(str::to_owned).to_vec(),
            forward_authorization: false,
            forward_tenant_header: false,
        }
    }
}
