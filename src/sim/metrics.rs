//! The engine's own counters and their Prometheus text rendering, under
//! vLLM's (V1) or SGLang's metric names. Rendered by hand, per engine, so
//! several simulated engines and the gateway can share one process.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use super::EngineKind;

/// vLLM's bucket bounds for `vllm:time_to_first_token_seconds`.
pub const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// vLLM's bucket bounds for `vllm:inter_token_latency_seconds`.
pub const ITL_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
/// vLLM's bucket bounds for `vllm:e2e_request_latency_seconds`.
pub const E2E_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// A histogram with one writer (the engine task) and any number of readers.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<AtomicU64>,
    sum_bits: AtomicU64,
    count: AtomicU64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            sum_bits: AtomicU64::new(0f64.to_bits()),
            count: AtomicU64::new(0),
        }
    }

    /// Record one observation (seconds). Single writer only.
    pub fn observe(&self, v: f64) {
        if let Some(i) = self.bounds.iter().position(|&b| v <= b) {
            self.counts[i].fetch_add(1, Relaxed);
        }
        let sum = f64::from_bits(self.sum_bits.load(Relaxed)) + v;
        self.sum_bits.store(sum.to_bits(), Relaxed);
        self.count.fetch_add(1, Relaxed);
    }

    pub fn count(&self) -> u64 {
        self.count.load(Relaxed)
    }

    pub fn sum(&self) -> f64 {
        f64::from_bits(self.sum_bits.load(Relaxed))
    }
}

/// Live state and counters of one simulated engine.
#[derive(Debug)]
pub struct Stats {
    pub running: AtomicU64,
    pub waiting: AtomicU64,
    pub kv_used_blocks: AtomicU64,
    pub num_blocks: u64,
    pub block_size: u64,
    pub prefix_queries: AtomicU64,
    pub prefix_hits: AtomicU64,
    /// The engine has a CPU offload tier: its queries and hits are exported
    /// as vLLM exports a KV connector's (`vllm:external_prefix_cache_*`).
    pub offload: bool,
    pub external_queries: AtomicU64,
    pub external_hits: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
    pub finished_stop: AtomicU64,
    pub finished_length: AtomicU64,
    pub finished_abort: AtomicU64,
    pub preemptions: AtomicU64,
    pub requests_received: AtomicU64,
    /// KV-event batches handed to the publisher (`--kv-events`).
    pub kv_event_batches: AtomicU64,
    /// Generated tokens per (simulated) second over the last step, f64 bits.
    pub gen_throughput_bits: AtomicU64,
    /// When this engine started, Unix seconds: exported as
    /// `process_start_time_seconds`, as the Python process collector of vLLM
    /// and SGLang does, so a restart shows in a scrape.
    pub started_unix: f64,
    pub ttft: Histogram,
    pub itl: Histogram,
    pub e2e: Histogram,
}

impl Stats {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        let z = || AtomicU64::new(0);
        Stats {
            running: z(),
            waiting: z(),
            kv_used_blocks: z(),
            num_blocks: num_blocks as u64,
            block_size: block_size as u64,
            prefix_queries: z(),
            prefix_hits: z(),
            offload: false,
            external_queries: z(),
            external_hits: z(),
            prompt_tokens: z(),
            generation_tokens: z(),
            finished_stop: z(),
            finished_length: z(),
            finished_abort: z(),
            preemptions: z(),
            requests_received: z(),
            kv_event_batches: z(),
            gen_throughput_bits: AtomicU64::new(0f64.to_bits()),
            started_unix: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64()),
            ttft: Histogram::new(TTFT_BUCKETS),
            itl: Histogram::new(ITL_BUCKETS),
            e2e: Histogram::new(E2E_BUCKETS),
        }
    }

    /// Fraction (0–1) of KV blocks referenced by running sequences.
    pub fn kv_usage(&self) -> f64 {
        if self.num_blocks == 0 {
            return 0.0;
        }
        self.kv_used_blocks.load(Relaxed) as f64 / self.num_blocks as f64
    }

    /// Prefix-cache hit fraction of all queried prompt tokens so far.
    pub fn cache_hit_rate(&self) -> f64 {
        let q = self.prefix_queries.load(Relaxed);
        if q == 0 {
            return 0.0;
        }
        self.prefix_hits.load(Relaxed) as f64 / q as f64
    }
}

/// Escape a Prometheus label value.
fn esc(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

struct Out {
    s: String,
    labels: String,
}

impl Out {
    fn head(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.s, "# HELP {name} {help}");
        let _ = writeln!(self.s, "# TYPE {name} {kind}");
    }

    fn sample(&mut self, name: &str, extra: &str, v: f64) {
        let sep = if extra.is_empty() { "" } else { "," };
        let _ = writeln!(self.s, "{name}{{{}{sep}{extra}}} {}", self.labels, num(v));
    }

    fn scalar(&mut self, name: &str, kind: &str, help: &str, v: f64) {
        self.head(name, kind, help);
        self.sample(name, "", v);
    }

    fn histogram(&mut self, name: &str, help: &str, h: &Histogram) {
        self.head(name, "histogram", help);
        let mut acc = 0;
        for (b, c) in h.bounds.iter().zip(&h.counts) {
            acc += c.load(Relaxed);
            self.sample(
                &format!("{name}_bucket"),
                &format!("le=\"{}\"", num(*b)),
                acc as f64,
            );
        }
        let count = h.count();
        self.sample(&format!("{name}_bucket"), "le=\"+Inf\"", count as f64);
        self.sample(&format!("{name}_sum"), "", h.sum());
        self.sample(&format!("{name}_count"), "", count as f64);
    }
}

fn num(v: f64) -> String {
    if v.is_finite() && v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{v:.1}")
    } else {
        format!("{v}")
    }
}

/// Render the exposition text (format 0.0.4) for one engine.
pub fn render(kind: EngineKind, model: &str, s: &Stats) -> String {
    let mut o = Out {
        s: String::with_capacity(8192),
        labels: format!("engine=\"0\",model_name=\"{}\"", esc(model)),
    };
    let g = |a: &AtomicU64| a.load(Relaxed) as f64;
    // Unlabelled, like prometheus_client's process collector.
    o.head(
        "process_start_time_seconds",
        "gauge",
        "Start time of the process since unix epoch in seconds.",
    );
    let _ = writeln!(o.s, "process_start_time_seconds {}", s.started_unix);
    match kind {
        EngineKind::Vllm => {
            o.scalar(
                "vllm:num_requests_running",
                "gauge",
                "Number of requests in model execution batches.",
                g(&s.running),
            );
            o.scalar(
                "vllm:num_requests_waiting",
                "gauge",
                "Number of requests waiting to be processed.",
                g(&s.waiting),
            );
            o.scalar(
                "vllm:kv_cache_usage_perc",
                "gauge",
                "KV-cache usage. 1 means 100 percent usage.",
                s.kv_usage(),
            );
            o.scalar(
                "vllm:prefix_cache_queries_total",
                "counter",
                "Prefix cache queries, in terms of number of queried tokens.",
                g(&s.prefix_queries),
            );
            o.scalar(
                "vllm:prefix_cache_hits_total",
                "counter",
                "Prefix cache hits, in terms of number of cached tokens.",
                g(&s.prefix_hits),
            );
            if s.offload {
                o.scalar(
                    "vllm:external_prefix_cache_queries_total",
                    "counter",
                    "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of queried tokens.",
                    g(&s.external_queries),
                );
                o.scalar(
                    "vllm:external_prefix_cache_hits_total",
                    "counter",
                    "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of cached tokens.",
                    g(&s.external_hits),
                );
            }
            o.scalar(
                "vllm:num_preemptions_total",
                "counter",
                "Cumulative number of preemption from the engine.",
                g(&s.preemptions),
            );
            o.scalar(
                "vllm:prompt_tokens_total",
                "counter",
                "Number of prefill tokens processed.",
                g(&s.prompt_tokens),
            );
            o.scalar(
                "vllm:generation_tokens_total",
                "counter",
                "Number of generation tokens processed.",
                g(&s.generation_tokens),
            );
            o.head(
                "vllm:request_success_total",
                "counter",
                "Count of successfully processed requests.",
            );
            o.sample(
                "vllm:request_success_total",
                "finished_reason=\"stop\"",
                g(&s.finished_stop),
            );
            o.sample(
                "vllm:request_success_total",
                "finished_reason=\"length\"",
                g(&s.finished_length),
            );
            o.sample(
                "vllm:request_success_total",
                "finished_reason=\"abort\"",
                g(&s.finished_abort),
            );
            o.head(
                "vllm:cache_config_info",
                "gauge",
                "Information of the LLMEngine CacheConfig",
            );
            o.sample(
                "vllm:cache_config_info",
                &format!(
                    "block_size=\"{}\",num_gpu_blocks=\"{}\"",
                    s.block_size, s.num_blocks
                ),
                1.0,
            );
            o.histogram(
                "vllm:time_to_first_token_seconds",
                "Histogram of time to first token in seconds.",
                &s.ttft,
            );
            o.histogram(
                "vllm:inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds.",
                &s.itl,
            );
            o.histogram(
                "vllm:e2e_request_latency_seconds",
                "Histogram of e2e request latency in seconds.",
                &s.e2e,
            );
        }
        EngineKind::Sglang => {
            let used_tokens = g(&s.kv_used_blocks) * s.block_size as f64;
            o.scalar(
                "sglang:num_running_reqs",
                "gauge",
                "The number of running requests.",
                g(&s.running),
            );
            o.scalar(
                "sglang:num_queue_reqs",
                "gauge",
                "The number of requests in the waiting queue.",
                g(&s.waiting),
            );
            o.scalar(
                "sglang:page_size",
                "gauge",
                "KV cache page size in tokens.",
                s.block_size as f64,
            );
            o.scalar(
                "sglang:num_pages",
                "gauge",
                "Number of KV cache pages.",
                s.num_blocks as f64,
            );
            o.scalar(
                "sglang:num_used_tokens",
                "gauge",
                "The number of used tokens.",
                used_tokens,
            );
            o.scalar(
                "sglang:token_usage",
                "gauge",
                "The token usage.",
                s.kv_usage(),
            );
            o.scalar(
                "sglang:cache_hit_rate",
                "gauge",
                "The prefix cache hit rate.",
                s.cache_hit_rate(),
            );
            o.scalar(
                "sglang:gen_throughput",
                "gauge",
                "The generation throughput (token/s).",
                f64::from_bits(s.gen_throughput_bits.load(Relaxed)),
            );
            o.scalar(
                "sglang:prompt_tokens_total",
                "counter",
                "Number of prefill tokens processed.",
                g(&s.prompt_tokens),
            );
            o.scalar(
                "sglang:generation_tokens_total",
                "counter",
                "Number of generation tokens processed.",
                g(&s.generation_tokens),
            );
            o.scalar(
                "sglang:cached_tokens_total",
                "counter",
                "Number of cached prompt tokens.",
                g(&s.prefix_hits),
            );
            let done = g(&s.finished_stop) + g(&s.finished_length) + g(&s.finished_abort);
            o.scalar(
                "sglang:num_requests_total",
                "counter",
                "Number of requests processed.",
                done,
            );
            o.scalar(
                "sglang:num_aborted_requests_total",
                "counter",
                "Number of requests aborted.",
                g(&s.finished_abort),
            );
            o.scalar(
                "sglang:num_retractions_total",
                "counter",
                "Number of retracted (preempted) requests.",
                g(&s.preemptions),
            );
            o.histogram(
                "sglang:time_to_first_token_seconds",
                "Histogram of time to first token in seconds.",
                &s.ttft,
            );
            o.histogram(
                "sglang:inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds.",
                &s.itl,
            );
            o.histogram(
                "sglang:e2e_request_latency_seconds",
                "Histogram of End-to-end request latency in seconds",
                &s.e2e,
            );
        }
    }
    o.scalar(
        "sim_requests_received_total",
        "counter",
        "Requests that arrived at a generation endpoint, faulted ones included.",
        g(&s.requests_received),
    );
    o.scalar(
        "sim_kv_event_batches_total",
        "counter",
        "KV-event batches published (sequence numbers 0..n), when --kv-events is on.",
        g(&s.kv_event_batches),
    );
    o.s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_dialects_report_the_block_size_the_gateway_reads() {
        let s = Stats::new(64, 128);
        for kind in [EngineKind::Vllm, EngineKind::Sglang] {
            let text = render(kind, "m", &s);
            let found = text.lines().any(|l| match kind {
                EngineKind::Vllm => {
                    l.starts_with("vllm:cache_config_info{") && l.contains("block_size=\"128\"")
                }
                EngineKind::Sglang => l.starts_with("sglang:page_size{") && l.contains("} 128"),
            });
            assert!(found, "{kind:?}: {text}");
        }
    }

    #[test]
    fn histogram_is_cumulative() {
        let s = Stats::new(10, 16);
        s.ttft.observe(0.003);
        s.ttft.observe(0.05);
        s.ttft.observe(9999.0);
        let text = render(EngineKind::Vllm, "m\"x", &s);
        assert!(text.contains(r#"vllm:time_to_first_token_seconds_bucket{engine="0",model_name="m\"x",le="0.005"} 1.0"#), "{text}");
        assert!(text.contains(
            r#"vllm:time_to_first_token_seconds_bucket{engine="0",model_name="m\"x",le="0.06"} 2.0"#
        ));
        assert!(text.contains(
            r#"vllm:time_to_first_token_seconds_bucket{engine="0",model_name="m\"x",le="+Inf"} 3.0"#
        ));
        assert!(text.contains(
            r#"vllm:time_to_first_token_seconds_count{engine="0",model_name="m\"x"} 3.0"#
        ));
    }
}
