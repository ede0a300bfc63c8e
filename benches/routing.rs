//! Criterion micro-benches for routing: one decision of the `prefix` and
//! `least_queue` policies over 8, 64 and 1,024 workers with an 8k-character chat
//! prompt (block hashing included, as on the request path), and prefix-index
//! insert / lookup. Run: `cargo bench --bench routing`.

use bytes::Bytes;
use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion};
use std::sync::Arc;
use switchyard::api::RequestInfo;
use switchyard::config::{self, PoolConfig};
use switchyard::pool::stats::{now_ms, parse_metrics};
use switchyard::pool::Worker;
use switchyard::routing::{self, hash_blocks, BuildContext, Policy, PrefixIndex, RouteRequest};

fn pool(policy: &str, n: usize) -> PoolConfig {
    let workers: Vec<String> = (0..n)
        .map(|i| format!("{{ url = \"http://10.0.{}.{}:8000\" }}", i / 256, i % 256))
        .collect();
    let text = format!(
        "[[pools]]\nname = \"p\"\nmodels = [\"m\"]\npolicy = \"{policy}\"\nworkers = [{}]\n",
        workers.join(", ")
    );
    config::first_pool(&text).unwrap()
}

/// An 8k-character chat body's `messages` text; `k` varies the system prompt.
fn prompt(k: usize) -> Bytes {
    let system = format!("You are assistant number {k}. ")
        + &"Answer carefully, cite sources, keep it short. ".repeat(200);
    let text = format!(
        r#"[{{"role":"system","content":"{}"}},{{"role":"user","content":"What is the capital of country {k}?"}}]"#,
        &system[..7_900]
    );
    Bytes::from(text)
}

struct Setup {
    workers: Vec<Arc<Worker>>,
    policy: Box<dyn Policy>,
}

fn setup(policy: &str, n: usize) -> Setup {
    let pc = pool(policy, n);
    let workers: Vec<Arc<Worker>> = pc
        .workers
        .iter()
        .map(|w| Arc::new(Worker::new(&w.url, Default::default(), Default::default()).unwrap()))
        .collect();
    for (i, w) in workers.iter().enumerate() {
        let text = format!(
            "vllm:num_requests_running {}\nvllm:num_requests_waiting {}\nvllm:kv_cache_usage_perc 0.5\nvllm:cache_config_info{{block_size=\"16\",num_gpu_blocks=\"26000\"}} 1\n",
            i % 7,
            i % 3
        );
        w.state.stats.store(&parse_metrics(&text), now_ms());
    }
    let index = Arc::new(PrefixIndex::new(pc.routing.index_max_blocks));
    index.set_workers(&workers.iter().map(|w| w.id.clone()).collect::<Vec<_>>());
    let policy = routing::build(&BuildContext {
        kind: pc.policy,
        model: "m",
        pool: &pc,
        workers: &workers,
        index: Some(&index),
        global: &Default::default(),
        spill: None,
        kv: None,
    });
    // Warm the index: 256 system prompts seen once each.
    for k in 0..256 {
        let info = RequestInfo {
            routing_text: Some(prompt(k)),
            ..Default::default()
        };
        let req = RouteRequest::new(&info, None);
        if let Some(d) = policy.pick(&req, &workers, &|_| true) {
            policy.record(&d, &req, &workers);
        }
    }
    Setup { workers, policy }
}

fn decisions(c: &mut Criterion) {
    let mut g = c.benchmark_group("decision_8k_prompt");
    for policy in ["prefix", "least_queue"] {
        for n in [8usize, 64, 1024] {
            let s = setup(policy, n);
            let info = RequestInfo {
                routing_text: Some(prompt(17)),
                ..Default::default()
            };
            g.bench_with_input(BenchmarkId::new(policy, n), &n, |b, _| {
                b.iter(|| {
                    let req = RouteRequest::new(&info, None);
                    black_box(s.policy.pick(&req, &s.workers, &|_| true))
                })
            });
        }
    }
    g.finish();
}

fn index(c: &mut Criterion) {
    let ix = PrefixIndex::new(1 << 20);
    let ids: Vec<Arc<str>> = (0..64).map(|i| Arc::from(format!("w{i}"))).collect();
    let slots = ix.set_workers(&ids);
    let text = prompt(3);
    let blocks = hash_blocks(&text, 7, 256);
    let mut g = c.benchmark_group("prefix_index");
    let mut k = 0u64;
    g.bench_function(format!("insert_{}_blocks", blocks.len()), |b| {
        b.iter(|| {
            k += 1;
            // A new conversation each time: new blocks, evictions once full.
            let fresh: Vec<u64> = blocks
                .iter()
                .map(|h| xxhash_rust::xxh3::xxh3_64_with_seed(&h.to_le_bytes(), k))
                .collect();
            ix.insert(slots[(k % 64) as usize], &fresh, 16_384);
        })
    });
    ix.insert(slots[0], &blocks, 16_384);
    g.bench_function(format!("lookup_{}_blocks", blocks.len()), |b| {
        let mut out = [(0u16, 0u32); routing::prefix_index::REPLICAS];
        b.iter(|| black_box(ix.lookup(black_box(&blocks), &mut out)))
    });
    g.bench_function("hash_8k_prompt", |b| {
        b.iter(|| black_box(hash_blocks(black_box(&text), 7, 256)))
    });
    g.finish();
    let m = ix.memory();
    println!(
        "prefix index after the insert bench: {} entries, {} pairs, {} bytes, {:.1} bytes/entry",
        m.entries,
        m.pairs,
        m.bytes,
        m.bytes as f64 / m.entries.max(1) as f64
    );
}

criterion_group!(benches, decisions, index);
criterion_main!(benches);
