//! Prefill/decode disaggregation: the gateway picks both workers and hands the
//! request from one to the other, the way the engines expect it.
//!
//! - **vLLM (NIXL connector)**, sequential: the prefill worker gets the request with
//!   `max_tokens: 1`, `stream: false` and `kv_transfer_params.do_remote_decode`; its
//!   answer's `kv_transfer_params` go with the original request to the decode worker.
//! - **SGLang**, concurrent: `bootstrap_host`, `bootstrap_port` and a random 63-bit
//!   `bootstrap_room` are injected and the request goes to both at once; the decode
//!   worker's response is streamed back.
//!
//! A decider keeps short prompts (few uncached tokens) on the aggregated path, as it
//! does when no prefill or decode worker is available. A failed leg is retried with
//! a fresh pair before anything reaches the client. TTFT includes both legs because
//! it is measured from the request's arrival.

mod pairs;

use super::attempts::{backoff, forward_aggregated, Blame};
use super::forward::{respond, retryable_status, send_attempt, Failure, ForwardContext, RouteNote};
use super::GatewayError;
use crate::config::{DisaggConfig, DisaggMode};
use crate::pool::{InFlightGuard, RequestSize, Role, Worker};
use crate::routing::{rendezvous, Reason};
use crate::telemetry::names;
use axum::body::Body;
use bytes::Bytes;
use http::Response;
use http_body_util::{BodyExt, Limited};
use metrics::{counter, histogram, SharedString};
use serde_json::{json, Map, Value};
use std::sync::Arc;
use tokio::time::Instant;

/// Approximate bytes per token for the decider's prompt estimate.
const BYTES_PER_TOKEN: u64 = 4;

/// Route one chat/completions request of a disaggregated pool.
pub async fn forward(
    ctx: &ForwardContext<'_>,
    cfg: &DisaggConfig,
) -> Result<Response<Body>, GatewayError> {
    let pool = SharedString::from(ctx.route.pool.name.clone());
    let skip = skip_reason(ctx, cfg);
    let mode = match cfg.mode {
        DisaggMode::Vllm => "vllm",
        DisaggMode::Sglang => "sglang",
    };
    counter!(names::DISAGG_DECISIONS_TOTAL, names::L_POOL => pool.clone(),
        names::L_MODE => mode, names::L_REASON => skip.unwrap_or("disaggregated"))
    .increment(1);
    if skip.is_some() {
        return forward_aggregated(ctx).await;
    }
    let body: Map<String, Value> = serde_json::from_slice(&ctx.body)
        .map_err(|e| GatewayError::MalformedJson(e.to_string()))?;
    ctx.route.pool.retry_budget.on_request();
    // Failed legs are charged to their workers when the request is done, as in
    // the aggregated path: a failure the request itself causes on two workers
    // is charged to neither.
    let mut blame = Blame::new(ctx.route, ctx.health);
    let (mut tried_prefill, mut tried_decode) = (Vec::new(), Vec::new());
    let mut last_err = None;
    for attempt in 0..ctx.route.pool.config.max_attempts {
        if attempt > 0 && !retry_allowed(ctx, &pool, attempt).await {
            break;
        }
        let (Some(p), Some(d)) = (
            pick_prefill(ctx, &tried_prefill),
            pick_decode(ctx, &tried_decode),
        ) else {
            break;
        };
        let (p, d) = if attempt == 0 {
            let can_prefill = |i| can_prefill(ctx, i, &[]);
            let can_decode = |i| can_decode(ctx, i, &[]);
            pairs::choose(ctx, cfg.mode, (p, d), &can_prefill, &can_decode)?
        } else {
            (p, d)
        };
        let result = match cfg.mode {
            DisaggMode::Vllm => vllm(ctx, cfg, &body, p, d).await,
            DisaggMode::Sglang => sglang(ctx, cfg, &body, p, d).await,
        };
        let LegError { leg, err, failure } = match result {
            Ok(resp) => {
                blame.record(d, None);
                return Ok(resp);
            }
            Err(e) => e,
        };
        counter!(names::DISAGG_LEG_FAILURES_TOTAL, names::L_POOL => pool.clone(),
            names::L_LEG => leg.as_str())
        .increment(1);
        tracing::warn!(leg = leg.as_str(), error = %err, "disaggregated leg failed");
        match leg {
            Leg::Prefill => tried_prefill.push(p),
            Leg::Decode => tried_decode.push(d),
        }
        if let Some(f) = failure {
            blame.record(if matches!(leg, Leg::Prefill) { p } else { d }, Some(f));
        }
        if !err.retryable() {
            return Err(err);
        }
        last_err = Some(err);
    }
    Err(last_err.unwrap_or_else(|| ctx.no_worker()))
}

/// Why the request stays on the aggregated path, if it does: few uncached
/// prompt tokens (as far as the best prefill worker's cache is predicted), or
/// no prefill or no decode worker available.
fn skip_reason(ctx: &ForwardContext<'_>, cfg: &DisaggConfig) -> Option<&'static str> {
    let workers = &ctx.route.workers;
    let prompt_tokens = ctx
        .info
        .routing_text
        .as_ref()
        .map_or(0, |t| t.len() as u64 / BYTES_PER_TOKEN);
    // A dry-run pick: nothing is recorded.
    let req = ctx.route_request();
    let accept = |i: usize| {
        workers[i].role == Role::Prefill && workers[i].is_available() && ctx.allows(&workers[i])
    };
    let predicted = ctx
        .route
        .policy
        .pick(&req, workers, &accept)
        .and_then(|d| ctx.route.policy.predicted_cached_tokens(&d, &req))
        .unwrap_or(0);
    let any = |f: &dyn Fn(&Worker) -> bool| {
        workers
            .iter()
            .any(|w| w.is_available() && ctx.allows(w) && f(w))
    };
    if prompt_tokens.saturating_sub(predicted) < cfg.min_uncached_tokens {
        Some("few_uncached_tokens")
    } else if !any(&|w| w.role == Role::Prefill) {
        Some("no_prefill_worker")
    } else if !any(&|w| w.role != Role::Prefill) {
        Some("no_decode_worker")
    } else {
        None
    }
}

/// A retry, as in the aggregated path: within the deadline and the retry
/// budget, counted, after a jittered backoff.
async fn retry_allowed(ctx: &ForwardContext<'_>, pool: &SharedString, attempt: u32) -> bool {
    if crate::runtime::clock::now() >= ctx.deadline() {
        return false;
    }
    if !ctx.route.pool.retry_budget.try_retry() {
        counter!(names::RETRY_BUDGET_EXHAUSTED_TOTAL, names::L_POOL => pool.clone()).increment(1);
        return false;
    }
    counter!(names::RETRIES_TOTAL, names::L_POOL => pool.clone()).increment(1);
    let b = crate::runtime::clock::now();
    Box::pin(backoff(ctx.route.pool.config.retry_backoff, attempt)).await;
    ctx.tags.add_waited(b.elapsed());
    true
}

#[derive(Clone, Copy, Debug)]
enum Leg {
    Prefill,
    Decode,
}

impl Leg {
    fn as_str(self) -> &'static str {
        match self {
            Leg::Prefill => "prefill",
            Leg::Decode => "decode",
        }
    }
}

struct LegError {
    leg: Leg,
    err: GatewayError,
    /// What the leg's worker is to be charged with, settled by [`Blame`].
    failure: Option<Failure>,
}

/// Send one leg; a transport failure or a retryable answer (429, 5xx) is the
/// leg's error, with what its worker is to be charged with.
async fn send_leg(
    ctx: &ForwardContext<'_>,
    which: Leg,
    idx: usize,
    body: Bytes,
    size: RequestSize,
) -> Result<(Response<hyper::body::Incoming>, InFlightGuard), LegError> {
    let (result, failure) = send_attempt(ctx, idx, body, size, ctx.deadline(), None).await;
    let (resp, guard) = result.map_err(|err| LegError {
        leg: which,
        err,
        failure,
    })?;
    if !retryable_status(resp.status()) {
        return Ok((resp, guard));
    }
    Err(LegError {
        leg: which,
        err: GatewayError::UpstreamFailed {
            worker: ctx.route.workers[idx].id.clone(),
            detail: format!("{} answered {}", which.as_str(), resp.status()),
        },
        failure,
    })
}

/// Prefill by the pool's policy (prefix affinity when configured) over prefill workers.
fn pick_prefill(ctx: &ForwardContext<'_>, tried: &[usize]) -> Option<usize> {
    let ws = &ctx.route.workers;
    let req = ctx.route_request();
    let d = ctx
        .route
        .policy
        .pick(&req, ws, &|i| can_prefill(ctx, i, tried))?;
    // The prompt's blocks are now on this prefill worker (prefix index).
    ctx.route.policy.record(&d, &req, ws);
    Some(d.index)
}

fn can_prefill(ctx: &ForwardContext<'_>, i: usize, tried: &[usize]) -> bool {
    let w = &ctx.route.workers[i];
    w.role == Role::Prefill && w.is_available() && !tried.contains(&i) && ctx.allows(w)
}

fn can_decode(ctx: &ForwardContext<'_>, i: usize, tried: &[usize]) -> bool {
    let w = &ctx.route.workers[i];
    w.role != Role::Prefill && w.is_available() && !tried.contains(&i) && ctx.allows(w)
}

/// Decode by load: fewest requests in flight, ties broken by rendezvous hashing of
/// the routing text so replicas agree; only where the request's residency allows.
/// (Locality tiers are not applied to the decode leg.)
fn pick_decode(ctx: &ForwardContext<'_>, tried: &[usize]) -> Option<usize> {
    let ws = &ctx.route.workers;
    let key = ctx
        .info
        .routing_text
        .as_ref()
        .map_or(0, |t| xxhash_rust::xxh3::xxh3_64(t));
    let min = (0..ws.len())
        .filter(|&i| can_decode(ctx, i, tried))
        .map(|i| ws[i].in_flight())
        .min()?;
    rendezvous::pick(
        key,
        (0..ws.len())
            .filter(|&i| can_decode(ctx, i, tried) && ws[i].in_flight() == min)
            .map(|i| (i, ws[i].id_hash)),
    )
}

fn to_bytes(v: &Map<String, Value>) -> Bytes {
    Bytes::from(serde_json::to_vec(v).expect("a JSON map serialises"))
}

fn leg_seconds(pool: &Arc<str>, leg: &'static str, since: Instant) {
    histogram!(names::DISAGG_LEG_SECONDS, names::L_POOL => SharedString::from(pool.clone()),
        names::L_LEG => leg)
    .record(since.elapsed().as_secs_f64());
}

async fn vllm(
    ctx: &ForwardContext<'_>,
    cfg: &DisaggConfig,
    body: &Map<String, Value>,
    p: usize,
    d: usize,
) -> Result<Response<Body>, LegError> {
    let ws = &ctx.route.workers;
    let deadline = ctx.deadline();
    let pool = &ctx.route.pool.name;

    // Leg 1: prefill only, one token, not streamed.
    let mut pre = body.clone();
    pre.insert(
        "kv_transfer_params".into(),
        json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
               "remote_block_ids": null, "remote_host": null, "remote_port": null}),
    );
    pre.insert("stream".into(), Value::Bool(false));
    pre.remove("stream_options");
    pre.insert("max_tokens".into(), json!(1));
    if pre.contains_key("max_completion_tokens") {
        pre.insert("max_completion_tokens".into(), json!(1));
    }
    let t0 = crate::runtime::clock::now();
    let dispatch = ws[p].dispatch(ctx.size(0));
    let (resp, guard) = send_leg(ctx, Leg::Prefill, p, to_bytes(&pre), ctx.size(0)).await?;
    if !resp.status().is_success() {
        // The client's mistake (e.g. 400): show it the prefill worker's answer.
        let note = RouteNote {
            index: p,
            policy: ctx.route.policy.name(),
            reason: Reason::Prefill,
            prefill: None,
            est_cost_usd: None,
            precise: false,
        };
        return Ok(respond(ctx, resp, note, None, guard, deadline));
    }
    let limit = cfg.max_prefill_response_bytes;
    let read =
        tokio::time::timeout_at(deadline, Limited::new(resp.into_body(), limit).collect()).await;
    if matches!(read, Ok(Ok(_))) {
        // The one-token answer took the leg's time to first token.
        guard.learn(&dispatch, t0.elapsed(), None);
    }
    drop(guard);
    let failed = |detail: String| LegError {
        leg: Leg::Prefill,
        err: GatewayError::UpstreamFailed {
            worker: ws[p].id.clone(),
            detail,
        },
        failure: Some(Failure::Broken),
    };
    let bytes = match read {
        Ok(Ok(c)) => c.to_bytes(),
        Ok(Err(e)) => return Err(failed(format!("reading prefill answer: {e}"))),
        Err(_) => return Err(failed("prefill answer timed out".into())),
    };
    #[derive(serde::Deserialize)]
    struct PrefillAnswer {
        kv_transfer_params: Option<Value>,
    }
    let kv = serde_json::from_slice::<PrefillAnswer>(&bytes)
        .ok()
        .and_then(|a| a.kv_transfer_params)
        .filter(Value::is_object)
        .ok_or_else(|| failed("prefill answer carries no kv_transfer_params".into()))?;
    leg_seconds(pool, "prefill", t0);

    // Leg 2: the original request, with the transfer parameters.
    let mut dec = body.clone();
    dec.insert("kv_transfer_params".into(), kv);
    decode_leg(ctx, to_bytes(&dec), p, d).await
}

async fn decode_leg(
    ctx: &ForwardContext<'_>,
    body: Bytes,
    p: usize,
    d: usize,
) -> Result<Response<Body>, LegError> {
    let ws = &ctx.route.workers;
    let deadline = ctx.deadline();
    let t1 = crate::runtime::clock::now();
    // The KV arrives from the prefill worker: no prefill work here.
    let size = RequestSize {
        prefill_tokens: 0,
        ..ctx.size(0)
    };
    let (resp, guard) = send_leg(ctx, Leg::Decode, d, body, size).await?;
    leg_seconds(&ctx.route.pool.name, "decode_first_byte", t1);
    let note = RouteNote {
        index: d,
        policy: ctx.route.policy.name(),
        reason: Reason::Decode,
        prefill: Some(&ws[p].id),
        est_cost_usd: None,
        precise: false,
    };
    Ok(respond(ctx, resp, note, None, guard, deadline))
}

async fn sglang(
    ctx: &ForwardContext<'_>,
    cfg: &DisaggConfig,
    body: &Map<String, Value>,
    p: usize,
    d: usize,
) -> Result<Response<Body>, LegError> {
    let ws = &ctx.route.workers;
    let prefill = &ws[p];
    let port = prefill
        .labels
        .get("bootstrap_port")
        .and_then(|v| v.parse::<u16>().ok())
        .unwrap_or(cfg.bootstrap_port);
    let mut b = body.clone();
    b.insert("bootstrap_host".into(), json!(prefill.authority.host()));
    b.insert("bootstrap_port".into(), json!(port));
    b.insert("bootstrap_room".into(), json!(rand::random::<u64>() >> 1));
    let bytes = to_bytes(&b);
    let t0 = crate::runtime::clock::now();
    let dispatch = prefill.dispatch(ctx.size(0));
    let (pre, dec) = tokio::join!(
        send_leg(ctx, Leg::Prefill, p, bytes.clone(), ctx.size(0)),
        decode_leg(ctx, bytes, p, d)
    );
    let (pre_resp, pre_guard) = pre?;
    leg_seconds(&ctx.route.pool.name, "prefill", t0);
    // The prefill worker's own answer is not for the client: drain it aside.
    // Its end is the end of the prefill: what the worker's model learns.
    tokio::spawn(async move {
        if pre_resp.into_body().collect().await.is_ok() {
            pre_guard.learn(&dispatch, t0.elapsed(), None);
        }
    });
    dec
}
