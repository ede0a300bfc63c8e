//! The in-process store: per scope, a GCRA cell each for requests and tokens,
//! an atomic count of requests in flight, and the spend sums. A refusal gives
//! back what the earlier scopes took; an admitted request's slots are released
//! when its [`Held`] drops.

use super::gcra::{self, Cell};
use super::headers::{tighter, RateHeaders};
use super::spend::{Calendar, Spend};
use super::{refusal, secs, unix_s, Admitted, Ask, LimitKind, Refusal, ScopeRef, Usage};
use crate::config::limits::Limits;
use dashmap::DashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
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
    took_spend: bool,
}

/// An admitted request's share of the local scopes.
pub(super) struct Held {
    held: Vec<HeldScope>,
    ask: Ask,
    /// The calendar at admission: the period the spend was reserved in.
    cal: Calendar,
    epoch: Instant,
    settled: AtomicBool,
}

impl Local {
    pub(super) fn admit(
        &self,
        scopes: &[ScopeRef<'_>],
        ask: Ask,
    ) -> Result<Admitted, Box<Refusal>> {
        let now = now_ns(self.epoch);
        let mut held = Held {
            held: Vec::with_capacity(scopes.len()),
            ask,
            cal: Calendar::at(unix_s()),
            epoch: self.epoch,
            settled: AtomicBool::new(false),
        };
        let mut headers = RateHeaders::default();
        for s in scopes {
            let scope = self.scope(&s.key);
            if let Err(mut r) = held.take(scope, s, now, &mut headers) {
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

/// Reserve `ask`'s worst cost in the scope's budgets, if it has any (`true`
/// when something was reserved).
fn reserve_spend(
    scope: &Scope,
    s: &ScopeRef<'_>,
    ask: Ask,
    cal: Calendar,
) -> Result<bool, Box<Refusal>> {
    let l = s.limits;
    if l.daily_budget_usd.is_none() && l.monthly_budget_usd.is_none() {
        return Ok(false);
    }
    let budgets = (l.daily_budget_usd, l.monthly_budget_usd);
    scope
        .spend
        .reserve(cal, ask.nano_usd(), budgets)
        .map_err(|(kind, spent)| {
            let left = match kind {
                LimitKind::DailyBudget => cal.day_left_s,
                _ => cal.month_left_s,
            };
            refusal(kind, s, ask, spent, left)
        })?;
    Ok(true)
}

impl Held {
    /// Take this request's share of one scope, or say which limit it is over.
    fn take(
        &mut self,
        scope: Arc<Scope>,
        s: &ScopeRef<'_>,
        now: u64,
        headers: &mut RateHeaders,
    ) -> Result<(), Box<Refusal>> {
        let (l, ask, cal) = (s.limits, self.ask, self.cal);
        self.held.push(HeldScope {
            scope: scope.clone(),
            limits: l.clone(),
            counted: l.max_concurrent_requests.is_some(),
            took_request: false,
            took_tokens: false,
            took_spend: false,
        });
        let held = self.held.last_mut().expect("just pushed");
        if let Some(max) = l.max_concurrent_requests {
            if scope.in_flight.fetch_add(1, Ordering::AcqRel) >= max {
                return Err(refusal(LimitKind::Concurrency, s, ask, 0.0, 1));
            }
        }
        held.took_spend = reserve_spend(&scope, s, ask, cal)?;
        if let Some(rpm) = l.requests_per_minute {
            let taken = scope.requests.take(now, 1, rpm);
            let w = match taken {
                Ok(w) | Err((_, w)) => w,
            };
            headers.requests = tighter(headers.requests, w);
            if let Err((wait, _)) = taken {
                return Err(refusal(LimitKind::Requests, s, ask, 0.0, secs(wait)));
            }
            held.took_request = true;
        }
        if let Some(tpm) = l.tokens_per_minute {
            let taken = scope.tokens.take(now, ask.tokens(), tpm);
            let w = match taken {
                Ok(w) | Err((_, w)) => w,
            };
            headers.tokens = tighter(headers.tokens, w);
            if let Err((wait, _)) = taken {
                return Err(refusal(LimitKind::Tokens, s, ask, 0.0, secs(wait)));
            }
            held.took_tokens = true;
        }
        Ok(())
    }

    /// Give back what a refused request took (its concurrency slots go on drop).
    fn rollback(&mut self, now: u64) {
        let (tokens, nano) = (self.ask.tokens(), self.ask.nano_usd());
        for h in &mut self.held {
            if let (true, Some(rpm)) = (h.took_request, h.limits.requests_per_minute) {
                h.scope.requests.refund(now, 1, rpm);
            }
            if let (true, Some(tpm)) = (h.took_tokens, h.limits.tokens_per_minute) {
                h.scope.tokens.refund(now, tokens, tpm);
            }
            if h.took_spend {
                h.scope.spend.adjust(self.cal, -(nano as i64));
            }
        }
    }

    /// Replace the reservation with the usage, once.
    pub(super) fn settle(&self, usage: Usage) {
        if self.settled.swap(true, Ordering::AcqRel) {
            return;
        }
        let now = now_ns(self.epoch);
        let estimate = self.ask.tokens();
        let reserved = self.ask.nano_usd();
        let spend_diff = usage.nano_usd(reserved) as i64 - reserved as i64;
        for h in &self.held {
            if let (Some(tpm), Some(used), true) = (
                h.limits.tokens_per_minute,
                usage.tokens_used(),
                h.took_tokens,
            ) {
                if used > estimate {
                    h.scope.tokens.force(now, used - estimate, tpm);
                } else {
                    h.scope.tokens.refund(now, estimate - used, tpm);
                }
            }
            if let (true, Some(rpm), true) =
                (usage.refused, h.limits.requests_per_minute, h.took_request)
            {
                h.scope.requests.refund(now, 1, rpm);
            }
            if h.took_spend {
                h.scope.spend.adjust(self.cal, spend_diff);
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

    fn ask(prompt: u64) -> Ask {
        Ask {
            prompt,
            ..Ask::default()
        }
    }

    fn used(tokens: u64, usd: f64) -> Usage {
        Usage {
            tokens: Some(tokens),
            usd,
            refused: false,
        }
    }

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
        let a = l.admit(&t, "m", ask(1)).await.unwrap().unwrap();
        assert_eq!(a.headers.requests.unwrap().remaining, 1);
        l.admit(&t, "m", ask(1)).await.unwrap().unwrap();
        let r = l.admit(&t, "m", ask(1)).await.unwrap_err();
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
        let a = l.admit(&t, "m", ask(1)).await.unwrap().unwrap();
        let r = l.admit(&t, "m", ask(1)).await.unwrap_err();
        assert_eq!(r.kind, LimitKind::Concurrency);
        drop(a);
        assert!(l.admit(&t, "m", ask(1)).await.is_ok());
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
        let a = l.admit(&t, "m", ask(10)).await.unwrap().unwrap();
        assert_eq!(a.headers.tokens.unwrap().remaining, 90);
        a.settle(used(60, 0.01));
        drop(a);
        let r = l.admit(&t, "m", ask(10)).await.unwrap_err();
        assert_eq!(r.kind, LimitKind::DailyBudget);
        assert!(r.message().contains("daily_budget_usd"), "{}", r.message());
    }

    /// 600 tokens a minute, requests that may use 250: two fit at once, a
    /// third waits; a request that may use 700 never fits, and takes nothing.
    #[tokio::test(start_paused = true)]
    async fn the_worst_case_is_reserved_and_the_rest_given_back_once() {
        let l = Limiter::new(&LimitsStore::Memory);
        let tpm = Limits {
            tokens_per_minute: Some(600),
            ..Default::default()
        };
        let t = tenant(tpm, Limits::default());
        let worst = Ask {
            prompt: 50,
            output: 200,
            usd: 0.0,
        };
        let a = l.admit(&t, "m", worst).await.unwrap().unwrap();
        let b = l.admit(&t, "m", worst).await.unwrap().unwrap();
        let r = l.admit(&t, "m", worst).await.unwrap_err();
        assert!(!r.never && r.retry_after_s > 0, "{r:?}");
        let huge = Ask {
            output: 650,
            ..worst
        };
        let r = l.admit(&t, "m", huge).await.unwrap_err();
        assert!(r.never && r.kind == LimitKind::Tokens, "{r:?}");
        assert!(r.message().contains("can never fit"), "{}", r.message());
        // `a` used 60 tokens: 190 come back, once, and a third request fits.
        a.settle(used(60, 0.0));
        a.settle(used(60, 0.0));
        let c = l.admit(&t, "m", worst).await.unwrap().unwrap();
        assert_eq!(c.headers.tokens.unwrap().remaining, 600 - 60 - 250 - 250);
        // Refused by the gateway after admission: the reservation comes back whole.
        b.settle(Usage {
            refused: true,
            ..Usage::default()
        });
        let d = l.admit(&t, "m", ask(0)).await.unwrap().unwrap();
        assert_eq!(d.headers.tokens.unwrap().remaining, 600 - 60 - 250);
    }

    /// A $1 day and requests that may cost $0.40: two fit, the third is
    /// refused until one of them settles for less; one that may cost $2 never fits.
    #[tokio::test(start_paused = true)]
    async fn budgets_reserve_the_worst_cost() {
        let l = Limiter::new(&LimitsStore::Memory);
        let day = Limits {
            daily_budget_usd: Some(1.0),
            requests_per_minute: Some(100),
            ..Default::default()
        };
        let t = tenant(day, Limits::default());
        let worst = Ask {
            prompt: 1,
            output: 1,
            usd: 0.4,
        };
        let a = l.admit(&t, "m", worst).await.unwrap().unwrap();
        let _b = l.admit(&t, "m", worst).await.unwrap().unwrap();
        let r = l.admit(&t, "m", worst).await.unwrap_err();
        assert_eq!((r.kind, r.never), (LimitKind::DailyBudget, false));
        let r = l
            .admit(&t, "m", Ask { usd: 2.0, ..worst })
            .await
            .unwrap_err();
        assert_eq!((r.kind, r.never), (LimitKind::DailyBudget, true));
        a.settle(used(2, 0.1));
        let _c = l.admit(&t, "m", worst).await.unwrap().unwrap();
        // The refusals took nothing: 0.1 + 0.4 + 0.4 spent or reserved.
        let (spent, _) = l.local.scope("t|acme").spend.spent(Calendar::at(unix_s()));
        assert!((spent - 0.9).abs() < 1e-9, "{spent}");
    }

    /// A request the gateway refused after admission gives its request back.
    #[tokio::test(start_paused = true)]
    async fn a_request_refused_after_admission_is_not_charged() {
        let l = Limiter::new(&LimitsStore::Memory);
        let rpm = Limits {
            requests_per_minute: Some(1),
            ..Default::default()
        };
        let t = tenant(rpm, Limits::default());
        let a = l.admit(&t, "m", ask(1)).await.unwrap().unwrap();
        a.settle(Usage {
            refused: true,
            ..Usage::default()
        });
        let b = l.admit(&t, "m", ask(1)).await.unwrap().unwrap();
        b.settle(used(5, 0.0));
        assert!(l.admit(&t, "m", ask(1)).await.is_err());
    }
}
