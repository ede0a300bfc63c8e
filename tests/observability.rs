//! Observability end to end: known traffic through the gateway, then the numbers on
//! `/metrics`, the access log, the dashboard status, the scaling recommendation and
//! the trace headers and spans must match it.

mod support;

use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use support::scripted::Scripted;
use support::*;
use switchyard::telemetry::names;

const ADMIN_TOKEN: &str = "obs-admin-token-0123456789";

fn admin_toml() -> String {
    std::env::set_var("SWITCHYARD_OBS_ADMIN_TOKEN", ADMIN_TOKEN);
    "[admin]\nlisten = \"127.0.0.1:0\"\ntoken_env = \"SWITCHYARD_OBS_ADMIN_TOKEN\"\n".into()
}

async fn chat(url: &str, key: Option<&str>, tenant: Option<&str>, body: Value) -> Value {
    let mut req = client()
        .post(format!("{url}/v1/chat/completions"))
        .json(&body);
    if let Some(k) = key {
        req = req.bearer_auth(k);
    }
    if let Some(t) = tenant {
        req = req.header("x-switchyard-tenant", t);
    }
    let r = req.send().await.unwrap();
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

/// Every sample of `name` as (labels, value), for label-set checks.
fn samples(text: &str, name: &str) -> Vec<(std::collections::HashMap<String, String>, f64)> {
    let scrape = prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_string()))).unwrap();
    scrape
        .samples
        .into_iter()
        .filter(|s| s.metric == name)
        .map(|s| {
            let v = match s.value {
                prometheus_parse::Value::Counter(v)
                | prometheus_parse::Value::Gauge(v)
                | prometheus_parse::Value::Untyped(v) => v,
                _ => 0.0,
            };
            (
                s.labels
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
                v,
            )
        })
        .collect()
}

#[tokio::test]
async fn metrics_cost_and_access_log_match_known_traffic() {
    let s = sims(2, 20.0).await;
    let model = sim_model();
    std::env::set_var("SWITCHYARD_OBS_ACME_KEY", "sk-acme-secret-1");
    let dir = std::env::temp_dir().join(format!("switchyard-obs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("access.jsonl");
    let _ = std::fs::remove_file(&log);
    let toml = format!(
        r#"
[access_log]
enabled = true
path = "{log}"
[[tenants]]
name = "acme"
api_key_env = "SWITCHYARD_OBS_ACME_KEY"
[[prices]]
prompt_per_mtok = 1000.0
cached_prompt_per_mtok = 500.0
output_per_mtok = 2000.0
[[pools]]
name = "obs-known"
models = ["{model}"]
workers = [{{ url = "{w0}", labels = {{ region = "eu-west" }} }}, {{ url = "{w1}", labels = {{ region = "us-east" }} }}]
"#,
        log = log.display(),
        w0 = s[0].url(),
        w1 = s[1].url(),
    );
    let gw = gateway(&toml).await;
    let url = gw.url();
    let prompt = "a long shared system prompt for the cache ".repeat(30);
    let mut expected_cost = 0.0;
    let (mut prompt_sum, mut cached_sum, mut output_sum) = (0.0, 0.0, 0.0);
    for i in 0..6 {
        let key = (i % 2 == 0).then_some("sk-acme-secret-1");
        let v = chat(
            &url,
            key,
            None,
            json!({"model": model, "max_tokens": 4 + i,
                   "messages": [{"role":"system","content": prompt}, {"role":"user","content": format!("q{i}")}]}),
        )
        .await;
        let u = &v["usage"];
        let p = u["prompt_tokens"].as_f64().unwrap();
        let c = u["prompt_tokens_details"]["cached_tokens"]
            .as_f64()
            .unwrap_or(0.0);
        let o = u["completion_tokens"].as_f64().unwrap();
        prompt_sum += p;
        cached_sum += c;
        output_sum += o;
        expected_cost += ((p - c) * 1000.0 + c * 500.0 + o * 2000.0) / 1e6;
    }
    assert!(cached_sum > 0.0, "the shared prefix should hit the cache");
    // One client error: an unknown model.
    let r = client()
        .post(format!("{url}/v1/chat/completions"))
        .json(&json!({"model": "nope", "messages": []}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);

    let text = scrape(&url).await;
    let req = |want: &[(&str, &str)]| {
        let mut w = want.to_vec();
        if !want.iter().any(|(k, _)| *k == "pool") {
            w.push(("pool", "obs-known"));
        }
        metric_sum(&text, names::REQUESTS_TOTAL, &w)
    };
    assert_eq!(req(&[("tenant", "acme"), ("class", "ok")]), 3.0);
    assert_eq!(req(&[("tenant", "anonymous"), ("class", "ok")]), 3.0);
    // The gateway's own 404: no pool or worker; the unknown name is not a label value.
    assert_eq!(
        req(&[
            ("class", "client"),
            ("outcome", "gateway_error"),
            ("status", "404"),
            ("pool", "none"),
            ("model", "none"),
        ]),
        1.0
    );
    // Round robin over two workers: three requests in each region.
    assert_eq!(req(&[("region", "eu-west"), ("pool", "obs-known")]), 3.0);
    assert_eq!(req(&[("region", "us-east"), ("pool", "obs-known")]), 3.0);
    let tok = |k: &str| {
        metric_sum(
            &text,
            names::TOKENS_TOTAL,
            &[("kind", k), ("pool", "obs-known")],
        )
    };
    assert_eq!(tok("prompt"), prompt_sum);
    assert_eq!(tok("cached"), cached_sum);
    assert_eq!(tok("output"), output_sum);
    let cost = metric_sum(&text, names::COST_USD_TOTAL, &[]);
    assert!(
        (cost - expected_cost).abs() < 1e-6,
        "cost {cost} vs expected {expected_cost}"
    );
    let acme_cost = metric_sum(&text, names::COST_USD_TOTAL, &[("tenant", "acme")]);
    assert!(acme_cost > 0.0 && acme_cost < cost);
    // Every cost series carries exactly model, region and tenant.
    for (labels, _) in samples(&text, names::COST_USD_TOTAL) {
        let keys: BTreeSet<&str> = labels.keys().map(String::as_str).collect();
        assert_eq!(keys, BTreeSet::from(["model", "region", "tenant"]));
    }
    assert!(
        metric_sum(
            &text,
            &format!("{}_count", names::GATEWAY_OVERHEAD_SECONDS),
            &[]
        ) >= 6.0
    );
    assert!(metric_sum(&text, names::PROCESS_RESIDENT_MEMORY_BYTES, &[]) > 0.0);
    assert!(text.contains(names::PROCESS_CPU_SECONDS_TOTAL));

    // The access log: one line per request, the fields filled, no secrets.
    let lines = eventually(Duration::from_secs(5), "7 access-log lines", || {
        let log = log.clone();
        async move {
            let t = std::fs::read_to_string(&log).ok()?;
            (t.lines().count() == 7).then_some(t)
        }
    })
    .await;
    assert!(
        !lines.contains("sk-acme-secret-1"),
        "the key must never be logged"
    );
    assert!(!lines.contains("shared system prompt"), "no prompt text");
    let recs: Vec<Value> = lines
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let ok: Vec<&Value> = recs.iter().filter(|r| r["status"] == 200).collect();
    assert_eq!(ok.len(), 6);
    let logged_cost: f64 = ok.iter().map(|r| r["cost_usd"].as_f64().unwrap()).sum();
    assert!((logged_cost - expected_cost).abs() < 1e-6);
    for r in &ok {
        for f in [
            "ts",
            "request_id",
            "tenant",
            "model",
            "pool",
            "worker",
            "region",
            "policy",
            "reason",
            "e2e_ms",
            "prompt_tokens",
            "output_tokens",
            "request_bytes",
            "response_bytes",
        ] {
            assert!(!r[f].is_null(), "field {f} missing in {r}");
        }
        assert_eq!(r["attempts"], 1);
        assert_eq!(r["class"], "ok");
        assert!(r["response_bytes"].as_u64().unwrap() > 0);
    }
    assert_eq!(ok.iter().filter(|r| r["tenant"] == "acme").count(), 3);
    let err = recs.iter().find(|r| r["status"] == 404).unwrap();
    assert_eq!(err["error"], "unknown_model");
    assert_eq!(err["class"], "client");
    gw.shutdown().await;
}

#[tokio::test]
async fn tenant_labels_are_bounded_with_an_other_bucket() {
    let s = sims(1, 50.0).await;
    let model = sim_model();
    let toml = format!(
        "[telemetry]\nmax_tenant_labels = 2\n[tenancy]\ntrust_tenant_header = true\n{}",
        pool_toml(&model, &[s[0].url().as_str()], "").replace("name = \"p\"", "name = \"bounded\"")
    );
    let gw = gateway(&toml).await;
    let url = gw.url();
    for t in ["t1", "t2", "t3", "t4", "t5", "t1"] {
        chat(
            &url,
            None,
            Some(t),
            json!({"model": model, "max_tokens": 2, "messages": [{"role":"user","content":"hi"}]}),
        )
        .await;
    }
    let text = scrape(&url).await;
    let tenants: BTreeSet<String> = samples(&text, names::REQUESTS_TOTAL)
        .into_iter()
        .filter(|(l, _)| l.get("pool").map(String::as_str) == Some("bounded"))
        .filter_map(|(l, _)| l.get("tenant").cloned())
        .collect();
    assert_eq!(
        tenants,
        BTreeSet::from(["t1".to_string(), "t2".into(), "other".into()])
    );
    assert_eq!(
        metric_sum(
            &text,
            names::REQUESTS_TOTAL,
            &[("tenant", "other"), ("pool", "bounded")]
        ),
        3.0
    );
    assert_eq!(
        metric_sum(
            &text,
            names::REQUESTS_TOTAL,
            &[("tenant", "t1"), ("pool", "bounded")]
        ),
        2.0
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn dashboard_status_and_scaling_follow_the_load() {
    // 20× slower than real time: a 100-token stream takes a few seconds.
    let s = sims(1, 0.05).await;
    let model = sim_model();
    let toml = format!(
        "{}[scaling]\ntarget_queue_per_replica = 1.0\nmax_replicas = 8\nscale_down_stabilization_ms = 1500\n{}",
        admin_toml(),
        pool_toml(&model, &[s[0].url().as_str()], "").replace("name = \"p\"", "name = \"scaled\"")
    );
    let gw = gateway(&toml).await;
    let url = gw.url();
    let admin = format!("http://{}", gw.admin_addr.unwrap());
    let c = client();
    let page = c.get(format!("{url}/dashboard")).send().await.unwrap();
    assert_eq!(page.status(), 200);
    let html = page.text().await.unwrap();
    assert!(
        html.contains("/dashboard/status")
            && !html.contains("http://")
            && !html.contains("https://")
    );

    let scaling = |admin: String| async move {
        let v: Value = client()
            .get(format!("{admin}/admin/scaling"))
            .bearer_auth(ADMIN_TOKEN)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        v["pools"][0].clone()
    };
    // Idle: one replica is enough.
    let idle = eventually(Duration::from_secs(5), "a first tick", || {
        let a = admin.clone();
        async move {
            let p = scaling(a).await;
            (!p.is_null()).then_some(p)
        }
    })
    .await;
    assert_eq!(idle["recommendation"]["desired_replicas"], 1);

    // Ramp up: four long streams in flight on one worker → queue 4 per replica.
    let mut streams = Vec::new();
    for i in 0..4 {
        let u = url.clone();
        let m = model.clone();
        streams.push(tokio::spawn(async move {
            stream_text(
                &u,
                // Long enough to stay in flight however slow the machine is;
                // the test ends them once the scale-out is seen.
                json!({"model": m, "stream": true, "max_tokens": 1500, "ignore_eos": true,
                       "messages": [{"role":"user","content": format!("long {i}")}]}),
            )
            .await
        }));
    }
    let busy = eventually(Duration::from_secs(10), "scale-out to 4", || {
        let a = admin.clone();
        async move {
            let p = scaling(a).await;
            (p["recommendation"]["desired_replicas"] == 4).then_some(p)
        }
    })
    .await;
    assert_eq!(busy["recommendation"]["signal"], "queue");
    let text = scrape(&url).await;
    assert_eq!(
        metric_sum(&text, names::POOL_DESIRED_REPLICAS, &[("pool", "scaled")]),
        4.0
    );
    for st in streams {
        st.abort();
    }
    // Idle again: back to one once the stabilisation window has passed.
    eventually(Duration::from_secs(10), "scale-in to 1", || {
        let a = admin.clone();
        async move { (scaling(a).await["recommendation"]["desired_replicas"] == 1).then_some(()) }
    })
    .await;

    // The dashboard status: the worker in the fleet table, per-second series with data.
    let st: Value = c
        .get(format!("{url}/dashboard/status"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let workers = st["fleet"]["workers"].as_array().unwrap();
    assert_eq!(workers.len(), 1);
    assert_eq!(workers[0]["id"], s[0].url());
    assert_eq!(workers[0]["state"], "healthy");
    let series = st["series"].as_array().unwrap();
    let reqs: u64 = series.iter().map(|x| x["requests"].as_u64().unwrap()).sum();
    assert_eq!(reqs, 4);
    assert!(series.iter().any(|x| x["ttft_p90_ms"].as_f64().is_some()));
    assert!(series.iter().any(|x| x["itl_p50_ms"].as_f64().is_some()));
    gw.shutdown().await;
}

#[tokio::test]
async fn traceparent_reaches_the_worker_and_spans_reach_the_collector() {
    // A fake OTLP/HTTP collector.
    let got: Arc<Mutex<Vec<Value>>> = Default::default();
    let sink = got.clone();
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |body: axum::body::Bytes| {
            let sink = sink.clone();
            async move {
                sink.lock()
                    .unwrap()
                    .push(serde_json::from_slice(&body).unwrap());
                "{}"
            }
        }),
    );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let collector = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(l, app).await.unwrap() });

    let (up, _tx) = Scripted::start().await;
    let toml = format!(
        "[tracing]\notlp_endpoint = \"{collector}\"\n{}",
        pool_toml("scripted", &[up.url.as_str()], "")
    );
    let gw = gateway(&toml).await;
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let r = client()
        .post(format!("{}/v1/chat/completions", gw.url()))
        .header("traceparent", format!("00-{trace}-00f067aa0ba902b7-01"))
        .json(&json!({"model": "scripted", "messages": []}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.text().await.unwrap();
    let sent = up.recorded.lock().unwrap().headers[0]["traceparent"].clone();
    let parts: Vec<&str> = sent.split('-').collect();
    assert_eq!(parts[1], trace, "the trace continues to the worker");
    assert_ne!(
        parts[2], "00f067aa0ba902b7",
        "the worker's parent is the attempt span"
    );
    assert_eq!(parts[3], "01");

    let spans = eventually(Duration::from_secs(5), "four spans exported", || {
        let got = got.clone();
        async move {
            let spans: Vec<Value> = got
                .lock()
                .unwrap()
                .iter()
                .flat_map(|b| {
                    b["resourceSpans"][0]["scopeSpans"][0]["spans"]
                        .as_array()
                        .cloned()
                        .unwrap_or_default()
                })
                .collect();
            (spans.len() >= 4).then_some(spans)
        }
    })
    .await;
    let by_name = |n: &str| spans.iter().find(|s| s["name"] == n).unwrap().clone();
    let request = by_name("switchyard.request");
    let attempt = by_name("switchyard.upstream_attempt");
    by_name("switchyard.admission");
    by_name("switchyard.route");
    assert!(spans.iter().all(|s| s["traceId"] == trace));
    assert_eq!(request["parentSpanId"], "00f067aa0ba902b7");
    assert_eq!(attempt["parentSpanId"], request["spanId"]);
    assert_eq!(attempt["spanId"], parts[2]);
    assert_eq!(attempt["kind"], 3);
    gw.shutdown().await;

    // Without an exporter a traceparent is still generated for the worker.
    let (up2, _tx2) = Scripted::start().await;
    let gw = gateway(&pool_toml("scripted", &[up2.url.as_str()], "")).await;
    let r = client()
        .post(format!("{}/v1/chat/completions", gw.url()))
        .json(&json!({"model": "scripted", "messages": []}))
        .send()
        .await
        .unwrap();
    r.text().await.unwrap();
    let tp = up2.recorded.lock().unwrap().headers[0]["traceparent"].clone();
    assert!(
        tp.starts_with("00-") && tp.len() == 55 && tp.ends_with("-00"),
        "{tp}"
    );
    gw.shutdown().await;
}

/// The prefix index's prediction is compared with the `cached_tokens` the worker
/// reports: a repeated prompt is predicted cached and is cached.
#[tokio::test]
async fn predicted_cache_hits_are_compared_with_actual_ones() {
    let s = sims(2, 20.0).await;
    let model = sim_model();
    let u = urls(&s);
    let gw = gateway(&format!(
        "[[pools]]\nname = \"predict\"\nmodels = [\"{model}\"]\npolicy = \"prefix\"\nworkers = [{{ url = \"{}\" }}, {{ url = \"{}\" }}]\n",
        u[0], u[1]
    ))
    .await;
    let prompt = "a shared system prompt for prediction ".repeat(60);
    for i in 0..3 {
        let r = client()
            .post(format!("{}/v1/chat/completions", gw.url()))
            .json(&json!({"model": model, "max_tokens": 2,
                "messages": [{"role":"system","content": prompt}, {"role":"user","content": format!("q{i}")}]}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        r.bytes().await.unwrap();
    }
    let m = scrape(&gw.url()).await;
    let pool = [("pool", "predict")];
    let predicted = metric_sum(&m, names::CACHE_PREDICTED_TOKENS_TOTAL, &pool);
    let actual = metric_sum(&m, names::CACHE_ACTUAL_TOKENS_TOTAL, &pool);
    assert!(
        predicted > 0.0,
        "the index predicted the repeated prefix: {predicted}"
    );
    assert!(actual > 0.0, "the worker reported cached tokens: {actual}");
    // The first request is a predicted miss; the two repeats are predicted hits.
    assert_eq!(
        metric_sum(
            &m,
            names::CACHE_PREDICTIONS_TOTAL,
            &[pool[0], ("result", "hit")]
        ),
        2.0
    );
    gw.shutdown().await;
}
