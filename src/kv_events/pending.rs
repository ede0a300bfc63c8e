//! Blocks this gateway just sent to a worker, before the engine's own events can
//! have told. An engine publishes a prompt's blocks once it has computed them, so
//! requests sharing a new prefix that arrive while the first is still queued or
//! in prefill would see nobody holding it and be placed anew (a second copy, a
//! second prefill). A decision therefore counts as held on its worker for a short
//! time (`[pools.kv_events].pending_ttl_ms`), or until the engine reports the
//! block stored; its events speak from then on (evictions included).
//!
//! Bounded: at most [`MAX_PENDING_KEYS`] keys per pool; when full, expired
//! entries are dropped first, and a decision that still does not fit is not
//! remembered (the caller counts it).

use dashmap::DashMap;
use std::hash::BuildHasherDefault;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::index::KeyHasher;

/// Most block keys a pool remembers as pending.
pub const MAX_PENDING_KEYS: usize = 1 << 16;

#[derive(Clone, Copy)]
struct Entry {
    /// One bit per worker slot.
    mask: u64,
    /// Pending until then (`pool::stats::now_ms` scale); the latest decision's.
    until: u64,
}

/// A pool's pending blocks (see the module docs).
#[derive(Default)]
pub struct Pending {
    map: DashMap<u64, Entry, BuildHasherDefault<KeyHasher>>,
    len: AtomicUsize,
}

impl Pending {
    /// Remember that `slot` is about to hold `keys` until `until`; `false` when
    /// the bound left no room.
    pub fn insert(&self, slot: u8, keys: &[u64], now: u64, until: u64) -> bool {
        if self.len.load(Ordering::Relaxed) + keys.len() > MAX_PENDING_KEYS {
            self.map.retain(|_, e| e.until > now);
            self.len.store(self.map.len(), Ordering::Relaxed);
            if self.map.len() + keys.len() > MAX_PENDING_KEYS {
                return false;
            }
        }
        let bit = 1u64 << slot;
        for &k in keys {
            let mut new = false;
            let mut e = self.map.entry(k).or_insert_with(|| {
                new = true;
                Entry { mask: 0, until }
            });
            if e.until <= now {
                e.mask = 0;
            }
            e.mask |= bit;
            e.until = e.until.max(until);
            if new {
                self.len.fetch_add(1, Ordering::Relaxed);
            }
        }
        true
    }

    /// The engine of `slot` reported `key` stored: from now on its events speak
    /// for it (a later eviction counts at once).
    pub fn confirm(&self, slot: u8, key: u64) {
        if self.is_empty() {
            return;
        }
        let bit = 1u64 << slot;
        let gone = self.map.remove_if_mut(&key, |_, e| {
            e.mask &= !bit;
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
        assert!(p.insert(3, &[1, 2], 1_000, 3_000));
        assert!(p.insert(5, &[2], 1_500, 3_500));
        assert_eq!(
            (p.mask(1, 2_000), p.mask(2, 2_000)),
            (1 << 3, 1 << 3 | 1 << 5)
        );
        assert_eq!(p.mask(1, 3_000), 0, "expired");
        p.confirm(5, 2);
        assert_eq!(p.mask(2, 2_000), 1 << 3, "the events speak for slot 5 now");
        p.confirm(3, 2);
        assert_eq!((p.mask(2, 2_000), p.len()), (0, 1));
        assert!(p.insert(5, &[1], 4_000, 6_000));
        assert_eq!(p.mask(1, 4_000), 1 << 5, "an expired entry starts afresh");
        // Full: expired keys make room, live ones do not.
        let many: Vec<u64> = (10..10 + MAX_PENDING_KEYS as u64).collect();
        assert!(!p.insert(1, &many, 4_000, 5_000), "key 1 is still live");
        let (head, tail) = many.split_at(MAX_PENDING_KEYS - 4);
        assert!(p.insert(1, head, 4_000, 5_000));
        assert!(!p.insert(1, tail, 4_500, 6_000));
        assert!(p.insert(1, tail, 5_000, 6_000), "the head expired");
        assert_eq!(p.len(), 5);
    }
}
