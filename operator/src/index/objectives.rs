//! `ObjectiveSpec`, the index's view of an `InferenceObjective`, and the
//! list of objectives one pool's state carries.
//!
//! Attachment: an objective belongs to the pool of its own namespace that
//! its `poolRef` names; one naming another kind of object (`pool: None`)
//! belongs to none. A pool's list is every objective that belongs to it,
//! sorted by name (the full set, as routers replace theirs with it). There
//! is no conflict rule: two objectives are two names.
//!
//! Memory: one entry per objective in a watched namespace: about 150 bytes
//! of struct and map node, plus its strings (the name twice, as the store's
//! key too); and 30 bytes plus the name in the state of the pool it names.
//!
//! Not here: converting the `InferenceObjective` object (the watchers do
//! that), or when a pool's state is published ([`super::Index`]).

use kvroute_proto::v1;

/// What the index needs of an `InferenceObjective`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ObjectiveSpec {
    /// The objective's namespace; it applies to a pool of this namespace
    /// only.
    pub namespace: String,
    /// The objective's name: what a request's
    /// `x-gateway-inference-objective` header gives.
    pub name: String,
    /// `spec.poolRef.name` when the reference is to an `InferencePool`;
    /// `None` when it names another group or kind (no pool of kvroute's).
    pub pool: Option<String>,
    /// `spec.priority`, 0 when unset.
    pub priority: i32,
}

impl ObjectiveSpec {
    /// Whether the objective applies to pool `name` of its namespace.
    pub fn names(&self, pool: &str) -> bool {
        self.pool.as_deref() == Some(pool)
    }
}

/// The objectives of pool `pool` among `objectives` (those of the pool's
/// namespace, in name order), as its state carries them.
pub(super) fn of_pool<'a>(
    objectives: impl Iterator<Item = &'a ObjectiveSpec>,
    pool: &str,
) -> Vec<v1::Objective> {
    let mut out: Vec<v1::Objective> = objectives
        .filter(|o| o.names(pool))
        .map(|o| v1::Objective {
            name: o.name.clone(),
            priority: o.priority,
        })
        .collect();
    // The store iterates in name order already; sorting states the contract.
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}
