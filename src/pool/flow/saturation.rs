//! When a worker counts as saturated: its in-flight limit, and with
//! `[pools.flow_control]` the engine's running / waiting requests and KV usage
//! (last fresh scrape, corrected by this gateway's own requests since).

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

/// Whether the pool limits its workers at all (then it has a queue).
pub fn limits(cfg: &PoolConfig) -> bool {
    cfg.max_concurrency_per_worker > 0 || cfg.flow.is_some()
}
