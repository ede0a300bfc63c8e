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

/// A `redis-server` on a free loopback port, ready (killed on drop).
async fn start_redis(bin: &std::path::Path) -> (tokio::process::Child, u16) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut child = tokio::process::Command::new(bin)
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args([
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "yes",
        ])
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
    (child, port)
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
