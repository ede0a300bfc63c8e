//! The weighted pipeline's scorers. A [`Scorer`] rates one candidate worker in
//! [0, 1] (higher is better); the pipeline sums `weight × score` over its scorers
//! and names the decision after the scorer that contributed most.
//!
//! A pick calls [`Scorer::prepare`] once (what the scores share, e.g. the price
//! range), then [`Scorer::score`] per candidate. Both are pure and allocation-free.
//! Adding a scorer: one file here and one line in [`REGISTRY`] (see
//! `docs/architecture.md`, "How to add a scorer").

mod cost;
mod kv;
/// The toy scorer of `docs/architecture.md` ("How to add a scorer"); tests only.
#[cfg(test)]
pub(crate) mod last;
mod precise_prefix;
mod prefix;
mod queue;
mod session;
mod slo;

pub use cost::Cost;
pub use kv::Kv;
pub use precise_prefix::PrecisePrefix;
pub use prefix::Prefix;
pub use queue::Queue;
pub use session::Session;
pub use slo::Slo;

use super::{Reason, RouteRequest};
use crate::config::RawConfig;
use crate::pool::Worker;
use std::sync::Arc;

/// One candidate worker during a pick, as the scorers see it.
#[derive(Clone, Copy, Debug, Default)]
pub struct Candidate {
    /// Index into the route's workers.
    pub i: usize,
    /// Estimated requests queued or running.
    pub queue: f64,
    /// Estimated wait before a new request's prefill, in prompt tokens:
    /// pending prefill tokens + `QUEUE_TOKENS` × queue; for a stale worker, at
    /// least the busiest fresh worker's.
    pub wait: f64,
    /// `wait` before that stale adjustment.
    pub own_wait: f64,
    /// KV-cache usage in [0, 1].
    pub kv: f64,
    /// Prompt tokens queued for prefill on the worker (the stats' pending tokens).
    pub pending: f64,
    /// Its stats are stale (and some other candidate's are fresh).
    pub stale: bool,
    /// USD per 1M tokens (0 when unpriced).
    pub price: f64,
    /// Leading prefix blocks the worker holds (prefix index).
    pub depth: u32,
    /// Precise index: the tier-weighted share of the prompt's blocks the worker
    /// holds by its own events, in [0, 1].
    pub precise: f64,
    /// Precise index: leading prompt blocks the worker holds in any tier.
    pub precise_blocks: u32,
    /// Prompt tokens the worker is expected to hold cached, by the pick's index:
    /// in precise mode its tier-weighted held blocks × the engine's block size,
    /// otherwise `depth` × block tokens.
    pub held: f64,
    /// The weighted score.
    pub score: f64,
    /// Placing a prefix: blocks the index attributes to the worker and its cache
    /// capacity in those blocks; whether the prefix fits its cache, and keeps its
    /// footprint within the bound.
    pub footprint: u64,
    pub capacity: u64,
    pub room: bool,
    pub fits: bool,
}

/// What every scorer may look at during one pick.
pub struct PickView<'a> {
    pub req: &'a RouteRequest<'a>,
    pub workers: &'a [Arc<Worker>],
    pub cands: &'a [Candidate],
    /// The largest `wait` among the candidates.
    pub max_wait: f64,
    /// The request's prefix blocks (empty unless a scorer uses the prefix).
    pub n_blocks: usize,
    /// The deepest any candidate holds the prefix.
    pub max_depth: u32,
    /// The pool's precise index speaks for every candidate and the prompt was
    /// tokenized: `Candidate::precise` is set.
    pub precise: bool,
    /// The largest `Candidate::precise`.
    pub max_precise: f64,
    /// The stable key that breaks ties (rendezvous hashing).
    pub key: u64,
    /// The request's prompt tokens (exact in precise mode, else estimated from
    /// its text), and tokens per prefix block (what a candidate's `depth` saves).
    pub prompt_tokens: u64,
    pub block_tokens: u64,
}

/// What a scorer computes once per pick and reads back for every candidate: two
/// numbers and a worker index, each used or not as the scorer needs.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Prepared {
    pub lo: f64,
    pub hi: f64,
    pub index: Option<usize>,
}

/// A weighted scorer (see the module docs).
pub trait Scorer: Send + Sync {
    /// Once per pick, before any [`Scorer::score`].
    fn prepare(&self, _view: &PickView<'_>) -> Prepared {
        Prepared::default()
    }

    /// The candidate's score in [0, 1].
    fn score(&self, prep: &Prepared, view: &PickView<'_>, c: &Candidate) -> f64;

    /// The decision's reason when this scorer contributed most to the chosen
    /// worker's score.
    fn reason(&self) -> Reason;

    /// The reason when no scorer scored the chosen worker above 0 and this is the
    /// first scorer.
    fn idle_reason(&self) -> Reason {
        self.reason()
    }

    /// A reason that overrides every scorer's but the one holding the prefix
    /// (the prefix scorer: a prefix nobody holds is `new_prefix`).
    fn override_reason(&self, _view: &PickView<'_>) -> Option<Reason> {
        None
    }

    /// The scorer reads the request's prefix blocks and the prefix index.
    fn uses_prefix(&self) -> bool {
        false
    }

    /// The scorer reads the precise (KV-event) index.
    fn uses_precise(&self) -> bool {
        false
    }

    /// A tie-break key this scorer wants instead of the prefix or text hash.
    fn tie_key(&self, _req: &RouteRequest<'_>) -> Option<u64> {
        None
    }
}

/// A scorer's config name and how to make one.
pub type Entry = (&'static str, fn() -> Box<dyn Scorer>);

/// Every scorer a `weighted` pipeline can name in `[pools.routing].scorers`.
pub const REGISTRY: &[Entry] = &[
    ("prefix", || Box::new(Prefix)),
    ("queue", || Box::new(Queue)),
    ("cost", || Box::new(Cost)),
    ("session", || Box::new(Session)),
    ("kv", || Box::new(Kv)),
    ("precise_prefix", || Box::new(PrecisePrefix)),
    ("slo", || Box::new(Slo)),
    #[cfg(test)]
    ("last", || Box::new(last::Last)),
];

/// The scorer a configured name stands for.
pub fn build(name: &str) -> Option<Box<dyn Scorer>> {
    REGISTRY
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, make)| make())
}

/// `[pools.routing].scorers` entries naming no scorer, as config problems.
pub fn unknown_names(raw: &RawConfig) -> Vec<String> {
    let known = || {
        REGISTRY
            .iter()
            .map(|(n, _)| *n)
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut out = Vec::new();
    for (i, pool) in raw.pools.iter().enumerate() {
        let listed = pool.routing.scorers.as_deref();
        for (j, s) in listed.unwrap_or_default().iter().enumerate() {
            if build(&s.name).is_none() {
                out.push(format!(
                    "pools[{i}].routing.scorers[{j}].name: unknown scorer `{}` (expected one of: {})",
                    s.name,
                    known()
                ));
            }
        }
    }
    out
}

#[cfg(test)]
pub(crate) mod testing {
    use super::*;
    use crate::api::RequestInfo;
    use crate::routing::test_support::workers;

    /// Candidate `i` with defaults, adjusted by `f`.
    pub fn cand(i: usize, f: impl FnOnce(&mut Candidate)) -> Candidate {
        let mut c = Candidate {
            i,
            room: true,
            fits: true,
            ..Default::default()
        };
        f(&mut c);
        c
    }

    /// Run `f` on a view of `cands` (no prefix blocks, `max_wait` from the
    /// candidates) for a request with `session`.
    pub fn with_view<R>(
        cands: &[Candidate],
        session: Option<&str>,
        f: impl FnOnce(PickView<'_>) -> R,
    ) -> R {
        let info = RequestInfo::default();
        let req = RouteRequest::new(&info, session);
        let ws = workers(cands.iter().map(|c| c.i + 1).max().unwrap_or(0));
        let view = PickView {
            req: &req,
            workers: &ws,
            cands,
            max_wait: cands.iter().map(|c| c.wait).fold(0.0, f64::max),
            n_blocks: 0,
            max_depth: 0,
            precise: false,
            max_precise: 0.0,
            key: session.map_or(0, |s| xxhash_rust::xxh3::xxh3_64(s.as_bytes())),
            prompt_tokens: 0,
            block_tokens: 16,
        };
        f(view)
    }

    /// Every candidate's score under `s`.
    pub fn scores(s: &dyn Scorer, cands: &[Candidate], session: Option<&str>) -> Vec<f64> {
        with_view(cands, session, |v| {
            let p = s.prepare(&v);
            cands.iter().map(|c| s.score(&p, &v, c)).collect()
        })
    }
}

#[cfg(test)]
mod tests {
    use crate::config::{self, Secrets};

    #[test]
    fn an_unknown_scorer_is_reported_with_every_other_problem() {
        let text = r#"
            [[pools]]
            models = ["n"]
            policy = "weighted"
            workers = [{ url = "http://h:2" }]
            [pools.routing]
            scorers = [{ name = "vibes", weight = 1.0 }, { name = "queue", weight = 0.0 }]
        "#;
        let e = config::read(text)
            .check_with(super::unknown_names)
            .validate(Secrets::Required)
            .unwrap_err()
            .to_string();
        for needle in [
            "pools[0].routing.scorers[0].name: unknown scorer `vibes` (expected one of: prefix, queue",
            "pools[0].routing.scorers[1].weight",
        ] {
            assert!(e.contains(needle), "missing `{needle}` in:\n{e}");
        }
        let ok = config::read(&text.replace("vibes", "kv").replace("0.0", "1.0"));
        assert!(ok
            .check_with(super::unknown_names)
            .validate(Secrets::Required)
            .is_ok());
    }
}
