//! `InferencePool` (`inference.networking.k8s.io/v1`): the Gateway API
//! Inference Extension's pool of model-server pods, with its upstream schema,
//! so manifests written for that project apply unchanged.
//!
//! Field names, optionality, defaults and limits follow upstream's
//! `api/v1/inferencepool_types.go` and `shared_types.go` (the release where
//! `endpointPickerRef` became optional and `appProtocol` was added), including
//! its two CEL rules. [`InferencePoolSpec::validate`] checks the same rules in
//! Rust.
//!
//! Not here: what kvroute does with a pool (the index), or which pods it
//! selects (the pod watcher).

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::validation::{
    CONTROLLER_NAME_PATTERN, GROUP_PATTERN, KIND_PATTERN, NAMESPACE_PATTERN, ValidationError,
    check_count, check_range, check_string, is_group, is_kind, is_label_value,
};

/// Fewest labels in `spec.selector.matchLabels`.
pub const MIN_LABELS: usize = 1;
/// Most labels in `spec.selector.matchLabels`.
pub const MAX_LABELS: usize = 64;
/// Fewest entries in `spec.targetPorts`.
pub const MIN_TARGET_PORTS: usize = 1;
/// Most entries in `spec.targetPorts`.
pub const MAX_TARGET_PORTS: usize = 8;
/// Most entries in `status.parents`.
pub const MAX_PARENTS: usize = 32;

/// Condition types and reasons of `status.parents[].conditions`, as upstream
/// defines them.
pub mod conditions {
    /// Condition type: whether the parent accepted the pool.
    pub const ACCEPTED: &str = "Accepted";
    /// Condition type: whether every reference of the pool resolved.
    pub const RESOLVED_REFS: &str = "ResolvedRefs";

    /// `Accepted` reason, status True: the parent supports the pool as a
    /// backend.
    pub const REASON_ACCEPTED: &str = "Accepted";
    /// `Accepted` reason, status False: the parent does not support
    /// `InferencePool` backends.
    pub const REASON_NOT_SUPPORTED_BY_PARENT: &str = "NotSupportedByParent";
    /// `Accepted` reason, status False: a route referring to the pool was
    /// rejected by the parent.
    pub const REASON_HTTP_ROUTE_NOT_ACCEPTED: &str = "HTTPRouteNotAccepted";
    /// `Accepted` reason, status False: the implementation needs an
    /// `endpointPickerRef` and the pool has none.
    pub const REASON_ENDPOINT_PICKER_REF_MISSING: &str = "EndpointPickerRefMissing";
    /// `Accepted` reason, status Unknown: no controller has looked yet.
    pub const REASON_PENDING: &str = "Pending";
    /// `ResolvedRefs` reason, status True.
    pub const REASON_RESOLVED_REFS: &str = "ResolvedRefs";
    /// `ResolvedRefs` reason, status False: the endpoint picker reference is
    /// unsupported or points at nothing.
    pub const REASON_INVALID_EXTENSION_REF: &str = "InvalidExtensionRef";
}

/// Desired state of an `InferencePool`: which pods serve, on which ports, and
/// optionally which endpoint picker a gateway should consult.
#[derive(CustomResource, JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "inference.networking.k8s.io",
    version = "v1",
    kind = "InferencePool",
    namespaced,
    status = "InferencePoolStatus",
    shortname = "infpool",
    derive = "PartialEq",
    doc = "InferencePool is a group of model-server pods serving one base model, selected by labels, that an inference gateway routes to (Gateway API Inference Extension).",
    annotation(
        "api-approved.kubernetes.io",
        "https://github.com/kubernetes-sigs/gateway-api-inference-extension/pull/1173"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct InferencePoolSpec {
    /// Which pods of the pool's namespace are members, by label. Kept as
    /// simple as a Service selector so implementations can translate it into
    /// one.
    pub selector: LabelSelector,

    /// Ports of the member pods that serve inference; each pod and port is a
    /// distinct endpoint (podIP:number).
    #[schemars(
        length(min = 1, max = 8),
        extend(
            "x-kubernetes-list-type" = "atomic",
            "x-kubernetes-validations" = [{
                "message": "port number must be unique",
                "rule": "self.all(p1, self.exists_one(p2, p1.number==p2.number))",
            }],
        )
    )]
    pub target_ports: Vec<Port>,

    /// Application protocol of every target port: http (HTTP/1.1, the
    /// default) or kubernetes.io/h2c (HTTP/2 over cleartext).
    #[serde(default)]
    pub app_protocol: AppProtocol,

    /// The endpoint picker extension a gateway consults for this pool, and
    /// how it behaves when the picker does not answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint_picker_ref: Option<EndpointPickerRef>,
}

/// Selects pods by label, as a Service selector does.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct LabelSelector {
    /// Labels a pod must all carry (1 to 64 of them) to be a member.
    #[schemars(schema_with = "super::schema::match_labels")]
    pub match_labels: BTreeMap<String, String>,
}

/// A network port.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[serde(rename_all = "camelCase")]
pub struct Port {
    /// The port number, 1 to 65535.
    #[schemars(range(min = 1, max = 65535))]
    pub number: i32,
}

/// Application protocol of a pool's target ports.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum AppProtocol {
    /// HTTP/1.1 (`http`), the default.
    #[default]
    #[serde(rename = "http")]
    Http,
    /// HTTP/2 over cleartext (`kubernetes.io/h2c`).
    #[serde(rename = "kubernetes.io/h2c")]
    H2c,
}

impl AppProtocol {
    /// The name as written in manifests.
    pub fn as_str(self) -> &'static str {
        match self {
            AppProtocol::Http => "http",
            AppProtocol::H2c => "kubernetes.io/h2c",
        }
    }
}

/// A reference to an endpoint picker extension and how to use it.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "message": "port is required when kind is 'Service' or unspecified (defaults to 'Service')",
    "rule": "self.kind != 'Service' || has(self.port)",
}]))]
pub struct EndpointPickerRef {
    /// API group of the referent; empty (the default) is the core group.
    #[serde(default)]
    #[schemars(length(max = 253), pattern(GROUP_PATTERN))]
    pub group: String,

    /// Kind of the referent; defaults to Service. ExternalName Services are
    /// not supported.
    #[serde(default = "default_picker_kind")]
    #[schemars(length(min = 1, max = 63), pattern(KIND_PATTERN))]
    pub kind: String,

    /// Name of the referent, in the pool's namespace.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,

    /// Port of the picker; for a Service (required then), the Service port,
    /// not the target port.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<Port>,

    /// What the gateway does when the picker does not answer: FailClose (the
    /// default) drops the request, FailOpen forwards it to an endpoint of the
    /// gateway's choosing.
    #[serde(default)]
    pub failure_mode: FailureMode,
}

fn default_picker_kind() -> String {
    "Service".to_owned()
}

/// What a gateway does when the endpoint picker does not answer.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum FailureMode {
    /// Forward the request to an endpoint of the gateway's choosing.
    FailOpen,
    /// Drop the request (the default).
    #[default]
    FailClose,
}

/// Observed state of an `InferencePool`, per parent (typically a Gateway).
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct InferencePoolStatus {
    /// The pool's status with respect to each parent that uses it, at most 32.
    /// Empty: no parent uses the pool.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32), extend("x-kubernetes-list-type" = "atomic"))]
    pub parents: Vec<ParentStatus>,
}

/// The pool's status as one parent sees it.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ParentStatus {
    /// Conditions of the pool for this parent, one per type: Accepted,
    /// ResolvedRefs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "super::schema::conditions")]
    pub conditions: Vec<Condition>,

    /// The parent this entry describes.
    pub parent_ref: ParentReference,

    /// The controller that wrote this entry, as DOMAIN/PATH (for a Gateway,
    /// its GatewayClass's controllerName).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253), pattern(CONTROLLER_NAME_PATTERN))]
    pub controller_name: Option<String>,
}

/// Identifies a parent of a pool, typically a Gateway.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ParentReference {
    /// API group of the parent; defaults to gateway.networking.k8s.io.
    #[serde(default = "default_parent_group")]
    #[schemars(length(max = 253), pattern(GROUP_PATTERN))]
    pub group: String,

    /// Kind of the parent; defaults to Gateway.
    #[serde(default = "default_parent_kind")]
    #[schemars(length(min = 1, max = 63), pattern(KIND_PATTERN))]
    pub kind: String,

    /// Name of the parent.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,

    /// Namespace of the parent; absent means the pool's namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 63), pattern(NAMESPACE_PATTERN))]
    pub namespace: Option<String>,
}

fn default_parent_group() -> String {
    "gateway.networking.k8s.io".to_owned()
}

fn default_parent_kind() -> String {
    "Gateway".to_owned()
}

impl InferencePool {
    /// Checks the spec against the rules of the CRD schema; see
    /// [`InferencePoolSpec::validate`].
    pub fn validate(&self) -> Result<(), ValidationError> {
        self.spec.validate()
    }
}

impl InferencePoolSpec {
    /// Checks the rules the CRD schema expresses: 1 to 64 selector labels
    /// with valid values, 1 to 8 target ports of 1 to 65535 with unique
    /// numbers, and a well-formed endpoint picker reference (a Service needs
    /// a port). The error names the first offending field (as a path from the
    /// object's root) and its value.
    pub fn validate(&self) -> Result<(), ValidationError> {
        let labels = &self.selector.match_labels;
        check_count(
            "spec.selector.matchLabels",
            labels.len(),
            MIN_LABELS,
            MAX_LABELS,
            "labels",
        )?;
        for (key, value) in labels {
            check_string(
                &format!("spec.selector.matchLabels[{key:?}]"),
                value,
                0,
                63,
                is_label_value,
                "empty or alphanumerics at both ends with '-', '_' and '.' between",
            )?;
        }

        check_count(
            "spec.targetPorts",
            self.target_ports.len(),
            MIN_TARGET_PORTS,
            MAX_TARGET_PORTS,
            "items",
        )?;
        for (i, port) in self.target_ports.iter().enumerate() {
            let field = format!("spec.targetPorts[{i}].number");
            check_range(&field, port.number, 1, 65535)?;
            if let Some(first) = self.target_ports[..i].iter().position(|p| p == port) {
                return Err(ValidationError::new(
                    field,
                    port.number,
                    format!(
                        "duplicates spec.targetPorts[{first}].number: port numbers must be unique"
                    ),
                ));
            }
        }

        if let Some(picker) = &self.endpoint_picker_ref {
            picker.validate("spec.endpointPickerRef")?;
        }
        Ok(())
    }
}

impl EndpointPickerRef {
    /// Checks the reference's fields, naming them under `path`.
    fn validate(&self, path: &str) -> Result<(), ValidationError> {
        check_string(
            &format!("{path}.group"),
            &self.group,
            0,
            253,
            is_group,
            "empty or an RFC 1123 subdomain",
        )?;
        check_string(
            &format!("{path}.kind"),
            &self.kind,
            1,
            63,
            is_kind,
            "a letter, then letters, digits and '-', not ending in '-'",
        )?;
        check_string(
            &format!("{path}.name"),
            &self.name,
            1,
            253,
            super::validation::any,
            "",
        )?;
        match self.port {
            Some(port) => check_range(&format!("{path}.port.number"), port.number, 1, 65535)?,
            None if self.kind == "Service" => {
                return Err(ValidationError::new(
                    format!("{path}.port"),
                    "absent",
                    "is required when kind is 'Service' or unspecified (defaults to 'Service')",
                ));
            }
            None => {}
        }
        Ok(())
    }
}
