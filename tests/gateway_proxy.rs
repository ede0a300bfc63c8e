//! Proxy behaviour that needs exact control of the upstream: header rules and
//! chunk-by-chunk SSE pass-through.

mod support;

use futures_util::StreamExt;
use std::time::Duration;
use support::scripted::Scripted;
use support::{client, gateway, pool_toml};

#[tokio::test]
async fn client_credentials_stay_at_the_edge_and_request_id_round_trips() {
    let (up, _tx) = Scripted::start().await;
    let gw = gateway(&pool_toml("scripted", &[up.url.as_str()], "")).await;
    let resp = client()
        .post(format!("{}/v1/chat/completions", gw.url()))
        .header("authorization", "Bearer client-secret")
        .header("x-request-id", "req-42")
        .header("connection", "keep-alive, x-drop-me")
        .header("x-drop-me", "1")
        .header("x-custom", "kept")
        .body(r#"{"model":"scripted","messages":[{"role":"user","content":"hi"}]}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-request-id"], "req-42");
    // Hop-by-hop headers from the upstream do not reach the client.
    assert!(resp.headers().get("x-hop").is_none());
    let body: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(body["choices"][0]["message"]["content"], "ok");

    let seen = up.recorded.lock().unwrap().headers[0].clone();
    assert!(
        !seen.contains_key("authorization"),
        "client token leaked: {seen:?}"
    );
    assert!(!seen.contains_key("x-drop-me"));
    assert_eq!(seen.get("x-custom").map(String::as_str), Some("kept"));
    assert_eq!(seen.get("x-request-id").map(String::as_str), Some("req-42"));
    gw.shutdown().await;
}

#[tokio::test]
async fn pool_key_is_injected_and_client_auth_passes_only_when_configured() {
    let (up, _tx) = Scripted::start().await;
    std::env::set_var("SWITCHYARD_TEST_UPSTREAM_KEY", "pool-key");
    let gw = gateway(&pool_toml(
        "scripted",
        &[up.url.as_str()],
        "upstream_api_key_env = \"SWITCHYARD_TEST_UPSTREAM_KEY\"",
    ))
    .await;
    let resp = client()
        .post(format!("{}/v1/chat/completions", gw.url()))
        .header("authorization", "Bearer client-secret")
        .body(r#"{"model":"scripted","messages":[]}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let id = resp.headers()["x-request-id"].to_str().unwrap().to_string();
    assert!(!id.is_empty());
    gw.shutdown().await;

    let gw = gateway(&pool_toml(
        "scripted",
        &[up.url.as_str()],
        "pass_client_auth = true",
    ))
    .await;
    client()
        .post(format!("{}/v1/chat/completions", gw.url()))
        .header("authorization", "Bearer client-secret")
        .body(r#"{"model":"scripted","messages":[]}"#)
        .send()
        .await
        .unwrap();
    let rec = std::mem::take(&mut up.recorded.lock().unwrap().headers);
    assert_eq!(rec[0]["authorization"], "Bearer pool-key");
    assert_eq!(rec[0]["x-request-id"], id);
    assert_eq!(rec[1]["authorization"], "Bearer client-secret");
    gw.shutdown().await;
}

/// The client must receive each event before the worker sends the next one:
/// the upstream only sends event N+1 after the test saw event N through the gateway.
#[tokio::test]
async fn sse_events_are_not_buffered() {
    let (up, tx) = Scripted::start().await;
    let gw = gateway(&pool_toml("scripted", &[up.url.as_str()], "")).await;
    let resp = client()
        .post(format!("{}/v1/chat/completions", gw.url()))
        .body(r#"{"model":"scripted","stream":true,"messages":[]}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert!(resp.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let mut body = resp.bytes_stream();
    let mut seen = String::new();
    for i in 0..5 {
        let ev = format!(r#"{{"choices":[{{"index":0,"delta":{{"content":"tok{i}"}}}}]}}"#);
        tx.send(ev.clone()).unwrap();
        // Wait for this event to come through before the upstream sends another.
        while !seen.contains(&ev) {
            let chunk = tokio::time::timeout(Duration::from_secs(5), body.next())
                .await
                .unwrap_or_else(|_| panic!("event {i} was held back by the gateway"))
                .expect("stream open")
                .unwrap();
            seen.push_str(std::str::from_utf8(&chunk).unwrap());
        }
    }
    tx.send("[DONE]".into()).unwrap();
    drop(tx);
    while let Some(chunk) = body.next().await {
        seen.push_str(std::str::from_utf8(&chunk.unwrap()).unwrap());
    }
    assert!(seen.ends_with("data: [DONE]\n\n"), "{seen}");
    gw.shutdown().await;
}

/// Extra `/v1/...` paths reach the model's pool only when the pool lists them in
/// `forward_routes` (before issue 31 any path naming a model was forwarded).
#[tokio::test]
async fn responses_and_listed_extra_v1_paths_go_to_the_model_pool() {
    let (up, _tx) = Scripted::start().await;
    let extra = "forward_routes = [\"/v1/custom/thing\"]";
    let gw = gateway(&pool_toml("scripted", &[up.url.as_str()], extra)).await;
    for path in ["/v1/responses", "/v1/custom/thing"] {
        let r = client()
            .post(format!("{}{path}", gw.url()))
            .body(r#"{"model":"scripted","input":"hi"}"#)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{path}");
    }
    // Without a model there is nowhere to send it.
    let r = client()
        .post(format!("{}/v1/custom/thing", gw.url()))
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    // A path no pool lists is not forwarded, model or not.
    let r = client()
        .post(format!("{}/v1/custom/other", gw.url()))
        .body(r#"{"model":"scripted","input":"hi"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    assert_eq!(up.recorded.lock().unwrap().headers.len(), 2);
    gw.shutdown().await;
}
