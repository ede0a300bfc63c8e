//! Shared helpers for integration tests: start gateways and simulated workers on
//! ephemeral loopback ports, and a scriptable upstream for header/streaming checks.
#![allow(dead_code)]

pub mod raw;
pub mod scripted;
pub mod tls;

use std::time::Duration;
use switchyard::config;
use switchyard::server::{self, ServerHandle};

/// Start a gateway from TOML text; `{listen}` is filled with an ephemeral address.
pub async fn gateway(toml: &str) -> ServerHandle {
    let text = if toml.contains("[server]") {
        toml.replacen("[server]", "[server]\nlisten = \"127.0.0.1:0\"", 1)
    } else {
        format!("[server]\nlisten = \"127.0.0.1:0\"\n{toml}")
    };
    let cfg = config::parse(&text)
        .and_then(|r| r.validate())
        .unwrap_or_else(|e| panic!("test config invalid: {e}\n{text}"));
    server::spawn(cfg).await.expect("gateway starts")
}

/// A one-pool config over `urls` serving `model`.
pub fn pool_toml(model: &str, urls: &[&str], extra_pool_lines: &str) -> String {
    let workers: Vec<String> = urls
        .iter()
        .map(|u| format!("{{ url = \"{u}\" }}"))
        .collect();
    format!(
        "[[pools]]\nname = \"p\"\nmodels = [\"{model}\"]\n{extra_pool_lines}\nworkers = [{}]\n",
        workers.join(", ")
    )
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap()
}

/// Poll `f` until it returns `Some`, or panic after `within`.
pub async fn eventually<T, F, Fut>(within: Duration, what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        if tokio::time::Instant::now() > deadline {
            panic!("timed out waiting for: {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Sum of a Prometheus sample family whose labels include every `(k, v)` in `want`.
pub fn metric_sum(text: &str, name: &str, want: &[(&str, &str)]) -> f64 {
    let lines = text.lines().map(|l| Ok(l.to_string()));
    let scrape = prometheus_parse::Scrape::parse(lines).expect("valid exposition text");
    scrape
        .samples
        .iter()
        .filter(|s| s.metric == name)
        .filter(|s| want.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
        .map(|s| match s.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => v,
            prometheus_parse::Value::Histogram(ref h) => {
                h.iter().map(|b| b.count).fold(0.0, f64::max)
            }
            prometheus_parse::Value::Summary(_) => 0.0,
        })
        .sum()
}

/// POST a short chat completion for `model` to the gateway at `url`; its status.
pub async fn chat_status(url: &str, model: &str) -> u16 {
    client()
        .post(format!("{url}/v1/chat/completions"))
        .json(&serde_json::json!({"model": model, "max_tokens": 2,
                                  "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

/// GET `url` and read its JSON body (any status).
pub async fn get_json(url: &str) -> serde_json::Value {
    client()
        .get(url)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

pub async fn scrape(url: &str) -> String {
    client()
        .get(format!("{url}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// Start `n` quick simulated workers (tiny profile) with a time scale.
pub async fn sims(n: usize, time_scale: f64) -> Vec<switchyard::sim::SimHandle> {
    let mut v = Vec::new();
    for i in 0..n {
        let cfg = switchyard::sim::SimConfig {
            time_scale,
            seed: i as u64,
            ..switchyard::sim::SimConfig::profile("tiny").expect("tiny profile")
        };
        v.push(switchyard::sim::spawn(cfg).await.expect("sim starts"));
    }
    v
}

/// Model name served by `sims()`.
/// A prompt of `words` words, distinct per `tag` (`tag0 tag1 …`): long enough for
/// many KV blocks, and sharing no block with another tag's.
pub fn tagged_words(tag: &str, words: usize) -> String {
    (0..words)
        .map(|i| format!("{tag}{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

pub fn sim_model() -> String {
    switchyard::sim::SimConfig::profile("tiny").unwrap().model
}

pub fn urls(sims: &[switchyard::sim::SimHandle]) -> Vec<String> {
    sims.iter().map(|s| s.url()).collect()
}

/// A value from a simulated worker's `/metrics` (vLLM names contain `:`, which
/// prometheus-parse skips, so this reads the line directly).
pub async fn sim_metric(url: &str, name: &str) -> f64 {
    let text = client()
        .get(format!("{url}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Stream a chat completion and return the raw SSE text.
pub async fn stream_text(url: &str, body: serde_json::Value) -> (u16, String) {
    let r = client()
        .post(format!("{url}/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let text = match r.text().await {
        Ok(t) => t,
        Err(e) => format!("<transport error: {e}>"),
    };
    (status, text)
}

/// A `switchyard serve --config FILE` process and its URLs (killed on drop).
pub struct Replica {
    pub child: tokio::process::Child,
    pub url: String,
    /// The admin listener's URL, when the config has one.
    pub admin: Option<String>,
}

/// Start the real binary on an ephemeral port with `config`; returns once it
/// prints its ready line.
pub async fn serve_binary(config: &std::path::Path) -> Replica {
    serve_binary_with(config, &[], None).await
}

/// [`serve_binary`] with environment variables set and stderr written to a
/// file (else discarded).
pub async fn serve_binary_with(
    config: &std::path::Path,
    env: &[(&str, &str)],
    stderr: Option<&std::path::Path>,
) -> Replica {
    use tokio::io::AsyncBufReadExt;
    let stderr = match stderr {
        Some(f) => std::process::Stdio::from(std::fs::File::create(f).unwrap()),
        None => std::process::Stdio::null(),
    };
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args(["serve", "--listen", "127.0.0.1:0", "--config"])
        .arg(config)
        .envs(env.iter().copied())
        .stdout(std::process::Stdio::piped())
        .stderr(stderr)
        .kill_on_drop(true)
        .spawn()
        .expect("binary starts");
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let (url, admin) = tokio::time::timeout(Duration::from_secs(30), async {
        let mut admin = None;
        while let Some(l) = lines.next_line().await.unwrap() {
            if let Some(a) = l.strip_prefix("switchyard admin url=") {
                admin = Some(a.to_string());
            }
            if let Some(u) = l.strip_prefix("switchyard ready url=") {
                return (u.to_string(), admin);
            }
        }
        panic!("binary exited before printing its url");
    })
    .await
    .expect("ready line");
    // Keep draining stdout so the process never blocks on a full pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Replica { child, url, admin }
}

/// Write `toml` to a fresh file under the temp dir (named for the test).
pub fn config_file(name: &str, toml: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("switchyard-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("gw.toml");
    std::fs::write(&file, toml).unwrap();
    file
}

/// Start `switchyard ARGS…` and wait for its stdout line starting with
/// `prefix` (a readiness line); the process is killed on drop.
pub async fn spawn_binary_line(args: &[&str], prefix: &str) -> (tokio::process::Child, String) {
    use tokio::io::AsyncBufReadExt;
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("binary starts");
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let line = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(l) = lines.next_line().await.unwrap() {
            if l.starts_with(prefix) {
                return l;
            }
        }
        panic!("exited before printing {prefix:?}");
    })
    .await
    .expect("ready line");
    // Keep draining stdout so the child never blocks on a full pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    (child, line)
}

/// The value of `name=` in a readiness line.
pub fn line_field(line: &str, name: &str) -> String {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(&format!("{name}=")))
        .unwrap_or_else(|| panic!("no {name}= in {line:?}"))
        .to_string()
}
