//! A policy's warm-ups as routers receive them: each `configMapRef`
//! resolved from the ConfigMaps the operator watches (those labelled
//! [`WARMUP_SELECTOR`]), the key's text becoming the prefix's one
//! system message. A prefix whose reference does not resolve is left out
//! (the others are still warmed) and named in the policy's `WarmupReady`
//! condition.
//!
//! Not here: the rules a warm-up spec must follow (the core's
//! [`Warmup::validate`], through [`super::PolicySpec::validate`]).

use std::collections::BTreeMap;

use kvroute_core::warmup::{Prefix, Warmup};

use super::store::Namespaced;

/// The label selector a ConfigMap must match for the operator to watch it.
pub const WARMUP_SELECTOR: &str = "kvroute.dev/warmup=true";
/// The most bytes of one ConfigMap the index keeps (its data, summed): a
/// ConfigMap holds at most 1 MiB.
pub const MAX_CONFIG_MAP_BYTES: usize = 1 << 20;

/// What the index needs of a labelled ConfigMap.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ConfigMapInfo {
    pub namespace: String,
    pub name: String,
    /// `data`, key by key.
    pub data: BTreeMap<String, String>,
}

/// `warmup` (of a policy in `namespace`) with its references resolved
/// from `config_maps`, and why each prefix left out was (a message naming
/// its field).
pub(super) fn resolve(
    warmup: &Warmup,
    namespace: &str,
    config_maps: &Namespaced<ConfigMapInfo>,
) -> (Warmup, Vec<String>) {
    let mut unresolved = Vec::new();
    let mut prefixes = Vec::new();
    for (i, p) in warmup.prefixes.iter().enumerate() {
        let Some(r) = &p.config_map_ref else {
            prefixes.push(p.clone());
            continue;
        };
        let text = match config_maps.get(namespace, &r.name) {
            None => Err(format!(
                "ConfigMap {namespace}/{} labelled {WARMUP_SELECTOR} does not exist",
                r.name
            )),
            Some(map) => map
                .data
                .get(&r.key)
                .ok_or_else(|| format!("ConfigMap {namespace}/{} has no key {:?}", r.name, r.key)),
        };
        match text {
            Ok(text) => prefixes.push(Prefix {
                messages: Some(Prefix::system_message(text)),
                config_map_ref: None,
                ..p.clone()
            }),
            Err(why) => unresolved.push(format!("spec.warmup.prefixes[{i}].configMapRef: {why}")),
        }
    }
    let resolved = Warmup {
        prefixes,
        ..warmup.clone()
    };
    (resolved, unresolved)
}
