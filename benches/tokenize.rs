//! Criterion micro-benches for gateway-side tokenization of a ~8k-token chat
//! (a long system document plus a short question) with the tiny model's
//! tokenizer: a full tokenization (template render + encode, cache disabled)
//! against a cached-prefix hit (same document, a different question).
//! Run: `cargo bench --bench tokenize`.

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use switchyard::api::inspect::Endpoint;
use switchyard::tokenize::{HfTokenizer, PromptTokenizer};

const TINY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/tiny-tokenizer");

/// ~8k tokens of real text: this repository's own sources.
fn document(tok: &HfTokenizer) -> String {
    let sources = [
        include_str!("../src/proxy/observe.rs"),
        include_str!("../src/routing/prefix_index.rs"),
        include_str!("../src/pool/worker.rs"),
        include_str!("../src/config/raw.rs"),
    ];
    let mut doc = String::new();
    for (n, line) in sources.iter().cycle().flat_map(|s| s.lines()).enumerate() {
        doc.push_str(line);
        doc.push('\n');
        if n % 32 == 0 && tok.encode(&doc, false).unwrap().len() >= 7_900 {
            break;
        }
    }
    doc
}

fn body(doc: &str, question: usize) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "model": "tiny",
        "messages": [
            {"role": "system", "content": doc},
            {"role": "user", "content": format!("Question {question}: what does this code do?")},
        ]
    }))
    .unwrap()
}

fn bench(c: &mut Criterion) {
    let full = HfTokenizer::from_dir_with_cache(TINY, None, 0).unwrap();
    let cached = HfTokenizer::from_dir(TINY, None).unwrap();
    let doc = document(&full);
    let bodies: Vec<Vec<u8>> = (0..64).map(|q| body(&doc, q)).collect();
    let tokens = full.count(Endpoint::ChatCompletions, &bodies[0]).unwrap();
    eprintln!(
        "chat prompt: {tokens} tokens, {} bytes of document",
        doc.len()
    );
    cached
        .prompt_tokens(Endpoint::ChatCompletions, &bodies[0])
        .unwrap();

    let mut g = c.benchmark_group("tokenize_8k_chat");
    let mut i = 0;
    g.bench_function("full", |b| {
        b.iter(|| {
            i = (i + 1) % bodies.len();
            black_box(
                full.prompt_tokens(Endpoint::ChatCompletions, &bodies[i])
                    .unwrap(),
            )
        })
    });
    g.bench_function("cached_prefix_hit", |b| {
        b.iter(|| {
            i = (i + 1) % bodies.len();
            black_box(
                cached
                    .prompt_tokens(Endpoint::ChatCompletions, &bodies[i])
                    .unwrap(),
            )
        })
    });
    g.bench_function("render_only", |b| {
        b.iter(|| {
            i = (i + 1) % bodies.len();
            black_box(
                cached
                    .render(Endpoint::ChatCompletions, &bodies[i])
                    .unwrap(),
            )
        })
    });
    g.finish();
    assert_eq!(
        cached
            .prompt_tokens(Endpoint::ChatCompletions, &bodies[3])
            .unwrap(),
        full.prompt_tokens(Endpoint::ChatCompletions, &bodies[3])
            .unwrap(),
        "cached and full tokenizations agree"
    );
}

criterion_group!(benches, bench);
criterion_main!(benches);
