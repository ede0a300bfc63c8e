//! Forwarding: one request context through named phases — select a worker, prepare
//! the upstream request, forward, retry elsewhere while nothing has reached the
//! client, then hand the response body to the observer.

pub mod affinity;
pub(crate) mod anthropic;
mod attempts;
pub mod cancel;
pub mod context;
pub(crate) mod disagg;
mod edited;
mod error;
mod fallback;
mod flow;
pub mod forward;
mod headers;
pub mod observe;
pub mod slo;
pub mod stored_id;
pub mod upload;
mod upstream_body;
mod usage;

pub use crate::upstream::{UpstreamBody, UpstreamClient, UpstreamError};
pub use context::RequestTags;
pub use error::GatewayError;
pub use fallback::forward_with_fallbacks;
pub use forward::{
    forward, ForwardContext, Pinned, POLICY_HEADER, REQUEST_ID_HEADER, ROUTE_HEADER, SESSION_HEADER,
};
pub use upstream_body::for_pool;

/// The body with `model` replaced, for pools whose upstream knows the model under
/// another name (external providers); unchanged (no copy) otherwise.
pub fn rewrite_model(
    body: &bytes::Bytes,
    upstream_model: Option<&str>,
) -> Result<bytes::Bytes, GatewayError> {
    let Some(name) = upstream_model else {
        return Ok(body.clone());
    };
    let mut v: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(body).map_err(|e| GatewayError::MalformedJson(e.to_string()))?;
    v.insert("model".into(), serde_json::Value::String(name.to_string()));
    serde_json::to_vec(&v)
        .map(bytes::Bytes::from)
        .map_err(|e| GatewayError::MalformedJson(e.to_string()))
}
