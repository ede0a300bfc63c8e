//! The request's side of flow control (`pool::flow`): its priority class, what
//! it brings to the queue (fairness flow, weight, token cost, bytes), and the
//! cold-start phase — a request for a pool with no ready worker waits within its
//! TTL (while the scaling signal asks for a replica) and is then forwarded on the
//! route of the snapshot that has one.

use super::forward::ForwardContext;
use super::GatewayError;
use crate::config::flow::DEFAULT_EXPECTED_OUTPUT_TOKENS;
use crate::config::FairnessKey;
use crate::pool::flow::{Place, Priority, QueueError, Ticket};
use crate::routes::ModelRoute;
use std::sync::Arc;

/// The request's class, settled at admission (`tenancy::claims`).
pub(super) fn priority(ctx: &ForwardContext<'_>) -> Priority {
    ctx.tags.priority
}

/// What the request brings to its pool's queue: class, fairness flow and its
/// weight, token cost (prompt estimate + `max_tokens` or the expected output),
/// body bytes.
pub(super) fn ticket<'c>(ctx: &'c ForwardContext<'_>, prio: Priority, front: bool) -> Ticket<'c> {
    let flow_cfg = ctx.route.pool.config.flow.as_ref();
    let flow: &'c str = match flow_cfg.map(|f| &f.fairness_key) {
        Some(FairnessKey::Header(h)) => ctx
            .parts
            .headers
            .get(h.as_str())
            .and_then(|v| v.to_str().ok())
            .unwrap_or(""),
        _ => &ctx.tags.tenant.name,
    };
    let expected = flow_cfg.map_or(DEFAULT_EXPECTED_OUTPUT_TOKENS, |f| f.expected_output_tokens);
    Ticket {
        prio,
        flow,
        weight: flow_cfg.map_or(1.0, |f| f.weight(flow)),
        cost: ctx.size(0).tokens + ctx.info.max_tokens.unwrap_or(expected),
        bytes: ctx.body.len() as u64,
        front,
        declined: false,
    }
}

/// The gateway error for a request the queue let go.
pub(super) fn queue_error(ctx: &ForwardContext<'_>, e: QueueError) -> GatewayError {
    let pool = ctx.route.pool.name.to_string();
    match e {
        QueueError::Full => GatewayError::QueueFull(pool),
        QueueError::Timeout => GatewayError::QueueTimeout(pool),
        QueueError::Evicted => GatewayError::QueueEvicted(pool),
        // Only waits given an objective's deadline end so; they map it themselves.
        QueueError::Objective => GatewayError::QueueTimeout(pool),
    }
}

/// Phase: cold start. When the route's pool scales from zero and none of its
/// workers is ready, wait in the pool's queue — woken by every snapshot rebuild
/// and stats scrape — until the current snapshot's route for this model has a
/// ready worker; that route is returned (`None`: no wait was needed).
pub(super) async fn cold_start(
    ctx: &ForwardContext<'_>,
) -> Result<Option<Arc<ModelRoute>>, GatewayError> {
    let pool = &ctx.route.pool;
    let (Some(q), Some(routes)) = (pool.queue.as_deref(), ctx.routes) else {
        return Ok(None);
    };
    if ctx.pinned.is_some() {
        // Only its owner holds the state: a worker started now would not.
        return Ok(None);
    }
    if !pool.config.flow.as_ref().is_some_and(|f| f.scale_from_zero) || ready(ctx, ctx.route) {
        return Ok(None);
    }
    tracing::info!(pool = %pool.name, "no ready worker: waiting for one (scale from zero)");
    let ticket = ticket(ctx, priority(ctx), false);
    let mut place: Option<Place<'_>> = None;
    let waited = crate::runtime::clock::now();
    let r = loop {
        if let Err(e) = Box::pin(q.wait(&ticket, &mut place, None)).await {
            break Err(queue_error(ctx, e));
        }
        let fresh = routes.snapshot().route(&ctx.route.model).cloned();
        if let Some(route) = fresh.filter(|r| ready(ctx, r)) {
            q.dispatched(place.take());
            break Ok(Some(route));
        }
    };
    ctx.tags.add_queued(waited.elapsed());
    r
}

/// `route` has a worker ready for this request.
fn ready(ctx: &ForwardContext<'_>, route: &ModelRoute) -> bool {
    route
        .workers
        .iter()
        .any(|w| w.is_available() && ctx.allows(w))
}
