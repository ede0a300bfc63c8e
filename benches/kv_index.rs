//! Criterion micro-benches for the precise (KV-event) index: applying engine
//! events (BlockStored chained by parent, then BlockRemoved) on one core, and
//! looking up a 32k-token prompt (2,048 blocks of 16 tokens) with 64 workers
//! holding it to various depths (1/64 … 64/64 of it, with and without hashing
//! the prompt's tokens, and again among 256k other keys; a few hundred blocks;
//! all of it by 4 workers, 64 blocks by the rest; the first 4 blocks only).
//! Run: `cargo bench --bench kv_index`.

use criterion::{black_box, criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use std::sync::Arc;
use switchyard::kv_events::wire::{Event, Tier};
use switchyard::kv_events::{prompt_keys, Depths, KvIndex, WorkerBlocks, MAX_WORKERS};

const BS: usize = 16;
const PROMPT_TOKENS: usize = 32 * 1024;

fn stored(hash: u64, parent: Option<u64>, first_token: u32) -> Event {
    Event::Stored {
        block_hashes: vec![hash],
        parent,
        token_ids: (first_token..first_token + BS as u32).collect(),
        block_size: BS,
        salted: false,
        tier: Tier::Gpu,
    }
}

/// 64 workers × 256 blocks each, stored in chains of 32, then all removed.
fn events() -> Vec<(usize, Event)> {
    let mut v = Vec::new();
    for w in 0..MAX_WORKERS {
        for chain in 0..8u64 {
            for b in 0..32u64 {
                let h = (w as u64) << 32 | chain << 16 | b;
                let parent = (b > 0).then(|| h - 1);
                v.push((w, stored(h, parent, (chain * 32 + b) as u32 * BS as u32)));
            }
        }
    }
    let removes: Vec<_> = v
        .iter()
        .map(|(w, e)| match e {
            Event::Stored { block_hashes, .. } => (
                *w,
                Event::Removed {
                    block_hashes: block_hashes.clone(),
                    tier: Tier::Gpu,
                },
            ),
            _ => unreachable!(),
        })
        .collect();
    v.extend(removes);
    v
}

fn apply(c: &mut Criterion) {
    let evs = events();
    let mut g = c.benchmark_group("kv_index");
    g.throughput(Throughput::Elements(evs.len() as u64));
    g.bench_function("apply_block_events", |b| {
        b.iter_batched(
            || {
                let ix = KvIndex::new(BS);
                let ws: Vec<WorkerBlocks> = (0..MAX_WORKERS)
                    .map(|i| {
                        let slot = ix.claim(&Arc::from(format!("w{i}"))).unwrap();
                        WorkerBlocks::new(slot, BS, 1 << 20)
                    })
                    .collect();
                (ix, ws)
            },
            |(ix, mut ws)| {
                for (w, e) in &evs {
                    ws[*w].apply(&ix, e).unwrap();
                }
                (ix, ws)
            },
            BatchSize::LargeInput,
        )
    });
    g.finish();
}

/// An index over `keys` where worker i holds the first `depth(i)` blocks.
fn held(keys: &[u64], depth: impl Fn(usize) -> usize) -> KvIndex {
    let ix = KvIndex::new(BS);
    for i in 0..MAX_WORKERS {
        let slot = ix.claim(&Arc::from(format!("w{i}"))).unwrap();
        for &k in &keys[..depth(i).min(keys.len())] {
            ix.insert(slot, k, Tier::Gpu);
        }
    }
    ix
}

fn lookup(c: &mut Criterion) {
    let tokens: Vec<u32> = (0..PROMPT_TOKENS as u32).collect();
    let keys = prompt_keys(&tokens, BS);
    // Worker i holds the first (i + 1) / 64 of the prompt; worker 63 all of it:
    // 64 distinct depths, the last at the prompt's end.
    let ix = held(&keys, |i| keys.len() * (i + 1) / MAX_WORKERS);
    let mut g = c.benchmark_group("kv_index");
    let mut out: Box<Depths> = Box::new([[0; 3]; MAX_WORKERS]);
    g.bench_function("lookup_32k_tokens_64_workers", |b| {
        b.iter(|| ix.lookup(black_box(&keys), &mut out))
    });
    g.bench_function("hash_and_lookup_32k_tokens_64_workers", |b| {
        b.iter(|| {
            let k = prompt_keys(black_box(&tokens), BS);
            ix.lookup(&k, &mut out)
        })
    });
    // The same prompt in a full index: 64 workers x 4,096 other blocks, so the
    // probes miss the CPU caches as they would in a busy pool.
    for j in 0..(MAX_WORKERS * 4096) as u64 {
        let key = j.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xA5A5;
        ix.insert((j % MAX_WORKERS as u64) as u8, key, Tier::Gpu);
    }
    g.bench_function("lookup_32k_tokens_64_workers_full_index", |b| {
        b.iter(|| ix.lookup(black_box(&keys), &mut out))
    });
    // What a busy pool looks like: a shared system prompt of 64 blocks held by
    // all, then conversations held a few hundred blocks deep (64–575, a few
    // workers at each depth, some at none).
    let ix = held(&keys, |i| match i % 8 {
        0 => 0,
        1 | 2 => 64,
        _ => 64 + (i * 37) % 512,
    });
    g.bench_function("lookup_32k_tokens_64_workers_held_hundreds", |b| {
        b.iter(|| ix.lookup(black_box(&keys), &mut out))
    });
    // A long document a few workers hold whole, the rest its 64-block opening.
    let ix = held(&keys, |i| if i < 4 { keys.len() } else { 64 });
    g.bench_function("lookup_32k_tokens_64_workers_4_hold_all", |b| {
        b.iter(|| ix.lookup(black_box(&keys), &mut out))
    });
    // A new prompt: a common 4-block preamble, nothing after.
    let ix = held(&keys, |_| 4);
    g.bench_function("lookup_32k_tokens_64_workers_held_4", |b| {
        b.iter(|| ix.lookup(black_box(&keys), &mut out))
    });
    g.finish();
}

criterion_group!(benches, apply, lookup);
criterion_main!(benches);
