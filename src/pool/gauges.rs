//! Scrape-time gauges read from the pool set: each worker's live state and load.

use super::PoolSet;
use crate::telemetry::names;
use metrics::{gauge, SharedString};
use std::sync::atomic::Ordering;

/// Set the worker gauges from their atomics.
pub fn refresh(snap: &PoolSet) {
    super::block_size::refresh_gauges(snap);
    let now = crate::runtime::clock::now_ms();
    for w in snap.workers() {
        let id = SharedString::from(w.id.clone());
        let st = &w.state.stats;
        let load = st.load(w.in_flight(), now, u64::MAX);
        let set = |name: &'static str, v: f64| {
            gauge!(name, names::L_WORKER => id.clone()).set(v);
        };
        set(
            names::WORKER_IN_FLIGHT,
            w.state.in_flight.load(Ordering::Relaxed) as f64,
        );
        set(
            names::WORKER_HEALTHY,
            if w.is_available() { 1.0 } else { 0.0 },
        );
        set(names::WORKER_QUEUE, load.queue);
        set(
            names::WORKER_WAITING,
            st.waiting.load(Ordering::Relaxed) as f64,
        );
        set(
            names::WORKER_RUNNING,
            st.running.load(Ordering::Relaxed) as f64,
        );
        set(names::WORKER_KV_USAGE_RATIO, load.kv_usage);
        set(
            names::WORKER_STATS_AGE_SECONDS,
            st.age_ms(now).map_or(-1.0, |a| a as f64 / 1000.0),
        );
        if let Some(g) = st.gpu.get(now) {
            set(names::WORKER_GPU_UTILIZATION_RATIO, g.util_ratio);
            set(names::WORKER_GPU_MEMORY_USED_BYTES, g.fb_used_bytes as f64);
            set(names::WORKER_GPU_MEMORY_FREE_BYTES, g.fb_free_bytes as f64);
            set(
                names::WORKER_GPU_THROTTLE_REASONS,
                g.throttle_reasons as f64,
            );
        }
    }
}
