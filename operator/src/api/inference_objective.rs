//! `InferenceObjective` (`inference.networking.x-k8s.io/v1alpha2`): the
//! Gateway API Inference Extension's serving objective of the requests that
//! name it (by its metadata name, in their `x-gateway-inference-objective`
//! header), which today is a priority within one `InferencePool`.
//!
//! Field names, optionality, defaults and limits follow upstream's
//! `apix/v1alpha2/inferenceobjective_types.go` (the release where
//! `priority` replaced `criticality`), so manifests written for that project
//! apply unchanged. The API is alpha upstream: a cluster may not have the
//! CRD at all, and the operator works without it (see [`crate::watch`]).
//!
//! Two readings of upstream's schema are kvroute's own:
//! - `priority` is any integer there (a Go `int`); kvroute holds it as an
//!   `i32`, as routers receive it, so an object with a priority outside
//!   `i32` cannot be read (the watcher counts it as a decode error).
//! - A `poolRef` whose group or kind is not the `InferencePool`'s
//!   (`inference.networking.k8s.io`, `InferencePool`; an empty group reads
//!   as the default) names no pool kvroute serves; the conversion
//!   ([`crate::convert::objective`]) attaches such an objective to no pool.
//!
//! Not here: which pool's state carries an objective (the index), or any
//! status (kvroute writes none for objectives).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::CustomResource;
use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::{Deserialize, Serialize};

use super::validation::{
    GROUP_PATTERN, KIND_PATTERN, ValidationError, check_string, is_group, is_kind,
};

/// The group a `poolRef` names when it leaves `group` out.
pub const POOL_GROUP: &str = "inference.networking.k8s.io";
/// The kind a `poolRef` names when it leaves `kind` out.
pub const POOL_KIND: &str = "InferencePool";

/// Desired serving objective of the requests that name this object.
// Clippy reads the printer columns' repeated `type_ = "string"` as duplicated
// attributes; they are arguments of different columns.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "inference.networking.x-k8s.io",
    version = "v1alpha2",
    kind = "InferenceObjective",
    namespaced,
    status = "InferenceObjectiveStatus",
    derive = "PartialEq",
    doc = "InferenceObjective is the serving objective (a priority) of the requests to one InferencePool that name it in their x-gateway-inference-objective header (Gateway API Inference Extension, alpha).",
    printcolumn(
        name = "Inference Pool",
        type_ = "string",
        description = "The InferencePool the objective applies to.",
        json_path = ".spec.poolRef.name"
    ),
    printcolumn(
        name = "Priority",
        type_ = "string",
        description = "The requests' priority; unset means 0.",
        json_path = ".spec.priority"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct InferenceObjectiveSpec {
    /// How important the requests are against other requests of the same
    /// pool: higher is served first when requests must wait; negative values
    /// are allowed. Unset means 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "integer")]
    pub priority: Option<i32>,

    /// The InferencePool, in the objective's namespace, whose requests this
    /// objective applies to.
    pub pool_ref: PoolObjectReference,
}

/// A reference to a pool in the objective's namespace.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct PoolObjectReference {
    /// API group of the referent; defaults to inference.networking.k8s.io.
    #[serde(default = "default_pool_group")]
    #[schemars(length(max = 253), pattern(GROUP_PATTERN))]
    pub group: String,

    /// Kind of the referent; defaults to InferencePool.
    #[serde(default = "default_pool_kind")]
    #[schemars(length(min = 1, max = 63), pattern(KIND_PATTERN))]
    pub kind: String,

    /// Name of the referent.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
}

fn default_pool_group() -> String {
    POOL_GROUP.to_owned()
}

fn default_pool_kind() -> String {
    POOL_KIND.to_owned()
}

impl PoolObjectReference {
    /// The name of the `InferencePool` this references; `None` when it
    /// references another group or kind (an empty group reads as the
    /// default).
    pub fn pool(&self) -> Option<&str> {
        let group = if self.group.is_empty() {
            POOL_GROUP
        } else {
            &self.group
        };
        (group == POOL_GROUP && self.kind == POOL_KIND).then_some(self.name.as_str())
    }
}

/// Observed state of an `InferenceObjective`; kvroute writes none.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct InferenceObjectiveStatus {
    /// Conditions of the objective, one per type (upstream knows Accepted),
    /// at most 8.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "conditions")]
    pub conditions: Vec<Condition>,
}

/// An integer of any size, as upstream's schema has it (no `format`).
fn integer(_: &mut SchemaGenerator) -> Schema {
    json_schema!({ "type": "integer" })
}

/// The conditions list, with upstream's default: one `Ready` condition,
/// `Unknown`, waiting for a controller.
fn conditions(generator: &mut SchemaGenerator) -> Schema {
    let mut schema = super::schema::conditions(generator);
    schema.insert(
        "default".to_owned(),
        serde_json::json!([{
            "lastTransitionTime": "1970-01-01T00:00:00Z",
            "message": "Waiting for controller",
            "reason": "Pending",
            "status": "Unknown",
            "type": "Ready",
        }]),
    );
    schema
}

impl InferenceObjective {
    /// Checks the spec against the rules of the CRD schema; see
    /// [`InferenceObjectiveSpec::validate`].
    pub fn validate(&self) -> Result<(), ValidationError> {
        self.spec.validate()
    }
}

impl InferenceObjectiveSpec {
    /// Checks the rules the CRD schema expresses: a well-formed `poolRef`
    /// (group empty or a subdomain, a kind, a name of 1 to 253 characters).
    /// A reference to something other than an `InferencePool` is valid
    /// here, as upstream; it names no pool kvroute serves. The error names
    /// the offending field and its value.
    pub fn validate(&self) -> Result<(), ValidationError> {
        let r = &self.pool_ref;
        check_string(
            "spec.poolRef.group",
            &r.group,
            0,
            253,
            is_group,
            "empty or an RFC 1123 subdomain",
        )?;
        check_string(
            "spec.poolRef.kind",
            &r.kind,
            1,
            63,
            is_kind,
            "a letter, then letters, digits and '-', not ending in '-'",
        )?;
        check_string(
            "spec.poolRef.name",
            &r.name,
            1,
            253,
            super::validation::any,
            "",
        )
    }
}
