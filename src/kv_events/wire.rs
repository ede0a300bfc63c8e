//! The engines' KV-event wire format (vLLM `vllm/distributed/kv_events.py`, SGLang's
//! port of it), decoded from msgpack into plain Rust values.
//!
//! A payload is a `KVEventBatch`: a msgpack array `[ts, events, dp_rank?]`. Each
//! event is a tagged msgspec struct, in one of two encodings: a positional array
//! whose first element is the tag (`["BlockStored", block_hashes, parent, token_ids,
//! block_size, lora_id, medium, ...]`, engines before the switch to maps), or a map
//! with the tag under `type` and fields by name (current vLLM and SGLang). Both are
//! read; fields beyond the ones routing needs are ignored, so later additions at the
//! end of either encoding do not break decoding.

use rmpv::Value;

/// Where a block lives on the engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Tier {
    Gpu = 0,
    Cpu = 1,
    Disk = 2,
}

impl Tier {
    pub const ALL: [Tier; 3] = [Tier::Gpu, Tier::Cpu, Tier::Disk];

    /// The tier an event's `medium` names: absent or `GPU` is the device cache,
    /// `CPU` host memory, anything else (disk, remote stores) the slowest tier.
    pub fn from_medium(medium: Option<&str>) -> Tier {
        match medium {
            None => Tier::Gpu,
            Some(m) if m.eq_ignore_ascii_case("gpu") => Tier::Gpu,
            Some(m) if m.eq_ignore_ascii_case("cpu") => Tier::Cpu,
            Some(_) => Tier::Disk,
        }
    }

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Gpu => "gpu",
            Tier::Cpu => "cpu",
            Tier::Disk => "disk",
        }
    }
}

/// One KV-cache event.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// Full blocks stored, in prefix order: `block_hashes[i]` holds
    /// `token_ids[i*block_size..(i+1)*block_size]`, and the first block's parent
    /// is `parent` (`None`: the first block of a prompt).
    Stored {
        block_hashes: Vec<u64>,
        parent: Option<u64>,
        token_ids: Vec<u32>,
        block_size: usize,
        /// Blocks salted beyond their tokens (LoRA, `cache_salt`, multimodal
        /// inputs): the gateway cannot recompute them from a prompt's tokens.
        salted: bool,
        tier: Tier,
    },
    Removed {
        block_hashes: Vec<u64>,
        tier: Tier,
    },
    AllCleared,
}

/// A decoded `KVEventBatch`.
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    /// The engine's clock when the batch was made (Unix seconds).
    pub ts: f64,
    pub events: Vec<Event>,
}

/// Decode one payload.
pub fn decode(payload: &[u8]) -> Result<Batch, String> {
    let mut rd = payload;
    let v = rmpv::decode::read_value(&mut rd).map_err(|e| format!("not msgpack: {e}"))?;
    let Value::Array(items) = v else {
        return Err("batch: expected an array [ts, events, ...]".into());
    };
    let ts = items.first().and_then(Value::as_f64).unwrap_or(0.0);
    let Some(Value::Array(raw)) = items.get(1) else {
        return Err("batch: events: expected an array".into());
    };
    let events = raw
        .iter()
        .enumerate()
        .map(|(i, e)| event(e).map_err(|m| format!("events[{i}]: {m}")))
        .collect::<Result<_, _>>()?;
    Ok(Batch { ts, events })
}

/// An event in either encoding, read by field name.
enum Fields<'a> {
    /// Positional: the values after the tag, in `names` order.
    Array(&'a [Value], &'static [&'static str]),
    Map(&'a [(Value, Value)]),
}

impl<'a> Fields<'a> {
    fn get(&self, k: &str) -> Option<&'a Value> {
        match self {
            Fields::Array(a, names) => a.get(names.iter().position(|n| *n == k)? + 1),
            Fields::Map(m) => m.iter().find(|(n, _)| n.as_str() == Some(k)).map(|e| &e.1),
        }
    }
}

/// Positional field order of the array encoding, after the tag.
const STORED_FIELDS: &[&str] = &[
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
];
const REMOVED_FIELDS: &[&str] = &["block_hashes", "medium"];

/// The event's tag and fields.
fn fields(v: &Value) -> Result<(&str, Fields<'_>), String> {
    match v {
        Value::Array(a) => {
            let tag = a.first().and_then(Value::as_str).ok_or("no tag")?;
            let names = match tag {
                "BlockStored" => STORED_FIELDS,
                "BlockRemoved" => REMOVED_FIELDS,
                _ => &[],
            };
            Ok((tag, Fields::Array(a, names)))
        }
        Value::Map(m) => {
            let f = Fields::Map(m);
            let tag = f.get("type").and_then(Value::as_str).ok_or("no `type`")?;
            Ok((tag, f))
        }
        _ => Err("expected an array or a map".into()),
    }
}

fn event(v: &Value) -> Result<Event, String> {
    let (tag, f) = fields(v)?;
    let nil = |k: &str| f.get(k).is_none_or(Value::is_nil);
    let medium = f.get("medium").and_then(Value::as_str);
    match tag {
        "BlockStored" => {
            let block_hashes = hashes(f.get("block_hashes"))?;
            let parent = match f.get("parent_block_hash") {
                None | Some(Value::Nil) => None,
                Some(h) => Some(hash(h).ok_or("parent_block_hash: not a hash")?),
            };
            let token_ids = f
                .get("token_ids")
                .and_then(Value::as_array)
                .ok_or("token_ids: missing")?
                .iter()
                .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
                .collect::<Option<Vec<u32>>>()
                .ok_or("token_ids: not token ids")?;
            let block_size = f
                .get("block_size")
                .and_then(Value::as_u64)
                .ok_or("block_size: missing")? as usize;
            let extra = f
                .get("extra_keys")
                .and_then(Value::as_array)
                .is_some_and(|a| a.iter().any(|x| !x.is_nil()));
            let salted = !nil("lora_id") || !nil("lora_name") || extra;
            Ok(Event::Stored {
                block_hashes,
                parent,
                token_ids,
                block_size,
                salted,
                tier: Tier::from_medium(medium),
            })
        }
        "BlockRemoved" => Ok(Event::Removed {
            block_hashes: hashes(f.get("block_hashes"))?,
            tier: Tier::from_medium(medium),
        }),
        "AllBlocksCleared" => Ok(Event::AllCleared),
        t => Err(format!("unknown event type {t:?}")),
    }
}

/// A block hash: an integer (vLLM's 64-bit external hash, SGLang's signed one) or
/// bytes (older vLLM's full digest), folded to 64 bits.
fn hash(v: &Value) -> Option<u64> {
    match v {
        Value::Integer(i) => i.as_u64().or_else(|| i.as_i64().map(|x| x as u64)),
        Value::Binary(b) => Some(xxhash_rust::xxh3::xxh3_64(b)),
        _ => None,
    }
}

fn hashes(v: Option<&Value>) -> Result<Vec<u64>, String> {
    v.and_then(Value::as_array)
        .ok_or("block_hashes: missing")?
        .iter()
        .map(|h| hash(h).ok_or_else(|| "block_hashes: not a hash".to_string()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pack(v: Value) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, &v).unwrap();
        out
    }

    fn s(x: &str) -> Value {
        Value::from(x)
    }

    #[test]
    fn decodes_the_array_encoding() {
        let stored = Value::Array(vec![
            s("BlockStored"),
            Value::Array(vec![Value::from(7u64), Value::from(u64::MAX)]),
            Value::Nil,
            Value::Array((1..=4u32).map(Value::from).collect()),
            Value::from(2),
            Value::Nil,
            s("GPU"),
        ]);
        let removed = Value::Array(vec![
            s("BlockRemoved"),
            Value::Array(vec![Value::from(7)]),
            s("CPU"),
        ]);
        let batch = Value::Array(vec![
            Value::from(1.5),
            Value::Array(vec![
                stored,
                removed,
                Value::Array(vec![s("AllBlocksCleared")]),
            ]),
        ]);
        let b = decode(&pack(batch)).unwrap();
        assert_eq!(b.ts, 1.5);
        assert_eq!(
            b.events,
            vec![
                Event::Stored {
                    block_hashes: vec![7, u64::MAX],
                    parent: None,
                    token_ids: vec![1, 2, 3, 4],
                    block_size: 2,
                    salted: false,
                    tier: Tier::Gpu
                },
                Event::Removed {
                    block_hashes: vec![7],
                    tier: Tier::Cpu
                },
                Event::AllCleared,
            ]
        );
    }

    #[test]
    fn decodes_the_map_encoding_and_ignores_new_fields() {
        let map =
            |kv: Vec<(&str, Value)>| Value::Map(kv.into_iter().map(|(k, v)| (s(k), v)).collect());
        let stored = map(vec![
            ("type", s("BlockStored")),
            ("block_hashes", Value::Array(vec![Value::from(-3i64)])),
            ("parent_block_hash", Value::from(9)),
            (
                "token_ids",
                Value::Array(vec![Value::from(5), Value::from(6)]),
            ),
            ("block_size", Value::from(2)),
            ("lora_id", Value::Nil),
            ("medium", Value::Nil),
            ("lora_name", s("adapter")),
            ("group_idx", Value::from(0)),
        ]);
        let batch = Value::Array(vec![
            Value::from(2.0),
            Value::Array(vec![stored]),
            Value::from(0),
        ]);
        let b = decode(&pack(batch)).unwrap();
        let Event::Stored {
            block_hashes,
            parent,
            salted,
            tier,
            ..
        } = &b.events[0]
        else {
            panic!("{:?}", b.events)
        };
        assert_eq!(
            (block_hashes[0], *parent, *salted, *tier),
            ((-3i64) as u64, Some(9), true, Tier::Gpu)
        );
    }

    #[test]
    fn rejects_garbage_with_a_reason() {
        assert!(decode(b"\xc1").is_err());
        let e = decode(&pack(Value::Array(vec![
            Value::from(1.0),
            Value::Array(vec![Value::from(3)]),
        ])))
        .unwrap_err();
        assert!(e.starts_with("events[0]"), "{e}");
    }
}
