//! Watch streams: newline-delimited JSON watch events over a chunked body.
//!
//! Responsible for turning store changes into `ADDED`/`MODIFIED`/`DELETED`
//! events for one resource type, namespace and selector, for bookmarks, and
//! for the server-side timeout. Expired versions are reported the way the
//! real API server does it: HTTP 200 and one `ERROR` event carrying a 410
//! `Status` (kube-runtime's watcher relists on exactly that).

use std::convert::Infallible;
use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use serde_json::{Value, json};
use tokio::sync::{broadcast, mpsc};
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;

use crate::error::ApiError;
use crate::resource::ResourceType;
use crate::selector::Filter;
use crate::store::{Change, Store, WatchStart};

/// What one watch request asked for.
#[derive(Debug)]
pub struct WatchRequest {
    /// The resource type watched.
    pub resource: &'static ResourceType,
    /// One namespace, or all.
    pub namespace: Option<String>,
    /// Selectors the events must pass.
    pub filter: Filter,
    /// Version to replay from; `None` starts with every current object as `ADDED`.
    pub from: Option<u64>,
    /// `allowWatchBookmarks`.
    pub bookmarks: bool,
    /// `sendInitialEvents`: mark the end of the initial `ADDED`s with a bookmark.
    pub initial_events_end: bool,
    /// `timeoutSeconds`.
    pub timeout: Option<Duration>,
}

/// The event a change produces for this watch, if any. An object leaving
/// the selector is `DELETED`, one entering it is `ADDED`, as upstream.
fn event_for(req: &WatchRequest, change: &Change) -> Option<Value> {
    if change.resource != req.resource
        || req
            .namespace
            .as_ref()
            .is_some_and(|ns| *ns != change.namespace)
    {
        return None;
    }
    let now = req.filter.matches(&change.object);
    let before = change.old.as_ref().is_some_and(|o| req.filter.matches(o));
    let kind = match (change.deleted, before, now) {
        (true, _, true) => "DELETED",
        (false, true, true) => "MODIFIED",
        (false, false, true) => "ADDED",
        (false, true, false) => "DELETED",
        _ => return None,
    };
    Some(json!({ "type": kind, "object": change.object }))
}

fn bookmark(rt: &ResourceType, rv: u64, initial_events_end: bool) -> Value {
    let mut object = json!({
        "kind": rt.kind,
        "apiVersion": rt.api_version(),
        "metadata": { "resourceVersion": rv.to_string() },
    });
    if initial_events_end {
        object["metadata"]["annotations"] = json!({ "k8s.io/initial-events-end": "true" });
    }
    json!({ "type": "BOOKMARK", "object": object })
}

fn line(event: &Value) -> Result<Bytes, Infallible> {
    let mut bytes = serde_json::to_vec(event).unwrap_or_default();
    bytes.push(b'\n');
    Ok(Bytes::from(bytes))
}

async fn until(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

/// Starts a watch and returns its streaming body. The stream ends at the
/// timeout, when the client goes away, or after an `ERROR` event.
pub fn start(store: &Store, req: WatchRequest) -> Body {
    let (tx, rx) = mpsc::channel(64);
    let started = store.watch(req.resource, req.namespace.as_deref(), req.from);
    let deadline = req.timeout.map(|t| Instant::now() + t);
    tokio::spawn(async move {
        let (start, mut last, mut live) = match started {
            Ok(started) => started,
            Err(gone) => {
                let _ = tx
                    .send(line(
                        &json!({ "type": "ERROR", "object": gone.to_status() }),
                    ))
                    .await;
                return;
            }
        };
        let initial: Vec<Value> = match start {
            WatchStart::Snapshot(objects) => objects
                .into_iter()
                .filter(|o| req.filter.matches(o))
                .map(|o| json!({ "type": "ADDED", "object": o }))
                .collect(),
            WatchStart::Replay(changes) => {
                changes.iter().filter_map(|c| event_for(&req, c)).collect()
            }
        };
        for event in &initial {
            if tx.send(line(event)).await.is_err() {
                return;
            }
        }
        if req.bookmarks || req.initial_events_end {
            let event = bookmark(req.resource, last, req.initial_events_end);
            if tx.send(line(&event)).await.is_err() {
                return;
            }
        }
        loop {
            let received = tokio::select! {
                received = live.recv() => received,
                () = until(deadline) => {
                    if req.bookmarks {
                        let _ = tx.send(line(&bookmark(req.resource, last, false))).await;
                    }
                    return;
                }
                () = tx.closed() => return,
            };
            match received {
                Ok(change) if change.rv > last => {
                    last = change.rv;
                    if let Some(event) = event_for(&req, &change)
                        && tx.send(line(&event)).await.is_err()
                    {
                        return;
                    }
                }
                Ok(_) => {}
                Err(broadcast::error::RecvError::Lagged(_)) => {
                    let gone = ApiError::Gone {
                        requested: last,
                        oldest: last + 1,
                    };
                    let _ = tx
                        .send(line(
                            &json!({ "type": "ERROR", "object": gone.to_status() }),
                        ))
                        .await;
                    return;
                }
                Err(broadcast::error::RecvError::Closed) => return,
            }
        }
    });
    Body::from_stream(ReceiverStream::new(rx))
}
