//! Fixture builders: `PodInfo::test("a").ip("10.0.0.1").ready()`,
//! `PoolSpec::test("llama")`, `PolicySpec::test("p", "llama")`,
//! `ObjectiveSpec::test("chat", "llama").priority(10)`. Everything defaults
//! to namespace `ml` and the label `app=llama`.

use kvroute_core::keys::KeyMode;

use crate::index::{ObjectiveSpec, PodInfo, PolicySpec, PoolSpec};

pub(crate) const NS: &str = "ml";

impl PodInfo {
    /// Pod `name` in `ml`, labelled `app=llama`: Pending, no IP.
    pub(crate) fn test(name: &str) -> Self {
        PodInfo {
            namespace: NS.into(),
            name: name.into(),
            labels: [("app".to_owned(), "llama".to_owned())].into(),
            ..PodInfo::default()
        }
    }

    pub(crate) fn ip(mut self, ip: &str) -> Self {
        self.ip = Some(ip.parse().unwrap());
        self
    }

    /// Running but not (yet) Ready.
    pub(crate) fn running(mut self) -> Self {
        self.phase_running = true;
        self
    }

    /// Running and Ready.
    pub(crate) fn ready(mut self) -> Self {
        self.phase_running = true;
        self.ready = true;
        self
    }

    /// Its Ready condition went false.
    pub(crate) fn unready(mut self) -> Self {
        self.ready = false;
        self
    }

    /// It has a deletion timestamp.
    pub(crate) fn deleting(mut self) -> Self {
        self.deleting = true;
        self
    }

    pub(crate) fn label(mut self, key: &str, value: &str) -> Self {
        self.labels.insert(key.into(), value.into());
        self
    }

    pub(crate) fn in_namespace(mut self, namespace: &str) -> Self {
        self.namespace = namespace.into();
        self
    }
}

impl PoolSpec {
    /// Pool `name` in `ml`, selecting `app=llama`, target port 8000.
    pub(crate) fn test(name: &str) -> Self {
        PoolSpec {
            namespace: NS.into(),
            name: name.into(),
            selector: [("app".to_owned(), "llama".to_owned())].into(),
            target_ports: vec![8000],
            ..PoolSpec::default()
        }
    }

    /// Replaces the selector with the one label `key=value`.
    pub(crate) fn selector(mut self, key: &str, value: &str) -> Self {
        self.selector = [(key.to_owned(), value.to_owned())].into();
        self
    }

    /// Adds `key=value` to the selector.
    pub(crate) fn also_select(mut self, key: &str, value: &str) -> Self {
        self.selector.insert(key.into(), value.into());
        self
    }

    pub(crate) fn target_ports(mut self, ports: &[u16]) -> Self {
        self.target_ports = ports.to_vec();
        self
    }
}

impl PolicySpec {
    /// Policy `name` in `ml` targeting pool `target`, created at 1000,
    /// generation 1, everything else default.
    pub(crate) fn test(name: &str, target: &str) -> Self {
        PolicySpec {
            namespace: NS.into(),
            name: name.into(),
            created: 1000,
            generation: 1,
            target_pool: target.into(),
            ..PolicySpec::default()
        }
    }

    pub(crate) fn created(mut self, created: i64) -> Self {
        self.created = created;
        self
    }

    pub(crate) fn generation(mut self, generation: i64) -> Self {
        self.generation = generation;
        self
    }

    pub(crate) fn policy(mut self, policy: &str) -> Self {
        self.policy = Some(policy.into());
        self
    }

    pub(crate) fn key_mode(mut self, mode: KeyMode) -> Self {
        self.key_mode = Some(mode);
        self
    }

    pub(crate) fn cache_port(mut self, port: u16) -> Self {
        self.cache_port = Some(port);
        self
    }

    pub(crate) fn latency_slack(mut self, slack: f64) -> Self {
        self.latency_slack = Some(slack);
        self
    }
}

impl ObjectiveSpec {
    /// Objective `name` in `ml` for pool `pool`, priority 0.
    pub(crate) fn test(name: &str, pool: &str) -> Self {
        ObjectiveSpec {
            namespace: NS.into(),
            name: name.into(),
            pool: Some(pool.into()),
            priority: 0,
        }
    }

    pub(crate) fn priority(mut self, priority: i32) -> Self {
        self.priority = priority;
        self
    }

    /// Its `poolRef` names another kind of object: no pool.
    pub(crate) fn no_pool(mut self) -> Self {
        self.pool = None;
        self
    }

    pub(crate) fn in_namespace(mut self, namespace: &str) -> Self {
        self.namespace = namespace.into();
        self
    }
}
