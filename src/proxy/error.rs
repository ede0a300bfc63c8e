//! The gateway's one error type. Each variant maps to one row of a table
//! ([`GatewayError::kind`]): its HTTP status, OpenAI error type and code, a
//! low-cardinality `reason` label, who is at fault, and whether another worker
//! or pool may be tried.

use crate::api::ErrorBody;
use crate::tenancy::limits::LimitKind;
use crate::tenancy::limits::Refusal;
use http::{header, HeaderValue, Response, StatusCode};
use std::sync::Arc;
use std::time::Duration;
use StatusCode as S;

#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    #[error("We could not parse the JSON body of your request: {0}")]
    MalformedJson(String),
    #[error("The JSON body nests deeper than the limit of {0} levels")]
    JsonTooDeep(usize),
    #[error("Header `{0}` is not valid UTF-8")]
    InvalidHeader(&'static str),
    #[error("you must provide a model parameter")]
    MissingModel,
    /// A well-formed body that breaks the endpoint's rules (a missing
    /// required field, content that cannot be translated for the pool).
    #[error("{0}")]
    InvalidRequest(String),
    /// The endpoint exists, but not for this model's pool.
    #[error("{0}")]
    NotSupported(String),
    #[error("The model `{0}` does not exist")]
    UnknownModel(String),
    #[error("Request body exceeds the limit of {0} bytes")]
    BodyTooLarge(usize),
    #[error("Failed to read the request body: {0}")]
    BodyRead(String),
    #[error("The request body did not arrive within {0:?}")]
    BodyTimeout(Duration),
    #[error("The request body must be JSON (Content-Type: application/json), not {0}")]
    UnsupportedMediaType(String),
    #[error("Malformed multipart upload: {0}")]
    MalformedMultipart(String),
    #[error("Request headers too large: {0}")]
    HeadersTooLarge(String),
    #[error(
        "Transfer-Encoding `{0}` is not supported; send the body with Content-Length or chunked"
    )]
    UnsupportedTransferEncoding(String),
    #[error("Malformed request: {0}")]
    BadFraming(&'static str),
    #[error(
        "x-switchyard-tenant names a tenant that has API keys; authenticate with its key instead"
    )]
    TenantNeedsKey,
    /// `tenancy.require_key` and no key was presented.
    #[error("You didn't provide an API key. Send it as `Authorization: Bearer YOUR_KEY`.")]
    MissingApiKey,
    #[error("Incorrect API key provided.")]
    InvalidApiKey,
    /// The tenant's `allowed_models` leave this model out.
    #[error("Your API key may not use the model `{0}`")]
    ModelNotAllowed(String),
    /// Over a rate limit or a spend budget.
    #[error("{}", .0.message())]
    Limited(Box<crate::tenancy::limits::Refusal>),
    #[error("Method {method} is not allowed on {path}")]
    MethodNotAllowed { method: String, path: String },
    #[error("Unknown request URL: {0}")]
    NotFound(String),
    /// An engine control route the pool allows, called without admin scope.
    #[error("`{0}` is an engine control route: only an admin tenant's API key may call it")]
    ControlRouteForbidden(String),
    #[error("No healthy worker is available for model `{0}`")]
    NoHealthyWorker(String),
    /// The request's residency leaves no worker able to serve it.
    #[error("no worker in residency '{residency}' (regions {regions}) can serve model '{model}'")]
    ResidencyUnavailable {
        residency: Arc<str>,
        /// The allowed regions, for the message (`none` when the set is empty).
        regions: String,
        model: String,
    },
    #[error("Unknown residency `{value}` in x-switchyard-residency (expected a residency zone or declared regions: {known})")]
    InvalidResidency { value: String, known: String },
    #[error("Pool `{0}` is at capacity and its queue is full; retry later")]
    QueueFull(String),
    #[error("Pool `{0}` is at capacity; the request waited too long in the queue")]
    QueueTimeout(String),
    /// Dropped from a full queue to make room for a higher priority class.
    #[error("Pool `{0}` is at capacity and a higher-priority request took this one's place in the queue; retry later")]
    QueueEvicted(String),
    /// Cancelled before answering so a higher priority class could run
    /// (`preemption = "reject"`).
    #[error("Pool `{0}` is at capacity and this request was preempted by a higher-priority one before it answered; retry later")]
    Preempted(String),
    /// A gateway-issued response id whose worker is no longer in any pool.
    #[error("Response `{0}` was stored by a worker that is no longer serving, so it is gone (a follow-up must send the whole conversation as `input`, without `previous_response_id`)")]
    ResponseOwnerGone(String),
    /// The worker holding a stored response is configured but did not answer.
    #[error("The worker holding response `{id}` is unavailable ({detail}); retry later, or send the whole conversation as `input` without `previous_response_id`")]
    ResponseOwnerUnavailable { id: String, detail: String },
    /// A response id this gateway did not issue to the calling tenant (forged,
    /// another tenant's, another deployment's, or the old unsigned format):
    /// answered as the engine answers an id it does not hold, so the answer
    /// says nothing about whether it exists.
    #[error("Response with id '{id}' not found.")]
    UnknownResponse {
        id: String,
        /// `previous_response_id` when the id came in the body.
        param: Option<&'static str>,
    },
    /// A stored-response call (by id, or continuing `previous_response_id`)
    /// reached the Endpoint Picker, which cannot bind ids to their tenant.
    #[error("{what} needs the gateway's proxy mode (`switchyard serve`): the Endpoint Picker cannot bind stored response ids to the tenant that created them")]
    ProxyModeOnly {
        what: &'static str,
        param: Option<&'static str>,
    },
    /// No worker is predicted to meet the request's latency objective and the
    /// pool sheds such requests.
    #[error("No worker of model `{model}` is predicted to meet this request's latency objective (best predicted time to first token {predicted_ttft_ms} ms); retry later or relax x-slo-ttft-ms / x-slo-tpot-ms")]
    SloUnattainable {
        model: String,
        predicted_ttft_ms: u64,
        /// Seconds for `Retry-After`.
        retry_after_s: u32,
    },
    /// Still without an answer when the shutdown's drain deadline passed.
    #[error("The gateway is shutting down and this request did not get an answer before its drain deadline; retry (another replica will serve it)")]
    DrainDeadline,
    #[error("Upstream {worker} is unreachable: {detail}")]
    UpstreamConnect { worker: Arc<str>, detail: String },
    #[error("Upstream {worker} failed: {detail}")]
    UpstreamFailed { worker: Arc<str>, detail: String },
    #[error("Upstream {worker} did not answer within {after:?}")]
    UpstreamTimeout { worker: Arc<str>, after: Duration },
}

/// Who an error is charged to, for metrics and the access log (`class`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The request was bad, or the caller may not make it.
    Client,
    /// A gateway policy refused it: no capacity, queue, drain.
    Gateway,
    /// The worker failed.
    Upstream,
}

impl Fault {
    pub fn as_str(self) -> &'static str {
        match self {
            Fault::Client => "client",
            Fault::Gateway => "gateway",
            Fault::Upstream => "upstream",
        }
    }
}

/// One row of the error table: how an error is answered and counted. Every
/// accessor of [`GatewayError`] reads its row, so the columns cannot disagree.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ErrorKind {
    pub status: StatusCode,
    /// OpenAI's error `type`. (Anthropic's follows the status.)
    pub openai_type: &'static str,
    /// OpenAI's error `code`.
    pub code: Option<&'static str>,
    /// OpenAI's `param`: the request field at fault.
    pub param: Option<&'static str>,
    /// The low-cardinality metric label.
    pub reason: &'static str,
    pub fault: Fault,
    /// Another worker may be tried (nothing reached the client yet).
    pub retryable: bool,
    /// Another pool (a fallback) may serve it: the failure was the pool's.
    pub falls_back: bool,
    /// The client connection closes after the answer: the body may be unread,
    /// or its framing is not to be trusted.
    pub closes_connection: bool,
    /// `Retry-After` in seconds: 1 on every 429 and 503 unless the error knows better.
    pub retry_after_s: Option<u64>,
}

const INVALID: &str = "invalid_request_error";
const AUTHENTICATION: &str = "authentication_error";
const PERMISSION: &str = "permission_error";
const RATE_LIMITED: &str = "rate_limit_exceeded";
const QUOTA: &str = "insufficient_quota";
const UNAVAILABLE: &str = "service_unavailable";
const UPSTREAM: &str = "upstream_error";

/// A client error answered as OpenAI's 401 `authentication_error`.
const fn unauthorized(reason: &'static str) -> ErrorKind {
    row(S::UNAUTHORIZED, AUTHENTICATION, reason, Fault::Client).code("invalid_api_key")
}

/// A client error answered as OpenAI's 403 `permission_error`; the code is the reason.
const fn forbidden(reason: &'static str) -> ErrorKind {
    row(S::FORBIDDEN, PERMISSION, reason, Fault::Client).code_is_reason()
}

/// Shed by flow control as a rate limit: the code names why.
const fn throttled(reason: &'static str) -> ErrorKind {
    row(S::TOO_MANY_REQUESTS, RATE_LIMITED, reason, Fault::Gateway).code_is_reason()
}

/// The gateway cannot serve it now (503 `service_unavailable`).
const fn unavailable(reason: &'static str) -> ErrorKind {
    row(S::SERVICE_UNAVAILABLE, UNAVAILABLE, reason, Fault::Gateway)
}

/// The worker failed: another worker, or another pool, may be tried.
const fn upstream(status: StatusCode, reason: &'static str) -> ErrorKind {
    row(status, UPSTREAM, reason, Fault::Upstream).retryable()
}

/// A row with no code, param or flags; `Retry-After: 1` on 429 and 503.
const fn row(
    status: StatusCode,
    openai_type: &'static str,
    reason: &'static str,
    fault: Fault,
) -> ErrorKind {
    let s = status.as_u16();
    ErrorKind {
        status,
        openai_type,
        code: None,
        param: None,
        reason,
        fault,
        retryable: false,
        falls_back: false,
        closes_connection: false,
        retry_after_s: if s == 429 || s == 503 { Some(1) } else { None },
    }
}

/// A client error answered as `invalid_request_error`.
const fn bad(status: StatusCode, reason: &'static str) -> ErrorKind {
    row(status, INVALID, reason, Fault::Client)
}

impl ErrorKind {
    const fn code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }
    const fn param(mut self, param: Option<&'static str>) -> Self {
        self.param = param;
        self
    }
    /// The `code` repeats the `reason` label.
    const fn code_is_reason(self) -> Self {
        self.code(self.reason)
    }
    const fn retry_after(mut self, s: u64) -> Self {
        self.retry_after_s = Some(s);
        self
    }
    const fn falls_back(mut self) -> Self {
        self.falls_back = true;
        self
    }
    /// Retryable on another worker, hence also on another pool.
    const fn retryable(mut self) -> Self {
        self.retryable = true;
        self.falls_back = true;
        self
    }
    const fn closes(mut self) -> Self {
        self.closes_connection = true;
        self
    }

    /// A refusal's row depends on it: never passable (a client error without
    /// `Retry-After`), the limits store down, a spend budget, or a rate.
    fn limited(r: &Refusal) -> ErrorKind {
        let kind = r.kind.as_str();
        let (never, c) = (r.never, Fault::Client);
        match r.kind {
            _ if never => bad(S::BAD_REQUEST, kind)
                .code("request_exceeds_limit")
                .param(Some(kind)),
            LimitKind::StoreUnavailable => row(S::SERVICE_UNAVAILABLE, UNAVAILABLE, kind, c)
                .code("limits_store_unavailable")
                .retry_after(r.retry_after_s),
            k if k.is_budget() => row(S::TOO_MANY_REQUESTS, QUOTA, kind, c)
                .code("insufficient_quota")
                .param(Some(kind))
                .retry_after(r.retry_after_s),
            _ => row(S::TOO_MANY_REQUESTS, RATE_LIMITED, kind, c)
                .code("rate_limit_exceeded")
                .param(Some(kind))
                .retry_after(r.retry_after_s),
        }
    }
}

impl GatewayError {
    /// The error's row of the table. Rows that depend on the payload (a
    /// header's name, the field at fault, a refusal, a `Retry-After`) say so.
    pub fn kind(&self) -> ErrorKind {
        use GatewayError::*;
        match self {
            MalformedJson(_) => bad(S::BAD_REQUEST, "malformed_json"),
            MalformedMultipart(_) => bad(S::BAD_REQUEST, "malformed_multipart"),
            JsonTooDeep(_) => bad(S::BAD_REQUEST, "json_too_deep").code_is_reason(),
            InvalidHeader(h) => bad(S::BAD_REQUEST, "invalid_header")
                .code_is_reason()
                .param(Some(h)),
            MissingModel => bad(S::BAD_REQUEST, "missing_model").param(Some("model")),
            InvalidRequest(_) => bad(S::BAD_REQUEST, "invalid_request"),
            NotSupported(_) => bad(S::NOT_FOUND, "not_supported"),
            UnknownModel(_) => bad(S::NOT_FOUND, "unknown_model")
                .code("model_not_found")
                .param(Some("model")),
            BodyTooLarge(_) => bad(S::PAYLOAD_TOO_LARGE, "body_too_large")
                .code("request_too_large")
                .closes(),
            BodyRead(_) => bad(S::BAD_REQUEST, "body_read").closes(),
            BodyTimeout(_) => bad(S::REQUEST_TIMEOUT, "body_timeout")
                .code("request_timeout")
                .closes(),
            UnsupportedMediaType(_) => bad(S::UNSUPPORTED_MEDIA_TYPE, "unsupported_media_type"),
            HeadersTooLarge(_) => {
                bad(S::REQUEST_HEADER_FIELDS_TOO_LARGE, "headers_too_large").closes()
            }
            UnsupportedTransferEncoding(_) => {
                bad(S::NOT_IMPLEMENTED, "unsupported_transfer_encoding").closes()
            }
            BadFraming(_) => bad(S::BAD_REQUEST, "bad_framing").closes(),
            MethodNotAllowed { .. } => {
                bad(S::METHOD_NOT_ALLOWED, "method_not_allowed").code_is_reason()
            }
            TenantNeedsKey => unauthorized("tenant_needs_key"),
            MissingApiKey => unauthorized("missing_api_key"),
            InvalidApiKey => unauthorized("invalid_api_key"),
            ModelNotAllowed(_) => forbidden("model_not_allowed").param(Some("model")),
            ControlRouteForbidden(_) => forbidden("control_route_forbidden"),
            Limited(r) => ErrorKind::limited(r),
            NotFound(_) => bad(S::NOT_FOUND, "not_found").code("unknown_url"),
            UnknownResponse { param, .. } => bad(S::NOT_FOUND, "unknown_response")
                .code("response_not_found")
                .param(*param),
            ProxyModeOnly { param, .. } => bad(S::NOT_IMPLEMENTED, "proxy_mode_only")
                .code("proxy_mode_required")
                .param(*param),
            InvalidResidency { .. } => bad(S::BAD_REQUEST, "invalid_residency").code_is_reason(),
            ResponseOwnerGone(_) => {
                row(S::NOT_FOUND, INVALID, "response_owner_gone", Fault::Gateway)
                    .code_is_reason()
                    .param(Some("previous_response_id"))
            }
            ResponseOwnerUnavailable { .. } => {
                unavailable("response_owner_unavailable").code_is_reason()
            }
            NoHealthyWorker(_) => unavailable("no_healthy_worker").falls_back(),
            ResidencyUnavailable { .. } => unavailable("residency_unavailable")
                .code_is_reason()
                .falls_back(),
            QueueFull(_) => throttled("queue_full").falls_back(),
            QueueTimeout(_) => throttled("queue_timeout").falls_back(),
            QueueEvicted(_) => throttled("queue_evicted").falls_back(),
            Preempted(_) => unavailable("preempted").code_is_reason(),
            SloUnattainable { retry_after_s, .. } => unavailable("slo_unattainable")
                .code_is_reason()
                .falls_back()
                .retry_after(u64::from(*retry_after_s)),
            DrainDeadline => unavailable("drain_deadline").code_is_reason().closes(),
            UpstreamConnect { .. } => upstream(S::BAD_GATEWAY, "upstream_connect"),
            UpstreamFailed { .. } => upstream(S::BAD_GATEWAY, "upstream_failed"),
            UpstreamTimeout { .. } => upstream(S::GATEWAY_TIMEOUT, "upstream_timeout"),
        }
    }

    pub fn status(&self) -> StatusCode {
        self.kind().status
    }

    /// Metric label.
    pub fn reason(&self) -> &'static str {
        self.kind().reason
    }

    /// Error class for metrics and the access log: `client` (the request was bad),
    /// `gateway` (a gateway policy refused it: no capacity, queue) or `upstream`.
    pub fn class(&self) -> &'static str {
        self.kind().fault.as_str()
    }

    /// May the request be sent to another worker (nothing reached the client yet)?
    pub fn retryable(&self) -> bool {
        self.kind().retryable
    }

    /// May another pool (a fallback) serve the request instead? Nothing reached the
    /// client, and the failure was the pool's (down, saturated, upstream errors).
    pub fn falls_back(&self) -> bool {
        self.kind().falls_back
    }

    /// Must the client connection close after this answer? The request's body
    /// may be unread, or its framing is not to be trusted.
    pub fn closes_connection(&self) -> bool {
        self.kind().closes_connection
    }

    /// The message a client sees. Upstream errors name the worker (and the
    /// transport's detail, which may carry its address) only with debug headers
    /// on: internal addresses stay inside otherwise.
    pub fn client_message(&self, debug: bool) -> String {
        use GatewayError::*;
        match self {
            UpstreamConnect { .. } if !debug => "The upstream worker is unreachable".into(),
            UpstreamFailed { .. } if !debug => "The upstream worker failed".into(),
            UpstreamTimeout { after, .. } if !debug => {
                format!("The upstream worker did not answer within {after:?}")
            }
            _ => self.to_string(),
        }
    }

    /// The error as an OpenAI-shaped JSON response, internal addresses hidden.
    pub fn to_response<B: From<bytes::Bytes>>(&self) -> Response<B> {
        self.to_response_for(false, false)
    }

    /// The error as a JSON response in the shape the client's API uses:
    /// Anthropic's (`anthropic`) or OpenAI's; `debug`: name the worker.
    pub fn to_response_for<B: From<bytes::Bytes>>(
        &self,
        anthropic: bool,
        debug: bool,
    ) -> Response<B> {
        let kind = self.kind();
        let msg = self.client_message(debug);
        let body = if anthropic {
            crate::api::anthropic::error::body(kind.status.as_u16(), &msg)
        } else {
            ErrorBody::new(&msg, kind.openai_type, kind.param, kind.code).to_bytes()
        };
        let mut resp = Response::new(B::from(body));
        *resp.status_mut() = kind.status;
        let headers = resp.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let Some(s) = kind.retry_after_s {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        if let GatewayError::Limited(r) = self {
            r.headers.write(headers);
        }
        if kind.closes_connection {
            headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        resp
    }
}

impl From<crate::tenancy::Refused> for GatewayError {
    fn from(r: crate::tenancy::Refused) -> GatewayError {
        use crate::tenancy::Refused;
        match r {
            Refused::TenantNeedsKey => GatewayError::TenantNeedsKey,
            Refused::MissingKey => GatewayError::MissingApiKey,
            Refused::UnknownKey => GatewayError::InvalidApiKey,
            Refused::BadTenantHeader(why) => {
                GatewayError::InvalidRequest(format!("Header `x-switchyard-tenant`: {why}"))
            }
        }
    }
}

#[cfg(test)]
mod tests;
