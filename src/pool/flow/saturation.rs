//! When a worker counts as saturated: its in-flight limit, and with
//! `[pools.flow_control]` the engine's running / waiting requests and KV usage
//! (last fresh scrape, corrected by this gateway's own requests since) — and,
//! for one request, a worker much slower for it than the best one while a
//! faster one is expected to free up soon enough ([`holds_for_faster`]), or
//! one whose free slots are reserved and the request's flow is over its share
//! ([`in_reserve`]).

use crate::config::PoolConfig;
use crate::pool::Worker;

/// Worker `w` of a pool configured `cfg` may take one more request at `now_ms`.
pub fn has_room(cfg: &PoolConfig, w: &Worker, now_ms: u64) -> bool {
    let limit = cfg.max_concurrency_per_worker;
    if limit > 0 && w.in_flight() >= limit {
        return false;
    }
    let Some(flow) = &cfg.flow else {
        return true;
    };
    let stale = cfg.routing.stale_after.as_millis() as u64;
    let Some(c) = w.state.stats.engine_counts(now_ms, stale) else {
        return true;
    };
    flow.max_running.is_none_or(|m| c.running < m)
        && flow.max_waiting.is_none_or(|m| c.waiting <= m)
        && flow.max_kv_usage.is_none_or(|m| c.kv_usage < m)
}

/// Worker `w`'s free slots are all among the last ones kept for flows within
/// their share (`reserved_slots`; see `flow::share`).
pub fn in_reserve(cfg: &PoolConfig, w: &Worker) -> bool {
    let limit = cfg.max_concurrency_per_worker;
    let reserved = cfg.flow.as_ref().map_or(0, |f| f.reserved(limit));
    reserved > 0 && w.in_flight() + reserved >= limit
}

/// Whether the pool limits its workers at all (then it has a queue).
pub fn limits(cfg: &PoolConfig) -> bool {
    cfg.max_concurrency_per_worker > 0 || cfg.flow.is_some()
}

/// A worker with room predicted to take `predicted_ms` to the request's first
/// token counts as saturated *for this request* when that is over `ratio` times
/// the best eligible worker's `best_ms` (busy or not) and a slot on a worker
/// that fast is expected sooner than the slow one would answer: `wait_ms` is
/// that expectation (the waiters ahead of it, and itself, over the rate at
/// which the fast workers free slots). So a request near the head of the queue
/// — the fair queue puts small requests there — holds out for a fast worker,
/// and one deep in the queue takes the slow worker now. However wrong the
/// expectation, a request stops holding out once it has waited (`waited_ms`)
/// as long as the slow worker would cost it extra. `ratio` 0: off.
pub fn holds_for_faster(
    ratio: f64,
    predicted_ms: f64,
    best_ms: f64,
    wait_ms: f64,
    waited_ms: f64,
) -> bool {
    let extra = predicted_ms - best_ms;
    ratio > 0.0 && predicted_ms > ratio * best_ms && wait_ms < extra && waited_ms < extra
}

/// The expected wait (ms) for one of the slots freed at `per_s` a second when
/// `ahead` waiters go first.
pub fn expected_wait_ms(ahead: usize, per_s: f64) -> f64 {
    if per_s > 0.0 {
        (ahead as f64 + 1.0) * 1e3 / per_s
    } else {
        f64::INFINITY
    }
}

#[cfg(test)]
mod tests {
    use super::{expected_wait_ms, holds_for_faster};

    #[test]
    fn a_much_slower_worker_is_passed_over_while_a_fast_slot_comes_sooner() {
        // Fast slots free 10 a second: 100 ms each in turn.
        let wait = |ahead| expected_wait_ms(ahead, 10.0);
        assert_eq!(wait(0), 100.0);
        // 1500 ms against 300 ms: held while the fast slot comes within 1200 ms.
        assert!(holds_for_faster(2.0, 1500.0, 300.0, wait(0), 0.0));
        assert!(holds_for_faster(2.0, 1500.0, 300.0, wait(10), 0.0));
        assert!(
            !holds_for_faster(2.0, 1500.0, 300.0, wait(12), 0.0),
            "deep in the queue"
        );
        // ... and while it has waited less than those 1200 ms.
        assert!(holds_for_faster(2.0, 1500.0, 300.0, wait(0), 1199.0));
        assert!(!holds_for_faster(2.0, 1500.0, 300.0, wait(0), 1200.0));
        // Within the ratio (or off, or no fast slot ever frees): taken at once.
        assert!(!holds_for_faster(2.0, 500.0, 300.0, wait(0), 0.0));
        assert!(!holds_for_faster(0.0, 1500.0, 300.0, wait(0), 0.0));
        assert!(!holds_for_faster(
            2.0,
            1500.0,
            300.0,
            expected_wait_ms(0, 0.0),
            0.0
        ));
    }
}
