//! The `prefix` policy: the worker where the request should see its first token
//! soonest — its wait plus the prompt tokens it does not hold — with three biases
//! that keep caches useful:
//!
//! * workers over the load bound (in requests) get no new prefixes, and a holder
//!   is compared with the best worker within the bound;
//! * a worker holding the prefix wins while its estimate is within half the
//!   prompt of the best, so a prefix moves (is replicated) only when its holder
//!   is clearly busier than the prefill saved there;
//! * otherwise (a new prefix, or a spill) the prefix is placed on a worker with
//!   room for it in its cache and a footprint within bounds, if any (so that
//!   distinct prefixes spread evenly over the caches, as SGLang's cache_aware
//!   does by placing them on its smallest tree); among those, by rendezvous
//!   hashing among the ones within two queued requests of the least loaded — at
//!   low load all of them, so replicas agree and a forgotten prefix returns where
//!   it was; under load the least loaded, as `least_queue` would.
//!
//! It shares the pipeline's candidates, prefix index and block hashes (a
//! [`Pipeline`] with the prefix scorer), but not its weighted scoring. Its
//! source of cached depths is that scorer: `precise_prefix` (the engines' KV
//! events, where the pool's precise index speaks for every worker of the route)
//! or `prefix` (the approximate index), per `[pools.routing].index`.

use super::pipeline::{mean_queue, Candidates, Pipeline, QUEUE_TOKENS, TIE};
use super::scorers::{Candidate, PickView};
use super::{rendezvous, BuildContext, Decision, Policy, Reason, RouteRequest};
use crate::pool::Worker;
use rand::RngCore;
use std::sync::Arc;

/// The `prefix` policy (see the module docs).
pub struct PrefixPolicy {
    core: Pipeline,
}

/// A candidate's estimated time to first token, in prompt tokens, and the load
/// bound placements respect.
struct Estimate {
    prompt: f64,
    /// The most prompt tokens any candidate holds.
    max_held: f64,
    /// The prompt tokens every candidate holds (a chat template's opening, a
    /// system prompt all share): they do not tell the candidates apart, so a
    /// worker is a holder only for what it holds beyond them.
    common: f64,
    bound: f64,
    any_within: bool,
}

impl Estimate {
    fn total(&self, c: &Candidate) -> f64 {
        c.wait + (self.prompt - c.held).max(0.0)
    }

    /// Within the load bound, or nobody is.
    fn allowed(&self, c: &Candidate) -> bool {
        !self.any_within || c.queue <= self.bound
    }
}

impl PrefixPolicy {
    /// `ctx.kind` is `prefix`.
    pub fn new(ctx: &BuildContext<'_>) -> PrefixPolicy {
        PrefixPolicy {
            core: Pipeline::new(ctx),
        }
    }

    fn pick(&self, view: &PickView<'_>, cands: &mut [Candidate]) -> Option<Decision> {
        let core = &self.core;
        let bound = (1.0 + core.load_epsilon) * mean_queue(cands) + core.load_slack;
        let est = Estimate {
            prompt: view.prompt_tokens as f64,
            max_held: cands.iter().map(|c| c.held).fold(0.0, f64::max),
            common: match cands.len() {
                0 | 1 => 0.0,
                _ => cands.iter().map(|c| c.held).fold(f64::MAX, f64::min),
            },
            bound,
            any_within: cands.iter().any(|c| c.queue <= bound),
        };
        if let Some(d) = Self::holder(view, cands, &est) {
            return Some(d);
        }
        self.place(view, cands, &est)
    }

    /// A holder within the tolerance (the one with the lowest estimate), if any.
    fn holder(view: &PickView<'_>, cands: &[Candidate], est: &Estimate) -> Option<Decision> {
        let best = cands
            .iter()
            .filter(|c| est.allowed(c))
            .map(|c| est.total(c))
            .fold(f64::MAX, f64::min);
        // A holder keeps the prefix while within half the prompt of the best
        // worker within the load bound (one prefill queued ahead is tolerated,
        // two are not) — even when it is over the bound
        // itself: its requests are cheap there (mostly cached), and a copy
        // elsewhere costs a whole prefill plus cache space. The bound applies to
        // holders through their wait, to placements through their queue.
        let keep = (est.prompt / 2.0).max(2.0 * QUEUE_TOKENS);
        let mut hit: Option<(&Candidate, f64, u64)> = None;
        for c in cands
            .iter()
            .filter(|c| c.held > est.common && est.total(c) <= best + keep)
        {
            let t = est.total(c);
            let w = rendezvous::weight(view.key, view.workers[c.i].id_hash);
            match hit {
                Some((_, bt, bw)) if t > bt + TIE || (t >= bt - TIE && w <= bw) => {}
                _ => hit = Some((c, t, w)),
            }
        }
        let (c, _, _) = hit?;
        let reason = if c.held >= est.max_held {
            Reason::PrefixHit
        } else {
            Reason::SpillOverload
        };
        Some(Decision::new(c.i, reason))
    }

    /// Place the prefix: rendezvous hashing among the near workers, preferring
    /// those with room for it in their cache and whose footprint (blocks the
    /// index attributes to them) stays within (1 + ε) of the mean after the
    /// placement, or within one such prefix of the least filled — bounded-load
    /// consistent hashing on cache space, so distinct prefixes spread evenly.
    fn place(
        &self,
        view: &PickView<'_>,
        cands: &mut [Candidate],
        est: &Estimate,
    ) -> Option<Decision> {
        let (workers, key) = (view.workers, view.key);
        self.mark_room(view, cands);
        // Cache space first (where the prefix will be reused), then load: within
        // the first tier that has candidates, the workers within two queued
        // requests of its least loaded, by rendezvous weight.
        let cands = &*cands;
        let place = |tier: &dyn Fn(&Candidate) -> bool| {
            let best = cands
                .iter()
                .filter(|c| est.allowed(c) && tier(c))
                .map(|c| est.total(c))
                .fold(f64::MAX, f64::min);
            rendezvous::pick(
                key,
                cands
                    .iter()
                    .filter(|c| {
                        est.allowed(c) && tier(c) && est.total(c) <= best + 2.0 * QUEUE_TOKENS
                    })
                    .map(|c| (c.i, workers[c.i].id_hash)),
            )
        };
        let index = place(&|c| c.room && c.fits)
            .or_else(|| place(&|c| c.fits))
            .or_else(|| place(&|_| true))?;
        if tracing::enabled!(tracing::Level::TRACE) {
            for c in cands.iter() {
                tracing::trace!(
                    worker = %workers[c.i].id, chosen = c.i == index, total = est.total(c),
                    queue = c.queue, footprint = c.footprint, room = c.room, fits = c.fits,
                    cap = c.capacity, precise = view.precise, "prefix placement"
                );
            }
        }
        let reason = if est.max_held <= est.common {
            Reason::NewPrefix
        } else {
            Reason::SpillOverload
        };
        Some(Decision::new(index, reason))
    }

    /// Set each candidate's footprint and capacity (the pick's index), and
    /// whether the prefix fits its cache (`room`) and keeps its footprint within
    /// the bound (`fits`).
    fn mark_room(&self, view: &PickView<'_>, cands: &mut [Candidate]) {
        let Some(n) = self.core.space(view, cands) else {
            return;
        };
        let (mut sum, mut min) = (0u64, u64::MAX);
        for c in cands.iter() {
            sum = sum.saturating_add(c.footprint);
            min = min.min(c.footprint);
        }
        let eps = if view.precise {
            0.0
        } else {
            self.core.load_epsilon
        };
        let limit = ((1.0 + eps) * sum.saturating_add(n) as f64 / cands.len() as f64)
            .max(min.saturating_add(n) as f64);
        for c in cands.iter_mut() {
            c.room = c.footprint.saturating_add(n) <= c.capacity;
            c.fits = c.footprint.saturating_add(n) as f64 <= limit;
        }
    }
}

impl Policy for PrefixPolicy {
    fn name(&self) -> &'static str {
        "prefix"
    }

    fn pick_at(
        &self,
        req: &RouteRequest<'_>,
        workers: &[Arc<Worker>],
        accept: &dyn Fn(usize) -> bool,
        now: u64,
        _rng: &mut dyn RngCore,
    ) -> Option<Decision> {
        let mut cands = Candidates::new();
        let view = self.core.gather(req, workers, accept, now, &mut cands)?;
        self.pick(&view, &mut cands)
    }

    fn record(&self, d: &Decision, req: &RouteRequest<'_>, workers: &[Arc<Worker>]) {
        self.core.record(d, req, workers)
    }

    fn predicted_cached_tokens(&self, d: &Decision, req: &RouteRequest<'_>) -> Option<u64> {
        self.core.predicted_cached_tokens(d, req)
    }

    fn estimate_cost(&self, d: &Decision, req: &RouteRequest<'_>) -> Option<f64> {
        self.core.estimate_cost(d, req)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::inspect::Endpoint;
    use crate::api::RequestInfo;
    use crate::config::{self, PoolConfig, PrefixSource};
    use crate::kv_events::{self, PoolKv, SlotState};
    use crate::pool::stats::{now_ms, parse_metrics};
    use crate::routing::build_for_test_with_kv;
    use bytes::Bytes;

    /// Engine blocks of 4 tokens, each engine's cache 64 of them.
    const BLOCK: usize = 4;

    fn pool(index: &str, kv_lines: &str) -> PoolConfig {
        let workers: Vec<String> = (0..3)
            .map(|i| {
                format!(
                    "{{ url = \"http://w{i}:80\", kv_events = \"tcp://127.0.0.1:{}\" }}",
                    5000 + i
                )
            })
            .collect();
        let text = format!(
            "[[pools]]\nname = \"p\"\nmodels = [\"m\"]\npolicy = \"prefix\"\ntokenizer = \"sim\"\nworkers = [{}]\n[pools.routing]\nindex = \"{index}\"\n[pools.kv_events]\nblock_size = {BLOCK}\n{kv_lines}\n",
            workers.join(", ")
        );
        config::first_pool(&text).unwrap()
    }

    /// The prefix policy of `pool(index)` over three idle workers whose engines
    /// publish events, every one live in the precise index.
    struct Fixture {
        workers: Vec<Arc<Worker>>,
        policy: PrefixPolicy,
        kv: Arc<PoolKv>,
        slots: Vec<u8>,
    }

    fn fixture(index: &str, kv_lines: &str) -> Fixture {
        let pc = pool(index, kv_lines);
        let kv = Arc::new(PoolKv::new(&pc).expect("workers publish events"));
        let (workers, policy) = build_for_test_with_kv(&pc, Some(&kv), |ctx| {
            for w in ctx.workers {
                kv.index.claim(&w.id).unwrap();
            }
            PrefixPolicy::new(ctx)
        });
        let metrics = format!(
            "vllm:num_requests_running 0\nvllm:cache_config_info{{block_size=\"{BLOCK}\",num_gpu_blocks=\"64\"}} 1\n"
        );
        let mut slots = Vec::new();
        for w in &workers {
            w.state.stats.store(&parse_metrics(&metrics), now_ms());
            let slot = kv.index.slot_of(&w.id).unwrap();
            kv.index.set_state(slot, SlotState::Live);
            slots.push(slot);
        }
        Fixture {
            workers,
            policy,
            kv,
            slots,
        }
    }

    struct Req {
        info: RequestInfo,
        body: Vec<u8>,
    }

    fn req(text: &str) -> Req {
        let body =
            serde_json::json!({"model": "m", "messages": [{"role": "user", "content": text}]});
        Req {
            info: RequestInfo {
                routing_text: Some(Bytes::from(text.to_string())),
                ..Default::default()
            },
            body: serde_json::to_vec(&body).unwrap(),
        }
    }

    impl Fixture {
        /// The precise index's keys of `r`'s prompt.
        fn keys(&self, r: &Req) -> Vec<u64> {
            let tokenizer = self.kv.tokenizer.as_ref().unwrap();
            let tokens = tokenizer
                .prompt_tokens(Endpoint::ChatCompletions, &r.body)
                .unwrap();
            kv_events::prompt_keys(&tokens, BLOCK)
        }

        /// Worker `w`'s engine reports holding `keys` in `tier`.
        fn hold(&self, w: usize, keys: &[u64], tier: kv_events::wire::Tier) {
            for &k in keys {
                self.kv.index.insert(self.slots[w], k, tier);
            }
        }

        /// Pick for `r`, record it; the decision, the predicted cached tokens
        /// and whether the prediction was precise.
        fn pick(&self, r: &Req) -> (Decision, Option<u64>, bool) {
            let rr = RouteRequest::new(&r.info, None).with_body(Endpoint::ChatCompletions, &r.body);
            let d = Policy::pick(&self.policy, &rr, &self.workers, &|_| true).unwrap();
            let predicted = self.policy.predicted_cached_tokens(&d, &rr);
            self.policy.record(&d, &rr, &self.workers);
            (d, predicted, rr.predicted_precisely())
        }
    }

    fn long(tag: &str) -> String {
        (0..60)
            .map(|i| format!("{tag}{i}"))
            .collect::<Vec<_>>()
            .join(" ")
    }

    #[test]
    fn the_precise_index_overrules_what_this_gateway_sent_where() {
        // Decisions are not remembered as pending: only the events speak.
        let f = fixture("auto", "pending_ttl_ms = 0");
        let r = req(&long("evicted"));
        // While one worker is still syncing, the approximate index decides.
        f.kv.index.set_state(f.slots[1], SlotState::Syncing);
        let (first, _, precise) = f.pick(&r);
        assert_eq!((first.reason, precise), (Reason::NewPrefix, false));
        f.kv.index.set_state(f.slots[1], SlotState::Live);
        // The engine that got it evicted it; another one holds it (sent there
        // directly, or by another gateway).
        let other = (first.index + 1) % 3;
        let keys = f.keys(&r);
        f.hold(other, &keys, kv_events::wire::Tier::Gpu);
        let lookups = f.kv.index.lookups();
        let (d, predicted, precise) = f.pick(&r);
        assert_eq!((d.index, d.reason), (other, Reason::PrefixHit));
        assert!(precise, "counted under mode=\"precise\"");
        assert_eq!(predicted, Some((keys.len() * BLOCK) as u64));
        assert_eq!(
            f.kv.index.lookups() - lookups,
            1,
            "the prediction reuses the pick's lookup"
        );
    }

    #[test]
    fn approximate_keeps_to_what_this_gateway_sent_where() {
        let f = fixture("approximate", "");
        let r = req(&long("stale"));
        let (first, _, _) = f.pick(&r);
        f.hold(
            (first.index + 1) % 3,
            &f.keys(&r),
            kv_events::wire::Tier::Gpu,
        );
        let (d, predicted, precise) = f.pick(&r);
        assert_eq!((d.index, d.reason), (first.index, Reason::PrefixHit));
        assert!(!precise, "counted under mode=\"approximate\"");
        assert!(predicted.unwrap() > 0);
        assert_eq!(
            pool("approximate", "").routing.index,
            PrefixSource::Approximate
        );
    }

    #[test]
    fn a_gpu_copy_beats_an_offloaded_one() {
        let f = fixture("auto", "");
        let r = req(&long("tiers"));
        let keys = f.keys(&r);
        f.hold(0, &keys, kv_events::wire::Tier::Cpu);
        f.hold(2, &keys, kv_events::wire::Tier::Gpu);
        let (d, _, precise) = f.pick(&r);
        assert_eq!((d.index, d.reason, precise), (2, Reason::PrefixHit, true));
    }

    /// Requests sharing a new prefix follow the first one before the engine's
    /// events can tell (the decision is pending), and only for a while.
    #[test]
    fn a_prompt_just_sent_counts_as_held_until_its_events_can_tell() {
        let f = fixture("auto", "pending_ttl_ms = 60000");
        let r = req(&long("burst"));
        let (first, _, _) = f.pick(&r);
        assert_eq!(first.reason, Reason::NewPrefix);
        for w in &f.workers {
            w.state
                .stats
                .store(&parse_metrics("vllm:num_requests_running 0\n"), now_ms());
        }
        f.workers[first.index]
            .state
            .stats
            .store(&parse_metrics("vllm:num_requests_running 1\n"), now_ms());
        let (d, predicted, precise) = f.pick(&r);
        assert_eq!(
            (d.index, d.reason, precise),
            (first.index, Reason::PrefixHit, true)
        );
        assert_eq!(predicted, Some((f.keys(&r).len() * BLOCK) as u64));
        let later = now_ms() + 120_000;
        let rr = RouteRequest::new(&r.info, None).with_body(Endpoint::ChatCompletions, &r.body);
        let d = Policy::pick_at(
            &f.policy,
            &rr,
            &f.workers,
            &|_| true,
            later,
            &mut rand::thread_rng(),
        );
        assert_eq!(d.unwrap().reason, Reason::NewPrefix, "expired");
    }

    /// A new prefix goes where the engines' own events say there is room, the
    /// same on every replica (no replica's own traffic enters into it).
    #[test]
    fn a_new_prefix_goes_where_the_engines_have_room() {
        let f = fixture("auto", "pending_ttl_ms = 0");
        // Blocks of other prompts (not even the chat template's opening).
        let tokens: Vec<u32> = (100_000..100_240).collect();
        let filler = kv_events::prompt_keys(&tokens, BLOCK);
        f.hold(0, &filler[..60], kv_events::wire::Tier::Gpu);
        f.hold(2, &filler[..60], kv_events::wire::Tier::Gpu);
        for k in 0..8 {
            let (d, _, precise) = f.pick(&req(&format!("new {k} {}", long("x"))));
            assert_eq!((d.index, d.reason, precise), (1, Reason::NewPrefix, true));
        }
    }

    /// New prefixes sent in a burst spread over the caches before any engine
    /// reports them: a worker's pending new blocks count towards its footprint.
    #[test]
    fn new_prefixes_sent_in_a_burst_spread_before_the_events_tell() {
        let f = fixture("auto", "pending_ttl_ms = 60000");
        // Every engine holds the chat template's opening (a warm fleet): it
        // does not make any of them a holder of the new prefixes.
        let (a, b) = (f.keys(&req(&long("a"))), f.keys(&req(&long("b"))));
        let opening = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
        assert!(opening > 0, "the template's opening fills a block");
        for w in 0..3 {
            f.hold(w, &a[..opening], kv_events::wire::Tier::Gpu);
        }
        let mut placed: Vec<usize> = (0..6)
            .map(|k| {
                let (d, _, precise) = f.pick(&req(&long(&format!("burst{k}-"))));
                assert_eq!((d.reason, precise), (Reason::NewPrefix, true));
                d.index
            })
            .collect();
        placed.sort_unstable();
        assert_eq!(placed, [0, 0, 1, 1, 2, 2], "two new prefixes per engine");
    }

    /// On the precise index a new prefix goes to an engine no fuller than the
    /// mean after the placement: engines report every block they keep, so their
    /// footprints sit near capacity and the load tolerance would let one take a
    /// prefix more than its cache holds.
    #[test]
    fn on_the_events_a_new_prefix_goes_to_an_engine_no_fuller_than_the_mean() {
        let f = fixture("auto", "pending_ttl_ms = 0");
        let n = f.keys(&req(&long("probe"))).len();
        let tokens: Vec<u32> = (100_000..100_000 + 3 * 240 * BLOCK as u32).collect();
        let filler = kv_events::prompt_keys(&tokens, BLOCK);
        let full = 200;
        f.hold(0, &filler[..full], kv_events::wire::Tier::Gpu);
        f.hold(1, &filler[240..240 + full], kv_events::wire::Tier::Gpu);
        f.hold(
            2,
            &filler[480..480 + full - n / 2],
            kv_events::wire::Tier::Gpu,
        );
        for k in 0..8 {
            let (d, _, precise) = f.pick(&req(&long(&format!("new{k}-"))));
            assert_eq!((d.index, d.reason, precise), (2, Reason::NewPrefix, true));
        }
    }
}
