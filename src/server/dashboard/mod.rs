//! The live dashboard: one embedded HTML page (`index.html`, vanilla JS and canvas
//! charts, no external assets) at `/dashboard`, polling `/dashboard/status`, a JSON
//! document the gateway computes from its telemetry sinks: the fleet view of the last tick and
//! the ring buffer of per-second aggregates (bounded by
//! `telemetry.dashboard_window_s`).

use super::Gateway;
use crate::pool::fleet::FleetView;
use crate::telemetry::sinks::{self, series::SecondAgg};
use axum::extract::State;
use axum::http::header;
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::Arc;

/// The page, embedded in the binary.
pub const INDEX_HTML: &str = include_str!("index.html");

/// Routes for the client listener (empty when `telemetry.dashboard = false`).
pub fn router(gw: &Arc<Gateway>) -> Router<Arc<Gateway>> {
    if !gw.registry.config().observability.dashboard {
        return Router::new();
    }
    Router::new()
        .route("/dashboard", get(index))
        .route("/dashboard/status", get(status))
}

async fn index() -> Response {
    ([(header::CACHE_CONTROL, "no-cache")], Html(INDEX_HTML)).into_response()
}

#[derive(Serialize)]
pub struct CacheView {
    pub pool: String,
    pub predicted_tokens: u64,
    pub actual_tokens: u64,
    pub ratio: Option<f64>,
}

#[derive(Serialize)]
pub struct CostView {
    pub total_usd: f64,
    pub by_tenant: BTreeMap<String, f64>,
    pub by_model: BTreeMap<String, f64>,
    pub by_region: BTreeMap<String, f64>,
}

#[derive(Serialize)]
pub struct Status {
    pub t: u64,
    pub window_s: usize,
    pub fleet: Arc<FleetView>,
    pub series: Vec<SecondAgg>,
    pub cache: Vec<CacheView>,
    pub cost: CostView,
    /// Each pool's KV block size and the engines that disagree with it.
    pub kv_block_size: Vec<crate::pool::block_size::PoolBlockSize>,
}

/// Build the status document.
pub fn status_of(gw: &Gateway) -> Status {
    let s = &gw.sinks;
    let mut cost = CostView {
        total_usd: 0.0,
        by_tenant: BTreeMap::new(),
        by_model: BTreeMap::new(),
        by_region: BTreeMap::new(),
    };
    for (model, region, tenant, usd) in s.costs.totals() {
        cost.total_usd += usd;
        *cost.by_tenant.entry(tenant.to_string()).or_default() += usd;
        *cost.by_model.entry(model.to_string()).or_default() += usd;
        *cost.by_region.entry(region.to_string()).or_default() += usd;
    }
    Status {
        t: sinks::unix_ms(),
        window_s: gw.registry.config().observability.dashboard_window_s,
        fleet: gw.fleet.view(),
        series: s.series.seconds(),
        cache: s
            .cache
            .totals()
            .into_iter()
            .map(|(pool, p, a)| CacheView {
                pool,
                predicted_tokens: p,
                actual_tokens: a,
                ratio: (p > 0).then(|| a as f64 / p as f64),
            })
            .collect(),
        cost,
        kv_block_size: crate::pool::block_size::statuses(&gw.registry.snapshot()),
    }
}

async fn status(State(gw): State<Arc<Gateway>>) -> Response {
    ([(header::CACHE_CONTROL, "no-store")], Json(status_of(&gw))).into_response()
}
