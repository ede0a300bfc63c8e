//! SGLang's `POST /abort_request`: running streamed requests registered by
//! their `rid` (the body's, else `X-Request-Id`), each with a signal its
//! producer waits on beside the engine's events. Entries leave when their
//! request ends, so the map holds at most the running requests.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, PoisonError};

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use tokio::sync::Notify;

use super::api::parse_json;
use super::{EngineKind, Shared};

#[derive(Default)]
pub(crate) struct Registry {
    running: Mutex<HashMap<String, Arc<Notify>>>,
    /// `/abort_request` calls received.
    calls: AtomicU64,
}

/// A registered request; unregisters on drop.
pub(super) struct Entry<'a> {
    reg: &'a Registry,
    rid: String,
    pub signal: Arc<Notify>,
}

impl Drop for Entry<'_> {
    fn drop(&mut self) {
        self.reg.with(|m| m.remove(&self.rid));
    }
}

impl Registry {
    fn with<R>(&self, f: impl FnOnce(&mut HashMap<String, Arc<Notify>>) -> R) -> R {
        f(&mut self.running.lock().unwrap_or_else(PoisonError::into_inner))
    }

    pub(super) fn register(&self, rid: &str) -> Entry<'_> {
        let signal = Arc::new(Notify::new());
        self.with(|m| m.insert(rid.to_string(), signal.clone()));
        Entry {
            reg: self,
            rid: rid.to_string(),
            signal,
        }
    }

    /// Signal `rid` (or every request); how many were running.
    fn abort(&self, rid: Option<&str>) -> usize {
        let hit: Vec<Arc<Notify>> = self.with(|m| match rid {
            Some(r) => m.get(r).cloned().into_iter().collect(),
            None => m.values().cloned().collect(),
        });
        for n in &hit {
            n.notify_one();
        }
        hit.len()
    }

    pub(super) fn calls(&self) -> u64 {
        self.calls.load(Relaxed)
    }
}

/// `POST /abort_request {"rid": ..., "abort_all": bool}` (SGLang only).
pub(super) async fn abort_request(State(s): State<Arc<Shared>>, body: Bytes) -> Response {
    if s.cfg.engine != EngineKind::Sglang {
        return super::api::error(axum::http::StatusCode::NOT_FOUND, "Not Found", None);
    }
    let v = match parse_json(&body) {
        Ok(v) => v,
        Err(e) => return e.into_response(),
    };
    s.aborts.calls.fetch_add(1, Relaxed);
    let all = v.get("abort_all").and_then(Value::as_bool) == Some(true);
    let rid = v.get("rid").and_then(Value::as_str);
    let n = if all {
        s.aborts.abort(None)
    } else {
        match rid {
            Some(r) => s.aborts.abort(Some(r)),
            None => 0,
        }
    };
    axum::Json(json!({"aborted": n})).into_response()
}
