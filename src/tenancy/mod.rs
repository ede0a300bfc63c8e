//! Tenancy: who is calling, and what they may do. A client's
//! `Authorization: Bearer KEY` (or Anthropic's `x-api-key: KEY`) is mapped to a
//! configured tenant by the key's SHA-256 digest (`keys`: the keys themselves are
//! never stored, logged or compared byte by byte); keys the admin API issued are
//! found by their public id and compared in constant time. Without a key the
//! tenant is `anonymous` (or, with `require_key`, the request is refused), or
//! the `x-switchyard-tenant` header when the config trusts it; a key presented
//! but not recognised is refused. What its headers may claim (priority,
//! objectives) is capped by the tenant's rules (`claims`). The tenant
//! travels with the request (`proxy::RequestTags`) so metrics, cost and limits
//! (`limits`) can use it; a tenant's residency is a hard constraint on the
//! regions its requests may be served in, its `allowed_models` a hard constraint
//! on the models.

pub mod claims;
pub mod keys;
pub mod limits;
pub mod shared_keys;

use crate::config::flow::Priority;
use crate::config::glob;
use crate::config::limits::Limits;
use crate::config::observability::{TenantConfig, ANONYMOUS_TENANT};
use crate::config::{Residency, TenancyConfig};
pub use claims::ClaimRules;
use http::HeaderMap;
use keys::{Digest, IssuedKeys};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use crate::api::headers::{Name, Own};
pub use crate::api::headers::{API_KEY_HEADER, TENANT_HEADER};
/// Longest tenant name accepted from the header.
const MAX_HEADER_TENANT: usize = 64;

/// A resolved tenant. `name` is the tenant's real name (for routing and the access
/// log); metric labels go through the bounded label set in `telemetry`.
#[derive(Clone, Debug, PartialEq)]
pub struct Tenant {
    pub name: Arc<str>,
    /// The tenant was identified by a configured API key.
    pub authenticated: bool,
    /// The regions this tenant's requests must stay in.
    pub residency: Option<Residency>,
    /// Public id of the key the request came with (per-key limits).
    pub key_id: Option<Arc<str>>,
    /// A configured tenant's models, priority and limits.
    pub policy: Option<Arc<TenantPolicy>>,
    /// Latency objectives for requests that send none.
    pub slo: crate::api::Slo,
    /// How far its priority and objective headers are honoured.
    pub claims: ClaimRules,
}

/// What a configured tenant may do.
#[derive(Debug, PartialEq, Default)]
pub struct TenantPolicy {
    /// Exact names or `*` globs; empty allows every model.
    pub allowed_models: Vec<String>,
    pub limits: Limits,
    pub key_limits: Limits,
    pub model_limits: BTreeMap<String, Limits>,
    /// `admin = true`: may call the engine control routes a pool allows.
    pub admin: bool,
}

impl Tenant {
    /// Admin scope: a configured admin tenant that presented one of its keys
    /// (never a tenant named by the trusted header alone).
    pub fn is_admin(&self) -> bool {
        self.key_id.is_some() && self.policy.as_ref().is_some_and(|p| p.admin)
    }

    /// Whether the tenant may use `model` (the configured name, after aliases).
    pub fn allows(&self, model: &str) -> bool {
        self.policy.as_ref().is_none_or(|p| {
            p.allowed_models.is_empty() || p.allowed_models.iter().any(|g| glob(g, model))
        })
    }

    /// Whether a request for `model` reserves tokens or cost in any scope (a
    /// tokens-per-minute limit or a budget; only then are its prompt tokens
    /// counted).
    pub fn reserves(&self, model: &str) -> bool {
        self.any_scope(model, Limits::reserves)
    }

    /// Whether a request for `model` counts against a spend budget.
    pub fn has_budget(&self, model: &str) -> bool {
        self.any_scope(model, |l| {
            l.daily_budget_usd.is_some() || l.monthly_budget_usd.is_some()
        })
    }

    /// Whether any scope of a request for `model` (tenant, key, model) has `f`.
    fn any_scope(&self, model: &str, f: impl Fn(&Limits) -> bool) -> bool {
        self.policy.as_ref().is_some_and(|p| {
            f(&p.limits)
                || (self.key_id.is_some() && f(&p.key_limits))
                || p.model_limits.get(model).is_some_and(&f)
        })
    }
}

/// API-key → tenant lookup, built from the config.
pub struct Tenancy {
    by_digest: HashMap<Digest, Tenant>,
    /// Configured tenants by name (keys issued later name them).
    by_name: HashMap<Arc<str>, Tenant>,
    anonymous: Tenant,
    trust_header: bool,
    require_key: bool,
    list_models_without_key: bool,
}

/// The token of an `Authorization: Bearer TOKEN` value; the scheme name is
/// case-insensitive (RFC 9110 §11.1).
pub fn bearer_token(v: &[u8]) -> Option<&[u8]> {
    let (scheme, rest) = v.split_at_checked(7)?;
    scheme
        .eq_ignore_ascii_case(b"bearer ")
        .then(|| rest.trim_ascii())
        .filter(|t| !t.is_empty())
}

/// A configured tenant, before any key is known.
fn configured(t: &TenantConfig) -> Tenant {
    Tenant {
        name: Arc::from(t.name.as_str()),
        authenticated: true,
        residency: t.residency.clone(),
        key_id: None,
        policy: Some(Arc::new(TenantPolicy {
            allowed_models: t.allowed_models.clone(),
            limits: t.limits.clone(),
            key_limits: t.key_limits.clone(),
            model_limits: t.model_limits.clone(),
            admin: t.admin,
        })),
        slo: crate::api::Slo {
            ttft_ms: t.slo_ttft_ms,
            tpot_ms: t.slo_tpot_ms,
        },
        claims: tenant_claims(t),
    }
}

/// A configured tenant's claim rules: its header may ask for up to
/// `max_priority` (default: its own class), objectives as it allows.
fn tenant_claims(t: &TenantConfig) -> ClaimRules {
    let max = t.max_priority.or(t.priority).unwrap_or(Priority::Normal);
    ClaimRules {
        // `max` of classes is the lower one: never above the cap.
        default: t.priority.unwrap_or(Priority::Normal).max(max),
        max,
        slo_headers: t.allow_slo_headers,
    }
}

impl Tenancy {
    pub fn new(cfg: &TenancyConfig) -> Tenancy {
        let mut by_digest = HashMap::new();
        let mut by_name = HashMap::new();
        for t in &cfg.tenants {
            let tenant = configured(t);
            let plain = t.api_key.as_ref().map(|k| k.expose().as_bytes());
            let digests = plain.map(keys::digest).into_iter().chain(t.key_sha256);
            for d in digests {
                let key_id = keys::config_id(plain.filter(|p| keys::digest(p) == d), &d);
                let keyed = Tenant {
                    key_id: Some(Arc::from(key_id)),
                    ..tenant.clone()
                };
                by_digest.insert(d, keyed);
            }
            by_name.insert(tenant.name.clone(), tenant);
        }
        Tenancy {
            by_digest,
            by_name,
            anonymous: Tenant {
                name: Arc::from(ANONYMOUS_TENANT),
                authenticated: false,
                residency: None,
                key_id: None,
                policy: None,
                slo: Default::default(),
                claims: ClaimRules::anonymous(&cfg.anonymous),
            },
            trust_header: cfg.trust_tenant_header,
            require_key: cfg.require_key,
            list_models_without_key: cfg.list_models_without_key,
        }
    }

    /// Whether `name` is a configured tenant (keys may be issued for it).
    pub fn has_tenant(&self, name: &str) -> bool {
        self.by_name.contains_key(name)
    }

    /// The configured keys: (public id, tenant), sorted.
    pub fn config_keys(&self) -> Vec<(Arc<str>, Arc<str>)> {
        let mut v: Vec<_> = self
            .by_digest
            .values()
            .filter_map(|t| Some((t.key_id.clone()?, t.name.clone())))
            .collect();
        v.sort();
        v
    }

    /// The tenant of a presented key: a configured key, or one the admin API issued.
    fn by_key(&self, key: &[u8], issued: &IssuedKeys) -> Option<Tenant> {
        let d = keys::digest(key);
        if let Some(t) = self.by_digest.get(&d) {
            return Some(t.clone());
        }
        let e = issued.find(key, &d)?;
        let t = self.by_name.get(&e.tenant)?;
        Some(Tenant {
            key_id: Some(e.id),
            ..t.clone()
        })
    }

    /// The tenant of a request, from its headers. A key that is presented but
    /// not recognised (wrong, revoked) is refused whether or not keys are
    /// required (when the gateway has tenants): serving it as anonymous would
    /// drop that tenant's limits. The
    /// tenant header is the trust boundary's one exception: with
    /// `trust_tenant_header` a front proxy may name a tenant, but never a
    /// configured one (that needs its key) nor a reserved name.
    pub fn resolve(
        &self,
        headers: &HeaderMap,
        own: Own,
        issued: &IssuedKeys,
    ) -> Result<Tenant, Refused> {
        // Anthropic's clients send their key as `x-api-key`.
        let bearer = own
            .get(headers, Name::Authorization)
            .and_then(|v| bearer_token(v.as_bytes()));
        let api_key = own
            .get(headers, Name::ApiKey)
            .map(|v| v.as_bytes().trim_ascii())
            .filter(|k| !k.is_empty());
        for k in [bearer, api_key].into_iter().flatten() {
            if let Some(t) = self.by_key(k, issued) {
                return Ok(t);
            }
        }
        if (bearer.is_some() || api_key.is_some()) && self.authenticates() {
            return Err(Refused::UnknownKey);
        }
        if self.require_key {
            return Err(Refused::MissingKey);
        }
        if self.trust_header {
            if let Some(n) = own.get_str(headers, Name::Tenant) {
                return self.named(n);
            }
        }
        Ok(self.anonymous.clone())
    }

    /// The tenant a trusted `x-switchyard-tenant` names: a sane label value
    /// that is neither reserved nor a configured tenant's name.
    fn named(&self, n: &str) -> Result<Tenant, Refused> {
        let sane = !n.is_empty()
            && n.len() <= MAX_HEADER_TENANT
            && n.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
        if !sane {
            return Err(Refused::BadTenantHeader(format!(
                "must be 1 to {MAX_HEADER_TENANT} letters, digits, `-`, `_` or `.`"
            )));
        }
        if n == ANONYMOUS_TENANT || n == crate::config::OTHER_LABEL {
            return Err(Refused::BadTenantHeader(format!("`{n}` is reserved")));
        }
        if self.by_name.contains_key(n) {
            return Err(Refused::TenantNeedsKey);
        }
        Ok(Tenant {
            name: Arc::from(n),
            ..self.anonymous.clone()
        })
    }

    /// Keys are the gateway's business: it requires them, or has tenants
    /// (configured keys, or keys the admin API issues for them). Without
    /// either, a client's `Authorization` is for the upstream
    /// (`pass_client_auth`) and is not checked here.
    fn authenticates(&self) -> bool {
        self.require_key || !self.by_name.is_empty()
    }

    /// The tenant of callers without a key.
    pub fn anonymous(&self) -> Tenant {
        self.anonymous.clone()
    }

    /// `GET /v1/models` may answer callers without a key.
    pub fn lists_models_without_key(&self) -> bool {
        self.list_models_without_key
    }
}

/// Why a request has no tenant.
#[derive(Debug, PartialEq, Eq)]
pub enum Refused {
    /// The tenant header named a configured tenant without one of its keys.
    TenantNeedsKey,
    /// `require_key`, and no key was presented.
    MissingKey,
    /// The key presented is not one of ours (wrong, or revoked).
    UnknownKey,
    /// A trusted tenant header with a value no tenant may have (the reason).
    BadTenantHeader(String),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::observability::TenantConfig;

    fn none() -> IssuedKeys {
        IssuedKeys::default()
    }

    fn tenancy(trust: bool) -> Tenancy {
        Tenancy::new(&TenancyConfig {
            tenants: vec![
                TenantConfig {
                    name: "acme".into(),
                    api_key: Some("sk-acme-123".into()),
                    allowed_models: vec!["m".into(), "llama-*-8b".into()],
                    ..Default::default()
                },
                TenantConfig {
                    name: "globex".into(),
                    key_sha256: Some(keys::digest(b"sk-globex-456")),
                    slo_ttft_ms: Some(250),
                    ..Default::default()
                },
            ],
            trust_tenant_header: trust,
            require_key: false,
            limits: Default::default(),
            anonymous: Default::default(),
            list_models_without_key: true,
        })
    }

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(
                http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        h
    }

    /// `t`'s tenant for a request with header `pairs` (every header looked up).
    fn resolve(t: &Tenancy, pairs: &[(&str, &str)]) -> Result<Tenant, Refused> {
        t.resolve(&headers(pairs), Own::ANY, &none())
    }

    #[test]
    fn keys_map_to_tenants_and_unknown_keys_are_refused() {
        let t = tenancy(false);
        let acme = resolve(&t, &[("authorization", "Bearer sk-acme-123")]).unwrap();
        assert_eq!(&*acme.name, "acme");
        assert!(acme.authenticated);
        assert_eq!(acme.slo.ttft_ms, None);
        let globex = headers(&[("authorization", "Bearer sk-globex-456")]);
        let globex = t.resolve(&globex, Own::ANY, &none()).unwrap();
        assert_eq!(
            globex.slo.ttft_ms,
            Some(250),
            "the tenant's default objective"
        );
        assert_eq!(
            &*resolve(&t, &[("authorization", "Bearer sk-globex-456")])
                .unwrap()
                .name,
            "globex"
        );
        // Not required, but presented and wrong: refused, not anonymous.
        assert_eq!(
            resolve(&t, &[("authorization", "Bearer sk-acme-12")]),
            Err(Refused::UnknownKey)
        );
        assert_eq!(
            &*t.resolve(&HeaderMap::new(), Own::ANY, &none())
                .unwrap()
                .name,
            ANONYMOUS_TENANT
        );
    }

    #[test]
    fn x_api_key_maps_to_tenants_like_bearer() {
        let t = tenancy(false);
        let h = headers(&[("x-api-key", "sk-acme-123")]);
        assert_eq!(&*t.resolve(&h, Own::ANY, &none()).unwrap().name, "acme");
        // An unknown bearer token does not hide a known x-api-key.
        let both = headers(&[
            ("authorization", "Bearer nope"),
            ("x-api-key", "sk-globex-456"),
        ]);
        assert_eq!(
            &*t.resolve(&both, Own::ANY, &none()).unwrap().name,
            "globex"
        );
        let wrong = headers(&[("x-api-key", "sk-acme-12")]);
        assert_eq!(
            t.resolve(&wrong, Own::ANY, &none()),
            Err(Refused::UnknownKey)
        );
    }

    #[test]
    fn the_tenant_header_is_honoured_only_when_trusted() {
        let h = headers(&[(TENANT_HEADER.as_str(), "team-7")]);
        assert_eq!(
            &*tenancy(false).resolve(&h, Own::ANY, &none()).unwrap().name,
            ANONYMOUS_TENANT
        );
        assert_eq!(
            &*tenancy(true).resolve(&h, Own::ANY, &none()).unwrap().name,
            "team-7"
        );
        // A key wins over the header; odd header values are ignored.
        let both = headers(&[
            (TENANT_HEADER.as_str(), "team-7"),
            ("authorization", "Bearer sk-acme-123"),
        ]);
        assert_eq!(
            &*tenancy(true)
                .resolve(&both, Own::ANY, &none())
                .unwrap()
                .name,
            "acme"
        );
        for odd in ["a b", "anonymous", "other", &"x".repeat(65)] {
            let h = headers(&[(TENANT_HEADER.as_str(), odd)]);
            assert!(
                matches!(
                    tenancy(true).resolve(&h, Own::ANY, &none()),
                    Err(Refused::BadTenantHeader(_))
                ),
                "{odd}"
            );
        }
    }

    #[test]
    fn without_tenants_a_clients_key_is_for_the_upstream() {
        let t = Tenancy::new(&TenancyConfig {
            tenants: Vec::new(),
            trust_tenant_header: false,
            require_key: false,
            anonymous: Default::default(),
            list_models_without_key: true,
            limits: Default::default(),
        });
        let h = headers(&[("authorization", "Bearer sk-provider")]);
        assert_eq!(
            &*t.resolve(&h, Own::ANY, &none()).unwrap().name,
            ANONYMOUS_TENANT
        );
    }

    #[test]
    fn the_bearer_scheme_is_case_insensitive() {
        assert_eq!(bearer_token(b"Bearer abc"), Some(&b"abc"[..]));
        assert_eq!(bearer_token(b"bearer abc"), Some(&b"abc"[..]));
        assert_eq!(bearer_token(b"BEARER  abc "), Some(&b"abc"[..]));
        assert_eq!(bearer_token(b"Basic abc"), None);
        assert_eq!(bearer_token(b"Bearer "), None);
        assert_eq!(bearer_token(b"Bear"), None);
        let t = tenancy(false);
        let lower = headers(&[("authorization", "bearer sk-acme-123")]);
        assert_eq!(&*t.resolve(&lower, Own::ANY, &none()).unwrap().name, "acme");
    }

    #[test]
    fn the_tenant_header_cannot_claim_a_keyed_tenant() {
        let claim = headers(&[(TENANT_HEADER.as_str(), "acme")]);
        assert_eq!(
            tenancy(true).resolve(&claim, Own::ANY, &none()),
            Err(Refused::TenantNeedsKey)
        );
        // Untrusted, the header is ignored altogether.
        assert_eq!(
            &*tenancy(false)
                .resolve(&claim, Own::ANY, &none())
                .unwrap()
                .name,
            ANONYMOUS_TENANT
        );
        // With acme's key the request is acme's, whatever the header says.
        let keyed = headers(&[
            (TENANT_HEADER.as_str(), "globex"),
            ("authorization", "Bearer sk-acme-123"),
        ]);
        assert_eq!(
            &*tenancy(true)
                .resolve(&keyed, Own::ANY, &none())
                .unwrap()
                .name,
            "acme"
        );
    }

    #[test]
    fn require_key_refuses_missing_and_unknown_keys() {
        let mut cfg = TenancyConfig {
            tenants: vec![TenantConfig {
                name: "acme".into(),
                api_key: Some("sk-acme-123".into()),
                ..Default::default()
            }],
            trust_tenant_header: true,
            require_key: true,
            limits: Default::default(),
            anonymous: Default::default(),
            list_models_without_key: false,
        };
        let t = Tenancy::new(&cfg);
        let issued = none();
        assert_eq!(
            t.resolve(&HeaderMap::new(), Own::ANY, &issued),
            Err(Refused::MissingKey)
        );
        let named = headers(&[(TENANT_HEADER.as_str(), "team-7")]);
        assert_eq!(
            t.resolve(&named, Own::ANY, &issued),
            Err(Refused::MissingKey)
        );
        let wrong = headers(&[("authorization", "Bearer sk-nope")]);
        assert_eq!(
            t.resolve(&wrong, Own::ANY, &issued),
            Err(Refused::UnknownKey)
        );
        // An issued key works once created and stops when revoked.
        let (e, key) = issued.create("acme", 1).unwrap();
        let h = headers(&[("authorization", &format!("Bearer {key}"))]);
        let acme = t.resolve(&h, Own::ANY, &issued).unwrap();
        assert_eq!(
            (&*acme.name, acme.key_id.as_deref()),
            ("acme", Some(&*e.id))
        );
        issued.revoke(&e.id);
        assert_eq!(t.resolve(&h, Own::ANY, &issued), Err(Refused::UnknownKey));
        cfg.require_key = false;
        let open = Tenancy::new(&cfg);
        assert_eq!(
            open.resolve(&wrong, Own::ANY, &issued),
            Err(Refused::UnknownKey),
            "a revoked or wrong key is refused even when keys are optional"
        );
        assert_eq!(
            open.resolve(&h, Own::ANY, &issued),
            Err(Refused::UnknownKey)
        );
        assert_eq!(
            &*open
                .resolve(&HeaderMap::new(), Own::ANY, &issued)
                .unwrap()
                .name,
            ANONYMOUS_TENANT
        );
    }

    #[test]
    fn allowed_models_match_exactly_or_by_glob() {
        let t = tenancy(false);
        let acme = resolve(&t, &[("authorization", "Bearer sk-acme-123")]).unwrap();
        assert!(acme.allows("m") && acme.allows("llama-3-8b") && acme.allows("llama--8b"));
        assert!(!acme.allows("m2") && !acme.allows("llama-3-70b"));
        let globex = resolve(&t, &[("x-api-key", "sk-globex-456")]).unwrap();
        assert!(globex.allows("anything"));
    }

    #[test]
    fn keys_never_show_in_debug_output() {
        let t = tenancy(false);
        let acme = resolve(&t, &[("authorization", "Bearer sk-acme-123")]).unwrap();
        assert!(!format!("{acme:?}").contains("sk-acme-123"));
        assert!(acme.key_id.as_deref().unwrap().starts_with("cfg-"));
    }
}
