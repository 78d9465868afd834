//! The CRD's spelling of the core's enums: PascalCase (`Shared`), where the
//! core and the router's YAML spell them lowercase (`shared`). One Rust enum
//! in two formats: the CRD's fields choose this spelling with
//! `#[serde(with = "super::spelling::pascal_case")]` and describe it with
//! `#[schemars(schema_with = "...")]`.
//!
//! Not here: what the values mean (the core's docs say).

use kvroute_core::spec::{DisaggregationMode, TenancyMode};
use schemars::{Schema, SchemaGenerator, json_schema};

/// A core enum with every value and a lowercase name for each.
pub(super) trait Named: Copy + 'static {
    /// Every value, in the order the schema lists them.
    const ALL: &'static [Self];
    /// The value's name as the core spells it.
    fn name(self) -> &'static str;
}

impl Named for TenancyMode {
    const ALL: &'static [Self] = &TenancyMode::ALL;

    fn name(self) -> &'static str {
        self.as_str()
    }
}

impl Named for DisaggregationMode {
    const ALL: &'static [Self] = &DisaggregationMode::ALL;

    fn name(self) -> &'static str {
        self.as_str()
    }
}

/// `name` with its first letter in upper case (`shared` → `Shared`).
fn pascal(name: &str) -> String {
    let mut chars = name.chars();
    chars
        .next()
        .map(|first| first.to_ascii_uppercase().to_string() + chars.as_str())
        .unwrap_or_default()
}

/// Every value of `T`, as the CRD spells it.
fn names<T: Named>() -> Vec<String> {
    T::ALL.iter().map(|v| pascal(v.name())).collect()
}

/// Serde's `with` module of a core enum in the CRD's spelling.
pub(super) mod pascal_case {
    use serde::de::Error as _;
    use serde::{Deserialize, Deserializer, Serializer};

    use super::{Named, pascal};

    pub(in crate::api) fn serialize<T: Named, S: Serializer>(
        value: &T,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        s.serialize_str(&pascal(value.name()))
    }

    pub(in crate::api) fn deserialize<'de, T: Named, D: Deserializer<'de>>(
        d: D,
    ) -> Result<T, D::Error> {
        let written = String::deserialize(d)?;
        T::ALL
            .iter()
            .copied()
            .find(|v| pascal(v.name()) == written)
            .ok_or_else(|| {
                D::Error::custom(format!(
                    "unknown variant `{written}`, expected one of {}",
                    super::names::<T>()
                        .iter()
                        .map(|n| format!("`{n}`"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ))
            })
    }
}

/// The schema of a [`TenancyMode`] field: a string, one of the modes.
pub(super) fn tenancy_mode(_: &mut SchemaGenerator) -> Schema {
    json_schema!({"type": "string", "enum": names::<TenancyMode>()})
}

/// The schema of a [`DisaggregationMode`] field: a string, one of the
/// modes.
pub(super) fn disaggregation_mode(_: &mut SchemaGenerator) -> Schema {
    json_schema!({"type": "string", "default": "Disabled", "enum": names::<DisaggregationMode>()})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Serialize, serde::Deserialize, Debug, PartialEq)]
    struct Field(#[serde(with = "pascal_case")] TenancyMode);

    #[test]
    fn tenancy_modes_are_pascal_case() {
        assert_eq!(names::<TenancyMode>(), ["Shared", "Salted"]);
        for mode in TenancyMode::ALL {
            let json = serde_json::to_value(Field(mode)).unwrap();
            assert_eq!(json, serde_json::json!(pascal(mode.as_str())));
            assert_eq!(serde_json::from_value::<Field>(json).unwrap(), Field(mode));
        }
        let err = serde_json::from_value::<Field>(serde_json::json!("shared")).unwrap_err();
        assert_eq!(
            err.to_string(),
            "unknown variant `shared`, expected one of `Shared`, `Salted`"
        );
    }
}
