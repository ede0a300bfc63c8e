//! Blocks this gateway just sent to a worker, before the engine's own events can
//! have told. An engine publishes a prompt's blocks once it has computed them, so
//! requests sharing a new prefix that arrive while the first is still queued or
//! in prefill would see nobody holding it and be placed anew (a second copy, a
//! second prefill). A decision therefore counts as held on its worker for a short
//! time (`[pools.kv_events].pending_ttl_ms`), or until the engine reports the
//! block stored; its events speak from then on (evictions included).
//!
//! Pending blocks the worker did not hold already are counted per worker, so
//! the `prefix` policy's cache-space balance sees where new prefixes were just
//! placed (a burst of new prefixes would otherwise all look like they fit the
//! same, still empty-looking, engine).
//!
//! Bounded: at most [`MAX_PENDING_KEYS`] keys per pool; when full, expired
//! entries are dropped first, and a decision that still does not fit is not
//! remembered (the caller counts it). Expired entries are also swept once per
//! TTL, so the per-worker counts lag an expiry by one TTL at most.

use dashmap::DashMap;
use std::hash::BuildHasherDefault;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use super::index::{KeyHasher, MAX_WORKERS};

/// Most block keys a pool remembers as pending.
pub const MAX_PENDING_KEYS: usize = 1 << 16;

#[derive(Clone, Copy)]
struct Entry {
    /// One bit per worker slot.
    mask: u64,
    /// The slots for which this key counts in `new_blocks` (not held before).
    counted: u64,
    /// Pending until then (`pool::stats::now_ms` scale); the latest decision's.
    until: u64,
}

/// A pool's pending blocks (see the module docs).
pub struct Pending {
    map: DashMap<u64, Entry, BuildHasherDefault<KeyHasher>>,
    len: AtomicUsize,
    /// Per slot: pending keys it did not hold when they were sent.
    new_blocks: [AtomicU64; MAX_WORKERS],
    /// When expired entries are next swept.
    next_sweep: AtomicU64,
}

impl Default for Pending {
    fn default() -> Self {
        Pending {
            map: DashMap::default(),
            len: AtomicUsize::new(0),
            new_blocks: std::array::from_fn(|_| AtomicU64::new(0)),
            next_sweep: AtomicU64::new(0),
        }
    }
}

impl Pending {
    /// Remember that `slot` is about to hold `keys` until `until`; `false` when
    /// the bound left no room. `held(key)`: the slot holds it already (so it
    /// adds nothing to the slot's cache footprint).
    pub fn insert(
        &self,
        slot: u8,
        keys: &[u64],
        now: u64,
        until: u64,
        held: impl Fn(u64) -> bool,
    ) -> bool {
        if now >= self.next_sweep.load(Ordering::Relaxed) {
            self.next_sweep.store(until, Ordering::Relaxed);
            self.sweep(now);
        }
        if self.len.load(Ordering::Relaxed) + keys.len() > MAX_PENDING_KEYS {
            self.sweep(now);
            if self.map.len() + keys.len() > MAX_PENDING_KEYS {
                return false;
            }
        }
        let bit = 1u64 << slot;
        for &k in keys {
            let mut new = false;
            let mut e = self.map.entry(k).or_insert_with(|| {
                new = true;
                Entry {
                    mask: 0,
                    counted: 0,
                    until,
                }
            });
            if e.until <= now {
                self.uncount(e.counted);
                (e.mask, e.counted) = (0, 0);
            }
            e.mask |= bit;
            e.until = e.until.max(until);
            if e.counted & bit == 0 && !held(k) {
                e.counted |= bit;
                self.new_blocks[slot as usize].fetch_add(1, Ordering::Relaxed);
            }
            if new {
                self.len.fetch_add(1, Ordering::Relaxed);
            }
        }
        true
    }

    /// Pending blocks `slot` did not hold when they were sent (expired ones
    /// until the next sweep).
    pub fn new_blocks(&self, slot: u8) -> u64 {
        self.new_blocks
            .get(slot as usize)
            .map_or(0, |n| n.load(Ordering::Relaxed))
    }

    /// Drop the entries expired at `now`.
    fn sweep(&self, now: u64) {
        self.map.retain(|_, e| {
            let keep = e.until > now;
            if !keep {
                self.uncount(e.counted);
            }
            keep
        });
        self.len.store(self.map.len(), Ordering::Relaxed);
    }

    fn uncount(&self, mut counted: u64) {
        while counted != 0 {
            let slot = counted.trailing_zeros() as usize;
            self.new_blocks[slot].fetch_sub(1, Ordering::Relaxed);
            counted &= counted - 1;
        }
    }

    /// The engine of `slot` reported `key` stored: from now on its events speak
    /// for it (a later eviction counts at once).
    pub fn confirm(&self, slot: u8, key: u64) {
        if self.is_empty() {
            return;
        }
        let bit = 1u64 << slot;
        let gone = self.map.remove_if_mut(&key, |_, e| {
            if e.counted & bit != 0 {
                self.new_blocks[slot as usize].fetch_sub(1, Ordering::Relaxed);
            }
            e.mask &= !bit;
            e.counted &= !bit;
            e.mask == 0
        });
        if gone.is_some() {
            self.len.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// The slots `key` is pending on at `now`.
    #[inline]
    pub fn mask(&self, key: u64, now: u64) -> u64 {
        if self.len.load(Ordering::Relaxed) == 0 {
            return 0;
        }
        self.map
            .get(&key)
            .filter(|e| e.until > now)
            .map_or(0, |e| e.mask)
    }

    /// Keys remembered (expired ones included until a purge).
    pub fn len(&self) -> usize {
        self.len.load(Ordering::Relaxed)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pending_blocks_expire_and_stay_bounded() {
        let p = Pending::default();
        assert!(p.insert(3, &[1, 2], 1_000, 3_000, |_| false));
        assert!(p.insert(5, &[2], 1_500, 3_500, |_| false));
        assert_eq!(
            (p.mask(1, 2_000), p.mask(2, 2_000)),
            (1 << 3, 1 << 3 | 1 << 5)
        );
        assert_eq!(p.mask(1, 3_000), 0, "expired");
        p.confirm(5, 2);
        assert_eq!(p.mask(2, 2_000), 1 << 3, "the events speak for slot 5 now");
        p.confirm(3, 2);
        assert_eq!((p.mask(2, 2_000), p.len()), (0, 1));
        assert!(p.insert(5, &[1], 4_000, 6_000, |_| false));
        assert_eq!(p.mask(1, 4_000), 1 << 5, "an expired entry starts afresh");
        // Full: expired keys make room, live ones do not.
        let many: Vec<u64> = (10..10 + MAX_PENDING_KEYS as u64).collect();
        assert!(
            !p.insert(1, &many, 4_000, 5_000, |_| false),
            "key 1 is still live"
        );
        let (head, tail) = many.split_at(MAX_PENDING_KEYS - 4);
        assert!(p.insert(1, head, 4_000, 5_000, |_| false));
        assert!(!p.insert(1, tail, 4_500, 6_000, |_| false));
        assert!(
            p.insert(1, tail, 5_000, 6_000, |_| false),
            "the head expired"
        );
        assert_eq!(p.len(), 5);
    }

    /// What a slot was just sent and did not hold counts towards its cache
    /// footprint until the engine confirms it or it expires.
    #[test]
    fn new_blocks_count_until_confirmed_or_expired() {
        let p = Pending::default();
        // Key 2 is held already: only 1 and 3 are new to slot 4.
        assert!(p.insert(4, &[1, 2, 3], 1_000, 3_000, |k| k == 2));
        assert_eq!(p.new_blocks(4), 2);
        // Sent again: not counted twice.
        assert!(p.insert(4, &[1, 3], 1_100, 3_000, |_| false));
        assert_eq!((p.new_blocks(4), p.new_blocks(5)), (2, 0));
        p.confirm(4, 1);
        assert_eq!(p.new_blocks(4), 1, "the events count it now");
        // After the TTL, the next decision sweeps the expired entries.
        assert!(p.insert(5, &[9], 3_000, 5_000, |_| false));
        assert_eq!((p.new_blocks(4), p.new_blocks(5)), (0, 1));
    }
}
