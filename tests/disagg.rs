//! Prefill/decode disaggregation against simulated prefill and decode workers.

mod support;

use serde_json::json;
use support::scripted::Scripted;
use support::*;
use switchyard::sim::{self, EngineKind, Faults, Role, SimConfig, SimHandle};
use switchyard::telemetry::names;

async fn worker(role: Role, engine: EngineKind) -> SimHandle {
    sim::spawn(SimConfig {
        role,
        engine,
        time_scale: 20.0,
        ..SimConfig::profile("tiny").unwrap()
    })
    .await
    .unwrap()
}

fn pd_toml(name: &str, mode: &str, workers: &[(&str, &str)], extra: &str) -> String {
    let ws: Vec<String> = workers
        .iter()
        .map(|(url, role)| format!("{{ url = \"{url}\", labels = {{ role = \"{role}\" }} }}"))
        .collect();
    format!(
        "[[pools]]\nname = \"{name}\"\nmodels = [\"{}\"]\n{extra}\nworkers = [{}]\n[pools.disaggregation]\nmode = \"{mode}\"\nmin_uncached_tokens = 200\n",
        sim_model(),
        ws.join(", ")
    )
}

fn long_chat(stream: bool, max_tokens: u32) -> serde_json::Value {
    json!({"model": sim_model(), "stream": stream, "max_tokens": max_tokens,
           "stream_options": {"include_usage": true},
           "messages": [{"role": "system", "content": "a long shared document ".repeat(200)},
                        {"role": "user", "content": "summarise"}]})
}

#[tokio::test]
async fn vllm_decode_worker_receives_the_prefill_workers_transfer_params() {
    let prefill = worker(Role::Prefill, EngineKind::Vllm).await;
    let (decode, tx) = Scripted::start().await;
    drop(tx);
    let gw = gateway(&pd_toml(
        "pd-params",
        "vllm",
        &[(&prefill.url(), "prefill"), (&decode.url, "decode")],
        "",
    ))
    .await;
    let r = client()
        .post(format!("{}/v1/chat/completions", gw.url()))
        .json(&long_chat(false, 5))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let bodies = decode.recorded.lock().unwrap().bodies.clone();
    assert_eq!(bodies.len(), 1);
    let kv = &bodies[0]["kv_transfer_params"];
    assert_eq!(kv["do_remote_prefill"], true, "{kv}");
    assert_eq!(kv["remote_port"], prefill.addr().port());
    assert!(!kv["remote_block_ids"].as_array().unwrap().is_empty());
    // The decode leg carries the client's own max_tokens and stream flag.
    assert_eq!(bodies[0]["max_tokens"], 5);
    assert_eq!(prefill.requests_received(), 1);
    gw.shutdown().await;
}

#[tokio::test]
async fn vllm_style_streams_through_both_legs() {
    let prefill = worker(Role::Prefill, EngineKind::Vllm).await;
    let decode = worker(Role::Decode, EngineKind::Vllm).await;
    let gw = gateway(&pd_toml(
        "pd-stream",
        "vllm",
        &[(&prefill.url(), "prefill"), (&decode.url(), "decode")],
        "",
    ))
    .await;
    let (status, text) = stream_text(&gw.url(), long_chat(true, 6)).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(text.matches("\"content\":\"").count() - 1, 6, "{text}");
    assert!(text.ends_with("data: [DONE]\n\n"));
    assert_eq!(
        (prefill.requests_received(), decode.requests_received()),
        (1, 1)
    );
    // A short prompt skips disaggregation: the decode worker does everything.
    let (status, _) = stream_text(
        &gw.url(),
        json!({"model": sim_model(), "stream": true, "max_tokens": 3,
               "messages": [{"role":"user","content":"hi"}]}),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(
        (prefill.requests_received(), decode.requests_received()),
        (1, 2)
    );
    let m = scrape(&gw.url()).await;
    let pool = [("pool", "pd-stream")];
    let with = |k: &'static str, v: &'static str| [pool[0], (k, v)];
    assert_eq!(
        metric_sum(
            &m,
            names::DISAGG_DECISIONS_TOTAL,
            &with("reason", "few_uncached_tokens")
        ),
        1.0
    );
    assert_eq!(
        metric_sum(
            &m,
            names::DISAGG_DECISIONS_TOTAL,
            &with("reason", "disaggregated")
        ),
        1.0
    );
    assert_eq!(
        metric_sum(
            &m,
            &format!("{}_count", names::DISAGG_LEG_SECONDS),
            &with("leg", "prefill")
        ),
        1.0
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn failed_legs_are_retried_with_a_fresh_pair() {
    let bad_prefill = worker(Role::Prefill, EngineKind::Vllm).await;
    bad_prefill.set_faults(Faults {
        error_rate: 1.0,
        error_status: 500,
        ..Default::default()
    });
    let good_prefill = worker(Role::Prefill, EngineKind::Vllm).await;
    let dead_decode = worker(Role::Decode, EngineKind::Vllm).await;
    dead_decode.kill();
    let decode = worker(Role::Decode, EngineKind::Vllm).await;
    let gw = gateway(&format!(
        "[health]\ninterval_ms = 0\n{}",
        pd_toml(
            "pd-retry",
            "vllm",
            &[
                (&bad_prefill.url(), "prefill"),
                (&good_prefill.url(), "prefill"),
                (&dead_decode.url(), "decode"),
                (&decode.url(), "decode"),
            ],
            "max_attempts = 4",
        )
    ))
    .await;
    // Keep the live decode worker busier, so the dead one is chosen first.
    let snap = gw.gateway.registry.snapshot();
    let live = snap.workers().find(|w| *w.id == decode.url()).unwrap();
    let busy = live.begin(None, Default::default());
    for _ in 0..4 {
        let r = client()
            .post(format!("{}/v1/chat/completions", gw.url()))
            .json(&long_chat(false, 4))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let v: serde_json::Value = r.json().await.unwrap();
        assert_eq!(v["usage"]["completion_tokens"], 4);
    }
    drop(busy);
    assert_eq!(decode.requests_received(), 4);
    let m = scrape(&gw.url()).await;
    let p = ("pool", "pd-retry");
    assert!(
        metric_sum(
            &m,
            names::DISAGG_LEG_FAILURES_TOTAL,
            &[p, ("leg", "prefill")]
        ) >= 1.0
    );
    assert!(
        metric_sum(
            &m,
            names::DISAGG_LEG_FAILURES_TOTAL,
            &[p, ("leg", "decode")]
        ) >= 1.0
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn no_prefill_worker_means_the_decode_worker_does_everything() {
    let prefill = worker(Role::Prefill, EngineKind::Vllm).await;
    let decode = worker(Role::Decode, EngineKind::Vllm).await;
    let gw = gateway(&pd_toml(
        "pd-noprefill",
        "vllm",
        &[(&prefill.url(), "prefill"), (&decode.url(), "decode")],
        "",
    ))
    .await;
    for w in gw.gateway.registry.snapshot().workers() {
        if w.role == switchyard::pool::Role::Prefill {
            w.state
                .draining
                .store(true, std::sync::atomic::Ordering::Relaxed);
        }
    }
    let (status, text) = stream_text(&gw.url(), long_chat(true, 3)).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(
        (prefill.requests_received(), decode.requests_received()),
        (0, 1)
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn sglang_style_sends_both_legs_at_once_with_a_bootstrap_room() {
    let prefill = worker(Role::Prefill, EngineKind::Sglang).await;
    let (decode, tx) = Scripted::start().await;
    let gw = gateway(&pd_toml(
        "pd-sglang",
        "sglang",
        &[(&prefill.url(), "prefill"), (&decode.url, "decode")],
        "",
    ))
    .await;
    let url = gw.url();
    let req = tokio::spawn(async move { stream_text(&url, long_chat(true, 2)).await });
    tx.send(r#"{"choices":[{"index":0,"delta":{"content":"x"}}]}"#.into())
        .unwrap();
    tx.send("[DONE]".into()).unwrap();
    drop(tx);
    let (status, text) = req.await.unwrap();
    assert_eq!(status, 200);
    assert!(text.contains("\"content\":\"x\""), "{text}");
    let body = decode.recorded.lock().unwrap().bodies[0].clone();
    assert_eq!(body["bootstrap_host"], "127.0.0.1");
    assert!(body["bootstrap_room"].as_u64().unwrap() < (1u64 << 63));
    assert_eq!(prefill.requests_received(), 1);
    gw.shutdown().await;
}

#[tokio::test]
async fn a_prompt_the_prefill_worker_already_caches_skips_disaggregation() {
    let prefill = worker(Role::Prefill, EngineKind::Vllm).await;
    let decode = worker(Role::Decode, EngineKind::Vllm).await;
    let gw = gateway(
        &pd_toml(
            "pd-cached",
            "vllm",
            &[(&prefill.url(), "prefill"), (&decode.url(), "decode")],
            "policy = \"prefix\"",
        )
        .replace("min_uncached_tokens = 200", "min_uncached_tokens = 400"),
    )
    .await;
    // ~1,200 estimated prompt tokens: disaggregated the first time.
    let (status, _) = stream_text(&gw.url(), long_chat(true, 2)).await;
    assert_eq!(status, 200);
    assert_eq!(prefill.requests_received(), 1);
    // The same prompt again: the index predicts it cached on the prefill worker, so
    // the uncached part is below the threshold and the decode worker does it all.
    let (status, _) = stream_text(&gw.url(), long_chat(true, 2)).await;
    assert_eq!(status, 200);
    assert_eq!(prefill.requests_received(), 1, "no second prefill leg");
    assert_eq!(decode.requests_received(), 2);
    let m = scrape(&gw.url()).await;
    assert_eq!(
        metric_sum(
            &m,
            names::DISAGG_DECISIONS_TOTAL,
            &[("pool", "pd-cached"), ("reason", "few_uncached_tokens")]
        ),
        1.0
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn translated_anthropic_messages_take_both_legs() {
    let prefill = worker(Role::Prefill, EngineKind::Vllm).await;
    let decode = worker(Role::Decode, EngineKind::Vllm).await;
    let gw = gateway(&pd_toml(
        "pd-messages",
        "vllm",
        &[(&prefill.url(), "prefill"), (&decode.url(), "decode")],
        "anthropic = \"translate\"",
    ))
    .await;
    let body = json!({"model": sim_model(), "stream": true, "max_tokens": 6,
                      "system": "a long shared document ".repeat(200),
                      "messages": [{"role": "user", "content": "summarise"}]});
    let r = client()
        .post(format!("{}/v1/messages", gw.url()))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    assert!(text.contains("event: content_block_delta"), "{text}");
    assert!(
        text.trim_end()
            .ends_with("data: {\"type\":\"message_stop\"}"),
        "{text}"
    );
    assert_eq!(prefill.requests_received(), 1);
    assert_eq!(decode.requests_received(), 1);
    gw.shutdown().await;
}

/// A simulated vLLM-style engine in `role`, with its own step and prefill costs.
async fn timed(role: Role, step_base_ms: f64, per_prefill_token_ms: f64) -> SimHandle {
    sim::spawn(SimConfig {
        role,
        engine: EngineKind::Vllm,
        step_base_ms,
        per_prefill_token_ms,
        ..SimConfig::profile("tiny").unwrap()
    })
    .await
    .unwrap()
}

/// A streamed long chat (its prompt unique to `tag`, so no cache helps) with
/// `slo_ms` as its TTFT objective: status, route header, body.
async fn chat_with_slo(base: &str, tag: &str, slo_ms: Option<&str>) -> (u16, String, String) {
    let mut body = long_chat(true, 2);
    body["messages"][0]["content"] = format!("{tag} {}", "a long document ".repeat(60)).into();
    let mut req = client()
        .post(format!("{base}/v1/chat/completions"))
        .json(&body);
    if let Some(ms) = slo_ms {
        req = req.header("x-slo-ttft-ms", ms);
    }
    let r = req.send().await.unwrap();
    let status = r.status().as_u16();
    let route = r
        .headers()
        .get("x-switchyard-route")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    (status, route, r.text().await.unwrap())
}

/// Latency objectives over (prefill, decode) pairs: once the workers' models
/// have learnt (the prefill workers from their legs, the decode worker from its
/// first tokens after the hand-off), a tight TTFT objective takes the pair with
/// the fast prefill worker whatever the prefill policy would pick, and an
/// unattainable one is shed.
#[tokio::test]
async fn latency_objectives_choose_the_prefill_decode_pair() {
    let fast = timed(Role::Prefill, 2.0, 0.01).await;
    let slow = timed(Role::Prefill, 150.0, 0.3).await;
    let decode = timed(Role::Decode, 2.0, 0.01).await;
    let (f, s, d) = (fast.url(), slow.url(), decode.url());
    let toml = format!(
        "[server]\ndebug_headers = true\n[tenancy]\nanonymous_allow_slo_headers = true\n\n[[pools]]\nname = \"pd-slo\"\nmodels = [\"{}\"]\n\
         policy = \"least_queue\"\nworkers = [{{ url = \"{f}\", labels = {{ role = \"prefill\" }} }}, \
         {{ url = \"{s}\", labels = {{ role = \"prefill\" }} }}, {{ url = \"{d}\", labels = {{ role = \"decode\" }} }}]\n\
         [pools.routing]\nslo_unattainable = \"shed\"\n\
         [pools.disaggregation]\nmode = \"vllm\"\nmin_uncached_tokens = 200\n",
        sim_model()
    );
    let gw = gateway(&toml).await;
    let base = gw.url();
    // Least queue over the prefill workers (ties broken by each prompt's hash)
    // teaches both models, and the decode worker's, their minimum of samples.
    for i in 0..40 {
        let (st, route, body) = chat_with_slo(&base, &format!("warm {i}"), None).await;
        assert_eq!(st, 200, "{body}");
        assert!(route.contains("reason=pd_decode"), "{route}");
    }
    // The slow prefill worker takes over 150 ms; the fast pair a few ms. Least
    // queue alone would send about half of these to the slow one.
    for i in 0..4 {
        let (st, route, body) = chat_with_slo(&base, &format!("tight {i}"), Some("120")).await;
        assert_eq!(st, 200, "{body}");
        assert!(
            route.ends_with(&format!("prefill={f}")),
            "request {i}: {route}"
        );
    }
    let (st, _, body) = chat_with_slo(&base, "impossible", Some("1")).await;
    assert_eq!(st, 503, "{body}");
    assert!(body.contains("slo_unattainable"), "{body}");
    let m = scrape(&base).await;
    let decisions = |r| {
        metric_sum(
            &m,
            "switchyard_slo_decisions_total",
            &[("pool", "pd-slo"), ("result", r)],
        )
    };
    assert_eq!(decisions("met"), 4.0, "{m}");
    assert_eq!(decisions("shed"), 1.0, "{m}");
    gw.shutdown().await;
}
