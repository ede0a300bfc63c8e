//! The Redis store, shared by every replica: one Lua script per request
//! (`admit.lua`: every scope's counters checked and taken in one round trip)
//! and one per finished request (`settle.lua`: the token correction, the slot
//! and the cost), sent in the background so the response never waits for it.
//! While Redis fails, `on_redis_error` applies: `open` admits without limits,
//! `closed` refuses; each failure is counted and logged at most every 10 s.

use super::headers::RateHeaders;
use super::spend::Calendar;
use super::{gcra, refusal, secs, unix_s, Admitted, LimitKind, Refusal, ScopeRef};
use crate::config::limits::RedisStore;
use crate::telemetry::names;
use parking_lot::Mutex;
use redis::aio::ConnectionManager;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::LazyLock;
use std::time::Duration;

static ADMIT: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(include_str!("admit.lua")));
static SETTLE: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(include_str!("settle.lua")));
const WINDOW_US: u64 = gcra::WINDOW_NS / 1_000;
const NANO: f64 = 1e9;
/// Least time between two "Redis failed" log lines (ms).
const LOG_EVERY_MS: u64 = 10_000;

/// The connection and the failure mode.
pub(super) struct Shared {
    pub(super) conn: ConnectionManager,
    fail_closed: bool,
    timeout: Duration,
    last_log_ms: AtomicU64,
}

/// The five Redis keys of one scope.
fn keys(scope: &str, cal: Calendar) -> [String; 5] {
    let base = format!("switchyard:limits:{scope}");
    [
        format!("{base}:requests"),
        format!("{base}:tokens"),
        format!("{base}:in_flight"),
        format!("{base}:spend:day:{}", cal.day),
        format!("{base}:spend:month:{}", cal.month),
    ]
}

fn nano(usd: Option<f64>) -> i64 {
    usd.map_or(-1, |u| (u * NANO).round() as i64)
}

impl Shared {
    pub(super) fn new(cfg: &RedisStore) -> redis::RedisResult<Shared> {
        let client = redis::Client::open(cfg.url.expose())?;
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Some(cfg.timeout))
            .set_response_timeout(Some(cfg.timeout))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_millis(500));
        Ok(Shared {
            conn: ConnectionManager::new_lazy_with_config(client, config)?,
            fail_closed: cfg.fail_closed,
            timeout: cfg.timeout,
            last_log_ms: AtomicU64::new(0),
        })
    }

    pub(super) async fn admit(
        self: &Shared,
        scopes: &[ScopeRef<'_>],
        tokens: u64,
    ) -> Result<Option<Admitted>, Box<Refusal>> {
        let cal = Calendar::at(unix_s());
        let mut inv = ADMIT.prepare_invoke();
        inv.arg(scopes.len()).arg(tokens).arg(WINDOW_US);
        for s in scopes {
            for k in keys(&s.key, cal) {
                inv.key(k);
            }
            let l = s.limits;
            inv.arg(l.requests_per_minute.unwrap_or(0))
                .arg(l.tokens_per_minute.unwrap_or(0))
                .arg(l.max_concurrent_requests.unwrap_or(0))
                .arg(nano(l.daily_budget_usd))
                .arg(nano(l.monthly_budget_usd));
        }
        let mut conn = self.conn.clone();
        let answer =
            tokio::time::timeout(self.timeout, inv.invoke_async::<Vec<i64>>(&mut conn)).await;
        let r = match answer {
            Ok(Ok(r)) if r.len() == 11 => r,
            Ok(Ok(_)) => return self.failed("admit", "unexpected script answer"),
            Ok(Err(e)) => return self.failed("admit", &e.to_string()),
            Err(_) => return self.failed("admit", "timed out"),
        };
        let w = |i: usize| {
            (r[i] >= 0).then(|| gcra::Window {
                limit: r[i] as u64,
                remaining: r[i + 1].max(0) as u64,
                reset_ns: r[i + 2].max(0) as u64 * 1_000,
            })
        };
        let headers = RateHeaders {
            requests: w(5),
            tokens: w(8),
        };
        if r[0] != 1 {
            return Err(self.refused(scopes, &r, tokens, cal, headers));
        }
        let held = Held {
            shared: self.conn.clone(),
            keys: scopes.iter().map(|s| keys(&s.key, cal)).collect(),
            specs: scopes
                .iter()
                .map(|s| {
                    let l = s.limits;
                    let budgets = l.daily_budget_usd.is_some() || l.monthly_budget_usd.is_some();
                    (
                        l.tokens_per_minute.unwrap_or(0),
                        l.max_concurrent_requests.is_some(),
                        budgets,
                    )
                })
                .collect(),
            estimate: tokens,
            settled: Mutex::new(None),
            timeout: self.timeout,
        };
        Ok(Some(Admitted {
            headers,
            held: super::Held::Shared(held),
        }))
    }

    /// The script's refusal, in the client's terms.
    fn refused(
        &self,
        scopes: &[ScopeRef<'_>],
        r: &[i64],
        tokens: u64,
        cal: Calendar,
        headers: RateHeaders,
    ) -> Box<Refusal> {
        let kind = match r[1] {
            1 => LimitKind::Requests,
            2 => LimitKind::Tokens,
            3 => LimitKind::Concurrency,
            4 => LimitKind::DailyBudget,
            _ => LimitKind::MonthlyBudget,
        };
        let scope = &scopes[(r[2].max(0) as usize).min(scopes.len() - 1)];
        let retry = match kind {
            LimitKind::DailyBudget => cal.day_left_s,
            LimitKind::MonthlyBudget => cal.month_left_s,
            LimitKind::Concurrency => 1,
            _ => secs(r[3].max(0) as u64 * 1_000),
        };
        let mut refusal = refusal(kind, scope, tokens, r[4] as f64 / NANO, retry);
        refusal.headers = headers;
        refusal
    }

    /// Redis failed: count it, log it (at most every 10 s), apply the mode.
    fn failed(&self, op: &'static str, why: &str) -> Result<Option<Admitted>, Box<Refusal>> {
        store_error(op, why, &self.last_log_ms, self.fail_closed);
        if !self.fail_closed {
            return Ok(None);
        }
        Err(Box::new(Refusal {
            kind: LimitKind::StoreUnavailable,
            scope: String::new(),
            limit: String::new(),
            retry_after_s: 1,
            headers: RateHeaders::default(),
        }))
    }
}

/// Count a store failure; log it unless one was logged in the last 10 s.
fn store_error(op: &'static str, why: &str, last_log_ms: &AtomicU64, fail_closed: bool) {
    metrics::counter!(names::LIMITS_STORE_ERRORS_TOTAL, names::L_OP => op).increment(1);
    let now = crate::runtime::clock::now_ms();
    let last = last_log_ms.load(Ordering::Relaxed);
    let due = last == 0 || now.saturating_sub(last) >= LOG_EVERY_MS;
    if due
        && last_log_ms
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    {
        let mode = if fail_closed {
            "refusing requests"
        } else {
            "admitting without limits"
        };
        tracing::warn!(op, error = %why, "limits store (Redis) failed: {mode}");
    }
}

/// An admitted request's scopes in Redis, settled when it drops.
pub(super) struct Held {
    shared: ConnectionManager,
    keys: Vec<[String; 5]>,
    /// Per scope: tokens per minute (0: none), holds a slot, has budgets.
    specs: Vec<(u64, bool, bool)>,
    estimate: u64,
    /// (tokens used, cost), once the request ended.
    settled: Mutex<Option<(Option<u64>, f64)>>,
    timeout: Duration,
}

static SETTLE_LOG: AtomicU64 = AtomicU64::new(0);

impl Held {
    pub(super) fn settle(&self, used_tokens: Option<u64>, usd: f64) {
        *self.settled.lock() = Some((used_tokens, usd));
    }
}

impl Drop for Held {
    /// One script call in the background: the correction, the slot, the cost.
    fn drop(&mut self) {
        let (used, usd) = self.settled.lock().take().unwrap_or((None, 0.0));
        let diff = used.map_or(0, |u| u as i64 - self.estimate as i64);
        let mut inv = SETTLE.prepare_invoke();
        inv.arg(self.keys.len())
            .arg(diff)
            .arg((usd.max(0.0) * NANO).round() as i64)
            .arg(WINDOW_US);
        for (k, (tpm, slot, budgets)) in self.keys.iter().zip(&self.specs) {
            for key in k {
                inv.key(key);
            }
            inv.arg(*tpm).arg(u8::from(*slot)).arg(u8::from(*budgets));
        }
        let mut conn = self.shared.clone();
        let timeout = self.timeout * 4;
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        rt.spawn(async move {
            match tokio::time::timeout(timeout, inv.invoke_async::<i64>(&mut conn)).await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => store_error("settle", &e.to_string(), &SETTLE_LOG, false),
                Err(_) => store_error("settle", "timed out", &SETTLE_LOG, false),
            }
        });
    }
}
