//! The in-memory object store: one resourceVersion counter, objects keyed by
//! resource type, namespace and name, and a bounded history of changes that
//! watches replay from.
//!
//! Responsible for the write semantics (preconditions, server-set metadata,
//! `spec`/`status` separation, generation). Not responsible for HTTP or for
//! turning changes into watch events (see `http` and `watch`).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use json_patch::PatchOperation;
use serde_json::{Value, json};
use tokio::sync::broadcast;

use crate::error::ApiError;
use crate::meta::{new_uid, now_rfc3339};
use crate::resource::ResourceType;

/// How many changes a watch can replay; older versions get 410 Gone.
pub const HISTORY_LEN: usize = 1000;

/// Which part of an object a write targets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// The object itself; `status` in the body is ignored.
    Main,
    /// The `/status` subresource; only `status` is taken from the body.
    Status,
    /// Test helpers only: `spec` and `status` both come from the body.
    Whole,
}

/// How a PATCH body is applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PatchKind {
    /// RFC 7386 merge patch (also used for strategic merge patch).
    Merge,
    /// Server-side apply, simplified to a merge patch that creates missing objects.
    Apply,
    /// RFC 6902 JSON patch.
    Json,
}

/// One committed write, as watches see it.
#[derive(Debug)]
pub struct Change {
    /// The resourceVersion this write produced.
    pub rv: u64,
    /// The object's resource type.
    pub resource: &'static ResourceType,
    /// The object's namespace.
    pub namespace: String,
    /// The object before the write; `None` on create.
    pub old: Option<Value>,
    /// The object after the write, or its last state for a delete.
    pub object: Value,
    /// Whether the write deleted the object.
    pub deleted: bool,
}

/// Where a new watch starts.
#[derive(Debug)]
pub enum WatchStart {
    /// No version given: every current object of the type, in key order.
    Snapshot(Vec<Value>),
    /// Changes after the given version, oldest first.
    Replay(Vec<Arc<Change>>),
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct ObjectKey {
    resource: &'static ResourceType,
    namespace: String,
    name: String,
}

#[derive(Debug, Default)]
struct Inner {
    rv: u64,
    objects: BTreeMap<ObjectKey, Value>,
    history: VecDeque<Arc<Change>>,
    /// The newest version no longer in `history`; watches from below it are Gone.
    evicted_up_to: u64,
}

/// The fake server's state, shared by HTTP handlers and test helpers.
#[derive(Debug)]
pub struct Store {
    inner: Mutex<Inner>,
    changes: broadcast::Sender<Arc<Change>>,
    /// Types the HTTP surface does not serve, as if their CRD were absent.
    unserved: Mutex<BTreeSet<&'static ResourceType>>,
}

impl Default for Store {
    fn default() -> Self {
        Self {
            inner: Mutex::default(),
            changes: broadcast::channel(HISTORY_LEN).0,
            unserved: Mutex::default(),
        }
    }
}

fn what(rt: &ResourceType, name: &str) -> String {
    if rt.group.is_empty() {
        format!("{} {name:?}", rt.plural)
    } else {
        format!("{}.{} {name:?}", rt.plural, rt.group)
    }
}

fn key(rt: &'static ResourceType, namespace: &str, name: &str) -> ObjectKey {
    ObjectKey {
        resource: rt,
        namespace: namespace.to_string(),
        name: name.to_string(),
    }
}

/// Copies the fields only the server may set from `old` into `new`.
fn keep_server_fields(rt: &ResourceType, old: &Value, new: &mut Value) {
    new["apiVersion"] = json!(rt.api_version());
    new["kind"] = json!(rt.kind);
    for field in [
        "name",
        "namespace",
        "uid",
        "creationTimestamp",
        "generation",
        "resourceVersion",
        "deletionTimestamp",
        "deletionGracePeriodSeconds",
    ] {
        match old["metadata"].get(field) {
            Some(v) => new["metadata"][field] = v.clone(),
            None => {
                if let Some(m) = new["metadata"].as_object_mut() {
                    m.remove(field);
                }
            }
        }
    }
}

fn set_status(object: &mut Value, status: Option<&Value>) {
    match status {
        Some(s) => object["status"] = s.clone(),
        None => {
            if let Some(m) = object.as_object_mut() {
                m.remove("status");
            }
        }
    }
}

fn has_finalizers(object: &Value) -> bool {
    object["metadata"]["finalizers"]
        .as_array()
        .is_some_and(|f| !f.is_empty())
}

fn check_precondition(rt: &ResourceType, old: &Value, body: &Value) -> Result<(), ApiError> {
    match body["metadata"]["resourceVersion"].as_str() {
        Some(rv) if !rv.is_empty() && Some(rv) != old["metadata"]["resourceVersion"].as_str() => {
            Err(ApiError::Conflict {
                what: what(rt, old["metadata"]["name"].as_str().unwrap_or("")),
            })
        }
        _ => Ok(()),
    }
}

/// Applies an RFC 6902 JSON patch to `doc`, as the API server does: a body
/// that is not a list of operations is 400, an operation that cannot apply
/// (a failed `test`, a missing path) is 422. Unlike the `json-patch` crate, a
/// `test` of `null` passes on a missing path, as upstream's
/// (evanphx/json-patch) does; kube-runtime's finalizer helper relies on it.
/// On error `doc` may be half patched, so callers patch a copy.
fn apply_json_patch(doc: &mut Value, patch: &Value) -> Result<(), ApiError> {
    let ops: Vec<PatchOperation> = serde_json::from_value(patch.clone())
        .map_err(|e| ApiError::BadRequest(format!("invalid JSON patch: {e}")))?;
    for (i, op) in ops.iter().enumerate() {
        if let PatchOperation::Test(test) = op
            && test.value.is_null()
            && doc.pointer(test.path.as_str()).is_none()
        {
            continue;
        }
        json_patch::patch(doc, std::slice::from_ref(op)).map_err(|e| {
            ApiError::Invalid(format!(
                "JSON patch operation {i} failed at {:?}: {}",
                e.path.as_str(),
                e.kind
            ))
        })?;
    }
    Ok(())
}

impl Store {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether the HTTP surface serves `rt`.
    pub fn serves(&self, rt: &'static ResourceType) -> bool {
        let unserved = self.unserved.lock().unwrap_or_else(PoisonError::into_inner);
        !unserved.contains(rt)
    }

    /// Starts (`true`) or stops serving `rt` over HTTP.
    pub fn set_served(&self, rt: &'static ResourceType, served: bool) {
        let mut unserved = self.unserved.lock().unwrap_or_else(PoisonError::into_inner);
        if served {
            unserved.remove(rt);
        } else {
            unserved.insert(rt);
        }
    }

    /// The current resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.lock().rv
    }

    /// Objects of one type, in one namespace or all, and the current version.
    pub fn list(
        &self,
        rt: &'static ResourceType,
        namespace: Option<&str>,
        keep: impl Fn(&Value) -> bool,
    ) -> (Vec<Value>, u64) {
        let inner = self.lock();
        let items = inner
            .objects
            .iter()
            .filter(|(k, _)| k.resource == rt && namespace.is_none_or(|ns| k.namespace == ns))
            .map(|(_, v)| v)
            .filter(|v| keep(v))
            .cloned()
            .collect();
        (items, inner.rv)
    }

    /// One object.
    pub fn get(&self, rt: &'static ResourceType, ns: &str, name: &str) -> Result<Value, ApiError> {
        self.lock()
            .objects
            .get(&key(rt, ns, name))
            .cloned()
            .ok_or_else(|| ApiError::NotFound {
                what: what(rt, name),
            })
    }

    /// Creates an object, as POST does: server-set metadata, no `status`.
    pub fn create(
        &self,
        rt: &'static ResourceType,
        ns: &str,
        mut body: Value,
    ) -> Result<Value, ApiError> {
        set_status(&mut body, None);
        self.insert_new(rt, ns, body)
    }

    fn insert_new(
        &self,
        rt: &'static ResourceType,
        ns: &str,
        mut body: Value,
    ) -> Result<Value, ApiError> {
        if !body.is_object() || !body["metadata"].is_object() {
            return Err(ApiError::BadRequest("object has no metadata".into()));
        }
        match body["metadata"]["namespace"].as_str() {
            Some(b) if b != ns => {
                return Err(ApiError::BadRequest(format!(
                    "the namespace of the object ({b}) does not match the namespace on the request ({ns})"
                )));
            }
            _ => {}
        }
        let mut inner = self.lock();
        let name = match (
            body["metadata"]["name"].as_str(),
            body["metadata"]["generateName"].as_str(),
        ) {
            (Some(n), _) if !n.is_empty() => n.to_string(),
            (_, Some(prefix)) => format!("{prefix}{:05x}", inner.rv + 1),
            _ => {
                return Err(ApiError::BadRequest(
                    "name or generateName is required".into(),
                ));
            }
        };
        let k = key(rt, ns, &name);
        if inner.objects.contains_key(&k) {
            return Err(ApiError::AlreadyExists {
                what: what(rt, &name),
            });
        }
        body["apiVersion"] = json!(rt.api_version());
        body["kind"] = json!(rt.kind);
        let meta = &mut body["metadata"];
        meta["name"] = json!(name);
        meta["namespace"] = json!(ns);
        meta["uid"] = json!(new_uid());
        meta["creationTimestamp"] = json!(now_rfc3339());
        meta["generation"] = json!(1);
        Ok(self.commit(&mut inner, k, None, body, false))
    }

    /// Replaces an object (PUT) or its status (PUT `/status`).
    pub fn replace(
        &self,
        rt: &'static ResourceType,
        ns: &str,
        name: &str,
        body: Value,
        part: Part,
    ) -> Result<Value, ApiError> {
        if body["metadata"]["name"].as_str().is_some_and(|n| n != name) {
            return Err(ApiError::BadRequest(format!(
                "the name of the object does not match the name on the URL ({name})"
            )));
        }
        self.update(
            rt,
            ns,
            name,
            |old| {
                check_precondition(rt, old, &body)?;
                Ok(body.clone())
            },
            part,
        )
    }

    /// Patches an object (PATCH) or its status (PATCH `/status`). Apply
    /// creates a missing object from the patch, as server-side apply does.
    pub fn patch(
        &self,
        rt: &'static ResourceType,
        ns: &str,
        name: &str,
        patch: &Value,
        part: Part,
        kind: PatchKind,
    ) -> Result<Value, ApiError> {
        if kind != PatchKind::Json && !patch.is_object() {
            return Err(ApiError::BadRequest("a patch must be a JSON object".into()));
        }
        if kind == PatchKind::Apply && part == Part::Main && self.get(rt, ns, name).is_err() {
            let mut body = patch.clone();
            body["metadata"]["name"] = json!(name);
            match self.create(rt, ns, body) {
                Err(ApiError::AlreadyExists { .. }) => {} // lost a race; patch instead
                done => return done,
            }
        }
        self.update(
            rt,
            ns,
            name,
            |old| {
                let mut new = old.clone();
                if kind == PatchKind::Json {
                    apply_json_patch(&mut new, patch)?;
                } else {
                    check_precondition(rt, old, patch)?;
                    json_patch::merge(&mut new, patch);
                }
                Ok(new)
            },
            part,
        )
    }

    /// Shared update path: `edit` proposes a new object from the stored one;
    /// the server fields, `status` or everything but `status` are then kept
    /// from the stored object according to `part`.
    fn update(
        &self,
        rt: &'static ResourceType,
        ns: &str,
        name: &str,
        edit: impl FnOnce(&Value) -> Result<Value, ApiError>,
        part: Part,
    ) -> Result<Value, ApiError> {
        let mut inner = self.lock();
        let k = key(rt, ns, name);
        let old = inner
            .objects
            .get(&k)
            .cloned()
            .ok_or_else(|| ApiError::NotFound {
                what: what(rt, name),
            })?;
        let proposed = edit(&old)?;
        if !proposed.is_object() {
            return Err(ApiError::BadRequest(
                "the body must be a JSON object".into(),
            ));
        }
        let new = match part {
            Part::Main | Part::Whole => {
                let mut new = proposed;
                if !new["metadata"].is_object() {
                    new["metadata"] = json!({});
                }
                keep_server_fields(rt, &old, &mut new);
                if part == Part::Main {
                    set_status(&mut new, old.get("status"));
                }
                if new.get("spec") != old.get("spec") {
                    let generation = old["metadata"]["generation"].as_i64().unwrap_or(0);
                    new["metadata"]["generation"] = json!(generation + 1);
                }
                new
            }
            Part::Status => {
                let mut new = old.clone();
                set_status(&mut new, proposed.get("status").filter(|s| !s.is_null()));
                new
            }
        };
        if new == old {
            // The real server does not bump the version on a no-op write, so
            // controllers that rewrite identical status do not wake themselves.
            return Ok(old);
        }
        // The last finalizer of a deleting object is gone: it goes for good.
        let finalized = new["metadata"]["deletionTimestamp"].is_string() && !has_finalizers(&new);
        Ok(self.commit(&mut inner, k, Some(old), new, finalized))
    }

    /// Deletes an object, returning its last state. An object with
    /// finalizers only gets a `deletionTimestamp` (and a new generation);
    /// it goes when an update removes the last finalizer.
    pub fn delete(
        &self,
        rt: &'static ResourceType,
        ns: &str,
        name: &str,
    ) -> Result<Value, ApiError> {
        let mut inner = self.lock();
        let k = key(rt, ns, name);
        let old = inner
            .objects
            .get(&k)
            .cloned()
            .ok_or_else(|| ApiError::NotFound {
                what: what(rt, name),
            })?;
        if !has_finalizers(&old) {
            return Ok(self.commit(&mut inner, k, Some(old.clone()), old, true));
        }
        if old["metadata"]["deletionTimestamp"].is_string() {
            return Ok(old);
        }
        let mut new = old.clone();
        let generation = old["metadata"]["generation"].as_i64().unwrap_or(0);
        new["metadata"]["generation"] = json!(generation + 1);
        new["metadata"]["deletionTimestamp"] = json!(now_rfc3339());
        new["metadata"]["deletionGracePeriodSeconds"] = json!(0);
        Ok(self.commit(&mut inner, k, Some(old), new, false))
    }

    /// Test helper: creates or replaces an object unconditionally, `status`
    /// included.
    pub fn put(&self, rt: &'static ResourceType, body: Value) -> Result<Value, ApiError> {
        let ns = body["metadata"]["namespace"]
            .as_str()
            .unwrap_or("default")
            .to_string();
        let name = body["metadata"]["name"]
            .as_str()
            .ok_or_else(|| ApiError::BadRequest("metadata.name is required".into()))?
            .to_string();
        if self.get(rt, &ns, &name).is_err() {
            return self.insert_new(rt, &ns, body);
        }
        self.update(rt, &ns, &name, |_| Ok(body), Part::Whole)
    }

    /// Subscribes to changes and says where a watch from `from` starts,
    /// atomically, so no change falls between the start and the live feed.
    pub fn watch(
        &self,
        rt: &'static ResourceType,
        namespace: Option<&str>,
        from: Option<u64>,
    ) -> Result<(WatchStart, u64, broadcast::Receiver<Arc<Change>>), ApiError> {
        let inner = self.lock();
        let rx = self.changes.subscribe();
        let start = match from {
            None => WatchStart::Snapshot(
                inner
                    .objects
                    .iter()
                    .filter(|(k, _)| {
                        k.resource == rt && namespace.is_none_or(|ns| k.namespace == ns)
                    })
                    .map(|(_, v)| v.clone())
                    .collect(),
            ),
            Some(n) if n < inner.evicted_up_to => {
                return Err(ApiError::Gone {
                    requested: n,
                    oldest: inner.evicted_up_to,
                });
            }
            Some(n) => {
                WatchStart::Replay(inner.history.iter().filter(|c| c.rv > n).cloned().collect())
            }
        };
        Ok((start, inner.rv, rx))
    }

    fn commit(
        &self,
        inner: &mut Inner,
        k: ObjectKey,
        old: Option<Value>,
        mut object: Value,
        deleted: bool,
    ) -> Value {
        inner.rv += 1;
        object["metadata"]["resourceVersion"] = json!(inner.rv.to_string());
        if deleted {
            inner.objects.remove(&k);
        } else {
            inner.objects.insert(k.clone(), object.clone());
        }
        let change = Arc::new(Change {
            rv: inner.rv,
            resource: k.resource,
            namespace: k.namespace,
            old,
            object: object.clone(),
            deleted,
        });
        inner.history.push_back(change.clone());
        while inner.history.len() > HISTORY_LEN {
            if let Some(evicted) = inner.history.pop_front() {
                inner.evicted_up_to = evicted.rv;
            }
        }
        // No receivers is fine: nobody is watching.
        let _ = self.changes.send(change);
        object
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_patch_edits_finalizers_like_kube_runtime() {
        let mut doc = json!({"metadata": {"finalizers": ["a", "b"]}});
        let patch = json!([
            {"op": "test", "path": "/metadata/finalizers/1", "value": "b"},
            {"op": "remove", "path": "/metadata/finalizers/1"},
            {"op": "add", "path": "/metadata/finalizers/-", "value": "c"},
            {"op": "replace", "path": "/metadata/finalizers/0", "value": "z"},
            {"op": "copy", "from": "/metadata/finalizers", "path": "/metadata/copy"},
            {"op": "move", "from": "/metadata/copy", "path": "/m~1v"},
        ]);
        apply_json_patch(&mut doc, &patch).unwrap();
        assert_eq!(
            doc,
            json!({"metadata": {"finalizers": ["z", "c"]}, "m/v": ["z", "c"]})
        );

        let failing = json!([{"op": "test", "path": "/metadata/finalizers/0", "value": "a"}]);
        assert!(matches!(
            apply_json_patch(&mut doc, &failing),
            Err(ApiError::Invalid(_))
        ));
        let absent = json!([{"op": "test", "path": "/metadata/absent", "value": null}]);
        apply_json_patch(&mut doc, &absent).unwrap();
        let missing = json!([{"op": "remove", "path": "/nope/x"}]);
        assert!(matches!(
            apply_json_patch(&mut doc, &missing),
            Err(ApiError::Invalid(_))
        ));
        for malformed in [
            json!({"op": "add"}),
            json!([{"op": "frobnicate", "path": "/a"}]),
        ] {
            assert!(matches!(
                apply_json_patch(&mut doc, &malformed),
                Err(ApiError::BadRequest(_))
            ));
        }
    }

    #[test]
    fn merge_patch_follows_rfc_7386_examples() {
        let mut doc = json!({"a": "b", "c": {"d": "e", "f": "g"}, "l": [1, 2]});
        json_patch::merge(&mut doc, &json!({"a": "z", "c": {"f": null}, "l": [3]}));
        assert_eq!(doc, json!({"a": "z", "c": {"d": "e"}, "l": [3]}));

        let mut scalar = json!("x");
        json_patch::merge(&mut scalar, &json!({"a": {"b": 1}}));
        assert_eq!(scalar, json!({"a": {"b": 1}}));
    }
}
