//! The client-facing listener: routes, request ids, body limit, OpenAI error shape,
//! and graceful shutdown. Everything model-specific is delegated to `proxy/`.

mod handlers;
mod request_id;

use crate::config::Config;
use crate::pool::{self, Registry};
use crate::proxy::UpstreamClient;
use crate::telemetry;
use axum::routing::{get, post};
use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use metrics_exporter_prometheus::PrometheusHandle;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;

/// How long in-flight requests may run after shutdown begins.
pub const DEFAULT_DRAIN_DEADLINE: Duration = Duration::from_secs(30);

/// Shared state of one gateway instance.
pub struct Gateway {
    pub registry: Arc<Registry>,
    pub client: UpstreamClient,
    pub metrics: PrometheusHandle,
    shutting_down: AtomicBool,
}

impl Gateway {
    /// Build the gateway state and start its background tasks (model discovery,
    /// worker stats poller).
    pub async fn start(config: Config) -> Arc<Gateway> {
        let client = UpstreamClient::new(config.server.timeouts.connect);
        let registry = Registry::new(config);
        pool::spawn_model_discovery(registry.clone(), client.clone()).await;
        pool::spawn_stats_poller(registry.clone(), client.clone());
        Arc::new(Gateway {
            registry,
            client,
            metrics: telemetry::install(),
            shutting_down: AtomicBool::new(false),
        })
    }

    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::Relaxed)
    }
}

/// The client-facing routes.
pub fn router(gw: Arc<Gateway>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(handlers::proxy))
        .route("/v1/completions", post(handlers::proxy))
        .route("/v1/embeddings", post(handlers::proxy))
        .route("/v1/responses", post(handlers::proxy))
        .route("/v1/models", get(handlers::models))
        .route("/health", get(handlers::health))
        .route("/ready", get(handlers::ready))
        .route("/metrics", get(handlers::metrics))
        .fallback(handlers::fallback)
        .with_state(gw)
}

/// A running gateway: its address and a way to stop it.
pub struct ServerHandle {
    pub addr: SocketAddr,
    pub gateway: Arc<Gateway>,
    stop: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl ServerHandle {
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
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
    let listener = TcpListener::bind(config.server.listen).await?;
    let addr = listener.local_addr()?;
    let gateway = Gateway::start(config).await;
    let (stop, mut rx) = tokio::sync::watch::channel(false);
    let gw = gateway.clone();
    let task = tokio::spawn(async move {
        let signal = async move {
            let _ = rx.wait_for(|v| *v).await;
        };
        if let Err(e) = serve(listener, gw, signal, DEFAULT_DRAIN_DEADLINE).await {
            tracing::error!(error = %e, "server stopped");
        }
    });
    Ok(ServerHandle {
        addr,
        gateway,
        stop,
        task,
    })
}

/// Accept connections until `shutdown` resolves, then drain.
pub async fn serve(
    listener: TcpListener,
    gw: Arc<Gateway>,
    shutdown: impl Future<Output = ()>,
    drain: Duration,
) -> std::io::Result<()> {
    let app = router(gw.clone());
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(Duration::from_secs(30))
        .keep_alive(true);
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, _peer) = match accepted {
                    Ok(s) => s,
                    Err(e) => {
                        // Out of file descriptors and similar: back off briefly.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let svc = TowerToHyperService::new(app.clone());
                let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), svc);
                let conn = graceful.watch(conn.into_owned());
                tokio::spawn(async move {
                    let _ = conn.await;
                });
            }
            _ = &mut shutdown => break,
        }
    }
    gw.shutting_down.store(true, Ordering::Relaxed);
    drop(listener);
    if tokio::time::timeout(drain, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("drain deadline reached with requests still in flight");
    }
    Ok(())
}
