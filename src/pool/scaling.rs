//! The replica recommendation for a pool: a pure function of the pool's signals
//! and targets, plus the scale-down stabilisation window (the only state).
//!
//! ```text
//! ratio_queue = (queue / replicas) / target_queue_per_replica
//! ratio_kv    = mean_kv_usage / target_kv_usage            (when the workers report it)
//! ratio_ttft  = ttft_p90 / target_ttft_p90                  (when requests finished)
//! ratio       = max(ratio_queue, ratio_kv, ratio_ttft)
//! raw         = replicas                       if |ratio − 1| ≤ tolerance
//!             = ceil(replicas × ratio)         otherwise
//! raw         = clamp(raw, min_replicas, max_replicas)
//! desired     = max(raw over the last scale_down_stabilization)
//! ```
//! With no replicas, `raw` is `max(min_replicas, 1)` when requests wait, else
//! `min_replicas`. Scale-up takes effect at once; scale-down only once every
//! recommendation in the window agrees (as the Kubernetes HPA does).

use crate::config::observability::ScalingTargets;
use serde::Serialize;
use std::collections::VecDeque;
use std::time::Duration;
use tokio::time::Instant;

/// What the pool looks like now.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ScalingInput {
    /// Workers able to take requests.
    pub replicas: u32,
    /// Requests waiting or running on the pool's workers (plus the gateway's own queue).
    pub queue: f64,
    /// Mean KV-cache usage (0–1) of the workers, when they report it.
    pub kv_usage: Option<f64>,
    /// p90 time to first token over the recent window, when requests finished.
    pub ttft_p90: Option<Duration>,
}

/// The recommendation and how it was reached.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Recommendation {
    pub desired_replicas: u32,
    /// Before stabilisation.
    pub raw_replicas: u32,
    pub ratio: f64,
    /// The signal with the largest ratio: `queue`, `kv_usage`, `ttft` or `none`.
    pub signal: &'static str,
    pub queue_ratio: f64,
    pub kv_ratio: Option<f64>,
    pub ttft_ratio: Option<f64>,
}

/// Per-pool state: recent raw recommendations, for scale-down stabilisation.
#[derive(Debug, Default)]
pub struct Scaler {
    history: VecDeque<(Instant, u32)>,
}

impl Scaler {
    pub fn recommend(
        &mut self,
        now: Instant,
        input: &ScalingInput,
        t: &ScalingTargets,
    ) -> Recommendation {
        let replicas = input.replicas;
        let per = f64::from(replicas.max(1));
        let queue_ratio = (input.queue.max(0.0) / per) / t.queue_per_replica;
        let kv_ratio = input.kv_usage.map(|k| k.max(0.0) / t.kv_usage);
        let ttft_ratio = input
            .ttft_p90
            .map(|d| d.as_secs_f64() / t.ttft_p90.as_secs_f64());
        let mut ratio = queue_ratio;
        let mut signal = if queue_ratio > 0.0 { "queue" } else { "none" };
        if let Some(k) = kv_ratio.filter(|&k| k > ratio) {
            ratio = k;
            signal = "kv_usage";
        }
        if let Some(r) = ttft_ratio.filter(|&r| r > ratio) {
            ratio = r;
            signal = "ttft";
        }
        let raw = if replicas == 0 {
            if input.queue > 0.0 {
                t.min_replicas.max(1)
            } else {
                t.min_replicas
            }
        } else if (ratio - 1.0).abs() <= t.tolerance {
            replicas
        } else {
            let want = (f64::from(replicas) * ratio).ceil();
            if want >= f64::from(u32::MAX) {
                u32::MAX
            } else {
                want as u32
            }
        };
        let raw = raw.clamp(t.min_replicas, t.max_replicas);
        self.history.push_back((now, raw));
        while let Some(&(at, _)) = self.history.front() {
            if now.saturating_duration_since(at) > t.scale_down_stabilization {
                self.history.pop_front();
            } else {
                break;
            }
        }
        let desired = self.history.iter().map(|&(_, r)| r).max().unwrap_or(raw);
        Recommendation {
            desired_replicas: desired,
            raw_replicas: raw,
            ratio,
            signal,
            queue_ratio,
            kv_ratio,
            ttft_ratio,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn targets() -> ScalingTargets {
        ScalingTargets {
            queue_per_replica: 4.0,
            kv_usage: 0.8,
            ttft_p90: Duration::from_millis(1_000),
            min_replicas: 1,
            max_replicas: 10,
            scale_down_stabilization: Duration::from_secs(60),
            tolerance: 0.1,
        }
    }

    fn input(replicas: u32, queue: f64, kv: f64, ttft_ms: Option<u64>) -> ScalingInput {
        ScalingInput {
            replicas,
            queue,
            kv_usage: Some(kv),
            ttft_p90: ttft_ms.map(Duration::from_millis),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn ramp_up_scales_out_at_once() {
        let t = targets();
        let mut s = Scaler::default();
        // Ramp: queue grows 4 → 8 → 16 → 40 on 2 replicas.
        let mut seen = Vec::new();
        for q in [8.0, 16.0, 32.0, 80.0] {
            let r = s.recommend(
                crate::runtime::clock::now(),
                &input(2, q, 0.3, Some(500)),
                &t,
            );
            seen.push(r.desired_replicas);
            tokio::time::advance(Duration::from_secs(10)).await;
        }
        // 8/2/4 = 1 → stay; 16 → 4; 32 → 8; 80 → 20, capped at 10.
        assert_eq!(seen, vec![2, 4, 8, 10]);
    }

    #[tokio::test(start_paused = true)]
    async fn kv_and_ttft_can_drive_the_recommendation() {
        let t = targets();
        let mut s = Scaler::default();
        let r = s.recommend(
            crate::runtime::clock::now(),
            &input(4, 4.0, 0.96, Some(200)),
            &t,
        );
        assert_eq!((r.signal, r.desired_replicas), ("kv_usage", 5)); // 4 × 1.2 = 4.8 → 5
        let mut s = Scaler::default();
        let r = s.recommend(
            crate::runtime::clock::now(),
            &input(4, 4.0, 0.2, Some(3_000)),
            &t,
        );
        assert_eq!((r.signal, r.desired_replicas), ("ttft", 10)); // 4 × 3 = 12 → cap 10
    }

    #[tokio::test(start_paused = true)]
    async fn steady_load_within_tolerance_keeps_the_count() {
        let t = targets();
        let mut s = Scaler::default();
        for q in [16.0, 17.0, 15.0, 16.5, 14.5] {
            let r = s.recommend(
                crate::runtime::clock::now(),
                &input(4, q, 0.5, Some(600)),
                &t,
            );
            assert_eq!(r.desired_replicas, 4, "queue {q}: {r:?}");
            tokio::time::advance(Duration::from_secs(5)).await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn idle_scales_down_only_after_the_stabilisation_window() {
        let t = targets();
        let mut s = Scaler::default();
        let busy = s.recommend(
            crate::runtime::clock::now(),
            &input(6, 24.0, 0.5, Some(800)),
            &t,
        );
        assert_eq!(busy.desired_replicas, 6);
        // Idle from now on: no queue, empty KV, no finished requests.
        let mut t_at_drop = None;
        for sec in 1..=90u64 {
            tokio::time::advance(Duration::from_secs(1)).await;
            let r = s.recommend(crate::runtime::clock::now(), &input(6, 0.0, 0.0, None), &t);
            assert_eq!(r.raw_replicas, 1);
            if r.desired_replicas == 1 && t_at_drop.is_none() {
                t_at_drop = Some(sec);
            }
            if t_at_drop.is_none() {
                assert_eq!(r.desired_replicas, 6, "held during the window at {sec}s");
            }
        }
        // The busy recommendation ages out just after the 60 s window.
        assert_eq!(t_at_drop, Some(61));
    }

    #[tokio::test(start_paused = true)]
    async fn an_empty_pool_with_waiting_requests_asks_for_one() {
        let mut t = targets();
        t.min_replicas = 0;
        let mut s = Scaler::default();
        let r = s.recommend(
            crate::runtime::clock::now(),
            &ScalingInput {
                replicas: 0,
                queue: 3.0,
                ..Default::default()
            },
            &t,
        );
        assert_eq!(r.desired_replicas, 1);
        let mut s = Scaler::default();
        let r = s.recommend(crate::runtime::clock::now(), &ScalingInput::default(), &t);
        assert_eq!(r.desired_replicas, 0);
    }
}
