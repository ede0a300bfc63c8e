//! What a client may claim by header. `x-switchyard-priority` and the `x-slo-*`
//! objectives are requests, not orders: a tenant's configuration says how far
//! they are honoured (`[[tenants]] max_priority`, `allow_slo_headers`; for
//! callers without a configured tenant `[tenancy] anonymous_*`). A claim beyond
//! that is capped to what the tenant may have, never refused (the request is
//! still served), and counted in `switchyard_client_claims_total` with a debug
//! line, so operators see clients trying. A name that is no class is a 400.

use crate::api::Slo;
use crate::config::flow::Priority;
use crate::telemetry::names;

/// How far a tenant's headers are honoured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClaimRules {
    /// The class of a request that asks for none.
    pub default: Priority,
    /// The highest class a request may ask for.
    pub max: Priority,
    /// Objectives may be set tighter than the tenant's own.
    pub slo_headers: bool,
}

/// An anonymous caller's rules with the default settings.
impl Default for ClaimRules {
    fn default() -> Self {
        ClaimRules::anonymous(&Default::default())
    }
}

impl ClaimRules {
    /// The rules of callers without a configured tenant.
    pub fn anonymous(c: &crate::config::observability::AnonymousClaims) -> ClaimRules {
        ClaimRules {
            default: Priority::Normal.max(c.max_priority),
            max: c.max_priority,
            slo_headers: c.allow_slo_headers,
        }
    }

    /// The class honoured for a request asking for `asked` (`None`: no header).
    /// `Err`: the header names no class (the message says which exist).
    pub fn priority(&self, asked: Option<&str>, tenant: &str) -> Result<Priority, String> {
        let Some(name) = asked else {
            return Ok(self.default);
        };
        let Some(class) = Priority::from_name(&name.trim().to_ascii_lowercase()) else {
            return Err(format!(
                "Header `x-switchyard-priority`: unknown priority class `{}` (one of {})",
                crate::api::error::echo(name),
                Priority::NAMES
            ));
        };
        if class < self.max {
            noted("priority", "capped", tenant);
            return Ok(self.max);
        }
        Ok(class)
    }

    /// The objectives honoured: the header's where the tenant allows them,
    /// else only where they loosen the tenant's own (`defaults`); a header
    /// with no objective of the tenant's to loosen is ignored.
    pub fn slo(&self, asked: Slo, defaults: Slo, tenant: &str) -> Slo {
        if self.slo_headers {
            return Slo {
                ttft_ms: asked.ttft_ms.or(defaults.ttft_ms),
                tpot_ms: asked.tpot_ms.or(defaults.tpot_ms),
            };
        }
        let one = |asked: Option<u32>, own: Option<u32>| match (asked, own) {
            (None, own) => own,
            (Some(a), Some(o)) if a >= o => Some(a),
            (Some(_), Some(o)) => {
                noted("slo", "capped", tenant);
                Some(o)
            }
            (Some(_), None) => {
                noted("slo", "ignored", tenant);
                None
            }
        };
        Slo {
            ttft_ms: one(asked.ttft_ms, defaults.ttft_ms),
            tpot_ms: one(asked.tpot_ms, defaults.tpot_ms),
        }
    }
}

/// A claim not honoured as asked: counted (bounded labels) and logged at debug.
pub fn noted(claim: &'static str, action: &'static str, tenant: &str) {
    metrics::counter!(names::CLIENT_CLAIMS_TOTAL, names::L_CLAIM => claim, names::L_ACTION => action)
        .increment(1);
    tracing::debug!(claim, action, tenant, "client claim not honoured as asked");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(default: Priority, max: Priority, slo_headers: bool) -> ClaimRules {
        ClaimRules {
            default,
            max,
            slo_headers,
        }
    }

    #[test]
    fn priority_is_capped_at_the_tenants_maximum_and_may_be_lowered() {
        let low = rules(Priority::Low, Priority::Low, false);
        assert_eq!(low.priority(Some("critical"), "t"), Ok(Priority::Low));
        assert_eq!(low.priority(None, "t"), Ok(Priority::Low));
        let high = rules(Priority::Normal, Priority::High, false);
        assert_eq!(high.priority(Some("critical"), "t"), Ok(Priority::High));
        assert_eq!(high.priority(Some("High"), "t"), Ok(Priority::High));
        assert_eq!(high.priority(Some("low"), "t"), Ok(Priority::Low));
        assert_eq!(high.priority(None, "t"), Ok(Priority::Normal));
        let e = high.priority(Some("urgent"), "t").unwrap_err();
        assert!(
            e.contains("`urgent`") && e.contains("critical, high"),
            "{e}"
        );
    }

    #[test]
    fn anonymous_callers_get_at_most_their_configured_class() {
        let mut c = crate::config::observability::AnonymousClaims::default();
        let r = ClaimRules::anonymous(&c);
        assert_eq!(
            r.priority(Some("critical"), "anonymous"),
            Ok(Priority::Normal)
        );
        c.max_priority = Priority::Low;
        let r = ClaimRules::anonymous(&c);
        assert_eq!(r.priority(None, "anonymous"), Ok(Priority::Low));
        c.max_priority = Priority::Critical;
        let r = ClaimRules::anonymous(&c);
        assert_eq!(r.priority(None, "anonymous"), Ok(Priority::Normal));
        assert_eq!(r.priority(Some("critical"), "x"), Ok(Priority::Critical));
    }

    #[test]
    fn objectives_may_only_loosen_unless_allowed() {
        let own = Slo {
            ttft_ms: Some(500),
            tpot_ms: None,
        };
        let asked = Slo {
            ttft_ms: Some(50),
            tpot_ms: Some(10),
        };
        let strict = rules(Priority::Normal, Priority::Normal, false);
        assert_eq!(strict.slo(asked, own, "t"), own, "tighter: the tenant's");
        let looser = Slo {
            ttft_ms: Some(900),
            tpot_ms: None,
        };
        assert_eq!(strict.slo(looser, own, "t"), looser);
        assert_eq!(strict.slo(Slo::default(), own, "t"), own);
        let open = rules(Priority::Normal, Priority::Normal, true);
        assert_eq!(open.slo(asked, own, "t"), asked);
    }
}
