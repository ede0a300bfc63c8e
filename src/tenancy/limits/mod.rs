//! Limits per key, per tenant and per (tenant, model): requests and tokens per
//! minute (GCRA, `gcra`), concurrent requests (a slot released when the
//! request's context drops) and spend budgets per UTC day and month (`spend`).
//! A request is checked against every scope that has a limit before anything
//! is kept. It reserves its worst case up front ([`Ask`]: the prompt plus
//! `max_tokens` × `n`, or a default, and that many tokens' price against the
//! budgets), so concurrent requests cannot overrun a limit together; a request
//! whose worst case exceeds a whole limit is refused for good
//! ([`Refusal::never`]). When it ends, [`Admitted::settle`] gives back the
//! difference to its real usage and cost, once; a request the gateway refused
//! after admission is charged nothing.
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
mod persistence;
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
    /// The request's worst case exceeds the whole limit: it can never pass,
    /// so it is a client error without `Retry-After`.
    pub never: bool,
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
            _ if self.never => format!(
                "This request can never fit the limit of {scope}: {limit} ({kind}). \
                 Lower `max_tokens` or `n`."
            ),
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

/// What a request reserves up front in every scope it counts against: its
/// worst case.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Ask {
    /// Prompt tokens (exact with the pool's tokenizer, else estimated).
    pub prompt: u64,
    /// Output tokens it may generate: `max_tokens` × choices, or the default.
    pub output: u64,
    /// The price of those tokens by the price table (USD; the dearest row
    /// that may apply).
    pub usd: f64,
}

impl Ask {
    /// Prompt plus output tokens.
    pub fn tokens(&self) -> u64 {
        self.prompt.saturating_add(self.output)
    }

    fn nano_usd(&self) -> u64 {
        usd_to_nano(self.usd)
    }
}

/// What turns a request into its worst case: the default output reservation
/// (`[limits] default_max_tokens`) and the price table.
pub struct Pricing<'a> {
    pub default_max_tokens: u64,
    pub prices: &'a [crate::config::observability::PriceConfig],
}

impl Pricing<'_> {
    /// The worst case of `tenant`'s request for (`model`, `pool`) with
    /// `prompt` tokens: its output by [`worst_output`], and the price of both
    /// when a budget applies.
    pub fn worst_case(
        &self,
        tenant: &Tenant,
        (model, pool): (&str, &str),
        endpoint: crate::api::Endpoint,
        info: &crate::api::RequestInfo,
        prompt: u64,
    ) -> Ask {
        let output = worst_output(tenant, model, endpoint, info, self.default_max_tokens);
        let usd = if tenant.has_budget(model) {
            let t = crate::telemetry::cost::TokenCounts {
                prompt,
                cached: 0,
                output,
            };
            crate::telemetry::cost::worst_usd(self.prices, model, pool, t)
        } else {
            0.0
        };
        Ask {
            prompt,
            output,
            usd,
        }
    }
}

/// The output a request may generate: `max_tokens` (or the most specific
/// scope's `default_max_tokens`, else `fallback`) times its choices. Only
/// endpoints that generate text have output.
pub fn worst_output(
    tenant: &Tenant,
    model: &str,
    endpoint: crate::api::Endpoint,
    info: &crate::api::RequestInfo,
    fallback: u64,
) -> u64 {
    use crate::api::Endpoint as E;
    if !matches!(
        endpoint,
        E::ChatCompletions | E::Completions | E::Responses | E::Messages
    ) {
        return 0;
    }
    let per_choice = info.max_tokens.unwrap_or_else(|| {
        let p = tenant.policy.as_deref();
        let scoped = p.and_then(|p| {
            let model = p.model_limits.get(model).and_then(|l| l.default_max_tokens);
            let key = tenant.key_id.as_ref().and(p.key_limits.default_max_tokens);
            model.or(key).or(p.limits.default_max_tokens)
        });
        scoped.unwrap_or(fallback)
    });
    per_choice.saturating_mul(info.choices.unwrap_or(1).max(1))
}

/// The scope whose limit `ask` exceeds on its own, if any: such a request
/// can never be admitted, so it is refused without touching any state.
fn never_fits(scopes: &[ScopeRef<'_>], ask: Ask) -> Option<Box<Refusal>> {
    let tokens = ask.tokens();
    for s in scopes {
        let l = s.limits;
        let kind = if l.tokens_per_minute.is_some_and(|t| tokens > t) {
            LimitKind::Tokens
        } else if l
            .daily_budget_usd
            .is_some_and(|b| ask.nano_usd() > usd_to_nano(b))
        {
            LimitKind::DailyBudget
        } else if l
            .monthly_budget_usd
            .is_some_and(|b| ask.nano_usd() > usd_to_nano(b))
        {
            LimitKind::MonthlyBudget
        } else {
            continue;
        };
        let mut r = refusal(kind, s, ask, 0.0, 0);
        r.never = true;
        return Some(r);
    }
    None
}

/// The limits' state: this process's, or a shared Redis.
pub struct Limiter {
    local: local::Local,
    shared: arc_swap::ArcSwapOption<shared::Shared>,
    /// The `[limits]` store this limiter was built for (reloads compare to it).
    store: arc_swap::ArcSwap<LimitsStore>,
}

impl Limiter {
    /// A limiter over the configured store.
    pub fn new(store: &LimitsStore) -> Limiter {
        let shared = match store {
            LimitsStore::Memory => None,
            LimitsStore::Redis(r) => shared::Shared::new(r)
                .map_err(|e| tracing::error!(error = %e, "limits.redis_url is unusable; limits stay in memory"))
                .ok()
                .map(std::sync::Arc::new),
        };
        Limiter {
            local: local::Local::default(),
            shared: arc_swap::ArcSwapOption::new(shared),
            store: arc_swap::ArcSwap::from_pointee(store.clone()),
        }
    }

    /// Apply a reloaded `[limits]` store: the failure mode, timeout and lease
    /// of the same Redis change in place (state is kept); another store (memory
    /// and Redis swapped, another URL) cannot move the state or the issued
    /// keys' sync, so it is refused and nothing changes.
    pub fn reconfigure(&self, new: &LimitsStore) -> Result<(), String> {
        let old = self.store.load();
        if **old == *new {
            return Ok(());
        }
        let same = match (&**old, new) {
            (LimitsStore::Redis(a), LimitsStore::Redis(b)) => a.same_server(b),
            _ => false,
        };
        if !same {
            return Err("limits changed: restart required ([limits] state or \
                 redis_url differ from the running store)"
                .into());
        }
        if let (Some(s), LimitsStore::Redis(r)) = (self.shared.load_full(), new) {
            self.shared
                .store(Some(std::sync::Arc::new(s.with_settings(r))));
        }
        self.store.store(std::sync::Arc::new(new.clone()));
        tracing::info!("limits store settings changed: applied (on_redis_error, timeout, lease)");
        Ok(())
    }

    /// Check `tenant`'s request for `model`, reserving `ask`, against every
    /// scope with a limit; `None` when none applies (or the shared store failed
    /// and fails open).
    pub async fn admit(
        &self,
        tenant: &Tenant,
        model: &str,
        ask: Ask,
    ) -> Result<Option<Admitted>, Box<Refusal>> {
        let scopes = scopes(tenant, model);
        if scopes.is_empty() {
            return Ok(None);
        }
        if let Some(r) = never_fits(&scopes, ask) {
            return Err(r);
        }
        match self.shared.load_full() {
            None => self.local.admit(&scopes, ask).map(Some),
            Some(s) => Box::pin(s.admit(&scopes, ask)).await,
        }
    }

    /// The shared store's connection, when limits live in Redis (issued keys
    /// are shared through it too).
    pub fn redis(&self) -> Option<redis::aio::ConnectionManager> {
        self.shared.load().as_ref().map(|s| s.conn.clone())
    }

    /// Drop a revoked key's state.
    pub fn forget_key(&self, id: &str) {
        self.local.forget(&format!("k|{id}"));
    }
}

/// How an admitted request ended, for its settlement.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Usage {
    /// Prompt plus output tokens used, when the answer said.
    pub tokens: Option<u64>,
    /// Its cost by the price table (USD).
    pub usd: f64,
    /// The gateway refused it after admission (no worker's answer): nothing
    /// is charged, not even the request.
    pub refused: bool,
}

impl Usage {
    /// Tokens to charge in place of the reservation (`None`: keep it, the
    /// usage is unknown).
    fn tokens_used(&self) -> Option<u64> {
        if self.refused {
            Some(0)
        } else {
            self.tokens
        }
    }

    /// Cost to charge in place of `reserved` (nano-USD): the real cost, or
    /// at least the reservation while usage is unknown.
    fn nano_usd(&self, reserved: u64) -> u64 {
        match (self.refused, self.tokens) {
            (true, _) => 0,
            (false, Some(_)) => usd_to_nano(self.usd),
            (false, None) => usd_to_nano(self.usd).max(reserved),
        }
    }
}

/// An admitted request's share of its scopes: the concurrency slots (released
/// on drop), the reservation to correct, and the headers to send.
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
    /// The request ended: replace the reservation with what it used and cost
    /// (the first call counts; later ones are ignored).
    pub fn settle(&self, usage: Usage) {
        match &self.held {
            Held::Local(h) => h.settle(usage),
            Held::Shared(h) => h.settle(usage),
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

/// USD as whole nano-USD (negative and non-finite amounts are 0).
fn usd_to_nano(usd: f64) -> u64 {
    if usd.is_finite() && usd > 0.0 {
        (usd * 1e9).round() as u64
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
fn describe(kind: LimitKind, l: &Limits, ask: Ask, spent: f64) -> String {
    let (tokens, prompt, output, usd) = (ask.tokens(), ask.prompt, ask.output, ask.usd);
    match kind {
        LimitKind::Requests => {
            format!("{} requests per minute", l.requests_per_minute.unwrap_or(0))
        }
        LimitKind::Tokens => format!(
            "{} tokens per minute, this request reserves {tokens} \
             ({prompt} prompt + {output} output)",
            l.tokens_per_minute.unwrap_or(0)
        ),
        LimitKind::Concurrency => {
            format!(
                "{} concurrent requests",
                l.max_concurrent_requests.unwrap_or(0)
            )
        }
        LimitKind::DailyBudget => format!(
            "${} per day, ${spent:.6} spent or reserved, this request reserves up to ${usd:.6}",
            l.daily_budget_usd.unwrap_or(0.0)
        ),
        LimitKind::MonthlyBudget => format!(
            "${} per month, ${spent:.6} spent or reserved, this request reserves up to ${usd:.6}",
            l.monthly_budget_usd.unwrap_or(0.0)
        ),
        LimitKind::StoreUnavailable => String::new(),
    }
}

fn refusal(
    kind: LimitKind,
    s: &ScopeRef<'_>,
    ask: Ask,
    spent: f64,
    retry_after_s: u64,
) -> Box<Refusal> {
    Box::new(Refusal {
        never: false,
        kind,
        scope: s.who.to_string(),
        limit: describe(kind, s.limits, ask, spent),
        retry_after_s,
        headers: RateHeaders::default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn redis(url: &str, fail_closed: bool) -> LimitsStore {
        LimitsStore::Redis(crate::config::limits::RedisStore {
            url: url.to_string().into(),
            fail_closed,
            timeout: std::time::Duration::from_millis(100),
            lease: std::time::Duration::from_secs(30),
        })
    }

    #[tokio::test]
    async fn a_reload_changes_the_mode_in_place_but_not_the_store() {
        let l = Limiter::new(&redis("redis://127.0.0.1:1/", false));
        assert!(l.reconfigure(&redis("redis://127.0.0.1:1/", true)).is_ok());
        assert!(l.shared.load().as_ref().unwrap().fail_closed());
        for other in [redis("redis://127.0.0.1:2/", true), LimitsStore::Memory] {
            let e = l.reconfigure(&other).unwrap_err();
            assert!(e.contains("restart required"), "{e}");
        }
        assert!(Limiter::new(&LimitsStore::Memory)
            .reconfigure(&redis("redis://127.0.0.1:1/", false))
            .is_err());
    }

    #[test]
    fn the_worst_output_is_max_tokens_times_choices_or_the_default() {
        use crate::api::Endpoint as E;
        let policy = crate::tenancy::TenantPolicy {
            model_limits: [(
                "m".to_string(),
                Limits {
                    default_max_tokens: Some(7),
                    ..Default::default()
                },
            )]
            .into(),
            ..Default::default()
        };
        let t = Tenant {
            name: "t".into(),
            authenticated: true,
            residency: None,
            key_id: None,
            policy: Some(std::sync::Arc::new(policy)),
            slo: Default::default(),
            claims: Default::default(),
        };
        let info = |max_tokens, choices| crate::api::RequestInfo {
            max_tokens,
            choices,
            ..Default::default()
        };
        assert_eq!(
            worst_output(&t, "m", E::ChatCompletions, &info(Some(10), Some(4)), 99),
            40
        );
        assert_eq!(
            worst_output(&t, "m", E::Completions, &info(None, Some(0)), 99),
            7
        );
        assert_eq!(
            worst_output(&t, "x", E::Responses, &info(None, None), 99),
            99
        );
        assert_eq!(
            worst_output(&t, "m", E::Embeddings, &info(Some(10), None), 99),
            0
        );
        let huge = info(Some(u64::MAX), Some(4));
        assert_eq!(worst_output(&t, "m", E::Messages, &huge, 99), u64::MAX);
    }

    #[test]
    fn estimates_count_bytes_and_optionally_max_tokens() {
        assert_eq!(estimate_tokens(0, None, true), 1);
        assert_eq!(estimate_tokens(9, Some(5), false), 3);
        assert_eq!(estimate_tokens(9, Some(5), true), 8);
    }
}
