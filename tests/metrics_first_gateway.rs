//! The first gateway of a process records per-request metrics.
//!
//! Its own test binary on purpose: the metrics recorder is process-global, and in a
//! binary where another test already started a gateway the recorder is installed
//! before this one builds its routing snapshot. `switchyard serve` is always the
//! first gateway of its process; the real-vLLM e2e suite found that it recorded no
//! TTFT, ITL, token or request counters, because the per-(model, worker) metric
//! handles were resolved while building the snapshot, before the recorder existed,
//! and were no-ops for the life of that snapshot.

mod support;

use serde_json::json;
use support::*;
use switchyard::telemetry::names;

#[tokio::test]
async fn the_first_gateway_in_a_process_records_request_metrics() {
    let s = sims(1, 20.0).await;
    let model = sim_model();
    let u = urls(&s);
    // Static models: the snapshot (and its metric handles) is built at start.
    let gw = gateway(&pool_toml(&model, &[u[0].as_str()], "")).await;
    let url = gw.url();
    let (status, _) = stream_text(
        &url,
        json!({"model": model, "stream": true, "max_tokens": 4,
               "messages": [{"role":"user","content":"count"}]}),
    )
    .await;
    assert_eq!(status, 200);
    let text = scrape(&url).await;
    let ttft = metric_sum(&text, names::TTFT_SECONDS, &[]);
    assert!(ttft >= 1.0, "no TTFT sample recorded:\n{text}");
    let reqs = metric_sum(&text, names::REQUESTS_TOTAL, &[]);
    assert!(reqs >= 1.0, "no request counted:\n{text}");
}
