//! Label and field selectors for list and watch.
//!
//! Labels: equality (`a=b`, `a==b`, `a!=b`), existence (`a`, `!a`) and sets
//! (`a in (x,y)`, `a notin (x,y)`). Fields: only `metadata.name` and
//! `metadata.namespace` with `=`, `==` or `!=`; any other field is a 400, as
//! the real server does for unsupported field labels.

use serde_json::Value;

use crate::error::ApiError;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Requirement {
    Equals(String, String),
    NotEquals(String, String),
    Exists(String),
    NotExists(String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
}

/// A parsed `labelSelector` and `fieldSelector` pair.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Filter {
    labels: Vec<Requirement>,
    fields: Vec<Requirement>,
}

impl Filter {
    /// Parses the two query parameters; either may be absent.
    pub fn parse(labels: Option<&str>, fields: Option<&str>) -> Result<Self, ApiError> {
        let labels = split_terms(labels.unwrap_or(""))
            .into_iter()
            .map(parse_term)
            .collect::<Result<Vec<_>, _>>()?;
        let fields = split_terms(fields.unwrap_or(""))
            .into_iter()
            .map(parse_term)
            .collect::<Result<Vec<_>, _>>()?;
        for field in &fields {
            match field {
                Requirement::Equals(k, _) | Requirement::NotEquals(k, _)
                    if k == "metadata.name" || k == "metadata.namespace" => {}
                other => {
                    return Err(ApiError::BadRequest(format!(
                        "field selector {other:?} is not supported by the fake API server"
                    )));
                }
            }
        }
        Ok(Self { labels, fields })
    }

    /// Whether `object` passes both selectors.
    pub fn matches(&self, object: &Value) -> bool {
        let meta = &object["metadata"];
        let labels = |key: &str| meta["labels"][key].as_str().map(str::to_string);
        let fields = |key: &str| match key {
            "metadata.name" => meta["name"].as_str().map(str::to_string),
            "metadata.namespace" => Some(meta["namespace"].as_str().unwrap_or("").to_string()),
            _ => None,
        };
        self.labels.iter().all(|r| satisfies(r, &labels))
            && self.fields.iter().all(|r| satisfies(r, &fields))
    }
}

fn satisfies(req: &Requirement, lookup: &dyn Fn(&str) -> Option<String>) -> bool {
    match req {
        Requirement::Equals(k, v) => lookup(k).as_deref() == Some(v.as_str()),
        Requirement::NotEquals(k, v) => lookup(k).as_deref() != Some(v.as_str()),
        Requirement::Exists(k) => lookup(k).is_some(),
        Requirement::NotExists(k) => lookup(k).is_none(),
        Requirement::In(k, vs) => lookup(k).is_some_and(|v| vs.contains(&v)),
        Requirement::NotIn(k, vs) => lookup(k).is_none_or(|v| !vs.contains(&v)),
    }
}

/// Splits on commas outside parentheses, so `a in (x,y),b` is two terms.
fn split_terms(selector: &str) -> Vec<&str> {
    let mut terms = Vec::new();
    let (mut depth, mut start) = (0usize, 0usize);
    for (i, c) in selector.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                terms.push(&selector[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    terms.push(&selector[start..]);
    terms
        .into_iter()
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .collect()
}

fn parse_term(term: &str) -> Result<Requirement, ApiError> {
    let bad = || ApiError::BadRequest(format!("unable to parse requirement: {term:?}"));
    let words: Vec<&str> = term.splitn(2, char::is_whitespace).collect();
    if let [key, rest] = words[..] {
        let rest = rest.trim_start();
        for (op, negated) in [("notin", true), ("in", false)] {
            if let Some(set) = rest.strip_prefix(op) {
                let set = set.trim();
                let inner = set
                    .strip_prefix('(')
                    .and_then(|s| s.strip_suffix(')'))
                    .ok_or_else(bad)?;
                let values = inner.split(',').map(|v| v.trim().to_string()).collect();
                let key = key.to_string();
                return Ok(if negated {
                    Requirement::NotIn(key, values)
                } else {
                    Requirement::In(key, values)
                });
            }
        }
    }
    if let Some((k, v)) = term.split_once("!=") {
        return Ok(Requirement::NotEquals(k.trim().into(), v.trim().into()));
    }
    if let Some((k, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
        return Ok(Requirement::Equals(k.trim().into(), v.trim().into()));
    }
    if let Some(k) = term.strip_prefix('!') {
        return Ok(Requirement::NotExists(k.trim().into()));
    }
    if term.contains(char::is_whitespace) {
        return Err(bad());
    }
    Ok(Requirement::Exists(term.into()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(name: &str, labels: Value) -> Value {
        json!({"metadata": {"name": name, "namespace": "ns", "labels": labels}})
    }

    #[test]
    fn label_selectors_follow_kubernetes_semantics() {
        let web = pod("web", json!({"app": "web", "tier": "a"}));
        let db = pod("db", json!({"app": "db"}));
        let check = |sel: &str| {
            let f = Filter::parse(Some(sel), None).unwrap();
            (f.matches(&web), f.matches(&db))
        };
        assert_eq!(check("app=web"), (true, false));
        assert_eq!(check("app==web"), (true, false));
        assert_eq!(check("app!=web"), (false, true));
        assert_eq!(check("tier"), (true, false));
        assert_eq!(check("!tier"), (false, true));
        assert_eq!(check("app in (web, db),!tier"), (false, true));
        assert_eq!(check("app notin (web)"), (false, true));
        assert_eq!(check(""), (true, true));
    }

    #[test]
    fn field_selectors_support_only_name_and_namespace() {
        let f = Filter::parse(None, Some("metadata.name=web")).unwrap();
        assert!(f.matches(&pod("web", json!({}))));
        assert!(!f.matches(&pod("db", json!({}))));
        assert!(Filter::parse(None, Some("status.phase=Running")).is_err());
    }
}
