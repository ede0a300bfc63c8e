//! Usage you can bill on: a streamed request is asked for usage upstream even when
//! its client did not ask, the usage chunk is kept out of that client's stream, and
//! tokens are exact; an upstream that reports none is estimated and says so.
//! The real binary in front of simulated engines.

mod support;

use serde_json::{json, Value};
use std::time::Duration;
use support::*;

fn config(name: &str, sim: &str, pool_lines: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!("switchyard-usage-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("access.jsonl");
    let _ = std::fs::remove_file(&log);
    let toml = format!(
        "[access_log]\nenabled = true\npath = \"{}\"\n{}",
        log.display(),
        pool_toml(&sim_model(), &[sim], pool_lines)
    );
    (config_file(&format!("usage-{name}"), &toml), log)
}

/// The `data:` payloads of an SSE text, without `[DONE]`.
fn chunks(sse: &str) -> Vec<Value> {
    sse.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

fn usage_chunks(sse: &str) -> Vec<Value> {
    chunks(sse)
        .into_iter()
        .filter(|c| c["usage"].is_object())
        .collect()
}

fn ask(stream_options: Option<Value>) -> Value {
    let mut body = json!({
        "model": sim_model(),
        "stream": true,
        "max_tokens": 6,
        "messages": [{"role": "user", "content": "count the tokens of this prompt exactly"}],
    });
    if let Some(o) = stream_options {
        body["stream_options"] = o;
    }
    body
}

/// The access-log records, once `n` have been written.
async fn access_records(log: &std::path::Path, n: usize) -> Vec<Value> {
    eventually(Duration::from_secs(10), "access log records", || async {
        let text = std::fs::read_to_string(log).ok()?;
        let recs: Vec<Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        (recs.len() >= n).then_some(recs)
    })
    .await
}

#[tokio::test]
async fn usage_is_asked_for_upstream_and_stripped_for_clients_that_did_not_ask() {
    let s = sims(1, 50.0).await;
    let (cfg, log) = config("asked", &s[0].url(), "");
    let gw = serve_binary(&cfg).await;

    // The engine's own count for this prompt, asked directly.
    let (_, direct) = stream_text(&s[0].url(), ask(Some(json!({"include_usage": true})))).await;
    let truth = usage_chunks(&direct)[0]["usage"]["prompt_tokens"]
        .as_u64()
        .unwrap();
    assert!(truth > 0);

    let (status, text) = stream_text(&gw.url, ask(None)).await;
    assert_eq!(status, 200);
    assert!(usage_chunks(&text).is_empty(), "usage leaked: {text}");
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    assert!(chunks(&text)
        .iter()
        .all(|c| !c["choices"].as_array().unwrap().is_empty()));

    // `null` options, then a client that asks: it gets exactly one usage chunk.
    let (_, null_opts) = stream_text(&gw.url, ask(Some(Value::Null))).await;
    assert!(usage_chunks(&null_opts).is_empty(), "{null_opts}");
    let (_, asked) = stream_text(&gw.url, ask(Some(json!({"include_usage": true})))).await;
    let got = usage_chunks(&asked);
    assert_eq!(got.len(), 1, "{asked}");
    assert_eq!(got[0]["usage"]["prompt_tokens"].as_u64(), Some(truth));

    let recs = access_records(&log, 3).await;
    for r in &recs {
        assert_eq!(r["usage"], "reported", "{r}");
        assert_eq!(r["prompt_tokens"].as_u64(), Some(truth), "{r}");
    }
    let metrics = scrape(&gw.url).await;
    let prompt = metric_sum(&metrics, "switchyard_tokens_total", &[("kind", "prompt")]);
    assert_eq!(prompt, 3.0 * truth as f64);
    let estimated = metric_sum(&metrics, "switchyard_usage_estimated_total", &[]);
    assert_eq!(estimated, 0.0);
}

#[tokio::test]
async fn an_answer_without_usage_is_estimated_and_labelled() {
    let s = sims(1, 50.0).await;
    // The pool does not ask: the client's stream carries no usage at all.
    let (cfg, log) = config("estimated", &s[0].url(), "request_usage = false");
    let gw = serve_binary(&cfg).await;

    let (status, text) = stream_text(&gw.url, ask(None)).await;
    assert_eq!(status, 200);
    assert!(usage_chunks(&text).is_empty());
    let content = chunks(&text)
        .iter()
        .filter(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .is_some_and(|t| !t.is_empty())
        })
        .count() as u64;

    let rec = &access_records(&log, 1).await[0];
    assert_eq!(rec["usage"], "estimated", "{rec}");
    assert!(rec["prompt_tokens"].as_u64().unwrap() > 0, "{rec}");
    assert_eq!(rec["output_tokens"].as_u64(), Some(content), "{rec}");
    let metrics = scrape(&gw.url).await;
    let estimated = metric_sum(
        &metrics,
        "switchyard_usage_estimated_total",
        &[("pool", "p")],
    );
    assert_eq!(estimated, 1.0);
    assert!(metric_sum(&metrics, "switchyard_tokens_total", &[("kind", "prompt")]) > 0.0);
}
