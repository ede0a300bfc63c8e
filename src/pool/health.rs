//! Worker health: active probes, passive outlier detection from real traffic,
//! ejection with exponential backoff, half-open re-admission after a good probe,
//! a short cooldown for workers answering 429, and a per-pool panic threshold so a
//! bad health endpoint cannot empty a pool.

use super::{Registry, Worker, WorkerState};
use crate::config::HealthConfig;
use crate::telemetry::names;
use crate::upstream::UpstreamClient;
use metrics::{counter, SharedString};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::Duration;
use tokio::time::Instant;

static EPOCH: LazyLock<Instant> = LazyLock::new(crate::runtime::clock::now);

fn now_ms() -> u64 {
    EPOCH.elapsed().as_millis() as u64
}

/// Health bookkeeping of one worker (part of its shared `WorkerState`).
#[derive(Debug, Default)]
pub struct HealthState {
    /// Consecutive failed requests (reset by any success).
    pub consecutive_failures: AtomicU32,
    probe_failures: AtomicU32,
    probe_successes: AtomicU32,
    /// Ejections without a healthy stretch in between; drives the backoff.
    pub ejections: AtomicU32,
    ejected_until_ms: AtomicU64,
    /// Answered 429 recently: no new requests until the cooldown ends.
    pub overloaded: AtomicBool,
    overload_epoch: AtomicU64,
    probing: AtomicBool,
}

/// Why a worker was ejected; a metric label.
#[derive(Clone, Copy, Debug)]
pub enum EjectReason {
    Requests,
    Probe,
}

impl EjectReason {
    fn as_str(self) -> &'static str {
        match self {
            EjectReason::Requests => "requests",
            EjectReason::Probe => "probe",
        }
    }
}

/// A request to the worker succeeded (any status that is not 5xx/429).
#[inline]
pub fn on_success(state: &WorkerState) {
    if state.health.consecutive_failures.load(Ordering::Relaxed) != 0 {
        state
            .health
            .consecutive_failures
            .store(0, Ordering::Relaxed);
    }
}

/// A request failed because of the worker (connect error, reset, timeout, 5xx).
/// Ejects it after `eject_after_failures` in a row, within the pool's panic threshold.
pub fn on_failure(worker: &Worker, pool: &[Arc<Worker>], cfg: &HealthConfig) {
    let n = worker
        .state
        .health
        .consecutive_failures
        .fetch_add(1, Ordering::Relaxed)
        + 1;
    if n >= cfg.eject_after_failures {
        eject(worker, pool, cfg, EjectReason::Requests);
    }
}

/// The worker answered 429: give it `overload_cooldown` without new requests,
/// unless that would leave more than the allowed share of `pool` ejected or cooling
/// down (the same panic threshold as ejection). Without that bound one request
/// whose 429 is its own (a per-key limit upstream, an injected fault) is retried on
/// every worker and takes the whole pool out for the cooldown: every other request
/// then gets a 503 from the gateway instead of being served. Returns whether the
/// cooldown was applied.
pub fn on_overloaded(worker: &Worker, pool: &[Arc<Worker>], cfg: &HealthConfig) -> bool {
    let h = &worker.state.health;
    counter!(names::WORKER_OVERLOADED_TOTAL, names::L_WORKER => SharedString::from(worker.id.clone()))
        .increment(1);
    if !h.overloaded.load(Ordering::Relaxed) {
        let out = pool
            .iter()
            .filter(|w| w.id != worker.id)
            .filter(|w| {
                !w.state.healthy.load(Ordering::Relaxed)
                    || w.state.health.overloaded.load(Ordering::Relaxed)
            })
            .count();
        if !pool.is_empty() && (out + 1) as f64 > cfg.max_ejected_fraction * pool.len() as f64 {
            tracing::debug!(worker = %worker.id, out, pool = pool.len(), "429 cooldown refused: panic threshold");
            return false;
        }
    }
    let epoch = h.overload_epoch.fetch_add(1, Ordering::Relaxed) + 1;
    h.overloaded.store(true, Ordering::Relaxed);
    let state = worker.state.clone();
    let cooldown = cfg.overload_cooldown;
    tokio::spawn(async move {
        tokio::time::sleep(cooldown).await;
        // A later 429 extended the cooldown: leave it to that one.
        if state.health.overload_epoch.load(Ordering::Relaxed) == epoch {
            state.health.overloaded.store(false, Ordering::Relaxed);
        }
    });
    true
}

/// Eject `worker` unless that would leave more than the allowed share of `pool` out.
pub fn eject(worker: &Worker, pool: &[Arc<Worker>], cfg: &HealthConfig, why: EjectReason) -> bool {
    let label = SharedString::from(worker.id.clone());
    if !worker.state.healthy.load(Ordering::Relaxed) {
        return false;
    }
    let ejected = pool
        .iter()
        .filter(|w| !w.state.healthy.load(Ordering::Relaxed))
        .count();
    if !pool.is_empty() && (ejected + 1) as f64 > cfg.max_ejected_fraction * pool.len() as f64 {
        counter!(names::EJECTIONS_REFUSED_TOTAL, names::L_WORKER => label).increment(1);
        tracing::warn!(worker = %worker.id, ejected, pool = pool.len(), "ejection refused: panic threshold");
        return false;
    }
    let h = &worker.state.health;
    let k = h.ejections.fetch_add(1, Ordering::Relaxed).min(16);
    let backoff = cfg
        .base_ejection
        .saturating_mul(1u32 << k)
        .min(cfg.max_ejection);
    h.ejected_until_ms
        .store(now_ms() + backoff.as_millis() as u64, Ordering::Relaxed);
    h.probe_successes.store(0, Ordering::Relaxed);
    worker.state.healthy.store(false, Ordering::Relaxed);
    counter!(names::EJECTIONS_TOTAL, names::L_WORKER => label, names::L_REASON => why.as_str())
        .increment(1);
    tracing::warn!(worker = %worker.id, reason = why.as_str(), ?backoff, "worker ejected");
    true
}

fn readmit(worker: &Worker) {
    let h = &worker.state.health;
    h.consecutive_failures.store(0, Ordering::Relaxed);
    h.probe_failures.store(0, Ordering::Relaxed);
    worker.state.healthy.store(true, Ordering::Relaxed);
    tracing::info!(worker = %worker.id, "worker re-admitted");
}

/// Start the health loop: ejected workers are probed once their backoff ends
/// (half-open); healthy ones every `interval` when active checks are on.
pub fn spawn_health_checks(registry: Arc<Registry>, client: UpstreamClient) {
    tokio::spawn(async move {
        let tick = Duration::from_millis(100);
        let mut next_active = crate::runtime::clock::now();
        loop {
            tokio::time::sleep(tick).await;
            let snap = registry.snapshot();
            let cfg = &snap.config.health;
            let active_due = cfg.interval.is_some() && crate::runtime::clock::now() >= next_active;
            if let (true, Some(every)) = (active_due, cfg.interval) {
                // ±10 % jitter so many gateways do not probe in lockstep.
                next_active =
                    crate::runtime::clock::now() + every.mul_f64(0.9 + rand::random::<f64>() * 0.2);
            }
            for pool in &snap.pools {
                for w in &pool.workers {
                    let h = &w.state.health;
                    let ejected = !w.state.healthy.load(Ordering::Relaxed);
                    let due = if ejected {
                        now_ms() >= h.ejected_until_ms.load(Ordering::Relaxed)
                    } else {
                        active_due
                    };
                    if !due || h.probing.swap(true, Ordering::AcqRel) {
                        continue;
                    }
                    let (w, pool_workers, client) =
                        (w.clone(), pool.workers.clone(), client.clone());
                    let cfg = cfg.clone();
                    tokio::spawn(async move {
                        let ok = probe(&client, &w, &cfg).await;
                        after_probe(&w, &pool_workers, &cfg, ok);
                        w.state.health.probing.store(false, Ordering::Release);
                    });
                }
            }
        }
    });
}

fn after_probe(w: &Worker, pool: &[Arc<Worker>], cfg: &HealthConfig, ok: bool) {
    let h = &w.state.health;
    let ejected = !w.state.healthy.load(Ordering::Relaxed);
    match (ejected, ok) {
        (true, true) => {
            if h.probe_successes.fetch_add(1, Ordering::Relaxed) + 1 >= cfg.healthy_threshold {
                readmit(w);
            }
        }
        (true, false) => {
            // Half-open probe failed: back off further.
            w.state.healthy.store(true, Ordering::Relaxed);
            if !eject(w, pool, cfg, EjectReason::Probe) {
                w.state.healthy.store(false, Ordering::Relaxed);
                h.ejected_until_ms.store(
                    now_ms() + cfg.base_ejection.as_millis() as u64,
                    Ordering::Relaxed,
                );
            }
        }
        (false, true) => {
            h.probe_failures.store(0, Ordering::Relaxed);
            // A healthy stretch shortens the next ejection again.
            let _ = h
                .ejections
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |e| e.checked_sub(1));
        }
        (false, false) => {
            if h.probe_failures.fetch_add(1, Ordering::Relaxed) + 1 >= cfg.unhealthy_threshold {
                eject(w, pool, cfg, EjectReason::Probe);
            }
        }
    }
}

async fn probe(client: &UpstreamClient, w: &Worker, cfg: &HealthConfig) -> bool {
    let uri = format!("{}{}", w.id, cfg.path);
    let Ok(req) = http::Request::get(uri).body(Default::default()) else {
        return false;
    };
    matches!(
        tokio::time::timeout(cfg.timeout, client.request(req)).await,
        Ok(Ok(resp)) if resp.status().is_success()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config;

    fn cfg() -> HealthConfig {
        config::parse("[[pools]]\nmodels=[\"m\"]\nworkers=[{url=\"http://h:1\"}]")
            .unwrap()
            .validate()
            .unwrap()
            .health
    }

    fn pool(n: usize) -> Vec<Arc<Worker>> {
        (0..n)
            .map(|i| {
                Arc::new(
                    Worker::new(
                        &format!("http://w{i}:1"),
                        Default::default(),
                        Default::default(),
                    )
                    .unwrap(),
                )
            })
            .collect()
    }

    #[test]
    fn consecutive_failures_eject_and_success_resets() {
        let c = cfg();
        let p = pool(4);
        on_failure(&p[0], &p, &c);
        on_success(&p[0].state);
        for _ in 0..c.eject_after_failures - 1 {
            on_failure(&p[0], &p, &c);
        }
        assert!(p[0].is_available(), "a success in between resets the count");
        on_failure(&p[0], &p, &c);
        assert!(!p[0].is_available());
    }

    #[test]
    fn panic_threshold_keeps_half_the_pool() {
        let c = cfg(); // 50 %
        let p = pool(4);
        assert!(eject(&p[0], &p, &c, EjectReason::Probe));
        assert!(eject(&p[1], &p, &c, EjectReason::Probe));
        assert!(!eject(&p[2], &p, &c, EjectReason::Probe));
        assert!(p[2].is_available() && p[3].is_available());
    }

    #[test]
    fn backoff_doubles_per_ejection() {
        let c = cfg();
        let p = pool(1);
        let one = [p[0].clone()];
        let mut c2 = c.clone();
        c2.max_ejected_fraction = 1.0;
        let t0 = now_ms();
        eject(&one[0], &one, &c2, EjectReason::Probe);
        let first = p[0].state.health.ejected_until_ms.load(Ordering::Relaxed) - t0;
        p[0].state.healthy.store(true, Ordering::Relaxed);
        eject(&one[0], &one, &c2, EjectReason::Probe);
        let second = p[0].state.health.ejected_until_ms.load(Ordering::Relaxed) - t0;
        assert!(second >= 2 * first - 5, "{first} then {second}");
    }
}
