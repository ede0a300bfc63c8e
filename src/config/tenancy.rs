//! `[tenancy]` and `[[tenants]]`: who a caller is (by key, or by a trusted
//! header), what each tenant may use and claim (models, priority, latency
//! objectives, admin scope) and its limits. The keys are read in `resolve.rs`.

use super::flow::Priority;
use super::key::Key;
use super::limits::Limits;
use super::resolve::{PendingTenancy, PendingTenant};
use super::Problems;
use serde::Deserialize;
use std::collections::BTreeMap;

/// Tenant of requests without a recognised API key.
pub const ANONYMOUS_TENANT: &str = "anonymous";
/// The largest latency objective accepted (one hour, ms).
pub const MAX_SLO_MS: u32 = 3_600_000;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTenancy {
    /// Accept `x-switchyard-tenant` from clients without a recognised key.
    pub trust_tenant_header: Option<bool>,
    /// Refuse inference requests without a recognised API key (401).
    pub require_key: Option<bool>,
    /// Highest priority class a caller without a configured tenant may ask for
    /// with `x-switchyard-priority` (default `normal`).
    pub anonymous_max_priority: Option<String>,
    /// Callers without a configured tenant may set latency objectives with
    /// `x-slo-ttft-ms` / `x-slo-tpot-ms` (default false: ignored).
    pub anonymous_allow_slo_headers: Option<bool>,
    /// `GET /v1/models` answers callers that present no key (default true;
    /// always false with `require_key`).
    pub list_models_without_key: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTenant {
    pub name: String,
    /// Environment variable holding this tenant's API key (hashed when read).
    pub api_key_env: Option<String>,
    /// The SHA-256 of this tenant's API key, as 64 hex digits.
    pub key_sha256: Option<String>,
    /// A residency zone (`[residency]`) or region(s) this tenant's requests must stay in.
    pub residency: Option<String>,
    /// Models (exact names or `*` globs, matched after aliases resolve) this
    /// tenant may use; all when left out.
    pub allowed_models: Option<Vec<String>>,
    /// The queue priority class of this tenant's requests without a header.
    pub priority: Option<String>,
    /// Highest class the tenant's `x-switchyard-priority` may ask for (default:
    /// `priority`, else `normal`); higher asks are capped to it.
    pub max_priority: Option<String>,
    /// The tenant's requests may set objectives tighter than its own with
    /// `x-slo-*` headers (default false: headers may only loosen them).
    pub allow_slo_headers: Option<bool>,
    pub limits: Option<super::limits::RawLimits>,
    /// Limits each of the tenant's keys has on its own.
    pub key_limits: Option<super::limits::RawLimits>,
    /// Limits of the tenant's requests for one model, by model name.
    #[serde(default)]
    pub model_limits: BTreeMap<String, super::limits::RawLimits>,
    /// Default time-to-first-token objective of this tenant's requests (ms).
    pub slo_ttft_ms: Option<u32>,
    /// Default time-per-output-token objective of this tenant's requests (ms).
    pub slo_tpot_ms: Option<u32>,
    /// Admin scope: the tenant's keys may call the engine control routes a pool
    /// allows (`allow_control_routes`). Default false.
    pub admin: Option<bool>,
}

/// Validated tenancy settings. Keys are resolved from the environment and never logged.
#[derive(Clone, Default)]
pub struct TenancyConfig {
    pub tenants: Vec<TenantConfig>,
    pub trust_tenant_header: bool,
    pub require_key: bool,
    /// `[limits]`: where limit state lives, the default output reservation.
    pub limits: super::limits::LimitsConfig,
    /// What callers without a configured tenant may claim by header.
    pub anonymous: AnonymousClaims,
    /// `GET /v1/models` answers callers without a key.
    pub list_models_without_key: bool,
}

#[derive(Clone, Debug, Default)]
pub struct TenantConfig {
    pub name: String,
    pub api_key: Option<super::Secret>,
    /// SHA-256 of a key given as a hash.
    pub key_sha256: Option<[u8; 32]>,
    /// Regions this tenant's requests may be served in (a hard constraint).
    pub residency: Option<super::global::Residency>,
    /// Exact names or `*` globs; empty allows every model.
    pub allowed_models: Vec<String>,
    /// Class of requests that ask for none.
    pub priority: Option<Priority>,
    /// Highest class a request may ask for (`None`: `priority`, else `normal`).
    pub max_priority: Option<Priority>,
    /// Requests may set objectives tighter than `slo_*_ms`.
    pub allow_slo_headers: bool,
    pub limits: Limits,
    pub key_limits: Limits,
    pub model_limits: BTreeMap<String, Limits>,
    /// Default latency objectives (ms) when a request sends none.
    pub slo_ttft_ms: Option<u32>,
    pub slo_tpot_ms: Option<u32>,
    /// Admin scope (engine control routes a pool allows), with a key only.
    pub admin: bool,
}

/// What a caller without a configured tenant (anonymous, or named by a trusted
/// tenant header) may ask for by header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AnonymousClaims {
    pub max_priority: Priority,
    pub allow_slo_headers: bool,
}

impl Default for AnonymousClaims {
    fn default() -> Self {
        AnonymousClaims {
            max_priority: Priority::Normal,
            allow_slo_headers: false,
        }
    }
}

impl std::fmt::Debug for TenancyConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.tenants.iter().map(|t| t.name.as_str()).collect();
        f.debug_struct("TenancyConfig")
            .field("tenants", &names)
            .field("trust_tenant_header", &self.trust_tenant_header)
            .field("require_key", &self.require_key)
            .field("limits", &self.limits)
            .field("anonymous", &self.anonymous)
            .field("list_models_without_key", &self.list_models_without_key)
            .finish()
    }
}

/// Validate `[tenancy]` and `[[tenants]]`; `global` resolves tenants' residency.
pub(crate) fn validate(
    tenancy: RawTenancy,
    tenants: Vec<RawTenant>,
    global: &super::global::GlobalConfig,
    p: &mut Problems,
) -> PendingTenancy {
    PendingTenancy {
        tenants: validate_tenants(tenants, global, p),
        trust_tenant_header: tenancy.trust_tenant_header.unwrap_or(false),
        require_key: tenancy.require_key.unwrap_or(false),
        anonymous: AnonymousClaims {
            max_priority: priority_class(
                "tenancy.anonymous_max_priority",
                tenancy.anonymous_max_priority.as_deref(),
                p,
            )
            .unwrap_or(Priority::Normal),
            allow_slo_headers: tenancy.anonymous_allow_slo_headers.unwrap_or(false),
        },
        list_models_without_key: tenancy.list_models_without_key.unwrap_or(true),
    }
}

/// `[[tenants]]`: names and residency; the keys are read in `resolve`.
fn validate_tenants(
    raw: Vec<RawTenant>,
    global: &super::global::GlobalConfig,
    p: &mut Problems,
) -> Vec<PendingTenant> {
    let mut tenants: Vec<PendingTenant> = Vec::new();
    for (i, t) in raw.into_iter().enumerate() {
        let key = Key::new("tenants").index(i);
        let name = key.field("name");
        if t.name.is_empty() {
            p.push(format!("{name}: must not be empty"));
        } else if t.name == ANONYMOUS_TENANT || t.name == crate::config::OTHER_LABEL {
            p.push(format!("{name}: `{}` is reserved", t.name));
        } else if tenants.iter().any(|o| o.config.name == t.name) {
            p.push(format!("{name}: duplicate tenant `{}`", t.name));
        }
        // Regions or zones that were rejected while reading are missing here:
        // a residency naming one is not reported again.
        let zones_lost = p.rejected_at("regions") || p.rejected_at("residency");
        let residency = t.residency.as_deref().and_then(|r| {
            let res = global.residency(r);
            if res.is_none() && !zones_lost {
                p.push(format!(
                    "{}: `{r}` is neither a residency zone nor a declared region",
                    key.field("residency")
                ));
            }
            res
        });
        for (field, v) in [
            ("slo_ttft_ms", t.slo_ttft_ms),
            ("slo_tpot_ms", t.slo_tpot_ms),
        ] {
            if v.is_some_and(|ms| !(1..=MAX_SLO_MS).contains(&ms)) {
                p.push(format!(
                    "{}: must be between 1 and {MAX_SLO_MS} ms",
                    key.field(field)
                ));
            }
        }
        tenants.push(PendingTenant {
            api_key_env: t.api_key_env.clone(),
            config: tenant_config(&key, t, residency, p),
            key,
        });
    }
    tenants
}

/// A tenant's key hash, allowed models, priority and limits.
fn tenant_config(
    key: &Key,
    t: RawTenant,
    residency: Option<super::global::Residency>,
    p: &mut Problems,
) -> TenantConfig {
    let key_sha256 = t
        .key_sha256
        .as_deref()
        .and_then(|h| super::limits::sha256_hex(key, h, p));
    let allowed_models = t.allowed_models.unwrap_or_default();
    if allowed_models.iter().any(|m| m.is_empty()) {
        p.push(format!(
            "{}: names must not be empty",
            key.field("allowed_models")
        ));
    }
    let priority = priority_class(&key.field("priority"), t.priority.as_deref(), p);
    let max_priority = priority_class(&key.field("max_priority"), t.max_priority.as_deref(), p);
    if let (Some(own), Some(max)) = (priority, max_priority) {
        if max > own {
            p.push(format!(
                "{}: `{}` is below the tenant's own priority `{}`",
                key.field("max_priority"),
                max.as_str(),
                own.as_str()
            ));
        }
    }
    let admin = t.admin.unwrap_or(false);
    if admin && t.api_key_env.is_none() && t.key_sha256.is_none() {
        p.push(format!(
            "{}: an admin tenant needs an API key (api_key_env or key_sha256); admin scope is never given by x-switchyard-tenant",
            key.field("admin")
        ));
    }
    let model_limits = t
        .model_limits
        .into_iter()
        .map(|(m, l)| {
            let k = key.field("model_limits").field(&m);
            (m, super::limits::validate(&k, Some(l), p))
        })
        .collect();
    TenantConfig {
        name: t.name,
        api_key: None,
        key_sha256,
        residency,
        allowed_models,
        priority,
        max_priority,
        allow_slo_headers: t.allow_slo_headers.unwrap_or(false),
        slo_ttft_ms: t.slo_ttft_ms,
        slo_tpot_ms: t.slo_tpot_ms,
        limits: super::limits::validate(&key.field("limits"), t.limits, p),
        key_limits: super::limits::validate(&key.field("key_limits"), t.key_limits, p),
        model_limits,
        admin,
    }
}

/// A priority class by name; an unknown name is a problem naming the classes.
fn priority_class(key: &str, name: Option<&str>, p: &mut Problems) -> Option<Priority> {
    let name = name?;
    let class = Priority::from_name(name);
    if class.is_none() {
        p.push(format!(
            "{key}: unknown priority class `{name}` (one of {})",
            Priority::NAMES
        ));
    }
    class
}
