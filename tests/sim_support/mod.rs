//! Helpers shared by the `sim_*` integration tests.
#![allow(dead_code)]

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde_json::Value;
use switchyard::sim::{spawn, SimConfig, SimHandle};

/// A small, quick engine: tests override what they measure.
pub fn cfg() -> SimConfig {
    SimConfig {
        time_scale: 2.0,
        ..SimConfig::profile("tiny").expect("tiny profile")
    }
}

pub async fn sim(cfg: SimConfig) -> SimHandle {
    spawn(cfg).await.expect("spawn sim")
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .expect("client")
}

/// What a streaming request saw.
#[derive(Debug)]
pub struct Streamed {
    pub status: u16,
    /// Parsed `data:` JSON events, in order (`[DONE]` excluded).
    pub events: Vec<Value>,
    /// Each event's `event:` name ("" when it has none), parallel to `events`.
    pub names: Vec<String>,
    /// When each event arrived, relative to the request start.
    pub at: Vec<Duration>,
    pub done: bool,
    /// The body ended with a transport error.
    pub broken: bool,
}

impl Streamed {
    /// Content (chat `delta.content` or completion `text`) events only.
    pub fn tokens(&self) -> Vec<(Duration, String)> {
        self.events
            .iter()
            .zip(&self.at)
            .filter_map(|(e, t)| {
                let c = e.get("choices")?.get(0)?;
                let text = c
                    .get("text")
                    .or_else(|| c.get("delta")?.get("content"))?
                    .as_str()?;
                if text.is_empty() {
                    return None;
                }
                Some((*t, text.to_string()))
            })
            .collect()
    }

    /// Time to the first content token.
    pub fn ttft(&self) -> Duration {
        self.tokens().first().map(|t| t.0).expect("no token")
    }

    pub fn usage(&self) -> Option<&Value> {
        self.events.iter().find_map(|e| e.get("usage"))
    }
}

pub async fn stream(
    client: &reqwest::Client,
    url: &str,
    body: Value,
    fault: Option<&str>,
) -> Streamed {
    let start = Instant::now();
    let mut req = client.post(url).json(&body);
    if let Some(f) = fault {
        req = req.header("x-sim-fault", f);
    }
    let resp = req.send().await.expect("send");
    let status = resp.status().as_u16();
    let mut s = Streamed {
        status,
        events: Vec::new(),
        names: Vec::new(),
        at: Vec::new(),
        done: false,
        broken: false,
    };
    let mut buf = Vec::<u8>::new();
    let mut body = resp.bytes_stream();
    while let Some(chunk) = body.next().await {
        let Ok(chunk) = chunk else {
            s.broken = true;
            break;
        };
        let now = start.elapsed();
        buf.extend_from_slice(&chunk);
        while let Some(pos) = buf.windows(2).position(|w| w == b"\n\n") {
            let ev: Vec<u8> = buf.drain(..pos + 2).collect();
            let block = std::str::from_utf8(&ev).expect("utf8").trim_end();
            // An optional `event: NAME` line, then one `data: ...` line.
            let (name, line) = match block.split_once('\n') {
                Some((first, rest)) => {
                    let name = first.strip_prefix("event: ").expect("event: prefix");
                    (name, rest)
                }
                None => ("", block),
            };
            let data = line.strip_prefix("data: ").expect("data: prefix");
            if data == "[DONE]" {
                s.done = true;
            } else {
                s.events
                    .push(serde_json::from_str(data).expect("event JSON"));
                s.names.push(name.to_string());
                s.at.push(now);
            }
        }
    }
    s
}

/// POST a JSON body; the status and the JSON answer.
pub async fn post_json(client: &reqwest::Client, url: &str, body: &Value) -> (u16, Value) {
    let r = client.post(url).json(body).send().await.expect("send");
    let status = r.status().as_u16();
    (status, r.json().await.expect("JSON answer"))
}

pub fn chat_body(model: &str, content: &str, max_tokens: u32) -> Value {
    serde_json::json!({
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "ignore_eos": true,
        "stream": true,
        "stream_options": {"include_usage": true},
    })
}

/// A deterministic text of about `words` words, distinct per `tag`.
pub fn text(tag: &str, words: usize) -> String {
    let mut s = format!("{tag}:");
    for i in 0..words {
        s.push_str(&format!(" w{}", (i * 7919) % 1000));
    }
    s
}

pub async fn metrics(client: &reqwest::Client, base: &str) -> String {
    client
        .get(format!("{base}/metrics"))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("metrics text")
}

/// Value of the first sample named exactly `name` whose labels contain `filter`.
pub fn metric(text: &str, name: &str, filter: &str) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (head, value) = l.rsplit_once(' ')?;
        let n = head.split('{').next()?;
        (n == name && head.contains(filter)).then(|| value.parse().ok())?
    })
}

/// Poll `/metrics` until `pred` holds (a readiness check, not a sleep).
pub async fn wait_metrics(
    client: &reqwest::Client,
    base: &str,
    what: &str,
    pred: impl Fn(&str) -> bool,
) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let m = metrics(client, base).await;
        if pred(&m) {
            return m;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}:\n{m}"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}
