//! Priorities by name: a request names an objective with
//! [`OBJECTIVE_HEADER`], as the Gateway API Inference Extension's
//! `InferenceObjective` does; the router's `objectives` list says what
//! each name's priority is and which tenants may name it. An unknown or
//! missing name, or one the tenant may not name, has priority 0.

use std::collections::HashMap;

use axum::http::HeaderMap;

use crate::config::Objective;

/// The request header naming an objective.
pub const OBJECTIVE_HEADER: &str = "x-gateway-inference-objective";

/// The configured objectives, by name.
#[derive(Debug, Default)]
pub(crate) struct Objectives {
    by_name: HashMap<String, Objective>,
}

impl Objectives {
    /// The objectives of `list` (names checked unique at start).
    pub(crate) fn new(list: &[Objective]) -> Self {
        Objectives {
            by_name: list.iter().map(|o| (o.name.clone(), o.clone())).collect(),
        }
    }

    /// The name `headers` give, if any.
    pub(crate) fn named(headers: &HeaderMap) -> Option<String> {
        let value = headers.get(OBJECTIVE_HEADER)?.to_str().ok()?;
        Some(value.trim().to_owned())
    }

    /// The priority of a request naming `name` from `tenant`.
    pub(crate) fn priority(&self, name: Option<&str>, tenant: Option<&str>) -> i32 {
        let Some(o) = name.and_then(|n| self.by_name.get(n)) else {
            return 0;
        };
        let allowed =
            (o.tenants.as_ref()).is_none_or(|ts| tenant.is_some_and(|t| ts.iter().any(|x| x == t)));
        if allowed { o.priority } else { 0 }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_gives_its_priority_to_the_tenants_it_allows() {
        let o = Objectives::new(&[
            Objective {
                name: "chat".into(),
                priority: 10,
                tenants: None,
            },
            Objective {
                name: "batch".into(),
                priority: -1,
                tenants: Some(vec!["etl".into()]),
            },
        ]);
        assert_eq!(o.priority(Some("chat"), None), 10);
        assert_eq!(o.priority(Some("chat"), Some("a")), 10);
        assert_eq!(o.priority(Some("batch"), Some("etl")), -1);
        assert_eq!(o.priority(Some("batch"), Some("a")), 0);
        assert_eq!(o.priority(Some("batch"), None), 0);
        assert_eq!(o.priority(Some("unknown"), None), 0);
        assert_eq!(o.priority(None, None), 0);
        let mut headers = HeaderMap::new();
        assert_eq!(Objectives::named(&headers), None);
        headers.insert(OBJECTIVE_HEADER, " chat ".parse().unwrap());
        assert_eq!(Objectives::named(&headers).as_deref(), Some("chat"));
    }
}
