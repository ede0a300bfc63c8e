//! Prefill/decode disaggregation benchmark (scripted load run, not criterion).
//!
//! Same simulated hardware, two deployments, one long-prompt workload:
//! - `2P+2D`: two prefill and two decode workers behind a `vllm`-mode
//!   disaggregated pool;
//! - `4 combined`: four ordinary workers, round robin.
//!
//! Requests arrive as a Poisson process; each has a unique ~2k-token prompt and
//! streams 64 tokens. TTFT and inter-token gaps are measured at the client.
//!
//! Run: `cargo bench --bench pd` (env: PD_REQUESTS, PD_RATE, PD_PROMPT_WORDS).
//! Writes `bench-out/pd.md`.

use futures_util::StreamExt;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::time::{Duration, Instant};
use switchyard::config;
use switchyard::server;
use switchyard::sim::{self, Role, SimConfig, SimHandle};

fn env<T: std::str::FromStr>(k: &str, d: T) -> T {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(d)
}

struct Sample {
    ttft: Duration,
    gaps: Vec<Duration>,
    ok: bool,
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

async fn deploy(roles: &[Role], disagg: bool) -> (Vec<SimHandle>, server::ServerHandle, String) {
    let base = SimConfig::profile("llama-8b-h100").unwrap();
    let model = base.model.clone();
    let mut sims = Vec::new();
    for (i, r) in roles.iter().enumerate() {
        sims.push(
            sim::spawn(SimConfig {
                role: *r,
                seed: i as u64,
                ..base.clone()
            })
            .await
            .unwrap(),
        );
    }
    let workers: Vec<String> = sims
        .iter()
        .zip(roles)
        .map(|(s, r)| {
            let role = match r {
                Role::Prefill => "prefill",
                Role::Decode => "decode",
                Role::Both => "both",
            };
            format!(
                "{{ url = \"{}\", labels = {{ role = \"{role}\" }} }}",
                s.url()
            )
        })
        .collect();
    let mut toml = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n[[pools]]\nname = \"bench\"\nmodels = [\"{model}\"]\npolicy = \"round_robin\"\nworkers = [{}]\n",
        workers.join(", ")
    );
    if disagg {
        toml.push_str("[pools.disaggregation]\nmode = \"vllm\"\nmin_uncached_tokens = 256\n");
    }
    let cfg = config::parse(&toml).unwrap().validate().unwrap();
    let gw = server::spawn(cfg).await.unwrap();
    (sims, gw, model)
}

async fn one(client: reqwest::Client, url: String, body: serde_json::Value) -> Sample {
    let t0 = Instant::now();
    let mut out = Sample {
        ttft: Duration::ZERO,
        gaps: Vec::new(),
        ok: false,
    };
    let Ok(resp) = client.post(&url).json(&body).send().await else {
        return out;
    };
    if !resp.status().is_success() {
        return out;
    }
    let mut last: Option<Instant> = None;
    let mut stream = resp.bytes_stream();
    while let Some(Ok(chunk)) = stream.next().await {
        let now = Instant::now();
        // Each non-empty content event is one token; several may share a chunk.
        let key = b"\"content\":\"";
        let n = chunk
            .windows(key.len() + 1)
            .filter(|w| w.starts_with(key) && w[key.len()] != b'"')
            .count();
        for _ in 0..n {
            match last {
                None => out.ttft = now - t0,
                Some(p) => out.gaps.push(now - p),
            }
            last = Some(now);
        }
        if chunk.ends_with(b"data: [DONE]\n\n") {
            out.ok = true;
        }
    }
    out
}

async fn run(
    name: &str,
    roles: &[Role],
    disagg: bool,
    words: usize,
    n: usize,
    rate: f64,
) -> String {
    let (sims, gw, model) = deploy(roles, disagg).await;
    let url = format!("{}/v1/chat/completions", gw.url());
    let client = reqwest::Client::new();
    let mut rng = SmallRng::seed_from_u64(7);
    let vocab = [
        "alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa",
    ];
    let mut tasks = Vec::new();
    let start = Instant::now();
    let mut at = 0.0f64;
    for i in 0..n {
        at += -rng.gen::<f64>().max(1e-9).ln() / rate;
        let wait = Duration::from_secs_f64(at).saturating_sub(start.elapsed());
        tokio::time::sleep(wait).await;
        let prompt: String = (0..words)
            .map(|_| vocab[rng.gen_range(0..vocab.len())])
            .collect::<Vec<_>>()
            .join(" ");
        let body = serde_json::json!({"model": model, "stream": true, "max_tokens": 64, "ignore_eos": true,
            "messages": [{"role": "user", "content": format!("request {i}: {prompt}")}]});
        tasks.push(tokio::spawn(one(client.clone(), url.clone(), body)));
    }
    let mut ttft = Vec::new();
    let mut itl = Vec::new();
    let mut failed = 0;
    for t in tasks {
        let s = t.await.unwrap();
        if !s.ok {
            failed += 1;
            continue;
        }
        ttft.push(s.ttft.as_secs_f64() * 1e3);
        itl.extend(s.gaps.iter().map(|g| g.as_secs_f64() * 1e3));
    }
    let elapsed = start.elapsed().as_secs_f64();
    gw.shutdown().await;
    for s in sims {
        s.shutdown().await;
    }
    format!(
        "| {name} | {} | {failed} | {:.0} | {:.0} | {:.1} | {:.1} | {:.1} |",
        ttft.len(),
        pct(&mut ttft, 0.5),
        pct(&mut ttft, 0.99),
        pct(&mut itl, 0.5),
        pct(&mut itl, 0.99),
        (ttft.len() as f64) / elapsed,
    )
}

fn main() {
    let n: usize = env("PD_REQUESTS", 200);
    let rate: f64 = env("PD_RATE", 6.0);
    let words: usize = env("PD_PROMPT_WORDS", 2000);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut rows = Vec::new();
    rt.block_on(async {
        rows.push(
            run(
                "2P+2D (vllm mode)",
                &[Role::Prefill, Role::Prefill, Role::Decode, Role::Decode],
                true,
                words,
                n,
                rate,
            )
            .await,
        );
        rows.push(
            run(
                "4 combined (round robin)",
                &[Role::Both; 4],
                false,
                words,
                n,
                rate,
            )
            .await,
        );
    });
    let table = format!(
        "Workload: {n} requests, Poisson {rate}/s, unique ~{words}-word prompts, 64 streamed tokens; profile llama-8b-h100, real time.\n\n\
         | deployment | ok | failed | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) | ITL p99 (ms) | req/s |\n|---|---:|---:|---:|---:|---:|---:|---:|\n{}\n",
        rows.join("\n")
    );
    println!("{table}");
    std::fs::create_dir_all("bench-out").ok();
    std::fs::write("bench-out/pd.md", table).ok();
}
