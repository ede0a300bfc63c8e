//! Tenant limits: `[tenants.limits]` (the tenant as a whole), `[tenants.key_limits]`
//! (each of its keys on its own) and `[tenants.model_limits.MODEL]` (the tenant's
//! requests for one model). Every field is optional; a limit left out does not apply.
//! `[limits]` says where their state lives: this process, or a Redis shared by
//! every replica.

use super::key::Key;
use super::Problems;
use serde::Deserialize;

#[derive(Debug, Default, Deserialize, Clone)]
#[serde(deny_unknown_fields)]
pub struct RawLimits {
    pub requests_per_minute: Option<u64>,
    /// Prompt plus output tokens per minute.
    pub tokens_per_minute: Option<u64>,
    pub max_concurrent_requests: Option<u64>,
    /// USD per UTC day, priced by `[[prices]]`.
    pub daily_budget_usd: Option<f64>,
    /// USD per UTC calendar month.
    pub monthly_budget_usd: Option<f64>,
    /// Output tokens reserved for a request that sends no `max_tokens`.
    pub default_max_tokens: Option<u64>,
}

/// Validated limits of one scope; `None` is "no limit".
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Limits {
    pub requests_per_minute: Option<u64>,
    pub tokens_per_minute: Option<u64>,
    pub max_concurrent_requests: Option<u64>,
    pub daily_budget_usd: Option<f64>,
    pub monthly_budget_usd: Option<f64>,
    /// Output tokens a request without `max_tokens` reserves in this scope
    /// (the most specific scope's wins, then `[limits] default_max_tokens`).
    pub default_max_tokens: Option<u64>,
}

impl Limits {
    /// No limit is set (a default reservation alone limits nothing).
    pub fn is_empty(&self) -> bool {
        self.requests_per_minute.is_none()
            && self.tokens_per_minute.is_none()
            && self.max_concurrent_requests.is_none()
            && self.daily_budget_usd.is_none()
            && self.monthly_budget_usd.is_none()
    }

    /// A limit that reserves tokens or cost up front.
    pub fn reserves(&self) -> bool {
        self.tokens_per_minute.is_some()
            || self.daily_budget_usd.is_some()
            || self.monthly_budget_usd.is_some()
    }
}

/// Output tokens reserved for a request without `max_tokens` when no scope
/// and no `[limits] default_max_tokens` says otherwise.
pub const DEFAULT_MAX_TOKENS: u64 = 4_096;

/// Default lease of a concurrency slot in Redis (ms): a slot whose request
/// stopped renewing it (a crashed replica, a lost release) frees itself then.
pub const DEFAULT_REDIS_LEASE_MS: u64 = 30_000;

/// Default time a Redis call may take before the failure mode applies (ms).
pub const DEFAULT_REDIS_TIMEOUT_MS: u64 = 250;

/// `[limits]`: where limit state lives.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawLimitsStore {
    /// `memory` (default) or `redis`.
    pub state: Option<String>,
    /// `redis://[user:password@]host:port[/db]`; required with `state = "redis"`.
    pub redis_url: Option<String>,
    /// `open` (admit without limits, default) or `closed` (refuse) while Redis fails.
    pub on_redis_error: Option<String>,
    pub redis_timeout_ms: Option<u64>,
    /// Output tokens reserved for a request without `max_tokens` (default 4096).
    pub default_max_tokens: Option<u64>,
    /// Lease of a concurrency slot in Redis, renewed while the request lives (ms).
    pub redis_lease_ms: Option<u64>,
}

/// `[limits]`, validated.
#[derive(Clone, Debug, PartialEq)]
pub struct LimitsConfig {
    pub store: LimitsStore,
    pub default_max_tokens: u64,
}

impl Default for LimitsConfig {
    fn default() -> LimitsConfig {
        LimitsConfig {
            store: LimitsStore::Memory,
            default_max_tokens: DEFAULT_MAX_TOKENS,
        }
    }
}

/// Where limit state lives.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum LimitsStore {
    #[default]
    Memory,
    Redis(RedisStore),
}

/// A Redis shared by the replicas. The URL may hold a password: it is a secret.
#[derive(Clone, Debug, PartialEq)]
pub struct RedisStore {
    pub url: super::Secret,
    /// Refuse requests (rather than admit them unlimited) while Redis fails.
    pub fail_closed: bool,
    pub timeout: std::time::Duration,
    /// How long a concurrency slot lives unless its request renews it.
    pub lease: std::time::Duration,
}

impl RedisStore {
    /// Same Redis (a reload may change the mode, timeout and lease in place).
    pub fn same_server(&self, other: &RedisStore) -> bool {
        self.url.expose() == other.url.expose()
    }
}

/// `[limits]`: the store, and the default output reservation (> 0).
pub(crate) fn validate_config(r: RawLimitsStore, p: &mut Problems) -> LimitsConfig {
    let default_max_tokens = r.default_max_tokens.unwrap_or(DEFAULT_MAX_TOKENS);
    if default_max_tokens == 0 {
        let k = Key::new("limits").field("default_max_tokens");
        p.push(format!("{k}: must be greater than 0"));
    }
    LimitsConfig {
        store: validate_store(r, p),
        default_max_tokens: default_max_tokens.max(1),
    }
}

/// `[limits]`: `redis` needs a `redis://` URL; the failure mode is `open` or `closed`.
fn validate_store(r: RawLimitsStore, p: &mut Problems) -> LimitsStore {
    let key = Key::new("limits");
    let lease_ms = r.redis_lease_ms.unwrap_or(DEFAULT_REDIS_LEASE_MS);
    if lease_ms < 1_000 {
        let k = key.field("redis_lease_ms");
        p.push(format!("{k}: must be at least 1000 (got {lease_ms})"));
    }
    let fail_closed = match r.on_redis_error.as_deref() {
        None | Some("open") => false,
        Some("closed") => true,
        Some(o) => {
            let k = key.field("on_redis_error");
            p.push(format!("{k}: must be `open` or `closed` (got `{o}`)"));
            false
        }
    };
    let timeout_ms = r.redis_timeout_ms.unwrap_or(DEFAULT_REDIS_TIMEOUT_MS);
    if timeout_ms == 0 {
        p.push(format!(
            "{}: must be greater than 0",
            key.field("redis_timeout_ms")
        ));
    }
    match r.state.as_deref() {
        None | Some("memory") => LimitsStore::Memory,
        Some("redis") => {
            let url = r.redis_url.unwrap_or_default();
            if !(url.starts_with("redis://") || url.starts_with("rediss://")) {
                let k = key.field("redis_url");
                p.push(format!("{k}: `state = \"redis\"` needs a redis:// URL"));
            }
            LimitsStore::Redis(RedisStore {
                url: url.into(),
                fail_closed,
                timeout: std::time::Duration::from_millis(timeout_ms.max(1)),
                lease: std::time::Duration::from_millis(lease_ms.max(1_000)),
            })
        }
        Some(o) => {
            let k = key.field("state");
            p.push(format!("{k}: must be `memory` or `redis` (got `{o}`)"));
            LimitsStore::Memory
        }
    }
}

/// Counts must be > 0; budgets finite and >= 0 (a zero budget refuses everything).
pub(crate) fn validate(key: &Key, raw: Option<RawLimits>, p: &mut Problems) -> Limits {
    let Some(r) = raw else {
        return Limits::default();
    };
    let mut count = |field: &str, v: Option<u64>| {
        if v == Some(0) {
            p.push(format!("{}: must be greater than 0", key.field(field)));
            return None;
        }
        v
    };
    let requests_per_minute = count("requests_per_minute", r.requests_per_minute);
    let tokens_per_minute = count("tokens_per_minute", r.tokens_per_minute);
    let max_concurrent_requests = count("max_concurrent_requests", r.max_concurrent_requests);
    let default_max_tokens = count("default_max_tokens", r.default_max_tokens);
    let mut usd = |field: &str, v: Option<f64>| {
        let v = v?;
        if !(v.is_finite() && v >= 0.0) {
            p.push(format!(
                "{}: must be a finite number >= 0 (got {v})",
                key.field(field)
            ));
            return None;
        }
        Some(v)
    };
    Limits {
        requests_per_minute,
        tokens_per_minute,
        max_concurrent_requests,
        daily_budget_usd: usd("daily_budget_usd", r.daily_budget_usd),
        monthly_budget_usd: usd("monthly_budget_usd", r.monthly_budget_usd),
        default_max_tokens,
    }
}

/// A `key_sha256` value: 64 hex digits.
pub(crate) fn sha256_hex(key: &Key, v: &str, p: &mut Problems) -> Option<[u8; 32]> {
    let mut out = [0u8; 32];
    let ok = v.len() == 64
        && v.as_bytes().chunks(2).zip(out.iter_mut()).all(|(pair, o)| {
            std::str::from_utf8(pair)
                .ok()
                .and_then(|s| u8::from_str_radix(s, 16).ok())
                .map(|b| *o = b)
                .is_some()
        });
    if !ok {
        p.push(format!(
            "{}: must be the key's SHA-256 as 64 hex digits",
            key.field("key_sha256")
        ));
        return None;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_counts_and_negative_budgets_are_refused() {
        let mut p = Problems::default();
        let l = validate(
            &Key::new("tenants").index(0).field("limits"),
            Some(RawLimits {
                requests_per_minute: Some(0),
                tokens_per_minute: Some(10),
                daily_budget_usd: Some(-1.0),
                ..Default::default()
            }),
            &mut p,
        );
        assert_eq!(l.tokens_per_minute, Some(10));
        let e = p.error().unwrap().to_string();
        assert!(e.contains("tenants[0].limits.requests_per_minute: must be greater than 0"));
        assert!(e.contains("tenants[0].limits.daily_budget_usd"));
    }

    #[test]
    fn key_hashes_are_64_hex_digits() {
        let mut p = Problems::default();
        let k = Key::new("tenants").index(0);
        assert_eq!(sha256_hex(&k, &"ab".repeat(32), &mut p), Some([0xab; 32]));
        assert_eq!(sha256_hex(&k, "abc", &mut p), None);
        assert_eq!(sha256_hex(&k, &"zz".repeat(32), &mut p), None);
        assert!(p
            .error()
            .unwrap()
            .to_string()
            .contains("tenants[0].key_sha256"));
    }
}
