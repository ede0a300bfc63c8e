//! An engine restart seen only through `/metrics`: the engine's process start
//! time changes while its KV-event stream shows nothing (no replay endpoint to
//! probe, no new event whose sequence could go back). The gateway (the real
//! binary) must still drop the old engine's entries and count a resync with
//! reason `restart`.
//!
//! The engine is a real `switchyard sim` process; its `/metrics` reach the
//! gateway through a small pass-through server that can replace the
//! `process_start_time_seconds` value, as a new engine process behind the same
//! address would report it.

mod support;

use axum::extract::State;
use axum::routing::get;
use parking_lot::Mutex;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use support::{
    client, config_file, eventually, line_field, metric_sum, scrape, serve_binary,
    spawn_binary_line, tagged_words,
};
use switchyard::telemetry::names;

const WAIT: Duration = Duration::from_secs(20);
const START: &str = "process_start_time_seconds";

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// The engine's `/metrics`, with the start time replaced when one is set.
#[derive(Clone)]
struct Front {
    engine: String,
    start: Arc<Mutex<Option<f64>>>,
}

async fn metrics(State(f): State<Front>) -> String {
    let text = client()
        .get(format!("{}/metrics", f.engine))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let Some(start) = *f.start.lock() else {
        return text;
    };
    text.lines()
        .map(|l| match l.strip_prefix(START) {
            Some(v) if v.starts_with(' ') => format!("{START} {start}"),
            _ => l.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\n")
        + "\n"
}

/// Serve `front` on an ephemeral port: `/metrics` and `/health`.
async fn serve_front(front: Front) -> String {
    let app = axum::Router::new()
        .route("/metrics", get(metrics))
        .route("/health", get(|| async { "ok" }))
        .with_state(front);
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(l, app).await });
    url
}

fn gateway_toml(model: &str, worker: &str, events: &str) -> String {
    format!(
        "[[pools]]\nname = \"p\"\nmodels = [\"{model}\"]\npolicy = \"weighted\"\ntokenizer = \"sim\"\n\
         workers = [{{ url = \"{worker}\", kv_events = \"{events}\" }}]\n\
         [pools.routing]\nscorers = [{{ name = \"precise_prefix\", weight = 1.0 }}]\nstats_interval_ms = 50\n\
         [pools.kv_events]\ntopic = \"kv-events\"\nprobe_interval_ms = 50\n"
    )
}

fn worker_metric(text: &str, name: &str, worker: &str, extra: &[(&str, &str)]) -> f64 {
    let mut want = vec![(names::L_WORKER, worker)];
    want.extend_from_slice(extra);
    metric_sum(text, name, &want)
}

async fn chat(base: &str, model: &str, content: &str) {
    let resp = client()
        .post(format!("{base}/v1/chat/completions"))
        .json(&serde_json::json!({"model": model, "max_tokens": 2,
            "messages": [{"role": "user", "content": content}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let _ = resp.bytes().await.unwrap();
}

/// Wait until the gateway's metrics satisfy `ok`.
async fn wait_for(gw: &str, what: &str, ok: impl Fn(&str) -> bool) {
    eventually(WAIT, what, || {
        let gw = gw.to_string();
        let ok = &ok;
        async move { ok(&scrape(&gw).await).then_some(()) }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_start_time_in_metrics_drops_the_old_engines_entries() {
    let before = unix_now();
    let (_sim, line) = spawn_binary_line(
        &[
            "sim",
            "--port",
            "0",
            "--time-scale",
            "50",
            "--kv-events",
            "tcp://127.0.0.1:0",
        ],
        "switchyard-sim ready",
    )
    .await;
    let (engine, model) = (line_field(&line, "url"), line_field(&line, "model"));
    let events = line_field(&line, "kv_events");

    // The engine reports its own start time, as vLLM's process collector does.
    let text = scrape(&engine).await;
    let started = metric_sum(&text, START, &[]);
    assert!(
        started >= before - 1.0 && started <= unix_now(),
        "{START} {started} is not this process's start ({before})"
    );

    let front = Front {
        engine: engine.clone(),
        start: Arc::new(Mutex::new(None)),
    };
    let worker = serve_front(front.clone()).await;
    let cfg = config_file("kv-restart", &gateway_toml(&model, &worker, &events));
    let replica = serve_binary(&cfg).await;
    let gw = replica.url.clone();
    let start_gauge = |m: &str| worker_metric(m, names::KV_ENGINE_START_SECONDS, &worker, &[]);
    let blocks = |m: &str| {
        worker_metric(
            m,
            names::KV_INDEX_BLOCKS,
            &worker,
            &[(names::L_MEDIUM, "gpu")],
        )
    };
    let resyncs = |m: &str, reason: &str| {
        worker_metric(m, names::KV_RESYNCS_TOTAL, &worker, &[("reason", reason)])
    };
    // The subscriber goes by the engine's start time once it is live.
    wait_for(&gw, "the subscriber adopts the engine's start time", |m| {
        worker_metric(m, names::KV_WORKER_STATE, &worker, &[]) == 2.0
            && (start_gauge(m) - started).abs() < 0.01
    })
    .await;
    // Traffic the gateway never saw fills the index from the engine's events.
    chat(&engine, &model, &tagged_words("old", 80)).await;
    wait_for(&gw, "the old engine's blocks indexed", |m| blocks(m) >= 4.0).await;
    let m = scrape(&gw).await;
    let reconnects = resyncs(&m, "reconnect");

    // A new process behind the same address: only its start time tells.
    let restarted = started + 1_000.0;
    *front.start.lock() = Some(restarted);
    wait_for(&gw, "the old engine's entries dropped on restart", |m| {
        blocks(m) == 0.0 && resyncs(m, "restart") >= 1.0
    })
    .await;
    let m = scrape(&gw).await;
    assert!((start_gauge(&m) - restarted).abs() < 0.01);
    assert_eq!(resyncs(&m, "sequence_reset"), 0.0, "not the sequence rule");
    assert_eq!(resyncs(&m, "reconnect"), reconnects, "not a reconnect");
    assert_eq!(resyncs(&m, "restart"), 1.0, "one restart, counted once");
    assert_eq!(worker_metric(&m, names::KV_WORKER_STATE, &worker, &[]), 2.0);

    // The stream goes on: the engine's next events are indexed again.
    chat(&engine, &model, &tagged_words("new", 80)).await;
    wait_for(&gw, "new blocks indexed after the resync", |m| {
        blocks(m) >= 4.0
    })
    .await;
}
