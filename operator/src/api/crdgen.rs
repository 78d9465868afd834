//! The CustomResourceDefinitions as installed, and their YAML rendering for
//! the checked-in `crds/` directory (`kvroute-operator crdgen`).
//!
//! Each CRD is the one `#[derive(CustomResource)]` generates, with one change:
//! no `nullable`. The derive marks every `Option` field `nullable: true`;
//! upstream's InferencePool schema has none, so an explicit `null` is pruned
//! (then defaulted) as it is upstream instead of being stored. The Rust types
//! never write `null`: every `Option` is skipped when `None`.
//!
//! Not here: installing CRDs in a cluster (the Helm chart does that).

use std::path::Path;

use anyhow::Context as _;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    CustomResourceDefinition, JSONSchemaProps,
};
use kube::CustomResourceExt;
use serde_json::Value;

use super::{CacheRoutingPolicy, InferenceObjective, InferencePool};

/// The first lines of every rendered CRD file.
const HEADER: &str = "# Generated from the Rust types in operator/src/api by\n\
                      # `cargo run -p kvroute-operator -- crdgen`. Do not edit.\n";

/// One CRD rendered for the `crds/` directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CrdFile {
    /// File name: `<plural>.<group>.yaml`.
    pub file_name: String,
    /// The file's contents: a header comment and the CRD as YAML.
    pub yaml: String,
}

/// Every CRD kvroute defines, as installed: `InferencePool` (upstream's
/// schema), `CacheRoutingPolicy` and `InferenceObjective` (upstream's
/// schema; optional: the operator runs without it).
pub fn crds() -> Vec<CustomResourceDefinition> {
    vec![
        without_nullable(InferencePool::crd()),
        without_nullable(CacheRoutingPolicy::crd()),
        without_nullable(InferenceObjective::crd()),
    ]
}

/// Every CRD of [`crds`], rendered.
pub fn crd_files() -> anyhow::Result<Vec<CrdFile>> {
    crds().iter().map(render).collect()
}

/// Renders `crd` as a [`CrdFile`]. The rendering is stable: struct fields in
/// declaration order, schema properties sorted, descriptions as block
/// scalars; the same types always give the same bytes.
pub fn render(crd: &CustomResourceDefinition) -> anyhow::Result<CrdFile> {
    let name = crd
        .metadata
        .name
        .as_deref()
        .context("CRD without metadata.name")?;
    let body = serde_yaml::to_string(crd).with_context(|| format!("rendering CRD {name}"))?;
    Ok(CrdFile {
        file_name: format!("{name}.yaml"),
        yaml: format!("{HEADER}{body}"),
    })
}

/// Writes every CRD of [`crds`] to `dir` (created if missing), one file each,
/// replacing files of the same name.
pub fn write_crds(dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    for file in crd_files()? {
        let path = dir.join(&file.file_name);
        std::fs::write(&path, &file.yaml).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// `crd` with `nullable` removed from every schema in every version.
fn without_nullable(mut crd: CustomResourceDefinition) -> CustomResourceDefinition {
    for version in &mut crd.spec.versions {
        let Some(schema) = version
            .schema
            .as_mut()
            .and_then(|s| s.open_api_v3_schema.as_mut())
        else {
            continue;
        };
        let mut value = serde_json::to_value(&*schema).expect("a schema serializes");
        strip_nullable(&mut value);
        *schema = serde_json::from_value::<JSONSchemaProps>(value)
            .expect("a schema without nullable is still a schema");
    }
    crd
}

/// Removes `nullable` from the schema `value` and every schema nested in it
/// (not from `default` or `enum` values, which are data).
fn strip_nullable(value: &mut Value) {
    let Value::Object(schema) = value else {
        return;
    };
    schema.remove("nullable");
    for key in ["items", "additionalProperties", "not"] {
        if let Some(sub) = schema.get_mut(key) {
            strip_nullable(sub);
        }
    }
    for key in ["properties", "patternProperties", "definitions"] {
        if let Some(Value::Object(subs)) = schema.get_mut(key) {
            subs.values_mut().for_each(strip_nullable);
        }
    }
    for key in ["allOf", "anyOf", "oneOf"] {
        if let Some(Value::Array(subs)) = schema.get_mut(key) {
            subs.iter_mut().for_each(strip_nullable);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_schema_is_nullable_but_defaults_survive() {
        for file in crd_files().unwrap() {
            assert!(!file.yaml.contains("nullable"), "{}", file.file_name);
            assert!(file.yaml.contains("default:"), "{}", file.file_name);
        }
    }

    #[test]
    fn file_names_are_plural_dot_group() {
        let names: Vec<String> = crd_files()
            .unwrap()
            .into_iter()
            .map(|f| f.file_name)
            .collect();
        assert_eq!(
            names,
            [
                "inferencepools.inference.networking.k8s.io.yaml",
                "cacheroutingpolicies.kvroute.dev.yaml",
                "inferenceobjectives.inference.networking.x-k8s.io.yaml",
            ]
        );
    }
}
