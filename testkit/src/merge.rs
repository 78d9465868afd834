//! JSON merge patch (RFC 7386), the one patch algorithm the fake implements.

use serde_json::{Map, Value};

/// Applies `patch` to `target` in place: objects merge key by key, `null`
/// removes a key, anything else (arrays included) replaces.
pub fn merge_patch(target: &mut Value, patch: &Value) {
    let Value::Object(patch) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    if let Value::Object(target) = target {
        for (key, value) in patch {
            if value.is_null() {
                target.remove(key);
            } else {
                merge_patch(target.entry(key.clone()).or_insert(Value::Null), value);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn follows_rfc_7386_examples() {
        let mut doc = json!({"a": "b", "c": {"d": "e", "f": "g"}, "l": [1, 2]});
        merge_patch(&mut doc, &json!({"a": "z", "c": {"f": null}, "l": [3]}));
        assert_eq!(doc, json!({"a": "z", "c": {"d": "e"}, "l": [3]}));

        let mut scalar = json!("x");
        merge_patch(&mut scalar, &json!({"a": {"b": 1}}));
        assert_eq!(scalar, json!({"a": {"b": 1}}));
    }
}
