//! Live worker stats: a small scanner for the engines' Prometheus text (vLLM and
//! SGLang names), atomics on each worker that hold the last scrape, the gateway's own
//! corrections between scrapes, and the poller tasks that keep them fresh.
//!
//! The load a policy sees is [`WorkerStats::load`]:
//! * `queue`: `waiting + running` from the last scrape, plus the requests this
//!   gateway started on the worker since that scrape was *sent*, minus those that
//!   finished since — never less than this gateway's own in-flight count;
//! * `pending_tokens`: the prefill work queued ahead of a new request — the
//!   estimated uncached prompt tokens of this gateway's requests on the worker that
//!   have not produced a first token yet, plus other clients' waiting requests
//!   (the scraped `waiting` beyond this gateway's own) at this gateway's mean
//!   prompt size. A request that is decoding costs the next one little; one that
//!   waits for its prefill delays it by that whole prefill.
//!
//! Stats older than `stale_after` make the worker count as fully loaded (the
//! routing pipeline scores it like the busiest fresh worker).

use super::{Registry, Worker};
use crate::kv_events::EngineStart;
use crate::telemetry;
use crate::upstream::UpstreamClient;
use http_body_util::{BodyExt, Limited};
use rand::Rng;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Largest `/metrics` body the poller reads (bytes).
pub const MAX_METRICS_BYTES: usize = 4 * 1024 * 1024;
/// How often the poller supervisor looks for added or removed workers.
pub const SUPERVISE_EVERY: Duration = Duration::from_secs(1);

/// The gateway's millisecond clock, re-exported where the stats use it.
pub use crate::runtime::clock::now_ms;

/// What one scrape found; `None` where the engine did not say.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Scraped {
    pub waiting: Option<f64>,
    pub running: Option<f64>,
    /// KV-cache usage, 0..=1.
    pub kv_usage: Option<f64>,
    pub num_gpu_blocks: Option<u64>,
    /// Tokens per engine KV block, as the capacity counts them (SGLang: 1).
    pub block_size: Option<u64>,
    /// Tokens per block the engine's prefix cache hashes (and its KV events
    /// report): vLLM's `block_size`, SGLang's `page_size`.
    pub kv_block_size: Option<u64>,
    pub prefix_hits: Option<f64>,
    pub prefix_queries: Option<f64>,
    /// Cumulative prompt tokens the engine received (`vllm:prompt_tokens_total`).
    pub prompt_tokens: Option<f64>,
    /// The engine process's start, Unix seconds (`process_start_time_seconds`).
    pub process_start: Option<f64>,
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
            "vllm:prompt_tokens_total" | "sglang:prompt_tokens_total" => {
                add(&mut s.prompt_tokens, value)
            }
            "process_start_time_seconds" => max(&mut s.process_start, value),
            "vllm:cache_config_info" => {
                if let Some(b) = label(labels, "num_gpu_blocks").and_then(|v| v.parse().ok()) {
                    s.num_gpu_blocks = Some(b);
                }
                if let Some(b) = label(labels, "block_size").and_then(|v| v.parse().ok()) {
                    s.block_size = Some(b);
                    s.kv_block_size = Some(b);
                }
            }
            // SGLang's info gauge (`page_size`, `num_pages` labels), later two gauges.
            "sglang:cache_config_info" => {
                if let Some(b) = label(labels, "page_size").and_then(|v| v.parse().ok()) {
                    s.kv_block_size = Some(b);
                }
            }
            "sglang:page_size" if value.is_finite() && value >= 1.0 => {
                s.kv_block_size = Some(value as u64);
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
/// Fixed-point scale of the measured bytes per token.
const MILLI: f64 = 1_000.0;
/// Prompt tokens measured before the bytes per token are trusted.
const CALIBRATE_MIN_TOKENS: u64 = 2_048;
/// The measurement's memory: past this many tokens, both sums are halved.
const CALIBRATE_HALF_AT: u64 = 1 << 22;

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
    /// Tokens per block of the engine's prefix cache as its `/metrics` says
    /// ([`Scraped::kv_block_size`]), 0 when it does not.
    pub kv_block_size: AtomicU64,
    /// The reported size last logged as disagreeing with its pool's, 0 when
    /// none is (a log line once per change: `pool/block_size.rs`).
    pub kv_block_size_flagged: AtomicU64,
    /// Cumulative prefix-cache hits and queries as reported by the engine (tokens).
    pub prefix_hits: AtomicU64,
    pub prefix_queries: AtomicU64,
    /// [`now_ms`] of the last successful scrape; 0 = never.
    pub last_poll_ms: AtomicU64,
    pub poll_errors: AtomicU64,
    /// Requests/s this gateway sent to the worker, EWMA over [`RATE_TAU`], × 1000.
    pub rate_milli: AtomicU64,
    rate_seen_requests: AtomicU64,
    rate_seen_ms: AtomicU64,
    /// Requests this gateway started / finished on the worker, ever.
    started: AtomicU64,
    finished: AtomicU64,
    /// `started` / `finished` / `pending_requests` when the stored scrape was sent.
    base_started: AtomicU64,
    base_finished: AtomicU64,
    base_pending: AtomicU64,
    /// Estimated uncached prompt tokens of this gateway's requests on the worker
    /// that have not produced a first token yet, and how many such requests.
    pending_tokens: AtomicU64,
    pending_requests: AtomicU64,
    /// Mean prompt tokens of the requests this gateway sends to the worker (EWMA).
    mean_prompt_tokens: AtomicU64,
    /// Routing-text bytes of this gateway's requests that reached their first
    /// token on the worker, ever (the engine has counted their prompt tokens by
    /// then); and the value and the engine's prompt-token counter at the last
    /// calibration.
    sent_bytes: AtomicU64,
    calib_bytes: AtomicU64,
    calib_tokens: AtomicU64,
    /// Bytes and engine prompt tokens accumulated for the measurement.
    acc_bytes: AtomicU64,
    acc_tokens: AtomicU64,
    /// Measured routing-text bytes per engine prompt token × 1000; 0 = not yet.
    bytes_per_token_milli: AtomicU64,
    /// The worker's GPUs by its DCGM exporter (label `dcgm_url`), when it has one.
    pub gpu: super::dcgm::GpuStats,
    /// The engine's process start time, read by its KV-event subscriber to
    /// notice a restart.
    pub engine_start: Arc<EngineStart>,
}

/// This gateway's counters at the moment a scrape is sent: requests started after
/// it are not in the engine's answer and keep counting as corrections.
#[derive(Clone, Copy, Debug, Default)]
pub struct ScrapeMark {
    started: u64,
    finished: u64,
    pending: u64,
    sent_bytes: u64,
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
    /// Estimated prompt tokens waiting for prefill on the worker (see the module docs).
    pub pending_tokens: f64,
    /// KV-cache usage, 0..=1 (0 when unknown).
    pub kv_usage: f64,
    pub freshness: Freshness,
}

/// A worker's engine counts as flow control reads them ([`WorkerStats::engine_counts`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EngineCounts {
    pub running: u64,
    pub waiting: u64,
    pub kv_usage: f64,
}

impl WorkerStats {
    /// This gateway's counters now: take it right before sending a scrape.
    pub fn mark(&self) -> ScrapeMark {
        ScrapeMark {
            started: self.started.load(Ordering::Relaxed),
            finished: self.finished.load(Ordering::Relaxed),
            pending: self.pending_requests.load(Ordering::Relaxed),
            sent_bytes: self.sent_bytes.load(Ordering::Relaxed),
        }
    }

    /// Store a scrape taken at `now`, counting corrections from now on.
    pub fn store(&self, s: &Scraped, now: u64) {
        self.store_marked(s, now, self.mark())
    }

    /// Store a scrape sent when `mark` was taken and received at `now`: requests
    /// started or finished since `mark` stay as corrections.
    pub fn store_marked(&self, s: &Scraped, now: u64, mark: ScrapeMark) {
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
        if let Some(b) = s.kv_block_size {
            self.kv_block_size.store(b, Ordering::Relaxed);
        }
        if let Some(h) = s.prefix_hits {
            self.prefix_hits.store(h as u64, Ordering::Relaxed);
        }
        if let Some(q) = s.prefix_queries {
            self.prefix_queries.store(q as u64, Ordering::Relaxed);
        }
        if let Some(t) = s.prompt_tokens {
            self.calibrate(t.max(0.0) as u64, mark.sent_bytes);
        }
        if let Some(t) = s.process_start {
            self.engine_start.observe(t);
        }
        self.base_started.store(mark.started, Ordering::Relaxed);
        self.base_finished.store(mark.finished, Ordering::Relaxed);
        self.base_pending.store(mark.pending, Ordering::Relaxed);
        self.last_poll_ms.store(now, Ordering::Relaxed);
    }

    /// Update the measured bytes per token: the routing-text bytes of requests
    /// that reached their first token (when vLLM counts their prompt tokens) over
    /// the engine's prompt-token counter, both accumulated since the first scrape
    /// and halved whenever the tokens pass [`CALIBRATE_HALF_AT`], so the ratio is
    /// stable (a request counted on one side only at a scrape is a small part of
    /// the total) yet follows a lasting change of traffic. An engine restart (its
    /// counter going back) restarts the baseline, not the measurement.
    fn calibrate(&self, tokens: u64, bytes: u64) {
        let t0 = self.calib_tokens.load(Ordering::Relaxed);
        let b0 = self.calib_bytes.load(Ordering::Relaxed);
        self.calib_tokens.store(tokens.max(1), Ordering::Relaxed);
        self.calib_bytes.store(bytes, Ordering::Relaxed);
        if tokens < t0 || bytes < b0 || t0 == 0 {
            return;
        }
        let mut acc_t = self.acc_tokens.load(Ordering::Relaxed) + (tokens - t0);
        let mut acc_b = self.acc_bytes.load(Ordering::Relaxed) + (bytes - b0);
        if acc_t > CALIBRATE_HALF_AT {
            acc_t /= 2;
            acc_b /= 2;
        }
        self.acc_tokens.store(acc_t, Ordering::Relaxed);
        self.acc_bytes.store(acc_b, Ordering::Relaxed);
        if acc_t < CALIBRATE_MIN_TOKENS || acc_b == 0 {
            return; // too little yet, or another client's traffic only
        }
        let bpt = (acc_b as f64 / acc_t as f64).clamp(0.5, 32.0);
        self.bytes_per_token_milli
            .store((bpt * MILLI).round() as u64, Ordering::Relaxed);
    }

    /// Routing-text bytes per engine prompt token, as measured; `None` until
    /// enough traffic went through. Other clients of the same engine make it low.
    pub fn bytes_per_token(&self) -> Option<f64> {
        match self.bytes_per_token_milli.load(Ordering::Relaxed) {
            0 => None,
            m => Some(m as f64 / MILLI),
        }
    }

    /// A request was sent to the worker (called with the in-flight guard):
    /// `prompt_tokens` estimated, `prefill_tokens` of them uncached.
    pub fn note_started(&self, prompt_tokens: u64, prefill_tokens: u64) {
        self.started.fetch_add(1, Ordering::Relaxed);
        self.pending_tokens
            .fetch_add(prefill_tokens, Ordering::Relaxed);
        self.pending_requests.fetch_add(1, Ordering::Relaxed);
        // EWMA with weight 1/16; races between requests only blur it.
        let old = self.mean_prompt_tokens.load(Ordering::Relaxed);
        let new = if old == 0 {
            prompt_tokens
        } else {
            (old * 15 + prompt_tokens) / 16
        };
        self.mean_prompt_tokens.store(new, Ordering::Relaxed);
    }

    /// The request's first token arrived (`Some(prompt bytes)`), or it ended
    /// without one (`None`): its prefill no longer delays others. Called once per
    /// request.
    pub fn note_prefilled(&self, prefill_tokens: u64, first_token: Option<u64>) {
        self.pending_tokens
            .fetch_sub(prefill_tokens, Ordering::Relaxed);
        self.pending_requests.fetch_sub(1, Ordering::Relaxed);
        if let Some(bytes) = first_token {
            self.sent_bytes.fetch_add(bytes, Ordering::Relaxed);
        }
    }

    /// A request ended (the in-flight guard dropped).
    pub fn note_finished(&self) {
        self.finished.fetch_add(1, Ordering::Relaxed);
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
        let local_pending = self.pending_tokens.load(Ordering::Relaxed) as f64;
        let local = |freshness| Load {
            queue: in_flight as f64,
            pending_tokens: local_pending,
            kv_usage,
            freshness,
        };
        match self.age_ms(now) {
            None => local(Freshness::Unknown),
            // The scrape says nothing current; callers score this as fully
            // loaded and use these local counts only when every worker is stale.
            Some(age) if age > stale_after_ms => local(Freshness::Stale),
            Some(_) => {
                let waiting = self.waiting.load(Ordering::Relaxed);
                // Saturating: a worker may report any count (`1e400` reads as u64::MAX).
                let polled = waiting.saturating_add(self.running.load(Ordering::Relaxed));
                let since = |total: &AtomicU64, base: &AtomicU64| {
                    total
                        .load(Ordering::Relaxed)
                        .saturating_sub(base.load(Ordering::Relaxed)) as i64
                };
                let est = (polled as i64)
                    .saturating_add(since(&self.started, &self.base_started))
                    .saturating_sub(since(&self.finished, &self.base_finished))
                    .max(0) as u64;
                // Waiting requests beyond this gateway's own unstarted ones at the
                // scrape belong to other clients; their size is unknown, so count
                // them at this gateway's mean prompt size.
                let foreign = waiting.saturating_sub(self.base_pending.load(Ordering::Relaxed));
                let mean = self.mean_prompt_tokens.load(Ordering::Relaxed) as f64;
                Load {
                    queue: est.max(in_flight) as f64,
                    pending_tokens: local_pending + foreign as f64 * mean,
                    kv_usage,
                    freshness: Freshness::Fresh,
                }
            }
        }
    }

    /// The engine's running and waiting requests and KV usage as of the last
    /// fresh scrape, corrected by this gateway's requests since it was sent:
    /// started ones count as waiting, finished ones leave the running. `None`
    /// when never scraped or stale (flow control then relies on in-flight counts).
    pub fn engine_counts(&self, now: u64, stale_after_ms: u64) -> Option<EngineCounts> {
        if self.age_ms(now)? > stale_after_ms {
            return None;
        }
        let since = |total: &AtomicU64, base: &AtomicU64| {
            total
                .load(Ordering::Relaxed)
                .saturating_sub(base.load(Ordering::Relaxed)) as i64
        };
        let net = since(&self.started, &self.base_started)
            .saturating_sub(since(&self.finished, &self.base_finished));
        let running = self.running.load(Ordering::Relaxed) as i64;
        Some(EngineCounts {
            running: running.saturating_add(net.min(0)).max(0) as u64,
            waiting: self
                .waiting
                .load(Ordering::Relaxed)
                .saturating_add(net.max(0) as u64),
            kv_usage: self.kv_usage_ppm.load(Ordering::Relaxed) as f64 / PPM,
        })
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

    /// KV capacity in bytes of routing text, when the engine published its
    /// capacity: tokens × the measured bytes per token, else × `default_bpt`.
    pub fn kv_capacity_bytes(&self, default_bpt: f64) -> Option<u64> {
        let bpt = self.bytes_per_token().unwrap_or(default_bpt);
        self.kv_capacity_tokens()
            .map(|t| (t as f64 * bpt).round() as u64)
    }
}

/// Control block shared between the supervisor and one worker's poll task.
struct PollCtl {
    interval_ms: AtomicU64,
    stop: AtomicBool,
    auth: arc_swap::ArcSwapOption<http::HeaderValue>,
}

/// Start the stats poller: a supervisor that re-reads the registry's pool set every
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
                tokio::spawn(poll_worker(w, client.clone(), ctl, registry.clone()));
            }
            tokio::time::sleep(SUPERVISE_EVERY).await;
        }
    })
}

async fn poll_worker(
    w: Arc<Worker>,
    client: UpstreamClient,
    ctl: Arc<PollCtl>,
    registry: Arc<Registry>,
) {
    let uri = format!("{}/metrics", w.id);
    let dcgm = w.labels.get(super::dcgm::DCGM_LABEL).cloned();
    let label = metrics::SharedString::from(w.id.clone());
    // Spread the first scrapes of many workers over one interval.
    let first = ctl.interval_ms.load(Ordering::Relaxed);
    let delay = rand::thread_rng().gen_range(0..first.max(1));
    tokio::time::sleep(Duration::from_millis(delay)).await;
    while !ctl.stop.load(Ordering::Relaxed) {
        let every = ctl.interval_ms.load(Ordering::Relaxed).max(1);
        let started = crate::runtime::clock::now();
        // A scrape may take at most a few intervals (and at most 1 s).
        let limit = Duration::from_millis((every * 4).clamp(50, 1_000));
        w.state
            .stats
            .update_rate(w.state.requests.load(Ordering::Relaxed), now_ms());
        let auth = ctl.auth.load_full();
        let mark = w.state.stats.mark();
        match tokio::time::timeout(limit, scrape(&client, &uri, auth.as_deref())).await {
            Ok(Ok(s)) if s.is_useful() => {
                w.state.stats.store_marked(&s, now_ms(), mark);
                if s.kv_block_size.is_some() {
                    super::block_size::observe(&registry.snapshot(), &w);
                }
                // The scrape may show room: a held request gets a turn.
                registry.kick_queues();
            }
            Ok(Ok(_)) => fail(&w, &label, "no known metric names"),
            Ok(Err(e)) => fail(&w, &label, &e.to_string()),
            Err(_) => fail(&w, &label, "timeout"),
        }
        if let Some(url) = &dcgm {
            scrape_gpu(&w, &client, url, limit, &label).await;
        }
        // ±10 % jitter so scrapes of many workers do not align.
        let jitter = rand::thread_rng().gen_range(0.9..1.1);
        let next = started + Duration::from_millis(((every as f64) * jitter) as u64);
        tokio::time::sleep_until(next).await;
    }
}

/// Scrape the worker's DCGM exporter into its GPU stats; a failure is counted
/// like a failed engine scrape (`source="dcgm"` in the log line).
async fn scrape_gpu(
    w: &Worker,
    client: &UpstreamClient,
    url: &str,
    limit: Duration,
    label: &metrics::SharedString,
) {
    match tokio::time::timeout(limit, fetch_text(client, url, None)).await {
        Ok(Ok(text)) => w
            .state
            .stats
            .gpu
            .store(&super::dcgm::parse_dcgm(&text), now_ms()),
        Ok(Err(e)) => fail(w, label, &format!("dcgm: {e}")),
        Err(_) => fail(w, label, "dcgm: timeout"),
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
    Ok(parse_metrics(&fetch_text(client, uri, auth).await?))
}

/// One scrape of `worker`'s `/metrics` (`check-config --probe`): what it says
/// within `limit`.
pub async fn scrape_once(
    client: &UpstreamClient,
    worker: &str,
    auth: Option<&http::HeaderValue>,
    limit: Duration,
) -> anyhow::Result<Scraped> {
    let uri = format!("{}/metrics", worker.trim_end_matches('/'));
    match tokio::time::timeout(limit, scrape(client, &uri, auth)).await {
        Ok(r) => r,
        Err(_) => anyhow::bail!("no answer within {limit:?}"),
    }
}

/// GET `uri` and read its body as text (at most [`MAX_METRICS_BYTES`]).
async fn fetch_text(
    client: &UpstreamClient,
    uri: &str,
    auth: Option<&http::HeaderValue>,
) -> anyhow::Result<String> {
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
    Ok(String::from_utf8(body.to_vec())?)
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
# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.
# TYPE process_start_time_seconds gauge
process_start_time_seconds 1.76471123456e+09
"#;

    /// Found by the `engine_metrics` fuzz target: huge counts from a worker
    /// overflowed the load estimate.
    #[test]
    fn absurd_counts_from_a_worker_do_not_overflow() {
        let s = parse_metrics("vllm:num_requests_waiting 1e400\nvllm:num_requests_running 1e400\n");
        let w = WorkerStats::default();
        w.store(&s, 1_000);
        let l = w.load(3, 2_000, 5_000);
        assert!(l.queue.is_finite());
    }

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
        assert_eq!(s.process_start, Some(1_764_711_234.56));
    }

    #[test]
    fn a_scrape_reports_the_engine_start_time_to_its_subscriber() {
        let w = WorkerStats::default();
        w.store(&parse_metrics(VLLM), 1_000);
        assert_eq!(w.engine_start.get_ms(), Some(1_764_711_234_560));
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
        assert_eq!(s.kv_block_size, None, "a token count is not a page size");
        assert!(!parse_metrics("up 1\nnode_load1 3\n").is_useful());
    }

    #[test]
    fn the_prefix_cache_block_size_comes_from_each_dialect() {
        let kv = |t: &str| parse_metrics(t).kv_block_size;
        let vllm = "vllm:cache_config_info{block_size=\"128\",num_gpu_blocks=\"9\"} 1\n";
        assert_eq!(kv(vllm), Some(128));
        let info = "sglang:cache_config_info{num_pages=\"100\",page_size=\"64\"} 1\n";
        assert_eq!(kv(info), Some(64));
        assert_eq!(kv("sglang:page_size{model_name=\"q\"} 32\n"), Some(32));
        assert_eq!(kv("sglang:page_size 0\nsglang:page_size NaN\n"), None);
        let s = parse_metrics(&format!("{info}sglang:max_total_num_tokens 500\n"));
        assert_eq!((s.kv_block_size, s.block_size), (Some(64), Some(1)));
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
            st.note_started(0, 0);
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

    /// Requests sent while a scrape is on its way are not in the engine's answer:
    /// storing the answer must not forget them.
    #[test]
    fn requests_sent_during_a_scrape_stay_counted() {
        let st = WorkerStats::default();
        let mark = st.mark();
        for _ in 0..3 {
            st.note_started(0, 0);
        }
        st.store_marked(&parse_metrics("vllm:num_requests_running 2\n"), 1_000, mark);
        // 2 the engine saw + 3 it had not seen yet (in-flight floor left out: 0).
        assert_eq!(st.load(0, 1_000, 500).queue, 5.0);
        // One of the engine's two finishes: 4.
        st.note_finished();
        assert_eq!(st.load(0, 1_000, 500).queue, 4.0);
        // The next scrape, sent after all of them, restarts from its own count.
        let mark = st.mark();
        st.store_marked(&parse_metrics("vllm:num_requests_running 4\n"), 1_100, mark);
        assert_eq!(st.load(0, 1_100, 500).queue, 4.0);
    }

    /// A request waiting for its prefill delays the next one by that prefill; once
    /// its first token is out, it no longer does.
    #[test]
    fn pending_prefill_counts_until_the_first_token() {
        let st = WorkerStats::default();
        st.store(&parse_metrics("vllm:num_requests_running 0\n"), 1_000);
        st.note_started(2_000, 1_500);
        st.note_started(2_000, 2_000);
        assert_eq!(st.load(2, 1_000, 500).pending_tokens, 3_500.0);
        st.note_prefilled(1_500, Some(8_000));
        assert_eq!(st.load(2, 1_000, 500).pending_tokens, 2_000.0);
        // Stale or never scraped: the local part still counts.
        assert_eq!(st.load(2, 9_000, 500).pending_tokens, 2_000.0);
        // Other clients' waiting requests (beyond this gateway's one unstarted
        // request at the scrape) count at this gateway's mean prompt size.
        let mark = st.mark();
        st.store_marked(&parse_metrics("vllm:num_requests_waiting 4\n"), 1_100, mark);
        assert_eq!(
            st.load(1, 1_100, 500).pending_tokens,
            2_000.0 + 3.0 * 2_000.0
        );
    }

    #[test]
    fn bytes_per_token_is_measured_from_the_prompt_token_counter() {
        let st = WorkerStats::default();
        let scrape = |tokens: u64| {
            let mark = st.mark();
            let text = format!(
                "vllm:num_requests_running 0\nvllm:prompt_tokens_total {tokens}\nvllm:cache_config_info{{num_gpu_blocks=\"100\",block_size=\"16\"}} 1\n"
            );
            st.store_marked(&parse_metrics(&text), 1_000, mark);
        };
        scrape(500);
        assert_eq!(st.bytes_per_token(), None);
        assert_eq!(st.kv_capacity_bytes(4.0), Some(1_600 * 4));
        // 6 bytes per token: 10,000 tokens for 60,000 bytes of requests that got
        // their first token (a request that failed before counts no bytes).
        for _ in 0..10 {
            st.note_started(1_500, 1_500);
            st.note_prefilled(1_500, Some(6_000));
        }
        st.note_started(1_500, 1_500);
        st.note_prefilled(1_500, None);
        scrape(10_500);
        assert_eq!(st.bytes_per_token(), Some(6.0));
        assert_eq!(st.kv_capacity_bytes(4.0), Some(1_600 * 6));
        // Later traffic moves the accumulated ratio: 100 tokens at 1 byte each.
        st.note_started(100, 100);
        st.note_prefilled(100, Some(100));
        scrape(10_600);
        assert_eq!(
            st.bytes_per_token(),
            Some(60_100.0 / 10_100.0 * 1000.0).map(|v: f64| v.round() / 1000.0)
        );
        // An engine restart (its counter back to 0) keeps the measurement.
        scrape(0);
        assert!(st.bytes_per_token().is_some());
    }
}
