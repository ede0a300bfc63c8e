//! What the gateway holds towards its workers, below routing and the proxy: the
//! pooled upstream HTTP client (one HTTP/1 pool per serving thread, TLS for
//! `https://` workers) and the per-pool retry budget. Imports nothing of ours.

mod body;
mod client;
pub mod retry_budget;

pub use body::{BoxError, UpstreamBody};
pub(crate) use client::origin_form;
pub use client::{UpstreamClient, UpstreamError};
