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
    /// Name of the environment variable holding the upstream bearer token.
    pub upstream_api_key_env: Option<String>,
    #[serde(default)]
    pub workers: Vec<RawWorker>,
    /// `[pools.routing]`: settings of the routing policy and the stats poller.
    #[serde(default)]
    pub routing: RawRouting,
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
pub struct RawWorker {
    pub url: String,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Price of this worker's tokens, USD per 1M tokens (prompt + output); the `cost`
    /// policy prefers cheaper workers. Default 0.
    pub price_per_mtok: Option<f64>,
}
