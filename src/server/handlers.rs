//! Route handlers: the proxy entry point and its phases (the gateway's own
//! endpoints are in `endpoints.rs`).

use super::client_addr::{self, Peer};
use super::refusal::close_if_unread;
use super::{request_id, Gateway};
use crate::api::headers::{Name, Own};
use crate::api::{self, inspect::InspectError, Endpoint};
use crate::config::Residency;
use crate::proxy::RequestTags;
use crate::proxy::{self, affinity, ForwardContext, GatewayError, Pinned};
use crate::routes::{ModelRoute, Snapshot};
use crate::routing::request_residency;
use crate::telemetry;
use crate::telemetry::trace::{new_span_id, ChildSpan, SpanKind, TraceContext};
use crate::telemetry::End;
use crate::tenancy::Tenant;
use axum::extract::{Request, State};
use axum::response::Response;
use bytes::{Bytes, BytesMut};
use http::{header, HeaderValue};
use http_body_util::BodyExt;
use std::sync::Arc;
use tokio::time::Instant;

/// Any inference endpoint, in phases: *admit* (tenant, residency, trace),
/// *read* and inspect the body, *resolve* the model to a route, *forward* it
/// (retries and the fallback chain in `proxy`), and *finish* an error once.
///
/// Generic over the request body so the hot path can hand hyper's body over as it
/// is, without boxing it into axum's.
pub async fn proxy<B>(State(gw): State<Arc<Gateway>>, req: http::Request<B>) -> Response
where
    B: http_body::Body<Data = Bytes>,
    B::Error: std::fmt::Display,
{
    let peer = peer_of(&req);
    run(gw, req, Mode::Json, peer).await
}

/// The socket peer the service noted in the request's extensions.
fn peer_of<B>(req: &http::Request<B>) -> Option<std::net::IpAddr> {
    req.extensions().get::<Peer>().and_then(|p| p.0)
}

/// [`proxy`] as hyper's service future, built in one step: each async layer
/// between hyper and [`run`] would move the whole request future once more.
pub(super) async fn proxy_hyper(
    gw: Arc<Gateway>,
    req: http::Request<hyper::body::Incoming>,
    peer: Option<std::net::IpAddr>,
) -> Result<Response, std::convert::Infallible> {
    Ok(run(gw, req, Mode::Json, peer).await)
}

/// `GET`/`DELETE /v1/responses/{id}` and `/v1/responses/{id}/{cancel,input_items}`:
/// sent to the worker that stored the response, named by its gateway-issued id.
pub async fn stored_response(State(gw): State<Arc<Gateway>>, req: Request) -> Response {
    let peer = peer_of(&req);
    run(gw, req, Mode::Stored, peer).await
}

/// `POST /v1/audio/transcriptions` and `/translations`: a multipart upload,
/// forwarded as it arrives once its `model` field is read.
pub async fn upload(State(gw): State<Arc<Gateway>>, req: Request) -> Response {
    let peer = peer_of(&req);
    let (parts, body) = req.into_parts();
    let head = http::Request::from_parts(parts, http_body_util::Empty::<Bytes>::new());
    run(gw, head, Mode::Upload(body), peer).await
}

/// Where a request names what serves it.
enum Mode {
    /// `model` in a JSON body.
    Json,
    /// A gateway-issued response id in the path.
    Stored,
    /// A `model` form field of a multipart upload (its body).
    Upload(axum::body::Body),
}

/// The phases of [`proxy`], for each [`Mode`]. `peer`: the socket's.
async fn run<B>(
    gw: Arc<Gateway>,
    req: http::Request<B>,
    mode: Mode,
    peer: Option<std::net::IpAddr>,
) -> Response
where
    B: http_body::Body<Data = Bytes>,
    B::Error: std::fmt::Display,
{
    let start = crate::runtime::clock::now();
    let (parts, body) = req.into_parts();
    // A steering header that is not UTF-8 is refused at admission, logged.
    let (own, unreadable) = match Own::scan(&parts.headers) {
        Ok(own) => (own, None),
        Err(name) => (Own::ANY, Some(GatewayError::InvalidHeader(name))),
    };
    let request_id = request_id::get_or_make_noted(&parts.headers, own);
    let snap = gw.routes.snapshot();
    let inbound = Inbound {
        gw: &gw,
        snap: &snap,
        parts: &parts,
        own,
        request_id: &request_id,
        endpoint: if matches!(mode, Mode::Stored) {
            Endpoint::Responses
        } else {
            Endpoint::from_path(parts.uri.path())
        },
        start,
        client: client_addr::client(peer, &parts.headers, &snap.config.server.trusted_proxies),
    };
    let admitted = match unreadable {
        Some(e) => Err(e),
        None => inbound.admit(),
    };
    let (mut tags, residency) = match admitted {
        Ok(admitted) => admitted,
        Err(e) => return inbound.refuse_admission(&e),
    };
    // The route, once known, names the model for error metrics.
    let mut known = None;
    let serving = async {
        match mode {
            Mode::Json => inbound.serve(body, &mut tags, residency, &mut known).await,
            // Rare paths are boxed: the common request's future stays small (it is
            // moved whole, and nests the largest of these).
            Mode::Stored => Box::pin(inbound.serve_stored(body, &mut tags, &mut known)).await,
            Mode::Upload(upload) => {
                Box::pin(inbound.serve_upload(upload, &mut tags, residency, &mut known)).await
            }
        }
    };
    // A request with no answer yet at the drain deadline (its body, the queue,
    // the upstream's first byte) is answered 503 rather than cut off.
    let result = tokio::select! {
        biased;
        r = serving => r,
        () = gw.drain.deadline() => {
            gw.drain.count_refused();
            Err(GatewayError::DrainDeadline)
        }
    };
    let mut resp = match result {
        Ok(r) => r,
        Err(e) => inbound.finish_error(&e, &tags, known),
    };
    if let Some(a) = &tags.admitted {
        a.headers.write(resp.headers_mut());
    }
    resp.headers_mut().insert(request_id::HEADER, request_id);
    resp
}

/// One inference request on its way in: what every phase of [`proxy`] reads.
struct Inbound<'a> {
    gw: &'a Gateway,
    snap: &'a Snapshot,
    parts: &'a http::request::Parts,
    /// Which of the gateway's own headers it carries.
    own: Own,
    request_id: &'a HeaderValue,
    endpoint: Endpoint,
    start: Instant,
    /// The client's address (see `client_addr`).
    client: Option<std::net::IpAddr>,
}

/// The residency a request asked for, or the header value that named none.
type AskedResidency = Result<Option<Residency>, String>;

impl<'a> Inbound<'a> {
    /// Phase: admit. Who is calling, where the request may be served (the
    /// tenant's residency narrowed by the header; checked once a model needs
    /// it) and which trace it belongs to: the request's tags.
    fn admit(&self) -> Result<(Arc<RequestTags>, AskedResidency), GatewayError> {
        let headers = &self.parts.headers;
        let tenant = self
            .gw
            .tenancy
            .load()
            .resolve(headers, self.own, &self.gw.keys)
            .map_err(|r| refused_by_tenancy(r.into()))?;
        let priority = tenant
            .claims
            .priority(self.own.get_str(headers, Name::Priority), &tenant.name)
            .map_err(GatewayError::InvalidRequest)?;
        let config = &self.snap.config;
        let residency = request_residency(
            &config.global,
            tenant.residency.as_ref(),
            self.own
                .get(headers, Name::Residency)
                .map(|v| v.to_str().unwrap_or("\u{fffd}")),
        );
        let sample = config
            .observability
            .tracing
            .as_ref()
            .map(|t| t.sample_ratio);
        let trace = TraceContext::from_header(self.own.get(headers, Name::TraceParent), sample);
        // Shared with the response observer once a worker answers; until the first
        // attempt nothing else holds it, so the later phases can still fill it in.
        let mut tags = RequestTags::new(
            &self.gw.sinks,
            config.clone(),
            self.request_id.clone(),
            tenant,
            trace,
            &self.gw.drain,
        );
        tags.priority = priority;
        tags.client = self.client;
        Ok((Arc::new(tags), residency))
    }

    /// A request refused at admission (its key, tenant header or a steering
    /// header): answered, counted and written to the access log with the
    /// client's address, under the anonymous tenant (no tenant was proven).
    fn refuse_admission(&self, e: &GatewayError) -> Response {
        let mut tags = RequestTags::new(
            &self.gw.sinks,
            self.snap.config.clone(),
            self.request_id.clone(),
            self.gw.tenancy.load().anonymous(),
            TraceContext::from_header(None, None),
            &self.gw.drain,
        );
        tags.client = self.client;
        let mut resp = self.finish_error(e, &tags, None);
        resp.headers_mut()
            .insert(request_id::HEADER, self.request_id.clone());
        close_if_unread(&mut resp, &self.parts.headers);
        resp
    }

    /// Phases read, resolve and forward.
    async fn serve<B>(
        &self,
        body: B,
        tags: &mut Arc<RequestTags>,
        residency: AskedResidency,
        known: &mut Option<&'a Arc<ModelRoute>>,
    ) -> Result<Response, GatewayError>
    where
        B: http_body::Body<Data = Bytes>,
        B::Error: std::fmt::Display,
    {
        let (body, info) = self.read(body, tags).await?;
        let residency = residency.map_err(|v| GatewayError::InvalidResidency {
            value: v,
            known: known_residencies(&self.snap.config.global),
        })?;
        let (route, body) = self.resolve(&info, body, residency.as_ref())?;
        let path = self.parts.uri.path();
        if self.endpoint == Endpoint::Other && !api::inspect::MODEL_PATHS.contains(&path) {
            super::engine_routes::admit(path, &route.pool.config, &tags.tenant)?;
        }
        let tenant = tags.tenant.clone();
        let (route, body, pinned) = self.continuation(&info, &tenant, route, body)?;
        *known = Some(route);
        if let Some(t) = unshared(tags) {
            t.pool = Some(route.pool.metrics.name.clone());
        }
        if tags.tenant.policy.is_some() {
            // Boxed: a limits store's future (Redis) would otherwise make every
            // request's future larger, and it is moved whole.
            Box::pin(self.limit(route, &info, &body, tags)).await?;
        }
        self.admission_span(tags, info.model.as_deref().unwrap_or_default());
        // Phase: forward, along the fallback chain.
        let pool_body = proxy::for_pool(
            &body,
            &info,
            &route.pool.config,
            self.endpoint,
            self.request_id,
        )?;
        let mut ctx = ForwardContext {
            pinned,
            ..self.context(route, pool_body, &info, tags, residency.as_ref())
        };
        let answer = proxy::forward_with_fallbacks(&mut ctx, self.snap, &body).await;
        match (answer, &info.previous_response_id) {
            (Err(e), Some(id)) if pinned.is_some() => Err(owner_failed(id, e)),
            (answer, _) => answer,
        }
    }

    /// A Responses request continuing a `previous_response_id` goes to the
    /// id's owner, with the engine's own id written back into the body. The
    /// id must be one this gateway issued to the calling tenant (else 404, as
    /// for an id that never existed); the owner's route is then the request's
    /// route: its model's permissions, limits and queue apply.
    fn continuation(
        &self,
        info: &api::RequestInfo,
        tenant: &Tenant,
        route: &'a Arc<ModelRoute>,
        body: Bytes,
    ) -> Result<(&'a Arc<ModelRoute>, Bytes, Option<Pinned>), GatewayError> {
        let prev = match (&self.endpoint, &info.previous_response_id) {
            (Endpoint::Responses, Some(p)) => p,
            _ => return Ok((route, body, None)),
        };
        let param = Some("previous_response_id");
        let (owner, index, engine_id) = self.owner_of(prev, tenant, Some(route), param)?;
        let body = affinity::replace_string(&body, prev, engine_id);
        let pinned = Pinned {
            index,
            generates: true,
        };
        Ok((owner, body, Some(pinned)))
    }

    /// The owner (route, worker index) and engine id of the stored response
    /// `id` names, if `tenant` may name it: signed for it with this gateway's
    /// key (else 404 not found, counted), held by a worker still serving
    /// (else 404 gone), preferably in a route of a model the tenant may use.
    fn owner_of<'i>(
        &self,
        id: &'i str,
        tenant: &Tenant,
        preferred: Option<&'a Arc<ModelRoute>>,
        param: Option<&'static str>,
    ) -> Result<(&'a Arc<ModelRoute>, usize, &'i str), GatewayError> {
        let v = self.gw.ids.verify(tenant, id).map_err(|why| {
            metrics::counter!(telemetry::names::STORED_ID_REFUSALS_TOTAL,
                telemetry::names::L_REASON => why.as_str())
            .increment(1);
            tracing::debug!(reason = why.as_str(), "refused a response id");
            GatewayError::UnknownResponse {
                id: api::error::echo(id),
                param,
            }
        })?;
        let usable = |r: &ModelRoute| tenant.allows(&r.model);
        match affinity::find_owner(self.snap, preferred, v.token, &usable) {
            Ok((route, index)) => Ok((route, index, v.engine_id)),
            // Its owner serves only models the tenant may not use (its own
            // response, from before its models changed).
            Err(Some((route, _))) => Err(refused_by_tenancy(GatewayError::ModelNotAllowed(
                api::error::echo(&route.model),
            ))),
            Err(None) => {
                tracing::warn!(id = %api::error::echo(id), "stored response's worker is gone");
                Err(GatewayError::ResponseOwnerGone(api::error::echo(id)))
            }
        }
    }

    /// A request on a stored response's path: to the response's owner, with
    /// the engine's id in the path, never elsewhere; admitted as a request for
    /// the owner's model.
    async fn serve_stored<B>(
        &self,
        body: B,
        tags: &mut Arc<RequestTags>,
        known: &mut Option<&'a Arc<ModelRoute>>,
    ) -> Result<Response, GatewayError>
    where
        B: http_body::Body<Data = Bytes>,
        B::Error: std::fmt::Display,
    {
        let server = &self.snap.config.server;
        let body = within(
            server.body_read_timeout,
            read_body(body, &self.parts.headers, server.max_body_bytes),
        )
        .await?;
        let path = self.parts.uri.path();
        let rest = path.strip_prefix("/v1/responses/").unwrap_or_default();
        let (id, tail) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
        if !matches!(tail, "" | "/cancel" | "/input_items") {
            return Err(GatewayError::NotFound(api::error::echo(path)));
        }
        let tenant = tags.tenant.clone();
        let (route, index, engine_id) = self.owner_of(id, &tenant, None, None)?;
        *known = Some(route);
        if let Some(t) = unshared(tags) {
            t.pool = Some(route.pool.metrics.name.clone());
        }
        let mut parts = self.parts.clone();
        parts.uri = stored_path(engine_id, tail, parts.uri.query()).ok_or_else(|| {
            GatewayError::UnknownResponse {
                id: api::error::echo(id),
                param: None,
            }
        })?;
        let info = api::RequestInfo {
            model: Some(route.model.to_string()),
            ..Default::default()
        };
        // The stored response belongs to a model: the tenant's rules apply.
        self.limit(route, &info, &Bytes::new(), tags).await?;
        let ctx = ForwardContext {
            parts: &parts,
            pinned: Some(Pinned {
                index,
                generates: false,
            }),
            ..self.context(route, body, &info, tags, None)
        };
        proxy::forward(&ctx).await.map_err(|e| owner_failed(id, e))
    }

    /// A multipart upload: read until its `model` field, then forwarded as a
    /// stream to one worker of that model's pool (the body is sent once).
    async fn serve_upload<B>(
        &self,
        body: B,
        tags: &mut Arc<RequestTags>,
        residency: AskedResidency,
        known: &mut Option<&'a Arc<ModelRoute>>,
    ) -> Result<Response, GatewayError>
    where
        B: http_body::Body<Data = Bytes> + Send + Unpin + 'static,
        B::Error: Into<crate::upstream::BoxError>,
    {
        let server = &self.snap.config.server;
        let boundary = proxy::upload::boundary(&self.parts.headers)?;
        if let Some(n) = self
            .parts
            .headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
        {
            if n > server.max_body_bytes as u64 {
                return Err(GatewayError::BodyTooLarge(server.max_body_bytes));
            }
        }
        let peek = proxy::upload::split_model(body, &boundary, server.max_body_bytes);
        let (model, upload) = tokio::time::timeout(server.body_read_timeout, peek)
            .await
            .map_err(|_| GatewayError::BodyTimeout(server.body_read_timeout))??;
        let residency = residency.map_err(|v| GatewayError::InvalidResidency {
            value: v,
            known: known_residencies(&self.snap.config.global),
        })?;
        let route = self
            .snap
            .resolve(&model, None, residency.as_ref())
            .ok_or_else(|| GatewayError::UnknownModel(api::error::echo(&model)))?
            .route;
        *known = Some(route);
        if let Some(t) = unshared(tags) {
            t.pool = Some(route.pool.metrics.name.clone());
        }
        let info = api::RequestInfo {
            model: Some(model),
            ..Default::default()
        };
        // An upload counts as a request (its tokens come from the answer's usage).
        self.limit(route, &info, &Bytes::new(), tags).await?;
        let ctx = ForwardContext {
            upload: Some(&upload),
            ..self.context(route, Bytes::new(), &info, tags, residency.as_ref())
        };
        proxy::forward(&ctx).await
    }

    /// Phase: read the body (bounded in size and time) and inspect it.
    async fn read<B>(
        &self,
        body: B,
        tags: &mut Arc<RequestTags>,
    ) -> Result<(Bytes, api::RequestInfo), GatewayError>
    where
        B: http_body::Body<Data = Bytes>,
        B::Error: std::fmt::Display,
    {
        let server = &self.snap.config.server;
        let headers = &self.parts.headers;
        let body = within(
            server.body_read_timeout,
            read_body(body, headers, server.max_body_bytes),
        )
        .await?;
        if let Some(t) = unshared(tags) {
            t.request_bytes = body.len() as u64;
        }
        api::inspect::check_depth(&body, server.max_json_depth)
            .map_err(|e| not_inspectable(e, headers))?;
        let mut info = api::inspect(&body).map_err(|e| not_inspectable(e, headers))?;
        let asked = api::Slo::from_headers(headers, self.own, api::Slo::default())
            .map_err(GatewayError::InvalidRequest)?;
        let tenant = &tags.tenant;
        info.slo = tenant.claims.slo(asked, tenant.slo, &tenant.name);
        if self.endpoint.is_anthropic() {
            api::anthropic::check(self.endpoint, &info).map_err(GatewayError::InvalidRequest)?;
        }
        if let Some(t) = unshared(tags) {
            t.stream = info.stream;
        }
        Ok((body, info))
    }

    /// Phase: resolve the request's model (or split) to a route; a split
    /// target gets the model name its pool serves written into the body.
    fn resolve(
        &self,
        info: &api::RequestInfo,
        body: Bytes,
        residency: Option<&Residency>,
    ) -> Result<(&'a Arc<ModelRoute>, Bytes), GatewayError> {
        let name = info.model.as_deref().ok_or(
            if self.endpoint == Endpoint::Other
                && !api::inspect::MODEL_PATHS.contains(&self.parts.uri.path())
            {
                GatewayError::NotFound(api::error::echo(self.parts.uri.path()))
            } else {
                GatewayError::MissingModel
            },
        )?;
        let session = self
            .own
            .get_str(&self.parts.headers, Name::Session)
            .or(info.user.as_deref());
        let resolved = self
            .snap
            .resolve(name, session, residency)
            .ok_or_else(|| GatewayError::UnknownModel(api::error::echo(name)))?;
        let route = resolved.route;
        let body = if resolved.split {
            proxy::rewrite_model(&body, Some(&route.model))?
        } else {
            body
        };
        Ok((route, body))
    }

    /// Phase: limit ([`admit_limits`]); the admission rides in the tags, so
    /// the request's end settles it.
    async fn limit(
        &self,
        route: &ModelRoute,
        info: &api::RequestInfo,
        body: &Bytes,
        tags: &mut Arc<RequestTags>,
    ) -> Result<(), GatewayError> {
        let admitted = admit_limits(
            self.gw,
            self.snap,
            self.endpoint,
            route,
            info,
            body,
            &tags.tenant,
        )
        .await?;
        if let Some(t) = unshared(tags) {
            t.admitted = admitted.map(Box::new);
        }
        Ok(())
    }

    /// The forwarding context of a resolved request (no pinned worker, no
    /// streamed upload: callers that have one set it).
    fn context<'b>(
        &'b self,
        route: &'b Arc<ModelRoute>,
        body: Bytes,
        info: &'b api::RequestInfo,
        tags: &'b Arc<RequestTags>,
        residency: Option<&'b Residency>,
    ) -> ForwardContext<'b> {
        let server = &self.snap.config.server;
        ForwardContext {
            client: &self.gw.client,
            route,
            parts: self.parts,
            own: self.own,
            body,
            info,
            endpoint: self.endpoint,
            request_id: self.request_id,
            timeouts: server.timeouts,
            health: &self.snap.config.health,
            debug_headers: server.debug_headers,
            start: self.start,
            tags,
            residency,
            global: &self.snap.config.global,
            pinned: None,
            ids: &self.gw.ids,
            upload: None,
            routes: Some(&self.gw.routes),
        }
    }

    /// The admission span of a traced request: from arrival to a route for the
    /// model it asked for.
    fn admission_span(&self, tags: &RequestTags, model: &str) {
        if !tags.tracing() {
            return;
        }
        let attrs = vec![
            ("switchyard.tenant", (*tags.tenant.name).into()),
            ("gen_ai.request.model", model.into()),
        ];
        tags.child_span(ChildSpan {
            name: "switchyard.admission",
            kind: SpanKind::Internal,
            span_id: new_span_id(),
            start: self.start,
            end: crate::runtime::clock::now(),
            attrs,
            error: false,
        });
    }

    /// Phase: finish a request that got no worker's answer: counted once, and
    /// the error in OpenAI's shape.
    fn finish_error(
        &self,
        e: &GatewayError,
        tags: &RequestTags,
        known: Option<&Arc<ModelRoute>>,
    ) -> Response {
        // Only configured model names become labels; anything else is "none".
        let known = known.map(|r| &*r.model);
        telemetry::record_gateway_error(known, e.reason(), e.status().as_u16());
        tags.finish(
            self.endpoint.as_str(),
            e.status().as_u16(),
            End::Refused {
                model: known,
                class: e.class(),
                reason: e.reason(),
                elapsed: self.start.elapsed(),
            },
        );
        e.to_response_for(
            self.endpoint.is_anthropic(),
            self.snap.config.server.debug_headers,
        )
    }
}

/// The tenant may use the model its request resolved to, and the request fits
/// the tenant's limits, its worst case reserved (prompt tokens exactly with the
/// pool's tokenizer, else estimated from the body). Shared by the proxy and the
/// Endpoint Picker; `None` when no limit applies.
pub(crate) async fn admit_limits(
    gw: &Gateway,
    snap: &Snapshot,
    endpoint: Endpoint,
    route: &ModelRoute,
    info: &api::RequestInfo,
    body: &Bytes,
    tenant: &Tenant,
) -> Result<Option<crate::tenancy::limits::Admitted>, GatewayError> {
    if tenant.policy.is_none() {
        return Ok(None);
    }
    if !tenant.allows(&route.model) {
        let model = info.model.as_deref().unwrap_or(&route.model);
        return Err(refused_by_tenancy(GatewayError::ModelNotAllowed(
            api::error::echo(model),
        )));
    }
    let ask = if tenant.reserves(&route.model) {
        let prompt = prompt_tokens(gw, endpoint, route, info, body);
        let cfg = &snap.config;
        let pricing = crate::tenancy::limits::Pricing {
            default_max_tokens: cfg.tenancy.limits.default_max_tokens,
            prices: &cfg.observability.prices,
        };
        let (model, pool) = (&*route.model, &*route.pool.name);
        pricing.worst_case(tenant, (model, pool), endpoint, info, prompt)
    } else {
        Default::default()
    };
    gw.limits
        .admit(tenant, &route.model, ask)
        .await
        .map_err(|r| refused_by_tenancy(GatewayError::Limited(r)))
}

/// A request's prompt tokens: exactly, with the pool's tokenizer (its
/// segment cache makes the routing's later count nearly free), else estimated.
fn prompt_tokens(
    gw: &Gateway,
    endpoint: Endpoint,
    route: &ModelRoute,
    info: &api::RequestInfo,
    body: &Bytes,
) -> u64 {
    let exact = gw
        .registry
        .prompt_tokenizer(&route.pool.name)
        .and_then(|t| t.prompt_tokens(endpoint, body).ok())
        .map(|t| t.len() as u64);
    exact.unwrap_or_else(|| {
        let text = info.routing_text.as_ref().map_or(0, |t| t.len());
        crate::tenancy::limits::estimate_tokens(text, info.max_tokens, false)
    })
}

/// A refusal by tenancy (key, model or limit), counted by reason.
pub(crate) fn refused_by_tenancy(e: GatewayError) -> GatewayError {
    metrics::counter!(telemetry::names::LIMIT_REFUSALS_TOTAL, telemetry::names::L_REASON => e.reason())
        .increment(1);
    e
}

/// A pinned request's failure: the owner did not answer (no other worker
/// holds the response), said so in the client's terms.
fn owner_failed(id: &str, e: GatewayError) -> GatewayError {
    if !e.falls_back() {
        return e;
    }
    tracing::warn!(id = %id, error = %e, "the worker holding a stored response did not answer");
    GatewayError::ResponseOwnerUnavailable {
        id: api::error::echo(id),
        detail: e.to_string(),
    }
}

/// The engine's path for a stored response's call: its id (checked by
/// `stored_id`: letters, digits, `_`, `-`), one of the known tails, and the
/// client's query (a query cannot change the path).
fn stored_path(engine_id: &str, tail: &str, query: Option<&str>) -> Option<http::Uri> {
    if !proxy::stored_id::engine_id_ok(engine_id) {
        return None;
    }
    let query = query.map(|q| format!("?{q}")).unwrap_or_default();
    format!("/v1/responses/{engine_id}{tail}{query}")
        .parse()
        .ok()
}

/// Read the body within `limit`. The usual body is already in hand when its
/// headers are, so the timer is armed only if the first poll finds it pending.
async fn within<F>(limit: std::time::Duration, read: F) -> Result<Bytes, GatewayError>
where
    F: std::future::Future<Output = Result<Bytes, GatewayError>>,
{
    let mut read = std::pin::pin!(read);
    let first = std::future::poll_fn(|cx| std::task::Poll::Ready(read.as_mut().poll(cx))).await;
    if let std::task::Poll::Ready(r) = first {
        return r;
    }
    match tokio::time::timeout(limit, read).await {
        Ok(r) => r,
        Err(_) => {
            super::conn::Closed::BodyTimeout.count();
            Err(GatewayError::BodyTimeout(limit))
        }
    }
}

/// Why a body could not be inspected, in the client's terms: a body that is not
/// JSON because it was sent as a form is named by its content type.
fn not_inspectable(e: InspectError, headers: &http::HeaderMap) -> GatewayError {
    let m = match e {
        InspectError::Malformed(m) => m,
        InspectError::TooDeep(limit) => return GatewayError::JsonTooDeep(limit),
    };
    let media = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|v| {
            v.split(';')
                .next()
                .unwrap_or("")
                .trim()
                .to_ascii_lowercase()
        })
        .unwrap_or_default();
    if !media.is_empty() && media != "application/json" && !media.ends_with("+json") {
        return GatewayError::UnsupportedMediaType(api::error::echo(&media));
    }
    GatewayError::MalformedJson(m)
}

/// The request's tags while admission still fills them in: nothing else holds
/// them before the first attempt shares them with its response.
fn unshared(tags: &mut Arc<RequestTags>) -> Option<&mut RequestTags> {
    let t = Arc::get_mut(tags);
    debug_assert!(t.is_some(), "request tags shared before admission finished");
    t
}

/// Zones and regions a residency header may name, for the error message.
fn known_residencies(g: &crate::config::GlobalConfig) -> String {
    let names: Vec<&str> = g
        .zones
        .iter()
        .map(|z| &*z.name)
        .chain(g.regions.iter().map(|r| &*r.name))
        .collect();
    if names.is_empty() {
        "none configured".into()
    } else {
        names.join(", ")
    }
}

/// The whole request body, at most `limit` bytes. A body that arrives in one
/// frame (the usual case) is returned as that frame, without a copy.
async fn read_body<B>(
    body: B,
    headers: &http::HeaderMap,
    limit: usize,
) -> Result<Bytes, GatewayError>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: std::fmt::Display,
{
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(GatewayError::BodyTooLarge(limit));
    }
    let mut body = std::pin::pin!(body);
    let mut first: Option<Bytes> = None;
    let mut more: Option<BytesMut> = None;
    let mut len = 0usize;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| GatewayError::BodyRead(e.to_string()))?;
        let Ok(data) = frame.into_data() else {
            continue; // trailers: nothing to forward in a JSON request
        };
        len += data.len();
        if len > limit {
            return Err(GatewayError::BodyTooLarge(limit));
        }
        if let Some(buf) = more.as_mut() {
            buf.extend_from_slice(&data);
        } else if let Some(head) = first.take() {
            let want = declared.map_or(len, |n| n as usize).max(len);
            let mut buf = BytesMut::with_capacity(want);
            buf.extend_from_slice(&head);
            buf.extend_from_slice(&data);
            more = Some(buf);
        } else {
            first = Some(data);
        }
    }
    Ok(match more {
        Some(buf) => buf.freeze(),
        None => first.unwrap_or_default(),
    })
}
