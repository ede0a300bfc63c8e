//! The exact index of one pool: block key → the workers holding the block, per
//! tier (GPU, CPU, disk), as the engines' own events say.
//!
//! **The key is the gateway's own hash**, not the engine's: block i's key is
//! xxh3 of its token ids seeded by block i-1's key (the first block by
//! [`ROOT_KEY`]), so it names the whole prefix up to and including the block.
//! Engine hashes are not reproducible outside the engine process: vLLM seeds its
//! block hashes per process (`PYTHONHASHSEED`, or a random `NONE_HASH`), SGLang
//! and older vLLM use other schemes, so two engines serving the same prompt
//! report different hashes for the same block. Keying on tokens makes one prompt
//! one key on every worker and every gateway replica, computable from a request's
//! tokens alone; the engine's hashes are kept per worker only to resolve parents
//! and removals (`apply.rs`).
//!
//! Holders are one bit per worker slot per tier (three `u64` masks), so a pool's
//! precise index covers up to [`MAX_WORKERS`] workers. A lookup reads the masks
//! of a few of the prompt's blocks, not all: engines hold prefix-closed sets, so
//! each worker's depth is found by galloping and bisecting (`search.rs`), and a
//! sample of lookups is checked against the full walk (`check.rs`).

use papaya::{Compute, HashMap, LocalGuard, Operation, ResizeMode};
use parking_lot::Mutex;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::check::Checks;
use super::pending::Pending;
use super::search;
use super::wire::Tier;

/// Workers a pool's precise index can tell apart (one bit each).
pub const MAX_WORKERS: usize = 64;
/// Seed of the first block's key.
pub const ROOT_KEY: u64 = 0x5357_4954_4348_5944; // "SWITCHYD"

/// The key of a block holding `tokens` after the block keyed `parent`.
#[inline]
pub fn block_key(parent: u64, tokens: &[u32]) -> u64 {
    let mut buf = [0u8; 256];
    if tokens.len() * 4 <= buf.len() {
        for (c, t) in buf.chunks_exact_mut(4).zip(tokens) {
            c.copy_from_slice(&t.to_le_bytes());
        }
        xxh3_64_with_seed(&buf[..tokens.len() * 4], parent)
    } else {
        let v: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        xxh3_64_with_seed(&v, parent)
    }
}

/// The keys of every full block of `tokens`.
pub fn prompt_keys(tokens: &[u32], block_size: usize) -> Vec<u64> {
    let mut k = ROOT_KEY;
    tokens
        .chunks_exact(block_size.max(1))
        .map(|b| {
            k = block_key(k, b);
            k
        })
        .collect()
}

/// The keys of the blocks of a prompt an engine can serve from its cache: every
/// full block before the prompt's last token. The engine always computes that token
/// (it needs its logits; vLLM caps a hit at `num_tokens - 1`), so a prompt of
/// exactly n blocks, fully cached, hits only n - 1 of them.
pub fn reusable_prompt_keys(tokens: &[u32], block_size: usize) -> Vec<u64> {
    prompt_keys(&tokens[..tokens.len().saturating_sub(1)], block_size)
}

/// A worker's standing in the precise index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum SlotState {
    /// No subscriber (or it stopped).
    Absent = 0,
    /// Connecting or replaying its history: not yet trusted.
    Syncing = 1,
    /// Applying live events.
    Live = 2,
    /// Its events do not fit the pool's configuration (block size, missing
    /// tokens): the pool routes on the approximate index.
    Refused = 3,
}

/// Per worker and tier: how many leading blocks of a prompt it holds in that
/// tier or a faster one (`[gpu, gpu+cpu, any]`).
pub type Depths = [[u32; 3]; MAX_WORKERS];

#[derive(Clone, Copy, Default)]
struct Holders([u64; 3]);

/// The map, pinned for reading.
type Map<'a> = papaya::HashMapRef<'a, u64, Holders, BuildHasherDefault<KeyHasher>, LocalGuard<'a>>;

/// Keys are already hashes: the map uses them as they are.
#[derive(Default)]
pub(super) struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, b: &[u8]) {
        for &x in b {
            self.0 = (self.0 << 8) | u64::from(x);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// One pool's precise index (see the module docs).
pub struct KvIndex {
    /// Lock-free reads (a lookup pins once, then probes without a lock or an
    /// atomic write); writers replace an entry's holders by compare-and-swap.
    map: HashMap<u64, Holders, BuildHasherDefault<KeyHasher>>,
    /// Slot → worker id; taken when a subscriber starts.
    slots: Mutex<Vec<Option<Arc<str>>>>,
    states: [AtomicU8; MAX_WORKERS],
    /// (worker, tier) pairs held, all workers.
    pairs: AtomicU64,
    /// Per slot: blocks held on the GPU (what competes for the engine's cache
    /// space; the `prefix` policy places new prefixes by it).
    gpu: [AtomicU64; MAX_WORKERS],
    /// Blocks just sent to a worker, not yet confirmed by its events.
    pending: Pending,
    /// Lookups checked against the full walk.
    checks: Checks,
    /// Tokens per block, with [`LEARN`] set while the first engine report may
    /// still set it (`[pools.kv_events] block_size` not configured).
    block_size: AtomicU64,
}

/// Bit of `KvIndex::block_size`: not pinned yet, the engines' first report sets it.
const LEARN: u64 = 1 << 63;

impl KvIndex {
    pub fn new(block_size: usize) -> KvIndex {
        KvIndex::for_pool("", block_size)
    }

    /// The index of pool `pool` (the label of its lookup-check metric).
    pub fn for_pool(pool: &str, block_size: usize) -> KvIndex {
        KvIndex {
            // Blocking resizes: an incremental one left half done (it advances
            // only on writes) makes every read check both tables, 5-30x slower
            // when measured; a blocking one stalls writers, never readers.
            map: HashMap::builder()
                .hasher(BuildHasherDefault::default())
                .resize_mode(ResizeMode::Blocking)
                .build(),
            slots: Mutex::new(Vec::new()),
            states: std::array::from_fn(|_| AtomicU8::new(0)),
            pairs: AtomicU64::new(0),
            gpu: std::array::from_fn(|_| AtomicU64::new(0)),
            pending: Pending::default(),
            checks: Checks::new(pool),
            block_size: AtomicU64::new(block_size.max(1) as u64),
        }
    }

    /// Let the engines' first report set the block size (the configured one is
    /// only a default until then).
    pub fn learning_block_size(self) -> KvIndex {
        self.block_size.fetch_or(LEARN, Ordering::Relaxed);
        self
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        (self.block_size.load(Ordering::Relaxed) & !LEARN) as usize
    }

    /// Tokens per block once set: configured, or learned from an engine;
    /// `None` while still learning.
    pub fn pinned_block_size(&self) -> Option<usize> {
        let v = self.block_size.load(Ordering::Relaxed);
        (v & LEARN == 0).then_some(v as usize)
    }

    /// An engine reports `engine` tokens per block: `true` when that is the
    /// index's size, which the first report sets (and pins) while learning.
    pub fn adopt_block_size(&self, engine: usize) -> bool {
        let now = self.block_size.load(Ordering::Relaxed);
        if now & LEARN != 0 && engine > 0 {
            let won = self
                .block_size
                .compare_exchange(now, engine as u64, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok();
            if won && (now & !LEARN) as usize != engine {
                tracing::info!(
                    pool = %self.checks.pool(),
                    block_size = engine,
                    "kv events: block size learned from the engine"
                );
            }
        }
        self.block_size() == engine
    }

    /// The slot of `worker`, taking a free one if it has none; `None` when all
    /// [`MAX_WORKERS`] are taken.
    pub fn claim(&self, worker: &Arc<str>) -> Option<u8> {
        let mut slots = self.slots.lock();
        if let Some(i) = slots.iter().position(|s| s.as_deref() == Some(&**worker)) {
            return Some(i as u8);
        }
        let i = match slots.iter().position(Option::is_none) {
            Some(i) => i,
            None if slots.len() < MAX_WORKERS => {
                slots.push(None);
                slots.len() - 1
            }
            None => return None,
        };
        slots[i] = Some(worker.clone());
        self.set_state(i as u8, SlotState::Syncing);
        Some(i as u8)
    }

    /// Give `slot` back (its blocks must have been removed).
    pub fn release(&self, slot: u8) {
        self.set_state(slot, SlotState::Absent);
        let mut slots = self.slots.lock();
        if let Some(s) = slots.get_mut(slot as usize) {
            *s = None;
        }
    }

    /// The slot `worker` holds, if any.
    pub fn slot_of(&self, worker: &str) -> Option<u8> {
        let slots = self.slots.lock();
        slots
            .iter()
            .position(|s| s.as_deref() == Some(worker))
            .map(|i| i as u8)
    }

    pub fn set_state(&self, slot: u8, s: SlotState) {
        if let Some(a) = self.states.get(slot as usize) {
            a.store(s as u8, Ordering::Release);
        }
    }

    pub fn state(&self, slot: u8) -> SlotState {
        match self
            .states
            .get(slot as usize)
            .map(|a| a.load(Ordering::Acquire))
        {
            Some(1) => SlotState::Syncing,
            Some(2) => SlotState::Live,
            Some(3) => SlotState::Refused,
            _ => SlotState::Absent,
        }
    }

    /// Whether the index speaks for every one of `slots` (a route's workers):
    /// each has a live subscriber. One worker without events, or refused, and the
    /// pool routes on the approximate index instead.
    pub fn covers(&self, slots: &[Option<u8>]) -> bool {
        !slots.is_empty()
            && slots
                .iter()
                .all(|s| s.is_some_and(|s| self.state(s) == SlotState::Live))
    }

    /// Record that `slot` holds `key` in `tier`; whether it was new.
    pub fn insert(&self, slot: u8, key: u64, tier: Tier) -> bool {
        let bit = 1u64 << slot;
        self.pending.confirm(slot, key);
        let new = self
            .change(key, |mut h| {
                h[tier as usize] |= bit;
                h
            })
            .is_some();
        if new {
            self.pairs.fetch_add(1, Ordering::Relaxed);
            if tier == Tier::Gpu {
                self.gpu[slot as usize].fetch_add(1, Ordering::Relaxed);
            }
        }
        new
    }

    /// Record that `slot` no longer holds `key` in `tier`; whether it did.
    pub fn remove(&self, slot: u8, key: u64, tier: Tier) -> bool {
        let bit = 1u64 << slot;
        let had = self
            .change(key, |mut h| {
                h[tier as usize] &= !bit;
                h
            })
            .is_some();
        if had {
            self.pairs.fetch_sub(1, Ordering::Relaxed);
            if tier == Tier::Gpu {
                self.gpu[slot as usize].fetch_sub(1, Ordering::Relaxed);
            }
        }
        had
    }

    /// Remove every entry of `slot` (a subscriber that ended without its own
    /// record of them): a scan of the whole map, on a cold path.
    pub fn clear_slot(&self, slot: u8) {
        let bit = 1u64 << slot;
        let keys: Vec<u64> = {
            let map = self.map.pin();
            let held = map.iter().filter(|(_, h)| h.0.iter().any(|m| m & bit != 0));
            held.map(|(k, _)| *k).collect()
        };
        let mut gone = 0u64;
        for k in keys {
            if let Some(old) = self.change(k, |h| h.map(|m| m & !bit)) {
                gone += old.iter().map(|m| u64::from(m & bit != 0)).sum::<u64>();
            }
        }
        self.pairs.fetch_sub(gone, Ordering::Relaxed);
        if let Some(g) = self.gpu.get(slot as usize) {
            g.store(0, Ordering::Relaxed);
        }
    }

    /// Replace `key`'s holders `h` (none: zeros) by `f(h)`, atomically against
    /// other writers, dropping the entry when nobody is left; the holders
    /// before, when that changed them (`None`: `f` changed nothing).
    fn change(&self, key: u64, f: impl Fn([u64; 3]) -> [u64; 3]) -> Option<[u64; 3]> {
        let map = self.map.pin();
        let r = map.compute(key, |e| {
            let old = e.map_or([0; 3], |(_, h)| h.0);
            match f(old) {
                new if new == old => Operation::Abort(()),
                [0, 0, 0] => Operation::Remove,
                new => Operation::Insert(Holders(new)),
            }
        });
        match r {
            Compute::Inserted(..) => Some([0; 3]),
            Compute::Updated { old: (_, h), .. } | Compute::Removed(_, h) => Some(h.0),
            Compute::Aborted(()) => None,
        }
    }

    /// Blocks `slot` holds on the GPU.
    pub fn gpu_blocks(&self, slot: u8) -> u64 {
        self.gpu
            .get(slot as usize)
            .map_or(0, |g| g.load(Ordering::Relaxed))
    }

    /// (worker, tier) pairs held.
    pub fn pairs(&self) -> u64 {
        self.pairs.load(Ordering::Relaxed)
    }

    /// Lookups so far.
    pub fn lookups(&self) -> u64 {
        self.checks.lookups()
    }

    /// Sampled lookups whose search differed from the full walk.
    pub fn lookup_mismatches(&self) -> u64 {
        self.checks.mismatches()
    }

    /// Distinct block keys held by anyone.
    pub fn keys(&self) -> usize {
        self.map.len()
    }

    /// For each slot, how many leading blocks of `keys` it holds per tier
    /// (cumulative: `[gpu, gpu+cpu, any]`), written into `out` (zeroed first).
    /// Stops at the first block nobody holds.
    pub fn lookup(&self, keys: &[u64], out: &mut Depths) {
        self.lookup_with(keys, out, |_| 0);
    }

    /// [`KvIndex::lookup`] with the blocks pending at `now` (just sent, not yet
    /// confirmed) counted as held on the GPU.
    pub fn lookup_at(&self, keys: &[u64], out: &mut Depths, now: u64) {
        if self.pending.is_empty() {
            return self.lookup(keys, out);
        }
        self.lookup_with(keys, out, |k| self.pending.mask(k, now));
    }

    /// Remember that `slot` was just sent a prompt with `keys`, pending until
    /// `until`; `false` when the pending set is full.
    pub fn note_pending(&self, slot: u8, keys: &[u64], now: u64, until: u64) -> bool {
        let bit = 1u64 << slot;
        let map = self.map.pin();
        let held = |k| map.get(&k).is_some_and(|h| h.0[0] & bit != 0);
        self.pending.insert(slot, keys, now, until, held)
    }

    /// Blocks `slot` was just sent and did not hold on the GPU, not yet
    /// confirmed by its events: with [`KvIndex::gpu_blocks`], the cache space it
    /// is about to use.
    pub fn pending_blocks(&self, slot: u8) -> u64 {
        self.pending.new_blocks(slot)
    }

    /// Runs [`search::search`]; every [`CHECK_EVERY`](super::CHECK_EVERY)th
    /// lookup also runs the full walk and counts a disagreement (holdings that
    /// are not prefix-closed), answering with the walk's depths.
    #[inline]
    fn lookup_with(&self, keys: &[u64], out: &mut Depths, pending: impl Fn(u64) -> u64) {
        let map = self.map.pin();
        let probe = |i: usize| self.masks(&map, keys[i], &pending);
        search::search(keys.len(), probe, out);
        if self.checks.due() {
            let mut exact: Depths = [[0; 3]; MAX_WORKERS];
            search::walk(keys.len(), probe, &mut exact);
            if exact != *out {
                self.checks.mismatch(keys.len());
                *out = exact;
            }
        }
    }

    /// The cumulative holders of `key` (`[gpu, gpu|cpu, any]`), its pending
    /// marks counted as GPU.
    #[inline]
    fn masks(&self, map: &Map<'_>, key: u64, pending: impl Fn(u64) -> u64) -> search::Masks {
        let mut h = map.get(&key).map_or([0; 3], |e| e.0);
        h[0] |= pending(key);
        [h[0], h[0] | h[1], h[0] | h[1] | h[2]]
    }

    /// [`KvIndex::lookup_at`] by the full walk, to test the search against.
    #[cfg(test)]
    fn walk_at(&self, keys: &[u64], out: &mut Depths, now: u64) {
        let map = self.map.pin();
        let probe = |i: usize| self.masks(&map, keys[i], |k| self.pending.mask(k, now));
        search::walk(keys.len(), probe, out);
    }
}

/// Tier-weighted blocks from a slot's [`Depths`] row: each block counts the
/// weight of the fastest tier the worker holds it in, along the held prefix.
pub fn weighted_blocks(d: &[u32; 3], weights: &[f64; 3]) -> f64 {
    weights[0] * d[0] as f64
        + weights[1] * d[1].saturating_sub(d[0]) as f64
        + weights[2] * d[2].saturating_sub(d[1]) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn index_with(workers: &[&str]) -> (KvIndex, Vec<u8>) {
        let ix = KvIndex::new(4);
        let slots = workers
            .iter()
            .map(|w| ix.claim(&Arc::from(*w)).unwrap())
            .collect();
        (ix, slots)
    }

    #[test]
    fn keys_chain_over_the_prefix() {
        let a = prompt_keys(&[1, 2, 3, 4, 5, 6, 7, 8, 9], 4);
        let b = prompt_keys(&[0, 2, 3, 4, 5, 6, 7, 8], 4);
        assert_eq!(a.len(), 2, "the partial block is left out");
        assert_ne!(a[1], b[1], "a block's key depends on what precedes it");
        assert_eq!(a, prompt_keys(&[1, 2, 3, 4, 5, 6, 7, 8], 4));
        let long: Vec<u32> = (0..200).collect();
        assert_eq!(
            prompt_keys(&long, 100).len(),
            2,
            "blocks beyond the stack buffer"
        );
    }

    #[test]
    fn the_block_ending_at_the_last_token_is_not_reusable() {
        let whole: Vec<u32> = (0..8).collect();
        assert_eq!(reusable_prompt_keys(&whole, 4), prompt_keys(&whole[..4], 4));
        let more: Vec<u32> = (0..9).collect();
        assert_eq!(reusable_prompt_keys(&more, 4), prompt_keys(&more, 4));
        assert!(reusable_prompt_keys(&[], 4).is_empty());
    }

    #[test]
    fn lookup_gives_each_worker_its_held_prefix_by_tier() {
        let (ix, s) = index_with(&["a", "b", "c"]);
        let k = prompt_keys(&(0..16).collect::<Vec<_>>(), 4);
        for &key in &k[..3] {
            ix.insert(s[0], key, Tier::Gpu);
        }
        ix.insert(s[1], k[0], Tier::Gpu);
        ix.insert(s[1], k[1], Tier::Cpu);
        ix.insert(s[1], k[2], Tier::Disk);
        ix.insert(s[1], k[3], Tier::Gpu);
        ix.insert(s[2], k[1], Tier::Gpu); // not a prefix: block 0 missing
        let mut d = [[0; 3]; MAX_WORKERS];
        ix.lookup(&k, &mut d);
        assert_eq!(d[s[0] as usize], [3, 3, 3]);
        assert_eq!(d[s[1] as usize], [1, 2, 4]);
        assert_eq!(d[s[2] as usize], [0, 0, 0]);
        let w = weighted_blocks(&d[s[1] as usize], &[1.0, 0.5, 0.25]);
        assert_eq!(w, 1.0 + 0.5 + 0.25 * 2.0);
        assert!(ix.remove(s[0], k[0], Tier::Gpu));
        assert!(!ix.remove(s[0], k[0], Tier::Gpu));
        ix.lookup(&k, &mut d);
        assert_eq!(d[s[0] as usize], [0, 0, 0]);
        assert_eq!(ix.pairs(), 7);
        let gpu: Vec<u64> = s.iter().map(|&s| ix.gpu_blocks(s)).collect();
        assert_eq!(gpu, [2, 2, 1], "GPU blocks per worker");
        ix.clear_slot(s[1]);
        assert_eq!((ix.gpu_blocks(s[1]), ix.pairs()), (0, 3));
    }

    #[test]
    fn slots_are_reused_and_bounded() {
        let ix = KvIndex::new(16);
        let ids: Vec<Arc<str>> = (0..=MAX_WORKERS)
            .map(|i| Arc::from(format!("w{i}")))
            .collect();
        for id in &ids[..MAX_WORKERS] {
            assert!(ix.claim(id).is_some());
        }
        assert_eq!(ix.claim(&ids[MAX_WORKERS]), None);
        assert_eq!(ix.claim(&ids[3]), Some(3), "a worker keeps its slot");
        ix.release(3);
        assert_eq!(ix.claim(&ids[MAX_WORKERS]), Some(3));
        assert!(!ix.covers(&[Some(3)]), "syncing until live");
        ix.set_state(3, SlotState::Live);
        assert!(ix.covers(&[Some(3)]));
        assert!(!ix.covers(&[Some(3), None]));
    }

    /// A worker's holdings: `[gpu, gpu+cpu, any]` depths, realised as blocks
    /// on the GPU, then the CPU, then disk (some GPU blocks with a CPU copy),
    /// and a pending mark over the first `pending` blocks, live or expired.
    #[derive(Debug, Clone)]
    struct Holding {
        depths: [usize; 3],
        copies: usize,
        pending: usize,
        live: bool,
    }

    fn holding(n: usize) -> impl Strategy<Value = Holding> {
        let d = prop_oneof![Just(0), 0..=n + 2, 0..4usize];
        (d.clone(), d.clone(), d.clone(), d, any::<bool>()).prop_map(|(a, b, c, pending, live)| {
            let mut depths = [a, b, c];
            depths.sort_unstable();
            let copies = depths[0] / 2;
            Holding {
                depths,
                copies,
                pending,
                live,
            }
        })
    }

    fn holdings() -> impl Strategy<Value = (usize, Vec<Holding>)> {
        (1usize..200, 1usize..=MAX_WORKERS)
            .prop_flat_map(|(n, w)| (Just(n), proptest::collection::vec(holding(n), w)))
    }

    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn lookup_at_equals_the_full_walk_on_prefix_closed_holdings((n, hs) in holdings()) {
            let ix = KvIndex::new(4);
            let keys = prompt_keys(&(0..(n as u32 + 3) * 4).collect::<Vec<_>>(), 4);
            let now = 1_000;
            for (w, h) in hs.iter().enumerate() {
                let slot = ix.claim(&Arc::from(format!("w{w}"))).unwrap();
                let tiers = [Tier::Gpu, Tier::Cpu, Tier::Disk];
                let mut from = 0;
                for (t, &to) in tiers.iter().zip(&h.depths) {
                    for &k in &keys[from..to] {
                        ix.insert(slot, k, *t);
                    }
                    from = to;
                }
                for &k in &keys[..h.copies] {
                    ix.insert(slot, k, Tier::Cpu);
                }
                let until = if h.live { now + 10 } else { now - 1 };
                ix.note_pending(slot, &keys[..h.pending], now - 5, until);
            }
            let keys = &keys[..n];
            let (mut got, mut want) = ([[0; 3]; MAX_WORKERS], [[0; 3]; MAX_WORKERS]);
            for _ in 0..2 {
                ix.lookup_at(keys, &mut got, now);
                ix.walk_at(keys, &mut want, now);
                prop_assert_eq!(got, want);
            }
            prop_assert_eq!(ix.lookup_mismatches(), 0, "the sampled check agreed");
        }
    }

    #[test]
    fn a_hole_is_caught_by_the_sampled_check() {
        let (ix, s) = index_with(&["a"]);
        let k = prompt_keys(&(0..64).collect::<Vec<_>>(), 4);
        for &key in &k[..10] {
            ix.insert(s[0], key, Tier::Gpu);
        }
        ix.remove(s[0], k[5], Tier::Gpu); // held past a block it lacks
        let mut d = [[0; 3]; MAX_WORKERS];
        ix.lookup(&k, &mut d);
        assert_eq!(
            (d[0], ix.lookup_mismatches()),
            ([5; 3], 1),
            "checked: the walk's answer"
        );
        for _ in 1..crate::kv_events::CHECK_EVERY {
            ix.lookup(&k, &mut d);
        }
        assert_eq!(
            (d[0], ix.lookup_mismatches()),
            ([10; 3], 1),
            "unchecked: the search misses the hole"
        );
        ix.lookup(&k, &mut d);
        assert_eq!((d[0], ix.lookup_mismatches()), ([5; 3], 2));
    }

    #[test]
    fn concurrent_writers_on_the_same_keys_lose_nothing() {
        let (ix, s) = index_with(&["a", "b", "c", "d"]);
        let k = prompt_keys(&(0..4096).collect::<Vec<_>>(), 4);
        std::thread::scope(|scope| {
            for &slot in &s {
                let (ix, k) = (&ix, &k);
                scope.spawn(move || {
                    for &key in k {
                        ix.insert(slot, key, Tier::Gpu);
                        ix.insert(slot, key, Tier::Cpu);
                    }
                    // Half of them freed again, racing the others' inserts.
                    for &key in &k[k.len() / 2..] {
                        ix.remove(slot, key, Tier::Gpu);
                        ix.remove(slot, key, Tier::Cpu);
                    }
                });
            }
        });
        let half = (k.len() / 2) as u64;
        assert_eq!((ix.pairs(), ix.keys()), (half * 8, half as usize));
        let mut d = [[0; 3]; MAX_WORKERS];
        ix.lookup(&k, &mut d);
        for &slot in &s {
            assert_eq!(d[slot as usize], [half as u32; 3]);
            assert_eq!(ix.gpu_blocks(slot), half);
        }
        ix.clear_slot(s[0]);
        assert_eq!((ix.pairs(), ix.gpu_blocks(s[0])), (half * 6, 0));
    }
}
