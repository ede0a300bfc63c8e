//! The forwarding phases for one request: select → prepare → send → on response.
//! Retries go to a different worker, only while nothing has reached the client.

use super::client::{origin_form, UpstreamBody, UpstreamClient};
use super::error::GatewayError;
use super::headers::{forwardable, stays_at_gateway, strip_hop_by_hop};
use super::observe::{ObserveParams, ObservedBody};
use crate::api::{Endpoint, RequestInfo};
use crate::config::{GlobalConfig, HealthConfig, Residency, Timeouts};
use crate::pool::admission::{Priority, QueueError};
use crate::pool::{health, InFlightGuard, ModelRoute, RequestSize, Role, Worker};
use crate::routing::{Decision, Policy, Reason, RouteRequest};
use crate::telemetry;
use crate::telemetry::names;
use crate::telemetry::trace::{new_span_id, SpanKind, TRACEPARENT};
use crate::telemetry::RequestTags;
use axum::body::Body;
use bytes::Bytes;
use http::header::{self, HeaderName, HeaderValue};
use http::{request, Request, Response, Uri};
use http_body_util::Full;
use hyper::body::Incoming;
use metrics::counter;
use metrics::SharedString;
use smallvec::SmallVec;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tokio::time::Instant;

/// The request id header, propagated or made at the edge and set upstream.
pub const REQUEST_ID_HEADER: HeaderName = HeaderName::from_static("x-request-id");
/// Header carrying the session id used by session-affine routing.
pub const SESSION_HEADER: HeaderName = HeaderName::from_static("x-session-id");
/// Header selecting the queueing priority class (`high`, `normal`, `low`).
pub const PRIORITY_HEADER: HeaderName = HeaderName::from_static("x-switchyard-priority");
/// Debug header naming the chosen worker and the reason.
pub const ROUTE_HEADER: HeaderName = HeaderName::from_static("x-switchyard-route");
/// Request header naming a policy to use instead of the pool's (honoured only when
/// the pool sets `allow_policy_override`).
pub const POLICY_HEADER: HeaderName = HeaderName::from_static("x-switchyard-policy");

impl ForwardContext<'_> {
    pub(crate) fn route_request(&self) -> RouteRequest<'_> {
        RouteRequest::new(
            self.info,
            self.parts
                .headers
                .get(SESSION_HEADER)
                .and_then(|v| v.to_str().ok()),
        )
        .with_residency(self.residency)
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
        let bytes = self
            .info
            .routing_text
            .as_ref()
            .map_or(0, |t| t.len() as u64);
        let tokens = bytes / u64::from(self.route.pool.config.routing.bytes_per_token.get());
        RequestSize {
            bytes,
            tokens,
            prefill_tokens: tokens.saturating_sub(cached),
        }
    }
}

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
}

/// Forward to a worker chosen by the route's policy, retrying elsewhere on
/// retryable failures (within the pool's retry budget), queueing when every
/// eligible worker is at its concurrency limit, and return the observed response.
/// Disaggregated pools go through `disagg::forward`, which may come back here.
pub async fn forward(ctx: ForwardContext<'_>) -> Result<Response<Body>, GatewayError> {
    let result = match &ctx.route.pool.config.disaggregation {
        Some(d)
            if matches!(
                ctx.endpoint,
                Endpoint::ChatCompletions | Endpoint::Completions
            ) =>
        {
            // Boxed: its state would otherwise be part of every request's future.
            Box::pin(crate::disagg::forward(&ctx, d)).await
        }
        _ => forward_aggregated(&ctx).await,
    };
    // Overhead: time to the response head not spent waiting on workers, the pool
    // queue or retry backoff.
    ctx.route
        .pool
        .metrics
        .record_overhead(ctx.start.elapsed().saturating_sub(ctx.tags.waited()));
    result
}

/// The ordinary path: one worker does the whole request. In a disaggregated pool,
/// prefill-only workers are not eligible.
pub async fn forward_aggregated(ctx: &ForwardContext<'_>) -> Result<Response<Body>, GatewayError> {
    let route = ctx.route;
    let pool = &route.pool;
    let skip_prefill = pool.config.disaggregation.is_some();
    let rreq = ctx.route_request();
    let deadline = ctx.deadline();
    let pool_label = pool.metrics.name.clone();
    let limit = pool.config.max_concurrency_per_worker;
    // The pool's policy, or the one the request names when the pool allows it.
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
    // Workers tried so far: a few, kept inline.
    let mut tried: SmallVec<[usize; 4]> = SmallVec::new();
    let mut last_err: Option<GatewayError> = None;
    // Failed attempts as `worker=outcome`, logged when the request fails (only
    // allocated on failures).
    let mut trail: Vec<String> = Vec::new();
    let mut stop = "no_candidate";
    let mut blame = Blame::new(route, ctx.health);
    pool.retry_budget.on_request();
    let eligible = |i: usize, tried: &[usize]| {
        let w = &route.workers[i];
        w.is_available()
            && !tried.contains(&i)
            && !(skip_prefill && w.role == Role::Prefill)
            && ctx.allows(w)
    };

    let mut attempt = 0;
    while attempt < pool.config.max_attempts {
        // Phase: select (wait in the pool queue if every candidate is at its limit).
        let accept =
            |i: usize| eligible(i, &tried) && (limit == 0 || route.workers[i].in_flight() < limit);
        // Only a trace span needs the time routing took.
        let pick_start = ctx.tags.tracing().then(Instant::now);
        let decision = match policy.pick(&rreq, &route.workers, &accept) {
            Some(d) => d,
            None => {
                let saturated = limit > 0 && (0..route.workers.len()).any(|i| eligible(i, &tried));
                match (&pool.queue, saturated) {
                    (Some(q), true) => {
                        let prio = Priority::parse(
                            ctx.parts
                                .headers
                                .get(PRIORITY_HEADER)
                                .and_then(|v| v.to_str().ok()),
                        );
                        let waited = Instant::now();
                        let r = Box::pin(q.wait(prio, waited)).await;
                        ctx.tags.add_waited(waited.elapsed());
                        r.map_err(|e| match e {
                            QueueError::Full => GatewayError::QueueFull(pool.name.to_string()),
                            QueueError::Timeout => {
                                GatewayError::QueueTimeout(pool.name.to_string())
                            }
                        })?;
                        continue;
                    }
                    // Last resort for a retry: a worker already tried (not the one that
                    // just failed) or cooling down after a 429 — better than failing a
                    // request that another attempt could still save. Preferably one
                    // that answered this request (a 5xx may not repeat) over one whose
                    // connection broke or hung, and among those the one failing least
                    // for everybody else right now.
                    _ => match (attempt > 0)
                        .then(|| {
                            let ok = |i: usize| last_resort(route, i, &tried, skip_prefill, &rreq);
                            let answered = |i: usize| ok(i) && !blame.broke(i);
                            pick_fewest_failures(policy, &rreq, route, &answered)
                                .or_else(|| pick_fewest_failures(policy, &rreq, route, &ok))
                        })
                        .flatten()
                    {
                        Some(d) => {
                            counter!(names::LAST_RESORT_RETRIES_TOTAL, names::L_POOL => pool_label.clone())
                                .increment(1);
                            d
                        }
                        None => break,
                    },
                }
            }
        };
        if attempt > 0 {
            counter!(names::RETRIES_TOTAL, names::L_POOL => pool_label.clone()).increment(1);
            let b = Instant::now();
            Box::pin(backoff(pool.config.retry_backoff, attempt)).await;
            ctx.tags.add_waited(b.elapsed());
        }
        attempt += 1;
        pool.metrics
            .record_decision(policy.name(), decision.reason.as_str());
        // Before `record`, which teaches the index this request's blocks.
        let predicted = policy.predicted_cached_tokens(&decision, &rreq);
        policy.record(&decision, &rreq, &route.workers);
        let est_cost = policy.estimate_cost(&decision, &rreq);
        tried.push(decision.index);
        let worker = &route.workers[decision.index];
        if let Some(pick_start) = pick_start {
            ctx.tags.child_span(
                "switchyard.route",
                SpanKind::Internal,
                new_span_id(),
                pick_start,
                Instant::now(),
                vec![
                    ("switchyard.policy", policy.name().into()),
                    ("switchyard.reason", decision.reason.as_str().into()),
                    ("switchyard.worker", worker.id.as_ref().into()),
                ],
                false,
            );
        }
        let size = ctx.size(predicted.unwrap_or(0));

        // Phases: prepare and send.
        let (result, failure) =
            // Boxed: an attempt's state is a few KB, and Rust futures hold an awaited
            // future's state inline (often twice), then are moved whole; boxing it
            // keeps the request's future under 4 KB instead of over 20 KB.
            Box::pin(send_attempt(ctx, decision.index, ctx.body.clone(), size, deadline)).await;
        blame.record(decision.index, failure);
        match result {
            Ok((resp, guard)) => {
                let status = resp.status();
                if retryable_status(status) {
                    trail.push(format!("{}={}", worker.id, status.as_u16()));
                    match may_retry(route, &rreq, &tried, attempt, deadline, &pool_label) {
                        Ok(()) => {
                            tracing::debug!(worker = %worker.id, %status, "retrying on another worker");
                            continue;
                        }
                        Err(why) => log_failed(ctx, &trail, why),
                    }
                }
                if let Some(usd) = est_cost {
                    telemetry::record_estimated_cost(&pool_label, usd);
                }
                // Phase: on response.
                let mut out = respond(
                    ctx,
                    resp,
                    decision.index,
                    decision.reason,
                    predicted,
                    guard,
                    deadline,
                );
                if ctx.debug_headers {
                    let mut v = format!(
                        "{}; policy={}; reason={}",
                        worker.id,
                        policy.name(),
                        decision.reason.as_str()
                    );
                    if let Some(usd) = est_cost {
                        v.push_str(&format!("; est_cost_usd={usd:.9}"));
                    }
                    if let Ok(v) = HeaderValue::from_str(&v) {
                        out.headers_mut().insert(ROUTE_HEADER, v);
                    }
                }
                return Ok(out);
            }
            Err(err) => {
                trail.push(format!("{}={}", worker.id, err.reason()));
                let retry = err.retryable();
                last_err = Some(err);
                if !retry {
                    stop = "not_retryable";
                    break;
                }
                if let Err(why) = may_retry(route, &rreq, &tried, attempt, deadline, &pool_label) {
                    stop = why;
                    break;
                }
            }
        }
    }
    log_failed(ctx, &trail, stop);
    Err(last_err.unwrap_or_else(|| ctx.no_worker()))
}

/// One line per request that failed (or is passed a worker's error) after its
/// attempts: which workers answered what, and why no further attempt was made
/// (`attempts`, `deadline`, `no_candidate`, `budget`, `not_retryable`).
fn log_failed(ctx: &ForwardContext<'_>, trail: &[String], stop: &'static str) {
    tracing::warn!(
        request_id = ?ctx.request_id,
        model = %ctx.route.model,
        attempts = %trail.join(","),
        stop,
        "request failed"
    );
}

/// Send `body` to `worker` with the client's (filtered) headers, bounded by the
/// first-byte and total deadlines, charging a failure to the worker's health at
/// once; a response of any status is `Ok` (the caller decides whether to retry it).
/// `size` is what the request adds to the worker's load until its first token.
pub(crate) async fn send(
    ctx: &ForwardContext<'_>,
    idx: usize,
    body: Bytes,
    size: RequestSize,
    deadline: Instant,
) -> Result<(Response<Incoming>, InFlightGuard), GatewayError> {
    let (result, failure) = send_attempt(ctx, idx, body, size, deadline).await;
    if let Some(f) = failure {
        charge(ctx.route, ctx.health, idx, f);
    }
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
    fn may_be_the_requests(self) -> bool {
        self != Failure::Connect
    }
}

/// Count a failure against the worker: a 429 cooldown, or a failure towards
/// passive ejection.
fn charge(route: &ModelRoute, cfg: &HealthConfig, idx: usize, f: Failure) {
    let w = &route.workers[idx];
    if f == Failure::Overloaded {
        health::on_overloaded(w, &route.workers, cfg);
    } else {
        w.state.failures.fetch_add(1, Ordering::Relaxed);
        health::on_failure(w, &route.workers, cfg);
    }
}

/// Who is to blame for a request's failed attempts, settled when the request is
/// done (dropped). If the request succeeded in the end, every failure was its
/// worker's and is charged. If it failed, a failure seen on two or more workers
/// (the same status, resets, timeouts, 429s) is taken as the request's own — a
/// query of death, a per-key limit upstream, a fault the client asked for — and
/// charged to none of them; the others are charged. Otherwise one such request
/// retried over the pool ejects or cools down healthy workers one after the
/// other and shrinks the pool for everybody else. Refused connections are always
/// charged. The charge comes a few attempts late at most.
struct Blame<'a> {
    route: &'a ModelRoute,
    cfg: &'a HealthConfig,
    /// This request's failed attempts (allocated only on failures).
    failures: Vec<(usize, Failure)>,
    succeeded: bool,
}

impl<'a> Blame<'a> {
    fn new(route: &'a ModelRoute, cfg: &'a HealthConfig) -> Self {
        Blame {
            route,
            cfg,
            failures: Vec::new(),
            succeeded: false,
        }
    }

    /// Attempt on worker `idx` ended with `failure` (`None`: it succeeded).
    fn record(&mut self, idx: usize, failure: Option<Failure>) {
        match failure {
            Some(f) => self.failures.push((idx, f)),
            None => self.succeeded = true,
        }
    }

    /// Worker `idx`'s connection broke or hung on this request.
    fn broke(&self, idx: usize) -> bool {
        self.failures.iter().any(|&(i, f)| {
            i == idx && matches!(f, Failure::Broken | Failure::Timeout | Failure::Connect)
        })
    }
}

impl Drop for Blame<'_> {
    fn drop(&mut self) {
        let mut own = false;
        for &(i, f) in &self.failures {
            let repeated = self.failures.iter().any(|&(j, g)| g == f && j != i);
            if !self.succeeded && repeated && f.may_be_the_requests() {
                own = true;
            } else {
                charge(self.route, self.cfg, i, f);
            }
        }
        if own {
            counter!(names::REQUEST_CAUSED_FAILURES_TOTAL,
                names::L_POOL => SharedString::from(self.route.pool.name.clone()))
            .increment(1);
        }
    }
}

/// One attempt: send, wait for the response head. Attempt metrics and a success
/// are accounted here; a failure is returned for the caller to charge (or not).
pub(crate) async fn send_attempt(
    ctx: &ForwardContext<'_>,
    idx: usize,
    body: Bytes,
    size: RequestSize,
    deadline: Instant,
) -> (
    Result<(Response<Incoming>, InFlightGuard), GatewayError>,
    Option<Failure>,
) {
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
    let guard = worker.begin(route.pool.queue.as_ref(), size);
    let sent = Instant::now();
    let until = (sent + ctx.timeouts.first_byte).min(deadline);
    let wait = until.saturating_duration_since(sent);
    let result =
        tokio::time::timeout_at(until, send_prepared(ctx.client, worker, upstream_req)).await;
    ctx.tags.add_waited(sent.elapsed());
    let attempt = ctx.tags.add_attempt();
    if ctx.tags.tracing() {
        let (label, error) = match &result {
            Ok(Ok(r)) => (
                attempt_result(r.status().as_u16()),
                r.status().is_server_error(),
            ),
            Ok(Err(e)) if e.is_connect() => ("upstream_connect", true),
            Ok(Err(_)) => ("upstream_failed", true),
            Err(_) => ("upstream_timeout", true),
        };
        ctx.tags.child_span(
            "switchyard.upstream_attempt",
            SpanKind::Client,
            attempt_span,
            sent,
            Instant::now(),
            vec![
                ("switchyard.worker", worker.id.as_ref().into()),
                ("switchyard.attempt", attempt.into()),
                ("switchyard.result", label.into()),
            ],
            error,
        );
    }
    let (err, failure) = match result {
        Err(_) => (
            GatewayError::UpstreamTimeout {
                worker: worker.id.clone(),
                after: wait,
            },
            Failure::Timeout,
        ),
        Ok(Err(e)) if e.is_connect() => (
            GatewayError::UpstreamConnect {
                worker: worker.id.clone(),
                detail: error_chain(&e),
            },
            Failure::Connect,
        ),
        Ok(Err(e)) => (
            GatewayError::UpstreamFailed {
                worker: worker.id.clone(),
                detail: error_chain(&e),
            },
            Failure::Broken,
        ),
        Ok(Ok(resp)) => {
            let status = resp.status();
            metrics.record_attempt(attempt_result(status.as_u16()));
            let failure = if status.as_u16() == 429 {
                Some(Failure::Overloaded)
            } else if status.is_server_error() {
                Some(Failure::Status(status.as_u16()))
            } else {
                health::on_success(&worker.state);
                None
            };
            return (Ok((resp, guard)), failure);
        }
    };
    metrics.record_attempt(err.reason());
    tracing::warn!(worker = %worker.id, error = %err, "upstream attempt failed");
    (Err(err), Some(failure))
}

/// Another attempt is allowed: attempts left, time left, an untried worker able to
/// take it, and the pool's retry budget has a retry to spend (checked last: it takes
/// one). Otherwise, why not.
fn may_retry(
    route: &ModelRoute,
    rreq: &RouteRequest<'_>,
    tried: &[usize],
    attempt: u32,
    deadline: Instant,
    pool_label: &SharedString,
) -> Result<(), &'static str> {
    let pool = &route.pool;
    if attempt >= pool.config.max_attempts {
        return Err("attempts");
    }
    if Instant::now() >= deadline {
        return Err("deadline");
    }
    let skip_prefill = pool.config.disaggregation.is_some();
    let candidate = (0..route.workers.len()).any(|i| {
        (route.workers[i].is_available() && !tried.contains(&i) && rreq.allows(&route.workers[i]))
            || last_resort(route, i, tried, skip_prefill, rreq)
    });
    if !candidate {
        return Err("no_candidate");
    }
    if pool.retry_budget.try_retry() {
        Ok(())
    } else {
        counter!(names::RETRY_BUDGET_EXHAUSTED_TOTAL, names::L_POOL => pool_label.clone())
            .increment(1);
        Err("budget")
    }
}

/// A worker's answer that means "try another worker" (before anything reached the
/// client) rather than "tell the client": 5xx and 429.
pub(crate) fn retryable_status(s: http::StatusCode) -> bool {
    s.is_server_error() || s.as_u16() == 429
}

/// May worker `i` take a retry when no untried available worker is left? Not
/// ejected or draining (a 429 cooldown is tolerated), not the worker that failed
/// last, not prefill-only in a disaggregated pool, and allowed by the residency.
fn last_resort(
    route: &ModelRoute,
    i: usize,
    tried: &[usize],
    skip_prefill: bool,
    rreq: &RouteRequest<'_>,
) -> bool {
    let w = &route.workers[i];
    w.state.healthy.load(Ordering::Relaxed)
        && !w.state.draining.load(Ordering::Relaxed)
        && tried.last() != Some(&i)
        && !(skip_prefill && w.role == Role::Prefill)
        && rreq.allows(w)
}

/// The policy's pick among the workers `ok` admits that have the fewest
/// consecutive failures (as charged so far).
fn pick_fewest_failures(
    policy: &dyn Policy,
    req: &RouteRequest<'_>,
    route: &ModelRoute,
    ok: &dyn Fn(usize) -> bool,
) -> Option<Decision> {
    let failures = |i: usize| {
        route.workers[i]
            .state
            .health
            .consecutive_failures
            .load(Ordering::Relaxed)
    };
    let fewest = (0..route.workers.len())
        .filter(|&i| ok(i))
        .map(failures)
        .min()?;
    policy.pick(req, &route.workers, &|i| ok(i) && failures(i) == fewest)
}

/// Jittered exponential backoff before retry number `attempt` (1-based).
async fn backoff(base: std::time::Duration, attempt: u32) {
    if base.is_zero() {
        return;
    }
    let cap = base.saturating_mul(1 << attempt.min(6));
    let d = cap.mul_f64(rand::random::<f64>());
    tokio::time::sleep(d).await;
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
    let pq = ctx
        .parts
        .uri
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/");
    let uri = if plain && worker.path_prefix.is_empty() {
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
    let same_length = {
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
    if plain {
        headers.insert(header::HOST, worker.host.clone());
    }
    if let Some(auth) = &pool.upstream_auth {
        headers.insert(header::AUTHORIZATION, auth.clone());
    }
    headers.insert(REQUEST_ID_HEADER, ctx.request_id.clone());
    headers.insert(TRACEPARENT, ctx.tags.trace.upstream_header(attempt_span));
    let mut req = Request::new(Full::new(body));
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

/// Wrap the upstream response for the client: hop-by-hop headers dropped, body
/// observed, debug route header when enabled.
pub(crate) fn respond(
    ctx: &ForwardContext<'_>,
    resp: Response<Incoming>,
    idx: usize,
    reason: Reason,
    predicted: Option<u64>,
    guard: InFlightGuard,
    deadline: Instant,
) -> Response<Body> {
    let worker = &ctx.route.workers[idx];
    // The response's tags: the route as finally taken, with the prefix index's
    // prediction so observe can compare it with the worker's `cached_tokens`.
    let route = ctx.tags.route(
        &ctx.route.pool.metrics.name,
        worker,
        ctx.route.policy.name(),
        reason.as_str(),
        predicted,
    );
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
            metrics: ctx.route.metrics[idx].clone(),
            endpoint: ctx.endpoint.index(),
            status: parts.status.as_u16(),
            sse,
            idle: ctx.timeouts.idle,
            deadline,
            guard,
            tags: ctx.tags.clone(),
            route,
        },
    );
    if ctx.debug_headers {
        if let Ok(v) = HeaderValue::from_str(&format!("{}; reason={}", worker.id, reason.as_str()))
        {
            parts.headers.insert(ROUTE_HEADER, v);
        }
    }
    Response::from_parts(parts, Body::new(observed))
}
