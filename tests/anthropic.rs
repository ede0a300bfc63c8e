//! Anthropic's Messages API through the gateway, in both pool modes:
//! `passthrough` (the sims serve `/v1/messages` themselves) and `translate`
//! (the gateway speaks chat completions to the sims and Messages to the
//! client) — whole answers, event streams, tool use, count_tokens, errors in
//! Anthropic's shape, `x-api-key` tenancy, prefix affinity and telemetry.

mod support;

use serde_json::{json, Value};
use support::scripted::Scripted;
use support::*;
use switchyard::telemetry::names;

/// A gateway with one pool over `sims` in `mode`, named `pool`.
async fn gateway_for(
    pool: &str,
    mode: &str,
    s: &[switchyard::sim::SimHandle],
    extra: &str,
) -> switchyard::server::ServerHandle {
    let workers: Vec<String> = s
        .iter()
        .map(|w| format!("{{ url = \"{}\" }}", w.url()))
        .collect();
    gateway(&format!(
        "[server]\ndebug_headers = true\n{extra}\n[[pools]]\nname = \"{pool}\"\nmodels = [\"{}\"]\nanthropic = \"{mode}\"\nworkers = [{}]\n",
        sim_model(),
        workers.join(", ")
    ))
    .await
}

async fn post(url: &str, path: &str, body: &Value, key: Option<&str>) -> reqwest::Response {
    let mut r = client()
        .post(format!("{url}{path}"))
        .header("anthropic-version", "2023-06-01")
        .json(body);
    if let Some(k) = key {
        r = r.header("x-api-key", k);
    }
    r.send().await.unwrap()
}

/// A create-message request.
fn message(stream: bool, max_tokens: u32) -> Value {
    json!({"model": sim_model(), "max_tokens": max_tokens, "stream": stream,
           "system": [{"type": "text", "text": "You are terse."}],
           "messages": [{"role": "user", "content": "Say hello"},
                        {"role": "assistant", "content": [{"type": "text", "text": "Hello"}]},
                        {"role": "user", "content": [{"type": "text", "text": "Again"}]}]})
}

fn weather_tools(stream: bool) -> Value {
    json!({"model": sim_model(), "max_tokens": 64, "stream": stream,
           "tools": [{"name": "get_weather", "description": "Weather in a city",
                      "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                                       "required": ["city"]}}],
           "tool_choice": {"type": "tool", "name": "get_weather"},
           "messages": [{"role": "user", "content": "Weather in Oslo?"}]})
}

/// The (event name, data) pairs of an SSE body.
fn events(text: &str) -> Vec<(String, Value)> {
    text.split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            let mut name = String::new();
            let mut data = Value::Null;
            for line in e.lines() {
                if let Some(n) = line.strip_prefix("event: ") {
                    name = n.to_string();
                } else if let Some(d) = line.strip_prefix("data: ") {
                    data = serde_json::from_str(d).unwrap_or_else(|_| panic!("bad data: {d}"));
                }
            }
            assert_eq!(
                data["type"],
                name.as_str(),
                "event name and type agree: {e}"
            );
            (name, data)
        })
        .collect()
}

fn names_of(ev: &[(String, Value)]) -> Vec<&str> {
    ev.iter().map(|(n, _)| n.as_str()).collect()
}

/// A whole message: text content, a stop reason, usage.
fn check_message(m: &Value, max_tokens: u64) {
    assert_eq!(m["type"], "message", "{m}");
    assert_eq!(m["role"], "assistant");
    assert!(m["id"].as_str().unwrap().starts_with("msg_"), "{m}");
    assert_eq!(m["content"][0]["type"], "text");
    assert!(!m["content"][0]["text"].as_str().unwrap().is_empty());
    assert!(
        ["end_turn", "max_tokens"].contains(&m["stop_reason"].as_str().unwrap()),
        "{m}"
    );
    let u = &m["usage"];
    assert!(
        u["input_tokens"].as_u64().unwrap() + u["cache_read_input_tokens"].as_u64().unwrap_or(0)
            > 0
    );
    let out = u["output_tokens"].as_u64().unwrap();
    assert!(out >= 1 && out <= max_tokens, "{m}");
}

/// A text stream: the full event sequence, deltas that add up.
fn check_text_stream(text: &str) -> u64 {
    let ev = events(text);
    let n = names_of(&ev);
    assert_eq!(n[0], "message_start", "{text}");
    assert_eq!(n[n.len() - 1], "message_stop");
    assert_eq!(n[n.len() - 2], "message_delta");
    assert_eq!(n[n.len() - 3], "content_block_stop");
    assert!(n.contains(&"content_block_start"));
    let deltas: Vec<&Value> = ev
        .iter()
        .filter(|(n, _)| n == "content_block_delta")
        .map(|(_, d)| d)
        .collect();
    assert!(!deltas.is_empty());
    assert!(deltas.iter().all(|d| d["delta"]["type"] == "text_delta"));
    let md = &ev[n.len() - 2].1;
    assert!(md["delta"]["stop_reason"].is_string());
    md["usage"]["output_tokens"].as_u64().unwrap()
}

#[tokio::test]
async fn passthrough_serves_messages_from_the_engine() {
    let s = sims(1, 20.0).await;
    let gw = gateway_for("anth-pass", "passthrough", &s, "").await;
    let url = gw.url();
    let r = post(&url, "/v1/messages", &message(false, 8), None).await;
    assert_eq!(r.status(), 200);
    check_message(&r.json().await.unwrap(), 8);

    let r = post(&url, "/v1/messages", &message(true, 6), None).await;
    assert!(r.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let out = check_text_stream(&r.text().await.unwrap());
    assert!((1..=6).contains(&out));

    // Tool use, forced: the engine's own tool_use block and input_json deltas.
    let r = post(&url, "/v1/messages", &weather_tools(false), None).await;
    let m: Value = r.json().await.unwrap();
    assert_eq!(m["stop_reason"], "tool_use", "{m}");
    assert_eq!(m["content"][0]["name"], "get_weather");
    assert!(
        m["content"][0]["id"]
            .as_str()
            .unwrap()
            .starts_with("toolu_"),
        "the sim's own Messages API answered: {m}"
    );
    assert!(m["content"][0]["input"]["city"].is_string(), "{m}");

    let r = post(&url, "/v1/messages/count_tokens", &json!({"model": sim_model(), "messages": [{"role": "user", "content": "count these words please"}]}), None).await;
    assert_eq!(r.status(), 200);
    let c: Value = r.json().await.unwrap();
    assert!(c["input_tokens"].as_u64().unwrap() > 0, "{c}");

    // Telemetry from Messages events: TTFT, ITL and the engine's usage.
    let text = scrape(&url).await;
    let worker = [("worker", s[0].url())];
    let w: Vec<(&str, &str)> = worker.iter().map(|(k, v)| (*k, v.as_str())).collect();
    assert!(
        metric_sum(&text, names::TTFT_SECONDS, &w) >= 1.0,
        "TTFT from content_block_delta"
    );
    assert!(
        metric_sum(&text, names::ITL_SECONDS, &w) >= 1.0,
        "ITL from content_block_delta"
    );
    let req = metric_sum(
        &text,
        names::REQUESTS_TOTAL,
        &[
            ("pool", "anth-pass"),
            ("endpoint", "messages"),
            ("class", "ok"),
        ],
    );
    assert_eq!(req, 3.0);
    let output = metric_sum(
        &text,
        names::TOKENS_TOTAL,
        &[("pool", "anth-pass"), ("kind", "output")],
    );
    assert!(
        output >= 3.0,
        "usage from message_start/message_delta: {output}"
    );
}

#[tokio::test]
async fn translate_speaks_chat_completions_to_the_engine() {
    let s = sims(1, 20.0).await;
    let gw = gateway_for("anth-tr", "translate", &s, "").await;
    let url = gw.url();
    let r = post(&url, "/v1/messages", &message(false, 8), None).await;
    assert_eq!(r.status(), 200);
    assert!(r.headers().get("content-length").is_none_or(|v| v
        .to_str()
        .unwrap()
        .parse::<usize>()
        .unwrap()
        > 0));
    check_message(&r.json().await.unwrap(), 8);

    let r = post(&url, "/v1/messages", &message(true, 6), None).await;
    let out = check_text_stream(&r.text().await.unwrap());
    assert!((1..=6).contains(&out));

    // Tool use through chat tool_calls: the call id is the engine's chat id.
    let r = post(&url, "/v1/messages", &weather_tools(false), None).await;
    let m: Value = r.json().await.unwrap();
    assert_eq!(m["stop_reason"], "tool_use", "{m}");
    let block = &m["content"][0];
    assert_eq!(block["type"], "tool_use");
    assert!(
        block["id"].as_str().unwrap().starts_with("call_"),
        "answered through chat completions: {m}"
    );
    assert!(block["input"]["city"].is_string(), "{m}");

    let r = post(&url, "/v1/messages", &weather_tools(true), None).await;
    let ev = events(&r.text().await.unwrap());
    let start = ev.iter().find(|(n, _)| n == "content_block_start").unwrap();
    assert_eq!(start.1["content_block"]["type"], "tool_use");
    assert_eq!(start.1["content_block"]["name"], "get_weather");
    let json_text: String = ev
        .iter()
        .filter(|(n, d)| n == "content_block_delta" && d["delta"]["type"] == "input_json_delta")
        .map(|(_, d)| d["delta"]["partial_json"].as_str().unwrap().to_string())
        .collect();
    let input: Value = serde_json::from_str(&json_text).unwrap();
    assert!(input["city"].is_string(), "{json_text}");
    let md = ev.iter().find(|(n, _)| n == "message_delta").unwrap();
    assert_eq!(md.1["delta"]["stop_reason"], "tool_use");

    // count_tokens needs the engine's Messages API.
    let r = post(
        &url,
        "/v1/messages/count_tokens",
        &json!({"model": sim_model(), "messages": [{"role": "user", "content": "x"}]}),
        None,
    )
    .await;
    assert_eq!(r.status(), 404);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["type"], "not_found_error", "{e}");

    let text = scrape(&url).await;
    let req = metric_sum(
        &text,
        names::REQUESTS_TOTAL,
        &[
            ("pool", "anth-tr"),
            ("endpoint", "messages"),
            ("class", "ok"),
        ],
    );
    assert_eq!(req, 4.0);
}

#[tokio::test]
async fn translated_request_is_a_chat_completion_and_keys_stay_at_the_gateway() {
    let (up, events_tx) = Scripted::start().await;
    drop(events_tx);
    std::env::set_var("SWITCHYARD_ANTH_ACME_KEY", "sk-anth-acme-1");
    let gw = gateway(&format!(
        "[[tenants]]\nname = \"acme\"\napi_key_env = \"SWITCHYARD_ANTH_ACME_KEY\"\n[[pools]]\nname = \"anth-scripted\"\nmodels = [\"scripted\"]\nanthropic = \"translate\"\nworkers = [{{ url = \"{}\" }}]\n",
        up.url
    ))
    .await;
    let url = gw.url();
    let body = json!({"model": "scripted", "max_tokens": 5, "temperature": 0.2, "top_k": 3,
                      "stop_sequences": ["END"], "metadata": {"user_id": "u-7"},
                      "system": "sys", "messages": [{"role": "user", "content": "hi"}]});
    let r = post(&url, "/v1/messages", &body, Some("sk-anth-acme-1")).await;
    assert_eq!(r.status(), 200);
    let m: Value = r.json().await.unwrap();
    assert_eq!(m["content"][0]["text"], "ok");
    assert_eq!(m["stop_reason"], "end_turn");
    assert_eq!(m["usage"]["input_tokens"], 3);
    let (sent, headers) = {
        let rec = up.recorded.lock().unwrap();
        (rec.bodies[0].clone(), rec.headers[0].clone())
    };
    assert_eq!(
        sent["messages"],
        json!([{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}])
    );
    assert_eq!(sent["max_tokens"], 5);
    assert_eq!(sent["stop"], json!(["END"]));
    assert_eq!(sent["top_k"], 3);
    assert_eq!(sent["user"], "u-7");
    assert!(
        !headers.contains_key("x-api-key"),
        "the client's key stays at the gateway"
    );
    let text = scrape(&url).await;
    assert_eq!(
        metric_sum(
            &text,
            names::REQUESTS_TOTAL,
            &[("pool", "anth-scripted"), ("tenant", "acme")]
        ),
        1.0,
        "x-api-key names the tenant"
    );
}

#[tokio::test]
async fn errors_use_anthropics_shape() {
    let s = sims(1, 20.0).await;
    let gw = gateway_for("anth-err", "translate", &s, "").await;
    let url = gw.url();
    let check = |v: &Value, kind: &str, needle: &str| {
        assert_eq!(v["type"], "error", "{v}");
        assert_eq!(v["error"]["type"], kind, "{v}");
        assert!(
            v["error"]["message"].as_str().unwrap().contains(needle),
            "{v}"
        );
    };
    let r = post(
        &url,
        "/v1/messages",
        &json!({"model": "nope", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}),
        None,
    )
    .await;
    assert_eq!(r.status(), 404);
    check(&r.json().await.unwrap(), "not_found_error", "nope");
    let r = client()
        .post(format!("{url}/v1/messages"))
        .header("content-type", "application/json")
        .body("{\"model\":")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    check(&r.json().await.unwrap(), "invalid_request_error", "");
    let r = post(
        &url,
        "/v1/messages",
        &json!({"model": sim_model(), "messages": [{"role": "user", "content": "x"}]}),
        None,
    )
    .await;
    assert_eq!(r.status(), 400);
    check(
        &r.json().await.unwrap(),
        "invalid_request_error",
        "max_tokens",
    );
    let doc = json!({"model": sim_model(), "max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]});
    let r = post(&url, "/v1/messages", &doc, None).await;
    assert_eq!(r.status(), 400);
    check(
        &r.json().await.unwrap(),
        "invalid_request_error",
        "document",
    );
    // The engine's own refusal (over its context length), reshaped.
    let long = json!({"model": sim_model(), "max_tokens": 100000000, "messages": [{"role": "user", "content": "x"}]});
    let r = post(&url, "/v1/messages", &long, None).await;
    assert_eq!(r.status(), 400);
    check(
        &r.json().await.unwrap(),
        "invalid_request_error",
        "context length",
    );
    // Passthrough: the engine answers in Anthropic's shape itself.
    let gw2 = gateway_for("anth-err-pass", "passthrough", &s, "").await;
    let r = post(&gw2.url(), "/v1/messages", &long, None).await;
    assert_eq!(r.status(), 400);
    check(
        &r.json().await.unwrap(),
        "invalid_request_error",
        "context length",
    );
}

#[tokio::test]
async fn system_prompt_and_messages_drive_prefix_affinity() {
    let s = sims(3, 20.0).await;
    let workers: Vec<String> = s
        .iter()
        .map(|w| format!("{{ url = \"{}\" }}", w.url()))
        .collect();
    let gw = gateway(&format!(
        "[server]\ndebug_headers = true\n[[pools]]\nname = \"anth-prefix\"\nmodels = [\"{}\"]\npolicy = \"prefix\"\nworkers = [{}]\n",
        sim_model(),
        workers.join(", ")
    ))
    .await;
    let system = "You are a careful assistant for the shipping department. ".repeat(40);
    let mut chosen = std::collections::BTreeSet::new();
    for i in 0..6 {
        let body = json!({"model": sim_model(), "max_tokens": 2, "system": system,
                          "messages": [{"role": "user", "content": format!("question {i}")}]});
        let r = post(&gw.url(), "/v1/messages", &body, None).await;
        assert_eq!(r.status(), 200);
        let route = r.headers()["x-switchyard-route"]
            .to_str()
            .unwrap()
            .to_string();
        chosen.insert(route.split(';').next().unwrap().to_string());
    }
    assert_eq!(
        chosen.len(),
        1,
        "one shared system prompt, one worker: {chosen:?}"
    );
}

#[tokio::test]
async fn a_failed_stream_ends_with_an_anthropic_error_event() {
    let s = sims(1, 20.0).await;
    for mode in ["passthrough", "translate"] {
        let gw = gateway_for(&format!("anth-die-{mode}"), mode, &s, "").await;
        let r = client()
            .post(format!("{}/v1/messages", gw.url()))
            .header("x-sim-fault", "die-after:3")
            .json(&message(true, 20))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let ev = events(&r.text().await.unwrap());
        let (name, data) = ev.last().unwrap();
        assert_eq!(name, "error", "{mode}: {ev:?}");
        assert_eq!(data["error"]["type"], "api_error", "{mode}");
        assert!(data["error"]["message"].is_string());
        assert!(
            names_of(&ev).contains(&"content_block_delta"),
            "{mode}: tokens came first"
        );
        assert!(!names_of(&ev).contains(&"message_stop"), "{mode}");
    }
}

#[tokio::test]
async fn a_down_passthrough_pool_falls_back_to_a_translating_one() {
    let s = sims(1, 20.0).await;
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let gw = gateway(&format!(
        "[[pools]]\nname = \"anth-down\"\nmodels = [\"anth-model\"]\nfallback = [\"anth-fb\"]\nworkers = [{{ url = \"{dead}\" }}]\n\
         [[pools]]\nname = \"anth-fb\"\nmodels = [\"anth-fb-model\"]\nanthropic = \"translate\"\nupstream_model = \"{}\"\nworkers = [{{ url = \"{}\" }}]\n",
        sim_model(),
        s[0].url()
    ))
    .await;
    let mut body = weather_tools(false);
    body["model"] = json!("anth-model");
    let r = post(&gw.url(), "/v1/messages", &body, None).await;
    assert_eq!(r.status(), 200);
    let m: Value = r.json().await.unwrap();
    // Translated for the fallback pool: the tool call id is the engine's chat id.
    assert!(
        m["content"][0]["id"].as_str().unwrap().starts_with("call_"),
        "{m}"
    );
    assert_eq!(m["stop_reason"], "tool_use");
    let text = scrape(&gw.url()).await;
    assert_eq!(
        metric_sum(
            &text,
            names::REQUESTS_TOTAL,
            &[("pool", "anth-fb"), ("endpoint", "messages")]
        ),
        1.0
    );
}
