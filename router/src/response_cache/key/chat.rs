//! A chat's `messages` for the key and the semantic level at once: the
//! canonical digest of the list, and the same with the last user
//! message's content left out (the question's context), with that content
//! when it is text. One message at a time, nothing kept of the ones before
//! but a hash state.

use serde::Deserialize;
use serde::de::{DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;
use sha2::{Digest, Sha256};

use super::canon::{self, KeySeed, Members, Refused};
use crate::response_cache::semantic::MAX_QUESTION_BYTES;

/// The digest standing for a question left out of its context (no
/// canonical form hashes to it).
pub const BLANK: [u8; 32] = [0; 32];

/// A member's digest and, for the question's member, its context's
/// digest (the question [`BLANK`]) and the question as text.
pub type Digested = ([u8; 32], Option<([u8; 32], Option<String>)>);

/// The digest of a chat's `messages` (its raw value), and, when one of
/// them is the user's, the digest with the last user message's content
/// [`BLANK`] and that content as text ([`text_of`], when `asking`).
pub fn messages(raw: &[u8], asking: bool) -> Result<Digested, Refused> {
    if raw.first() != Some(&b'[') {
        return canon::digest(raw).map(|d| (d, None));
    }
    let mut de = serde_json::Deserializer::from_slice(raw);
    let (key, context) = de.deserialize_seq(List).map_err(canon::why)?;
    de.end().map_err(canon::why)?;
    Ok((
        key,
        context.map(|(c, content)| (c, content.filter(|_| asking).and_then(text_of))),
    ))
}

/// [`messages`]' visitor.
struct List;

impl<'de> Visitor<'de> for List {
    /// The key's digest; the context's, and the question's raw content.
    type Value = ([u8; 32], Option<([u8; 32], Option<&'de [u8]>)>);

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a list of messages")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut key = Sha256::new();
        key.update(b"[");
        // The context: the key's state before the last user message, that
        // message without its content, and every element after it.
        let mut context: Option<(Sha256, Option<&'de [u8]>)> = None;
        while let Some(raw) = seq.next_element::<&'de RawValue>()? {
            let raw = raw.get().as_bytes();
            let message = match raw.first() {
                Some(b'{') => {
                    let mut de = serde_json::Deserializer::from_slice(raw);
                    Some(Message.deserialize(&mut de).map_err(custom)?)
                }
                _ => None,
            };
            let Some(mut m) = message else {
                let digest = canon::digest(raw).map_err(serde::de::Error::custom)?;
                for out in std::iter::once(&mut key).chain(context.as_mut().map(|c| &mut c.0)) {
                    out.update(b"v");
                    out.update(digest);
                }
                continue;
            };
            canon::sorted(&mut m.members).map_err(serde::de::Error::custom)?;
            if m.user {
                let mut c = key.clone();
                let mut blanked = m.members.clone();
                if let Some(content) = blanked.iter_mut().find(|(k, _)| k == "content") {
                    content.1 = BLANK;
                }
                canon::feed_object(&mut c, &blanked);
                context = Some((c, m.content));
            } else if let Some((c, _)) = &mut context {
                canon::feed_object(c, &m.members);
            }
            canon::feed_object(&mut key, &m.members);
        }
        key.update(b"]");
        let context = context.map(|(mut c, content)| {
            c.update(b"]");
            (c.finalize().into(), content)
        });
        Ok((key.finalize().into(), context))
    }
}

/// A refusal carried through serde.
fn custom<E: serde::de::Error>(e: serde_json::Error) -> E {
    E::custom(canon::why(e))
}

/// One message: its members, whether it is the user's, and its content.
struct Message;

struct Read<'de> {
    members: Members<'de>,
    user: bool,
    /// `content`'s raw value.
    content: Option<&'de [u8]>,
}

impl<'de> DeserializeSeed<'de> for Message {
    type Value = Read<'de>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Read<'de>, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for Message {
    type Value = Read<'de>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a message")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Read<'de>, A::Error> {
        let mut read = Read {
            members: Members::new(),
            user: false,
            content: None,
        };
        while let Some(key) = map.next_key_seed(KeySeed)? {
            if read.members.len() == canon::MAX_MEMBERS {
                return Err(serde::de::Error::custom(canon::MEMBERS));
            }
            let raw = map.next_value::<&'de RawValue>()?.get().as_bytes();
            let digest = canon::digest(raw).map_err(serde::de::Error::custom)?;
            match &*key {
                "role" => read.user = serde_json::from_slice::<&str>(raw).ok() == Some("user"),
                "content" => read.content = Some(raw),
                _ => {}
            }
            read.members.push((key, digest));
        }
        Ok(read)
    }
}

/// The longest raw content read for a question: a question is at most
/// [`MAX_QUESTION_BYTES`], and escapes or parts' JSON may take more.
const MAX_CONTENT_BYTES: usize = 8 * MAX_QUESTION_BYTES;

/// The text of a message's content or a prompt (its raw value): a string,
/// or text parts joined; `None` for anything else, blank text, or text
/// longer than [`MAX_QUESTION_BYTES`].
pub fn text_of(raw: &[u8]) -> Option<String> {
    #[derive(Deserialize)]
    struct Part {
        #[serde(rename = "type")]
        kind: String,
        text: Option<String>,
    }
    if raw.len() > MAX_CONTENT_BYTES {
        return None;
    }
    let text = match raw.first()? {
        b'"' => serde_json::from_slice::<String>(raw).ok()?,
        b'[' => (serde_json::from_slice::<Vec<Part>>(raw).ok()?.into_iter())
            .map(|p| p.text.filter(|_| p.kind == "text"))
            .collect::<Option<String>>()?,
        _ => return None,
    };
    (!text.trim().is_empty() && text.len() <= MAX_QUESTION_BYTES).then_some(text)
}
