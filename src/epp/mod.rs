//! Endpoint Picker mode (`switchyard epp`): Envoy's external processing (ext_proc)
//! gRPC service, answering the Gateway API Inference Extension's endpoint-picker
//! protocol. An Envoy-based gateway sends each request's headers and body; the
//! picker runs the proxy's routing (the same registry, policies, stats poller,
//! health checks and discovery, started by `server::Gateway`) and answers with
//! the picked `ip:port` (then the fallbacks) in the `x-gateway-destination-endpoint`
//! header and the `envoy.lb` dynamic metadata. The data plane forwards the request
//! itself; where it shows the picker the response, the proxy's response observer
//! records TTFT, inter-token gaps and tokens.
//!
//! `exchange.rs` holds the per-stream state machine, `admit.rs` the proxy's
//! admission rules (tenant, class, client address, stored-state refusals),
//! `models.rs` the model list it answers itself, `pick.rs` the decision,
//! `reply.rs` the protobuf answers, `service.rs` the tonic service, `health.rs`
//! the gRPC health service.

mod admit;
mod exchange;
mod health;
mod models;
pub mod pick;
pub mod reply;
mod service;

pub use exchange::{BodyMode, Exchange, Shared};

use crate::cli::ServeArgs;
use crate::server::{self, Gateway};
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use clap::Args;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer;
use http::{header, HeaderValue};
use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

/// `switchyard epp` flags.
#[derive(Args, Debug, Clone)]
pub struct EppArgs {
    /// TOML configuration file (the same file `serve` reads).
    #[arg(long, short)]
    pub config: PathBuf,
    /// Address of the ext_proc gRPC service, e.g. 0.0.0.0:9002.
    #[arg(long, default_value = "0.0.0.0:9002")]
    pub grpc_listen: SocketAddr,
    /// Address of /metrics, /health and /ready (overrides server.listen).
    #[arg(long)]
    pub listen: Option<String>,
    /// Fallback endpoints listed after the pick, in the header and the metadata
    /// (0: the pick alone, as an ORIGINAL_DST cluster needs).
    #[arg(long, default_value_t = 2)]
    pub fallbacks: usize,
}

impl EppArgs {
    fn serve_args(&self) -> ServeArgs {
        ServeArgs {
            config: Some(self.config.clone()),
            listen: self.listen.clone(),
            ..Default::default()
        }
    }
}

/// A running picker: its two addresses, its gateway state and a way to stop it.
pub struct PickerHandle {
    pub grpc_addr: SocketAddr,
    pub http_addr: SocketAddr,
    pub gateway: Arc<Gateway>,
}

/// Start the picker: the gateway state (discovery, health, stats), the HTTP
/// listener for metrics and probes, and the gRPC service, until `shutdown`.
pub async fn start(
    args: &EppArgs,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<PickerHandle> {
    let serve = args.serve_args();
    let config = serve.resolve()?;
    let http = server::listen::bind_exclusive(config.server.listen, "server.listen")?;
    let grpc = server::listen::bind_exclusive(args.grpc_listen, "--grpc-listen")?;
    let (http_addr, grpc_addr) = (http.local_addr()?, grpc.local_addr()?);
    let gw = Gateway::start(config).await?;
    gw.set_reloader(serve.reloader());
    server::spawn_reload_triggers(gw.clone(), serve.config.clone());
    if let Some(admin) = server::admin::spawn(gw.clone()).await? {
        println!("switchyard admin url=http://{admin}");
    }
    let app = probes(gw.clone());
    tokio::spawn(async move {
        if let Err(e) = axum::serve(http, app).await {
            tracing::error!(error = %e, "epp http listener stopped");
        }
    });
    let picker = service::Picker {
        shared: Arc::new(Shared {
            gw: gw.clone(),
            fallbacks: args.fallbacks,
        }),
    };
    let health = health::service(gw.clone());
    let incoming = tonic::transport::server::TcpIncoming::from(grpc).with_nodelay(Some(true));
    tokio::spawn(async move {
        let r = tonic::transport::Server::builder()
            .add_service(ExternalProcessorServer::new(picker))
            .add_service(health)
            .serve_with_incoming_shutdown(incoming, shutdown)
            .await;
        if let Err(e) = r {
            tracing::error!(error = %e, "epp grpc server stopped");
        }
    });
    Ok(PickerHandle {
        grpc_addr,
        http_addr,
        gateway: gw,
    })
}

/// `switchyard epp`: run until `shutdown`, printing `switchyard epp ready …` once
/// every model has a worker.
pub async fn run(
    args: EppArgs,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let h = start(&args, async move {
        let mut stopped = stopped;
        let _ = stopped.wait_for(|v| *v).await;
    })
    .await?;
    tracing::info!(grpc = %h.grpc_addr, http = %h.http_addr, fallbacks = args.fallbacks, "switchyard epp listening");
    announce_ready(&h).await;
    shutdown.await;
    let _ = stop.send(true);
    Ok(())
}

/// Print the ready line once the snapshot is ready (what is missing until then).
async fn announce_ready(h: &PickerHandle) {
    let line = format!(
        "switchyard epp ready grpc={} url=http://{}",
        h.grpc_addr, h.http_addr
    );
    let snap = h.gateway.routes.snapshot();
    if !snap.is_ready() {
        println!(
            "switchyard epp listening grpc={}, not ready: {}",
            h.grpc_addr,
            snap.unready_reasons().join("; ")
        );
    }
    let gw = h.gateway.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(std::time::Duration::from_millis(200));
        loop {
            tick.tick().await;
            if gw.routes.snapshot().is_ready() {
                println!("{line}");
                return;
            }
        }
    });
}

/// `/metrics`, `/health` and `/ready` of the picker.
fn probes(gw: Arc<Gateway>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/health", get(|| async { "ok" }))
        .route("/ready", get(ready))
        .with_state(gw)
}

async fn metrics(State(gw): State<Arc<Gateway>>) -> Response {
    let text = crate::server::metrics_text(&gw);
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4"),
        )],
        text,
    )
        .into_response()
}

/// The gateway's `/ready` answer: status and JSON detail (KV block sizes).
async fn ready(State(gw): State<Arc<Gateway>>) -> Response {
    server::ready_answer(&gw, gw.routes.snapshot().is_ready())
}
