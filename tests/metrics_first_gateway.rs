//! The first gateway of a process records per-request metrics.
//!
//! Its own test binary on purpose: the metrics recorder is process-global, and in a
//! binary where another test already started a gateway the recorder is installed
//! before this one builds its routing snapshot. `switchyard serve` is always the
//! first gateway of its process; the real-vLLM e2e suite found that it recorded no
//! TTFT, ITL, token or request counters, because the per-(model, worker) metric
//! handles were resolved while building the snapshot, before the recorder existed,
//! and were no-ops for the life of that snapshot.

mod support;

use serde_json::json;
use support::*;
use switchyard::telemetry::names;

/// A short streamed chat completion that must succeed.
async fn stream_chat(url: &str, model: &str) {
    let (status, _) = stream_text(
        url,
        json!({"model": model, "stream": true, "max_tokens": 4,
               "messages": [{"role":"user","content":"count"}]}),
    )
    .await;
    assert_eq!(status, 200);
}

#[tokio::test]
async fn the_first_gateway_in_a_process_records_request_metrics() {
    let s = sims(1, 20.0).await;
    let model = sim_model();
    let u = urls(&s);
    // Static models: the snapshot (and its metric handles) is built at start.
    let gw = gateway(&pool_toml(&model, &[u[0].as_str()], "")).await;
    let url = gw.url();
    stream_chat(&url, &model).await;
    let text = scrape(&url).await;
    let ttft = metric_sum(&text, names::TTFT_SECONDS, &[]);
    assert!(ttft >= 1.0, "no TTFT sample recorded:\n{text}");
    let reqs = metric_sum(&text, names::REQUESTS_TOTAL, &[]);
    assert!(reqs >= 1.0, "no request counted:\n{text}");
}

/// The exposition stays valid Prometheus text with the per-thread families
/// (`telemetry::local`) rendered next to the exporter's, and counters kept per
/// thread are handed to the exporter exactly once: a second scrape adds only the
/// requests made in between.
#[tokio::test]
async fn per_thread_counters_and_histograms_render_once_and_exactly() {
    let s = sims(1, 20.0).await;
    // A model name of its own (the recorder is process-wide), served as the
    // simulator's.
    let model = format!("{}-exact", sim_model());
    let u = urls(&s);
    let upstream = format!("upstream_model = \"{}\"", sim_model());
    let gw = gateway(&pool_toml(&model, &[u[0].as_str()], &upstream)).await;
    let url = gw.url();
    stream_chat(&url, &model).await;
    let first = scrape(&url).await;
    let requests = |text: &str| metric_sum(text, names::REQUESTS_TOTAL, &[("model", &model)]);
    let e2e_count = format!("{}_count", names::E2E_SECONDS);
    let e2e = |text: &str| metric_sum(text, &e2e_count, &[("model", &model)]);
    assert_eq!(requests(&first), 1.0, "{first}");
    assert_eq!(e2e(&first), 1.0, "{first}");
    for _ in 0..3 {
        stream_chat(&url, &model).await;
    }
    let second = scrape(&url).await;
    assert_eq!(requests(&second), 4.0, "{second}");
    assert_eq!(e2e(&second), 4.0, "{second}");

    // One HELP and one TYPE per family; histogram buckets cumulative, ending at
    // `+Inf` = `_count`.
    let mut types = std::collections::HashMap::new();
    for line in second.lines().filter(|l| l.starts_with("# TYPE ")) {
        let name = line.split_whitespace().nth(2).unwrap();
        *types.entry(name.to_string()).or_insert(0) += 1;
    }
    assert!(types.values().all(|n| *n == 1), "{types:?}");
    let helps: Vec<&str> = second
        .lines()
        .filter_map(|l| l.strip_prefix("# HELP "))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert_eq!(helps.len(), types.len(), "{helps:?} vs {types:?}");
    for family in [names::TTFT_SECONDS, names::E2E_SECONDS, names::ITL_SECONDS] {
        assert_eq!(types.get(family), Some(&1), "{family}");
        let prefix = format!("{family}_bucket{{model=\"{model}\"");
        let buckets: Vec<f64> = second
            .lines()
            .filter(|l| l.starts_with(&prefix))
            .map(|l| l.rsplit(' ').next().unwrap().parse().unwrap())
            .collect();
        assert!(buckets.len() > 2, "{family}: {second}");
        assert!(
            buckets.windows(2).all(|w| w[0] <= w[1]),
            "{family}: {buckets:?}"
        );
        let count = metric_sum(&second, &format!("{family}_count"), &[("model", &model)]);
        assert_eq!(buckets.last().copied(), Some(count), "{family}");
    }
}
