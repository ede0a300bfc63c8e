//! Limits per key, per tenant and per (tenant, model): requests and tokens per
//! minute (GCRA, `gcra`), concurrent requests (a slot released when the
//! request's context drops) and spend budgets per UTC day and month (`spend`).
//! A request is checked against every scope that has a limit before anything
//! is kept. Its tokens are estimated up front and corrected with the real usage
//! when it ends ([`Admitted::settle`]), which also adds its cost to the budgets.
//!
//! Two stores answer the same questions with the same arithmetic: `local`
//! (this process: atomics and a lock per scope) and `shared` (a Redis every
//! replica uses, one Lua script per request). The [`Limiter`] outlives config
//! reloads; the limits themselves are read from the tenant's policy on every
//! request, so a reload changes them at once. Scopes exist only for configured
//! limits (tenants, their keys, their configured models), so state is bounded
//! by the config and the issued-key cap.

pub mod gcra;
pub mod headers;
mod local;
mod shared;
pub mod spend;

use super::Tenant;
use crate::config::limits::{Limits, LimitsStore};
use headers::RateHeaders;

/// Which limit refused a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LimitKind {
    Requests,
    Tokens,
    Concurrency,
    DailyBudget,
    MonthlyBudget,
    /// The shared store failed and `on_redis_error = "closed"`.
    StoreUnavailable,
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
            LimitKind::StoreUnavailable => "limits_store_unavailable",
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
        let (scope, limit, kind, s) = (
            &self.scope,
            &self.limit,
            self.kind.as_str(),
            self.retry_after_s,
        );
        match self.kind {
            LimitKind::StoreUnavailable => {
                format!("Limits cannot be checked right now ({kind}). Retry after {s}s.")
            }
            k if k.is_budget() => {
                format!("Budget exhausted for {scope}: {limit} ({kind}). It renews in {s}s.")
            }
            _ => format!("Rate limit reached for {scope}: {limit} ({kind}). Retry after {s}s."),
        }
    }
}

/// One scope a request counts against.
struct ScopeRef<'a> {
    /// Unique among scopes: `t|acme`, `k|ab12cd34`, `m|acme|model`.
    key: String,
    limits: &'a Limits,
    /// Whose, for messages (written out only for a refusal).
    who: Who<'a>,
}

/// Whose limit a scope is.
enum Who<'a> {
    Key(&'a str),
    Tenant(&'a str),
    TenantModel(&'a str, &'a str),
}

impl std::fmt::Display for Who<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Who::Key(id) => write!(f, "key `{id}`"),
            Who::Tenant(t) => write!(f, "tenant `{t}`"),
            Who::TenantModel(t, m) => write!(f, "tenant `{t}` on model `{m}`"),
        }
    }
}

/// The scopes with limits that `tenant`'s request for `model` counts against.
fn scopes<'a>(tenant: &'a Tenant, model: &'a str) -> Vec<ScopeRef<'a>> {
    let Some(policy) = &tenant.policy else {
        return Vec::new();
    };
    let mut v = Vec::with_capacity(3);
    let name = &tenant.name;
    if let Some(id) = tenant
        .key_id
        .as_deref()
        .filter(|_| !policy.key_limits.is_empty())
    {
        let (key, who) = (format!("k|{id}"), Who::Key(id));
        v.push(ScopeRef {
            key,
            limits: &policy.key_limits,
            who,
        });
    }
    if !policy.limits.is_empty() {
        let (key, who) = (format!("t|{name}"), Who::Tenant(name));
        v.push(ScopeRef {
            key,
            limits: &policy.limits,
            who,
        });
    }
    if let Some(l) = policy.model_limits.get(model).filter(|l| !l.is_empty()) {
        let key = format!("m|{name}|{model}");
        let who = Who::TenantModel(name, model);
        v.push(ScopeRef {
            key,
            limits: l,
            who,
        });
    }
    v
}

/// The limits' state: this process's, or a shared Redis.
pub struct Limiter {
    local: local::Local,
    shared: Option<shared::Shared>,
}

impl Limiter {
    /// A limiter over the configured store (chosen at start; a reload keeps it).
    pub fn new(store: &LimitsStore) -> Limiter {
        let shared = match store {
            LimitsStore::Memory => None,
            LimitsStore::Redis(r) => shared::Shared::new(r)
                .map_err(|e| tracing::error!(error = %e, "limits.redis_url is unusable; limits stay in memory"))
                .ok(),
        };
        Limiter {
            local: local::Local::default(),
            shared,
        }
    }

    /// Check `tenant`'s request for `model` estimated at `tokens` against every
    /// scope with a limit; `None` when none applies (or the shared store failed
    /// and fails open).
    pub async fn admit(
        &self,
        tenant: &Tenant,
        model: &str,
        tokens: u64,
    ) -> Result<Option<Admitted>, Box<Refusal>> {
        let scopes = scopes(tenant, model);
        if scopes.is_empty() {
            return Ok(None);
        }
        match &self.shared {
            None => self.local.admit(&scopes, tokens).map(Some),
            Some(s) => Box::pin(s.admit(&scopes, tokens)).await,
        }
    }

    /// The shared store's connection, when limits live in Redis (issued keys
    /// are shared through it too).
    pub fn redis(&self) -> Option<redis::aio::ConnectionManager> {
        self.shared.as_ref().map(|s| s.conn.clone())
    }

    /// Drop a revoked key's state.
    pub fn forget_key(&self, id: &str) {
        self.local.forget(&format!("k|{id}"));
    }
}

/// An admitted request's share of its scopes: the concurrency slots (released
/// on drop), the estimate to correct, and the headers to send.
pub struct Admitted {
    pub headers: RateHeaders,
    held: Held,
}

enum Held {
    Local(local::Held),
    Shared(shared::Held),
}

impl std::fmt::Debug for Admitted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admitted")
            .field("headers", &self.headers)
            .finish_non_exhaustive()
    }
}

impl Admitted {
    /// The request ended: correct the token estimate with the tokens it used
    /// (when known) and add its cost to the budgets.
    pub fn settle(&self, used_tokens: Option<u64>, usd: f64) {
        match &self.held {
            Held::Local(h) => h.settle(used_tokens, usd),
            Held::Shared(h) => h.settle(used_tokens, usd),
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

fn unix_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn secs(ns: u64) -> u64 {
    ns.div_ceil(1_000_000_000).max(1)
}

/// The words for a refused limit.
fn describe(kind: LimitKind, l: &Limits, tokens: u64, spent: f64) -> String {
    match kind {
        LimitKind::Requests => {
            format!("{} requests per minute", l.requests_per_minute.unwrap_or(0))
        }
        LimitKind::Tokens => format!(
            "{} tokens per minute, this request needs {tokens}",
            l.tokens_per_minute.unwrap_or(0)
        ),
        LimitKind::Concurrency => {
            format!(
                "{} concurrent requests",
                l.max_concurrent_requests.unwrap_or(0)
            )
        }
        LimitKind::DailyBudget => format!(
            "${} per day, ${spent:.6} spent",
            l.daily_budget_usd.unwrap_or(0.0)
        ),
        LimitKind::MonthlyBudget => format!(
            "${} per month, ${spent:.6} spent",
            l.monthly_budget_usd.unwrap_or(0.0)
        ),
        LimitKind::StoreUnavailable => String::new(),
    }
}

fn refusal(
    kind: LimitKind,
    s: &ScopeRef<'_>,
    tokens: u64,
    spent: f64,
    retry_after_s: u64,
) -> Box<Refusal> {
    Box::new(Refusal {
        kind,
        scope: s.who.to_string(),
        limit: describe(kind, s.limits, tokens, spent),
        retry_after_s,
        headers: RateHeaders::default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn estimates_count_bytes_and_optionally_max_tokens() {
        assert_eq!(estimate_tokens(0, None, true), 1);
        assert_eq!(estimate_tokens(9, Some(5), false), 3);
        assert_eq!(estimate_tokens(9, Some(5), true), 8);
    }
}
