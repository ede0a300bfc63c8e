//! Weighted splits: one client-facing model name served by several pools by
//! weight (canary 95/5, A/B tests). Resolved to a pool before the pool's policy
//! runs (`routes::Snapshot::resolve`).
//!
//! * **With a session key** (`x-session-id`, else the body's `user`): weighted
//!   rendezvous hashing — each target scores `weight / -ln(u)` with `u` a hash of
//!   (key, target) in (0, 1), the highest wins. A session always lands on the
//!   same pool, every gateway replica agrees without talking, and changing the
//!   weights moves only the sessions that must move (raising the canary's weight
//!   moves sessions from the others to the canary, never between the others).
//! * **Without one**: a weighted quasi-random draw — a golden-ratio (Weyl)
//!   sequence from a random start, so the observed shares stay within a fraction
//!   of a point of the weights even over a few hundred requests, without a short
//!   repeating pattern.
//!
//! Targets whose pool has no available worker are passed over while another has
//! one (a session then moves only if its own pool is down).

use std::sync::atomic::{AtomicU64, Ordering};
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// 1/φ: the Weyl sequence step with the best spread.
const GOLDEN: f64 = 0.618_033_988_749_894_9;

struct Target {
    weight: f64,
    /// xxh3 of the pool name: seeds the session hash.
    hash: u64,
}

/// A split's targets and its draw state.
pub struct WeightedSplit {
    targets: Vec<Target>,
    next: AtomicU64,
    start: f64,
}

impl WeightedSplit {
    /// `targets`: (pool name, weight ≥ 0), as validated by the config.
    pub fn new<'a>(targets: impl IntoIterator<Item = (&'a str, f64)>) -> WeightedSplit {
        WeightedSplit {
            targets: targets
                .into_iter()
                .map(|(name, weight)| Target {
                    weight,
                    hash: xxh3_64(name.as_bytes()),
                })
                .collect(),
            next: AtomicU64::new(0),
            start: rand::random::<f64>(),
        }
    }

    pub fn len(&self) -> usize {
        self.targets.len()
    }

    pub fn is_empty(&self) -> bool {
        self.targets.is_empty()
    }

    /// The target for a request: sticky by `session` when given, else a weighted
    /// draw; among targets `accept` admits, or among all when it admits none.
    pub fn pick(&self, session: Option<&str>, accept: impl Fn(usize) -> bool) -> usize {
        let any = (0..self.targets.len()).any(|i| self.targets[i].weight > 0.0 && accept(i));
        let ok = |i: usize| !any || accept(i);
        let chosen = match session {
            Some(key) => self.pick_session(xxh3_64(key.as_bytes()), ok),
            None => {
                let n = self.next.fetch_add(1, Ordering::Relaxed);
                self.pick_at((self.start + n as f64 * GOLDEN).fract(), ok)
            }
        };
        chosen.unwrap_or(0)
    }

    /// Weighted rendezvous: the highest `weight / -ln(u)`.
    pub fn pick_session(&self, key: u64, accept: impl Fn(usize) -> bool) -> Option<usize> {
        let mut best: Option<(usize, f64)> = None;
        for (i, t) in self.targets.iter().enumerate() {
            if t.weight <= 0.0 || !accept(i) {
                continue;
            }
            let h = xxh3_64_with_seed(&key.to_le_bytes(), t.hash);
            // (0, 1): never 0 (ln) and never 1 (division by zero).
            let u = ((h >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
            let score = t.weight / -u.ln();
            if best.is_none_or(|(_, s)| score > s) {
                best = Some((i, score));
            }
        }
        best.map(|b| b.0)
    }

    /// The target whose share of the accepted weight covers `u` ∈ [0, 1).
    fn pick_at(&self, u: f64, accept: impl Fn(usize) -> bool) -> Option<usize> {
        let total: f64 = (0..self.targets.len())
            .filter(|&i| accept(i))
            .map(|i| self.targets[i].weight)
            .sum();
        if total <= 0.0 {
            return None;
        }
        let mut x = u * total;
        let mut last = None;
        for (i, t) in self.targets.iter().enumerate() {
            if t.weight <= 0.0 || !accept(i) {
                continue;
            }
            last = Some(i);
            if x < t.weight {
                return Some(i);
            }
            x -= t.weight;
        }
        last
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(w: &[(&'static str, f64)]) -> WeightedSplit {
        WeightedSplit::new(w.iter().copied())
    }

    #[test]
    fn draws_hold_the_weights_closely() {
        let s = split(&[("stable", 95.0), ("canary", 5.0)]);
        let mut n = [0u32; 2];
        for _ in 0..1_000 {
            n[s.pick(None, |_| true)] += 1;
        }
        assert!((45..=55).contains(&n[1]), "{n:?}");
        let s = split(&[("a", 1.0), ("b", 1.0), ("c", 2.0)]);
        let mut n = [0u32; 3];
        for _ in 0..400 {
            n[s.pick(None, |_| true)] += 1;
        }
        assert!(
            n.iter()
                .zip([100, 100, 200])
                .all(|(&g, w)| g.abs_diff(w) <= 4),
            "{n:?}"
        );
    }

    #[test]
    fn sessions_stick_and_follow_the_weights() {
        let s = split(&[("stable", 95.0), ("canary", 5.0)]);
        let mut canary = 0;
        for k in 0..20_000 {
            let key = format!("session-{k}");
            let t = s.pick(Some(&key), |_| true);
            assert_eq!(t, s.pick(Some(&key), |_| true));
            canary += t;
        }
        // Binomial(20000, 0.05): sd ≈ 31.
        assert!((850..=1150).contains(&canary), "{canary}");
    }

    #[test]
    fn raising_the_canary_moves_only_stable_sessions_to_it() {
        let before = split(&[("stable", 95.0), ("canary", 5.0)]);
        let after = split(&[("stable", 90.0), ("canary", 10.0)]);
        let mut moved = 0;
        for k in 0..20_000u64 {
            let key = xxh3_64(&k.to_le_bytes());
            let (b, a) = (
                before.pick_session(key, |_| true).unwrap(),
                after.pick_session(key, |_| true).unwrap(),
            );
            if b != a {
                assert_eq!((b, a), (0, 1), "only stable → canary");
                moved += 1;
            }
        }
        // About 5 % of all sessions must move, and no more.
        assert!((800..=1200).contains(&moved), "{moved}");
    }

    #[test]
    fn a_refused_target_hands_over_only_its_sessions() {
        let s = split(&[("a", 1.0), ("b", 1.0), ("c", 1.0)]);
        for k in 0..3_000u64 {
            let key = xxh3_64(&k.to_le_bytes());
            let all = s.pick_session(key, |_| true).unwrap();
            let without_c = s.pick_session(key, |i| i != 2).unwrap();
            if all != 2 {
                assert_eq!(all, without_c);
            }
            assert_ne!(without_c, 2);
        }
        // Nothing accepted: the pick still names a target (its pool reports the error).
        assert!(s.pick(None, |_| false) < 3);
        // Zero weight: never chosen while another is.
        let z = split(&[("off", 0.0), ("on", 1.0)]);
        assert!((0..100).all(|_| z.pick(None, |_| true) == 1));
        assert_eq!(z.pick(Some("k"), |_| true), 1);
    }
}
