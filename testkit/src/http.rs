//! The HTTP surface: URL routing, verbs, discovery and `Status` errors.
//!
//! Responsible for mapping Kubernetes REST paths onto store operations.
//! Not responsible for write semantics (`store`) or streaming (`watch`).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, Method, StatusCode, Uri, header};
use axum::response::Response;
use bytes::Bytes;
use serde_json::{Value, json};

use crate::error::ApiError;
use crate::resource::{self, RESOURCES, ResourceType};
use crate::selector::Filter;
use crate::store::{Part, PatchKind, Store};
use crate::watch::{self, WatchRequest};

/// The fake server's routes; everything goes through one dispatcher because
/// Kubernetes paths have too many shapes for a route table to stay readable.
pub fn router(store: Arc<Store>) -> Router {
    Router::new().fallback(dispatch).with_state(store)
}

#[derive(Debug)]
enum Route<'a> {
    Version,
    CoreVersions,
    Groups,
    Resources(&'a str, &'a str),
    Collection(&'static ResourceType, Option<&'a str>),
    Object(&'static ResourceType, &'a str, &'a str, Part),
}

fn not_found(path: &str) -> ApiError {
    ApiError::NotFound {
        what: format!("the server could not find the requested resource ({path})"),
    }
}

fn route(path: &str) -> Result<Route<'_>, ApiError> {
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group, version, rest) = match segments[..] {
        ["version"] => return Ok(Route::Version),
        ["api"] => return Ok(Route::CoreVersions),
        ["apis"] => return Ok(Route::Groups),
        ["api", version, ref rest @ ..] => ("", version, rest),
        ["apis", group, version, ref rest @ ..] => (group, version, rest),
        _ => return Err(not_found(path)),
    };
    let rt =
        |plural: &str| resource::by_path(group, version, plural).ok_or_else(|| not_found(path));
    match *rest {
        [] if !resource::in_group_version(group, version).is_empty() => {
            Ok(Route::Resources(group, version))
        }
        [plural] => Ok(Route::Collection(rt(plural)?, None)),
        ["namespaces", ns, plural] => Ok(Route::Collection(rt(plural)?, Some(ns))),
        ["namespaces", ns, plural, name] => Ok(Route::Object(rt(plural)?, ns, name, Part::Main)),
        ["namespaces", ns, plural, name, "status"] => {
            Ok(Route::Object(rt(plural)?, ns, name, Part::Status))
        }
        _ => Err(not_found(path)),
    }
}

fn respond(code: StatusCode, body: &Value) -> Response {
    Response::builder()
        .status(code)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(serde_json::to_vec(body).unwrap_or_default()))
        .unwrap_or_default()
}

fn error(e: &ApiError) -> Response {
    let code = StatusCode::from_u16(e.code()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    respond(code, &e.to_status())
}

async fn dispatch(
    State(store): State<Arc<Store>>,
    method: Method,
    uri: Uri,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    match handle(&store, &method, uri.path(), &query, &headers, &body) {
        Ok(response) => response,
        Err(e) => {
            tracing::debug!(%method, %uri, error = %e, "fake API request failed");
            error(&e)
        }
    }
}

fn parse_body(body: &Bytes) -> Result<Value, ApiError> {
    serde_json::from_slice(body).map_err(ApiError::InvalidJson)
}

fn handle(
    store: &Store,
    method: &Method,
    path: &str,
    query: &HashMap<String, String>,
    headers: &HeaderMap,
    body: &Bytes,
) -> Result<Response, ApiError> {
    if query.contains_key("dryRun") {
        return Err(ApiError::BadRequest(
            "dryRun is not supported by the fake API server".into(),
        ));
    }
    let ok = |v: Value| Ok(respond(StatusCode::OK, &v));
    let route = route(path)?;
    if let Route::Collection(rt, _) | Route::Object(rt, ..) = route
        && !store.serves(rt)
    {
        return Err(not_found(path));
    }
    match (route, method) {
        (Route::Version, &Method::GET) => ok(version()),
        (Route::CoreVersions, &Method::GET) => ok(core_versions()),
        (Route::Groups, &Method::GET) => ok(groups(store)),
        (Route::Resources(group, version), &Method::GET) => {
            ok(resource_list(store, group, version))
        }
        (Route::Collection(rt, ns), &Method::GET) => {
            let filter = Filter::parse(
                query.get("labelSelector").map(String::as_str),
                query.get("fieldSelector").map(String::as_str),
            )?;
            if matches!(query.get("watch").map(String::as_str), Some("true" | "1")) {
                return watch_response(store, rt, ns, filter, query);
            }
            let (items, rv) = store.list(rt, ns, |o| filter.matches(o));
            ok(json!({
                "kind": rt.list_kind(),
                "apiVersion": rt.api_version(),
                "metadata": { "resourceVersion": rv.to_string() },
                "items": items,
            }))
        }
        (Route::Collection(rt, Some(ns)), &Method::POST) => {
            let created = store.create(rt, ns, parse_body(body)?)?;
            Ok(respond(StatusCode::CREATED, &created))
        }
        (Route::Object(rt, ns, name, part), &Method::GET) => {
            let _ = part;
            ok(store.get(rt, ns, name)?)
        }
        (Route::Object(rt, ns, name, part), &Method::PUT) => {
            ok(store.replace(rt, ns, name, parse_body(body)?, part)?)
        }
        (Route::Object(rt, ns, name, part), &Method::PATCH) => {
            let content_type = headers
                .get(header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .split(';')
                .next()
                .unwrap_or("")
                .trim();
            let kind = match content_type {
                "application/merge-patch+json" | "application/strategic-merge-patch+json" => {
                    PatchKind::Merge
                }
                "application/apply-patch+yaml" => PatchKind::Apply,
                "application/json-patch+json" => PatchKind::Json,
                other => return Err(ApiError::UnsupportedMediaType(other.to_string())),
            };
            if kind == PatchKind::Apply && !query.contains_key("fieldManager") {
                return Err(ApiError::BadRequest(
                    "PATCH with apply-patch+yaml requires a fieldManager".into(),
                ));
            }
            ok(store.patch(rt, ns, name, &parse_body(body)?, part, kind)?)
        }
        (Route::Object(rt, ns, name, Part::Main), &Method::DELETE) => {
            ok(store.delete(rt, ns, name)?)
        }
        _ => Err(ApiError::MethodNotAllowed),
    }
}

fn watch_response(
    store: &Store,
    rt: &'static ResourceType,
    ns: Option<&str>,
    filter: Filter,
    query: &HashMap<String, String>,
) -> Result<Response, ApiError> {
    let flag = |name: &str| matches!(query.get(name).map(String::as_str), Some("true" | "1"));
    let initial_events_end = flag("sendInitialEvents");
    let from = match query.get("resourceVersion").map(String::as_str) {
        _ if initial_events_end => None,
        None | Some("" | "0") => None,
        Some(rv) => Some(
            rv.parse::<u64>()
                .map_err(|_| ApiError::BadRequest(format!("invalid resourceVersion {rv:?}")))?,
        ),
    };
    let timeout = match query.get("timeoutSeconds") {
        None => None,
        Some(s) => Some(Duration::from_secs(s.parse().map_err(|_| {
            ApiError::BadRequest(format!("invalid timeoutSeconds {s:?}"))
        })?)),
    };
    let body = watch::start(
        store,
        WatchRequest {
            resource: rt,
            namespace: ns.map(str::to_string),
            filter,
            from,
            bookmarks: flag("allowWatchBookmarks"),
            initial_events_end,
            timeout,
        },
    );
    Ok(Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/json")
        .body(body)
        .unwrap_or_default())
}

fn version() -> Value {
    json!({
        "major": "1",
        "minor": "34",
        "gitVersion": "v1.34.0-kvroute-fake",
        "gitCommit": "0000000000000000000000000000000000000000",
        "gitTreeState": "clean",
        "buildDate": "2025-01-01T00:00:00Z",
        "goVersion": "go1.24.0",
        "compiler": "gc",
        "platform": "linux/amd64",
    })
}

fn core_versions() -> Value {
    json!({
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [{ "clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1" }],
    })
}

fn groups(store: &Store) -> Value {
    let mut groups: Vec<Value> = Vec::new();
    let served = RESOURCES.iter().filter(|r| store.serves(r));
    for rt in served.filter(|r| !r.group.is_empty()) {
        if groups.iter().any(|g| g["name"] == rt.group) {
            continue;
        }
        let version = json!({ "groupVersion": rt.api_version(), "version": rt.version });
        groups.push(json!({
            "name": rt.group,
            "versions": [version],
            "preferredVersion": version,
        }));
    }
    json!({ "kind": "APIGroupList", "apiVersion": "v1", "groups": groups })
}

fn resource_list(store: &Store, group: &str, version: &str) -> Value {
    let mut resources = Vec::new();
    let served = resource::in_group_version(group, version).into_iter();
    for rt in served.filter(|r| store.serves(r)) {
        resources.push(json!({
            "name": rt.plural,
            "singularName": rt.singular,
            "namespaced": rt.namespaced,
            "kind": rt.kind,
            "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"],
        }));
        resources.push(json!({
            "name": format!("{}/status", rt.plural),
            "singularName": "",
            "namespaced": rt.namespaced,
            "kind": rt.kind,
            "verbs": ["get", "patch", "update"],
        }));
    }
    let group_version = if group.is_empty() {
        version.to_string()
    } else {
        format!("{group}/{version}")
    };
    json!({
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": group_version,
        "resources": resources,
    })
}
