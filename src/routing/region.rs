//! Global routing in front of a pool's policy: the residency filter and locality
//! tiers with spill-over and hysteresis.
//!
//! **Residency** is a hard filter: a worker whose region is not in the request's
//! allowed set is never offered to the policy (a worker without a declared region
//! is outside every set). Spill, retries and fallback pools all pick through here.
//!
//! **Locality.** With a gateway region (`server.region`), the route's workers are
//! split into tiers once per snapshot: tier 0 is the gateway's region plus every
//! region whose round trip is within the pool's `max_added_latency_ms`; then one
//! tier per region of the gateway region's `spill_order`; then the other declared
//! regions by round trip; then workers without a declared region. The policy
//! picks within tier 0 unless the pool's [`SpillState`] says the local tier is
//! unhealthy (no available worker) or overloaded: it enters spill when the local
//! tier's mean load (estimated queue ÷ capacity per available worker) reaches the
//! high watermark, and leaves only after the tier has stayed healthy and below
//! the low watermark for `min_dwell`. While spilling, the first remote tier with
//! headroom (load under the high watermark) takes the request; if none has, the
//! local tier does, then any remote one. A tier whose workers the caller's
//! `accept` refuses (tried by this request, at their concurrency limit) passes the
//! request on to the next.
//!
//! Every pick outside the gateway's region carries a [`CrossReason`], counted in
//! `switchyard_cross_region_requests_total{from, to, reason}` when the decision
//! is recorded; `to` is a declared region name or `unknown`, so the label set is
//! bounded by the configuration.

use super::{BuildContext, Decision, Policy, RouteRequest};
use crate::config::{GlobalConfig, LocalityConfig, RegionId, Residency};
use crate::pool::Worker;
use crate::telemetry::names;
use metrics::{counter, gauge, Gauge, SharedString};
use rand::RngCore;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

pub use crate::api::headers::RESIDENCY_HEADER;

/// The residency of one request: the tenant's (if any) narrowed by the
/// `x-switchyard-residency` header (if any) — a header can narrow a tenant's
/// residency, never widen it. `Err(value)` for a header naming nothing declared.
/// No allocation unless the header is present.
pub fn request_residency(
    global: &GlobalConfig,
    tenant: Option<&Residency>,
    header: Option<&str>,
) -> Result<Option<Residency>, String> {
    let Some(h) = header else {
        return Ok(tenant.cloned());
    };
    let h = global.residency(h).ok_or_else(|| h.to_string())?;
    Ok(Some(match tenant {
        None => h,
        Some(t) => Residency {
            name: Arc::from(format!("{} & {}", t.name, h.name)),
            regions: t.regions.intersect(h.regions),
        },
    }))
}

/// Why a request went to a worker outside the gateway's region; a metric label.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CrossReason {
    /// No worker of the local tier is available (ejected, draining, cooling down).
    LocalUnhealthy,
    /// The local tier is over its load bound (spill state, with hysteresis).
    LocalOverloaded,
    /// Every local worker was refused for this request: tried already (a retry)
    /// or at its concurrency limit.
    LocalExhausted,
    /// The pool has no worker in the local tier.
    NoLocalWorker,
    /// The request's residency excludes every local worker.
    Residency,
    /// A remote region within the pool's latency budget won on the policy's merits
    /// (e.g. cheaper).
    WithinBudget,
}

impl CrossReason {
    pub const ALL: &'static [CrossReason] = &[
        CrossReason::LocalUnhealthy,
        CrossReason::LocalOverloaded,
        CrossReason::LocalExhausted,
        CrossReason::NoLocalWorker,
        CrossReason::Residency,
        CrossReason::WithinBudget,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            CrossReason::LocalUnhealthy => "local_unhealthy",
            CrossReason::LocalOverloaded => "local_overloaded",
            CrossReason::LocalExhausted => "local_exhausted",
            CrossReason::NoLocalWorker => "no_local_worker",
            CrossReason::Residency => "residency",
            CrossReason::WithinBudget => "within_budget",
        }
    }
}

const LOCAL: u8 = 0;
const OVERLOADED: u8 = 1;
const UNHEALTHY: u8 = 2;

/// What the spill state decided for one pick ([`SpillState::plan`]): whether
/// requests spill and why, and the state change [`Regional`] makes when the
/// decision is recorded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpillStep {
    pub reason: Option<CrossReason>,
    from: u8,
    to: u8,
    calm: Calm,
}

/// What happens to the time the local tier became calm.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Calm {
    Keep,
    Reset,
    /// Start the dwell at this time (unless it has started).
    Start(u64),
}

/// The spill state of one pool's local tier, shared by the pool's routes and kept
/// by the registry across rebuilds. Lock-free: two atomics and a gauge.
pub struct SpillState {
    mode: AtomicU8,
    /// While spilling: when the local tier became calm (healthy, under the low
    /// watermark); 0 while it is not.
    calm_since: AtomicU64,
    gauge: Gauge,
    pool: Arc<str>,
}

impl SpillState {
    pub fn new(pool: &str) -> SpillState {
        let pool: Arc<str> = Arc::from(pool);
        let gauge =
            gauge!(names::LOCALITY_SPILLING, names::L_POOL => SharedString::from(pool.clone()));
        gauge.set(0.0);
        SpillState {
            mode: AtomicU8::new(LOCAL),
            calm_since: AtomicU64::new(0),
            gauge,
            pool,
        }
    }

    /// Whether new requests currently leave the local tier.
    pub fn is_spilling(&self) -> bool {
        self.mode.load(Ordering::Relaxed) != LOCAL
    }

    /// Update the state from the local tier's condition at `now` (ms) and say
    /// whether requests spill, and why: [`SpillState::plan`], then
    /// [`SpillState::apply`].
    pub fn evaluate(
        &self,
        now: u64,
        available: bool,
        load: f64,
        cfg: &LocalityConfig,
    ) -> Option<CrossReason> {
        let step = self.plan(now, available, load, cfg);
        self.apply(step);
        step.reason
    }

    /// Whether requests spill, and why, given the local tier's condition at
    /// `now` (ms), with the state change that goes with it; changes nothing.
    /// `available`: some local worker takes requests; `load`: their mean load as
    /// a share of capacity.
    pub fn plan(&self, now: u64, available: bool, load: f64, cfg: &LocalityConfig) -> SpillStep {
        let mode = self.mode.load(Ordering::Relaxed);
        let step = |reason, to, calm| SpillStep {
            reason,
            from: mode,
            to,
            calm,
        };
        if !available {
            return step(Some(CrossReason::LocalUnhealthy), UNHEALTHY, Calm::Reset);
        }
        let cause = if mode == UNHEALTHY {
            CrossReason::LocalUnhealthy
        } else {
            CrossReason::LocalOverloaded
        };
        if mode == LOCAL {
            if load >= cfg.high_watermark {
                return step(Some(CrossReason::LocalOverloaded), OVERLOADED, Calm::Keep);
            }
            return step(None, LOCAL, Calm::Keep);
        }
        if load >= cfg.low_watermark {
            return step(Some(cause), mode, Calm::Reset);
        }
        let (since, calm) = match self.calm_since.load(Ordering::Relaxed) {
            0 => (now, Calm::Start(now)),
            t => (t, Calm::Keep),
        };
        if now.saturating_sub(since) >= cfg.min_dwell.as_millis() as u64 {
            return step(None, LOCAL, calm);
        }
        step(Some(cause), mode, calm)
    }

    /// Make the state change `plan` decided on.
    pub fn apply(&self, step: SpillStep) {
        match step.calm {
            Calm::Keep => {}
            Calm::Reset => self.calm_since.store(0, Ordering::Relaxed),
            Calm::Start(now) => {
                let _ =
                    self.calm_since
                        .compare_exchange(0, now, Ordering::Relaxed, Ordering::Relaxed);
            }
        }
        if step.to != step.from {
            self.switch(step.from, step.to);
        }
    }

    fn switch(&self, from: u8, to: u8) {
        if self
            .mode
            .compare_exchange(from, to, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
        {
            self.calm_since.store(0, Ordering::Relaxed);
            self.gauge.set(if to == LOCAL { 0.0 } else { 1.0 });
            let state = match to {
                LOCAL => "local",
                OVERLOADED => "spilling (local_overloaded)",
                _ => "spilling (local_unhealthy)",
            };
            tracing::info!(pool = %self.pool, state, "locality state changed");
        }
    }
}

/// Residency filter and locality tiers around a pool's policy (module docs).
pub struct Regional {
    inner: Box<dyn Policy>,
    /// Tier of each of the route's workers; 0 is local.
    tier_of: Vec<u8>,
    /// The workers of each tier (tier 0 may be empty; the others are not).
    tiers: Vec<Vec<usize>>,
    /// The gateway's region, when locality is on.
    local: Option<RegionId>,
    /// Metric labels: the gateway's region, and every declared region by id
    /// followed by `unknown`.
    from_label: SharedString,
    to_labels: Vec<SharedString>,
    /// Requests a worker can hold before it counts as fully loaded.
    capacity: f64,
    stale_after_ms: u64,
    locality: LocalityConfig,
    spill: Option<Arc<SpillState>>,
}

impl Regional {
    pub fn new(ctx: &BuildContext<'_>, inner: Box<dyn Policy>) -> Regional {
        let g = ctx.global;
        let n = g.regions.len();
        let to_labels = g
            .regions
            .iter()
            .map(|r| SharedString::from(r.name.clone()))
            .chain(std::iter::once(SharedString::from("unknown")))
            .collect();
        let local = g.region.filter(|_| ctx.spill.is_some());
        let mut tier_of = vec![0u8; ctx.workers.len()];
        let mut tiers = vec![(0..ctx.workers.len()).collect::<Vec<_>>()];
        if let Some(home) = local {
            // Rank every region (and "unknown" = n): tier 0, then spill order, then
            // by round trip.
            let budget = ctx.pool.routing.max_added_latency_ms;
            let mut rank = vec![u16::MAX; n + 1];
            let mut next = 1u16;
            for (r, slot) in rank.iter_mut().enumerate().take(n) {
                let id = RegionId(r as u8);
                if id == home || g.rtt_ms(home, id).is_some_and(|ms| ms <= budget) {
                    *slot = 0;
                }
            }
            for id in &g.regions[home.0 as usize].spill_order {
                if rank[id.0 as usize] == u16::MAX {
                    rank[id.0 as usize] = next;
                    next += 1;
                }
            }
            let mut rest: Vec<usize> = (0..n).filter(|&r| rank[r] == u16::MAX).collect();
            rest.sort_by_key(|&r| (g.rtt_ms(home, RegionId(r as u8)).unwrap_or(u32::MAX), r));
            for r in rest {
                rank[r] = next;
                next += 1;
            }
            rank[n] = next;
            // Only tiers that have workers, renumbered in order.
            let worker_rank: Vec<u16> = ctx
                .workers
                .iter()
                .map(|w| rank[w.region.map_or(n, |r| r.0 as usize)])
                .collect();
            let mut present: Vec<u16> = worker_rank.iter().copied().filter(|&r| r > 0).collect();
            present.sort_unstable();
            present.dedup();
            tiers = vec![Vec::new(); present.len() + 1];
            for (i, r) in worker_rank.iter().enumerate() {
                let t = if *r == 0 {
                    0
                } else {
                    present.binary_search(r).map_or(0, |k| k + 1)
                };
                tier_of[i] = t as u8;
                tiers[t].push(i);
            }
        }
        let limit = ctx.pool.max_concurrency_per_worker;
        let capacity = if limit > 0 {
            limit as f64
        } else {
            ctx.pool.routing.target_queue.max(1.0)
        };
        Regional {
            inner,
            tier_of,
            tiers,
            local,
            from_label: local.map_or(SharedString::from("none"), |r| {
                SharedString::from(g.region_name(r).clone())
            }),
            to_labels,
            capacity,
            stale_after_ms: ctx.pool.routing.stale_after.as_millis() as u64,
            locality: g.locality,
            spill: ctx.spill.cloned(),
        }
    }

    /// Number of tiers (1 without locality).
    pub fn tier_count(&self) -> usize {
        self.tiers.len()
    }

    /// Available workers of tier `t` and their mean load (share of capacity).
    fn tier_load(&self, t: usize, workers: &[Arc<Worker>], now: u64) -> (usize, f64) {
        let (mut n, mut sum) = (0usize, 0.0);
        for &i in &self.tiers[t] {
            let w = &workers[i];
            if w.is_available() {
                n += 1;
                sum += w
                    .state
                    .stats
                    .load(w.in_flight(), now, self.stale_after_ms)
                    .queue
                    / self.capacity;
            }
        }
        (
            n,
            if n == 0 {
                f64::INFINITY
            } else {
                sum / n as f64
            },
        )
    }

    fn pick_impl(
        &self,
        req: &RouteRequest<'_>,
        workers: &[Arc<Worker>],
        accept: &dyn Fn(usize) -> bool,
        now: u64,
        rng: &mut dyn RngCore,
    ) -> Option<Decision> {
        let (Some(_), Some(spill)) = (self.local, &self.spill) else {
            let accept = |i: usize| req.allows(&workers[i]) && accept(i);
            return self.inner.pick_at(req, workers, &accept, now, rng);
        };
        // The local tier's condition drives the pool's spill state, whatever this
        // request's residency; the state changes when the decision is recorded.
        let step = if self.tiers[0].is_empty() {
            None
        } else {
            let (available, load) = self.tier_load(0, workers, now);
            Some(spill.plan(now, available > 0, load, &self.locality))
        };
        let state = step.and_then(|s| s.reason);
        let d = self.pick_in_tiers(req, workers, accept, now, rng, state)?;
        Some(Decision { spill: step, ..d })
    }

    /// The locality tiers' pick, given whether (and why) the spill state sends
    /// requests away from the local tier.
    fn pick_in_tiers(
        &self,
        req: &RouteRequest<'_>,
        workers: &[Arc<Worker>],
        accept: &dyn Fn(usize) -> bool,
        now: u64,
        rng: &mut dyn RngCore,
        state: Option<CrossReason>,
    ) -> Option<Decision> {
        let home = self.local?;
        let allowed = |i: usize| req.allows(&workers[i]);
        let in_tier = |t: usize| {
            let tier_of = &self.tier_of;
            move |i: usize| tier_of[i] as usize == t && allowed(i) && accept(i)
        };
        let mut pick_in = |t: usize| self.inner.pick_at(req, workers, &in_tier(t), now, rng);
        let local_pick = |d: Decision| Decision {
            cross: (workers[d.index].region != Some(home)).then_some(CrossReason::WithinBudget),
            ..d
        };
        let local_allowed = self.tiers[0].iter().any(|&i| allowed(i));
        let why = if self.tiers[0].is_empty() {
            CrossReason::NoLocalWorker
        } else if !local_allowed {
            CrossReason::Residency
        } else if let Some(r) = state {
            r
        } else if let Some(d) = pick_in(0) {
            return Some(local_pick(d));
        } else {
            CrossReason::LocalExhausted
        };
        let cross = |d: Decision| Decision {
            cross: Some(why),
            ..d
        };
        // Remote tiers with headroom, in order.
        let mut skipped = false;
        for t in 1..self.tiers.len() {
            let (available, load) = self.tier_load(t, workers, now);
            if available == 0 || load >= self.locality.high_watermark {
                skipped = true;
                continue;
            }
            if let Some(d) = pick_in(t) {
                return Some(cross(d));
            }
        }
        // Nobody remote has headroom: an overloaded local tier still beats a remote
        // one (no added latency), then any remote tier.
        if local_allowed && why == CrossReason::LocalOverloaded {
            if let Some(d) = pick_in(0) {
                return Some(local_pick(d));
            }
        }
        if skipped {
            for t in 1..self.tiers.len() {
                if let Some(d) = pick_in(t) {
                    return Some(cross(d));
                }
            }
        }
        None
    }
}

impl Policy for Regional {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn pick_at(
        &self,
        req: &RouteRequest<'_>,
        workers: &[Arc<Worker>],
        accept: &dyn Fn(usize) -> bool,
        now: u64,
        rng: &mut dyn RngCore,
    ) -> Option<Decision> {
        self.pick_impl(req, workers, accept, now, rng)
    }

    fn record(&self, d: &Decision, req: &RouteRequest<'_>, workers: &[Arc<Worker>]) {
        self.inner.record(d, req, workers);
        if let (Some(step), Some(spill)) = (d.spill, &self.spill) {
            spill.apply(step);
        }
        if let (Some(reason), Some(w)) = (d.cross, workers.get(d.index)) {
            let to = w.region.map_or(self.to_labels.len() - 1, |r| r.0 as usize);
            counter!(
                names::CROSS_REGION_REQUESTS_TOTAL,
                names::L_FROM => self.from_label.clone(),
                names::L_TO => self.to_labels[to].clone(),
                names::L_REASON => reason.as_str()
            )
            .increment(1);
        }
    }

    fn predicted_cached_tokens(&self, d: &Decision, req: &RouteRequest<'_>) -> Option<u64> {
        self.inner.predicted_cached_tokens(d, req)
    }

    fn estimate_cost(&self, d: &Decision, req: &RouteRequest<'_>) -> Option<f64> {
        self.inner.estimate_cost(d, req)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::RequestInfo;
    use crate::config::{self, Config, Residency};
    use crate::pool::stats::{now_ms, parse_metrics};
    use crate::routing::{build, BuildContext};
    use std::time::Duration;

    fn locality(high: f64, low: f64, dwell_ms: u64) -> LocalityConfig {
        LocalityConfig {
            high_watermark: high,
            low_watermark: low,
            min_dwell: Duration::from_millis(dwell_ms),
        }
    }

    #[test]
    fn hysteresis_spills_at_high_and_returns_below_low_after_the_dwell() {
        let s = SpillState::new("t");
        let c = locality(0.8, 0.5, 1_000);
        assert_eq!(s.evaluate(10, true, 0.79, &c), None);
        assert_eq!(
            s.evaluate(20, true, 0.8, &c),
            Some(CrossReason::LocalOverloaded)
        );
        // Between the watermarks: still spilling, however long.
        assert!(s.evaluate(5_000, true, 0.6, &c).is_some());
        // Calm from t = 6000; a bump above the low watermark restarts the dwell.
        assert!(s.evaluate(6_000, true, 0.2, &c).is_some());
        assert!(s.evaluate(6_900, true, 0.55, &c).is_some());
        assert!(s.evaluate(7_000, true, 0.2, &c).is_some());
        assert!(s.evaluate(7_999, true, 0.2, &c).is_some());
        assert_eq!(s.evaluate(8_000, true, 0.2, &c), None);
        assert!(!s.is_spilling());
        // Unhealthy spills at once and returns only after a calm dwell too.
        assert_eq!(
            s.evaluate(9_000, false, 0.0, &c),
            Some(CrossReason::LocalUnhealthy)
        );
        assert_eq!(
            s.evaluate(9_100, true, 0.0, &c),
            Some(CrossReason::LocalUnhealthy)
        );
        assert_eq!(s.evaluate(10_100, true, 0.0, &c), None);
    }

    const REGIONS: &str = r#"
[server]
region = "eu-west"
[locality]
high_watermark = 0.8
low_watermark = 0.5
min_dwell_ms = 1000
[regions.eu-west]
spill_order = ["us-east", "eu-central"]
rtt_ms = { eu-central = 15, us-east = 80 }
[regions.eu-central]
rtt_ms = { us-east = 90 }
[regions.us-east]
[residency]
eu = ["eu-west", "eu-central"]
"#;

    struct Fixture {
        config: Config,
        workers: Vec<Arc<Worker>>,
        policy: Regional,
        spill: Arc<SpillState>,
    }

    /// Workers: 0, 1 in eu-west; 2 in eu-central; 3, 4 in us-east; 5 unlabelled.
    fn fixture(policy: &str, pool_extra: &str) -> Fixture {
        let text = format!(
            "{REGIONS}\n[[pools]]\nname = \"p\"\nmodels = [\"m\"]\npolicy = \"{policy}\"\nworkers = [\
             {{ url = \"http://w0:1\", labels = {{ region = \"eu-west\" }}, price_per_mtok = 3.0 }},\
             {{ url = \"http://w1:1\", labels = {{ region = \"eu-west\" }}, price_per_mtok = 3.0 }},\
             {{ url = \"http://w2:1\", labels = {{ region = \"eu-central\" }}, price_per_mtok = 1.0 }},\
             {{ url = \"http://w3:1\", labels = {{ region = \"us-east\" }}, price_per_mtok = 0.5 }},\
             {{ url = \"http://w4:1\", labels = {{ region = \"us-east\" }}, price_per_mtok = 0.5 }},\
             {{ url = \"http://w5:1\" }}]\n{pool_extra}\n"
        );
        let config = config::parse(&text).unwrap().validate().unwrap();
        let pc = &config.pools[0];
        let workers: Vec<Arc<Worker>> = pc
            .workers
            .iter()
            .map(|wc| {
                let mut w = Worker::new(&wc.url, wc.labels.clone(), Default::default()).unwrap();
                w.region = wc
                    .labels
                    .get(crate::config::global::REGION_LABEL)
                    .and_then(|r| config.global.region_id(r));
                Arc::new(w)
            })
            .collect();
        let spill = Arc::new(SpillState::new("p"));
        let ctx = BuildContext {
            kind: pc.policy,
            model: "m",
            pool: pc,
            workers: &workers,
            index: None,
            global: &config.global,
            spill: Some(&spill),
            kv: None,
        };
        // The policy alone (no regions: not wrapped), then wrapped explicitly.
        let inner = build(&BuildContext {
            global: &Default::default(),
            ..ctx
        });
        let policy = Regional::new(&ctx, inner);
        for w in &workers {
            w.state
                .stats
                .store(&parse_metrics("vllm:num_requests_running 0\n"), now_ms());
        }
        Fixture {
            config,
            workers,
            policy,
            spill,
        }
    }

    fn pick(
        f: &Fixture,
        res: Option<&Residency>,
        accept: &dyn Fn(usize) -> bool,
    ) -> Option<Decision> {
        let info = RequestInfo::default();
        let req = RouteRequest::new(&info, None).with_residency(res);
        let d = f.policy.pick(&req, &f.workers, accept)?;
        // As the proxy does: the decision is final (the spill state changes).
        f.policy.record(&d, &req, &f.workers);
        Some(d)
    }

    fn down(w: &Worker) {
        w.state.healthy.store(false, Ordering::Relaxed);
    }

    fn avail(f: &Fixture) -> impl Fn(usize) -> bool + '_ {
        |i| f.workers[i].is_available()
    }

    #[test]
    fn local_first_then_spill_order_then_residency() {
        let f = fixture("least_queue", "");
        for _ in 0..10 {
            let d = pick(&f, None, &avail(&f)).unwrap();
            assert!(d.index < 2 && d.cross.is_none(), "{d:?}");
        }
        // A retry that tried both local workers goes to the first spill region.
        let d = pick(&f, None, &|i| i >= 2).unwrap();
        assert!(matches!(d.index, 3 | 4), "{d:?}");
        assert_eq!(d.cross, Some(CrossReason::LocalExhausted));
        // Local region down: us-east first (spill order), but never for `eu`.
        down(&f.workers[0]);
        down(&f.workers[1]);
        let d = pick(&f, None, &avail(&f)).unwrap();
        assert!(matches!(d.index, 3 | 4));
        assert_eq!(d.cross, Some(CrossReason::LocalUnhealthy));
        assert!(f.spill.is_spilling());
        let eu = f.config.global.residency("eu").unwrap();
        let d = pick(&f, Some(&eu), &avail(&f)).unwrap();
        assert_eq!((d.index, d.cross), (2, Some(CrossReason::LocalUnhealthy)));
        down(&f.workers[2]);
        assert_eq!(pick(&f, Some(&eu), &avail(&f)), None);
        // A single-region residency outside the gateway's region: the local
        // region's health does not matter to it.
        let us = f.config.global.residency("us-east").unwrap();
        let d = pick(&f, Some(&us), &avail(&f)).unwrap();
        assert_eq!(d.cross, Some(CrossReason::Residency));
    }

    /// A pick changes no state: the spill state moves when the decision is
    /// recorded, with the change the pick decided on.
    #[test]
    fn the_spill_state_changes_on_record_not_on_pick() {
        let f = fixture("least_queue", "");
        down(&f.workers[0]);
        down(&f.workers[1]);
        let info = RequestInfo::default();
        let req = RouteRequest::new(&info, None);
        let dry = f.policy.pick(&req, &f.workers, &avail(&f)).unwrap();
        assert_eq!(dry.cross, Some(CrossReason::LocalUnhealthy));
        assert!(!f.spill.is_spilling(), "a pick alone changes nothing");
        let d = f.policy.pick(&req, &f.workers, &avail(&f)).unwrap();
        assert_eq!(d.cross, dry.cross);
        f.policy.record(&d, &req, &f.workers);
        assert!(f.spill.is_spilling());
    }

    #[test]
    fn residency_outside_the_local_region_is_a_cross_reason() {
        let f = fixture("round_robin", "");
        let us = f.config.global.residency("us-east").unwrap();
        for _ in 0..6 {
            let d = pick(&f, Some(&us), &avail(&f)).unwrap();
            assert!(matches!(d.index, 3 | 4));
            assert_eq!(d.cross, Some(CrossReason::Residency));
        }
        // The unlabelled worker is in no residency, and last for everyone else.
        let d = pick(&f, None, &|i| i == 5).unwrap();
        assert_eq!(d.index, 5);
    }

    #[test]
    fn overload_spills_with_hysteresis() {
        let f = fixture("least_queue", "max_concurrency_per_worker = 4");
        // Scrapes taken at `at`, so that nothing is stale at the explicit pick times.
        let at = std::cell::Cell::new(1_000);
        let load = |w: &Worker, q: u64| {
            let text = format!("vllm:num_requests_running {q}\n");
            w.state.stats.store(&parse_metrics(&text), at.get());
        };
        let fresh = |now| {
            at.set(now);
            for w in &f.workers {
                let (r, wq) = (
                    w.state.stats.running.load(Ordering::Relaxed),
                    w.state.stats.waiting.load(Ordering::Relaxed),
                );
                let text =
                    format!("vllm:num_requests_running {r}\nvllm:num_requests_waiting {wq}\n");
                w.state.stats.store(&parse_metrics(&text), now);
            }
        };
        let info = RequestInfo::default();
        let req = RouteRequest::new(&info, None);
        let regional = |now| {
            fresh(now);
            let d = f
                .policy
                .pick_at(&req, &f.workers, &|_| true, now, &mut rand::thread_rng())
                .unwrap();
            f.policy.record(&d, &req, &f.workers);
            d
        };
        load(&f.workers[0], 4);
        load(&f.workers[1], 3); // mean 0.875 ≥ 0.8
        let d = regional(1_000);
        assert_eq!(d.cross, Some(CrossReason::LocalOverloaded));
        assert!(matches!(d.index, 3 | 4));
        // 0.625: between the watermarks, still spilling.
        load(&f.workers[0], 2);
        load(&f.workers[1], 3);
        assert!(regional(5_000).cross.is_some());
        // Calm (0.25) from t = 6000; back home at t = 7000.
        load(&f.workers[0], 1);
        load(&f.workers[1], 1);
        assert!(regional(6_000).cross.is_some());
        assert!(regional(6_999).cross.is_some());
        let d = regional(7_000);
        assert!(d.index < 2 && d.cross.is_none(), "{d:?}");
        // Every remote tier over the bound too: the overloaded local tier keeps it.
        for (i, q) in [(0, 4), (1, 4), (2, 4), (3, 4), (4, 4), (5, 4)] {
            load(&f.workers[i], q);
        }
        let d = regional(8_000);
        assert!(d.index < 2, "{d:?}");
    }

    #[test]
    fn cost_takes_a_cheaper_remote_only_within_the_latency_budget() {
        // Budget 20 ms: eu-central (15 ms, $1) beats eu-west ($3); us-east ($0.5,
        // 80 ms) is out of reach.
        let f = fixture("cost", "[pools.routing]\nmax_added_latency_ms = 20");
        let d = pick(&f, None, &avail(&f)).unwrap();
        assert_eq!((d.index, d.cross), (2, Some(CrossReason::WithinBudget)));
        // Budget 100 ms: us-east is cheapest and within it.
        let f = fixture("cost", "[pools.routing]\nmax_added_latency_ms = 100");
        let d = pick(&f, None, &avail(&f)).unwrap();
        assert!(matches!(d.index, 3 | 4));
        assert_eq!(d.cross, Some(CrossReason::WithinBudget));
        // No budget: local only, however cheap the others are.
        let f = fixture("cost", "");
        let d = pick(&f, None, &avail(&f)).unwrap();
        assert!(d.index < 2 && d.cross.is_none());
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]
        /// Whatever is healthy, tried or allowed, a pick is never outside the
        /// request's residency, never refused by `accept`, and finds a worker
        /// whenever one is both allowed and accepted.
        #[test]
        fn residency_is_never_violated(
            healthy in 0u8..64, accepted in 0u8..64, zone in 0usize..4, policy in 0usize..7,
        ) {
            let (policy, extra) = [
                ("least_queue", ""),
                ("round_robin", ""),
                ("cost", ""),
                ("random", ""),
                ("prefix", ""),
                ("session", ""),
                ("weighted", "[pools.routing]\nscorers = [{ name = \"queue\", weight = 1.0 }, { name = \"cost\", weight = 0.5 }, { name = \"kv\", weight = 0.2 }]"),
            ][policy];
            let f = fixture(policy, extra);
            for (i, w) in f.workers.iter().enumerate() {
                if healthy & (1 << i) == 0 { down(w); }
            }
            let res = [None, Some("eu"), Some("us-east"), Some("eu-central,us-east")][zone]
                .map(|z| f.config.global.residency(z).unwrap());
            let ok = |i: usize| f.workers[i].is_available() && accepted & (1 << i) != 0;
            let d = pick(&f, res.as_ref(), &ok);
            let allowed = |i: usize| res.as_ref().is_none_or(|r| r.admits(f.workers[i].region));
            match d {
                Some(d) => {
                    proptest::prop_assert!(ok(d.index) && allowed(d.index), "{d:?}");
                }
                None => proptest::prop_assert!(!(0..6).any(|i| ok(i) && allowed(i))),
            }
        }
    }
}
