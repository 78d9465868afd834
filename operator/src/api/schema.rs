//! Hand-written schemas for the fields `#[derive(JsonSchema)]` cannot
//! describe on its own: a label map with bounds on its entries, and lists of
//! `metav1.Condition` (k8s-openapi's types carry no `JsonSchema` here).
//!
//! Used through `#[schemars(schema_with = "...")]` on the field; the field's
//! doc comment still becomes the description.

use schemars::{Schema, SchemaGenerator, json_schema};

use super::validation::LABEL_VALUE_PATTERN;

/// Most conditions a status list holds (upstream's bound for `InferencePool`,
/// kept for `CacheRoutingPolicy`).
pub(crate) const MAX_CONDITIONS: usize = 8;

/// A `matchLabels` map: 1 to 64 entries, each value a label value.
pub(crate) fn match_labels(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "object",
        "minProperties": super::inference_pool::MIN_LABELS,
        "maxProperties": super::inference_pool::MAX_LABELS,
        "additionalProperties": {
            "type": "string",
            "description": "A label value: at most 63 characters, empty or alphanumerics at both ends with '-', '_' and '.' between.",
            "maxLength": 63,
            "pattern": LABEL_VALUE_PATTERN,
        },
    })
}

/// A `metav1.Time`: an RFC 3339 date-time.
pub(crate) fn date_time(_: &mut SchemaGenerator) -> Schema {
    json_schema!({ "type": "string", "format": "date-time" })
}

/// A list of `metav1.Condition`, one per type (a list map keyed by `type`),
/// at most [`MAX_CONDITIONS`].
pub(crate) fn conditions(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "array",
        "maxItems": MAX_CONDITIONS,
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["type"],
        "items": {
            "type": "object",
            "description": "One aspect of the object's current state (metav1.Condition).",
            "required": ["lastTransitionTime", "message", "reason", "status", "type"],
            "properties": {
                "lastTransitionTime": {
                    "type": "string",
                    "format": "date-time",
                    "description": "When the status last changed.",
                },
                "message": {
                    "type": "string",
                    "maxLength": 32768,
                    "description": "Human-readable details; may be empty.",
                },
                "observedGeneration": {
                    "type": "integer",
                    "format": "int64",
                    "minimum": 0,
                    "description": "The metadata.generation the condition was computed from.",
                },
                "reason": {
                    "type": "string",
                    "minLength": 1,
                    "maxLength": 1024,
                    "pattern": "^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$",
                    "description": "Why the status last changed, in CamelCase.",
                },
                "status": {
                    "type": "string",
                    "enum": ["True", "False", "Unknown"],
                    "description": "True, False or Unknown.",
                },
                "type": {
                    "type": "string",
                    "maxLength": 316,
                    "pattern": "^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$",
                    "description": "The condition's type, in CamelCase or as domain/CamelCase.",
                },
            },
        },
    })
}
