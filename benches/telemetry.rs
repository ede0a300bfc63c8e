//! Criterion micro-benches for the per-request telemetry lookups, each next to the
//! way it was done before, in the same run:
//! - a `switchyard_requests_total` counter found through `CounterCache` (a map per
//!   thread, looked up with borrowed label values) against a `DashMap` keyed by a
//!   cloned label tuple;
//! - cloning a label value made from an `Arc<str>` against one made from a `String`
//!   (an owned `SharedString` copies itself on every clone).
//!
//! Single-threaded, so contention between serving threads is not in these figures.
//! Run: `cargo bench --bench telemetry`.

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use dashmap::DashMap;
use metrics::{Counter, SharedString};
use switchyard::telemetry::labels::shared;
use switchyard::telemetry::{Borrowed, CounterCache, RequestsKey};

fn labels(shared_values: bool) -> (SharedString, SharedString, SharedString) {
    let make = |s: &str| {
        if shared_values {
            shared(s)
        } else {
            SharedString::from(s.to_string())
        }
    };
    (make("chat-pool"), make("eu-west"), make("acme-tenant"))
}

fn counters(c: &mut Criterion) {
    let mut g = c.benchmark_group("requests_counter_lookup");
    let (pool, region, tenant) = labels(true);
    let key = |p: &SharedString, r: &SharedString, t: &SharedString| -> RequestsKey {
        (
            p.clone(),
            r.clone(),
            t.clone(),
            "chat_completions",
            "200",
            "ok",
            "completed",
        )
    };

    let cache: CounterCache<RequestsKey> = CounterCache::default();
    g.bench_function("counter_cache_borrowed", |b| {
        b.iter(|| {
            cache.increment(
                &Borrowed((
                    &pool,
                    &region,
                    &tenant,
                    "chat_completions",
                    "200",
                    "ok",
                    "completed",
                )),
                1,
                |_| Counter::noop(),
            )
        })
    });

    // Before: a DashMap with a cloned key per lookup, label values owned.
    let (opool, oregion, otenant) = labels(false);
    let map: DashMap<RequestsKey, Counter, foldhash::fast::RandomState> = DashMap::default();
    map.insert(key(&opool, &oregion, &otenant), Counter::noop());
    g.bench_function("dashmap_cloned_owned_labels_baseline", |b| {
        b.iter(|| {
            if let Some(c) = map.get(&key(&opool, &oregion, &otenant)) {
                c.increment(1);
            }
        })
    });
    g.finish();

    let mut g = c.benchmark_group("label_clone");
    let (s, _, _) = labels(true);
    let (o, _, _) = labels(false);
    g.bench_function("shared", |b| b.iter(|| black_box(s.clone())));
    g.bench_function("owned_baseline", |b| b.iter(|| black_box(o.clone())));
    g.finish();
}

criterion_group!(benches, counters);
criterion_main!(benches);
