//! Tokens of prompt segments, kept so a shared prefix (system prompt, earlier
//! turns) is encoded once.
//!
//! Exactness: a rendered prompt is cut only around the special tokens the
//! tokenizer itself splits out before its pre-tokenizer and model run (added
//! tokens marked `special`, without `lstrip`/`rstrip`/`single_word`/`normalized`,
//! matched leftmost-longest as the tokenizer matches them). No BPE merge or
//! pre-tokenizer rule can cross such a token, so the concatenated segment tokens
//! equal the tokens of the whole text. Tokenizers where that does not hold (an
//! added token that strips whitespace, a Metaspace pre-tokenizer that treats the
//! first piece differently) get a disabled cache (`hf::segment_cache`). The
//! property test in `hf` proves the equality on a real tokenizer.
//!
//! Bounds: at most `max_tokens` cached tokens over all shards, evicted in CLOCK
//! order (a hit sets a reference bit; eviction skips referenced entries once).

use super::TokenizeError;
use crate::telemetry::names;
use aho_corasick::{AhoCorasick, MatchKind};
use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use xxhash_rust::xxh3::xxh3_64;

const SHARDS: usize = 16;
/// Segments shorter than this are encoded directly: a lookup costs about as much.
const MIN_CACHED_BYTES: usize = 64;

/// Hit and size counters of a [`SegmentCache`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub hits: u64,
    pub misses: u64,
    pub evictions: u64,
    pub tokens: u64,
    pub entries: u64,
}

struct Entry {
    tokens: Arc<[u32]>,
    referenced: bool,
}

#[derive(Default)]
struct Shard {
    map: HashMap<u64, Entry>,
    clock: VecDeque<u64>,
    tokens: usize,
}

/// A bounded map from segment text to its tokens, plus the splitter that cuts
/// text into segments.
pub struct SegmentCache {
    splitter: Option<AhoCorasick>,
    specials: Vec<u32>,
    shards: Vec<Mutex<Shard>>,
    shard_budget: usize,
    hits: AtomicU64,
    misses: AtomicU64,
    evictions: AtomicU64,
}

impl std::fmt::Debug for SegmentCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SegmentCache")
            .field("stats", &self.stats())
            .finish()
    }
}

/// A piece of text: ordinary text to encode, or a special token's id.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Piece<'a> {
    Text(&'a str),
    Special(u32),
}

impl SegmentCache {
    /// `specials`: the (content, id) of every added token the tokenizer splits
    /// out verbatim; `max_tokens`: the bound on cached tokens (0 disables caching).
    pub fn new(specials: Vec<(String, u32)>, max_tokens: usize) -> Self {
        let splitter = (!specials.is_empty()).then(|| {
            AhoCorasick::builder()
                .match_kind(MatchKind::LeftmostLongest)
                .build(specials.iter().map(|(s, _)| s.as_str()))
                .expect("special tokens build an automaton")
        });
        SegmentCache {
            splitter,
            specials: specials.into_iter().map(|(_, id)| id).collect(),
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            shard_budget: max_tokens / SHARDS,
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
        }
    }

    /// `text` cut around special tokens, in order.
    pub(crate) fn split<'a>(&self, text: &'a str) -> Vec<Piece<'a>> {
        let mut out = Vec::new();
        let mut at = 0;
        if let Some(ac) = &self.splitter {
            for m in ac.find_iter(text) {
                if m.start() > at {
                    out.push(Piece::Text(&text[at..m.start()]));
                }
                out.push(Piece::Special(self.specials[m.pattern().as_usize()]));
                at = m.end();
            }
        }
        if at < text.len() {
            out.push(Piece::Text(&text[at..]));
        }
        out
    }

    /// Tokens of all of `text`: each segment from the cache or from `encode`;
    /// a disabled cache (budget 0) encodes the whole text at once.
    pub(crate) fn encode<E>(&self, text: &str, mut encode: E) -> Result<Vec<u32>, TokenizeError>
    where
        E: FnMut(&str) -> Result<Vec<u32>, TokenizeError>,
    {
        if self.shard_budget == 0 {
            return encode(text);
        }
        let mut out = Vec::with_capacity(text.len() / 3);
        for piece in self.split(text) {
            match piece {
                Piece::Special(id) => out.push(id),
                Piece::Text(s) if s.len() < MIN_CACHED_BYTES => out.extend(encode(s)?),
                Piece::Text(s) => out.extend_from_slice(&self.segment(s, &mut encode)?),
            }
        }
        Ok(out)
    }

    fn segment<E>(&self, s: &str, encode: &mut E) -> Result<Arc<[u32]>, TokenizeError>
    where
        E: FnMut(&str) -> Result<Vec<u32>, TokenizeError>,
    {
        let key = xxh3_64(s.as_bytes());
        let shard = &self.shards[(key >> 60) as usize % SHARDS];
        if let Some(e) = shard.lock().map.get_mut(&key) {
            e.referenced = true;
            self.hits.fetch_add(1, Ordering::Relaxed);
            metrics::counter!(names::TOKENIZE_CACHE_HITS_TOTAL).increment(1);
            return Ok(e.tokens.clone());
        }
        self.misses.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(names::TOKENIZE_CACHE_MISSES_TOTAL).increment(1);
        let tokens: Arc<[u32]> = encode(s)?.into();
        if tokens.len() <= self.shard_budget {
            let (evicted, delta) = shard.lock().insert(key, tokens.clone(), self.shard_budget);
            self.evictions.fetch_add(evicted, Ordering::Relaxed);
            metrics::counter!(names::TOKENIZE_CACHE_EVICTIONS_TOTAL).increment(evicted);
            metrics::gauge!(names::TOKENIZE_CACHE_TOKENS).increment(delta as f64);
        }
        Ok(tokens)
    }

    pub fn stats(&self) -> CacheStats {
        let (mut tokens, mut entries) = (0, 0);
        for s in &self.shards {
            let s = s.lock();
            tokens += s.tokens as u64;
            entries += s.map.len() as u64;
        }
        CacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            evictions: self.evictions.load(Ordering::Relaxed),
            tokens,
            entries,
        }
    }
}

impl Shard {
    /// Insert and evict down to `budget` tokens; returns how many entries were
    /// evicted and the change in cached tokens.
    fn insert(&mut self, key: u64, tokens: Arc<[u32]>, budget: usize) -> (u64, i64) {
        let len = tokens.len();
        let before = self.tokens as i64;
        if self
            .map
            .insert(
                key,
                Entry {
                    tokens,
                    referenced: false,
                },
            )
            .is_some()
        {
            return (0, 0); // raced with another miss on the same segment: same tokens
        }
        self.clock.push_back(key);
        self.tokens += len;
        let mut evicted = 0;
        while self.tokens > budget {
            let Some(k) = self.clock.pop_front() else {
                break;
            };
            match self.map.get_mut(&k) {
                Some(e) if e.referenced && k != key => {
                    e.referenced = false;
                    self.clock.push_back(k);
                }
                Some(_) => {
                    let e = self.map.remove(&k).expect("present");
                    self.tokens -= e.tokens.len();
                    evicted += 1;
                }
                None => {}
            }
        }
        (evicted, self.tokens as i64 - before)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache(max: usize) -> SegmentCache {
        SegmentCache::new(
            vec![("<|end|>".into(), 1), ("<|e".into(), 2), ("<s>".into(), 3)],
            max,
        )
    }

    #[test]
    fn splits_leftmost_longest_around_specials() {
        let c = cache(1000);
        assert_eq!(
            c.split("<s>a<|end|><|eb"),
            vec![
                Piece::Special(3),
                Piece::Text("a"),
                Piece::Special(1),
                Piece::Special(2),
                Piece::Text("b")
            ]
        );
        assert_eq!(c.split(""), vec![]);
    }

    #[test]
    fn second_encode_of_a_long_segment_is_a_hit() {
        let c = cache(10_000);
        let text = format!("{}<|end|>tail", "x".repeat(100));
        let mut calls = 0;
        let mut enc = |s: &str| {
            calls += 1;
            Ok(s.bytes().map(u32::from).collect())
        };
        let a = c.encode(&text, &mut enc).unwrap();
        let b = c.encode(&text, &mut enc).unwrap();
        assert_eq!(a, b);
        assert_eq!(
            calls, 3,
            "the long segment is encoded once, the short tail twice"
        );
        let s = c.stats();
        assert_eq!((s.hits, s.misses, s.entries, s.tokens), (1, 1, 1, 100));
    }

    #[test]
    fn memory_stays_within_the_token_budget() {
        let c = cache(16 * 200);
        let enc = |s: &str| Ok(s.bytes().map(u32::from).collect());
        for i in 0..2000 {
            c.encode(&format!("{i:0>80}"), enc).unwrap();
        }
        let s = c.stats();
        assert!(s.tokens <= 16 * 200, "{s:?}");
        assert!(s.evictions > 0 && s.entries > 0, "{s:?}");
    }
}
