//! Choosing a worker. A policy is a pure function of the request's features and the
//! route's workers with their live stats: no I/O, no locks on the decision path
//! beyond the prefix index's sharded reads. The caller passes an `accept` predicate
//! that refuses workers already tried or unavailable.
//!
//! Policies: the baselines (`round_robin`, `random`) and the [`Pipeline`]: filters
//! (eligible labels, `accept`, stale stats) → weighted scorers in [0, 1] (prefix,
//! queue, cost, session, kv; one [`scorers::Scorer`] each, in `scorers/`) →
//! bounded-load / headroom spill → the highest score,
//! ties broken by rendezvous hashing on a stable request key. `least_queue`,
//! `cost` and `session` are presets of the pipeline; `weighted` takes its scorers
//! from the config. `prefix` is a policy of its own ([`PrefixPolicy`],
//! `prefix.rs`: estimated time to first token) over the pipeline's candidates
//! and prefix index.
//!
//! Global routing wraps any of them: [`Regional`] (`region.rs`) first filters by
//! the request's residency (a hard constraint) and then offers the policy one
//! locality tier at a time — the gateway's region (plus regions within the pool's
//! latency budget), then the spill order — with hysteresis on the local tier's
//! load. [`WeightedSplit`] (`split.rs`) resolves a split model name to a pool
//! before any of this.

mod baseline;
mod pipeline;
mod prefix;
pub mod prefix_index;
#[cfg(test)]
mod properties;
pub mod region;
pub mod rendezvous;
pub mod scorers;
pub mod split;

pub use baseline::{RandomPolicy, RoundRobin};
pub use pipeline::{hash_blocks, Pipeline};
pub use prefix::PrefixPolicy;
pub use prefix_index::PrefixIndex;
pub use region::{
    request_residency, CrossReason, Regional, SpillState, SpillStep, RESIDENCY_HEADER,
};
pub use split::WeightedSplit;

use crate::api::inspect::Endpoint;
use crate::api::RequestInfo;
use crate::config::{GlobalConfig, PolicyKind, PoolConfig, Residency};
use crate::kv_events::PoolKv;
use crate::pool::stats::now_ms;
use crate::pool::Worker;
use rand::RngCore;
use std::sync::{Arc, OnceLock};

/// Why a worker was chosen; a low-cardinality metric label.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reason {
    RoundRobin,
    Random,
    /// Lowest estimated queue.
    LeastQueue,
    /// The worker holds the longest run of the request's leading prefix blocks.
    PrefixHit,
    /// No worker holds the prefix: placed by rendezvous hashing of its first blocks.
    NewPrefix,
    /// The preferred worker was over the load bound (or without headroom): the
    /// request went to the next candidate.
    SpillOverload,
    /// The cheapest worker with headroom.
    Cheapest,
    /// The rendezvous owner of the request's session key.
    Session,
    /// Lowest KV-cache usage.
    LeastKv,
    /// Disaggregation: the prefill worker answered for the client (its error).
    Prefill,
    /// Disaggregation: the decode worker, chosen by load.
    Decode,
    /// The worker holding the stored response the request continues.
    Owner,
    /// The most headroom against the request's latency objectives (or the
    /// shortest predicted time to first token).
    SloHeadroom,
}

impl Reason {
    pub const ALL: &'static [Reason] = &[
        Reason::RoundRobin,
        Reason::Random,
        Reason::LeastQueue,
        Reason::PrefixHit,
        Reason::NewPrefix,
        Reason::SpillOverload,
        Reason::Cheapest,
        Reason::Session,
        Reason::LeastKv,
        Reason::Prefill,
        Reason::Decode,
        Reason::Owner,
        Reason::SloHeadroom,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Reason::RoundRobin => "round_robin",
            Reason::Random => "random",
            Reason::LeastQueue => "least_queue",
            Reason::PrefixHit => "prefix_hit",
            Reason::NewPrefix => "new_prefix",
            Reason::SpillOverload => "spill_overload",
            Reason::Cheapest => "cheapest",
            Reason::Session => "session",
            Reason::LeastKv => "least_kv",
            Reason::Prefill => "pd_prefill",
            Reason::Decode => "pd_decode",
            Reason::Owner => "response_owner",
            Reason::SloHeadroom => "slo_headroom",
        }
    }
}

/// A policy's choice: the index into the route's workers, and why.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decision {
    pub index: usize,
    pub reason: Reason,
    /// Set by [`Regional`] when the worker is outside the gateway's region: why.
    pub cross: Option<CrossReason>,
    /// Set by [`Regional`] with locality tiers: the pool's spill-state change,
    /// made when the decision is recorded (a pick itself changes nothing).
    pub spill: Option<SpillStep>,
}

impl Decision {
    pub fn new(index: usize, reason: Reason) -> Decision {
        Decision {
            index,
            reason,
            cross: None,
            spill: None,
        }
    }
}

/// What a policy may look at besides the workers. Derived features (prefix block
/// hashes) are computed once per request and shared by retries and `record`.
pub struct RouteRequest<'a> {
    pub info: &'a RequestInfo,
    /// `x-session-id` header, when present.
    pub session: Option<&'a str>,
    /// The regions the request may be served in (tenant and/or header); `None`:
    /// anywhere.
    pub residency: Option<&'a Residency>,
    /// The endpoint and body, for policies that tokenize the prompt.
    pub body: Option<(Endpoint, &'a [u8])>,
    blocks: OnceLock<Vec<u64>>,
    /// The precise index's block keys of the prompt tokens, and how many tokens
    /// the prompt has (`None`: the prompt could not be tokenized).
    prompt_keys: OnceLock<Option<(Vec<u64>, u64)>>,
    /// The last cache prediction came from the precise index.
    precise: std::sync::atomic::AtomicBool,
    /// The last pick's precise lookup, for the cache prediction after it.
    precise_held: parking_lot::Mutex<Option<Box<PreciseHeld>>>,
    /// Time since the request arrived (ms) when this pick runs — the wait in the
    /// gateway's queue counts against a TTFT objective.
    pub elapsed_ms: f64,
}

/// Blocks of the prompt each slot of a precise index held (any tier) at the
/// last pick: the cache prediction for the chosen worker reads it instead of
/// looking the prompt up again. Boxed, allocated once per request, so the
/// request's future stays small.
struct PreciseHeld {
    /// Which index (its address): a fallback policy may read another.
    index: usize,
    blocks: [u32; crate::kv_events::MAX_WORKERS],
}

impl<'a> RouteRequest<'a> {
    pub fn new(info: &'a RequestInfo, session: Option<&'a str>) -> RouteRequest<'a> {
        RouteRequest {
            info,
            session,
            residency: None,
            body: None,
            blocks: OnceLock::new(),
            prompt_keys: OnceLock::new(),
            precise: Default::default(),
            precise_held: Default::default(),
            elapsed_ms: 0.0,
        }
    }

    /// The prompt's exact token count, once a policy has tokenized it (the
    /// precise index's lookup); `None` before or without that.
    pub fn prompt_tokens(&self) -> Option<u64> {
        self.prompt_keys.get()?.as_ref().map(|(_, n)| *n)
    }

    /// Whether the last [`Policy::predicted_cached_tokens`] for this request
    /// came from the engines' KV events (the precise index).
    pub fn predicted_precisely(&self) -> bool {
        self.precise.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub(crate) fn set_predicted_precisely(&self, v: bool) {
        self.precise.store(v, std::sync::atomic::Ordering::Relaxed);
    }

    /// Keep the depths a pick looked up in the precise index `index` (its
    /// address), or forget them (`None`: that pick had no precise lookup).
    pub(crate) fn keep_precise_held(&self, held: Option<(usize, &crate::kv_events::Depths)>) {
        let mut kept = self.precise_held.lock();
        match (held, &mut *kept) {
            (None, k) => *k = None,
            (Some((index, d)), Some(k)) => {
                k.index = index;
                k.blocks = d.map(|r| r[2]);
            }
            (Some((index, d)), k) => {
                *k = Some(Box::new(PreciseHeld {
                    index,
                    blocks: d.map(|r| r[2]),
                }))
            }
        }
    }

    /// The blocks `slot` held at the last pick's lookup of the precise index
    /// `index` (`Some(None)`: no slot); `None` when that pick did not look there.
    pub(crate) fn precise_held(&self, index: usize, slot: Option<u8>) -> Option<Option<u32>> {
        let kept = self.precise_held.lock();
        let k = kept.as_ref().filter(|k| k.index == index)?;
        Some(slot.and_then(|s| k.blocks.get(s as usize).copied()))
    }

    /// The same request with its endpoint and body (to tokenize the prompt).
    pub fn with_body(mut self, endpoint: Endpoint, body: &'a [u8]) -> RouteRequest<'a> {
        self.body = Some((endpoint, body));
        self
    }

    /// The precise index's keys of the prompt and its token count, computed on
    /// first use.
    pub fn prompt_keys(
        &self,
        f: impl FnOnce() -> Option<(Vec<u64>, u64)>,
    ) -> Option<(&[u64], u64)> {
        self.prompt_keys
            .get_or_init(f)
            .as_ref()
            .map(|(k, n)| (k.as_slice(), *n))
    }

    /// The same request restricted to `residency`.
    pub fn with_residency(mut self, residency: Option<&'a Residency>) -> RouteRequest<'a> {
        self.residency = residency;
        self
    }

    /// Whether the request may be served by `worker` (its residency allows the
    /// worker's region).
    #[inline]
    pub fn allows(&self, worker: &Worker) -> bool {
        self.residency.is_none_or(|r| r.admits(worker.region))
    }

    /// The session key: `x-session-id`, else the body's `user`.
    pub fn session_key(&self) -> Option<&str> {
        self.session.or(self.info.user.as_deref())
    }

    /// The chained block hashes of the routing text, computed on first use.
    pub fn blocks(&self, f: impl FnOnce() -> Vec<u64>) -> &[u64] {
        self.blocks.get_or_init(f)
    }
}

/// A routing policy.
pub trait Policy: Send + Sync {
    fn name(&self) -> &'static str;

    /// Pick one of `workers` for which `accept(index)` holds, or `None` if none does,
    /// at `now` (`pool::stats::now_ms` scale) and drawing any randomness from `rng`:
    /// the clock and the randomness are inputs, so equal inputs give equal picks
    /// (round robin aside: its cursor is its state).
    fn pick_at(
        &self,
        req: &RouteRequest<'_>,
        workers: &[Arc<Worker>],
        accept: &dyn Fn(usize) -> bool,
        now: u64,
        rng: &mut dyn RngCore,
    ) -> Option<Decision>;

    /// [`Policy::pick_at`] now, with the thread's RNG.
    fn pick(
        &self,
        req: &RouteRequest<'_>,
        workers: &[Arc<Worker>],
        accept: &dyn Fn(usize) -> bool,
    ) -> Option<Decision> {
        self.pick_at(req, workers, accept, now_ms(), &mut rand::thread_rng())
    }

    /// The decision is final and the request is about to be sent: update any state
    /// the policy learns from (the prefix index, the locality spill state). Picks
    /// change nothing; this is where state changes.
    fn record(&self, _decision: &Decision, _req: &RouteRequest<'_>, _workers: &[Arc<Worker>]) {}

    /// Prompt tokens the policy expects the chosen worker to have cached (prefix
    /// index), computed before `record`; `None` when the policy keeps no index.
    fn predicted_cached_tokens(
        &self,
        _decision: &Decision,
        _req: &RouteRequest<'_>,
    ) -> Option<u64> {
        None
    }

    /// Estimated cost of the request on the chosen worker (USD), when priced.
    fn estimate_cost(&self, _decision: &Decision, _req: &RouteRequest<'_>) -> Option<f64> {
        None
    }
}

/// Test support: a pool config's workers (with a prefix index over them) and
/// what `make` builds from the context the registry would give a policy.
#[cfg(test)]
pub(crate) fn build_for_test<T>(
    pc: &PoolConfig,
    make: impl FnOnce(&BuildContext<'_>) -> T,
) -> (Vec<Arc<Worker>>, T) {
    build_for_test_with_kv(pc, None, make)
}

/// [`build_for_test`] with the pool's precise (KV-event) state.
#[cfg(test)]
pub(crate) fn build_for_test_with_kv<T>(
    pc: &PoolConfig,
    kv: Option<&Arc<PoolKv>>,
    make: impl FnOnce(&BuildContext<'_>) -> T,
) -> (Vec<Arc<Worker>>, T) {
    let workers: Vec<Arc<Worker>> = pc
        .workers
        .iter()
        .map(|wc| Arc::new(Worker::new(&wc.url, wc.labels.clone(), Default::default()).unwrap()))
        .collect();
    let index = Arc::new(PrefixIndex::new(pc.routing.index_max_blocks));
    index.set_workers(&workers.iter().map(|w| w.id.clone()).collect::<Vec<_>>());
    let built = make(&BuildContext {
        kind: pc.policy,
        model: "m",
        pool: pc,
        workers: &workers,
        index: Some(&index),
        global: &Default::default(),
        spill: None,
        kv,
    });
    (workers, built)
}

/// What building a route's policy needs.
pub struct BuildContext<'a> {
    pub kind: PolicyKind,
    /// The model as configured (seeds prefix hashes).
    pub model: &'a str,
    pub pool: &'a PoolConfig,
    /// The route's workers, in the order `pick` will see them.
    pub workers: &'a [Arc<Worker>],
    /// The pool's prefix index, when the pool keeps one.
    pub index: Option<&'a Arc<PrefixIndex>>,
    /// Regions, the gateway's region and the locality settings.
    pub global: &'a GlobalConfig,
    /// The pool's locality state (kept by the registry across rebuilds); locality
    /// tiers are used only with it and a gateway region.
    pub spill: Option<&'a Arc<SpillState>>,
    /// The pool's precise (KV-event) index and tokenizer, when its engines publish events.
    pub kv: Option<&'a Arc<PoolKv>>,
}

/// Instantiate a route's policy: the pool's policy, wrapped in the residency
/// filter and locality tiers when regions are configured.
pub fn build(ctx: &BuildContext<'_>) -> Box<dyn Policy> {
    let inner: Box<dyn Policy> = match ctx.kind {
        PolicyKind::RoundRobin => Box::new(RoundRobin::default()),
        PolicyKind::Random => Box::new(RandomPolicy),
        PolicyKind::Prefix => Box::new(PrefixPolicy::new(ctx)),
        _ => Box::new(Pipeline::new(ctx)),
    };
    if ctx.global.regions.is_empty() {
        inner
    } else {
        Box::new(Regional::new(ctx, inner))
    }
}

/// Whether a pool needs a prefix index (its policy or an allowed override uses one).
pub fn needs_index(pool: &PoolConfig) -> bool {
    pool.routing.allow_policy_override
        || pool.policy == PolicyKind::Prefix
        || pool.policy == PolicyKind::Slo
        || pool
            .routing
            .scorers
            .iter()
            .any(|(k, _)| scorers::build(k).is_some_and(|s| s.uses_prefix()))
}

#[cfg(test)]
pub(crate) mod test_support {
    use super::*;

    pub fn workers(n: usize) -> Vec<Arc<Worker>> {
        (0..n)
            .map(|i| {
                Arc::new(
                    Worker::new(
                        &format!("http://w{i}:80"),
                        Default::default(),
                        Default::default(),
                    )
                    .unwrap(),
                )
            })
            .collect()
    }
}
