//! Routing-quality benchmark: 8 simulated engines with finite prefix caches behind
//! an in-process gateway, three workloads, one row per (workload, policy).
//!
//! ```text
//! cargo bench --bench routing_quality                       # everything (~6 min)
//! cargo bench --bench routing_quality -- --secs 10 --workloads shared --policies prefix,round_robin
//! ```
//!
//! Workloads (open-loop Poisson arrivals, streamed responses, `ignore_eos`):
//! * `shared`: 32 groups, each a ~3k-token system prompt, plus a short question.
//! * `sessions`: multi-turn chats; each turn sends the whole history (unique
//!   ~2k-token system prompt, 10 turns of ~60-token user messages, the answers).
//! * `random`: ~2k-token random prompts, nothing shared.
//!
//! Reported: TTFT p50/p99 (client side, to the first content token), throughput
//! (completed requests/s), cluster prefix-cache hit rate (Σ hits / Σ queries from
//! the engines' `/metrics`, tokens), load imbalance (max / mean requests per worker).
//! Deterministic inputs (seeded); timings vary with the machine's load.

use futures_util::StreamExt;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use switchyard::pool::stats::{now_ms, parse_metrics};
use switchyard::sim::{self, SimConfig, SimHandle};
use tokio::time::Instant;

const WORKERS: usize = 8;
const MODEL: &str = "sim-llama-8b";
/// Engine KV blocks (16 tokens each): 24k tokens, about 7 of the shared prompts.
const NUM_BLOCKS: usize = 1_500;
const OUTPUT_TOKENS: u32 = 16;
/// Sessions: a unique ~2k-token system prompt, then 10 turns of ~60-token user
/// messages and 16-token answers. Only the first turn's prompt and each turn's new
/// tokens can miss: the hit-rate ceiling is about 88 %.
const SESSION_SYSTEM: usize = 2_000;
const SESSION_TURNS: usize = 10;
const SESSION_USER: usize = 60;

#[derive(Clone)]
struct Args {
    secs: f64,
    time_scale: f64,
    policies: Vec<String>,
    workloads: Vec<String>,
    /// Multiplies every workload's arrival rate.
    load: f64,
}

fn args() -> Args {
    let mut a = Args {
        secs: 30.0,
        time_scale: 0.5,
        policies: vec![
            "round_robin".into(),
            "least_queue".into(),
            "prefix".into(),
            "session".into(),
        ],
        workloads: vec!["shared".into(), "sessions".into(), "random".into()],
        load: 1.0,
    };
    let v: Vec<String> = std::env::args().collect();
    let list = |s: &str| s.split(',').map(String::from).collect::<Vec<_>>();
    for w in v.windows(2) {
        match w[0].as_str() {
            "--secs" => a.secs = w[1].parse().expect("--secs N"),
            "--time-scale" => a.time_scale = w[1].parse().expect("--time-scale X"),
            "--load" => a.load = w[1].parse().expect("--load X"),
            "--policies" => a.policies = list(&w[1]),
            "--workloads" => a.workloads = list(&w[1]),
            _ => {}
        }
    }
    a
}

fn words(rng: &mut SmallRng, n: usize) -> String {
    const W: &[&str] = &[
        "alpha", "bravo", "delta", "gamma", "omega", "sigma", "kappa", "lemon", "mango", "pearl",
        "river", "stone", "cloud", "ember", "frost", "grove", "haven", "ivory", "jolly", "karma",
    ];
    let mut s = String::with_capacity(n * 6);
    for i in 0..n {
        if i > 0 {
            s.push(' ');
        }
        s.push_str(W[rng.gen_range(0..W.len())]);
        if rng.gen_ratio(1, 7) {
            s.push_str(&rng.gen_range(0..1000).to_string());
        }
    }
    s
}

fn exp(rng: &mut SmallRng, mean: f64) -> f64 {
    -mean * (1.0 - rng.gen::<f64>()).ln()
}

#[derive(Default)]
struct Samples {
    ttft_ms: Vec<f64>,
    completed: u64,
    errors: u64,
    /// (send time in s since the run started, worker, reason) from the debug header.
    routes: Vec<(f64, String, String)>,
}

struct Ctx {
    client: reqwest::Client,
    gw: String,
    samples: Mutex<Samples>,
    t0: Instant,
}

/// One streamed chat request; returns the answer text.
async fn send(ctx: &Ctx, messages: &serde_json::Value, session: Option<&str>) -> Option<String> {
    let body = serde_json::json!({
        "model": MODEL, "messages": messages, "stream": true,
        "max_tokens": OUTPUT_TOKENS, "ignore_eos": true,
    });
    let start = Instant::now();
    let mut req = ctx
        .client
        .post(format!("{}/v1/chat/completions", ctx.gw))
        .json(&body);
    if let Some(s) = session {
        req = req.header("x-session-id", s);
    }
    let fail = || {
        ctx.samples.lock().unwrap().errors += 1;
        None
    };
    let Ok(resp) = req.send().await else {
        return fail();
    };
    if !resp.status().is_success() {
        return fail();
    }
    if let Some(route) = resp
        .headers()
        .get("x-switchyard-route")
        .and_then(|v| v.to_str().ok())
    {
        let mut parts = route.split("; ");
        let worker = parts.next().unwrap_or_default().to_string();
        let reason = parts
            .find_map(|p| p.strip_prefix("reason="))
            .unwrap_or_default()
            .to_string();
        let at = (start - ctx.t0).as_secs_f64();
        ctx.samples
            .lock()
            .unwrap()
            .routes
            .push((at, worker, reason));
    }
    let mut stream = resp.bytes_stream();
    let mut buf = Vec::new();
    let mut answer = String::new();
    let mut ttft = None;
    while let Some(chunk) = stream.next().await {
        let Ok(chunk) = chunk else { return fail() };
        buf.extend_from_slice(&chunk);
        while let Some(end) = buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buf.drain(..end + 2).collect();
            let Some(data) = event.strip_prefix(b"data: ") else {
                continue;
            };
            let Ok(v) = serde_json::from_slice::<serde_json::Value>(data) else {
                continue;
            };
            if let Some(c) = v["choices"][0]["delta"]["content"].as_str() {
                if !c.is_empty() && ttft.is_none() {
                    ttft = Some(start.elapsed());
                }
                answer.push_str(c);
            }
        }
    }
    let mut s = ctx.samples.lock().unwrap();
    s.completed += 1;
    if let Some(t) = ttft {
        s.ttft_ms.push(t.as_secs_f64() * 1000.0);
    }
    Some(answer)
}

/// Requests per second of each workload at `load = 1` and `time_scale = 0.5`,
/// chosen so that round robin queues (see docs/benchmarks.md).
fn base_rate(workload: &str) -> f64 {
    match workload {
        "shared" => 20.0,
        "sessions" => 1.6, // sessions per second, SESSION_TURNS requests each
        _ => 20.0,
    }
}

async fn drive(ctx: Arc<Ctx>, workload: &str, secs: f64, rate: f64) {
    let mut rng = SmallRng::seed_from_u64(42);
    let groups: Vec<String> = (0..32).map(|_| words(&mut rng, 3_000)).collect();
    let groups = Arc::new(groups);
    let t0 = Instant::now();
    let mut at = 0.0;
    let mut tasks = Vec::new();
    let mut k = 0u64;
    while at < secs {
        at += exp(&mut rng, 1.0 / rate);
        tokio::time::sleep_until(t0 + Duration::from_secs_f64(at)).await;
        k += 1;
        let ctx = ctx.clone();
        let mut r = SmallRng::seed_from_u64(1_000 + k);
        match workload {
            "shared" => {
                let groups = groups.clone();
                tasks.push(tokio::spawn(async move {
                    let g = r.gen_range(0..groups.len());
                    let q = words(&mut r, 20);
                    let m = serde_json::json!([
                        {"role": "system", "content": groups[g]},
                        {"role": "user", "content": q},
                    ]);
                    send(&ctx, &m, None).await;
                }));
            }
            "sessions" => {
                tasks.push(tokio::spawn(async move {
                    let id = format!("s{k}");
                    let mut m = vec![serde_json::json!({"role": "system", "content": words(&mut r, SESSION_SYSTEM)})];
                    for _turn in 0..SESSION_TURNS {
                        m.push(serde_json::json!({"role": "user", "content": words(&mut r, SESSION_USER)}));
                        let msgs = serde_json::Value::Array(m.clone());
                        let Some(answer) = send(&ctx, &msgs, Some(&id)).await else {
                            return;
                        };
                        m.push(serde_json::json!({"role": "assistant", "content": answer}));
                        let think = exp(&mut r, 0.5);
                        tokio::time::sleep(Duration::from_secs_f64(think)).await;
                    }
                }));
            }
            _ => {
                tasks.push(tokio::spawn(async move {
                    let m = serde_json::json!([{"role": "user", "content": words(&mut r, 2_000)}]);
                    send(&ctx, &m, None).await;
                }));
            }
        }
    }
    for t in tasks {
        let _ = t.await;
    }
}

struct Row {
    workload: String,
    policy: String,
    p50: f64,
    p99: f64,
    throughput: f64,
    hit_rate: f64,
    imbalance: f64,
    requests: u64,
    errors: u64,
}

async fn engine_counts(sims: &[SimHandle], client: &reqwest::Client) -> (f64, f64) {
    let (mut h, mut q) = (0.0, 0.0);
    for s in sims {
        let text = client
            .get(format!("{}/metrics", s.url()))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let m = parse_metrics(&text);
        h += m.prefix_hits.unwrap_or(0.0);
        q += m.prefix_queries.unwrap_or(0.0);
    }
    (h, q)
}

#[derive(Default)]
struct LoadDiag {
    samples: u64,
    stale: u64,
    est_sum: f64,
    in_flight_sum: f64,
    over_sum: f64,
}

/// `RQ_DIAG=1`: how routing saw the workers during the run (stderr).
fn print_diag(
    workload: &str,
    policy: &str,
    routes: &mut [(f64, String, String)],
    d: &LoadDiag,
    poll_errors: u64,
) {
    routes.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut reasons = std::collections::BTreeMap::<&str, u64>::new();
    for r in routes.iter() {
        *reasons.entry(r.2.as_str()).or_default() += 1;
    }
    let same = routes.windows(2).filter(|w| w[0].1 == w[1].1).count();
    // Largest share of one worker among 8 consecutive arrivals, averaged.
    let mut max_share = 0.0f64;
    let mut windows = 0.0f64;
    for w in routes.windows(8) {
        let mut counts = std::collections::HashMap::<&str, u32>::new();
        for r in w {
            *counts.entry(r.1.as_str()).or_default() += 1;
        }
        max_share += *counts.values().max().unwrap_or(&0) as f64 / 8.0;
        windows += 1.0;
    }
    let n = d.samples.max(1) as f64;
    eprintln!(
        "  diag {workload}/{policy}: reasons {reasons:?}; same worker as previous arrival {:.1} %; \
         busiest worker's share of 8 consecutive arrivals {:.2}; stale samples {:.1} %; \
         poll errors {poll_errors}; mean est queue {:.2}, mean in-flight {:.2}, mean est - in-flight {:.2}",
        100.0 * same as f64 / (routes.len().max(2) - 1) as f64,
        max_share / windows.max(1.0),
        100.0 * d.stale as f64 / n,
        d.est_sum / n,
        d.in_flight_sum / n,
        d.over_sum / n,
    );
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

async fn run_one(a: &Args, workload: &str, policy: &str) -> Row {
    let mut sims = Vec::new();
    for i in 0..WORKERS {
        sims.push(
            sim::spawn(SimConfig {
                time_scale: a.time_scale,
                seed: i as u64,
                model: MODEL.into(),
                num_blocks: NUM_BLOCKS,
                ..SimConfig::default()
            })
            .await
            .expect("sim starts"),
        );
    }
    let workers: Vec<String> = sims
        .iter()
        .map(|s| format!("{{ url = \"{}\" }}", s.url()))
        .collect();
    let toml = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\ndebug_headers = true\n[[pools]]\nname = \"bench\"\nmodels = [\"{MODEL}\"]\npolicy = \"{policy}\"\nworkers = [{}]\n",
        workers.join(", ")
    );
    let cfg = switchyard::config::parse(&toml)
        .unwrap()
        .validate()
        .unwrap();
    let gw = switchyard::server::spawn(cfg)
        .await
        .expect("gateway starts");
    let snap = gw.gateway.registry.snapshot();
    // Ready when every worker's stats have been scraped once.
    let ready = Instant::now();
    while !snap
        .workers()
        .all(|w| w.state.stats.age_ms(now_ms()).is_some())
    {
        assert!(
            ready.elapsed() < Duration::from_secs(10),
            "stats never arrived"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(512)
        .timeout(Duration::from_secs(120))
        .build()
        .unwrap();
    let ctx = Arc::new(Ctx {
        client: client.clone(),
        gw: gw.url(),
        samples: Mutex::new(Samples::default()),
        t0: Instant::now(),
    });
    // Sample what routing sees: per worker, the estimated queue, this gateway's
    // in-flight count and whether the stats are stale.
    let stale_ms = snap.pools[0].config.routing.stale_after.as_millis() as u64;
    let sampling = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let sampler = {
        let snap = snap.clone();
        let sampling = sampling.clone();
        tokio::spawn(async move {
            let mut d = LoadDiag::default();
            while sampling.load(Ordering::Relaxed) {
                let now = now_ms();
                for w in snap.workers() {
                    let l = w.state.stats.load(w.in_flight(), now, stale_ms);
                    d.samples += 1;
                    d.stale += (l.freshness == switchyard::pool::stats::Freshness::Stale) as u64;
                    d.est_sum += l.queue;
                    d.in_flight_sum += w.in_flight() as f64;
                    d.over_sum += l.queue - w.in_flight() as f64;
                }
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
            d
        })
    };
    let poll_errors0: u64 = snap
        .workers()
        .map(|w| w.state.stats.poll_errors.load(Ordering::Relaxed))
        .sum();
    let before = engine_counts(&sims, &client).await;
    let req0: Vec<u64> = snap
        .workers()
        .map(|w| w.state.requests.load(Ordering::Relaxed))
        .collect();
    let t0 = Instant::now();
    drive(ctx.clone(), workload, a.secs, base_rate(workload) * a.load).await;
    let elapsed = t0.elapsed().as_secs_f64();
    sampling.store(false, Ordering::Relaxed);
    let diag = sampler.await.unwrap_or_default();
    let poll_errors = snap
        .workers()
        .map(|w| w.state.stats.poll_errors.load(Ordering::Relaxed))
        .sum::<u64>()
        - poll_errors0;
    let after = engine_counts(&sims, &client).await;
    let per: Vec<f64> = snap
        .workers()
        .zip(&req0)
        .map(|(w, r0)| (w.state.requests.load(Ordering::Relaxed) - r0) as f64)
        .collect();
    let mean = per.iter().sum::<f64>() / per.len() as f64;
    let max = per.iter().copied().fold(0.0, f64::max);
    let mut s = std::mem::take(&mut *ctx.samples.lock().unwrap());
    if std::env::var_os("RQ_DIAG").is_some() {
        print_diag(workload, policy, &mut s.routes, &diag, poll_errors);
    }
    let row = Row {
        workload: workload.into(),
        policy: policy.into(),
        p50: pct(&mut s.ttft_ms, 0.5),
        p99: pct(&mut s.ttft_ms, 0.99),
        throughput: s.completed as f64 / elapsed,
        hit_rate: (after.0 - before.0) / (after.1 - before.1).max(1.0),
        imbalance: if mean > 0.0 { max / mean } else { f64::NAN },
        requests: s.completed,
        errors: s.errors,
    };
    gw.shutdown().await;
    for s in sims {
        s.shutdown().await;
    }
    row
}

fn main() {
    let a = args();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mut rows = Vec::new();
    rt.block_on(async {
        for w in &a.workloads {
            for p in &a.policies {
                if p == "session" && w != "sessions" {
                    continue;
                }
                let r = run_one(&a, w, p).await;
                eprintln!(
                    "{:<9} {:<12} p50 {:>7.1} ms  p99 {:>7.1} ms  {:>5.1} req/s  hit {:>5.1} %  imbalance {:.2}  ({} ok, {} errors)",
                    r.workload, r.policy, r.p50, r.p99, r.throughput, r.hit_rate * 100.0, r.imbalance, r.requests, r.errors
                );
                rows.push(r);
            }
        }
    });
    println!(
        "\n| workload | policy | TTFT p50 (ms) | TTFT p99 (ms) | throughput (req/s) | prefix-cache hit rate | imbalance (max/mean) | requests | errors |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|");
    for r in &rows {
        println!(
            "| {} | {} | {:.1} | {:.1} | {:.1} | {:.1} % | {:.2} | {} | {} |",
            r.workload,
            r.policy,
            r.p50,
            r.p99,
            r.throughput,
            r.hit_rate * 100.0,
            r.imbalance,
            r.requests,
            r.errors
        );
    }
    println!(
        "\n{} workers, {} KV blocks × 16 tokens each, time_scale {}, {} s of arrivals per run, load × {}",
        WORKERS, NUM_BLOCKS, a.time_scale, a.secs, a.load
    );
}
