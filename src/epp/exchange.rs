//! One ext_proc stream is one HTTP request: a state machine fed each
//! `ProcessingRequest` that returns the `ProcessingResponse`s now due. It keeps
//! the request body until it is complete (the model is in it), then decides and
//! answers in the order the body mode requires:
//!
//! - `BUFFERED`: headers pass at once; the whole body arrives in one message,
//!   whose answer carries the destination header and metadata.
//! - `STREAMED`: headers pass with a `mode_override` to `BUFFERED` (honoured when
//!   the filter allows overrides); if chunks still stream, each passes and the
//!   last one's answer carries the route.
//! - `FULL_DUPLEX_STREAMED`: nothing is answered until the body (or trailers)
//!   completes; then the headers answer (with the route), then the body, sent
//!   back as one streamed chunk.
//!
//! On the response path the bytes feed the proxy's response observer, so TTFT,
//! inter-token gaps, tokens and usage are recorded as in proxy mode.

use super::admit::{self, Caller};
use super::pick::{self, Choice};
use super::reply::{self, Route, Side};
use crate::api::headers::Own;
use crate::api::{self, Endpoint};
use crate::pool::InFlightGuard;
use crate::proxy::observe::{ObserveParams, ResponseObserver};
use crate::proxy::GatewayError;
use crate::proxy::RequestTags;
use crate::routes::ModelRoute;
use crate::routing::request_residency;
use crate::server::Gateway;
use crate::telemetry::names;
use bytes::{Bytes, BytesMut};
use envoy_types::pb::envoy::config::core::v3::HeaderMap as PbHeaders;
use envoy_types::pb::envoy::config::core::v3::Metadata;
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request::Request, HttpHeaders, ProcessingRequest, ProcessingResponse,
    ProtocolConfiguration,
};
use http::{HeaderMap, HeaderName, HeaderValue};
use metrics::{counter, histogram};
use std::net::IpAddr;
use std::sync::Arc;
use tokio::time::Instant;

/// What every stream of one picker shares.
pub struct Shared {
    pub gw: Arc<Gateway>,
    /// Fallback endpoints listed after the pick.
    pub fallbacks: usize,
}

/// How the data plane sends a body to the picker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BodyMode {
    None,
    Streamed,
    Buffered,
    FullDuplex,
}

impl BodyMode {
    fn from_proto(v: i32) -> BodyMode {
        match BodySendMode::try_from(v) {
            Ok(BodySendMode::Streamed) => BodyMode::Streamed,
            Ok(BodySendMode::Buffered | BodySendMode::BufferedPartial) => BodyMode::Buffered,
            Ok(BodySendMode::FullDuplexStreamed) => BodyMode::FullDuplex,
            _ => BodyMode::None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            BodyMode::None => "none",
            BodyMode::Streamed => "streamed",
            BodyMode::Buffered => "buffered",
            BodyMode::FullDuplex => "full_duplex_streamed",
        }
    }
}

/// The request's route once decided: what the response observer needs.
struct Routed {
    route: Arc<ModelRoute>,
    /// Index of the picked worker in `route.workers`.
    index: usize,
    policy: &'static str,
    reason: &'static str,
    predicted: Option<u64>,
    /// The picked worker counts the request in flight until the response ends.
    guard: InFlightGuard,
    tags: Arc<RequestTags>,
}

/// One request's exchange with the data plane.
pub struct Exchange {
    shared: Arc<Shared>,
    start: Instant,
    request_mode: BodyMode,
    response_mode: BodyMode,
    path: String,
    headers: HeaderMap,
    /// The gateway's headers among them (scanned at admission).
    own: Own,
    body: BytesMut,
    /// The data plane's address (the gRPC peer).
    grpc_peer: Option<IpAddr>,
    /// The client's address, for the access log.
    client: Option<IpAddr>,
    /// The request's context from its admission (at its headers) until the
    /// pick moves it into `routed`.
    tags: Option<RequestTags>,
    /// The route its model resolved to, once known (the error metric's model).
    known: Option<Arc<ModelRoute>>,
    routed: Option<Routed>,
    observer: Option<ResponseObserver>,
    /// An immediate response was sent: the data plane answers the client itself.
    closed: bool,
}

impl Exchange {
    /// A new exchange with the data plane at `grpc_peer`; without a protocol
    /// configuration from the data plane the body is taken to come buffered.
    pub fn new(shared: Arc<Shared>, grpc_peer: Option<IpAddr>) -> Exchange {
        Exchange {
            shared,
            start: crate::runtime::clock::now(),
            request_mode: BodyMode::Buffered,
            response_mode: BodyMode::None,
            path: String::new(),
            headers: HeaderMap::new(),
            own: Own::ANY,
            body: BytesMut::new(),
            grpc_peer,
            client: None,
            tags: None,
            known: None,
            routed: None,
            observer: None,
            closed: false,
        }
    }

    /// Whether an immediate response ended the exchange.
    pub fn is_closed(&self) -> bool {
        self.closed
    }

    /// Feed one message; returns the answers due now, in order.
    pub async fn on_message(&mut self, msg: ProcessingRequest) -> Vec<ProcessingResponse> {
        if self.closed {
            return Vec::new();
        }
        let out = match msg.request {
            Some(Request::RequestHeaders(h)) => {
                self.on_request_headers(h, msg.protocol_config, &msg.attributes)
                    .await
            }
            Some(Request::RequestBody(b)) => self.on_request_body(b.body, b.end_of_stream).await,
            Some(Request::RequestTrailers(_)) => self.on_request_trailers().await,
            Some(Request::ResponseHeaders(h)) => {
                self.on_response_headers(&h, msg.metadata_context.as_ref())
            }
            Some(Request::ResponseBody(b)) => self.on_response_body(b.body, b.end_of_stream),
            Some(Request::ResponseTrailers(_)) => {
                self.finish_response();
                vec![reply::continue_trailers(Side::Response)]
            }
            None => Vec::new(),
        };
        // Observability mode: the data plane expects no answers.
        if msg.observability_mode {
            Vec::new()
        } else {
            out
        }
    }

    async fn on_request_headers(
        &mut self,
        h: HttpHeaders,
        protocol: Option<ProtocolConfiguration>,
        attributes: &std::collections::HashMap<String, envoy_types::pb::google::protobuf::Struct>,
    ) -> Vec<ProcessingResponse> {
        if let Some(p) = protocol {
            self.request_mode = BodyMode::from_proto(p.request_body_mode);
            self.response_mode = BodyMode::from_proto(p.response_body_mode);
        }
        counter!(names::EPP_STREAMS_TOTAL, names::L_MODE => self.request_mode.as_str())
            .increment(1);
        let (path, headers) = convert_headers(h.headers.as_ref());
        self.path = path;
        self.headers = headers;
        let config = self.shared.gw.routes.snapshot().config.clone();
        self.client = admit::client(self.grpc_peer, attributes, &self.headers, &config);
        // Phase: admit, before any body is read (a wrong key costs nothing).
        match self.admit() {
            Ok(tags) => self.tags = Some(tags),
            Err(e) => return self.refuse(&e),
        }
        if crate::server::engine_routes::is_control(&config, &self.path) {
            let path = self.path.split('?').next().unwrap_or_default().to_string();
            return self.refuse(&crate::server::engine_routes::not_found(&path));
        }
        if let Some(e) = admit::stored_by_id(&self.path) {
            return self.refuse(&e);
        }
        let method = header_value(h.headers.as_ref(), ":method").unwrap_or_default();
        if let Some(id) = super::models::asked(method, &self.path) {
            return self.answer_models(id).await;
        }
        if h.end_of_stream || self.request_mode == BodyMode::None {
            return self.route_by_path();
        }
        match self.request_mode {
            BodyMode::FullDuplex => Vec::new(),
            BodyMode::Streamed => vec![reply::continue_headers_buffer_body(
                match self.response_mode {
                    BodyMode::FullDuplex => BodySendMode::FullDuplexStreamed as i32,
                    BodyMode::Buffered => BodySendMode::Buffered as i32,
                    BodyMode::Streamed => BodySendMode::Streamed as i32,
                    BodyMode::None => BodySendMode::None as i32,
                },
            )],
            _ => vec![reply::continue_headers(Side::Request)],
        }
    }

    /// Phase: admit. The tenant (its key), class and trace, as in proxy mode:
    /// the request's tags.
    fn admit(&mut self) -> Result<RequestTags, GatewayError> {
        let gw = &self.shared.gw;
        let config = gw.routes.snapshot().config.clone();
        let request_id = self.request_id();
        let caller = Caller {
            gw,
            config: &config,
            headers: &self.headers,
            request_id: &request_id,
            client: self.client,
        };
        let (tags, own) = caller.admit()?;
        self.own = own;
        Ok(tags)
    }

    /// `GET /v1/models[/{id}]`: answered by the picker, filtered for the caller.
    async fn answer_models(&mut self, id: Option<String>) -> Vec<ProcessingResponse> {
        let tenant = match &self.tags {
            Some(t) => t.tenant.clone(),
            None => self.shared.gw.tenancy.load().anonymous(),
        };
        let gw = self.shared.gw.clone();
        match super::models::answer(&gw, &tenant, id.as_deref()).await {
            Ok(body) => {
                self.closed = true;
                vec![reply::immediate_json(body)]
            }
            Err(e) => self.refuse(&e),
        }
    }

    /// No body to route on: the worker the request's path hashes to, for an
    /// admitted caller.
    fn route_by_path(&mut self) -> Vec<ProcessingResponse> {
        let snap = self.shared.gw.routes.snapshot();
        match pick::by_path(&snap, &self.path) {
            Some(w) => {
                let ep = pick::endpoint(&w);
                let route = Route {
                    endpoints: &ep,
                    new_body_len: None,
                    priority: None,
                };
                vec![route.on_headers()]
            }
            None => self.refuse(&GatewayError::NoHealthyWorker("any".into())),
        }
    }

    async fn on_request_body(&mut self, chunk: Vec<u8>, end: bool) -> Vec<ProcessingResponse> {
        if self.routed.is_some() {
            return self.pass_request_body(chunk, end);
        }
        // A body before any headers (a confused data plane): admitted as
        // headers without a key would be.
        if self.tags.is_none() {
            match self.admit() {
                Ok(tags) => self.tags = Some(tags),
                Err(e) => return self.refuse(&e),
            }
        }
        let max = self.shared.gw.registry.config().server.max_body_bytes;
        if self.body.len() + chunk.len() > max {
            return self.refuse(&GatewayError::BodyTooLarge(max));
        }
        self.body.extend_from_slice(&chunk);
        match (self.request_mode, end) {
            (BodyMode::FullDuplex, false) => Vec::new(),
            (BodyMode::Streamed, false) => vec![reply::continue_body(Side::Request)],
            _ => self.route_body(end).await,
        }
    }

    /// The body is complete (`end`: with its last chunk; else trailers follow):
    /// decide, then answer as the mode requires.
    async fn route_body(&mut self, end: bool) -> Vec<ProcessingResponse> {
        let body = self.body.split().freeze();
        let (endpoints, new_body) = match self.decide(&body).await {
            Ok(c) => (c.endpoints(), c.body),
            Err(e) => return self.refuse(&e),
        };
        let route = Route {
            endpoints: &endpoints,
            new_body_len: new_body.as_ref().map(Bytes::len),
            priority: self.routed.as_ref().map(|r| r.tags.priority.as_str()),
        };
        if self.request_mode == BodyMode::FullDuplex {
            let out = new_body.unwrap_or(body);
            vec![
                route.on_headers(),
                reply::streamed_body(Side::Request, Vec::from(out), end),
            ]
        } else {
            vec![route.on_body(new_body)]
        }
    }

    /// A request body chunk after the decision (a streamed body whose mode
    /// override was not honoured): it passes.
    fn pass_request_body(&mut self, chunk: Vec<u8>, end: bool) -> Vec<ProcessingResponse> {
        if self.request_mode == BodyMode::FullDuplex {
            vec![reply::streamed_body(Side::Request, chunk, end)]
        } else {
            vec![reply::continue_body(Side::Request)]
        }
    }

    async fn on_request_trailers(&mut self) -> Vec<ProcessingResponse> {
        let mut out = Vec::new();
        if self.routed.is_none() && self.request_mode == BodyMode::FullDuplex {
            out = self.route_body(false).await;
            if self.closed {
                return out;
            }
        }
        out.push(reply::continue_trailers(Side::Request));
        out
    }

    /// Phase: decide. Residency, the model, the tenant's permissions and
    /// limits (its worst case reserved) as in proxy mode, then the pick; the
    /// picked worker counts the request in flight from here.
    async fn decide(&mut self, body: &Bytes) -> Result<Choice, GatewayError> {
        let gw = self.shared.gw.clone();
        let snap = gw.routes.snapshot();
        let mut tags = match self.tags.take() {
            Some(t) => t,
            None => self.admit()?,
        };
        let r = self.limit(&snap, body, &mut tags).await;
        let r = r.and_then(|(r, residency)| {
            let t = crate::runtime::clock::now();
            let choice = pick::choose(
                r,
                &self.headers,
                residency.as_ref(),
                self.shared.fallbacks,
                &tags.tenant.name,
            )?;
            histogram!(names::EPP_DECISION_SECONDS).record(t.elapsed().as_secs_f64());
            Ok(choice)
        });
        let choice = match r {
            Ok(c) => c,
            Err(e) => {
                // Refused with its tags: the admission (if any) settles as refused.
                self.tags = Some(tags);
                return Err(e);
            }
        };
        counter!(names::EPP_DECISIONS_TOTAL, names::L_RESULT => "picked", names::L_STATUS => "200")
            .increment(1);
        tags.pool = Some(choice.route.pool.metrics.name.clone());
        tags.request_bytes = body.len() as u64;
        tags.stream = choice.info.stream;
        let index = choice.picked[0];
        let worker = &choice.route.workers[index];
        // What the worker's latency model learns from when the answer is observed.
        let since_arrival = self.start.elapsed().as_secs_f64() * 1e3;
        tags.dispatch
            .set(worker.dispatch(choice.size()).at(since_arrival));
        let guard = worker.begin(None, choice.size());
        self.routed = Some(Routed {
            route: choice.route.clone(),
            index,
            policy: choice.policy,
            reason: choice.decision.reason.as_str(),
            predicted: choice.predicted,
            guard,
            tags: Arc::new(tags),
        });
        Ok(choice)
    }

    /// The request resolved and held to its tenant's rules before any pick:
    /// residency, the model (and its path's allow-list), no stored-state
    /// continuation, the objective headers as the tenant may set them, then
    /// `allowed_models` and the limits (the admission rides in `tags`).
    async fn limit(
        &mut self,
        snap: &crate::routes::Snapshot,
        body: &Bytes,
        tags: &mut RequestTags,
    ) -> Result<(pick::Resolved, Option<crate::config::Residency>), GatewayError> {
        let server = &snap.config.server;
        api::inspect::check_depth(body, server.max_json_depth).map_err(|e| match e {
            api::inspect::InspectError::TooDeep(n) => GatewayError::JsonTooDeep(n),
            api::inspect::InspectError::Malformed(m) => GatewayError::MalformedJson(m),
        })?;
        let tenant = tags.tenant.clone();
        let residency = request_residency(
            &snap.config.global,
            tenant.residency.as_ref(),
            self.own
                .get(&self.headers, crate::api::headers::Name::Residency)
                .map(|v| v.to_str().unwrap_or("\u{fffd}")),
        )
        .map_err(|value| GatewayError::InvalidResidency {
            value,
            known: "see the gateway's configuration".into(),
        })?;
        let mut r = pick::resolve(snap, &self.headers, body, residency.as_ref())?;
        self.known = Some(r.route.clone());
        let endpoint = self.endpoint();
        if endpoint == Endpoint::Responses && r.info.previous_response_id.is_some() {
            return Err(admit::continuation());
        }
        let path = self.path.split('?').next().unwrap_or_default();
        if endpoint == Endpoint::Other && !api::inspect::MODEL_PATHS.contains(&path) {
            crate::server::engine_routes::admit(path, &r.route.pool.config, &tenant)?;
        }
        let asked = api::Slo::from_headers(&self.headers, self.own, api::Slo::default())
            .map_err(GatewayError::InvalidRequest)?;
        r.info.slo = tenant.claims.slo(asked, tenant.slo, &tenant.name);
        let sent = r.body.clone().unwrap_or_else(|| body.clone());
        let admitted = crate::server::admit_limits(
            &self.shared.gw,
            snap,
            endpoint,
            &r.route,
            &r.info,
            &sent,
            &tenant,
        )
        .await?;
        tags.admitted = admitted.map(Box::new);
        Ok((r, residency))
    }

    /// The endpoint the request's path names.
    fn endpoint(&self) -> Endpoint {
        Endpoint::from_path(self.path.split('?').next().unwrap_or_default())
    }

    fn request_id(&self) -> HeaderValue {
        self.headers
            .get(crate::proxy::REQUEST_ID_HEADER)
            .cloned()
            .unwrap_or_else(|| {
                HeaderValue::from_str(&uuid::Uuid::new_v4().to_string())
                    .expect("a uuid is a valid header value")
            })
    }

    /// Answer the client with `e` (through the data plane) and stop: counted,
    /// and written to the access log with the tenant (`anonymous` before one
    /// was proven) and the client's address.
    fn refuse(&mut self, e: &GatewayError) -> Vec<ProcessingResponse> {
        let status = e.status().as_u16();
        counter!(names::EPP_DECISIONS_TOTAL, names::L_RESULT => e.reason(), names::L_STATUS => crate::telemetry::status_label(status))
            .increment(1);
        let tags = match self.tags.take() {
            Some(t) => t,
            None => {
                let gw = &self.shared.gw;
                let config = gw.routes.snapshot().config.clone();
                let request_id = self.request_id();
                Caller {
                    gw,
                    config: &config,
                    headers: &self.headers,
                    request_id: &request_id,
                    client: self.client,
                }
                .anonymous()
            }
        };
        let model = self.known.as_ref().map(|r| &*r.model);
        admit::finish_refused(&tags, e, self.endpoint(), model, self.start);
        tracing::debug!(path = %self.path, reason = e.reason(), "picker refused the request");
        self.closed = true;
        vec![reply::immediate(e)]
    }

    fn on_response_headers(
        &mut self,
        h: &HttpHeaders,
        metadata: Option<&Metadata>,
    ) -> Vec<ProcessingResponse> {
        let status = header_value(h.headers.as_ref(), ":status")
            .and_then(|s| s.parse::<u16>().ok())
            .unwrap_or(0);
        let sse = header_value(h.headers.as_ref(), "content-type")
            .is_some_and(|v| v.starts_with("text/event-stream"));
        let served = metadata.and_then(|m| {
            reply::metadata_str(&m.filter_metadata, reply::LB_NAMESPACE, reply::SERVED)
        });
        // The tenant's rate-limit headers, as the proxy adds them.
        let mut add = HeaderMap::new();
        if let Some(r) = self.routed.take() {
            if let Some(a) = &r.tags.admitted {
                a.headers.write(&mut add);
            }
            self.observer = Some(self.observe(r, status, sse, served));
        }
        if h.end_of_stream {
            self.finish_response();
        }
        vec![reply::continue_response_headers(&add)]
    }

    /// The response observer for the worker that served: the pick, or the
    /// fallback the data plane reports it used (which then counts in flight).
    fn observe(
        &self,
        mut r: Routed,
        status: u16,
        sse: bool,
        served: Option<&str>,
    ) -> ResponseObserver {
        if let Some(ep) = served.and_then(|s| s.split(',').next()) {
            let pos = r.route.workers.iter().position(|w| pick::endpoint(w) == ep);
            if let Some(i) = pos.filter(|&i| i != r.index) {
                r.guard = r.route.workers[i].begin(None, Default::default());
                r.index = i;
                // A fallback answered: the pick's dispatch does not describe it.
                r.tags.dispatch.clear();
            }
        }
        let worker = &r.route.workers[r.index];
        let route = r.tags.route(
            &r.route.pool.metrics.name,
            worker,
            r.policy,
            r.reason,
            r.predicted,
            false,
        );
        let server = &r.tags.config.server;
        ResponseObserver::new(ObserveParams {
            start: self.start,
            metrics: r.route.metrics[r.index].clone(),
            endpoint: Endpoint::from_path(&self.path).index(),
            status,
            sse,
            idle: server.timeouts.idle,
            deadline: self.start + server.timeouts.total,
            guard: r.guard,
            tags: r.tags.clone(),
            route,
            // The picker does not hold the upstream connection: Envoy does.
            cancel: None,
            anthropic_errors: false,
            // Envoy sends the body as the client wrote it: usage is the engine's
            // when the client asked for it, and not estimated here.
            prompt_estimate: None,
        })
    }

    fn on_response_body(&mut self, chunk: Vec<u8>, end: bool) -> Vec<ProcessingResponse> {
        let chunk = Bytes::from(chunk);
        if let Some(o) = self.observer.as_mut() {
            o.on_data(&chunk);
        }
        if end {
            self.finish_response();
        }
        if self.response_mode == BodyMode::FullDuplex {
            vec![reply::streamed_body(Side::Response, Vec::from(chunk), end)]
        } else {
            vec![reply::continue_body(Side::Response)]
        }
    }

    fn finish_response(&mut self) {
        if let Some(o) = self.observer.take() {
            o.finish();
        }
    }
}

/// The request's `:path` and its regular headers (values as raw bytes; pseudo
/// and malformed headers left out).
fn convert_headers(h: Option<&PbHeaders>) -> (String, HeaderMap) {
    let mut path = String::new();
    let mut out = HeaderMap::new();
    for hv in h.map(|h| h.headers.as_slice()).unwrap_or_default() {
        let raw = raw(hv);
        if hv.key == ":path" {
            path = String::from_utf8_lossy(raw).into_owned();
            continue;
        }
        if let (Ok(k), Ok(v)) = (
            HeaderName::from_bytes(hv.key.as_bytes()),
            HeaderValue::from_bytes(raw),
        ) {
            out.append(k, v);
        }
    }
    (path, out)
}

fn raw(hv: &envoy_types::pb::envoy::config::core::v3::HeaderValue) -> &[u8] {
    if hv.raw_value.is_empty() {
        hv.value.as_bytes()
    } else {
        &hv.raw_value
    }
}

fn header_value<'a>(h: Option<&'a PbHeaders>, key: &str) -> Option<&'a str> {
    let hv = h?.headers.iter().find(|hv| hv.key == key)?;
    std::str::from_utf8(raw(hv)).ok()
}
