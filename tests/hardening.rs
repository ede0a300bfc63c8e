//! What a hostile or careless client meets: slow and idle connections closed so
//! they cannot hold the connection cap, header limits, framing the gateway will
//! not interpret, credentials kept at the gateway, and errors in OpenAI's shape
//! that name the problem.

mod support;

use support::raw::{raw, read_to_close, status_of, SAFETY};
use support::scripted::Scripted;
use support::{client, eventually, gateway, metric_sum, pool_toml, scrape};
use switchyard::telemetry::names;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn body_of(answer: &str) -> serde_json::Value {
    let body = answer.split("\r\n\r\n").nth(1).unwrap_or("");
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {answer:?}"))
}

async fn closed(url: &str, reason: &str) -> f64 {
    metric_sum(
        &scrape(url).await,
        names::CONNECTIONS_CLOSED_TOTAL,
        &[("reason", reason)],
    )
}

#[tokio::test]
async fn silent_connections_are_closed_and_the_cap_frees_for_others() {
    let (up, _tx) = Scripted::start().await;
    let gw = gateway(&format!(
        "[server]\nmax_connections = 2\nheader_read_timeout_ms = 300\n{}",
        pool_toml("scripted", &[up.url.as_str()], "")
    ))
    .await;
    // Two connections that never send a byte take the whole cap.
    let mut a = TcpStream::connect(gw.addr).await.unwrap();
    let mut b = TcpStream::connect(gw.addr).await.unwrap();
    // One that sends half a request line, then nothing.
    assert_eq!(read_to_close(&mut a).await, "");
    assert_eq!(read_to_close(&mut b).await, "");
    let mut c = TcpStream::connect(gw.addr).await.unwrap();
    c.write_all(b"GET /health HT").await.unwrap();
    read_to_close(&mut c).await;
    let r = client()
        .get(format!("{}/health", gw.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(closed(&gw.url(), "header_timeout").await >= 3.0);
}

#[tokio::test]
async fn a_trickled_body_gets_408_and_the_connection_closes() {
    let (up, _tx) = Scripted::start().await;
    let gw = gateway(&format!(
        "[server]\nmax_connections = 1\nbody_read_timeout_ms = 300\n{}",
        pool_toml("scripted", &[up.url.as_str()], "")
    ))
    .await;
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    s.write_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"mo",
    )
    .await
    .unwrap();
    let answer = read_to_close(&mut s).await;
    assert_eq!(status_of(&answer), 408, "{answer}");
    assert_eq!(body_of(&answer)["error"]["code"], "request_timeout");
    assert!(up.recorded.lock().unwrap().bodies.is_empty());
    assert_eq!(closed(&gw.url(), "body_timeout").await, 1.0);
}

#[tokio::test]
async fn an_idle_http2_connection_is_closed() {
    let (up, _tx) = Scripted::start().await;
    let gw = gateway(&format!(
        "[server]\nidle_timeout_ms = 300\n{}",
        pool_toml("scripted", &[up.url.as_str()], "")
    ))
    .await;
    let h2 = reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    let r = h2.get(format!("{}/health", gw.url())).send().await.unwrap();
    assert_eq!(r.version(), reqwest::Version::HTTP_2);
    let url = gw.url();
    eventually(SAFETY, "the idle connection closed", || {
        let url = url.clone();
        async move { (closed(&url, "idle_timeout").await >= 1.0).then_some(()) }
    })
    .await;
}

#[tokio::test]
async fn header_limits_hold_before_anything_is_forwarded() {
    let (up, _tx) = Scripted::start().await;
    let gw = gateway(&format!(
        "[server]\nmax_headers = 20\nmax_header_bytes = 4096\n{}",
        pool_toml("scripted", &[up.url.as_str()], "")
    ))
    .await;
    let chat = format!("{}/v1/chat/completions", gw.url());
    let body = r#"{"model":"scripted","messages":[]}"#;
    // Too many headers.
    let mut req = client().post(&chat).body(body);
    for i in 0..25 {
        req = req.header(format!("x-h{i}"), "v");
    }
    assert_eq!(req.send().await.unwrap().status(), 431);
    // One header within hyper's smallest buffer but over the configured size.
    let r = client()
        .post(&chat)
        .header("x-big", "a".repeat(6000))
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 431);
    let v: serde_json::Value = r.json().await.unwrap();
    assert!(v["error"]["message"].as_str().unwrap().contains("4096"));
    // One far over it.
    let big = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\nContent-Length: {}\r\n\r\n{body}",
        "a".repeat(300_000),
        body.len()
    );
    assert_eq!(status_of(&raw(gw.addr, big.as_bytes()).await), 431);
    assert!(up.recorded.lock().unwrap().bodies.is_empty());
    // Within the limits the request goes through.
    let r = client().post(&chat).body(body).send().await.unwrap();
    assert_eq!(r.status(), 200);
}

#[tokio::test]
async fn framing_the_gateway_will_not_interpret_is_refused() {
    let (up, _tx) = Scripted::start().await;
    let gw = gateway(&pool_toml("scripted", &[up.url.as_str()], "")).await;
    let body = r#"{"model":"scripted","messages":[]}"#;
    let gzip = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n{:x}\r\n{body}\r\n0\r\n\r\n",
        body.len()
    );
    let answer = raw(gw.addr, gzip.as_bytes()).await;
    assert_eq!(status_of(&answer), 501, "{answer}");
    assert!(body_of(&answer)["error"]["message"]
        .as_str()
        .unwrap()
        .contains("gzip"));
    let bare_lf = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-A: 1\nX-Injected: 2\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let answer = raw(gw.addr, bare_lf.as_bytes()).await;
    assert_eq!(status_of(&answer), 400, "{answer}");
    assert!(up.recorded.lock().unwrap().bodies.is_empty());
    assert_eq!(closed(&gw.url(), "bad_framing").await, 2.0);
    // A keep-alive connection's second request is checked too, and a body with
    // bare LFs in it is fine.
    let pretty = "{\n\"model\": \"scripted\",\n\"messages\": []\n}";
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    let first = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{pretty}",
        pretty.len()
    );
    s.write_all(first.as_bytes()).await.unwrap();
    let mut buf = vec![0u8; 4096];
    let n = s.read(&mut buf).await.unwrap();
    assert_eq!(status_of(&String::from_utf8_lossy(&buf[..n])), 200);
    s.write_all(b"GET /health HTTP/1.1\r\nHost: x\nX-B: 1\r\n\r\n")
        .await
        .unwrap();
    assert_eq!(status_of(&read_to_close(&mut s).await), 400);
}

#[tokio::test]
async fn credentials_and_gateway_headers_stay_at_the_gateway() {
    let (up, _tx) = Scripted::start().await;
    let (open_up, _tx2) = Scripted::start().await;
    let gw = gateway(&format!(
        "{}\n[[pools]]\nname = \"open\"\nmodels = [\"open\"]\npass_client_auth = true\nforward_headers = [\"Cookie\"]\nworkers = [{{ url = \"{}\" }}]\n",
        pool_toml("scripted", &[up.url.as_str()], ""),
        open_up.url
    ))
    .await;
    let send = |model: &'static str| {
        client()
            .post(format!("{}/v1/chat/completions", gw.url()))
            .header("authorization", "Bearer sk-client")
            .header("x-api-key", "sk-anthropic-style")
            .header("api-key", "sk-azure-style")
            .header("x-goog-api-key", "sk-google-style")
            .header("cookie", "session=secret")
            .header("x-switchyard-note", "internal")
            .header("x-custom", "kept")
            .body(format!(r#"{{"model":"{model}","messages":[]}}"#))
            .send()
    };
    assert_eq!(send("scripted").await.unwrap().status(), 200);
    assert_eq!(send("open").await.unwrap().status(), 200);
    let closed_pool = up.recorded.lock().unwrap().headers[0].clone();
    for h in [
        "authorization",
        "x-api-key",
        "api-key",
        "x-goog-api-key",
        "cookie",
        "x-switchyard-note",
    ] {
        assert!(
            !closed_pool.contains_key(h),
            "{h} forwarded: {closed_pool:?}"
        );
    }
    assert_eq!(closed_pool["x-custom"], "kept");
    let open_pool = open_up.recorded.lock().unwrap().headers[0].clone();
    assert_eq!(open_pool["authorization"], "Bearer sk-client");
    assert_eq!(open_pool["x-api-key"], "sk-anthropic-style");
    assert_eq!(open_pool["cookie"], "session=secret");
    assert!(!open_pool.contains_key("x-switchyard-note"));
}

#[tokio::test]
async fn the_tenant_header_cannot_claim_a_keyed_tenant() {
    std::env::set_var("SWITCHYARD_HARDEN_ACME_KEY", "sk-acme-hardening-1");
    let (up, _tx) = Scripted::start().await;
    let gw = gateway(&format!(
        "[tenancy]\ntrust_tenant_header = true\n[[tenants]]\nname = \"acme\"\napi_key_env = \"SWITCHYARD_HARDEN_ACME_KEY\"\n{}",
        pool_toml("scripted", &[up.url.as_str()], "")
    ))
    .await;
    let send = |tenant: &'static str, key: Option<&'static str>| {
        let mut r = client()
            .post(format!("{}/v1/chat/completions", gw.url()))
            .header("x-switchyard-tenant", tenant)
            .body(r#"{"model":"scripted","messages":[]}"#);
        if let Some(k) = key {
            r = r.bearer_auth(k);
        }
        r.send()
    };
    let r = send("acme", None).await.unwrap();
    assert_eq!(r.status(), 401);
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "invalid_api_key");
    assert_eq!(
        send("acme", Some("sk-acme-hardening-1"))
            .await
            .unwrap()
            .status(),
        200
    );
    assert_eq!(send("team-7", None).await.unwrap().status(), 200);
    assert_eq!(up.recorded.lock().unwrap().bodies.len(), 2);
}

#[tokio::test]
async fn every_error_is_openai_shaped_and_names_the_problem() {
    let (up, _tx) = Scripted::start().await;
    let gw = gateway(&pool_toml("scripted", &[up.url.as_str()], "")).await;
    let chat = format!("{}/v1/chat/completions", gw.url());
    let message = |v: &serde_json::Value| v["error"]["message"].as_str().unwrap().to_string();
    let post = |body: String, ctype: &'static str| {
        client()
            .post(&chat)
            .header("content-type", ctype)
            .body(body)
            .send()
    };
    for (body, want) in [
        ("[1,2,3]", "must be a JSON object, not an array"),
        ("\"hello\"", "must be a JSON object, not a string"),
        (r#"{"model":7}"#, "`model` must be a string"),
    ] {
        let r = post(body.into(), "application/json").await.unwrap();
        assert_eq!(r.status(), 400, "{body}");
        let v: serde_json::Value = r.json().await.unwrap();
        assert!(message(&v).contains(want), "{body}: {v}");
    }
    // A huge model name is not echoed whole.
    let r = post(
        format!(r#"{{"model":"{}","messages":[]}}"#, "m".repeat(100_000)),
        "application/json",
    )
    .await
    .unwrap();
    assert_eq!(r.status(), 404);
    let v: serde_json::Value = r.json().await.unwrap();
    assert!(message(&v).len() < 200, "{}", message(&v).len());
    // A form sent to a JSON route.
    let r = post(
        "--b\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nx\r\n--b--".into(),
        "multipart/form-data; boundary=b",
    )
    .await
    .unwrap();
    assert_eq!(r.status(), 415);
    let v: serde_json::Value = r.json().await.unwrap();
    assert!(message(&v).contains("multipart/form-data"), "{v}");
    // A known path with the wrong method.
    let r = client().get(&chat).send().await.unwrap();
    assert_eq!(r.status(), 405);
    assert!(r.headers().contains_key("x-request-id"));
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "method_not_allowed");
    // models.retrieve
    let r = client()
        .get(format!("{}/v1/models/scripted", gw.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(
        (v["id"].as_str(), v["object"].as_str()),
        (Some("scripted"), Some("model"))
    );
    let r = client()
        .get(format!("{}/v1/models/org/unknown", gw.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "model_not_found");
}

#[tokio::test]
async fn ready_explains_a_worker_whose_models_cannot_be_discovered() {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let dead = format!("http://{}", l.local_addr().unwrap());
    drop(l);
    let gw = gateway(&format!(
        "[[pools]]\nname = \"cli\"\nworkers = [{{ url = \"{dead}\" }}]\n"
    ))
    .await;
    let snap = gw.gateway.routes.snapshot();
    assert!(!snap.is_ready());
    let why = snap.unready_reasons().join("; ");
    assert!(why.contains("pool `cli` serves no model yet"), "{why}");
    assert!(why.contains(&dead), "{why}");
    assert!(!why.contains("no model listed yet"), "{why}");
}

#[tokio::test]
async fn the_admin_listener_has_the_same_limits_and_honest_401s() {
    std::env::set_var("SWITCHYARD_HARDEN_ADMIN_TOKEN", "f3a9c1e07b5d4a2e9c8b");
    let (up, _tx) = Scripted::start().await;
    let gw = gateway(&format!(
        "[server]\nheader_read_timeout_ms = 300\n[admin]\nlisten = \"127.0.0.1:0\"\ntoken_env = \"SWITCHYARD_HARDEN_ADMIN_TOKEN\"\n{}",
        pool_toml("scripted", &[up.url.as_str()], "")
    ))
    .await;
    let admin = gw.admin_addr.expect("admin listener");
    let mut silent = TcpStream::connect(admin).await.unwrap();
    assert_eq!(read_to_close(&mut silent).await, "");
    let workers = format!("http://{admin}/admin/workers");
    let r = client().get(&workers).send().await.unwrap();
    assert_eq!(r.status(), 401);
    let challenge = r.headers()["www-authenticate"]
        .to_str()
        .unwrap()
        .to_string();
    assert!(challenge.starts_with("Bearer"), "{challenge}");
    let r = client()
        .get(&workers)
        .header("authorization", "bearer f3a9c1e07b5d4a2e9c8b")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
}

/// An upstream that accepts connections and closes them at once.
async fn slamming_upstream() -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            drop(s);
        }
    });
    format!("http://{addr}")
}

#[tokio::test]
async fn worker_addresses_reach_clients_only_with_debug_headers() {
    let up = slamming_upstream().await;
    let port = up.rsplit(':').next().unwrap().to_string();
    let body = serde_json::json!({"model": "m", "messages": []});
    for debug in [false, true] {
        let gw = gateway(&format!(
            "[server]\ndebug_headers = {debug}\n{}",
            pool_toml("m", &[up.as_str()], "max_attempts = 1")
        ))
        .await;
        let r = client()
            .post(format!("{}/v1/chat/completions", gw.url()))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 502);
        let route = r.headers().get("x-switchyard-route").cloned();
        let text = r.text().await.unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["error"]["type"], "upstream_error", "{text}");
        assert_eq!(text.contains(&port), debug, "debug_headers={debug}: {text}");
        if !debug {
            assert!(route.is_none());
        }
        gw.shutdown().await;
    }
}

#[tokio::test]
async fn cors_preflights_are_answered_for_allowed_origins_only() {
    let (up, _tx) = Scripted::start().await;
    let gw = gateway(&format!(
        "[server.cors]\nallowed_origins = [\"https://app.example\"]\nmax_age_s = 60\n{}",
        pool_toml("scripted", &[up.url.as_str()], "")
    ))
    .await;
    let chat = format!("{}/v1/chat/completions", gw.url());
    let preflight = |origin: &'static str| {
        client()
            .request(reqwest::Method::OPTIONS, &chat)
            .header("origin", origin)
            .header("access-control-request-method", "POST")
            .header(
                "access-control-request-headers",
                "authorization, content-type",
            )
            .send()
    };
    let r = preflight("https://app.example").await.unwrap();
    assert_eq!(r.status(), 204);
    let h = r.headers();
    assert_eq!(h["access-control-allow-origin"], "https://app.example");
    assert!(h["access-control-allow-methods"]
        .to_str()
        .unwrap()
        .contains("POST"));
    let allowed = h["access-control-allow-headers"].to_str().unwrap();
    assert!(allowed.contains("authorization") && allowed.contains("content-type"));
    assert_eq!(h["access-control-max-age"], "60");
    assert!(
        up.recorded.lock().unwrap().bodies.is_empty(),
        "a preflight reached the worker"
    );

    let r = preflight("https://evil.example").await.unwrap();
    assert_eq!(r.status(), 403);
    assert!(!r.headers().contains_key("access-control-allow-origin"));
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "cors_origin_not_allowed");

    // The actual request: marked for the allowed origin, not for another.
    let body = serde_json::json!({"model": "scripted", "messages": []});
    for (origin, marked) in [
        ("https://app.example", true),
        ("https://evil.example", false),
    ] {
        let r = client()
            .post(&chat)
            .header("origin", origin)
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(
            r.headers().contains_key("access-control-allow-origin"),
            marked,
            "{origin}"
        );
    }
    let refused = metric_sum(&scrape(&gw.url()).await, names::CORS_REFUSED_TOTAL, &[]);
    assert_eq!(refused, 2.0);
}

#[tokio::test]
async fn without_cors_config_no_cors_header_is_sent() {
    let (up, _tx) = Scripted::start().await;
    let gw = gateway(&pool_toml("scripted", &[up.url.as_str()], "")).await;
    let r = client()
        .get(format!("{}/v1/models", gw.url()))
        .header("origin", "https://app.example")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(!r.headers().contains_key("access-control-allow-origin"));
}
