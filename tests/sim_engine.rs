//! The simulated engine behaves like vLLM where a router can see it: prefix
//! caching cuts TTFT, the batch cap and the KV cache make requests wait,
//! metrics and responses have vLLM's shapes.

mod sim_support;

use std::time::Duration;

use serde_json::{json, Value};
use sim_support::*;
use switchyard::sim::{EngineKind, Role, SimConfig};

/// Expected TTFT (simulated ms) of a prompt of `p` tokens with `cached` cached.
fn ttft_ms(c: &SimConfig, p: usize, cached: usize) -> f64 {
    c.step_base_ms + c.per_seq_ms + c.per_prefill_token_ms * (p - cached) as f64
}

fn timing_cfg() -> SimConfig {
    SimConfig {
        time_scale: 1.0,
        max_num_batched_tokens: 8192,
        num_blocks: 4096,
        max_model_len: 8192,
        step_base_ms: 20.0,
        per_seq_ms: 0.0,
        per_prefill_token_ms: 0.1,
        ..cfg()
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

#[tokio::test]
async fn repeated_long_prompt_has_lower_ttft_by_expected_ratio() {
    let c = timing_cfg();
    let h = sim(c.clone()).await;
    let url = format!("{}/v1/chat/completions", h.url());
    let cl = client();

    let mut cold = Vec::new();
    let mut prompt_tokens = 0;
    for tag in ["cold-a", "cold-b", "cold-c"] {
        let r = stream(&cl, &url, chat_body(&c.model, &text(tag, 1500), 2), None).await;
        cold.push(r.ttft().as_secs_f64());
        let u = r.usage().expect("usage");
        assert_eq!(u["prompt_tokens_details"]["cached_tokens"], 0);
        prompt_tokens = u["prompt_tokens"].as_u64().unwrap() as usize;
    }
    let mut warm = Vec::new();
    let mut cached = 0;
    for _ in 0..5 {
        let r = stream(
            &cl,
            &url,
            chat_body(&c.model, &text("cold-a", 1500), 2),
            None,
        )
        .await;
        warm.push(r.ttft().as_secs_f64());
        cached = r.usage().unwrap()["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap() as usize;
    }
    // Every full block but the one holding the last prompt token is cached.
    assert_eq!(cached, (prompt_tokens - 1) / c.block_size * c.block_size);
    let expected = ttft_ms(&c, prompt_tokens, 0) / ttft_ms(&c, prompt_tokens, cached);
    let measured = median(cold.clone()) / median(warm.clone());
    println!(
        "prompt={prompt_tokens} cached={cached} cold={cold:?} warm={warm:?} expected ratio {expected:.2}, measured {measured:.2}"
    );
    assert!(expected > 5.0, "the setup must make the difference clear");
    assert!(
        measured > expected * 0.6 && measured < expected * 1.25,
        "measured ratio {measured:.2} vs expected {expected:.2}"
    );
    // Absolute cold TTFT is the model's figure (plus a little overhead).
    let cold_ms = median(cold) * 1000.0;
    let model_ms = ttft_ms(&c, prompt_tokens, 0);
    assert!(
        cold_ms > model_ms * 0.9 && cold_ms < model_ms * 1.6,
        "{cold_ms} vs {model_ms}"
    );
}

#[tokio::test]
async fn prefix_hits_show_in_usage_and_metrics() {
    let c = cfg();
    let h = sim(c.clone()).await;
    let cl = client();
    let body = json!({"model": c.model, "prompt": text("shared", 200), "max_tokens": 3});
    let url = format!("{}/v1/completions", h.url());
    let a: Value = cl
        .post(&url)
        .json(&body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let b: Value = cl
        .post(&url)
        .json(&body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(a["object"], "text_completion");
    let p = a["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(a["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let hit = b["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert_eq!(hit, (p - 1) / 16 * 16);
    assert_eq!(b["usage"]["total_tokens"], p + 3);

    let m = metrics(&cl, &h.url()).await;
    assert_eq!(
        metric(&m, "vllm:prefix_cache_queries_total", ""),
        Some((2 * p) as f64)
    );
    assert_eq!(
        metric(&m, "vllm:prefix_cache_hits_total", ""),
        Some(hit as f64)
    );
    assert_eq!(
        metric(&m, "vllm:prompt_tokens_total", ""),
        Some((2 * p) as f64)
    );
    assert_eq!(metric(&m, "vllm:generation_tokens_total", ""), Some(6.0));
    assert_eq!(
        metric(
            &m,
            "vllm:request_success_total",
            "finished_reason=\"length\""
        ),
        Some(2.0)
    );
    assert_eq!(metric(&m, "sim_requests_received_total", ""), Some(2.0));

    // A different cache_salt shares nothing.
    let salted = json!({"model": c.model, "prompt": text("shared", 200), "max_tokens": 1, "cache_salt": "tenant-b"});
    let s: Value = cl
        .post(&url)
        .json(&salted)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(s["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
}

#[tokio::test]
async fn previous_answer_is_cached_in_the_next_turn() {
    let c = cfg();
    let h = sim(c.clone()).await;
    let cl = client();
    let url = format!("{}/v1/chat/completions", h.url());
    let q1 = text("turn", 100);
    let mut body = chat_body(&c.model, &q1, 60);
    body["stream"] = json!(false);
    let a: Value = cl
        .post(&url)
        .json(&body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let answer = a["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let p1 = a["usage"]["prompt_tokens"].as_u64().unwrap();
    body["messages"] = json!([
        {"role": "user", "content": q1},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And then?"},
    ]);
    let b: Value = cl
        .post(&url)
        .json(&body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let hit = b["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    // The first turn's prompt and most of the generated answer were cached.
    assert!(
        hit >= (p1 + 60 - 16) / 16 * 16,
        "hit {hit}, first prompt {p1}"
    );
}

#[tokio::test]
async fn requests_beyond_max_num_seqs_wait() {
    let c = SimConfig {
        time_scale: 1.0,
        max_num_seqs: 4,
        step_base_ms: 10.0,
        ..cfg()
    };
    let h = sim(c.clone()).await;
    let cl = client();
    let url = format!("{}/v1/chat/completions", h.url());
    let reqs: Vec<_> = (0..10)
        .map(|i| {
            let (cl, url, body) = (
                cl.clone(),
                url.clone(),
                chat_body(&c.model, &format!("q{i}"), 30),
            );
            tokio::spawn(async move { stream(&cl, &url, body, None).await })
        })
        .collect();
    let m = wait_metrics(&cl, &h.url(), "4 running, 6 waiting", |m| {
        metric(m, "vllm:num_requests_running", "") == Some(4.0)
            && metric(m, "vllm:num_requests_waiting", "") == Some(6.0)
    })
    .await;
    assert!(metric(&m, "vllm:kv_cache_usage_perc", "").unwrap() > 0.0);
    let mut ttfts = Vec::new();
    for r in reqs {
        let r = r.await.unwrap();
        assert!(r.done);
        assert_eq!(r.tokens().len(), 30);
        ttfts.push(r.ttft());
    }
    ttfts.sort();
    // The first four start at once; the rest wait for a whole batch (30 steps).
    let batch = Duration::from_millis((30.0 * c.step_base_ms) as u64);
    assert!(ttfts[3] < batch / 3, "{ttfts:?}");
    assert!(ttfts[4] > batch * 3 / 4, "{ttfts:?}");
    let m = metrics(&cl, &h.url()).await;
    assert_eq!(metric(&m, "vllm:num_requests_waiting", ""), Some(0.0));
    assert_eq!(metric(&m, "vllm:kv_cache_usage_perc", ""), Some(0.0));
    assert_eq!(
        metric(&m, "vllm:request_success_total", "length"),
        Some(10.0)
    );
}

#[tokio::test]
async fn full_kv_cache_makes_new_requests_wait() {
    // 64 blocks of 16 tokens; each request may reach ~100 + 200 tokens (19
    // blocks), so without preemption only 3 fit at once although the batch
    // allows 8.
    let c = SimConfig {
        time_scale: 4.0,
        max_num_seqs: 8,
        num_blocks: 64,
        max_model_len: 1024,
        preemption: false,
        ..cfg()
    };
    let h = sim(c.clone()).await;
    let cl = client();
    let url = format!("{}/v1/completions", h.url());
    let reqs: Vec<_> = (0..6)
        .map(|i| {
            let body = json!({"model": c.model, "prompt": text(&format!("kv{i}"), 95), "max_tokens": 200,
                              "ignore_eos": true, "stream": true});
            let (cl, url) = (cl.clone(), url.clone());
            tokio::spawn(async move { stream(&cl, &url, body, None).await })
        })
        .collect();
    wait_metrics(&cl, &h.url(), "3 running, 3 waiting", |m| {
        metric(m, "vllm:num_requests_running", "") == Some(3.0)
            && metric(m, "vllm:num_requests_waiting", "") == Some(3.0)
    })
    .await;
    for r in reqs {
        let r = r.await.unwrap();
        assert!(r.done);
        assert_eq!(r.tokens().len(), 200);
    }
    let m = metrics(&cl, &h.url()).await;
    assert_eq!(metric(&m, "vllm:num_preemptions_total", ""), Some(0.0));
}

#[tokio::test]
async fn kv_exhaustion_preempts_the_newest_running_request() {
    let c = SimConfig {
        time_scale: 4.0,
        max_num_seqs: 8,
        num_blocks: 40,
        max_model_len: 640,
        ..cfg()
    };
    let h = sim(c.clone()).await;
    let cl = client();
    let url = format!("{}/v1/completions", h.url());
    let reqs: Vec<_> = (0..4)
        .map(|i| {
            let body = json!({"model": c.model, "prompt": text(&format!("pre{i}"), 95), "max_tokens": 200,
                              "ignore_eos": true, "stream": true});
            let (cl, url) = (cl.clone(), url.clone());
            tokio::spawn(async move { stream(&cl, &url, body, None).await })
        })
        .collect();
    for r in reqs {
        let r = r.await.unwrap();
        assert!(r.done);
        assert_eq!(r.tokens().len(), 200);
    }
    let m = metrics(&cl, &h.url()).await;
    assert!(
        metric(&m, "vllm:num_preemptions_total", "").unwrap() >= 1.0,
        "{m}"
    );
    assert_eq!(metric(&m, "vllm:kv_cache_usage_perc", ""), Some(0.0));
}

#[tokio::test]
async fn chat_stream_matches_vllm_shape_and_spacing() {
    let c = SimConfig {
        time_scale: 1.0,
        step_base_ms: 15.0,
        ..cfg()
    };
    let h = sim(c.clone()).await;
    let r = stream(
        &client(),
        &format!("{}/v1/chat/completions", h.url()),
        chat_body(&c.model, "Hello!", 8),
        None,
    )
    .await;
    assert_eq!(r.status, 200);
    assert!(r.done && !r.broken);
    // role chunk, 8 content chunks, usage chunk
    assert_eq!(r.events.len(), 10);
    let first = &r.events[0];
    assert_eq!(first["object"], "chat.completion.chunk");
    assert!(first["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(first["model"], c.model);
    assert_eq!(
        first["choices"][0]["delta"],
        json!({"role": "assistant", "content": ""})
    );
    for e in &r.events[1..8] {
        assert_eq!(e["choices"][0]["finish_reason"], Value::Null);
        assert_eq!(e["id"], first["id"]);
    }
    assert_eq!(r.events[8]["choices"][0]["finish_reason"], "length");
    let u = &r.events[9];
    assert_eq!(u["choices"], json!([]));
    let p = u["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(
        u["usage"],
        json!({"prompt_tokens": p, "total_tokens": p + 8, "completion_tokens": 8,
               "prompt_tokens_details": {"cached_tokens": 0}})
    );
    // Tokens arrive one step apart, each as its own event.
    let t = r.tokens();
    let gaps: Vec<f64> = t
        .windows(2)
        .map(|w| (w[1].0 - w[0].0).as_secs_f64() * 1000.0)
        .collect();
    let med = median(gaps.clone());
    assert!(
        med > c.step_base_ms * 0.7 && med < c.step_base_ms * 2.0,
        "{gaps:?}"
    );

    // Without include_usage there is no usage chunk.
    let mut body = chat_body(&c.model, "Hello!", 2);
    body["stream_options"] = json!(null);
    let r = stream(
        &client(),
        &format!("{}/v1/chat/completions", h.url()),
        body,
        None,
    )
    .await;
    assert!(r.done && r.usage().is_none());
}

#[tokio::test]
async fn completion_stream_and_non_stream_shapes() {
    let c = cfg();
    let h = sim(c.clone()).await;
    let cl = client();
    let url = format!("{}/v1/completions", h.url());
    let body = json!({"model": c.model, "prompt": "Once upon a time", "max_tokens": 4, "stream": true,
                      "stream_options": {"include_usage": true}});
    let r = stream(&cl, &url, body, None).await;
    assert!(r.done);
    assert_eq!(r.events.len(), 5);
    assert_eq!(r.events[0]["object"], "text_completion");
    assert!(r.events[0]["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(r.events[3]["choices"][0]["finish_reason"], "length");
    assert_eq!(r.events[4]["usage"]["completion_tokens"], 4);

    let chat: Value = cl
        .post(format!("{}/v1/chat/completions", h.url()))
        .json(&json!({"model": c.model, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(chat["object"], "chat.completion");
    assert_eq!(chat["choices"][0]["message"]["role"], "assistant");
    assert_eq!(chat["choices"][0]["finish_reason"], "length");
    assert_eq!(chat["usage"]["completion_tokens"], 3);
    // Content re-tokenizes to exactly the generated token count.
    let content = chat["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(switchyard::sim::tokenizer::count(content), 3);
}

#[tokio::test]
async fn bad_requests_get_openai_errors() {
    let c = SimConfig {
        max_model_len: 512,
        ..cfg()
    };
    let h = sim(c.clone()).await;
    let cl = client();
    let url = format!("{}/v1/chat/completions", h.url());
    let post = |body: String| {
        let (cl, url) = (cl.clone(), url.clone());
        async move {
            let r = cl
                .post(&url)
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap())
        }
    };
    let (st, e) = post("{not json".into()).await;
    assert_eq!(st, 400);
    assert_eq!(e["error"]["code"], 400);
    assert_eq!(e["error"]["type"], "BadRequestError");
    assert!(e["error"]["message"].is_string());
    assert_eq!(post("[1,2]".into()).await.0, 400);
    assert_eq!(post(json!({"model": c.model}).to_string()).await.0, 400);
    assert_eq!(
        post(json!({"model": c.model, "messages": "x"}).to_string())
            .await
            .0,
        400
    );
    assert_eq!(
        post(json!({"model": c.model, "messages": [{"role": "user", "content": 5}]}).to_string())
            .await
            .0,
        400
    );
    assert_eq!(post(json!({"model": c.model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}).to_string()).await.0, 400);
    assert_eq!(post(json!({"model": c.model, "messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}).to_string()).await.0, 400);
    let (st, e) =
        post(json!({"model": "nope", "messages": [{"role": "user", "content": "x"}]}).to_string())
            .await;
    assert_eq!(st, 404);
    assert_eq!(e["error"]["type"], "NotFoundError");
    let (st, e) = post(
        json!({"model": c.model, "messages": [{"role": "user", "content": text("long", 600)}]})
            .to_string(),
    )
    .await;
    assert_eq!(st, 400);
    assert!(e["error"]["message"]
        .as_str()
        .unwrap()
        .contains("maximum context length is 512"));
    let (st, _) = post(json!({"model": c.model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 600}).to_string()).await;
    assert_eq!(st, 400);
    let r = cl.get(format!("{}/nope", h.url())).send().await.unwrap();
    assert_eq!(r.status(), 404);
    // The engine still works afterwards.
    let r = stream(&cl, &url, chat_body(&c.model, "ok", 2), None).await;
    assert!(r.done);
}

#[tokio::test]
async fn info_endpoints_and_embeddings() {
    let c = SimConfig {
        aliases: vec!["alias-1".into()],
        embedding_dim: 32,
        ..cfg()
    };
    let h = sim(c.clone()).await;
    let cl = client();
    let m: Value = cl
        .get(format!("{}/v1/models", h.url()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(m["object"], "list");
    let ids: Vec<&str> = m["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, vec![c.model.as_str(), "alias-1"]);
    assert_eq!(m["data"][0]["max_model_len"], c.max_model_len);
    assert_eq!(
        cl.get(format!("{}/health", h.url()))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    let v: Value = cl
        .get(format!("{}/version", h.url()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(v["version"].is_string());

    let url = format!("{}/v1/embeddings", h.url());
    let e: Value = cl
        .post(&url)
        .json(&json!({"model": "alias-1", "input": ["a cat", "a dog"]}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(e["object"], "list");
    assert_eq!(e["data"].as_array().unwrap().len(), 2);
    let v0: Vec<f64> = serde_json::from_value(e["data"][0]["embedding"].clone()).unwrap();
    assert_eq!(v0.len(), 32);
    assert!((v0.iter().map(|x| x * x).sum::<f64>() - 1.0).abs() < 1e-3);
    assert_ne!(e["data"][0]["embedding"], e["data"][1]["embedding"]);
    assert_eq!(e["usage"]["prompt_tokens"], 4);
    let again: Value = cl
        .post(&url)
        .json(&json!({"input": "a cat"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(again["data"][0]["embedding"], e["data"][0]["embedding"]);
    let b64: Value = cl
        .post(&url)
        .json(&json!({"input": "a cat", "encoding_format": "base64"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        b64["data"][0]["embedding"].as_str().unwrap().len(),
        32 * 4 * 4 / 3 + 4 - (32 * 4 * 4 / 3) % 4
    );
}

#[tokio::test]
async fn output_is_deterministic_per_seed_and_stops_naturally() {
    let c = SimConfig {
        seed: 7,
        mean_output_tokens: 5,
        ..cfg()
    };
    let a = sim(c.clone()).await;
    let b = sim(c.clone()).await;
    let other = sim(SimConfig {
        seed: 8,
        ..c.clone()
    })
    .await;
    let cl = client();
    let body = json!({"model": c.model, "prompt": "Tell me a story", "max_tokens": 50, "ignore_eos": true});
    let get = |base: String, body: Value| {
        let cl = cl.clone();
        async move {
            let v: Value = cl
                .post(format!("{base}/v1/completions"))
                .json(&body)
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            v
        }
    };
    let ra = get(a.url(), body.clone()).await;
    let rb = get(b.url(), body.clone()).await;
    let ro = get(other.url(), body.clone()).await;
    assert_eq!(ra["choices"][0]["text"], rb["choices"][0]["text"]);
    assert_ne!(ra["choices"][0]["text"], ro["choices"][0]["text"]);
    assert_eq!(ra["choices"][0]["finish_reason"], "length");
    assert_eq!(ra["usage"]["completion_tokens"], 50);

    // Without ignore_eos, a short natural length (mean 5) ends with "stop".
    let mut natural = body.clone();
    natural["ignore_eos"] = json!(false);
    let rn = get(a.url(), natural).await;
    assert_eq!(rn["choices"][0]["finish_reason"], "stop");
    assert!(rn["usage"]["completion_tokens"].as_u64().unwrap() < 50);
}

/// A strict check of the Prometheus text exposition format (0.0.4).
fn check_exposition(text: &str) -> Vec<String> {
    use std::collections::HashMap;
    let name_ok = |n: &str| {
        let mut ch = n.chars();
        ch.next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
            && ch.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
    };
    let mut types: HashMap<String, String> = HashMap::new();
    let mut helps = 0;
    let mut families = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (n, h) = rest.split_once(' ').expect("HELP text");
            assert!(name_ok(n) && !h.is_empty(), "{line}");
            helps += 1;
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (n, t) = rest.split_once(' ').expect("TYPE kind");
            assert!(name_ok(n), "{line}");
            assert!(["counter", "gauge", "histogram"].contains(&t), "{line}");
            assert!(
                types.insert(n.to_string(), t.to_string()).is_none(),
                "duplicate TYPE {n}"
            );
            families.push(n.to_string());
            continue;
        }
        assert!(
            !line.starts_with('#') && !line.is_empty(),
            "stray line {line:?}"
        );
        let (head, value) = line.rsplit_once(' ').expect("sample value");
        let v: f64 = value.parse().unwrap_or_else(|_| panic!("value in {line}"));
        assert!(v.is_finite() && v >= 0.0, "{line}");
        let (name, labels) = match head.split_once('{') {
            Some((n, l)) => (n, l.strip_suffix('}').expect("closing brace")),
            None => (head, ""),
        };
        assert!(name_ok(name), "{line}");
        for pair in labels.split("\",").filter(|p| !p.is_empty()) {
            let (k, v) = pair
                .split_once("=\"")
                .unwrap_or_else(|| panic!("label in {line}"));
            assert!(name_ok(k) && !k.contains(':'), "{line}");
            let _ = v;
        }
        // The process collector's metrics are unlabelled, as in vLLM.
        assert!(
            name.starts_with("process_")
                || (labels.contains("model_name=\"") && labels.contains("engine=\"")),
            "{line}"
        );
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| {
                name.strip_suffix(s)
                    .filter(|f| types.get(*f).is_some_and(|t| t == "histogram"))
            })
            .unwrap_or(name);
        assert!(types.contains_key(family), "sample before its TYPE: {line}");
    }
    assert_eq!(helps, types.len());
    families
}

async fn traffic(h: &switchyard::sim::SimHandle, model: &str) {
    let cl = client();
    let url = format!("{}/v1/chat/completions", h.url());
    for _ in 0..2 {
        let r = stream(&cl, &url, chat_body(model, &text("m", 50), 5), None).await;
        assert!(r.done);
    }
}

#[tokio::test]
async fn metrics_are_valid_prometheus_text_with_vllm_names() {
    let c = cfg();
    let h = sim(c.clone()).await;
    traffic(&h, &c.model).await;
    let text = metrics(&client(), &h.url()).await;
    let families = check_exposition(&text);
    for n in [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:request_success_total",
        "vllm:num_preemptions_total",
        "vllm:cache_config_info",
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds",
        "sim_requests_received_total",
        "process_start_time_seconds",
    ] {
        assert!(families.iter().any(|f| f == n), "missing {n}");
    }
    assert!(text.contains("vllm:cache_config_info{engine=\"0\",model_name=\"sim-tiny\",block_size=\"16\",num_gpu_blocks=\"256\"} 1.0"));

    // prometheus-parse 0.2 only accepts `\w+` names and silently skips
    // samples with a colon, so parse a copy with `:` mapped to `_` to check
    // types, labels and histogram structure with a real parser.
    let mapped = text.replace("vllm:", "vllm_");
    let scrape =
        prometheus_parse::Scrape::parse(mapped.lines().map(|l| Ok(l.to_string()))).unwrap();
    let sample = |name: &str| {
        scrape
            .samples
            .iter()
            .find(|s| s.metric == name)
            .unwrap_or_else(|| panic!("{name} not parsed"))
    };
    let ttft = sample("vllm_time_to_first_token_seconds");
    assert_eq!(ttft.labels.get("model_name"), Some("sim-tiny"));
    assert_eq!(ttft.labels.get("engine"), Some("0"));
    match &ttft.value {
        prometheus_parse::Value::Histogram(buckets) => {
            assert_eq!(buckets.last().unwrap().less_than, f64::INFINITY);
            assert_eq!(buckets.last().unwrap().count, 2.0);
            assert!(buckets.windows(2).all(|w| w[0].count <= w[1].count));
        }
        other => panic!("TTFT is not a histogram: {other:?}"),
    }
    assert!(matches!(
        sample("vllm_kv_cache_usage_perc").value,
        prometheus_parse::Value::Gauge(_)
    ));
    assert!(
        matches!(sample("vllm_generation_tokens_total").value, prometheus_parse::Value::Counter(v) if v == 10.0)
    );
    let ok = scrape
        .samples
        .iter()
        .filter(|s| s.metric == "vllm_request_success_total")
        .count();
    assert_eq!(ok, 3, "one sample per finished_reason");
}

#[tokio::test]
async fn sglang_engine_uses_sglang_names_and_get_load() {
    let c = SimConfig {
        engine: EngineKind::Sglang,
        ..cfg()
    };
    let h = sim(c.clone()).await;
    traffic(&h, &c.model).await;
    let cl = client();
    let text = metrics(&cl, &h.url()).await;
    let families = check_exposition(&text);
    for n in [
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:token_usage",
        "sglang:cache_hit_rate",
        "sglang:prompt_tokens_total",
        "sglang:generation_tokens_total",
        "sglang:time_to_first_token_seconds",
        "sim_requests_received_total",
        "process_start_time_seconds",
    ] {
        assert!(families.iter().any(|f| f == n), "missing {n}");
    }
    assert!(!text.contains("vllm:"));
    let rate = metric(&text, "sglang:cache_hit_rate", "").unwrap();
    assert!(
        rate > 0.2 && rate < 0.5,
        "second of two equal prompts hits: {rate}"
    );
    let load: Value = cl
        .get(format!("{}/get_load", h.url()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(load[0]["num_reqs"], 0);
    assert_eq!(load[0]["num_waiting_reqs"], 0);
    assert!(load[0]["num_tokens"].is_u64());
    // vLLM mode has no /get_load.
    let v = sim(cfg()).await;
    assert_eq!(
        cl.get(format!("{}/get_load", v.url()))
            .send()
            .await
            .unwrap()
            .status(),
        404
    );
}

#[tokio::test]
async fn nixl_prefill_then_decode_skips_the_prefill() {
    let base = SimConfig {
        kv_transfer_base_ms: 1.0,
        kv_transfer_per_token_ms: 0.001,
        ..timing_cfg()
    };
    let prefill = sim(SimConfig {
        role: Role::Prefill,
        ..base.clone()
    })
    .await;
    let decode = sim(SimConfig {
        role: Role::Decode,
        ..base.clone()
    })
    .await;
    let both = sim(base.clone()).await;
    let cl = client();
    let prompt = text("pd", 1500);

    let mut req = chat_body(&base.model, &prompt, 1);
    req["stream"] = json!(false);
    req["kv_transfer_params"] = json!({"do_remote_decode": true, "do_remote_prefill": false,
        "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null});
    let p: Value = cl
        .post(format!("{}/v1/chat/completions", prefill.url()))
        .json(&req)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(p["usage"]["completion_tokens"], 1);
    let kv = p["kv_transfer_params"].clone();
    let n_prompt = p["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
    assert_eq!(kv["do_remote_prefill"], true);
    assert_eq!(kv["do_remote_decode"], false);
    assert_eq!(
        kv["remote_block_ids"].as_array().unwrap().len(),
        n_prompt.div_ceil(16)
    );
    assert_eq!(kv["remote_port"], prefill.addr().port());
    assert_eq!(kv["remote_host"], "127.0.0.1");
    assert!(!kv["remote_engine_id"].as_str().unwrap().is_empty());

    let mut dreq = chat_body(&base.model, &prompt, 4);
    dreq["kv_transfer_params"] = kv.clone();
    let d = stream(
        &cl,
        &format!("{}/v1/chat/completions", decode.url()),
        dreq,
        None,
    )
    .await;
    assert!(d.done);
    assert_eq!(d.tokens().len(), 4);
    assert_eq!(d.usage().unwrap()["prompt_tokens"], n_prompt);
    let cold = stream(
        &cl,
        &format!("{}/v1/chat/completions", both.url()),
        chat_body(&base.model, &prompt, 1),
        None,
    )
    .await;
    println!("decode TTFT {:?}, cold TTFT {:?}", d.ttft(), cold.ttft());
    assert!(
        d.ttft() * 3 < cold.ttft(),
        "decode {:?} cold {:?}",
        d.ttft(),
        cold.ttft()
    );

    // Each role refuses the other's half.
    let mut wrong = chat_body(&base.model, "x", 1);
    wrong["kv_transfer_params"] = kv;
    let r = cl
        .post(format!("{}/v1/chat/completions", prefill.url()))
        .json(&wrong)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    wrong["kv_transfer_params"] = json!({"do_remote_decode": true});
    let r = cl
        .post(format!("{}/v1/chat/completions", decode.url()))
        .json(&wrong)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
}

#[tokio::test]
async fn sglang_bootstrap_pair_runs_prefill_and_decode() {
    let base = SimConfig {
        engine: EngineKind::Sglang,
        ..timing_cfg()
    };
    let prefill = sim(SimConfig {
        role: Role::Prefill,
        ..base.clone()
    })
    .await;
    let decode = sim(SimConfig {
        role: Role::Decode,
        ..base.clone()
    })
    .await;
    let cl = client();
    let mut req = chat_body(&base.model, &text("boot", 300), 5);
    req["bootstrap_host"] = json!("127.0.0.1");
    req["bootstrap_port"] = json!(8998);
    req["bootstrap_room"] = json!(12345);
    let (pu, du) = (
        format!("{}/v1/chat/completions", prefill.url()),
        format!("{}/v1/chat/completions", decode.url()),
    );
    let (p, d) = tokio::join!(
        stream(&cl, &pu, req.clone(), None),
        stream(&cl, &du, req.clone(), None),
    );
    assert_eq!(p.tokens().len(), 1);
    assert_eq!(d.tokens().len(), 5);
    // The decode's first token waits for the peer's prefill.
    assert!(
        d.ttft() >= p.ttft() * 3 / 4,
        "decode {:?} prefill {:?}",
        d.ttft(),
        p.ttft()
    );
    req["bootstrap_port"] = json!(null);
    req.as_object_mut().unwrap().remove("bootstrap_port");
    let r = cl
        .post(format!("{}/v1/chat/completions", decode.url()))
        .json(&req)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
}

#[tokio::test]
async fn cli_runs_n_workers_and_prints_ready_lines() {
    use tokio::io::AsyncBufReadExt;
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args([
            "sim",
            "--workers",
            "3",
            "--profile",
            "tiny",
            "--time-scale",
            "10",
            "--worker-model",
            "a,b",
        ])
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn binary");
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let cl = client();
    let mut models = Vec::new();
    for _ in 0..3 {
        let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
            .await
            .expect("ready line in time")
            .unwrap()
            .expect("a line");
        let fields: Vec<&str> = line.split(' ').collect();
        assert_eq!(fields[0], "switchyard-sim");
        assert_eq!(fields[1], "ready");
        let url = fields[2]
            .strip_prefix("url=http://127.0.0.1:")
            .map(|p| format!("http://127.0.0.1:{p}"))
            .expect("url");
        assert_eq!(fields[4], "engine=vllm");
        assert_eq!(fields[5], "role=both");
        let m: Value = cl
            .get(format!("{url}/v1/models"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(
            fields[3],
            format!("model={}", m["data"][0]["id"].as_str().unwrap())
        );
        models.push(m["data"][0]["id"].as_str().unwrap().to_string());
    }
    assert_eq!(models, vec!["a", "b", "a"]);
    child.kill().await.unwrap();
}

// ------------------------------------------------------------ Responses API

/// Prompt tokens of a chat conversation, as the engine reports them.
async fn chat_prompt_tokens(cl: &reqwest::Client, base: &str, messages: Value) -> u64 {
    let (st, v) = post_json(
        cl,
        &format!("{base}/v1/chat/completions"),
        &json!({"messages": messages, "max_tokens": 1}),
    )
    .await;
    assert_eq!(st, 200, "{v}");
    v["usage"]["prompt_tokens"].as_u64().unwrap()
}

#[tokio::test]
async fn responses_non_streamed_shape_and_usage() {
    let c = cfg();
    let h = sim(c.clone()).await;
    let cl = client();
    let url = format!("{}/v1/responses", h.url());
    let question = text("responses", 60);
    let body = json!({
        "model": c.model, "instructions": "Answer briefly.", "max_output_tokens": 5,
        "ignore_eos": true,
        "input": [{"type": "message", "role": "user",
                   "content": [{"type": "input_text", "text": question}]}],
    });
    let (st, r) = post_json(&cl, &url, &body).await;
    assert_eq!(st, 200, "{r}");
    assert_eq!(r["object"], "response");
    assert!(r["id"].as_str().unwrap().starts_with("resp_"));
    assert!(r["created_at"].as_u64().unwrap() > 0);
    assert_eq!(r["status"], "completed");
    assert_eq!(r["model"], c.model);
    assert_eq!(r["instructions"], "Answer briefly.");
    assert_eq!(r["max_output_tokens"], 5);
    let out = r["output"].as_array().unwrap();
    assert_eq!(out.len(), 1);
    let msg = &out[0];
    assert_eq!(msg["type"], "message");
    assert!(msg["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(msg["status"], "completed");
    assert_eq!(msg["role"], "assistant");
    let part = &msg["content"][0];
    assert_eq!(part["type"], "output_text");
    assert_eq!(part["annotations"], json!([]));
    let answer = part["text"].as_str().unwrap();
    assert_eq!(switchyard::sim::tokenizer::count(answer), 5);

    // The input is the same conversation as the equivalent chat request.
    let p = chat_prompt_tokens(
        &cl,
        &h.url(),
        json!([{"role": "system", "content": "Answer briefly."},
               {"role": "user", "content": question}]),
    )
    .await;
    let u = &r["usage"];
    assert_eq!(
        *u,
        json!({"input_tokens": p, "input_tokens_details": {"cached_tokens": 0},
               "output_tokens": 5, "output_tokens_details": {"reasoning_tokens": 0},
               "total_tokens": p + 5})
    );
    // Asked again (input as a plain string this time), the prompt is cached.
    let again = json!({"model": c.model, "instructions": "Answer briefly.", "input": question,
                       "max_output_tokens": 2});
    let (_, r2) = post_json(&cl, &url, &again).await;
    assert_eq!(r2["usage"]["input_tokens"], p);
    assert_eq!(
        r2["usage"]["input_tokens_details"]["cached_tokens"],
        (p - 1) / c.block_size as u64 * c.block_size as u64
    );
    let m = metrics(&cl, &h.url()).await;
    assert_eq!(
        metric(&m, "vllm:generation_tokens_total", ""),
        Some(5.0 + 1.0 + 2.0)
    );

    // Errors keep OpenAI's shape.
    for (bad, status) in [
        (json!({"model": c.model}), 400),
        (json!({"model": c.model, "input": []}), 400),
        (
            json!({"model": c.model, "input": "x", "max_output_tokens": 0}),
            400,
        ),
        (
            json!({"model": c.model, "input": [{"type": "web_search_call"}]}),
            400,
        ),
        (
            json!({"model": c.model, "input": "x", "previous_response_id": "resp_1"}),
            404,
        ),
        (json!({"model": "nope", "input": "x"}), 404),
    ] {
        let (st, e) = post_json(&cl, &url, &bad).await;
        assert_eq!(st, status, "{bad} -> {e}");
        assert_eq!(e["error"]["code"], status, "{e}");
    }
}

#[tokio::test]
async fn responses_stream_events_in_order() {
    let c = cfg();
    let h = sim(c.clone()).await;
    let cl = client();
    let body = json!({"model": c.model, "input": "Tell me a story", "max_output_tokens": 6,
                      "ignore_eos": true, "stream": true});
    let r = stream(&cl, &format!("{}/v1/responses", h.url()), body, None).await;
    assert_eq!(r.status, 200);
    assert!(!r.broken);
    assert!(!r.done, "the Responses API sends no [DONE]");
    let mut expected = vec![
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ];
    expected.extend(["response.output_text.delta"; 6]);
    expected.extend([
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]);
    assert_eq!(r.names, expected);
    for (i, (e, name)) in r.events.iter().zip(&r.names).enumerate() {
        assert_eq!(e["type"], name.as_str(), "data type matches the event line");
        assert_eq!(e["sequence_number"], i, "{e}");
    }
    let created = &r.events[0]["response"];
    assert_eq!(created["status"], "in_progress");
    assert_eq!(created["output"], json!([]));
    let id = created["id"].as_str().unwrap();
    assert!(id.starts_with("resp_"));
    let added = &r.events[2]["item"];
    assert_eq!(added["type"], "message");
    assert_eq!(added["status"], "in_progress");
    let item_id = added["id"].as_str().unwrap();
    assert_eq!(r.events[3]["part"]["text"], "");
    let deltas: String = r.events[4..10]
        .iter()
        .map(|e| {
            assert_eq!(e["item_id"], item_id);
            assert_eq!(
                (e["output_index"].as_u64(), e["content_index"].as_u64()),
                (Some(0), Some(0))
            );
            e["delta"].as_str().unwrap().to_string()
        })
        .collect();
    assert_eq!(r.events[10]["text"], deltas.as_str());
    assert_eq!(r.events[11]["part"]["text"], deltas.as_str());
    let done_item = &r.events[12]["item"];
    assert_eq!(done_item["id"], item_id);
    assert_eq!(done_item["status"], "completed");
    let fin = &r.events[13]["response"];
    assert_eq!(fin["id"], id);
    assert_eq!(fin["status"], "completed");
    assert_eq!(fin["output"][0]["content"][0]["text"], deltas.as_str());
    let u = &fin["usage"];
    assert_eq!(u["output_tokens"], 6);
    assert_eq!(
        u["total_tokens"].as_u64(),
        Some(u["input_tokens"].as_u64().unwrap() + 6)
    );
    assert_eq!(u["input_tokens_details"]["cached_tokens"], 0);
}

// ------------------------------------------------------------ n > 1

#[tokio::test]
async fn n_choices_are_generated_and_counted() {
    let c = SimConfig {
        step_base_ms: 10.0,
        ..cfg()
    };
    let h = sim(c.clone()).await;
    let cl = client();
    let url = format!("{}/v1/chat/completions", h.url());
    let body = json!({"model": c.model, "messages": [{"role": "user", "content": "Name three rivers"}],
                      "n": 3, "max_tokens": 4, "ignore_eos": true});
    let (st, v) = post_json(&cl, &url, &body).await;
    assert_eq!(st, 200, "{v}");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    let mut texts = Vec::new();
    for (i, ch) in choices.iter().enumerate() {
        assert_eq!(ch["index"], i);
        assert_eq!(ch["finish_reason"], "length");
        let t = ch["message"]["content"].as_str().unwrap();
        assert_eq!(switchyard::sim::tokenizer::count(t), 4);
        texts.push(t.to_string());
    }
    texts.sort();
    texts.dedup();
    assert_eq!(texts.len(), 3, "each choice is sampled on its own");
    let p = v["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 12);
    assert_eq!(v["usage"]["total_tokens"], p + 12);
    let m = metrics(&cl, &h.url()).await;
    assert_eq!(metric(&m, "vllm:generation_tokens_total", ""), Some(12.0));
    assert_eq!(
        metric(
            &m,
            "vllm:request_success_total",
            "finished_reason=\"length\""
        ),
        Some(3.0)
    );
    // Choice 0 is what a lone request would have produced.
    let mut one = body.clone();
    one["n"] = json!(1);
    let (_, v1) = post_json(&cl, &url, &one).await;
    assert_eq!(
        v1["choices"][0]["message"]["content"],
        choices[0]["message"]["content"]
    );

    // The batch holds one sequence per choice while they run.
    let long = json!({"model": c.model, "messages": [{"role": "user", "content": "A long one"}],
                      "n": 3, "max_tokens": 150, "ignore_eos": true});
    let task = tokio::spawn({
        let (cl, url) = (cl.clone(), url.clone());
        async move { post_json(&cl, &url, &long).await }
    });
    wait_metrics(&cl, &h.url(), "3 running sequences", |m| {
        metric(m, "vllm:num_requests_running", "") == Some(3.0)
    })
    .await;
    let (st, v) = task.await.unwrap();
    assert_eq!(st, 200);
    assert_eq!(v["usage"]["completion_tokens"], 450);

    // Completions: best_of sequences generated, the first n returned, all billed.
    let (st, v) = post_json(
        &cl,
        &format!("{}/v1/completions", h.url()),
        &json!({"model": c.model, "prompt": "Once upon a time", "n": 2, "best_of": 3,
                "max_tokens": 3, "ignore_eos": true}),
    )
    .await;
    assert_eq!(st, 200, "{v}");
    let idx: Vec<u64> = v["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["index"].as_u64().unwrap())
        .collect();
    assert_eq!(idx, vec![0, 1]);
    assert_eq!(v["usage"]["completion_tokens"], 9);
}

#[tokio::test]
async fn n_siblings_share_one_prompt_prefill() {
    let c = cfg();
    let h = sim(c.clone()).await;
    let cl = client();
    let body = json!({"model": c.model, "prompt": text("siblings", 200), "n": 4,
                      "max_tokens": 2, "ignore_eos": true});
    let (st, v) = post_json(&cl, &format!("{}/v1/completions", h.url()), &body).await;
    assert_eq!(st, 200, "{v}");
    let p = v["usage"]["prompt_tokens"].as_u64().unwrap();
    // The usage reports the first sequence's hits: none on a cold cache.
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    // The three siblings found the first one's prompt blocks.
    let m = metrics(&cl, &h.url()).await;
    let hit = (p - 1) / c.block_size as u64 * c.block_size as u64;
    assert_eq!(
        metric(&m, "vllm:prefix_cache_hits_total", ""),
        Some((3 * hit) as f64)
    );
    assert_eq!(
        metric(&m, "vllm:prefix_cache_queries_total", ""),
        Some((4 * p) as f64)
    );
}

#[tokio::test]
async fn streamed_n_interleaves_choices_each_with_its_finish() {
    let c = cfg();
    let h = sim(c.clone()).await;
    let cl = client();
    let mut body = chat_body(&c.model, "Two answers please", 5);
    body["n"] = json!(2);
    let r = stream(&cl, &format!("{}/v1/chat/completions", h.url()), body, None).await;
    assert!(r.done && !r.broken);
    for i in 0..2u64 {
        let mine: Vec<&Value> = r
            .events
            .iter()
            .filter_map(|e| e["choices"].get(0))
            .filter(|ch| ch["index"] == i)
            .collect();
        assert_eq!(
            mine[0]["delta"],
            json!({"role": "assistant", "content": ""}),
            "choice {i} starts with the role"
        );
        let tokens = mine[1..]
            .iter()
            .filter(|ch| {
                ch["delta"]["content"]
                    .as_str()
                    .is_some_and(|t| !t.is_empty())
            })
            .count();
        assert_eq!(tokens, 5, "choice {i}");
        let finishes: Vec<&Value> = mine
            .iter()
            .map(|ch| &ch["finish_reason"])
            .filter(|f| !f.is_null())
            .collect();
        assert_eq!(finishes, vec!["length"], "choice {i}");
        assert_eq!(mine.last().unwrap()["finish_reason"], "length");
    }
    // The two choices advance together, step by step.
    let order: Vec<u64> = r
        .events
        .iter()
        .filter_map(|e| e["choices"].get(0)?["index"].as_u64())
        .collect();
    let first_1 = order.iter().position(|&i| i == 1).unwrap();
    let last_0 = order.iter().rposition(|&i| i == 0).unwrap();
    assert!(first_1 < last_0, "interleaved: {order:?}");
    let u = r.usage().unwrap();
    assert_eq!(u["completion_tokens"], 10);

    // Completions stream the same way, without role chunks.
    let body = json!({"model": c.model, "prompt": "Hello", "n": 2, "max_tokens": 3,
                      "ignore_eos": true, "stream": true});
    let r = stream(&cl, &format!("{}/v1/completions", h.url()), body, None).await;
    assert!(r.done);
    for i in 0..2u64 {
        let mine: Vec<&Value> = r
            .events
            .iter()
            .filter_map(|e| e["choices"].get(0))
            .filter(|ch| ch["index"] == i)
            .collect();
        assert_eq!(mine.len(), 3);
        assert_eq!(mine[2]["finish_reason"], "length");
    }
}

#[tokio::test]
async fn n_out_of_range_is_a_400() {
    let c = cfg();
    let h = sim(c.clone()).await;
    let cl = client();
    let chat = format!("{}/v1/chat/completions", h.url());
    let cmpl = format!("{}/v1/completions", h.url());
    let msgs = json!([{"role": "user", "content": "x"}]);
    for (url, body, param) in [
        (&chat, json!({"messages": msgs, "n": 0}), "n"),
        (&chat, json!({"messages": msgs, "n": -1}), "n"),
        (&chat, json!({"messages": msgs, "n": 129}), "n"),
        (
            &cmpl,
            json!({"prompt": "x", "n": 3, "best_of": 2}),
            "best_of",
        ),
        (
            &cmpl,
            json!({"prompt": "x", "n": 1, "best_of": 200}),
            "best_of",
        ),
        (
            &cmpl,
            json!({"prompt": "x", "n": 1, "best_of": 2, "stream": true}),
            "best_of",
        ),
    ] {
        let (st, e) = post_json(&cl, url, &body).await;
        assert_eq!(st, 400, "{body}");
        assert_eq!(e["error"]["type"], "BadRequestError");
        assert_eq!(e["error"]["code"], 400);
        assert_eq!(e["error"]["param"], param, "{e}");
        assert!(e["error"]["message"].is_string());
    }
    // Not with prefill/decode disaggregation.
    let (st, _) = post_json(
        &cl,
        &chat,
        &json!({"messages": msgs, "n": 2, "kv_transfer_params": {"do_remote_decode": true}}),
    )
    .await;
    assert_eq!(st, 400);
    assert_eq!(
        metric(
            &metrics(&cl, &h.url()).await,
            "vllm:generation_tokens_total",
            ""
        ),
        Some(0.0)
    );
}

// ------------------------------------------------------------ tool calls

fn weather_tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Current weather",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer", "minimum": 1},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "verbose": {"type": "boolean"}},
            "required": ["city", "days", "unit"]}}},
        {"type": "function", "function": {"name": "get_time",
            "parameters": {"type": "object", "properties": {"zone": {"type": "string"}},
                           "required": ["zone"]}}}
    ])
}

/// The JSON object in `arguments`, checked to hold exactly `keys`.
fn check_arguments(arguments: &str, keys: &[&str]) -> Value {
    let args: Value = serde_json::from_str(arguments).expect("arguments are JSON");
    let mut got: Vec<&str> = args
        .as_object()
        .expect("an object")
        .keys()
        .map(String::as_str)
        .collect();
    got.sort();
    assert_eq!(got, keys, "{arguments}");
    args
}

#[tokio::test]
async fn tool_choice_required_answers_with_a_tool_call() {
    let c = cfg();
    let h = sim(c.clone()).await;
    let cl = client();
    let url = format!("{}/v1/chat/completions", h.url());
    let question = json!({"role": "user", "content": "What is the weather in Paris?"});
    let body = json!({"model": c.model, "messages": [question], "tools": weather_tools(),
                      "tool_choice": "required"});
    let (st, v) = post_json(&cl, &url, &body).await;
    assert_eq!(st, 200, "{v}");
    let ch = &v["choices"][0];
    assert_eq!(ch["finish_reason"], "tool_calls");
    assert_eq!(ch["message"]["content"], Value::Null);
    let call = &ch["message"]["tool_calls"][0];
    assert!(call["id"].as_str().unwrap().starts_with("call_"));
    assert_eq!(call["type"], "function");
    assert_eq!(call["function"]["name"], "get_weather");
    let arguments = call["function"]["arguments"].as_str().unwrap();
    let args = check_arguments(arguments, &["city", "days", "unit"]);
    assert!(args["city"].is_string() && args["days"].as_i64() >= Some(1));
    assert_eq!(args["unit"], "celsius");
    // The arguments are what the engine generated, token by token.
    let a = switchyard::sim::tokenizer::count(arguments) as u64;
    assert_eq!(v["usage"]["completion_tokens"], a);
    // Deterministic: asked again, the same call.
    let (_, v2) = post_json(&cl, &url, &body).await;
    assert_eq!(
        v2["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"],
        arguments
    );

    // The next turn carries the call and its result: the call's tokens are
    // in the prefix cache.
    let p1 = v["usage"]["prompt_tokens"].as_u64().unwrap();
    let turn2 = json!({"model": c.model, "tools": weather_tools(), "max_tokens": 3, "messages": [
        question,
        {"role": "assistant", "content": null, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "{\"temp\": 21}"},
    ]});
    let (st, v3) = post_json(&cl, &url, &turn2).await;
    assert_eq!(st, 200, "{v3}");
    assert!(
        v3["choices"][0]["message"]["content"].is_string(),
        "no tool_choice: text"
    );
    let bs = c.block_size as u64;
    assert_eq!(
        v3["usage"]["prompt_tokens_details"]["cached_tokens"],
        (p1 + a - 1) / bs * bs,
        "prompt and generated arguments (all but the last token) cached"
    );

    // A named function is called even when another one comes first.
    let named = json!({"model": c.model, "messages": [question], "tools": weather_tools(),
                       "tool_choice": {"type": "function", "function": {"name": "get_time"}}});
    let (_, v) = post_json(&cl, &url, &named).await;
    let call = &v["choices"][0]["message"]["tool_calls"][0];
    assert_eq!(call["function"]["name"], "get_time");
    check_arguments(call["function"]["arguments"].as_str().unwrap(), &["zone"]);

    // "auto" (or no tool_choice) answers with text, as before.
    for choice in [json!("auto"), Value::Null] {
        let body = json!({"model": c.model, "messages": [question], "tools": weather_tools(),
                          "tool_choice": choice, "max_tokens": 3});
        let (_, v) = post_json(&cl, &url, &body).await;
        assert_eq!(v["choices"][0]["message"]["tool_calls"], json!([]));
        assert!(v["choices"][0]["message"]["content"].is_string());
    }
    // A forced choice that cannot be honoured is a 400.
    for body in [
        json!({"messages": [question], "tool_choice": "required"}),
        json!({"messages": [question], "tools": weather_tools(),
               "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
        json!({"messages": [question], "tools": weather_tools(), "tool_choice": "always"}),
    ] {
        let (st, e) = post_json(&cl, &url, &body).await;
        assert_eq!(st, 400, "{body} -> {e}");
        assert_eq!(e["error"]["type"], "BadRequestError");
    }
}

#[tokio::test]
async fn streamed_tool_call_sends_fragments_then_tool_calls() {
    let c = cfg();
    let h = sim(c.clone()).await;
    let cl = client();
    let body = json!({"model": c.model, "stream": true, "stream_options": {"include_usage": true},
                      "messages": [{"role": "user", "content": "Weather?"}],
                      "tools": weather_tools(), "tool_choice": "required"});
    let r = stream(&cl, &format!("{}/v1/chat/completions", h.url()), body, None).await;
    assert!(r.done && !r.broken);
    let choices: Vec<&Value> = r
        .events
        .iter()
        .filter_map(|e| e["choices"].get(0))
        .collect();
    assert_eq!(
        choices[0]["delta"],
        json!({"role": "assistant", "content": ""})
    );
    let head = &choices[1]["delta"]["tool_calls"][0];
    assert_eq!(head["index"], 0);
    assert!(head["id"].as_str().unwrap().starts_with("call_"));
    assert_eq!(head["type"], "function");
    assert_eq!(
        head["function"],
        json!({"name": "get_weather", "arguments": ""})
    );
    let fragments = &choices[2..];
    let mut arguments = String::new();
    for (k, ch) in fragments.iter().enumerate() {
        let tc = &ch["delta"]["tool_calls"][0];
        assert_eq!(tc["index"], 0);
        assert!(
            tc.get("id").is_none(),
            "only the first chunk names the call"
        );
        arguments.push_str(tc["function"]["arguments"].as_str().unwrap());
        let fin = &ch["finish_reason"];
        if k + 1 == fragments.len() {
            assert_eq!(fin, "tool_calls");
        } else {
            assert!(fin.is_null());
        }
    }
    check_arguments(&arguments, &["city", "days", "unit"]);
    assert_eq!(
        r.usage().unwrap()["completion_tokens"],
        fragments.len(),
        "one fragment per generated token"
    );
}

#[tokio::test]
async fn responses_api_forced_function_call() {
    let c = cfg();
    let h = sim(c.clone()).await;
    let cl = client();
    let url = format!("{}/v1/responses", h.url());
    let tools = json!([{"type": "function", "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]);
    let body = json!({"model": c.model, "input": "Weather in Paris?", "tools": tools,
                      "tool_choice": "required"});
    let (st, v) = post_json(&cl, &url, &body).await;
    assert_eq!(st, 200, "{v}");
    let item = &v["output"][0];
    assert_eq!(item["type"], "function_call");
    assert_eq!(item["name"], "get_weather");
    assert_eq!(item["status"], "completed");
    assert!(item["call_id"].as_str().unwrap().starts_with("call_"));
    let arguments = item["arguments"].as_str().unwrap();
    check_arguments(arguments, &["city"]);
    assert_eq!(v["tool_choice"], "required");
    assert_eq!(
        v["usage"]["output_tokens"],
        switchyard::sim::tokenizer::count(arguments)
    );

    let mut body = body;
    body["stream"] = json!(true);
    body["tool_choice"] = json!({"type": "function", "name": "get_weather"});
    let r = stream(&cl, &url, body, None).await;
    let n = r.names.len();
    assert_eq!(r.names[2], "response.output_item.added");
    assert_eq!(r.events[2]["item"]["type"], "function_call");
    assert!(r.names[3..n - 3]
        .iter()
        .all(|t| t == "response.function_call_arguments.delta"));
    assert_eq!(
        r.names[n - 3..],
        [
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.completed"
        ]
    );
    let streamed: String = r.events[3..n - 3]
        .iter()
        .map(|e| e["delta"].as_str().unwrap())
        .collect();
    assert_eq!(streamed, arguments);
    assert_eq!(r.events[n - 3]["arguments"], arguments);
    assert_eq!(
        r.events[n - 1]["response"]["output"][0]["arguments"],
        arguments
    );
}
