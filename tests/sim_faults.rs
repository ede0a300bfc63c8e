//! Every fault mode of the simulated engine does what it says.

mod sim_support;

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use sim_support::*;
use switchyard::sim::{Faults, SimConfig};

fn chat_url(h: &switchyard::sim::SimHandle) -> String {
    format!("{}/v1/chat/completions", h.url())
}

async fn received(cl: &reqwest::Client, base: &str) -> f64 {
    metric(&metrics(cl, base).await, "sim_requests_received_total", "").unwrap()
}

#[tokio::test]
async fn status_faults_answer_with_openai_errors_and_count_arrivals() {
    let c = cfg();
    let h = sim(c.clone()).await;
    let cl = client();
    for code in [500u16, 503, 429] {
        let r = cl
            .post(chat_url(&h))
            .header("x-sim-fault", code.to_string())
            .json(&chat_body(&c.model, "hi", 2))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), code);
        if code == 429 {
            assert!(r.headers().contains_key("retry-after"));
        }
        let e: Value = r.json().await.unwrap();
        assert_eq!(e["error"]["code"], code);
    }
    let r = cl
        .post(chat_url(&h))
        .header("x-sim-fault", "bogus")
        .json(&chat_body(&c.model, "hi", 2))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let m = metrics(&cl, &h.url()).await;
    assert_eq!(metric(&m, "sim_requests_received_total", ""), Some(4.0));
    assert_eq!(h.requests_received(), 4);
    assert_eq!(
        metric(&m, "vllm:request_success_total", "length"),
        Some(0.0)
    );
}

#[tokio::test]
async fn hang_never_answers() {
    let c = cfg();
    let h = sim(c.clone()).await;
    let cl = client();
    let r = cl
        .post(chat_url(&h))
        .header("x-sim-fault", "hang")
        .timeout(Duration::from_millis(300))
        .json(&chat_body(&c.model, "hi", 2))
        .send()
        .await;
    assert!(r.unwrap_err().is_timeout());
    assert_eq!(received(&cl, &h.url()).await, 1.0);
}

#[tokio::test]
async fn reset_drops_the_connection_without_a_response() {
    let c = cfg();
    let h = sim(c.clone()).await;
    let cl = client();
    let start = Instant::now();
    let r = cl
        .post(chat_url(&h))
        .header("x-sim-fault", "reset")
        .timeout(Duration::from_secs(5))
        .json(&chat_body(&c.model, "hi", 2))
        .send()
        .await;
    let e = r.unwrap_err();
    assert!(!e.is_timeout() && e.status().is_none(), "{e:?}");
    assert!(start.elapsed() < Duration::from_secs(2));
    // The engine keeps serving.
    assert!(
        stream(&cl, &chat_url(&h), chat_body(&c.model, "hi", 2), None)
            .await
            .done
    );
}

#[tokio::test]
async fn slow_delays_the_first_token() {
    let c = SimConfig {
        time_scale: 20.0,
        ..cfg()
    };
    let h = sim(c.clone()).await;
    let cl = client();
    let fast = stream(&cl, &chat_url(&h), chat_body(&c.model, "hi", 2), None).await;
    let slow = stream(
        &cl,
        &chat_url(&h),
        chat_body(&c.model, "hi", 2),
        Some("slow:300"),
    )
    .await;
    assert!(slow.done);
    assert!(
        slow.ttft() >= Duration::from_millis(300),
        "{:?}",
        slow.ttft()
    );
    assert!(
        fast.ttft() < Duration::from_millis(150),
        "{:?}",
        fast.ttft()
    );
    // Non-streaming too.
    let mut body = chat_body(&c.model, "hi", 2);
    body["stream"] = json!(false);
    let t = Instant::now();
    let r = cl
        .post(chat_url(&h))
        .header("x-sim-fault", "slow:200")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(t.elapsed() >= Duration::from_millis(200));
}

#[tokio::test]
async fn die_after_streams_n_tokens_then_aborts() {
    let c = SimConfig {
        time_scale: 10.0,
        ..cfg()
    };
    let h = sim(c.clone()).await;
    let cl = client();
    for n in [1usize, 3] {
        let r = stream(
            &cl,
            &chat_url(&h),
            chat_body(&c.model, "hi", 10),
            Some(&format!("die-after:{n}")),
        )
        .await;
        assert_eq!(r.status, 200);
        assert!(r.broken, "the body must end with a transport error");
        assert!(!r.done, "no [DONE]");
        assert_eq!(r.tokens().len(), n);
        assert!(r.usage().is_none());
        assert!(r
            .events
            .iter()
            .all(|e| e["choices"][0]["finish_reason"].is_null()));
    }
    // Dying after more tokens than the request makes still never finishes cleanly.
    let r = stream(
        &cl,
        &chat_url(&h),
        chat_body(&c.model, "hi", 2),
        Some("die-after:5"),
    )
    .await;
    assert!(r.broken && !r.done);
    assert_eq!(r.tokens().len(), 2);
    // Non-streaming: the connection drops.
    let mut body = chat_body(&c.model, "hi", 10);
    body["stream"] = json!(false);
    let e = cl
        .post(chat_url(&h))
        .header("x-sim-fault", "die-after:2")
        .json(&body)
        .send()
        .await
        .unwrap_err();
    assert!(e.status().is_none());
}

#[tokio::test]
async fn health_fault_and_admin_api() {
    let c = cfg();
    let h = sim(c.clone()).await;
    let cl = client();
    let health = |cl: reqwest::Client, url: String| async move {
        cl.get(format!("{url}/health"))
            .send()
            .await
            .unwrap()
            .status()
            .as_u16()
    };
    assert_eq!(health(cl.clone(), h.url()).await, 200);
    let r = cl
        .post(format!("{}/sim/faults", h.url()))
        .json(&json!({"health_fail": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(health(cl.clone(), h.url()).await, 503);
    let f: Faults = cl
        .get(format!("{}/sim/faults", h.url()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(f.health_fail);
    h.set_faults(Faults::default());
    assert_eq!(health(cl.clone(), h.url()).await, 200);
    // Bad bodies are refused and change nothing.
    for bad in [
        json!({"error_rate": 3.0}),
        json!({"nonsense": 1}),
        json!({"always": "explode"}),
    ] {
        let r = cl
            .post(format!("{}/sim/faults", h.url()))
            .json(&bad)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400, "{bad}");
    }
    assert_eq!(health(cl, h.url()).await, 200);
}

#[tokio::test]
async fn refuse_connections_then_accept_again() {
    let c = cfg();
    let h = sim(c.clone()).await;
    let cl = client();
    h.set_faults(Faults {
        refuse_connections: true,
        ..Faults::default()
    });
    // The listener closes asynchronously: wait until a connect is refused.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match tokio::net::TcpStream::connect(h.addr()).await {
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => break,
            _ => assert!(Instant::now() < deadline, "still accepting"),
        }
        tokio::task::yield_now().await;
    }
    let e = cl
        .get(format!("{}/health", h.url()))
        .send()
        .await
        .unwrap_err();
    assert!(e.is_connect(), "{e:?}");
    h.set_faults(Faults::default());
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if let Ok(r) = cl.get(format!("{}/health", h.url())).send().await {
            assert_eq!(r.status(), 200);
            break;
        }
        assert!(Instant::now() < deadline, "not accepting again");
        tokio::task::yield_now().await;
    }
}

#[tokio::test]
async fn error_rate_is_deterministic_with_seed() {
    let faults = Faults {
        error_rate: 0.5,
        error_status: 503,
        ..Faults::default()
    };
    let c = SimConfig {
        seed: 42,
        faults: faults.clone(),
        time_scale: 50.0,
        ..cfg()
    };
    let a = sim(c.clone()).await;
    let b = sim(c.clone()).await;
    let other = sim(SimConfig {
        seed: 43,
        ..c.clone()
    })
    .await;
    let cl = client();
    let pattern = |h: &switchyard::sim::SimHandle| {
        let (cl, url, model) = (cl.clone(), chat_url(h), c.model.clone());
        async move {
            let mut out = Vec::new();
            for _ in 0..30 {
                let mut body = chat_body(&model, "x", 1);
                body["stream"] = json!(false);
                out.push(
                    cl.post(&url)
                        .json(&body)
                        .send()
                        .await
                        .unwrap()
                        .status()
                        .as_u16(),
                );
            }
            out
        }
    };
    let pa = pattern(&a).await;
    assert_eq!(pa, pattern(&b).await);
    assert_ne!(pa, pattern(&other).await);
    let errors = pa.iter().filter(|&&s| s == 503).count();
    assert!((5..=25).contains(&errors), "{pa:?}");
    assert!(pa.iter().all(|&s| s == 200 || s == 503));
}

#[tokio::test]
async fn latency_spikes_and_always_fault() {
    let c = SimConfig {
        time_scale: 20.0,
        faults: Faults {
            spike_rate: 1.0,
            spike_ms: 250,
            ..Faults::default()
        },
        ..cfg()
    };
    let h = sim(c.clone()).await;
    let cl = client();
    let r = stream(&cl, &chat_url(&h), chat_body(&c.model, "hi", 2), None).await;
    assert!(r.ttft() >= Duration::from_millis(250), "{:?}", r.ttft());
    h.set_faults(Faults {
        always: Some("502".into()),
        ..Faults::default()
    });
    let r = cl
        .post(chat_url(&h))
        .json(&chat_body(&c.model, "hi", 2))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 502);
    // A header still overrides the standing fault.
    let r = cl
        .post(chat_url(&h))
        .header("x-sim-fault", "429")
        .json(&chat_body(&c.model, "hi", 2))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
}

#[tokio::test]
async fn kill_aborts_open_streams_and_refuses_new_connections() {
    let c = SimConfig {
        time_scale: 1.0,
        step_base_ms: 10.0,
        ..cfg()
    };
    let h = sim(c.clone()).await;
    let cl = client();
    let url = chat_url(&h);
    let body = chat_body(&c.model, "hi", 500);
    let open = tokio::spawn({
        let cl = cl.clone();
        async move { stream(&cl, &url, body, None).await }
    });
    wait_metrics(&cl, &h.url(), "a running request", |m| {
        metric(m, "vllm:num_requests_running", "") == Some(1.0)
    })
    .await;
    h.kill();
    let r = tokio::time::timeout(Duration::from_secs(5), open)
        .await
        .expect("stream ends")
        .unwrap();
    assert!(r.broken && !r.done);
    assert!(r.tokens().len() < 500);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match cl.get(format!("{}/health", h.url())).send().await {
            Err(e) if e.is_connect() => break,
            _ => assert!(Instant::now() < deadline, "still accepting after kill"),
        }
        tokio::task::yield_now().await;
    }
    h.shutdown().await;
}
