//! Flow control end to end: the real `switchyard serve` binary in front of
//! simulated engines. Requests are held while every worker is saturated and
//! dispatched, when a slot frees, to the worker free *then*; strict priority
//! classes; preemption before the answer; token-weighted fairness between
//! tenants; caps and TTL shed with `Retry-After`; scale from zero. Orderings are
//! asserted on the order requests were answered with one slot (so in the order
//! they were dispatched), never on durations. A slot is freed by dropping a
//! blocking stream, a signal the test controls.

mod support;

use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;
use support::{eventually, metric_sum, scrape};
use switchyard::sim::SimHandle;
use tokio::task::JoinHandle;

const MODEL: &str = "sim-tiny";
const ADMIN_TOKEN: &str = "flow-test-admin-token";

/// A `switchyard serve` process: its client URL and, when configured, admin URL.
struct Gw {
    _child: tokio::process::Child,
    url: String,
    admin: Option<String>,
}

/// Start the binary with one pool `p` over `sims` (`pool_lines` inside the
/// pool, `tail` after it, e.g. `[pools.flow_control]`).
async fn serve(name: &str, sims: &[&SimHandle], pool_lines: &str, tail: &str) -> Gw {
    let workers: Vec<String> = sims
        .iter()
        .map(|s| format!("{{ url = \"{}\" }}", s.url()))
        .collect();
    let toml = format!(
        "[tenancy]\ntrust_tenant_header = true\nanonymous_max_priority = \"critical\"\nanonymous_allow_slo_headers = true\n[admin]\nlisten = \"127.0.0.1:0\"\ntoken_env = \"FLOW_TEST_ADMIN_TOKEN\"\nallow_loopback_workers = true\n\
         [[pools]]\nname = \"p\"\nmodels = [\"{MODEL}\"]\n{}\n\
         {pool_lines}\nworkers = [{}]\n{tail}\n",
        // Round robin unless the pool's lines name a policy.
        if pool_lines.contains("policy =") { "" } else { "policy = \"round_robin\"" },
        workers.join(", ")
    );
    let file = support::config_file(name, &toml);
    // FLOW_TEST_LOG=1 keeps the gateway's log next to the test's files.
    let log = std::env::var_os("FLOW_TEST_LOG").map(|_| file.with_extension("log"));
    let r = support::serve_binary_with(
        &file,
        &[("FLOW_TEST_ADMIN_TOKEN", ADMIN_TOKEN)],
        log.as_deref(),
    )
    .await;
    Gw {
        _child: r.child,
        url: r.url,
        admin: r.admin,
    }
}

/// A tiny simulated engine at a fifth of its speed: a blocking stream lasts
/// long enough for every step of a test, which ends it by dropping it.
async fn sim() -> SimHandle {
    let cfg = switchyard::sim::SimConfig {
        time_scale: 0.2,
        ..switchyard::sim::SimConfig::profile("tiny").unwrap()
    };
    switchyard::sim::spawn(cfg).await.expect("sim starts")
}

fn body(words: usize, max_tokens: u32, stream: bool) -> Value {
    json!({
        "model": MODEL,
        "messages": [{ "role": "user", "content": vec!["word"; words].join(" ") }],
        "max_tokens": max_tokens,
        "ignore_eos": true,
        "stream": stream,
    })
}

/// POST a chat completion with `headers`; status, headers and JSON body.
async fn post(
    url: &str,
    headers: &[(&str, &str)],
    b: &Value,
) -> (u16, reqwest::header::HeaderMap, Value) {
    let mut req = support::client()
        .post(format!("{url}/v1/chat/completions"))
        .json(b);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let r = req.send().await.unwrap();
    let (status, h) = (r.status().as_u16(), r.headers().clone());
    (status, h, r.json().await.unwrap_or(Value::Null))
}

/// A stream that occupies a worker's slot until the task is aborted.
fn blocker(url: &str) -> JoinHandle<()> {
    let url = url.to_string();
    tokio::spawn(async move {
        let r = support::client()
            .post(format!("{url}/v1/chat/completions"))
            .json(&body(4, 2000, true))
            .send()
            .await
            .unwrap();
        let _ = r.text().await;
    })
}

/// Wait until `n` requests of `class` wait in pool `p`'s queue.
async fn queued(url: &str, class: &str, n: f64) {
    eventually(Duration::from_secs(20), "requests queued", || async move {
        let m = scrape(url).await;
        (metric_sum(
            &m,
            "switchyard_queue_depth",
            &[("pool", "p"), ("class", class)],
        ) == n)
            .then_some(())
    })
    .await
}

/// Wait until `sim` has received `n` requests.
async fn received(s: &SimHandle, n: u64) {
    eventually(
        Duration::from_secs(20),
        "requests received",
        || async move { (s.requests_received() >= n).then_some(()) },
    )
    .await
}

/// Send a request in the background that records `name` in `order` once answered.
fn recorded(
    url: &str,
    order: &Arc<parking_lot::Mutex<Vec<String>>>,
    name: &str,
    headers: Vec<(&'static str, String)>,
    b: Value,
) -> JoinHandle<u16> {
    let (url, order, name) = (url.to_string(), order.clone(), name.to_string());
    tokio::spawn(async move {
        let h: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let (status, _, _) = post(&url, &h, &b).await;
        order.lock().push(name);
        status
    })
}

fn flow_counter(metrics: &str, class: &str, event: &str) -> f64 {
    metric_sum(
        metrics,
        "switchyard_flow_requests_total",
        &[("pool", "p"), ("class", class), ("event", event)],
    )
}

#[tokio::test]
async fn a_held_request_goes_to_the_worker_that_freed_up() {
    let (a, b) = (sim().await, sim().await);
    let gw = serve("flow-late", &[&a, &b], "max_concurrency_per_worker = 1", "").await;
    // Round robin: the first stream lands on one worker, the second on the other
    // (the first is at its limit either way).
    let first = blocker(&gw.url);
    eventually(Duration::from_secs(20), "first stream placed", || async {
        (a.requests_received() + b.requests_received() == 1).then_some(())
    })
    .await;
    let (busy_first, other) = if a.requests_received() == 1 {
        (&a, &b)
    } else {
        (&b, &a)
    };
    let second = blocker(&gw.url);
    received(other, 1).await;
    // Both saturated: this one is held. Round robin would send it to the worker
    // of the first stream next; the second stream's worker frees first.
    let held = {
        let url = gw.url.clone();
        tokio::spawn(async move { post(&url, &[], &body(4, 3, false)).await.0 })
    };
    queued(&gw.url, "normal", 1.0).await;
    second.abort();
    assert_eq!(held.await.unwrap(), 200);
    assert_eq!(
        other.requests_received(),
        2,
        "dispatched to the worker that freed up"
    );
    assert_eq!(busy_first.requests_received(), 1);
    first.abort();
}

#[tokio::test]
async fn engine_stats_saturate_and_a_scrape_showing_room_dispatches() {
    let s = sim().await;
    // No in-flight limit: the engine's own running count (scraped) holds requests.
    let gw = serve(
        "flow-stats",
        &[&s],
        "",
        "[pools.routing]\nstats_interval_ms = 50\n[pools.flow_control]\nmax_running = 1",
    )
    .await;
    let stream = blocker(&gw.url);
    received(&s, 1).await;
    eventually(
        Duration::from_secs(20),
        "a scrape shows the stream running",
        || async {
            let m = scrape(&gw.url).await;
            (metric_sum(&m, "switchyard_worker_running", &[]) >= 1.0).then_some(())
        },
    )
    .await;
    let held = {
        let url = gw.url.clone();
        tokio::spawn(async move { post(&url, &[], &body(4, 3, false)).await.0 })
    };
    queued(&gw.url, "normal", 1.0).await;
    assert_eq!(
        s.requests_received(),
        1,
        "held in the gateway, not sent to the engine"
    );
    stream.abort();
    assert_eq!(held.await.unwrap(), 200);
    assert_eq!(s.requests_received(), 2);
}

#[tokio::test]
async fn classes_are_served_in_strict_order() {
    let s = sim().await;
    let gw = serve("flow-prio", &[&s], "max_concurrency_per_worker = 1", "").await;
    let stream = blocker(&gw.url);
    received(&s, 1).await;
    let order = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for class in ["low", "normal", "high", "critical"] {
        let h = vec![("x-switchyard-priority", class.to_string())];
        tasks.push(recorded(&gw.url, &order, class, h, body(4, 3, false)));
        queued(&gw.url, class, 1.0).await;
    }
    stream.abort();
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    assert_eq!(*order.lock(), ["critical", "high", "normal", "low"]);
    let m = scrape(&gw.url).await;
    for class in ["low", "normal", "high", "critical"] {
        assert_eq!(flow_counter(&m, class, "queued"), 1.0, "{class}");
        assert_eq!(flow_counter(&m, class, "dispatched"), 1.0, "{class}");
    }
}

#[tokio::test]
async fn a_lower_class_is_preempted_before_its_answer_and_still_answered() {
    let s = sim().await;
    let gw = serve(
        "flow-preempt",
        &[&s],
        "max_concurrency_per_worker = 1",
        "[pools.flow_control]\npreemption = \"requeue\"",
    )
    .await;
    let order = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let low_h = vec![("x-switchyard-priority", "low".to_string())];
    // Non-streamed: nothing reaches the client until the whole answer is ready.
    let low = recorded(&gw.url, &order, "low", low_h, body(4, 300, false));
    received(&s, 1).await;
    let crit_h = vec![("x-switchyard-priority", "critical".to_string())];
    let critical = recorded(&gw.url, &order, "critical", crit_h, body(4, 3, false));
    assert_eq!(critical.await.unwrap(), 200);
    assert_eq!(low.await.unwrap(), 200, "the preempted request is answered");
    assert_eq!(*order.lock(), ["critical", "low"]);
    // low, critical, low again: the preempted attempt was re-sent, once.
    assert_eq!(s.requests_received(), 3);
    let m = scrape(&gw.url).await;
    assert_eq!(flow_counter(&m, "low", "preempted"), 1.0);
    assert_eq!(flow_counter(&m, "critical", "preempted"), 0.0);
}

#[tokio::test]
async fn preemption_may_answer_a_retryable_error_instead() {
    let s = sim().await;
    let gw = serve(
        "flow-preempt-reject",
        &[&s],
        "max_concurrency_per_worker = 1",
        "[pools.flow_control]\npreemption = \"reject\"",
    )
    .await;
    let low = {
        let url = gw.url.clone();
        tokio::spawn(async move {
            post(
                &url,
                &[("x-switchyard-priority", "low")],
                &body(4, 300, false),
            )
            .await
        })
    };
    received(&s, 1).await;
    let (status, _, _) = post(
        &gw.url,
        &[("x-switchyard-priority", "high")],
        &body(4, 3, false),
    )
    .await;
    assert_eq!(status, 200);
    let (status, headers, err) = low.await.unwrap();
    assert_eq!(status, 503, "{err}");
    assert!(headers.contains_key("retry-after"));
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("preempted"),
        "{err}"
    );
}

#[tokio::test]
async fn a_tenant_sending_ten_times_the_tokens_gets_its_share_only() {
    let s = sim().await;
    let gw = serve("flow-fair", &[&s], "max_concurrency_per_worker = 1", "").await;
    let stream = blocker(&gw.url);
    received(&s, 1).await;
    let order = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    // The heavy tenant queues first, six prompts of 10× the light one's.
    for i in 1..=6 {
        let h = vec![("x-switchyard-tenant", "heavy".to_string())];
        tasks.push(recorded(&gw.url, &order, "heavy", h, body(400, 2, false)));
        queued(&gw.url, "normal", i as f64).await;
    }
    for i in 1..=3 {
        let h = vec![("x-switchyard-tenant", "light".to_string())];
        tasks.push(recorded(&gw.url, &order, "light", h, body(40, 2, false)));
        queued(&gw.url, "normal", (6 + i) as f64).await;
    }
    stream.abort();
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    let order = order.lock().clone();
    // First come, first served would answer all six heavy requests first.
    let second_heavy = order
        .iter()
        .enumerate()
        .filter(|(_, t)| *t == "heavy")
        .nth(1)
        .unwrap()
        .0;
    let last_light = order.iter().rposition(|t| t == "light").unwrap();
    assert!(last_light < second_heavy, "{order:?}");
    let m = scrape(&gw.url).await;
    let tokens = |t: &str| {
        metric_sum(
            &m,
            "switchyard_flow_dispatched_tokens_total",
            &[("pool", "p"), ("tenant", t)],
        )
    };
    assert!(
        tokens("heavy") > 5.0 * tokens("light"),
        "{} vs {}",
        tokens("heavy"),
        tokens("light")
    );
}

/// A stream of `tenant` with a prompt of `words` that holds a slot until
/// aborted (within the tiny model's 2,048-token context).
fn tenant_blocker(url: &str, tenant: &'static str, words: usize) -> JoinHandle<()> {
    let url = url.to_string();
    tokio::spawn(async move {
        let r = support::client()
            .post(format!("{url}/v1/chat/completions"))
            .header("x-switchyard-tenant", tenant)
            .json(&body(words, 1000, true))
            .send()
            .await
            .unwrap();
        let _ = r.text().await;
    })
}

#[tokio::test]
async fn a_tenant_over_its_token_share_leaves_the_reserved_slot_to_the_other() {
    let s = sim().await;
    let gw = serve(
        "flow-share",
        &[&s],
        "max_concurrency_per_worker = 3",
        "[pools.flow_control]\nreserved_slots = 1\n",
    )
    .await;
    // Both tenants active; the heavy one holds far more tokens in flight.
    let light = tenant_blocker(&gw.url, "light", 4);
    received(&s, 1).await;
    let heavy = tenant_blocker(&gw.url, "heavy", 400);
    received(&s, 2).await;
    // One slot is free, but it is the reserved one: the heavy tenant waits.
    let order = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let h = vec![("x-switchyard-tenant", "heavy".to_string())];
    let held = recorded(&gw.url, &order, "heavy", h, body(400, 2, false));
    queued(&gw.url, "normal", 1.0).await;
    assert_eq!(s.requests_received(), 2, "the reserved slot stays free");
    // The light tenant's next request takes it, past the heavy one's.
    let h = vec![("x-switchyard-tenant", "light".to_string())];
    let passed = recorded(&gw.url, &order, "light", h, body(4, 2, false));
    assert_eq!(passed.await.unwrap(), 200);
    assert_eq!(order.lock().as_slice(), ["light"]);
    // A slot the heavy tenant's own stream frees is the heavy waiter's.
    heavy.abort();
    assert_eq!(held.await.unwrap(), 200);
    assert_eq!(order.lock().as_slice(), ["light", "heavy"]);
    light.abort();
}

#[tokio::test]
async fn caps_and_ttl_shed_with_retry_after() {
    let s = sim().await;
    let gw = serve(
        "flow-shed",
        &[&s],
        "max_concurrency_per_worker = 1\nqueue_size = 1",
        "[pools.flow_control]\nmax_queued_bytes = 4096\nttl_ms = { normal = 10000 }",
    )
    .await;
    let stream = blocker(&gw.url);
    received(&s, 1).await;
    // A body over the byte cap is refused at once.
    let (status, h, err) = post(&gw.url, &[], &body(2000, 3, false)).await;
    assert_eq!(
        (status, h.contains_key("retry-after")),
        (429, true),
        "{err}"
    );
    assert_eq!(err["error"]["code"], "queue_full", "{err}");
    // One waits (normal, 10 s TTL: long enough that the next request surely
    // finds it still queued on a slow machine); the next finds the queue full.
    let waiting = {
        let url = gw.url.clone();
        tokio::spawn(async move { post(&url, &[], &body(4, 3, false)).await })
    };
    queued(&gw.url, "normal", 1.0).await;
    let (status, _, err) = post(&gw.url, &[], &body(4, 3, false)).await;
    assert_eq!(
        (status, err["error"]["code"].as_str()),
        (429, Some("queue_full"))
    );
    let (status, h, err) = waiting.await.unwrap();
    assert_eq!((status, h.contains_key("retry-after")), (429, true));
    assert_eq!(err["error"]["code"], "queue_timeout", "{err}");
    // A full queue sheds a lower class's waiter for a higher one.
    let low = {
        let url = gw.url.clone();
        tokio::spawn(async move {
            post(
                &url,
                &[("x-switchyard-priority", "low")],
                &body(4, 3, false),
            )
            .await
        })
    };
    queued(&gw.url, "low", 1.0).await;
    let high = {
        let url = gw.url.clone();
        tokio::spawn(async move {
            post(
                &url,
                &[("x-switchyard-priority", "high")],
                &body(4, 3, false),
            )
            .await
            .0
        })
    };
    let (status, h, err) = low.await.unwrap();
    assert_eq!((status, h.contains_key("retry-after")), (429, true));
    assert_eq!(err["error"]["code"], "queue_evicted", "{err}");
    stream.abort();
    assert_eq!(high.await.unwrap(), 200);
    let m = scrape(&gw.url).await;
    let shed = |class: &str, reason: &str| {
        metric_sum(
            &m,
            "switchyard_flow_shed_total",
            &[("pool", "p"), ("class", class), ("reason", reason)],
        )
    };
    assert_eq!(shed("normal", "full"), 2.0);
    assert_eq!(shed("normal", "ttl"), 1.0);
    assert_eq!(shed("low", "evicted"), 1.0);
}

#[tokio::test]
async fn a_pool_with_no_ready_worker_waits_for_one_and_asks_for_a_replica() {
    let (first, added) = (sim().await, sim().await);
    let gw = serve(
        "flow-zero",
        &[&first],
        "",
        "[pools.flow_control]\nscale_from_zero = true\nttl_ms = { normal = 60000 }\n\
         [scaling]\nmin_replicas = 0\nscale_down_stabilization_ms = 0",
    )
    .await;
    let admin = gw.admin.clone().expect("admin listener");
    let c = support::client();
    // Scale to zero: the only worker drains and leaves.
    let r = c
        .post(format!("{admin}/admin/workers/drain"))
        .bearer_auth(ADMIN_TOKEN)
        .json(&json!({ "url": first.url() }))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success());
    let desired = |m: &str| metric_sum(m, "switchyard_pool_desired_replicas", &[("pool", "p")]);
    eventually(
        Duration::from_secs(20),
        "no replica wanted while idle",
        || async { (desired(&scrape(&gw.url).await) == 0.0).then_some(()) },
    )
    .await;
    let held = {
        let url = gw.url.clone();
        tokio::spawn(async move { post(&url, &[], &body(4, 3, false)).await.0 })
    };
    queued(&gw.url, "normal", 1.0).await;
    eventually(
        Duration::from_secs(20),
        "the scaling signal asks for a replica",
        || async {
            let m = scrape(&gw.url).await;
            let want = metric_sum(&m, "switchyard_pool_desired_replicas", &[("pool", "p")]);
            (want >= 1.0).then_some(())
        },
    )
    .await;
    // A worker appears (as an autoscaler's new replica would, via the admin API).
    let r = c
        .post(format!("{admin}/admin/workers"))
        .bearer_auth(ADMIN_TOKEN)
        .json(&json!({ "pool": "p", "url": added.url() }))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success());
    assert_eq!(held.await.unwrap(), 200);
    assert_eq!(added.requests_received(), 1);
    assert_eq!(first.requests_received(), 0);
}

/// An L4-profile engine serving this file's model at a quarter of its speed:
/// much slower to a first token than [`sim`] (a 220 ms step against 10 ms).
async fn slow_sim() -> SimHandle {
    let cfg = switchyard::sim::SimConfig {
        time_scale: 0.25,
        model: MODEL.into(),
        ..switchyard::sim::SimConfig::profile("llama-8b-l4").unwrap()
    };
    switchyard::sim::spawn(cfg).await.expect("sim starts")
}

/// Teach the latency model of every worker in `sims`: short streams, one at a
/// time, round robin (where the pool lets a request name its policy), until
/// each worker has answered enough of them for its model to speak.
async fn learn(url: &str, sims: &[&SimHandle]) {
    let need = switchyard::pool::predict::MIN_SAMPLES;
    let start: Vec<u64> = sims.iter().map(|s| s.requests_received()).collect();
    for i in 0..60 {
        if sims
            .iter()
            .zip(&start)
            .all(|(s, n)| s.requests_received() >= n + need)
        {
            return;
        }
        let rr = [("x-switchyard-policy", "round_robin")];
        let (status, _, _) = post(url, &rr, &body(4, 2, true)).await;
        assert_eq!(status, 200, "warm-up request {i}");
    }
    panic!("the workers did not answer {need} warm-up requests each within 60");
}

#[tokio::test]
async fn a_held_request_that_can_no_longer_meet_its_objective_is_shed_while_it_waits() {
    let s = sim().await;
    // A class TTL of ten minutes: only the objective can end the wait early.
    let gw = serve(
        "flow-slo",
        &[&s],
        "max_concurrency_per_worker = 1",
        "[pools.flow_control]\nttl_ms = { normal = 600000 }\n\
         [pools.routing]\nslo_unattainable = \"shed\"",
    )
    .await;
    learn(&gw.url, &[&s]).await;
    let before = s.requests_received();
    let stream = blocker(&gw.url);
    received(&s, before + 1).await;
    // Attainable when it arrives (the engine answers in tens of ms), so it is
    // held; once the time it has waited plus the best prediction passes 1.5 s it
    // is shed, while the slot is still taken.
    let (status, h, err) = post(&gw.url, &[("x-slo-ttft-ms", "1500")], &body(4, 3, true)).await;
    assert_eq!(
        (status, h.contains_key("retry-after")),
        (503, true),
        "{err}"
    );
    assert_eq!(err["error"]["code"], "slo_unattainable", "{err}");
    assert!(!stream.is_finished(), "shed while the slot was still taken");
    let m = scrape(&gw.url).await;
    let shed = metric_sum(
        &m,
        "switchyard_flow_shed_total",
        &[("pool", "p"), ("class", "normal"), ("reason", "slo")],
    );
    assert_eq!(shed, 1.0, "left the queue for its objective, not its TTL");
    assert_eq!(
        flow_counter(&m, "normal", "queued"),
        1.0,
        "it was held first"
    );
    // An objective no worker is predicted to meet even after no wait is shed
    // without queueing.
    let (status, _, err) = post(&gw.url, &[("x-slo-ttft-ms", "1")], &body(4, 3, true)).await;
    assert_eq!(
        (status, err["error"]["code"].as_str()),
        (503, Some("slo_unattainable"))
    );
    let m = scrape(&gw.url).await;
    assert_eq!(flow_counter(&m, "normal", "queued"), 1.0, "not queued");
    stream.abort();
}

#[tokio::test]
async fn a_short_request_holds_out_for_a_much_faster_worker_and_a_long_one_does_not() {
    let (fast, slow) = (sim().await, slow_sim().await);
    let gw = serve(
        "flow-faster",
        &[&fast, &slow],
        "policy = \"slo\"\nmax_concurrency_per_worker = 1",
        "[pools.routing]\nstats_interval_ms = 50\nallow_policy_override = true\n\
         [pools.flow_control]\nhold_for_faster = 2.0",
    )
    .await;
    learn(&gw.url, &[&fast, &slow]).await;
    // Both idle: the long stream goes to the fast worker.
    let (f0, s0) = (fast.requests_received(), slow.requests_received());
    let stream = blocker(&gw.url);
    received(&fast, f0 + 1).await;
    assert_eq!(slow.requests_received(), s0);
    // The fast worker is taken for a long while by its model's reckoning (its
    // answer is to be 2000 tokens), so a fast slot is not expected before the
    // slow worker would answer: 300 tokens to go there at once.
    let long = {
        let url = gw.url.clone();
        tokio::spawn(async move { post(&url, &[], &body(4, 300, true)).await.0 })
    };
    received(&slow, s0 + 1).await;
    let m = scrape(&gw.url).await;
    assert_eq!(flow_counter(&m, "normal", "queued"), 0.0, "not held");
    long.abort();
    let slow_url = slow.url();
    eventually(Duration::from_secs(20), "the slow worker freed", || async {
        let m = scrape(&gw.url).await;
        (metric_sum(&m, "switchyard_worker_in_flight", &[("worker", &slow_url)]) == 0.0)
            .then_some(())
    })
    .await;
    // A short answer, though: each fast slot's turn is expected to come round
    // well before the slow worker's first token, so it waits in the queue with
    // the slow worker idle — until it has waited as long as that worker would
    // cost it extra, and takes it (the fast one still busy).
    let (status, _, _) = post(&gw.url, &[], &body(4, 2, true)).await;
    assert_eq!(status, 200);
    let m = scrape(&gw.url).await;
    assert_eq!(flow_counter(&m, "normal", "queued"), 1.0, "held first");
    assert_eq!(flow_counter(&m, "normal", "dispatched"), 1.0);
    assert!(!stream.is_finished(), "the fast worker was still busy");
    assert_eq!(
        slow.requests_received(),
        s0 + 2,
        "then served by the slow worker"
    );
    stream.abort();
}
