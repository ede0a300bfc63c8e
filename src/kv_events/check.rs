//! Checks that the index's fast lookup still answers exactly.
//!
//! The galloping search (`search.rs`) is exact only while every worker's holdings
//! are prefix-closed (a block held only with its parent). An engine that broke
//! that (a hole: a block kept after its parent was freed) would make it
//! overstate a depth silently, so every [`CHECK_EVERY`]th lookup also runs the
//! full walk; a disagreement is counted in
//! `switchyard_kv_index_lookup_mismatch_total{pool}` and logged (the 1st, 2nd,
//! 4th, 8th, … of a pool: rate-limited without a clock), and that lookup answers
//! with the walk's result.

use metrics::counter;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::telemetry::names;

/// One lookup in this many is checked (deterministic: a counter, not a coin).
pub const CHECK_EVERY: u64 = 256;

/// A pool's lookup checks (see the module docs).
pub(super) struct Checks {
    pool: Arc<str>,
    lookups: AtomicU64,
    mismatches: AtomicU64,
}

impl Checks {
    /// The pool's name.
    pub(super) fn pool(&self) -> &str {
        &self.pool
    }

    pub(super) fn new(pool: &str) -> Checks {
        Checks {
            pool: Arc::from(pool),
            lookups: AtomicU64::new(0),
            mismatches: AtomicU64::new(0),
        }
    }

    /// Whether this lookup is one to check.
    #[inline]
    pub(super) fn due(&self) -> bool {
        self.lookups
            .fetch_add(1, Ordering::Relaxed)
            .is_multiple_of(CHECK_EVERY)
    }

    /// The search and the walk disagreed on a prompt of `blocks` blocks.
    #[cold]
    pub(super) fn mismatch(&self, blocks: usize) {
        let n = self.mismatches.fetch_add(1, Ordering::Relaxed) + 1;
        counter!(names::KV_INDEX_LOOKUP_MISMATCH_TOTAL, names::L_POOL => self.pool.to_string())
            .increment(1);
        if n.is_power_of_two() {
            tracing::warn!(pool = %self.pool, mismatches = n, blocks,
                "kv events: a sampled lookup differed from the full walk (an engine holds a block without its parent); depths may be overstated");
        }
    }

    /// Lookups so far.
    pub(super) fn lookups(&self) -> u64 {
        self.lookups.load(Ordering::Relaxed)
    }

    /// Checked lookups that disagreed so far.
    pub(super) fn mismatches(&self) -> u64 {
        self.mismatches.load(Ordering::Relaxed)
    }
}
