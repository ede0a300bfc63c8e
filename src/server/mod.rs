//! The client-facing listener: routes, request ids, body limit, OpenAI error shape,
//! and graceful shutdown. Everything model-specific is delegated to `proxy/`.

pub mod admin;
mod admin_keys;
pub(crate) mod client_addr;
mod conn;
mod cors;
pub mod dashboard;
mod endpoints;
pub mod engine_routes;
mod handlers;
pub(crate) use handlers::{admit_limits, refused_by_tenancy};
pub mod listen;
pub use endpoints::{metrics_text, ready_answer};
mod models;
pub(crate) use models::list as model_list;
mod refusal;
mod reload;
mod request_id;
pub mod shards;
mod tls;

pub use reload::{spawn_reload_triggers, Reloader};

use crate::config::Config;
use crate::pool::{self, Registry};
use crate::routes::RouteTable;
use crate::telemetry::{self, names};
use crate::upstream::UpstreamClient;
use axum::routing::{get, post};
use axum::Router;
use conn::{ConnState, ConnTimeouts, HeaderLimits, Scanned, Stop};
use hyper::service::Service as HyperService;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use metrics::gauge;
use metrics_exporter_prometheus::PrometheusHandle;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;

/// Shared state of one gateway instance.
pub struct Gateway {
    /// The pools and their workers (reload, admin and discovery change them).
    pub registry: Arc<Registry>,
    /// The routes requests take, rebuilt on each change of the pools.
    pub routes: Arc<RouteTable>,
    pub client: UpstreamClient,
    pub metrics: PrometheusHandle,
    /// Where finished requests go: metrics, cost, dashboard series, access log, traces.
    pub sinks: Arc<telemetry::Sinks>,
    /// The once-a-second fleet view and scaling recommendation.
    pub fleet: Arc<pool::fleet::Fleet>,
    /// API key → tenant; rebuilt on reload.
    pub tenancy: arc_swap::ArcSwap<crate::tenancy::Tenancy>,
    /// Keys created through the admin API (they outlive reloads).
    pub keys: Arc<crate::tenancy::keys::IssuedKeys>,
    /// Rate, concurrency and budget state (it outlives reloads).
    pub limits: crate::tenancy::limits::Limiter,
    /// Signs and verifies the Responses ids handed out (read once, at start:
    /// a reload keeps it, so ids issued before stay valid).
    pub ids: Arc<crate::proxy::stored_id::IdKey>,
    /// The engines' model lists, reused for a few seconds by `/v1/models`.
    model_cards: models::CardCache,
    shutting_down: AtomicBool,
    /// Requests alive, and the cut of streams at the drain deadline.
    pub drain: crate::runtime::drain::Drain,
    reloader: arc_swap::ArcSwapOption<Reloader>,
    /// TLS of the client listener, when `server.tls` is set.
    tls: Option<tls::Tls>,
}

impl Gateway {
    /// Build the gateway state and start its background tasks (model, DNS and Kubernetes
    /// discovery, health checks, stats poller, telemetry).
    /// Fails only if the upstream TLS trust store cannot be built.
    pub async fn start(config: Config) -> std::io::Result<Arc<Gateway>> {
        // The recorder first: building the route table resolves per-(model,
        // worker) metric handles, which are no-ops if no recorder is installed yet.
        let metrics = telemetry::install();
        telemetry::spawn_upkeep(metrics.clone());
        let ca_files: Vec<String> = config
            .pools
            .iter()
            .filter_map(|p| p.upstream_ca_file.clone())
            .collect();
        let client = UpstreamClient::new(config.server.timeouts.connect, &ca_files)?;
        let tls = match &config.server.tls {
            Some(t) => Some(tls::Tls::new(t, "client")?),
            None => None,
        };
        let sinks = telemetry::Sinks::new(&config);
        let fleet = Arc::new(pool::fleet::Fleet::default());
        let tenancy =
            arc_swap::ArcSwap::from_pointee(crate::tenancy::Tenancy::new(&config.tenancy));
        let limits = crate::tenancy::limits::Limiter::new(&config.tenancy.limits.store);
        let keys = Arc::new(crate::tenancy::keys::IssuedKeys::default());
        let ids = Arc::new(crate::proxy::stored_id::IdKey::new(
            config.server.id_key.as_ref(),
        ));
        if !ids.is_configured() {
            tracing::warn!("server.id_key_env is not set: Responses ids are signed with a random key for this process; other replicas, and this one after a restart, will answer 404 for them");
        }
        if let Some(conn) = limits.redis() {
            crate::tenancy::shared_keys::spawn_sync(conn, keys.clone());
        }
        let registry = Registry::new(config);
        let routes = RouteTable::follow(&registry);
        pool::fleet::spawn_ticker(sinks.clone(), fleet.clone(), registry.clone());
        pool::spawn_model_discovery(registry.clone(), client.clone()).await;
        pool::spawn_stats_poller(registry.clone(), client.clone());
        pool::spawn_health_checks(registry.clone(), client.clone());
        pool::spawn_dns_discovery(registry.clone());
        pool::spawn_k8s_discovery(&registry);
        Ok(Arc::new(Gateway {
            registry,
            routes,
            client,
            metrics,
            sinks,
            fleet,
            tenancy,
            keys,
            limits,
            ids,
            model_cards: Default::default(),
            shutting_down: AtomicBool::new(false),
            drain: Default::default(),
            reloader: arc_swap::ArcSwapOption::empty(),
            tls,
        }))
    }

    /// Set how a reload obtains the new config (re-read the file, re-apply flags).
    pub fn set_reloader(&self, f: Reloader) {
        self.reloader.store(Some(Arc::new(f)));
    }

    /// Reload: validate the new config and swap it in, or keep the old one.
    pub fn reload(&self) -> Result<(), String> {
        let Some(f) = self.reloader.load_full() else {
            return Err("this gateway was started without a reloadable configuration".into());
        };
        let loaded = f();
        // The one section that cannot always change in place: refuse the
        // whole reload rather than log "reloaded" over a store kept as it was.
        if let Err(e) = loaded
            .as_ref()
            .map_or(Ok(()), |c| self.limits.reconfigure(&c.tenancy.limits.store))
        {
            metrics::counter!(names::CONFIG_RELOADS_TOTAL, names::L_RESULT => "rejected")
                .increment(1);
            tracing::warn!("{e}; configuration reload rejected, keeping the current one");
            return Err(e);
        }
        match loaded {
            Ok(cfg) => {
                self.tenancy
                    .store(Arc::new(crate::tenancy::Tenancy::new(&cfg.tenancy)));
                self.registry.apply_config(cfg);
                metrics::counter!(names::CONFIG_RELOADS_TOTAL, names::L_RESULT => "ok")
                    .increment(1);
                tracing::info!("configuration reloaded");
                Ok(())
            }
            Err(e) => {
                metrics::counter!(names::CONFIG_RELOADS_TOTAL, names::L_RESULT => "rejected")
                    .increment(1);
                tracing::error!(error = %e, "configuration reload rejected; keeping the current one");
                Err(e.to_string())
            }
        }
    }

    /// `https` when the client listener terminates TLS, else `http`.
    pub fn scheme(&self) -> &'static str {
        if self.tls.is_some() {
            "https"
        } else {
            "http"
        }
    }

    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::Relaxed)
    }
}

/// The client-facing routes.
pub fn router(gw: Arc<Gateway>) -> Router {
    let mut r = Router::new();
    for path in crate::api::inspect::MODEL_PATHS {
        r = r.route(path, post(handlers::proxy::<axum::body::Body>));
    }
    r.route(
        "/v1/chat/completions",
        post(handlers::proxy::<axum::body::Body>),
    )
    .route("/v1/completions", post(handlers::proxy::<axum::body::Body>))
    .route("/v1/embeddings", post(handlers::proxy::<axum::body::Body>))
    .route("/v1/responses", post(handlers::proxy::<axum::body::Body>))
    .route("/v1/messages", post(handlers::proxy::<axum::body::Body>))
    .route(
        "/v1/messages/count_tokens",
        post(handlers::proxy::<axum::body::Body>),
    )
    .route(
        "/v1/responses/{id}",
        get(handlers::stored_response).delete(handlers::stored_response),
    )
    .route("/v1/responses/{id}/cancel", post(handlers::stored_response))
    .route(
        "/v1/responses/{id}/input_items",
        get(handlers::stored_response),
    )
    .route("/v1/audio/transcriptions", post(handlers::upload))
    .route("/v1/audio/translations", post(handlers::upload))
    .route("/v1/models", get(endpoints::models))
    .route("/v1/models/{*id}", get(endpoints::model))
    .route("/health", get(endpoints::health))
    .route("/ready", get(endpoints::ready))
    .route("/metrics", get(endpoints::metrics))
    .merge(dashboard::router(&gw))
    .fallback(endpoints::fallback)
    .method_not_allowed_fallback(endpoints::method_not_allowed)
    .with_state(gw)
}

/// The client-facing service. Inference POSTs go straight to the proxy handler,
/// so the hot path skips the router's matching and extractor layers; everything
/// else (and anything unusual) goes through the axum router.
#[derive(Clone)]
struct GatewayService {
    gw: Arc<Gateway>,
    app: TowerToHyperService<Router>,
    conn: Arc<ConnState>,
    limits: HeaderLimits,
    /// The connection's socket peer (the access log's client, unless a
    /// trusted proxy forwarded for someone).
    peer: Option<std::net::IpAddr>,
}

type ServiceFuture =
    std::pin::Pin<Box<dyn Future<Output = Result<axum::response::Response, Infallible>> + Send>>;

impl HyperService<http::Request<hyper::body::Incoming>> for GatewayService {
    type Response = axum::response::Response;
    type Error = Infallible;
    type Future = ServiceFuture;

    fn call(&self, req: http::Request<hyper::body::Incoming>) -> Self::Future {
        crate::runtime::busy_poll::touch();
        let noticed = match self.conn.admit(&req, self.limits) {
            Ok(n) => n,
            Err(e) => {
                let refused = refusal::Refused {
                    gw: &self.gw,
                    headers: req.headers(),
                    path: req.uri().path(),
                    peer: self.peer,
                };
                return Box::pin(std::future::ready(Ok(refused.answer(&e))));
            }
        };
        let origin = noticed
            .origin
            .then(|| req.headers().get(http::header::ORIGIN).cloned())
            .flatten();
        if let Some(origin) = origin {
            if let Some(cors) = self.gw.registry.config().server.cors.clone() {
                return self.call_cors(req, cors, origin);
            }
        }
        self.call_plain(req)
    }
}

impl GatewayService {
    fn call_plain(&self, req: http::Request<hyper::body::Incoming>) -> ServiceFuture {
        if req.method() == http::Method::POST
            && crate::api::Endpoint::from_path(req.uri().path()) != crate::api::Endpoint::Other
        {
            let gw = self.gw.clone();
            Box::pin(handlers::proxy_hyper(gw, req, self.peer))
        } else {
            let mut req = req;
            req.extensions_mut().insert(client_addr::Peer(self.peer));
            Box::pin(self.app.call(req))
        }
    }

    /// A request from a browser origin, with CORS on: a preflight is answered
    /// here; anything else is served and its response marked.
    fn call_cors(
        &self,
        req: http::Request<hyper::body::Incoming>,
        cors: crate::config::CorsConfig,
        origin: http::HeaderValue,
    ) -> ServiceFuture {
        if let Some(resp) = cors::preflight(&cors, req.method(), req.headers()) {
            return Box::pin(std::future::ready(Ok(resp)));
        }
        let fut = self.call_plain(req);
        Box::pin(async move {
            let mut resp = fut.await?;
            cors::decorate(&cors, &origin, &mut resp);
            Ok(resp)
        })
    }
}

/// A running gateway: its address and a way to stop it.
pub struct ServerHandle {
    pub addr: SocketAddr,
    /// The admin listener, when the config enables it.
    pub admin_addr: Option<SocketAddr>,
    pub gateway: Arc<Gateway>,
    stop: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl ServerHandle {
    pub fn url(&self) -> String {
        format!("{}://{}", self.gateway.scheme(), self.addr)
    }

    /// Graceful stop: readiness turns false, the listener closes, in-flight
    /// requests finish (up to the drain deadline).
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
    }
}

/// Bind `listen` (port 0 for an ephemeral port) and serve in a background task.
pub async fn spawn(config: Config) -> std::io::Result<ServerHandle> {
    let listener = listen::bind_exclusive(config.server.listen, "server.listen")?;
    let addr = listener.local_addr()?;
    let gateway = Gateway::start(config).await?;
    gateway.registry.note_listener(addr);
    let admin_addr = admin::spawn(gateway.clone()).await?;
    let (stop, mut rx) = tokio::sync::watch::channel(false);
    let gw = gateway.clone();
    let task = tokio::spawn(async move {
        let signal = async move {
            let _ = rx.wait_for(|v| *v).await;
        };
        let drain = gw.registry.config().server.drain_timeout;
        if let Err(e) = serve(listener, gw.clone(), signal, drain).await {
            tracing::error!(error = %e, "server stopped");
        }
        gw.log_drained();
    });
    Ok(ServerHandle {
        addr,
        admin_addr,
        gateway,
        stop,
        task,
    })
}

/// hyper's own HTTP/1 header-count limit when none is set.
const HYPER_DEFAULT_MAX_HEADERS: usize = 100;

/// The HTTP/1 and HTTP/2 settings of client connections: header limits and the
/// HTTP/1 header timeout (which also bounds an idle keep-alive connection).
fn connection_builder(cfg: &crate::config::ServerConfig) -> auto::Builder<TokioExecutor> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(cfg.header_read_timeout)
        // The read buffer bounds the header section (hyper answers 431 when
        // headers do not fit); 8 KiB is hyper's smallest.
        .max_buf_size(cfg.max_header_bytes.max(8192))
        .keep_alive(true);
    // hyper parses into a stack array of its default size (100) unless told
    // another count, when it fills a vector per request instead: tell it only then.
    if cfg.max_headers != HYPER_DEFAULT_MAX_HEADERS {
        builder.http1().max_headers(cfg.max_headers);
    }
    builder
        .http2()
        .max_header_list_size(u32::try_from(cfg.max_header_bytes).unwrap_or(u32::MAX));
    builder
}

/// Serve an internal listener (the admin API) with the client listener's
/// connection limits and a cap of its own, until the process ends.
pub(crate) async fn serve_internal(
    listener: TcpListener,
    app: Router,
    cfg: crate::config::ServerConfig,
    cap: usize,
    tls: Option<tls::Tls>,
) {
    use tower::ServiceExt;
    let builder = connection_builder(&cfg);
    let (limits, timeouts) = (HeaderLimits::of(&cfg), ConnTimeouts::of(&cfg));
    let permits = Arc::new(tokio::sync::Semaphore::new(cap));
    // Never signalled: the internal listener lives as long as the process.
    let (_never, stop) = tokio::sync::watch::channel(Stop::Serve);
    loop {
        let permit = permits.clone().acquire_owned().await.expect("never closed");
        let stream = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                tracing::warn!(error = %e, "admin accept failed");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let state = Arc::new(ConnState::default());
        let (app, st) = (app.clone(), state.clone());
        let svc = hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
            let (app, st) = (app.clone(), st.clone());
            async move {
                if let Err(e) = st.admit(&req, limits) {
                    return Ok::<_, Infallible>(refusal::refuse(&e, req.headers()));
                }
                app.oneshot(req.map(axum::body::Body::new)).await
            }
        });
        let stop = stop.clone();
        let (builder, tls) = (builder.clone(), tls.clone());
        tokio::spawn(async move {
            match tls {
                Some(tls) => {
                    if let Some(stream) = tls.accept(stream, timeouts.header).await {
                        let io = TokioIo::new(Scanned::new(stream, state.clone()));
                        let conn = builder.serve_connection_with_upgrades(io, svc);
                        conn::drive(conn, &state, timeouts, stop).await;
                    }
                }
                None => {
                    let io = TokioIo::new(Scanned::new(stream, state.clone()));
                    let conn = builder.serve_connection_with_upgrades(io, svc);
                    conn::drive(conn, &state, timeouts, stop).await;
                }
            }
            drop(permit);
        });
    }
}

/// Accept connections until `shutdown` resolves, then drain.
pub async fn serve(
    listener: TcpListener,
    gw: Arc<Gateway>,
    shutdown: impl Future<Output = ()>,
    drain: Duration,
) -> std::io::Result<()> {
    let cap = gw.registry.config().server.max_connections;
    serve_with_permits(
        listener,
        gw,
        shutdown,
        drain,
        Arc::new(tokio::sync::Semaphore::new(cap)),
    )
    .await
}

/// What every accepted connection of one listener is served with.
struct Accepting {
    gw: Arc<Gateway>,
    app: Router,
    builder: auto::Builder<TokioExecutor>,
    limits: HeaderLimits,
    timeouts: ConnTimeouts,
    /// Asks the connection to shut down gracefully, or at once.
    stop: tokio::sync::watch::Receiver<Stop>,
}

impl Accepting {
    /// Serve one accepted connection on its own task (TLS first, when
    /// configured), holding its connection-cap permit until it closes.
    fn spawn(
        &self,
        stream: tokio::net::TcpStream,
        peer: SocketAddr,
        permit: tokio::sync::OwnedSemaphorePermit,
    ) {
        let _ = stream.set_nodelay(true);
        let state = Arc::new(ConnState::default());
        let svc = GatewayService {
            gw: self.gw.clone(),
            app: TowerToHyperService::new(self.app.clone()),
            conn: state.clone(),
            limits: self.limits,
            peer: Some(peer.ip()),
        };
        let (stop, timeouts) = (self.stop.clone(), self.timeouts);
        let open = gauge!(names::CONNECTIONS_OPEN);
        open.increment(1.0);
        if let Some(tls) = self.gw.tls.clone() {
            let builder = self.builder.clone();
            tokio::spawn(async move {
                if let Some(stream) = tls.accept(stream, timeouts.header).await {
                    let io = TokioIo::new(Scanned::new(stream, state.clone()));
                    let conn = builder.serve_connection_with_upgrades(io, svc);
                    conn::drive(conn, &state, timeouts, stop).await;
                }
                open.decrement(1.0);
                drop(permit);
            });
            return;
        }
        let io = TokioIo::new(Scanned::new(stream, state.clone()));
        let conn = self
            .builder
            .serve_connection_with_upgrades(io, svc)
            .into_owned();
        tokio::spawn(async move {
            conn::drive(conn, &state, timeouts, stop).await;
            open.decrement(1.0);
            drop(permit);
        });
    }
}

/// [`serve`], drawing connection permits from `permits` (shared by every
/// listener of a thread-per-core server, so `max_connections` stays one cap).
pub(crate) async fn serve_with_permits(
    listener: TcpListener,
    gw: Arc<Gateway>,
    shutdown: impl Future<Output = ()>,
    drain: Duration,
    permits: Arc<tokio::sync::Semaphore>,
) -> std::io::Result<()> {
    let server_cfg = gw.registry.config().server.clone();
    // Connections hold a receiver: it asks them to shut down gracefully (or at
    // once), and the sender's `closed()` tells when the last one has ended.
    let (drain_tx, drain_rx) = tokio::sync::watch::channel(Stop::Serve);
    let accepting = Accepting {
        app: router(gw.clone()),
        builder: connection_builder(&server_cfg),
        limits: HeaderLimits::of(&server_cfg),
        timeouts: ConnTimeouts::of(&server_cfg),
        stop: drain_rx,
        gw: gw.clone(),
    };
    let mut grace_end = crate::runtime::clock::now();
    tokio::pin!(shutdown);
    loop {
        // At the connection cap, stop accepting until one closes.
        let permit = tokio::select! {
            p = permits.clone().acquire_owned() => p.expect("semaphore never closed"),
            _ = &mut shutdown, if !gw.is_shutting_down() => {
                gw.shutting_down.store(true, Ordering::Relaxed);
                grace_end = crate::runtime::clock::now() + server_cfg.unready_grace;
                if server_cfg.unready_grace.is_zero() {
                    break;
                }
                continue;
            }
            _ = tokio::time::sleep_until(grace_end), if gw.is_shutting_down() => break,
        };
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, peer) = match accepted {
                    Ok(s) => s,
                    Err(e) => {
                        // Out of file descriptors and similar: back off briefly.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                };
                accepting.spawn(stream, peer, permit);
            }
            _ = &mut shutdown, if !gw.is_shutting_down() => {
                // Readiness turns false first; keep accepting through the grace period.
                gw.shutting_down.store(true, Ordering::Relaxed);
                grace_end = crate::runtime::clock::now() + server_cfg.unready_grace;
                tracing::info!(grace = ?server_cfg.unready_grace, "shutting down: not ready");
                if server_cfg.unready_grace.is_zero() {
                    break;
                }
            }
            _ = tokio::time::sleep_until(grace_end), if gw.is_shutting_down() => break,
        }
    }
    gw.shutting_down.store(true, Ordering::Relaxed);
    drop(listener);
    drop(accepting);
    drain_connections(&gw, &drain_tx, drain).await;
    Ok(())
}

/// After the drain deadline, how long cut streams have to write their error
/// event before their connections are dropped.
const CUT_FLUSH: Duration = Duration::from_secs(1);
/// Once no request is left, how long a connection has to close on its own
/// after its GOAWAY (an HTTP/2 client acknowledges it within a round trip)
/// before it is closed.
const GOAWAY_GRACE: Duration = Duration::from_millis(500);

/// Ask every connection to finish (HTTP/2: GOAWAY) and wait until all are
/// closed. Connections left once no request is alive anywhere are idle ones
/// whose client did not answer: closed after [`GOAWAY_GRACE`]. At the drain
/// deadline, streams still running end with their error event.
async fn drain_connections(
    gw: &Gateway,
    drain_tx: &tokio::sync::watch::Sender<Stop>,
    drain: Duration,
) {
    let deadline = crate::runtime::clock::now() + drain;
    gw.drain.begin();
    let _ = drain_tx.send(Stop::Graceful);
    let idle = async {
        loop {
            gw.drain.quiet().await;
            tokio::time::sleep(GOAWAY_GRACE).await;
            if gw.drain.alive() == 0 {
                let _ = drain_tx.send(Stop::Now);
                return std::future::pending::<()>().await;
            }
        }
    };
    tokio::select! {
        _ = drain_tx.closed() => return,
        _ = idle => {}
        _ = tokio::time::sleep_until(deadline) => {}
    }
    // Streams still running end with their error event; give their
    // connections a moment to write it and close.
    gw.drain.cut();
    let _ = tokio::time::timeout(CUT_FLUSH, drain_tx.closed()).await;
}

impl Gateway {
    /// Log what the drain did, once every listener has stopped.
    pub fn log_drained(&self) {
        let r = self.drain.report();
        let finished = r.at_start.saturating_sub(r.at_deadline);
        if r.at_deadline == 0 {
            tracing::info!(finished, "drained: {finished} requests finished");
            return;
        }
        let aborted = r.at_deadline.saturating_sub(r.cut + r.refused);
        tracing::warn!(
            finished,
            cut = r.cut,
            refused = r.refused,
            aborted,
            "drain deadline reached: {finished} requests finished, cut {} streams at the deadline (each ended with an error event), answered {} requests still waiting with 503 drain_deadline, {aborted} other requests aborted",
            r.cut,
            r.refused
        );
    }
}
