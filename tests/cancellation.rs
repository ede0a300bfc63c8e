//! Cancellation that reaches the engine: a client that leaves a streamed
//! request to an SGLang pool gets the request aborted on the engine with
//! `/abort_request` (the sims here keep generating after a disconnect, as an
//! engine that must be told would), on both legs of a disaggregated one; vLLM
//! pools stop by the connection closing. Each counted per worker.

mod support;

use futures_util::StreamExt;
use serde_json::json;
use std::time::Duration;
use support::*;
use switchyard::sim::{self, EngineKind, Role, SimConfig, SimHandle};
use switchyard::telemetry::names;

async fn sglang_sim(role: Role) -> SimHandle {
    sim::spawn(SimConfig {
        role,
        engine: EngineKind::Sglang,
        ignore_disconnect: true,
        time_scale: 0.5,
        ..SimConfig::profile("tiny").unwrap()
    })
    .await
    .unwrap()
}

fn long_stream() -> serde_json::Value {
    json!({"model": sim_model(), "stream": true, "max_tokens": 1900, "ignore_eos": true,
           "messages": [{"role": "user", "content": "a long story please"}]})
}

async fn running(url: &str) -> f64 {
    sim_metric(url, "sglang:num_running_reqs").await
}

/// Start a long stream through `gw`, read its first chunk once `watch` runs it,
/// then leave.
async fn start_and_leave(gw: &str, watch: &str) {
    let r = client()
        .post(format!("{gw}/v1/chat/completions"))
        .json(&long_stream())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let mut body = r.bytes_stream();
    body.next().await.unwrap().unwrap();
    let w = watch.to_string();
    eventually(Duration::from_secs(10), "the request runs", || {
        let w = w.clone();
        async move { (running(&w).await == 1.0).then_some(()) }
    })
    .await;
    drop(body);
}

async fn cancellations(gw: &str, worker: &str, kind: &str) -> f64 {
    metric_sum(
        &scrape(gw).await,
        names::CANCELLATIONS_TOTAL,
        &[("worker", worker), ("kind", kind)],
    )
}

#[tokio::test]
async fn a_client_leaving_an_sglang_pool_aborts_the_request_on_the_engine() {
    let s = sglang_sim(Role::Both).await;
    let gw = gateway(&pool_toml(&sim_model(), &[&s.url()], "engine = \"sglang\"")).await;
    start_and_leave(&gw.url(), &s.url()).await;
    // The sim ignores the closed connection: only the abort stops it.
    let u = s.url();
    eventually(
        Duration::from_secs(10),
        "the engine stopped the request",
        || {
            let u = u.clone();
            async move { (running(&u).await == 0.0).then_some(()) }
        },
    )
    .await;
    assert_eq!(s.aborts_received(), 1);
    let gwu = gw.url();
    eventually(Duration::from_secs(5), "cancellation counted", || {
        let (g, w) = (gwu.clone(), u.clone());
        async move { (cancellations(&g, &w, "abort_sent").await == 1.0).then_some(()) }
    })
    .await;
    gw.shutdown().await;
}

#[tokio::test]
async fn a_vllm_pool_counts_the_closed_connection_and_sends_no_abort() {
    let s = sglang_sim(Role::Both).await;
    // The same engine behind a pool that says vLLM: no abort call.
    let gw = gateway(&pool_toml(&sim_model(), &[&s.url()], "")).await;
    start_and_leave(&gw.url(), &s.url()).await;
    let (g, u) = (gw.url(), s.url());
    eventually(Duration::from_secs(5), "cancellation counted", || {
        let (g, u) = (g.clone(), u.clone());
        async move { (cancellations(&g, &u, "connection_closed").await == 1.0).then_some(()) }
    })
    .await;
    assert_eq!(s.aborts_received(), 0);
    assert_eq!(running(&u).await, 1.0, "nothing told this engine to stop");
    gw.shutdown().await;
}

#[tokio::test]
async fn both_legs_of_a_disaggregated_sglang_request_are_aborted() {
    let prefill = sglang_sim(Role::Prefill).await;
    let decode = sglang_sim(Role::Decode).await;
    let gw = gateway(&format!(
        "[[pools]]\nname = \"pd\"\nmodels = [\"{}\"]\nworkers = [{{ url = \"{}\", labels = {{ role = \"prefill\" }} }}, {{ url = \"{}\", labels = {{ role = \"decode\" }} }}]\n[pools.disaggregation]\nmode = \"sglang\"\nmin_uncached_tokens = 0\n",
        sim_model(),
        prefill.url(),
        decode.url()
    ))
    .await;
    start_and_leave(&gw.url(), &decode.url()).await;
    let d = decode.url();
    eventually(Duration::from_secs(10), "the decode leg stopped", || {
        let d = d.clone();
        async move { (running(&d).await == 0.0).then_some(()) }
    })
    .await;
    eventually(Duration::from_secs(5), "both legs told", || {
        let n = prefill.aborts_received() + decode.aborts_received();
        async move { (n == 2).then_some(()) }
    })
    .await;
    assert_eq!(prefill.aborts_received(), 1);
    assert_eq!(decode.aborts_received(), 1);
    assert_eq!(running(&prefill.url()).await, 0.0);
    gw.shutdown().await;
}
