//! The Redis store, shared by every replica: one Lua script per request
//! (`admit.lua`: every scope's counters checked and taken in one round trip)
//! and one per finished request (`settle.lua`: the token and cost correction,
//! the lease), sent in the background so the response never waits for it.
//!
//! Exact under faults: each admission has an id, recorded by the scripts, so
//! every call may be repeated. An admit whose answer never came (timed out,
//! connection lost) is taken back by `release.lua`, retried in the background:
//! if the admit ran (even after the timeout) everything it took is given back,
//! and if it has not run yet it will take nothing. Concurrency slots are leases
//! (`renew.lua` keeps a live request's), so a lost release or a crashed replica
//! frees its slots within one lease. While Redis fails, `on_redis_error`
//! applies: `open` admits without limits, `closed` refuses; each failure is
//! counted and logged at most every 10 s.

use super::headers::RateHeaders;
use super::spend::Calendar;
use super::{gcra, refusal, secs, unix_s, Admitted, Ask, LimitKind, Refusal, ScopeRef, Usage};
use crate::config::limits::RedisStore;
use crate::telemetry::names;
use parking_lot::Mutex;
use redis::aio::ConnectionManager;
use redis::ScriptInvocation;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::LazyLock;
use std::time::Duration;

static ADMIT: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(include_str!("admit.lua")));
static SETTLE: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(include_str!("settle.lua")));
static RELEASE: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(include_str!("release.lua")));
static RENEW: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(include_str!("renew.lua")));
const WINDOW_US: u64 = gcra::WINDOW_NS / 1_000;
const NANO: f64 = 1e9;
/// Least time between two "Redis failed" log lines (ms).
const LOG_EVERY_MS: u64 = 10_000;
/// How long an admission's record outlives its last use (ms): long enough
/// for a delayed admit to find the release that came before it.
const RECORD_KEEP_MS: u64 = 600_000;
/// Waits between the tries of a release or settle that failed (ms): about a
/// minute in all, so a Redis stall of that length loses nothing.
const BACKOFF_MS: [u64; 8] = [0, 250, 500, 1_000, 2_000, 5_000, 15_000, 30_000];
/// Most releases and settles waiting to be retried at once; past it they are
/// dropped (counted, logged), and their leases expire on their own.
const MAX_PENDING: usize = 10_000;
static PENDING: AtomicUsize = AtomicUsize::new(0);

/// The connection and the failure mode.
pub(super) struct Shared {
    pub(super) conn: ConnectionManager,
    fail_closed: bool,
    timeout: Duration,
    lease: Duration,
    last_log_ms: AtomicU64,
}

/// The five Redis keys of one scope.
fn keys(scope: &str, cal: Calendar) -> [String; 5] {
    let base = format!("switchyard:limits:{scope}");
    [
        format!("{base}:requests"),
        format!("{base}:tokens"),
        format!("{base}:leases"),
        format!("{base}:spend:day:{}", cal.day),
        format!("{base}:spend:month:{}", cal.month),
    ]
}

fn nano(usd: Option<f64>) -> i64 {
    usd.map_or(-1, |u| super::usd_to_nano(u) as i64)
}

/// What one scope asks of the scripts after admission.
#[derive(Clone, Copy)]
struct Spec {
    rpm: u64,
    tpm: u64,
    leased: bool,
    budgets: bool,
}

impl Spec {
    fn of(s: &ScopeRef<'_>) -> Spec {
        let l = s.limits;
        Spec {
            rpm: l.requests_per_minute.unwrap_or(0),
            tpm: l.tokens_per_minute.unwrap_or(0),
            leased: l.max_concurrent_requests.is_some(),
            budgets: l.daily_budget_usd.is_some() || l.monthly_budget_usd.is_some(),
        }
    }
}

/// One admission's id, keys and reservation: what every script after the
/// admit needs.
struct Admission {
    id: String,
    record: String,
    keys: Vec<[String; 5]>,
    specs: Vec<Spec>,
    ask: Ask,
}

impl Admission {
    fn new(scopes: &[ScopeRef<'_>], ask: Ask, cal: Calendar) -> Admission {
        let id = uuid::Uuid::new_v4().simple().to_string();
        Admission {
            record: format!("switchyard:limits:admission:{id}"),
            id,
            keys: scopes.iter().map(|s| keys(&s.key, cal)).collect(),
            specs: scopes.iter().map(Spec::of).collect(),
            ask,
        }
    }

    fn with_keys(&self, inv: &mut ScriptInvocation<'static>) {
        inv.key(&self.record);
        for k in self.keys.iter().flatten() {
            inv.key(k);
        }
    }

    /// Every scope's (rpm, tpm, leased, budgets), as the scripts after admit take them.
    fn with_specs(&self, inv: &mut ScriptInvocation<'static>) {
        for s in &self.specs {
            inv.arg(s.rpm)
                .arg(s.tpm)
                .arg(u8::from(s.leased))
                .arg(u8::from(s.budgets));
        }
    }

    /// The call that takes this admission back (`release.lua`).
    fn release(&self) -> ScriptInvocation<'static> {
        let mut inv = RELEASE.prepare_invoke();
        self.with_keys(&mut inv);
        inv.arg(self.keys.len())
            .arg(self.ask.tokens())
            .arg(WINDOW_US)
            .arg(self.ask.nano_usd())
            .arg(RECORD_KEEP_MS)
            .arg(&self.id);
        self.with_specs(&mut inv);
        inv
    }

    /// The call that settles it with `usage` (`settle.lua`).
    fn settle(&self, usage: Usage) -> ScriptInvocation<'static> {
        let reserved = self.ask.nano_usd();
        let tokens = usage
            .tokens_used()
            .map_or(0, |u| u as i64 - self.ask.tokens() as i64);
        let cost = usage.nano_usd(reserved) as i64 - reserved as i64;
        let mut inv = SETTLE.prepare_invoke();
        self.with_keys(&mut inv);
        inv.arg(self.keys.len())
            .arg(tokens)
            .arg(WINDOW_US)
            .arg(cost)
            .arg(60_000)
            .arg(&self.id)
            .arg(u8::from(usage.refused));
        self.with_specs(&mut inv);
        inv
    }

    /// The call that renews its leases (`renew.lua`), if it holds any.
    fn renew(&self, lease: Duration) -> Option<ScriptInvocation<'static>> {
        let mut inv = RENEW.prepare_invoke();
        inv.key(&self.record);
        let mut any = false;
        for (k, _) in self.keys.iter().zip(&self.specs).filter(|(_, s)| s.leased) {
            inv.key(&k[2]);
            any = true;
        }
        inv.arg(lease.as_millis() as u64)
            .arg(RECORD_KEEP_MS)
            .arg(&self.id);
        any.then_some(inv)
    }
}

impl Shared {
    pub(super) fn new(cfg: &RedisStore) -> redis::RedisResult<Shared> {
        let client = redis::Client::open(cfg.url.expose())?;
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Some(cfg.timeout))
            .set_response_timeout(Some(cfg.timeout))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_millis(500));
        let conn = ConnectionManager::new_lazy_with_config(client, config)?;
        super::persistence::check_in_background(conn.clone());
        Ok(Shared {
            conn,
            fail_closed: cfg.fail_closed,
            timeout: cfg.timeout,
            lease: cfg.lease,
            last_log_ms: AtomicU64::new(0),
        })
    }

    #[cfg(test)]
    pub(super) fn fail_closed(&self) -> bool {
        self.fail_closed
    }

    /// The same connection with a reloaded mode, timeout and lease.
    pub(super) fn with_settings(&self, cfg: &RedisStore) -> Shared {
        Shared {
            conn: self.conn.clone(),
            fail_closed: cfg.fail_closed,
            timeout: cfg.timeout,
            lease: cfg.lease,
            last_log_ms: AtomicU64::new(0),
        }
    }

    pub(super) async fn admit(
        self: &Shared,
        scopes: &[ScopeRef<'_>],
        ask: Ask,
    ) -> Result<Option<Admitted>, Box<Refusal>> {
        let cal = Calendar::at(unix_s());
        let adm = Admission::new(scopes, ask, cal);
        let mut inv = ADMIT.prepare_invoke();
        adm.with_keys(&mut inv);
        inv.arg(scopes.len())
            .arg(ask.tokens())
            .arg(WINDOW_US)
            .arg(ask.nano_usd())
            .arg(self.lease.as_millis() as u64)
            .arg(RECORD_KEEP_MS)
            .arg(&adm.id);
        for s in scopes {
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
        let why = match answer {
            Ok(Ok(r)) if r.len() == 11 && r[1] != 6 => return self.answered(scopes, adm, &r, cal),
            Ok(Ok(_)) => "unexpected script answer".to_string(),
            Ok(Err(e)) => e.to_string(),
            Err(_) => "timed out".to_string(),
        };
        // The admit may still run (or have run): take it back, in the background.
        retry_in_background("release", self.conn.clone(), adm.release(), self.timeout);
        self.failed("admit", &why)
    }

    /// The script's answer: an admission (with its lease renewed while it
    /// lives) or a refusal.
    fn answered(
        &self,
        scopes: &[ScopeRef<'_>],
        adm: Admission,
        r: &[i64],
        cal: Calendar,
    ) -> Result<Option<Admitted>, Box<Refusal>> {
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
            return Err(self.refused(scopes, r, adm.ask, cal, headers));
        }
        let renewal = adm.renew(self.lease).map(|inv| {
            let (conn, every, timeout) = (self.conn.clone(), self.lease / 3, self.timeout);
            tokio::spawn(renew_while_alive(conn, inv, every, timeout)).abort_handle()
        });
        let held = Held {
            conn: self.conn.clone(),
            adm,
            usage: Mutex::new(None),
            renewal,
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
        ask: Ask,
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
        let mut refusal = refusal(kind, scope, ask, r[4] as f64 / NANO, retry);
        refusal.headers = headers;
        refusal
    }

    /// Redis failed: count it, log it (at most every 10 s), apply the mode.
    fn failed(&self, op: &'static str, why: &str) -> Result<Option<Admitted>, Box<Refusal>> {
        let action = if self.fail_closed {
            "refusing: shared store unavailable"
        } else {
            "admitting without limits"
        };
        store_error(op, why, &self.last_log_ms, action);
        let outcome = if self.fail_closed {
            "refused"
        } else {
            "admitted_unlimited"
        };
        metrics::counter!(names::LIMITS_STORE_FAILOVERS_TOTAL, names::L_RESULT => outcome)
            .increment(1);
        if !self.fail_closed {
            return Ok(None);
        }
        Err(Box::new(Refusal {
            never: false,
            kind: LimitKind::StoreUnavailable,
            scope: String::new(),
            limit: String::new(),
            retry_after_s: 1,
            headers: RateHeaders::default(),
        }))
    }
}

/// Count a store failure; log it unless one was logged in the last 10 s.
fn store_error(op: &'static str, why: &str, last_log_ms: &AtomicU64, action: &str) {
    metrics::counter!(names::LIMITS_STORE_ERRORS_TOTAL, names::L_OP => op).increment(1);
    let now = crate::runtime::clock::now_ms();
    let last = last_log_ms.load(Ordering::Relaxed);
    let due = last == 0 || now.saturating_sub(last) >= LOG_EVERY_MS;
    if due
        && last_log_ms
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    {
        tracing::warn!(op, error = %why, "limits store (Redis) failed: {action}");
    }
}

static RETRY_LOG: AtomicU64 = AtomicU64::new(0);

/// Run an idempotent script until it answers (a release or a settle), with
/// backoff for about a minute; counted by result.
fn retry_in_background(
    op: &'static str,
    mut conn: ConnectionManager,
    inv: ScriptInvocation<'static>,
    timeout: Duration,
) {
    let Ok(rt) = tokio::runtime::Handle::try_current() else {
        return;
    };
    if PENDING.fetch_add(1, Ordering::AcqRel) >= MAX_PENDING {
        PENDING.fetch_sub(1, Ordering::AcqRel);
        let action = "dropped (too many pending): its leases expire on their own";
        store_error(op, "too many calls waiting for Redis", &RETRY_LOG, action);
        metrics::counter!(names::LIMITS_STORE_RETRIES_TOTAL, names::L_OP => op, names::L_RESULT => "dropped").increment(1);
        return;
    }
    rt.spawn(async move {
        let mut result = "failed";
        for wait in BACKOFF_MS {
            tokio::time::sleep(Duration::from_millis(wait)).await;
            match tokio::time::timeout(timeout * 4, inv.invoke_async::<i64>(&mut conn)).await {
                Ok(Ok(_)) => {
                    result = "ok";
                    break;
                }
                Ok(Err(e)) => store_error(op, &e.to_string(), &RETRY_LOG, "retrying"),
                Err(_) => store_error(op, "timed out", &RETRY_LOG, "retrying"),
            }
        }
        if result == "failed" {
            tracing::warn!(op, "limits store (Redis): gave up; leases expire on their own, a reservation stays charged");
        }
        metrics::counter!(names::LIMITS_STORE_RETRIES_TOTAL, names::L_OP => op, names::L_RESULT => result).increment(1);
        PENDING.fetch_sub(1, Ordering::AcqRel);
    });
}

/// Renew a live request's leases every third of a lease until aborted.
async fn renew_while_alive(
    mut conn: ConnectionManager,
    inv: ScriptInvocation<'static>,
    every: Duration,
    timeout: Duration,
) {
    loop {
        tokio::time::sleep(every).await;
        match tokio::time::timeout(timeout, inv.invoke_async::<i64>(&mut conn)).await {
            Ok(Ok(0)) => return,
            Ok(Ok(_)) => {}
            Ok(Err(e)) => store_error("renew", &e.to_string(), &RETRY_LOG, "retrying"),
            Err(_) => store_error("renew", "timed out", &RETRY_LOG, "retrying"),
        }
    }
}

/// An admitted request's scopes in Redis, settled when it drops.
pub(super) struct Held {
    conn: ConnectionManager,
    adm: Admission,
    /// How the request ended, once it did.
    usage: Mutex<Option<Usage>>,
    renewal: Option<tokio::task::AbortHandle>,
    timeout: Duration,
}

impl Held {
    /// Keep the first usage reported; the settle call goes out on drop.
    pub(super) fn settle(&self, usage: Usage) {
        self.usage.lock().get_or_insert(usage);
    }
}

impl Drop for Held {
    /// One script call in the background: the correction, the lease, the cost.
    fn drop(&mut self) {
        if let Some(r) = &self.renewal {
            r.abort();
        }
        let usage = self.usage.lock().take().unwrap_or_default();
        let inv = self.adm.settle(usage);
        retry_in_background("settle", self.conn.clone(), inv, self.timeout);
    }
}
