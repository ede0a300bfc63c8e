//! Per-second aggregates for the dashboard: requests, errors, output tokens, cost
//! and TTFT/ITL quantiles. The request path adds to its own thread's running
//! totals; the ticker sums the threads once a second and keeps a bounded ring.

use super::super::local::LocalCount;
use super::super::LATENCY_BUCKETS;
use parking_lot::Mutex;
use serde::Serialize;
use std::collections::VecDeque;
use std::time::Duration;
use thread_local::ThreadLocal;

pub(crate) const NB: usize = LATENCY_BUCKETS.len() + 1;

/// One thread's running bucket counts over [`LATENCY_BUCKETS`] (plus overflow).
#[derive(Default)]
pub struct LocalHist([LocalCount; NB]);

impl LocalHist {
    pub fn record(&self, d: Duration) {
        let v = d.as_secs_f64();
        let i = LATENCY_BUCKETS.partition_point(|&b| b < v);
        self.0[i].add(1);
    }

    pub(crate) fn add_to(&self, out: &mut [u64; NB]) {
        for (o, c) in out.iter_mut().zip(&self.0) {
            *o += c.get();
        }
    }
}

/// `now - before`, bucket by bucket: what was recorded in between.
pub(crate) fn since(now: &[u64; NB], before: &[u64; NB]) -> [u64; NB] {
    std::array::from_fn(|i| now[i].wrapping_sub(before[i]))
}

/// The `q` quantile (0–1) of bucket counts, interpolated within the bucket.
pub fn quantile(counts: &[u64; NB], q: f64) -> Option<f64> {
    let total: u64 = counts.iter().sum();
    if total == 0 {
        return None;
    }
    let rank = (q * total as f64).max(1.0);
    let mut cum = 0u64;
    for (i, &c) in counts.iter().enumerate() {
        if c > 0 && (cum + c) as f64 >= rank {
            let lo = if i == 0 { 0.0 } else { LATENCY_BUCKETS[i - 1] };
            let hi = LATENCY_BUCKETS.get(i).copied().unwrap_or(lo * 2.0);
            let frac = (rank - cum as f64) / c as f64;
            return Some(lo + (hi - lo) * frac);
        }
        cum += c;
    }
    LATENCY_BUCKETS.last().copied()
}

/// One serving thread's running totals.
#[derive(Default)]
struct Second {
    requests: LocalCount,
    errors: LocalCount,
    output_tokens: LocalCount,
    nano_usd: LocalCount,
    ttft: LocalHist,
    itl: LocalHist,
}

/// [`Second`] summed over threads.
#[derive(Clone, Copy, Default)]
struct SecondTotals {
    requests: u64,
    errors: u64,
    output_tokens: u64,
    nano_usd: u64,
    ttft: [u64; NB],
    itl: [u64; NB],
}

/// One second of history, for the dashboard.
#[derive(Clone, Debug, Serialize)]
pub struct SecondAgg {
    /// Unix time (ms) at the end of the second.
    pub t: u64,
    pub requests: u64,
    pub errors: u64,
    pub output_tokens: u64,
    pub cost_usd: f64,
    pub ttft_p50_ms: Option<f64>,
    pub ttft_p90_ms: Option<f64>,
    pub ttft_p99_ms: Option<f64>,
    pub itl_p50_ms: Option<f64>,
    pub itl_p90_ms: Option<f64>,
    pub itl_p99_ms: Option<f64>,
}

#[derive(Default)]
struct Ring {
    seconds: VecDeque<SecondAgg>,
    /// Totals as of the last tick, to take one second's worth from.
    seen: SecondTotals,
}

/// The dashboard's time series.
pub struct Series {
    window_s: usize,
    second: ThreadLocal<Second>,
    ring: Mutex<Ring>,
}

/// What one finished request adds to the current second.
pub struct SecondSample {
    pub error: bool,
    pub output_tokens: u64,
    pub nano_usd: u64,
    pub ttft: Option<Duration>,
}

impl Series {
    pub fn new(window_s: usize) -> Series {
        Series {
            window_s,
            second: ThreadLocal::new(),
            ring: Mutex::new(Ring::default()),
        }
    }

    pub fn record(&self, s: SecondSample) {
        let second = self.second.get_or_default();
        second.requests.add(1);
        if s.error {
            second.errors.add(1);
        }
        second.output_tokens.add(s.output_tokens);
        if s.nano_usd > 0 {
            second.nano_usd.add(s.nano_usd);
        }
        if let Some(t) = s.ttft {
            second.ttft.record(t);
        }
    }

    /// One inter-token gap.
    pub fn record_itl(&self, gap: Duration) {
        self.second.get_or_default().itl.record(gap);
    }

    /// The last seconds, oldest first.
    pub fn seconds(&self) -> Vec<SecondAgg> {
        let ring = self.ring.lock();
        ring.seconds.iter().cloned().collect()
    }

    /// Close the current second (the ticker calls this once a second).
    pub fn tick(&self, unix_ms: u64) {
        let mut now_t = SecondTotals::default();
        for s in self.second.iter() {
            now_t.requests += s.requests.get();
            now_t.errors += s.errors.get();
            now_t.output_tokens += s.output_tokens.get();
            now_t.nano_usd += s.nano_usd.get();
            s.ttft.add_to(&mut now_t.ttft);
            s.itl.add_to(&mut now_t.itl);
        }
        let mut ring = self.ring.lock();
        let was = std::mem::replace(&mut ring.seen, now_t);
        let ttft = since(&now_t.ttft, &was.ttft);
        let itl = since(&now_t.itl, &was.itl);
        let q = |c: &[u64; NB], p: f64| quantile(c, p).map(|s| s * 1e3);
        ring.seconds.push_back(SecondAgg {
            t: unix_ms,
            requests: now_t.requests.wrapping_sub(was.requests),
            errors: now_t.errors.wrapping_sub(was.errors),
            output_tokens: now_t.output_tokens.wrapping_sub(was.output_tokens),
            cost_usd: now_t.nano_usd.wrapping_sub(was.nano_usd) as f64 / 1e9,
            ttft_p50_ms: q(&ttft, 0.5),
            ttft_p90_ms: q(&ttft, 0.9),
            ttft_p99_ms: q(&ttft, 0.99),
            itl_p50_ms: q(&itl, 0.5),
            itl_p90_ms: q(&itl, 0.9),
            itl_p99_ms: q(&itl, 0.99),
        });
        while ring.seconds.len() > self.window_s {
            ring.seconds.pop_front();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_interpolate_within_buckets() {
        let mut c = [0u64; NB];
        // 10 samples in (0.01, 0.015], 10 in (0.1, 0.15].
        let i1 = LATENCY_BUCKETS.iter().position(|&b| b == 0.015).unwrap();
        let i2 = LATENCY_BUCKETS.iter().position(|&b| b == 0.15).unwrap();
        c[i1] = 10;
        c[i2] = 10;
        let p50 = quantile(&c, 0.5).unwrap();
        assert!((0.01..=0.015).contains(&p50), "{p50}");
        let p90 = quantile(&c, 0.9).unwrap();
        assert!((0.1..=0.15).contains(&p90), "{p90}");
        assert!(quantile(&[0; NB], 0.5).is_none());
        let h = LocalHist::default();
        h.record(Duration::from_millis(12));
        h.record(Duration::from_secs(500));
        let mut t = [0; NB];
        h.add_to(&mut t);
        assert_eq!(t[i1], 1);
        assert_eq!(t[NB - 1], 1);
        // A tick takes what was recorded since the last one.
        h.record(Duration::from_millis(12));
        let mut t2 = [0; NB];
        h.add_to(&mut t2);
        let d = since(&t2, &t);
        assert_eq!(d[i1], 1);
        assert_eq!(d.iter().sum::<u64>(), 1);
    }

    #[test]
    fn a_tick_closes_one_second_and_the_ring_is_bounded() {
        let s = Series::new(2);
        for (i, err) in [false, true, false].into_iter().enumerate() {
            s.record(SecondSample {
                error: err,
                output_tokens: 10,
                nano_usd: 0,
                ttft: Some(Duration::from_millis(12)),
            });
            s.tick(i as u64);
        }
        let v = s.seconds();
        assert_eq!(v.len(), 2, "bounded by the window");
        assert_eq!((v[0].t, v[0].requests, v[0].errors), (1, 1, 1));
        assert_eq!((v[1].requests, v[1].errors, v[1].output_tokens), (1, 0, 10));
        assert!(v[1].ttft_p50_ms.is_some());
    }
}
