//! Live worker stats: a small scanner for the engines' Prometheus text (vLLM and
//! SGLang names), atomics on each worker that hold the last scrape, the gateway's own
//! corrections between scrapes, and the poller tasks that keep them fresh.
//!
//! The load a policy sees is [`WorkerStats::load`]: `waiting + running` from the
//! last scrape, plus the requests this gateway started on the worker since that
//! scrape, minus those that finished — never less than this gateway's own in-flight
//! count. Stats older than `stale_after` make the worker count as fully loaded.

use super::{Registry, Worker};
use crate::proxy::UpstreamClient;
use crate::telemetry;
use http_body_util::{BodyExt, Limited};
use rand::Rng;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tokio::time::Instant;

/// Largest `/metrics` body the poller reads (bytes).
pub const MAX_METRICS_BYTES: usize = 4 * 1024 * 1024;
/// How often the poller supervisor looks for added or removed workers.
pub const SUPERVISE_EVERY: Duration = Duration::from_secs(1);

/// Milliseconds on the gateway's monotonic clock (tokio's, so paused-time tests
/// work). Starts at 1 so that 0 can mean "never".
pub fn now_ms() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    let epoch = *EPOCH.get_or_init(Instant::now);
    Instant::now().saturating_duration_since(epoch).as_millis() as u64 + 1
}

/// What one scrape found; `None` where the engine did not say.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Scraped {
    pub waiting: Option<f64>,
    pub running: Option<f64>,
    /// KV-cache usage, 0..=1.
    pub kv_usage: Option<f64>,
    pub num_gpu_blocks: Option<u64>,
    /// Tokens per engine KV block.
    pub block_size: Option<u64>,
    pub prefix_hits: Option<f64>,
    pub prefix_queries: Option<f64>,
}

impl Scraped {
    /// The scrape told us the queue: the worker speaks a dialect we know.
    pub fn is_useful(&self) -> bool {
        self.waiting.is_some() || self.running.is_some()
    }
}

fn add(slot: &mut Option<f64>, v: f64) {
    if v.is_finite() {
        *slot = Some(slot.unwrap_or(0.0) + v);
    }
}

fn max(slot: &mut Option<f64>, v: f64) {
    if v.is_finite() {
        *slot = Some(slot.map_or(v, |s| s.max(v)));
    }
}

/// Scan Prometheus text exposition for the names routing uses. Lines are split by
/// hand (name, optional `{labels}`, value); unknown names are skipped without
/// parsing their labels. Never panics on any input (property-tested).
pub fn parse_metrics(text: &str) -> Scraped {
    let mut s = Scraped::default();
    for line in text.lines() {
        let line = line.trim_start();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let name_end = line
            .find(|c: char| c == '{' || c.is_ascii_whitespace())
            .unwrap_or(line.len());
        let name = &line[..name_end];
        let rest = &line[name_end..];
        let (labels, rest) = if let Some(r) = rest.strip_prefix('{') {
            match label_block_end(r) {
                Some(end) => (&r[..end], &r[end + 1..]),
                None => continue,
            }
        } else {
            ("", rest)
        };
        let Some(value) = rest
            .split_ascii_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
        else {
            continue;
        };
        match name {
            "vllm:num_requests_waiting" | "sglang:num_queue_reqs" => add(&mut s.waiting, value),
            "vllm:num_requests_running" | "sglang:num_running_reqs" => add(&mut s.running, value),
            "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" | "sglang:token_usage" => {
                max(&mut s.kv_usage, value.clamp(0.0, 1.0))
            }
            "vllm:prefix_cache_hits_total" | "vllm:gpu_prefix_cache_hits_total" => {
                add(&mut s.prefix_hits, value)
            }
            "vllm:prefix_cache_queries_total" | "vllm:gpu_prefix_cache_queries_total" => {
                add(&mut s.prefix_queries, value)
            }
            "vllm:cache_config_info" => {
                if let Some(b) = label(labels, "num_gpu_blocks").and_then(|v| v.parse().ok()) {
                    s.num_gpu_blocks = Some(b);
                }
                if let Some(b) = label(labels, "block_size").and_then(|v| v.parse().ok()) {
                    s.block_size = Some(b);
                }
            }
            "sglang:max_total_num_tokens" if value.is_finite() && value >= 0.0 => {
                // SGLang counts its KV pool in tokens.
                s.num_gpu_blocks = Some(value as u64);
                s.block_size = Some(1);
            }
            _ => {}
        }
    }
    s
}

/// Index of the `}` closing a label block, skipping quoted values (with escapes).
fn label_block_end(r: &str) -> Option<usize> {
    let b = r.as_bytes();
    let mut i = 0;
    let mut quoted = false;
    while i < b.len() {
        match (b[i], quoted) {
            (b'\\', true) => i += 1,
            (b'"', _) => quoted = !quoted,
            (b'}', false) => return Some(i),
            _ => {}
        }
        i += 1;
    }
    None
}

/// The raw value of label `key` in a label block (escapes not decoded: the labels
/// we read are numbers).
fn label<'a>(labels: &'a str, key: &str) -> Option<&'a str> {
    let mut rest = labels;
    loop {
        let eq = rest.find('=')?;
        let k = rest[..eq].trim().trim_start_matches(',').trim();
        let after = rest[eq + 1..].trim_start().strip_prefix('"')?;
        let b = after.as_bytes();
        let mut i = 0;
        while i < b.len() && b[i] != b'"' {
            if b[i] == b'\\' {
                i += 1;
            }
            i += 1;
        }
        let v = after.get(..i.min(after.len()))?;
        if k == key {
            return Some(v);
        }
        rest = after.get(i + 1..)?;
    }
}

/// Fixed-point scale of `kv_usage` (parts per million).
const PPM: f64 = 1_000_000.0;

/// A worker's live stats: atomics written by the poller and the request path,
/// read by policies without locks.
#[derive(Debug, Default)]
pub struct WorkerStats {
    pub waiting: AtomicU64,
    pub running: AtomicU64,
    /// KV-cache usage in parts per million.
    pub kv_usage_ppm: AtomicU32,
    /// Engine KV blocks (`vllm:cache_config_info`), 0 when unknown.
    pub num_gpu_blocks: AtomicU64,
    /// Tokens per engine KV block, 0 when unknown.
    pub block_size: AtomicU64,
    /// Cumulative prefix-cache hits and queries as reported by the engine (tokens).
    pub prefix_hits: AtomicU64,
    pub prefix_queries: AtomicU64,
    /// [`now_ms`] of the last successful scrape; 0 = never.
    pub last_poll_ms: AtomicU64,
    /// Requests started minus requests finished since the last scrape.
    pub delta_since_poll: AtomicI64,
    /// Estimated prompt tokens sent since the last scrape.
    pub tokens_since_poll: AtomicU64,
    pub poll_errors: AtomicU64,
    /// Requests/s this gateway sent to the worker, EWMA over [`RATE_TAU`], × 1000.
    pub rate_milli: AtomicU64,
    rate_seen_requests: AtomicU64,
    rate_seen_ms: AtomicU64,
}

/// Time constant of the request-rate EWMA.
pub const RATE_TAU: Duration = Duration::from_secs(5);

/// How fresh a worker's stats are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Freshness {
    /// Never scraped successfully: only the gateway's own counts are known.
    Unknown,
    Fresh,
    /// Older than `stale_after`: scored as fully loaded.
    Stale,
}

/// A worker's load as a policy sees it at one instant.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Load {
    /// Estimated requests queued or running on the worker.
    pub queue: f64,
    /// KV-cache usage, 0..=1 (0 when unknown).
    pub kv_usage: f64,
    pub freshness: Freshness,
}

impl WorkerStats {
    /// Store a scrape taken at `now` and restart the local corrections.
    pub fn store(&self, s: &Scraped, now: u64) {
        let n = |v: Option<f64>| v.map_or(0, |v| v.max(0.0).round() as u64);
        self.waiting.store(n(s.waiting), Ordering::Relaxed);
        self.running.store(n(s.running), Ordering::Relaxed);
        if let Some(kv) = s.kv_usage {
            self.kv_usage_ppm
                .store((kv.clamp(0.0, 1.0) * PPM) as u32, Ordering::Relaxed);
        }
        if let Some(b) = s.num_gpu_blocks {
            self.num_gpu_blocks.store(b, Ordering::Relaxed);
        }
        if let Some(b) = s.block_size {
            self.block_size.store(b, Ordering::Relaxed);
        }
        if let Some(h) = s.prefix_hits {
            self.prefix_hits.store(h as u64, Ordering::Relaxed);
        }
        if let Some(q) = s.prefix_queries {
            self.prefix_queries.store(q as u64, Ordering::Relaxed);
        }
        self.delta_since_poll.store(0, Ordering::Relaxed);
        self.tokens_since_poll.store(0, Ordering::Relaxed);
        self.last_poll_ms.store(now, Ordering::Relaxed);
    }

    /// A request was sent to the worker (called with the in-flight guard).
    pub fn note_started(&self) {
        self.delta_since_poll.fetch_add(1, Ordering::Relaxed);
    }

    /// A request ended (the in-flight guard dropped).
    pub fn note_finished(&self) {
        self.delta_since_poll.fetch_sub(1, Ordering::Relaxed);
    }

    /// Add the estimated prompt tokens of a request just sent.
    pub fn note_tokens(&self, tokens: u64) {
        self.tokens_since_poll.fetch_add(tokens, Ordering::Relaxed);
    }

    /// Age of the last scrape at `now` (ms), `None` if never scraped.
    pub fn age_ms(&self, now: u64) -> Option<u64> {
        match self.last_poll_ms.load(Ordering::Relaxed) {
            0 => None,
            t => Some(now.saturating_sub(t)),
        }
    }

    /// The load at `now` given this gateway's in-flight count (pure: clock injected).
    pub fn load(&self, in_flight: u64, now: u64, stale_after_ms: u64) -> Load {
        let kv_usage = self.kv_usage_ppm.load(Ordering::Relaxed) as f64 / PPM;
        match self.age_ms(now) {
            None => Load {
                queue: in_flight as f64,
                kv_usage,
                freshness: Freshness::Unknown,
            },
            Some(age) if age > stale_after_ms => Load {
                // The scrape says nothing current; callers score this as fully
                // loaded and use `queue` only when every worker is stale.
                queue: in_flight as f64,
                kv_usage,
                freshness: Freshness::Stale,
            },
            Some(_) => {
                let polled =
                    self.waiting.load(Ordering::Relaxed) + self.running.load(Ordering::Relaxed);
                let delta = self.delta_since_poll.load(Ordering::Relaxed);
                let est = (polled as i64).saturating_add(delta).max(0) as u64;
                Load {
                    queue: est.max(in_flight) as f64,
                    kv_usage,
                    freshness: Freshness::Fresh,
                }
            }
        }
    }

    /// Fold the worker's request counter into the rate EWMA (called by the poller
    /// each tick; clock injected).
    pub fn update_rate(&self, requests: u64, now: u64) {
        let last_ms = self.rate_seen_ms.swap(now, Ordering::Relaxed);
        let last_req = self.rate_seen_requests.swap(requests, Ordering::Relaxed);
        if last_ms == 0 || now <= last_ms {
            return;
        }
        let dt = (now - last_ms) as f64 / 1000.0;
        let inst = requests.saturating_sub(last_req) as f64 / dt;
        let alpha = 1.0 - (-dt / RATE_TAU.as_secs_f64()).exp();
        let old = self.rate_milli.load(Ordering::Relaxed) as f64 / 1000.0;
        let new = old + alpha * (inst - old);
        self.rate_milli
            .store((new * 1000.0).round() as u64, Ordering::Relaxed);
    }

    /// Recent requests/s from this gateway (EWMA).
    pub fn rate(&self) -> f64 {
        self.rate_milli.load(Ordering::Relaxed) as f64 / 1000.0
    }

    /// KV capacity in tokens, when the engine published it.
    pub fn kv_capacity_tokens(&self) -> Option<u64> {
        let b = self.num_gpu_blocks.load(Ordering::Relaxed);
        let s = self.block_size.load(Ordering::Relaxed);
        (b > 0 && s > 0).then(|| b.saturating_mul(s))
    }
}

/// Control block shared between the supervisor and one worker's poll task.
struct PollCtl {
    interval_ms: AtomicU64,
    stop: AtomicBool,
    auth: arc_swap::ArcSwapOption<http::HeaderValue>,
}

/// Start the stats poller: a supervisor that re-reads the registry's snapshot every
/// [`SUPERVISE_EVERY`] and keeps one scrape task per distinct worker, at the
/// smallest `stats_interval` of the pools the worker belongs to.
pub fn spawn_stats_poller(
    registry: Arc<Registry>,
    client: UpstreamClient,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tasks: HashMap<Arc<str>, Arc<PollCtl>> = HashMap::new();
        loop {
            let snap = registry.snapshot();
            let mut want: HashMap<Arc<str>, (Arc<Worker>, u64, Option<http::HeaderValue>)> =
                HashMap::new();
            for pool in &snap.pools {
                let every = pool.config.routing.stats_interval.as_millis() as u64;
                for w in &pool.workers {
                    let e = want
                        .entry(w.id.clone())
                        .or_insert_with(|| (w.clone(), every, pool.upstream_auth.clone()));
                    e.1 = e.1.min(every);
                }
            }
            tasks.retain(|id, ctl| {
                let keep = want.contains_key(id);
                if !keep {
                    ctl.stop.store(true, Ordering::Relaxed);
                }
                keep
            });
            for (id, (w, every, auth)) in want {
                if let Some(ctl) = tasks.get(&id) {
                    ctl.interval_ms.store(every, Ordering::Relaxed);
                    ctl.auth.store(auth.map(Arc::new));
                    continue;
                }
                let ctl = Arc::new(PollCtl {
                    interval_ms: AtomicU64::new(every),
                    stop: AtomicBool::new(false),
                    auth: arc_swap::ArcSwapOption::new(auth.map(Arc::new)),
                });
                tasks.insert(id, ctl.clone());
                tokio::spawn(poll_worker(w, client.clone(), ctl));
            }
            tokio::time::sleep(SUPERVISE_EVERY).await;
        }
    })
}

async fn poll_worker(w: Arc<Worker>, client: UpstreamClient, ctl: Arc<PollCtl>) {
    let uri = format!("{}/metrics", w.id);
    let label = metrics::SharedString::from(w.id.clone());
    // Spread the first scrapes of many workers over one interval.
    let first = ctl.interval_ms.load(Ordering::Relaxed);
    let delay = rand::thread_rng().gen_range(0..first.max(1));
    tokio::time::sleep(Duration::from_millis(delay)).await;
    while !ctl.stop.load(Ordering::Relaxed) {
        let every = ctl.interval_ms.load(Ordering::Relaxed).max(1);
        let started = Instant::now();
        // A scrape may take at most a few intervals (and at most 1 s).
        let limit = Duration::from_millis((every * 4).clamp(50, 1_000));
        w.state
            .stats
            .update_rate(w.state.requests.load(Ordering::Relaxed), now_ms());
        let auth = ctl.auth.load_full();
        match tokio::time::timeout(limit, scrape(&client, &uri, auth.as_deref())).await {
            Ok(Ok(s)) if s.is_useful() => w.state.stats.store(&s, now_ms()),
            Ok(Ok(_)) => fail(&w, &label, "no known metric names"),
            Ok(Err(e)) => fail(&w, &label, &e.to_string()),
            Err(_) => fail(&w, &label, "timeout"),
        }
        // ±10 % jitter so scrapes of many workers do not align.
        let jitter = rand::thread_rng().gen_range(0.9..1.1);
        let next = started + Duration::from_millis(((every as f64) * jitter) as u64);
        tokio::time::sleep_until(next).await;
    }
}

fn fail(w: &Worker, label: &metrics::SharedString, why: &str) {
    w.state.stats.poll_errors.fetch_add(1, Ordering::Relaxed);
    telemetry::record_stats_poll_error(label);
    tracing::trace!(worker = %w.id, error = why, "stats scrape failed");
}

async fn scrape(
    client: &UpstreamClient,
    uri: &str,
    auth: Option<&http::HeaderValue>,
) -> anyhow::Result<Scraped> {
    let mut req = http::Request::get(uri).body(Default::default())?;
    if let Some(a) = auth {
        req.headers_mut()
            .insert(http::header::AUTHORIZATION, a.clone());
    }
    let resp = client.request(req).await?;
    if !resp.status().is_success() {
        anyhow::bail!("status {}", resp.status());
    }
    let body = Limited::new(resp.into_body(), MAX_METRICS_BYTES)
        .collect()
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?
        .to_bytes();
    Ok(parse_metrics(std::str::from_utf8(&body)?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const VLLM: &str = r#"# HELP vllm:num_requests_waiting Number of requests waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 2.0
vllm:num_requests_running{engine="0",model_name="m"} 7.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.42
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",gpu_memory_utilization="0.9",num_gpu_blocks="2048",prefix_caching_hash_algo="builtin"} 1.0
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 850.0
vllm:num_requests_waiting_by_reason{reason="capacity"} 99
"#;

    #[test]
    fn parses_vllm_names() {
        let s = parse_metrics(VLLM);
        assert_eq!(s.waiting, Some(5.0));
        assert_eq!(s.running, Some(7.0));
        assert_eq!(s.kv_usage, Some(0.42));
        assert_eq!(s.num_gpu_blocks, Some(2048));
        assert_eq!(s.block_size, Some(16));
        assert_eq!(s.prefix_hits, Some(850.0));
        assert_eq!(s.prefix_queries, Some(1000.0));
    }

    #[test]
    fn parses_old_vllm_and_sglang_names() {
        let s = parse_metrics(
            "vllm:gpu_cache_usage_perc{model_name=\"m\"} 0.5\nvllm:num_requests_running 1\n",
        );
        assert_eq!(
            (s.kv_usage, s.running, s.waiting),
            (Some(0.5), Some(1.0), None)
        );
        let s = parse_metrics(
            "sglang:num_queue_reqs{model_name=\"q\"} 4\nsglang:num_running_reqs{model_name=\"q\"} 6\nsglang:token_usage{model_name=\"q\"} 0.25\nsglang:max_total_num_tokens{model_name=\"q\"} 500000\n",
        );
        assert_eq!(
            (s.waiting, s.running, s.kv_usage),
            (Some(4.0), Some(6.0), Some(0.25))
        );
        assert_eq!((s.num_gpu_blocks, s.block_size), (Some(500_000), Some(1)));
        assert!(!parse_metrics("up 1\nnode_load1 3\n").is_useful());
    }

    #[test]
    fn quoted_braces_and_bad_values_are_tolerated() {
        let s = parse_metrics(
            "vllm:cache_config_info{x=\"a}b\\\"c\",num_gpu_blocks=\"12\",block_size=\"4\"} 1\nvllm:num_requests_waiting NaN\nvllm:num_requests_running{ 3\nvllm:num_requests_running oops\n",
        );
        assert_eq!(s.num_gpu_blocks, Some(12));
        assert_eq!(s.block_size, Some(4));
        assert_eq!(s.waiting, None);
        assert_eq!(s.running, None);
    }

    proptest! {
        #[test]
        fn scanner_never_panics(text in "\\PC*") {
            let _ = parse_metrics(&text);
        }

        #[test]
        fn scanner_never_panics_on_metric_like_lines(
            lines in proptest::collection::vec(
                "(vllm:cache_config_info|vllm:num_requests_waiting|sglang:token_usage)[{}\"=,a-z0-9\\\\ ]{0,40}[ ]?[-+.eE0-9NaInf]{0,8}",
                0..20,
            )
        ) {
            let _ = parse_metrics(&lines.join("\n"));
        }
    }

    #[test]
    fn rate_is_an_ewma_of_the_request_counter() {
        let st = WorkerStats::default();
        st.update_rate(0, 1_000);
        assert_eq!(st.rate(), 0.0);
        // 10 req/s for 20 s: converges to 10.
        for k in 1..=200u64 {
            st.update_rate(k, 1_000 + k * 100);
        }
        assert!((st.rate() - 10.0).abs() < 0.5, "{}", st.rate());
        // Then silence for 10 s (two time constants): below 10 × e^-2 + slack.
        for k in 1..=100u64 {
            st.update_rate(200, 21_000 + k * 100);
        }
        assert!(st.rate() < 1.5, "{}", st.rate());
    }

    #[test]
    fn load_uses_local_corrections_and_staleness() {
        let st = WorkerStats::default();
        // Never scraped: only the gateway's own in-flight count.
        let l = st.load(2, 1_000, 500);
        assert_eq!((l.queue, l.freshness), (2.0, Freshness::Unknown));
        st.store(&parse_metrics(VLLM), 1_000);
        assert_eq!(st.load(0, 1_100, 500).queue, 12.0);
        // A burst of 3 sent since the scrape counts before the next scrape.
        for _ in 0..3 {
            st.note_started();
        }
        assert_eq!(st.load(3, 1_100, 500).queue, 15.0);
        // Finishing ones lower it again, never below the local in-flight count.
        for _ in 0..20 {
            st.note_finished();
        }
        assert_eq!(st.load(1, 1_100, 500).queue, 1.0);
        assert_eq!(st.load(1, 1_100, 500).freshness, Freshness::Fresh);
        assert_eq!(st.load(1, 1_501, 500).freshness, Freshness::Stale);
        assert_eq!(st.kv_capacity_tokens(), Some(2048 * 16));
        // A new scrape resets the corrections.
        st.store(&parse_metrics("vllm:num_requests_running 1\n"), 2_000);
        assert_eq!(st.load(0, 2_000, 500).queue, 1.0);
    }
}
