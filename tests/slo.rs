//! Latency-objective placement through `switchyard serve` over a mixed fleet of
//! simulated engines (an H100 profile and an L4 profile of the same model): the
//! workers' latency models learn from measured answers, a tight objective goes
//! to the fast worker, an unattainable one is shed (503 + Retry-After) or served
//! marked as downgraded, a malformed objective is a 400, and predicted vs actual
//! TTFT shows in the metrics.

mod support;

use serde_json::{json, Value};
use support::*;
use switchyard::sim::{spawn, SimConfig, SimHandle};

const MODEL: &str = "sim-llama-8b";
/// The same workers under a second name, in a pool that serves a missed
/// objective anyway instead of shedding it.
const LAX_MODEL: &str = "sim-llama-8b-lax";

async fn sim(profile: &str) -> SimHandle {
    let cfg = SimConfig::profile(profile).expect("profile");
    spawn(cfg).await.expect("sim starts")
}

fn config(fast: &str, slow: &str) -> String {
    format!(
        r#"
[server]
debug_headers = true

# These callers set objectives by header without a key.
[tenancy]
anonymous_allow_slo_headers = true

[[pools]]
name = "shed"
models = ["{MODEL}"]
policy = "slo"
workers = [{{ url = "{fast}" }}, {{ url = "{slow}" }}]
[pools.routing]
allow_policy_override = true
stats_interval_ms = 100
slo_unattainable = "shed"

[[pools]]
name = "lax"
models = ["{LAX_MODEL}"]
upstream_model = "{MODEL}"
policy = "slo"
workers = [{{ url = "{fast}" }}, {{ url = "{slow}" }}]
"#
    )
}

/// A streamed chat completion with `headers`; status, response headers, body.
async fn chat(
    base: &str,
    model: &str,
    prompt: &str,
    headers: &[(&str, &str)],
) -> (u16, reqwest::header::HeaderMap, String) {
    let mut req = client()
        .post(format!("{base}/v1/chat/completions"))
        .json(&json!({
            "model": model, "stream": true, "max_tokens": 4,
            "stream_options": {"include_usage": true},
            "messages": [{"role": "user", "content": prompt}],
        }));
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let r = req.send().await.unwrap();
    let status = r.status().as_u16();
    let h = r.headers().clone();
    (status, h, r.text().await.unwrap())
}

/// The worker URL the route header names.
fn routed_to(h: &reqwest::header::HeaderMap) -> String {
    let v = h["x-switchyard-route"].to_str().unwrap();
    v.split(';').next().unwrap().trim().to_string()
}

/// Teach both workers' models: round-robin streams until each has answered
/// enough (more than the models' minimum of samples).
async fn warm_up(base: &str) {
    for i in 0..24 {
        let prompt = format!("warm-up {i}: tell me about the weather");
        let (st, _, body) = chat(
            base,
            MODEL,
            &prompt,
            &[("x-switchyard-policy", "round_robin")],
        )
        .await;
        assert_eq!(st, 200, "{body}");
    }
}

fn predicted_count(text: &str, worker: &str) -> f64 {
    metric_sum(
        text,
        "switchyard_predicted_ttft_seconds",
        &[("worker", worker)],
    )
}

#[tokio::test]
async fn placement_follows_the_learnt_latencies_and_the_objective() {
    let (fast, slow) = (sim("llama-8b-h100").await, sim("llama-8b-l4").await);
    let (f, s) = (fast.url(), slow.url());
    let gw = serve_binary(&config_file("slo", &config(&f, &s))).await;
    let base = &gw.url;
    warm_up(base).await;

    // Predicted vs actual TTFT is exported per worker once the models speak.
    let before = scrape(base).await;
    assert!(predicted_count(&before, &f) > 0.0, "{before}");
    assert!(predicted_count(&before, &s) > 0.0, "{before}");
    let errors = |t: &str| metric_sum(t, "switchyard_ttft_prediction_error_ratio", &[]);
    assert!(errors(&before) > 0.0);

    // A tight TTFT objective (the L4 profile's step alone is 55 ms): every such
    // request, whatever its prompt, goes to the fast worker.
    for i in 0..6 {
        let prompt = format!("tight {i}: a question with its own text");
        let (st, h, body) = chat(base, MODEL, &prompt, &[("x-slo-ttft-ms", "45")]).await;
        assert_eq!(st, 200, "{body}");
        assert_eq!(routed_to(&h), f, "request {i} went to the slow worker");
        assert!(h.get("x-switchyard-slo").is_none());
    }
    let after = scrape(base).await;
    assert!(predicted_count(&after, &f) > predicted_count(&before, &f));
    assert!(
        errors(&after) > errors(&before),
        "the error histogram moves"
    );
    let met = metric_sum(
        &after,
        "switchyard_slo_decisions_total",
        &[("pool", "shed"), ("result", "met")],
    );
    assert!(met >= 6.0, "met = {met}");
}

#[tokio::test]
async fn an_unattainable_objective_is_shed_or_downgraded_and_a_bad_one_refused() {
    let (fast, slow) = (sim("llama-8b-h100").await, sim("llama-8b-l4").await);
    let (f, s) = (fast.url(), slow.url());
    let gw = serve_binary(&config_file("slo-shed", &config(&f, &s))).await;
    let base = &gw.url;

    // Malformed objectives: 400 in OpenAI's shape, before any worker is asked.
    for (k, v) in [("x-slo-ttft-ms", "fast"), ("x-slo-tpot-ms", "0")] {
        let (st, _, body) = chat(base, MODEL, "hi", &[(k, v)]).await;
        assert_eq!(st, 400, "{k}: {v}: {body}");
        let e: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(e["error"]["type"], "invalid_request_error", "{e}");
        assert!(e["error"]["message"].as_str().unwrap().contains(k), "{e}");
    }

    // Before the models have learnt anything nothing is shed on a guess.
    let (st, _, body) = chat(base, MODEL, "cold", &[("x-slo-ttft-ms", "1")]).await;
    assert_eq!(st, 200, "{body}");

    warm_up(base).await;
    // 1 ms to the first token: no worker is predicted to make it.
    let (st, h, body) = chat(base, MODEL, "now", &[("x-slo-ttft-ms", "1")]).await;
    assert_eq!(st, 503, "{body}");
    let retry: u32 = h["retry-after"].to_str().unwrap().parse().unwrap();
    assert!(retry >= 1, "{retry}");
    let e: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(e["error"]["code"], "slo_unattainable", "{e}");
    // The lax pool serves it on the best worker, marked.
    let (st, h, body) = chat(base, LAX_MODEL, "now", &[("x-slo-ttft-ms", "1")]).await;
    assert_eq!(st, 200, "{body}");
    assert_eq!(h["x-switchyard-slo"], "downgraded");
    assert_eq!(
        routed_to(&h),
        f,
        "served on the worker closest to the objective"
    );

    let m = scrape(base).await;
    let result = |pool, r| {
        metric_sum(
            &m,
            "switchyard_slo_decisions_total",
            &[("pool", pool), ("result", r)],
        )
    };
    assert_eq!(result("shed", "shed"), 1.0);
    assert_eq!(result("lax", "downgraded"), 1.0);
    assert!(result("shed", "unknown") >= 1.0);
    let refused = metric_sum(
        &m,
        "switchyard_gateway_errors_total",
        &[("reason", "slo_unattainable")],
    );
    assert_eq!(refused, 1.0, "{m}");
}

/// Two GPUs as NVIDIA's dcgm-exporter prints them: 80 % mean utilisation, one
/// GPU in a hardware thermal slowdown (reason 64).
const DCGM_TEXT: &str = "\
# HELP DCGM_FI_DEV_GPU_UTIL GPU utilization (in %).
# TYPE DCGM_FI_DEV_GPU_UTIL gauge
DCGM_FI_DEV_GPU_UTIL{gpu=\"0\",UUID=\"GPU-a\",modelName=\"NVIDIA L4\"} 90
DCGM_FI_DEV_GPU_UTIL{gpu=\"1\",UUID=\"GPU-b\",modelName=\"NVIDIA L4\"} 70
DCGM_FI_DEV_FB_USED{gpu=\"0\",UUID=\"GPU-a\"} 20000
DCGM_FI_DEV_FB_USED{gpu=\"1\",UUID=\"GPU-b\"} 1000
DCGM_FI_DEV_FB_FREE{gpu=\"0\",UUID=\"GPU-a\"} 2000
DCGM_FI_DEV_FB_FREE{gpu=\"1\",UUID=\"GPU-b\"} 21000
DCGM_FI_DEV_CLOCK_THROTTLE_REASONS{gpu=\"0\",UUID=\"GPU-a\"} 0
DCGM_FI_DEV_CLOCK_THROTTLE_REASONS{gpu=\"1\",UUID=\"GPU-b\"} 64
";

/// A stand-in DCGM exporter (DCGM itself needs a GPU): canned text on /metrics.
async fn fake_dcgm() -> String {
    let app = axum::Router::new().route("/metrics", axum::routing::get(|| async { DCGM_TEXT }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{addr}/metrics")
}

#[tokio::test]
async fn gpu_stats_from_a_dcgm_exporter_reach_the_metrics_and_the_dashboard() {
    let (gpu, plain) = (sim("llama-8b-l4").await, sim("llama-8b-l4").await);
    let (g, p) = (gpu.url(), plain.url());
    let dcgm = fake_dcgm().await;
    let toml = format!(
        r#"
[[pools]]
name = "p"
models = ["{MODEL}"]
workers = [{{ url = "{g}", labels = {{ dcgm_url = "{dcgm}" }} }}, {{ url = "{p}" }}]
[pools.routing]
stats_interval_ms = 100
"#
    );
    let gw = serve_binary(&config_file("slo-dcgm", &toml)).await;
    let base = &gw.url;
    let text = eventually(std::time::Duration::from_secs(10), "GPU gauges", || async {
        let t = scrape(base).await;
        t.contains("switchyard_worker_gpu_utilization_ratio")
            .then_some(t)
    })
    .await;
    let worker = |name, w: &str| metric_sum(&text, name, &[("worker", w)]);
    assert!((worker("switchyard_worker_gpu_utilization_ratio", &g) - 0.8).abs() < 1e-6);
    assert_eq!(
        worker("switchyard_worker_gpu_memory_used_bytes", &g),
        21000.0 * 1048576.0
    );
    assert_eq!(worker("switchyard_worker_gpu_throttle_reasons", &g), 64.0);
    assert!(
        !text
            .lines()
            .any(|l| l.starts_with("switchyard_worker_gpu") && l.contains(&p)),
        "no GPU series for a worker without an exporter"
    );
    // The fleet view is rebuilt once a second.
    let workers = eventually(
        std::time::Duration::from_secs(10),
        "dashboard GPU",
        || async {
            let status = get_json(&format!("{base}/dashboard/status")).await;
            let ws = status["fleet"]["workers"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            ws.iter().any(|w| !w["gpu"].is_null()).then_some(ws)
        },
    )
    .await;
    let view = |url: &str| workers.iter().find(|w| w["id"] == url).unwrap().clone();
    assert_eq!(view(&g)["gpu"]["throttled"], true, "{workers:?}");
    assert!(view(&p)["gpu"].is_null());
}
