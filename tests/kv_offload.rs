//! The CPU offload tier, end to end: a `switchyard sim` process with
//! `--cpu-offload-blocks` moves blocks its GPU evicts to CPU memory and
//! publishes them with medium CPU, as vLLM's offloading connector does; the
//! gateway (the real binary) indexes them one tier down and still routes the
//! prefix to that engine rather than to one that never saw it. The engine
//! answers it as cached.

mod support;

use std::time::Duration;
use support::{
    client, config_file, eventually, line_field, metric_sum, scrape, serve_binary, sim_metric,
    spawn_binary_line, tagged_words,
};
use switchyard::proxy::ROUTE_HEADER;
use switchyard::telemetry::names;

const WAIT: Duration = Duration::from_secs(20);

/// A sim process with 96 GPU blocks of 16 tokens and KV events; its URL, model
/// and event endpoints.
async fn engine(extra: &[&str]) -> (tokio::process::Child, [String; 4]) {
    let mut args = vec![
        "sim",
        "--port",
        "0",
        "--time-scale",
        "50",
        "--num-blocks",
        "96",
        "--max-model-len",
        "1024",
        "--kv-events",
        "tcp://127.0.0.1:0",
        "--kv-replay",
        "tcp://127.0.0.1:0",
    ];
    args.extend_from_slice(extra);
    let (child, line) = spawn_binary_line(&args, "switchyard-sim ready").await;
    let f = ["url", "model", "kv_events", "kv_replay"].map(|k| line_field(&line, k));
    (child, f)
}

fn gateway_toml(model: &str, engines: &[&[String; 4]]) -> String {
    let workers: Vec<String> = engines
        .iter()
        .map(|e| {
            format!(
                "{{ url = \"{}\", kv_events = \"{}\", kv_replay = \"{}\" }}",
                e[0], e[2], e[3]
            )
        })
        .collect();
    format!(
        "[server]\ndebug_headers = true\n[[pools]]\nname = \"p\"\nmodels = [\"{model}\"]\npolicy = \"weighted\"\n\
         tokenizer = \"sim\"\nworkers = [{}]\n[pools.routing]\n\
         scorers = [{{ name = \"precise_prefix\", weight = 1.0 }}, {{ name = \"queue\", weight = 0.01 }}]\n\
         [pools.kv_events]\ntopic = \"kv-events\"\nprobe_interval_ms = 100\n",
        workers.join(", ")
    )
}

/// Send a chat request to `base`; the worker in the route header (if any) and
/// the cached prompt tokens the engine reported.
async fn chat(base: &str, model: &str, content: &str) -> (Option<String>, u64) {
    let resp = client()
        .post(format!("{base}/v1/chat/completions"))
        .json(&serde_json::json!({"model": model, "max_tokens": 2,
            "messages": [{"role": "user", "content": content}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let worker = resp
        .headers()
        .get(ROUTE_HEADER)
        .map(|v| v.to_str().unwrap().split("; ").next().unwrap().to_string());
    let body: serde_json::Value = resp.json().await.unwrap();
    let cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    (worker, cached)
}

fn worker_metric(text: &str, name: &str, worker: &str, extra: &[(&str, &str)]) -> f64 {
    let mut want = vec![(names::L_WORKER, worker)];
    want.extend_from_slice(extra);
    metric_sum(text, name, &want)
}

/// Wait until the gateway is live on `url` and applied every batch it published.
async fn wait_caught_up(gw: &str, url: &str) {
    let published = sim_metric(url, "sim_kv_event_batches_total").await;
    eventually(
        WAIT,
        "the gateway caught up with the engine",
        || async move {
            let m = scrape(gw).await;
            let live = worker_metric(&m, names::KV_WORKER_STATE, url, &[]) == 2.0;
            let applied = worker_metric(
                &m,
                names::KV_EVENTS_TOTAL,
                url,
                &[(names::L_KIND, "applied")],
            );
            (live && applied >= published).then_some(())
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_offloaded_to_cpu_still_routes_to_its_engine() {
    let (_a, offloading) = engine(&["--cpu-offload-blocks", "512"]).await;
    let (_b, plain) = engine(&[]).await;
    let model = offloading[1].clone();
    let cfg = config_file("kv-offload", &gateway_toml(&model, &[&offloading, &plain]));
    let replica = serve_binary(&cfg).await;
    let gw = replica.url.clone();
    let (a, b) = (offloading[0].clone(), plain[0].clone());
    wait_caught_up(&gw, &a).await;
    wait_caught_up(&gw, &b).await;

    // The offloading engine sees the prompt, then other prompts evict it from
    // its GPU (96 blocks) into its CPU tier. The other engine never sees it.
    let text = tagged_words("offload", 150);
    let (_, first) = chat(&a, &model, &text).await;
    assert_eq!(first, 0);
    for i in 0..6 {
        chat(&a, &model, &tagged_words(&format!("flood{i}y"), 150)).await;
    }
    wait_caught_up(&gw, &a).await;
    let m = scrape(&gw).await;
    let on_cpu = worker_metric(&m, names::KV_INDEX_BLOCKS, &a, &[(names::L_MEDIUM, "cpu")]);
    assert!(on_cpu > 0.0, "the index holds the engine's CPU tier");
    assert_eq!(
        worker_metric(&m, names::KV_INDEX_BLOCKS, &b, &[(names::L_MEDIUM, "cpu")]),
        0.0
    );

    let external = "vllm:external_prefix_cache_hits_total";
    let loaded_before = sim_metric(&a, external).await;
    let (worker, cached) = chat(&gw, &model, &text).await;
    assert_eq!(
        worker.as_deref(),
        Some(a.as_str()),
        "routed to the offloading engine"
    );
    let loaded = sim_metric(&a, external).await - loaded_before;
    assert!(
        loaded >= 16.0,
        "the engine loaded the prefix back from its CPU tier"
    );
    assert!(
        cached as f64 >= loaded,
        "loaded tokens count as cached: {cached}"
    );
}
