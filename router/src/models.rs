//! The models the endpoints serve, read from their `/v1/models`: the union
//! of the ids (for `GET /v1/models`, the model check and the `model`
//! metric label) and the LoRA adapters among them. vLLM lists an adapter
//! with its path as `root` and its base model as `parent`; a request naming
//! an adapter is hashed with it, as vLLM hashes its blocks.
//!
//! Cached: the first call fetches the list; later calls answer from the
//! cache at once and, once it is older than [`TTL`], refresh it in the
//! background, so no request waits on the endpoints.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use kvroute_core::hash::Lora;
use tokio::time::Instant;

/// How long the list is served before a refresh.
pub const TTL: Duration = Duration::from_secs(10);
/// How long one endpoint may take to answer.
const FETCH_TIMEOUT: Duration = Duration::from_secs(2);

/// What the endpoints serve.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ModelList {
    /// Every served model id, adapters included.
    pub ids: BTreeSet<String>,
    /// The LoRA adapters, by served name, with their base model.
    pub adapters: BTreeMap<String, Adapter>,
    /// Each model's `root` (vLLM: the path or repository it was loaded
    /// from), as the endpoints list it; part of a response cache key.
    pub roots: BTreeMap<String, BTreeSet<String>>,
}

/// A LoRA adapter an endpoint serves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Adapter {
    /// Its name and path, as its blocks are hashed.
    pub lora: Lora,
    /// The base model it adapts.
    pub parent: String,
}

impl ModelList {
    /// Adds the model cards of one `/v1/models` answer (OpenAI's list
    /// form; vLLM's `root` and `parent` mark adapters). Cards without an id
    /// are skipped.
    pub fn add_cards(&mut self, list: &serde_json::Value) {
        let Some(cards) = list["data"].as_array() else {
            return;
        };
        for card in cards {
            let Some(id) = card["id"].as_str() else {
                continue;
            };
            self.ids.insert(id.to_owned());
            if let Some(root) = card["root"].as_str() {
                let roots = self.roots.entry(id.to_owned()).or_default();
                roots.insert(root.to_owned());
            }
            if let (Some(root), Some(parent)) = (card["root"].as_str(), card["parent"].as_str()) {
                self.adapters.insert(
                    id.to_owned(),
                    Adapter {
                        lora: Lora::new(id, root),
                        parent: parent.to_owned(),
                    },
                );
            }
        }
    }
}

/// The cached list. See the module docs.
#[derive(Debug)]
pub struct Models {
    client: Client<HttpConnector, Full<Bytes>>,
    cached: Mutex<Option<(Instant, Arc<ModelList>)>>,
    refreshing: AtomicBool,
}

impl Models {
    /// A list fetched with an upstream client configured by `limits`.
    pub fn new(limits: &crate::config::Limits) -> Self {
        Models {
            client: crate::upstream::upstream(limits),
            cached: Mutex::default(),
            refreshing: AtomicBool::default(),
        }
    }

    /// The union of what `addresses` serve; empty when none answered.
    pub async fn get<F>(self: &Arc<Self>, addresses: F) -> Arc<ModelList>
    where
        F: FnOnce() -> Vec<SocketAddr>,
    {
        let client = &self.client;
        let cached = self
            .cached
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        match cached {
            Some((at, list)) => {
                if at.elapsed() >= TTL && !self.refreshing.swap(true, Ordering::SeqCst) {
                    let (this, client, addresses) = (self.clone(), client.clone(), addresses());
                    tokio::spawn(async move {
                        this.fetch(&client, addresses).await;
                        this.refreshing.store(false, Ordering::SeqCst);
                    });
                }
                list
            }
            None => self.fetch(client, addresses()).await,
        }
    }

    async fn fetch(
        &self,
        client: &Client<HttpConnector, Full<Bytes>>,
        addresses: Vec<SocketAddr>,
    ) -> Arc<ModelList> {
        let fetches = addresses.into_iter().map(|addr| async move {
            let request = Request::get(format!("http://{addr}/v1/models"))
                .body(Full::new(Bytes::new()))
                .ok()?;
            let response = tokio::time::timeout(FETCH_TIMEOUT, client.request(request))
                .await
                .ok()?
                .ok()?;
            let body = response.into_body().collect().await.ok()?.to_bytes();
            serde_json::from_slice::<serde_json::Value>(&body).ok()
        });
        let mut list = ModelList::default();
        for answer in futures_util::future::join_all(fetches)
            .await
            .into_iter()
            .flatten()
        {
            list.add_cards(&answer);
        }
        let list = Arc::new(list);
        *self.cached.lock().unwrap_or_else(|e| e.into_inner()) =
            Some((Instant::now(), list.clone()));
        list
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn adapters_are_the_cards_with_a_root_and_a_parent() {
        let mut list = ModelList::default();
        // vLLM's cards: the base model's parent is null.
        list.add_cards(&json!({"object": "list", "data": [
            {"id": "llama", "root": "/models/llama", "parent": null},
            {"id": "sql-lora", "root": "/adapters/sql", "parent": "llama"},
            {"object": "model"},
        ]}));
        list.add_cards(&json!({"data": [{"id": "llama"}, {"id": "other"}]}));
        list.add_cards(&json!({"error": "not a list"}));
        assert_eq!(
            list.ids.iter().map(String::as_str).collect::<Vec<_>>(),
            ["llama", "other", "sql-lora"]
        );
        assert_eq!(list.adapters.len(), 1);
        let a = &list.adapters["sql-lora"];
        assert_eq!(a.lora, Lora::new("sql-lora", "/adapters/sql"));
        assert_eq!(a.parent, "llama");
    }
}
