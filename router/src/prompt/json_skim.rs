//! Reads a request body's top-level members without building the values
//! routing does not need: a policy that reads no prompt needs a chat's
//! `model` and `stream`, not its 200 KiB of messages, and approximate mode
//! needs each message's role and content as text, not as a JSON map.
//!
//! Why by hand: serde_json, skipping or borrowing a string, checks every
//! byte for a quote, a backslash or a control character eight bytes a
//! step; on a 200 KiB prompt that was a fifth of round robin's CPU per
//! request. Here a string's end is found with `memchr` (32 bytes a step),
//! and its bytes are then checked in one pass the compiler vectorizes
//! (printable ASCII?), with the exact control-character and UTF-8 checks
//! only when they are not. The grammar is JSON's (RFC 8259): strings,
//! escapes, nesting (at most [`MAX_DEPTH`], serde_json's limit) and
//! separators here; scalars (numbers and literals) are short and checked
//! by serde_json, which also parses every value kept. Only success is
//! decided here: on any error the caller reads the body again with
//! serde_json, whose message the client gets, and the property test
//! `json_skim_agrees_with_serde_json` holds the two to the same answers.
//! Values [`members`] checked are walked again without the checks
//! ([`elements`], [`plain_strings`]).

use std::borrow::Cow;

use memchr::memchr2;

/// Nesting deeper than this is refused (serde_json's recursion limit).
const MAX_DEPTH: usize = 128;

/// The body is not a JSON object this reader accepts (the caller asks
/// serde_json why).
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Rejected;

type Result<T> = std::result::Result<T, Rejected>;

/// Calls `f` with each member of the JSON object `body`, in order: its
/// key, decoded, and its value's text, checked (strings and structure
/// here, scalars by serde_json).
pub(crate) fn members<'b>(
    body: &'b [u8],
    f: impl FnMut(Cow<'b, str>, &'b [u8]) -> Result<()>,
) -> Result<()> {
    walk::<true>(body, f)
}

/// The JSON object `body` with its member `key` (each one of that name)
/// replaced by `value`, a JSON text, written last; the other members
/// are copied as they are. No tree is built: the copy is the body's size.
pub(crate) fn replaced(body: &[u8], key: &str, value: &[u8]) -> Result<Vec<u8>> {
    let mut out = Object::with_capacity(body.len() + key.len() + value.len() + 8);
    out.keep(body, |k| k != key)?;
    out.member(key, value)?;
    Ok(out.end())
}

/// A JSON object written member by member: a body edited as bytes, never
/// as a tree of its values.
pub(crate) struct Object(Vec<u8>);

impl Object {
    /// An empty object with room for `bytes`.
    pub(crate) fn with_capacity(bytes: usize) -> Self {
        let mut out = Vec::with_capacity(bytes);
        out.push(b'{');
        Object(out)
    }

    /// Adds the member `key` with `value`, a JSON text.
    pub(crate) fn member(&mut self, key: &str, value: &[u8]) -> Result<()> {
        if self.0.len() > 1 {
            self.0.push(b',');
        }
        serde_json::to_writer(&mut self.0, key).map_err(|_| Rejected)?;
        self.0.push(b':');
        self.0.extend_from_slice(value);
        Ok(())
    }

    /// Copies the members of the JSON object `body` whose key (decoded)
    /// `keep` accepts, as they are.
    pub(crate) fn keep(&mut self, body: &[u8], mut keep: impl FnMut(&str) -> bool) -> Result<()> {
        walk::<true>(
            body,
            |k, v| if keep(&k) { self.member(&k, v) } else { Ok(()) },
        )
    }

    /// The object's text.
    pub(crate) fn end(mut self) -> Vec<u8> {
        self.0.push(b'}');
        self.0
    }
}

/// The texts of the elements of `array`, a value [`members`] checked;
/// `None` when it is not an array.
pub(crate) fn elements(array: &[u8]) -> Option<Vec<&[u8]>> {
    if array.first() != Some(&b'[') {
        return None;
    }
    let mut out = Vec::new();
    let mut i = ws(array, 1);
    while array.get(i).is_some_and(|&c| c != b']') {
        let end = value::<false>(array, i, MAX_DEPTH).ok()?;
        out.push(&array[i..end]);
        i = ws(array, end);
        if array.get(i) == Some(&b',') {
            i = ws(array, i + 1);
        }
    }
    Some(out)
}

/// The values of `keys` in `object`, a value [`members`] checked, when it
/// is an object and each is a string without escapes; else `None`.
pub(crate) fn plain_strings<'b, const N: usize>(
    object: &'b [u8],
    keys: [&str; N],
) -> Option<[&'b str; N]> {
    let mut found = [None; N];
    walk::<false>(object, |key, value| {
        if let Some(k) = keys.iter().position(|k| *k == key) {
            found[k] = Some(value);
        }
        Ok(())
    })
    .ok()?;
    let mut out = [""; N];
    for (o, value) in out.iter_mut().zip(found) {
        let text = value?.strip_prefix(b"\"")?.strip_suffix(b"\"")?;
        if text.contains(&b'\\') {
            return None;
        }
        *o = std::str::from_utf8(text).ok()?;
    }
    Some(out)
}

/// [`members`], checking the values when `CHECK` (else they are known to
/// be JSON and only their ends are found).
fn walk<'b, const CHECK: bool>(
    body: &'b [u8],
    mut f: impl FnMut(Cow<'b, str>, &'b [u8]) -> Result<()>,
) -> Result<()> {
    let mut i = ws(body, 0);
    if body.get(i) != Some(&b'{') {
        return Err(Rejected);
    }
    i = ws(body, i + 1);
    if body.get(i) == Some(&b'}') {
        i += 1;
    } else {
        loop {
            let (key, after) = key::<CHECK>(body, i)?;
            let start = colon(body, after)?;
            // One level is the object's.
            i = value::<CHECK>(body, start, MAX_DEPTH - 1)?;
            f(key, &body[start..i])?;
            i = ws(body, i);
            match body.get(i) {
                Some(b',') => i = ws(body, i + 1),
                Some(b'}') => {
                    i += 1;
                    break;
                }
                _ => return Err(Rejected),
            }
        }
    }
    if ws(body, i) == body.len() {
        Ok(())
    } else {
        Err(Rejected)
    }
}

/// Past JSON whitespace from `i`.
fn ws(b: &[u8], mut i: usize) -> usize {
    while let Some(b' ' | b'\t' | b'\n' | b'\r') = b.get(i) {
        i += 1;
    }
    i
}

/// The key at `i` (a string), decoded, and the index after it.
fn key<const CHECK: bool>(b: &[u8], i: usize) -> Result<(Cow<'_, str>, usize)> {
    if b.get(i) != Some(&b'"') {
        return Err(Rejected);
    }
    let end = string::<CHECK>(b, i + 1)?;
    let raw = &b[i..end];
    let key = if raw.contains(&b'\\') {
        Cow::Owned(serde_json::from_slice(raw).map_err(|_| Rejected)?)
    } else {
        Cow::Borrowed(std::str::from_utf8(&raw[1..raw.len() - 1]).map_err(|_| Rejected)?)
    };
    Ok((key, end))
}

/// Past the `:` after a key at `i` and the whitespace around it.
fn colon(b: &[u8], i: usize) -> Result<usize> {
    let i = ws(b, i);
    if b.get(i) == Some(&b':') {
        Ok(ws(b, i + 1))
    } else {
        Err(Rejected)
    }
}

/// Past the value at `i`, nested at most `depth` deeper.
fn value<const CHECK: bool>(b: &[u8], i: usize, depth: usize) -> Result<usize> {
    match b.get(i) {
        Some(b'"') => string::<CHECK>(b, i + 1),
        Some(&open @ (b'[' | b'{')) => {
            let close = if open == b'[' { b']' } else { b'}' };
            let depth = depth.checked_sub(1).ok_or(Rejected)?;
            let mut i = ws(b, i + 1);
            if b.get(i) == Some(&close) {
                return Ok(i + 1);
            }
            loop {
                if open == b'{' {
                    if b.get(i) != Some(&b'"') {
                        return Err(Rejected);
                    }
                    i = colon(b, string::<CHECK>(b, i + 1)?)?;
                }
                i = ws(b, value::<CHECK>(b, i, depth)?);
                match b.get(i) {
                    Some(b',') => i = ws(b, i + 1),
                    Some(&c) if c == close => return Ok(i + 1),
                    _ => return Err(Rejected),
                }
            }
        }
        Some(_) => {
            let len = b[i..]
                .iter()
                .position(|c| !(c.is_ascii_alphanumeric() || matches!(c, b'-' | b'+' | b'.')))
                .unwrap_or(b.len() - i);
            if len == 0 {
                return Err(Rejected);
            }
            if CHECK {
                serde_json::from_slice::<serde::de::IgnoredAny>(&b[i..i + len])
                    .map_err(|_| Rejected)?;
            }
            Ok(i + len)
        }
        None => Err(Rejected),
    }
}

/// Past the closing quote of the string whose contents start at `start`;
/// when `CHECK`, its escapes, control characters and UTF-8 checked.
fn string<const CHECK: bool>(b: &[u8], start: usize) -> Result<usize> {
    let mut i = start;
    loop {
        i += memchr2(b'"', b'\\', &b[i..]).ok_or(Rejected)?;
        if b[i] == b'"' {
            break;
        }
        i += match b.get(i + 1) {
            Some(b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't') => 2,
            Some(b'u')
                if b.get(i + 2..i + 6)
                    .is_some_and(|h| h.iter().all(u8::is_ascii_hexdigit)) =>
            {
                6
            }
            Some(_) if !CHECK => 2,
            _ => return Err(Rejected),
        };
    }
    let text = &b[start..i];
    // One pass for the common case, printable ASCII (0x20..0x7f); a fold,
    // not `any`, so that it vectorizes. Else the exact checks.
    if CHECK
        && text
            .iter()
            .fold(false, |bad, &x| bad | (x.wrapping_sub(0x20) >= 0x60))
        && (text.iter().any(|&x| x < 0x20) || std::str::from_utf8(text).is_err())
    {
        return Err(Rejected);
    }
    Ok(i + 1)
}

#[cfg(test)]
mod tests {
    use serde_json::{Map, Value};

    use crate::prompt::body::{scan_with_serde, skim};

    /// What the router reads of a body: its fields and its messages' texts.
    type Read = (Map<String, Value>, Option<Vec<Vec<u8>>>);

    fn read(s: crate::prompt::body::Scanned<'_>) -> Read {
        let messages = s.messages.map(|m| m.iter().map(|e| e.to_vec()).collect());
        (s.fields, messages)
    }

    /// Through this module.
    fn skimmed(body: &[u8]) -> Option<Read> {
        skim(body, true).ok().map(read)
    }

    /// Through serde_json, as the router reads a body this module rejects.
    fn parsed(body: &[u8]) -> Option<Read> {
        scan_with_serde(body, true).ok().map(read)
    }

    #[test]
    fn keeps_the_routing_fields_and_the_messages_texts() {
        let body =
            br#" {"messages": [{"role": "user", "content": "a \"quoted\" \u00e9 \\ b"} , [], {}],
            "model" : "m", "temperature": -1.5e3, "x": [true, false, null, {"k": [1, 2]}], "stream": true,
            "model": "last"} "#;
        let (fields, messages) = skimmed(body).unwrap();
        assert_eq!(fields.len(), 2);
        assert_eq!(fields["model"], "last");
        assert_eq!(fields["stream"], true);
        let messages = messages.unwrap();
        assert_eq!(messages.len(), 3);
        assert_eq!(
            messages[0],
            br#"{"role": "user", "content": "a \"quoted\" \u00e9 \\ b"}"#
        );
        assert_eq!(messages[1], b"[]");
        assert_eq!(skimmed(body), parsed(body));
        assert_eq!(skimmed(b"{}").unwrap().0.len(), 0);
        // An escaped key is decoded before it is matched.
        assert_eq!(skimmed(br#"{"mod\u0065l": 1}"#).unwrap().0["model"], 1);
    }

    #[test]
    fn plain_strings_are_strings_without_escapes() {
        fn roles(m: &[u8]) -> Option<[&str; 2]> {
            super::plain_strings(m, ["role", "content"])
        }
        assert_eq!(
            roles(br#"{"content": "hi", "name": {"x": [1]}, "role": "user"}"#),
            Some(["user", "hi"])
        );
        assert_eq!(
            roles(br#"{"role": "a", "role": "b", "content": ""}"#),
            Some(["b", ""])
        );
        assert_eq!(roles(br#"{"role": "user", "content": "a\nb"}"#), None);
        assert_eq!(roles(br#"{"role": "user", "content": null}"#), None);
        assert_eq!(roles(br#"{"role": "user"}"#), None);
        assert_eq!(roles(b"[]"), None);
    }

    #[test]
    fn rejects_what_json_does_not_allow() {
        let bad: &[&[u8]] = &[
            b"",
            b"[]",
            b"{",
            b"{\"a\"}",
            b"{\"a\":}",
            b"{\"a\":1,}",
            b"{\"a\":1 \"b\":2}",
            b"{\"a\":[1,]}",
            b"{\"a\":[1 2]}",
            b"{\"a\":{\"k\" 1}}",
            b"{\"a\":{1:1}}",
            b"{\"a\":[}",
            b"{\"a\":tru}",
            b"{\"a\":01}",
            b"{\"a\":\"x\ty\"}",
            b"{\"a\":\"\\x\"}",
            b"{\"a\":\"\\u12\"}",
            b"{\"a\":\"\xff\"}",
            b"{\"a\":\"open}",
            b"{\"a\":1} x",
            b"{\"a\":1}}",
            b"{\"messages\":[{\"content\":\"x\ty\"}]}",
        ];
        for body in bad {
            assert!(
                skim(body, true).is_err(),
                "{:?}",
                String::from_utf8_lossy(body)
            );
        }
        let deep = format!("{{\"a\":{}{}}}", "[".repeat(200), "]".repeat(200));
        assert!(skim(deep.as_bytes(), true).is_err());
        let fine = format!("{{\"a\":{}{}}}", "[".repeat(100), "]".repeat(100));
        assert!(skim(fine.as_bytes(), true).is_ok());
    }

    proptest::proptest! {
        /// Whatever this module accepts, serde_json reads the same; and it
        /// accepts every object serde_json writes. Bodies are chats, as
        /// written, then with up to three bytes replaced, inserted or
        /// removed.
        #[test]
        fn json_skim_agrees_with_serde_json(
            value in crate::prompt::tests::value(),
            text in "(\\PC|[\"\\\\\n])*",
            edits in proptest::collection::vec((0usize..4096, 0usize..3, proptest::sample::select(
                b"{}[],:\"\\ 0-etaunl\x01\xff".to_vec())), 0..4),
            pretty: bool,
        ) {
            let object = serde_json::json!({
                "model": value.clone(),
                "messages": [{"role": "user", "content": text}, value.clone()],
                "x": value,
                "stream": true,
            });
            let mut body = if pretty {
                serde_json::to_vec_pretty(&object).unwrap()
            } else {
                serde_json::to_vec(&object).unwrap()
            };
            proptest::prop_assert!(skimmed(&body).is_some());
            proptest::prop_assert_eq!(skimmed(&body), parsed(&body));
            for (at, op, byte) in edits {
                let at = at % (body.len() + 1);
                match op {
                    0 if at < body.len() => body[at] = byte,
                    1 => body.insert(at, byte),
                    _ if at < body.len() => {
                        body.remove(at);
                    }
                    _ => {}
                }
            }
            if let Some(got) = skimmed(&body) {
                proptest::prop_assert_eq!(Some(got), parsed(&body));
            }
        }
    }
}
