//! Configuration: a TOML file read into [`RawConfig`] (serde, unknown keys rejected),
//! then validated into the typed [`Config`] the rest of the gateway reads. Every
//! rejection names the key path. Defaults live here and nowhere else.

mod raw;

pub use raw::{RawConfig, RawPool, RawServer, RawTimeouts, RawWorker};

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

/// Default listen address for the OpenAI-compatible listener.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8080";
/// Default limit on a request body (bytes).
pub const DEFAULT_MAX_BODY_BYTES: usize = 8 * 1024 * 1024;
/// Default upstream connect timeout (ms).
pub const DEFAULT_CONNECT_TIMEOUT_MS: u64 = 2_000;
/// Default limit for the upstream's response headers to arrive (ms).
pub const DEFAULT_FIRST_BYTE_TIMEOUT_MS: u64 = 60_000;
/// Default limit on the gap between two body chunks of a response (ms).
pub const DEFAULT_IDLE_TIMEOUT_MS: u64 = 60_000;
/// Default limit on a whole request, streaming included (ms).
pub const DEFAULT_TOTAL_TIMEOUT_MS: u64 = 600_000;
/// Default number of attempts (first try included) before the gateway gives up.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 3;
/// Default interval between re-reads of each worker's `/v1/models` for discovered pools (ms).
pub const DEFAULT_MODEL_DISCOVERY_MS: u64 = 5_000;

/// Routing policies a pool can name. Their behaviour lives in `routing/`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PolicyKind {
    RoundRobin,
    Random,
}

impl PolicyKind {
    pub const ALL: &'static [PolicyKind] = &[PolicyKind::RoundRobin, PolicyKind::Random];

    pub fn as_str(self) -> &'static str {
        match self {
            PolicyKind::RoundRobin => "round_robin",
            PolicyKind::Random => "random",
        }
    }

    pub fn parse(s: &str) -> Option<PolicyKind> {
        Self::ALL.iter().copied().find(|p| p.as_str() == s)
    }

    fn names() -> String {
        Self::ALL
            .iter()
            .map(|p| p.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The validated configuration.
#[derive(Clone, Debug)]
pub struct Config {
    pub server: ServerConfig,
    pub pools: Vec<PoolConfig>,
}

#[derive(Clone, Debug)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    pub max_body_bytes: usize,
    pub timeouts: Timeouts,
    /// Add `x-switchyard-route` / `x-switchyard-worker` headers to responses.
    pub debug_headers: bool,
    /// Interval between `/v1/models` reads for pools whose models are discovered.
    pub model_discovery_interval: Duration,
}

/// Upstream timeouts.
#[derive(Clone, Copy, Debug)]
pub struct Timeouts {
    pub connect: Duration,
    pub first_byte: Duration,
    pub idle: Duration,
    pub total: Duration,
}

#[derive(Clone, Debug)]
pub struct PoolConfig {
    pub name: String,
    /// Model names served. Empty: discovered from the workers' `/v1/models`.
    pub models: Vec<String>,
    /// Extra names clients may use for this pool's first model.
    pub aliases: Vec<String>,
    pub policy: PolicyKind,
    pub max_attempts: u32,
    /// Forward the client's `Authorization` header upstream.
    pub pass_client_auth: bool,
    /// Bearer token injected upstream (value resolved from the named env var).
    pub upstream_api_key: Option<String>,
    pub workers: Vec<WorkerConfig>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerConfig {
    /// Normalised base URL, no trailing slash: `http://host:port[/prefix]`.
    pub url: String,
    pub labels: BTreeMap<String, String>,
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

/// Parse TOML text into a raw config; unknown keys are errors.
pub fn parse(text: &str) -> Result<RawConfig, ConfigError> {
    toml::from_str(text).map_err(|e| ConfigError::one(e.to_string().trim().to_string()))
}

/// Read, parse and validate a config file.
pub fn load(path: &Path) -> Result<Config, ConfigError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| ConfigError::one(format!("{}: {e}", path.display())))?;
    parse(&text)?.validate()
}

/// Normalise a worker URL: scheme http/https, a host, no query; trailing slash dropped.
pub fn normalize_worker_url(s: &str) -> Result<String, String> {
    let uri: http::Uri = s.parse().map_err(|e| format!("`{s}` is not a URL: {e}"))?;
    match uri.scheme_str() {
        Some("http") | Some("https") => {}
        _ => return Err(format!("`{s}` must start with http:// or https://")),
    }
    if uri.authority().is_none() {
        return Err(format!("`{s}` has no host"));
    }
    if uri.query().is_some() {
        return Err(format!("`{s}` must not have a query string"));
    }
    Ok(s.trim_end_matches('/').to_string())
}

impl RawConfig {
    /// Check every field, collecting all problems.
    pub fn validate(self) -> Result<Config, ConfigError> {
        let mut problems = Vec::new();
        let s = self.server;
        let listen = match s
            .listen
            .as_deref()
            .unwrap_or(DEFAULT_LISTEN)
            .parse::<SocketAddr>()
        {
            Ok(a) => a,
            Err(e) => {
                problems.push(format!("server.listen: {e}"));
                DEFAULT_LISTEN
                    .parse()
                    .expect("default listen address parses")
            }
        };
        let max_body_bytes = s.max_body_bytes.unwrap_or(DEFAULT_MAX_BODY_BYTES);
        if max_body_bytes == 0 {
            problems.push("server.max_body_bytes: must be greater than 0".into());
        }
        let t = s.timeouts;
        let mut ms = |key: &str, v: Option<u64>, default: u64| {
            let v = v.unwrap_or(default);
            if v == 0 {
                problems.push(format!("server.timeouts.{key}: must be greater than 0"));
            }
            Duration::from_millis(v.max(1))
        };
        let timeouts = Timeouts {
            connect: ms("connect_ms", t.connect_ms, DEFAULT_CONNECT_TIMEOUT_MS),
            first_byte: ms(
                "first_byte_ms",
                t.first_byte_ms,
                DEFAULT_FIRST_BYTE_TIMEOUT_MS,
            ),
            idle: ms("idle_ms", t.idle_ms, DEFAULT_IDLE_TIMEOUT_MS),
            total: ms("total_ms", t.total_ms, DEFAULT_TOTAL_TIMEOUT_MS),
        };
        let discovery = ms(
            "model_discovery_ms",
            s.model_discovery_ms,
            DEFAULT_MODEL_DISCOVERY_MS,
        );
        // `ms` borrows `problems`; the borrow ends here.
        let model_discovery_interval = discovery;

        let mut pools = Vec::new();
        let mut pool_names = HashSet::new();
        let mut model_names: HashSet<String> = HashSet::new();
        for (i, p) in self.pools.into_iter().enumerate() {
            let key = format!("pools[{i}]");
            let name = p.name.clone().unwrap_or_else(|| format!("pool-{i}"));
            if name.is_empty() {
                problems.push(format!("{key}.name: must not be empty"));
            }
            if !pool_names.insert(name.clone()) {
                problems.push(format!("{key}.name: duplicate pool name `{name}`"));
            }
            let policy = match p.policy.as_deref() {
                None => PolicyKind::RoundRobin,
                Some(s) => PolicyKind::parse(s).unwrap_or_else(|| {
                    problems.push(format!(
                        "{key}.policy: unknown policy `{s}` (expected one of: {})",
                        PolicyKind::names()
                    ));
                    PolicyKind::RoundRobin
                }),
            };
            for (j, m) in p.models.iter().chain(p.aliases.iter()).enumerate() {
                if m.is_empty() {
                    problems.push(format!("{key}.models[{j}]: empty model name"));
                } else if !model_names.insert(m.clone()) {
                    problems.push(format!(
                        "{key}: model name `{m}` is served by more than one pool"
                    ));
                }
            }
            if !p.aliases.is_empty() && p.models.is_empty() {
                problems.push(format!(
                    "{key}.aliases: aliases need at least one entry in {key}.models"
                ));
            }
            let max_attempts = p.max_attempts.unwrap_or(DEFAULT_MAX_ATTEMPTS);
            if max_attempts == 0 {
                problems.push(format!("{key}.max_attempts: must be at least 1"));
            }
            let upstream_api_key = match &p.upstream_api_key_env {
                None => None,
                Some(var) => match std::env::var(var) {
                    Ok(v) if !v.is_empty() => Some(v),
                    _ => {
                        problems.push(format!(
                            "{key}.upstream_api_key_env: environment variable `{var}` is not set"
                        ));
                        None
                    }
                },
            };
            let mut workers = Vec::new();
            let mut seen = HashSet::new();
            for (j, w) in p.workers.into_iter().enumerate() {
                match normalize_worker_url(&w.url) {
                    Ok(url) => {
                        if !seen.insert(url.clone()) {
                            problems
                                .push(format!("{key}.workers[{j}].url: duplicate worker `{url}`"));
                        }
                        workers.push(WorkerConfig {
                            url,
                            labels: w.labels,
                        });
                    }
                    Err(e) => problems.push(format!("{key}.workers[{j}].url: {e}")),
                }
            }
            if workers.is_empty() {
                problems.push(format!("{key}.workers: a pool needs at least one worker"));
            }
            pools.push(PoolConfig {
                name,
                models: p.models,
                aliases: p.aliases,
                policy,
                max_attempts: max_attempts.max(1),
                pass_client_auth: p.pass_client_auth.unwrap_or(false),
                upstream_api_key,
                workers,
            });
        }
        if pools.is_empty() {
            problems.push("pools: at least one pool (or a --worker flag) is required".into());
        }
        if !problems.is_empty() {
            return Err(ConfigError { problems });
        }
        Ok(Config {
            server: ServerConfig {
                listen,
                max_body_bytes,
                timeouts,
                debug_headers: s.debug_headers.unwrap_or(false),
                model_discovery_interval,
            },
            pools,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(text: &str) -> Result<Config, ConfigError> {
        parse(text)?.validate()
    }

    #[test]
    fn minimal_pool_gets_defaults() {
        let c = check(
            r#"
            [[pools]]
            name = "p"
            models = ["m"]
            workers = [{ url = "http://127.0.0.1:9000/" }]
            "#,
        )
        .unwrap();
        assert_eq!(c.server.listen, DEFAULT_LISTEN.parse().unwrap());
        assert_eq!(c.pools[0].workers[0].url, "http://127.0.0.1:9000");
        assert_eq!(c.pools[0].policy, PolicyKind::RoundRobin);
        assert_eq!(c.server.max_body_bytes, DEFAULT_MAX_BODY_BYTES);
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
