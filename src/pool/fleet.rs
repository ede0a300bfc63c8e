//! The once-a-second fleet view: per worker its state and load, per pool the
//! imbalance, idle workers, saturation and the scaling recommendation. Built by
//! the ticker from the routing snapshot and the telemetry sinks' rates; read by
//! the dashboard, the admin API and the pool gauges.

use super::scaling::{Recommendation, Scaler, ScalingInput};
use super::{PoolRuntime, PoolSet, Registry, Worker};
use crate::config::observability::{ObservabilityConfig, ScalingTargets};
use crate::telemetry::labels::{REGION_LABEL_KEY, UNKNOWN_REGION};
use crate::telemetry::sinks::{self, throughput::Throughput, Sinks};
use crate::telemetry::{local, names};
use arc_swap::ArcSwap;
use metrics::{gauge, SharedString};
use parking_lot::Mutex;
use serde::Serialize;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// A worker in the fleet view.
#[derive(Clone, Debug, Serialize)]
pub struct WorkerView {
    pub id: String,
    pub pool: String,
    pub region: String,
    pub state: &'static str,
    pub in_flight: u64,
    /// Waiting + running as far as the gateway knows (see [`worker_signals`]).
    pub queue: f64,
    pub running: Option<f64>,
    pub kv_usage: Option<f64>,
    pub stats_age_s: Option<f64>,
    pub requests: u64,
    pub tokens_per_s: f64,
    pub idle: bool,
    /// The worker's GPUs by its DCGM exporter, when it has one.
    pub gpu: Option<super::dcgm::Gpu>,
}

/// A pool in the fleet view.
#[derive(Clone, Debug, Serialize)]
pub struct PoolView {
    pub pool: String,
    pub replicas: u32,
    pub workers: usize,
    pub queue: f64,
    pub gateway_queue: usize,
    pub imbalance_ratio: f64,
    pub idle_workers: u32,
    pub saturation_ratio: f64,
    pub kv_usage: Option<f64>,
    pub ttft_p90_ms: Option<f64>,
    pub recommendation: Recommendation,
    pub targets: TargetsView,
}

#[derive(Clone, Debug, Serialize)]
pub struct TargetsView {
    pub queue_per_replica: f64,
    pub kv_usage: f64,
    pub ttft_p90_ms: f64,
    pub min_replicas: u32,
    pub max_replicas: u32,
    pub scale_down_stabilization_s: f64,
    pub tolerance: f64,
}

impl From<&ScalingTargets> for TargetsView {
    fn from(t: &ScalingTargets) -> Self {
        TargetsView {
            queue_per_replica: t.queue_per_replica,
            kv_usage: t.kv_usage,
            ttft_p90_ms: t.ttft_p90.as_secs_f64() * 1e3,
            min_replicas: t.min_replicas,
            max_replicas: t.max_replicas,
            scale_down_stabilization_s: t.scale_down_stabilization.as_secs_f64(),
            tolerance: t.tolerance,
        }
    }
}

/// The fleet as of the last tick.
#[derive(Clone, Debug, Default, Serialize)]
pub struct FleetView {
    pub t: u64,
    pub workers: Vec<WorkerView>,
    pub pools: Vec<PoolView>,
}

/// What the ticker keeps between ticks.
#[derive(Default)]
struct TickState {
    scalers: HashMap<Arc<str>, Scaler>,
    /// Per worker: requests counter at the last change, and when it changed.
    activity: HashMap<Arc<str>, (u64, Instant)>,
}

#[derive(Default)]
pub struct Fleet {
    tick: Mutex<TickState>,
    view: ArcSwap<FleetView>,
}

/// One pool's load gathered from its available workers.
#[derive(Default)]
struct PoolLoad {
    loads: Vec<f64>,
    kv: Vec<f64>,
    waiting_somewhere: bool,
}

impl Fleet {
    pub fn view(&self) -> Arc<FleetView> {
        self.view.load_full()
    }

    /// Rebuild the view from the snapshot and the measured rates.
    pub fn tick(&self, now: Instant, snap: &PoolSet, rates: &Throughput) {
        let mut st = self.tick.lock();
        let cfg = &snap.config.observability;
        let mut view = FleetView {
            t: sinks::unix_ms(),
            ..FleetView::default()
        };
        for pool in &snap.pools {
            let p = pool_view(&mut st, now, cfg, pool, rates, &mut view.workers);
            view.pools.push(p);
        }
        // Forget pools and workers that are gone.
        st.scalers
            .retain(|k, _| snap.pools.iter().any(|p| p.name == *k));
        st.activity
            .retain(|k, _| view.workers.iter().any(|w| *w.id == **k));
        drop(st);
        self.view.store(Arc::new(view));
    }

    /// Set the pool gauges from the last tick (scrape time).
    pub fn refresh_gauges(&self) {
        for p in &self.view().pools {
            let pool = SharedString::from(p.pool.clone());
            gauge!(names::POOL_IMBALANCE_RATIO, names::L_POOL => pool.clone())
                .set(p.imbalance_ratio);
            gauge!(names::POOL_IDLE_WORKERS, names::L_POOL => pool.clone())
                .set(f64::from(p.idle_workers));
            gauge!(names::POOL_SATURATION_RATIO, names::L_POOL => pool.clone())
                .set(p.saturation_ratio);
            gauge!(names::POOL_REPLICAS, names::L_POOL => pool.clone()).set(f64::from(p.replicas));
            gauge!(names::POOL_DESIRED_REPLICAS, names::L_POOL => pool)
                .set(f64::from(p.recommendation.desired_replicas));
        }
    }
}

/// One pool's view; its workers' views are appended to `workers`.
fn pool_view(
    st: &mut TickState,
    now: Instant,
    cfg: &ObservabilityConfig,
    pool: &PoolRuntime,
    rates: &Throughput,
    workers: &mut Vec<WorkerView>,
) -> PoolView {
    let targets = cfg.scaling.for_pool(&pool.name);
    let mut load = PoolLoad::default();
    let mut views = Vec::new();
    for w in &pool.workers {
        views.push(worker_view(st, now, cfg, pool, w, rates, &mut load));
    }
    let gateway_queue = pool.queue.as_ref().map_or(0, |q| q.depth());
    load.waiting_somewhere |= gateway_queue > 0;
    let mut idle_workers = 0;
    for (mut v, idle_candidate) in views {
        v.idle = idle_candidate && load.waiting_somewhere;
        idle_workers += u32::from(v.idle);
        workers.push(v);
    }
    let replicas = load.loads.len() as u32;
    let queue: f64 = load.loads.iter().sum::<f64>() + gateway_queue as f64;
    let kv = &load.kv;
    let kv_usage = (!kv.is_empty()).then(|| kv.iter().sum::<f64>() / kv.len() as f64);
    let ttft_p90 = rates.ttft_p90(&pool.name);
    let input = ScalingInput {
        replicas,
        queue,
        kv_usage,
        ttft_p90: ttft_p90.map(Duration::from_secs_f64),
    };
    let rec = st
        .scalers
        .entry(pool.name.clone())
        .or_default()
        .recommend(now, &input, targets);
    PoolView {
        pool: pool.name.to_string(),
        replicas,
        workers: pool.workers.len(),
        queue,
        gateway_queue,
        imbalance_ratio: imbalance(&load.loads),
        idle_workers,
        saturation_ratio: rec.ratio,
        kv_usage,
        ttft_p90_ms: ttft_p90.map(|s| s * 1e3),
        recommendation: rec,
        targets: targets.into(),
    }
}

/// A worker's view, and whether it is an idle candidate (available, quiet, empty).
fn worker_view(
    st: &mut TickState,
    now: Instant,
    cfg: &ObservabilityConfig,
    pool: &PoolRuntime,
    w: &Worker,
    rates: &Throughput,
    load: &mut PoolLoad,
) -> (WorkerView, bool) {
    let s = worker_signals(w);
    let requests = w.state.requests.load(Ordering::Relaxed);
    let act = st.activity.entry(w.id.clone()).or_insert((requests, now));
    if act.0 != requests {
        *act = (requests, now);
    }
    let quiet = now.saturating_duration_since(act.1) >= cfg.idle_worker_after;
    let available = w.is_available();
    if available {
        load.loads.push(s.queue);
        load.kv.extend(s.kv_usage);
        load.waiting_somewhere |= s.waiting > 0.0;
    }
    let view = WorkerView {
        id: w.id.to_string(),
        pool: pool.name.to_string(),
        region: w
            .labels
            .get(REGION_LABEL_KEY)
            .cloned()
            .unwrap_or_else(|| UNKNOWN_REGION.into()),
        state: w.state_name(),
        in_flight: w.in_flight(),
        queue: s.queue,
        running: s.running,
        kv_usage: s.kv_usage,
        stats_age_s: s.stats_age_s,
        requests,
        tokens_per_s: rates.tokens_per_s(&w.id),
        idle: false,
        gpu: w.state.stats.gpu.get(crate::runtime::clock::now_ms()),
    };
    (view, available && quiet && s.queue == 0.0)
}

/// Start the once-a-second ticker: the dashboard series, the rates, the fleet view.
pub fn spawn_ticker(sinks: Arc<Sinks>, fleet: Arc<Fleet>, registry: Arc<Registry>) {
    tokio::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_secs(1));
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        every.tick().await;
        loop {
            every.tick().await;
            let now = crate::runtime::clock::now();
            let snap = registry.snapshot();
            sinks.series.tick(sinks::unix_ms());
            let live_worker = |id: &str| snap.workers().any(|w| &*w.id == id);
            let live_pool = |p: &str| snap.pools.iter().any(|x| &*x.name == p);
            sinks.throughput.tick(now, live_worker, live_pool);
            fleet.tick(now, &snap, &sinks.throughput);
            // Per-thread counter totals reach the exporter at least once a second
            // (and those of replaced snapshots are dropped), scraped or not.
            local::flush();
        }
    });
}

/// A worker's load signals. Before its first stats scrape, the gateway's own
/// in-flight count stands for waiting + running and KV usage is unknown.
pub struct Signals {
    pub queue: f64,
    pub waiting: f64,
    pub running: Option<f64>,
    pub kv_usage: Option<f64>,
    pub stats_age_s: Option<f64>,
}

pub fn worker_signals(w: &Worker) -> Signals {
    let st = &w.state.stats;
    let now = crate::runtime::clock::now_ms();
    match st.age_ms(now) {
        None => Signals {
            queue: w.in_flight() as f64,
            waiting: 0.0,
            running: None,
            kv_usage: None,
            stats_age_s: None,
        },
        Some(age) => {
            let load = st.load(w.in_flight(), now, u64::MAX);
            Signals {
                queue: load.queue,
                waiting: st.waiting.load(Ordering::Relaxed) as f64,
                running: Some(st.running.load(Ordering::Relaxed) as f64),
                kv_usage: Some(load.kv_usage),
                stats_age_s: Some(age as f64 / 1000.0),
            }
        }
    }
}

/// max / mean of the loads; 1 when all are zero or there are none.
pub fn imbalance(loads: &[f64]) -> f64 {
    if loads.is_empty() {
        return 1.0;
    }
    let mean = loads.iter().sum::<f64>() / loads.len() as f64;
    if mean <= 0.0 {
        return 1.0;
    }
    loads.iter().copied().fold(0.0, f64::max) / mean
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn imbalance_is_max_over_mean() {
        assert_eq!(imbalance(&[]), 1.0);
        assert_eq!(imbalance(&[0.0, 0.0]), 1.0);
        assert_eq!(imbalance(&[2.0, 2.0]), 1.0);
        assert_eq!(imbalance(&[4.0, 0.0, 0.0, 0.0]), 4.0);
    }
}
