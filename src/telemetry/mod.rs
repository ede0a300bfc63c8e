//! Metrics: names and label keys in [`names`], the Prometheus recorder, and the
//! per-request [`RequestMetrics`] recorded once when a response finishes or is dropped.

pub mod access_log;
pub mod cost;
pub mod labels;
pub mod local;
pub mod names;
pub mod process;
pub mod record;
pub mod sinks;
pub mod trace;

pub use record::{End, RequestRecord, RouteTags};
pub use sinks::Sinks;

use dashmap::DashMap;
use foldhash::fast::RandomState;
use local::{LocalCount, LocalCounter, LocalHistogram};
use metrics::{counter, Counter, SharedString};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use std::cell::RefCell;
use std::hash::Hash;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use thread_local::ThreadLocal;

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Latency buckets (seconds): from 1 ms (inter-token gaps) to 120 s (long TTFTs).
pub const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
    0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0, 120.0,
];

/// Gateway-overhead buckets (seconds): 10 µs to 100 ms.
pub const OVERHEAD_BUCKETS: &[f64] = &[
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1,
];

/// Endpoint Picker decision buckets (seconds): 5 µs to 50 ms.
pub const EPP_DECISION_BUCKETS: &[f64] = &[
    0.000005, 0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05,
];

/// Install the process-wide Prometheus recorder (idempotent) and return its handle.
pub fn install() -> PrometheusHandle {
    HANDLE
        .get_or_init(|| {
            // A full-name matcher wins over a suffix one (the exporter tries them
            // in that order): the picker's decisions take microseconds.
            let recorder = PrometheusBuilder::new()
                .set_buckets_for_metric(
                    Matcher::Full(names::EPP_DECISION_SECONDS.into()),
                    EPP_DECISION_BUCKETS,
                )
                .expect("static buckets are valid")
                .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), LATENCY_BUCKETS)
                .expect("static buckets are valid")
                .build_recorder();
            let handle = recorder.handle();
            // Another recorder may already be set (e.g. by an embedding program); then
            // our handle renders only what we describe, which is still valid text.
            let _ = metrics::set_global_recorder(recorder);
            names::describe();
            handle
        })
        .clone()
}

/// How often the exporter's histogram storage is compacted when nobody scrapes.
const UPKEEP_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

/// Start the exporter's upkeep task once per process (must run inside a runtime):
/// without it, histogram samples accumulate between scrapes.
pub fn spawn_upkeep(handle: PrometheusHandle) {
    static STARTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if STARTED.swap(true, Ordering::AcqRel) {
        return;
    }
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(UPKEEP_EVERY).await;
            handle.run_upkeep();
        }
    });
}

/// Render the exposition text (the caller refreshes gauges kept elsewhere first).
pub fn render(handle: &PrometheusHandle, sinks: Option<&Sinks>) -> String {
    if let Some(s) = sinks {
        s.refresh_gauges();
    }
    let cpu = process::refresh();
    local::flush();
    let mut out = handle.render();
    local::render_into(&mut out);
    if let Some(s) = sinks {
        s.render_into(&mut out);
    }
    process::render_into(&mut out, cpu);
    out
}

/// How a request ended, for the `outcome` label.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The response body was delivered completely.
    Completed,
    /// The client went away before the end.
    Cancelled,
    /// The upstream failed or timed out mid-response.
    Error,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Completed => "completed",
            Outcome::Cancelled => "cancelled",
            Outcome::Error => "error",
        }
    }
}

/// What one proxied request measured.
#[derive(Debug, Default)]
pub struct RequestMetrics {
    pub ttft: Option<Duration>,
    pub e2e: Duration,
    pub prompt_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
    pub output_tokens: u64,
    /// The answer reported no usage: the token counts are the gateway's estimate.
    pub usage_estimated: bool,
    /// Mean gap between content events (streams with at least two).
    pub mean_itl: Option<Duration>,
    /// Body bytes sent to the client.
    pub response_bytes: u64,
}

/// Metric handles for one (model, worker) pair of a route, resolved once when the
/// routing snapshot is built so the request path does no registry lookups for the
/// latency histograms and attempt counter. Pool and region follow from the worker.
pub struct PairMetrics {
    pub model: SharedString,
    pub pool: SharedString,
    pub worker: SharedString,
    pub region: SharedString,
    pub ttft: Arc<LocalHistogram>,
    pub itl: Arc<LocalHistogram>,
    pub e2e: Arc<LocalHistogram>,
    /// Predicted TTFT and its relative error, for answers with both.
    pub predicted_ttft: Arc<LocalHistogram>,
    pub ttft_error: Arc<LocalHistogram>,
    attempt_ok: LocalCounter,
    /// `switchyard_requests_total` by (pool, region, tenant, endpoint, status, class, outcome).
    pub requests: CounterCache<RequestsKey>,
    /// `switchyard_tokens_total` by (pool, region, tenant), then kind.
    pub tokens: CounterCache<TokensKey, TokenCounters>,
}

/// Label values of `switchyard_requests_total` beyond the (model, worker) pair.
pub type RequestsKey = (
    SharedString,
    SharedString,
    SharedString,
    &'static str,
    &'static str,
    &'static str,
    &'static str,
);
/// Label values of `switchyard_tokens_total` beyond the (model, worker) pair
/// and the kind (one [`TokenCounters`] holds the kinds).
pub type TokensKey = (SharedString, SharedString, SharedString);
/// [`RequestsKey`] borrowed.
pub type RequestsRef<'a> = (
    &'a SharedString,
    &'a SharedString,
    &'a SharedString,
    &'static str,
    &'static str,
    &'static str,
    &'static str,
);
/// [`TokensKey`] borrowed.
pub type TokensRef<'a> = (&'a SharedString, &'a SharedString, &'a SharedString);

/// Token kinds, in [`TokenCounters`] order.
pub const TOKEN_KINDS: [&str; 3] = ["prompt", "cached", "output"];

/// One label set's `switchyard_tokens_total` counters by kind (in
/// [`TOKEN_KINDS`] order): an answered request counts its kinds with one
/// cache lookup, and each kind's series is registered when first counted.
#[derive(Default)]
pub struct TokenCounters([std::cell::OnceCell<Arc<LocalCount>>; 3]);

impl TokenCounters {
    /// Add `n` to kind `i`, registering its counter with `make` the first time.
    pub fn add(&self, i: usize, n: u64, make: impl FnOnce() -> Counter) {
        self.0[i].get_or_init(|| local::counter_slot(make())).add(n);
    }
}

/// Endpoint labels, in `api::Endpoint` order.
pub const ENDPOINTS: [&str; 7] = [
    "chat_completions",
    "completions",
    "embeddings",
    "responses",
    "messages",
    "count_tokens",
    "other",
];

impl PairMetrics {
    pub fn new(
        model: SharedString,
        pool: SharedString,
        worker: SharedString,
        region: SharedString,
    ) -> PairMetrics {
        let labels = [
            (names::L_MODEL, &*model),
            (names::L_POOL, &*pool),
            (names::L_WORKER, &*worker),
            (names::L_REGION, &*region),
        ];
        let latency = |(name, help)| local::histogram(name, help, LATENCY_BUCKETS, &labels);
        PairMetrics {
            ttft: latency((names::TTFT_SECONDS, names::TTFT_HELP)),
            itl: latency((names::ITL_SECONDS, names::ITL_HELP)),
            e2e: latency((names::E2E_SECONDS, names::E2E_HELP)),
            predicted_ttft: latency((names::PREDICTED_TTFT_SECONDS, names::PREDICTED_TTFT_HELP)),
            ttft_error: local::histogram(
                names::TTFT_PREDICTION_ERROR,
                names::TTFT_PREDICTION_ERROR_HELP,
                names::ERROR_RATIO_BUCKETS,
                &labels,
            ),
            attempt_ok: LocalCounter::new(counter!(names::UPSTREAM_ATTEMPTS_TOTAL,
                names::L_WORKER => worker.clone(), names::L_RESULT => "ok")),
            requests: CounterCache::default(),
            tokens: CounterCache::default(),
            model,
            pool,
            worker,
            region,
        }
    }

    /// Record one upstream attempt and its result.
    pub fn record_attempt(&self, result: &'static str) {
        if result == "ok" {
            self.attempt_ok.increment(1);
        } else {
            counter!(
                names::UPSTREAM_ATTEMPTS_TOTAL,
                names::L_WORKER => self.worker.clone(),
                names::L_RESULT => result
            )
            .increment(1);
        }
    }
}

/// Counters resolved once per distinct label combination. The request path then
/// hashes the label values it already holds, borrowed, instead of building a
/// metrics `Key` (a label vector) and looking it up in the recorder's registry.
/// Each serving thread has its own map, so a lookup takes no lock and clones
/// nothing that another thread touches. Keys are made of bounded label values
/// only, so every map is bounded too. An entry (`V`) is one counter, or a few
/// that share the key's labels.
pub struct CounterCache<K: Send, V: Send = Arc<LocalCount>>(
    ThreadLocal<RefCell<hashbrown::HashMap<K, V, RandomState>>>,
);

/// A concurrent map with a fast non-cryptographic hasher, for keys made of
/// bounded label values (never client-controlled strings).
pub type FastMap<K, V> = DashMap<K, V, RandomState>;

impl<K: Send, V: Send> Default for CounterCache<K, V> {
    fn default() -> Self {
        CounterCache(ThreadLocal::new())
    }
}

impl<K: Hash + Eq + Send, V: Send> CounterCache<K, V> {
    /// Call `f` with this thread's entry for `key` (and the owned key), made
    /// with `make` the first time.
    pub fn with<Q: CacheKey<K>, R>(
        &self,
        key: &Q,
        make: impl FnOnce(&K) -> V,
        f: impl FnOnce(&K, &V) -> R,
    ) -> R {
        let mut map = self.0.get_or_default().borrow_mut();
        if let Some((k, v)) = map.get_key_value(key) {
            return f(k, v);
        }
        let k = key.to_key();
        let v = make(&k);
        let r = f(&k, &v);
        map.insert(k, v);
        r
    }
}

impl<K: Hash + Eq + Send> CounterCache<K> {
    /// Add `n` to the counter for `key`, registering it with `make` the first time
    /// on this thread.
    pub fn increment<Q: CacheKey<K>>(&self, key: &Q, n: u64, make: impl FnOnce(&K) -> Counter) {
        self.with(key, |k| local::counter_slot(make(k)), |_, c| c.add(n));
    }
}

/// A key a [`CounterCache`] can look up without building the owned key `K`,
/// and build it from when the entry is new.
pub trait CacheKey<K>: Hash + hashbrown::Equivalent<K> {
    fn to_key(&self) -> K;
}

/// A key of `Copy` values is its own lookup key.
impl<K: Hash + Eq + Copy> CacheKey<K> for K {
    fn to_key(&self) -> K {
        *self
    }
}

/// Label values borrowed for a [`CounterCache`] lookup. It hashes exactly as the
/// owned key does: a tuple hashes its fields in order, a reference as what it
/// points to.
#[derive(Hash)]
pub struct Borrowed<T>(pub T);

/// Equal label values, found by address first: a request's values are
/// usually the very strings its cached key was made from.
#[inline]
fn same(a: &str, b: &str) -> bool {
    std::ptr::eq(a, b) || a == b
}

impl hashbrown::Equivalent<RequestsKey> for Borrowed<RequestsRef<'_>> {
    fn equivalent(&self, k: &RequestsKey) -> bool {
        let b = &self.0;
        same(b.0, &k.0)
            && same(b.1, &k.1)
            && same(b.2, &k.2)
            && same(b.3, k.3)
            && same(b.4, k.4)
            && same(b.5, k.5)
            && same(b.6, k.6)
    }
}

impl CacheKey<RequestsKey> for Borrowed<RequestsRef<'_>> {
    fn to_key(&self) -> RequestsKey {
        let b = &self.0;
        (b.0.clone(), b.1.clone(), b.2.clone(), b.3, b.4, b.5, b.6)
    }
}

impl hashbrown::Equivalent<TokensKey> for Borrowed<TokensRef<'_>> {
    fn equivalent(&self, k: &TokensKey) -> bool {
        let b = &self.0;
        same(b.0, &k.0) && same(b.1, &k.1) && same(b.2, &k.2)
    }
}

/// A per-pool counter's key: the pool and what is counted.
pub type PoolKindKey = (SharedString, &'static str);

impl hashbrown::Equivalent<PoolKindKey> for Borrowed<(&SharedString, &'static str)> {
    fn equivalent(&self, k: &PoolKindKey) -> bool {
        (self.0 .0, self.0 .1) == (&k.0, k.1)
    }
}

impl CacheKey<PoolKindKey> for Borrowed<(&SharedString, &'static str)> {
    fn to_key(&self) -> PoolKindKey {
        (self.0 .0.clone(), self.0 .1)
    }
}

impl CacheKey<TokensKey> for Borrowed<TokensRef<'_>> {
    fn to_key(&self) -> TokensKey {
        let b = &self.0;
        (b.0.clone(), b.1.clone(), b.2.clone())
    }
}

/// Per-pool metric handles, resolved when the pool's runtime is built.
pub struct PoolMetrics {
    pub name: SharedString,
    overhead: Arc<LocalHistogram>,
    decisions: CounterCache<(&'static str, &'static str)>,
}

impl PoolMetrics {
    pub fn new(name: SharedString) -> PoolMetrics {
        PoolMetrics {
            overhead: local::histogram(
                names::GATEWAY_OVERHEAD_SECONDS,
                names::GATEWAY_OVERHEAD_HELP,
                OVERHEAD_BUCKETS,
                &[(names::L_POOL, &name)],
            ),
            decisions: CounterCache::default(),
            name,
        }
    }

    /// Record the time a request spent in the gateway itself (not waiting on a
    /// worker, the pool queue or a retry backoff).
    pub fn record_overhead(&self, d: Duration) {
        self.overhead.record(d.as_secs_f64());
    }

    /// Record a routing decision.
    pub fn record_decision(&self, policy: &'static str, reason: &'static str) {
        self.decisions
            .increment(&(policy, reason), 1, |(policy, reason)| {
                counter!(
                    names::ROUTING_DECISIONS_TOTAL,
                    names::L_POOL => self.name.clone(),
                    names::L_POLICY => *policy,
                    names::L_REASON => *reason
                )
            });
    }
}

/// Record a request the gateway answered itself with an error.
pub fn record_gateway_error(model: Option<&str>, reason: &'static str, status: u16) {
    counter!(
        names::GATEWAY_ERRORS_TOTAL,
        names::L_REASON => reason,
        names::L_STATUS => status_label(status),
        names::L_MODEL => SharedString::from(model.unwrap_or("none").to_string())
    )
    .increment(1);
}

/// Record a request handed from a pool to its fallback.
pub fn record_fallback(from: &str, to: &str) {
    counter!(
        names::FALLBACKS_TOTAL,
        names::L_POOL => SharedString::from(from.to_string()),
        names::L_TARGET => SharedString::from(to.to_string())
    )
    .increment(1);
}

/// Record a failed `/metrics` scrape.
pub fn record_stats_poll_error(worker: &SharedString) {
    counter!(names::STATS_POLL_ERRORS_TOTAL, names::L_WORKER => worker.clone()).increment(1);
}

/// Add a routed request's estimated cost (USD) to the pool's total.
pub fn record_estimated_cost(pool: &SharedString, usd: f64) {
    if usd > 0.0 && usd.is_finite() {
        counter!(names::ESTIMATED_COST_MICRODOLLARS_TOTAL, names::L_POOL => pool.clone())
            .increment((usd * 1e6).round() as u64);
    }
}

/// Record an honoured `x-switchyard-policy` override.
pub fn record_policy_override(pool: &SharedString, policy: &'static str) {
    counter!(
        names::POLICY_OVERRIDES_TOTAL,
        names::L_POOL => pool.clone(),
        names::L_POLICY => policy
    )
    .increment(1);
}

/// A status code as a static label (no allocation for the common ones).
pub fn status_label(status: u16) -> &'static str {
    match status {
        200 => "200",
        400 => "400",
        401 => "401",
        403 => "403",
        404 => "404",
        408 => "408",
        413 => "413",
        422 => "422",
        429 => "429",
        500 => "500",
        502 => "502",
        503 => "503",
        504 => "504",
        s if s < 300 => "2xx",
        s if s < 400 => "3xx",
        s if s < 500 => "4xx",
        _ => "5xx",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    /// One entry holds a label set's token kinds: each kind's counter is made
    /// the first time that kind is counted, once, and keeps counting.
    #[test]
    fn token_kinds_share_one_entry_and_register_when_first_counted() {
        let cache: CounterCache<TokensKey, TokenCounters> = CounterCache::default();
        let (entries, counters) = (AtomicU32::new(0), AtomicU32::new(0));
        let (pool, region) = (labels::shared("p"), labels::shared("r"));
        let tenant = SharedString::const_str("t");
        for (kind, n) in [(0, 3), (2, 5), (0, 4), (2, 1)] {
            cache.with(
                &Borrowed((&pool, &region, &tenant)),
                |_| {
                    entries.fetch_add(1, Ordering::Relaxed);
                    TokenCounters::default()
                },
                |k, c| {
                    assert_eq!(&*k.2, "t");
                    c.add(kind, n, || {
                        counters.fetch_add(1, Ordering::Relaxed);
                        Counter::noop()
                    });
                },
            );
        }
        assert_eq!(entries.load(Ordering::Relaxed), 1);
        assert_eq!(
            counters.load(Ordering::Relaxed),
            2,
            "prompt and output, not cached"
        );
        let totals: Vec<u64> = cache
            .0
            .get()
            .unwrap()
            .borrow()
            .values()
            .next()
            .unwrap()
            .0
            .iter()
            .map(|c| c.get().map_or(0, |c| c.get()))
            .collect();
        assert_eq!(totals, [7, 0, 6]);
    }

    /// A borrowed key finds the entry its owned twin made: `make` runs once per
    /// distinct label set per thread, and the same counter keeps counting.
    #[test]
    fn a_borrowed_key_finds_the_owned_entry() {
        let cache: CounterCache<TokensKey> = CounterCache::default();
        let made = AtomicU32::new(0);
        let make = |k: &TokensKey| {
            made.fetch_add(1, Ordering::Relaxed);
            assert_eq!(&*k.0, "p", "the owned key is the borrowed one's");
            Counter::noop()
        };
        let pool = labels::shared("p");
        let region = labels::shared("r");
        let (t, v) = (SharedString::const_str("t"), SharedString::const_str("v"));
        for (tenant, n) in [(&t, 3), (&t, 4), (&v, 5), (&t, 1)] {
            cache.increment(&Borrowed((&pool, &region, tenant)), n, make);
        }
        assert_eq!(made.load(Ordering::Relaxed), 2);
        // Other values with the same text are the same key, whatever backs them.
        let (p2, r2) = (labels::shared("p"), SharedString::from("r".to_string()));
        cache.increment(&Borrowed((&p2, &r2, &v)), 1, make);
        assert_eq!(made.load(Ordering::Relaxed), 2);
        let other_tenant = labels::shared("u");
        cache.increment(&Borrowed((&pool, &region, &other_tenant)), 1, make);
        assert_eq!(made.load(Ordering::Relaxed), 3);
    }
}
