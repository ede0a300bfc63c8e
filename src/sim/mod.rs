//! Simulated vLLM/SGLang engine (`switchyard sim`): the timing model, the KV
//! and prefix cache, the OpenAI-compatible API, engine metrics and faults.
//!
//! Usable in-process from tests and benches through [`spawn`], and from the
//! command line through [`run`]. See `docs/sim.md` for the model and its limits.
//!
//! - `engine`: the step loop and scheduler (one tokio task per engine)
//! - `kv`: paged KV cache with chained-hash prefix caching and LRU eviction
//! - `tokenizer`: deterministic approximate tokenizer and chat template
//! - `api`: axum routes, OpenAI request/response shapes, P/D parameters
//! - `responses`: the Responses API's input items, objects and stream events
//! - `tools`: forced tool calls and their arguments from a JSON schema
//! - `metrics`: Prometheus text under vLLM's or SGLang's names
//! - `faults`: fault settings and the `x-sim-fault` header
//! - `profiles`: named parameter sets from published figures
//! - `cli`: `SimArgs` and [`run`]
// The simulated engine is a standalone program, not the gateway's request path:
// it keeps its own clock reads and locks.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

mod abort;
pub mod api;
mod cli;
mod endpoints;
pub mod engine;
pub mod faults;
pub mod kv;
pub mod kv_events;
mod messages;
pub mod metrics;
mod offload;
pub mod profiles;
mod responses;
pub mod tokenizer;
mod tools;

use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch, Notify};
use tokio::task::JoinHandle;
use tower::ServiceExt;

pub use cli::{run, SimArgs};
pub use faults::{Fault, Faults, FAULT_HEADER};

/// Which engine's metric names and extra endpoints to imitate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineKind {
    /// vLLM's metric names (`vllm:*`).
    Vllm,
    /// SGLang's metric names (`sglang:*`), plus `/get_load` and `/get_model_info`.
    Sglang,
}

impl EngineKind {
    pub fn as_str(self) -> &'static str {
        match self {
            EngineKind::Vllm => "vllm",
            EngineKind::Sglang => "sglang",
        }
    }
}

/// Role in prefill/decode disaggregation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Prefill instance: computes the prompt's KV and returns one token.
    Prefill,
    /// Decode instance: receives the prompt's KV from a prefill peer, then decodes.
    Decode,
    /// No disaggregation: prefill and decode on this engine.
    Both,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Both => "both",
        }
    }
}

/// Every knob of one simulated engine. Times are simulated milliseconds,
/// divided by `time_scale` to get wall-clock time.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Address to bind; port 0 picks an ephemeral port.
    pub host: String,
    pub port: u16,
    /// Profile the values came from (informational).
    pub profile: String,
    /// Served model name (also the `model_name` metric label).
    pub model: String,
    /// Further names the same engine answers to.
    pub aliases: Vec<String>,
    pub engine: EngineKind,
    pub role: Role,
    /// Speed-up factor: 10 runs the model ten times faster than real time.
    pub time_scale: f64,
    /// Seeds output text, natural output lengths and random faults.
    pub seed: u64,
    /// Cap on sequences in the running batch.
    pub max_num_seqs: usize,
    /// Cap on tokens computed in one step (chunked prefill budget).
    pub max_num_batched_tokens: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV cache capacity in blocks.
    pub num_blocks: usize,
    /// Longest prompt + output; capped at `num_blocks * block_size`.
    pub max_model_len: usize,
    pub enable_prefix_caching: bool,
    /// Preempt the newest running sequence when KV runs out (vLLM). When
    /// false, admission reserves KV for a sequence's whole length instead.
    pub preemption: bool,
    /// Fixed cost of one engine step (ms).
    pub step_base_ms: f64,
    /// Added per sequence in the step (ms).
    pub per_seq_ms: f64,
    /// Added per uncached prompt token computed in the step (ms).
    pub per_prefill_token_ms: f64,
    /// Fixed cost of receiving a remote prefill's KV (ms).
    pub kv_transfer_base_ms: f64,
    /// Per transferred token (ms).
    pub kv_transfer_per_token_ms: f64,
    /// Blocks of the CPU offload tier that GPU evictions move to (0: none).
    pub cpu_offload_blocks: usize,
    /// Cost of loading a prefix back from the CPU tier, per token (ms).
    pub cpu_load_per_token_ms: f64,
    /// Mean natural output length (tokens) before EOS, when not `ignore_eos`.
    pub mean_output_tokens: usize,
    /// Length of `/v1/embeddings` vectors.
    pub embedding_dim: usize,
    /// Faults active from the start.
    pub faults: Faults,
    /// Publish KV-cache events over ZeroMQ (vLLM's `--kv-events-config`).
    pub kv_events: Option<kv_events::KvEventsConfig>,
    /// Keep generating a streamed request whose client left, until it ends or
    /// `/abort_request` (SGLang) names its `rid`.
    pub ignore_disconnect: bool,
}

impl SimConfig {
    /// Values shared by all profiles before their own settings.
    pub(crate) fn base() -> SimConfig {
        SimConfig {
            host: "127.0.0.1".into(),
            port: 0,
            profile: "custom".into(),
            model: "sim-llama-8b".into(),
            aliases: Vec::new(),
            engine: EngineKind::Vllm,
            role: Role::Both,
            time_scale: 1.0,
            seed: 0,
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            block_size: 16,
            num_blocks: 26_000,
            max_model_len: 32_768,
            enable_prefix_caching: true,
            preemption: true,
            step_base_ms: 7.0,
            per_seq_ms: 0.06,
            per_prefill_token_ms: 0.07,
            kv_transfer_base_ms: 2.0,
            kv_transfer_per_token_ms: 0.002,
            cpu_offload_blocks: 0,
            cpu_load_per_token_ms: 0.005,
            mean_output_tokens: 200,
            ignore_disconnect: false,
            embedding_dim: 1024,
            faults: Faults::default(),
            kv_events: None,
        }
    }

    /// The named profile (see [`profiles::NAMES`]), or `None`.
    pub fn profile(name: &str) -> Option<SimConfig> {
        profiles::get(name)
    }

    /// All names this engine answers to, the primary first.
    pub fn served_names(&self) -> impl Iterator<Item = &str> {
        std::iter::once(self.model.as_str()).chain(self.aliases.iter().map(String::as_str))
    }

    /// Check the knobs; the message names the offending field.
    pub fn validate(&self) -> Result<(), String> {
        let pos = |v: usize, n: &str| {
            if v == 0 {
                Err(format!("{n} must be at least 1"))
            } else {
                Ok(())
            }
        };
        pos(self.max_num_seqs, "max_num_seqs")?;
        pos(self.max_num_batched_tokens, "max_num_batched_tokens")?;
        pos(self.block_size, "block_size")?;
        pos(self.num_blocks, "num_blocks")?;
        pos(self.max_model_len, "max_model_len")?;
        pos(self.embedding_dim, "embedding_dim")?;
        if self.max_model_len < 2 {
            return Err("max_model_len must be at least 2".into());
        }
        if !(self.time_scale.is_finite() && self.time_scale > 0.0) {
            return Err("time_scale must be a positive number".into());
        }
        for (v, n) in [
            (self.step_base_ms, "step_base_ms"),
            (self.per_seq_ms, "per_seq_ms"),
            (self.per_prefill_token_ms, "per_prefill_token_ms"),
            (self.kv_transfer_base_ms, "kv_transfer_base_ms"),
            (self.kv_transfer_per_token_ms, "kv_transfer_per_token_ms"),
            (self.cpu_load_per_token_ms, "cpu_load_per_token_ms"),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(format!("{n} must be a non-negative number"));
            }
        }
        if self.model.is_empty() {
            return Err("model must not be empty".into());
        }
        self.faults.validate()
    }
}

impl Default for SimConfig {
    fn default() -> Self {
        profiles::get("llama-8b-h100").unwrap_or_else(SimConfig::base)
    }
}

/// Per-connection control, found in each request's extensions.
#[derive(Clone)]
pub(crate) struct ConnCtl(pub Arc<Notify>);

/// State shared by the routes of one engine.
pub(crate) struct Shared {
    pub cfg: SimConfig,
    pub params: engine::Params,
    pub stats: Arc<metrics::Stats>,
    pub faults: watch::Sender<Faults>,
    pub submit: mpsc::Sender<engine::Submit>,
    pub engine_id: String,
    pub addr: SocketAddr,
    pub arrivals: AtomicU64,
    pub started: u64,
    /// Stored Responses API responses.
    pub responses: responses::Store,
    /// Bytes of audio uploads received so far (counted as they arrive).
    pub audio_bytes: AtomicU64,
    /// Streamed requests by `rid`, to stop on `/abort_request`.
    pub aborts: abort::Registry,
}

/// A running simulated engine. Dropping the handle kills the engine (as
/// [`SimHandle::kill`]), so keep it alive as long as the engine is needed.
pub struct SimHandle {
    addr: SocketAddr,
    kv: Option<kv_events::Bound>,
    shared: Arc<Shared>,
    kill: watch::Sender<bool>,
    server: JoinHandle<()>,
    engine: JoinHandle<()>,
}

/// Bind `cfg.host:cfg.port` (port 0 = ephemeral) and serve in tokio tasks.
pub async fn spawn(mut cfg: SimConfig) -> std::io::Result<SimHandle> {
    cfg.validate()
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    let capacity = cfg.num_blocks.saturating_mul(cfg.block_size);
    if cfg.max_model_len > capacity {
        tracing::warn!(
            max_model_len = cfg.max_model_len,
            capacity,
            "max_model_len exceeds the KV cache; capping it"
        );
        cfg.max_model_len = capacity;
    }
    let listener = TcpListener::bind((cfg.host.as_str(), cfg.port))
        .await
        .map_err(|e| {
            let at = format!("{}:{}", cfg.host, cfg.port);
            std::io::Error::new(e.kind(), format!("sim cannot listen on {at}: {e}"))
        })?;
    let addr = listener.local_addr()?;
    let params = engine::Params::from_config(&cfg);
    let stats = Arc::new(metrics::Stats {
        offload: cfg.cpu_offload_blocks > 0,
        ..metrics::Stats::new(cfg.num_blocks, cfg.block_size)
    });
    let (submit, rx) = mpsc::channel(1024);
    let mut eng = engine::Engine::new(params.clone(), rx, stats.clone());
    let mut kv = None;
    if let Some(k) = &cfg.kv_events {
        let k = kv_events::KvEventsConfig {
            block_size: cfg.block_size,
            ..k.clone()
        };
        let (bound, tx) = kv_events::start(k).await?;
        eng = eng.with_kv_events(tx);
        kv = Some(bound);
    }
    let engine = tokio::spawn(eng.run());
    let (faults, _) = watch::channel(cfg.faults.clone());
    let started = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let shared = Arc::new(Shared {
        params,
        stats,
        faults,
        submit,
        engine_id: uuid::Uuid::new_v4().to_string(),
        addr,
        arrivals: AtomicU64::new(0),
        started,
        responses: responses::Store::default(),
        audio_bytes: AtomicU64::new(0),
        aborts: abort::Registry::default(),
        cfg,
    });
    let (kill, _) = watch::channel(false);
    let server = tokio::spawn(serve(listener, shared.clone(), kill.subscribe()));
    Ok(SimHandle {
        addr,
        kv,
        shared,
        kill,
        server,
        engine,
    })
}

impl SimHandle {
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://HOST:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The bound KV-event endpoints (`tcp://IP:PORT`): publisher and replay.
    pub fn kv_endpoints(&self) -> Option<&kv_events::Bound> {
        self.kv.as_ref()
    }

    /// The configuration this engine runs with.
    pub fn config(&self) -> &SimConfig {
        &self.shared.cfg
    }

    /// Requests that reached a generation endpoint so far, faulted and invalid
    /// ones included (`sim_requests_received_total`).
    pub fn requests_received(&self) -> u64 {
        self.shared
            .stats
            .requests_received
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Replace the active faults (same as `POST /sim/faults`).
    /// `/abort_request` calls received (SGLang).
    pub fn aborts_received(&self) -> u64 {
        self.shared.aborts.calls()
    }

    /// Bytes of audio uploads received so far, counted as they arrive.
    pub fn audio_bytes_received(&self) -> u64 {
        self.shared
            .audio_bytes
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    pub fn set_faults(&self, f: Faults) {
        self.shared.faults.send_replace(f);
    }

    /// Stop accepting and abort every open connection and stream: a dead worker.
    pub fn kill(&self) {
        self.kill.send_replace(true);
        self.engine.abort();
    }

    /// Kill and wait for the tasks to end.
    pub async fn shutdown(mut self) {
        self.kill();
        let _ = (&mut self.server).await;
        let _ = (&mut self.engine).await;
    }
}

impl Drop for SimHandle {
    fn drop(&mut self) {
        self.kill.send_replace(true);
        self.engine.abort();
    }
}

/// Accept loop: honours `refuse_connections` by closing and rebinding the
/// listening socket, and `kill` by returning.
async fn serve(listener: TcpListener, shared: Arc<Shared>, mut kill: watch::Receiver<bool>) {
    let router = api::router(shared.clone());
    let mut faults = shared.faults.subscribe();
    let mut listener = Some(listener);
    loop {
        if *kill.borrow() {
            return;
        }
        let refuse = faults.borrow_and_update().refuse_connections;
        if refuse {
            listener = None;
        } else if listener.is_none() {
            match TcpListener::bind(shared.addr).await {
                Ok(l) => listener = Some(l),
                Err(e) => tracing::warn!(addr = %shared.addr, error = %e, "sim: cannot rebind"),
            }
        }
        match &listener {
            Some(l) => {
                tokio::select! {
                    r = l.accept() => match r {
                        Ok((stream, _)) => {
                            tokio::spawn(connection(stream, router.clone(), kill.clone()));
                        }
                        Err(e) => tracing::debug!(error = %e, "sim: accept failed"),
                    },
                    _ = faults.changed() => {}
                    _ = kill.changed() => {}
                }
            }
            None => {
                tokio::select! {
                    _ = faults.changed() => {}
                    _ = kill.changed() => {}
                    // Rebind failed: try again shortly.
                    _ = tokio::time::sleep(std::time::Duration::from_millis(100)), if !refuse => {}
                }
            }
        }
    }
}

async fn connection(stream: TcpStream, router: axum::Router, mut kill: watch::Receiver<bool>) {
    let _ = stream.set_nodelay(true);
    let ctl = ConnCtl(Arc::new(Notify::new()));
    let reset = ctl.0.clone();
    let svc = hyper::service::service_fn(move |mut req: http::Request<hyper::body::Incoming>| {
        req.extensions_mut().insert(ctl.clone());
        router.clone().oneshot(req.map(axum::body::Body::new))
    });
    let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    let conn = builder.serve_connection(TokioIo::new(stream), svc);
    tokio::select! {
        _ = conn => {}
        _ = reset.notified() => {}
        _ = kill.wait_for(|k| *k) => {}
    }
}
