//! The fixed table of resource types the fake API server serves.
//!
//! Responsible for naming resources (group, version, plural, kind) and
//! resolving them from URL paths or `apiVersion`/`kind` pairs. Not
//! responsible for storing objects (see `store`).

/// One resource type the fake server knows, e.g. core `v1` `pods`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ResourceType {
    /// API group; empty for the core group.
    pub group: &'static str,
    /// API version within the group.
    pub version: &'static str,
    /// Lower-case plural used in URLs.
    pub plural: &'static str,
    /// Singular name, as in discovery.
    pub singular: &'static str,
    /// `kind` of one object.
    pub kind: &'static str,
    /// Whether objects live in a namespace. Every served type currently does.
    pub namespaced: bool,
}

impl ResourceType {
    /// `apiVersion` of objects of this type: `v1` or `group/version`.
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.to_string()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    /// `kind` of a list of this type.
    pub fn list_kind(&self) -> String {
        format!("{}List", self.kind)
    }
}

/// Every resource type the fake server serves.
pub const RESOURCES: &[ResourceType] = &[
    ResourceType {
        group: "",
        version: "v1",
        plural: "pods",
        singular: "pod",
        kind: "Pod",
        namespaced: true,
    },
    ResourceType {
        group: "",
        version: "v1",
        plural: "services",
        singular: "service",
        kind: "Service",
        namespaced: true,
    },
    ResourceType {
        group: "",
        version: "v1",
        plural: "configmaps",
        singular: "configmap",
        kind: "ConfigMap",
        namespaced: true,
    },
    ResourceType {
        group: "",
        version: "v1",
        plural: "events",
        singular: "event",
        kind: "Event",
        namespaced: true,
    },
    ResourceType {
        group: "coordination.k8s.io",
        version: "v1",
        plural: "leases",
        singular: "lease",
        kind: "Lease",
        namespaced: true,
    },
    ResourceType {
        group: "events.k8s.io",
        version: "v1",
        plural: "events",
        singular: "event",
        kind: "Event",
        namespaced: true,
    },
    ResourceType {
        group: "inference.networking.k8s.io",
        version: "v1",
        plural: "inferencepools",
        singular: "inferencepool",
        kind: "InferencePool",
        namespaced: true,
    },
    ResourceType {
        group: "kvroute.dev",
        version: "v1alpha1",
        plural: "cacheroutingpolicies",
        singular: "cacheroutingpolicy",
        kind: "CacheRoutingPolicy",
        namespaced: true,
    },
    ResourceType {
        group: "inference.networking.x-k8s.io",
        version: "v1alpha2",
        plural: "inferenceobjectives",
        singular: "inferenceobjective",
        kind: "InferenceObjective",
        namespaced: true,
    },
];

/// The resource type served at `group/version/plural`.
pub fn by_path(group: &str, version: &str, plural: &str) -> Option<&'static ResourceType> {
    RESOURCES
        .iter()
        .find(|r| r.group == group && r.version == version && r.plural == plural)
}

/// The resource type of objects with this `apiVersion` and `kind`.
pub fn by_kind(api_version: &str, kind: &str) -> Option<&'static ResourceType> {
    RESOURCES
        .iter()
        .find(|r| r.api_version() == api_version && r.kind == kind)
}

/// The resource types in one `group/version`, for discovery.
pub fn in_group_version(group: &str, version: &str) -> Vec<&'static ResourceType> {
    RESOURCES
        .iter()
        .filter(|r| r.group == group && r.version == version)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolves_both_event_types_by_api_version() {
        assert_eq!(by_kind("v1", "Event").unwrap().group, "");
        assert_eq!(
            by_kind("events.k8s.io/v1", "Event").unwrap().group,
            "events.k8s.io"
        );
        assert!(by_kind("apps/v1", "Deployment").is_none());
        assert_eq!(by_path("", "v1", "pods").unwrap().kind, "Pod");
    }
}
