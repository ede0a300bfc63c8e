//! Cancellation that reaches the engine. vLLM stops a request when its
//! connection closes, which dropping the response does. SGLang must be told:
//! the gateway sets `rid` in every body it sends an SGLang pool (the client's
//! own `rid` is kept) and, when the client leaves before the end, posts
//! `{"rid": ...}` to `/abort_request` on each worker holding the request
//! (both legs of a disaggregated one). Counted per worker in
//! `switchyard_cancellations_total`.

use crate::config::{EngineKind, PoolConfig};
use crate::telemetry::names;
use crate::upstream::{UpstreamBody, UpstreamClient};
use bytes::Bytes;
use http::HeaderValue;
use std::sync::Arc;
use std::time::Duration;

/// An abort call that is not answered in this time is given up (and counted).
const ABORT_TIMEOUT: Duration = Duration::from_secs(5);

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
