//! The gateway's own endpoints: the model list, health, readiness, metrics, and
//! the router's answers for paths and methods it does not serve.

use super::client_addr::Peer;
use super::handlers::{proxy, refused_by_tenancy};
use super::refusal::Refused;
use super::Gateway;
use crate::api::{self, headers::Own};
use crate::proxy::GatewayError;
use crate::telemetry;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use http::{header, HeaderValue, StatusCode};
use std::sync::Arc;

/// `GET /v1/models`: every model name and alias the caller may use (a key's
/// `allowed_models`); without a key, everything, unless the config says a
/// key is needed (`require_key`, `list_models_without_key = false`).
pub async fn models(State(gw): State<Arc<Gateway>>, req: Request) -> Response {
    let tenant = match models_caller(&gw, &req) {
        Ok(t) => t,
        Err(e) => return refused(&gw, &req).answer(&e),
    };
    let mut list = super::models::list(&gw).await;
    let snap = gw.routes.snapshot();
    list.data
        .retain(|c| snap.usable_by(&c.id, |m| tenant.allows(m)));
    Json(list).into_response()
}

/// Who asks for the model list: a known key's tenant, or anonymous where
/// the config lets anonymous callers list models.
fn models_caller(gw: &Gateway, req: &Request) -> Result<crate::tenancy::Tenant, GatewayError> {
    let tenancy = gw.tenancy.load();
    let tenant = tenancy
        .resolve(req.headers(), Own::ANY, &gw.keys)
        .map_err(|r| refused_by_tenancy(r.into()))?;
    if tenant.key_id.is_none() && !tenancy.lists_models_without_key() {
        return Err(refused_by_tenancy(GatewayError::MissingApiKey));
    }
    Ok(tenant)
}

/// `GET /v1/models/{id}` (the SDKs' `models.retrieve`): one served model the
/// caller may use, or a 404 in OpenAI's shape (also for a model it may not
/// use: its existence is not confirmed). Model ids may contain `/`.
pub async fn model(
    State(gw): State<Arc<Gateway>>,
    axum::extract::Path(id): axum::extract::Path<String>,
    req: Request,
) -> Response {
    let tenant = match models_caller(&gw, &req) {
        Ok(t) => t,
        Err(e) => return refused(&gw, &req).answer(&e),
    };
    let snap = gw.routes.snapshot();
    let known = snap.model_names().contains(&id) && snap.usable_by(&id, |m| tenant.allows(m));
    if known {
        let list = super::models::list(&gw).await;
        if let Some(c) = list.data.into_iter().find(|c| c.id == id) {
            return Json(c).into_response();
        }
    }
    let e = GatewayError::UnknownModel(api::error::echo(&id));
    telemetry::record_gateway_error(None, e.reason(), 404);
    e.to_response()
}

/// A known path asked with a method it does not serve: 405 in OpenAI's shape,
/// with `Allow` filled in by the router.
pub async fn method_not_allowed(State(gw): State<Arc<Gateway>>, req: Request) -> Response {
    let e = GatewayError::MethodNotAllowed {
        method: api::error::echo(req.method().as_str()),
        path: api::error::echo(req.uri().path()),
    };
    refused(&gw, &req).answer(&e)
}

/// A router request's refusal, with the peer the service put in its extensions.
fn refused<'r>(gw: &'r Gateway, req: &'r Request) -> Refused<'r> {
    Refused {
        gw,
        headers: req.headers(),
        path: req.uri().path(),
        peer: req.extensions().get::<Peer>().and_then(|p| p.0),
    }
}

/// `GET /health`: the process is alive.
pub async fn health() -> &'static str {
    "ok"
}

/// `GET /ready`: 200 when every model has a worker that can take a request and
/// the gateway is not shutting down, else 503. The JSON body says which, and
/// each pool's KV block size (`pool/block_size.rs`): engines disagreeing with
/// their pool are named, with a warning line each. They leave the status at
/// 200: the pool still serves (on the approximate index), and turning every
/// replica unready at once over a routing-quality fault would be an outage.
pub async fn ready(State(gw): State<Arc<Gateway>>) -> Response {
    let ready = !gw.is_shutting_down() && gw.routes.snapshot().is_ready();
    ready_answer(&gw, ready)
}

/// `/ready`'s answer (also the picker's): the status and the JSON detail.
pub fn ready_answer(gw: &Gateway, ready: bool) -> Response {
    let kv = crate::pool::block_size::statuses(&gw.registry.snapshot());
    let warnings: Vec<String> = kv
        .iter()
        .flat_map(|s| s.mismatches.iter().map(|m| s.describe(m)))
        .collect();
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = serde_json::json!({
        "status": if ready { "ready" } else { "not ready" },
        "kv_block_size": kv,
        "warnings": warnings,
    });
    (status, Json(body)).into_response()
}

/// The exposition text: scrape-time gauges refreshed, then every family.
pub fn metrics_text(gw: &Gateway) -> String {
    crate::pool::gauges::refresh(&gw.registry.snapshot());
    gw.routes.refresh_gauges();
    gw.fleet.refresh_gauges();
    telemetry::render(&gw.metrics, Some(&gw.sinks))
}

/// `GET /metrics`: Prometheus text.
pub async fn metrics(State(gw): State<Arc<Gateway>>) -> Response {
    let text = metrics_text(&gw);
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4"),
        )],
        text,
    )
        .into_response()
}

/// Paths without a route of their own: a `POST` some pool forwards
/// (`server/engine_routes.rs`) goes to the proxy, the resolved pool deciding;
/// anything else is a 404 in OpenAI's shape, never sent to an engine.
pub async fn fallback(state: State<Arc<Gateway>>, req: Request) -> Response {
    let path = req.uri().path();
    if req.method() == http::Method::POST
        && super::engine_routes::may_forward(&state.registry.config(), path)
    {
        return proxy(state, req).await;
    }
    refused(&state, &req).answer(&super::engine_routes::not_found(path))
}
