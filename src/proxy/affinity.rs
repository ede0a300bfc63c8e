//! Responses API continuation affinity without a shared store.
//!
//! An engine keeps a stored response (and so a `previous_response_id` chain) in
//! its own memory, so a follow-up must reach the worker that answered. The
//! gateway writes the owner into the response ids it hands out (signed for the
//! tenant: `stored_id`): `<token>`, 16 hex digits of a seeded xxh3 of the
//! worker's URL, locates the worker. Every replica computes the same token for
//! the same URL, whatever order its workers are listed in, so any replica finds
//! the owner by looking the token up in its snapshot, and writes the engine's
//! own id back into the request on the way in.
//!
//! Rewriting out is a pass-through body ([`rewrite_ids`]) that replaces the
//! engine's id after `"id":"resp_` (and `response_id`, `previous_response_id`)
//! as bytes go by, holding back at most a partial match or an unfinished id at
//! the end of a chunk, so streamed events are never buffered.

use super::edited::{Edit, Edited};
use super::stored_id::{Issuer, MAX_ENGINE_ID};
use crate::routes::{ModelRoute, Snapshot};
use bytes::{Bytes, BytesMut};
use memchr::memmem;
use std::sync::Arc;

/// Seed of the owner token hash: fixed, so every replica (and every release)
/// agrees on it. The token only locates the owner; the id's MAC authenticates it.
const SEED: u64 = 0x7377_6974_6368_7964;

/// The owner token of a worker, from its URL.
pub fn owner_token(worker_id: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(worker_id.as_bytes(), SEED)
}

/// A stored response's owner: its route and its index in the route's workers.
pub type Owner<'s> = (&'s Arc<ModelRoute>, usize);

/// The route and worker index holding `token` among the routes `usable`
/// accepts (the tenant's models): in `preferred` (the request's own route)
/// first, else in any route of the snapshot (a split may have resolved the
/// model elsewhere; a by-id request names no model). Not found there: the
/// worker in a route `usable` refused, if any.
pub fn find_owner<'s>(
    snap: &'s Snapshot,
    preferred: Option<&'s Arc<ModelRoute>>,
    token: u64,
    usable: &dyn Fn(&ModelRoute) -> bool,
) -> Result<Owner<'s>, Option<Owner<'s>>> {
    let holds = |r: &'s Arc<ModelRoute>| {
        r.workers
            .iter()
            .position(|w| owner_token(&w.id) == token)
            .map(|i| (r, i))
    };
    let all = || {
        preferred.into_iter().chain(
            snap.pools
                .iter()
                .filter_map(|p| snap.pool_route(&p.name))
                .chain(snap.routes.values()),
        )
    };
    if let Some(found) = all().filter(|r| usable(r)).find_map(holds) {
        return Ok(found);
    }
    Err(all().find_map(holds))
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

/// `inner` with the engine's response ids replaced by the ids `issuer` signs.
pub(crate) fn rewrite_ids<B>(inner: B, issuer: Issuer) -> IdRewriter<B> {
    Edited::new(
        inner,
        Ids {
            issuer,
            held: BytesMut::new(),
            in_id: false,
            finders: PATTERNS.iter().map(|p| memmem::Finder::new(*p)).collect(),
        },
    )
}

/// The id edit: where the patterns are, how ids are signed, and what is held.
pub(crate) struct Ids {
    issuer: Issuer,
    /// The end of the last chunk that may begin a pattern, or an engine id
    /// not yet ended (`in_id`).
    held: BytesMut,
    /// `held` starts with an engine id whose closing quote has not come yet.
    in_id: bool,
    finders: Vec<memmem::Finder<'static>>,
}

impl Edit for Ids {
    /// Rewrite `data` (after what was held); hold back a suffix that is a
    /// proper prefix of a pattern, or an id not yet ended.
    fn pass(&mut self, data: &Bytes) -> Bytes {
        let mut buf = std::mem::take(&mut self.held);
        buf.extend_from_slice(data);
        // Where engine ids start: just after each pattern's opening quote.
        let mut hits: Vec<usize> = Vec::new();
        if std::mem::take(&mut self.in_id) {
            hits.push(0);
        }
        for (f, p) in self.finders.iter().zip(PATTERNS) {
            hits.extend(f.find_iter(&buf).map(|h| h + p.len() - b"resp_".len()));
        }
        hits.sort_unstable();
        let mut out = BytesMut::with_capacity(buf.len() + hits.len() * 48);
        let mut at = 0;
        for h in hits {
            if h < at {
                continue;
            }
            let window = &buf[h..buf.len().min(h + MAX_ENGINE_ID + 1)];
            match memchr::memchr(b'"', window) {
                Some(q) => {
                    out.extend_from_slice(&buf[at..h]);
                    at = h + q;
                    out.extend_from_slice(self.sign(&buf[h..at]).as_bytes());
                }
                None if window.len() <= MAX_ENGINE_ID => {
                    // The id goes on in the next chunk.
                    out.extend_from_slice(&buf[at..h]);
                    self.held = BytesMut::from(&buf[h..]);
                    self.in_id = true;
                    return out.freeze();
                }
                None => {} // too long to be an id we issue: left as it is
            }
        }
        let keep = partial_suffix(&buf[at..]);
        let cut = buf.len() - keep;
        out.extend_from_slice(&buf[at..cut]);
        self.held = BytesMut::from(&buf[cut..]);
        out.freeze()
    }

    fn rest(&mut self) -> Bytes {
        self.in_id = false;
        std::mem::take(&mut self.held).freeze()
    }
}

impl Ids {
    /// The gateway id for an engine id; the engine's as it is when it is not
    /// one the gateway accepts back (counted: a client could not continue it).
    fn sign(&self, engine_id: &[u8]) -> std::borrow::Cow<'_, str> {
        let id = std::str::from_utf8(engine_id).unwrap_or_default();
        match self.issuer.issue(id) {
            Some(signed) => signed.into(),
            None => {
                tracing::warn!("an engine response id has characters or a length the gateway does not issue; passed on unsigned");
                metrics::counter!(crate::telemetry::names::STORED_ID_REFUSALS_TOTAL,
                    crate::telemetry::names::L_REASON => "engine_id")
                .increment(1);
                String::from_utf8_lossy(engine_id).into_owned().into()
            }
        }
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
    use super::super::stored_id::{IdKey, MARK};
    use super::*;
    use crate::tenancy::Tenant;
    use http_body::Frame;
    use http_body_util::{BodyExt, StreamBody};

    fn tenant() -> Tenant {
        Tenant {
            name: Arc::from("t"),
            authenticated: true,
            residency: None,
            key_id: None,
            policy: None,
            slo: Default::default(),
            claims: Default::default(),
        }
    }

    #[test]
    fn owner_tokens_differ_by_worker() {
        let t = owner_token("http://10.0.0.7:8000");
        assert_eq!(t, owner_token("http://10.0.0.7:8000"));
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

    async fn rewrite_chunks(key: &IdKey, chunks: Vec<String>) -> String {
        let frames = chunks
            .into_iter()
            .map(|c| Ok::<_, std::convert::Infallible>(Frame::data(Bytes::from(c))));
        let body = StreamBody::new(futures_util::stream::iter(frames));
        let r = rewrite_ids(body, key.issuer(&tenant(), 0xab));
        let bytes = r.collect().await.unwrap().to_bytes();
        String::from_utf8(bytes.to_vec()).unwrap()
    }

    #[tokio::test]
    async fn rewrites_ids_across_chunk_boundaries_and_leaves_text_alone() {
        let key = IdKey::new(None);
        let issuer = key.issuer(&tenant(), 0xab);
        let (one, zero) = (
            issuer.issue("resp_1").unwrap(),
            issuer.issue("resp_0").unwrap(),
        );
        let src = r#"{"id":"resp_1","previous_response_id":"resp_0","text":"say \"id\":\"resp_x"}"#;
        let want = format!(
            r#"{{"id":"{one}","previous_response_id":"{zero}","text":"say \"id\":\"resp_x"}}"#
        );
        for split in 1..src.len() {
            let (a, b) = src.split_at(split);
            let out = rewrite_chunks(&key, vec![a.into(), b.into()]).await;
            assert_eq!(out, want, "split at {split}");
        }
        let bytes: Vec<String> = src.chars().map(String::from).collect();
        assert_eq!(rewrite_chunks(&key, bytes).await, want, "one byte a chunk");
        let sse = "event: response.created\ndata: {\"response\":{\"id\": \"resp_9\"}}\n\n";
        let out = rewrite_chunks(&key, vec![sse.into()]).await;
        let nine = issuer.issue("resp_9").unwrap();
        assert!(out.contains(&format!("\"id\": \"{nine}\"")), "{out}");
        assert!(out.ends_with("\n\n"), "a whole event is passed on at once");
        assert!(nine.starts_with(MARK));
    }

    #[tokio::test]
    async fn ids_it_would_not_accept_back_pass_unsigned() {
        let key = IdKey::new(None);
        let long = format!(r#"{{"id":"resp_{}"}}"#, "x".repeat(300));
        assert_eq!(rewrite_chunks(&key, vec![long.clone()]).await, long);
        let odd = r#"{"id":"resp_a/b"}"#.to_string();
        assert_eq!(rewrite_chunks(&key, vec![odd.clone()]).await, odd);
        let cut = r#"{"id":"resp_unfinished"#.to_string();
        assert_eq!(rewrite_chunks(&key, vec![cut.clone()]).await, cut);
    }
}
