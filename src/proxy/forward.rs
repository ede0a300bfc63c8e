//! The forwarding phases for one request: select → prepare → send → on response.
//! Retries go to a different worker, only while nothing has reached the client.

use super::error::GatewayError;
use super::headers::{forwardable, state_granted_claims, stays_at_gateway, strip_hop_by_hop};
use super::observe::{ObserveParams, ObservedBody};
use super::RequestTags;
use crate::api::headers::Name;
use crate::api::{Endpoint, RequestInfo};
use crate::config::{GlobalConfig, HealthConfig, Residency, Timeouts};
use crate::pool::{health, InFlightGuard, RequestSize, Worker};
use crate::routes::ModelRoute;
use crate::routing::{Reason, RouteRequest};
use crate::telemetry::trace::{new_span_id, ChildSpan, SpanKind, TRACEPARENT};
use crate::telemetry::PairMetrics;
use crate::upstream::{origin_form, UpstreamBody, UpstreamClient};
use axum::body::Body;
use bytes::Bytes;
use http::header::{self, HeaderName, HeaderValue};
use http::{request, Request, Response, Uri};
use hyper::body::Incoming;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tokio::time::Instant;

/// The request id header, propagated or made at the edge and set upstream.
pub const REQUEST_ID_HEADER: HeaderName = HeaderName::from_static("x-request-id");
pub use crate::api::headers::{POLICY_HEADER, PRIORITY_HEADER, SESSION_HEADER};
/// Debug header naming the chosen worker, the policy and the reason (see [`RouteNote`]).
pub const ROUTE_HEADER: HeaderName = HeaderName::from_static("x-switchyard-route");

/// What the `x-switchyard-route` debug header says, written only here:
/// `<worker>; policy=<policy>; reason=<reason>[; prefill=<worker>][; est_cost_usd=<usd>]`.
pub(crate) struct RouteNote<'a> {
    /// The worker that answers, by index in the route.
    pub index: usize,
    /// The policy that chose it (an override the request asked for, if any).
    pub policy: &'static str,
    pub reason: Reason,
    /// The prefill worker of a disaggregated request.
    pub prefill: Option<&'a str>,
    pub est_cost_usd: Option<f64>,
    /// The cache prediction came from the engines' KV events (precise index).
    pub precise: bool,
}

impl RouteNote<'_> {
    /// Add the header to a response's headers when the gateway shows debug headers.
    fn write_to(&self, ctx: &ForwardContext<'_>, headers: &mut http::HeaderMap) {
        if !ctx.debug_headers {
            return;
        }
        let mut v = format!(
            "{}; policy={}; reason={}",
            ctx.route.workers[self.index].id,
            self.policy,
            self.reason.as_str()
        );
        if let Some(p) = self.prefill {
            v.push_str("; prefill=");
            v.push_str(p);
        }
        if let Some(usd) = self.est_cost_usd {
            v.push_str(&format!("; est_cost_usd={usd:.9}"));
        }
        if let Ok(v) = HeaderValue::from_str(&v) {
            headers.insert(ROUTE_HEADER, v);
        }
    }
}

impl ForwardContext<'_> {
    pub(crate) fn route_request(&self) -> RouteRequest<'_> {
        RouteRequest::new(
            self.info,
            self.own
                .get_str(&self.parts.headers, crate::api::headers::Name::Session),
        )
        .with_residency(self.residency)
        .with_body(self.endpoint, &self.body)
    }

    /// Does this request go upstream as a chat completion (a Messages request
    /// on a pool that translates)?
    pub(crate) fn translates(&self) -> bool {
        super::anthropic::translates(&self.route.pool.config, self.endpoint)
    }

    /// The request's residency allows `worker`'s region.
    #[inline]
    pub(crate) fn allows(&self, worker: &Worker) -> bool {
        self.residency.is_none_or(|r| r.admits(worker.region))
    }

    /// The error when no worker could take the request: one naming the residency
    /// when the request has one, else "no healthy worker".
    pub(crate) fn no_worker(&self) -> GatewayError {
        let model = self
            .info
            .model
            .clone()
            .unwrap_or_else(|| self.route.model.to_string());
        match self.residency {
            Some(r) => GatewayError::ResidencyUnavailable {
                residency: r.name.clone(),
                regions: match self.global.names(r.regions) {
                    n if n.is_empty() => "none".into(),
                    n => n,
                },
                model,
            },
            None => GatewayError::NoHealthyWorker(model),
        }
    }

    pub(crate) fn deadline(&self) -> Instant {
        self.start + self.timeouts.total
    }

    /// The request's size for load accounting, `cached` of its prompt tokens
    /// expected in the chosen worker's prefix cache.
    pub(crate) fn size(&self, cached: u64) -> RequestSize {
        RequestSize::estimate(
            self.info
                .routing_text
                .as_ref()
                .map_or(0, |t| t.len() as u64),
            self.route.pool.config.routing.bytes_per_token,
            cached,
        )
    }

    /// [`ForwardContext::size`], with the prompt's exact token count when
    /// routing tokenized it: `cached` from the precise index is in the engine's
    /// tokens, and an estimate from bytes would leave a phantom prefill of its
    /// error on every cache hit (counted as the worker's pending work). The
    /// latency models learn from the size sent, so their predictions use it too.
    pub(crate) fn size_exact(&self, rreq: &RouteRequest<'_>, cached: u64) -> RequestSize {
        let est = self.size(cached);
        match rreq.prompt_tokens() {
            Some(tokens) => RequestSize {
                tokens,
                prefill_tokens: tokens.saturating_sub(cached),
                ..est
            },
            None => est,
        }
    }
}

/// The worker a request must go to: the owner of the stored response it names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pinned {
    /// Its index in `route.workers`.
    pub index: usize,
    /// It generates (a continuation): it takes a slot on the owner, waiting in
    /// the pool's queue like any request. A by-id call (read, delete, cancel,
    /// input items) generates nothing and takes no slot, so a cancel never
    /// waits behind the response it cancels.
    pub generates: bool,
}

/// Everything the forwarding phases need about one request.
pub struct ForwardContext<'a> {
    pub client: &'a UpstreamClient,
    pub route: &'a Arc<ModelRoute>,
    pub parts: &'a request::Parts,
    /// Which of the gateway's own headers `parts` carries.
    pub own: crate::api::headers::Own,
    pub body: Bytes,
    pub info: &'a RequestInfo,
    pub endpoint: Endpoint,
    pub request_id: &'a HeaderValue,
    pub timeouts: Timeouts,
    pub health: &'a HealthConfig,
    pub debug_headers: bool,
    /// When the gateway received the request (TTFT and e2e start here).
    pub start: Instant,
    /// Tenant, labels, trace and wait accounting of the request.
    pub tags: &'a Arc<RequestTags>,
    /// The regions the request may be served in (`None`: anywhere).
    pub residency: Option<&'a Residency>,
    /// Region names, for messages.
    pub global: &'a GlobalConfig,
    /// The only worker that may serve the request: the owner of the stored
    /// response it continues or names (`proxy::affinity`).
    pub pinned: Option<Pinned>,
    /// Signs the Responses ids in answers (`proxy::stored_id`).
    pub ids: &'a crate::proxy::stored_id::IdKey,
    /// A streamed upload sent instead of `body` (once: no retry, no fallback).
    pub upload: Option<&'a super::upload::Upload>,
    /// Where a request waiting for a first worker finds the current routes.
    pub routes: Option<&'a crate::routes::RouteTable>,
}

/// Forward to a worker chosen by the route's policy, retrying elsewhere on
/// retryable failures (within the pool's retry budget), queueing when every
/// eligible worker is at its concurrency limit, and return the observed response.
/// Disaggregated pools go through `disagg::forward`, which may come back here;
/// so do Messages requests a pool translates (they travel as chat completions).
pub async fn forward(ctx: &ForwardContext<'_>) -> Result<Response<Body>, GatewayError> {
    let result = match &ctx.route.pool.config.disaggregation {
        Some(d)
            if ctx.translates()
                || matches!(
                    ctx.endpoint,
                    Endpoint::ChatCompletions | Endpoint::Completions
                ) =>
        {
            // Boxed: its state would otherwise be part of every request's future.
            Box::pin(super::disagg::forward(ctx, d)).await
        }
        _ => super::attempts::forward_aggregated(ctx).await,
    };
    // Overhead: time to the response head not spent waiting on workers, the pool
    // queue or retry backoff.
    ctx.route
        .pool
        .metrics
        .record_overhead(ctx.start.elapsed().saturating_sub(ctx.tags.waited()));
    result
}

/// A failed attempt as worker health sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Failure {
    /// 429: overloaded (a cooldown, not a failure).
    Overloaded,
    /// A 5xx answer.
    Status(u16),
    /// No connection: never the request's doing.
    Connect,
    /// Reset or closed before the answer.
    Broken,
    /// No answer within the first-byte timeout.
    Timeout,
}

impl Failure {
    /// Could the request itself cause this on any worker (a query of death, a
    /// per-key limit upstream, a fault the client asked for)?
    pub(super) fn may_be_the_requests(self) -> bool {
        self != Failure::Connect
    }
}

/// Count a failure against the worker: a 429 cooldown, or a failure towards
/// passive ejection.
pub(super) fn charge(route: &ModelRoute, cfg: &HealthConfig, idx: usize, f: Failure) {
    let w = &route.workers[idx];
    if f == Failure::Overloaded {
        health::on_overloaded(w, &route.workers, cfg);
    } else {
        w.state.failures.fetch_add(1, Ordering::Relaxed);
        health::on_failure(w, &route.workers, cfg);
    }
}

/// An attempt's outcome: the response head (any status) with the worker's
/// in-flight guard, or the error; and the failure, if any, for worker health.
pub(crate) type Sent = (
    Result<(Response<Incoming>, InFlightGuard), GatewayError>,
    Option<Failure>,
);

/// One attempt: send, wait for the response head. Attempt metrics and a success
/// are accounted here; a failure is returned for the caller to charge (or not).
pub(crate) async fn send_attempt(
    ctx: &ForwardContext<'_>,
    idx: usize,
    body: Bytes,
    size: RequestSize,
    deadline: Instant,
    reserved: Option<crate::pool::Reservation>,
) -> Sent {
    let route = ctx.route;
    let worker = &route.workers[idx];
    let metrics = &route.metrics[idx];
    if !ctx.allows(worker) {
        // Routing never offers such a worker; this is the last line of defence.
        tracing::error!(worker = %worker.id, "refusing to send outside the request's residency");
        return (Err(ctx.no_worker()), None);
    }
    let attempt_span = new_span_id();
    let upstream_req = match prepare(ctx, worker, body, attempt_span) {
        Ok(r) => r,
        Err(e) => return (Err(e), None),
    };
    // One clock read for the dispatch record and the attempt's timing.
    let sent = crate::runtime::clock::now();
    let since_arrival = sent.saturating_duration_since(ctx.start).as_secs_f64() * 1e3;
    ctx.tags
        .dispatch
        .set(worker.dispatch(size).at(since_arrival));
    let guard = match reserved {
        Some(r) => worker.begin_reserved(r, size),
        None => worker.begin(route.pool.queue.as_ref(), size),
    };
    let until = (sent + ctx.timeouts.first_byte).min(deadline);
    let wait = until.saturating_duration_since(sent);
    let result =
        tokio::time::timeout_at(until, send_prepared(ctx.client, worker, upstream_req)).await;
    ctx.tags.add_waited(sent.elapsed());
    let attempt = ctx.tags.add_attempt();
    if ctx.tags.tracing() {
        attempt_span_end(ctx, worker, attempt, attempt_span, sent, &result);
    }
    match result {
        Ok(Ok(resp)) => {
            let status = resp.status();
            metrics.record_attempt(attempt_result(status.as_u16()));
            (Ok((resp, guard)), answered_failure(worker, status))
        }
        Ok(Err(e)) => failed(metrics, upstream_error(worker, e)),
        Err(_) => {
            let after = wait;
            let e = GatewayError::UpstreamTimeout {
                worker: worker.id.clone(),
                after,
            };
            failed(metrics, (e, Failure::Timeout))
        }
    }
}

/// What an answer means for the worker: 429 and 5xx are failures (retryable
/// elsewhere); anything else is a success for its health.
fn answered_failure(worker: &Worker, status: http::StatusCode) -> Option<Failure> {
    if status.as_u16() == 429 {
        Some(Failure::Overloaded)
    } else if status.is_server_error() {
        Some(Failure::Status(status.as_u16()))
    } else {
        health::on_success(&worker.state);
        None
    }
}

/// A transport error as the client's error and the worker's failure.
fn upstream_error(worker: &Worker, e: super::UpstreamError) -> (GatewayError, Failure) {
    let worker = worker.id.clone();
    let detail = error_chain(&e);
    if e.is_connect() {
        (
            GatewayError::UpstreamConnect { worker, detail },
            Failure::Connect,
        )
    } else {
        (
            GatewayError::UpstreamFailed { worker, detail },
            Failure::Broken,
        )
    }
}

fn failed(metrics: &PairMetrics, (err, failure): (GatewayError, Failure)) -> Sent {
    metrics.record_attempt(err.reason());
    tracing::warn!(worker = %metrics.worker, error = %err, "upstream attempt failed");
    (Err(err), Some(failure))
}

/// An upstream attempt's head, within its first-byte deadline.
type Attempted =
    Result<Result<Response<Incoming>, super::UpstreamError>, tokio::time::error::Elapsed>;

/// The span of one upstream attempt, from send to its head (or failure).
fn attempt_span_end(
    ctx: &ForwardContext<'_>,
    worker: &Worker,
    attempt: u32,
    span_id: u64,
    sent: Instant,
    result: &Attempted,
) {
    let (label, error) = match result {
        Ok(Ok(r)) => (
            attempt_result(r.status().as_u16()),
            r.status().is_server_error(),
        ),
        Ok(Err(e)) if e.is_connect() => ("upstream_connect", true),
        Ok(Err(_)) => ("upstream_failed", true),
        Err(_) => ("upstream_timeout", true),
    };
    ctx.tags.child_span(ChildSpan {
        name: "switchyard.upstream_attempt",
        kind: SpanKind::Client,
        span_id,
        start: sent,
        end: crate::runtime::clock::now(),
        attrs: vec![
            ("switchyard.worker", worker.id.as_ref().into()),
            ("switchyard.attempt", attempt.into()),
            ("switchyard.result", label.into()),
        ],
        error,
    });
}

/// A worker's answer that means "try another worker" (before anything reached the
/// client) rather than "tell the client": 5xx and 429.
pub(crate) fn retryable_status(s: http::StatusCode) -> bool {
    s.is_server_error() || s.as_u16() == 429
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
/// For `http://` workers the URI is in origin form with the worker's `Host`
/// (see [`send_prepared`]); for others it is absolute.
fn prepare(
    ctx: &ForwardContext<'_>,
    worker: &Worker,
    body: Bytes,
    attempt_span: u64,
) -> Result<Request<UpstreamBody>, GatewayError> {
    let plain = worker.is_plain_http();
    let translated = ctx.translates();
    let pq = match ctx.parts.uri.path_and_query() {
        _ if translated => super::anthropic::CHAT_PATH,
        Some(p) => p.as_str(),
        None => "/",
    };
    let uri = if plain && worker.path_prefix.is_empty() && !translated {
        // Origin form for `request_origin`; the path is the client's, shared.
        Ok(origin_form(&ctx.parts.uri))
    } else if plain {
        format!("{}{}", worker.path_prefix, pq)
            .parse::<Uri>()
            .map_err(|e| e.to_string())
    } else {
        Uri::builder()
            .scheme(worker.scheme.clone())
            .authority(worker.authority.clone())
            .path_and_query(format!("{}{}", worker.path_prefix, pq))
            .build()
            .map_err(|e| e.to_string())
    }
    .map_err(|e| GatewayError::UpstreamFailed {
        worker: worker.id.clone(),
        detail: format!("bad upstream URI: {e}"),
    })?;
    let pool = &ctx.route.pool;
    let pass_auth = pool.config.pass_client_auth;
    // The client's Content-Length is kept when the body is forwarded as it came
    // (hyper would otherwise format a new one); a rewritten body gets hyper's.
    let same_length = ctx.upload.is_some() || {
        let mut cl = ctx.parts.headers.get_all(header::CONTENT_LENGTH).iter();
        matches!((cl.next(), cl.next()), (Some(v), None)
            if v.to_str().ok().and_then(|s| s.parse::<usize>().ok()) == Some(body.len()))
    };
    let allow = &pool.config.forward_headers;
    let mut headers = forwardable(&ctx.parts.headers, 3, |n| {
        n == header::HOST
            || (n == header::CONTENT_LENGTH && !same_length)
            || stays_at_gateway(n, pass_auth, allow)
    });
    let asked_slo = ctx.own.has(Name::SloTtft) || ctx.own.has(Name::SloTpot);
    state_granted_claims(
        &mut headers,
        asked_slo,
        allow,
        ctx.tags.priority,
        ctx.info.slo,
    );
    if plain {
        headers.insert(header::HOST, worker.host.clone());
    }
    if let Some(auth) = &pool.upstream_auth {
        headers.insert(header::AUTHORIZATION, auth.clone());
    }
    headers.insert(REQUEST_ID_HEADER, ctx.request_id.clone());
    headers.insert(TRACEPARENT, ctx.tags.trace.upstream_header(attempt_span));
    let body = match ctx.upload {
        None => UpstreamBody::from(body),
        Some(u) => u.take().ok_or_else(|| GatewayError::UpstreamFailed {
            worker: worker.id.clone(),
            detail: "a streamed upload is sent once and cannot be retried".into(),
        })?,
    };
    let mut req = Request::new(body);
    *req.method_mut() = ctx.parts.method.clone();
    *req.uri_mut() = uri;
    *req.headers_mut() = headers;
    Ok(req)
}

/// Send a request built by [`prepare`]: origin form on this thread's HTTP/1
/// connections for `http://` workers, the absolute URI otherwise.
async fn send_prepared(
    client: &UpstreamClient,
    worker: &Worker,
    req: Request<UpstreamBody>,
) -> Result<Response<Incoming>, super::UpstreamError> {
    if worker.is_plain_http() {
        client.request_origin(&worker.authority, req).await
    } else {
        // Boxed so the plain-HTTP path's future stays small (futures are moved whole).
        Box::pin(client.request(req)).await
    }
}

/// How the engine learns the client left: SGLang pools get an abort on the
/// answering worker and, in a disaggregated request, its prefill worker.
fn cancel_for(
    ctx: &ForwardContext<'_>,
    worker: &Worker,
    prefill: Option<&str>,
) -> Option<Box<super::cancel::Cancel>> {
    let pool = &ctx.route.pool;
    if pool.config.engine != crate::config::EngineKind::Sglang {
        return None;
    }
    let mut workers = vec![worker.id.clone()];
    if let Some(p) = ctx.route.workers.iter().find(|w| Some(&*w.id) == prefill) {
        workers.push(p.id.clone());
    }
    Some(Box::new(super::cancel::Cancel::new(
        ctx.client,
        &pool.config,
        pool.upstream_auth.as_ref(),
        workers,
        ctx.body.clone(),
    )))
}

/// Wrap the upstream response for the client: hop-by-hop headers dropped, body
/// observed, debug route header when enabled.
pub(crate) fn respond(
    ctx: &ForwardContext<'_>,
    resp: Response<Incoming>,
    note: RouteNote<'_>,
    predicted: Option<u64>,
    guard: InFlightGuard,
    deadline: Instant,
) -> Response<Body> {
    let idx = note.index;
    let worker = &ctx.route.workers[idx];
    // The response's tags: the route as finally taken, with the prefix index's
    // prediction so observe can compare it with the worker's `cached_tokens`.
    let route = ctx.tags.route(
        &ctx.route.pool.metrics.name,
        worker,
        note.policy,
        note.reason.as_str(),
        predicted,
        note.precise,
    );
    let (mut parts, incoming) = resp.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    note.write_to(ctx, &mut parts.headers);
    if route.slo_downgraded {
        parts.headers.insert(
            super::slo::SLO_HEADER,
            HeaderValue::from_static("downgraded"),
        );
    }
    let sse = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    let observed = ObservedBody::new(
        incoming,
        ObserveParams {
            start: ctx.start,
            metrics: ctx.route.metrics[idx].clone(),
            endpoint: ctx.endpoint.index(),
            status: parts.status.as_u16(),
            sse,
            idle: ctx.timeouts.idle,
            deadline,
            guard,
            tags: ctx.tags.clone(),
            route,
            // A translated stream's errors are reshaped with the rest of it.
            anthropic_errors: ctx.endpoint.is_anthropic() && !ctx.translates(),
            cancel: cancel_for(ctx, worker, note.prefill),
            prompt_estimate: ctx.endpoint.carries_usage().then(|| ctx.size(0).tokens),
        },
    );
    if ctx.translates() {
        parts.headers.remove(header::CONTENT_LENGTH);
        let status = parts.status.as_u16();
        return Response::from_parts(
            parts,
            Body::new(super::anthropic::TranslatedBody::new(observed, sse, status)),
        );
    }
    if sse
        && parts.status.is_success()
        && super::usage::asks(ctx.info, &ctx.route.pool.config, ctx.endpoint)
    {
        // The usage chunk the gateway asked for is not the client's.
        parts.headers.remove(header::CONTENT_LENGTH);
        return Response::from_parts(parts, Body::new(super::usage::strip(observed)));
    }
    if ctx.endpoint == Endpoint::Responses {
        // Response ids carry their owner (`affinity`); the length changes.
        parts.headers.remove(header::CONTENT_LENGTH);
        let token = super::affinity::owner_token(&worker.id);
        let issuer = ctx.ids.issuer(&ctx.tags.tenant, token);
        let rewritten = super::affinity::rewrite_ids(Body::new(observed), issuer);
        return Response::from_parts(parts, Body::new(rewritten));
    }
    Response::from_parts(parts, Body::new(observed))
}
