//! Property tests over every policy and preset, built the way the registry builds
//! them (`routing::build`): a pick never returns a worker that `accept` refuses or
//! the label filter excludes, finds one whenever one qualifies, and gives the same
//! answer for the same inputs (history, stats, request, clock and RNG seed).
//! Residency under every preset is checked in `region.rs`.

use super::{build, Policy, RouteRequest};
use crate::api::RequestInfo;
use crate::config::{self, PoolConfig};
use crate::pool::stats::{now_ms, parse_metrics};
use crate::pool::Worker;
use bytes::Bytes;
use proptest::prelude::*;
use rand::rngs::SmallRng;
use rand::SeedableRng;
use std::sync::Arc;

const N: usize = 5;
/// When the scrapes are stored and the picks made: nothing is stale unless a
/// worker's scrape is made old on purpose.
const NOW: u64 = 1_000_000;

/// Every policy: name and `[pools.routing]` lines.
const POLICIES: &[(&str, &str)] = &[
    ("round_robin", ""),
    ("random", ""),
    ("least_queue", ""),
    ("least_queue", "power_of_two = true"),
    ("prefix", "block_tokens = 4"),
    ("cost", "target_queue = 4"),
    ("session", ""),
    ("weighted", "scorers = [{ name = \"prefix\", weight = 1.0 }, { name = \"queue\", weight = 0.5 }, { name = \"cost\", weight = 0.3 }, { name = \"session\", weight = 0.7 }, { name = \"kv\", weight = 0.2 }]\nblock_tokens = 4"),
    ("weighted", "require_labels = { tier = \"a\" }\nscorers = [{ name = \"queue\", weight = 1.0 }, { name = \"kv\", weight = 1.0 }]"),
];

fn pool(policy: &str, routing: &str) -> PoolConfig {
    let workers: Vec<String> = (0..N)
        .map(|i| {
            let tier = if i % 2 == 0 { "a" } else { "b" };
            format!(
                "{{ url = \"http://w{i}:80\", price_per_mtok = {}.0, labels = {{ tier = \"{tier}\" }} }}",
                1 + i % 3
            )
        })
        .collect();
    let text = format!(
        "[[pools]]\nname = \"p\"\nmodels = [\"m\"]\npolicy = \"{policy}\"\nworkers = [{}]\n[pools.routing]\n{routing}\n",
        workers.join(", ")
    );
    config::first_pool(&text).unwrap()
}

/// One gateway's view of the pool: its workers, index and policy.
struct Gateway {
    pc: PoolConfig,
    workers: Vec<Arc<Worker>>,
    policy: Box<dyn Policy>,
}

fn gateway(policy: &str, routing: &str) -> Gateway {
    let pc = pool(policy, routing);
    let (workers, policy) = super::build_for_test(&pc, build);
    Gateway {
        policy,
        workers,
        pc,
    }
}

/// Per worker: running requests, KV usage in tenths, whether its scrape is old.
type Loads = Vec<(u64, u8, bool)>;

fn scrape(g: &Gateway, loads: &Loads, now: u64) {
    for (w, &(q, kv, old)) in g.workers.iter().zip(loads) {
        let text = format!(
            "vllm:num_requests_running {q}\nvllm:kv_cache_usage_perc {}\n",
            kv as f64 / 10.0
        );
        let at = if old { now - 60_000 } else { now };
        w.state.stats.store(&parse_metrics(&text), at);
    }
}

fn request(text: usize, len: usize) -> RequestInfo {
    RequestInfo {
        routing_text: Some(Bytes::from(format!("{text:03} {}", "t".repeat(len)))),
        max_tokens: Some(100),
        ..Default::default()
    }
}

fn eligible(g: &Gateway, i: usize) -> bool {
    g.pc.routing
        .require_labels
        .iter()
        .all(|(k, v)| g.workers[i].labels.get(k) == Some(v))
}

fn loads() -> impl Strategy<Value = Loads> {
    proptest::collection::vec((0u64..12, 0u8..=10, proptest::bool::weighted(0.2)), N)
}

/// Earlier requests (text id, length, session), recorded before the checked pick.
fn history() -> impl Strategy<Value = Vec<(usize, usize, Option<u8>)>> {
    proptest::collection::vec(
        (0usize..6, 0usize..1200, proptest::option::of(0u8..4)),
        0..6,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// A pick is never refused by `accept` nor excluded by the label filter, and
    /// is `None` only when no worker qualifies.
    #[test]
    fn never_picks_an_excluded_worker(
        p in 0..POLICIES.len(), loads in loads(), accepted in 0u8..32,
        past in history(), text in 0usize..6, len in 0usize..1200, session in proptest::option::of(0u8..4),
    ) {
        let (policy, routing) = POLICIES[p];
        let g = gateway(policy, routing);
        // `pick` reads the clock: scrapes are as fresh (or old) as now.
        scrape(&g, &loads, now_ms().max(NOW));
        let ok = |i: usize| accepted & (1 << i) != 0;
        for (t, l, s) in past {
            let info = request(t, l);
            let s = s.map(|s| s.to_string());
            let req = RouteRequest::new(&info, s.as_deref());
            if let Some(d) = g.policy.pick(&req, &g.workers, &|_| true) {
                g.policy.record(&d, &req, &g.workers);
            }
        }
        let info = request(text, len);
        let s = session.map(|s| s.to_string());
        let req = RouteRequest::new(&info, s.as_deref());
        for _ in 0..3 {
            match g.policy.pick(&req, &g.workers, &ok) {
                Some(d) => prop_assert!(ok(d.index) && eligible(&g, d.index), "{policy}: {d:?}"),
                None => prop_assert!(!(0..N).any(|i| ok(i) && eligible(&g, i)), "{policy}: none"),
            }
        }
    }

    /// Two gateways with the same history, stats, request, clock and RNG seed
    /// decide alike.
    #[test]
    fn equal_inputs_give_equal_decisions(
        p in 0..POLICIES.len(), loads in loads(), accepted in 0u8..32,
        past in history(), text in 0usize..6, len in 0usize..1200, session in proptest::option::of(0u8..4),
        seed in 0u64..1_000,
    ) {
        let (policy, routing) = POLICIES[p];
        let gs = [gateway(policy, routing), gateway(policy, routing)];
        let ok = |i: usize| accepted & (1 << i) != 0;
        let mut decisions = Vec::new();
        for g in &gs {
            scrape(g, &loads, NOW);
            let pl = &g.policy;
            let mut rng = SmallRng::seed_from_u64(seed);
            for &(t, l, s) in &past {
                let info = request(t, l);
                let s = s.map(|s| s.to_string());
                let req = RouteRequest::new(&info, s.as_deref());
                if let Some(d) = pl.pick_at(&req, &g.workers, &|_| true, NOW, &mut rng) {
                    pl.record(&d, &req, &g.workers);
                }
            }
            let info = request(text, len);
            let s = session.map(|s| s.to_string());
            let req = RouteRequest::new(&info, s.as_deref());
            decisions.push(pl.pick_at(&req, &g.workers, &ok, NOW, &mut rng));
        }
        prop_assert_eq!(decisions[0], decisions[1], "{}", policy);
    }
}
