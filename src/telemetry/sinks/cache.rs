//! Predicted vs actual cached prompt tokens per pool: how well routing knows what
//! the engines hold. Counters go through per-thread handles; the totals behind
//! the ratio gauge are atomics.

use super::super::{names, Borrowed, CounterCache, FastMap, PoolKindKey};
use metrics::{counter, gauge, SharedString};
use std::sync::atomic::{AtomicU64, Ordering};

/// Kinds of the cache-prediction counters besides the prediction results.
const PREDICTED: &str = "predicted";
const ACTUAL: &str = "actual";

#[derive(Default)]
struct Totals {
    predicted: AtomicU64,
    actual: AtomicU64,
}

#[derive(Default)]
pub struct CacheAccuracy {
    totals: FastMap<SharedString, Totals>,
    counts: CounterCache<PoolKindKey>,
}

/// The counter behind a (pool, kind) key: predicted or actual cached tokens, or
/// a prediction's result.
fn cache_counter((pool, kind): &PoolKindKey) -> metrics::Counter {
    match *kind {
        PREDICTED => counter!(names::CACHE_PREDICTED_TOKENS_TOTAL, names::L_POOL => pool.clone()),
        ACTUAL => counter!(names::CACHE_ACTUAL_TOKENS_TOTAL, names::L_POOL => pool.clone()),
        result => counter!(
            names::CACHE_PREDICTIONS_TOTAL,
            names::L_POOL => pool.clone(),
            names::L_RESULT => result
        ),
    }
}

impl CacheAccuracy {
    /// One request the router predicted `predicted` cached tokens for, and the
    /// engine reported `actual`.
    pub fn record(&self, pool: &SharedString, predicted: u64, actual: u64) {
        let result = match (predicted > 0, actual > 0) {
            (true, true) => "hit",
            (true, false) => "false_hit",
            (false, true) => "missed_hit",
            (false, false) => "miss",
        };
        for (kind, n) in [(PREDICTED, predicted), (ACTUAL, actual), (result, 1)] {
            self.counts
                .increment(&Borrowed((pool, kind)), n, cache_counter);
        }
        let acc = match self.totals.get(pool) {
            Some(a) => a,
            None => self.totals.entry(pool.clone()).or_default().downgrade(),
        };
        acc.predicted.fetch_add(predicted, Ordering::Relaxed);
        acc.actual.fetch_add(actual, Ordering::Relaxed);
    }

    /// (pool, predicted, actual), sorted by pool.
    pub fn totals(&self) -> Vec<(String, u64, u64)> {
        let mut v: Vec<_> = self
            .totals
            .iter()
            .map(|e| {
                let t = e.value();
                (
                    e.key().to_string(),
                    t.predicted.load(Ordering::Relaxed),
                    t.actual.load(Ordering::Relaxed),
                )
            })
            .collect();
        v.sort();
        v
    }

    /// Set the actual/predicted ratio gauges (scrape time).
    pub fn refresh_gauges(&self) {
        for (pool, pred, actual) in self.totals() {
            if pred > 0 {
                gauge!(names::CACHE_PREDICTION_RATIO, names::L_POOL => pool)
                    .set(actual as f64 / pred as f64);
            }
        }
    }
}
