//! API keys, tenants and limits through the real binary: 401 without a
//! recognised key, 403 for a model the tenant may not use, 429 with
//! `Retry-After` and the limit named for requests per minute, concurrency,
//! tokens and budgets, worst cases reserved up front (a request that can
//! never fit is a 400), OpenAI's rate-limit headers on every limited response,
//! the token estimate corrected by the real usage, keys created, listed and
//! revoked through the admin API, and no key in `/metrics`, the access log or
//! the process's log output.

mod support;

use serde_json::{json, Value};
use std::time::Duration;
use support::*;
use switchyard::tenancy::limits::headers as h;

const ADMIN_TOKEN: &str = "limits-admin-token-3f9c1a7e52b0";
const ACME_KEY: &str = "sk-acme-limits-5d2c81f0a9e4";
const NARROW_KEY: &str = "sk-narrow-limits-77ab01c3d2";
const RPM_KEY: &str = "sk-rpm-limits-0c4e9a11b7";
const CONC_KEY: &str = "sk-conc-limits-a3b2c1d0e9";
const TOK_KEY: &str = "sk-tok-limits-19f8e7d6c5";
const BUDGET_KEY: &str = "sk-budget-limits-4a5b6c7d8e";

/// The gateway process: client URL, admin URL, and the files it writes.
struct Gw {
    _child: tokio::process::Child,
    url: String,
    admin: String,
    access_log: std::path::PathBuf,
    stderr: std::path::PathBuf,
}

fn sha256_hex(s: &str) -> String {
    switchyard::tenancy::keys::digest(s.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn config(model: &str, sim: &str, dir: &std::path::Path) -> String {
    format!(
        r#"
[admin]
listen = "127.0.0.1:0"
token_env = "SY_LIMITS_ADMIN_TOKEN"
[access_log]
enabled = true
path = "{log}"
[tenancy]
require_key = true
[[tenants]]
name = "acme"
api_key_env = "SY_LIMITS_ACME_KEY"
allowed_models = ["{model}"]
[[tenants]]
name = "narrow"
key_sha256 = "{narrow}"
allowed_models = ["other-*"]
[[tenants]]
name = "rpm"
api_key_env = "SY_LIMITS_RPM_KEY"
[tenants.limits]
requests_per_minute = 3
[[tenants]]
name = "conc"
api_key_env = "SY_LIMITS_CONC_KEY"
[tenants.model_limits."{model}"]
max_concurrent_requests = 1
[[tenants]]
name = "tok"
api_key_env = "SY_LIMITS_TOK_KEY"
[tenants.key_limits]
tokens_per_minute = 600
[[tenants]]
name = "budget"
api_key_env = "SY_LIMITS_BUDGET_KEY"
[tenants.limits]
daily_budget_usd = 0.03
[[prices]]
model = "{model}"
prompt_per_mtok = 0.0
output_per_mtok = 1000.0
[[pools]]
name = "p"
models = ["{model}"]
workers = [{{ url = "{sim}" }}]
"#,
        log = dir.join("access.jsonl").display(),
        narrow = sha256_hex(NARROW_KEY),
    )
}

async fn start(model: &str, sim: &str) -> Gw {
    let file = config_file("limits", "");
    let dir = file.parent().unwrap().to_path_buf();
    std::fs::write(&file, config(model, sim, &dir)).unwrap();
    let stderr = dir.join("stderr.log");
    let env = [
        ("SY_LIMITS_ADMIN_TOKEN", ADMIN_TOKEN),
        ("SY_LIMITS_ACME_KEY", ACME_KEY),
        ("SY_LIMITS_RPM_KEY", RPM_KEY),
        ("SY_LIMITS_CONC_KEY", CONC_KEY),
        ("SY_LIMITS_TOK_KEY", TOK_KEY),
        ("SY_LIMITS_BUDGET_KEY", BUDGET_KEY),
        ("RUST_LOG", "debug"),
    ];
    let r = serve_binary_with(&file, &env, Some(&stderr)).await;
    Gw {
        _child: r.child,
        url: r.url,
        admin: r.admin.expect("admin listener"),
        access_log: dir.join("access.jsonl"),
        stderr,
    }
}

fn body(model: &str, max_tokens: u32, stream: bool) -> Value {
    json!({"model": model, "max_tokens": max_tokens, "ignore_eos": true, "stream": stream,
           "messages": [{"role": "user", "content": "limits, keys and budgets"}]})
}

async fn post(url: &str, key: Option<&str>, body: &Value) -> reqwest::Response {
    let mut req = client()
        .post(format!("{url}/v1/chat/completions"))
        .json(body);
    if let Some(k) = key {
        req = req.bearer_auth(k);
    }
    req.send().await.unwrap()
}

fn header(r: &reqwest::Response, name: &http::HeaderName) -> Option<String> {
    r.headers()
        .get(name)
        .map(|v| v.to_str().unwrap().to_string())
}

fn num(r: &reqwest::Response, name: &http::HeaderName) -> u64 {
    header(r, name)
        .unwrap_or_else(|| panic!("no {name}"))
        .parse()
        .unwrap()
}

/// `1s`, `20ms`, `6m0s`, `1h2m3s`: OpenAI's reset format.
fn is_reset(v: &str) -> bool {
    let v = v.strip_suffix("ms").or_else(|| v.strip_suffix('s'));
    v.is_some_and(|v| {
        v.split(['h', 'm'])
            .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
    })
}

async fn error_of(r: reqwest::Response) -> (u16, Value) {
    let status = r.status().as_u16();
    let v: Value = r.json().await.unwrap();
    (status, v["error"].clone())
}

/// Requests finished so far by the gateway (its own count): the point after
/// which a finished request's usage and cost have been settled.
async fn finished(url: &str, n: f64) {
    eventually(Duration::from_secs(10), "requests counted", || async {
        let m = scrape(url).await;
        let seen = metric_sum(&m, "switchyard_requests_total", &[("class", "ok")]);
        (seen >= n).then_some(())
    })
    .await;
}

#[tokio::test]
async fn keys_models_and_limits() {
    let s = sims(1, 20.0).await;
    let model = sim_model();
    let gw = start(&model, &s[0].url()).await;
    let url = &gw.url;

    // 401: no key, an unknown key.
    let (st, e) = error_of(post(url, None, &body(&model, 2, false)).await).await;
    assert_eq!(
        (st, e["code"].as_str()),
        (401, Some("invalid_api_key")),
        "{e}"
    );
    let (st, e) = error_of(post(url, Some("sk-nope"), &body(&model, 2, false)).await).await;
    assert_eq!(
        (st, e["code"].as_str()),
        (401, Some("invalid_api_key")),
        "{e}"
    );
    assert_eq!(e["type"], "authentication_error");

    // A configured key works, and no limit means no rate-limit headers.
    let r = post(url, Some(ACME_KEY), &body(&model, 2, false)).await;
    assert_eq!(r.status(), 200);
    assert!(header(&r, &h::LIMIT_REQUESTS).is_none());

    // 403: a key given as its SHA-256, whose tenant may not use this model.
    let (st, e) = error_of(post(url, Some(NARROW_KEY), &body(&model, 2, false)).await).await;
    assert_eq!(
        (st, e["code"].as_str()),
        (403, Some("model_not_allowed")),
        "{e}"
    );
    assert!(e["message"].as_str().unwrap().contains(&model));

    // 429 on the fourth request of three per minute, every header present.
    for remaining in [2, 1, 0] {
        let r = post(url, Some(RPM_KEY), &body(&model, 2, false)).await;
        assert_eq!(r.status(), 200);
        assert_eq!(num(&r, &h::LIMIT_REQUESTS), 3);
        assert_eq!(num(&r, &h::REMAINING_REQUESTS), remaining);
        assert!(is_reset(&header(&r, &h::RESET_REQUESTS).unwrap()));
    }
    let r = post(url, Some(RPM_KEY), &body(&model, 2, false)).await;
    assert_eq!(r.status(), 429);
    let retry: u64 = header(&r, &http::header::RETRY_AFTER)
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=60).contains(&retry), "Retry-After {retry}");
    assert_eq!(num(&r, &h::REMAINING_REQUESTS), 0);
    assert_eq!(num(&r, &h::LIMIT_REQUESTS), 3);
    let (_, e) = error_of(r).await;
    assert_eq!(e["code"], "rate_limit_exceeded");
    assert_eq!(e["param"], "requests_per_minute");
    let msg = e["message"].as_str().unwrap();
    assert!(
        msg.contains("tenant `rpm`") && msg.contains("3 requests per minute"),
        "{msg}"
    );

    // Uploads count against the same limit (the fourth request of three).
    let upload = format!(
        "--b\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\n{model}\r\n\
         --b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\r\nRIFF\r\n--b--\r\n"
    );
    let r = client()
        .post(format!("{url}/v1/audio/transcriptions"))
        .bearer_auth(RPM_KEY)
        .header("content-type", "multipart/form-data; boundary=b")
        .body(upload)
        .send()
        .await
        .unwrap();
    let (st, e) = error_of(r).await;
    assert_eq!(
        (st, e["param"].as_str()),
        (429, Some("requests_per_minute")),
        "{e}"
    );

    concurrency(url, &model).await;
    token_correction(url, &model).await;
    budget(url, &model).await;
    let issued = admin_keys(&gw, &model).await;
    no_key_anywhere(&gw, &issued).await;
}

/// One request in flight for (conc, model): a second one is refused until it ends.
async fn concurrency(url: &str, model: &str) {
    let mut first = post(url, Some(CONC_KEY), &body(model, 2_000, true)).await;
    assert_eq!(first.status(), 200);
    first.chunk().await.unwrap();
    let (st, e) = error_of(post(url, Some(CONC_KEY), &body(model, 2, false)).await).await;
    assert_eq!(
        (st, e["param"].as_str()),
        (429, Some("max_concurrent_requests")),
        "{e}"
    );
    assert!(e["message"]
        .as_str()
        .unwrap()
        .contains(&format!("model `{model}`")));
    drop(first);
    eventually(Duration::from_secs(10), "slot released", || async {
        let r = post(url, Some(CONC_KEY), &body(model, 2, false)).await;
        (r.status() == 200).then_some(())
    })
    .await;
}

/// The reservation is the prompt and `max_tokens`; the real usage (prompt and
/// 300 output tokens) replaces it when the request ends.
async fn token_correction(url: &str, model: &str) {
    let base = metric_sum(
        &scrape(url).await,
        "switchyard_requests_total",
        &[("class", "ok")],
    );
    let r = post(url, Some(TOK_KEY), &body(model, 300, false)).await;
    assert_eq!(r.status(), 200);
    assert_eq!(num(&r, &h::LIMIT_TOKENS), 600);
    let first = num(&r, &h::REMAINING_TOKENS);
    assert!(is_reset(&header(&r, &h::RESET_TOKENS).unwrap()));
    let usage: Value = r.json().await.unwrap();
    let output = usage["usage"]["completion_tokens"].as_u64().unwrap();
    assert_eq!(output, 300);
    finished(url, base + 1.0).await;
    // The 300 output tokens were reserved up front, with the prompt.
    assert!(
        first <= 600 - output,
        "{first} tokens left after a request reserving {output} output tokens"
    );
    let r = post(url, Some(TOK_KEY), &body(model, 1, false)).await;
    let second = num(&r, &h::REMAINING_TOKENS);
    // It used what it reserved (ignore_eos): the settlement changed little,
    // the next request takes its own prompt (less what refilled meanwhile,
    // at 10 tokens a second).
    assert!(
        second < first && first - second < output / 2,
        "remaining tokens {first} then {second} after {output} output tokens"
    );
}

/// $0.001 an output token, $0.03 a day: ten-token requests pass until the
/// spend reaches the budget, then every request is refused, naming it.
async fn budget(url: &str, model: &str) {
    let mut spent = 0.0;
    let mut ok = 0.0;
    let base = metric_sum(
        &scrape(url).await,
        "switchyard_requests_total",
        &[("class", "ok")],
    );
    while spent < 0.03 - 1e-9 {
        let r = post(url, Some(BUDGET_KEY), &body(model, 10, false)).await;
        assert_eq!(r.status(), 200, "refused after ${spent}");
        let v: Value = r.json().await.unwrap();
        spent += v["usage"]["completion_tokens"].as_f64().unwrap() * 0.001;
        ok += 1.0;
        finished(url, base + ok).await;
    }
    for _ in 0..3 {
        let r = post(url, Some(BUDGET_KEY), &body(model, 10, false)).await;
        assert_eq!(r.status(), 429);
        let retry: u64 = header(&r, &http::header::RETRY_AFTER)
            .unwrap()
            .parse()
            .unwrap();
        assert!((1..=86_400).contains(&retry));
        let (_, e) = error_of(r).await;
        assert_eq!(e["code"], "insufficient_quota");
        assert_eq!(e["type"], "insufficient_quota");
        assert_eq!(e["param"], "daily_budget_usd");
        assert!(e["message"].as_str().unwrap().contains("tenant `budget`"));
    }
}

async fn admin(gw: &Gw, method: reqwest::Method, path: &str, body: Option<Value>) -> (u16, Value) {
    let mut req = client()
        .request(method, format!("{}{path}", gw.admin))
        .bearer_auth(ADMIN_TOKEN);
    if let Some(b) = body {
        req = req.json(&b);
    }
    let r = req.send().await.unwrap();
    let st = r.status().as_u16();
    let text = r.text().await.unwrap();
    (st, serde_json::from_str(&text).unwrap_or(Value::Null))
}

/// Create a key, use it, list it (without its secret), revoke it; returns it.
async fn admin_keys(gw: &Gw, model: &str) -> String {
    let (st, created) = admin(
        gw,
        reqwest::Method::POST,
        "/admin/keys",
        Some(json!({"tenant": "acme"})),
    )
    .await;
    assert_eq!(st, 201, "{created}");
    let key = created["key"].as_str().unwrap().to_string();
    let id = created["id"].as_str().unwrap().to_string();
    assert!(key.starts_with("sk-sy-") && key.contains(&id));
    let (st, _) = admin(
        gw,
        reqwest::Method::POST,
        "/admin/keys",
        Some(json!({"tenant": "ghost"})),
    )
    .await;
    assert_eq!(st, 404);
    assert_eq!(
        post(&gw.url, Some(&key), &body(model, 2, false))
            .await
            .status(),
        200
    );
    let (st, list) = admin(gw, reqwest::Method::GET, "/admin/keys", None).await;
    assert_eq!(st, 200);
    let text = list.to_string();
    assert!(!text.contains(&key) && !text.contains(ACME_KEY), "{text}");
    let row = list["keys"]
        .as_array()
        .unwrap()
        .iter()
        .find(|k| k["id"] == id.as_str())
        .unwrap();
    assert_eq!(
        (row["tenant"].as_str(), row["source"].as_str()),
        (Some("acme"), Some("admin"))
    );
    let configured = list["keys"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|k| k["source"] == "config");
    assert_eq!(configured.count(), 6);
    let (st, _) = admin(
        gw,
        reqwest::Method::DELETE,
        &format!("/admin/keys/{id}"),
        None,
    )
    .await;
    assert_eq!(st, 204);
    let (st, _) = admin(
        gw,
        reqwest::Method::DELETE,
        &format!("/admin/keys/{id}"),
        None,
    )
    .await;
    assert_eq!(st, 404);
    let (st, e) = error_of(post(&gw.url, Some(&key), &body(model, 2, false)).await).await;
    assert_eq!((st, e["code"].as_str()), (401, Some("invalid_api_key")));
    key
}

/// No key, configured or issued, in the metrics, the access log or the logs;
/// refusals are counted by reason.
async fn no_key_anywhere(gw: &Gw, issued: &str) {
    let m = scrape(&gw.url).await;
    for (reason, at_least) in [
        ("invalid_api_key", 2.0),
        ("missing_api_key", 1.0),
        ("model_not_allowed", 1.0),
        ("requests_per_minute", 1.0),
        ("max_concurrent_requests", 1.0),
        ("daily_budget_usd", 3.0),
    ] {
        let n = metric_sum(&m, "switchyard_limit_refusals_total", &[("reason", reason)]);
        assert!(n >= at_least, "{reason}: {n}");
    }
    let log = eventually(Duration::from_secs(10), "access log written", || async {
        let t = std::fs::read_to_string(&gw.access_log).ok()?;
        t.contains("\"tenant\":\"budget\"").then_some(t)
    })
    .await;
    let stderr = std::fs::read_to_string(&gw.stderr).unwrap();
    for key in [
        ACME_KEY, NARROW_KEY, RPM_KEY, CONC_KEY, TOK_KEY, BUDGET_KEY, issued,
    ] {
        let secret = &key[key.len() - 10..];
        for (what, text) in [("metrics", &m), ("access log", &log), ("stderr", &stderr)] {
            assert!(!text.contains(secret), "a key shows in the {what}");
        }
    }
}

/// With a pool tokenizer (here the sim's, exact for `switchyard sim`), the
/// prompt is counted exactly up front: the remaining tokens after the first
/// request are the limit less the engine's own prompt count.
#[tokio::test]
async fn prompt_tokens_are_exact_with_the_pools_tokenizer() {
    use switchyard::sim::kv_events::{EventFormat, KvEventsConfig};
    let sim = switchyard::sim::spawn(switchyard::sim::SimConfig {
        time_scale: 50.0,
        model: "sim-llama-8b".into(),
        max_model_len: 4096,
        kv_events: Some(KvEventsConfig {
            events: "tcp://127.0.0.1:0".into(),
            replay: Some("tcp://127.0.0.1:0".into()),
            topic: "kv-events".into(),
            format: EventFormat::Map,
            drop: None,
            reorder: None,
            block_size: 16,
        }),
        ..switchyard::sim::SimConfig::default()
    })
    .await
    .expect("sim starts");
    let kv = sim.kv_endpoints().expect("events on");
    std::env::set_var("SY_LIMITS_EXACT_KEY", "sk-exact-limits-6e5d4c3b2a");
    let gw = gateway(&format!(
        r#"
[tenancy]
require_key = true
[[tenants]]
name = "exact"
api_key_env = "SY_LIMITS_EXACT_KEY"
[tenants.limits]
tokens_per_minute = 10000
[[pools]]
name = "p"
models = ["sim-llama-8b"]
tokenizer = "sim"
workers = [{{ url = "{}", kv_events = "{}", kv_replay = "{}" }}]
[pools.kv_events]
topic = "kv-events"
"#,
        sim.url(),
        kv.events,
        kv.replay.as_deref().unwrap()
    ))
    .await;
    let url = format!("http://{}", gw.addr);
    let content = "count these prompt tokens exactly, not by the bytes they take up";
    let b = json!({"model": "sim-llama-8b", "max_tokens": 1,
                   "messages": [{"role": "user", "content": content}]});
    let r = post(&url, Some("sk-exact-limits-6e5d4c3b2a"), &b).await;
    assert_eq!(r.status(), 200);
    let remaining = num(&r, &h::REMAINING_TOKENS);
    let v: Value = r.json().await.unwrap();
    let prompt = v["usage"]["prompt_tokens"].as_u64().unwrap();
    let estimate = switchyard::tenancy::limits::estimate_tokens(
        serde_json::to_string(&b["messages"]).unwrap().len(),
        None,
        false,
    );
    assert_ne!(prompt, estimate, "the byte estimate would pass too");
    // The exact prompt plus the one output token `max_tokens` reserves.
    assert_eq!(remaining, 10_000 - prompt - 1);
}

/// A sim of `model` whose answers end after a token or two unless the request
/// sets `ignore_eos`: the short answers that reservations must refund.
async fn short_sim(model: &str) -> switchyard::sim::SimHandle {
    switchyard::sim::spawn(switchyard::sim::SimConfig {
        time_scale: 50.0,
        model: model.into(),
        mean_output_tokens: 1,
        ..switchyard::sim::SimConfig::profile("tiny").expect("tiny profile")
    })
    .await
    .expect("sim starts")
}

/// Worst cases reserved up front, from the hostile side: requests that ask
/// for much output, `n` choices, more than a whole limit, no `max_tokens` at
/// all, and a budget that concurrent requests tried to overspend together.
#[tokio::test]
async fn the_worst_case_is_reserved_up_front() {
    let s = sims(1, 50.0).await;
    let model = sim_model();
    let short = short_sim("short-model").await;
    for (k, v) in [
        ("SY_WC_TPM", "sk-wc-tpm-31a4b5c6d7"),
        ("SY_WC_N", "sk-wc-n-8e9f0a1b2c"),
        ("SY_WC_SHORT", "sk-wc-short-3d4e5f6a7b"),
        ("SY_WC_BUDGET", "sk-wc-budget-c8d9e0f1a2"),
    ] {
        std::env::set_var(k, v);
    }
    let gw = gateway(&format!(
        r#"
[limits]
default_max_tokens = 250
[tenancy]
require_key = true
[[tenants]]
name = "tpm"
api_key_env = "SY_WC_TPM"
[tenants.limits]
tokens_per_minute = 600
[[tenants]]
name = "n"
api_key_env = "SY_WC_N"
[tenants.limits]
tokens_per_minute = 1000
[[tenants]]
name = "short"
api_key_env = "SY_WC_SHORT"
[tenants.limits]
tokens_per_minute = 600
[[tenants]]
name = "budget"
api_key_env = "SY_WC_BUDGET"
[tenants.limits]
daily_budget_usd = 0.05
[[prices]]
prompt_per_mtok = 0.0
output_per_mtok = 1000.0
[[pools]]
name = "p"
models = ["{model}"]
workers = [{{ url = "{}" }}]
[[pools]]
name = "short"
models = ["short-model"]
workers = [{{ url = "{}" }}]
"#,
        s[0].url(),
        short.url()
    ))
    .await;
    let url = format!("http://{}", gw.addr);
    concurrent_requests_share_the_limit(&url, &model).await;
    choices_are_reserved(&url, &model).await;
    a_short_answer_gives_back_its_reservation(&url).await;
    budgets_are_not_overspent(&url, &model).await;
}

/// 600 tokens a minute, four concurrent requests that may each use about
/// 210: two are admitted, two get 429 with `Retry-After`; 2000 output tokens
/// can never fit, so that is a 400 without `Retry-After` naming the limit.
async fn concurrent_requests_share_the_limit(url: &str, model: &str) {
    let key = "sk-wc-tpm-31a4b5c6d7";
    let b = body(model, 200, false);
    let answers = futures_util::future::join_all((0..4).map(|_| post(url, Some(key), &b))).await;
    let (mut ok, mut used) = (0, 0);
    for r in answers {
        match r.status().as_u16() {
            200 => {
                let v: Value = r.json().await.unwrap();
                used += v["usage"]["total_tokens"].as_u64().unwrap();
                ok += 1;
            }
            429 => {
                let retry = header(&r, &http::header::RETRY_AFTER).expect("Retry-After");
                assert!(retry.parse::<u64>().unwrap() >= 1);
                let (_, e) = error_of(r).await;
                assert_eq!(e["param"], "tokens_per_minute", "{e}");
            }
            s => panic!("status {s}"),
        }
    }
    assert_eq!(ok, 2, "two reservations of ~210 fit in 600, not {ok}");
    assert!(used <= 600, "{used} tokens used under a 600 TPM limit");
    let r = post(url, Some(key), &body(model, 2_000, false)).await;
    assert_eq!(r.status(), 400);
    assert!(header(&r, &http::header::RETRY_AFTER).is_none());
    let (_, e) = error_of(r).await;
    assert_eq!(
        (e["code"].as_str(), e["param"].as_str()),
        (Some("request_exceeds_limit"), Some("tokens_per_minute")),
        "{e}"
    );
    let msg = e["message"].as_str().unwrap();
    assert!(msg.contains("600 tokens per minute"), "{msg}");
}

/// `n: 4` reserves four times `max_tokens`; without `max_tokens` the
/// configured default (250) is reserved.
async fn choices_are_reserved(url: &str, model: &str) {
    let key = "sk-wc-n-8e9f0a1b2c";
    let mut b = body(model, 100, false);
    b["n"] = json!(4);
    let r = post(url, Some(key), &b).await;
    assert_eq!(r.status(), 200);
    let left = num(&r, &h::REMAINING_TOKENS);
    assert!(
        (550..=600).contains(&left),
        "n: 4 × 100 left {left} of 1000"
    );
    b["n"] = json!(3);
    b["max_tokens"] = json!(400);
    let (st, e) = error_of(post(url, Some(key), &b).await).await;
    assert_eq!(
        (st, e["code"].as_str()),
        (400, Some("request_exceeds_limit"))
    );
    let mut b = body(model, 0, false);
    b.as_object_mut().unwrap().remove("max_tokens");
    b["ignore_eos"] = json!(false);
    let r = post(url, Some(key), &b).await;
    assert_eq!(r.status(), 200);
    let then = num(&r, &h::REMAINING_TOKENS);
    assert!(
        left + 20 >= then + 250 && left + 20 < then + 300,
        "no max_tokens: {left} then {then} left, 250 reserved"
    );
}

/// Reservations of ~510 against 600: the second waits for the first to
/// settle; its two-token answer gives back the rest, and then it fits.
async fn a_short_answer_gives_back_its_reservation(url: &str) {
    let key = "sk-wc-short-3d4e5f6a7b";
    let b = json!({"model": "short-model", "max_tokens": 500,
                   "messages": [{"role": "user", "content": "answer briefly"}]});
    let base = metric_sum(
        &scrape(url).await,
        "switchyard_requests_total",
        &[("class", "ok")],
    );
    let r = post(url, Some(key), &b).await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert!(
        v["usage"]["completion_tokens"].as_u64().unwrap() < 50,
        "{v}"
    );
    finished(url, base + 1.0).await;
    let r = post(url, Some(key), &b).await;
    assert_eq!(
        r.status(),
        200,
        "the first request's unused reservation came back"
    );
}

/// $0.001 an output token, $0.05 a day, two concurrent requests that may cost
/// $0.03 each: one is admitted, one refused; spend never passes the budget,
/// and a request that may cost $0.06 can never fit.
async fn budgets_are_not_overspent(url: &str, model: &str) {
    let key = "sk-wc-budget-c8d9e0f1a2";
    let b = body(model, 30, false);
    let answers = futures_util::future::join_all((0..2).map(|_| post(url, Some(key), &b))).await;
    let codes: Vec<u16> = answers.iter().map(|r| r.status().as_u16()).collect();
    assert!(codes.contains(&200) && codes.contains(&429), "{codes:?}");
    let (st, e) = error_of(post(url, Some(key), &body(model, 60, false)).await).await;
    assert_eq!(
        (st, e["param"].as_str(), e["code"].as_str()),
        (400, Some("daily_budget_usd"), Some("request_exceeds_limit"))
    );
    // $0.03 spent: a $0.02 request fits exactly, then nothing does.
    eventually(Duration::from_secs(10), "the first settled", || async {
        let r = post(url, Some(key), &body(model, 20, false)).await;
        (r.status() == 200).then_some(())
    })
    .await;
    let (st, e) = error_of(post(url, Some(key), &body(model, 1, false)).await).await;
    assert_eq!((st, e["code"].as_str()), (429, Some("insufficient_quota")));
    let spent = eventually(Duration::from_secs(10), "cost counted", || async {
        let m = scrape(url).await;
        let c = metric_sum(&m, "switchyard_cost_usd_total", &[("tenant", "budget")]);
        (c >= 0.05 - 1e-9).then_some(c)
    })
    .await;
    assert!(spent <= 0.05 + 1e-9, "spent ${spent} of a $0.05 day");
}

/// A reload that changes `[limits]`: the default reservation applies at
/// once; moving the state to another store cannot, so the reload is
/// rejected (counted, warned) and the running config kept.
#[tokio::test]
async fn a_limits_reload_applies_or_is_rejected() {
    let s = sims(1, 50.0).await;
    let model = sim_model();
    std::env::set_var("SY_RELOAD_KEY", "sk-reload-limits-9a8b7c6d5e");
    let toml = |extra: &str| {
        format!(
            "[server]\nlisten = \"127.0.0.1:0\"\n[limits]\n{extra}\n[tenancy]\nrequire_key = true\n\
             [[tenants]]\nname = \"r\"\napi_key_env = \"SY_RELOAD_KEY\"\n[tenants.limits]\n\
             tokens_per_minute = 100000\n{}",
            support::pool_toml(&model, &[&s[0].url()], "")
        )
    };
    let text = std::sync::Arc::new(parking_lot::Mutex::new(toml("default_max_tokens = 100")));
    let parse = |t: &str| switchyard::config::parse(t).and_then(|r| r.validate());
    let first = parse(&text.lock()).unwrap();
    let gw = switchyard::server::spawn(first).await.unwrap();
    let shared = text.clone();
    gw.gateway
        .set_reloader(Box::new(move || parse(&shared.lock())));
    let url = gw.url();
    let mut b = body(&model, 0, false);
    b.as_object_mut().unwrap().remove("max_tokens");
    let status = || async {
        let r = post(&url, Some("sk-reload-limits-9a8b7c6d5e"), &b).await;
        r.status().as_u16()
    };
    assert_eq!(status().await, 200);
    // A default larger than the whole limit: the same request can never fit.
    *text.lock() = toml("default_max_tokens = 200000");
    gw.gateway.reload().expect("a new default reloads");
    assert_eq!(status().await, 400);

    *text.lock() = toml("state = \"redis\"\nredis_url = \"redis://127.0.0.1:1/\"");
    let e = gw.gateway.reload().unwrap_err();
    assert!(e.contains("restart required"), "{e}");
    let m = scrape(&url).await;
    let rejected = metric_sum(
        &m,
        "switchyard_config_reloads_total",
        &[("result", "rejected")],
    );
    assert!(rejected >= 1.0, "rejected reloads {rejected}");
    // The running config (memory store, the large default) is kept.
    assert_eq!(status().await, 400);
}
