//! Forwarding: one request context through named phases — select a worker, prepare
//! the upstream request, forward, retry elsewhere while nothing has reached the
//! client, then hand the response body to the observer.

mod client;
mod error;
pub mod forward;
mod headers;
pub mod observe;
pub mod retry_budget;

pub use client::{UpstreamBody, UpstreamClient};
pub use error::GatewayError;
pub use forward::{forward, ForwardContext, POLICY_HEADER, ROUTE_HEADER, SESSION_HEADER};
