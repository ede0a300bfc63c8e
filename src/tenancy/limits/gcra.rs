//! The generic cell rate algorithm (GCRA) over one atomic: the theoretical
//! arrival time (TAT) of the next unit. A limit of `L` per window spaces units
//! `window / L` apart and allows a burst of `L`. Unlike a plain counter it has no
//! window edges, and unlike `governor`'s API it can be charged after the fact
//! (`force`) and refunded (`refund`), which the token correction needs: a
//! request that used more tokens than estimated puts the cell in debt. The
//! Redis script implements the same arithmetic, so both stores answer alike.

use std::sync::atomic::{AtomicU64, Ordering};

/// The window every limit is per.
pub const WINDOW_NS: u64 = 60_000_000_000;

/// One limited quantity (requests or tokens) of one scope.
#[derive(Default)]
pub struct Cell {
    /// Theoretical arrival time, ns on the limiter's clock.
    tat: AtomicU64,
}

/// The state after a take, for the rate-limit headers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    pub limit: u64,
    pub remaining: u64,
    /// Until the cell is full again (ns).
    pub reset_ns: u64,
}

/// Spacing of units for a limit per window (at least 1 ns).
fn interval(limit: u64) -> u64 {
    (WINDOW_NS / limit.max(1)).max(1)
}

fn window(limit: u64, now: u64, tat: u64) -> Window {
    let used = tat.saturating_sub(now);
    Window {
        limit,
        remaining: WINDOW_NS.saturating_sub(used) / interval(limit),
        reset_ns: used,
    }
}

impl Cell {
    /// Take `n` units if they fit; else the wait (ns) until they would.
    pub fn take(&self, now: u64, n: u64, limit: u64) -> Result<Window, (u64, Window)> {
        let cost = n.saturating_mul(interval(limit));
        let mut tat = self.tat.load(Ordering::Acquire);
        loop {
            let new = tat.max(now).saturating_add(cost);
            let used = new - now;
            if used > WINDOW_NS {
                return Err((used - WINDOW_NS, window(limit, now, tat)));
            }
            match self
                .tat
                .compare_exchange_weak(tat, new, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return Ok(window(limit, now, new)),
                Err(seen) => tat = seen,
            }
        }
    }

    /// Charge `n` units whether or not they fit (a correction after the fact).
    pub fn force(&self, now: u64, n: u64, limit: u64) {
        let cost = n.saturating_mul(interval(limit));
        let _ = self
            .tat
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |t| {
                Some(t.max(now).saturating_add(cost))
            });
    }

    /// Give back `n` units taken earlier (never below "full").
    pub fn refund(&self, now: u64, n: u64, limit: u64) {
        let cost = n.saturating_mul(interval(limit));
        let _ = self
            .tat
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |t| {
                Some(t.saturating_sub(cost).max(now))
            });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    #[test]
    fn a_full_cell_allows_a_burst_of_the_limit_then_refills_steadily() {
        let c = Cell::default();
        let t0 = 100 * S;
        for i in 0..60 {
            let w = c.take(t0, 1, 60).unwrap();
            assert_eq!(w.remaining, 59 - i);
        }
        let (wait, w) = c.take(t0, 1, 60).unwrap_err();
        assert_eq!((wait, w.remaining, w.reset_ns), (S, 0, 60 * S));
        // One unit back per second.
        assert!(c.take(t0 + S, 1, 60).is_ok());
        assert!(c.take(t0 + S, 1, 60).is_err());
        let w = c.take(t0 + 61 * S, 0, 60).unwrap();
        assert_eq!((w.remaining, w.reset_ns), (60, 0));
    }

    #[test]
    fn corrections_can_go_into_debt_and_refunds_stop_at_full() {
        let c = Cell::default();
        let t0 = 100 * S;
        c.take(t0, 10, 60).unwrap();
        c.force(t0, 100, 60);
        // 110 units at one a second: 50 s of debt beyond the window.
        let (wait, _) = c.take(t0, 1, 60).unwrap_err();
        assert_eq!(wait, 51 * S);
        c.refund(t0, 1_000, 60);
        assert_eq!(c.take(t0, 0, 60).unwrap().remaining, 60);
    }

    #[test]
    fn a_take_larger_than_the_limit_never_fits() {
        let c = Cell::default();
        assert!(c.take(S, 61, 60).is_err());
        assert_eq!(c.take(S, 0, 60).unwrap().remaining, 60);
    }
}
