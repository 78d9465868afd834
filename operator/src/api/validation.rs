//! The Rust side of the CRD schemas' rules: the error a `validate()` method
//! returns, and the syntax checks behind the `pattern`s the schemas carry.
//!
//! The API server enforces the schema on everything it stores, so these checks
//! matter for objects it did not validate: ones built in tests, read from
//! files, or stored before the CRD carried a rule. Each check mirrors one rule
//! of the generated schema and is no stricter.
//!
//! Not here: the rules themselves per type (each type's `validate()`), or
//! anything the schema cannot express (conflicts between policies, whether a
//! target exists: those are the index's).

use std::fmt::Display;

/// An object breaks a rule of its schema. Names the field (a JSON path such
/// as `spec.targetPorts[1].number`), the bad value and the rule.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {value} {rule}")]
pub struct ValidationError {
    /// JSON path of the offending field, from the object's root, e.g.
    /// `spec.selector.matchLabels`.
    pub field: String,
    /// The offending value as it appears in the object, or a summary of it
    /// for a collection (e.g. `9 items`).
    pub value: String,
    /// The rule the value breaks, e.g. `must be 1 to 65535`.
    pub rule: String,
}

impl ValidationError {
    /// An error for `field` holding `value`, which breaks `rule`.
    pub fn new(field: impl Into<String>, value: impl Display, rule: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            value: value.to_string(),
            rule: rule.into(),
        }
    }
}

/// `value` of `field` within `min..=max` (NaN is not).
pub(crate) fn check_range<T: PartialOrd + Display>(
    field: &str,
    value: T,
    min: T,
    max: T,
) -> Result<(), ValidationError> {
    if !(value >= min && value <= max) {
        return Err(ValidationError::new(
            field,
            value,
            format!("must be {min} to {max}"),
        ));
    }
    Ok(())
}

/// A collection of `len` items (or entries) in `field` holds `min..=max`.
pub(crate) fn check_count(
    field: &str,
    len: usize,
    min: usize,
    max: usize,
    noun: &str,
) -> Result<(), ValidationError> {
    if len < min || len > max {
        return Err(ValidationError::new(
            field,
            format!("{len} {noun}"),
            format!("must have {min} to {max} {noun}"),
        ));
    }
    Ok(())
}

/// A string `value` of `field` matches `is_valid` and is `min_len..=max_len`
/// bytes long; `syntax` describes the pattern for the error.
pub(crate) fn check_string(
    field: &str,
    value: &str,
    min_len: usize,
    max_len: usize,
    is_valid: fn(&str) -> bool,
    syntax: &str,
) -> Result<(), ValidationError> {
    if value.len() < min_len || value.len() > max_len {
        return Err(ValidationError::new(
            field,
            format!("{value:?}"),
            format!("must be {min_len} to {max_len} characters long"),
        ));
    }
    if !is_valid(value) {
        return Err(ValidationError::new(
            field,
            format!("{value:?}"),
            format!("must be {syntax}"),
        ));
    }
    Ok(())
}

/// Pattern of an API group: empty (the core group) or an RFC 1123 subdomain.
pub(crate) const GROUP_PATTERN: &str =
    r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$";
/// Pattern of a kind: a letter, then letters, digits and dashes, not ending
/// in a dash.
pub(crate) const KIND_PATTERN: &str = r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$";
/// Pattern of a namespace: an RFC 1123 label.
pub(crate) const NAMESPACE_PATTERN: &str = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$";
/// Pattern of a label value: empty, or alphanumerics at both ends with `-`,
/// `_` and `.` between.
pub(crate) const LABEL_VALUE_PATTERN: &str = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$";
/// Pattern of a controller name: a subdomain, `/`, a path.
pub(crate) const CONTROLLER_NAME_PATTERN: &str = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*\/[A-Za-z0-9\/\-._~%!$&'()*+,;=:]+$";
/// Pattern of an HTTP header name: an RFC 7230 token.
pub(crate) const HEADER_NAME_PATTERN: &str = r"^[A-Za-z0-9!#$%&'*+\-.^_`|~]+$";

/// [`GROUP_PATTERN`].
pub(crate) fn is_group(s: &str) -> bool {
    s.is_empty() || s.split('.').all(is_dns_label)
}

/// [`KIND_PATTERN`].
pub(crate) fn is_kind(s: &str) -> bool {
    let b = s.as_bytes();
    b.first().is_some_and(u8::is_ascii_alphabetic)
        && b.last().is_some_and(u8::is_ascii_alphanumeric)
        && b.iter().all(|c| c.is_ascii_alphanumeric() || *c == b'-')
}

/// [`NAMESPACE_PATTERN`], and an RFC 1123 label within a subdomain.
pub(crate) fn is_dns_label(s: &str) -> bool {
    let b = s.as_bytes();
    b.first()
        .is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
        && b.last()
            .is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
}

/// [`LABEL_VALUE_PATTERN`].
pub(crate) fn is_label_value(s: &str) -> bool {
    let b = s.as_bytes();
    b.is_empty()
        || (b[0].is_ascii_alphanumeric()
            && b[b.len() - 1].is_ascii_alphanumeric()
            && b.iter()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.')))
}

/// Any string: for fields whose schema bounds only the length.
pub(crate) fn any(_: &str) -> bool {
    true
}

/// [`HEADER_NAME_PATTERN`].
pub(crate) fn is_header_name(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|c| c.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&c))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn syntax_checks_agree_with_the_patterns_on_examples() {
        assert!(is_group(""));
        assert!(is_group("inference.networking.k8s.io"));
        assert!(!is_group("example.com/bar"));
        assert!(!is_group("Example.com"));
        assert!(!is_group("example..com"));
        assert!(is_kind("Service"));
        assert!(!is_kind("invalid/kind"));
        assert!(!is_kind("9Service"));
        assert!(!is_kind("Service-"));
        assert!(is_label_value(""));
        assert!(is_label_value("123-my.value_X"));
        assert!(!is_label_value("-value"));
        assert!(!is_label_value("has space"));
        assert!(is_header_name("x-tenant-id"));
        assert!(!is_header_name("x tenant"));
        assert!(!is_header_name(""));
    }

    #[test]
    fn errors_name_the_field_value_and_rule() {
        let err = check_range("spec.targetPorts[0].number", 0, 1, 65535).unwrap_err();
        assert_eq!(
            err.to_string(),
            "spec.targetPorts[0].number: 0 must be 1 to 65535"
        );
    }
}
