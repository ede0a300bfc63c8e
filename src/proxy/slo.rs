//! The latency-objective check of a request's first pick: may some worker meet
//! the request's `x-slo-ttft-ms` / `x-slo-tpot-ms` by its learnt latency model?
//! If none is predicted to, the pool sheds the request (503 with `Retry-After`,
//! reason `slo_unattainable`) or serves it on the chosen worker marked as
//! downgraded (`x-switchyard-slo: downgraded`, the access log's
//! `slo_downgraded`), as `[pools.routing].slo_unattainable` says. A worker whose
//! model has not learnt enough counts as able to: nothing is shed on a guess.
//!
//! A request held in the pool's flow-control queue is judged while it waits: in
//! a shedding pool it leaves the queue as soon as the time it has waited plus the
//! best TTFT any eligible worker predicts for it passes its objective
//! ([`hold_until`]), instead of waiting out its class's TTL for an answer that
//! would come too late.

use super::error::GatewayError;
use super::forward::ForwardContext;
use crate::config::SloUnattainable;
use crate::pool::RequestSize;
use crate::routing::{Decision, Policy, RouteRequest};
use crate::telemetry::names;
use http::HeaderName;
use metrics::counter;
use std::time::Duration;
use tokio::time::Instant;

/// Response header on an answer served below its objective.
pub const SLO_HEADER: HeaderName = HeaderName::from_static("x-switchyard-slo");

/// What the models say about the request's objective.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Verdict {
    /// Some worker is predicted to meet it.
    Met,
    /// Some eligible worker has no model yet.
    Unknown,
    /// Nobody is; the best predicted TTFT from arrival (ms) and the overshoot.
    Missed { ttft_ms: f64, over_ms: f64 },
}

/// Phase: select, the objective check (first attempt only). `Err`: shed.
pub(super) fn check(
    ctx: &ForwardContext<'_>,
    policy: &dyn Policy,
    rreq: &RouteRequest<'_>,
    decision: &Decision,
    eligible: &dyn Fn(usize) -> bool,
) -> Result<(), GatewayError> {
    if !rreq.info.slo.is_set() {
        return Ok(());
    }
    settle(ctx, assess(ctx, policy, rreq, decision, eligible))
}

/// Count the verdict; shed the request (`Err`) or mark it downgraded when it
/// missed, as the pool says.
pub(super) fn settle(ctx: &ForwardContext<'_>, verdict: Verdict) -> Result<(), GatewayError> {
    let shed = ctx.route.pool.config.routing.slo_unattainable == SloUnattainable::Shed;
    let result = match verdict {
        Verdict::Met => "met",
        Verdict::Unknown => "unknown",
        Verdict::Missed { .. } if shed => "shed",
        Verdict::Missed { .. } => "downgraded",
    };
    counter!(names::SLO_DECISIONS_TOTAL,
        names::L_POOL => ctx.route.pool.metrics.name.clone(), names::L_RESULT => result)
    .increment(1);
    match verdict {
        Verdict::Missed { ttft_ms, over_ms } if shed => Err(unattainable(ctx, ttft_ms, over_ms)),
        Verdict::Missed { .. } => {
            ctx.tags.downgrade_slo();
            Ok(())
        }
        _ => Ok(()),
    }
}

/// The shedding error: the best predicted TTFT from arrival and, for
/// `Retry-After`, how far it overshoots.
fn unattainable(ctx: &ForwardContext<'_>, ttft_ms: f64, over_ms: f64) -> GatewayError {
    GatewayError::SloUnattainable {
        model: ctx.route.model.to_string(),
        predicted_ttft_ms: ttft_ms.round() as u64,
        retry_after_s: (over_ms / 1000.0).ceil().clamp(1.0, 60.0) as u32,
    }
}

/// How long a request may be held in the pool's queue and still meet its TTFT
/// objective: until the objective less the best TTFT an eligible worker
/// predicts for it now (a lower bound: it is not sent yet). `None` when the pool
/// does not shed, the request sets no TTFT objective, or an eligible worker has
/// no model yet. With the deadline, that best prediction (ms). `size`: the
/// request's, measured as the models learn it (`ForwardContext::size_exact`).
pub(super) fn hold_until(
    ctx: &ForwardContext<'_>,
    size: RequestSize,
    eligible: &dyn Fn(usize) -> bool,
) -> Option<(Instant, f64)> {
    if ctx.route.pool.config.routing.slo_unattainable != SloUnattainable::Shed {
        return None;
    }
    let target = ctx.info.slo.ttft_ms?;
    let mut best = f64::INFINITY;
    for (i, w) in ctx.route.workers.iter().enumerate() {
        if eligible(i) {
            best = best.min(w.predict(size)?.ttft_ms);
        }
    }
    let slack_ms = (f64::from(target) - best).max(0.0);
    best.is_finite()
        .then(|| (ctx.start + Duration::from_secs_f64(slack_ms / 1e3), best))
}

/// A held request's objective passed while it waited: shed it, counted as an
/// objective decision.
pub(super) fn shed_held(ctx: &ForwardContext<'_>, best_ms: f64) -> GatewayError {
    counter!(names::SLO_DECISIONS_TOTAL,
        names::L_POOL => ctx.route.pool.metrics.name.clone(), names::L_RESULT => "shed")
    .increment(1);
    let ttft_ms = ctx.start.elapsed().as_secs_f64() * 1e3 + best_ms;
    let over = ctx.info.slo.ttft_ms.map_or(0.0, |t| ttft_ms - f64::from(t));
    unattainable(ctx, ttft_ms, over)
}

/// The chosen worker with its predicted cache hit, then every other eligible
/// worker (without one), against the objective.
fn assess(
    ctx: &ForwardContext<'_>,
    policy: &dyn Policy,
    rreq: &RouteRequest<'_>,
    decision: &Decision,
    eligible: &dyn Fn(usize) -> bool,
) -> Verdict {
    let elapsed_ms = ctx.start.elapsed().as_secs_f64() * 1e3;
    let cached = policy.predicted_cached_tokens(decision, rreq).unwrap_or(0);
    let others = (0..ctx.route.workers.len()).filter(|&i| i != decision.index && eligible(i));
    let mut best: Option<(f64, f64)> = None;
    for i in std::iter::once(decision.index).chain(others) {
        let size = ctx.size_exact(rreq, if i == decision.index { cached } else { 0 });
        let Some(p) = ctx.route.workers[i].predict(size) else {
            return Verdict::Unknown;
        };
        let Some(h) = p.headroom(&rreq.info.slo, elapsed_ms) else {
            return Verdict::Unknown; // only a TPOT objective, no TPOT learnt yet
        };
        if h >= 0.0 {
            return Verdict::Met;
        }
        let ttft = elapsed_ms + p.ttft_ms;
        let over = rreq.info.slo.ttft_ms.map_or(0.0, |t| ttft - f64::from(t));
        if best.is_none_or(|(b, _)| ttft < b) {
            best = Some((ttft, over));
        }
    }
    match best {
        Some((ttft_ms, over_ms)) => Verdict::Missed { ttft_ms, over_ms },
        None => Verdict::Unknown,
    }
}
