//! The one record every sink is fed when a request finishes: plain data, borrowed
//! from the request's context, with nothing a sink could call back into.

use super::trace::TraceContext;
use super::{Outcome, PairMetrics, RequestMetrics};
use crate::config::observability::PriceConfig;
use metrics::SharedString;
use std::sync::Arc;
use std::time::Duration;

/// The route one response took: the worker that answers it, for its metric
/// labels, its price and the cache-prediction check.
pub struct RouteTags {
    pub pool: SharedString,
    pub worker: Arc<str>,
    /// The worker's `tier` label, for the price table.
    pub tier: Option<Box<str>>,
    pub region: SharedString,
    pub policy: &'static str,
    pub reason: &'static str,
    /// Prompt tokens the router expects the chosen worker to have cached.
    pub predicted_cached_tokens: Option<u64>,
    /// The prediction came from the engines' KV events (precise index).
    pub precise: bool,
    /// The worker's latency model at dispatch: predicted TTFT and time per
    /// output token (ms), when it had learnt enough.
    pub predicted_ttft_ms: Option<f64>,
    pub predicted_tpot_ms: Option<f64>,
    /// Time held in the pool's flow-control queue before dispatch (ms).
    pub queued_ms: f64,
    /// When the answering attempt was sent, ms after arrival (queue, failed
    /// attempts and backoff before it); TTFT less this is the worker's part.
    pub dispatched_ms: Option<f64>,
    /// The request's SLO could not be met and it was served anyway.
    pub slo_downgraded: bool,
}

/// How a request ended.
pub enum End<'a> {
    /// A worker answered; the observer measured the response.
    Proxied {
        route: &'a RouteTags,
        /// The route's handles for the (model, worker) pair that answered.
        pair: &'a PairMetrics,
        outcome: Outcome,
        m: &'a RequestMetrics,
    },
    /// The gateway answered itself with an error.
    Refused {
        /// A configured model name, if the request named one.
        model: Option<&'a str>,
        class: &'static str,
        reason: &'static str,
        elapsed: Duration,
    },
}

/// One finished request, as every sink sees it.
pub struct RequestRecord<'a> {
    /// As received or made (checked as text only by the sinks that print it).
    pub request_id: &'a http::HeaderValue,
    pub tenant: &'a Arc<str>,
    pub tenant_label: &'a SharedString,
    pub trace: &'a TraceContext,
    /// The price table, for the cost sink.
    pub prices: &'a [PriceConfig],
    pub endpoint: &'static str,
    pub status: u16,
    pub attempts: u32,
    pub stream: bool,
    pub request_bytes: u64,
    /// The pool the model name resolved to, if it did.
    pub pool: Option<&'a SharedString>,
    /// The client's address, when known.
    pub client: Option<std::net::IpAddr>,
    /// The queue class the request was given.
    pub priority: &'static str,
    pub end: End<'a>,
}

impl RequestRecord<'_> {
    /// `ok`, `client`, `gateway` or `upstream`.
    pub fn class(&self) -> &'static str {
        match self.end {
            End::Proxied { outcome, .. } => proxied_class(self.status, outcome),
            End::Refused { class, .. } => class,
        }
    }

    /// The `outcome` label: how the body ended, or `gateway_error`.
    pub fn outcome(&self) -> &'static str {
        match self.end {
            End::Proxied { outcome, .. } => outcome.as_str(),
            End::Refused { .. } => "gateway_error",
        }
    }

    /// Arrival to the end of the response.
    pub fn elapsed(&self) -> Duration {
        match self.end {
            End::Proxied { m, .. } => m.e2e,
            End::Refused { elapsed, .. } => elapsed,
        }
    }

    pub fn route(&self) -> Option<&RouteTags> {
        match self.end {
            End::Proxied { route, .. } => Some(route),
            End::Refused { .. } => None,
        }
    }
}

/// `ok`, `client` (4xx or the client left) or `upstream` (5xx, failed mid-body).
pub fn proxied_class(status: u16, outcome: Outcome) -> &'static str {
    match outcome {
        Outcome::Error => "upstream",
        _ if status >= 500 => "upstream",
        _ if status >= 400 => "client",
        Outcome::Cancelled => "client",
        Outcome::Completed => "ok",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes() {
        assert_eq!(proxied_class(200, Outcome::Completed), "ok");
        assert_eq!(proxied_class(200, Outcome::Cancelled), "client");
        assert_eq!(proxied_class(200, Outcome::Error), "upstream");
        assert_eq!(proxied_class(404, Outcome::Completed), "client");
        assert_eq!(proxied_class(503, Outcome::Completed), "upstream");
    }
}
