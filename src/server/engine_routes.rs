//! Engine paths beyond the gateway's own routes: a `POST` reaches an engine only
//! when its path is a built-in inference route, in the resolved pool's
//! `forward_routes`, or in its `allow_control_routes` and the caller has admin
//! scope. Everything else is a 404 (a 403 for a non-admin on an allowed control
//! route), counted by `switchyard_route_refusals_total{reason}`.

use crate::config::engine_routes::{CONTROL_ROUTES, DEFAULT_FORWARD_ROUTES};
use crate::config::{Config, PoolConfig};
use crate::proxy::GatewayError;
use crate::telemetry::names;
use crate::tenancy::Tenant;

/// Why a path was refused: the metric's `reason` label.
#[derive(Clone, Copy)]
enum Refusal {
    UnknownRoute,
    ControlRoute,
    NotAdmin,
}

impl Refusal {
    fn count(self) {
        let reason = match self {
            Refusal::UnknownRoute => "unknown_route",
            Refusal::ControlRoute => "control_route",
            Refusal::NotAdmin => "not_admin",
        };
        metrics::counter!(names::ROUTE_REFUSALS_TOTAL, names::L_REASON => reason).increment(1);
    }
}

/// May a `POST` to `path` (no route of its own) go on to be read and resolved?
/// Only if some pool could take it; the resolved pool decides ([`admit`]).
pub(super) fn may_forward(config: &Config, path: &str) -> bool {
    DEFAULT_FORWARD_ROUTES.contains(&path)
        || config
            .pools
            .iter()
            .any(|p| listed(&p.forward_routes, path) || listed(&p.allow_control_routes, path))
}

/// Is `path` (a query ignored) an engine control path: a known one, or one a
/// pool allows? The Endpoint Picker refuses these outright (it has no admin
/// scope to check: Envoy authenticates).
pub fn is_control(config: &Config, path: &str) -> bool {
    let path = path.split_once('?').map_or(path, |(p, _)| p);
    CONTROL_ROUTES.contains(&path)
        || config
            .pools
            .iter()
            .any(|p| listed(&p.allow_control_routes, path))
}

/// The 404 for a path no pool forwards, counted.
pub fn not_found(path: &str) -> GatewayError {
    let known_control = CONTROL_ROUTES.contains(&path);
    let refusal = if known_control {
        Refusal::ControlRoute
    } else {
        Refusal::UnknownRoute
    };
    refusal.count();
    GatewayError::NotFound(crate::api::error::echo(path))
}

/// A request on an extra path, resolved to `pool`: forwarded if the pool takes
/// the path from this caller.
pub fn admit(path: &str, pool: &PoolConfig, tenant: &Tenant) -> Result<(), GatewayError> {
    if DEFAULT_FORWARD_ROUTES.contains(&path) || listed(&pool.forward_routes, path) {
        return Ok(());
    }
    if !listed(&pool.allow_control_routes, path) {
        return Err(not_found(path));
    }
    if !tenant.is_admin() {
        Refusal::NotAdmin.count();
        tracing::warn!(tenant = %tenant.name, path, pool = %pool.name, "engine control route refused: the caller is not an admin tenant");
        return Err(GatewayError::ControlRouteForbidden(
            crate::api::error::echo(path),
        ));
    }
    tracing::info!(tenant = %tenant.name, path, pool = %pool.name, "engine control route forwarded for an admin tenant");
    Ok(())
}

fn listed(list: &[String], path: &str) -> bool {
    list.iter().any(|p| p == path)
}
