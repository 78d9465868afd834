//! The status the index implies for each pool and policy, as plain structs
//! for the status writer: conditions with a reason and a message, the ready
//! endpoint count, the observed generation.
//!
//! Not here: writing status to the API (the status writer), condition
//! timestamps or Kubernetes condition types.

use kvroute_core::contract::Contract;

use super::{Index, PolicySpec, PoolSpec, WarmupSent};

/// Why a condition has its status. The names follow Gateway API policy
/// attachment (GEP-713) and `InferencePool` status.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    /// The object is valid and in effect.
    Accepted,
    /// The spec is invalid; the message names the field and value.
    Invalid,
    /// The policy's target pool exists.
    TargetFound,
    /// The policy's target pool does not exist.
    TargetNotFound,
    /// An older policy targets the same pool and wins.
    Conflicted,
    /// No other policy wins the policy's target.
    NoConflict,
    /// Everything the pool refers to is resolved.
    ResolvedRefs,
    /// The pool's endpoint picker reference is unsupported or names no
    /// such Service port.
    InvalidExtensionRef,
    /// Every probed engine of the target hashes as the policy says.
    EnginesConsistent,
    /// Some probed engine hashes otherwise: routers give it no cache
    /// credit.
    EnginesInconsistent,
    /// Every warm-up prefix is resolved.
    WarmupReady,
    /// A warm-up prefix's ConfigMap or key does not exist: it is left out.
    WarmupRefNotFound,
}

impl Reason {
    /// The reason as a Kubernetes condition reason (`CamelCase`).
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Accepted => "Accepted",
            Reason::Invalid => "Invalid",
            Reason::TargetFound => "TargetFound",
            Reason::TargetNotFound => "TargetNotFound",
            Reason::Conflicted => "Conflicted",
            Reason::NoConflict => "NoConflict",
            Reason::ResolvedRefs => "ResolvedRefs",
            Reason::InvalidExtensionRef => "InvalidExtensionRef",
            Reason::EnginesConsistent => "EnginesConsistent",
            Reason::EnginesInconsistent => "EnginesInconsistent",
            Reason::WarmupReady => "WarmupReady",
            Reason::WarmupRefNotFound => "WarmupRefNotFound",
        }
    }
}

/// One condition: whether it holds, why, and a message for humans.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Condition {
    /// Whether the condition holds (`True`).
    pub status: bool,
    /// Why.
    pub reason: Reason,
    /// A human-readable explanation.
    pub message: String,
}

impl Condition {
    fn new(status: bool, reason: Reason, message: impl Into<String>) -> Self {
        Condition {
            status,
            reason,
            message: message.into(),
        }
    }
}

/// What an `InferencePool`'s status should say.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolStatus {
    /// The pool's namespace.
    pub namespace: String,
    /// The pool's name.
    pub name: String,
    /// `Accepted`: true unless the spec can select no endpoint (reason
    /// `Invalid`).
    pub accepted: Condition,
    /// `ResolvedRefs`: whether `spec.endpointPickerRef` (when set) names
    /// an existing Service and one of its ports (else reason
    /// `InvalidExtensionRef`); when true, the message names the policy in
    /// effect.
    pub resolved_refs: Condition,
    /// The name of the `CacheRoutingPolicy` in effect; `None` for the
    /// defaults.
    pub policy: Option<String>,
    /// Endpoints that are ready and not draining.
    pub ready_endpoints: u32,
}

/// What a `CacheRoutingPolicy`'s status should say.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PolicyStatus {
    /// The policy's namespace.
    pub namespace: String,
    /// The policy's name.
    pub name: String,
    /// The generation this status describes.
    pub observed_generation: i64,
    /// `Accepted`: true when the policy is in effect. Otherwise the reason
    /// is the first of `Invalid`, `TargetNotFound`, `Conflicted` that
    /// applies.
    pub accepted: Condition,
    /// Whether the target pool exists.
    pub target_found: Condition,
    /// Whether an older valid policy targets the same pool and wins. False
    /// for an invalid policy, which competes for nothing.
    pub conflicted: Condition,
    /// Ready endpoints of the pool the policy is in effect for; 0 when it is
    /// not in effect.
    pub ready_endpoints: u32,
    /// `EnginesConsistent`: whether the serving engines of the target that
    /// the operator probed hash their blocks as the policy says (block
    /// size, algorithm, seed). `None` while the policy is not in effect or
    /// no engine was probed.
    pub engines: Option<Condition>,
    /// `WarmupReady`: whether every prefix of `spec.warmup` is resolved;
    /// when not, the message names each left out by its field. `None`
    /// while the policy has no warm-ups or is not in effect.
    pub warmup: Option<Condition>,
    /// The last warm-up of each prefix to each owner, as routers reported
    /// them, in the order of `spec.warmup.prefixes`; empty while the policy
    /// has no warm-ups or is not in effect.
    pub warmups_sent: Vec<WarmupSent>,
    /// The names of `spec.warmup.prefixes`, in order, while the policy is in
    /// effect.
    pub warmup_prefixes: Vec<String>,
}

impl Index {
    /// The status of pool `namespace/name`; `None` if it does not exist.
    pub fn pool_status(&self, namespace: &str, name: &str) -> Option<PoolStatus> {
        let pool = self.pools.get(namespace, name)?;
        Some(self.status_of_pool(pool))
    }

    /// The status of every pool, by namespace and name.
    pub fn pool_statuses(&self) -> Vec<PoolStatus> {
        self.pools
            .iter()
            .map(|(_, _, pool)| self.status_of_pool(pool))
            .collect()
    }

    /// The status of policy `namespace/name`; `None` if it does not exist.
    pub fn policy_status(&self, namespace: &str, name: &str) -> Option<PolicyStatus> {
        let policy = self.policies.get(namespace, name)?;
        Some(self.status_of_policy(policy))
    }

    /// The status of every policy, by namespace and name.
    pub fn policy_statuses(&self) -> Vec<PolicyStatus> {
        self.policies
            .iter()
            .map(|(_, _, policy)| self.status_of_policy(policy))
            .collect()
    }

    fn status_of_pool(&self, pool: &PoolSpec) -> PoolStatus {
        let accepted = match pool.validate() {
            Ok(()) => Condition::new(true, Reason::Accepted, "kvroute serves the pool"),
            Err(e) => Condition::new(false, Reason::Invalid, e),
        };
        let policy = self
            .attached_policy(&pool.namespace, &pool.name)
            .map(|p| p.name.clone());
        let message = match &policy {
            Some(p) => format!("routing with CacheRoutingPolicy {p}"),
            None => "no CacheRoutingPolicy targets the pool; routing with the defaults".to_owned(),
        };
        let unresolved = pool.picker.as_ref().and_then(|r| {
            r.unresolved(&pool.namespace, self.services.get(&pool.namespace, &r.name))
        });
        let resolved_refs = match unresolved {
            Some(why) => Condition::new(false, Reason::InvalidExtensionRef, why),
            None => Condition::new(true, Reason::ResolvedRefs, message),
        };
        PoolStatus {
            namespace: pool.namespace.clone(),
            name: pool.name.clone(),
            accepted,
            resolved_refs,
            policy,
            ready_endpoints: self.ready_endpoints(&pool.namespace, &pool.name),
        }
    }

    fn status_of_policy(&self, policy: &PolicySpec) -> PolicyStatus {
        let (ns, target) = (&policy.namespace, &policy.target_pool);
        let valid = policy.validate();
        let found = self.pools.get(ns, target).is_some();
        let target_found = if found {
            Condition::new(
                true,
                Reason::TargetFound,
                format!("InferencePool {target} exists"),
            )
        } else {
            let message = format!("InferencePool {target} does not exist in namespace {ns}");
            Condition::new(false, Reason::TargetNotFound, message)
        };
        let winner = self
            .attached_policy(ns, target)
            .filter(|w| valid.is_ok() && w.name != policy.name);
        let conflicted = match winner {
            Some(w) => {
                let message = format!(
                    "CacheRoutingPolicy {} is older and applies to {target}",
                    w.name
                );
                Condition::new(true, Reason::Conflicted, message)
            }
            None => Condition::new(false, Reason::NoConflict, "no other policy wins the target"),
        };
        let accepted = match valid {
            Err(e) => Condition::new(false, Reason::Invalid, e),
            Ok(()) if !found => {
                Condition::new(false, Reason::TargetNotFound, &target_found.message)
            }
            Ok(()) if conflicted.status => {
                Condition::new(false, Reason::Conflicted, &conflicted.message)
            }
            Ok(()) => Condition::new(true, Reason::Accepted, format!("applies to {target}")),
        };
        let (ready_endpoints, engines, warmup, warmups_sent, warmup_prefixes) = if accepted.status {
            let warmup = self.unresolved_warmups(policy).map(|left_out| {
                if left_out.is_empty() {
                    let routers = self.routers(ns, target);
                    let message = format!(
                        "every prefix is sent to the routers; {routers} routers share the warm-ups"
                    );
                    Condition::new(true, Reason::WarmupReady, message)
                } else {
                    let message = format!("left out: {}", left_out.join("; "));
                    Condition::new(false, Reason::WarmupRefNotFound, message)
                }
            });
            let prefixes: Vec<&str> = (policy.warmup.iter())
                .flat_map(|w| w.prefixes.iter().map(|p| p.name.as_str()))
                .collect();
            let sent = (self.warmups_sent.get(&(ns.clone(), target.clone())))
                .map(|r| r.of(&prefixes))
                .unwrap_or_default();
            (
                self.ready_endpoints(ns, target),
                self.engines_of(policy),
                warmup,
                sent,
                prefixes.into_iter().map(str::to_owned).collect(),
            )
        } else {
            (0, None, None, Vec::new(), Vec::new())
        };
        PolicyStatus {
            namespace: ns.clone(),
            name: policy.name.clone(),
            observed_generation: policy.generation,
            accepted,
            target_found,
            conflicted,
            ready_endpoints,
            engines,
            warmup,
            warmups_sent,
            warmup_prefixes,
        }
    }

    /// The `EnginesConsistent` condition of `policy`, in effect for its
    /// target: each probed, serving pod's engine checked against the
    /// policy's hashing. The message names up to five differing pods.
    fn engines_of(&self, policy: &PolicySpec) -> Option<Condition> {
        const NAMED: usize = 5;
        let pool = self.pools.get(&policy.namespace, &policy.target_pool)?;
        let hasher = policy.hasher()?;
        let mut probed = 0;
        let mut differ = Vec::new();
        for (_, pod) in self.pods.in_namespace(&policy.namespace) {
            let Some(engine) = self
                .engine(&pod.namespace, &pod.name)
                .filter(|_| pod.serves() && pool.selects(pod))
            else {
                continue;
            };
            probed += 1;
            if let Contract::Mismatch(fields) = Contract::check(engine, &hasher) {
                let fields: Vec<String> = fields
                    .iter()
                    .map(|m| format!("{} {} (policy {})", m.field, m.engine, m.router))
                    .collect();
                differ.push(format!("{}: {}", pod.name, fields.join(", ")));
            }
        }
        if probed == 0 {
            return None;
        }
        if differ.is_empty() {
            let message =
                format!("all {probed} probed engines hash their blocks as this policy says");
            return Some(Condition::new(true, Reason::EnginesConsistent, message));
        }
        let mut message = format!(
            "{} of {probed} probed engines hash their blocks otherwise, so routers give them no cache credit: {}",
            differ.len(),
            differ[..differ.len().min(NAMED)].join("; ")
        );
        if differ.len() > NAMED {
            message.push_str(&format!("; and {} more", differ.len() - NAMED));
        }
        Some(Condition::new(false, Reason::EnginesInconsistent, message))
    }

    /// Routers in pool `namespace/name`'s published state.
    fn routers(&self, namespace: &str, name: &str) -> usize {
        (self.states.get(namespace, name)).map_or(0, |tx| tx.borrow().routers.len())
    }

    /// Ready, non-draining endpoints in pool `namespace/name`'s published
    /// state.
    fn ready_endpoints(&self, namespace: &str, name: &str) -> u32 {
        self.states.get(namespace, name).map_or(0, |tx| {
            let count = tx
                .borrow()
                .endpoints
                .iter()
                .filter(|e| e.ready && !e.draining)
                .count();
            u32::try_from(count).unwrap_or(u32::MAX)
        })
    }
}
