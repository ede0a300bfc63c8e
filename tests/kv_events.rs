//! Precise routing from the engines' KV-cache events, end to end: simulated
//! engines publish their events over ZeroMQ, the gateway subscribes, and routing
//! follows what the engines actually hold, including what the gateway never sent
//! them (requests sent to an engine directly) and what they evicted.

mod support;

use std::time::Duration;
use support::{client, eventually, gateway, metric_sum, scrape, tagged_words};
use switchyard::proxy::ROUTE_HEADER;
use switchyard::sim::kv_events::{EventFormat, KvEventsConfig};
use switchyard::sim::{self, SimConfig, SimHandle};
use switchyard::telemetry::names;

const MODEL: &str = "sim-llama-8b";
const WAIT: Duration = Duration::from_secs(20);

fn kv_cfg(port: u16, replay_port: u16) -> KvEventsConfig {
    KvEventsConfig {
        events: format!("tcp://127.0.0.1:{port}"),
        replay: Some(format!("tcp://127.0.0.1:{replay_port}")),
        topic: "kv-events".into(),
        format: EventFormat::Map,
        drop: None,
        reorder: None,
        block_size: 16,
    }
}

fn sim_config(num_blocks: usize, kv: KvEventsConfig) -> SimConfig {
    SimConfig {
        time_scale: 50.0,
        model: MODEL.into(),
        num_blocks,
        max_model_len: 4096,
        kv_events: Some(kv),
        ..SimConfig::default()
    }
}

async fn sim_with(port: u16, num_blocks: usize, kv: KvEventsConfig) -> SimHandle {
    sim::spawn(SimConfig {
        port,
        ..sim_config(num_blocks, kv)
    })
    .await
    .expect("sim starts")
}

async fn sims(n: usize, num_blocks: usize) -> Vec<SimHandle> {
    let mut v = Vec::new();
    for _ in 0..n {
        v.push(sim_with(0, num_blocks, kv_cfg(0, 0)).await);
    }
    v
}

/// A weighted pool `p` on `precise_prefix` over the sims, with their event endpoints.
fn config(sims: &[SimHandle], kv_lines: &str) -> String {
    config_named("p", sims, kv_lines)
}

/// The same, pool named `pool` (its metrics apart from other tests' in this process).
fn config_named(pool: &str, sims: &[SimHandle], kv_lines: &str) -> String {
    let routing = "[pools.routing]\nscorers = [{ name = \"precise_prefix\", weight = 1.0 }, { name = \"queue\", weight = 0.01 }]";
    pool_config(sims, pool, "policy = \"weighted\"", routing, Some(kv_lines))
}

/// Pool `name` over the sims with `policy` and `routing` lines; with events
/// unless `kv_lines` is `None`.
fn pool_config(
    sims: &[SimHandle],
    name: &str,
    policy: &str,
    routing: &str,
    kv_lines: Option<&str>,
) -> String {
    let workers: Vec<String> = sims
        .iter()
        .map(|s| match kv_lines {
            None => format!("{{ url = \"{}\" }}", s.url()),
            Some(_) => {
                let kv = s.kv_endpoints().expect("events on");
                format!(
                    "{{ url = \"{}\", kv_events = \"{}\", kv_replay = \"{}\" }}",
                    s.url(),
                    kv.events,
                    kv.replay.as_deref().unwrap()
                )
            }
        })
        .collect();
    let (tokenizer, kv) = kv_lines.map_or((String::new(), String::new()), |l| {
        let kv =
            format!("[pools.kv_events]\ntopic = \"kv-events\"\nprobe_interval_ms = 100\n{l}\n");
        ("tokenizer = \"sim\"".to_string(), kv)
    });
    format!(
        "[server]\ndebug_headers = true\n[[pools]]\nname = \"{name}\"\nmodels = [\"{MODEL}\"]\n{policy}\n{tokenizer}\nworkers = [{}]\n{routing}\n{kv}",
        workers.join(", ")
    )
}

fn body(content: &str) -> serde_json::Value {
    serde_json::json!({"model": MODEL, "max_tokens": 2,
        "messages": [{"role": "user", "content": content}]})
}

/// Send a chat request to `base` (gateway or engine); the route header if any.
async fn chat(base: &str, content: &str) -> Option<(String, String)> {
    let resp = client()
        .post(format!("{base}/v1/chat/completions"))
        .json(&body(content))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let route = resp
        .headers()
        .get(ROUTE_HEADER)
        .map(|v| v.to_str().unwrap().to_string());
    let _ = resp.bytes().await.unwrap();
    route.map(|r| {
        let worker = r.split("; ").next().unwrap().to_string();
        let reason = r
            .split("reason=")
            .nth(1)
            .unwrap()
            .split(';')
            .next()
            .unwrap()
            .to_string();
        (worker, reason)
    })
}

fn worker_metric(text: &str, name: &str, worker: &str, extra: &[(&str, &str)]) -> f64 {
    let mut want = vec![(names::L_WORKER, worker)];
    want.extend_from_slice(extra);
    metric_sum(text, name, &want)
}

/// Wait until every worker is live in the precise index.
async fn wait_live(gw: &str, sims: &[SimHandle]) {
    for s in sims {
        let url = s.url();
        eventually(WAIT, "worker live in the precise index", || {
            let url = url.clone();
            async move {
                let m = scrape(gw).await;
                (worker_metric(&m, names::KV_WORKER_STATE, &url, &[]) == 2.0).then_some(())
            }
        })
        .await;
    }
}

/// Wait until the gateway indexes at least `n` GPU blocks of `worker`.
async fn wait_blocks(gw: &str, worker: &str, at_least: f64) {
    eventually(WAIT, "blocks indexed", || async move {
        let m = scrape(gw).await;
        let n = worker_metric(
            &m,
            names::KV_INDEX_BLOCKS,
            worker,
            &[(names::L_MEDIUM, "gpu")],
        );
        (n >= at_least).then_some(())
    })
    .await;
}

/// Wait until the gateway applied every batch `sim` published so far.
async fn wait_caught_up(gw: &str, sim: &SimHandle) {
    let published = support::sim_metric(&sim.url(), "sim_kv_event_batches_total").await;
    let url = sim.url();
    eventually(
        WAIT,
        "the gateway caught up with the engine's events",
        || {
            let url = url.clone();
            async move {
                let m = scrape(gw).await;
                let applied = worker_metric(
                    &m,
                    names::KV_EVENTS_TOTAL,
                    &url,
                    &[(names::L_KIND, "applied")],
                );
                (applied >= published).then_some(())
            }
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_drive_the_index_even_for_traffic_the_gateway_never_saw() {
    let sims = sims(3, 4096).await;
    let gw = gateway(&config(&sims, "")).await;
    wait_live(&gw.url(), &sims).await;
    // Warm worker 2 behind the gateway's back: only its events tell.
    let text = tagged_words("direct", 120);
    chat(&sims[2].url(), &text).await;
    wait_caught_up(&gw.url(), &sims[2]).await;
    let (worker, reason) = chat(&gw.url(), &text).await.unwrap();
    assert_eq!(
        (worker.as_str(), reason.as_str()),
        (sims[2].url().as_str(), "prefix_hit")
    );
    // The prediction was exact: the engine reported the cached tokens predicted.
    let m = scrape(&gw.url()).await;
    let pred = metric_sum(
        &m,
        names::CACHE_PREDICTED_TOKENS_TOTAL,
        &[(names::L_POOL, "p"), (names::L_MODE, "precise")],
    );
    let actual = metric_sum(
        &m,
        names::CACHE_ACTUAL_TOKENS_TOTAL,
        &[(names::L_POOL, "p"), (names::L_MODE, "precise")],
    );
    assert!(
        pred > 0.0 && pred == actual,
        "predicted {pred}, actual {actual}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_range_is_replayed() {
    let mut kv = kv_cfg(0, 0);
    kv.drop = Some(0..=2);
    kv.reorder = Some(4..=6);
    let s = sim_with(0, 4096, kv).await;
    let sims = vec![s];
    let gw = gateway(&config(&sims, "")).await;
    wait_live(&gw.url(), &sims).await;
    for i in 0..8 {
        chat(&sims[0].url(), &tagged_words(&format!("p{i}x"), 40)).await;
    }
    let url = sims[0].url();
    eventually(WAIT, "dropped batches replayed", || {
        let (gw, url) = (gw.url(), url.clone());
        async move {
            let m = scrape(&gw).await;
            let k =
                |kind| worker_metric(&m, names::KV_EVENTS_TOTAL, &url, &[(names::L_KIND, kind)]);
            (k("replayed") >= 3.0 && k("applied") >= 8.0).then_some((k("lost"), k("duplicate")))
        }
    })
    .await;
    let m = scrape(&gw.url()).await;
    let k = |kind| worker_metric(&m, names::KV_EVENTS_TOTAL, &url, &[(names::L_KIND, kind)]);
    assert_eq!(k("lost"), 0.0);
    assert!(
        k("duplicate") >= 1.0,
        "reordered live batches arrive after their replay"
    );
    // The first prompt's blocks (in a dropped batch) are indexed.
    let (worker, reason) = chat(&gw.url(), &tagged_words("p0x", 40)).await.unwrap();
    assert_eq!((worker, reason.as_str()), (url, "prefix_hit"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_restart_clears_its_entries() {
    let probe = sims(1, 4096).await;
    let http_port = probe[0].addr().port();
    let events = probe[0].kv_endpoints().unwrap().clone();
    let port = |e: &str| e.rsplit(':').next().unwrap().parse::<u16>().unwrap();
    let (ep, rp) = (
        port(&events.events),
        port(events.replay.as_deref().unwrap()),
    );
    let gw = gateway(&config(&probe, "")).await;
    wait_live(&gw.url(), &probe).await;
    let url = probe[0].url();
    chat(&url, &tagged_words("before", 80)).await;
    wait_blocks(&gw.url(), &url, 4.0).await;
    let resyncs =
        |m: &str| worker_metric(m, names::KV_RESYNCS_TOTAL, &url, &[("reason", "reconnect")]);
    let before = resyncs(&scrape(&gw.url()).await);
    for s in probe {
        s.shutdown().await;
    }
    // The same engine address comes back empty (once the old engine's sockets,
    // closed by background tasks, have let go of the ports).
    let again = eventually(
        WAIT,
        "the restarted engine binds its ports",
        || async move {
            sim::spawn(SimConfig {
                port: http_port,
                ..sim_config(4096, kv_cfg(ep, rp))
            })
            .await
            .ok()
        },
    )
    .await;
    eventually(WAIT, "entries cleared after the restart", || {
        let (gw, url) = (gw.url(), url.clone());
        async move {
            let m = scrape(&gw).await;
            let blocks = worker_metric(
                &m,
                names::KV_INDEX_BLOCKS,
                &url,
                &[(names::L_MEDIUM, "gpu")],
            );
            let live = worker_metric(&m, names::KV_WORKER_STATE, &url, &[]) == 2.0;
            (blocks == 0.0 && live && resyncs(&m) > before).then_some(())
        }
    })
    .await;
    // And it is indexed again from its new events.
    chat(&again.url(), &tagged_words("after", 80)).await;
    wait_blocks(&gw.url(), &url, 4.0).await;
}

/// vLLM's block size for most models on recent GPUs: 128 tokens, where the
/// gateway's default is 16. Unconfigured, the pool learns it from the engines'
/// events and routes precisely (before, every worker was refused and routing
/// silently fell back to the approximate index).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unconfigured_block_size_is_learned_from_the_engines() {
    let mut v = Vec::new();
    for _ in 0..2 {
        let kv = KvEventsConfig {
            block_size: 128,
            ..kv_cfg(0, 0)
        };
        v.push(
            sim::spawn(SimConfig {
                block_size: 128,
                ..sim_config(4096, kv)
            })
            .await
            .expect("sim starts"),
        );
    }
    let sims = v;
    let gw = gateway(&config_named("learned", &sims, "")).await;
    wait_live(&gw.url(), &sims).await;
    let text = tagged_words("learned", 400);
    chat(&sims[1].url(), &text).await;
    wait_caught_up(&gw.url(), &sims[1]).await;
    let (worker, reason) = chat(&gw.url(), &text).await.unwrap();
    assert_eq!(
        (worker.as_str(), reason.as_str()),
        (sims[1].url().as_str(), "prefix_hit")
    );
    let m = scrape(&gw.url()).await;
    for s in &sims {
        let refused = worker_metric(&m, names::KV_REFUSALS_TOTAL, &s.url(), &[]);
        assert!(refused <= 0.0, "{} refused: {refused}", s.url());
    }
    let pred = metric_sum(
        &m,
        names::CACHE_PREDICTED_TOKENS_TOTAL,
        &[(names::L_POOL, "learned"), (names::L_MODE, "precise")],
    );
    assert!(
        pred >= 128.0,
        "precise prediction in 128-token blocks: {pred}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_size_mismatch_falls_back_loudly() {
    let sims = sims(2, 4096).await;
    let gw = gateway(&config(&sims, "block_size = 32")).await;
    let url = sims[0].url();
    chat(&url, &tagged_words("size", 80)).await;
    eventually(WAIT, "the worker is refused", || {
        let (gw, url) = (gw.url(), url.clone());
        async move {
            let m = scrape(&gw).await;
            let refused = worker_metric(
                &m,
                names::KV_REFUSALS_TOTAL,
                &url,
                &[("reason", "block_size")],
            );
            let state = worker_metric(&m, names::KV_WORKER_STATE, &url, &[]);
            (refused >= 1.0 && state == 3.0).then_some(())
        }
    })
    .await;
    // Routing goes on, on the approximate index: the same prompt twice lands on
    // the same worker as a prefix hit.
    let text = tagged_words("approx", 80);
    let (w1, _) = chat(&gw.url(), &text).await.unwrap();
    let (w2, reason) = chat(&gw.url(), &text).await.unwrap();
    assert_eq!((w2, reason.as_str()), (w1, "prefix_hit"));
    let m = scrape(&gw.url()).await;
    assert!(
        metric_sum(
            &m,
            names::CACHE_PREDICTIONS_TOTAL,
            &[(names::L_POOL, "p"), (names::L_MODE, "approximate")]
        ) >= 1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eviction_on_the_engine_moves_the_next_request_elsewhere() {
    // 96 blocks of 16 tokens: a few long prompts evict everything else.
    let sims = sims(2, 96).await;
    let gw = gateway(&config(&sims, "")).await;
    wait_live(&gw.url(), &sims).await;
    let text = tagged_words("evict", 150);
    let (first, _) = chat(&gw.url(), &text).await.unwrap();
    let (held, other) = if first == sims[0].url() {
        (0, 1)
    } else {
        (1, 0)
    };
    // The other engine learns the prompt directly; the holder then evicts it.
    chat(&sims[other].url(), &text).await;
    wait_caught_up(&gw.url(), &sims[other]).await;
    for i in 0..6 {
        chat(&sims[held].url(), &tagged_words(&format!("flood{i}y"), 150)).await;
    }
    wait_caught_up(&gw.url(), &sims[held]).await;
    let (worker, reason) = chat(&gw.url(), &text).await.unwrap();
    assert_eq!((worker, reason.as_str()), (sims[other].url(), "prefix_hit"));
}

/// A prompt whose sim tokens (chat template included) are exactly whole blocks.
fn whole_blocks_prompt(block_size: usize) -> (String, usize) {
    use switchyard::api::inspect::Endpoint;
    let tok = switchyard::tokenize::build(&switchyard::config::TokenizerConfig::Sim).unwrap();
    // Each word is two tokens; trailing `!`s (one token each) set the remainder.
    (0..block_size)
        .map(|bangs| format!("{}{}", tagged_words("whole", 60), "!".repeat(bangs)))
        .find_map(|text| {
            let body = serde_json::to_vec(&body(&text)).unwrap();
            let n = tok
                .prompt_tokens(Endpoint::ChatCompletions, &body)
                .ok()?
                .len();
            (n % block_size == 0).then_some((text, n))
        })
        .expect("some length is a multiple of the block size")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_prompt_of_whole_blocks_is_predicted_as_the_engine_counts() {
    // The engine computes a prompt's last token again (it needs its logits), so the
    // last of n whole blocks is never a hit: predicted and reported must both say n - 1.
    let sims = sims(1, 4096).await;
    let gw = gateway(&config_named("whole", &sims, "")).await;
    wait_live(&gw.url(), &sims).await;
    let (text, n) = whole_blocks_prompt(16);
    chat(&gw.url(), &text).await;
    wait_caught_up(&gw.url(), &sims[0]).await;
    chat(&gw.url(), &text).await;
    let m = scrape(&gw.url()).await;
    let precise = |name| {
        metric_sum(
            &m,
            name,
            &[(names::L_POOL, "whole"), (names::L_MODE, "precise")],
        )
    };
    let (pred, actual) = (
        precise(names::CACHE_PREDICTED_TOKENS_TOTAL),
        precise(names::CACHE_ACTUAL_TOKENS_TOTAL),
    );
    assert_eq!(
        actual,
        (n - 16) as f64,
        "the engine reuses all but the last block"
    );
    assert_eq!(pred, actual, "{n} prompt tokens");
}

/// The `prefix` policy reads the precise index when its pool has one: after the
/// engine it sent a prompt to evicted it, the next request goes to the engine
/// that holds it, while a gateway on the approximate index (what it sent where)
/// still sends it to the first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_prefix_policy_follows_an_eviction_the_approximate_index_cannot_see() {
    let sims = sims(2, 96).await;
    let prefix = "policy = \"prefix\"";
    let precise = gateway(&pool_config(&sims, "prefix_precise", prefix, "", Some(""))).await;
    let approx = gateway(&pool_config(&sims, "prefix_approx", prefix, "", None)).await;
    wait_live(&precise.url(), &sims).await;
    let text = tagged_words("follow", 150);
    let (first, _) = chat(&approx.url(), &text).await.unwrap();
    let held = usize::from(first != sims[0].url());
    let other = 1 - held;
    chat(&sims[other].url(), &text).await;
    for i in 0..6 {
        chat(&sims[held].url(), &tagged_words(&format!("flood{i}z"), 150)).await;
    }
    wait_caught_up(&precise.url(), &sims[other]).await;
    wait_caught_up(&precise.url(), &sims[held]).await;
    let (worker, reason) = chat(&precise.url(), &text).await.unwrap();
    assert_eq!((worker, reason.as_str()), (sims[other].url(), "prefix_hit"));
    let (worker, reason) = chat(&approx.url(), &text).await.unwrap();
    assert_eq!(
        (worker, reason.as_str()),
        (first, "prefix_hit"),
        "the approximate index cannot see the eviction"
    );
    // Each decision's prediction is counted under its own mode, and the precise
    // one was exact.
    let (mp, ma) = (scrape(&precise.url()).await, scrape(&approx.url()).await);
    let mode = |m: &str, pool, mode, name| {
        metric_sum(m, name, &[(names::L_POOL, pool), (names::L_MODE, mode)])
    };
    let (pp, pa) = ("prefix_precise", "prefix_approx");
    let predictions = names::CACHE_PREDICTIONS_TOTAL;
    assert_eq!(mode(&mp, pp, "precise", predictions), 1.0);
    assert_eq!(mode(&mp, pp, "approximate", predictions), 0.0);
    assert_eq!(mode(&ma, pa, "approximate", predictions), 2.0);
    let predicted = mode(&mp, pp, "precise", names::CACHE_PREDICTED_TOKENS_TOTAL);
    let actual = mode(&mp, pp, "precise", names::CACHE_ACTUAL_TOKENS_TOTAL);
    assert!(
        predicted > 0.0 && predicted == actual,
        "predicted {predicted}, actual {actual}"
    );
}

/// Cache hits in flight on the holder count only the prefill they still need:
/// the prompt's exact token count (tokenized for the precise lookup) less the
/// engine's cached tokens, not a byte estimate less them. A long-worded prompt
/// estimated from its bytes at several times its tokens made every hit waiting
/// for its first token look like a large prefill, and the holder of a busy
/// prefix looked busier than an idle engine by more than the prompt: the
/// prefix spilled to a second engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hits_waiting_for_their_first_token_do_not_spill_their_prefix() {
    let sims = sims(2, 4096).await;
    let prefix = "policy = \"prefix\"";
    let gw = gateway(&pool_config(&sims, "hits_pending", prefix, "", Some(""))).await;
    wait_live(&gw.url(), &sims).await;
    // Words of one sim token in six bytes: the estimate at 4 bytes a token is 1.5×.
    let text: Vec<String> = (0..400).map(|i| format!("w{i:04}")).collect();
    let text = text.join(" ");
    let tokens = switchyard::sim::tokenizer::count(&text);
    assert!(
        text.len() / 4 >= tokens * 7 / 5,
        "the byte estimate is over the tokens"
    );
    let (holder, _) = chat(&gw.url(), &text).await.unwrap();
    let h = usize::from(holder != sims[0].url());
    wait_caught_up(&gw.url(), &sims[h]).await;
    // Five hits held before their first token on the holder.
    let held: Vec<_> = (0..5)
        .map(|_| {
            let (url, b) = (gw.url(), body(&text));
            tokio::spawn(async move {
                let r = client()
                    .post(format!("{url}/v1/chat/completions"))
                    .header("x-sim-fault", "slow:30000")
                    .json(&b)
                    .send()
                    .await;
                drop(r);
            })
        })
        .collect();
    eventually(WAIT, "five hits in flight on the holder", || async {
        (sims[h].requests_received() >= 6).then_some(())
    })
    .await;
    assert_eq!(sims[1 - h].requests_received(), 0);
    let (worker, reason) = chat(&gw.url(), &text).await.unwrap();
    assert_eq!((worker, reason.as_str()), (holder, "prefix_hit"));
    for t in held {
        t.abort();
    }
}
