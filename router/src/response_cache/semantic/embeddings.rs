//! The embeddings client: a question's vector from an OpenAI-compatible
//! `POST {url}/v1/embeddings` (vLLM serves one for embedding models).
//!
//! Bounded and distrustful: one attempt within `timeoutMs`, an answer of
//! at most [`MAX_ANSWER_BYTES`], a vector of 1 to [`MAX_DIM`] finite
//! numbers that is not all zeros, L2-normalized here. Anything else is an
//! [`EmbedError`], which the caller counts and treats as a miss.
//!
//! Not here: what is embedded, and what is done with the vector
//! ([`super`]).

use std::time::Duration;

use axum::http::header::{self, HeaderValue};
use axum::http::{Request, Uri};
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};

use crate::config::{ConfigError, Embeddings, Limits};
use crate::upstream::{Upstream, upstream};

/// The largest answer read, bytes.
pub const MAX_ANSWER_BYTES: usize = 4 << 20;
/// The most dimensions a vector may have.
pub const MAX_DIM: usize = 16_384;

/// Why a question got no vector.
#[derive(Debug, thiserror::Error)]
pub enum EmbedError {
    /// No answer within the timeout.
    #[error("the embeddings server did not answer within {0} ms")]
    Timeout(u64),
    /// It could not be reached, or its answer broke off.
    #[error("the embeddings server could not be reached: {0}")]
    Transport(String),
    /// It answered with an error status.
    #[error("the embeddings server answered {0}")]
    Status(u16),
    /// Its answer is not a usable vector.
    #[error("the embeddings server's answer is unusable: {0}")]
    Garbage(&'static str),
}

impl EmbedError {
    /// The `reason` label.
    pub fn reason(&self) -> &'static str {
        match self {
            EmbedError::Timeout(_) => "timeout",
            EmbedError::Transport(_) => "transport",
            EmbedError::Status(_) => "status",
            EmbedError::Garbage(_) => "garbage",
        }
    }
}

/// A client of one embeddings server.
#[derive(Debug)]
pub struct Embedder {
    client: Upstream,
    uri: Uri,
    model: String,
    authorization: Option<HeaderValue>,
    timeout: Duration,
}

impl Embedder {
    /// A client for `config`, its key read from `apiKeyFile`.
    pub fn new(config: &Embeddings, limits: &Limits) -> Result<Self, ConfigError> {
        let field = "responseCache.semantic.embeddings.url";
        let url = format!("{}/v1/embeddings", config.url.trim_end_matches('/'));
        let uri = url.parse().map_err(|_| ConfigError::Invalid {
            field,
            value: config.url.clone(),
            reason: "is not a URL",
        })?;
        let authorization = match &config.api_key_file {
            None => None,
            Some(path) => {
                let field = "responseCache.semantic.embeddings.apiKeyFile";
                let key =
                    std::fs::read_to_string(path).map_err(|e| ConfigError::file(field, path, e))?;
                let value = HeaderValue::from_str(&format!("Bearer {}", key.trim_end()));
                Some(value.map_err(|_| ConfigError::Invalid {
                    field,
                    value: path.display().to_string(),
                    reason: "the key is not a valid header value",
                })?)
            }
        };
        Ok(Embedder {
            client: upstream(limits),
            uri,
            model: config.model.clone(),
            authorization,
            timeout: Duration::from_millis(config.timeout_ms),
        })
    }

    /// `text`'s vector, normalized.
    pub async fn embed(&self, text: &str) -> Result<Vec<f32>, EmbedError> {
        let ms = self.timeout.as_millis() as u64;
        match tokio::time::timeout(self.timeout, self.ask(text)).await {
            Ok(answer) => answer,
            Err(_) => Err(EmbedError::Timeout(ms)),
        }
    }

    async fn ask(&self, text: &str) -> Result<Vec<f32>, EmbedError> {
        let body = serde_json::json!({"model": self.model, "input": text});
        let mut request = Request::post(self.uri.clone())
            .header(header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body.to_string())))
            .map_err(|e| EmbedError::Transport(e.to_string()))?;
        if let Some(key) = &self.authorization {
            request
                .headers_mut()
                .insert(header::AUTHORIZATION, key.clone());
        }
        let response = (self.client.request(request).await)
            .map_err(|e| EmbedError::Transport(e.to_string()))?;
        if !response.status().is_success() {
            return Err(EmbedError::Status(response.status().as_u16()));
        }
        let bytes = Limited::new(response.into_body(), MAX_ANSWER_BYTES)
            .collect()
            .await
            .map_err(
                |e| match e.downcast_ref::<http_body_util::LengthLimitError>() {
                    Some(_) => EmbedError::Garbage("over 4 MiB"),
                    None => EmbedError::Transport(e.to_string()),
                },
            )?
            .to_bytes();
        vector(&bytes)
    }
}

/// The first vector of an embeddings answer, normalized.
pub fn vector(answer: &[u8]) -> Result<Vec<f32>, EmbedError> {
    #[derive(serde::Deserialize)]
    struct Answer {
        data: Vec<Datum>,
    }
    #[derive(serde::Deserialize)]
    struct Datum {
        embedding: Vec<f64>,
    }
    let answer: Answer = serde_json::from_slice(answer)
        .map_err(|_| EmbedError::Garbage("not an embeddings list"))?;
    let first = answer.data.into_iter().next();
    let values = first.ok_or(EmbedError::Garbage("no vector"))?.embedding;
    if values.is_empty() || values.len() > MAX_DIM {
        return Err(EmbedError::Garbage(
            "a vector of 0 or over 16384 dimensions",
        ));
    }
    let norm = values.iter().map(|v| v * v).sum::<f64>().sqrt();
    if !norm.is_finite() || norm == 0.0 {
        return Err(EmbedError::Garbage("a vector that is zero or not finite"));
    }
    Ok(values.iter().map(|v| (v / norm) as f32).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_vector_is_normalized_and_garbage_refused() {
        let v = vector(br#"{"data":[{"embedding":[3,4]}],"model":"m"}"#).unwrap();
        assert_eq!(v, vec![0.6, 0.8]);
        for bad in [
            &b"not json"[..],
            br#"{"data":[]}"#,
            br#"{"data":[{"embedding":[]}]}"#,
            br#"{"data":[{"embedding":[0,0]}]}"#,
            br#"{"data":[{"embedding":["x"]}]}"#,
            br#"{"data":[{"embedding":[1e308,1e308]}]}"#,
            br#"{"error":{"message":"no"}}"#,
        ] {
            assert!(vector(bad).is_err(), "{}", String::from_utf8_lossy(bad));
        }
        let long = format!(
            r#"{{"data":[{{"embedding":[{}]}}]}}"#,
            vec!["1"; MAX_DIM + 1].join(",")
        );
        assert!(vector(long.as_bytes()).is_err());
    }
}
