//! The admin API's key routes: create a key for a configured tenant (the key is
//! in that one answer and nowhere else), list keys (public id, tenant, created;
//! never a secret), revoke one.

use super::admin::error;
use super::Gateway;
use crate::tenancy::keys::IssueError;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use std::sync::Arc;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct CreateKey {
    tenant: String,
}

#[derive(Serialize)]
struct KeyView {
    id: String,
    tenant: String,
    /// Unix seconds; absent for keys from the config.
    #[serde(skip_serializing_if = "Option::is_none")]
    created: Option<u64>,
    /// `admin` or `config` (config keys are revoked by editing the config).
    source: &'static str,
}

/// `POST /admin/keys {"tenant": "acme"}`: 201 with the new key, shown once.
pub(super) async fn create(State(gw): State<Arc<Gateway>>, Json(req): Json<CreateKey>) -> Response {
    if !gw.tenancy.load().has_tenant(&req.tenant) {
        let msg = format!(
            "no configured tenant named `{}`",
            crate::api::error::echo(&req.tenant)
        );
        return error(StatusCode::NOT_FOUND, &msg);
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    match gw.keys.create(&req.tenant, now) {
        Ok((e, key)) => {
            if let Some(conn) = gw.limits.redis() {
                if let Err(why) = crate::tenancy::shared_keys::publish(conn, &e).await {
                    gw.keys.revoke(&e.id);
                    tracing::warn!(error = %why, "API key not created: the shared store failed");
                    let msg = "the shared key store (Redis) is unavailable; no key was created";
                    return error(StatusCode::SERVICE_UNAVAILABLE, msg);
                }
            }
            tracing::info!(id = %e.id, tenant = %e.tenant, "API key created");
            let body = serde_json::json!({
                "id": &*e.id,
                "tenant": &*e.tenant,
                "created": e.created,
                "key": key,
            });
            (StatusCode::CREATED, Json(body)).into_response()
        }
        Err(IssueError::Full) => error(
            StatusCode::INSUFFICIENT_STORAGE,
            "the gateway holds as many issued keys as it may; revoke some first",
        ),
        Err(IssueError::Random) => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "could not generate a key; try again",
        ),
    }
}

/// `GET /admin/keys`: configured keys, then issued ones, oldest first.
pub(super) async fn list(State(gw): State<Arc<Gateway>>) -> Response {
    let config = gw
        .tenancy
        .load()
        .config_keys()
        .into_iter()
        .map(|(id, t)| KeyView {
            id: id.to_string(),
            tenant: t.to_string(),
            created: None,
            source: "config",
        });
    let issued = gw.keys.list().into_iter().map(|e| KeyView {
        id: e.id.to_string(),
        tenant: e.tenant.to_string(),
        created: Some(e.created),
        source: "admin",
    });
    let keys: Vec<KeyView> = config.chain(issued).collect();
    Json(serde_json::json!({ "keys": keys })).into_response()
}

/// `DELETE /admin/keys/{id}`: 204, or 404 for an id that is not an issued key
/// (with Redis, a key issued by another replica is known here within a second).
pub(super) async fn revoke(State(gw): State<Arc<Gateway>>, Path(id): Path<String>) -> Response {
    if !gw.keys.revoke(&id) {
        let msg = format!("no issued key with id `{}`", crate::api::error::echo(&id));
        return error(StatusCode::NOT_FOUND, &msg);
    }
    gw.limits.forget_key(&id);
    if let Some(conn) = gw.limits.redis() {
        if let Err(why) = crate::tenancy::shared_keys::remove(conn, &id).await {
            tracing::warn!(error = %why, "API key revoked here only: the shared store failed");
            let msg =
                "revoked on this replica only: the shared key store (Redis) is unavailable; retry";
            return error(StatusCode::SERVICE_UNAVAILABLE, msg);
        }
    }
    tracing::info!(id = %id, "API key revoked");
    StatusCode::NO_CONTENT.into_response()
}
