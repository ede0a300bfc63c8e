//! Routing policies end to end: gateway + simulated engines on loopback ports.
//! Stats come from the engines' real `/metrics`; decisions are read from the
//! `x-switchyard-route` debug header.

mod support;

use std::time::Duration;
use support::{client, eventually, gateway, metric_sum, scrape};
use switchyard::proxy::{POLICY_HEADER, ROUTE_HEADER};
use switchyard::sim::{self, SimConfig, SimHandle};
use switchyard::telemetry::names;

const MODEL: &str = "sim-llama-8b";

async fn sims(n: usize) -> Vec<SimHandle> {
    let mut v = Vec::new();
    for i in 0..n {
        v.push(
            sim::spawn(SimConfig {
                time_scale: 20.0,
                seed: i as u64,
                model: MODEL.into(),
                ..SimConfig::default()
            })
            .await
            .expect("sim starts"),
        );
    }
    v
}

fn config(sims: &[SimHandle], policy: &str, routing: &str) -> String {
    let workers: Vec<String> = sims
        .iter()
        .map(|s| format!("{{ url = \"{}\" }}", s.url()))
        .collect();
    format!(
        "[server]\ndebug_headers = true\n[[pools]]\nname = \"p\"\nmodels = [\"{MODEL}\"]\npolicy = \"{policy}\"\nworkers = [{}]\n[pools.routing]\n{routing}\n",
        workers.join(", ")
    )
}

/// Send a chat request; return (worker url, policy, reason) from the debug header.
async fn chat(gw: &str, messages: &str, headers: &[(&str, &str)]) -> (String, String, String) {
    let mut req = client()
        .post(format!("{gw}/v1/chat/completions"))
        .body(format!(
            r#"{{"model":"{MODEL}","max_tokens":4,"messages":{messages}}}"#
        ));
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = req.send().await.unwrap();
    assert_eq!(resp.status(), 200);
    let route = resp.headers()[ROUTE_HEADER].to_str().unwrap().to_string();
    let _ = resp.bytes().await.unwrap();
    let mut parts = route.split("; ");
    let worker = parts.next().unwrap().to_string();
    let field = |p: Option<&str>, k: &str| {
        p.and_then(|s| s.strip_prefix(k))
            .unwrap_or_else(|| panic!("bad route header {route}"))
            .to_string()
    };
    let policy = field(parts.next(), "policy=");
    let reason = field(parts.next(), "reason=");
    (worker, policy, reason)
}

fn conversation(system: &str, question: &str) -> String {
    format!(
        r#"[{{"role":"system","content":"{system}"}},{{"role":"user","content":"{question}"}}]"#
    )
}

#[tokio::test]
async fn poller_reads_engine_stats_into_gateway_gauges() {
    let s = sims(2).await;
    let gw = gateway(&config(&s, "least_queue", "stats_interval_ms = 25")).await;
    let url = gw.url();
    for sim in &s {
        let id = sim.url();
        eventually(Duration::from_secs(5), "stats age gauge", || {
            let url = url.clone();
            let id = id.clone();
            async move {
                let text = scrape(&url).await;
                let age = metric_sum(&text, names::WORKER_STATS_AGE_SECONDS, &[("worker", &id)]);
                (age >= 0.0 && text.contains(names::WORKER_STATS_AGE_SECONDS)).then_some(())
            }
        })
        .await;
    }
    // KV capacity from vllm:cache_config_info reached the worker state.
    let snap = gw.gateway.registry.snapshot();
    for w in snap.workers() {
        assert!(w.state.stats.kv_capacity_tokens().unwrap() > 0);
    }
    let (_, policy, reason) = chat(&url, &conversation("s", "q"), &[]).await;
    assert_eq!(
        (policy.as_str(), reason.as_str()),
        ("least_queue", "least_queue")
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn prefix_policy_sends_a_shared_prefix_back_to_its_worker() {
    let s = sims(4).await;
    let gw = gateway(&config(&s, "prefix", "")).await;
    let url = gw.url();
    let system = "You are a meticulous assistant for the routing test. ".repeat(40);
    let (w1, policy, r1) = chat(&url, &conversation(&system, "first question"), &[]).await;
    assert_eq!((policy.as_str(), r1.as_str()), ("prefix", "new_prefix"));
    for q in ["second", "third", "fourth"] {
        let (w, _, r) = chat(&url, &conversation(&system, q), &[]).await;
        assert_eq!((w.as_str(), r.as_str()), (w1.as_str(), "prefix_hit"));
    }
    // The engine saw the prefix cached.
    let engine = switchyard::pool::stats::parse_metrics(&scrape(&w1).await);
    let hits = engine.prefix_hits.unwrap_or(0.0);
    assert!(hits > 0.0, "no prefix-cache hits on {w1}");
    // The index reports its size.
    let text = scrape(&url).await;
    assert!(metric_sum(&text, names::PREFIX_INDEX_ENTRIES, &[("pool", "p")]) > 0.0);
    assert!(metric_sum(&text, names::PREFIX_INDEX_BYTES, &[("pool", "p")]) > 0.0);
    let decisions = metric_sum(
        &text,
        names::ROUTING_DECISIONS_TOTAL,
        &[("policy", "prefix"), ("reason", "prefix_hit")],
    );
    assert_eq!(decisions, 3.0);
    gw.shutdown().await;
}

#[tokio::test]
async fn session_sticks_and_override_is_honoured_only_when_allowed() {
    let s = sims(4).await;
    let gw = gateway(&config(&s, "session", "allow_policy_override = true")).await;
    let url = gw.url();
    let (w, _, r) = chat(&url, &conversation("s", "q1"), &[("x-session-id", "abc")]).await;
    assert_eq!(r, "session");
    for q in ["q2", "q3", "q4"] {
        let (w2, _, _) = chat(&url, &conversation("s", q), &[("x-session-id", "abc")]).await;
        assert_eq!(w2, w);
    }
    let (_, policy, reason) = chat(
        &url,
        &conversation("s", "q"),
        &[
            ("x-session-id", "abc"),
            (POLICY_HEADER.as_str(), "round_robin"),
        ],
    )
    .await;
    assert_eq!(
        (policy.as_str(), reason.as_str()),
        ("round_robin", "round_robin")
    );
    gw.shutdown().await;

    let gw = gateway(&config(&s, "session", "")).await;
    let (_, policy, _) = chat(
        &gw.url(),
        &conversation("s", "q"),
        &[(POLICY_HEADER.as_str(), "round_robin")],
    )
    .await;
    assert_eq!(policy, "session", "override ignored when not allowed");
    gw.shutdown().await;
}

#[tokio::test]
async fn dead_worker_goes_stale_and_is_avoided() {
    let s = sims(2).await;
    let gw = gateway(&config(
        &s,
        "least_queue",
        "stats_interval_ms = 25\nstale_after_ms = 100",
    ))
    .await;
    let url = gw.url();
    let snap = gw.gateway.registry.snapshot();
    let now = switchyard::pool::stats::now_ms;
    eventually(Duration::from_secs(5), "both workers scraped", || {
        let fresh = snap
            .workers()
            .all(|w| w.state.stats.age_ms(now()).is_some_and(|a| a < 100));
        async move { fresh.then_some(()) }
    })
    .await;
    // Worker 0 dies: its scrapes fail from now on.
    s[0].kill();
    let dead = s[0].url();
    eventually(Duration::from_secs(5), "worker 0 stale", || {
        let stale = snap
            .workers()
            .find(|w| *w.id == *dead)
            .and_then(|w| w.state.stats.age_ms(now()))
            .is_some_and(|a| a > 100);
        async move { stale.then_some(()) }
    })
    .await;
    // Idle workers tie, and ties go by rendezvous on the prompt: with a dozen
    // different prompts some would land on worker 0 if it looked idle.
    for k in 0..12 {
        let (w, _, _) = chat(&url, &conversation("s", &format!("question {k}")), &[]).await;
        assert_eq!(w, s[1].url());
    }
    let text = scrape(&url).await;
    let tried_dead = metric_sum(&text, names::UPSTREAM_ATTEMPTS_TOTAL, &[("worker", &dead)]);
    assert_eq!(tried_dead, 0.0, "a stale worker was tried");
    gw.shutdown().await;
}
