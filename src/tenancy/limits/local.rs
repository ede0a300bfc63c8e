//! The in-process store: per scope, a GCRA cell each for requests and tokens,
//! an atomic count of requests in flight, and the spend sums. A refusal gives
//! back what the earlier scopes took; an admitted request's slots are released
//! when its [`Held`] drops.

use super::gcra::{self, Cell};
use super::headers::{tighter, RateHeaders};
use super::spend::{Calendar, Spend};
use super::{refusal, secs, unix_s, Admitted, LimitKind, Refusal, ScopeRef};
use crate::config::limits::Limits;
use dashmap::DashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tokio::time::Instant;

/// One scope's state.
#[derive(Default)]
pub(super) struct Scope {
    requests: Cell,
    tokens: Cell,
    in_flight: AtomicU64,
    spend: Spend,
}

/// Every scope's state, by scope key.
pub(super) struct Local {
    scopes: DashMap<Box<str>, Arc<Scope>>,
    epoch: Instant,
}

impl Default for Local {
    fn default() -> Local {
        Local {
            scopes: DashMap::new(),
            epoch: crate::runtime::clock::now(),
        }
    }
}

/// Nanoseconds on the limiter's clock, offset by a window so that "full"
/// (TAT 0) is in the past from the start.
fn now_ns(epoch: Instant) -> u64 {
    crate::runtime::clock::now()
        .saturating_duration_since(epoch)
        .as_nanos() as u64
        + gcra::WINDOW_NS
}

/// What one scope holds for an admitted request.
struct HeldScope {
    scope: Arc<Scope>,
    limits: Limits,
    counted: bool,
    took_request: bool,
    took_tokens: bool,
}

/// An admitted request's share of the local scopes.
pub(super) struct Held {
    held: Vec<HeldScope>,
    estimate: u64,
    epoch: Instant,
}

impl Local {
    pub(super) fn admit(
        &self,
        scopes: &[ScopeRef<'_>],
        tokens: u64,
    ) -> Result<Admitted, Box<Refusal>> {
        let now = now_ns(self.epoch);
        let cal = Calendar::at(unix_s());
        let mut held = Held {
            held: Vec::with_capacity(scopes.len()),
            estimate: tokens,
            epoch: self.epoch,
        };
        let mut headers = RateHeaders::default();
        for s in scopes {
            let scope = self.scope(&s.key);
            if let Err(mut r) = held.take(scope, s, now, cal, &mut headers) {
                held.rollback(now);
                r.headers = headers;
                return Err(r);
            }
        }
        Ok(Admitted {
            headers,
            held: super::Held::Local(held),
        })
    }

    fn scope(&self, key: &str) -> Arc<Scope> {
        if let Some(s) = self.scopes.get(key) {
            return s.clone();
        }
        self.scopes.entry(key.into()).or_default().clone()
    }

    pub(super) fn forget(&self, key: &str) {
        self.scopes.remove(key);
    }
}

impl Held {
    /// Take this request's share of one scope, or say which limit it is over.
    fn take(
        &mut self,
        scope: Arc<Scope>,
        s: &ScopeRef<'_>,
        now: u64,
        cal: Calendar,
        headers: &mut RateHeaders,
    ) -> Result<(), Box<Refusal>> {
        let l = s.limits;
        let tokens = self.estimate;
        self.held.push(HeldScope {
            scope: scope.clone(),
            limits: l.clone(),
            counted: l.max_concurrent_requests.is_some(),
            took_request: false,
            took_tokens: false,
        });
        let held = self.held.last_mut().expect("just pushed");
        if let Some(max) = l.max_concurrent_requests {
            if scope.in_flight.fetch_add(1, Ordering::AcqRel) >= max {
                return Err(refusal(LimitKind::Concurrency, s, tokens, 0.0, 1));
            }
        }
        let (day, month) = scope.spend.spent(cal);
        if l.daily_budget_usd.is_some_and(|b| day >= b) {
            return Err(refusal(
                LimitKind::DailyBudget,
                s,
                tokens,
                day,
                cal.day_left_s,
            ));
        }
        if l.monthly_budget_usd.is_some_and(|b| month >= b) {
            let r = refusal(LimitKind::MonthlyBudget, s, tokens, month, cal.month_left_s);
            return Err(r);
        }
        if let Some(rpm) = l.requests_per_minute {
            let taken = scope.requests.take(now, 1, rpm);
            let w = match taken {
                Ok(w) | Err((_, w)) => w,
            };
            headers.requests = tighter(headers.requests, w);
            if let Err((wait, _)) = taken {
                return Err(refusal(LimitKind::Requests, s, tokens, 0.0, secs(wait)));
            }
            held.took_request = true;
        }
        if let Some(tpm) = l.tokens_per_minute {
            let taken = scope.tokens.take(now, tokens, tpm);
            let w = match taken {
                Ok(w) | Err((_, w)) => w,
            };
            headers.tokens = tighter(headers.tokens, w);
            if let Err((wait, _)) = taken {
                return Err(refusal(LimitKind::Tokens, s, tokens, 0.0, secs(wait)));
            }
            held.took_tokens = true;
        }
        Ok(())
    }

    /// Give back what a refused request took (its concurrency slots go on drop).
    fn rollback(&mut self, now: u64) {
        for h in &mut self.held {
            if let (true, Some(rpm)) = (h.took_request, h.limits.requests_per_minute) {
                h.scope.requests.refund(now, 1, rpm);
            }
            if let (true, Some(tpm)) = (h.took_tokens, h.limits.tokens_per_minute) {
                h.scope.tokens.refund(now, self.estimate, tpm);
            }
        }
    }

    pub(super) fn settle(&self, used_tokens: Option<u64>, usd: f64) {
        let now = now_ns(self.epoch);
        let cal = Calendar::at(unix_s());
        for h in &self.held {
            if let (Some(tpm), Some(used)) = (h.limits.tokens_per_minute, used_tokens) {
                if used > self.estimate {
                    h.scope.tokens.force(now, used - self.estimate, tpm);
                } else {
                    h.scope.tokens.refund(now, self.estimate - used, tpm);
                }
            }
            if h.limits.daily_budget_usd.is_some() || h.limits.monthly_budget_usd.is_some() {
                h.scope.spend.add(cal, usd);
            }
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        for h in &self.held {
            if h.counted {
                h.scope.in_flight.fetch_sub(1, Ordering::AcqRel);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::Limiter;
    use super::*;
    use crate::config::limits::LimitsStore;
    use crate::tenancy::{Tenant, TenantPolicy};

    fn tenant(limits: Limits, key_limits: Limits) -> Tenant {
        Tenant {
            name: "acme".into(),
            authenticated: true,
            residency: None,
            key_id: Some("k1".into()),
            policy: Some(Arc::new(TenantPolicy {
                limits,
                key_limits,
                ..Default::default()
            })),
            slo: Default::default(),
            claims: crate::tenancy::ClaimRules::anonymous(&Default::default()),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_refusal_names_its_limit_and_gives_back_what_others_took() {
        let l = Limiter::new(&LimitsStore::Memory);
        let rpm = |n| Limits {
            requests_per_minute: Some(n),
            ..Default::default()
        };
        let t = tenant(rpm(2), rpm(10));
        let a = l.admit(&t, "m", 1).await.unwrap().unwrap();
        assert_eq!(a.headers.requests.unwrap().remaining, 1);
        l.admit(&t, "m", 1).await.unwrap().unwrap();
        let r = l.admit(&t, "m", 1).await.unwrap_err();
        assert_eq!(
            (r.kind, r.scope.as_str()),
            (LimitKind::Requests, "tenant `acme`")
        );
        assert_eq!(r.retry_after_s, 30);
        assert!(r.message().contains("2 requests per minute"));
        // The key's own cell got its unit back: 8 of 10 left, not 7.
        let key = l.local.scope("k|k1");
        let now = now_ns(l.local.epoch);
        assert_eq!(key.requests.take(now, 0, 10).unwrap().remaining, 8);
    }

    #[tokio::test(start_paused = true)]
    async fn concurrency_slots_are_released_when_the_request_ends() {
        let l = Limiter::new(&LimitsStore::Memory);
        let one = Limits {
            max_concurrent_requests: Some(1),
            ..Default::default()
        };
        let t = tenant(one, Limits::default());
        let a = l.admit(&t, "m", 1).await.unwrap().unwrap();
        let r = l.admit(&t, "m", 1).await.unwrap_err();
        assert_eq!(r.kind, LimitKind::Concurrency);
        drop(a);
        assert!(l.admit(&t, "m", 1).await.is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn usage_corrects_the_estimate_and_cost_spends_the_budget() {
        let l = Limiter::new(&LimitsStore::Memory);
        let limits = Limits {
            tokens_per_minute: Some(100),
            daily_budget_usd: Some(0.01),
            ..Default::default()
        };
        let t = tenant(limits, Limits::default());
        let a = l.admit(&t, "m", 10).await.unwrap().unwrap();
        assert_eq!(a.headers.tokens.unwrap().remaining, 90);
        a.settle(Some(60), 0.01);
        drop(a);
        let r = l.admit(&t, "m", 10).await.unwrap_err();
        assert_eq!(r.kind, LimitKind::DailyBudget);
        assert!(r.message().contains("daily_budget_usd"), "{}", r.message());
    }
}
