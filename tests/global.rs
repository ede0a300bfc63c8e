//! Global routing: fallback chains to an external HTTPS provider with model
//! rewrite and key injection, LoRA adapters, weighted splits between pools,
//! locality with spill-over and hysteresis, data residency, cost-aware placement
//! across regions and region outages. Every test drives a real gateway over real
//! sockets against simulated engines and counts what each engine received.
//!
//! Metrics are process-wide in a test binary, so tests that assert exact counter
//! values use region, pool and model names of their own.

mod support;

use serde_json::json;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use support::scripted::Scripted;
use support::*;
use switchyard::sim::SimHandle;
use switchyard::telemetry::names;
use tokio::time::Instant;

/// A CA the test trusts and a server config for `localhost` signed by it.
fn test_pki(dir: &std::path::Path) -> (std::path::PathBuf, Arc<rustls::ServerConfig>) {
    let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let leaf_key = rcgen::KeyPair::generate().unwrap();
    let leaf = rcgen::CertificateParams::new(vec!["localhost".to_string()])
        .unwrap()
        .signed_by(&leaf_key, &ca_cert, &ca_key)
        .unwrap();
    let ca_file = dir.join("ca.pem");
    std::fs::write(&ca_file, ca_cert.pem()).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![leaf.der().clone()],
            rustls_pki_types::PrivateKeyDer::Pkcs8(leaf_key.serialize_der().into()),
        )
        .unwrap();
    (ca_file, Arc::new(cfg))
}

#[tokio::test]
async fn down_pool_falls_back_to_an_https_provider_with_rewrite_and_key() {
    let dir = std::env::temp_dir().join(format!("switchyard-global-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (ca, tls) = test_pki(&dir);
    let (provider, _tx) = Scripted::start_tls(tls).await;
    std::env::set_var("SWITCHYARD_TEST_PROVIDER_KEY", "sk-provider");
    let dead = {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let gw = gateway(&format!(
        r#"
[[pools]]
name = "self-hosted"
models = ["llama-8b"]
fallback = ["provider"]
max_attempts = 1
workers = [{{ url = "{dead}" }}]

[[pools]]
name = "provider"
models = ["provider-only"]
upstream_model = "gpt-4o-mini"
upstream_api_key_env = "SWITCHYARD_TEST_PROVIDER_KEY"
upstream_ca_file = "{}"
workers = [{{ url = "{}" }}]
"#,
        ca.display(),
        provider.url
    ))
    .await;
    let r = client()
        .post(format!("{}/v1/chat/completions", gw.url()))
        .header("authorization", "Bearer client-key")
        .body(r#"{"model":"llama-8b","messages":[{"role":"user","content":"hi"}]}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    let rec = std::mem::take(&mut *provider.recorded.lock().unwrap());
    assert_eq!(rec.bodies.len(), 1, "the provider answered over TLS");
    assert_eq!(rec.bodies[0]["model"], "gpt-4o-mini");
    assert_eq!(rec.headers[0]["authorization"], "Bearer sk-provider");
    let m = scrape(&gw.url()).await;
    assert_eq!(
        metric_sum(
            &m,
            switchyard::telemetry::names::FALLBACKS_TOTAL,
            &[("pool", "self-hosted"), ("target", "provider")]
        ),
        1.0
    );
    gw.shutdown().await;
    std::fs::remove_dir_all(dir).ok();
}

#[tokio::test]
async fn an_untrusted_certificate_is_refused() {
    let dir = std::env::temp_dir().join(format!("switchyard-untrusted-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (_ca, tls) = test_pki(&dir);
    let (provider, _tx) = Scripted::start_tls(tls).await;
    let gw = gateway(&pool_toml("m", &[&provider.url], "max_attempts = 1")).await;
    let r = client()
        .post(format!("{}/v1/chat/completions", gw.url()))
        .body(r#"{"model":"m","messages":[]}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 502);
    assert!(provider.recorded.lock().unwrap().bodies.is_empty());
    gw.shutdown().await;
    std::fs::remove_dir_all(dir).ok();
}

#[tokio::test]
async fn lora_adapters_route_to_their_pool_unchanged() {
    let (base, _t1) = Scripted::start().await;
    let (lora, _t2) = Scripted::start().await;
    let gw = gateway(&format!(
        "[[pools]]\nname = \"base\"\nmodels = [\"llama\"]\nworkers = [{{ url = \"{}\" }}]\n\
         [[pools]]\nname = \"adapters\"\nmodels = [\"llama-lora-host\"]\nlora_adapters = [\"sql-lora\"]\nworkers = [{{ url = \"{}\" }}]\n",
        base.url, lora.url
    ))
    .await;
    let r = client()
        .post(format!("{}/v1/chat/completions", gw.url()))
        .body(r#"{"model":"sql-lora","messages":[]}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(base.recorded.lock().unwrap().bodies.is_empty());
    assert_eq!(lora.recorded.lock().unwrap().bodies[0]["model"], "sql-lora");
    let models: serde_json::Value = get_json(&format!("{}/v1/models", gw.url())).await;
    assert!(models["data"]
        .as_array()
        .unwrap()
        .iter()
        .any(|m| m["id"] == "sql-lora"));
    gw.shutdown().await;
}

// ---------------------------------------------------------------------------
// Helpers

/// A chat request body for `model`.
fn chat(model: &str, max_tokens: u32) -> serde_json::Value {
    json!({"model": model, "max_tokens": max_tokens,
           "messages": [{"role": "user", "content": "global routing"}]})
}

/// POST a chat completion with extra headers: (status, worker from the debug
/// route header, body text).
async fn post(
    url: &str,
    body: &serde_json::Value,
    headers: &[(&str, &str)],
) -> (u16, Option<String>, String) {
    let mut rb = client()
        .post(format!("{url}/v1/chat/completions"))
        .json(body);
    for (k, v) in headers {
        rb = rb.header(*k, *v);
    }
    let r = rb.send().await.unwrap();
    let status = r.status().as_u16();
    let worker = r
        .headers()
        .get(switchyard::proxy::ROUTE_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .map(str::to_string);
    (status, worker, r.text().await.unwrap_or_default())
}

/// Requests received so far by each sim.
fn counts(s: &[SimHandle]) -> Vec<u64> {
    s.iter().map(|s| s.requests_received()).collect()
}

fn delta(after: &[u64], before: &[u64]) -> Vec<u64> {
    after.iter().zip(before).map(|(a, b)| a - b).collect()
}

/// Whether the gateway currently takes requests to `worker`.
fn available(gw: &switchyard::server::ServerHandle, worker: &str) -> bool {
    let snap = gw.gateway.registry.snapshot();
    let up = snap
        .workers()
        .find(|w| &*w.id == worker)
        .is_some_and(|w| w.is_available());
    up
}

// ---------------------------------------------------------------------------
// 1. Weighted splits

/// A 95/5 canary split: 1,000 requests without a session land within ±2 points
/// of the weights (counted on the engines), and every session sticks to one pool.
#[tokio::test]
async fn weighted_split_holds_95_5_and_sessions_stick() {
    let s = sims(2, 50.0).await;
    let model = sim_model();
    let gw = gateway(&format!(
        r#"
[server]
debug_headers = true
[[splits]]
model = "split-chat"
targets = [{{ pool = "split-stable", weight = 95 }}, {{ pool = "split-canary", weight = 5 }}]
[[pools]]
name = "split-stable"
models = ["{model}"]
workers = [{{ url = "{}" }}]
[[pools]]
name = "split-canary"
models = ["split-canary-model"]
upstream_model = "{model}"
workers = [{{ url = "{}" }}]
"#,
        s[0].url(),
        s[1].url()
    ))
    .await;
    let url = gw.url();
    // Without a session: 1,000 requests, 16 at a time.
    let before = counts(&s);
    let body = chat("split-chat", 1);
    let mut tasks = Vec::new();
    for t in 0..16 {
        let (url, body) = (url.clone(), body.clone());
        tasks.push(tokio::spawn(async move {
            let n = 1_000 / 16 + usize::from(t < 1_000 % 16);
            for _ in 0..n {
                let (st, _, text) = post(&url, &body, &[]).await;
                assert_eq!(st, 200, "{text}");
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let d = delta(&counts(&s), &before);
    assert_eq!(d[0] + d[1], 1_000, "{d:?}");
    let canary = d[1] as f64 / 10.0;
    println!(
        "split 95/5 over 1,000 requests: stable {} / canary {} ({canary:.1} %)",
        d[0], d[1]
    );
    assert!(
        (3.0..=7.0).contains(&canary),
        "canary share {canary} % (95/5 ± 2 points)"
    );

    // Sessions: 200 of them, 3 requests each, by header or by the body's `user`.
    let mut owner: HashMap<String, String> = HashMap::new();
    let mut on_canary = 0;
    for round in 0..3 {
        for k in 0..200 {
            let key = format!("session-{k}");
            let (st, worker, text) = if k % 2 == 0 {
                post(&url, &body, &[("x-session-id", &key)]).await
            } else {
                let mut b = body.clone();
                b["user"] = json!(key);
                post(&url, &b, &[]).await
            };
            assert_eq!(st, 200, "{text}");
            let worker = worker.expect("debug route header");
            match owner.get(&key) {
                None => {
                    on_canary += usize::from(worker == s[1].url());
                    owner.insert(key, worker);
                }
                Some(w) => assert_eq!(w, &worker, "session {key} moved in round {round}"),
            }
        }
    }
    println!("sticky sessions on the canary: {on_canary} of 200");
    assert!(
        on_canary <= 30,
        "{on_canary} of 200 sessions on a 5 % canary"
    );
    let m = scrape(&url).await;
    let by = |pool: &str, sticky: &str| {
        metric_sum(
            &m,
            names::SPLIT_DECISIONS_TOTAL,
            &[("model", "split-chat"), ("pool", pool), ("sticky", sticky)],
        )
    };
    assert_eq!(
        by("split-stable", "false") + by("split-canary", "false"),
        1_000.0
    );
    assert_eq!(by("split-canary", "false"), d[1] as f64);
    assert_eq!(
        by("split-stable", "true") + by("split-canary", "true"),
        600.0
    );
    // The split name is listed like any model.
    let models: serde_json::Value = get_json(&format!("{url}/v1/models")).await;
    assert!(models["data"]
        .as_array()
        .unwrap()
        .iter()
        .any(|m| m["id"] == "split-chat"));
    gw.shutdown().await;
}

// ---------------------------------------------------------------------------
// 2. Locality with spill-over and hysteresis

/// All traffic stays local while the local worker has room; once it is at its
/// concurrency limit new requests spill to the next region (counted with reason
/// `local_overloaded`); after the local load falls, traffic returns only when it
/// has stayed under the low watermark for `min_dwell_ms`.
#[tokio::test]
async fn locality_prefers_local_spills_under_overload_and_returns_with_hysteresis() {
    let s = sims(2, 50.0).await; // s[0] in lo-eu (local), s[1] in lo-us
    let model = sim_model();
    let dwell_ms = 400;
    let gw = gateway(&format!(
        r#"
[server]
region = "lo-eu"
debug_headers = true
[locality]
high_watermark = 0.8
low_watermark = 0.5
min_dwell_ms = {dwell_ms}
[regions.lo-eu]
spill_order = ["lo-us"]
rtt_ms = {{ lo-us = 80 }}
[regions.lo-us]
[[pools]]
name = "lo-pool"
models = ["{model}"]
max_concurrency_per_worker = 4
workers = [
  {{ url = "{}", labels = {{ region = "lo-eu", zone = "lo-eu-1a", accelerator = "h100", provider = "self" }} }},
  {{ url = "{}", labels = {{ region = "lo-us", zone = "lo-us-1b", accelerator = "h100", provider = "self" }} }},
]
"#,
        s[0].url(),
        s[1].url()
    ))
    .await;
    let url = gw.url();
    let (eu, us) = (s[0].url(), s[1].url());
    // Healthy and under the bound: everything local.
    let before = counts(&s);
    let body = chat(&model, 2);
    let mut tasks = Vec::new();
    for _ in 0..2 {
        let (url, body) = (url.clone(), body.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..20 {
                assert_eq!(post(&url, &body, &[]).await.0, 200);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(delta(&counts(&s), &before), vec![40, 0], "all local");

    // Fill the local worker to its limit with four slow requests, one at a time.
    let mut slow = Vec::new();
    for k in 1..=4u64 {
        let (url, body) = (url.clone(), body.clone());
        slow.push(tokio::spawn(async move {
            post(&url, &body, &[("x-sim-fault", "slow:3000")]).await
        }));
        let w = gw.gateway.registry.worker_state(&eu).unwrap();
        eventually(
            Duration::from_secs(5),
            "slow request in flight locally",
            || {
                let w = w.clone();
                async move { (w.in_flight.load(Ordering::Relaxed) == k).then_some(()) }
            },
        )
        .await;
    }
    let before = counts(&s);
    for _ in 0..20 {
        let (st, worker, _) = post(&url, &body, &[]).await;
        assert_eq!((st, worker.as_deref()), (200, Some(us.as_str())), "spilled");
    }
    assert_eq!(delta(&counts(&s), &before), vec![0, 20]);
    let m = scrape(&url).await;
    assert_eq!(
        metric_sum(
            &m,
            names::CROSS_REGION_REQUESTS_TOTAL,
            &[
                ("from", "lo-eu"),
                ("to", "lo-us"),
                ("reason", "local_overloaded")
            ]
        ),
        20.0
    );
    assert_eq!(
        metric_sum(&m, names::LOCALITY_SPILLING, &[("pool", "lo-pool")]),
        1.0
    );
    for t in slow {
        let (st, worker, _) = t.await.unwrap();
        assert_eq!((st, worker.as_deref()), (200, Some(eu.as_str())));
    }
    // Local load is 0 now; traffic returns only after the dwell.
    let calm = Instant::now();
    let returned = eventually(Duration::from_secs(10), "traffic back home", || {
        let (url, body, eu) = (url.clone(), body.clone(), eu.clone());
        async move {
            let (st, worker, _) = post(&url, &body, &[]).await;
            assert_eq!(st, 200);
            (worker.as_deref() == Some(eu.as_str())).then(|| calm.elapsed())
        }
    })
    .await;
    println!("traffic returned {returned:?} after the local load fell (min_dwell_ms = {dwell_ms})");
    assert!(
        returned >= Duration::from_millis(dwell_ms - 50),
        "returned after {returned:?}, before the dwell"
    );
    let before = counts(&s);
    for _ in 0..20 {
        assert_eq!(post(&url, &body, &[]).await.0, 200);
    }
    assert_eq!(
        delta(&counts(&s), &before),
        vec![20, 0],
        "home again, and staying"
    );
    let m = scrape(&url).await;
    assert_eq!(
        metric_sum(&m, names::LOCALITY_SPILLING, &[("pool", "lo-pool")]),
        0.0
    );
    gw.shutdown().await;
}

// ---------------------------------------------------------------------------
// 3. Data residency

/// Three regions. The gateway is in eu-west and spills to us-east first. With
/// eu-west killed under load, `eu` requests (by header and by tenant key) go only
/// to eu-central — never to us-east, although it is first in the spill order —
/// and none fails; unrestricted requests spill to us-east. With eu-central down
/// too, `eu` requests get a 503 naming the constraint while unrestricted ones
/// still succeed via us-east.
#[tokio::test]
async fn residency_is_never_violated_when_regions_fail() {
    let us = sims(2, 50.0).await;
    let ew = sims(2, 50.0).await;
    let ec = sims(1, 50.0).await;
    let model = sim_model();
    std::env::set_var("SWITCHYARD_TEST_EU_TENANT_KEY", "sk-eu-tenant-123");
    let w = |s: &SimHandle, region: &str| {
        format!(
            "{{ url = \"{}\", labels = {{ region = \"{region}\" }} }}",
            s.url()
        )
    };
    let gw = gateway(&format!(
        r#"
[server]
region = "eu-west"
debug_headers = true
[health]
interval_ms = 200
unhealthy_threshold = 1
# Regions fail as a whole here: allow ejecting all of them.
max_ejected_percent = 100
[regions.eu-west]
spill_order = ["us-east", "eu-central"]
rtt_ms = {{ us-east = 80, eu-central = 15 }}
[regions.eu-central]
[regions.us-east]
[residency]
eu = ["eu-west", "eu-central"]
[[tenants]]
name = "eu-tenant"
api_key_env = "SWITCHYARD_TEST_EU_TENANT_KEY"
residency = "eu"
[[pools]]
name = "res-pool"
models = ["{model}"]
policy = "least_queue"
workers = [{}, {}, {}, {}, {}]
"#,
        w(&us[0], "us-east"),
        w(&us[1], "us-east"),
        w(&ew[0], "eu-west"),
        w(&ew[1], "eu-west"),
        w(&ec[0], "eu-central"),
    ))
    .await;
    let url = gw.url();
    let body = chat(&model, 4);
    let eu_header: &[(&str, &str)] = &[("x-switchyard-residency", "eu")];
    let eu_tenant: &[(&str, &str)] = &[("authorization", "Bearer sk-eu-tenant-123")];

    // Phase A: eu load (half by header, half by tenant key); eu-west dies midway.
    let us_before = counts(&us);
    let ec_before = counts(&ec);
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for t in 0..4 {
        let (url, body, stop) = (url.clone(), body.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let h: &[(&str, &str)] = if t % 2 == 0 {
                &[("x-switchyard-residency", "eu")]
            } else {
                &[("authorization", "Bearer sk-eu-tenant-123")]
            };
            let (mut ok, mut failed) = (0, Vec::new());
            while !stop.load(Ordering::Relaxed) {
                let (st, _, text) = post(&url, &body, h).await;
                if st == 200 {
                    ok += 1;
                } else {
                    failed.push(format!("{st}: {text}"));
                }
            }
            (ok, failed)
        }));
    }
    tokio::time::sleep(Duration::from_millis(400)).await;
    let ew_served_before_kill = counts(&ew).iter().sum::<u64>();
    for s in &ew {
        s.kill();
    }
    let ew_urls: Vec<String> = ew.iter().map(|s| s.url()).collect();
    eventually(Duration::from_secs(5), "eu-west ejected", || {
        let up = ew_urls.iter().any(|u| available(&gw, u));
        async move { (!up).then_some(()) }
    })
    .await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    stop.store(true, Ordering::Relaxed);
    let (mut ok, mut failed) = (0, Vec::new());
    for t in tasks {
        let (o, f) = t.await.unwrap();
        ok += o;
        failed.extend(f);
    }
    let us_d = delta(&counts(&us), &us_before);
    let ec_d = delta(&counts(&ec), &ec_before);
    println!(
        "residency phase A: {ok} eu requests ok, {} failed; eu-west served {ew_served_before_kill} before the kill; eu-central {ec_d:?}, us-east {us_d:?}",
        failed.len()
    );
    assert!(failed.is_empty(), "eu requests failed: {failed:?}");
    assert_eq!(us_d, vec![0, 0], "an eu request reached us-east");
    assert!(ew_served_before_kill > 0 && ec_d[0] > 0);

    // Phase B: unrestricted requests spill to us-east (first in the spill order).
    let (us_before, ec_before) = (counts(&us), counts(&ec));
    for _ in 0..20 {
        let (st, worker, _) = post(&url, &body, &[]).await;
        assert_eq!(st, 200);
        assert!(us.iter().any(|s| Some(s.url()) == worker), "{worker:?}");
    }
    assert_eq!(delta(&counts(&us), &us_before).iter().sum::<u64>(), 20);
    assert_eq!(delta(&counts(&ec), &ec_before), vec![0]);

    // Phase C: eu-central goes down too.
    ec[0].kill();
    let ec_url = ec[0].url();
    eventually(Duration::from_secs(5), "eu-central ejected", || {
        let up = available(&gw, &ec_url);
        async move { (!up).then_some(()) }
    })
    .await;
    let us_before = counts(&us);
    for h in [eu_header, eu_tenant] {
        let (st, _, text) = post(&url, &body, h).await;
        assert_eq!(st, 503, "{text}");
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(
            v["error"]["message"],
            format!("no worker in residency 'eu' (regions eu-central, eu-west) can serve model '{model}'")
        );
        assert_eq!(v["error"]["code"], "residency_unavailable");
    }
    // A header narrowing the tenant's residency is named with it.
    let (st, _, text) = post(
        &url,
        &body,
        &[
            ("authorization", "Bearer sk-eu-tenant-123"),
            ("x-switchyard-residency", "us-east"),
        ],
    )
    .await;
    assert_eq!(st, 503);
    assert!(
        text.contains("residency 'eu & us-east' (regions none)"),
        "{text}"
    );
    assert_eq!(
        delta(&counts(&us), &us_before),
        vec![0, 0],
        "nothing crossed"
    );
    // Unrestricted requests still succeed via us-east.
    for _ in 0..10 {
        assert_eq!(post(&url, &body, &[]).await.0, 200);
    }
    assert_eq!(delta(&counts(&us), &us_before).iter().sum::<u64>(), 10);
    // An unknown residency is the client's mistake.
    let (st, _, text) = post(&url, &body, &[("x-switchyard-residency", "mars")]).await;
    assert_eq!(st, 400, "{text}");
    assert!(
        text.contains("mars") && text.contains("eu-central"),
        "{text}"
    );
    let m = scrape(&url).await;
    assert!(
        metric_sum(
            &m,
            names::GATEWAY_ERRORS_TOTAL,
            &[("reason", "residency_unavailable")]
        ) >= 3.0
    );
    gw.shutdown().await;
}

/// A fallback pool with no worker in the request's residency (an external
/// provider without a region label) is skipped: the eu request gets the 503,
/// the provider never sees it; unrestricted requests still fall back to it.
#[tokio::test]
async fn residency_skips_fallback_pools_outside_it() {
    let eu = sims(1, 50.0).await;
    let (provider, _tx) = Scripted::start().await;
    let model = sim_model();
    let gw = gateway(&format!(
        r#"
[regions.fb-eu]
[residency]
fb-zone = ["fb-eu"]
[[pools]]
name = "fb-self"
models = ["{model}"]
fallback = ["fb-provider"]
max_attempts = 1
workers = [{{ url = "{}", labels = {{ region = "fb-eu" }} }}]
[[pools]]
name = "fb-provider"
models = ["fb-provider-model"]
workers = [{{ url = "{}", labels = {{ provider = "external" }} }}]
"#,
        eu[0].url(),
        provider.url
    ))
    .await;
    let url = gw.url();
    let body = chat(&model, 2);
    let h: &[(&str, &str)] = &[("x-switchyard-residency", "fb-zone")];
    assert_eq!(post(&url, &body, h).await.0, 200, "served in fb-eu");
    eu[0].kill();
    let (st, _, text) = post(&url, &body, h).await;
    assert!(st == 502 || st == 503, "{st} {text}");
    assert!(provider.recorded.lock().unwrap().bodies.is_empty());
    let (st, _, _) = post(&url, &body, &[]).await;
    assert_eq!(st, 200, "unrestricted: falls back to the provider");
    assert_eq!(provider.recorded.lock().unwrap().bodies.len(), 1);
    let m = scrape(&url).await;
    assert!(
        metric_sum(
            &m,
            names::FALLBACKS_SKIPPED_TOTAL,
            &[("pool", "fb-self"), ("target", "fb-provider")]
        ) >= 1.0
    );
    gw.shutdown().await;
}

// ---------------------------------------------------------------------------
// 4. Cost-aware placement across regions

/// The `cost` policy may use a cheaper remote region only when its round trip is
/// within the pool's `max_added_latency_ms`.
#[tokio::test]
async fn cost_placement_uses_a_cheaper_remote_region_only_within_the_latency_budget() {
    let s = sims(3, 50.0).await; // c-eu-west $2, c-eu-central $1 (15 ms), c-us-east $0.5 (90 ms)
    let model = sim_model();
    let config = |budget: u32| {
        format!(
            r#"
[server]
region = "c-eu-west"
[regions.c-eu-west]
rtt_ms = {{ c-eu-central = 15, c-us-east = 90 }}
[regions.c-eu-central]
[regions.c-us-east]
[[pools]]
name = "cost-{budget}"
models = ["{model}"]
policy = "cost"
workers = [
  {{ url = "{}", price_per_mtok = 2.0, labels = {{ region = "c-eu-west" }} }},
  {{ url = "{}", price_per_mtok = 1.0, labels = {{ region = "c-eu-central" }} }},
  {{ url = "{}", price_per_mtok = 0.5, labels = {{ region = "c-us-east" }} }},
]
[pools.routing]
max_added_latency_ms = {budget}
"#,
            s[0].url(),
            s[1].url(),
            s[2].url()
        )
    };
    let body = chat(&model, 2);
    for (budget, expect) in [
        (30, vec![0, 20, 0]),
        (100, vec![0, 0, 20]),
        (0, vec![20, 0, 0]),
    ] {
        let gw = gateway(&config(budget)).await;
        let before = counts(&s);
        for _ in 0..20 {
            assert_eq!(post(&gw.url(), &body, &[]).await.0, 200);
        }
        assert_eq!(delta(&counts(&s), &before), expect, "budget {budget} ms");
        let m = scrape(&gw.url()).await;
        let within = |to: &str| {
            metric_sum(
                &m,
                names::CROSS_REGION_REQUESTS_TOTAL,
                &[
                    ("from", "c-eu-west"),
                    ("to", to),
                    ("reason", "within_budget"),
                ],
            )
        };
        // Cumulative over the three gateways (metrics are process-wide).
        assert_eq!(
            within("c-eu-central") + within("c-us-east"),
            if budget == 30 { 20.0 } else { 40.0 }
        );
        gw.shutdown().await;
    }
}

// ---------------------------------------------------------------------------
// 5. Region outage

/// Both workers of the gateway's region die under concurrent load: the gateway
/// stops using them within one health-check interval, traffic moves to the other
/// region, and no request fails before its first byte (non-streamed requests all
/// succeed; streams cut mid-way end with an error event).
#[tokio::test]
async fn region_outage_moves_traffic_within_a_health_interval_without_failures() {
    let eu = sims(2, 20.0).await;
    let us = sims(2, 20.0).await;
    let model = sim_model();
    let interval_ms = 500;
    let w = |s: &SimHandle, region: &str| {
        format!(
            "{{ url = \"{}\", labels = {{ region = \"{region}\" }} }}",
            s.url()
        )
    };
    let gw = gateway(&format!(
        r#"
[server]
region = "o-eu"
[health]
interval_ms = {interval_ms}
unhealthy_threshold = 1
[regions.o-eu]
spill_order = ["o-us"]
[regions.o-us]
[[pools]]
name = "outage-pool"
models = ["{model}"]
policy = "least_queue"
workers = [{}, {}, {}, {}]
"#,
        w(&eu[0], "o-eu"),
        w(&eu[1], "o-eu"),
        w(&us[0], "o-us"),
        w(&us[1], "o-us"),
    ))
    .await;
    let url = gw.url();
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for t in 0..8 {
        let (url, model, stop) = (url.clone(), model.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let stream = t % 2 == 1;
            let (mut ok, mut cut, mut failed) = (0, 0, Vec::new());
            while !stop.load(Ordering::Relaxed) {
                if stream {
                    let mut b = chat(&model, 20);
                    b["stream"] = json!(true);
                    let (st, text) = stream_text(&url, b).await;
                    if st != 200 {
                        failed.push(format!("stream {st}: {text}"));
                    } else if text.ends_with("data: [DONE]\n\n") {
                        ok += 1;
                    } else {
                        // Already streaming when its worker died: may not be retried.
                        assert!(text.contains("data: {\"error\""), "silent cut: {text}");
                        cut += 1;
                    }
                } else {
                    let (st, _, text) = post(&url, &chat(&model, 20), &[]).await;
                    if st == 200 {
                        ok += 1;
                    } else {
                        failed.push(format!("{st}: {text}"));
                    }
                }
            }
            (ok, cut, failed)
        }));
    }
    tokio::time::sleep(Duration::from_millis(800)).await;
    let us_before = counts(&us);
    let killed = Instant::now();
    for s in &eu {
        s.kill();
    }
    let eu_urls: Vec<String> = eu.iter().map(|s| s.url()).collect();
    let moved = eventually(Duration::from_secs(5), "eu workers out of rotation", || {
        let up = eu_urls.iter().any(|u| available(&gw, u));
        async move { (!up).then(|| killed.elapsed()) }
    })
    .await;
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    stop.store(true, Ordering::Relaxed);
    let (mut ok, mut cut, mut failed) = (0, 0, Vec::new());
    for t in tasks {
        let (o, c, f) = t.await.unwrap();
        ok += o;
        cut += c;
        failed.extend(f);
    }
    let us_d: u64 = delta(&counts(&us), &us_before).iter().sum();
    let m = scrape(&url).await;
    let spilled = metric_sum(
        &m,
        names::CROSS_REGION_REQUESTS_TOTAL,
        &[("from", "o-eu"), ("to", "o-us")],
    );
    println!(
        "region outage: eu out of rotation {moved:?} after the kill (interval {interval_ms} ms); {ok} ok, {cut} streams cut after their first byte, {} failed; us-east took {us_d} requests after the kill; {spilled} cross-region attempts",
        failed.len()
    );
    assert!(failed.is_empty(), "retryable requests failed: {failed:?}");
    assert!(
        moved <= Duration::from_millis(interval_ms),
        "traffic moved after {moved:?}"
    );
    assert!(us_d > 0 && spilled > 0.0);
    gw.shutdown().await;
}
