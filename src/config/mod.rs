//! Configuration: a TOML file read into [`RawConfig`] (serde, unknown keys rejected),
//! then validated into the typed [`Config`] the rest of the gateway reads. Every
//! rejection names the key path, and one run reports them all: type errors and
//! unknown keys while reading (`read.rs`), then everything validation finds,
//! except what only follows from an earlier rejection (`problems.rs`). Validation
//! goes section by section, each section's types, defaults and validator in a
//! file of its own (`server.rs`, `health.rs`, `admin.rs`, `pools.rs`,
//! `routing.rs`, `discovery.rs`, `global.rs`, `observability.rs`, `tenancy.rs`,
//! …), and reads nothing outside the file; then `resolve.rs` reads what the file
//! points to: secrets from the environment (as [`Secret`]s, whose formatting
//! never shows them) and CA files. Key paths in messages are built with `key.rs`.
//! This file holds [`Config`], the order the sections are checked in
//! ([`RawConfig::validate`]) and loading; every item stays reachable as
//! `config::X`. Defaults live beside their section and nowhere else.

mod admin;
pub mod cert_validity;
mod discovery;
mod edge;
pub mod engine_routes;
pub mod flow;
pub mod global;
mod health;
mod key;
pub mod kv_events;
pub mod limits;
pub mod observability;
mod pools;
mod problems;
mod raw;
mod read;
mod resolve;
mod routing;
mod secret;
mod server;
pub mod tenancy;
mod warnings;
pub mod worker_url;

use admin::validate_admin;
pub use admin::AdminConfig;
pub use flow::{FairnessKey, FlowConfig, Preemption, Priority};
use health::validate_health;
pub use health::{
    HealthConfig, DEFAULT_BASE_EJECTION_MS, DEFAULT_EJECT_AFTER_FAILURES,
    DEFAULT_HEALTHY_THRESHOLD, DEFAULT_HEALTH_INTERVAL_MS, DEFAULT_HEALTH_PATH,
    DEFAULT_HEALTH_TIMEOUT_MS, DEFAULT_MAX_EJECTED_PERCENT, DEFAULT_MAX_EJECTION_MS,
    DEFAULT_OVERLOAD_COOLDOWN_MS, DEFAULT_UNHEALTHY_THRESHOLD,
};
pub use kv_events::{KvEndpoints, KvEventsConfig, TokenizerConfig};
use pools::{check_region_labels, validate_pools};
pub use pools::{
    AnthropicMode, DisaggConfig, DisaggMode, EngineKind, PoolConfig, WorkerConfig,
    DEFAULT_BOOTSTRAP_PORT, DEFAULT_MAX_ATTEMPTS, DEFAULT_MAX_PREFILL_RESPONSE_BYTES,
    DEFAULT_MIN_UNCACHED_TOKENS, DEFAULT_QUEUE_SIZE, DEFAULT_QUEUE_TIMEOUT_MS,
    DEFAULT_RETRY_BACKOFF_MS, DEFAULT_RETRY_BUDGET_MIN, DEFAULT_RETRY_BUDGET_RATIO,
};
use problems::Problems;
pub use problems::Secrets;
pub use routing::{
    PolicyKind, PrefixSource, RoutingConfig, ScorerName, SloUnattainable, DEFAULT_BLOCK_TOKENS,
    DEFAULT_BYTES_PER_TOKEN, DEFAULT_INDEX_MAX_BLOCKS, DEFAULT_LOAD_EPSILON, DEFAULT_LOAD_SLACK,
    DEFAULT_STALE_AFTER_MS, DEFAULT_STATS_INTERVAL_MS, DEFAULT_TARGET_QUEUE, DEFAULT_WORKER_BLOCKS,
    MIN_STATS_INTERVAL_MS,
};
pub use secret::Secret;
use server::validate_server;
pub use server::{
    default_max_connections, ServerConfig, Timeouts, DEFAULT_BODY_READ_TIMEOUT_MS,
    DEFAULT_CLIENT_IDLE_TIMEOUT_MS, DEFAULT_CONNECT_TIMEOUT_MS, DEFAULT_DRAIN_TIMEOUT_MS,
    DEFAULT_FIRST_BYTE_TIMEOUT_MS, DEFAULT_HEADER_READ_TIMEOUT_MS, DEFAULT_IDLE_TIMEOUT_MS,
    DEFAULT_LISTEN, DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_HEADERS, DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_MAX_JSON_DEPTH, DEFAULT_MODEL_DISCOVERY_MS, DEFAULT_TOTAL_TIMEOUT_MS, MAX_BUSY_POLL_US,
    MAX_MAX_JSON_DEPTH,
};
pub use worker_url::normalize_worker_url;

pub use raw::{
    RawAdmin, RawConfig, RawDisagg, RawDns, RawHealth, RawKubernetes, RawPool, RawRouting,
    RawScorer, RawServer, RawTimeouts, RawWorker,
};

pub use discovery::{DnsConfig, KubernetesConfig, DEFAULT_DNS_INTERVAL_MS};
pub use edge::{
    chain_not_after, load_certified_key, load_client_roots, Cidr, CorsConfig, RawCors, RawTls,
    TlsConfig,
};
pub use global::{
    GlobalConfig, LocalityConfig, RegionConfig, RegionId, RegionSet, Residency, SplitConfig,
};
pub use observability::ObservabilityConfig;
pub use tenancy::TenancyConfig;
pub use warnings::{glob, open_warnings};

use std::fmt;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

/// Label value standing for every value beyond a label's configured limit.
pub const OTHER_LABEL: &str = "other";

/// The validated configuration.
#[derive(Clone, Debug)]
pub struct Config {
    pub server: ServerConfig,
    pub pools: Vec<PoolConfig>,
    pub health: HealthConfig,
    pub admin: Option<AdminConfig>,
    pub observability: ObservabilityConfig,
    pub tenancy: TenancyConfig,
    /// Regions, locality, residency and weighted splits.
    pub global: GlobalConfig,
}

/// Every problem found in a configuration, each naming its key path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub problems: Vec<String>,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid configuration:")?;
        for p in &self.problems {
            write!(f, "\n  - {p}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigError {}

impl ConfigError {
    fn one(p: impl Into<String>) -> Self {
        ConfigError {
            problems: vec![p.into()],
        }
    }
}

/// A validated configuration and the notes of the check (unset secrets when
/// they are optional).
#[derive(Debug)]
pub struct Checked {
    pub config: Config,
    pub notes: Vec<String>,
}

/// A raw configuration as read, with the problems found while reading it: flags
/// can still be applied to `raw` before [`Parsed::validate`] reports everything.
#[derive(Debug)]
pub struct Parsed {
    pub raw: RawConfig,
    problems: Problems,
}

impl From<RawConfig> for Parsed {
    fn from(raw: RawConfig) -> Self {
        Parsed {
            raw,
            problems: Problems::default(),
        }
    }
}

impl Parsed {
    /// Add the problems a higher layer finds in the raw config (e.g. scorer
    /// names routing does not know), so they are reported with all the others.
    pub fn check_with(mut self, check: impl FnOnce(&RawConfig) -> Vec<String>) -> Parsed {
        for problem in check(&self.raw) {
            self.problems.push(problem);
        }
        self
    }

    /// Validate, reporting the reading problems and the validation problems
    /// together (a TOML syntax error alone ends the check).
    pub fn validate(self, secrets: Secrets) -> Result<Checked, ConfigError> {
        let mut problems = self.problems;
        if problems.is_unreadable() {
            return Err(problems.error().expect("a syntax error is a problem"));
        }
        problems.secrets = secrets;
        let config = self.raw.validate_with(&mut problems)?;
        Ok(Checked {
            config,
            notes: problems.into_notes(),
        })
    }
}

/// Read TOML text into a raw config, noting every syntax error (the first ends
/// the reading), unknown key and wrongly typed value.
pub fn read(text: &str) -> Parsed {
    let mut problems = Problems::default();
    let raw = read::read(text, &mut problems);
    Parsed { raw, problems }
}

/// Parse TOML text into a raw config; unknown keys and type errors are errors
/// (all of them are reported).
pub fn parse(text: &str) -> Result<RawConfig, ConfigError> {
    let parsed = read(text);
    match parsed.problems.error() {
        Some(e) => Err(e),
        None => Ok(parsed.raw),
    }
}

/// The first pool of a config given as TOML text, validated (for tests and
/// benchmarks that build one pool's policy or route).
pub fn first_pool(text: &str) -> Result<PoolConfig, ConfigError> {
    let mut config = parse(text)?.validate()?;
    if config.pools.is_empty() {
        return Err(ConfigError::one("no [[pools]]"));
    }
    Ok(config.pools.remove(0))
}

/// Read a file into a raw config (see [`read`]).
pub fn read_file(path: &Path) -> Result<Parsed, ConfigError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| ConfigError::one(format!("{}: {e}", path.display())))?;
    Ok(read(&text))
}

/// Read and validate a config file, reporting every problem at once.
pub fn check_file(path: &Path, secrets: Secrets) -> Result<Checked, ConfigError> {
    read_file(path)?.validate(secrets)
}

/// Read, parse and validate a config file; the secrets must be set.
pub fn load(path: &Path) -> Result<Config, ConfigError> {
    check_file(path, Secrets::Required).map(|c| c.config)
}

impl RawConfig {
    /// Check every field, collecting all problems; the secrets must be set.
    pub fn validate(self) -> Result<Config, ConfigError> {
        Parsed::from(self)
            .validate(Secrets::Required)
            .map(|c| c.config)
    }

    /// Check every field, adding to `problems` (which may hold problems from
    /// reading, and says whether secrets are required). Sections are checked in
    /// file order of their problems: server, health, admin, pools, the global
    /// sections, then observability and tenancy.
    fn validate_with(self, problems: &mut Problems) -> Result<Config, ConfigError> {
        let mut server = self.server;
        let server_region = server.region.take();
        let id_key_env = server.id_key_env.take();
        let mut server = validate_server(server, problems);
        let health = validate_health(self.health, problems);
        let admin = validate_admin(self.admin, problems);
        let own: Vec<SocketAddr> = std::iter::once(server.listen)
            .chain(admin.as_ref().and_then(|a| a.listen))
            .filter(|a| a.port() != 0)
            .collect();
        let rules = worker_url::AddressRules {
            allow_link_local: server.allow_link_local_workers,
            allow_admin_loopback: false,
            own: &own,
        };
        let pools = validate_pools(self.pools, &rules, problems);
        let pool_names: Vec<&str> = pools.pools.iter().map(|p| p.name.as_str()).collect();
        let global = global::validate(
            global::GlobalRaw {
                server_region,
                regions: self.regions,
                residency: self.residency,
                locality: self.locality,
                splits: self.splits,
                pools: &pool_names,
                models: &pools.models,
            },
            problems,
        );
        check_region_labels(&pools, &global, problems);
        let observability = observability::validate(
            observability::ObservabilityRaw {
                telemetry: self.telemetry,
                access_log: self.access_log,
                tracing: self.tracing,
                prices: self.prices,
                scaling: self.scaling,
            },
            &pool_names,
            problems,
        );
        let tenancy = tenancy::validate(self.tenancy, self.tenants, &global, problems);
        // The environment and the file system, once the file itself is checked.
        let admin = resolve::admin(admin, problems);
        server.id_key = resolve::id_key(id_key_env, problems);
        resolve::tls("server.tls", server.tls.as_ref(), problems);
        if let Some(a) = &admin {
            resolve::tls("admin.tls", a.tls.as_ref(), problems);
        }
        let mut pools = pools;
        resolve::pools(&mut pools.pools, &pools.upstream_api_key_envs, problems);
        let mut tenancy = resolve::tenancy(tenancy, problems);
        tenancy.limits = limits::validate_config(self.limits, problems);
        if let Some(e) = problems.error() {
            return Err(e);
        }
        Ok(Config {
            server,
            pools: pools.pools,
            health,
            admin,
            observability,
            tenancy,
            global,
        })
    }
}

/// "no pool named `name` (pools: a, b)", for a reference to a pool.
fn no_pool(name: &str, pools: &[&str]) -> String {
    format!("no pool named `{name}` (pools: {})", pools.join(", "))
}

/// A positive millisecond duration, or a problem naming `key`.
fn ms(problems: &mut Problems, key: &str, v: Option<u64>, default: u64) -> Duration {
    let v = v.unwrap_or(default);
    if v == 0 {
        problems.push(format!("{key}: must be greater than 0"));
    }
    Duration::from_millis(v.max(1))
}

#[cfg(test)]
mod tests;
