//! `PoolSpec`, the index's view of an `InferencePool`: which pods it selects
//! and which of their ports are endpoints.
//!
//! Not here: converting the `InferencePool` object (the watchers do that),
//! or building endpoints ([`super::pods`]).

use std::collections::BTreeMap;

use super::observed::Observed;
use super::pods::PodInfo;
use super::services::PickerRef;
use crate::api::InferencePoolStatus;

/// What the index needs of an `InferencePool`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PoolSpec {
    /// The pool's namespace; it selects pods of this namespace only.
    pub namespace: String,
    /// The pool's name.
    pub name: String,
    /// `spec.selector.matchLabels`: a pod is in the pool when it carries
    /// every one of these labels with the same value. An empty selector
    /// selects no pod (the CRD requires at least one label; selecting every
    /// pod of the namespace would be a dangerous reading of a broken spec).
    pub selector: BTreeMap<String, String>,
    /// `spec.targetPorts[].number`: every selected pod is one endpoint per
    /// port. Zeros and duplicates are ignored.
    pub target_ports: Vec<u16>,
    /// `spec.endpointPickerRef`, resolved in the pool's status.
    pub picker: Option<PickerRef>,
    /// `metadata.generation`, reported back as the conditions'
    /// `observedGeneration`.
    pub generation: i64,
    /// The object as last watched, for the status writer.
    pub observed: Observed<InferencePoolStatus>,
}

impl PoolSpec {
    /// Whether `pod` is in the pool: same namespace, every selector label.
    pub fn selects(&self, pod: &PodInfo) -> bool {
        pod.namespace == self.namespace
            && !self.selector.is_empty()
            && self
                .selector
                .iter()
                .all(|(k, v)| pod.labels.get(k) == Some(v))
    }

    /// The usable target ports: sorted, without zeros or duplicates.
    pub fn ports(&self) -> Vec<u16> {
        let mut ports: Vec<u16> = self
            .target_ports
            .iter()
            .copied()
            .filter(|&p| p != 0)
            .collect();
        ports.sort_unstable();
        ports.dedup();
        ports
    }

    /// Why the pool can have no endpoints, if its spec says so: an empty
    /// selector, or no usable target port.
    pub fn validate(&self) -> Result<(), String> {
        if self.selector.is_empty() {
            return Err("the selector has no labels, so it selects no pod".to_owned());
        }
        if self.ports().is_empty() {
            return Err(format!(
                "target ports {:?}: need at least one port from 1 to 65535",
                self.target_ports
            ));
        }
        Ok(())
    }
}
