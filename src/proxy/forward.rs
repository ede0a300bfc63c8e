//! The forwarding phases for one request: select → prepare → send → on response.
//! Retries go to a different worker, only while nothing has reached the client.

use super::client::{UpstreamBody, UpstreamClient};
use super::error::GatewayError;
use super::headers::strip_hop_by_hop;
use super::observe::{ObserveParams, ObservedBody};
use crate::api::{Endpoint, RequestInfo};
use crate::config::Timeouts;
use crate::pool::{ModelRoute, Worker};
use crate::routing::{Reason, RouteRequest};
use crate::telemetry;
use axum::body::Body;
use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{request, Request, Response, Uri};
use http_body_util::Full;
use metrics::SharedString;
use std::sync::Arc;
use tokio::time::Instant;

/// Header carrying the session id used by session-affine routing.
pub const SESSION_HEADER: &str = "x-session-id";
/// Debug header naming the chosen worker and the reason.
pub const ROUTE_HEADER: &str = "x-switchyard-route";
/// Request header naming a policy to use instead of the pool's (honoured only when
/// the pool sets `allow_policy_override`).
pub const POLICY_HEADER: &str = "x-switchyard-policy";

/// Everything the forwarding phases need about one request.
pub struct ForwardContext<'a> {
    pub client: &'a UpstreamClient,
    pub route: &'a Arc<ModelRoute>,
    pub parts: &'a request::Parts,
    pub body: Bytes,
    pub info: &'a RequestInfo,
    pub endpoint: Endpoint,
    pub request_id: &'a HeaderValue,
    pub timeouts: Timeouts,
    pub debug_headers: bool,
    /// When the gateway received the request (TTFT and e2e start here).
    pub start: Instant,
}

/// Forward to a worker chosen by the route's policy, retrying elsewhere on
/// retryable failures, and return the observed response.
pub async fn forward(ctx: ForwardContext<'_>) -> Result<Response<Body>, GatewayError> {
    let route = ctx.route;
    let pool = &route.pool;
    let session = ctx
        .parts
        .headers
        .get(SESSION_HEADER)
        .and_then(|v| v.to_str().ok());
    let rreq = RouteRequest::new(ctx.info, session);
    let deadline = ctx.start + ctx.timeouts.total;
    let pool_label = SharedString::from(pool.name.clone());
    let policy = match ctx
        .parts
        .headers
        .get(POLICY_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|name| route.override_policy(name))
    {
        Some(p) => {
            telemetry::record_policy_override(&pool_label, p.name());
            p
        }
        None => &*route.policy,
    };
    let prompt_tokens = ctx.info.routing_text.as_ref().map_or(0, |t| t.len() as u64)
        / u64::from(pool.config.routing.bytes_per_token.get());
    let mut tried: Vec<usize> = Vec::new();
    let mut last_err: Option<GatewayError> = None;

    for attempt in 0..pool.config.max_attempts {
        // Phase: select.
        let accept = |i: usize| route.workers[i].is_available() && !tried.contains(&i);
        let Some(decision) = policy.pick(&rreq, &route.workers, &accept) else {
            break;
        };
        telemetry::record_decision(&pool_label, policy.name(), decision.reason.as_str());
        policy.record(&decision, &rreq, &route.workers);
        let est_cost = policy.estimate_cost(&decision, &rreq);
        tried.push(decision.index);
        let worker = &route.workers[decision.index];
        let worker_label = SharedString::from(worker.id.clone());

        // Phase: prepare.
        let upstream_req = prepare(&ctx, worker)?;

        // Phase: send, bounded by the first-byte and total deadlines.
        let guard = worker.begin();
        worker.state.stats.note_tokens(prompt_tokens);
        let wait = ctx
            .timeouts
            .first_byte
            .min(deadline.saturating_duration_since(Instant::now()));
        let result = tokio::time::timeout(wait, ctx.client.request(upstream_req)).await;
        let err = match result {
            Err(_) => GatewayError::UpstreamTimeout {
                worker: worker.id.clone(),
                after: wait,
            },
            Ok(Err(e)) if e.is_connect() => GatewayError::UpstreamConnect {
                worker: worker.id.clone(),
                detail: error_chain(&e),
            },
            Ok(Err(e)) => GatewayError::UpstreamFailed {
                worker: worker.id.clone(),
                detail: error_chain(&e),
            },
            Ok(Ok(resp)) => {
                let status = resp.status();
                let retry_status = status.is_server_error() || status.as_u16() == 429;
                let more = attempt + 1 < pool.config.max_attempts
                    && (0..route.workers.len())
                        .any(|i| route.workers[i].is_available() && !tried.contains(&i));
                if retry_status && more {
                    telemetry::record_attempt(&worker_label, attempt_result(status.as_u16()));
                    tracing::debug!(worker = %worker.id, %status, "retrying on another worker");
                    continue;
                }
                telemetry::record_attempt(&worker_label, attempt_result(status.as_u16()));
                if let Some(usd) = est_cost {
                    telemetry::record_estimated_cost(&pool_label, usd);
                }
                // Phase: on response.
                return Ok(respond(
                    &ctx,
                    resp,
                    worker,
                    worker_label,
                    (policy.name(), decision.reason, est_cost),
                    guard,
                    deadline,
                ));
            }
        };
        worker
            .state
            .failures
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        telemetry::record_attempt(&worker_label, err.reason());
        tracing::warn!(worker = %worker.id, error = %err, attempt, "upstream attempt failed");
        let retry = err.retryable();
        last_err = Some(err);
        if !retry || Instant::now() >= deadline {
            break;
        }
    }
    Err(last_err.unwrap_or_else(|| GatewayError::NoHealthyWorker(route.model.to_string())))
}

fn attempt_result(status: u16) -> &'static str {
    match status {
        429 => "status_429",
        s if s >= 500 => "status_5xx",
        s if s >= 400 => "status_4xx",
        _ => "ok",
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        s.push_str(": ");
        s.push_str(&c.to_string());
        src = c.source();
    }
    s
}

/// Build the upstream request: same method, path and body; hop-by-hop headers
/// dropped; client credentials dropped unless the pool passes them; pool key injected.
fn prepare(
    ctx: &ForwardContext<'_>,
    worker: &Worker,
) -> Result<Request<UpstreamBody>, GatewayError> {
    let pq = ctx
        .parts
        .uri
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/");
    let uri = if worker.path_prefix.is_empty() {
        Uri::builder()
            .scheme(worker.scheme.clone())
            .authority(worker.authority.clone())
            .path_and_query(pq)
            .build()
    } else {
        Uri::builder()
            .scheme(worker.scheme.clone())
            .authority(worker.authority.clone())
            .path_and_query(format!("{}{}", worker.path_prefix, pq))
            .build()
    }
    .map_err(|e| GatewayError::UpstreamFailed {
        worker: worker.id.clone(),
        detail: format!("bad upstream URI: {e}"),
    })?;
    let mut headers = ctx.parts.headers.clone();
    strip_hop_by_hop(&mut headers);
    headers.remove(header::HOST);
    headers.remove(header::CONTENT_LENGTH);
    let pool = &ctx.route.pool;
    if !pool.config.pass_client_auth {
        headers.remove(header::AUTHORIZATION);
    }
    if let Some(auth) = &pool.upstream_auth {
        headers.insert(header::AUTHORIZATION, auth.clone());
    }
    headers.insert("x-request-id", ctx.request_id.clone());
    let mut req = Request::new(Full::new(ctx.body.clone()));
    *req.method_mut() = ctx.parts.method.clone();
    *req.uri_mut() = uri;
    *req.headers_mut() = headers;
    Ok(req)
}

fn respond(
    ctx: &ForwardContext<'_>,
    resp: Response<hyper::body::Incoming>,
    worker: &Worker,
    worker_label: SharedString,
    (policy, reason, est_cost): (&'static str, Reason, Option<f64>),
    guard: crate::pool::InFlightGuard,
    deadline: Instant,
) -> Response<Body> {
    let (mut parts, incoming) = resp.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    let sse = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    let observed = ObservedBody::new(
        incoming,
        ObserveParams {
            start: ctx.start,
            model: SharedString::from(ctx.route.model.clone()),
            worker: worker_label,
            endpoint: ctx.endpoint.as_str(),
            status: parts.status.as_u16(),
            sse,
            idle: ctx.timeouts.idle,
            deadline,
            guard,
        },
    );
    if ctx.debug_headers {
        let mut v = format!("{}; policy={policy}; reason={}", worker.id, reason.as_str());
        if let Some(usd) = est_cost {
            v.push_str(&format!("; est_cost_usd={usd:.9}"));
        }
        if let Ok(v) = HeaderValue::from_str(&v) {
            parts.headers.insert(ROUTE_HEADER, v);
        }
    }
    Response::from_parts(parts, Body::new(observed))
}
