//! Configuration: a TOML file read into [`RawConfig`] (serde, unknown keys rejected),
//! then validated into the typed [`Config`] the rest of the gateway reads. Every
//! rejection names the key path, and one run reports them all: type errors and
//! unknown keys while reading (`read.rs`), then everything validation finds,
//! except what only follows from an earlier rejection (`problems.rs`). Validation
//! goes section by section (`validate_server`, `validate_pools`, `global.rs`,
//! `observability.rs`) and reads nothing outside the file; then `resolve.rs` reads
//! what the file points to: secrets from the environment (as [`Secret`]s, whose
//! formatting never shows them) and CA files. Key paths in messages are built with
//! `key.rs`. Defaults live here and nowhere else.

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
mod tests {
    use super::*;

    pub(super) fn check(text: &str) -> Result<Config, ConfigError> {
        parse(text)?.validate()
    }

    pub(super) const ONE_POOL: &str =
        "[[pools]]\nmodels = [\"m\"]\nworkers = [{ url = \"http://127.0.0.1:9000\" }]\n";

    #[test]
    fn debug_of_a_config_shows_no_secret() {
        let vars = [
            (
                "SWITCHYARD_TEST_DEBUG_ADMIN_TOKEN",
                "adm-3f9c1a7e52b04d6e8a1f",
            ),
            ("SWITCHYARD_TEST_DEBUG_TENANT_KEY", "sk-tenant-8a1f3f9c1a7e"),
            ("SWITCHYARD_TEST_DEBUG_UPSTREAM_KEY", "sk-upstream-52b04d6e"),
        ];
        for (var, value) in vars {
            std::env::set_var(var, value);
        }
        let c = check(
            r#"
            [admin]
            listen = "127.0.0.1:9001"
            token_env = "SWITCHYARD_TEST_DEBUG_ADMIN_TOKEN"
            [[tenants]]
            name = "acme"
            api_key_env = "SWITCHYARD_TEST_DEBUG_TENANT_KEY"
            [[pools]]
            models = ["m"]
            upstream_api_key_env = "SWITCHYARD_TEST_DEBUG_UPSTREAM_KEY"
            workers = [{ url = "http://h:1" }]
            "#,
        )
        .unwrap();
        assert_eq!(c.admin.as_ref().unwrap().token.expose(), vars[0].1);
        assert_eq!(
            c.tenancy.tenants[0].api_key.as_ref().unwrap().expose(),
            vars[1].1
        );
        let upstream = c.pools[0].upstream_api_key.as_ref().unwrap();
        assert_eq!(upstream.expose(), vars[2].1);
        for shown in [
            format!("{c:?}"),
            format!("{c:#?}"),
            format!("{:?}", c.tenancy.tenants),
        ] {
            for (_, value) in vars {
                assert!(!shown.contains(value), "`{value}` shown in {shown}");
            }
        }
        let admin = format!("{:?}", c.admin);
        assert!(admin.contains("token: ***"), "{admin}");
        let pool = format!("{:?}", c.pools[0]);
        assert!(pool.contains("upstream_api_key: Some(***)"), "{pool}");
    }

    #[test]
    fn secrets_and_files_are_read_after_the_file_is_checked() {
        let e = check(
            r#"
            [admin]
            listen = "127.0.0.1:9001"
            token_env = "SWITCHYARD_TEST_RESOLVE_UNSET_TOKEN"
            [[pools]]
            models = ["m"]
            upstream_ca_file = "/nonexistent/switchyard-test-ca.pem"
            workers = [{ url = "ftp://h:1" }]
            "#,
        )
        .unwrap_err();
        let keys: Vec<&str> = e
            .problems
            .iter()
            .map(|p| p.split_once(": ").unwrap().0)
            .collect();
        assert_eq!(
            keys,
            [
                "pools[0].workers[0].url",
                "admin.token_env",
                "pools[0].upstream_ca_file"
            ],
            "{e}"
        );
    }

    #[test]
    fn unknown_key_is_named() {
        let e = check("[server]\nlisten = \"127.0.0.1:1\"\nlisen = 3\n").unwrap_err();
        assert!(e.to_string().contains("lisen"), "{e}");
    }

    #[test]
    fn every_problem_is_reported_with_its_path() {
        let e = check(
            r#"
            [server]
            listen = "nope"
            [server.timeouts]
            connect_ms = 0
            [[pools]]
            name = "a"
            policy = "fastest"
            models = ["m"]
            workers = [{ url = "ftp://x" }]
            [[pools]]
            name = "a"
            models = ["m"]
            workers = []
            "#,
        )
        .unwrap_err();
        let all = e.to_string();
        for needle in [
            "server.listen",
            "server.timeouts.connect_ms",
            "pools[0].policy: unknown policy `fastest`",
            "pools[0].workers[0].url",
            "pools[1].name: duplicate",
            "served by more than one pool",
            "pools[1].workers: a pool needs at least one worker",
        ] {
            assert!(all.contains(needle), "missing `{needle}` in:\n{all}");
        }
    }

    /// Read and validate like `check-config`: reading and validation problems together.
    pub(super) fn check_all(text: &str, secrets: Secrets) -> Result<Checked, ConfigError> {
        read(text).validate(secrets)
    }

    pub(super) const POOL: &str =
        "[[pools]]\nname = \"p\"\nmodels = [\"m\"]\nworkers = [{ url = \"http://127.0.0.1:9000\" }]\n";

    #[test]
    fn type_errors_unknown_keys_and_bad_values_are_reported_together() {
        let e = check_all(
            r#"
            [server]
            max_connections = "many"
            [health]
            intervl_ms = 5
            [[pools]]
            models = ["m"]
            policy = "fastest"
            workers = [{ url = "http://h:1" }]
            "#,
            Secrets::Required,
        )
        .unwrap_err();
        assert_eq!(
            e.problems,
            [
                "health.intervl_ms: unknown key (did you mean `interval_ms`?), expected one of `interval_ms`, `timeout_ms`, `path`, `unhealthy_threshold`, `healthy_threshold`, `eject_after_failures`, `base_ejection_ms`, `max_ejection_ms`, `max_ejected_percent`, `overload_cooldown_ms`",
                "server.max_connections: invalid type: string \"many\", expected a non-negative integer",
                "pools[0].policy: unknown policy `fastest` (expected one of: round_robin, random, least_queue, prefix, cost, session, weighted, slo)",
            ]
        );
    }

    #[test]
    fn a_syntax_error_is_reported_alone() {
        let e = check_all("[server\nlisten = 1\n", Secrets::Required).unwrap_err();
        assert_eq!(e.problems.len(), 1, "{e}");
        assert!(e.problems[0].contains("line 1"), "{e}");
    }

    #[test]
    fn consequences_of_a_rejection_are_not_reported() {
        let e = check_all(
            r#"
            [[pools]]
            name = "a"
            models = ["a"]
            policy = "weigthed"
            workers = [{ url = "ftp://h:1" }]
            [pools.routing]
            scorers = [{ name = "queue", weight = 1.0 }]
            [[pools]]
            name = "b"
            models = ["b"]
            workers = [{ urll = "http://h:2" }]
            [[pools]]
            name = "c"
            models = 3
            aliases = ["c-alias"]
            workers = ["http://h:3"]
            [[pools]]
            name = "d"
            models = ["d"]
            workers = "http://h:4"
            "#,
            Secrets::Required,
        )
        .unwrap_err();
        let starts: Vec<&str> = e
            .problems
            .iter()
            .map(|p| p.split_once(": ").unwrap().0)
            .collect();
        assert_eq!(
            starts,
            [
                "pools[1].workers[0].urll",
                "pools[2].models",
                "pools[2].workers[0]",
                "pools[3].workers",
                "pools[0].policy",
                "pools[0].workers[0].url",
            ],
            "{e}"
        );
    }

    #[test]
    fn a_mistyped_section_hides_nothing_else_and_adds_nothing() {
        // `[pools]` where `[[pools]]` was meant: no "at least one pool", and
        // references to pools are not reported again.
        let e = check_all(
            "[pools]\nname = \"p\"\n[scaling.pools.p]\nmax_replicas = 2\n[[splits]]\nmodel = \"s\"\ntargets = [{ pool = \"p\", weight = 1 }]\n[health]\ntimeout_ms = 0\n",
            Secrets::Required,
        )
        .unwrap_err();
        assert_eq!(
            e.problems,
            [
                "pools: invalid type: map, expected an array",
                "health.timeout_ms: must be greater than 0"
            ]
        );
    }

    #[test]
    fn the_responses_id_key_is_read_checked_and_noted_when_absent() {
        let with = |var: &str| format!("[server]\nid_key_env = \"{var}\"\n{ONE_POOL}");
        let c = check_all(ONE_POOL, Secrets::Required).unwrap();
        assert!(c.config.server.id_key.is_none());
        assert!(
            c.notes
                .iter()
                .any(|n| n.starts_with("server.id_key_env: not set")),
            "{:?}",
            c.notes
        );
        std::env::set_var("SWITCHYARD_TEST_SHORT_ID_KEY", "0123abcd");
        let e = check_all(&with("SWITCHYARD_TEST_SHORT_ID_KEY"), Secrets::Required)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(
                "server.id_key_env: the key in `SWITCHYARD_TEST_SHORT_ID_KEY` must be at least 32"
            ),
            "{e}"
        );
        let e = check_all(&with("SWITCHYARD_TEST_UNSET_ID_KEY"), Secrets::Required)
            .unwrap_err()
            .to_string();
        assert!(e.contains("server.id_key_env: environment variable"), "{e}");
        let key = "5e0f1d2c3b4a69788796a5b4c3d2e1f0";
        std::env::set_var("SWITCHYARD_TEST_GOOD_ID_KEY", key);
        let c = check_all(&with("SWITCHYARD_TEST_GOOD_ID_KEY"), Secrets::Required).unwrap();
        assert_eq!(
            c.config.server.id_key.as_ref().map(Secret::expose),
            Some(key)
        );
        assert!(!format!("{:?}", c.config).contains(key), "Debug redacts it");
        assert!(c.notes.iter().all(|n| !n.contains("id_key")));
    }

    #[test]
    fn unset_secrets_are_notes_when_optional() {
        let text = r#"
            [admin]
            listen = "127.0.0.1:9001"
            token_env = "SWITCHYARD_TEST_UNSET_ADMIN_TOKEN"
            [[tenants]]
            name = "acme"
            api_key_env = "SWITCHYARD_TEST_UNSET_TENANT_KEY"
            [[pools]]
            models = ["m"]
            upstream_api_key_env = "SWITCHYARD_TEST_UNSET_UPSTREAM_KEY"
            workers = [{ url = "http://h:1" }]
            "#;
        let vars = [
            "SWITCHYARD_TEST_UNSET_ADMIN_TOKEN",
            "SWITCHYARD_TEST_UNSET_TENANT_KEY",
            "SWITCHYARD_TEST_UNSET_UPSTREAM_KEY",
        ];
        let e = check_all(text, Secrets::Required).unwrap_err();
        let c = check_all(text, Secrets::Optional).unwrap();
        for v in vars {
            assert!(e.problems.iter().any(|p| p.contains(v)), "{v} in {e}");
            assert!(
                c.notes.iter().any(|n| n.contains(v)),
                "{v} in {:?}",
                c.notes
            );
        }
        assert!(c.config.pools[0].upstream_api_key.is_none());
        // Set values are still checked, and the rest of the file too.
        std::env::set_var("SWITCHYARD_TEST_SHORT_ADMIN_TOKEN", "short");
        let e = check_all(
            &text
                .replace("UNSET_ADMIN", "SHORT_ADMIN")
                .replace("name = \"acme\"", "name = \"acme\"\nresidency = \"mars\""),
            Secrets::Optional,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("admin.token_env: the token in `SWITCHYARD_TEST_SHORT_ADMIN_TOKEN` must be at least 16"), "{e}");
        assert!(e.contains("tenants[0].residency: `mars`"), "{e}");
    }

    #[test]
    fn missing_api_key_env_is_an_error() {
        let e = check(
            r#"
            [[pools]]
            models = ["m"]
            upstream_api_key_env = "SWITCHYARD_TEST_SURELY_UNSET_VAR"
            workers = [{ url = "http://h:1" }]
            "#,
        )
        .unwrap_err();
        assert!(e.to_string().contains("pools[0].upstream_api_key_env"));
    }
}
