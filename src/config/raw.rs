//! The TOML schema as written by users: every field optional, unknown keys rejected.
//! Units are in the field names (`_ms`, `_bytes`); defaults are in `config/mod.rs`.

use serde::Deserialize;
use std::collections::BTreeMap;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    #[serde(default)]
    pub server: RawServer,
    #[serde(default)]
    pub pools: Vec<RawPool>,
    #[serde(default)]
    pub health: RawHealth,
    #[serde(default)]
    pub admin: RawAdmin,
    // Observability, tenancy and cost (validated in `config/observability.rs`).
    #[serde(default)]
    pub telemetry: super::observability::RawTelemetry,
    #[serde(default)]
    pub access_log: super::observability::RawAccessLog,
    #[serde(default)]
    pub tracing: super::observability::RawTracing,
    #[serde(default)]
    pub prices: Vec<super::observability::RawPrice>,
    #[serde(default)]
    pub scaling: super::observability::RawScaling,
    #[serde(default)]
    pub tenancy: super::tenancy::RawTenancy,
    #[serde(default)]
    pub tenants: Vec<super::tenancy::RawTenant>,
    /// `[limits]`: where tenant limit state lives (`config/limits.rs`).
    #[serde(default)]
    pub limits: super::limits::RawLimitsStore,
    // Global routing (validated in `config/global.rs`).
    /// `[regions.NAME]`: declared regions, their spill order and round-trip times.
    #[serde(default)]
    pub regions: BTreeMap<String, super::global::RawRegion>,
    /// `[residency]`: zone name → regions.
    #[serde(default)]
    pub residency: BTreeMap<String, Vec<String>>,
    #[serde(default)]
    pub locality: super::global::RawLocality,
    #[serde(default)]
    pub splits: Vec<super::global::RawSplit>,
}

/// Active health checks and passive ejection, for every pool.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawHealth {
    /// Probe each worker's health path this often (ms, jittered ±10 %). 0 disables probes.
    pub interval_ms: Option<u64>,
    pub timeout_ms: Option<u64>,
    pub path: Option<String>,
    /// Consecutive failed probes before a worker is ejected.
    pub unhealthy_threshold: Option<u32>,
    /// Consecutive successful probes before an ejected worker is re-admitted.
    pub healthy_threshold: Option<u32>,
    /// Consecutive failed requests (connect errors, resets, timeouts, 5xx) before ejection.
    pub eject_after_failures: Option<u32>,
    /// First ejection lasts this long (ms); each further one doubles it.
    pub base_ejection_ms: Option<u64>,
    pub max_ejection_ms: Option<u64>,
    /// Never eject more than this share of a pool at once (0–100).
    pub max_ejected_percent: Option<u8>,
    /// A worker answering 429 gets no new requests for this long (ms).
    pub overload_cooldown_ms: Option<u64>,
}

/// The admin API listener.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawAdmin {
    /// `host:port`; the admin API is off when unset.
    pub listen: Option<String>,
    /// Environment variable holding the bearer token (required when `listen` is set).
    pub token_env: Option<String>,
    /// Serve the admin API over TLS (optionally requiring client certificates).
    pub tls: Option<super::edge::RawTls>,
    /// `POST /admin/workers` may add loopback workers (default false).
    pub allow_loopback_workers: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawServer {
    /// `host:port` of the OpenAI-compatible listener.
    pub listen: Option<String>,
    /// Largest accepted request body, in bytes.
    pub max_body_bytes: Option<usize>,
    #[serde(default)]
    pub timeouts: RawTimeouts,
    /// Expose routing decisions in response headers.
    pub debug_headers: Option<bool>,
    /// How often discovered pools re-read `/v1/models` (ms).
    pub model_discovery_ms: Option<u64>,
    /// Most client connections open at once.
    pub max_connections: Option<usize>,
    /// Time a client has to send complete request headers (ms): from accept for
    /// the first request, and on HTTP/1.1 from the end of the previous response.
    pub header_read_timeout_ms: Option<u64>,
    /// Time a client has to send the whole request body once its headers are in (ms).
    pub body_read_timeout_ms: Option<u64>,
    /// A connection on which no request starts for this long is closed (ms).
    pub idle_timeout_ms: Option<u64>,
    /// Most request headers accepted (count); more is answered 431.
    pub max_headers: Option<usize>,
    /// Largest request header section accepted (bytes, all names and values); more is answered 431.
    pub max_header_bytes: Option<usize>,
    /// How long in-flight requests may finish after SIGTERM (ms).
    pub drain_timeout_ms: Option<u64>,
    /// After SIGTERM, keep serving with `/ready` false this long before the
    /// listener closes, so load balancers stop sending first (ms).
    pub unready_grace_ms: Option<u64>,
    /// Reload the config file when it changes on disk.
    pub watch_config: Option<bool>,
    /// Serving threads (one runtime and listener each); 0 or unset: one per CPU.
    pub threads: Option<usize>,
    /// Busy-poll window of each serving thread (µs); 0 or unset: off.
    pub busy_poll_us: Option<u64>,
    /// This gateway's region (one of `[regions]`); turns on locality routing.
    pub region: Option<String>,
    /// Deepest JSON nesting (arrays and objects) accepted in a request body.
    pub max_json_depth: Option<usize>,
    /// Terminate TLS on the client listener.
    pub tls: Option<super::edge::RawTls>,
    /// Answer browsers' CORS preflights and tag responses for allowed origins.
    pub cors: Option<super::edge::RawCors>,
    /// Environment variable holding the key that signs Responses ids.
    pub id_key_env: Option<String>,
    /// Accept link-local and cloud-metadata worker addresses (default false).
    pub allow_link_local_workers: Option<bool>,
    /// Addresses or CIDR blocks of proxies whose `x-forwarded-for` names the client.
    #[serde(default)]
    pub trusted_proxies: Vec<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTimeouts {
    pub connect_ms: Option<u64>,
    pub first_byte_ms: Option<u64>,
    pub idle_ms: Option<u64>,
    pub total_ms: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawPool {
    pub name: Option<String>,
    #[serde(default)]
    pub models: Vec<String>,
    #[serde(default)]
    pub aliases: Vec<String>,
    pub policy: Option<String>,
    pub max_attempts: Option<u32>,
    pub pass_client_auth: Option<bool>,
    /// Client headers the gateway keeps by default (cookies, its own
    /// `x-switchyard-*`, credentials) to forward to this pool anyway.
    #[serde(default)]
    pub forward_headers: Vec<String>,
    /// Name of the environment variable holding the upstream bearer token.
    pub upstream_api_key_env: Option<String>,
    #[serde(default)]
    pub workers: Vec<RawWorker>,
    /// Retries allowed as a share of recent requests (0.0–1.0).
    pub retry_budget_ratio: Option<f64>,
    /// Retries always allowed on top of the ratio (a reserve for low traffic).
    pub retry_budget_min: Option<u32>,
    /// Base of the jittered backoff before a retry (ms).
    pub retry_backoff_ms: Option<u64>,
    /// Requests in flight per worker before new ones queue (0 = unlimited).
    pub max_concurrency_per_worker: Option<u64>,
    /// Requests that may wait for a free worker; beyond it, 429.
    pub queue_size: Option<usize>,
    /// Longest wait in the queue (ms); then 429.
    pub queue_timeout_ms: Option<u64>,
    /// `[pools.flow_control]`: saturation, queue bounds, priorities, fairness.
    pub flow_control: Option<super::flow::RawFlowControl>,
    /// Workers from DNS: every address of `name` becomes `http://ADDR:port`.
    pub dns: Option<RawDns>,
    /// Prefill/decode disaggregation (workers labelled `role = prefill|decode|both`).
    pub disaggregation: Option<RawDisagg>,
    /// Send this model name upstream instead of the client's (external providers).
    pub upstream_model: Option<String>,
    /// How Anthropic Messages requests reach the workers: `passthrough` or `translate`.
    pub anthropic: Option<String>,
    /// Extra CA certificates (PEM file) trusted for this pool's `https://` workers.
    pub upstream_ca_file: Option<String>,
    /// Pools tried in order when this one cannot take or complete the request.
    #[serde(default)]
    pub fallback: Vec<String>,
    /// LoRA adapter names served by this pool's workers; forwarded unchanged.
    #[serde(default)]
    pub lora_adapters: Vec<String>,
    /// The engine the workers run: `vllm` (default) or `sglang` (a client that
    /// leaves gets its request aborted with `POST /abort_request`).
    pub engine: Option<String>,
    /// Ask the engines for usage on every streamed request (`stream_options.
    /// include_usage`), stripping it from streams whose client did not ask; default true.
    pub request_usage: Option<bool>,
    /// Workers from Kubernetes: Ready pods matching a label selector in a namespace.
    pub kubernetes: Option<RawKubernetes>,
    /// `[pools.routing]`: settings of the routing policy and the stats poller.
    #[serde(default)]
    pub routing: RawRouting,
    /// How prompts are tokenized for the precise (KV-event) index: `"sim"`.
    pub tokenizer: Option<super::kv_events::RawTokenizer>,
    /// `[pools.kv_events]`: the engines' KV-cache event streams.
    pub kv_events: Option<super::kv_events::RawKvEvents>,
    /// Extra inference paths (beyond the built-in OpenAI/Anthropic/vLLM ones)
    /// forwarded to this pool for any caller.
    #[serde(default)]
    pub forward_routes: Vec<String>,
    /// Engine control paths (`/v1/load_lora_adapter`, `/reset_prefix_cache`, …)
    /// forwarded to this pool for admin tenants only.
    #[serde(default)]
    pub allow_control_routes: Vec<String>,
}

/// `[pools.routing]`. Units in the names; defaults and meaning in `config/mod.rs`
/// and `docs/routing.md`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRouting {
    pub block_tokens: Option<u32>,
    pub bytes_per_token: Option<u32>,
    pub load_epsilon: Option<f64>,
    pub load_slack: Option<f64>,
    pub stats_interval_ms: Option<u64>,
    pub stale_after_ms: Option<u64>,
    pub allow_policy_override: Option<bool>,
    pub power_of_two: Option<bool>,
    pub target_queue: Option<f64>,
    pub index_max_blocks: Option<u64>,
    pub default_worker_blocks: Option<u64>,
    #[serde(default)]
    pub require_labels: BTreeMap<String, String>,
    pub scorers: Option<Vec<RawScorer>>,
    /// Regions whose round trip from the gateway's region is within this budget
    /// (ms) count as local for this pool (cost-aware placement across regions).
    pub max_added_latency_ms: Option<u32>,
    /// What to do with a request whose latency objective no worker is predicted
    /// to meet: `downgrade` (serve it on the best worker, marked) or `shed`.
    pub slo_unattainable: Option<String>,
    /// `auto` (default), `precise` or `approximate`.
    pub index: Option<String>,
}

/// One entry of `[pools.routing].scorers`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawScorer {
    pub name: String,
    pub weight: f64,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawDisagg {
    /// `vllm` (sequential, NIXL `kv_transfer_params`) or `sglang` (concurrent, bootstrap).
    pub mode: String,
    /// Below this many uncached prompt tokens the decode worker does everything.
    pub min_uncached_tokens: Option<u64>,
    /// SGLang bootstrap port of prefill workers without a `bootstrap_port` label.
    pub bootstrap_port: Option<u16>,
    /// Largest prefill answer read (bytes).
    pub max_prefill_response_bytes: Option<usize>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawDns {
    pub name: String,
    pub port: u16,
    /// Re-resolve this often (ms).
    pub interval_ms: Option<u64>,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

/// Kubernetes discovery: every Ready pod with an IP becomes `http://POD_IP:PORT`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawKubernetes {
    pub namespace: String,
    /// Kubernetes label selector, e.g. `app=vllm,tier!=canary`; all pods when unset.
    pub label_selector: Option<String>,
    /// Port of the engine on every pod (used when the annotation is absent).
    pub port: Option<u16>,
    /// Pod annotation holding the port, e.g. `switchyard.io/port`; wins over `port`.
    pub port_annotation: Option<String>,
    /// Pod label → worker label, e.g. `"topology.kubernetes.io/region" = "region"`.
    #[serde(default)]
    pub label_map: BTreeMap<String, String>,
    /// API server URL (tests, out-of-cluster); default: in-cluster or kubeconfig.
    pub api_url: Option<String>,
    /// Name of a Gateway API Inference Extension `InferencePool` in `namespace`:
    /// its selector and target port replace `label_selector` and `port`.
    pub inference_pool: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawWorker {
    pub url: String,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Price of this worker's tokens, USD per 1M tokens (prompt + output); the `cost`
    /// policy prefers cheaper workers. Default 0.
    pub price_per_mtok: Option<f64>,
    /// The engine's KV-event publisher (ZeroMQ PUB), e.g. `tcp://host:5557`.
    pub kv_events: Option<String>,
    /// The engine's KV-event replay endpoint (ZeroMQ ROUTER), e.g. `tcp://host:5558`.
    pub kv_replay: Option<String>,
}
