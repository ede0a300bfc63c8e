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
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawWorker {
    pub url: String,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}
