//! Paged KV cache with a prefix cache, after vLLM's v1 `KVCacheManager`.
//!
//! The cache has `num_blocks` blocks of `block_size` tokens. A full block is
//! identified by a chained hash (parent block hash + the block's token ids),
//! so a block matches only when the whole prefix before it matches too. Blocks
//! nobody references stay cached in an LRU free queue and are evicted (their
//! hash forgotten) when a new block is needed. Partial blocks are never shared.
//! With a CPU offload tier (`offload.rs`) an evicted block keeps a copy in host
//! memory that a later prompt can load back.

use std::collections::HashMap;

use super::offload::CpuTier;
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

const NIL: u32 = u32::MAX;

/// Hash of the first block's parent: model name and salt, so different models
/// or tenants (`cache_salt`) never share blocks.
pub fn root_hash(model: &str, salt: Option<&str>) -> u64 {
    let mut s = String::with_capacity(model.len() + 16);
    s.push_str(model);
    s.push('\u{0}');
    if let Some(salt) = salt {
        s.push_str(salt);
    }
    xxh3_64(s.as_bytes())
}

/// Hash of one full block given its parent's hash.
pub fn block_hash(parent: u64, tokens: &[u32]) -> u64 {
    let mut buf = Vec::with_capacity(tokens.len() * 4);
    for t in tokens {
        buf.extend_from_slice(&t.to_le_bytes());
    }
    xxh3_64_with_seed(&buf, parent)
}

/// Extend `hashes` so it covers every full block of `tokens`.
pub fn extend_hashes(root: u64, hashes: &mut Vec<u64>, tokens: &[u32], block_size: usize) {
    let full = tokens.len() / block_size;
    while hashes.len() < full {
        let i = hashes.len();
        let parent = if i == 0 { root } else { hashes[i - 1] };
        hashes.push(block_hash(
            parent,
            &tokens[i * block_size..(i + 1) * block_size],
        ));
    }
}

/// A change to the prefix cache, as the engine publishes it (`sim/kv_events.rs`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CacheEvent {
    /// A full block entered the prefix cache: its hash, its parent's (`None` for
    /// a prompt's first block), its tokens, and whether it is salted beyond its
    /// tokens (a `cache_salt` request's blocks).
    Stored {
        hash: u64,
        parent: Option<u64>,
        tokens: Vec<u32>,
        salted: bool,
    },
    /// A cached block was evicted from the GPU.
    Removed { hash: u64 },
    /// An evicted block's copy entered the CPU tier (vLLM's offloading
    /// connector publishes it as `BlockStored`, medium `CPU`, without tokens).
    Offloaded { hash: u64 },
    /// A block fell out of the CPU tier (`BlockRemoved`, medium `CPU`).
    OffloadEvicted { hash: u64 },
}

/// Most events kept between two drains; beyond, the oldest are dropped (the
/// publisher drains after every step).
const MAX_PENDING_EVENTS: usize = 1 << 16;

#[derive(Debug)]
pub struct KvCache {
    block_size: usize,
    ref_cnt: Vec<u32>,
    hash: Vec<Option<u64>>,
    // Intrusive doubly linked LRU list of unreferenced blocks: head evicts first.
    prev: Vec<u32>,
    next: Vec<u32>,
    head: u32,
    tail: u32,
    free: usize,
    cached: HashMap<u64, u32>,
    prefix_caching: bool,
    /// Where evicted blocks go, when the engine offloads to CPU.
    cpu: Option<CpuTier>,
    /// Recorded events, when publishing is on.
    events: Option<Vec<CacheEvent>>,
}

impl KvCache {
    pub fn new(num_blocks: usize, block_size: usize, prefix_caching: bool) -> Self {
        let n = num_blocks.min(NIL as usize - 1);
        let mut kv = KvCache {
            block_size,
            ref_cnt: vec![0; n],
            hash: vec![None; n],
            prev: vec![NIL; n],
            next: vec![NIL; n],
            head: NIL,
            tail: NIL,
            free: 0,
            cached: HashMap::new(),
            prefix_caching,
            cpu: None,
            events: None,
        };
        for b in 0..n as u32 {
            kv.push_back(b);
        }
        kv
    }

    /// Keep up to `blocks` evicted blocks in a CPU tier (0: none).
    pub fn with_cpu_offload(mut self, blocks: usize) -> Self {
        self.cpu = (blocks > 0 && self.prefix_caching).then(|| CpuTier::new(blocks));
        self
    }

    /// How many of `hashes`, from the first, the CPU tier holds.
    pub fn cpu_run(&self, hashes: &[u64]) -> usize {
        self.cpu.as_ref().map_or(0, |c| c.run(hashes))
    }

    /// Mark `hashes` recently used in the CPU tier (they are being loaded, so
    /// the evictions of the same admission do not push them out).
    pub fn cpu_touch(&mut self, hashes: &[u64]) {
        if let Some(c) = &mut self.cpu {
            hashes.iter().for_each(|h| c.touch(*h));
        }
    }

    /// Blocks held in the CPU tier.
    pub fn cpu_blocks(&self) -> usize {
        self.cpu.as_ref().map_or(0, CpuTier::held)
    }

    /// An evicted block's hash goes to the CPU tier (copied before the GPU
    /// block is freed, so `Offloaded` precedes `Removed`).
    fn evicted(&mut self, h: u64) {
        if let Some(c) = &mut self.cpu {
            let (new, out) = c.insert(h);
            if new {
                self.record(CacheEvent::Offloaded { hash: h });
            }
            for o in out {
                self.record(CacheEvent::OffloadEvicted { hash: o });
            }
        }
        self.record(CacheEvent::Removed { hash: h });
    }

    /// Record [`CacheEvent`]s from now on.
    pub fn record_events(&mut self) {
        self.events.get_or_insert_with(Vec::new);
    }

    /// The events recorded since the last call.
    pub fn take_events(&mut self) -> Vec<CacheEvent> {
        self.events.as_mut().map(std::mem::take).unwrap_or_default()
    }

    fn record(&mut self, e: CacheEvent) {
        if let Some(v) = &mut self.events {
            if v.len() >= MAX_PENDING_EVENTS {
                v.remove(0);
            }
            v.push(e);
        }
    }

    /// [`commit`](Self::commit), recording the block as stored when it entered
    /// the cache: `parent` is the previous block's hash, `tokens` the block's.
    pub fn commit_block(
        &mut self,
        b: u32,
        h: u64,
        parent: Option<u64>,
        tokens: &[u32],
        salted: bool,
    ) {
        if self.commit(b, h) && self.events.is_some() {
            self.record(CacheEvent::Stored {
                hash: h,
                parent,
                tokens: tokens.to_vec(),
                salted,
            });
        }
    }

    pub fn num_blocks(&self) -> usize {
        self.ref_cnt.len()
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks that can be handed out (unreferenced, cached or empty).
    pub fn free_blocks(&self) -> usize {
        self.free
    }

    /// Blocks referenced by at least one sequence.
    pub fn used_blocks(&self) -> usize {
        self.num_blocks() - self.free
    }

    fn push_back(&mut self, b: u32) {
        let i = b as usize;
        self.prev[i] = self.tail;
        self.next[i] = NIL;
        if self.tail == NIL {
            self.head = b;
        } else {
            self.next[self.tail as usize] = b;
        }
        self.tail = b;
        self.free += 1;
    }

    fn push_front(&mut self, b: u32) {
        let i = b as usize;
        self.next[i] = self.head;
        self.prev[i] = NIL;
        if self.head == NIL {
            self.tail = b;
        } else {
            self.prev[self.head as usize] = b;
        }
        self.head = b;
        self.free += 1;
    }

    fn unlink(&mut self, b: u32) {
        let i = b as usize;
        let (p, n) = (self.prev[i], self.next[i]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[i] = NIL;
        self.next[i] = NIL;
        self.free -= 1;
    }

    /// Longest run of cached blocks matching `hashes` from the start, capped at
    /// `max_blocks`. Does not take references.
    pub fn lookup(&self, hashes: &[u64], max_blocks: usize) -> Vec<u32> {
        if !self.prefix_caching {
            return Vec::new();
        }
        hashes
            .iter()
            .take(max_blocks)
            .map_while(|h| self.cached.get(h).copied())
            .collect()
    }

    /// Can `hit` (from [`lookup`](Self::lookup)) be taken plus `new` fresh blocks?
    pub fn can_take(&self, hit: &[u32], new: usize) -> bool {
        let hit_in_free = hit
            .iter()
            .filter(|&&b| self.ref_cnt[b as usize] == 0)
            .count();
        self.free >= hit_in_free + new
    }

    /// Take a reference on cached blocks found by [`lookup`](Self::lookup).
    pub fn touch(&mut self, hit: &[u32]) {
        for &b in hit {
            if self.ref_cnt[b as usize] == 0 {
                self.unlink(b);
            }
            self.ref_cnt[b as usize] += 1;
        }
    }

    /// Allocate `n` fresh blocks, evicting the least recently used cached ones.
    /// Returns `None` (and allocates nothing) when fewer than `n` are free.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<u32>> {
        if self.free < n {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let b = self.head;
            self.unlink(b);
            if let Some(h) = self.hash[b as usize].take() {
                if self.cached.get(&h) == Some(&b) {
                    self.cached.remove(&h);
                    self.evicted(h);
                }
            }
            self.ref_cnt[b as usize] = 1;
            out.push(b);
        }
        Some(out)
    }

    /// Record that block `b` is full and holds the prefix identified by `h`;
    /// whether the prefix entered the cache (it was not cached already).
    pub fn commit(&mut self, b: u32, h: u64) -> bool {
        if !self.prefix_caching || self.hash[b as usize].is_some() {
            return false;
        }
        if let std::collections::hash_map::Entry::Vacant(e) = self.cached.entry(h) {
            e.insert(b);
            self.hash[b as usize] = Some(h);
            return true;
        }
        false
    }

    /// Drop one reference on each block. Tail blocks become evictable before
    /// head blocks (a shared prefix outlives its continuations); blocks that
    /// hold no cached prefix are reused first.
    pub fn release(&mut self, blocks: &[u32]) {
        for &b in blocks.iter().rev() {
            let rc = &mut self.ref_cnt[b as usize];
            if *rc == 0 {
                continue;
            }
            *rc -= 1;
            if *rc == 0 {
                if self.hash[b as usize].is_some() {
                    self.push_back(b);
                } else {
                    self.push_front(b);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hashes(tokens: &[u32], bs: usize) -> Vec<u64> {
        let mut h = Vec::new();
        extend_hashes(root_hash("m", None), &mut h, tokens, bs);
        h
    }

    #[test]
    fn chained_hashes_depend_on_prefix() {
        let a = hashes(&[1, 2, 3, 4, 5, 6, 7, 8], 4);
        let b = hashes(&[9, 2, 3, 4, 5, 6, 7, 8], 4);
        assert_eq!(a.len(), 2);
        assert_ne!(
            a[1], b[1],
            "second block differs because its parent differs"
        );
        assert_ne!(root_hash("m", Some("x")), root_hash("m", None));
    }

    #[test]
    fn hit_after_release_then_lru_eviction() {
        let mut kv = KvCache::new(4, 4, true);
        let h = hashes(&[1, 2, 3, 4, 5, 6, 7, 8], 4);
        let blocks = kv.allocate(2).unwrap();
        kv.commit(blocks[0], h[0]);
        kv.commit(blocks[1], h[1]);
        assert_eq!(kv.used_blocks(), 2);
        kv.release(&blocks);
        assert_eq!(kv.used_blocks(), 0);
        assert_eq!(kv.lookup(&h, 10), blocks);
        assert_eq!(kv.lookup(&h, 1), vec![blocks[0]]);
        // Two empty blocks go first, then the tail of the cached prefix.
        let x = kv.allocate(3).unwrap();
        assert!(x.contains(&blocks[1]));
        assert_eq!(kv.lookup(&h, 10), vec![blocks[0]]);
        assert!(kv.allocate(2).is_none());
        assert_eq!(kv.free_blocks(), 1);
    }

    #[test]
    fn touch_protects_from_eviction() {
        let mut kv = KvCache::new(2, 4, true);
        let h = hashes(&[1, 2, 3, 4], 4);
        let b = kv.allocate(1).unwrap();
        kv.commit(b[0], h[0]);
        kv.release(&b);
        let hit = kv.lookup(&h, 1);
        assert!(kv.can_take(&hit, 1));
        assert!(!kv.can_take(&hit, 2));
        kv.touch(&hit);
        assert_eq!(kv.allocate(1).map(|v| v.len()), Some(1));
        assert!(kv.allocate(1).is_none());
        assert_eq!(kv.lookup(&h, 1), hit);
    }

    #[test]
    fn records_stored_and_evicted_blocks() {
        let mut kv = KvCache::new(1, 4, true);
        kv.record_events();
        let h = hashes(&[1, 2, 3, 4], 4);
        let b = kv.allocate(1).unwrap();
        kv.commit_block(b[0], h[0], None, &[1, 2, 3, 4], false);
        kv.commit_block(b[0], h[0], None, &[1, 2, 3, 4], false);
        kv.release(&b);
        kv.allocate(1).unwrap();
        assert_eq!(
            kv.take_events(),
            vec![
                CacheEvent::Stored {
                    hash: h[0],
                    parent: None,
                    tokens: vec![1, 2, 3, 4],
                    salted: false
                },
                CacheEvent::Removed { hash: h[0] },
            ]
        );
        assert!(kv.take_events().is_empty());
    }

    #[test]
    fn evicted_blocks_move_to_the_cpu_tier_and_fall_out_of_it() {
        let mut kv = KvCache::new(1, 4, true).with_cpu_offload(1);
        kv.record_events();
        let (a, b) = (hashes(&[1, 2, 3, 4], 4), hashes(&[5, 6, 7, 8], 4));
        for h in [a[0], b[0]] {
            let blk = kv.allocate(1).unwrap();
            kv.commit(blk[0], h);
            kv.release(&blk);
        }
        // `a` was evicted by `b`: no longer on the GPU, but on the CPU.
        assert!(kv.lookup(&a, 1).is_empty());
        assert_eq!(kv.cpu_run(&a), 1);
        kv.allocate(1).unwrap();
        assert_eq!(kv.cpu_run(&a), 0, "pushed out by b (capacity 1)");
        assert_eq!((kv.cpu_run(&b), kv.cpu_blocks()), (1, 1));
        assert_eq!(
            kv.take_events(),
            vec![
                CacheEvent::Offloaded { hash: a[0] },
                CacheEvent::Removed { hash: a[0] },
                CacheEvent::Offloaded { hash: b[0] },
                CacheEvent::OffloadEvicted { hash: a[0] },
                CacheEvent::Removed { hash: b[0] },
            ]
        );
    }

    #[test]
    fn disabled_prefix_cache_never_hits() {
        let mut kv = KvCache::new(2, 4, false);
        let h = hashes(&[1, 2, 3, 4], 4);
        let b = kv.allocate(1).unwrap();
        kv.commit(b[0], h[0]);
        kv.release(&b);
        assert!(kv.lookup(&h, 1).is_empty());
    }
}
