//! Answers the gateway gives before (or instead of) proxying: OpenAI- or
//! Anthropic-shaped errors with the request id, an access-log line with the
//! client address, and a closed HTTP/1 connection when the body was not read.

use super::{client_addr, request_id, Gateway};
use crate::api::Endpoint;
use crate::proxy::{GatewayError, RequestTags};
use crate::telemetry;
use crate::telemetry::trace::TraceContext;
use crate::telemetry::End;
use axum::response::Response;
use http::{header, HeaderValue};

/// A request refused before any handler ran (its headers broke a limit): an
/// OpenAI-shaped error, counted, with the request id.
/// Its body is left unread, so an HTTP/1 connection closes after the answer
/// rather than reading the body as the next request.
pub(super) fn refuse(e: &GatewayError, headers: &http::HeaderMap) -> Response {
    refuse_for(e, headers, false)
}

/// [`refuse`], in Anthropic's error shape when `anthropic`.
pub(super) fn refuse_for(e: &GatewayError, headers: &http::HeaderMap, anthropic: bool) -> Response {
    telemetry::record_gateway_error(None, e.reason(), e.status().as_u16());
    let mut resp: Response = e.to_response_for(anthropic, false);
    resp.headers_mut()
        .insert(request_id::HEADER, request_id::get_or_make(headers));
    close_if_unread(&mut resp, headers);
    resp
}

/// Who a refusal before any handler ran (header limits, framing, method,
/// path, the model list's key check) was given to, for its access-log line.
pub(super) struct Refused<'r> {
    pub gw: &'r Gateway,
    pub headers: &'r http::HeaderMap,
    pub path: &'r str,
    /// The socket peer (`x-forwarded-for` counts only behind a trusted proxy).
    pub peer: Option<std::net::IpAddr>,
}

impl Refused<'_> {
    /// [`refuse_for`], finished like any request: an access-log line with the
    /// status, the error code and the client address. The line carries no
    /// header value but a sane `x-request-id` (bounded; never a credential).
    pub(super) fn answer(&self, e: &GatewayError) -> Response {
        let endpoint = Endpoint::from_path(self.path);
        let config = self.gw.registry.config();
        let request_id = request_id::get_or_make(self.headers);
        let mut tags = RequestTags::new(
            &self.gw.sinks,
            config.clone(),
            request_id.clone(),
            self.gw.tenancy.load().anonymous(),
            TraceContext::from_header(None, None),
            &self.gw.drain,
        );
        tags.client = client_addr::client(self.peer, self.headers, &config.server.trusted_proxies);
        telemetry::record_gateway_error(None, e.reason(), e.status().as_u16());
        let end = End::Refused {
            model: None,
            class: e.class(),
            reason: e.reason(),
            elapsed: std::time::Duration::ZERO,
        };
        tags.finish(endpoint.as_str(), e.status().as_u16(), end);
        let mut resp: Response = e.to_response_for(endpoint.is_anthropic(), false);
        resp.headers_mut().insert(request_id::HEADER, request_id);
        close_if_unread(&mut resp, self.headers);
        resp
    }
}

/// An answer given before the request's body was read: an HTTP/1 connection
/// closes after it rather than read the body as the next request.
pub(super) fn close_if_unread(resp: &mut Response, headers: &http::HeaderMap) {
    let has_body = headers.contains_key(header::TRANSFER_ENCODING)
        || headers
            .get(header::CONTENT_LENGTH)
            .is_some_and(|v| v.as_bytes() != b"0");
    if has_body {
        resp.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
}
