//! HTTP surface of one simulated engine, in the shapes of vLLM's OpenAI
//! server: chat/completions (stream and not, `n` choices, forced tool calls),
//! the Responses API (see `responses`), embeddings, models, health,
//! version, metrics; SGLang's `/get_load`; the `/sim/*` admin routes; P/D
//! parameters of vLLM's NIXL connector and SGLang's bootstrap protocol.

use std::fmt::Write as _;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Router};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Deserialize;
use serde_json::{json, Map, Value};
use tokio::sync::{mpsc, Notify};
use tokio::time::Instant;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::engine::{vocab, Event, Finish, Remote, Submit};
use super::faults::{Fault, Faults, FAULT_HEADER};
use super::{
    endpoints, messages, metrics, responses, tokenizer, tools, ConnCtl, EngineKind, Role, Shared,
};

type S = State<Arc<Shared>>;

pub(crate) fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/responses", post(responses))
        .route(
            "/v1/responses/{id}",
            get(stored_response).delete(delete_response),
        )
        .route("/v1/responses/{id}/input_items", get(input_items))
        .route("/v1/responses/{id}/cancel", post(cancel_response))
        .route("/v1/messages", post(anthropic_messages))
        .route("/v1/messages/count_tokens", post(count_tokens))
        .route("/v1/embeddings", post(embeddings))
        .route("/tokenize", post(endpoints::tokenize))
        .route("/detokenize", post(endpoints::detokenize))
        .route("/v1/rerank", post(endpoints::rerank))
        .route("/rerank", post(endpoints::rerank))
        .route("/v2/rerank", post(endpoints::rerank))
        .route("/v1/score", post(endpoints::score))
        .route("/score", post(endpoints::score))
        .route("/v1/audio/transcriptions", post(endpoints::audio))
        .route("/v1/audio/translations", post(endpoints::audio))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/version", get(version))
        .route("/metrics", get(prom))
        .route("/get_load", get(get_load))
        .route("/abort_request", post(super::abort::abort_request))
        .route("/get_model_info", get(get_model_info))
        .route("/sim/faults", post(set_faults).get(get_faults))
        .route("/sim/info", get(info))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(32 << 20))
        .with_state(shared)
}

// ---------------------------------------------------------------- errors

/// An OpenAI-shaped error, as vLLM sends it.
pub(super) struct ApiError {
    status: StatusCode,
    message: String,
    param: Option<&'static str>,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let kind = match self.status.as_u16() {
            400 => "BadRequestError",
            404 => "NotFoundError",
            429 => "RateLimitError",
            503 => "ServiceUnavailableError",
            s if s >= 500 => "InternalServerError",
            _ => "Error",
        };
        let body = json!({"error": {
            "message": self.message, "type": kind, "param": self.param, "code": self.status.as_u16()
        }});
        let mut r = (self.status, axum::Json(body)).into_response();
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        r
    }
}

impl ApiError {
    /// The error in the shape of the API the request came in on.
    fn respond(self, kind: Kind) -> Response {
        match kind {
            Kind::Messages => messages::error(self.status, &self.message),
            _ => self.into_response(),
        }
    }
}

pub(super) fn api_error(
    status: StatusCode,
    message: impl Into<String>,
    param: Option<&'static str>,
) -> ApiError {
    ApiError {
        status,
        message: message.into(),
        param,
    }
}

pub(crate) fn error(
    status: StatusCode,
    message: impl Into<String>,
    param: Option<&'static str>,
) -> Response {
    api_error(status, message, param).into_response()
}

pub(super) fn bad(message: impl Into<String>) -> ApiError {
    api_error(StatusCode::BAD_REQUEST, message, None)
}

async fn not_found() -> Response {
    error(StatusCode::NOT_FOUND, "Not Found", None)
}

// ---------------------------------------------------------------- info routes

async fn health(State(s): S) -> Response {
    if s.faults.borrow().health_fail {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "unhealthy (sim fault)",
            None,
        );
    }
    StatusCode::OK.into_response()
}

async fn version() -> Response {
    axum::Json(json!({"version": concat!(env!("CARGO_PKG_VERSION"), "+switchyard-sim")}))
        .into_response()
}

async fn models(State(s): S) -> Response {
    let data: Vec<Value> = s
        .cfg
        .served_names()
        .map(|m| {
            json!({"id": m, "object": "model", "created": s.started, "owned_by": s.cfg.engine.as_str(),
                   "root": s.cfg.model, "parent": null, "max_model_len": s.cfg.max_model_len,
                   "permission": []})
        })
        .collect();
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

async fn prom(State(s): S) -> Response {
    let text = metrics::render(s.cfg.engine, &s.cfg.model, &s.stats);
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

async fn get_load(State(s): S) -> Response {
    if s.cfg.engine != EngineKind::Sglang {
        return not_found().await;
    }
    let running = s.stats.running.load(Relaxed);
    let waiting = s.stats.waiting.load(Relaxed);
    let tokens = s.stats.kv_used_blocks.load(Relaxed) * s.stats.block_size;
    axum::Json(json!([{
        "dp_rank": 0, "num_reqs": running + waiting, "num_waiting_reqs": waiting, "num_tokens": tokens
    }]))
    .into_response()
}

async fn get_model_info(State(s): S) -> Response {
    if s.cfg.engine != EngineKind::Sglang {
        return not_found().await;
    }
    axum::Json(
        json!({"model_path": s.cfg.model, "tokenizer_path": s.cfg.model, "is_generation": true}),
    )
    .into_response()
}

async fn info(State(s): S) -> Response {
    let c = &s.cfg;
    axum::Json(json!({
        "engine": c.engine, "role": c.role, "engine_id": s.engine_id, "profile": c.profile,
        "model": c.model, "aliases": c.aliases, "time_scale": c.time_scale, "seed": c.seed,
        "max_num_seqs": c.max_num_seqs, "max_num_batched_tokens": c.max_num_batched_tokens,
        "block_size": c.block_size, "num_blocks": c.num_blocks, "max_model_len": c.max_model_len,
        "enable_prefix_caching": c.enable_prefix_caching, "preemption": c.preemption,
        "step_base_ms": c.step_base_ms, "per_seq_ms": c.per_seq_ms,
        "per_prefill_token_ms": c.per_prefill_token_ms,
        "kv_transfer_base_ms": c.kv_transfer_base_ms,
        "kv_transfer_per_token_ms": c.kv_transfer_per_token_ms,
    }))
    .into_response()
}

async fn set_faults(State(s): S, body: Bytes) -> Response {
    let f: Faults = match serde_json::from_slice(&body) {
        Ok(f) => f,
        Err(e) => return bad(format!("invalid faults: {e}")).into_response(),
    };
    if let Err(e) = f.validate() {
        return bad(e).into_response();
    }
    s.faults.send_replace(f.clone());
    axum::Json(f).into_response()
}

async fn get_faults(State(s): S) -> Response {
    axum::Json(s.faults.borrow().clone()).into_response()
}

// ---------------------------------------------------------------- faults

/// Count the arrival and decide its fault. Returns a response when the fault
/// answers by itself (status, hang, reset).
async fn arrive(s: &Shared, headers: &HeaderMap, ctl: &ConnCtl) -> Result<Option<Fault>, ApiError> {
    let n = s.arrivals.fetch_add(1, Relaxed);
    s.stats.requests_received.fetch_add(1, Relaxed);
    let header = match headers.get(FAULT_HEADER) {
        None => None,
        Some(v) => match v.to_str().ok().and_then(Fault::parse) {
            Some(f) => Some(f),
            None => return Err(bad(format!("unknown {FAULT_HEADER} value"))),
        },
    };
    let fault = s.faults.borrow().decide(s.cfg.seed, n, header);
    match fault {
        Some(Fault::Status(code)) => {
            let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            Err(api_error(status, format!("injected fault {code}"), None))
        }
        Some(Fault::Hang) => {
            std::future::pending::<()>().await;
            Err(api_error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "unreachable",
                None,
            ))
        }
        Some(Fault::Reset) => {
            ctl.0.notify_one();
            std::future::pending::<()>().await;
            Err(api_error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "unreachable",
                None,
            ))
        }
        other => Ok(other),
    }
}

// ---------------------------------------------------------------- requests

/// Largest `n` (and `best_of`) accepted; more is surely a mistake.
const MAX_CHOICES: i64 = 128;

#[derive(Deserialize, Default)]
#[serde(default)]
struct StreamOptions {
    include_usage: bool,
}

/// Fields of the generation requests that the sim uses.
#[derive(Deserialize, Default)]
#[serde(default)]
struct Common {
    model: Option<String>,
    stream: bool,
    stream_options: Option<StreamOptions>,
    max_tokens: Option<i64>,
    max_completion_tokens: Option<i64>,
    /// Responses API.
    max_output_tokens: Option<i64>,
    ignore_eos: bool,
    n: Option<i64>,
    /// Completions only.
    best_of: Option<i64>,
    cache_salt: Option<String>,
    kv_transfer_params: Option<Value>,
    bootstrap_host: Option<Value>,
    bootstrap_port: Option<Value>,
    bootstrap_room: Option<Value>,
}

#[derive(Clone, Copy, PartialEq)]
pub(super) enum Kind {
    Chat,
    Completion,
    Responses,
    /// Anthropic's Messages API.
    Messages,
}

/// A forced tool call, tokenized: the engine emits `ids`, one per step, and
/// the client sees the matching `pieces` of the arguments' JSON text.
pub(super) struct Script {
    pub name: String,
    pieces: Vec<String>,
    ids: Arc<[u32]>,
}

/// What one choice produces.
pub(super) enum Output {
    /// Sampled pseudo-English.
    Text,
    /// A call of `call.name`; `call_id` is the choice's own.
    Tool { call_id: String, call: Arc<Script> },
}

impl Output {
    /// Text of the `k`-th token of this choice (`tok` from [`Event::Token`]).
    pub(super) fn piece(&self, tok: Option<u16>, k: usize) -> &str {
        match (tok, self) {
            (Some(t), _) => &vocab().text[t as usize],
            (None, Output::Tool { call, .. }) => call.pieces.get(k).map_or("", String::as_str),
            (None, Output::Text) => "",
        }
    }

    /// OpenAI `finish_reason`: a completed tool call is `tool_calls`.
    pub(super) fn finish_reason(&self, f: Finish) -> &'static str {
        match (self, f) {
            (Output::Tool { .. }, Finish::Stop) => "tool_calls",
            _ => f.as_str(),
        }
    }
}

/// A validated generation request.
struct Gen {
    kind: Kind,
    model: String,
    stream: bool,
    include_usage: bool,
    /// Choices returned: the first `n` of `outputs`.
    n: usize,
    /// One per generated sequence (`best_of` may generate more than `n`).
    outputs: Vec<Output>,
    submits: Vec<Submit>,
    events: mpsc::UnboundedReceiver<Event>,
    /// Prefill side of vLLM's NIXL P/D: answer with `kv_transfer_params`.
    nixl_prefill: bool,
    /// Responses API: request fields the response object repeats.
    echo: Map<String, Value>,
    /// Responses API: the conversation so far, stored with the answer.
    turns: responses::Turns,
    /// SGLang's request id (`rid` in the body, else `X-Request-Id`), which
    /// `/abort_request` names.
    rid: Option<String>,
}

pub(super) fn parse_json(body: &Bytes) -> Result<Value, ApiError> {
    let v: Value =
        serde_json::from_slice(body).map_err(|e| bad(format!("invalid JSON body: {e}")))?;
    if !v.is_object() {
        return Err(bad("request body must be a JSON object"));
    }
    Ok(v)
}

pub(super) fn check_model(s: &Shared, model: Option<String>) -> Result<String, ApiError> {
    match model {
        None => Ok(s.cfg.model.clone()),
        Some(m) if s.cfg.served_names().any(|n| n == m) => Ok(m),
        Some(m) => Err(api_error(
            StatusCode::NOT_FOUND,
            format!("The model `{m}` does not exist."),
            Some("model"),
        )),
    }
}

fn truthy(v: Option<&Value>) -> bool {
    v.and_then(Value::as_bool).unwrap_or(false)
}

/// Text of a message `content`: a string, or a list of parts whose `text`
/// fields are concatenated (other parts, e.g. images, cost nothing).
pub(super) fn content_text(content: Option<&Value>, what: &str) -> Result<String, ApiError> {
    match content {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => Ok(parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect()),
        Some(_) => Err(bad(format!("{what}: must be a string or a list"))),
    }
}

/// (role, text) of each chat message. An assistant message's tool calls are
/// rendered as their arguments, the tokens the engine generated for them.
fn chat_messages(v: &Value) -> Result<Vec<(String, String)>, ApiError> {
    let Some(msgs) = v.get("messages").and_then(Value::as_array) else {
        return Err(bad("messages: field required (a list)"));
    };
    if msgs.is_empty() {
        return Err(bad("messages: must not be empty"));
    }
    let mut out = Vec::with_capacity(msgs.len());
    for (i, m) in msgs.iter().enumerate() {
        let role = m
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| bad(format!("messages[{i}].role: field required")))?;
        let mut content = content_text(m.get("content"), &format!("messages[{i}].content"))?;
        for call in m
            .get("tool_calls")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            if let Some(a) = call.pointer("/function/arguments").and_then(Value::as_str) {
                content.push_str(a);
            }
        }
        out.push((role.to_string(), content));
    }
    Ok(out)
}

/// Token ids of a conversation; function tools, when given, are rendered
/// first as a system turn holding their JSON, as chat templates do.
pub(super) fn encode_messages(msgs: &[(String, String)], tools: Option<&Value>) -> Vec<u32> {
    let tools = tools
        .filter(|t| t.as_array().is_some_and(|a| !a.is_empty()))
        .map(Value::to_string);
    tokenizer::encode_chat(
        tools
            .iter()
            .map(|t| ("system", t.as_str()))
            .chain(msgs.iter().map(|(r, c)| (r.as_str(), c.as_str()))),
    )
}

/// The last user message, which picks the tool under `tool_choice: "required"`.
fn last_user(msgs: &[(String, String)]) -> String {
    msgs.iter()
        .rev()
        .find(|(r, _)| r == "user")
        .map(|(_, c)| c.clone())
        .unwrap_or_default()
}

fn prompt_tokens(v: &Value) -> Result<Vec<u32>, ApiError> {
    let ids = |a: &[Value]| -> Option<Vec<u32>> {
        a.iter()
            .map(|x| x.as_u64().and_then(|n| u32::try_from(n).ok()))
            .collect()
    };
    match v.get("prompt") {
        Some(Value::String(s)) => Ok(tokenizer::encode(s)),
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
            Ok(tokenizer::encode(a[0].as_str().unwrap_or_default()))
        }
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_array() => a[0]
            .as_array()
            .and_then(|x| ids(x))
            .ok_or_else(|| bad("prompt: token ids must be non-negative integers")),
        Some(Value::Array(a)) if a.iter().all(Value::is_number) => {
            ids(a).ok_or_else(|| bad("prompt: token ids must be non-negative integers"))
        }
        Some(Value::Array(_)) => Err(bad("prompt: the simulator takes one prompt per request")),
        _ => Err(bad(
            "prompt: field required (a string or a list of token ids)",
        )),
    }
}

/// The prompt's token ids and the last user message (which picks a forced tool).
fn request_tokens(
    kind: Kind,
    v: &Value,
    store: &responses::Store,
) -> Result<(Vec<u32>, String, responses::Turns), ApiError> {
    let m = match kind {
        Kind::Completion => return Ok((prompt_tokens(v)?, String::new(), Vec::new())),
        Kind::Chat => chat_messages(v)?,
        Kind::Responses => responses::messages(v, store)?,
        Kind::Messages => messages::messages(v)?,
    };
    let tools = match kind {
        Kind::Messages => messages::chat_tools(v).0,
        _ => v.get("tools").cloned(),
    };
    Ok((encode_messages(&m, tools.as_ref()), last_user(&m), m))
}

/// Which endpoint a body was sent to, for [`prompt_token_ids`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PromptKind {
    Chat,
    Completion,
    Responses,
}

/// The prompt token ids this engine computes for a request body: what the
/// gateway's `tokenizer = "sim"` uses, so both tokenize identically.
pub fn prompt_token_ids(kind: PromptKind, body: &[u8]) -> Result<Vec<u32>, String> {
    let v: Value = serde_json::from_slice(body).map_err(|e| format!("invalid JSON body: {e}"))?;
    let kind = match kind {
        PromptKind::Chat => Kind::Chat,
        PromptKind::Completion => Kind::Completion,
        PromptKind::Responses => Kind::Responses,
    };
    request_tokens(kind, &v, &responses::Store::default())
        .map(|(t, _, _)| t)
        .map_err(|e| e.message)
}

/// `n` (and `best_of` for completions): sequences returned and generated.
fn choices(kind: Kind, c: &Common) -> Result<(usize, usize), ApiError> {
    let n = match kind {
        Kind::Responses | Kind::Messages => 1,
        _ => c.n.unwrap_or(1),
    };
    let best_of = match kind {
        Kind::Completion => c.best_of.unwrap_or(n),
        _ => n,
    };
    let param = |m: String, p| Err(api_error(StatusCode::BAD_REQUEST, m, Some(p)));
    if n < 1 {
        return param(format!("n must be at least 1, got {n}."), "n");
    }
    if n > MAX_CHOICES {
        return param(format!("n must be at most {MAX_CHOICES}, got {n}."), "n");
    }
    if best_of < n {
        return param(
            format!("best_of must be greater than or equal to n, got n={n} and best_of={best_of}."),
            "best_of",
        );
    }
    if best_of > MAX_CHOICES {
        return param(
            format!("best_of must be at most {MAX_CHOICES}, got {best_of}."),
            "best_of",
        );
    }
    if c.stream && best_of > n {
        return param(
            "best_of > n is not supported with stream.".into(),
            "best_of",
        );
    }
    Ok((n as usize, best_of as usize))
}

impl Gen {
    fn build(s: &Shared, kind: Kind, body: &Bytes) -> Result<Gen, ApiError> {
        let v = parse_json(body)?;
        let c: Common =
            serde_json::from_value(v.clone()).map_err(|e| bad(format!("invalid request: {e}")))?;
        let model = check_model(s, c.model.clone())?;
        let mut echo = Map::new();
        let mut turns = Vec::new();
        let mut tool_spec = (v.get("tools").cloned(), v.get("tool_choice").cloned());
        if kind == Kind::Messages {
            tool_spec = messages::chat_tools(&v);
        }
        let (tokens, hint, m) = request_tokens(kind, &v, &s.responses)?;
        if kind == Kind::Responses {
            echo = responses::echo(&v);
            turns = m;
        }
        if tokens.is_empty() {
            return Err(bad("prompt: must not be empty"));
        }
        let call = match kind {
            Kind::Completion => None,
            _ => tools::forced(tool_spec.0.as_ref(), tool_spec.1.as_ref(), &hint).map_err(bad)?,
        };
        let (n, best_of) = choices(kind, &c)?;
        let max_len = s.cfg.max_model_len;
        let p = tokens.len();
        if p >= max_len {
            return Err(bad(format!(
                "This model's maximum context length is {max_len} tokens. However, you requested \
                 {p} tokens in the messages, Please reduce the length of the messages."
            )));
        }
        let (requested, field) = match kind {
            Kind::Responses => (c.max_output_tokens, "max_output_tokens"),
            Kind::Messages if c.max_tokens.is_none() => {
                return Err(bad("max_tokens: Field required"));
            }
            _ => (c.max_completion_tokens.or(c.max_tokens), "max_tokens"),
        };
        let mut max_tokens = match requested {
            None => max_len - p,
            Some(m) if m < 1 => return Err(bad(format!("{field} must be at least 1, got {m}."))),
            Some(m) => {
                let m = usize::try_from(m).unwrap_or(usize::MAX);
                if p.saturating_add(m) > max_len {
                    return Err(bad(format!(
                        "This model's maximum context length is {max_len} tokens. However, you \
                         requested {} tokens ({p} in the messages, {m} in the completion). Please \
                         reduce the length of the messages or completion.",
                        p.saturating_add(m)
                    )));
                }
                m
            }
        };

        // Prefill/decode disaggregation.
        let role = s.cfg.role;
        let mut remote = None;
        let mut nixl_prefill = false;
        let mut disaggregated = false;
        if let Some(kv) = c.kv_transfer_params.as_ref().filter(|v| v.is_object()) {
            if truthy(kv.get("do_remote_decode")) {
                if role == Role::Decode {
                    return Err(bad("kv_transfer_params: this engine is a decode instance"));
                }
                nixl_prefill = true;
                disaggregated = true;
                max_tokens = 1;
            } else if truthy(kv.get("do_remote_prefill")) {
                if role == Role::Prefill {
                    return Err(bad("kv_transfer_params: this engine is a prefill instance"));
                }
                if !kv.get("remote_block_ids").is_some_and(Value::is_array) {
                    return Err(bad("kv_transfer_params: remote_block_ids required"));
                }
                disaggregated = true;
                remote = Some(Remote { extra_ms: 0.0 });
            }
        } else if c.bootstrap_room.is_some() {
            if c.bootstrap_host.is_none() || c.bootstrap_port.is_none() {
                return Err(bad(
                    "bootstrap_host and bootstrap_port are required with bootstrap_room",
                ));
            }
            disaggregated = role != Role::Both;
            match role {
                Role::Prefill => max_tokens = 1,
                Role::Decode => {
                    // Both halves start at once: the KV lands after the peer's
                    // prefill (assumed idle and uncached) plus the transfer.
                    let pr = &s.params;
                    let extra =
                        pr.step_base_ms + pr.per_seq_ms + pr.per_prefill_token_ms * p as f64;
                    remote = Some(Remote { extra_ms: extra });
                }
                Role::Both => {}
            }
        }
        if disaggregated && best_of > 1 {
            return Err(bad(
                "n > 1 is not supported by the simulator with prefill/decode disaggregation",
            ));
        }

        let script = call.map(|call| {
            let pieces: Vec<String> = tokenizer::pieces(&call.arguments)
                .into_iter()
                .map(String::from)
                .collect();
            let ids = pieces.iter().map(|t| tokenizer::token_id(t)).collect();
            Arc::new(Script {
                name: call.name,
                pieces,
                ids,
            })
        });
        let (tx, events) = mpsc::unbounded_channel();
        let arrived = Instant::now();
        let mut outputs = Vec::with_capacity(best_of);
        let mut submits = Vec::with_capacity(best_of);
        for i in 0..best_of {
            outputs.push(match &script {
                Some(call) => Output::Tool {
                    call_id: format!("call_{}", &uuid::Uuid::new_v4().simple().to_string()[..24]),
                    call: call.clone(),
                },
                None => Output::Text,
            });
            submits.push(Submit {
                tokens: tokens.clone(),
                max_tokens,
                ignore_eos: c.ignore_eos,
                index: i as u32,
                script: script.as_ref().map(|s| s.ids.clone()),
                parallel: best_of > 1,
                salt: c.cache_salt.clone(),
                remote,
                want_blocks: nixl_prefill,
                arrived,
                events: tx.clone(),
            });
        }
        let include_usage = c.stream_options.is_some_and(|o| o.include_usage);
        Ok(Gen {
            kind,
            model,
            stream: c.stream,
            include_usage,
            n,
            outputs,
            submits,
            events,
            nixl_prefill,
            echo,
            turns,
            rid: v.get("rid").and_then(Value::as_str).map(String::from),
        })
    }
}

async fn chat(
    State(s): S,
    Extension(ctl): Extension<ConnCtl>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    generate(s, ctl, headers, body, Kind::Chat).await
}

async fn completions(
    State(s): S,
    Extension(ctl): Extension<ConnCtl>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    generate(s, ctl, headers, body, Kind::Completion).await
}

async fn responses(
    State(s): S,
    Extension(ctl): Extension<ConnCtl>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    generate(s, ctl, headers, body, Kind::Responses).await
}

/// `GET /v1/responses/{id}`: a response this engine stored.
async fn stored_response(State(s): S, Path(id): Path<String>) -> Response {
    match s.responses.get(&id) {
        Some(o) => axum::Json(o).into_response(),
        None => responses::not_found(&id, None).into_response(),
    }
}

/// `DELETE /v1/responses/{id}`.
async fn delete_response(State(s): S, Path(id): Path<String>) -> Response {
    if s.responses.delete(&id) {
        axum::Json(json!({"id": id, "object": "response", "deleted": true})).into_response()
    } else {
        responses::not_found(&id, None).into_response()
    }
}

/// `GET /v1/responses/{id}/input_items`: the conversation a stored response
/// answered, as message items.
async fn input_items(State(s): S, Path(id): Path<String>) -> Response {
    match s.responses.input_items(&id) {
        Some(items) => axum::Json(items).into_response(),
        None => responses::not_found(&id, None).into_response(),
    }
}

/// `POST /v1/responses/{id}/cancel`: the sim runs nothing in the background,
/// so a stored response is refused as vLLM refuses a synchronous one.
async fn cancel_response(State(s): S, Path(id): Path<String>) -> Response {
    match s.responses.get(&id) {
        Some(_) => bad("Cannot cancel a synchronous response.").into_response(),
        None => responses::not_found(&id, None).into_response(),
    }
}

async fn anthropic_messages(
    State(s): S,
    Extension(ctl): Extension<ConnCtl>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    generate(s, ctl, headers, body, Kind::Messages).await
}

/// `POST /v1/messages/count_tokens`: the prompt's length in the sim's tokens.
async fn count_tokens(State(s): S, body: Bytes) -> Response {
    let counted = parse_json(&body).and_then(|v| {
        check_model(&s, v.get("model").and_then(Value::as_str).map(String::from))?;
        let m = messages::messages(&v)?;
        Ok(encode_messages(&m, messages::chat_tools(&v).0.as_ref()).len())
    });
    match counted {
        Ok(n) => messages::count(n),
        Err(e) => e.respond(Kind::Messages),
    }
}

pub(super) fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn request_id(kind: Kind) -> String {
    let prefix = match kind {
        Kind::Chat => "chatcmpl-",
        Kind::Completion => "cmpl-",
        Kind::Responses => "resp_",
        Kind::Messages => "msg_",
    };
    format!("{prefix}{}", uuid::Uuid::new_v4().simple())
}

fn usage(t: &Totals) -> Value {
    json!({"prompt_tokens": t.prompt, "total_tokens": t.prompt + t.completion,
           "completion_tokens": t.completion, "prompt_tokens_details": {"cached_tokens": t.cached}})
}

/// What the sequences of one request add up to. The prompt is counted once;
/// completion tokens over every sequence generated; cached tokens and KV
/// blocks are the first sequence's (the others share its prompt).
#[derive(Default)]
pub(super) struct Totals {
    pub prompt: usize,
    pub completion: usize,
    pub cached: usize,
    blocks: Vec<u32>,
    done: usize,
}

impl Totals {
    fn add(&mut self, e: Event) {
        if let Event::Done {
            index,
            prompt_tokens,
            completion_tokens,
            cached_tokens,
            blocks,
            ..
        } = e
        {
            self.prompt = prompt_tokens;
            self.completion += completion_tokens;
            if index == 0 {
                self.cached = cached_tokens;
                self.blocks = blocks;
            }
            self.done += 1;
        }
    }
}

async fn generate(
    s: Arc<Shared>,
    ctl: ConnCtl,
    headers: HeaderMap,
    body: Bytes,
    kind: Kind,
) -> Response {
    let fault = match arrive(&s, &headers, &ctl).await {
        Ok(f) => f,
        Err(r) => return r.respond(kind),
    };
    let mut g = match Gen::build(&s, kind, &body) {
        Ok(g) => g,
        Err(r) => return r.respond(kind),
    };
    if g.rid.is_none() {
        g.rid = headers
            .get("x-request-id")
            .and_then(|v| v.to_str().ok())
            .map(String::from);
    }
    let slow = match fault {
        Some(Fault::Slow(ms)) => Duration::from_millis(ms),
        _ => Duration::ZERO,
    };
    let die_after = match fault {
        Some(Fault::DieAfter(n)) => Some(n as usize),
        _ => None,
    };
    let submits = std::mem::take(&mut g.submits);
    if g.stream {
        stream_response(s, g, submits, slow, die_after)
    } else {
        if !slow.is_zero() {
            tokio::time::sleep(slow).await;
        }
        for sub in submits {
            if s.submit.send(sub).await.is_err() {
                return error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "engine is not running",
                    None,
                );
            }
        }
        full_response(&s, g, ctl, die_after).await
    }
}

/// What one choice produced so far.
#[derive(Default)]
struct Choice {
    text: String,
    tokens: usize,
    reason: Option<Finish>,
}

async fn full_response(s: &Shared, mut g: Gen, ctl: ConnCtl, die_after: Option<usize>) -> Response {
    let mut choices: Vec<Choice> = g.outputs.iter().map(|_| Choice::default()).collect();
    let mut totals = Totals::default();
    let mut n = 0;
    let die = || async {
        ctl.0.notify_one();
        std::future::pending::<()>().await;
    };
    while let Some(e) = g.events.recv().await {
        match e {
            Event::Token { index, tok, .. } => {
                let i = index as usize;
                if let (Some(c), Some(o)) = (choices.get_mut(i), g.outputs.get(i)) {
                    c.text.push_str(o.piece(tok, c.tokens));
                    c.tokens += 1;
                }
                n += 1;
                if die_after.is_some_and(|d| n >= d) {
                    die().await;
                }
            }
            Event::Failed(m) => return error(StatusCode::INTERNAL_SERVER_ERROR, m, None),
            Event::Done { index, reason, .. } => {
                if let Some(c) = choices.get_mut(index as usize) {
                    c.reason = Some(reason);
                }
                totals.add(e);
                if totals.done < g.outputs.len() {
                    continue;
                }
                if die_after.is_some() {
                    die().await;
                }
                return axum::Json(full_body(s, &g, &choices, &totals)).into_response();
            }
        }
    }
    error(StatusCode::SERVICE_UNAVAILABLE, "engine stopped", None)
}

fn full_body(s: &Shared, g: &Gen, choices: &[Choice], totals: &Totals) -> Value {
    let kv = if g.nixl_prefill {
        json!({"do_remote_prefill": true, "do_remote_decode": false,
               "remote_block_ids": totals.blocks, "remote_engine_id": s.engine_id,
               "remote_host": s.addr.ip().to_string(), "remote_port": s.addr.port(),
               "tp_size": 1})
    } else {
        Value::Null
    };
    let id = request_id(g.kind);
    let returned = choices.iter().zip(&g.outputs).take(g.n).enumerate();
    let finish = |c: &Choice, o: &Output| c.reason.map(|r| o.finish_reason(r));
    match g.kind {
        Kind::Chat => {
            let list: Vec<Value> = returned
                .map(|(i, (c, o))| {
                    let message = match o {
                        Output::Text => json!({"role": "assistant", "content": c.text,
                                               "reasoning_content": null, "tool_calls": []}),
                        Output::Tool { call_id, call } => json!({"role": "assistant", "content": null,
                            "reasoning_content": null, "tool_calls": [{"id": call_id, "type": "function",
                                "function": {"name": call.name, "arguments": c.text}}]}),
                    };
                    json!({"index": i, "message": message, "logprobs": null,
                           "finish_reason": finish(c, o), "stop_reason": null})
                })
                .collect();
            json!({
                "id": id, "object": "chat.completion", "created": now_secs(), "model": g.model,
                "choices": list, "usage": usage(totals), "prompt_logprobs": null,
                "kv_transfer_params": kv,
            })
        }
        Kind::Completion => {
            let list: Vec<Value> = returned
                .map(|(i, (c, o))| {
                    json!({"index": i, "text": c.text, "logprobs": null,
                           "finish_reason": finish(c, o), "stop_reason": null, "prompt_logprobs": null})
                })
                .collect();
            json!({
                "id": id, "object": "text_completion", "created": now_secs(), "model": g.model,
                "choices": list, "usage": usage(totals), "kv_transfer_params": kv,
            })
        }
        Kind::Responses => {
            let output: Vec<Value> = choices
                .iter()
                .zip(&g.outputs)
                .take(g.n)
                .map(|(c, o)| responses::item(o, &c.text, "completed"))
                .collect();
            let o = responses::object(
                &g.echo,
                &id,
                now_secs(),
                &g.model,
                "completed",
                json!(output),
                responses::usage(totals),
            );
            responses::remember(&s.responses, &o, g.turns.clone());
            o
        }
        Kind::Messages => {
            let (c, o) = (&choices[0], &g.outputs[0]);
            messages::object(&id, &g.model, o, &c.text, finish(c, o), totals)
        }
    }
}

/// Writes chat and completion chunks the way vLLM does: `data: {json}\n\n`,
/// then `data: [DONE]\n\n`.
struct Sse {
    kind: Kind,
    /// Everything up to and including `"choices":`.
    head: String,
}

impl Sse {
    fn new(kind: Kind, model: &str) -> Sse {
        let object = match kind {
            Kind::Chat => "chat.completion.chunk",
            _ => "text_completion",
        };
        let head = format!(
            "data: {{\"id\":{},\"object\":\"{object}\",\"created\":{},\"model\":{},\"choices\":",
            Value::String(request_id(kind)),
            now_secs(),
            Value::String(model.to_string())
        );
        Sse { kind, head }
    }

    /// One chunk holding one choice, `{"index":i,` + `rest`.
    fn chunk(&self, out: &mut String, i: usize, rest: std::fmt::Arguments) {
        out.push_str(&self.head);
        let _ = write!(out, "[{{\"index\":{i},{rest}}}]}}\n\n");
    }

    /// The events for one token of choice `i`; a chat choice's first token
    /// is preceded by the assistant role (and a tool call's id and name).
    fn token(&self, i: usize, o: &Output, first: bool, text: &str, fin: Option<&str>) -> Bytes {
        let text = Value::String(text.to_string());
        let fin = match fin {
            Some(f) => format!("\"{f}\""),
            None => "null".into(),
        };
        let mut out = String::with_capacity(2 * self.head.len() + 192);
        if self.kind == Kind::Completion {
            self.chunk(
                &mut out,
                i,
                format_args!(
                    "\"text\":{text},\"logprobs\":null,\"finish_reason\":{fin},\"stop_reason\":null"
                ),
            );
            return Bytes::from(out);
        }
        if first {
            self.chunk(
                &mut out,
                i,
                format_args!(
                    "\"delta\":{{\"role\":\"assistant\",\"content\":\"\"}},\"logprobs\":null,\"finish_reason\":null"
                ),
            );
        }
        match o {
            Output::Text => self.chunk(
                &mut out,
                i,
                format_args!(
                    "\"delta\":{{\"content\":{text}}},\"logprobs\":null,\"finish_reason\":{fin}"
                ),
            ),
            Output::Tool { call_id, call } => {
                if first {
                    let name = Value::String(call.name.clone());
                    self.chunk(
                        &mut out,
                        i,
                        format_args!(
                            "\"delta\":{{\"tool_calls\":[{{\"index\":0,\"id\":\"{call_id}\",\"type\":\"function\",\"function\":{{\"name\":{name},\"arguments\":\"\"}}}}]}},\"logprobs\":null,\"finish_reason\":null"
                        ),
                    );
                }
                self.chunk(
                    &mut out,
                    i,
                    format_args!(
                        "\"delta\":{{\"tool_calls\":[{{\"index\":0,\"function\":{{\"arguments\":{text}}}}}]}},\"logprobs\":null,\"finish_reason\":{fin}"
                    ),
                );
            }
        }
        Bytes::from(out)
    }

    /// The usage chunk (when asked for), then `[DONE]`.
    fn end(&self, usage: Option<&Value>) -> Bytes {
        let mut out = String::new();
        if let Some(u) = usage {
            let _ = write!(out, "{}[],\"usage\":{u}}}\n\n", self.head);
        }
        out.push_str(DONE);
        Bytes::from(out)
    }

    fn error(&self, message: &str) -> Bytes {
        let e = json!({"error": {"message": message, "type": "InternalServerError", "param": null, "code": 500}});
        Bytes::from(format!("data: {e}\n\n"))
    }
}

const DONE: &str = "data: [DONE]\n\n";

/// The stream format of one request.
enum Writer {
    Chunks(Sse),
    Responses(responses::Stream),
    Messages(messages::Stream),
}

impl Writer {
    fn new(g: &Gen) -> Writer {
        match g.kind {
            Kind::Responses => Writer::Responses(responses::Stream::new(
                request_id(g.kind),
                &g.model,
                g.echo.clone(),
            )),
            Kind::Messages => Writer::Messages(messages::Stream::new(request_id(g.kind), &g.model)),
            kind => Writer::Chunks(Sse::new(kind, &g.model)),
        }
    }

    /// Events sent as soon as the request is accepted.
    fn start(&mut self) -> Option<Bytes> {
        match self {
            Writer::Chunks(_) => None,
            Writer::Responses(r) => Some(r.start()),
            Writer::Messages(m) => Some(m.start()),
        }
    }

    fn token(&mut self, i: usize, o: &Output, first: bool, text: &str, fin: Option<&str>) -> Bytes {
        match self {
            Writer::Chunks(c) => c.token(i, o, first, text, fin),
            Writer::Responses(r) => r.token(o, first, text),
            Writer::Messages(m) => m.token(o, first, text, fin),
        }
    }

    fn end(&mut self, g: &Gen, totals: &Totals) -> Bytes {
        match self {
            Writer::Chunks(c) => c.end(g.include_usage.then(|| usage(totals)).as_ref()),
            Writer::Responses(r) => r.end(&g.outputs[0], totals),
            Writer::Messages(m) => m.end(totals),
        }
    }

    fn error(&mut self, message: &str) -> Bytes {
        match self {
            Writer::Chunks(c) => c.error(message),
            Writer::Responses(r) => r.error(message),
            Writer::Messages(m) => m.error(message),
        }
    }
}

type Frame = Result<Bytes, std::io::Error>;

fn stream_response(
    s: Arc<Shared>,
    g: Gen,
    submits: Vec<Submit>,
    slow: Duration,
    die_after: Option<usize>,
) -> Response {
    let (tx, mut rx) = mpsc::channel::<Frame>(64);
    tokio::spawn(produce(s, g, submits, slow, die_after, tx));
    // An error frame aborts the connection at once, dropping bytes hyper has
    // buffered but not yet written. Answer `Pending` once before an error so
    // hyper flushes the tokens already sent (its loop flushes after a
    // pending body), then hand the error over.
    let mut deferred: Option<Frame> = None;
    let stream = futures_util::stream::poll_fn(move |cx| {
        if let Some(e) = deferred.take() {
            return std::task::Poll::Ready(Some(e));
        }
        match rx.poll_recv(cx) {
            std::task::Poll::Ready(Some(Err(e))) => {
                deferred = Some(Err(e));
                cx.waker().wake_by_ref();
                std::task::Poll::Pending
            }
            other => other,
        }
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream; charset=utf-8")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// Feed one streaming response from the engine's events. A send error means
/// the client went away: returning drops the event receiver, which the engine
/// sees as an abort of every sequence of the request.
async fn produce(
    s: Arc<Shared>,
    mut g: Gen,
    submits: Vec<Submit>,
    slow: Duration,
    die_after: Option<usize>,
    tx: mpsc::Sender<Frame>,
) {
    if !slow.is_zero() {
        tokio::select! {
            _ = tokio::time::sleep(slow) => {}
            _ = tx.closed() => return,
        }
    }
    let mut w = Writer::new(&g);
    for sub in submits {
        if s.submit.send(sub).await.is_err() {
            let _ = tx.send(Ok(w.error("engine is not running"))).await;
            return;
        }
    }
    let die = |tx: mpsc::Sender<Frame>| async move {
        let _ = tx
            .send(Err(std::io::Error::new(
                std::io::ErrorKind::ConnectionAborted,
                "sim fault: die-after",
            )))
            .await;
    };
    if die_after == Some(0) {
        return die(tx).await;
    }
    // `/abort_request` may name this request; a client that left stops it
    // only when the engine notices disconnects.
    let entry = g.rid.as_deref().map(|r| s.aborts.register(r));
    let signal = entry
        .as_ref()
        .map_or_else(|| Arc::new(Notify::new()), |e| e.signal.clone());
    let mut gone = false;
    let ignore = s.cfg.ignore_disconnect;
    if let Some(b) = w.start() {
        if tx.send(Ok(b)).await.is_err() {
            if !ignore {
                return;
            }
            gone = true;
        }
    }
    let mut counts = vec![0usize; g.outputs.len()];
    let mut totals = Totals::default();
    let mut sent = 0usize;
    loop {
        let e = tokio::select! {
            e = g.events.recv() => e,
            // Returning drops the event receiver: the engine aborts.
            _ = signal.notified() => return,
        };
        let Some(e) = e else { break };
        match e {
            Event::Token { index, tok, finish } => {
                let i = index as usize;
                let Some(o) = g.outputs.get(i) else { continue };
                let fin = finish
                    .filter(|_| die_after.is_none())
                    .map(|f| o.finish_reason(f));
                let frame = w.token(i, o, counts[i] == 0, o.piece(tok, counts[i]), fin);
                counts[i] += 1;
                if !gone && tx.send(Ok(frame)).await.is_err() {
                    if !ignore {
                        return;
                    }
                    gone = true;
                }
                sent += 1;
                if die_after.is_some_and(|d| sent >= d) {
                    return die(tx).await;
                }
            }
            Event::Failed(m) => {
                let _ = tx.send(Ok(w.error(&m))).await;
                return;
            }
            e @ Event::Done { .. } => {
                totals.add(e);
                if totals.done < g.outputs.len() {
                    continue;
                }
                if die_after.is_some() {
                    return die(tx).await;
                }
                let end = w.end(&g, &totals);
                if let Writer::Responses(r) = &w {
                    if let Some(o) = &r.done {
                        responses::remember(&s.responses, o, g.turns.clone());
                    }
                }
                let _ = tx.send(Ok(end)).await;
                return;
            }
        }
    }
    let _ = tx.send(Ok(w.error("engine stopped"))).await;
}

// ---------------------------------------------------------------- embeddings

async fn embeddings(
    State(s): S,
    Extension(ctl): Extension<ConnCtl>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let fault = match arrive(&s, &headers, &ctl).await {
        Ok(f) => f,
        Err(r) => return r.into_response(),
    };
    let v = match parse_json(&body) {
        Ok(v) => v,
        Err(r) => return r.into_response(),
    };
    let model = match check_model(&s, v.get("model").and_then(Value::as_str).map(String::from)) {
        Ok(m) => m,
        Err(r) => return r.into_response(),
    };
    let inputs: Vec<Vec<u32>> = match v.get("input") {
        Some(Value::String(t)) => vec![tokenizer::encode(t)],
        Some(Value::Array(a)) if a.iter().all(Value::is_string) && !a.is_empty() => a
            .iter()
            .map(|x| tokenizer::encode(x.as_str().unwrap_or_default()))
            .collect(),
        Some(Value::Array(a)) if a.iter().all(Value::is_number) && !a.is_empty() => {
            vec![a.iter().map(|x| x.as_u64().unwrap_or(0) as u32).collect()]
        }
        Some(Value::Array(a)) if a.iter().all(Value::is_array) && !a.is_empty() => a
            .iter()
            .map(|x| {
                x.as_array()
                    .map(|t| t.iter().map(|n| n.as_u64().unwrap_or(0) as u32).collect())
                    .unwrap_or_default()
            })
            .collect(),
        _ => {
            return bad("input: field required (a string, a list of strings or token ids)")
                .into_response()
        }
    };
    let base64 = match v.get("encoding_format").and_then(Value::as_str) {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return bad(format!("encoding_format: unknown value {other:?}")).into_response()
        }
    };
    let total: usize = inputs.iter().map(Vec::len).sum();
    if inputs.iter().any(|t| t.len() >= s.cfg.max_model_len) {
        return bad(format!(
            "This model's maximum context length is {} tokens.",
            s.cfg.max_model_len
        ))
        .into_response();
    }
    // One uncached prefill of all inputs (outside the generation batch).
    let pr = &s.params;
    let mut delay = pr.real(pr.step_base_ms + pr.per_prefill_token_ms * total as f64);
    if let Some(Fault::Slow(ms)) = fault {
        delay += Duration::from_millis(ms);
    }
    tokio::time::sleep(delay).await;
    let dim = s.cfg.embedding_dim;
    let data: Vec<Value> = inputs
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let e = embed(s.cfg.seed, t, dim);
            let emb = if base64 {
                let mut b = Vec::with_capacity(dim * 4);
                for x in &e {
                    b.extend_from_slice(&x.to_le_bytes());
                }
                Value::String(b64(&b))
            } else {
                json!(e)
            };
            json!({"index": i, "object": "embedding", "embedding": emb})
        })
        .collect();
    s.stats.prompt_tokens.fetch_add(total as u64, Relaxed);
    axum::Json(json!({
        "id": format!("embd-{}", uuid::Uuid::new_v4().simple()), "object": "list",
        "created": now_secs(), "model": model, "data": data,
        "usage": {"prompt_tokens": total, "total_tokens": total, "completion_tokens": 0,
                  "prompt_tokens_details": null}
    }))
    .into_response()
}

/// A deterministic unit vector for a token sequence.
pub(crate) fn embed(seed: u64, tokens: &[u32], dim: usize) -> Vec<f32> {
    let mut key = Vec::with_capacity(tokens.len() * 4);
    for t in tokens {
        key.extend_from_slice(&t.to_le_bytes());
    }
    let mut rng = SmallRng::seed_from_u64(xxh3_64_with_seed(&key, seed));
    let mut v: Vec<f32> = (0..dim).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
    let norm = v
        .iter()
        .map(|x| x * x)
        .sum::<f32>()
        .sqrt()
        .max(f32::MIN_POSITIVE);
    for x in &mut v {
        *x /= norm;
    }
    v
}

fn b64(data: &[u8]) -> String {
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for c in data.chunks(3) {
        let n = (u32::from(c[0]) << 16)
            | (u32::from(*c.get(1).unwrap_or(&0)) << 8)
            | u32::from(*c.get(2).unwrap_or(&0));
        for i in 0..4 {
            if i <= c.len() {
                out.push(T[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_rfc4648() {
        assert_eq!(b64(b""), "");
        assert_eq!(b64(b"f"), "Zg==");
        assert_eq!(b64(b"fo"), "Zm8=");
        assert_eq!(b64(b"foo"), "Zm9v");
        assert_eq!(b64(b"foobar"), "Zm9vYmFy");
    }

    #[test]
    fn embeddings_are_deterministic_unit_vectors() {
        let a = embed(1, &[1, 2, 3], 64);
        assert_eq!(a, embed(1, &[1, 2, 3], 64));
        assert_ne!(a, embed(2, &[1, 2, 3], 64));
        let n: f32 = a.iter().map(|x| x * x).sum();
        assert!((n - 1.0).abs() < 1e-4);
    }
}
