//! Limits per key, per tenant and per (tenant, model): requests and tokens per
//! minute (GCRA, `gcra`), concurrent requests (a counter released when the
//! request's context drops) and spend budgets per UTC day and month (`spend`).
//! A request is checked against every scope that has a limit before anything
//! is kept: a refusal gives back what the earlier scopes took. Its tokens are
//! estimated up front and corrected with the real usage when it ends
//! ([`Admitted::settle`]), which also adds its cost to the budgets.
//!
//! State lives in the [`Limiter`], which outlives config reloads; the limits
//! themselves are read from the tenant's policy on every request, so a reload
//! changes them at once. Scopes exist only for configured limits (tenants,
//! their keys, their configured models), so the map is bounded by the config
//! and the issued-key cap.

pub mod gcra;
pub mod headers;
pub mod spend;

use super::Tenant;
use crate::config::limits::Limits;
use dashmap::DashMap;
use gcra::Cell;
use headers::{tighter, RateHeaders};
use spend::{Calendar, Spend};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tokio::time::Instant;

/// One scope's state.
#[derive(Default)]
struct Scope {
    requests: Cell,
    tokens: Cell,
    in_flight: AtomicU64,
    spend: Spend,
}

/// The limiter's state: every scope's cells, counters and spend.
pub struct Limiter {
    scopes: DashMap<Box<str>, Arc<Scope>>,
    epoch: Instant,
}

impl Default for Limiter {
    fn default() -> Limiter {
        Limiter {
            scopes: DashMap::new(),
            epoch: crate::runtime::clock::now(),
        }
    }
}

/// Which limit refused a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LimitKind {
    Requests,
    Tokens,
    Concurrency,
    DailyBudget,
    MonthlyBudget,
}

impl LimitKind {
    /// The limit's config field: the error's `param` and the metric's `reason`.
    pub fn as_str(self) -> &'static str {
        match self {
            LimitKind::Requests => "requests_per_minute",
            LimitKind::Tokens => "tokens_per_minute",
            LimitKind::Concurrency => "max_concurrent_requests",
            LimitKind::DailyBudget => "daily_budget_usd",
            LimitKind::MonthlyBudget => "monthly_budget_usd",
        }
    }

    /// A spend budget (OpenAI's `insufficient_quota`) rather than a rate.
    pub fn is_budget(self) -> bool {
        matches!(self, LimitKind::DailyBudget | LimitKind::MonthlyBudget)
    }
}

/// A request over a limit: which one, whose, and when to come back.
#[derive(Debug, PartialEq)]
pub struct Refusal {
    pub kind: LimitKind,
    /// Whose limit, in words: "tenant `acme`", "key `ab12cd34`", "tenant `acme` on model `m`".
    pub scope: String,
    /// The limit's value, in words ("600 requests per minute", "$5 per day").
    pub limit: String,
    pub retry_after_s: u64,
    pub headers: RateHeaders,
}

impl Refusal {
    /// The client's message: the limit named.
    pub fn message(&self) -> String {
        if self.kind.is_budget() {
            format!(
                "Budget exhausted for {}: {} ({}). It renews in {}s.",
                self.scope,
                self.limit,
                self.kind.as_str(),
                self.retry_after_s
            )
        } else {
            format!(
                "Rate limit reached for {}: {} ({}). Retry after {}s.",
                self.scope,
                self.limit,
                self.kind.as_str(),
                self.retry_after_s
            )
        }
    }
}

/// What one scope holds for an admitted request.
struct Held {
    scope: Arc<Scope>,
    limits: Limits,
    counted: bool,
    took_request: bool,
    took_tokens: bool,
}

/// An admitted request's share of its scopes: the concurrency slots (released on
/// drop), the estimate to correct, and the headers to send.
pub struct Admitted {
    held: Vec<Held>,
    estimate: u64,
    epoch: Instant,
    pub headers: RateHeaders,
}

impl std::fmt::Debug for Admitted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admitted")
            .field("scopes", &self.held.len())
            .field("estimate", &self.estimate)
            .finish()
    }
}

fn now_ns(epoch: Instant) -> u64 {
    // Offset by a window so "full" (TAT 0) is in the past from the start.
    crate::runtime::clock::now()
        .saturating_duration_since(epoch)
        .as_nanos() as u64
        + gcra::WINDOW_NS
}

fn unix_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn secs(ns: u64) -> u64 {
    ns.div_ceil(1_000_000_000).max(1)
}

impl Limiter {
    /// Check `tenant`'s request for `model` estimated at `tokens` against every
    /// scope with a limit; `None` when none applies.
    pub fn admit(
        &self,
        tenant: &Tenant,
        model: &str,
        tokens: u64,
    ) -> Result<Option<Admitted>, Box<Refusal>> {
        let Some(policy) = &tenant.policy else {
            return Ok(None);
        };
        let mut scopes: Vec<(String, &Limits, String)> = Vec::with_capacity(3);
        if let Some(id) = tenant
            .key_id
            .as_deref()
            .filter(|_| !policy.key_limits.is_empty())
        {
            scopes.push((
                format!("k\0{id}"),
                &policy.key_limits,
                format!("key `{id}`"),
            ));
        }
        let name = &tenant.name;
        if !policy.limits.is_empty() {
            scopes.push((
                format!("t\0{name}"),
                &policy.limits,
                format!("tenant `{name}`"),
            ));
        }
        if let Some(l) = policy.model_limits.get(model).filter(|l| !l.is_empty()) {
            let who = format!("tenant `{name}` on model `{model}`");
            scopes.push((format!("m\0{name}\0{model}"), l, who));
        }
        if scopes.is_empty() {
            return Ok(None);
        }
        let now = now_ns(self.epoch);
        let cal = Calendar::at(unix_s());
        let mut adm = Admitted {
            held: Vec::with_capacity(scopes.len()),
            estimate: tokens,
            epoch: self.epoch,
            headers: RateHeaders::default(),
        };
        for (key, limits, who) in scopes {
            let scope = self.scope(key);
            if let Err(mut r) = adm.take(scope, limits, now, cal) {
                r.scope = who;
                adm.rollback(now);
                r.headers = adm.headers;
                return Err(r);
            }
        }
        Ok(Some(adm))
    }

    fn scope(&self, key: String) -> Arc<Scope> {
        if let Some(s) = self.scopes.get(key.as_str()) {
            return s.clone();
        }
        self.scopes.entry(key.into()).or_default().clone()
    }

    /// Drop a revoked key's state.
    pub fn forget_key(&self, id: &str) {
        self.scopes.remove(format!("k\0{id}").as_str());
    }
}

impl Admitted {
    /// Take this request's share of one scope, or say which limit it is over.
    fn take(
        &mut self,
        scope: Arc<Scope>,
        limits: &Limits,
        now: u64,
        cal: Calendar,
    ) -> Result<(), Box<Refusal>> {
        let refuse = |kind, limit: String, retry_after_s| {
            Box::new(Refusal {
                kind,
                scope: String::new(),
                limit,
                retry_after_s,
                headers: RateHeaders::default(),
            })
        };
        let mut held = Held {
            scope,
            limits: limits.clone(),
            counted: false,
            took_request: false,
            took_tokens: false,
        };
        let s = held.scope.clone();
        if let Some(max) = limits.max_concurrent_requests {
            held.counted = true;
            let n = s.in_flight.fetch_add(1, Ordering::AcqRel) + 1;
            if n > max {
                self.held.push(held);
                let what = format!("{max} concurrent requests");
                return Err(refuse(LimitKind::Concurrency, what, 1));
            }
        }
        self.held.push(held);
        let held = self.held.last_mut().expect("just pushed");
        let (day, month) = s.spend.spent(cal);
        if let Some(b) = limits.daily_budget_usd.filter(|b| day >= *b) {
            let what = format!("${b} per day, ${day:.6} spent");
            return Err(refuse(LimitKind::DailyBudget, what, cal.day_left_s));
        }
        if let Some(b) = limits.monthly_budget_usd.filter(|b| month >= *b) {
            let what = format!("${b} per month, ${month:.6} spent");
            return Err(refuse(LimitKind::MonthlyBudget, what, cal.month_left_s));
        }
        if let Some(rpm) = limits.requests_per_minute {
            let (w, r) = match s.requests.take(now, 1, rpm) {
                Ok(w) => (w, None),
                Err((wait, w)) => (w, Some(wait)),
            };
            self.headers.requests = tighter(self.headers.requests, w);
            if let Some(wait) = r {
                let what = format!("{rpm} requests per minute");
                return Err(refuse(LimitKind::Requests, what, secs(wait)));
            }
            held.took_request = true;
        }
        if let Some(tpm) = limits.tokens_per_minute {
            let (w, r) = match s.tokens.take(now, self.estimate, tpm) {
                Ok(w) => (w, None),
                Err((wait, w)) => (w, Some(wait)),
            };
            self.headers.tokens = tighter(self.headers.tokens, w);
            if let Some(wait) = r {
                let what = format!(
                    "{tpm} tokens per minute, this request needs {}",
                    self.estimate
                );
                return Err(refuse(LimitKind::Tokens, what, secs(wait)));
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

    /// The request ended: correct the token estimate with the tokens it used
    /// (when known) and add its cost to the budgets.
    pub fn settle(&self, used_tokens: Option<u64>, usd: f64) {
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

impl Drop for Admitted {
    fn drop(&mut self) {
        for h in &self.held {
            if h.counted {
                h.scope.in_flight.fetch_sub(1, Ordering::AcqRel);
            }
        }
    }
}

/// Prompt tokens of a request estimated from its routing text (about four bytes
/// a token), plus the output it may ask for (`max_tokens`) when `count_output`.
pub fn estimate_tokens(
    routing_text_len: usize,
    max_tokens: Option<u64>,
    count_output: bool,
) -> u64 {
    let prompt = (routing_text_len as u64).div_ceil(4).max(1);
    prompt
        + if count_output {
            max_tokens.unwrap_or(0)
        } else {
            0
        }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tenancy::TenantPolicy;

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
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_refusal_names_its_limit_and_gives_back_what_others_took() {
        let l = Limiter::default();
        let t = tenant(
            Limits {
                requests_per_minute: Some(2),
                ..Default::default()
            },
            Limits {
                requests_per_minute: Some(10),
                ..Default::default()
            },
        );
        let a = l.admit(&t, "m", 1).unwrap().unwrap();
        assert_eq!(a.headers.requests.unwrap().remaining, 1);
        l.admit(&t, "m", 1).unwrap().unwrap();
        let r = l.admit(&t, "m", 1).unwrap_err();
        assert_eq!(
            (r.kind, r.scope.as_str()),
            (LimitKind::Requests, "tenant `acme`")
        );
        assert_eq!(r.retry_after_s, 30);
        assert!(r.message().contains("2 requests per minute"));
        // The key's own cell got its unit back: 8 of 10 left, not 7.
        let key = l.scope("k\0k1".into());
        assert_eq!(
            key.requests.take(now_ns(l.epoch), 0, 10).unwrap().remaining,
            8
        );
    }

    #[tokio::test(start_paused = true)]
    async fn concurrency_slots_are_released_when_the_request_ends() {
        let l = Limiter::default();
        let t = tenant(
            Limits {
                max_concurrent_requests: Some(1),
                ..Default::default()
            },
            Limits::default(),
        );
        let a = l.admit(&t, "m", 1).unwrap().unwrap();
        let r = l.admit(&t, "m", 1).unwrap_err();
        assert_eq!(r.kind, LimitKind::Concurrency);
        drop(a);
        assert!(l.admit(&t, "m", 1).is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn usage_corrects_the_estimate_and_cost_spends_the_budget() {
        let l = Limiter::default();
        let t = tenant(
            Limits {
                tokens_per_minute: Some(100),
                daily_budget_usd: Some(0.01),
                ..Default::default()
            },
            Limits::default(),
        );
        let a = l.admit(&t, "m", 10).unwrap().unwrap();
        assert_eq!(a.headers.tokens.unwrap().remaining, 90);
        a.settle(Some(60), 0.01);
        drop(a);
        let r = l.admit(&t, "m", 10).unwrap_err();
        assert_eq!(r.kind, LimitKind::DailyBudget);
        assert!(r.message().contains("daily_budget_usd"), "{}", r.message());
    }

    #[test]
    fn estimates_count_bytes_and_optionally_max_tokens() {
        assert_eq!(estimate_tokens(0, None, true), 1);
        assert_eq!(estimate_tokens(9, Some(5), false), 3);
        assert_eq!(estimate_tokens(9, Some(5), true), 8);
    }
}
