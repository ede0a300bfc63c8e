//! Every error the gateway answers itself, in OpenAI's shape with the right status.

mod support;

use futures_util::StreamExt;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use support::scripted::Scripted;
use support::{client, gateway, metric_sum, pool_toml, scrape};
use switchyard::telemetry::names;

async fn post(url: &str, body: impl Into<reqwest::Body>) -> (u16, serde_json::Value) {
    let r = client()
        .post(format!("{url}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    assert!(r.headers().contains_key("x-request-id"));
    (status, r.json().await.expect("error body is JSON"))
}

fn assert_openai_error(v: &serde_json::Value) {
    let e = &v["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert!(e["type"].is_string(), "{v}");
    assert!(e.get("param").is_some() && e.get("code").is_some(), "{v}");
}

/// A port that refuses connections (bound, then closed).
async fn dead_url() -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    drop(l);
    url
}

#[tokio::test]
async fn client_errors() {
    let (up, _tx) = Scripted::start().await;
    let gw = gateway(&format!(
        "[server]\nmax_body_bytes = 1024\n{}",
        pool_toml("scripted", &[up.url.as_str()], "aliases = [\"alias-a\"]")
    ))
    .await;
    let url = gw.url();

    let (s, v) = post(&url, "{\"model\": ").await;
    assert_eq!(s, 400);
    assert_openai_error(&v);
    assert!(v["error"]["message"].as_str().unwrap().contains("JSON"));

    let (s, v) = post(&url, r#"{"messages":[]}"#).await;
    assert_eq!((s, v["error"]["param"].as_str()), (400, Some("model")));

    let (s, v) = post(&url, r#"{"model":"nope","messages":[]}"#).await;
    assert_eq!(s, 404);
    assert_eq!(v["error"]["code"], "model_not_found");

    let big = format!(r#"{{"model":"scripted","prompt":"{}"}}"#, "x".repeat(4096));
    let (s, v) = post(&url, big.clone()).await;
    assert_eq!(s, 413);
    assert_openai_error(&v);
    // Without a Content-Length (chunked), the limit still holds.
    let stream = futures_util::stream::iter(
        big.into_bytes()
            .chunks(100)
            .map(|c| Ok::<_, std::io::Error>(c.to_vec()))
            .collect::<Vec<_>>(),
    );
    let (s, _) = post(&url, reqwest::Body::wrap_stream(stream)).await;
    assert_eq!(s, 413);
    // A chunked body under the limit arrives in several frames and is forwarded whole.
    let fits = format!(r#"{{"model":"scripted","prompt":"{}"}}"#, "y".repeat(700));
    let stream = futures_util::stream::iter(
        fits.clone()
            .into_bytes()
            .chunks(100)
            .map(|c| Ok::<_, std::io::Error>(c.to_vec()))
            .collect::<Vec<_>>(),
    );
    let (s, _) = post(&url, reqwest::Body::wrap_stream(stream)).await;
    assert_eq!(s, 200);
    let sent: serde_json::Value = serde_json::from_str(&fits).unwrap();
    assert_eq!(up.recorded.lock().unwrap().bodies.last(), Some(&sent));

    // An alias routes; an unknown path is a 404 in OpenAI shape.
    let (s, _) = post(&url, r#"{"model":"alias-a","messages":[]}"#).await;
    assert_eq!(s, 200);
    let r = client()
        .get(format!("{url}/v2/whatever"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    assert_openai_error(&r.json().await.unwrap());

    let models: serde_json::Value = support::get_json(&format!("{url}/v1/models")).await;
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(models["object"], "list");
    assert_eq!(ids, vec!["alias-a", "scripted"]);

    let text = scrape(&url).await;
    assert!(
        metric_sum(
            &text,
            names::GATEWAY_ERRORS_TOTAL,
            &[("reason", "body_too_large")]
        ) >= 2.0
    );
    assert!(
        metric_sum(
            &text,
            names::GATEWAY_ERRORS_TOTAL,
            &[("reason", "unknown_model")]
        ) >= 1.0
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn refused_upstream_is_502_and_no_healthy_worker_is_503() {
    let dead = dead_url().await;
    let gw = gateway(&pool_toml("m", &[dead.as_str()], "max_attempts = 2")).await;
    let url = gw.url();
    let (s, v) = post(&url, r#"{"model":"m","messages":[]}"#).await;
    assert_eq!(s, 502);
    assert_eq!(v["error"]["type"], "upstream_error");

    for w in gw.gateway.registry.snapshot().workers() {
        w.state.healthy.store(false, Ordering::Relaxed);
    }
    let t = Instant::now();
    let (s, v) = post(&url, r#"{"model":"m","messages":[]}"#).await;
    assert_eq!(s, 503);
    assert_openai_error(&v);
    assert!(t.elapsed() < Duration::from_secs(2), "503 must be fast");
    let r = client().get(format!("{url}/ready")).send().await.unwrap();
    assert_eq!(r.status(), 503);
    gw.shutdown().await;
}

#[tokio::test]
async fn a_refused_worker_fails_over_to_a_live_one() {
    let dead = dead_url().await;
    let (up, _tx) = Scripted::start().await;
    let gw = gateway(&pool_toml(
        "scripted",
        &[dead.as_str(), up.url.as_str()],
        "",
    ))
    .await;
    for _ in 0..6 {
        let (s, _) = post(&gw.url(), r#"{"model":"scripted","messages":[]}"#).await;
        assert_eq!(s, 200);
    }
    gw.shutdown().await;
}

#[tokio::test]
async fn silent_upstream_is_504_after_first_byte_timeout() {
    // Accepts connections and never answers.
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = l.accept().await {
            held.push(s);
        }
    });
    let gw = gateway(&format!(
        "[server]\n[server.timeouts]\nfirst_byte_ms = 300\n{}",
        pool_toml("m", &[url.as_str()], "max_attempts = 1")
    ))
    .await;
    let t = Instant::now();
    let (s, v) = post(&gw.url(), r#"{"model":"m","messages":[]}"#).await;
    assert_eq!(s, 504);
    assert_openai_error(&v);
    assert!(t.elapsed() >= Duration::from_millis(300));
    assert!(t.elapsed() < Duration::from_secs(5));
    gw.shutdown().await;
}

#[tokio::test]
async fn a_stream_that_goes_quiet_ends_with_an_error_event() {
    let (up, tx) = Scripted::start().await;
    let gw = gateway(&format!(
        "[server]\n[server.timeouts]\nidle_ms = 300\n{}",
        pool_toml("scripted", &[up.url.as_str()], "")
    ))
    .await;
    let resp = client()
        .post(format!("{}/v1/chat/completions", gw.url()))
        .body(r#"{"model":"scripted","stream":true,"messages":[]}"#)
        .send()
        .await
        .unwrap();
    tx.send(r#"{"choices":[{"delta":{"content":"a"}}]}"#.into())
        .unwrap();
    let mut all = String::new();
    let mut body = resp.bytes_stream();
    while let Some(c) = tokio::time::timeout(Duration::from_secs(5), body.next())
        .await
        .expect("gateway must end the stream, not hang")
    {
        all.push_str(std::str::from_utf8(&c.unwrap()).unwrap());
    }
    let last = all.trim_end().rsplit("\n\n").next().unwrap();
    let v: serde_json::Value = serde_json::from_str(last.strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(v["error"]["code"], "idle_timeout", "{all}");
    drop(tx);
    let text = scrape(&gw.url()).await;
    assert_eq!(
        metric_sum(
            &text,
            names::STREAM_ERRORS_TOTAL,
            &[("reason", "idle_timeout"), ("worker", &up.url)]
        ),
        1.0
    );
    gw.shutdown().await;
}
