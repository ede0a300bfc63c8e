//! Limits shared through a real `redis-server` (started here on a free port):
//! two gateway processes enforce one 600 RPM / 60k TPM limit together under
//! concurrent load from both sides, a budget spent mid-run refuses every later
//! request naming the budget, and with Redis killed the fail-open replica
//! admits while the fail-closed one refuses, both counting the failures.
//!
//! Without `redis-server` on PATH the test is skipped, unless `CI` or
//! `REQUIRE_REDIS=1` is set: then it fails (`scripts/test-all.sh` installs it).

mod support;

use serde_json::{json, Value};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use support::*;
use tokio::io::AsyncBufReadExt;

const ADMIN_TOKEN: &str = "limits-redis-admin-5e1f0a9b8c7d";
const RPM_KEY: &str = "sk-redis-rpm-0f1e2d3c4b5a";
const TPM_KEY: &str = "sk-redis-tpm-a5b4c3d2e1f0";
const BUDGET_KEY: &str = "sk-redis-budget-66aa77bb88";
const KILL_KEY: &str = "sk-redis-kill-99cc00dd11";

/// `redis-server` on PATH, or `None` (a failure under CI / REQUIRE_REDIS=1).
fn redis_server() -> Option<std::path::PathBuf> {
    let found = std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join("redis-server"))
            .find(|f| f.is_file())
    });
    let required =
        std::env::var_os("CI").is_some() || std::env::var("REQUIRE_REDIS").is_ok_and(|v| v == "1");
    if found.is_none() {
        assert!(
            !required,
            "redis-server is not on PATH (scripts/test-all.sh installs it)"
        );
        eprintln!("skipped: redis-server is not on PATH");
    }
    found
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A `redis-server` on a free loopback port, ready (killed on drop).
async fn start_redis(bin: &std::path::Path) -> (tokio::process::Child, u16) {
    let port = free_port();
    let no_persistence = ["--save", "", "--appendonly", "no"];
    (start_redis_on(bin, port, &no_persistence).await, port)
}

/// A `redis-server` on `port` with `args`, ready (killed on drop).
async fn start_redis_on(bin: &std::path::Path, port: u16, args: &[&str]) -> tokio::process::Child {
    let mut child = tokio::process::Command::new(bin)
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--protected-mode", "yes"])
        .args(args)
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("redis-server starts");
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(l) = lines.next_line().await.unwrap() {
            if l.contains("Ready to accept connections") {
                return;
            }
        }
        panic!("redis-server exited before it was ready");
    })
    .await
    .expect("redis ready line");
    // Keep reading its output so it never blocks on a full pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    child
}

fn config(model: &str, sim: &str, redis_port: u16, mode: &str) -> String {
    format!(
        r#"
[admin]
listen = "127.0.0.1:0"
token_env = "SY_LR_ADMIN_TOKEN"
[limits]
state = "redis"
redis_url = "redis://127.0.0.1:{redis_port}/"
on_redis_error = "{mode}"
redis_timeout_ms = 500
[tenancy]
require_key = true
[[tenants]]
name = "rpm"
api_key_env = "SY_LR_RPM_KEY"
[tenants.limits]
requests_per_minute = 600
tokens_per_minute = 60000
[[tenants]]
name = "tpm"
api_key_env = "SY_LR_TPM_KEY"
[tenants.limits]
tokens_per_minute = 60000
[[tenants]]
name = "budget"
api_key_env = "SY_LR_BUDGET_KEY"
[tenants.limits]
daily_budget_usd = 0.5
[[tenants]]
name = "kill"
api_key_env = "SY_LR_KILL_KEY"
[tenants.limits]
requests_per_minute = 100000
[[prices]]
model = "{model}"
prompt_per_mtok = 0.0
output_per_mtok = 1000.0
[[pools]]
name = "p"
models = ["{model}"]
workers = [{{ url = "{sim}" }}]
"#
    )
}

/// A gateway process with the shared-store config; its URL and admin URL.
async fn gateway(name: &str, toml: &str) -> (tokio::process::Child, String, String) {
    let file = config_file(name, toml);
    let env = [
        ("SY_LR_ADMIN_TOKEN", ADMIN_TOKEN),
        ("SY_LR_RPM_KEY", RPM_KEY),
        ("SY_LR_TPM_KEY", TPM_KEY),
        ("SY_LR_BUDGET_KEY", BUDGET_KEY),
        ("SY_LR_KILL_KEY", KILL_KEY),
    ];
    let r = serve_binary_with(&file, &env, None).await;
    (r.child, r.url, r.admin.unwrap_or_default())
}

fn body(model: &str, content: &str, max_tokens: u32) -> Value {
    json!({"model": model, "max_tokens": max_tokens, "ignore_eos": true,
           "messages": [{"role": "user", "content": content}]})
}

/// One request's status, error code and tokens used.
async fn send(c: &reqwest::Client, url: &str, key: &str, body: &Value) -> (u16, String, u64) {
    let r = c
        .post(format!("{url}/v1/chat/completions"))
        .bearer_auth(key)
        .json(body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let v: Value = r.json().await.unwrap_or(Value::Null);
    let code = v["error"]["param"]
        .as_str()
        .or(v["error"]["code"].as_str())
        .unwrap_or_default()
        .to_string();
    (
        status,
        code,
        v["usage"]["total_tokens"].as_u64().unwrap_or(0),
    )
}

/// `total` requests, `per_side` at a time against each gateway; the admitted
/// count and tokens, and the seconds the run took.
async fn load(
    urls: &[String],
    key: &str,
    body: &Value,
    total: u64,
    per_side: usize,
) -> (u64, u64, f64) {
    let left = Arc::new(AtomicU64::new(total));
    let admitted = Arc::new(AtomicU64::new(0));
    let tokens = Arc::new(AtomicU64::new(0));
    let start = std::time::Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for url in urls {
        for _ in 0..per_side {
            let (url, key, body) = (url.clone(), key.to_string(), body.clone());
            let (left, admitted, tokens) = (left.clone(), admitted.clone(), tokens.clone());
            tasks.spawn(async move {
                let c = client();
                while left
                    .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
                    .is_ok()
                {
                    let (status, code, used) = send(&c, &url, &key, &body).await;
                    match status {
                        200 => {
                            admitted.fetch_add(1, Ordering::Relaxed);
                            tokens.fetch_add(used, Ordering::Relaxed);
                        }
                        429 => assert!(code.ends_with("_per_minute"), "{code}"),
                        s => panic!("unexpected status {s} {code}"),
                    }
                }
            });
        }
    }
    while let Some(r) = tasks.join_next().await {
        r.unwrap();
    }
    let secs = start.elapsed().as_secs_f64();
    (
        admitted.load(Ordering::Relaxed),
        tokens.load(Ordering::Relaxed),
        secs,
    )
}

/// Admitted within 2 % of the limit, plus what refilled while the run lasted
/// (GCRA refills continuously: limit/60 a second).
fn within(what: &str, admitted: f64, limit: f64, secs: f64) {
    let most = limit + limit / 60.0 * secs;
    eprintln!(
        "{what}: admitted {admitted} of {limit} (+{:.1} refilled in {secs:.2}s)",
        most - limit
    );
    assert!(
        admitted >= limit * 0.98,
        "{what}: {admitted} admitted, limit {limit}"
    );
    assert!(
        admitted <= most * 1.02,
        "{what}: {admitted} admitted, at most {most:.0} allowed"
    );
}

#[tokio::test]
async fn two_replicas_share_limits_budgets_and_the_failure_mode() {
    let Some(bin) = redis_server() else { return };
    let (mut redis, port) = start_redis(&bin).await;
    let s = sims(1, 50.0).await;
    let model = sim_model();
    let (_a, open, open_admin) =
        gateway("lr-open", &config(&model, &s[0].url(), port, "open")).await;
    let (_b, closed, closed_admin) =
        gateway("lr-closed", &config(&model, &s[0].url(), port, "closed")).await;
    let both = [open.clone(), closed.clone()];

    // Requests: 900 small requests from both sides at once against 600 a minute.
    let small = body(&model, "shared limits", 1);
    let (n, _, secs) = load(&both, RPM_KEY, &small, 900, 16).await;
    within("requests per minute", n as f64, 600.0, secs);

    // Tokens: requests of about 250 tokens against 60k a minute; what counts
    // is the tokens the admitted requests really used.
    let big = body(&model, &"tokens ".repeat(140), 1);
    let (_, used, secs) = load(&both, TPM_KEY, &big, 400, 16).await;
    within("tokens per minute", used as f64, 60_000.0, secs);

    budget(&both, &model).await;
    shared_keys(&open_admin, &closed_admin, &closed, &model).await;
    kill_redis(&mut redis, &open, &closed, &model).await;
}

/// $0.001 an output token, $0.50 a day: 10-token requests from both sides until
/// one is refused for the budget; once the requests in flight have settled,
/// every request is refused, naming the budget.
async fn budget(both: &[String; 2], model: &str) {
    let b = body(model, "budget", 10);
    let c = client();
    let mut sent = 0;
    loop {
        let r =
            futures_util::future::join_all(both.iter().map(|u| send(&c, u, BUDGET_KEY, &b))).await;
        sent += 2;
        assert!(sent < 200, "the budget never ran out");
        if r.iter().any(|(s, _, _)| *s == 429) {
            for (s, code, _) in &r {
                assert!(*s == 200 || code == "daily_budget_usd", "{s} {code}");
            }
            break;
        }
    }
    for _ in 0..5 {
        for u in both {
            let (s, code, _) = send(&c, u, BUDGET_KEY, &b).await;
            assert_eq!((s, code.as_str()), (429, "daily_budget_usd"));
        }
    }
}

/// A key issued by one replica works on the other; revoked there, it stops
/// working on both.
async fn shared_keys(admin_a: &str, admin_b: &str, url_b: &str, model: &str) {
    let c = client();
    let created: Value = c
        .post(format!("{admin_a}/admin/keys"))
        .bearer_auth(ADMIN_TOKEN)
        .json(&json!({"tenant": "kill"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let key = created["key"].as_str().expect("a key").to_string();
    let id = created["id"].as_str().unwrap().to_string();
    let b = body(model, "issued elsewhere", 1);
    eventually(
        Duration::from_secs(10),
        "key known to the other replica",
        || async { (send(&c, url_b, &key, &b).await.0 == 200).then_some(()) },
    )
    .await;
    let r = c
        .delete(format!("{admin_b}/admin/keys/{id}"))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    assert_eq!(send(&c, url_b, &key, &b).await.0, 401);
}

/// Redis gone: the fail-open replica admits (without rate-limit headers), the
/// fail-closed one answers 503, and both count the store's failures.
async fn kill_redis(redis: &mut tokio::process::Child, open: &str, closed: &str, model: &str) {
    let c = client();
    let b = body(model, "before the kill", 1);
    assert_eq!(send(&c, open, KILL_KEY, &b).await.0, 200);
    assert_eq!(send(&c, closed, KILL_KEY, &b).await.0, 200);
    redis.kill().await.unwrap();
    for _ in 0..3 {
        let r = c
            .post(format!("{open}/v1/chat/completions"))
            .bearer_auth(KILL_KEY)
            .json(&b)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert!(r.headers().get("x-ratelimit-limit-requests").is_none());
        let (s, code, _) = send(&c, closed, KILL_KEY, &b).await;
        assert_eq!((s, code.as_str()), (503, "limits_store_unavailable"));
    }
    for url in [open, closed] {
        let m = scrape(url).await;
        let errors = metric_sum(
            &m,
            "switchyard_limits_store_errors_total",
            &[("op", "admit")],
        );
        assert!(errors >= 3.0, "{url}: {errors} store errors counted");
    }
}

const STALL_KEY: &str = "sk-redis-stall-5a6b7c8d9e";
const RATE_KEY: &str = "sk-redis-rate-0e1f2a3b4c";
const SPEND_KEY: &str = "sk-redis-spend-d5e6f7a8b9";
/// The concurrency lease in these tests (ms): short, so self-healing shows fast.
const LEASE_MS: u64 = 2_000;

fn fault_config(model: &str, sim: &str, redis_port: u16, mode: &str) -> String {
    format!(
        r#"
[limits]
state = "redis"
redis_url = "redis://127.0.0.1:{redis_port}/"
on_redis_error = "{mode}"
redis_timeout_ms = 200
redis_lease_ms = {LEASE_MS}
[tenancy]
require_key = true
[[tenants]]
name = "stall"
api_key_env = "SY_LR_STALL_KEY"
[tenants.limits]
max_concurrent_requests = 8
[[tenants]]
name = "rate"
api_key_env = "SY_LR_RATE_KEY"
[tenants.limits]
requests_per_minute = 60
[[tenants]]
name = "spend"
api_key_env = "SY_LR_SPEND_KEY"
[tenants.limits]
daily_budget_usd = 0.02
[[prices]]
model = "{model}"
prompt_per_mtok = 0.0
output_per_mtok = 1000.0
[[pools]]
name = "p"
models = ["{model}"]
workers = [{{ url = "{sim}" }}]
"#
    )
}

async fn fault_gateway(name: &str, toml: &str) -> Replica {
    let env = [
        ("SY_LR_STALL_KEY", STALL_KEY),
        ("SY_LR_RATE_KEY", RATE_KEY),
        ("SY_LR_SPEND_KEY", SPEND_KEY),
    ];
    serve_binary_with(&config_file(name, toml), &env, None).await
}

/// One Redis command's integer answer.
async fn redis_int(port: u16, args: &[&str]) -> i64 {
    let c = redis::Client::open(format!("redis://127.0.0.1:{port}/")).unwrap();
    let mut conn = c.get_multiplexed_async_connection().await.unwrap();
    let mut cmd = redis::cmd(args[0]);
    for a in &args[1..] {
        cmd.arg(*a);
    }
    cmd.query_async(&mut conn).await.unwrap()
}

fn signal(child: &tokio::process::Child, sig: &str) {
    let pid = child.id().expect("running").to_string();
    let ok = std::process::Command::new("kill")
        .args([sig, &pid])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill {sig} {pid}");
}

/// `n` streams of the stall tenant opened at once: those admitted (their
/// first bytes read, kept open) and how many were refused for concurrency.
async fn open_streams(url: &str, n: usize, model: &str) -> (Vec<reqwest::Response>, usize) {
    let b = json!({"model": model, "max_tokens": 1800, "ignore_eos": true, "stream": true,
                   "messages": [{"role": "user", "content": "a long answer"}]});
    let c = client();
    let sent = (0..n).map(|_| {
        c.post(format!("{url}/v1/chat/completions"))
            .bearer_auth(STALL_KEY)
            .json(&b)
            .send()
    });
    let (mut open, mut refused) = (Vec::new(), 0);
    for r in futures_util::future::join_all(sent).await {
        let mut r = r.unwrap();
        match r.status().as_u16() {
            200 => {
                r.chunk().await.unwrap();
                open.push(r);
            }
            429 => refused += 1,
            s => panic!("status {s}"),
        }
    }
    (open, refused)
}

/// Redis paused under live streams and new requests: the admits that timed
/// out are taken back when it resumes (even those Redis ran late), the
/// leases return to zero when the streams end, the refused requests were not
/// charged, and a replica killed with streams open frees its slots within a lease.
#[tokio::test]
async fn a_redis_stall_or_a_crashed_replica_leaks_nothing() {
    let Some(bin) = redis_server() else { return };
    let (redis, port) = start_redis(&bin).await;
    let s = sims(1, 1.0).await;
    let model = sim_model();
    let a = fault_gateway(
        "lr-stall-a",
        &fault_config(&model, &s[0].url(), port, "closed"),
    )
    .await;
    let leases = "switchyard:limits:t|stall:leases";

    // Four of eight slots in use; Redis stops.
    let (streams, refused) = open_streams(&a.url, 4, &model).await;
    assert_eq!((streams.len(), refused), (4, 0));
    assert_eq!(redis_int(port, &["ZCARD", leases]).await, 4);
    signal(&redis, "-STOP");
    // Requests arriving now time out and are refused (closed mode); their
    // admits run when Redis resumes, and four of them would fit.
    let c = client();
    let b = body(&model, "during the stall", 1);
    let stalled = futures_util::future::join_all(
        (0..6)
            .map(|_| send(&c, &a.url, STALL_KEY, &b))
            .chain((0..20).map(|_| send(&c, &a.url, RATE_KEY, &b))),
    )
    .await;
    for (st, code, _) in &stalled {
        assert_eq!((*st, code.as_str()), (503, "limits_store_unavailable"));
    }
    tokio::time::sleep(Duration::from_secs(2)).await; // the stall itself
    signal(&redis, "-CONT");
    drop(streams);
    eventually(
        Duration::from_millis(LEASE_MS),
        "no slot held once every stream ended",
        || async { (redis_int(port, &["ZCARD", leases]).await == 0).then_some(()) },
    )
    .await;
    // Nothing leaked: all eight slots are free again.
    let (streams, refused) = open_streams(&a.url, 8, &model).await;
    assert_eq!((streams.len(), refused), (8, 0));
    drop(streams);
    // The twenty refused requests of `rate` were not charged: a full minute's
    // 60 less this one.
    let r = c
        .post(format!("{}/v1/chat/completions", a.url))
        .bearer_auth(RATE_KEY)
        .json(&b)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let left = r.headers()["x-ratelimit-remaining-requests"]
        .to_str()
        .unwrap();
    assert_eq!(left, "59", "refused requests were charged");

    crashed_replica_frees_its_slots(&a.url, &s[0].url(), port, &model).await;
    let m = scrape(&a.url).await;
    let failovers = metric_sum(
        &m,
        "switchyard_limits_store_failovers_total",
        &[("result", "refused")],
    );
    assert!(failovers >= 26.0, "{failovers} refusals counted");
}

/// A second replica takes all eight slots and is killed: within a lease
/// (and a renewal's third of one) the first replica has all eight again.
async fn crashed_replica_frees_its_slots(url_a: &str, sim: &str, port: u16, model: &str) {
    let toml = fault_config(model, sim, port, "closed");
    let mut b = fault_gateway("lr-stall-b", &toml).await;
    let (streams, _) = open_streams(&b.url, 8, model).await;
    assert_eq!(streams.len(), 8);
    assert_eq!(
        open_streams(url_a, 1, model).await.1,
        1,
        "all slots are B's"
    );
    b.child.start_kill().unwrap();
    b.child.wait().await.unwrap();
    drop(streams);
    let killed = std::time::Instant::now();
    eventually(
        Duration::from_millis(LEASE_MS * 2),
        "the killed replica's slots expired",
        || async {
            let (open, _) = open_streams(url_a, 8, model).await;
            (open.len() == 8).then_some(())
        },
    )
    .await;
    eprintln!("slots back {:?} after the kill", killed.elapsed());
}

/// Spend written with AOF (`appendfsync always` here; `everysec` in
/// production loses at most a second) survives a Redis restart: the spent
/// budget still refuses afterwards.
#[tokio::test]
async fn spend_survives_a_redis_restart_with_aof() {
    let Some(bin) = redis_server() else { return };
    let dir = std::env::temp_dir().join(format!("switchyard-lr-aof-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let port = free_port();
    let d = dir.to_str().unwrap();
    let aof = [
        "--save",
        "",
        "--appendonly",
        "yes",
        "--appendfsync",
        "always",
        "--dir",
        d,
    ];
    let mut redis = start_redis_on(&bin, port, &aof).await;
    let s = sims(1, 50.0).await;
    let model = sim_model();
    let gw = fault_gateway("lr-aof", &fault_config(&model, &s[0].url(), port, "closed")).await;
    let c = client();
    let b = body(&model, "spend", 10);
    for _ in 0..2 {
        assert_eq!(send(&c, &gw.url, SPEND_KEY, &b).await.0, 200);
    }
    let refused = || async {
        let (st, code, _) = send(&c, &gw.url, SPEND_KEY, &b).await;
        (st != 503).then_some((st, code))
    };
    let (st, code) = eventually(Duration::from_secs(10), "settled", || async {
        refused().await.filter(|(st, _)| *st == 429)
    })
    .await;
    assert_eq!((st, code.as_str()), (429, "daily_budget_usd"));
    redis.kill().await.unwrap();
    let _redis = start_redis_on(&bin, port, &aof).await;
    let (st, code) = eventually(Duration::from_secs(10), "reconnected", refused).await;
    assert_eq!((st, code.as_str()), (429, "daily_budget_usd"), "spend lost");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `serve` asks the limits' Redis once whether it persists spend: without
/// AOF or RDB save points it warns that budgets are lost on a Redis restart;
/// with AOF on it says so and does not warn.
#[tokio::test]
async fn a_redis_without_persistence_is_warned_about_at_start() {
    let Some(bin) = redis_server() else { return };
    let s = sims(1, 50.0).await;
    let model = sim_model();
    let (_bare, bare_port) = start_redis(&bin).await;
    let dir = std::env::temp_dir().join(format!("switchyard-lr-warn-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let aof_port = free_port();
    let d = dir.to_str().unwrap();
    let aof = ["--save", "", "--appendonly", "yes", "--dir", d];
    let _aof = start_redis_on(&bin, aof_port, &aof).await;
    let mut logs = Vec::new();
    for (name, port) in [("lr-warn-bare", bare_port), ("lr-warn-aof", aof_port)] {
        let toml = fault_config(&model, &s[0].url(), port, "open");
        let stderr = dir.join(format!("{name}.stderr"));
        let env = [
            ("SY_LR_STALL_KEY", STALL_KEY),
            ("SY_LR_RATE_KEY", RATE_KEY),
            ("SY_LR_SPEND_KEY", SPEND_KEY),
        ];
        let gw = serve_binary_with(&config_file(name, &toml), &env, Some(&stderr)).await;
        // The answer to the one question: a warning, or the AOF line.
        let text = eventually(Duration::from_secs(20), "the persistence line", || {
            let t = std::fs::read_to_string(&stderr).unwrap_or_default();
            async move { t.contains("limits store (Redis)").then_some(t) }
        })
        .await;
        logs.push(text);
        drop(gw);
    }
    assert!(
        logs[0].contains("WARN")
            && logs[0].contains("budgets and spend are lost on a Redis restart"),
        "{}",
        logs[0]
    );
    assert!(logs[1].contains("append-only file on"), "{}", logs[1]);
    assert!(
        !logs[1].contains("are lost on a Redis restart"),
        "{}",
        logs[1]
    );
    let _ = std::fs::remove_dir_all(&dir);
}
