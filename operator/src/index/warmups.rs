//! A policy's warm-ups as routers receive them: each `configMapRef`
//! resolved from the ConfigMaps the operator watches (those labelled
//! [`WARMUP_SELECTOR`]), the key's text becoming the prefix's one
//! system message. A prefix whose reference does not resolve is left out
//! (the others are still warmed) and named in the policy's `WarmupReady`
//! condition.
//!
//! Also who may report warm-ups sent ([`reporter`]): only the pool's own
//! routers, each from its pod's address.
//!
//! Not here: the rules a warm-up spec must follow (the core's
//! [`Warmup::validate`], through [`super::PolicySpec::validate`]).

use std::collections::{BTreeMap, HashSet};
use std::net::IpAddr;

use kvroute_core::warmup::{Prefix, Warmup};

use super::pods::PodInfo;
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

/// One warm-up a router reported sending: the last to its owner.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WarmupSent {
    /// The prefix's name.
    pub prefix: String,
    /// The owner endpoint it went to.
    pub endpoint: String,
    /// When, Unix milliseconds.
    pub unix_ms: u64,
    /// The router that sent it.
    pub router: String,
}

/// A pool's reported warm-ups: the last per prefix and owner, newest kept.
#[derive(Debug, Default)]
pub(super) struct Reported(BTreeMap<(String, String), (u64, String)>);

impl Reported {
    /// Takes `sent` from `router`, keeping only the prefixes in `prefixes`
    /// and the endpoints in `endpoints` (what is gone is dropped too), so
    /// the map stays within prefixes × endpoints. How many entries were
    /// known, and whether anything changed.
    pub(super) fn record(
        &mut self,
        router: &str,
        sent: Vec<(String, String, u64)>,
        prefixes: &[&str],
        endpoints: &[&str],
    ) -> (usize, bool) {
        let (prefixes, endpoints): (HashSet<&str>, HashSet<&str>) = (
            prefixes.iter().copied().collect(),
            endpoints.iter().copied().collect(),
        );
        let known = |prefix: &str, endpoint: &str| {
            prefixes.contains(prefix) && endpoints.contains(endpoint)
        };
        let before = self.0.len();
        self.0.retain(|(p, e), _| known(p, e));
        let mut changed = self.0.len() != before;
        let mut taken = 0;
        for (prefix, endpoint, unix_ms) in sent {
            if !known(&prefix, &endpoint) {
                continue;
            }
            taken += 1;
            let entry = self.0.entry((prefix, endpoint)).or_default();
            if unix_ms > entry.0 {
                *entry = (unix_ms, router.to_owned());
                changed = true;
            }
        }
        (taken, changed)
    }

    /// The entries for `prefixes` (in their order), then by endpoint.
    pub(super) fn of(&self, prefixes: &[&str]) -> Vec<WarmupSent> {
        let mut out = Vec::new();
        for &prefix in prefixes {
            let from = (prefix.to_owned(), String::new());
            let entries = self.0.range(from..).take_while(|((p, _), _)| p == prefix);
            out.extend(
                entries.map(|((p, endpoint), (unix_ms, router))| WarmupSent {
                    prefix: p.clone(),
                    endpoint: endpoint.clone(),
                    unix_ms: *unix_ms,
                    router: router.clone(),
                }),
            );
        }
        out
    }
}

/// Why a warm-up report was refused; [`Self::reason`] is its label in
/// `kvroute_operator_warmup_reports_refused_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum WarmupRefused {
    /// The pool's state names no router by the report's name.
    #[error("the pool's state names no ready router by that name")]
    UnknownRouter,
    /// The named router's pod is not at the address the report came from.
    #[error("the report does not come from the named router pod's address")]
    WrongAddress,
}

impl WarmupRefused {
    /// The metric's `reason` label.
    pub fn reason(self) -> &'static str {
        match self {
            WarmupRefused::UnknownRouter => "unknown_router",
            WarmupRefused::WrongAddress => "wrong_address",
        }
    }
}

/// Whether a report naming `router`, from `peer`, is believed for pool
/// `namespace/pool`. Status is what users and tools read as what the
/// routers did, so a report is believed only when:
///
/// 1. the pool's state names `router` (`named`, the sorted names of its
///    ready router pods): anyone else's is refused, `UnknownRouter`;
/// 2. it comes from the IP of that router pod (`status.podIP`; pods
///    connect from it): a caller that only knows a router's name, or a
///    report whose address is unknown, is refused, `WrongAddress`.
///
/// The cheap check on names comes first, so a flood of made-up names
/// costs no scan of the pods.
pub(super) fn reporter<'a>(
    named: &[String],
    mut pods: impl Iterator<Item = &'a PodInfo>,
    (namespace, pool): (&str, &str),
    router: &str,
    peer: Option<IpAddr>,
) -> Result<(), WarmupRefused> {
    if named.binary_search_by(|n| n.as_str().cmp(router)).is_err() {
        return Err(WarmupRefused::UnknownRouter);
    }
    // An IPv4 client of a dual-stack listener shows as `::ffff:a.b.c.d`.
    let peer = peer.map(|ip| ip.to_canonical());
    let at_peer = |p: &PodInfo| {
        p.name == router
            && p.serves()
            && p.router_for() == Some((namespace, pool))
            && p.ip.map(|ip| ip.to_canonical()) == peer
    };
    if peer.is_some() && pods.any(at_peer) {
        Ok(())
    } else {
        Err(WarmupRefused::WrongAddress)
    }
}
