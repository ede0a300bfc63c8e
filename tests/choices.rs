//! Requests for several choices (`n > 1`, and `best_of` for completions)
//! stream every choice through the gateway and are counted as the engine bills
//! them: output tokens from `usage` when the stream carries it, else one per
//! content event of every choice.

mod support;

use serde_json::{json, Value};
use std::collections::BTreeMap;
use support::*;
use switchyard::telemetry::names;

async fn output_tokens(gw: &str, worker: &str) -> f64 {
    metric_sum(
        &scrape(gw).await,
        names::TOKENS_TOTAL,
        &[("worker", worker), ("kind", "output")],
    )
}

/// Content pieces per choice index in a chat or completions stream, and the
/// usage chunk if any.
fn per_choice(sse: &str) -> (BTreeMap<u64, usize>, Option<Value>) {
    let mut pieces = BTreeMap::new();
    let mut usage = None;
    for data in sse.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if data == "[DONE]" {
            continue;
        }
        let v: Value = serde_json::from_str(data).unwrap();
        if !v["usage"].is_null() {
            usage = Some(v["usage"].clone());
        }
        for c in v["choices"].as_array().into_iter().flatten() {
            let text = c["delta"]["content"].as_str().or(c["text"].as_str());
            if text.is_some_and(|t| !t.is_empty()) {
                *pieces.entry(c["index"].as_u64().unwrap()).or_default() += 1;
            }
        }
    }
    (pieces, usage)
}

#[tokio::test]
async fn n_and_best_of_stream_every_choice_and_count_what_the_engine_bills() {
    let s = sims(1, 20.0).await;
    let model = sim_model();
    let w = s[0].url();
    let gw = gateway(&pool_toml(&model, &[&w], "")).await;
    let url = gw.url();

    // Streamed chat, n = 3, with usage: every choice streams; usage bills all.
    let (st, text) = stream_text(
        &url,
        json!({"model": model, "stream": true, "n": 3, "max_tokens": 4, "ignore_eos": true,
               "stream_options": {"include_usage": true},
               "messages": [{"role": "user", "content": "three takes"}]}),
    )
    .await;
    assert_eq!(st, 200);
    let (pieces, usage) = per_choice(&text);
    assert_eq!(pieces, BTreeMap::from([(0, 4), (1, 4), (2, 4)]), "{text}");
    assert_eq!(usage.unwrap()["completion_tokens"], json!(12));
    assert_eq!(output_tokens(&url, &w).await, 12.0);

    // Without usage: counted from the content events of every choice.
    let (_, text) = stream_text(
        &url,
        json!({"model": model, "stream": true, "n": 2, "max_tokens": 5, "ignore_eos": true,
               "messages": [{"role": "user", "content": "two takes"}]}),
    )
    .await;
    let (pieces, usage) = per_choice(&text);
    assert_eq!(pieces, BTreeMap::from([(0, 5), (1, 5)]));
    assert!(usage.is_none());
    assert_eq!(output_tokens(&url, &w).await, 12.0 + 10.0);

    // Completions with best_of = 3, n = 2: two returned, three generated and billed.
    let v: Value = client()
        .post(format!("{url}/v1/completions"))
        .json(
            &json!({"model": model, "prompt": "Once upon a time", "n": 2, "best_of": 3,
                      "max_tokens": 3, "ignore_eos": true}),
        )
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["choices"].as_array().unwrap().len(), 2, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], json!(9), "{v}");
    assert_eq!(output_tokens(&url, &w).await, 12.0 + 10.0 + 9.0);

    // Streamed completions, n = 2, with usage.
    let r = client()
        .post(format!("{url}/v1/completions"))
        .json(
            &json!({"model": model, "prompt": "Twice", "n": 2, "max_tokens": 3, "stream": true,
                      "ignore_eos": true, "stream_options": {"include_usage": true}}),
        )
        .send()
        .await
        .unwrap();
    let text = r.text().await.unwrap();
    let (pieces, usage) = per_choice(&text);
    assert_eq!(pieces, BTreeMap::from([(0, 3), (1, 3)]), "{text}");
    assert_eq!(usage.unwrap()["completion_tokens"], json!(6));
    assert_eq!(output_tokens(&url, &w).await, 12.0 + 10.0 + 9.0 + 6.0);
    gw.shutdown().await;
}
