//! The engine's KV-cache events over ZeroMQ, as vLLM publishes them
//! (`vllm/distributed/kv_events.py`): a PUB socket sends multipart messages
//! `[topic, sequence (8 bytes, big-endian), msgpack KVEventBatch]`, one per engine
//! step that changed the cache, numbered from 0; a ROUTER socket answers replay
//! requests (`[identity, "", start sequence]`) with every buffered batch from that
//! sequence on (`[identity, "", sequence, payload]`) and an end marker (sequence
//! -1, empty payload). Test knobs drop or reorder a range of live messages (the
//! replay buffer still holds them), as a lossy network would.

use super::kv::CacheEvent;
use bytes::Bytes;
use rmpv::Value;
use std::collections::VecDeque;
use std::ops::RangeInclusive;
use tokio::sync::mpsc;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

/// Batches kept for replay (vLLM's default `buffer_steps`).
pub const REPLAY_BUFFER: usize = 10_000;

/// How events are encoded inside a batch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum EventFormat {
    /// Tagged maps (`{"type": "BlockStored", ...}`): current vLLM and SGLang.
    #[default]
    Map,
    /// Tagged positional arrays (`["BlockStored", ...]`): earlier releases.
    Array,
}

/// Where and how the engine publishes its KV events.
#[derive(Clone, Debug, PartialEq)]
pub struct KvEventsConfig {
    /// PUB endpoint to bind, e.g. `tcp://127.0.0.1:5557` (port 0: ephemeral).
    pub events: String,
    /// ROUTER endpoint to bind for replays.
    pub replay: Option<String>,
    pub topic: String,
    pub format: EventFormat,
    /// Live messages with these sequence numbers are not sent (still replayable).
    pub drop: Option<RangeInclusive<u64>>,
    /// Live messages with these sequence numbers are held back and sent in
    /// reverse order after the last of them.
    pub reorder: Option<RangeInclusive<u64>>,
    /// Tokens per block (reported in `BlockStored.block_size`).
    pub block_size: usize,
}

/// The bound endpoints (`tcp://IP:PORT`).
#[derive(Clone, Debug)]
pub struct Bound {
    pub events: String,
    pub replay: Option<String>,
}

/// Bind the sockets and start publishing what arrives on the returned sender.
pub async fn start(cfg: KvEventsConfig) -> std::io::Result<(Bound, mpsc::Sender<Vec<CacheEvent>>)> {
    let io = |e: zeromq::ZmqError| std::io::Error::other(e.to_string());
    let mut publ = PubSocket::new();
    let events = publ.bind(&cfg.events).await.map_err(io)?.to_string();
    let mut router = None;
    let mut replay = None;
    if let Some(r) = &cfg.replay {
        let mut s = RouterSocket::new();
        replay = Some(s.bind(r).await.map_err(io)?.to_string());
        router = Some(s);
    }
    let (tx, rx) = mpsc::channel(1024);
    tokio::spawn(
        Publisher {
            cfg,
            publ,
            buffer: VecDeque::new(),
            held: Vec::new(),
            next: 0,
        }
        .run(rx, router),
    );
    Ok((Bound { events, replay }, tx))
}

struct Publisher {
    cfg: KvEventsConfig,
    publ: PubSocket,
    buffer: VecDeque<(u64, Bytes)>,
    /// Reordered messages held back.
    held: Vec<(u64, Bytes)>,
    next: u64,
}

impl Publisher {
    async fn run(
        mut self,
        mut rx: mpsc::Receiver<Vec<CacheEvent>>,
        mut router: Option<RouterSocket>,
    ) {
        loop {
            tokio::select! {
                batch = rx.recv() => match batch {
                    Some(b) => self.publish(&b).await,
                    None => return,
                },
                req = async { router.as_mut()?.recv().await.ok() }, if router.is_some() => {
                    if let (Some(r), Some(req)) = (router.as_mut(), req) {
                        self.serve_replay(r, req).await;
                    }
                }
            }
        }
    }

    async fn publish(&mut self, events: &[CacheEvent]) {
        let seq = self.next;
        self.next += 1;
        let payload = Bytes::from(encode_batch(events, self.cfg.block_size, self.cfg.format));
        if self.buffer.len() == REPLAY_BUFFER {
            self.buffer.pop_front();
        }
        self.buffer.push_back((seq, payload.clone()));
        if self.cfg.drop.as_ref().is_some_and(|r| r.contains(&seq)) {
            return;
        }
        if let Some(r) = self.cfg.reorder.clone().filter(|r| r.contains(&seq)) {
            self.held.push((seq, payload));
            if seq == *r.end() {
                for (s, p) in std::mem::take(&mut self.held).into_iter().rev() {
                    self.send(s, p).await;
                }
            }
            return;
        }
        self.send(seq, payload).await;
    }

    async fn send(&mut self, seq: u64, payload: Bytes) {
        let frames = vec![
            Bytes::from(self.cfg.topic.clone().into_bytes()),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            payload,
        ];
        if let Ok(m) = ZmqMessage::try_from(frames) {
            let _ = self.publ.send(m).await;
        }
    }

    /// Answer `[identity, "", start]` with the buffered batches from `start` on.
    async fn serve_replay(&mut self, r: &mut RouterSocket, req: ZmqMessage) {
        let frames = req.into_vec();
        let (Some(id), Some(start)) = (frames.first(), frames.last()) else {
            return;
        };
        let Ok(start) = <[u8; 8]>::try_from(start.as_ref()).map(u64::from_be_bytes) else {
            tracing::warn!("sim: malformed KV replay request");
            return;
        };
        let reply = |seq: Bytes, payload: Bytes| {
            ZmqMessage::try_from(vec![id.clone(), Bytes::new(), seq, payload]).ok()
        };
        for (seq, p) in self.buffer.iter().filter(|(s, _)| *s >= start) {
            if let Some(m) = reply(Bytes::copy_from_slice(&seq.to_be_bytes()), p.clone()) {
                if r.send(m).await.is_err() {
                    return;
                }
            }
        }
        if let Some(m) = reply(Bytes::copy_from_slice(&(-1i64).to_be_bytes()), Bytes::new()) {
            let _ = r.send(m).await;
        }
    }
}

/// A `KVEventBatch`: `[ts, events, data_parallel_rank]`.
pub fn encode_batch(events: &[CacheEvent], block_size: usize, format: EventFormat) -> Vec<u8> {
    let ts = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    let evs = events
        .iter()
        .map(|e| encode_event(e, block_size, format))
        .collect();
    let batch = Value::Array(vec![Value::from(ts), Value::Array(evs), Value::from(0)]);
    let mut out = Vec::new();
    // Writing to a Vec cannot fail.
    let _ = rmpv::encode::write_value(&mut out, &batch);
    out
}

fn encode_event(e: &CacheEvent, block_size: usize, format: EventFormat) -> Value {
    let (tag, fields): (&str, Vec<(&str, Value)>) = match e {
        CacheEvent::Stored {
            hash,
            parent,
            tokens,
            salted,
        } => (
            "BlockStored",
            vec![
                ("block_hashes", Value::Array(vec![Value::from(*hash)])),
                ("parent_block_hash", parent.map_or(Value::Nil, Value::from)),
                (
                    "token_ids",
                    Value::Array(tokens.iter().map(|&t| Value::from(t)).collect()),
                ),
                ("block_size", Value::from(block_size)),
                ("lora_id", Value::Nil),
                ("medium", Value::from("GPU")),
                ("lora_name", Value::Nil),
                // One entry per block: what salts its hash beyond the tokens.
                (
                    "extra_keys",
                    Value::Array(vec![if *salted {
                        Value::Array(vec![Value::from("cache_salt")])
                    } else {
                        Value::Nil
                    }]),
                ),
            ],
        ),
        CacheEvent::Removed { hash } => removed(*hash, "GPU"),
        CacheEvent::OffloadEvicted { hash } => removed(*hash, "CPU"),
        // As vLLM's offloading connector publishes it: the engine's hash (the
        // GPU block's), no parent, no tokens.
        CacheEvent::Offloaded { hash } => (
            "BlockStored",
            vec![
                ("block_hashes", Value::Array(vec![Value::from(*hash)])),
                ("parent_block_hash", Value::Nil),
                ("token_ids", Value::Array(Vec::new())),
                ("block_size", Value::from(block_size)),
                ("lora_id", Value::Nil),
                ("medium", Value::from("CPU")),
                ("lora_name", Value::Nil),
            ],
        ),
    };
    match format {
        EventFormat::Array => Value::Array(
            std::iter::once(Value::from(tag))
                .chain(fields.into_iter().map(|f| f.1))
                .collect(),
        ),
        EventFormat::Map => Value::Map(
            std::iter::once(("type", Value::from(tag)))
                .chain(fields)
                .map(|(k, v)| (Value::from(k), v))
                .collect(),
        ),
    }
}

fn removed(hash: u64, medium: &'static str) -> (&'static str, Vec<(&'static str, Value)>) {
    (
        "BlockRemoved",
        vec![
            ("block_hashes", Value::Array(vec![Value::from(hash)])),
            ("medium", Value::from(medium)),
        ],
    )
}

/// The sequence range a `--kv-drop-seqs` / `--kv-reorder-seqs` value names:
/// `A-B` or a single `A`.
pub fn parse_range(s: &str) -> Result<RangeInclusive<u64>, String> {
    let bad = || format!("expected a sequence number or a range A-B, got {s:?}");
    let (a, b) = s.split_once('-').unwrap_or((s, s));
    let (a, b) = (
        a.trim().parse().map_err(|_| bad())?,
        b.trim().parse().map_err(|_| bad())?,
    );
    if a > b {
        return Err(bad());
    }
    Ok(a..=b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges() {
        assert_eq!(parse_range("3-5"), Ok(3..=5));
        assert_eq!(parse_range("7"), Ok(7..=7));
        assert!(parse_range("5-3").is_err());
        assert!(parse_range("x").is_err());
    }

    #[test]
    fn batches_are_msgpack_arrays_with_tagged_events() {
        let e = [CacheEvent::Removed { hash: 9 }];
        for f in [EventFormat::Map, EventFormat::Array] {
            let b = encode_batch(&e, 16, f);
            let v = rmpv::decode::read_value(&mut &b[..]).unwrap();
            let items = v.as_array().unwrap();
            assert_eq!(items.len(), 3);
            let ev = &items[1].as_array().unwrap()[0];
            match f {
                EventFormat::Map => {
                    assert_eq!(ev.as_map().unwrap()[0].1.as_str(), Some("BlockRemoved"))
                }
                EventFormat::Array => {
                    assert_eq!(ev.as_array().unwrap()[0].as_str(), Some("BlockRemoved"))
                }
            }
        }
    }
}
