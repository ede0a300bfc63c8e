//! The prefix index of one pool: which workers recently served which prefix blocks.
//!
//! * `map`: block hash → up to [`REPLICAS`] packed `(worker slot, ring sequence)`
//!   pairs, in a sharded `DashMap` (no global lock; the key is already a hash, so
//!   the map only mixes it with one multiply).
//! * one ring per worker: the block hashes in insertion order (an item's sequence
//!   follows from its position), bounded
//!   by the worker's capacity; popping the front evicts the pair unless it was
//!   refreshed since (then the front item is a stale duplicate and is dropped).
//!   This is an approximate LRU: a block used again after half a ring's worth of
//!   insertions is pushed again.
//! * a hard cap on pairs: each worker's ring capacity is at most
//!   `max_pairs / workers`, so the index never holds more than `max_pairs` pairs.

use arc_swap::ArcSwap;
use dashmap::DashMap;
use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Most workers remembered per block (a hot prefix replicated further is still
/// routed well: spilled requests land on the next rendezvous choice).
pub const REPLICAS: usize = 3;
/// Largest worker slot (12 bits); workers beyond it are not indexed.
pub const MAX_SLOTS: usize = (1 << SLOT_BITS) - 1;
/// Largest per-worker capacity (blocks): sequences are 20-bit and compared by
/// wrapping difference, which stays valid while a ring holds fewer than 2^19 items.
pub const MAX_WORKER_BLOCKS: u64 = 1 << 19;

const SLOT_BITS: u32 = 12;
const SEQ_BITS: u32 = 32 - SLOT_BITS;
const SEQ_MASK: u32 = (1 << SEQ_BITS) - 1;

type Pairs = [u32; REPLICAS];

/// A ring item: a block hash (its sequence follows from its position).
type RingItem = u64;

/// A block hash as the map's key. Aligned to 4 bytes, so a map entry (key and
/// pairs) takes 20 bytes instead of 24: the index's memory is mostly map buckets.
#[derive(Clone, Copy)]
#[repr(C, packed(4))]
struct Key(u64);

impl Key {
    #[inline]
    fn get(self) -> u64 {
        self.0
    }
}

impl PartialEq for Key {
    #[inline]
    fn eq(&self, other: &Self) -> bool {
        self.get() == other.get()
    }
}

impl Eq for Key {}

impl std::hash::Hash for Key {
    #[inline]
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.get());
    }
}

#[inline]
fn pack(slot: u16, seq: u64) -> u32 {
    ((slot as u32) << SEQ_BITS) | (seq as u32 & SEQ_MASK)
}
#[inline]
fn slot_of(p: u32) -> u16 {
    (p >> SEQ_BITS) as u16
}
#[inline]
fn age(now_seq: u64, p: u32) -> u32 {
    (now_seq as u32).wrapping_sub(p) & SEQ_MASK
}

/// Push onto a ring's queue, growing its buffer by a quarter, exactly: doubling
/// would leave up to half of a full ring's buffer unused. A full ring briefly
/// holds cap + 1 items (push, then evict), so that is its size.
fn push_bounded(q: &mut VecDeque<RingItem>, h: RingItem, cap: usize) {
    if q.len() == q.capacity() && q.len() <= cap {
        let len = q.len();
        q.reserve_exact((len / 4).max(64).min(cap + 1 - len));
    }
    q.push_back(h);
}

/// Keys are xxh3 outputs already; one folded 128-bit multiply (as in wyhash)
/// still mixes them, so structured keys cannot cluster the table.
#[derive(Default)]
pub struct MixHasher(u64);

impl Hasher for MixHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ b as u64;
        }
    }
    fn write_u64(&mut self, n: u64) {
        let m = (n as u128).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        self.0 = (m as u64) ^ ((m >> 64) as u64);
    }
}

struct Ring {
    /// Block hashes in the order they were pushed. Sequences are not stored:
    /// the front item's is `pushed - len` ([`Ring::pop_oldest`]).
    q: Mutex<VecDeque<RingItem>>,
    /// Items ever pushed; the low 20 bits are the next item's sequence.
    pushed: AtomicU64,
    /// Blocks the map currently attributes to this worker.
    live: AtomicU64,
}

impl Ring {
    /// Remove the oldest item of `q` (this ring's queue, locked by the caller)
    /// with its sequence: items are pushed in sequence order, so the front's is
    /// the count pushed minus those still queued.
    fn pop_oldest(&self, q: &mut VecDeque<RingItem>) -> Option<(u64, u64)> {
        let seq = self
            .pushed
            .load(Ordering::Relaxed)
            .wrapping_sub(q.len() as u64);
        q.pop_front().map(|h| (h, seq))
    }
}

/// Every worker's footprint in the index: the blocks attributed to it.
pub struct Footprints(arc_swap::Guard<Arc<Vec<Arc<Ring>>>>);

impl Footprints {
    /// Blocks attributed to the worker in `slot` (0 for an unknown slot).
    pub fn get(&self, slot: u16) -> u64 {
        (slot as usize)
            .checked_sub(1)
            .and_then(|i| self.0.get(i))
            .map_or(0, |r| r.live.load(Ordering::Relaxed))
    }
}

/// Size of the index, for gauges and benches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IndexMemory {
    /// Distinct blocks tracked.
    pub entries: u64,
    /// (block, worker) pairs tracked.
    pub pairs: u64,
    /// Estimated bytes: map buckets plus ring buffers.
    pub bytes: u64,
    pub evictions: u64,
}

/// One pool's prefix index; lives in the registry, outside snapshots, so it
/// survives rebuilds.
pub struct PrefixIndex {
    map: DashMap<Key, Pairs, BuildHasherDefault<MixHasher>>,
    /// Ring of slot `s` at position `s - 1`.
    rings: ArcSwap<Vec<Arc<Ring>>>,
    slots: Mutex<HashMap<Arc<str>, u16>>,
    max_pairs: AtomicU64,
    /// Workers currently indexed (divides `max_pairs`).
    active: AtomicU64,
    pairs: AtomicU64,
    evictions: AtomicU64,
}

impl PrefixIndex {
    pub fn new(max_pairs: u64) -> PrefixIndex {
        PrefixIndex {
            map: DashMap::with_hasher(Default::default()),
            rings: ArcSwap::from_pointee(Vec::new()),
            slots: Mutex::new(HashMap::new()),
            max_pairs: AtomicU64::new(max_pairs.max(1)),
            active: AtomicU64::new(0),
            pairs: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
        }
    }

    /// Change the hard cap (config reload); rings shrink on their next insert.
    pub fn set_max_pairs(&self, max_pairs: u64) {
        self.max_pairs.store(max_pairs.max(1), Ordering::Relaxed);
    }

    /// Make `ids` the indexed workers: assign slots to new ones (kept per id, so a
    /// returning worker gets its old slot) and forget the blocks of the others.
    /// Returns each id's slot, 0 when the slot space is exhausted. Build-time only.
    pub fn set_workers(&self, ids: &[Arc<str>]) -> Vec<u16> {
        let mut slots = self.slots.lock();
        let mut rings: Vec<Arc<Ring>> = (**self.rings.load()).clone();
        let out: Vec<u16> = ids
            .iter()
            .map(|id| {
                if let Some(&s) = slots.get(id) {
                    return s;
                }
                if rings.len() >= MAX_SLOTS {
                    return 0;
                }
                rings.push(Arc::new(Ring {
                    q: Mutex::new(VecDeque::new()),
                    pushed: AtomicU64::new(0),
                    live: AtomicU64::new(0),
                }));
                let s = rings.len() as u16;
                slots.insert(id.clone(), s);
                s
            })
            .collect();
        self.rings.store(Arc::new(rings));
        let keep: std::collections::HashSet<u16> = out.iter().copied().collect();
        for (&slot, _) in slots.iter().map(|(k, v)| (v, k)) {
            if !keep.contains(&slot) {
                self.clear_slot(slot);
            }
        }
        let active = keep.iter().filter(|&&s| s != 0).count() as u64;
        self.active.store(active, Ordering::Relaxed);
        // More workers share the cap: trim every ring to its new share now.
        let share = (self.max_pairs.load(Ordering::Relaxed) / active.max(1)).max(1) as usize;
        for (i, ring) in self.rings.load().iter().enumerate() {
            let mut q = ring.q.lock();
            while q.len() > share {
                let (h, seq) = ring.pop_oldest(&mut q).expect("len > share");
                self.remove_pair(h, pack(i as u16 + 1, seq));
            }
        }
        out
    }

    /// The slots of `ids` (0 for a worker the index does not know); read-only.
    pub fn slots(&self, ids: &[Arc<str>]) -> Vec<u16> {
        let slots = self.slots.lock();
        ids.iter()
            .map(|id| slots.get(id).copied().unwrap_or(0))
            .collect()
    }

    fn ring(&self, slot: u16) -> Option<Arc<Ring>> {
        (slot != 0)
            .then(|| self.rings.load().get(slot as usize - 1).cloned())
            .flatten()
    }

    /// The per-worker bound actually applied (at least 1, so the index holds at
    /// most `max(max_pairs, workers)` pairs) for a worker whose own capacity is `cap`.
    pub fn effective_capacity(&self, cap: u64) -> u64 {
        let share =
            self.max_pairs.load(Ordering::Relaxed) / self.active.load(Ordering::Relaxed).max(1);
        cap.min(share).clamp(1, MAX_WORKER_BLOCKS)
    }

    /// Record that the worker in `slot` now holds `blocks`; `cap` approximates its
    /// KV capacity in index blocks.
    pub fn insert(&self, slot: u16, blocks: &[u64], cap: u64) {
        let Some(ring) = self.ring(slot) else { return };
        let cap = self.effective_capacity(cap) as usize;
        let refresh_after = (cap / 2).max(1) as u32;
        let rings = self.rings.load();
        // Leading blocks this worker already holds fresh need no write: find them
        // with shard read locks, so the ring's lock covers only blocks that change.
        let fresh = blocks
            .iter()
            .take_while(|&&h| self.is_fresh(h, slot, &ring, refresh_after))
            .count();
        let mut q = ring.q.lock();
        for &h in &blocks[fresh..] {
            let seq = ring.pushed.load(Ordering::Relaxed);
            if self.claim(h, slot, seq, &ring, &rings, refresh_after) {
                push_bounded(&mut q, h, cap);
                ring.pushed.fetch_add(1, Ordering::Relaxed);
            }
            self.trim(slot, &ring, &mut q, cap);
        }
        // The cap may have shrunk (reload, more workers) with nothing pushed.
        self.trim(slot, &ring, &mut q, cap);
    }

    /// Point block `h`'s entry at (`slot`, `seq`): a new pair, a refresh of a
    /// stale one, or the replacement of the replica idle longest on its worker.
    /// Returns whether the block goes onto the worker's ring.
    fn claim(
        &self,
        h: u64,
        slot: u16,
        seq: u64,
        ring: &Ring,
        rings: &[Arc<Ring>],
        refresh_after: u32,
    ) -> bool {
        let mut e = self.map.entry(Key(h)).or_insert([0; REPLICAS]);
        let pairs = e.value_mut();
        if let Some(p) = pairs.iter_mut().find(|p| **p != 0 && slot_of(**p) == slot) {
            if age(seq, *p) < refresh_after {
                return false;
            }
            *p = pack(slot, seq);
            return true;
        }
        if let Some(p) = pairs.iter_mut().find(|p| **p == 0) {
            *p = pack(slot, seq);
            self.pairs.fetch_add(1, Ordering::Relaxed);
        } else {
            let oldest = pairs
                .iter_mut()
                .max_by_key(|p| {
                    rings
                        .get(slot_of(**p) as usize - 1)
                        .map_or(u32::MAX, |r| age(r.pushed.load(Ordering::Relaxed), **p))
                })
                .expect("REPLICAS > 0");
            if let Some(r) = rings.get(slot_of(*oldest) as usize - 1) {
                r.live.fetch_sub(1, Ordering::Relaxed);
            }
            *oldest = pack(slot, seq);
            self.evictions.fetch_add(1, Ordering::Relaxed);
        }
        ring.live.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// Evict the ring's oldest blocks beyond `cap`.
    fn trim(&self, slot: u16, ring: &Ring, q: &mut VecDeque<RingItem>, cap: usize) {
        while q.len() > cap {
            let (old, oseq) = ring.pop_oldest(q).expect("len > cap >= 1");
            self.remove_pair(old, pack(slot, oseq));
        }
    }

    /// The worker in `slot` holds block `h`, stored recently enough not to refresh.
    fn is_fresh(&self, h: u64, slot: u16, ring: &Ring, refresh_after: u32) -> bool {
        let seq = ring.pushed.load(Ordering::Relaxed);
        self.map.get(&Key(h)).is_some_and(|e| {
            e.value()
                .iter()
                .any(|p| *p != 0 && slot_of(*p) == slot && age(seq, *p) < refresh_after)
        })
    }

    fn remove_pair(&self, h: u64, pair: u32) {
        // One map access: clear the pair, and drop the entry if it is now empty.
        self.map.remove_if_mut(&Key(h), |_, pairs| {
            if let Some(p) = pairs.iter_mut().find(|p| **p == pair) {
                *p = 0;
                self.pairs.fetch_sub(1, Ordering::Relaxed);
                self.evictions.fetch_add(1, Ordering::Relaxed);
                if let Some(r) = self.ring(slot_of(pair)) {
                    r.live.fetch_sub(1, Ordering::Relaxed);
                }
            }
            pairs.iter().all(|p| *p == 0)
        });
    }

    fn clear_slot(&self, slot: u16) {
        let Some(ring) = self.ring(slot) else { return };
        let mut q = ring.q.lock();
        while let Some((h, seq)) = ring.pop_oldest(&mut q) {
            self.remove_pair(h, pack(slot, seq));
        }
        q.shrink_to_fit();
    }

    /// Blocks the index attributes to the worker in `slot` (0 for an unknown slot).
    pub fn live(&self, slot: u16) -> u64 {
        self.footprints().get(slot)
    }

    /// A view of every worker's footprint (blocks attributed to it), loaded once.
    pub fn footprints(&self) -> Footprints {
        Footprints(self.rings.load())
    }

    /// For each worker holding `blocks[0]`, how many leading blocks it holds.
    /// Writes up to [`REPLICAS`] `(slot, depth)` pairs into `out`; returns how many.
    pub fn lookup(&self, blocks: &[u64], out: &mut [(u16, u32); REPLICAS]) -> usize {
        let Some(first) = blocks.first() else {
            return 0;
        };
        let n = match self.map.get(&Key(*first)) {
            None => return 0,
            Some(e) => {
                let mut n = 0;
                for &p in e.iter().filter(|p| **p != 0) {
                    out[n] = (slot_of(p), 1);
                    n += 1;
                }
                n
            }
        };
        for (depth, h) in blocks.iter().enumerate().skip(1) {
            let Some(e) = self.map.get(&Key(*h)) else {
                break;
            };
            let mut any = false;
            for o in out[..n].iter_mut() {
                if o.1 as usize == depth && e.iter().any(|&p| p != 0 && slot_of(p) == o.0) {
                    o.1 += 1;
                    any = true;
                }
            }
            if !any {
                break;
            }
        }
        n
    }

    pub fn memory(&self) -> IndexMemory {
        // The buckets each shard has allocated (a control byte each), not its
        // capacity: deleted slots lower hashbrown's capacity but not its memory.
        let bucket = (std::mem::size_of::<(Key, dashmap::SharedValue<Pairs>)>() + 1) as u64;
        let map_bytes: u64 = self
            .map
            .shards()
            .iter()
            .map(|s| s.read().buckets() as u64 * bucket)
            .sum();
        let ring_bytes: u64 = self
            .rings
            .load()
            .iter()
            .map(|r| r.q.lock().capacity() as u64 * std::mem::size_of::<RingItem>() as u64)
            .sum();
        IndexMemory {
            entries: self.map.len() as u64,
            pairs: self.pairs.load(Ordering::Relaxed),
            bytes: map_bytes + ring_bytes,
            evictions: self.evictions.load(Ordering::Relaxed),
        }
    }

    /// Check the invariants (tests): pair count matches the map, no empty entries.
    #[doc(hidden)]
    pub fn check(&self) -> Result<(), String> {
        let mut pairs = 0;
        let mut per_slot: HashMap<u16, u64> = HashMap::new();
        for e in self.map.iter() {
            let n = e.value().iter().filter(|p| **p != 0).count();
            if n == 0 {
                return Err(format!("empty entry {:x}", e.key().get()));
            }
            for p in e.value().iter().filter(|p| **p != 0) {
                *per_slot.entry(slot_of(*p)).or_default() += 1;
            }
            pairs += n as u64;
        }
        let counted = self.pairs.load(Ordering::Relaxed);
        if pairs != counted {
            return Err(format!("map holds {pairs} pairs, counter says {counted}"));
        }
        for (i, r) in self.rings.load().iter().enumerate() {
            let slot = i as u16 + 1;
            let (held, live) = (
                per_slot.get(&slot).copied().unwrap_or(0),
                r.live.load(Ordering::Relaxed),
            );
            if held != live {
                return Err(format!("slot {slot} holds {held} blocks, live says {live}"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ids(n: usize) -> Vec<Arc<str>> {
        (0..n).map(|i| Arc::from(format!("http://w{i}"))).collect()
    }

    #[test]
    fn lookup_counts_leading_blocks_per_worker() {
        let ix = PrefixIndex::new(1000);
        let s = ix.set_workers(&ids(3));
        ix.insert(s[0], &[1, 2, 3, 4], 100);
        ix.insert(s[1], &[1, 2, 9], 100);
        let mut out = [(0, 0); REPLICAS];
        let n = ix.lookup(&[1, 2, 3, 4, 5], &mut out);
        let mut got = out[..n].to_vec();
        got.sort();
        assert_eq!(got, vec![(s[0], 4), (s[1], 2)]);
        assert_eq!(ix.lookup(&[7, 2, 3], &mut out), 0);
        assert_eq!(ix.lookup(&[], &mut out), 0);
        ix.check().unwrap();
    }

    #[test]
    fn a_fresh_prefix_is_left_alone_and_a_lowered_cap_still_trims() {
        let ix = PrefixIndex::new(1000);
        let s = ix.set_workers(&ids(1))[0];
        ix.insert(s, &[1, 2, 3, 4], 100);
        let pushed = ix.ring(s).unwrap().pushed.load(Ordering::Relaxed);
        ix.insert(s, &[1, 2, 3, 4, 5], 100);
        let after = ix.ring(s).unwrap().pushed.load(Ordering::Relaxed);
        assert_eq!(after - pushed, 1, "only the new block is pushed");
        // The cap drops below what is held; a request that changes nothing trims.
        ix.set_max_pairs(2);
        ix.insert(s, &[1, 2], 100);
        assert!(ix.memory().pairs <= 2, "{:?}", ix.memory());
        ix.check().unwrap();
    }

    #[test]
    fn ring_evicts_oldest_but_keeps_refreshed_blocks() {
        let ix = PrefixIndex::new(1000);
        let s = ix.set_workers(&ids(1))[0];
        ix.insert(s, &[100], 4);
        for b in 0..3u64 {
            ix.insert(s, &[b], 4);
        }
        // Refresh 100 (its age, 3, exceeds cap/2): pushed again.
        ix.insert(s, &[100], 4);
        for b in 3..6u64 {
            ix.insert(s, &[b], 4);
        }
        let mut out = [(0, 0); REPLICAS];
        assert_eq!(ix.lookup(&[100], &mut out), 1, "refreshed block survives");
        assert_eq!(ix.lookup(&[0], &mut out), 0, "oldest block evicted");
        assert!(ix.memory().pairs <= 4);
        ix.check().unwrap();
    }

    #[test]
    fn removed_worker_is_forgotten_and_replicas_are_bounded() {
        let ix = PrefixIndex::new(1000);
        let all = ids(6);
        let s = ix.set_workers(&all);
        for &slot in &s {
            ix.insert(slot, &[42], 10);
        }
        let mut out = [(0, 0); REPLICAS];
        assert_eq!(ix.lookup(&[42], &mut out), REPLICAS);
        // The latest holder replaced one of the others.
        let held: Vec<u16> = out.iter().map(|o| o.0).collect();
        assert!(held.contains(&s[5]), "{held:?}");
        let s2 = ix.set_workers(&all[..1]);
        assert_eq!(s2[0], s[0]);
        let n = ix.lookup(&[42], &mut out);
        assert!(out[..n].iter().all(|o| o.0 == s[0]));
        ix.check().unwrap();
    }

    #[test]
    fn at_most_100_bytes_per_tracked_block() {
        let ix = PrefixIndex::new(1 << 20);
        let slots = ix.set_workers(&ids(8));
        // 8 workers × 30k blocks: each worker's ring wraps (cap 20k), so the
        // index is full and in steady state.
        let mut h = 0u64;
        for round in 0..30_000u64 {
            for &s in &slots {
                h = h.wrapping_add(0x9E37_79B9_7F4A_7C15);
                ix.insert(s, &[h ^ round], 20_000);
            }
        }
        let m = ix.memory();
        assert_eq!(m.pairs, 8 * 20_000);
        let per = m.bytes as f64 / m.entries as f64;
        eprintln!("prefix index: {per:.1} bytes per tracked block ({m:?})");
        assert!(per <= 100.0, "{per:.1} bytes per block ({m:?})");
    }

    /// The index's memory is mostly map entries and ring items: keep them small.
    #[test]
    fn entries_take_20_bytes_and_ring_items_8() {
        assert_eq!(
            std::mem::size_of::<(Key, dashmap::SharedValue<Pairs>)>(),
            20
        );
        assert_eq!(std::mem::size_of::<RingItem>(), 8);
    }

    /// An index turned over again and again (every insert a new block, every
    /// one evicting an old one) reaches a size and stays there: deleted slots
    /// are reused, rings do not outgrow their capacity.
    #[test]
    fn memory_stops_growing_under_churn() {
        let ix = PrefixIndex::new(1 << 15);
        let slots = ix.set_workers(&ids(8));
        let mut h = 0u64;
        let mut turnover = |ix: &PrefixIndex| {
            for _ in 0..(1 << 15) / 8 {
                for &s in &slots {
                    h = h.wrapping_add(0x9E37_79B9_7F4A_7C15);
                    ix.insert(s, &[h], 1 << 12);
                }
            }
        };
        for _ in 0..16 {
            turnover(&ix);
        }
        let settled = ix.memory();
        for _ in 0..16 {
            turnover(&ix);
        }
        let later = ix.memory();
        eprintln!(
            "after 16 turnovers {:.1}, after 32 {:.1} bytes per block",
            settled.bytes as f64 / settled.entries as f64,
            later.bytes as f64 / later.entries as f64
        );
        assert_eq!(later.pairs, 1 << 15);
        assert_eq!(later.bytes, settled.bytes, "{settled:?} -> {later:?}");
        // The default cap (a power of two) at its worst: 4 buckets per entry.
        let per = later.bytes as f64 / later.entries as f64;
        assert!(per <= 100.0, "{per:.1} bytes per block ({later:?})");
        assert_eq!(ix.check(), Ok(()));
    }

    proptest! {
        /// Whatever is inserted, pairs never exceed the hard cap (at least one
        /// block per worker), entries never exceed pairs, and the counters agree
        /// with the map.
        #[test]
        fn memory_bound_holds(
            max_pairs in 1u64..200,
            workers in 1usize..8,
            ops in proptest::collection::vec((0usize..8, proptest::collection::vec(0u64..300, 0..20), 1u64..100), 0..60),
        ) {
            let ix = PrefixIndex::new(max_pairs);
            let slots = ix.set_workers(&ids(workers));
            for (w, blocks, cap) in ops {
                ix.insert(slots[w % workers], &blocks, cap);
                let m = ix.memory();
                let bound = max_pairs.max(workers as u64);
                prop_assert!(m.pairs <= bound, "{m:?} > {bound}");
                prop_assert!(m.entries <= m.pairs);
            }
            prop_assert_eq!(ix.check(), Ok(()));
        }
    }
}
