//! CORS for browser clients (`server.cors`): the gateway answers preflights
//! itself and marks responses to allowed origins. Without `server.cors` no CORS
//! header is ever sent, so browsers keep other origins out. An origin not
//! allowed is counted; its plain requests are still answered (a non-browser
//! client may send `Origin`), just without the headers a browser needs.

use crate::api::ErrorBody;
use crate::config::CorsConfig;
use crate::telemetry::names;
use axum::response::Response;
use http::header::{self, HeaderValue};
use http::{HeaderMap, Method, StatusCode};

/// Response headers a browser script may read.
const EXPOSED: &str = "x-request-id, retry-after";

/// Is `origin` one `cfg` allows?
fn allows(cfg: &CorsConfig, origin: &HeaderValue) -> bool {
    cfg.any_origin
        || cfg
            .origins
            .iter()
            .any(|o| o.as_bytes().eq_ignore_ascii_case(origin.as_bytes()))
}

fn refused() {
    metrics::counter!(names::CORS_REFUSED_TOTAL).increment(1);
}

/// A preflight (`OPTIONS` with `Origin` and `Access-Control-Request-Method`):
/// 204 with what is allowed, or 403 in OpenAI's error shape. `None`: not a preflight.
pub(crate) fn preflight(
    cfg: &CorsConfig,
    method: &Method,
    headers: &HeaderMap,
) -> Option<Response> {
    if method != Method::OPTIONS || !headers.contains_key(header::ACCESS_CONTROL_REQUEST_METHOD) {
        return None;
    }
    let origin = headers.get(header::ORIGIN)?;
    if !allows(cfg, origin) {
        refused();
        let body = ErrorBody::new(
            "This origin is not allowed to call the API (server.cors.allowed_origins)",
            "invalid_request_error",
            None,
            Some("cors_origin_not_allowed"),
        );
        let mut resp = Response::new(axum::body::Body::from(body.to_bytes()));
        *resp.status_mut() = StatusCode::FORBIDDEN;
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        return Some(resp);
    }
    let mut resp = Response::new(axum::body::Body::empty());
    *resp.status_mut() = StatusCode::NO_CONTENT;
    let h = resp.headers_mut();
    allow_origin(cfg, origin, h);
    let text = |s: &str| HeaderValue::from_str(s).unwrap_or(HeaderValue::from_static(""));
    h.insert(header::ACCESS_CONTROL_ALLOW_METHODS, text(&cfg.methods));
    h.insert(header::ACCESS_CONTROL_ALLOW_HEADERS, text(&cfg.headers));
    h.insert(
        header::ACCESS_CONTROL_MAX_AGE,
        HeaderValue::from(cfg.max_age.as_secs()),
    );
    Some(resp)
}

/// Mark a response to a request from `origin`, if the origin is allowed.
pub(crate) fn decorate(cfg: &CorsConfig, origin: &HeaderValue, resp: &mut Response) {
    if !allows(cfg, origin) {
        refused();
        return;
    }
    let h = resp.headers_mut();
    allow_origin(cfg, origin, h);
    h.insert(
        header::ACCESS_CONTROL_EXPOSE_HEADERS,
        HeaderValue::from_static(EXPOSED),
    );
}

/// `*` for any origin; otherwise the origin itself, with `Vary: Origin` so a
/// cache does not hand one origin's answer to another.
fn allow_origin(cfg: &CorsConfig, origin: &HeaderValue, h: &mut HeaderMap) {
    if cfg.any_origin {
        h.insert(
            header::ACCESS_CONTROL_ALLOW_ORIGIN,
            HeaderValue::from_static("*"),
        );
    } else {
        h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin.clone());
        h.append(header::VARY, HeaderValue::from_static("origin"));
    }
}
