//! Routing keys: the identity a request is placed by when no endpoint holds
//! its prefix yet.
//!
//! A key comes from the conversation (`prompt_cache_key` or a configured
//! header), from the first K prompt tokens, or from the tenant. When tenancy
//! is salted, every key is scoped by the tenant, so two tenants never share a
//! key (and so never share the endpoint a key pins them to).
//!
//! Keys are 64-bit XXH3 digests of a fixed byte encoding, stable across
//! processes and releases:
//!
//! ```text
//! kind byte ('c' conversation, 'p' prefix tokens, 'i' prefix block ids, 't' tenant)
//! tenant scope: 0x00, or 0x01 + u32 LE byte length + UTF-8 bytes
//! payload: conversation UTF-8 bytes | tokens as u32 LE | ids as u64 LE | nothing
//! ```
//!
//! A prefix key moved past a prefix many keys share
//! ([`RoutingKey::past_shared`]) is `'s'`, the prefix key's u64 LE, then the
//! block hash's u64 LE: scoped as the prefix key was.
//!
//! Not here: where the tenant or conversation key come from (the router
//! decides which sources are trusted).

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::Xxh3;

/// A request's routing key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RoutingKey(pub u64);

impl RoutingKey {
    fn digest(kind: u8, tenant: Option<&str>, payload: impl FnOnce(&mut Xxh3)) -> Self {
        let mut h = Xxh3::new();
        h.update(&[kind]);
        match tenant {
            None => h.update(&[0]),
            Some(t) => {
                h.update(&[1]);
                h.update(&(t.len() as u32).to_le_bytes());
                h.update(t.as_bytes());
            }
        }
        payload(&mut h);
        RoutingKey(h.digest())
    }

    /// The key of a conversation (`prompt_cache_key` or a header value).
    pub fn conversation(tenant: Option<&str>, conversation: &str) -> Self {
        Self::digest(b'c', tenant, |h| h.update(conversation.as_bytes()))
    }

    /// The key of a prompt prefix given as token ids (the caller passes the
    /// first K tokens).
    pub fn prefix_tokens(tenant: Option<&str>, tokens: &[u32]) -> Self {
        Self::digest(b'p', tenant, |h| update_le(h, tokens, |t| t.to_le_bytes()))
    }

    /// The key of a prompt prefix given as block ids (the replay benchmark's
    /// traces carry one id per block instead of tokens).
    pub fn prefix_ids(tenant: Option<&str>, ids: &[u64]) -> Self {
        Self::digest(b'i', tenant, |h| update_le(h, ids, |id| id.to_le_bytes()))
    }

    /// A prefix key taken from past a prefix many keys share: `self` (the
    /// prefix key, for its tenant scope) with `block`, the hash of the
    /// last block of as many blocks past the shared ones. Block hashes
    /// chain, so `block` names everything before it: two prompts that
    /// differ there get different keys. The `kvroute` policy derives it
    /// ([`crate::policy`]), because it is the one that knows what is
    /// shared.
    pub fn past_shared(self, block: u64) -> Self {
        let mut h = Xxh3::new();
        h.update(b"s");
        h.update(&self.0.to_le_bytes());
        h.update(&block.to_le_bytes());
        RoutingKey(h.digest())
    }

    /// The key of a whole tenant.
    pub fn tenant(tenant: &str) -> Self {
        Self::digest(b't', Some(tenant), |_| {})
    }
}

/// Feeds `values` to `h` as their little-endian bytes, 256 bytes an
/// update: XXH3's streaming update copies each call's bytes into its buffer,
/// so an update per 4-byte token cost more than the hashing.
fn update_le<T: Copy, const N: usize>(h: &mut Xxh3, values: &[T], le: impl Fn(T) -> [u8; N]) {
    let mut buf = [0u8; 256];
    for chunk in values.chunks(256 / N) {
        for (out, &v) in buf.chunks_exact_mut(N).zip(chunk) {
            out.copy_from_slice(&le(v));
        }
        h.update(&buf[..chunk.len() * N]);
    }
}

/// What a routing key is made from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum KeyMode {
    /// The conversation key when the request has one, else the prompt prefix.
    /// The default ([`DEFAULT_KEY_MODE`]): multi-turn chats stay together,
    /// everything else is grouped by what it starts with.
    Conversation,
    /// Always the first `prefix_tokens` prompt tokens.
    Prefix,
    /// The tenant when known, else the prompt prefix: one tenant's requests
    /// go to the same endpoints.
    Tenant,
}

/// How routing keys are derived.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct KeyConfig {
    /// Which request feature the key comes from. Default: `conversation`.
    pub mode: KeyMode,
    /// K, the number of leading prompt tokens in a prefix key. Default: 256
    /// (16 blocks of 16 tokens: long enough to cover a system prompt and
    /// the start of the first message, so distinct chats spread out).
    pub prefix_tokens: usize,
    /// Scope every key by the tenant. Set when tenancy is salted, so tenants
    /// never share keys. Default: false.
    pub scope_by_tenant: bool,
}

/// Default key mode: the conversation key, so every turn of a chat goes to
/// the same endpoint.
pub const DEFAULT_KEY_MODE: KeyMode = KeyMode::Conversation;
/// Default prefix length of a routing key, in tokens: 256 (16 blocks of 16).
pub const DEFAULT_PREFIX_TOKENS: usize = 256;

impl Default for KeyMode {
    fn default() -> Self {
        DEFAULT_KEY_MODE
    }
}

impl Default for KeyConfig {
    fn default() -> Self {
        KeyConfig {
            mode: DEFAULT_KEY_MODE,
            prefix_tokens: DEFAULT_PREFIX_TOKENS,
            scope_by_tenant: false,
        }
    }
}

/// The request features a key can be made from.
#[derive(Clone, Copy, Debug, Default)]
pub struct KeyInput<'a> {
    /// The authenticated tenant, if any.
    pub tenant: Option<&'a str>,
    /// The conversation key, if the request carries one.
    pub conversation: Option<&'a str>,
    /// The prompt's token ids (exact or approximate).
    pub tokens: &'a [u32],
}

impl KeyConfig {
    /// The routing key of a request.
    pub fn key(&self, input: &KeyInput<'_>) -> RoutingKey {
        let scope = if self.scope_by_tenant {
            input.tenant
        } else {
            None
        };
        match self.named(input) {
            Some(Named::Conversation(c)) => RoutingKey::conversation(scope, c),
            Some(Named::Tenant(t)) => RoutingKey::tenant(t),
            None => {
                let k = self.prefix_tokens.min(input.tokens.len());
                RoutingKey::prefix_tokens(scope, &input.tokens[..k])
            }
        }
    }

    /// Whether [`Self::key`] makes `input`'s key from its first tokens:
    /// always in prefix mode, and when the request has no conversation key
    /// (conversation mode) or no tenant (tenant mode).
    pub fn from_prefix(&self, input: &KeyInput<'_>) -> bool {
        self.named(input).is_none()
    }

    fn named<'a>(&self, input: &KeyInput<'a>) -> Option<Named<'a>> {
        match (self.mode, input.conversation, input.tenant) {
            (KeyMode::Conversation, Some(c), _) => Some(Named::Conversation(c)),
            (KeyMode::Tenant, _, Some(t)) => Some(Named::Tenant(t)),
            _ => None,
        }
    }
}

/// A key named by the request rather than made from its prompt.
enum Named<'a> {
    Conversation(&'a str),
    Tenant(&'a str),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_key_uses_only_the_first_k_tokens() {
        let cfg = KeyConfig {
            mode: KeyMode::Prefix,
            prefix_tokens: 4,
            ..KeyConfig::default()
        };
        let a = cfg.key(&KeyInput {
            tokens: &[1, 2, 3, 4, 5, 6],
            ..Default::default()
        });
        let b = cfg.key(&KeyInput {
            tokens: &[1, 2, 3, 4, 9],
            ..Default::default()
        });
        let c = cfg.key(&KeyInput {
            tokens: &[1, 2, 3, 5],
            ..Default::default()
        });
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn conversation_mode_falls_back_to_the_prefix() {
        let cfg = KeyConfig::default();
        let tokens = [7u32; 300];
        let with = cfg.key(&KeyInput {
            conversation: Some("chat-1"),
            tokens: &tokens,
            ..Default::default()
        });
        let without = cfg.key(&KeyInput {
            tokens: &tokens,
            ..Default::default()
        });
        assert_eq!(with, RoutingKey::conversation(None, "chat-1"));
        assert_eq!(without, RoutingKey::prefix_tokens(None, &tokens[..256]));
    }

    #[test]
    fn salted_tenants_never_share_keys() {
        let cfg = KeyConfig {
            scope_by_tenant: true,
            ..KeyConfig::default()
        };
        let input = |tenant| KeyInput {
            tenant: Some(tenant),
            conversation: Some("same"),
            tokens: &[1, 2, 3],
        };
        assert_ne!(cfg.key(&input("a")), cfg.key(&input("b")));
        let shared = KeyConfig::default();
        assert_eq!(shared.key(&input("a")), shared.key(&input("b")));
    }

    #[test]
    fn encoding_is_unambiguous() {
        // A tenant name cannot run into the payload, nor a kind into another.
        assert_ne!(
            RoutingKey::conversation(Some("ab"), "c"),
            RoutingKey::conversation(Some("a"), "bc")
        );
        assert_ne!(
            RoutingKey::prefix_tokens(None, &[]),
            RoutingKey::prefix_ids(None, &[])
        );
        assert_ne!(
            RoutingKey::tenant("a"),
            RoutingKey::conversation(Some("a"), "")
        );
    }

    #[test]
    fn keys_are_pinned_across_releases() {
        let mut h = Xxh3::new();
        h.update(b"c\x00chat-1");
        assert_eq!(RoutingKey::conversation(None, "chat-1").0, h.digest());
    }

    #[test]
    fn prefix_keys_hash_the_values_little_endian_across_update_chunks() {
        // 300 tokens and 70 ids: more than one 256-byte update each.
        let tokens: Vec<u32> = (0..300u32).map(|t| t.wrapping_mul(0x9e37_79b9)).collect();
        let ids: Vec<u64> = (0..70u64)
            .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15))
            .collect();
        let mut bytes = b"p\x01\x01\x00\x00\x00t".to_vec();
        bytes.extend(tokens.iter().flat_map(|t| t.to_le_bytes()));
        assert_eq!(
            RoutingKey::prefix_tokens(Some("t"), &tokens).0,
            xxhash_rust::xxh3::xxh3_64(&bytes)
        );
        let mut bytes = b"i\x00".to_vec();
        bytes.extend(ids.iter().flat_map(|i| i.to_le_bytes()));
        assert_eq!(
            RoutingKey::prefix_ids(None, &ids).0,
            xxhash_rust::xxh3::xxh3_64(&bytes)
        );
    }
}
