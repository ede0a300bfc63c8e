//! The gateway in front of simulated vLLM workers: every endpoint, streaming,
//! measurement, and cancellation when the client goes away.

mod support;

use futures_util::StreamExt;
use serde_json::json;
use std::time::Duration;
use support::*;
use switchyard::telemetry::names;

#[tokio::test]
async fn chat_completions_embeddings_and_models_through_the_gateway() {
    let s = sims(2, 20.0).await;
    let model = sim_model();
    let u = urls(&s);
    let gw = gateway(&pool_toml(&model, &[u[0].as_str(), u[1].as_str()], "")).await;
    let url = gw.url();
    let c = client();

    let r: serde_json::Value = c
        .post(format!("{url}/v1/chat/completions"))
        .json(&json!({"model": model, "max_tokens": 5, "messages": [{"role":"user","content":"hello there"}]}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(r["object"], "chat.completion");
    assert_eq!(r["usage"]["completion_tokens"], 5);

    let r: serde_json::Value = c
        .post(format!("{url}/v1/completions"))
        .json(&json!({"model": model, "max_tokens": 3, "prompt": "once upon"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(r["object"], "text_completion");

    let r: serde_json::Value = c
        .post(format!("{url}/v1/embeddings"))
        .json(&json!({"model": model, "input": ["a", "b"]}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(r["data"].as_array().unwrap().len(), 2);

    let (status, text) = stream_text(
        &url,
        json!({"model": model, "stream": true, "max_tokens": 4,
               "stream_options": {"include_usage": true},
               "messages": [{"role":"user","content":"stream it"}]}),
    )
    .await;
    assert_eq!(status, 200);
    let content_events = text.matches("\"content\":\"").count() - 1; // minus the role chunk
    assert_eq!(content_events, 4, "{text}");
    assert!(text.contains("\"usage\":{") && text.ends_with("data: [DONE]\n\n"));
    gw.shutdown().await;
}

#[tokio::test]
async fn metrics_match_the_traffic_sent() {
    let s = sims(1, 20.0).await;
    let model = sim_model();
    let gw = gateway(&pool_toml(&model, &[s[0].url().as_str()], "")).await;
    let url = gw.url();
    let prompt = "the same long shared system prompt ".repeat(40);
    let mut prompt_tokens = 0.0;
    let mut cached = 0.0;
    for i in 0..3 {
        let (_, text) = stream_text(
            &url,
            json!({"model": model, "stream": true, "max_tokens": 6,
                   "stream_options": {"include_usage": true},
                   "messages": [{"role":"system","content": prompt}, {"role":"user","content": format!("q{i}")}]}),
        )
        .await;
        let usage_line = text
            .lines()
            .find(|l| l.contains("\"usage\":{"))
            .expect("usage chunk");
        let v: serde_json::Value =
            serde_json::from_str(usage_line.trim_start_matches("data: ")).unwrap();
        prompt_tokens += v["usage"]["prompt_tokens"].as_f64().unwrap();
        cached += v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_f64()
            .unwrap_or(0.0);
    }
    // A stream without include_usage: the gateway asks the engine for usage
    // anyway, so its tokens count exactly (the engine's count, asked afterwards).
    let quiet = json!({"model": model, "stream": true, "max_tokens": 5, "messages": [{"role":"user","content":"x"}]});
    stream_text(&url, quiet.clone()).await;
    let mut asked = quiet;
    asked["stream_options"] = json!({"include_usage": true});
    let (_, direct) = stream_text(&s[0].url(), asked).await;
    let usage_line = direct.lines().find(|l| l.contains("\"usage\":{")).unwrap();
    let v: serde_json::Value =
        serde_json::from_str(usage_line.trim_start_matches("data: ")).unwrap();
    prompt_tokens += v["usage"]["prompt_tokens"].as_f64().unwrap();
    // A non-streamed response (Content-Length body): usage is read from its end.
    let v: serde_json::Value = client()
        .post(format!("{url}/v1/chat/completions"))
        .json(&json!({"model": model, "max_tokens": 7, "messages": [{"role":"user","content":"plain"}]}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    prompt_tokens += v["usage"]["prompt_tokens"].as_f64().unwrap();
    assert!(
        cached > 0.0,
        "the repeated prefix must hit the simulated cache"
    );
    let text = scrape(&url).await;
    let w = s[0].url();
    let l = |k: &'static str| {
        vec![
            ("model", model.as_str()),
            ("worker", w.as_str()),
            ("kind", k),
        ]
    };
    assert_eq!(
        metric_sum(&text, names::TOKENS_TOTAL, &l("prompt")),
        prompt_tokens
    );
    assert_eq!(metric_sum(&text, names::TOKENS_TOTAL, &l("cached")), cached);
    assert_eq!(
        metric_sum(&text, names::TOKENS_TOTAL, &l("output")),
        3.0 * 6.0 + 5.0 + 7.0
    );
    assert_eq!(
        metric_sum(
            &text,
            names::REQUESTS_TOTAL,
            &[("worker", &w), ("status", "200"), ("outcome", "completed")]
        ),
        5.0
    );
    assert_eq!(
        metric_sum(
            &text,
            &format!("{}_count", names::TTFT_SECONDS),
            &[("worker", &w)]
        ),
        4.0
    );
    // 3 × 5 gaps + 4 gaps between content events.
    assert_eq!(
        metric_sum(
            &text,
            &format!("{}_count", names::ITL_SECONDS),
            &[("worker", &w)]
        ),
        19.0
    );
    assert_eq!(
        metric_sum(&text, names::WORKER_IN_FLIGHT, &[("worker", &w)]),
        0.0
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn a_client_that_leaves_cancels_the_upstream_sequence() {
    let s = sims(1, 1.0).await;
    let model = sim_model();
    let gw = gateway(&pool_toml(&model, &[s[0].url().as_str()], "")).await;
    let resp = client()
        .post(format!("{}/v1/chat/completions", gw.url()))
        .json(
            &json!({"model": model, "stream": true, "max_tokens": 2000, "ignore_eos": true,
                      "messages": [{"role":"user","content":"a long answer please"}]}),
        )
        .send()
        .await
        .unwrap();
    let mut body = resp.bytes_stream();
    let mut got = 0;
    while got < 3 {
        body.next().await.unwrap().unwrap();
        got += 1;
    }
    assert_eq!(
        sim_metric(&s[0].url(), "vllm:num_requests_running").await,
        1.0
    );
    drop(body);
    let w = s[0].url();
    eventually(Duration::from_secs(5), "upstream sequence aborted", || {
        let w = w.clone();
        async move { (sim_metric(&w, "vllm:num_requests_running").await == 0.0).then_some(()) }
    })
    .await;
    let url = gw.url();
    eventually(Duration::from_secs(5), "cancelled outcome recorded", || {
        let (url, w) = (url.clone(), w.clone());
        async move {
            let text = scrape(&url).await;
            (metric_sum(
                &text,
                names::REQUESTS_TOTAL,
                &[("worker", &w), ("outcome", "cancelled")],
            ) == 1.0
                && metric_sum(&text, names::WORKER_IN_FLIGHT, &[("worker", &w)]) == 0.0)
                .then_some(())
        }
    })
    .await;
    gw.shutdown().await;
}
