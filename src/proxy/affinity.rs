//! Responses API continuation affinity without a shared store.
//!
//! An engine keeps a stored response (and so a `previous_response_id` chain) in
//! its own memory, so a follow-up must reach the worker that answered. The
//! gateway writes the owner into the response ids it hands out:
//! `resp_<engine>` becomes `resp_sy<token><resp_engine>`, where `<token>` is 16
//! hex digits of a seeded xxh3 of the worker's URL. Every replica computes the
//! same token for the same URL, whatever order its workers are listed in, so any
//! replica finds the owner by looking the token up in its snapshot, and writes
//! the engine's own id back into the request on the way in.
//!
//! Rewriting out is a pass-through body ([`rewrite_ids`]) that replaces
//! `"id":"resp_` (and `response_id`, `previous_response_id`) as bytes go by,
//! holding back at most a partial match at the end of a chunk, so streamed
//! events are never buffered.

use super::edited::{Edit, Edited};
use crate::routes::{ModelRoute, Snapshot};
use bytes::{Bytes, BytesMut};
use memchr::memmem;
use std::sync::Arc;

/// The prefix of ids the gateway issued.
const MARK: &str = "resp_sy";
/// Digits of the owner token.
const TOKEN_HEX: usize = 16;
/// Seed of the owner token hash: fixed, so every replica (and every release)
/// agrees on it.
const SEED: u64 = 0x7377_6974_6368_7964;

/// The owner token of a worker, from its URL.
pub fn owner_token(worker_id: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(worker_id.as_bytes(), SEED)
}

/// The id a client sees for `engine_id` answered by the worker with `token`.
pub fn encode(token: u64, engine_id: &str) -> String {
    format!("{MARK}{token:016x}{engine_id}")
}

/// A gateway-issued id split into the owner token and the engine's id; `None`
/// for ids the gateway did not issue.
pub fn decode(id: &str) -> Option<(u64, &str)> {
    let rest = id.strip_prefix(MARK)?;
    let hex = rest.get(..TOKEN_HEX)?;
    let engine = &rest[TOKEN_HEX..];
    if engine.is_empty() {
        return None;
    }
    Some((u64::from_str_radix(hex, 16).ok()?, engine))
}

/// The route and worker index holding `token`: in `preferred` (the request's own
/// route) first, else in any route of the snapshot (a split may have resolved
/// the model elsewhere; a by-id request names no model).
pub fn find_owner<'s>(
    snap: &'s Snapshot,
    preferred: Option<&'s Arc<ModelRoute>>,
    token: u64,
) -> Option<(&'s Arc<ModelRoute>, usize)> {
    let within = |r: &'s Arc<ModelRoute>| {
        r.workers
            .iter()
            .position(|w| owner_token(&w.id) == token)
            .map(|i| (r, i))
    };
    preferred
        .and_then(within)
        .or_else(|| {
            snap.pools
                .iter()
                .find_map(|p| snap.pool_route(&p.name).and_then(within))
        })
        .or_else(|| snap.routes.values().find_map(within))
}

/// `body` with every occurrence of the JSON string `"from"` replaced by `"to"`
/// (the client's gateway id by the engine's); unchanged (no copy) without one.
pub fn replace_string(body: &Bytes, from: &str, to: &str) -> Bytes {
    let needle = format!("\"{from}\"");
    let finder = memmem::Finder::new(needle.as_bytes());
    let mut hits = finder.find_iter(body).peekable();
    if hits.peek().is_none() {
        return body.clone();
    }
    let mut out = BytesMut::with_capacity(body.len());
    let mut at = 0;
    for hit in hits {
        out.extend_from_slice(&body[at..hit]);
        out.extend_from_slice(b"\"");
        out.extend_from_slice(to.as_bytes());
        out.extend_from_slice(b"\"");
        at = hit + needle.len();
    }
    out.extend_from_slice(&body[at..]);
    out.freeze()
}

/// Keys whose `resp_` values are response ids (the one a response object has,
/// the one it continues, and the one events name).
const PATTERNS: &[&[u8]] = &[
    b"\"id\":\"resp_",
    b"\"id\": \"resp_",
    b"\"response_id\":\"resp_",
    b"\"response_id\": \"resp_",
    b"\"previous_response_id\":\"resp_",
    b"\"previous_response_id\": \"resp_",
];

/// Replaces engine response ids by gateway ids in a body as it streams.
pub(crate) type IdRewriter<B> = Edited<B, Ids>;

/// `inner` with the engine's response ids replaced by the gateway's for `token`.
pub(crate) fn rewrite_ids<B>(inner: B, token: u64) -> IdRewriter<B> {
    Edited::new(
        inner,
        Ids {
            insert: format!("{MARK}{token:016x}").into_bytes(),
            held: BytesMut::new(),
            finders: PATTERNS.iter().map(|p| memmem::Finder::new(*p)).collect(),
        },
    )
}

/// The id edit: where the patterns are, what to insert, and what is held.
pub(crate) struct Ids {
    /// `"resp_sy<token>` inserted before each engine id's `resp_`.
    insert: Vec<u8>,
    /// The end of the last chunk that may begin a pattern.
    held: BytesMut,
    finders: Vec<memmem::Finder<'static>>,
}

impl Edit for Ids {
    /// Rewrite `data` (after what was held); hold back a suffix that is a
    /// proper prefix of a pattern.
    fn pass(&mut self, data: &Bytes) -> Bytes {
        let mut buf = std::mem::take(&mut self.held);
        buf.extend_from_slice(data);
        let mut hits: Vec<usize> = Vec::new();
        for (f, p) in self.finders.iter().zip(PATTERNS) {
            // The insertion point: just before `resp_`.
            hits.extend(f.find_iter(&buf).map(|h| h + p.len() - b"resp_".len()));
        }
        hits.sort_unstable();
        let keep = partial_suffix(&buf);
        let cut = buf.len() - keep;
        let mut out = BytesMut::with_capacity(cut + hits.len() * self.insert.len());
        let mut at = 0;
        for h in hits.into_iter().filter(|&h| h < cut) {
            out.extend_from_slice(&buf[at..h]);
            out.extend_from_slice(&self.insert);
            at = h;
        }
        out.extend_from_slice(&buf[at..cut]);
        self.held = BytesMut::from(&buf[cut..]);
        out.freeze()
    }

    fn rest(&mut self) -> Bytes {
        std::mem::take(&mut self.held).freeze()
    }
}

/// Length of the longest suffix of `buf` that is a proper prefix of a pattern
/// (a match cut by a chunk boundary).
fn partial_suffix(buf: &[u8]) -> usize {
    PATTERNS
        .iter()
        .flat_map(|p| (1..p.len()).rev().map(move |n| (p, n)))
        .filter(|(p, n)| *n <= buf.len() && buf.ends_with(&p[..*n]))
        .map(|(_, n)| n)
        .max()
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body::Frame;
    use http_body_util::{BodyExt, StreamBody};

    #[test]
    fn ids_round_trip_and_foreign_ids_are_not_decoded() {
        let t = owner_token("http://10.0.0.7:8000");
        let id = encode(t, "resp_abc123");
        assert!(id.starts_with("resp_sy"));
        assert_eq!(decode(&id), Some((t, "resp_abc123")));
        assert_eq!(decode("resp_abc123"), None);
        assert_eq!(decode("resp_syzz"), None);
        assert_eq!(decode(&format!("resp_sy{t:016x}")), None);
        assert_ne!(t, owner_token("http://10.0.0.8:8000"));
    }

    #[test]
    fn replace_string_swaps_whole_json_strings_only() {
        let b = Bytes::from_static(br#"{"previous_response_id":"resp_syX","input":"resp_syXY"}"#);
        let out = replace_string(&b, "resp_syX", "resp_1");
        assert_eq!(
            &out[..],
            br#"{"previous_response_id":"resp_1","input":"resp_syXY"}"#
        );
    }

    async fn rewrite_chunks(chunks: Vec<&'static str>) -> String {
        let frames = chunks.into_iter().map(|c| {
            Ok::<_, std::convert::Infallible>(Frame::data(Bytes::from_static(c.as_bytes())))
        });
        let body = StreamBody::new(futures_util::stream::iter(frames));
        let r = rewrite_ids(body, 0xab);
        let bytes = r.collect().await.unwrap().to_bytes();
        String::from_utf8(bytes.to_vec()).unwrap()
    }

    #[tokio::test]
    async fn rewrites_ids_across_chunk_boundaries_and_leaves_text_alone() {
        let tok = "resp_sy00000000000000ab";
        for split in 1..30 {
            let src =
                r#"{"id":"resp_1","previous_response_id":"resp_0","text":"say \"id\":\"resp_x"}"#;
            let (a, b) = src.split_at(split);
            let a: &'static str = Box::leak(a.to_string().into_boxed_str());
            let b: &'static str = Box::leak(b.to_string().into_boxed_str());
            let out = rewrite_chunks(vec![a, b]).await;
            assert_eq!(
                out,
                format!(
                    r#"{{"id":"{tok}resp_1","previous_response_id":"{tok}resp_0","text":"say \"id\":\"resp_x"}}"#
                ),
                "split at {split}"
            );
        }
        let sse = "event: response.created\ndata: {\"response\":{\"id\": \"resp_9\"}}\n\n";
        let out = rewrite_chunks(vec![sse]).await;
        assert!(out.contains(&format!("\"id\": \"{tok}resp_9\"")), "{out}");
        assert!(out.ends_with("\n\n"), "a whole event is passed on at once");
    }
}
