//! What an endpoint does in a disaggregated pool: prefill, decode or both
//! (the default). Prefill-capable endpoints are `prefill` and `both`;
//! decode-capable ones `decode` and `both`. Discovery gives the role: the
//! static file's `role:`, or the pod label [`LABEL`] (llm-d's
//! [`LLM_D_LABEL`] values are accepted too).

use std::collections::BTreeMap;

/// kvroute's pod label naming an endpoint's role.
pub const LABEL: &str = "kvroute.dev/role";

/// llm-d's pod label naming the same (`prefill`, `decode`, `both`).
pub const LLM_D_LABEL: &str = "llm-d.ai/role";

/// An endpoint's role.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Role {
    /// Prefills and decodes: an ordinary engine.
    #[default]
    Both,
    /// Prefills for decode endpoints (vLLM's `kv_producer`).
    Prefill,
    /// Decodes what prefill endpoints computed (vLLM's `kv_consumer`).
    Decode,
}

impl Role {
    /// Whether it can prefill a disaggregated request.
    pub fn prefills(self) -> bool {
        self != Role::Decode
    }

    /// Whether it can decode one (and take ordinary requests).
    pub fn decodes(self) -> bool {
        self != Role::Prefill
    }

    /// Its name: `both`, `prefill` or `decode`.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Both => "both",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }

    /// The role a pod's labels give: [`LABEL`], else [`LLM_D_LABEL`], else
    /// `both`. An unknown value is the error, with the label's name.
    pub fn from_labels(labels: &BTreeMap<String, String>) -> Result<Role, (&'static str, String)> {
        for label in [LABEL, LLM_D_LABEL] {
            if let Some(value) = labels.get(label) {
                return value.parse().map_err(|()| (label, value.clone()));
            }
        }
        Ok(Role::Both)
    }
}

impl std::str::FromStr for Role {
    type Err = ();

    fn from_str(s: &str) -> Result<Self, ()> {
        match s {
            "both" => Ok(Role::Both),
            "prefill" => Ok(Role::Prefill),
            "decode" => Ok(Role::Decode),
            _ => Err(()),
        }
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn kvroutes_label_wins_then_llm_ds_then_both() {
        assert_eq!(Role::from_labels(&labels(&[])), Ok(Role::Both));
        assert_eq!(
            Role::from_labels(&labels(&[(LLM_D_LABEL, "prefill")])),
            Ok(Role::Prefill)
        );
        assert_eq!(
            Role::from_labels(&labels(&[(LABEL, "decode"), (LLM_D_LABEL, "prefill")])),
            Ok(Role::Decode)
        );
        assert_eq!(
            Role::from_labels(&labels(&[(LABEL, "Prefill")])),
            Err((LABEL, "Prefill".to_owned()))
        );
        assert!(Role::Both.prefills() && Role::Both.decodes());
        assert!(!Role::Prefill.decodes() && !Role::Decode.prefills());
    }
}
