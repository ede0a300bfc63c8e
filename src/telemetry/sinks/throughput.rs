//! Per-worker throughput (processed tokens per second) and per-pool TTFT over the
//! last minute: what the cost sink prices time by and the fleet view scales on.
//! The request path adds to per-thread totals; the ticker turns them into rates.

use super::super::local::{LocalCount, LocalMap};
use super::super::FastMap;
use super::series::{quantile, since, LocalHist, NB};
use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// Seconds of per-pool TTFT kept for the scaling signal.
const TTFT_WINDOW_S: usize = 60;

/// Per-worker throughput, measured by the ticker.
#[derive(Default)]
struct WorkerRate {
    /// Tokens/s (f64 bits), an EWMA over ticks.
    tps_bits: AtomicU64,
}

#[derive(Default)]
struct TickState {
    /// Per pool: TTFT bucket counts of the last [`TTFT_WINDOW_S`] seconds.
    pool_ttft: HashMap<Arc<str>, VecDeque<[u64; NB]>>,
    seen_pool_ttft: HashMap<Arc<str>, [u64; NB]>,
    seen_tokens: HashMap<Arc<str>, u64>,
    last_tick: Option<Instant>,
}

#[derive(Default)]
pub struct Throughput {
    rates: FastMap<Arc<str>, WorkerRate>,
    /// Processed tokens (uncached prompt + output) per worker, per thread.
    worker_tokens: LocalMap<LocalCount>,
    /// TTFT per pool, per thread.
    pool_ttft: LocalMap<LocalHist>,
    tick: Mutex<TickState>,
}

impl Throughput {
    pub fn record(&self, worker: &str, pool: &str, processed_tokens: u64, ttft: Option<Duration>) {
        self.worker_tokens.with(worker, |n| n.add(processed_tokens));
        if let Some(t) = ttft {
            self.pool_ttft.with(pool, |h| h.record(t));
        }
    }

    /// The worker's measured tokens per second (0 before the first tick).
    pub fn tokens_per_s(&self, worker: &str) -> f64 {
        self.rates
            .get(worker)
            .map_or(0.0, |r| f64::from_bits(r.tps_bits.load(Ordering::Relaxed)))
    }

    /// The pool's TTFT p90 over the last minute, in seconds.
    pub fn ttft_p90(&self, pool: &str) -> Option<f64> {
        let st = self.tick.lock();
        let w = st.pool_ttft.get(pool)?;
        let mut sum = [0u64; NB];
        for s in w {
            for (a, b) in sum.iter_mut().zip(s) {
                *a += b;
            }
        }
        quantile(&sum, 0.9)
    }

    /// Once a second: update the rates and the TTFT windows, and forget workers
    /// and pools that are gone (discovery churn would otherwise grow the maps).
    pub fn tick(
        &self,
        now: Instant,
        live_worker: impl Fn(&str) -> bool,
        live_pool: impl Fn(&str) -> bool,
    ) {
        let mut st = self.tick.lock();
        let dt = st
            .last_tick
            .map_or(1.0, |t| now.saturating_duration_since(t).as_secs_f64())
            .max(1e-3);
        st.last_tick = Some(now);
        self.tick_ttft(&mut st);
        self.tick_rates(&mut st, dt);
        self.worker_tokens.retain(&live_worker);
        self.rates.retain(|w, _| live_worker(w));
        st.seen_tokens.retain(|w, _| live_worker(w));
        self.pool_ttft.retain(&live_pool);
        st.seen_pool_ttft.retain(|p, _| live_pool(p));
        st.pool_ttft.retain(|p, _| live_pool(p));
    }

    fn tick_ttft(&self, st: &mut TickState) {
        let mut pools: HashMap<Arc<str>, [u64; NB]> = HashMap::new();
        for (pool, h) in self.pool_ttft.entries() {
            h.add_to(pools.entry(pool).or_insert([0; NB]));
        }
        for (pool, total) in pools {
            let was = st
                .seen_pool_ttft
                .insert(pool.clone(), total)
                .unwrap_or([0; NB]);
            let w = st.pool_ttft.entry(pool).or_default();
            w.push_back(since(&total, &was));
            while w.len() > TTFT_WINDOW_S {
                w.pop_front();
            }
        }
    }

    /// EWMA (α = 0.2 per second) of processed tokens per second.
    fn tick_rates(&self, st: &mut TickState, dt: f64) {
        let mut tokens: HashMap<Arc<str>, u64> = HashMap::new();
        for (w, n) in self.worker_tokens.entries() {
            *tokens.entry(w).or_default() += n.get();
        }
        for (w, total) in tokens {
            let was = st.seen_tokens.insert(w.clone(), total).unwrap_or(0);
            let rate = total.wrapping_sub(was) as f64 / dt;
            let e = self.rates.entry(w).or_default();
            let old = f64::from_bits(e.tps_bits.load(Ordering::Relaxed));
            let alpha = (0.2 * dt).min(1.0);
            e.tps_bits
                .store((old + alpha * (rate - old)).to_bits(), Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn rates_and_windows_follow_ticks_and_forget_the_gone() {
        let t = Throughput::default();
        let t0 = crate::runtime::clock::now();
        t.tick(t0, |_| true, |_| true);
        t.record("w1", "p", 1000, Some(Duration::from_millis(100)));
        t.tick(t0 + Duration::from_secs(1), |_| true, |_| true);
        let r = t.tokens_per_s("w1");
        assert!((r - 200.0).abs() < 1e-6, "α=0.2 of 1000 tok/s: {r}");
        let p90 = t.ttft_p90("p").unwrap();
        assert!((0.075..=0.1).contains(&p90), "{p90}");
        t.tick(t0 + Duration::from_secs(2), |w| w != "w1", |p| p != "p");
        assert_eq!(t.tokens_per_s("w1"), 0.0);
        assert!(t.ttft_p90("p").is_none());
    }
}
