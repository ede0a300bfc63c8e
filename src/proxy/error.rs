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

/// Shed by a gateway policy (flow control, SLO, drain): the code names why.
const fn shed(status: StatusCode, openai_type: &'static str, reason: &'static str) -> ErrorKind {
    row(status, openai_type, reason, Fault::Gateway).code_is_reason()
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
        use Fault::{Gateway, Upstream};
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
            ResponseOwnerGone(_) => row(S::NOT_FOUND, INVALID, "response_owner_gone", Gateway)
                .code_is_reason()
                .param(Some("previous_response_id")),
            ResponseOwnerUnavailable { .. } => row(
                S::SERVICE_UNAVAILABLE,
                UNAVAILABLE,
                "response_owner_unavailable",
                Gateway,
            )
            .code_is_reason(),
            NoHealthyWorker(_) => row(
                S::SERVICE_UNAVAILABLE,
                UNAVAILABLE,
                "no_healthy_worker",
                Gateway,
            )
            .falls_back(),
            ResidencyUnavailable { .. } => row(
                S::SERVICE_UNAVAILABLE,
                UNAVAILABLE,
                "residency_unavailable",
                Gateway,
            )
            .code_is_reason()
            .falls_back(),
            QueueFull(_) => shed(S::TOO_MANY_REQUESTS, RATE_LIMITED, "queue_full").falls_back(),
            QueueTimeout(_) => {
                shed(S::TOO_MANY_REQUESTS, RATE_LIMITED, "queue_timeout").falls_back()
            }
            QueueEvicted(_) => {
                shed(S::TOO_MANY_REQUESTS, RATE_LIMITED, "queue_evicted").falls_back()
            }
            Preempted(_) => shed(S::SERVICE_UNAVAILABLE, UNAVAILABLE, "preempted"),
            SloUnattainable { retry_after_s, .. } => {
                shed(S::SERVICE_UNAVAILABLE, UNAVAILABLE, "slo_unattainable")
                    .falls_back()
                    .retry_after(*retry_after_s as u64)
            }
            DrainDeadline => shed(S::SERVICE_UNAVAILABLE, UNAVAILABLE, "drain_deadline").closes(),
            UpstreamConnect { .. } => {
                row(S::BAD_GATEWAY, UPSTREAM, "upstream_connect", Upstream).retryable()
            }
            UpstreamFailed { .. } => {
                row(S::BAD_GATEWAY, UPSTREAM, "upstream_failed", Upstream).retryable()
            }
            UpstreamTimeout { .. } => {
                row(S::GATEWAY_TIMEOUT, UPSTREAM, "upstream_timeout", Upstream).retryable()
            }
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
mod tests {
    use super::*;

    /// Every refusal the limits can produce: each kind, passable later or never.
    fn refusals() -> Vec<crate::tenancy::limits::Refusal> {
        use crate::tenancy::limits::gcra::Window;
        use crate::tenancy::limits::headers::RateHeaders;
        let kinds = [
            LimitKind::Requests,
            LimitKind::Tokens,
            LimitKind::Concurrency,
            LimitKind::DailyBudget,
            LimitKind::MonthlyBudget,
            LimitKind::StoreUnavailable,
        ];
        let window = Window {
            limit: 10,
            remaining: 0,
            reset_ns: 6_000_000_000,
        };
        let headers = RateHeaders {
            requests: Some(window),
            tokens: None,
        };
        let refusal = |kind, never| crate::tenancy::limits::Refusal {
            never,
            kind,
            scope: "tenant `acme`".into(),
            limit: "10 per minute".into(),
            retry_after_s: 7,
            headers,
        };
        let mut all: Vec<_> = kinds.iter().map(|&k| refusal(k, false)).collect();
        all.extend(kinds.iter().map(|&k| refusal(k, true)));
        all
    }

    /// One error of each variant (several for payload-dependent rows).
    fn one_of_each() -> Vec<GatewayError> {
        use GatewayError::*;
        let w: Arc<str> = Arc::from("http://10.0.0.7:8000");
        let s = |x: &str| x.to_string();
        let mut all = vec![
            MalformedJson(s("eof")),
            JsonTooDeep(64),
            InvalidHeader("x-session-id"),
            MissingModel,
            InvalidRequest(s("bad")),
            NotSupported(s("no")),
            UnknownModel(s("m")),
            BodyTooLarge(1024),
            BodyRead(s("reset")),
            BodyTimeout(Duration::from_secs(3)),
            UnsupportedMediaType(s("text/plain")),
            MalformedMultipart(s("no boundary")),
            HeadersTooLarge(s("64 KiB")),
            UnsupportedTransferEncoding(s("gzip")),
            BadFraming("both Content-Length and Transfer-Encoding"),
            TenantNeedsKey,
            MissingApiKey,
            InvalidApiKey,
            ModelNotAllowed(s("m")),
            MethodNotAllowed {
                method: s("PUT"),
                path: s("/v1/models"),
            },
            NotFound(s("/v2")),
            ControlRouteForbidden(s("/sleep")),
            NoHealthyWorker(s("m")),
            ResidencyUnavailable {
                residency: Arc::from("eu"),
                regions: s("eu-west"),
                model: s("m"),
            },
            InvalidResidency {
                value: s("mars"),
                known: s("eu, us"),
            },
            QueueFull(s("p")),
            QueueTimeout(s("p")),
            QueueEvicted(s("p")),
            Preempted(s("p")),
            ResponseOwnerGone(s("resp_1")),
            ResponseOwnerUnavailable {
                id: s("resp_1"),
                detail: s("refused"),
            },
            UnknownResponse {
                id: s("resp_1"),
                param: None,
            },
            UnknownResponse {
                id: s("resp_1"),
                param: Some("previous_response_id"),
            },
            ProxyModeOnly {
                what: "GET /v1/responses/{id}",
                param: None,
            },
            ProxyModeOnly {
                what: "previous_response_id",
                param: Some("previous_response_id"),
            },
            SloUnattainable {
                model: s("m"),
                predicted_ttft_ms: 900,
                retry_after_s: 4,
            },
            DrainDeadline,
            UpstreamConnect {
                worker: w.clone(),
                detail: s("refused"),
            },
            UpstreamFailed {
                worker: w.clone(),
                detail: s("reset"),
            },
            UpstreamTimeout {
                worker: w,
                after: Duration::from_secs(30),
            },
        ];
        all.extend(refusals().into_iter().map(|r| Limited(Box::new(r))));
        all
    }

    /// The variant's position in the enum. No wildcard: a new variant does not
    /// compile until it is listed here, and then fails `the_table_is_total`
    /// until `one_of_each` constructs it.
    fn ordinal(e: &GatewayError) -> usize {
        use GatewayError::*;
        match e {
            MalformedJson(_) => 0,
            JsonTooDeep(_) => 1,
            InvalidHeader(_) => 2,
            MissingModel => 3,
            InvalidRequest(_) => 4,
            NotSupported(_) => 5,
            UnknownModel(_) => 6,
            BodyTooLarge(_) => 7,
            BodyRead(_) => 8,
            BodyTimeout(_) => 9,
            UnsupportedMediaType(_) => 10,
            MalformedMultipart(_) => 11,
            HeadersTooLarge(_) => 12,
            UnsupportedTransferEncoding(_) => 13,
            BadFraming(_) => 14,
            TenantNeedsKey => 15,
            MissingApiKey => 16,
            InvalidApiKey => 17,
            ModelNotAllowed(_) => 18,
            Limited(_) => 19,
            MethodNotAllowed { .. } => 20,
            NotFound(_) => 21,
            ControlRouteForbidden(_) => 22,
            NoHealthyWorker(_) => 23,
            ResidencyUnavailable { .. } => 24,
            InvalidResidency { .. } => 25,
            QueueFull(_) => 26,
            QueueTimeout(_) => 27,
            QueueEvicted(_) => 28,
            Preempted(_) => 29,
            ResponseOwnerGone(_) => 30,
            ResponseOwnerUnavailable { .. } => 31,
            UnknownResponse { .. } => 32,
            ProxyModeOnly { .. } => 33,
            SloUnattainable { .. } => 34,
            DrainDeadline => 35,
            UpstreamConnect { .. } => 36,
            UpstreamFailed { .. } => 37,
            UpstreamTimeout { .. } => 38,
        }
    }
    const VARIANTS: usize = 39;

    /// Every variant is constructed, and reason labels are few, well-formed
    /// and name one variant each (a dashboard can tell them apart).
    #[test]
    fn the_table_is_total() {
        let all = one_of_each();
        let seen: std::collections::BTreeSet<usize> = all.iter().map(ordinal).collect();
        let missing: Vec<usize> = (0..VARIANTS).filter(|i| !seen.contains(i)).collect();
        assert!(missing.is_empty(), "variants not constructed: {missing:?}");
        let mut owner = std::collections::HashMap::new();
        for e in &all {
            let reason = e.kind().reason;
            let snake = |s: &str| {
                !s.is_empty()
                    && s.len() <= 40
                    && s.bytes().all(|b| b.is_ascii_lowercase() || b == b'_')
            };
            assert!(snake(reason), "{reason}");
            assert!(e.kind().code.is_none_or(snake), "{e:?}");
            let first = *owner.entry(reason).or_insert(ordinal(e));
            assert_eq!(first, ordinal(e), "`{reason}` labels two variants");
        }
        // One label per variant, plus one per limit kind for `Limited`.
        assert_eq!(owner.len(), VARIANTS - 1 + 6);
    }

    /// The columns of each row agree with each other.
    #[test]
    fn the_table_is_consistent() {
        for e in one_of_each() {
            let k = e.kind();
            let s = k.status.as_u16();
            assert!(
                k.status.is_client_error() || k.status.is_server_error(),
                "{e:?}"
            );
            if k.retryable {
                assert!(k.falls_back && k.fault == Fault::Upstream, "{e:?}");
                assert!(s == 502 || s == 504, "{e:?}");
            }
            if k.falls_back {
                assert!(k.fault != Fault::Client && (s == 429 || s >= 500), "{e:?}");
            }
            // Retry-After on every 429 and 503, and only there.
            assert_eq!(k.retry_after_s.is_some(), s == 429 || s == 503, "{e:?}");
            let expected_type = match s {
                401 => vec![AUTHENTICATION],
                403 => vec![PERMISSION],
                429 => vec![RATE_LIMITED, QUOTA],
                503 => vec![UNAVAILABLE],
                502 | 504 => vec![UPSTREAM],
                _ => vec![INVALID],
            };
            assert!(expected_type.contains(&k.openai_type), "{e:?}");
            assert_eq!(
                k.fault == Fault::Upstream,
                k.openai_type == UPSTREAM,
                "{e:?}"
            );
            // The accessors read the row.
            assert_eq!(e.status(), k.status);
            assert_eq!(e.reason(), k.reason);
            assert_eq!(e.class(), k.fault.as_str());
            assert_eq!(e.retryable(), k.retryable);
            assert_eq!(e.falls_back(), k.falls_back);
            assert_eq!(e.closes_connection(), k.closes_connection);
        }
    }

    /// The answer carries the row: status, OpenAI body, Retry-After, Connection.
    #[test]
    fn answers_follow_the_table() {
        for e in one_of_each() {
            let k = e.kind();
            let r: Response<bytes::Bytes> = e.to_response();
            assert_eq!(r.status(), k.status);
            let v: serde_json::Value = serde_json::from_slice(r.body()).unwrap();
            assert_eq!(v["error"]["type"], k.openai_type, "{e:?}");
            assert_eq!(v["error"]["code"].as_str(), k.code, "{e:?}");
            assert_eq!(v["error"]["param"].as_str(), k.param, "{e:?}");
            let header = |name| {
                r.headers()
                    .get(name)
                    .map(|v| v.to_str().unwrap().to_owned())
            };
            let after = k.retry_after_s.map(|s| s.to_string());
            assert_eq!(header(header::RETRY_AFTER), after, "{e:?}");
            let close = k.closes_connection.then(|| "close".to_owned());
            assert_eq!(header(header::CONNECTION), close, "{e:?}");
        }
    }

    /// Payload-dependent rows: a refusal's kind and passability, the SLO's wait.
    #[test]
    fn payload_rows() {
        for r in refusals() {
            let (never, kind, after) = (r.never, r.kind, r.retry_after_s);
            let k = GatewayError::Limited(Box::new(r)).kind();
            assert_eq!(k.reason, kind.as_str());
            let (status, ty, code, retry_after) = match kind {
                _ if never => (400, INVALID, "request_exceeds_limit", None),
                LimitKind::StoreUnavailable => {
                    (503, UNAVAILABLE, "limits_store_unavailable", Some(after))
                }
                k if k.is_budget() => (429, QUOTA, "insufficient_quota", Some(after)),
                _ => (429, RATE_LIMITED, "rate_limit_exceeded", Some(after)),
            };
            assert_eq!(k.status.as_u16(), status, "{kind:?} never={never}");
            assert_eq!((k.openai_type, k.code), (ty, Some(code)));
            assert_eq!(k.retry_after_s, retry_after);
        }
        let slo = GatewayError::SloUnattainable {
            model: "m".into(),
            predicted_ttft_ms: 1,
            retry_after_s: 9,
        };
        assert_eq!(slo.kind().retry_after_s, Some(9));
        assert_eq!(GatewayError::InvalidHeader("x-a").kind().param, Some("x-a"));
    }

    #[test]
    fn statuses_and_retryability() {
        let w: Arc<str> = Arc::from("http://w");
        let cases = [
            (GatewayError::MalformedJson("x".into()), 400, false),
            (GatewayError::MissingModel, 400, false),
            (GatewayError::UnknownModel("m".into()), 404, false),
            (GatewayError::BodyTooLarge(1), 413, false),
            (GatewayError::NoHealthyWorker("m".into()), 503, false),
            (
                GatewayError::UpstreamConnect {
                    worker: w.clone(),
                    detail: "refused".into(),
                },
                502,
                true,
            ),
            (
                GatewayError::UpstreamTimeout {
                    worker: w,
                    after: Duration::from_secs(1),
                },
                504,
                true,
            ),
        ];
        for (e, status, retry) in cases {
            assert_eq!(e.status().as_u16(), status, "{e}");
            assert_eq!(e.retryable(), retry, "{e}");
            let r: Response<bytes::Bytes> = e.to_response();
            let v: serde_json::Value = serde_json::from_slice(r.body()).unwrap();
            assert!(v["error"]["message"].is_string());
            let r: Response<bytes::Bytes> = e.to_response_for(true, false);
            let v: serde_json::Value = serde_json::from_slice(r.body()).unwrap();
            assert_eq!(v["type"], "error");
            assert!(v["error"]["type"].is_string() && v["error"]["message"].is_string());
        }
    }
}
