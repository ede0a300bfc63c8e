//! The fallback chain: the route's pool first, then each pool its config names,
//! while nothing has reached the client and the failure is one another pool
//! could fix (down, saturated, upstream errors). A pool with no worker inside the
//! request's residency is passed over, never tried.

use super::{for_pool, forward, ForwardContext, GatewayError};
use crate::routes::{ModelRoute, Snapshot};
use crate::telemetry::{self, names};
use axum::body::Body;
use bytes::Bytes;
use http::Response;
use smallvec::SmallVec;
use std::sync::Arc;

/// Forward `ctx` (whose route is the request's own) and fall back along the
/// chain. `body` is the request body before any pool's model rewrite. The
/// context is taken by reference and changed in place on a fallback: these
/// futures are moved whole, and a context held by value is a few hundred bytes
/// more in each.
pub async fn forward_with_fallbacks<'a>(
    ctx: &mut ForwardContext<'a>,
    snap: &'a Snapshot,
    body: &Bytes,
) -> Result<Response<Body>, GatewayError> {
    match super::flow::cold_start(ctx).await? {
        Some(route) => {
            let mut cold = ForwardContext {
                route: &route,
                body: ctx.body.clone(),
                ..*ctx
            };
            Box::pin(along_chain(&mut cold, snap, body)).await
        }
        None => along_chain(ctx, snap, body).await,
    }
}

/// Forward on `ctx`'s route, then along its pool's fallback chain.
async fn along_chain<'a>(
    ctx: &mut ForwardContext<'a>,
    snap: &'a Snapshot,
    body: &Bytes,
) -> Result<Response<Body>, GatewayError> {
    let mut visited: SmallVec<[&str; 4]> = SmallVec::new();
    loop {
        let err = match forward(ctx).await {
            // A pinned request's state is on its owner: no other pool has it;
            // a streamed upload has been sent.
            Err(e) if e.falls_back() && ctx.pinned.is_none() && ctx.upload.is_none() => e,
            other => return other,
        };
        let route = ctx.route;
        visited.push(&route.pool.name);
        let Some(next) = next_pool(ctx, snap, &visited) else {
            return Err(err);
        };
        tracing::info!(from = %route.pool.name, to = %next.pool.name, error = %err, "falling back");
        telemetry::record_fallback(&route.pool.name, &next.pool.name);
        ctx.body = for_pool(
            body,
            ctx.info,
            &next.pool.config,
            ctx.endpoint,
            ctx.request_id,
        )?;
        ctx.route = next;
    }
}

/// The next pool of the chain not yet visited that has a worker in the
/// request's residency; skipped pools are counted.
fn next_pool<'a>(
    ctx: &ForwardContext<'a>,
    snap: &'a Snapshot,
    visited: &[&str],
) -> Option<&'a Arc<ModelRoute>> {
    let from = &ctx.route.pool;
    from.config
        .fallback
        .iter()
        .filter(|p| !visited.contains(&p.as_str()))
        .filter_map(|p| snap.pool_route(p))
        .find(|n| {
            let inside = ctx.residency.is_none() || n.workers.iter().any(|w| ctx.allows(w));
            if !inside {
                metrics::counter!(names::FALLBACKS_SKIPPED_TOTAL,
                    names::L_POOL => metrics::SharedString::from(from.name.clone()),
                    names::L_TARGET => metrics::SharedString::from(n.pool.name.clone()))
                .increment(1);
            }
            inside
        })
}
