//! The gateway's one error type. Each variant knows its HTTP status, its OpenAI
//! error type, a low-cardinality `reason` label, and whether another worker may be tried.

use crate::api::ErrorBody;
use crate::tenancy::limits::LimitKind;
use http::{header, HeaderValue, Response, StatusCode};
use std::sync::Arc;
use std::time::Duration;

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

impl GatewayError {
    pub fn status(&self) -> StatusCode {
        use GatewayError::*;
        match self {
            MalformedJson(_)
            | MalformedMultipart(_)
            | JsonTooDeep(_)
            | InvalidHeader(_)
            | MissingModel
            | InvalidRequest(_)
            | BodyRead(_)
            | BadFraming(_)
            | InvalidResidency { .. } => StatusCode::BAD_REQUEST,
            BodyTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            UnsupportedMediaType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            HeadersTooLarge(_) => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            UnsupportedTransferEncoding(_) | ProxyModeOnly { .. } => StatusCode::NOT_IMPLEMENTED,
            MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            TenantNeedsKey | MissingApiKey | InvalidApiKey => StatusCode::UNAUTHORIZED,
            ModelNotAllowed(_) | ControlRouteForbidden(_) => StatusCode::FORBIDDEN,
            Limited(r) if r.never => StatusCode::BAD_REQUEST,
            Limited(r) if r.kind == LimitKind::StoreUnavailable => StatusCode::SERVICE_UNAVAILABLE,
            Limited(_) => StatusCode::TOO_MANY_REQUESTS,
            UnknownModel(_)
            | NotFound(_)
            | NotSupported(_)
            | ResponseOwnerGone(_)
            | UnknownResponse { .. } => StatusCode::NOT_FOUND,
            BodyTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            NoHealthyWorker(_)
            | ResidencyUnavailable { .. }
            | ResponseOwnerUnavailable { .. }
            | SloUnattainable { .. }
            | DrainDeadline => StatusCode::SERVICE_UNAVAILABLE,
            QueueFull(_) | QueueTimeout(_) | QueueEvicted(_) => StatusCode::TOO_MANY_REQUESTS,
            Preempted(_) => StatusCode::SERVICE_UNAVAILABLE,
            UpstreamConnect { .. } | UpstreamFailed { .. } => StatusCode::BAD_GATEWAY,
            UpstreamTimeout { .. } => StatusCode::GATEWAY_TIMEOUT,
        }
    }

    /// Metric label.
    pub fn reason(&self) -> &'static str {
        use GatewayError::*;
        match self {
            MalformedJson(_) => "malformed_json",
            MalformedMultipart(_) => "malformed_multipart",
            JsonTooDeep(_) => "json_too_deep",
            InvalidHeader(_) => "invalid_header",
            MissingModel => "missing_model",
            InvalidRequest(_) => "invalid_request",
            NotSupported(_) => "not_supported",
            UnknownModel(_) => "unknown_model",
            BodyTooLarge(_) => "body_too_large",
            BodyRead(_) => "body_read",
            BodyTimeout(_) => "body_timeout",
            UnsupportedMediaType(_) => "unsupported_media_type",
            HeadersTooLarge(_) => "headers_too_large",
            UnsupportedTransferEncoding(_) => "unsupported_transfer_encoding",
            BadFraming(_) => "bad_framing",
            MethodNotAllowed { .. } => "method_not_allowed",
            TenantNeedsKey => "tenant_needs_key",
            MissingApiKey => "missing_api_key",
            InvalidApiKey => "invalid_api_key",
            ModelNotAllowed(_) => "model_not_allowed",
            ControlRouteForbidden(_) => "control_route_forbidden",
            Limited(r) => r.kind.as_str(),
            NotFound(_) => "not_found",
            ResponseOwnerGone(_) => "response_owner_gone",
            UnknownResponse { .. } => "unknown_response",
            ProxyModeOnly { .. } => "proxy_mode_only",
            ResponseOwnerUnavailable { .. } => "response_owner_unavailable",
            NoHealthyWorker(_) => "no_healthy_worker",
            ResidencyUnavailable { .. } => "residency_unavailable",
            InvalidResidency { .. } => "invalid_residency",
            QueueFull(_) => "queue_full",
            QueueTimeout(_) => "queue_timeout",
            QueueEvicted(_) => "queue_evicted",
            Preempted(_) => "preempted",
            SloUnattainable { .. } => "slo_unattainable",
            DrainDeadline => "drain_deadline",
            UpstreamConnect { .. } => "upstream_connect",
            UpstreamFailed { .. } => "upstream_failed",
            UpstreamTimeout { .. } => "upstream_timeout",
        }
    }

    /// Error class for metrics and the access log: `client` (the request was bad),
    /// `gateway` (a gateway policy refused it: no capacity, queue) or `upstream`.
    pub fn class(&self) -> &'static str {
        use GatewayError::*;
        match self {
            MalformedJson(_)
            | MalformedMultipart(_)
            | JsonTooDeep(_)
            | InvalidHeader(_)
            | MissingModel
            | InvalidRequest(_)
            | NotSupported(_)
            | BodyRead(_)
            | BodyTimeout(_)
            | UnsupportedMediaType(_)
            | HeadersTooLarge(_)
            | UnsupportedTransferEncoding(_)
            | BadFraming(_)
            | MethodNotAllowed { .. }
            | TenantNeedsKey
            | MissingApiKey
            | InvalidApiKey
            | ModelNotAllowed(_)
            | ControlRouteForbidden(_)
            | Limited(_)
            | UnknownModel(_)
            | NotFound(_)
            | UnknownResponse { .. }
            | ProxyModeOnly { .. }
            | BodyTooLarge(_)
            | InvalidResidency { .. } => "client",
            NoHealthyWorker(_)
            | ResidencyUnavailable { .. }
            | QueueFull(_)
            | QueueTimeout(_)
            | QueueEvicted(_)
            | Preempted(_)
            | ResponseOwnerGone(_)
            | ResponseOwnerUnavailable { .. }
            | SloUnattainable { .. }
            | DrainDeadline => "gateway",
            UpstreamConnect { .. } | UpstreamFailed { .. } | UpstreamTimeout { .. } => "upstream",
        }
    }

    /// May the request be sent to another worker (nothing reached the client yet)?
    pub fn retryable(&self) -> bool {
        matches!(
            self,
            GatewayError::UpstreamConnect { .. }
                | GatewayError::UpstreamFailed { .. }
                | GatewayError::UpstreamTimeout { .. }
        )
    }

    /// May another pool (a fallback) serve the request instead? Nothing reached the
    /// client, and the failure was the pool's (down, saturated, upstream errors).
    pub fn falls_back(&self) -> bool {
        self.retryable()
            || matches!(
                self,
                GatewayError::NoHealthyWorker(_)
                    | GatewayError::ResidencyUnavailable { .. }
                    | GatewayError::QueueFull(_)
                    | GatewayError::QueueTimeout(_)
                    | GatewayError::QueueEvicted(_)
                    | GatewayError::SloUnattainable { .. }
            )
    }

    /// OpenAI's error `type`: follows the class, with two finer kinds.
    fn openai_type(&self) -> &'static str {
        use GatewayError::*;
        match self {
            TenantNeedsKey | MissingApiKey | InvalidApiKey => "authentication_error",
            ModelNotAllowed(_) | ControlRouteForbidden(_) => "permission_error",
            Limited(r) if r.never => "invalid_request_error",
            Limited(r) if r.kind.is_budget() => "insufficient_quota",
            Limited(r) if r.kind == LimitKind::StoreUnavailable => "service_unavailable",
            Limited(_) => "rate_limit_exceeded",
            NoHealthyWorker(_) | ResidencyUnavailable { .. } | SloUnattainable { .. } => {
                "service_unavailable"
            }
            ResponseOwnerGone(_) => "invalid_request_error",
            ResponseOwnerUnavailable { .. } => "service_unavailable",
            QueueFull(_) | QueueTimeout(_) | QueueEvicted(_) => "rate_limit_exceeded",
            Preempted(_) | DrainDeadline => "service_unavailable",
            _ => match self.class() {
                "upstream" => "upstream_error",
                _ => "invalid_request_error",
            },
        }
    }

    fn param_and_code(&self) -> (Option<&'static str>, Option<&'static str>) {
        use GatewayError::*;
        match self {
            MissingModel => (Some("model"), None),
            UnknownModel(_) => (Some("model"), Some("model_not_found")),
            BodyTooLarge(_) => (None, Some("request_too_large")),
            JsonTooDeep(_) => (None, Some("json_too_deep")),
            InvalidHeader(h) => (Some(*h), Some("invalid_header")),
            BodyTimeout(_) => (None, Some("request_timeout")),
            MethodNotAllowed { .. } => (None, Some("method_not_allowed")),
            TenantNeedsKey | MissingApiKey | InvalidApiKey => (None, Some("invalid_api_key")),
            ModelNotAllowed(_) => (Some("model"), Some("model_not_allowed")),
            Limited(r) if r.never => (Some(r.kind.as_str()), Some("request_exceeds_limit")),
            Limited(r) if r.kind.is_budget() => (Some(r.kind.as_str()), Some("insufficient_quota")),
            Limited(r) if r.kind == LimitKind::StoreUnavailable => {
                (None, Some("limits_store_unavailable"))
            }
            Limited(r) => (Some(r.kind.as_str()), Some("rate_limit_exceeded")),
            NotFound(_) => (None, Some("unknown_url")),
            ControlRouteForbidden(_) => (None, Some("control_route_forbidden")),
            ResponseOwnerGone(_) => (Some("previous_response_id"), Some("response_owner_gone")),
            UnknownResponse { param, .. } => (*param, Some("response_not_found")),
            ProxyModeOnly { param, .. } => (*param, Some("proxy_mode_required")),
            ResponseOwnerUnavailable { .. } => (None, Some("response_owner_unavailable")),
            ResidencyUnavailable { .. } => (None, Some("residency_unavailable")),
            InvalidResidency { .. } => (None, Some("invalid_residency")),
            // Shed by flow control: the code names why (the `reason` label).
            QueueFull(_) | QueueTimeout(_) | QueueEvicted(_) | Preempted(_) => {
                (None, Some(self.reason()))
            }
            SloUnattainable { .. } => (None, Some("slo_unattainable")),
            DrainDeadline => (None, Some("drain_deadline")),
            _ => (None, None),
        }
    }

    /// Must the client connection close after this answer? The request's body
    /// may be unread, or its framing is not to be trusted.
    pub fn closes_connection(&self) -> bool {
        use GatewayError::*;
        matches!(
            self,
            BodyTooLarge(_)
                | BodyTimeout(_)
                | BodyRead(_)
                | HeadersTooLarge(_)
                | UnsupportedTransferEncoding(_)
                | BadFraming(_)
                | DrainDeadline
        )
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
        let msg = self.client_message(debug);
        let body = if anthropic {
            crate::api::anthropic::error::body(self.status().as_u16(), &msg)
        } else {
            let (param, code) = self.param_and_code();
            ErrorBody::new(&msg, self.openai_type(), param, code).to_bytes()
        };
        let mut resp = Response::new(B::from(body));
        *resp.status_mut() = self.status();
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if resp.status() == StatusCode::TOO_MANY_REQUESTS
            || resp.status() == StatusCode::SERVICE_UNAVAILABLE
        {
            let after = match self {
                GatewayError::SloUnattainable { retry_after_s, .. } => {
                    HeaderValue::from(*retry_after_s)
                }
                _ => HeaderValue::from_static("1"),
            };
            resp.headers_mut().insert(header::RETRY_AFTER, after);
        }
        if let GatewayError::Limited(r) = self {
            if !r.never {
                resp.headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from(r.retry_after_s));
            }
            r.headers.write(resp.headers_mut());
        }
        if self.closes_connection() {
            resp.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
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
