//! Tenancy (minimal): who is calling. A client's `Authorization: Bearer KEY` (or
//! Anthropic's `x-api-key: KEY`) is
//! mapped to a configured tenant through a map of key hashes (the keys themselves
//! are never stored here, logged or compared byte by byte); without a recognised
//! key the tenant is `anonymous`, or the `x-switchyard-tenant` header when the
//! config trusts it. The tenant travels with the request (`telemetry::RequestTags`)
//! so metrics and cost can use it; a tenant's residency (`[[tenants]] residency`)
//! is a hard constraint on the regions its requests may be served in.

use crate::config::observability::ANONYMOUS_TENANT;
use crate::config::{Residency, TenancyConfig};
use http::HeaderMap;
use std::collections::HashMap;
use std::sync::Arc;

/// Header naming the tenant, honoured only with `tenancy.trust_tenant_header`.
pub const TENANT_HEADER: http::HeaderName = http::HeaderName::from_static("x-switchyard-tenant");
/// Anthropic's API key header, read like `Authorization: Bearer`.
pub const API_KEY_HEADER: http::HeaderName = http::HeaderName::from_static("x-api-key");
/// Longest tenant name accepted from the header.
const MAX_HEADER_TENANT: usize = 64;

/// A resolved tenant. `name` is the tenant's real name (for routing and the access
/// log); metric labels go through the bounded label set in `telemetry`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tenant {
    pub name: Arc<str>,
    /// The tenant was identified by a configured API key.
    pub authenticated: bool,
    /// The regions this tenant's requests must stay in.
    pub residency: Option<Residency>,
    /// Latency objectives for requests that send none.
    pub slo: crate::api::Slo,
}

/// API-key → tenant lookup, built from the config.
pub struct Tenancy {
    by_key_hash: HashMap<[u8; 16], Tenant>,
    /// Names of the tenants that have keys: the header may not claim them.
    keyed: std::collections::HashSet<Arc<str>>,
    anonymous: Tenant,
    trust_header: bool,
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

/// A keyed 128-bit hash of an API key. The map holds only these, so a lookup's
/// timing does not depend on how many leading bytes of a key match.
fn key_hash(key: &[u8]) -> [u8; 16] {
    xxhash_rust::xxh3::xxh3_128_with_seed(key, 0x5357_4954_4348_5944).to_le_bytes()
}

impl Tenancy {
    pub fn new(cfg: &TenancyConfig) -> Tenancy {
        let by_key_hash = cfg
            .tenants
            .iter()
            .map(|t| {
                (
                    key_hash(t.api_key.expose().as_bytes()),
                    Tenant {
                        name: Arc::from(t.name.as_str()),
                        authenticated: true,
                        residency: t.residency.clone(),
                        slo: crate::api::Slo {
                            ttft_ms: t.slo_ttft_ms,
                            tpot_ms: t.slo_tpot_ms,
                        },
                    },
                )
            })
            .collect::<HashMap<_, Tenant>>();
        let keyed = by_key_hash.values().map(|t| t.name.clone()).collect();
        Tenancy {
            by_key_hash,
            keyed,
            anonymous: Tenant {
                name: Arc::from(ANONYMOUS_TENANT),
                authenticated: false,
                residency: None,
                slo: Default::default(),
            },
            trust_header: cfg.trust_tenant_header,
        }
    }

    /// The tenant of a request, from its headers. The tenant header is the
    /// trust boundary's one exception: with `trust_tenant_header` a front proxy
    /// may name a tenant, but never one that has keys (that needs the key).
    pub fn resolve(&self, headers: &HeaderMap) -> Result<Tenant, Refused> {
        // Anthropic's clients send their key as `x-api-key`.
        let bearer = headers
            .get(http::header::AUTHORIZATION)
            .and_then(|v| bearer_token(v.as_bytes()));
        let api_key = headers
            .get(API_KEY_HEADER)
            .map(|v| v.as_bytes().trim_ascii())
            .filter(|k| !k.is_empty());
        for k in [bearer, api_key].into_iter().flatten() {
            if let Some(t) = self.by_key_hash.get(&key_hash(k)) {
                return Ok(t.clone());
            }
        }
        if self.trust_header {
            let named = headers
                .get(TENANT_HEADER)
                .and_then(|v| v.to_str().ok())
                .filter(|v| {
                    !v.is_empty()
                        && v.len() <= MAX_HEADER_TENANT
                        && v.bytes()
                            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
                });
            if let Some(n) = named {
                if self.keyed.contains(n) {
                    return Err(Refused);
                }
                return Ok(Tenant {
                    name: Arc::from(n),
                    authenticated: false,
                    residency: None,
                    slo: Default::default(),
                });
            }
        }
        Ok(self.anonymous.clone())
    }
}

/// A request named, in the tenant header, a tenant that has API keys without
/// presenting one of them.
#[derive(Debug, PartialEq, Eq)]
pub struct Refused;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::observability::TenantConfig;

    fn tenancy(trust: bool) -> Tenancy {
        Tenancy::new(&TenancyConfig {
            tenants: vec![
                TenantConfig {
                    name: "acme".into(),
                    api_key: "sk-acme-123".into(),
                    residency: None,
                    slo_ttft_ms: None,
                    slo_tpot_ms: None,
                },
                TenantConfig {
                    name: "globex".into(),
                    api_key: "sk-globex-456".into(),
                    residency: None,
                    slo_ttft_ms: Some(250),
                    slo_tpot_ms: None,
                },
            ],
            trust_tenant_header: trust,
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

    #[test]
    fn keys_map_to_tenants_and_unknown_keys_are_anonymous() {
        let t = tenancy(false);
        let acme = t
            .resolve(&headers(&[("authorization", "Bearer sk-acme-123")]))
            .unwrap();
        assert_eq!(&*acme.name, "acme");
        assert!(acme.authenticated);
        assert_eq!(
            &*t.resolve(&headers(&[("authorization", "Bearer sk-globex-456")]))
                .unwrap()
                .name,
            "globex"
        );
        assert_eq!(
            &*t.resolve(&headers(&[("authorization", "Bearer sk-acme-12")]))
                .unwrap()
                .name,
            ANONYMOUS_TENANT
        );
        assert_eq!(
            &*t.resolve(&HeaderMap::new()).unwrap().name,
            ANONYMOUS_TENANT
        );
    }

    #[test]
    fn x_api_key_maps_to_tenants_like_bearer() {
        let t = tenancy(false);
        let h = headers(&[("x-api-key", "sk-acme-123")]);
        assert_eq!(&*t.resolve(&h).unwrap().name, "acme");
        // An unknown bearer token does not hide a known x-api-key.
        let both = headers(&[
            ("authorization", "Bearer nope"),
            ("x-api-key", "sk-globex-456"),
        ]);
        assert_eq!(&*t.resolve(&both).unwrap().name, "globex");
        let wrong = headers(&[("x-api-key", "sk-acme-12")]);
        assert_eq!(&*t.resolve(&wrong).unwrap().name, ANONYMOUS_TENANT);
    }

    #[test]
    fn the_tenant_header_is_honoured_only_when_trusted() {
        let h = headers(&[(TENANT_HEADER.as_str(), "team-7")]);
        assert_eq!(&*tenancy(false).resolve(&h).unwrap().name, ANONYMOUS_TENANT);
        assert_eq!(&*tenancy(true).resolve(&h).unwrap().name, "team-7");
        // A key wins over the header; odd header values are ignored.
        let both = headers(&[
            (TENANT_HEADER.as_str(), "team-7"),
            ("authorization", "Bearer sk-acme-123"),
        ]);
        assert_eq!(&*tenancy(true).resolve(&both).unwrap().name, "acme");
        let odd = headers(&[(TENANT_HEADER.as_str(), "a b")]);
        assert_eq!(
            &*tenancy(true).resolve(&odd).unwrap().name,
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
        assert_eq!(&*t.resolve(&lower).unwrap().name, "acme");
    }

    #[test]
    fn the_tenant_header_cannot_claim_a_keyed_tenant() {
        let claim = headers(&[(TENANT_HEADER.as_str(), "acme")]);
        assert_eq!(tenancy(true).resolve(&claim), Err(Refused));
        // Untrusted, the header is ignored altogether.
        assert_eq!(
            &*tenancy(false).resolve(&claim).unwrap().name,
            ANONYMOUS_TENANT
        );
        // With acme's key the request is acme's, whatever the header says.
        let keyed = headers(&[
            (TENANT_HEADER.as_str(), "globex"),
            ("authorization", "Bearer sk-acme-123"),
        ]);
        assert_eq!(&*tenancy(true).resolve(&keyed).unwrap().name, "acme");
    }
}
