//! JSON patch (RFC 6902): `add`, `remove`, `replace`, `move`, `copy` and
//! `test`. kube-runtime's finalizer helper patches `metadata.finalizers`
//! this way, with a `test` guarding each change.

use serde_json::Value;

use crate::error::ApiError;

fn invalid(message: String) -> ApiError {
    ApiError::Invalid(message)
}

/// Splits an RFC 6901 pointer into unescaped tokens.
fn tokens(pointer: &str) -> Result<Vec<String>, ApiError> {
    if pointer.is_empty() {
        return Ok(Vec::new());
    }
    let rest = pointer
        .strip_prefix('/')
        .ok_or_else(|| invalid(format!("invalid JSON pointer {pointer:?}")))?;
    Ok(rest
        .split('/')
        .map(|t| t.replace("~1", "/").replace("~0", "~"))
        .collect())
}

fn index(token: &str, len: usize, allow_end: bool) -> Result<usize, ApiError> {
    if allow_end && token == "-" {
        return Ok(len);
    }
    let i: usize = token
        .parse()
        .map_err(|_| invalid(format!("invalid array index {token:?}")))?;
    if i > len || (!allow_end && i == len) {
        return Err(invalid(format!("array index {i} out of bounds")));
    }
    Ok(i)
}

/// The parent container of the pointer's target, and the last token.
fn parent<'a>(doc: &'a mut Value, path: &str) -> Result<(&'a mut Value, String), ApiError> {
    let mut tokens = tokens(path)?;
    let last = tokens
        .pop()
        .ok_or_else(|| invalid("the whole document cannot be a patch target".into()))?;
    let mut node = doc;
    for token in tokens {
        node = match node {
            Value::Object(map) => map.get_mut(&token),
            Value::Array(items) => {
                let i = index(&token, items.len(), false)?;
                items.get_mut(i)
            }
            _ => None,
        }
        .ok_or_else(|| invalid(format!("path {path:?} does not exist")))?;
    }
    Ok((node, last))
}

fn get(doc: &Value, path: &str) -> Result<Value, ApiError> {
    let pointer_missing = || invalid(format!("path {path:?} does not exist"));
    doc.pointer(path).cloned().ok_or_else(pointer_missing)
}

fn add(doc: &mut Value, path: &str, value: Value) -> Result<(), ApiError> {
    let (node, last) = parent(doc, path)?;
    match node {
        Value::Object(map) => {
            map.insert(last, value);
        }
        Value::Array(items) => {
            let i = index(&last, items.len(), true)?;
            items.insert(i, value);
        }
        _ => return Err(invalid(format!("path {path:?} does not exist"))),
    }
    Ok(())
}

fn remove(doc: &mut Value, path: &str) -> Result<Value, ApiError> {
    let (node, last) = parent(doc, path)?;
    let removed = match node {
        Value::Object(map) => map.remove(&last),
        Value::Array(items) => {
            let i = index(&last, items.len(), false)?;
            Some(items.remove(i))
        }
        _ => None,
    };
    removed.ok_or_else(|| invalid(format!("path {path:?} does not exist")))
}

/// Applies a JSON patch document to `doc`; on error `doc` may be half
/// patched, so callers patch a copy.
pub fn json_patch(doc: &mut Value, patch: &Value) -> Result<(), ApiError> {
    let ops = patch
        .as_array()
        .ok_or_else(|| ApiError::BadRequest("a JSON patch must be an array".into()))?;
    for op in ops {
        let path = op["path"]
            .as_str()
            .ok_or_else(|| ApiError::BadRequest("JSON patch operation without path".into()))?;
        let value = || {
            op.get("value")
                .cloned()
                .ok_or_else(|| ApiError::BadRequest(format!("{op} needs a value")))
        };
        let from = || {
            op["from"]
                .as_str()
                .ok_or_else(|| ApiError::BadRequest(format!("{op} needs from")))
        };
        match op["op"].as_str() {
            Some("add") => add(doc, path, value()?)?,
            Some("remove") => {
                remove(doc, path)?;
            }
            Some("replace") => {
                remove(doc, path)?;
                add(doc, path, value()?)?;
            }
            Some("move") => {
                let moved = remove(doc, from()?)?;
                add(doc, path, moved)?;
            }
            Some("copy") => {
                let copied = get(doc, from()?)?;
                add(doc, path, copied)?;
            }
            Some("test") => {
                // A missing path tests equal to null, as upstream (evanphx/json-patch)
                // does; kube-runtime's finalizer helper relies on it.
                let actual = doc.pointer(path).cloned().unwrap_or(Value::Null);
                if actual != value()? {
                    return Err(invalid(format!("test operation failed at {path:?}")));
                }
            }
            _ => {
                return Err(ApiError::BadRequest(format!(
                    "unknown JSON patch operation {op}"
                )));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn edits_finalizers_like_kube_runtime() {
        let mut doc = json!({"metadata": {"finalizers": ["a", "b"]}});
        let patch = json!([
            {"op": "test", "path": "/metadata/finalizers/1", "value": "b"},
            {"op": "remove", "path": "/metadata/finalizers/1"},
            {"op": "add", "path": "/metadata/finalizers/-", "value": "c"},
            {"op": "replace", "path": "/metadata/finalizers/0", "value": "z"},
            {"op": "copy", "from": "/metadata/finalizers", "path": "/metadata/copy"},
            {"op": "move", "from": "/metadata/copy", "path": "/m~1v"},
        ]);
        json_patch(&mut doc, &patch).unwrap();
        assert_eq!(
            doc,
            json!({"metadata": {"finalizers": ["z", "c"]}, "m/v": ["z", "c"]})
        );

        let failing = json!([{"op": "test", "path": "/metadata/finalizers/0", "value": "a"}]);
        assert!(matches!(
            json_patch(&mut doc, &failing),
            Err(ApiError::Invalid(_))
        ));
        let absent = json!([{"op": "test", "path": "/metadata/absent", "value": null}]);
        json_patch(&mut doc, &absent).unwrap();
        let missing = json!([{"op": "remove", "path": "/nope/x"}]);
        assert!(json_patch(&mut doc, &missing).is_err());
    }
}
