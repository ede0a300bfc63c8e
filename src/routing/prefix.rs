//! The `prefix` policy: the worker where the request should see its first token
//! soonest — its wait plus the prompt tokens it does not hold — with three biases
//! that keep caches useful:
//!
//! * workers over the load bound (in requests) get no new prefixes, and a holder
//!   is compared with the best worker within the bound;
//! * a worker holding the prefix wins while its estimate is within half the
//!   prompt of the best, so a prefix moves (is replicated) only when its holder
//!   is clearly busier than the prefill saved there;
//! * otherwise (a new prefix, or a spill) the prefix is placed on a worker with
//!   room for it in its cache and a footprint within bounds, if any (so that
//!   distinct prefixes spread evenly over the caches, as SGLang's cache_aware
//!   does by placing them on its smallest tree); among those, by rendezvous
//!   hashing among the ones within two queued requests of the least loaded — at
//!   low load all of them, so replicas agree and a forgotten prefix returns where
//!   it was; under load the least loaded, as `least_queue` would.
//!
//! It shares the pipeline's candidates, prefix index and block hashes (a
//! [`Pipeline`] with the prefix scorer), but not its weighted scoring.

use super::pipeline::{mean_queue, Candidates, Pipeline, QUEUE_TOKENS, TIE};
use super::scorers::{Candidate, PickView};
use super::{rendezvous, BuildContext, Decision, Policy, Reason, RouteRequest};
use crate::pool::Worker;
use rand::RngCore;
use std::sync::Arc;

/// The `prefix` policy (see the module docs).
pub struct PrefixPolicy {
    core: Pipeline,
}

/// A candidate's estimated time to first token, in prompt tokens, and the load
/// bound placements respect.
struct Estimate {
    prompt: f64,
    block_tokens: f64,
    bound: f64,
    any_within: bool,
}

impl Estimate {
    fn total(&self, c: &Candidate) -> f64 {
        c.wait + (self.prompt - c.depth as f64 * self.block_tokens).max(0.0)
    }

    /// Within the load bound, or nobody is.
    fn allowed(&self, c: &Candidate) -> bool {
        !self.any_within || c.queue <= self.bound
    }
}

impl PrefixPolicy {
    /// `ctx.kind` is `prefix`.
    pub fn new(ctx: &BuildContext<'_>) -> PrefixPolicy {
        PrefixPolicy {
            core: Pipeline::new(ctx),
        }
    }

    fn pick(&self, view: &PickView<'_>, cands: &mut [Candidate]) -> Option<Decision> {
        let core = &self.core;
        let text = view.req.info.routing_text.as_ref();
        let prompt = text.map_or(0, |t| t.len() as u64) / core.bytes_per_token;
        let bound = (1.0 + core.load_epsilon) * mean_queue(cands) + core.load_slack;
        let est = Estimate {
            prompt: prompt as f64,
            block_tokens: core.block_tokens as f64,
            bound,
            any_within: cands.iter().any(|c| c.queue <= bound),
        };
        if let Some(d) = Self::holder(view, cands, &est) {
            return Some(d);
        }
        self.place(view, cands, &est)
    }

    /// A holder within the tolerance (the one with the lowest estimate), if any.
    fn holder(view: &PickView<'_>, cands: &[Candidate], est: &Estimate) -> Option<Decision> {
        let best = cands
            .iter()
            .filter(|c| est.allowed(c))
            .map(|c| est.total(c))
            .fold(f64::MAX, f64::min);
        // A holder keeps the prefix while within half the prompt of the best
        // worker within the load bound (one prefill queued ahead is tolerated,
        // two are not) — even when it is over the bound
        // itself: its requests are cheap there (mostly cached), and a copy
        // elsewhere costs a whole prefill plus cache space. The bound applies to
        // holders through their wait, to placements through their queue.
        let keep = (est.prompt / 2.0).max(2.0 * QUEUE_TOKENS);
        let mut hit: Option<(&Candidate, f64, u64)> = None;
        for c in cands
            .iter()
            .filter(|c| c.depth > 0 && est.total(c) <= best + keep)
        {
            let t = est.total(c);
            let w = rendezvous::weight(view.key, view.workers[c.i].id_hash);
            match hit {
                Some((_, bt, bw)) if t > bt + TIE || (t >= bt - TIE && w <= bw) => {}
                _ => hit = Some((c, t, w)),
            }
        }
        let (c, _, _) = hit?;
        let reason = if c.depth == view.max_depth {
            Reason::PrefixHit
        } else {
            Reason::SpillOverload
        };
        Some(Decision::new(c.i, reason))
    }

    /// Place the prefix: rendezvous hashing among the near workers, preferring
    /// those with room for it in their cache and whose footprint (blocks the
    /// index attributes to them) stays within (1 + ε) of the mean after the
    /// placement, or within one such prefix of the least filled — bounded-load
    /// consistent hashing on cache space, so distinct prefixes spread evenly.
    fn place(
        &self,
        view: &PickView<'_>,
        cands: &mut [Candidate],
        est: &Estimate,
    ) -> Option<Decision> {
        let (workers, key) = (view.workers, view.key);
        self.mark_room(workers, cands, view.n_blocks as u64);
        // Cache space first (where the prefix will be reused), then load: within
        // the first tier that has candidates, the workers within two queued
        // requests of its least loaded, by rendezvous weight.
        let cands = &*cands;
        let place = |tier: &dyn Fn(&Candidate) -> bool| {
            let best = cands
                .iter()
                .filter(|c| est.allowed(c) && tier(c))
                .map(|c| est.total(c))
                .fold(f64::MAX, f64::min);
            rendezvous::pick(
                key,
                cands
                    .iter()
                    .filter(|c| {
                        est.allowed(c) && tier(c) && est.total(c) <= best + 2.0 * QUEUE_TOKENS
                    })
                    .map(|c| (c.i, workers[c.i].id_hash)),
            )
        };
        let index = place(&|c| c.room && c.fits)
            .or_else(|| place(&|c| c.fits))
            .or_else(|| place(&|_| true))?;
        if tracing::enabled!(tracing::Level::TRACE) {
            for c in cands.iter() {
                tracing::trace!(
                    worker = %workers[c.i].id, chosen = c.i == index, total = est.total(c),
                    queue = c.queue, footprint = c.footprint, room = c.room, fits = c.fits,
                    cap = self.core.capacity_blocks(&workers[c.i]), n_blocks = view.n_blocks,
                    "prefix placement"
                );
            }
        }
        let reason = if view.max_depth == 0 {
            Reason::NewPrefix
        } else {
            Reason::SpillOverload
        };
        Some(Decision::new(index, reason))
    }

    /// Set each candidate's footprint, and whether `n` more blocks fit its cache
    /// (`room`) and keep its footprint within the bound (`fits`).
    fn mark_room(&self, workers: &[Arc<Worker>], cands: &mut [Candidate], n: u64) {
        let core = &self.core;
        let Some(ix) = &core.index else { return };
        let fp = ix.footprints();
        let (mut sum, mut min) = (0u64, u64::MAX);
        for c in cands.iter_mut() {
            c.footprint = fp.get(core.slots[c.i]);
            sum += c.footprint;
            min = min.min(c.footprint);
        }
        let limit = ((1.0 + core.load_epsilon) * (sum + n) as f64 / cands.len() as f64)
            .max(min.saturating_add(n) as f64);
        for c in cands.iter_mut() {
            let cap = ix.effective_capacity(core.capacity_blocks(&workers[c.i]));
            c.room = c.footprint + n <= cap;
            c.fits = (c.footprint + n) as f64 <= limit;
        }
    }
}

impl Policy for PrefixPolicy {
    fn name(&self) -> &'static str {
        "prefix"
    }

    fn pick_at(
        &self,
        req: &RouteRequest<'_>,
        workers: &[Arc<Worker>],
        accept: &dyn Fn(usize) -> bool,
        now: u64,
        _rng: &mut dyn RngCore,
    ) -> Option<Decision> {
        let mut cands = Candidates::new();
        let view = self.core.gather(req, workers, accept, now, &mut cands)?;
        self.pick(&view, &mut cands)
    }

    fn record(&self, d: &Decision, req: &RouteRequest<'_>, workers: &[Arc<Worker>]) {
        self.core.record(d, req, workers)
    }

    fn predicted_cached_tokens(&self, d: &Decision, req: &RouteRequest<'_>) -> Option<u64> {
        self.core.predicted_cached_tokens(d, req)
    }

    fn estimate_cost(&self, d: &Decision, req: &RouteRequest<'_>) -> Option<f64> {
        self.core.estimate_cost(d, req)
    }
}
