//! Priorities by name: a request names an objective with
//! [`OBJECTIVE_HEADER`], as the Gateway API Inference Extension's
//! `InferenceObjective` does. The router's `objectives` list says what
//! each name's priority is and which tenants may name it; a name it does
//! not list takes the priority of the pool's `InferenceObjective` of that
//! name, which the operator streams (any tenant may name those). An unknown
//! or missing name, or one the tenant may not name, has priority 0.

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

    /// The priority of a request naming `name` from `tenant`, given the
    /// `cluster`'s objectives for the names the router does not list.
    pub(crate) fn priority(
        &self,
        name: Option<&str>,
        tenant: Option<&str>,
        cluster: &HashMap<String, i32>,
    ) -> i32 {
        let Some(name) = name else { return 0 };
        let Some(o) = self.by_name.get(name) else {
            return cluster.get(name).copied().unwrap_or(0);
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
        let none = HashMap::new();
        assert_eq!(o.priority(Some("chat"), None, &none), 10);
        assert_eq!(o.priority(Some("chat"), Some("a"), &none), 10);
        assert_eq!(o.priority(Some("batch"), Some("etl"), &none), -1);
        assert_eq!(o.priority(Some("batch"), Some("a"), &none), 0);
        assert_eq!(o.priority(Some("batch"), None, &none), 0);
        assert_eq!(o.priority(Some("unknown"), None, &none), 0);
        assert_eq!(o.priority(None, None, &none), 0);
        let mut headers = HeaderMap::new();
        assert_eq!(Objectives::named(&headers), None);
        headers.insert(OBJECTIVE_HEADER, " chat ".parse().unwrap());
        assert_eq!(Objectives::named(&headers).as_deref(), Some("chat"));
    }

    #[test]
    fn the_clusters_objectives_name_what_the_router_does_not() {
        let o = Objectives::new(&[Objective {
            name: "batch".into(),
            priority: -1,
            tenants: Some(vec!["etl".into()]),
        }]);
        let cluster = HashMap::from([("critical".to_owned(), 20), ("batch".to_owned(), 5)]);
        assert_eq!(o.priority(Some("critical"), None, &cluster), 20);
        assert_eq!(o.priority(Some("critical"), Some("a"), &cluster), 20);
        // The router's entry wins, tenants and all.
        assert_eq!(o.priority(Some("batch"), Some("etl"), &cluster), -1);
        assert_eq!(o.priority(Some("batch"), Some("a"), &cluster), 0);
        assert_eq!(o.priority(Some("other"), None, &cluster), 0);
    }
}
