//! The KV block size, from the operator's side: a pool learns it from its
//! engines' `/metrics` (vLLM's `cache_config_info`) before any event, and a
//! configured size the engines do not serve shows in `/ready`'s detail, the
//! dashboard status, a per-pool gauge and `check-config --probe` — not only in a
//! log line (a hand-set 16 once silently turned a 128-token vLLM pool with
//! `index = "precise"` into approximate routing).

mod support;

use serde_json::Value;
use std::process::Output;
use std::time::Duration;
use support::{client, config_file, eventually, gateway, get_json, metric_sum, scrape};
use switchyard::sim::kv_events::{EventFormat, KvEventsConfig};
use switchyard::sim::{self, SimConfig, SimHandle};
use switchyard::telemetry::names;

const MODEL: &str = "sim-llama-8b";
const WAIT: Duration = Duration::from_secs(20);
const BIN: &str = env!("CARGO_BIN_EXE_switchyard");

/// A simulated engine whose KV blocks (cache, events and `/metrics`) hold `block` tokens.
async fn sim_with_blocks(block: usize) -> SimHandle {
    let kv = KvEventsConfig {
        events: "tcp://127.0.0.1:0".into(),
        replay: Some("tcp://127.0.0.1:0".into()),
        topic: "kv-events".into(),
        format: EventFormat::Map,
        drop: None,
        reorder: None,
        block_size: block,
    };
    sim::spawn(SimConfig {
        time_scale: 50.0,
        model: MODEL.into(),
        block_size: block,
        num_blocks: 512,
        max_model_len: 4096,
        kv_events: Some(kv),
        ..SimConfig::default()
    })
    .await
    .expect("sim starts")
}

/// Pool `name` on the `prefix` policy with the precise index required, over
/// the sims and their event endpoints, with `kv_lines` in `[pools.kv_events]`.
fn precise_pool(name: &str, sims: &[SimHandle], kv_lines: &str) -> String {
    let workers: Vec<String> = sims
        .iter()
        .map(|s| {
            let kv = s.kv_endpoints().expect("events on");
            format!(
                "{{ url = \"{}\", kv_events = \"{}\", kv_replay = \"{}\" }}",
                s.url(),
                kv.events,
                kv.replay.as_deref().unwrap()
            )
        })
        .collect();
    format!(
        "[[pools]]\nname = \"{name}\"\nmodels = [\"{MODEL}\"]\npolicy = \"prefix\"\ntokenizer = \"sim\"\nworkers = [{}]\n[pools.routing]\nindex = \"precise\"\nstats_interval_ms = 50\n[pools.kv_events]\ntopic = \"kv-events\"\n{kv_lines}\n",
        workers.join(", ")
    )
}

/// The entry of pool `pool` in a `kv_block_size` array.
fn pool_entry<'a>(doc: &'a Value, pool: &str) -> &'a Value {
    doc["kv_block_size"]
        .as_array()
        .and_then(|a| a.iter().find(|p| p["pool"] == pool))
        .unwrap_or_else(|| panic!("no kv_block_size entry for {pool}: {doc}"))
}

/// `/ready`'s status and JSON body.
async fn ready(url: &str) -> (u16, Value) {
    let r = client().get(format!("{url}/ready")).send().await.unwrap();
    (r.status().as_u16(), r.json().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configured_block_size_the_engines_do_not_serve_is_shown_where_operators_look() {
    let sims = vec![sim_with_blocks(128).await, sim_with_blocks(128).await];
    let gw = gateway(&precise_pool("bs_mismatch", &sims, "block_size = 16")).await;
    let url = gw.url();
    let body = eventually(WAIT, "both mismatches in /ready", || {
        let url = url.clone();
        async move {
            let (status, body) = ready(&url).await;
            let n = pool_entry(&body, "bs_mismatch")["mismatches"]
                .as_array()
                .map_or(0, |m| m.len());
            (status == 200 && n == 2).then_some(body)
        }
    })
    .await;
    let p = pool_entry(&body, "bs_mismatch");
    assert_eq!(p["index"], "precise");
    assert_eq!(p["configured"], 16);
    assert_eq!(p["block_size"], 16);
    assert_eq!(p["precise_ready"], false);
    for (m, s) in p["mismatches"].as_array().unwrap().iter().zip(&sims) {
        assert_eq!(m["worker"], s.url());
        assert_eq!(
            (&m["configured"], &m["reported"]),
            (&16.into(), &128.into())
        );
    }
    let warnings = body["warnings"].to_string();
    assert!(
        warnings.contains(&sims[0].url()) && warnings.contains("128"),
        "{warnings}"
    );

    let dash = get_json(&format!("{url}/dashboard/status")).await;
    assert_eq!(pool_entry(&dash, "bs_mismatch"), p, "dashboard = /ready");

    let m = scrape(&url).await;
    let gauge = metric_sum(
        &m,
        names::KV_BLOCK_SIZE_MISMATCH,
        &[(names::L_POOL, "bs_mismatch")],
    );
    assert_eq!(gauge, 2.0, "{m}");
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unset_block_size_is_learned_from_metrics_before_any_event() {
    let sims = vec![sim_with_blocks(128).await, sim_with_blocks(128).await];
    let gw = gateway(&precise_pool("bs_learned", &sims, "")).await;
    let url = gw.url();
    let body = eventually(WAIT, "the learned size in /ready", || {
        let url = url.clone();
        async move {
            let (_, body) = ready(&url).await;
            let p = pool_entry(&body, "bs_learned").clone();
            let both = p["workers"]
                .as_array()
                .is_some_and(|w| w.iter().all(|w| w["reported"] == 128));
            (p["block_size"] == 128 && both).then_some(body)
        }
    })
    .await;
    let p = pool_entry(&body, "bs_learned");
    assert_eq!(p["configured"], Value::Null);
    assert_eq!(p["precise_ready"], true);
    assert_eq!(p["mismatches"], serde_json::json!([]));
    let m = scrape(&url).await;
    let events = metric_sum(&m, names::KV_EVENTS_TOTAL, &[(names::L_POOL, "bs_learned")]);
    assert_eq!(events, 0.0, "learned before any event: {m}");
    let gauge = metric_sum(
        &m,
        names::KV_BLOCK_SIZE_MISMATCH,
        &[(names::L_POOL, "bs_learned")],
    );
    assert_eq!(gauge, 0.0);
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_of_one_pool_that_disagree_are_named() {
    let sims = vec![sim_with_blocks(128).await, sim_with_blocks(64).await];
    let gw = gateway(&precise_pool("bs_disagree", &sims, "")).await;
    let url = gw.url();
    let body = eventually(WAIT, "the disagreement in /ready", || {
        let url = url.clone();
        async move {
            let (_, body) = ready(&url).await;
            let n = pool_entry(&body, "bs_disagree")["mismatches"]
                .as_array()
                .map_or(0, |m| m.len());
            (n == 1).then_some(body)
        }
    })
    .await;
    let p = pool_entry(&body, "bs_disagree");
    let m = &p["mismatches"][0];
    // Whichever engine was scraped first set the pool's size; the other is named.
    let (pool, reported) = (m["pool_block_size"].clone(), m["reported"].clone());
    assert!(
        (pool == 128 && reported == 64) || (pool == 64 && reported == 128),
        "{p}"
    );
    assert_eq!(m["configured"], Value::Null);
    assert_eq!(p["precise_ready"], false);
    gw.shutdown().await;
}

async fn check_config_probe(path: &std::path::Path) -> Output {
    tokio::process::Command::new(BIN)
        .args(["check-config", "--probe"])
        .arg(path)
        .output()
        .await
        .expect("binary runs")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_config_probe_compares_the_configured_block_size_with_live_engines() {
    let sims = vec![sim_with_blocks(128).await];
    let listen = "[server]\nlisten = \"127.0.0.1:0\"\n";
    let text = format!(
        "{listen}{}",
        precise_pool("probe", &sims, "block_size = 16")
    );
    let bad = check_config_probe(&config_file("probe_mismatch", &text)).await;
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(!bad.status.success(), "a mismatch fails: {err}");
    assert!(
        err.contains(&sims[0].url()) && err.contains("128") && err.contains("16"),
        "{err}"
    );
    assert!(err.contains("pools[0].kv_events.block_size"), "{err}");

    let text = format!(
        "{listen}{}",
        precise_pool("probe", &sims, "block_size = 128")
    );
    let good = check_config_probe(&config_file("probe_agree", &text)).await;
    let out = String::from_utf8_lossy(&good.stdout);
    assert!(
        good.status.success(),
        "{out}{}",
        String::from_utf8_lossy(&good.stderr)
    );
    assert!(out.contains(&sims[0].url()) && out.contains("128"), "{out}");

    // Without --probe, check-config stays offline: the same mismatch is not seen.
    let text = format!(
        "{listen}{}",
        precise_pool("probe", &sims, "block_size = 16")
    );
    let offline = tokio::process::Command::new(BIN)
        .args(["check-config"])
        .arg(config_file("probe_offline", &text))
        .output()
        .await
        .unwrap();
    assert!(offline.status.success());
}
