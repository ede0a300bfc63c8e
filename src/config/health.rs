//! `[health]`: active health checks and passive ejection (see `pool/health.rs`),
//! with their defaults.

use super::problems::Problems;
use super::{ms, RawHealth};
use std::time::Duration;

/// Health-check defaults.
pub const DEFAULT_HEALTH_INTERVAL_MS: u64 = 2_000;
pub const DEFAULT_HEALTH_TIMEOUT_MS: u64 = 1_000;
pub const DEFAULT_HEALTH_PATH: &str = "/health";
pub const DEFAULT_UNHEALTHY_THRESHOLD: u32 = 2;
pub const DEFAULT_HEALTHY_THRESHOLD: u32 = 1;
pub const DEFAULT_EJECT_AFTER_FAILURES: u32 = 3;
pub const DEFAULT_BASE_EJECTION_MS: u64 = 1_000;
pub const DEFAULT_MAX_EJECTION_MS: u64 = 60_000;
pub const DEFAULT_MAX_EJECTED_PERCENT: u8 = 50;
pub const DEFAULT_OVERLOAD_COOLDOWN_MS: u64 = 1_000;

/// Health checking and ejection (see `pool/health.rs`).
#[derive(Clone, Debug)]
pub struct HealthConfig {
    /// `None`: no active probes (passive ejection still applies).
    pub interval: Option<Duration>,
    pub timeout: Duration,
    pub path: String,
    pub unhealthy_threshold: u32,
    pub healthy_threshold: u32,
    pub eject_after_failures: u32,
    pub base_ejection: Duration,
    pub max_ejection: Duration,
    pub max_ejected_fraction: f64,
    pub overload_cooldown: Duration,
}

/// `[health]`; every key has a default.
pub(super) fn validate_health(h: RawHealth, p: &mut Problems) -> HealthConfig {
    let interval = match h.interval_ms.unwrap_or(DEFAULT_HEALTH_INTERVAL_MS) {
        0 => None,
        v => Some(Duration::from_millis(v)),
    };
    let at_least_one = |p: &mut Problems, key: &str, v: Option<u32>, d: u32| {
        let v = v.unwrap_or(d);
        if v == 0 {
            p.push(format!("{key}: must be at least 1"));
        }
        v.max(1)
    };
    let percent = h.max_ejected_percent.unwrap_or(DEFAULT_MAX_EJECTED_PERCENT);
    if percent > 100 {
        p.push(format!(
            "health.max_ejected_percent: must be 0–100, got {percent}"
        ));
    }
    let path = h.path.unwrap_or_else(|| DEFAULT_HEALTH_PATH.into());
    if !path.starts_with('/') {
        p.push(format!("health.path: must start with `/`, got `{path}`"));
    }
    HealthConfig {
        interval,
        timeout: ms(
            p,
            "health.timeout_ms",
            h.timeout_ms,
            DEFAULT_HEALTH_TIMEOUT_MS,
        ),
        path,
        unhealthy_threshold: at_least_one(
            p,
            "health.unhealthy_threshold",
            h.unhealthy_threshold,
            DEFAULT_UNHEALTHY_THRESHOLD,
        ),
        healthy_threshold: at_least_one(
            p,
            "health.healthy_threshold",
            h.healthy_threshold,
            DEFAULT_HEALTHY_THRESHOLD,
        ),
        eject_after_failures: at_least_one(
            p,
            "health.eject_after_failures",
            h.eject_after_failures,
            DEFAULT_EJECT_AFTER_FAILURES,
        ),
        base_ejection: ms(
            p,
            "health.base_ejection_ms",
            h.base_ejection_ms,
            DEFAULT_BASE_EJECTION_MS,
        ),
        max_ejection: ms(
            p,
            "health.max_ejection_ms",
            h.max_ejection_ms,
            DEFAULT_MAX_EJECTION_MS,
        ),
        max_ejected_fraction: f64::from(percent.min(100)) / 100.0,
        overload_cooldown: ms(
            p,
            "health.overload_cooldown_ms",
            h.overload_cooldown_ms,
            DEFAULT_OVERLOAD_COOLDOWN_MS,
        ),
    }
}
