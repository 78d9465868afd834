//! `ServiceInfo`, the index's view of a Service: what resolving a pool's
//! `spec.endpointPickerRef` needs (the Service exists, its type, its ports).
//!
//! Not here: converting `Service` objects (the watchers do that), or the
//! pool status that reads them ([`super::status`]).

/// What the index needs of a Service.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServiceInfo {
    /// The Service's namespace.
    pub namespace: String,
    /// The Service's name.
    pub name: String,
    /// `spec.ports[].port`.
    pub ports: Vec<u16>,
    /// `spec.type` is `ExternalName`, which a picker reference may not name.
    pub external_name: bool,
}

/// A pool's `spec.endpointPickerRef`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PickerRef {
    /// API group; empty for the core group.
    pub group: String,
    /// Kind; `Service` is the only one kvroute resolves.
    pub kind: String,
    /// Name, in the pool's namespace.
    pub name: String,
    /// The Service port; `None` when absent or out of range.
    pub port: Option<u16>,
}

impl PickerRef {
    /// Why the reference does not resolve against `service` (the Service
    /// of its name, if one exists); `None` when it does.
    pub fn unresolved(&self, namespace: &str, service: Option<&ServiceInfo>) -> Option<String> {
        if !self.group.is_empty() || self.kind != "Service" {
            let group = if self.group.is_empty() {
                "core"
            } else {
                &self.group
            };
            return Some(format!(
                "endpointPickerRef: kind {} of group {group} is not supported; name a core Service",
                self.kind
            ));
        }
        let Some(service) = service else {
            return Some(format!(
                "endpointPickerRef: Service {} does not exist in namespace {namespace}",
                self.name
            ));
        };
        if service.external_name {
            return Some(format!(
                "endpointPickerRef: Service {} is of type ExternalName, which is not supported",
                self.name
            ));
        }
        match self.port {
            Some(port) if service.ports.contains(&port) => None,
            Some(port) => Some(format!(
                "endpointPickerRef: Service {} has no port {port} (it has {:?})",
                self.name, service.ports
            )),
            None => Some("endpointPickerRef: a Service reference needs port.number".to_owned()),
        }
    }
}
