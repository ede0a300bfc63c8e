//! Cancellation that reaches the engine. vLLM stops a request when its
//! connection closes, which dropping the response does. SGLang must be told:
//! the gateway sets `rid` in every body it sends an SGLang pool (the client's
//! own `rid` is kept) and, when the client leaves before the end, posts
//! `{"rid": ...}` to `/abort_request` on each worker holding the request
//! (both legs of a disaggregated one). Counted per worker in
//! `switchyard_cancellations_total`.

use crate::api::Endpoint;
use crate::config::{EngineKind, PoolConfig};
use crate::telemetry::names;
use crate::upstream::{UpstreamBody, UpstreamClient};
use bytes::Bytes;
use http::HeaderValue;
use serde_json::{Map, Value};
use std::sync::Arc;
use std::time::Duration;

/// An abort call that is not answered in this time is given up (and counted).
const ABORT_TIMEOUT: Duration = Duration::from_secs(5);

/// The body an SGLang pool gets for a generation `endpoint`: `rid` set to the
/// request id unless the client set one; anything else is unchanged (no copy).
pub fn with_rid(
    body: Bytes,
    pool: &PoolConfig,
    endpoint: Endpoint,
    request_id: &HeaderValue,
) -> Result<Bytes, super::GatewayError> {
    let generates = matches!(
        endpoint,
        Endpoint::ChatCompletions | Endpoint::Completions | Endpoint::Responses
    );
    if pool.engine != EngineKind::Sglang || !generates || body.is_empty() {
        return Ok(body);
    }
    let mut v: Map<String, Value> = serde_json::from_slice(&body)
        .map_err(|e| super::GatewayError::MalformedJson(e.to_string()))?;
    if v.get("rid").is_some_and(Value::is_string) {
        return Ok(body);
    }
    let rid = request_id.to_str().unwrap_or_default().to_string();
    v.insert("rid".into(), Value::String(rid));
    serde_json::to_vec(&v)
        .map(Bytes::from)
        .map_err(|e| super::GatewayError::MalformedJson(e.to_string()))
}

/// What to do when a response is dropped before its end: for SGLang, abort the
/// request on `workers`; count the cancellation on each.
pub struct Cancel {
    client: UpstreamClient,
    /// Worker base URLs holding the request.
    workers: Vec<Arc<str>>,
    /// The body sent (its `rid` names the request), read only if cancelled.
    body: Bytes,
    auth: Option<HeaderValue>,
    sglang: bool,
}

impl Cancel {
    pub fn new(
        client: &UpstreamClient,
        pool: &PoolConfig,
        auth: Option<&HeaderValue>,
        workers: Vec<Arc<str>>,
        body: Bytes,
    ) -> Self {
        Cancel {
            client: client.clone(),
            workers,
            body,
            auth: auth.cloned(),
            sglang: pool.engine == EngineKind::Sglang,
        }
    }

    /// The client left: count it, and tell SGLang workers to stop.
    pub fn fire(self) {
        let rid = self.sglang.then(|| rid_of(&self.body)).flatten();
        let Some(rid) = rid else {
            for w in &self.workers {
                count(w, "connection_closed");
            }
            return;
        };
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        for w in self.workers {
            let (client, auth, rid) = (self.client.clone(), self.auth.clone(), rid.clone());
            rt.spawn(async move {
                let how = match tokio::time::timeout(ABORT_TIMEOUT, abort(&client, &w, auth, &rid))
                    .await
                {
                    Ok(Ok(())) => "abort_sent",
                    Ok(Err(e)) => {
                        tracing::warn!(worker = %w, error = %e, "SGLang abort failed");
                        "abort_failed"
                    }
                    Err(_) => {
                        tracing::warn!(worker = %w, "SGLang abort timed out");
                        "abort_failed"
                    }
                };
                count(&w, how);
            });
        }
    }
}

pub(crate) fn count(worker: &Arc<str>, how: &'static str) {
    metrics::counter!(names::CANCELLATIONS_TOTAL,
        names::L_WORKER => metrics::SharedString::from(worker.clone()),
        names::L_KIND => how)
    .increment(1);
}

fn rid_of(body: &Bytes) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Rid {
        rid: Option<String>,
    }
    serde_json::from_slice::<Rid>(body).ok()?.rid
}

/// `POST {worker}/abort_request {"rid": rid}`.
async fn abort(
    client: &UpstreamClient,
    worker: &str,
    auth: Option<HeaderValue>,
    rid: &str,
) -> Result<(), String> {
    let body = serde_json::json!({"rid": rid, "abort_all": false}).to_string();
    let mut req = http::Request::post(format!("{worker}/abort_request"))
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(UpstreamBody::from(Bytes::from(body)))
        .map_err(|e| e.to_string())?;
    if let Some(a) = auth {
        req.headers_mut().insert(http::header::AUTHORIZATION, a);
    }
    let resp = client.request(req).await.map_err(|e| e.to_string())?;
    if resp.status().is_success() {
        Ok(())
    } else {
        Err(format!("answered {}", resp.status()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rid_is_set_for_sglang_pools_only_and_a_clients_rid_is_kept() {
        let mut pool = crate::config::parse(
            "[[pools]]\nname = \"p\"\nmodels = [\"m\"]\nworkers = [{ url = \"http://a:1\" }]\n",
        )
        .and_then(|r| r.validate())
        .unwrap()
        .pools
        .remove(0);
        let id = HeaderValue::from_static("req-1");
        let body = Bytes::from_static(br#"{"model":"m"}"#);
        let chat = Endpoint::ChatCompletions;
        assert_eq!(with_rid(body.clone(), &pool, chat, &id).unwrap(), body);
        pool.engine = EngineKind::Sglang;
        assert_eq!(
            with_rid(body.clone(), &pool, Endpoint::Other, &id).unwrap(),
            body
        );
        let out = with_rid(body, &pool, chat, &id).unwrap();
        assert_eq!(rid_of(&out).as_deref(), Some("req-1"));
        let own = Bytes::from_static(br#"{"model":"m","rid":"mine"}"#);
        assert_eq!(
            rid_of(&with_rid(own, &pool, chat, &id).unwrap()).as_deref(),
            Some("mine")
        );
    }
}
