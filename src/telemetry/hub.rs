//! The observability hub: everything one finished request feeds besides the
//! Prometheus families — cost totals, cache-prediction accuracy, per-worker
//! throughput, the per-second aggregates behind the dashboard — and the once-a-second
//! fleet view (imbalance, idle workers, saturation, scaling recommendation).
//!
//! The request path adds to its own thread's running totals (`telemetry::local`),
//! and touches shared atomics and sharded maps only for costs and cache accuracy;
//! the ring buffer and the scalers are owned by the ticker (`Hub::tick`, once a
//! second), which sums the threads' totals.

use super::access_log::{self, AccessLog, AccessRecord};
use super::labels::BoundedLabels;
use super::local::{escape, LocalCount, LocalMap};
use super::scaling::{Recommendation, Scaler, ScalingInput};
use super::trace::{TraceContext, Tracer};
use super::{
    cost, names, status_label, Borrowed, FastMap, Outcome, RequestMetrics, LATENCY_BUCKETS,
};
use crate::config::observability::ScalingTargets;
use crate::config::Config;
use crate::pool::{Registry, Snapshot, Worker};
use crate::tenancy::Tenant;
use arc_swap::ArcSwap;
use http::HeaderValue;
use metrics::{counter, gauge, SharedString};
use serde::Serialize;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use thread_local::ThreadLocal;
use tokio::time::Instant;

/// Label value for "not applicable" (no worker, no pool).
pub const NONE_LABEL: &str = "none";
/// Region of a worker without a `region` label.
pub const UNKNOWN_REGION: &str = "unknown";
/// Worker label naming the region.
pub const REGION_LABEL_KEY: &str = crate::config::global::REGION_LABEL;
/// Worker label naming the price tier.
pub const TIER_LABEL_KEY: &str = "tier";
/// Seconds of per-pool TTFT kept for the scaling signal.
const TTFT_WINDOW_S: usize = 60;

const NB: usize = LATENCY_BUCKETS.len() + 1;

/// One thread's running bucket counts over [`LATENCY_BUCKETS`] (plus overflow).
#[derive(Default)]
pub struct LocalHist([LocalCount; NB]);

impl LocalHist {
    pub fn record(&self, d: Duration) {
        let v = d.as_secs_f64();
        let i = LATENCY_BUCKETS.partition_point(|&b| b < v);
        self.0[i].add(1);
    }

    fn add_to(&self, out: &mut [u64; NB]) {
        for (o, c) in out.iter_mut().zip(&self.0) {
            *o += c.get();
        }
    }
}

/// `now - before`, bucket by bucket: what was recorded in between.
fn since(now: &[u64; NB], before: &[u64; NB]) -> [u64; NB] {
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

/// Everything known about one request at admission, shared (behind an `Arc`) by
/// the forwarding phases and the response observer. Attempts and time spent
/// waiting are atomics; the route a response took is in its [`RouteTags`].
pub struct RequestTags {
    pub hub: Arc<Hub>,
    pub config: Arc<Config>,
    pub request_id: HeaderValue,
    /// Who is calling (residency and tenant labels use it).
    pub tenant: Tenant,
    pub tenant_label: SharedString,
    pub request_bytes: u64,
    pub stream: bool,
    pub trace: TraceContext,
    /// The pool the model name resolved to.
    pub pool: Option<SharedString>,
    attempts: AtomicU32,
    /// Time spent waiting on workers, the pool queue and retry backoff (ns).
    waited_ns: AtomicU64,
}

/// The route one response took: the worker that answers it, for its metric
/// labels, its price and the cache-prediction check.
pub struct RouteTags {
    pub pool: SharedString,
    pub worker: Arc<str>,
    /// The worker's `tier` label, for the price table.
    pub tier: Option<Box<str>>,
    pub region: SharedString,
    pub policy: &'static str,
    pub reason: &'static str,
    /// Prompt tokens the router expects the chosen worker to have cached.
    pub predicted_cached_tokens: Option<u64>,
    /// The prediction came from the engines' KV events (precise index).
    pub precise: bool,
}

impl RequestTags {
    /// The route a response took, for its observer.
    pub fn route(
        &self,
        pool: &SharedString,
        worker: &Worker,
        policy: &'static str,
        reason: &'static str,
        predicted_cached_tokens: Option<u64>,
        precise: bool,
    ) -> RouteTags {
        let region = worker
            .labels
            .get(REGION_LABEL_KEY)
            .map_or(UNKNOWN_REGION, String::as_str);
        RouteTags {
            pool: pool.clone(),
            worker: worker.id.clone(),
            tier: worker.labels.get(TIER_LABEL_KEY).map(|s| s.as_str().into()),
            region: self.hub.regions.get(region),
            policy,
            reason,
            predicted_cached_tokens,
            precise,
        }
    }

    /// Count an upstream attempt; returns its number (1-based).
    pub fn add_attempt(&self) -> u32 {
        self.attempts.fetch_add(1, Ordering::Relaxed) + 1
    }

    pub fn attempts(&self) -> u32 {
        self.attempts.load(Ordering::Relaxed)
    }

    /// Add time spent waiting outside the gateway's own work.
    pub fn add_waited(&self, d: Duration) {
        self.waited_ns
            .fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
    }

    pub fn waited(&self) -> Duration {
        Duration::from_nanos(self.waited_ns.load(Ordering::Relaxed))
    }
}

/// One proxied response, as the observer saw it.
pub struct Finished<'a> {
    /// The route's handles for the (model, worker) pair that answered.
    pub pair: &'a crate::telemetry::PairMetrics,
    pub endpoint: &'static str,
    pub status: u16,
    pub outcome: Outcome,
    pub m: &'a RequestMetrics,
}

/// Per-pool cache-prediction accumulators.
#[derive(Default)]
struct CacheAcc {
    predicted: AtomicU64,
    actual: AtomicU64,
}

/// Per-worker throughput, measured by the ticker.
#[derive(Default)]
pub struct WorkerAcc {
    /// Measured throughput, tokens/s (f64 bits), an EWMA over ticks.
    tps_bits: AtomicU64,
}

impl WorkerAcc {
    pub fn tokens_per_s(&self) -> f64 {
        f64::from_bits(self.tps_bits.load(Ordering::Relaxed))
    }
}

/// One serving thread's running totals behind the per-second aggregates. The
/// request path adds to its own thread's; the ticker sums all threads and takes
/// the difference from the last tick ([`SecondTotals`]).
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
    ring: VecDeque<SecondAgg>,
    /// Per pool: TTFT bucket counts of the last [`TTFT_WINDOW_S`] seconds.
    pool_ttft: HashMap<Arc<str>, VecDeque<[u64; NB]>>,
    /// Running totals as of the last tick, to take one second's worth from.
    seen_second: SecondTotals,
    seen_pool_ttft: HashMap<Arc<str>, [u64; NB]>,
    seen_tokens: HashMap<Arc<str>, u64>,
    scalers: HashMap<Arc<str>, Scaler>,
    /// Per worker: requests counter at the last change, and when it changed.
    activity: HashMap<Arc<str>, (u64, Instant)>,
    last_tick: Option<Instant>,
}

/// Kinds of the cache-prediction counters, `mode:kind`: predicted or actual
/// cached tokens, or a prediction's result, per prediction mode (`precise`: the
/// engines' KV events; `approximate`: the gateway's own prefix index).
const CACHE_KINDS: [[&str; 6]; 2] = [
    [
        "approximate:predicted",
        "approximate:actual",
        "approximate:hit",
        "approximate:false_hit",
        "approximate:missed_hit",
        "approximate:miss",
    ],
    [
        "precise:predicted",
        "precise:actual",
        "precise:hit",
        "precise:false_hit",
        "precise:missed_hit",
        "precise:miss",
    ],
];

/// The counter behind a (pool, `mode:kind`) cache-prediction key.
fn cache_counter((pool, kind): &super::PoolKindKey) -> metrics::Counter {
    let (mode, kind) = kind.split_once(':').unwrap_or(("approximate", kind));
    match kind {
        "predicted" => {
            counter!(names::CACHE_PREDICTED_TOKENS_TOTAL, names::L_POOL => pool.clone(), names::L_MODE => mode)
        }
        "actual" => {
            counter!(names::CACHE_ACTUAL_TOKENS_TOTAL, names::L_POOL => pool.clone(), names::L_MODE => mode)
        }
        result => counter!(
            names::CACHE_PREDICTIONS_TOTAL,
            names::L_POOL => pool.clone(),
            names::L_MODE => mode,
            names::L_RESULT => result
        ),
    }
}

pub struct Hub {
    pub tenants: BoundedLabels,
    pub regions: BoundedLabels,
    access_log: Option<AccessLog>,
    pub tracer: Option<Tracer>,
    window_s: usize,
    second: ThreadLocal<Second>,
    /// Cost so far (nano-USD) by (model, region, tenant).
    costs: FastMap<(SharedString, SharedString, SharedString), AtomicU64>,
    cache: FastMap<SharedString, CacheAcc>,
    /// The cache-prediction counters per (pool, kind), through per-thread handles.
    cache_counts: super::CounterCache<super::PoolKindKey>,
    workers: FastMap<Arc<str>, Arc<WorkerAcc>>,
    /// Processed tokens (uncached prompt + output) per worker, per thread.
    worker_tokens: LocalMap<LocalCount>,
    /// TTFT per pool, per thread.
    pool_ttft: LocalMap<LocalHist>,
    tick: Mutex<TickState>,
    fleet: ArcSwap<FleetView>,
}

impl Hub {
    /// Build from the config; starts the access-log writer and the span exporter
    /// when configured (needs a tokio runtime).
    pub fn new(config: &Config) -> Arc<Hub> {
        let o = &config.observability;
        Arc::new(Hub {
            tenants: BoundedLabels::new(names::L_TENANT, o.max_tenant_labels),
            regions: BoundedLabels::new(names::L_REGION, o.max_region_labels),
            access_log: o.access_log.as_ref().map(AccessLog::start),
            tracer: o.tracing.as_ref().map(Tracer::start),
            window_s: o.dashboard_window_s,
            second: ThreadLocal::new(),
            costs: FastMap::default(),
            cache: FastMap::default(),
            cache_counts: Default::default(),
            workers: FastMap::default(),
            worker_tokens: LocalMap::default(),
            pool_ttft: LocalMap::default(),
            tick: Mutex::new(TickState::default()),
            fleet: ArcSwap::from_pointee(FleetView::default()),
        })
    }

    /// Tags for a new request.
    pub fn tags(
        self: &Arc<Self>,
        config: Arc<Config>,
        request_id: HeaderValue,
        tenant: Tenant,
        trace: TraceContext,
    ) -> RequestTags {
        let tenant_label = self.tenants.get(&tenant.name);
        RequestTags {
            hub: self.clone(),
            config,
            request_id,
            tenant,
            tenant_label,
            request_bytes: 0,
            stream: false,
            trace,
            pool: None,
            attempts: AtomicU32::new(0),
            waited_ns: AtomicU64::new(0),
        }
    }

    fn worker_acc(&self, id: &Arc<str>) -> Arc<WorkerAcc> {
        if let Some(a) = self.workers.get(id) {
            return a.clone();
        }
        self.workers.entry(id.clone()).or_default().clone()
    }

    /// Record one inter-token gap in the dashboard aggregates.
    pub fn record_itl(&self, gap: Duration) {
        self.second.get_or_default().itl.record(gap);
    }

    /// A proxied request finished (body ended or dropped): metrics, cost, cache
    /// accuracy, dashboard aggregates, access log, trace span.
    pub fn finish(&self, tags: &RequestTags, route: &RouteTags, f: Finished<'_>) {
        let m = f.m;
        let pool = &route.pool;
        let class = proxied_class(f.status, f.outcome);
        let pair = f.pair;
        pair.requests.increment(
            &Borrowed((
                pool,
                &route.region,
                &tags.tenant_label,
                f.endpoint,
                status_label(f.status),
                class,
                f.outcome.as_str(),
            )),
            1,
            |(pool, region, tenant, endpoint, status, class, outcome)| {
                counter!(
                    names::REQUESTS_TOTAL,
                    names::L_MODEL => pair.model.clone(),
                    names::L_POOL => pool.clone(),
                    names::L_WORKER => pair.worker.clone(),
                    names::L_REGION => region.clone(),
                    names::L_TENANT => tenant.clone(),
                    names::L_ENDPOINT => *endpoint,
                    names::L_STATUS => *status,
                    names::L_CLASS => *class,
                    names::L_OUTCOME => *outcome
                )
            },
        );
        f.pair.e2e.record(m.e2e.as_secs_f64());
        if let Some(t) = m.ttft {
            f.pair.ttft.record(t.as_secs_f64());
            self.second.get_or_default().ttft.record(t);
            self.pool_ttft.with(pool, |h| h.record(t));
        }
        let toks = cost::TokenCounts {
            prompt: m.prompt_tokens.unwrap_or(0),
            cached: m.cached_tokens.unwrap_or(0),
            output: m.output_tokens,
        };
        for (kind, n) in [
            ("prompt", toks.prompt),
            ("cached", toks.cached),
            ("output", toks.output),
        ] {
            if n > 0 {
                pair.tokens.increment(
                    &Borrowed((pool, &route.region, &tags.tenant_label, kind)),
                    n,
                    |(pool, region, tenant, kind)| {
                        counter!(
                            names::TOKENS_TOTAL,
                            names::L_MODEL => pair.model.clone(),
                            names::L_POOL => pool.clone(),
                            names::L_WORKER => pair.worker.clone(),
                            names::L_REGION => region.clone(),
                            names::L_TENANT => tenant.clone(),
                            names::L_KIND => *kind
                        )
                    },
                );
            }
        }

        // Cost: the most specific price row for (model, pool, worker tier).
        let mut cost_usd = 0.0;
        let w = &route.worker;
        self.worker_tokens.with(w, |n| n.add(toks.processed()));
        let tier = route.tier.as_deref();
        if let Some(price) =
            cost::find_price(&tags.config.observability.prices, &f.pair.model, pool, tier)
        {
            cost_usd = cost::cost_usd(&price.rate, toks, self.worker_acc(w).tokens_per_s());
        }
        let nano = (cost_usd * 1e9).round() as u64;
        if nano > 0 {
            let key = (
                f.pair.model.clone(),
                route.region.clone(),
                tags.tenant_label.clone(),
            );
            match self.costs.get(&key) {
                Some(c) => {
                    c.fetch_add(nano, Ordering::Relaxed);
                }
                None => {
                    self.costs
                        .entry(key)
                        .or_default()
                        .fetch_add(nano, Ordering::Relaxed);
                }
            }
            self.second.get_or_default().nano_usd.add(nano);
        }

        // Predicted vs actual cache hits.
        if let (Some(pred), Some(_)) = (route.predicted_cached_tokens, m.prompt_tokens) {
            let actual = toks.cached;
            let kinds = &CACHE_KINDS[usize::from(route.precise)];
            let result = match (pred > 0, actual > 0) {
                (true, true) => kinds[2],
                (true, false) => kinds[3],
                (false, true) => kinds[4],
                (false, false) => kinds[5],
            };
            for (kind, n) in [(kinds[0], pred), (kinds[1], actual), (result, 1)] {
                self.cache_counts
                    .increment(&Borrowed((pool, kind)), n, cache_counter);
            }
            let acc = self.cache.entry(pool.clone()).or_default();
            acc.predicted.fetch_add(pred, Ordering::Relaxed);
            acc.actual.fetch_add(actual, Ordering::Relaxed);
        }

        let second = self.second.get_or_default();
        second.requests.add(1);
        if class != "ok" {
            second.errors.add(1);
        }
        second.output_tokens.add(toks.output);

        if let Some(t) = &self.tracer {
            t.end_request_span(tags, Some(route), f.status, f.outcome.as_str(), m.e2e);
        }
        if let Some(log) = &self.access_log {
            log.log(AccessRecord {
                ts: access_log::rfc3339_now(),
                request_id: tags.request_id.to_str().unwrap_or("").to_string(),
                tenant: tags.tenant.name.clone(),
                model: Some(Arc::from(&*f.pair.model)),
                endpoint: f.endpoint,
                pool: Some(Arc::from(&*route.pool)),
                worker: Some(route.worker.clone()),
                region: Some(Arc::from(&*route.region)),
                policy: Some(route.policy),
                reason: Some(route.reason),
                attempts: tags.attempts(),
                status: f.status,
                outcome: f.outcome.as_str(),
                class,
                error: None,
                stream: tags.stream,
                ttft_ms: m.ttft.map(ms),
                mean_itl_ms: m.mean_itl.map(ms),
                e2e_ms: ms(m.e2e),
                prompt_tokens: m.prompt_tokens,
                cached_tokens: m.cached_tokens,
                output_tokens: m.output_tokens,
                predicted_cached_tokens: route.predicted_cached_tokens,
                cost_usd,
                request_bytes: tags.request_bytes,
                response_bytes: m.response_bytes,
                trace_id: tags.trace.sampled.then(|| tags.trace.trace_id_hex()),
            });
        }
    }

    /// The gateway answered the request itself with an error.
    #[allow(clippy::too_many_arguments)]
    pub fn finish_error(
        &self,
        tags: &RequestTags,
        model: Option<&str>,
        endpoint: &'static str,
        status: u16,
        class: &'static str,
        reason: &'static str,
        elapsed: Duration,
    ) {
        let model_label = SharedString::from(model.unwrap_or(NONE_LABEL).to_string());
        let pool = tags
            .pool
            .clone()
            .unwrap_or(SharedString::const_str(NONE_LABEL));
        // The gateway answered itself: no worker, so no region either.
        let none = SharedString::const_str(NONE_LABEL);
        counter!(
            names::REQUESTS_TOTAL,
            names::L_MODEL => model_label,
            names::L_POOL => pool,
            names::L_WORKER => none.clone(),
            names::L_REGION => none,
            names::L_TENANT => tags.tenant_label.clone(),
            names::L_ENDPOINT => endpoint,
            names::L_STATUS => status_label(status),
            names::L_CLASS => class,
            names::L_OUTCOME => "gateway_error"
        )
        .increment(1);
        let second = self.second.get_or_default();
        second.requests.add(1);
        second.errors.add(1);
        if let Some(t) = &self.tracer {
            t.end_request_span(tags, None, status, reason, elapsed);
        }
        if let Some(log) = &self.access_log {
            log.log(AccessRecord {
                ts: access_log::rfc3339_now(),
                request_id: tags.request_id.to_str().unwrap_or("").to_string(),
                tenant: tags.tenant.name.clone(),
                model: model.map(Arc::from),
                endpoint,
                pool: tags.pool.as_ref().map(|p| Arc::from(&**p)),
                worker: None,
                region: None,
                policy: None,
                reason: None,
                attempts: tags.attempts(),
                status,
                outcome: "gateway_error",
                class,
                error: Some(reason),
                stream: tags.stream,
                ttft_ms: None,
                mean_itl_ms: None,
                e2e_ms: ms(elapsed),
                prompt_tokens: None,
                cached_tokens: None,
                output_tokens: 0,
                predicted_cached_tokens: None,
                cost_usd: 0.0,
                request_bytes: tags.request_bytes,
                response_bytes: 0,
                trace_id: tags.trace.sampled.then(|| tags.trace.trace_id_hex()),
            });
        }
    }

    /// Cost so far by (model, region, tenant), in USD.
    pub fn costs(&self) -> Vec<(SharedString, SharedString, SharedString, f64)> {
        let mut v: Vec<_> = self
            .costs
            .iter()
            .map(|e| {
                let (m, r, t) = e.key().clone();
                (m, r, t, e.value().load(Ordering::Relaxed) as f64 / 1e9)
            })
            .collect();
        v.sort_by(|a, b| (&*a.0, &*a.1, &*a.2).cmp(&(&*b.0, &*b.1, &*b.2)));
        v
    }

    /// Cache prediction totals by pool: (pool, predicted, actual).
    pub fn cache_totals(&self) -> Vec<(String, u64, u64)> {
        let mut v: Vec<_> = self
            .cache
            .iter()
            .map(|e| {
                (
                    e.key().to_string(),
                    e.predicted.load(Ordering::Relaxed),
                    e.actual.load(Ordering::Relaxed),
                )
            })
            .collect();
        v.sort();
        v
    }

    pub fn fleet(&self) -> Arc<FleetView> {
        self.fleet.load_full()
    }

    /// The last `n` seconds of aggregates, oldest first.
    pub fn series(&self) -> Vec<SecondAgg> {
        let st = self.tick.lock().unwrap_or_else(|e| e.into_inner());
        st.ring.iter().cloned().collect()
    }

    /// Once a second: close the current second, update throughput, and rebuild the
    /// fleet view with the scaling recommendation.
    pub fn tick(&self, now: Instant, snap: &Snapshot) {
        let mut st = self.tick.lock().unwrap_or_else(|e| e.into_inner());
        let dt = st
            .last_tick
            .map_or(1.0, |t| now.saturating_duration_since(t).as_secs_f64())
            .max(1e-3);
        st.last_tick = Some(now);
        let mut now_t = SecondTotals::default();
        for s in self.second.iter() {
            now_t.requests += s.requests.get();
            now_t.errors += s.errors.get();
            now_t.output_tokens += s.output_tokens.get();
            now_t.nano_usd += s.nano_usd.get();
            s.ttft.add_to(&mut now_t.ttft);
            s.itl.add_to(&mut now_t.itl);
        }
        let was = std::mem::replace(&mut st.seen_second, now_t);
        let ttft = since(&now_t.ttft, &was.ttft);
        let itl = since(&now_t.itl, &was.itl);
        let q = |c: &[u64; NB], p: f64| quantile(c, p).map(|s| s * 1e3);
        let agg = SecondAgg {
            t: unix_ms(),
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
        };
        st.ring.push_back(agg);
        while st.ring.len() > self.window_s {
            st.ring.pop_front();
        }
        // Per-pool TTFT windows.
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
        // Throughput: EWMA (α = 0.2 per second) of processed tokens per second.
        let mut tokens: HashMap<Arc<str>, u64> = HashMap::new();
        for (w, n) in self.worker_tokens.entries() {
            *tokens.entry(w).or_default() += n.get();
        }
        for (w, total) in tokens {
            let was = st.seen_tokens.insert(w.clone(), total).unwrap_or(0);
            let e = self.worker_acc(&w);
            let n = total.wrapping_sub(was) as f64;
            let rate = n / dt;
            let old = e.tokens_per_s();
            let alpha = (0.2 * dt).min(1.0);
            e.tps_bits
                .store((old + alpha * (rate - old)).to_bits(), Ordering::Relaxed);
        }
        // Forget the running totals of workers and pools that are gone (discovery
        // churn would otherwise grow these maps for good).
        let live: std::collections::HashSet<&str> = snap.workers().map(|w| &*w.id).collect();
        self.worker_tokens.retain(|w| live.contains(w));
        self.workers.retain(|w, _| live.contains(&**w));
        st.seen_tokens.retain(|w, _| live.contains(&**w));
        let pool_live = |p: &str| snap.pools.iter().any(|x| &*x.name == p);
        self.pool_ttft.retain(pool_live);
        st.seen_pool_ttft.retain(|p, _| pool_live(p));
        let view = self.fleet_view(now, snap, &mut st);
        drop(st);
        self.fleet.store(Arc::new(view));
    }

    fn fleet_view(&self, now: Instant, snap: &Snapshot, st: &mut TickState) -> FleetView {
        let cfg = &snap.config.observability;
        let mut workers = Vec::new();
        let mut pools = Vec::new();
        for pool in &snap.pools {
            let targets = cfg.scaling.for_pool(&pool.name);
            let mut loads = Vec::new();
            let mut kv = Vec::new();
            let mut waiting_somewhere = false;
            let mut views = Vec::new();
            for w in &pool.workers {
                let s = worker_signals(w);
                let requests = w.state.requests.load(Ordering::Relaxed);
                let act = st.activity.entry(w.id.clone()).or_insert((requests, now));
                if act.0 != requests {
                    *act = (requests, now);
                }
                let quiet = now.saturating_duration_since(act.1) >= cfg.idle_worker_after;
                let available = w.is_available();
                if available {
                    loads.push(s.queue);
                    if let Some(k) = s.kv_usage {
                        kv.push(k);
                    }
                    if s.waiting > 0.0 {
                        waiting_somewhere = true;
                    }
                }
                views.push((
                    WorkerView {
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
                        tokens_per_s: self.workers.get(&w.id).map_or(0.0, |a| a.tokens_per_s()),
                        idle: false,
                    },
                    available && quiet && s.queue == 0.0,
                ));
            }
            let gateway_queue = pool.queue.as_ref().map_or(0, |q| q.depth());
            if gateway_queue > 0 {
                waiting_somewhere = true;
            }
            let mut idle_workers = 0;
            for (mut v, idle_candidate) in views {
                v.idle = idle_candidate && waiting_somewhere;
                idle_workers += u32::from(v.idle);
                workers.push(v);
            }
            let replicas = loads.len() as u32;
            let queue: f64 = loads.iter().sum::<f64>() + gateway_queue as f64;
            let imbalance_ratio = imbalance(&loads);
            let kv_usage = (!kv.is_empty()).then(|| kv.iter().sum::<f64>() / kv.len() as f64);
            let ttft_p90 = st.pool_ttft.get(&*pool.name).and_then(|w| {
                let mut sum = [0u64; NB];
                for s in w {
                    for (a, b) in sum.iter_mut().zip(s) {
                        *a += b;
                    }
                }
                quantile(&sum, 0.9)
            });
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
            pools.push(PoolView {
                pool: pool.name.to_string(),
                replicas,
                workers: pool.workers.len(),
                queue,
                gateway_queue,
                imbalance_ratio,
                idle_workers,
                saturation_ratio: rec.ratio,
                kv_usage,
                ttft_p90_ms: ttft_p90.map(|s| s * 1e3),
                recommendation: rec,
                targets: targets.into(),
            });
        }
        // Forget pools and workers that are gone.
        st.scalers
            .retain(|k, _| snap.pools.iter().any(|p| p.name == *k));
        st.pool_ttft
            .retain(|k, _| snap.pools.iter().any(|p| p.name == *k));
        st.activity
            .retain(|k, _| workers.iter().any(|w| *w.id == **k));
        FleetView {
            t: unix_ms(),
            workers,
            pools,
        }
    }

    /// Set the fleet and cache-ratio gauges from the last tick (scrape time).
    pub fn refresh_gauges(&self) {
        let fleet = self.fleet();
        for p in &fleet.pools {
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
        for (pool, pred, actual) in self.cache_totals() {
            if pred > 0 {
                gauge!(names::CACHE_PREDICTION_RATIO, names::L_POOL => pool)
                    .set(actual as f64 / pred as f64);
            }
        }
    }

    /// Append the cost counter to `out`. It is a float, so it is rendered here
    /// rather than through `metrics`, whose counters are integers.
    pub fn render_into(&self, out: &mut String) {
        use std::fmt::Write;
        let _ = writeln!(
            out,
            "# HELP {} Cost attributed to requests by the price table (USD), by model, region and tenant.\n# TYPE {} counter",
            names::COST_USD_TOTAL,
            names::COST_USD_TOTAL
        );
        for (m, r, t, usd) in self.costs() {
            let _ = writeln!(
                out,
                "{}{{{}=\"{}\",{}=\"{}\",{}=\"{}\"}} {usd}",
                names::COST_USD_TOTAL,
                names::L_MODEL,
                escape(&m),
                names::L_REGION,
                escape(&r),
                names::L_TENANT,
                escape(&t)
            );
        }
    }
}

/// Start the once-a-second ticker.
pub fn spawn_ticker(hub: Arc<Hub>, registry: Arc<Registry>) {
    tokio::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_secs(1));
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        every.tick().await;
        loop {
            every.tick().await;
            hub.tick(Instant::now(), &registry.snapshot());
            // Per-thread counter totals reach the exporter at least once a second
            // (and those of replaced snapshots are dropped), scraped or not.
            super::local::flush();
        }
    });
}

/// A worker's load signals. Until the stats poller (routing branch) lands, the
/// gateway's own in-flight count stands for waiting + running and KV usage is
/// unknown.
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
        // Never scraped: only the gateway's own in-flight count is known.
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

/// `ok`, `client` (4xx or the client left) or `upstream` (5xx, failed mid-body).
pub fn proxied_class(status: u16, outcome: Outcome) -> &'static str {
    match outcome {
        Outcome::Error => "upstream",
        _ if status >= 500 => "upstream",
        _ if status >= 400 => "client",
        Outcome::Cancelled => "client",
        Outcome::Completed => "ok",
    }
}

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
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
    fn imbalance_is_max_over_mean() {
        assert_eq!(imbalance(&[]), 1.0);
        assert_eq!(imbalance(&[0.0, 0.0]), 1.0);
        assert_eq!(imbalance(&[2.0, 2.0]), 1.0);
        assert_eq!(imbalance(&[4.0, 0.0, 0.0, 0.0]), 4.0);
    }

    #[test]
    fn classes() {
        assert_eq!(proxied_class(200, Outcome::Completed), "ok");
        assert_eq!(proxied_class(200, Outcome::Cancelled), "client");
        assert_eq!(proxied_class(200, Outcome::Error), "upstream");
        assert_eq!(proxied_class(404, Outcome::Completed), "client");
        assert_eq!(proxied_class(503, Outcome::Completed), "upstream");
    }
}
