//! The admin API, on its own listener (loopback by default) and always behind a
//! bearer token: list workers with live state, add/remove, drain/undrain, reload,
//! and API keys (`admin_keys`).

use super::Gateway;
use crate::api::ErrorBody;
use crate::config::{normalize_worker_url, WorkerConfig};
use crate::pool::AddWorkerError;
use crate::tenancy::bearer_token;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Admin connections open at once: an operator's tools, not a crowd.
const MAX_ADMIN_CONNECTIONS: usize = 64;

/// Start the admin listener if the config has one; returns its address. It has
/// the client listener's header, idle and header-size limits, and its own cap.
pub async fn spawn(gw: Arc<Gateway>) -> std::io::Result<Option<SocketAddr>> {
    let Some(admin) = gw.registry.config().admin.clone() else {
        return Ok(None);
    };
    let listener = super::listen::bind_exclusive(admin.listen, "admin.listen")?;
    let addr = listener.local_addr()?;
    gw.registry.note_listener(addr);
    if !addr.ip().is_loopback() {
        tracing::warn!(%addr, "the admin API listens on a non-loopback address: anyone who can reach it needs only the token; prefer 127.0.0.1 and a tunnel");
    }
    let tls = match &admin.tls {
        Some(t) => Some(super::tls::Tls::new(t, "admin")?),
        None => None,
    };
    let app = router(gw.clone());
    let server = gw.registry.config().server.clone();
    tokio::spawn(super::serve_internal(
        listener,
        app,
        server,
        MAX_ADMIN_CONNECTIONS,
        tls,
    ));
    Ok(Some(addr))
}

pub fn router(gw: Arc<Gateway>) -> Router {
    Router::new()
        .route("/admin/workers", get(list).post(add).delete(remove))
        .route("/admin/workers/drain", post(drain))
        .route("/admin/workers/undrain", post(undrain))
        .route("/admin/reload", post(reload))
        .route("/admin/scaling", get(scaling))
        .route(
            "/admin/keys",
            get(super::admin_keys::list).post(super::admin_keys::create),
        )
        .route("/admin/keys/{id}", delete(super::admin_keys::revoke))
        .layer(middleware::from_fn_with_state(gw.clone(), authenticate))
        .with_state(gw)
}

pub(super) fn error(status: StatusCode, msg: &str) -> Response {
    let kind = if status == StatusCode::UNAUTHORIZED {
        "authentication_error"
    } else {
        "invalid_request_error"
    };
    (
        status,
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        ErrorBody::new(msg, kind, None, None).to_bytes(),
    )
        .into_response()
}

/// Constant-time comparison, so the token cannot be guessed byte by byte.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn authenticate(State(gw): State<Arc<Gateway>>, req: Request, next: Next) -> Response {
    let config = gw.registry.config();
    let Some(admin) = &config.admin else {
        return error(StatusCode::NOT_FOUND, "admin API disabled");
    };
    let given = req
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| bearer_token(v.as_bytes()));
    match given {
        Some(t) if same(t, admin.token.expose().as_bytes()) => next.run(req).await,
        _ => {
            let mut resp = error(
                StatusCode::UNAUTHORIZED,
                "missing or wrong admin bearer token",
            );
            resp.headers_mut().insert(
                axum::http::header::WWW_AUTHENTICATE,
                axum::http::HeaderValue::from_static("Bearer realm=\"switchyard-admin\""),
            );
            resp
        }
    }
}

#[derive(Serialize)]
struct WorkerView {
    url: String,
    pool: String,
    labels: BTreeMap<String, String>,
    state: &'static str,
    healthy: bool,
    draining: bool,
    overloaded: bool,
    in_flight: u64,
    requests: u64,
    failures: u64,
    consecutive_failures: u32,
    ejections: u32,
    discovered_models: Vec<String>,
}

async fn list(State(gw): State<Arc<Gateway>>) -> Json<serde_json::Value> {
    let snap = gw.routes.snapshot();
    let mut out = Vec::new();
    for pool in &snap.pools {
        for w in &pool.workers {
            let s = &w.state;
            out.push(WorkerView {
                url: w.id.to_string(),
                pool: pool.name.to_string(),
                labels: w.labels.clone(),
                state: w.state_name(),
                healthy: s.healthy.load(Ordering::Relaxed),
                draining: s.draining.load(Ordering::Relaxed),
                overloaded: s.health.overloaded.load(Ordering::Relaxed),
                in_flight: s.in_flight.load(Ordering::Relaxed),
                requests: s.requests.load(Ordering::Relaxed),
                failures: s.failures.load(Ordering::Relaxed),
                consecutive_failures: s.health.consecutive_failures.load(Ordering::Relaxed),
                ejections: s.health.ejections.load(Ordering::Relaxed),
                discovered_models: s.discovered_models.load().to_vec(),
            });
        }
    }
    Json(serde_json::json!({ "workers": out }))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AddWorker {
    pool: String,
    url: String,
    #[serde(default)]
    labels: BTreeMap<String, String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ByUrl {
    url: String,
}

async fn add(State(gw): State<Arc<Gateway>>, body: Json<AddWorker>) -> Response {
    let url = match crate::pool::admit_admin_worker(&gw.registry, &body.url).await {
        Ok(u) => u.url,
        Err(e) => return error(StatusCode::BAD_REQUEST, &format!("url: {e}")),
    };
    let wc = WorkerConfig {
        url: url.clone(),
        labels: body.labels.clone(),
        price_per_mtok: 0.0,
        kv_events: None,
    };
    match gw.registry.add_worker(&body.pool, wc) {
        Ok(()) => (
            StatusCode::CREATED,
            Json(serde_json::json!({ "added": url })),
        )
            .into_response(),
        Err(e @ AddWorkerError::Duplicate(_)) => error(StatusCode::CONFLICT, &format!("url: {e}")),
        Err(e) => error(StatusCode::NOT_FOUND, &e.to_string()),
    }
}

/// A worker URL named in a request, in the pools' spelling (`http://H:80/` is
/// `http://h`); an unparsable one is left as sent, to be reported unknown.
fn normalized(url: &str) -> String {
    normalize_worker_url(url).unwrap_or_else(|_| url.trim_end_matches('/').to_string())
}

async fn remove(State(gw): State<Arc<Gateway>>, body: Json<ByUrl>) -> Response {
    let url = normalized(&body.url);
    if gw.registry.remove_worker(&url) {
        Json(serde_json::json!({ "removed": url })).into_response()
    } else {
        error(StatusCode::NOT_FOUND, &format!("no worker `{url}`"))
    }
}

fn set_draining(gw: &Gateway, url: &str, on: bool) -> Response {
    let url = normalized(url);
    let url = url.as_str();
    match gw.registry.worker_state(url) {
        Some(s) if gw.routes.snapshot().workers().any(|w| &*w.id == url) => {
            s.draining.store(on, Ordering::Relaxed);
            Json(serde_json::json!({ "url": url, "draining": on, "in_flight": s.in_flight.load(Ordering::Relaxed) }))
                .into_response()
        }
        _ => error(StatusCode::NOT_FOUND, &format!("no worker `{url}`")),
    }
}

async fn drain(State(gw): State<Arc<Gateway>>, body: Json<ByUrl>) -> Response {
    set_draining(&gw, &body.url, true)
}

async fn undrain(State(gw): State<Arc<Gateway>>, body: Json<ByUrl>) -> Response {
    set_draining(&gw, &body.url, false)
}

/// `GET /admin/scaling`: the per-pool replica recommendation of the last tick,
/// with the signals and targets behind it.
async fn scaling(State(gw): State<Arc<Gateway>>) -> Json<serde_json::Value> {
    let fleet = gw.fleet.view();
    Json(serde_json::json!({ "t": fleet.t, "pools": fleet.pools }))
}

async fn reload(State(gw): State<Arc<Gateway>>) -> Response {
    match gw.reload() {
        Ok(()) => Json(serde_json::json!({ "reloaded": true })).into_response(),
        Err(e) => error(StatusCode::BAD_REQUEST, &e),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn token_comparison() {
        assert!(super::same(b"abcdefgh", b"abcdefgh"));
        assert!(!super::same(b"abcdefgh", b"abcdefgi"));
        assert!(!super::same(b"abc", b"abcd"));
    }
}
