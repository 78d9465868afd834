//! vLLM's KV cache events, as its `ZmqEventPublisher` sends them: a ZMQ
//! message of three frames — topic, an 8-byte big-endian sequence number,
//! and a msgpack `KVEventBatch` `[ts, events, dp_rank]`.
//!
//! Two forms of event are decoded:
//! - tagged (vLLM ≥ 0.31): a map with `type` (`BlockStored`,
//!   `BlockRemoved`, `AllBlocksCleared`) and named fields, some of which
//!   newer versions add (`lora_name`, `extra_keys`, `group_idx`);
//! - positional (older): an array whose first element is the type and
//!   whose fields follow in declaration order.
//!
//! Block hashes arrive as integers, or as bytes when vLLM runs with
//! `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`; both become the u64 form of
//! kvroute's protocols (the last 8 bytes, big-endian).
//!
//! msgpack is decoded with `rmpv` (the maintained dynamic-value crate of
//! the `rmp` family): the events are a union of shapes across vLLM
//! versions, so they are matched field by field rather than through a
//! fixed schema, and anything unexpected is an error naming it, never a
//! panic. An event of a type this build does not know decodes as
//! [`Event::Unknown`], so a newer vLLM's additions skip that event, not the
//! batch.

use rmpv::Value;

/// A ZMQ message from vLLM's publisher.
#[derive(Clone, Debug, PartialEq)]
pub struct Message {
    /// The topic frame.
    pub topic: Vec<u8>,
    /// The batch's sequence number.
    pub seq: u64,
    /// The events.
    pub batch: Batch,
}

/// One `KVEventBatch`.
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    /// When vLLM published it, Unix seconds.
    pub ts: f64,
    /// Its events, in order.
    pub events: Vec<Event>,
    /// The data-parallel rank that published it, if given.
    pub dp_rank: Option<u32>,
}

/// One KV cache event.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// Blocks were cached.
    Stored(Stored),
    /// Blocks were evicted.
    Removed {
        /// Their hashes, u64 form.
        block_hashes: Vec<u64>,
        /// Where they were (`GPU`, `CPU`, …), if given.
        medium: Option<String>,
    },
    /// The whole cache was cleared.
    Cleared {
        /// Which medium, if given.
        medium: Option<String>,
    },
    /// An event type this build does not know (a newer vLLM's): skipped,
    /// and counted, by whoever applies the batch.
    Unknown(String),
}

/// A `BlockStored` event.
#[derive(Clone, Debug, PartialEq)]
pub struct Stored {
    /// The stored blocks' hashes, u64 form, in chain order.
    pub block_hashes: Vec<u64>,
    /// The hash of the block before the first, if any.
    pub parent_block_hash: Option<u64>,
    /// The tokens of the stored blocks, when vLLM sends them.
    pub token_ids: Vec<u32>,
    /// Tokens per block.
    pub block_size: u32,
    /// The LoRA adapter's id, if any.
    pub lora_id: Option<u64>,
    /// Where the blocks are (`GPU`, `CPU`, …), if given.
    pub medium: Option<String>,
    /// The LoRA adapter's name, if any (newer vLLM).
    pub lora_name: Option<String>,
    /// Each block's extra keys (LoRA name, cache salt, multimodal
    /// hashes), when vLLM sends them; kept as decoded.
    pub extra_keys: Option<Vec<Value>>,
}

/// Why a message or a batch could not be decoded.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum DecodeError {
    /// Not the three frames vLLM sends.
    #[error("expected 3 frames (topic, sequence, payload), got {0}")]
    Frames(usize),
    /// The sequence frame is not 8 bytes.
    #[error("the sequence frame has {0} bytes, not 8")]
    Sequence(usize),
    /// The payload is not msgpack.
    #[error("the payload is not msgpack: {0}")]
    Msgpack(String),
    /// The payload is msgpack of another shape.
    #[error("{0}")]
    Shape(String),
    /// The payload holds more values than [`MAX_VALUES`].
    #[error("the payload holds more than {MAX_VALUES} msgpack values")]
    TooManyValues,
}

/// The most msgpack values a payload may hold. Decoded, a value costs 40
/// bytes of `rmpv`'s tree (up to twice that while its vectors grow) where
/// it took one byte on the wire, so this bounds a message's decoded size
/// (160 MiB at most) where the frame limit alone would let 64 MiB of
/// one-byte integers become 2.5 GB or more. A vLLM batch holds one engine
/// step's events: a few values per block and one per token, far fewer.
pub const MAX_VALUES: usize = 1 << 21;

/// Walks a msgpack `payload`'s markers without decoding it, counting its
/// values (a map's keys and values each) up to `max`. rmp classifies each
/// marker; the walk only reads the lengths that follow, so nothing is
/// allocated whatever the payload claims.
fn check_values(payload: &[u8], max: usize) -> Result<(), DecodeError> {
    use rmp::Marker;
    let short = || DecodeError::Msgpack("the payload ends inside a value".into());
    let mut at = 0usize;
    // Reads an `n`-byte big-endian length.
    let length = |at: &mut usize, n: usize| -> Result<u64, DecodeError> {
        let bytes = payload.get(*at..*at + n).ok_or_else(short)?;
        *at += n;
        Ok(bytes.iter().fold(0u64, |v, &b| v << 8 | u64::from(b)))
    };
    let (mut pending, mut counted) = (1u64, 0usize);
    while pending > 0 {
        pending -= 1;
        counted += 1;
        if counted > max {
            return Err(DecodeError::TooManyValues);
        }
        let marker = Marker::from_u8(*payload.get(at).ok_or_else(short)?);
        at += 1;
        let skip = match marker {
            Marker::FixPos(_) | Marker::FixNeg(_) => 0,
            Marker::Null | Marker::True | Marker::False | Marker::Reserved => 0,
            Marker::U8 | Marker::I8 => 1,
            Marker::U16 | Marker::I16 => 2,
            Marker::U32 | Marker::I32 | Marker::F32 => 4,
            Marker::U64 | Marker::I64 | Marker::F64 => 8,
            Marker::FixStr(n) => u64::from(n),
            Marker::Str8 | Marker::Bin8 => length(&mut at, 1)?,
            Marker::Str16 | Marker::Bin16 => length(&mut at, 2)?,
            Marker::Str32 | Marker::Bin32 => length(&mut at, 4)?,
            Marker::FixExt1 => 2,
            Marker::FixExt2 => 3,
            Marker::FixExt4 => 5,
            Marker::FixExt8 => 9,
            Marker::FixExt16 => 17,
            Marker::Ext8 => length(&mut at, 1)? + 1,
            Marker::Ext16 => length(&mut at, 2)? + 1,
            Marker::Ext32 => length(&mut at, 4)? + 1,
            Marker::FixArray(n) => {
                pending += u64::from(n);
                0
            }
            Marker::Array16 => {
                pending += length(&mut at, 2)?;
                0
            }
            Marker::Array32 => {
                pending += length(&mut at, 4)?;
                0
            }
            Marker::FixMap(n) => {
                pending += 2 * u64::from(n);
                0
            }
            Marker::Map16 => {
                pending += 2 * length(&mut at, 2)?;
                0
            }
            Marker::Map32 => {
                pending += 2 * length(&mut at, 4)?;
                0
            }
        };
        at = usize::try_from(skip)
            .ok()
            .and_then(|skip| at.checked_add(skip))
            .filter(|&end| end <= payload.len())
            .ok_or_else(short)?;
    }
    Ok(())
}

fn shape(what: impl Into<String>) -> DecodeError {
    DecodeError::Shape(what.into())
}

/// Decodes one message's frames.
pub fn decode_message(frames: &[&[u8]]) -> Result<Message, DecodeError> {
    let [topic, seq, payload] = frames else {
        return Err(DecodeError::Frames(frames.len()));
    };
    let seq: [u8; 8] = (*seq)
        .try_into()
        .map_err(|_| DecodeError::Sequence(seq.len()))?;
    Ok(Message {
        topic: topic.to_vec(),
        seq: u64::from_be_bytes(seq),
        batch: decode_batch(payload)?,
    })
}

/// Decodes a msgpack `KVEventBatch` (`[ts, events, dp_rank]`).
pub fn decode_batch(payload: &[u8]) -> Result<Batch, DecodeError> {
    check_values(payload, MAX_VALUES)?;
    let mut reader = payload;
    let value =
        rmpv::decode::read_value(&mut reader).map_err(|e| DecodeError::Msgpack(e.to_string()))?;
    if !reader.is_empty() {
        return Err(DecodeError::Msgpack(format!(
            "{} bytes after the batch",
            reader.len()
        )));
    }
    let Value::Array(parts) = value else {
        return Err(shape("the batch is not an array"));
    };
    let (ts, events, rank) = match parts.as_slice() {
        [ts, events] => (ts, events, None),
        [ts, events, rank] => (ts, events, Some(rank)),
        _ => return Err(shape(format!("the batch has {} fields", parts.len()))),
    };
    let ts = ts
        .as_f64()
        .or_else(|| ts.as_i64().map(|t| t as f64))
        .ok_or_else(|| shape("the batch timestamp is not a number"))?;
    let events = events
        .as_array()
        .ok_or_else(|| shape("the batch's events are not an array"))?
        .iter()
        .enumerate()
        .map(|(i, e)| decode_event(e).map_err(|err| shape(format!("event {i}: {err}"))))
        .collect::<Result<_, _>>()?;
    let dp_rank = match rank {
        None | Some(Value::Nil) => None,
        Some(r) => Some(
            r.as_u64()
                .and_then(|r| u32::try_from(r).ok())
                .ok_or_else(|| shape("dp_rank is not a small integer"))?,
        ),
    };
    Ok(Batch {
        ts,
        events,
        dp_rank,
    })
}

/// An event's fields by name, from either form.
struct Fields<'a> {
    kind: &'a str,
    named: Vec<(&'a str, &'a Value)>,
}

/// The field names of each event type, in declaration order (the
/// positional form's order).
const STORED_FIELDS: [&str; 9] = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
];
const REMOVED_FIELDS: [&str; 3] = ["block_hashes", "medium", "group_idx"];
const CLEARED_FIELDS: [&str; 1] = ["medium"];

impl<'a> Fields<'a> {
    fn of(event: &'a Value) -> Result<Self, String> {
        match event {
            Value::Map(entries) => {
                let mut kind = None;
                let mut named = Vec::with_capacity(entries.len());
                for (k, v) in entries {
                    let k = k.as_str().ok_or("a field name is not a string")?;
                    if k == "type" {
                        kind = Some(v.as_str().ok_or("`type` is not a string")?);
                    } else {
                        named.push((k, v));
                    }
                }
                Ok(Fields {
                    kind: kind.ok_or("no `type`")?,
                    named,
                })
            }
            Value::Array(items) => {
                let (kind, rest) = items.split_first().ok_or("an empty event")?;
                let kind = kind.as_str().ok_or("the event type is not a string")?;
                let names: &[&str] = match kind {
                    "BlockStored" => &STORED_FIELDS,
                    "BlockRemoved" => &REMOVED_FIELDS,
                    "AllBlocksCleared" => &CLEARED_FIELDS,
                    _ => &[],
                };
                if !names.is_empty() && rest.len() > names.len() {
                    return Err(format!("{kind} has {} fields", rest.len()));
                }
                Ok(Fields {
                    kind,
                    named: names.iter().copied().zip(rest).collect(),
                })
            }
            _ => Err("an event is neither a map nor an array".to_owned()),
        }
    }

    /// Field `name`, `None` when absent or nil.
    fn get(&self, name: &str) -> Option<&'a Value> {
        self.named
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| *v)
            .filter(|v| !v.is_nil())
    }

    fn string(&self, name: &str) -> Result<Option<String>, String> {
        self.get(name)
            .map(|v| {
                v.as_str()
                    .map(str::to_owned)
                    .ok_or_else(|| format!("`{name}` is not a string"))
            })
            .transpose()
    }

    fn hashes(&self, name: &str) -> Result<Vec<u64>, String> {
        let list = self
            .get(name)
            .ok_or_else(|| format!("no `{name}`"))?
            .as_array()
            .ok_or_else(|| format!("`{name}` is not an array"))?;
        list.iter().map(|h| hash(h, name)).collect()
    }
}

/// A block hash in u64 form: an integer as is, bytes by their last 8,
/// big-endian.
fn hash(value: &Value, field: &str) -> Result<u64, String> {
    match value {
        Value::Integer(i) => i
            .as_u64()
            .or_else(|| i.as_i64().map(|v| v as u64))
            .ok_or_else(|| format!("`{field}` holds an integer out of range")),
        Value::Binary(bytes) => {
            let tail = &bytes[bytes.len().saturating_sub(8)..];
            let mut be = [0u8; 8];
            be[8 - tail.len()..].copy_from_slice(tail);
            Ok(u64::from_be_bytes(be))
        }
        _ => Err(format!("`{field}` holds a value that is not a hash")),
    }
}

fn decode_event(event: &Value) -> Result<Event, String> {
    let f = Fields::of(event)?;
    match f.kind {
        "BlockStored" => {
            let token_ids = match f.get("token_ids") {
                None => Vec::new(),
                Some(v) => v
                    .as_array()
                    .ok_or("`token_ids` is not an array")?
                    .iter()
                    .map(|t| {
                        t.as_u64()
                            .and_then(|t| u32::try_from(t).ok())
                            .ok_or("`token_ids` holds a value that is not a token id")
                    })
                    .collect::<Result<_, _>>()?,
            };
            let block_size = f
                .get("block_size")
                .and_then(Value::as_u64)
                .and_then(|b| u32::try_from(b).ok())
                .filter(|b| *b > 0)
                .ok_or("`block_size` is missing or not a positive integer")?;
            let parent_block_hash = f
                .get("parent_block_hash")
                .map(|p| hash(p, "parent_block_hash"))
                .transpose()?;
            let lora_id = match f.get("lora_id") {
                None => None,
                Some(v) => Some(v.as_u64().ok_or("`lora_id` is not an integer")?),
            };
            let extra_keys = match f.get("extra_keys") {
                None => None,
                Some(Value::Array(keys)) => Some(keys.clone()),
                Some(_) => return Err("`extra_keys` is not an array".to_owned()),
            };
            Ok(Event::Stored(Stored {
                block_hashes: f.hashes("block_hashes")?,
                parent_block_hash,
                token_ids,
                block_size,
                lora_id,
                medium: f.string("medium")?,
                lora_name: f.string("lora_name")?,
                extra_keys,
            }))
        }
        "BlockRemoved" => Ok(Event::Removed {
            block_hashes: f.hashes("block_hashes")?,
            medium: f.string("medium")?,
        }),
        "AllBlocksCleared" => Ok(Event::Cleared {
            medium: f.string("medium")?,
        }),
        other => Ok(Event::Unknown(other.to_owned())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_counted_before_anything_is_decoded() {
        // An array claiming 2^32 - 1 values in 5 bytes: cut short.
        let claim = [0xdd, 0xff, 0xff, 0xff, 0xff];
        assert!(matches!(decode_batch(&claim), Err(DecodeError::Msgpack(_))));
        // More values than the limit: refused.
        let mut many = vec![0xdd];
        many.extend_from_slice(&(MAX_VALUES as u32).to_be_bytes());
        many.resize(5 + MAX_VALUES, 0x01);
        assert!(matches!(
            decode_batch(&many),
            Err(DecodeError::TooManyValues)
        ));
        // Every marker kind walks as rmpv decodes it: the count is exact.
        let value = Value::Array(vec![
            Value::from(1),
            Value::from(-1),
            Value::from(300),
            Value::from(-70_000),
            Value::from(u64::MAX),
            Value::F32(1.0),
            Value::F64(2.0),
            Value::from("s"),
            Value::from("x".repeat(300)),
            Value::Binary(vec![1; 70_000]),
            Value::Ext(1, vec![0; 4]),
            Value::Ext(2, vec![0; 300]),
            Value::Map(vec![(Value::from("k"), Value::Nil)]),
            Value::Array((0..20).map(Value::from).collect()),
            Value::Boolean(true),
        ]);
        let bytes = encode(&value);
        // The array, its 15 values, the map key and value, the inner 20.
        assert!(check_values(&bytes, 38).is_ok());
        assert!(matches!(
            check_values(&bytes, 37),
            Err(DecodeError::TooManyValues)
        ));
        for cut in 0..bytes.len() {
            assert!(check_values(&bytes[..cut], 1000).is_err(), "cut at {cut}");
        }
    }

    fn encode(v: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, v).unwrap();
        out
    }

    fn batch(events: Vec<Value>) -> Vec<u8> {
        encode(&Value::Array(vec![
            Value::F64(1.5),
            Value::Array(events),
            Value::from(0),
        ]))
    }

    #[test]
    fn byte_hashes_become_their_last_8_bytes() {
        let digest: Vec<u8> = (0..32).collect();
        let event = Value::Map(vec![
            (Value::from("type"), Value::from("BlockRemoved")),
            (
                Value::from("block_hashes"),
                Value::Array(vec![Value::Binary(digest), Value::Binary(vec![1, 2])]),
            ),
        ]);
        let b = decode_batch(&batch(vec![event])).unwrap();
        assert_eq!(
            b.events,
            [Event::Removed {
                block_hashes: vec![0x18191a1b1c1d1e1f, 0x0102],
                medium: None
            }]
        );
    }

    #[test]
    fn unknown_event_types_decode_as_unknown_in_both_forms() {
        let b = decode_batch(&batch(vec![
            Value::Array(vec![Value::from("Teleported"), Value::from(1)]),
            Value::Map(vec![(Value::from("type"), Value::from("BlockMoved"))]),
        ]))
        .unwrap();
        assert_eq!(
            b.events,
            [
                Event::Unknown("Teleported".into()),
                Event::Unknown("BlockMoved".into())
            ]
        );
    }

    #[test]
    fn bad_input_is_an_error_that_names_it() {
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (vec![0x93, 0xcb], "not msgpack"),
            (encode(&Value::from(3)), "not an array"),
            (
                batch(vec![Value::Map(vec![(
                    Value::from("type"),
                    Value::from("BlockStored"),
                )])]),
                "block_size",
            ),
            (
                batch(vec![Value::Map(vec![
                    (Value::from("type"), Value::from("BlockRemoved")),
                    (Value::from("block_hashes"), Value::from("x")),
                ])]),
                "not an array",
            ),
            ([batch(vec![]), vec![0]].concat(), "after the batch"),
        ];
        for (payload, needle) in cases {
            let err = decode_batch(&payload).unwrap_err().to_string();
            assert!(err.contains(needle), "{needle}: {err}");
        }
        assert_eq!(
            decode_message(&[b"t", b"1234"]).unwrap_err(),
            DecodeError::Frames(2)
        );
        assert_eq!(
            decode_message(&[b"t", b"1234", &batch(vec![])]).unwrap_err(),
            DecodeError::Sequence(4)
        );
    }
}
