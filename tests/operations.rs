//! Operations: admin API (auth, list, drain, add/remove), hot reload under load,
//! backpressure queue, graceful shutdown, DNS discovery and the slowloris guard.

mod support;

use serde_json::json;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use support::*;
use switchyard::server;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const TOKEN: &str = "test-admin-token-0123456789";

fn admin_toml() -> String {
    std::env::set_var("SWITCHYARD_TEST_ADMIN_TOKEN", TOKEN);
    // The sims listen on loopback: the admin API may add them only when allowed.
    "[admin]\nlisten = \"127.0.0.1:0\"\ntoken_env = \"SWITCHYARD_TEST_ADMIN_TOKEN\"\nallow_loopback_workers = true\n".into()
}

fn chat(model: &str, stream: bool, max_tokens: u32) -> serde_json::Value {
    json!({"model": model, "stream": stream, "max_tokens": max_tokens,
           "messages": [{"role":"user","content":"ops"}]})
}

async fn post_chat(url: &str, body: &serde_json::Value) -> reqwest::Response {
    client()
        .post(format!("{url}/v1/chat/completions"))
        .json(body)
        .send()
        .await
        .unwrap()
}

#[tokio::test]
async fn admin_api_requires_the_token_and_drains_adds_removes() {
    let s = sims(3, 20.0).await;
    let model = sim_model();
    let u = urls(&s);
    let gw = gateway(&format!(
        "{}{}",
        admin_toml(),
        pool_toml(&model, &[&u[0], &u[1]], "")
    ))
    .await;
    let admin = format!("http://{}", gw.admin_addr.expect("admin listener"));
    let c = client();

    let r = c
        .get(format!("{admin}/admin/workers"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let r = c
        .get(format!("{admin}/admin/workers"))
        .bearer_auth("wrong-token-wrong-token")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let list: serde_json::Value = c
        .get(format!("{admin}/admin/workers"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(list["workers"].as_array().unwrap().len(), 2);
    assert_eq!(list["workers"][0]["state"], "healthy");

    // Drain worker 0: an in-flight stream finishes, new requests avoid it.
    let url = gw.url();
    let inflight = {
        let (url, model) = (url.clone(), model.clone());
        tokio::spawn(async move { stream_text(&url, chat(&model, true, 30)).await })
    };
    eventually(Duration::from_secs(5), "stream in flight", || {
        let s0 = s[0].requests_received() + s[1].requests_received();
        async move { (s0 >= 1).then_some(()) }
    })
    .await;
    let busy = if s[0].requests_received() == 1 {
        &u[0]
    } else {
        &u[1]
    };
    let r = c
        .post(format!("{admin}/admin/workers/drain"))
        .bearer_auth(TOKEN)
        .json(&json!({"url": busy}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let busy_sim = if busy == &u[0] { &s[0] } else { &s[1] };
    let before = busy_sim.requests_received();
    for _ in 0..4 {
        assert_eq!(post_chat(&url, &chat(&model, false, 2)).await.status(), 200);
    }
    assert_eq!(
        busy_sim.requests_received(),
        before,
        "a draining worker gets nothing new"
    );
    let (status, text) = inflight.await.unwrap();
    assert_eq!(status, 200);
    assert!(
        text.ends_with("data: [DONE]\n\n"),
        "in-flight stream finished: {text}"
    );

    // Add the third worker, remove the first two: everything goes to the third.
    let r = c
        .post(format!("{admin}/admin/workers"))
        .bearer_auth(TOKEN)
        .json(&json!({"pool": "p", "url": u[2]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    for w in [&u[0], &u[1]] {
        let r = c
            .delete(format!("{admin}/admin/workers"))
            .bearer_auth(TOKEN)
            .json(&json!({"url": w}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    let before = s[2].requests_received();
    for _ in 0..3 {
        assert_eq!(post_chat(&url, &chat(&model, false, 2)).await.status(), 200);
    }
    assert_eq!(s[2].requests_received(), before + 3);
    let r = c
        .post(format!("{admin}/admin/workers"))
        .bearer_auth(TOKEN)
        .json(&json!({"pool": "nope", "url": u[2]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    gw.shutdown().await;
}

/// Change the worker set and the policy while requests flow: none fails.
#[tokio::test]
async fn reload_under_load_fails_nothing() {
    let s = sims(3, 20.0).await;
    let model = sim_model();
    let u = urls(&s);
    let dir = std::env::temp_dir().join(format!("switchyard-reload-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("gw.toml");
    let write = |workers: &[&str], policy: &str| {
        let t = format!(
            "[server]\nlisten = \"127.0.0.1:0\"\n{}",
            pool_toml(&model, workers, &format!("policy = \"{policy}\""))
        );
        std::fs::write(&file, t).unwrap();
    };
    write(&[&u[0], &u[1]], "round_robin");
    let args = switchyard::cli::ServeArgs {
        config: Some(file.clone()),
        ..Default::default()
    };
    let gw = server::spawn(args.resolve().unwrap()).await.unwrap();
    gw.gateway.set_reloader(args.reloader());
    let url = gw.url();
    let failures = Arc::new(AtomicU32::new(0));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut load = Vec::new();
    for _ in 0..4 {
        let (url, model, failures, stop) =
            (url.clone(), model.clone(), failures.clone(), stop.clone());
        load.push(tokio::spawn(async move {
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                let (st, text) = stream_text(&url, chat(&model, true, 5)).await;
                if st != 200 || !text.ends_with("data: [DONE]\n\n") {
                    failures.fetch_add(1, Ordering::Relaxed);
                }
                n += 1;
            }
            n
        }));
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    write(&[&u[1], &u[2]], "random");
    gw.gateway.reload().expect("valid config reloads");
    let mark = s[2].requests_received();
    tokio::time::sleep(Duration::from_millis(300)).await;
    // An invalid file is rejected and the running config kept.
    std::fs::write(&file, "[[pools]]\nname = 3\n").unwrap();
    assert!(gw.gateway.reload().is_err());
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop.store(true, Ordering::Relaxed);
    let mut total = 0;
    for l in load {
        total += l.await.unwrap();
    }
    assert!(total > 20, "load ran: {total}");
    assert_eq!(failures.load(Ordering::Relaxed), 0);
    assert!(
        s[2].requests_received() > mark,
        "the new worker serves after reload"
    );
    let snap = gw.gateway.routes.snapshot();
    let r = snap.route(&model).unwrap();
    assert_eq!(r.policy.name(), "random");
    assert!(r.workers.iter().all(|w| *w.id != u[0]));
    gw.shutdown().await;
    std::fs::remove_dir_all(dir).ok();
}

#[tokio::test]
async fn saturated_pool_queues_then_refuses_with_retry_after() {
    let s = sims(1, 1.0).await;
    let model = sim_model();
    let gw = gateway(&pool_toml(
        &model,
        &[&s[0].url()],
        "max_concurrency_per_worker = 1\nqueue_size = 2\nqueue_timeout_ms = 10000",
    ))
    .await;
    let url = gw.url();
    let mut tasks = Vec::new();
    for _ in 0..5 {
        let (url, model) = (url.clone(), model.clone());
        tasks.push(tokio::spawn(async move {
            let r = post_chat(&url, &chat(&model, false, 20)).await;
            let retry_after = r.headers().get("retry-after").is_some();
            (r.status().as_u16(), retry_after)
        }));
    }
    let mut ok = 0;
    let mut refused = 0;
    for t in tasks {
        match t.await.unwrap() {
            (200, _) => ok += 1,
            (429, true) => refused += 1,
            other => panic!("unexpected {other:?}"),
        }
    }
    // One running + two queued are served; the other two are refused at once.
    assert_eq!((ok, refused), (3, 2));
    assert_eq!(s[0].requests_received(), 3);
    gw.shutdown().await;
}

#[tokio::test]
async fn graceful_shutdown_finishes_streams_and_turns_unready_first() {
    let s = sims(1, 5.0).await;
    let model = sim_model();
    let gw = gateway(&format!(
        "[server]\nunready_grace_ms = 400\n{}",
        pool_toml(&model, &[&s[0].url()], "")
    ))
    .await;
    let url = gw.url();
    let stream = {
        let (url, model) = (url.clone(), model.clone());
        tokio::spawn(async move { stream_text(&url, chat(&model, true, 50)).await })
    };
    eventually(Duration::from_secs(5), "stream started", || {
        let n = s[0].requests_received();
        async move { (n == 1).then_some(()) }
    })
    .await;
    let gateway = gw.gateway.clone();
    let stopping = tokio::spawn(gw.shutdown());
    eventually(Duration::from_secs(5), "shutting down", || {
        let g = gateway.clone();
        async move { g.is_shutting_down().then_some(()) }
    })
    .await;
    // During the grace period the gateway still answers, but is not ready.
    let r = client().get(format!("{url}/ready")).send().await.unwrap();
    assert_eq!(r.status(), 503);
    let (status, text) = stream.await.unwrap();
    assert_eq!(status, 200);
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    stopping.await.unwrap();
    assert!(
        client().get(format!("{url}/health")).send().await.is_err(),
        "listener closed"
    );
}

#[tokio::test]
async fn dns_names_become_workers() {
    let s = sims(1, 20.0).await;
    let model = sim_model();
    let port = s[0].addr().port();
    let gw = gateway(&format!(
        "[[pools]]\nname = \"d\"\nmodels = [\"{model}\"]\n[pools.dns]\nname = \"127.0.0.1\"\nport = {port}\ninterval_ms = 100\n"
    ))
    .await;
    let reg = gw.gateway.registry.clone();
    eventually(Duration::from_secs(5), "DNS worker discovered", || {
        let n = reg.snapshot().workers().count();
        async move { (n == 1).then_some(()) }
    })
    .await;
    assert_eq!(
        post_chat(&gw.url(), &chat(&model, false, 2)).await.status(),
        200
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn slow_header_senders_are_cut_off() {
    let s = sims(1, 20.0).await;
    let model = sim_model();
    let gw = gateway(&format!(
        "[server]\nheader_read_timeout_ms = 300\n{}",
        pool_toml(&model, &[&s[0].url()], "")
    ))
    .await;
    let mut tcp = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    tcp.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
        .await
        .unwrap();
    let t = Instant::now();
    let mut buf = Vec::new();
    // The gateway closes the connection (or resets it): either way the read ends.
    let _ = tokio::time::timeout(Duration::from_secs(5), tcp.read_to_end(&mut buf))
        .await
        .expect("connection must be closed by the gateway");
    assert!(
        t.elapsed() >= Duration::from_millis(250),
        "{:?}",
        t.elapsed()
    );
    gw.shutdown().await;
}
