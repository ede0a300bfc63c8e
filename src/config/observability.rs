//! Observability and cost configuration: `[telemetry]`, `[access_log]`,
//! `[tracing]`, `[[prices]]` and `[scaling]`. Raw (serde) shapes, their
//! validation and the typed results, kept apart from the core schema so the
//! sections can evolve without touching pools and workers.

use super::key::Key;
use super::Problems;
// Tenancy moved to `tenancy.rs`; its items stay reachable where they were.
pub use super::tenancy::{AnonymousClaims, TenantConfig, ANONYMOUS_TENANT, MAX_SLO_MS};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

/// Default cap on distinct `tenant` label values before `other` is used.
pub const DEFAULT_MAX_TENANT_LABELS: usize = 32;
/// Default cap on distinct `region` label values before `other` is used.
pub const DEFAULT_MAX_REGION_LABELS: usize = 16;
/// Default time without requests after which a worker counts as idle (ms).
pub const DEFAULT_IDLE_WORKER_AFTER_MS: u64 = 60_000;
/// Default seconds of per-second aggregates kept for the dashboard.
pub const DEFAULT_DASHBOARD_WINDOW_S: usize = 300;
/// Default access-log buffer (records waiting for the writer) before records are dropped.
pub const DEFAULT_ACCESS_LOG_BUFFER: usize = 8_192;
/// Default OpenTelemetry `service.name`.
pub const DEFAULT_SERVICE_NAME: &str = "switchyard";
/// Default spans buffered for the OTLP exporter before new ones are dropped.
pub const DEFAULT_TRACE_BUFFER: usize = 4_096;
/// Default throughput floor for GPU-hour prices (tokens/s): below it, the floor is used.
pub const DEFAULT_THROUGHPUT_FLOOR_TPS: f64 = 50.0;
/// Scaling defaults (see `docs/observability.md`).
pub const DEFAULT_TARGET_QUEUE_PER_REPLICA: f64 = 8.0;
pub const DEFAULT_TARGET_KV_USAGE: f64 = 0.8;
pub const DEFAULT_TARGET_TTFT_P90_MS: u64 = 2_000;
pub const DEFAULT_MIN_REPLICAS: u32 = 1;
pub const DEFAULT_MAX_REPLICAS: u32 = 64;
pub const DEFAULT_SCALE_DOWN_STABILIZATION_MS: u64 = 300_000;
pub const DEFAULT_SCALING_TOLERANCE: f64 = 0.1;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTelemetry {
    /// Distinct `tenant` label values before further tenants are counted as `other`.
    pub max_tenant_labels: Option<usize>,
    /// Distinct `region` label values before further regions are counted as `other`.
    pub max_region_labels: Option<usize>,
    /// A worker without requests for this long, while others queue, is idle (ms).
    pub idle_worker_after_ms: Option<u64>,
    /// Serve the live dashboard at `/dashboard`.
    pub dashboard: Option<bool>,
    /// Seconds of per-second aggregates kept for the dashboard.
    pub dashboard_window_s: Option<usize>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawAccessLog {
    pub enabled: Option<bool>,
    /// `-` for stdout, else a file appended to.
    pub path: Option<String>,
    /// Records buffered for the writer; beyond it records are dropped (and counted).
    pub buffer: Option<usize>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTracing {
    /// OTLP/HTTP base URL (e.g. `http://127.0.0.1:4318`); tracing export is off when unset.
    pub otlp_endpoint: Option<String>,
    pub service_name: Option<String>,
    /// Share of traces exported, 0.0–1.0 (a sampled parent is always followed).
    pub sample_ratio: Option<f64>,
    /// Spans buffered for the exporter before new ones are dropped.
    pub buffer: Option<usize>,
}

/// One row of the price table. Matchers left out match anything; the most
/// specific matching row wins (then the first).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawPrice {
    pub model: Option<String>,
    pub pool: Option<String>,
    /// Worker label `tier`.
    pub tier: Option<String>,
    /// USD per 1M uncached prompt tokens.
    pub prompt_per_mtok: Option<f64>,
    /// USD per 1M cached prompt tokens (default: the prompt price).
    pub cached_prompt_per_mtok: Option<f64>,
    /// USD per 1M output tokens.
    pub output_per_mtok: Option<f64>,
    /// USD per GPU-hour of the worker, amortised over its measured token throughput.
    pub gpu_hour_usd: Option<f64>,
    /// Lowest throughput (tokens/s) used for the amortisation.
    pub throughput_floor_tps: Option<f64>,
}

#[derive(Debug, Default, Deserialize, Clone)]
#[serde(deny_unknown_fields)]
pub struct RawScalingTargets {
    pub target_queue_per_replica: Option<f64>,
    pub target_kv_usage: Option<f64>,
    pub target_ttft_p90_ms: Option<u64>,
    pub min_replicas: Option<u32>,
    pub max_replicas: Option<u32>,
    pub scale_down_stabilization_ms: Option<u64>,
    pub tolerance: Option<f64>,
}

/// `[scaling]`: the targets for every pool, and `[scaling.pools.NAME]` overrides.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawScaling {
    /// Waiting + running requests per replica the pool should run at.
    pub target_queue_per_replica: Option<f64>,
    /// Mean KV-cache usage (0–1] the pool should run at.
    pub target_kv_usage: Option<f64>,
    /// p90 time to first token the pool should stay under (ms).
    pub target_ttft_p90_ms: Option<u64>,
    pub min_replicas: Option<u32>,
    pub max_replicas: Option<u32>,
    /// A lower recommendation takes effect only after it held this long (ms).
    pub scale_down_stabilization_ms: Option<u64>,
    /// Ratios within 1 ± tolerance keep the current replica count.
    pub tolerance: Option<f64>,
    /// Per-pool overrides of the defaults.
    #[serde(default)]
    pub pools: BTreeMap<String, RawScalingTargets>,
}

impl RawScaling {
    fn defaults(&self) -> RawScalingTargets {
        RawScalingTargets {
            target_queue_per_replica: self.target_queue_per_replica,
            target_kv_usage: self.target_kv_usage,
            target_ttft_p90_ms: self.target_ttft_p90_ms,
            min_replicas: self.min_replicas,
            max_replicas: self.max_replicas,
            scale_down_stabilization_ms: self.scale_down_stabilization_ms,
            tolerance: self.tolerance,
        }
    }
}

/// Validated observability settings.
#[derive(Clone, Debug)]
pub struct ObservabilityConfig {
    pub max_tenant_labels: usize,
    pub max_region_labels: usize,
    pub idle_worker_after: Duration,
    pub dashboard: bool,
    pub dashboard_window_s: usize,
    pub access_log: Option<AccessLogConfig>,
    pub tracing: Option<TracingConfig>,
    pub prices: Vec<PriceConfig>,
    pub scaling: ScalingConfig,
}

impl Default for ObservabilityConfig {
    fn default() -> Self {
        let mut p = Problems::default();
        validate(ObservabilityRaw::default(), &[], &mut p)
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AccessLogTarget {
    Stdout,
    File(PathBuf),
}

#[derive(Clone, Debug)]
pub struct AccessLogConfig {
    pub target: AccessLogTarget,
    pub buffer: usize,
}

#[derive(Clone, Debug)]
pub struct TracingConfig {
    /// Full URL spans are posted to (`…/v1/traces`).
    pub traces_url: String,
    pub service_name: String,
    pub sample_ratio: f64,
    pub buffer: usize,
}

#[derive(Clone, Debug, PartialEq)]
pub enum PriceRate {
    /// USD per 1M tokens.
    Tokens {
        prompt: f64,
        cached_prompt: f64,
        output: f64,
    },
    /// USD per GPU-hour amortised over measured throughput (tokens/s, floored).
    GpuHour { usd: f64, throughput_floor_tps: f64 },
}

#[derive(Clone, Debug, PartialEq)]
pub struct PriceConfig {
    pub model: Option<String>,
    pub pool: Option<String>,
    pub tier: Option<String>,
    pub rate: PriceRate,
}

impl PriceConfig {
    /// How many matchers this row sets, if it matches; `None` if it does not.
    pub fn specificity(&self, model: &str, pool: &str, tier: Option<&str>) -> Option<u8> {
        let mut n = 0;
        if let Some(m) = &self.model {
            if m != model {
                return None;
            }
            n += 1;
        }
        if let Some(p) = &self.pool {
            if p != pool {
                return None;
            }
            n += 1;
        }
        if let Some(t) = &self.tier {
            if Some(t.as_str()) != tier {
                return None;
            }
            n += 1;
        }
        Some(n)
    }
}

/// Targets the scaling recommendation compares the pool's signals with.
#[derive(Clone, Debug, PartialEq)]
pub struct ScalingTargets {
    pub queue_per_replica: f64,
    pub kv_usage: f64,
    pub ttft_p90: Duration,
    pub min_replicas: u32,
    pub max_replicas: u32,
    pub scale_down_stabilization: Duration,
    pub tolerance: f64,
}

#[derive(Clone, Debug)]
pub struct ScalingConfig {
    pub defaults: ScalingTargets,
    pub pools: BTreeMap<String, ScalingTargets>,
}

impl ScalingConfig {
    pub fn for_pool(&self, pool: &str) -> &ScalingTargets {
        self.pools.get(pool).unwrap_or(&self.defaults)
    }
}

/// The raw sections this module validates.
#[derive(Default)]
pub struct ObservabilityRaw {
    pub telemetry: RawTelemetry,
    pub access_log: RawAccessLog,
    pub tracing: RawTracing,
    pub prices: Vec<RawPrice>,
    pub scaling: RawScaling,
}

fn positive(p: &mut Problems, key: &str, v: Option<usize>, d: usize) -> usize {
    let v = v.unwrap_or(d);
    if v == 0 {
        p.push(format!("{key}: must be greater than 0"));
    }
    v.max(1)
}

fn price_value(p: &mut Problems, key: &str, v: Option<f64>) -> Option<f64> {
    let v = v?;
    if !(v.is_finite() && v >= 0.0) {
        p.push(format!("{key}: must be a finite number >= 0 (got {v})"));
        return Some(0.0);
    }
    Some(v)
}

/// Validate the observability sections; `pools` are the configured pool names
/// (prices and scaling overrides must name one).
pub(crate) fn validate(
    raw: ObservabilityRaw,
    pools: &[&str],
    p: &mut Problems,
) -> ObservabilityConfig {
    let t = raw.telemetry;
    let max_tenant_labels = positive(
        p,
        "telemetry.max_tenant_labels",
        t.max_tenant_labels,
        DEFAULT_MAX_TENANT_LABELS,
    );
    let max_region_labels = positive(
        p,
        "telemetry.max_region_labels",
        t.max_region_labels,
        DEFAULT_MAX_REGION_LABELS,
    );
    let dashboard_window_s = positive(
        p,
        "telemetry.dashboard_window_s",
        t.dashboard_window_s,
        DEFAULT_DASHBOARD_WINDOW_S,
    );
    let idle = t
        .idle_worker_after_ms
        .unwrap_or(DEFAULT_IDLE_WORKER_AFTER_MS);
    if idle == 0 {
        p.push("telemetry.idle_worker_after_ms: must be greater than 0".into());
    }
    // Fields are evaluated in the order written: the order of the problems.
    ObservabilityConfig {
        max_tenant_labels,
        max_region_labels,
        idle_worker_after: Duration::from_millis(idle.max(1)),
        dashboard: t.dashboard.unwrap_or(true),
        dashboard_window_s,
        access_log: validate_access_log(raw.access_log, p),
        tracing: validate_tracing(raw.tracing, p),
        prices: validate_prices(raw.prices, pools, p),
        scaling: validate_scaling(&raw.scaling, pools, p),
    }
}

/// `[access_log]`: `None` unless enabled.
fn validate_access_log(a: RawAccessLog, p: &mut Problems) -> Option<AccessLogConfig> {
    if !a.enabled.unwrap_or(false) {
        return None;
    }
    let path = a.path.unwrap_or_else(|| "-".into());
    let target = match path.as_str() {
        "-" => AccessLogTarget::Stdout,
        "" => {
            p.push("access_log.path: must not be empty (use \"-\" for stdout)".into());
            AccessLogTarget::Stdout
        }
        f => AccessLogTarget::File(PathBuf::from(f)),
    };
    Some(AccessLogConfig {
        target,
        buffer: positive(p, "access_log.buffer", a.buffer, DEFAULT_ACCESS_LOG_BUFFER),
    })
}

/// `[tracing]`: `None` without an (acceptable) OTLP endpoint.
fn validate_tracing(tr: RawTracing, p: &mut Problems) -> Option<TracingConfig> {
    let ratio = tr.sample_ratio.unwrap_or(1.0);
    if !(0.0..=1.0).contains(&ratio) {
        p.push(format!(
            "tracing.sample_ratio: must be between 0.0 and 1.0, got {ratio}"
        ));
    }
    let buffer = positive(p, "tracing.buffer", tr.buffer, DEFAULT_TRACE_BUFFER);
    let ep = tr.otlp_endpoint?;
    let ep = ep.trim_end_matches('/').to_string();
    match ep.parse::<http::Uri>() {
        Ok(u) if u.scheme_str() == Some("http") && u.authority().is_some() => {}
        Ok(u) if u.scheme_str() == Some("https") => {
            p.push(format!(
                "tracing.otlp_endpoint: `{ep}`: https is not supported by the built-in exporter; send to a local collector over http"
            ));
            return None;
        }
        _ => {
            p.push(format!(
                "tracing.otlp_endpoint: `{ep}` must be an http:// URL with a host"
            ));
            return None;
        }
    }
    let traces_url = if ep.ends_with("/v1/traces") {
        ep
    } else {
        format!("{ep}/v1/traces")
    };
    Some(TracingConfig {
        traces_url,
        service_name: tr
            .service_name
            .unwrap_or_else(|| DEFAULT_SERVICE_NAME.into()),
        sample_ratio: ratio.clamp(0.0, 1.0),
        buffer,
    })
}

/// `[[prices]]`, each either per token or per GPU hour.
fn validate_prices(raw: Vec<RawPrice>, pools: &[&str], p: &mut Problems) -> Vec<PriceConfig> {
    raw.into_iter()
        .enumerate()
        .filter_map(|(i, r)| validate_price(&Key::new("prices").index(i), r, pools, p))
        .collect()
}

/// One price (`key` is `prices[N]`); `None` when it sets neither kind or both.
fn validate_price(key: &Key, r: RawPrice, pools: &[&str], p: &mut Problems) -> Option<PriceConfig> {
    let prompt = price_value(p, &key.field("prompt_per_mtok"), r.prompt_per_mtok);
    let cached_key = key.field("cached_prompt_per_mtok");
    let cached = price_value(p, &cached_key, r.cached_prompt_per_mtok);
    let output = price_value(p, &key.field("output_per_mtok"), r.output_per_mtok);
    let gpu = price_value(p, &key.field("gpu_hour_usd"), r.gpu_hour_usd);
    let token_priced = prompt.is_some() || cached.is_some() || output.is_some();
    let floor_key = key.field("throughput_floor_tps");
    let rate = match (token_priced, gpu) {
        (true, Some(_)) => {
            p.push(format!(
                "{key}: set either per-token prices or gpu_hour_usd, not both"
            ));
            return None;
        }
        (false, None) => {
            p.push(format!(
                "{key}: needs prompt_per_mtok/cached_prompt_per_mtok/output_per_mtok or gpu_hour_usd"
            ));
            return None;
        }
        (true, None) => {
            let prompt = prompt.unwrap_or(0.0);
            PriceRate::Tokens {
                prompt,
                cached_prompt: cached.unwrap_or(prompt),
                output: output.unwrap_or(0.0),
            }
        }
        (false, Some(usd)) => {
            let floor = r
                .throughput_floor_tps
                .unwrap_or(DEFAULT_THROUGHPUT_FLOOR_TPS);
            let valid = floor.is_finite() && floor > 0.0;
            if !valid {
                p.push(format!(
                    "{floor_key}: must be a finite number > 0 (got {floor})"
                ));
            }
            PriceRate::GpuHour {
                usd,
                throughput_floor_tps: if valid {
                    floor
                } else {
                    DEFAULT_THROUGHPUT_FLOOR_TPS
                },
            }
        }
    };
    if r.throughput_floor_tps.is_some() && matches!(rate, PriceRate::Tokens { .. }) {
        p.push(format!("{floor_key}: only applies with gpu_hour_usd"));
    }
    if let Some(pool) = &r.pool {
        if !pools.is_empty() && !pools.contains(&pool.as_str()) {
            let why = super::no_pool(pool, pools);
            p.push(format!("{}: {why}", key.field("pool")));
        }
    }
    Some(PriceConfig {
        model: r.model,
        pool: r.pool,
        tier: r.tier,
        rate,
    })
}

/// `[scaling]`: defaults, and per-pool overrides that must name a pool.
fn validate_scaling(raw: &RawScaling, pools: &[&str], p: &mut Problems) -> ScalingConfig {
    let defaults = scaling_targets(p, "scaling", &raw.defaults(), None);
    let mut scaling_pools = BTreeMap::new();
    for (name, t) in &raw.pools {
        let key = Key::new("scaling").field("pools").field(name);
        if !pools.contains(&name.as_str()) && !p.rejected_at("pools") {
            p.push(format!("{key}: {}", super::no_pool(name, pools)));
        }
        scaling_pools.insert(name.clone(), scaling_targets(p, &key, t, Some(&defaults)));
    }
    ScalingConfig {
        defaults,
        pools: scaling_pools,
    }
}

fn scaling_targets(
    p: &mut Problems,
    key: &str,
    r: &RawScalingTargets,
    base: Option<&ScalingTargets>,
) -> ScalingTargets {
    let d = base.cloned().unwrap_or(ScalingTargets {
        queue_per_replica: DEFAULT_TARGET_QUEUE_PER_REPLICA,
        kv_usage: DEFAULT_TARGET_KV_USAGE,
        ttft_p90: Duration::from_millis(DEFAULT_TARGET_TTFT_P90_MS),
        min_replicas: DEFAULT_MIN_REPLICAS,
        max_replicas: DEFAULT_MAX_REPLICAS,
        scale_down_stabilization: Duration::from_millis(DEFAULT_SCALE_DOWN_STABILIZATION_MS),
        tolerance: DEFAULT_SCALING_TOLERANCE,
    });
    let queue = r.target_queue_per_replica.unwrap_or(d.queue_per_replica);
    if !(queue.is_finite() && queue > 0.0) {
        p.push(format!(
            "{key}.target_queue_per_replica: must be > 0 (got {queue})"
        ));
    }
    let kv = r.target_kv_usage.unwrap_or(d.kv_usage);
    if !(kv > 0.0 && kv <= 1.0) {
        p.push(format!(
            "{key}.target_kv_usage: must be in (0, 1] (got {kv})"
        ));
    }
    let ttft = r
        .target_ttft_p90_ms
        .map(Duration::from_millis)
        .unwrap_or(d.ttft_p90);
    if ttft.is_zero() {
        p.push(format!("{key}.target_ttft_p90_ms: must be greater than 0"));
    }
    let min = r.min_replicas.unwrap_or(d.min_replicas);
    let max = r.max_replicas.unwrap_or(d.max_replicas);
    if max == 0 || min > max {
        p.push(format!(
            "{key}: need 0 <= min_replicas <= max_replicas and max_replicas >= 1 (got {min}..{max})"
        ));
    }
    let tol = r.tolerance.unwrap_or(d.tolerance);
    if !(0.0..1.0).contains(&tol) {
        p.push(format!("{key}.tolerance: must be in [0, 1) (got {tol})"));
    }
    ScalingTargets {
        queue_per_replica: if queue.is_finite() && queue > 0.0 {
            queue
        } else {
            d.queue_per_replica
        },
        kv_usage: kv.clamp(0.01, 1.0),
        ttft_p90: ttft.max(Duration::from_millis(1)),
        min_replicas: min,
        max_replicas: max.max(min).max(1),
        scale_down_stabilization: r
            .scale_down_stabilization_ms
            .map(Duration::from_millis)
            .unwrap_or(d.scale_down_stabilization),
        tolerance: tol.clamp(0.0, 0.99),
    }
}

#[cfg(test)]
mod tests {
    use crate::config::{parse, Config, ConfigError};

    fn check(text: &str) -> Result<Config, ConfigError> {
        parse(text)?.validate()
    }

    const POOL: &str =
        "[[pools]]\nname = \"p\"\nmodels = [\"m\"]\nworkers = [{ url = \"http://h:1\" }]\n";

    #[test]
    fn defaults_when_the_sections_are_absent() {
        let c = check(POOL).unwrap();
        let o = &c.observability;
        assert!(o.access_log.is_none() && o.tracing.is_none() && o.dashboard);
        assert_eq!(o.max_tenant_labels, super::DEFAULT_MAX_TENANT_LABELS);
        assert_eq!(
            o.scaling.for_pool("p").max_replicas,
            super::DEFAULT_MAX_REPLICAS
        );
        assert!(c.tenancy.tenants.is_empty());
    }

    #[test]
    fn observability_sections_parse() {
        std::env::set_var("SWITCHYARD_CFG_TEST_TENANT_KEY", "sk-123");
        let c = check(&format!(
            r#"
            [access_log]
            enabled = true
            path = "/tmp/x.jsonl"
            [tracing]
            otlp_endpoint = "http://127.0.0.1:4318/"
            sample_ratio = 0.5
            [[tenants]]
            name = "acme"
            api_key_env = "SWITCHYARD_CFG_TEST_TENANT_KEY"
            [[prices]]
            model = "m"
            prompt_per_mtok = 0.5
            output_per_mtok = 1.5
            [[prices]]
            tier = "h100"
            gpu_hour_usd = 2.5
            [scaling]
            target_queue_per_replica = 4
            [scaling.pools.p]
            max_replicas = 3
            {POOL}"#
        ))
        .unwrap();
        let o = &c.observability;
        assert_eq!(
            o.tracing.as_ref().unwrap().traces_url,
            "http://127.0.0.1:4318/v1/traces"
        );
        assert_eq!(o.prices.len(), 2);
        let p = o.scaling.for_pool("p");
        assert_eq!((p.queue_per_replica, p.max_replicas), (4.0, 3));
        assert_eq!(c.tenancy.tenants[0].name, "acme");
        // The key never shows in the config's debug output.
        assert!(!format!("{:?}", c.tenancy).contains("sk-123"));
    }

    #[test]
    fn observability_problems_name_their_keys() {
        let e = check(&format!(
            r#"
            [telemetry]
            max_tenant_labels = 0
            [tracing]
            otlp_endpoint = "ftp://x"
            [[tenants]]
            name = "anonymous"
            api_key_env = "SWITCHYARD_CFG_TEST_SURELY_UNSET"
            [[prices]]
            prompt_per_mtok = -1.0
            [[prices]]
            prompt_per_mtok = 1.0
            gpu_hour_usd = 2.0
            [[prices]]
            pool = "nope"
            [scaling]
            min_replicas = 5
            max_replicas = 2
            [scaling.pools.ghost]
            target_kv_usage = 1.5
            {POOL}"#
        ))
        .unwrap_err()
        .to_string();
        for needle in [
            "telemetry.max_tenant_labels",
            "tracing.otlp_endpoint",
            "tenants[0].name: `anonymous` is reserved",
            "tenants[0].api_key_env",
            "prices[0].prompt_per_mtok",
            "prices[1]: set either per-token prices or gpu_hour_usd",
            "prices[2]: needs",
            "scaling: need 0 <= min_replicas <= max_replicas",
            "scaling.pools.ghost: no pool named `ghost`",
            "scaling.pools.ghost.target_kv_usage",
        ] {
            assert!(e.contains(needle), "missing `{needle}` in:\n{e}");
        }
    }
}
