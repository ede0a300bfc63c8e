//! Criterion bench of one Endpoint Picker decision as `switchyard epp` makes it
//! (`switchyard_epp_decision_seconds` measures the same span): the JSON body
//! inspected, the model resolved, the `prefix` policy's pick over 64 workers with
//! live stats, two fallbacks, and the decision recorded in the prefix index.
//! The body carries an 8k-character prompt drawn from 512 system prompts, so the
//! index sees hits and misses. Run: `cargo bench --bench epp`.

use bytes::Bytes;
use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion};
use switchyard::config;
use switchyard::epp::pick;
use switchyard::pool::stats::{now_ms, parse_metrics};
use switchyard::pool::Registry;
use switchyard::routes::RouteTable;

fn routes(n: usize) -> std::sync::Arc<RouteTable> {
    let workers: Vec<String> = (0..n)
        .map(|i| format!("{{ url = \"http://10.0.{}.{}:8000\" }}", i / 256, i % 256))
        .collect();
    let text = format!(
        "[[pools]]\nname = \"p\"\nmodels = [\"m\"]\npolicy = \"prefix\"\nworkers = [{}]\n",
        workers.join(", ")
    );
    let cfg = config::parse(&text).unwrap().validate().unwrap();
    let reg = Registry::new(cfg);
    for (i, w) in reg.snapshot().workers().enumerate() {
        let text = format!(
            "vllm:num_requests_running {}\nvllm:num_requests_waiting {}\nvllm:kv_cache_usage_perc 0.5\nvllm:cache_config_info{{block_size=\"16\",num_gpu_blocks=\"26000\"}} 1\n",
            i % 7,
            i % 3
        );
        w.state.stats.store(&parse_metrics(&text), now_ms());
    }
    RouteTable::follow(&reg)
}

/// A chat request whose system prompt is number `k` (8k characters).
fn body(k: usize) -> Bytes {
    let system = format!("You are assistant number {k}. ")
        + &"Answer carefully, cite sources, keep it short. ".repeat(200);
    let v = serde_json::json!({
        "model": "m", "stream": true, "max_tokens": 64,
        "messages": [{"role": "system", "content": &system[..7_900]},
                     {"role": "user", "content": format!("What is the capital of country {k}?")}]
    });
    Bytes::from(serde_json::to_vec(&v).unwrap())
}

fn decision(c: &mut Criterion) {
    let mut g = c.benchmark_group("epp_decision_8k_prompt");
    for n in [8usize, 64, 256] {
        let table = routes(n);
        let snap = table.snapshot();
        let bodies: Vec<Bytes> = (0..512).map(body).collect();
        let headers = http::HeaderMap::new();
        let mut k = 0usize;
        g.bench_with_input(BenchmarkId::new("prefix", n), &n, |b, _| {
            b.iter(|| {
                k = (k * 7 + 13) % bodies.len();
                let choice =
                    pick::decide(&snap, &headers, &bodies[k], None, 2, "anonymous").unwrap();
                black_box(choice.endpoints())
            })
        });
    }
    g.finish();
}

criterion_group!(benches, decision);
criterion_main!(benches);
