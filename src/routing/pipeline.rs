//! The scoring pipeline behind `least_queue`, `cost`, `session` and `weighted`:
//! filters → weighted scorers in [0, 1] → spill rules → max score, ties broken by
//! rendezvous hashing on a stable request key. The `prefix` policy
//! (`prefix.rs`) shares its candidates, block hashes and prefix index.
//!
//! Spill rules: a worker whose stats are stale is never preferred over a fresh one;
//! with a load bound (`prefix`, `session`, `weighted`), a worker whose estimated
//! queue exceeds `(1 + ε) × mean + slack` is passed over while any other is within
//! it; with headroom (`cost`, or `weighted` with a cost scorer), a worker whose
//! queue reaches `target_queue` is passed over while any other has headroom.

use super::prefix_index::{PrefixIndex, REPLICAS};
use super::scorers::{self, Candidate, PickView, Prepared, Scorer};
use super::{rendezvous, BuildContext, Decision, Reason, RouteRequest};
use crate::config::{PolicyKind, PrefixSource, ScorerName};
use crate::kv_events::{self, PoolKv, MAX_WORKERS};
use crate::pool::stats::Freshness;
use crate::pool::Worker;
use crate::telemetry::names;
use crate::tokenize::PromptTokenizer;
use rand::{Rng, RngCore};
use smallvec::SmallVec;
use std::sync::Arc;
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// Most prefix blocks hashed per request (beyond: not indexed). With the default
/// 256-byte blocks this is 1 MiB of routing text.
pub const MAX_BLOCKS: usize = 4096;
/// New prefixes are placed by the chain hash of this many leading blocks (or all
/// of them when fewer): enough to tell apart prompts sharing a boilerplate opening.
pub const PLACEMENT_BLOCKS: usize = 4;
/// The index remembers up to `1 + 1/INDEX_SLACK_DIV` times a worker's estimated
/// KV capacity: forgetting a prefix the engine still holds costs a miss *and* a
/// second copy elsewhere (the prefix is placed anew), while remembering one the
/// engine dropped costs only the miss, on the worker that then caches it again.
/// The estimate (bytes per token, engine block counts) is rarely exact.
pub const INDEX_SLACK_DIV: u64 = 2;
/// Scores closer than this tie.
pub(super) const TIE: f64 = 1e-9;

/// Split `text` into full `block_bytes` blocks and hash them as a chain seeded by
/// `seed`: block i's hash covers blocks 0..=i. The trailing partial block is left
/// out (engines cache only full blocks, and it is where requests differ).
pub fn hash_blocks(text: &[u8], seed: u64, block_bytes: usize) -> Vec<u64> {
    let mut h = seed;
    text.chunks_exact(block_bytes.max(1))
        .take(MAX_BLOCKS)
        .map(|c| {
            h = xxh3_64_with_seed(c, h);
            h
        })
        .collect()
}

/// A configured pipeline (see the module docs).
pub struct Pipeline {
    name: &'static str,
    /// The weighted scorers, built once with the pool.
    scorers: Vec<(Box<dyn Scorer>, f64)>,
    /// Some scorer reads the prefix blocks.
    uses_prefix: bool,
    bounded: bool,
    headroom: bool,
    power_of_two: bool,
    pub(super) load_epsilon: f64,
    pub(super) load_slack: f64,
    target_queue: f64,
    stale_after_ms: u64,
    block_bytes: usize,
    pub(super) block_tokens: u64,
    pub(super) bytes_per_token: u64,
    default_worker_blocks: u64,
    /// xxh3 of the model name; prefix hashes are seeded by it and the cache salt.
    model_seed: u64,
    /// Per worker: passes the label filter.
    eligible: Vec<bool>,
    /// Per worker: USD per 1M tokens.
    prices: Vec<f64>,
    /// Per worker: prefix-index slot (0 = not indexed).
    pub(super) slots: Vec<u16>,
    /// Slot → worker index (`u32::MAX` = not in this route).
    slot_to_index: Vec<u32>,
    pub(super) index: Option<Arc<PrefixIndex>>,
    /// The pool's precise index, when a scorer reads it and the pool has one
    /// with a tokenizer.
    precise: Option<Precise>,
}

/// A prompt looked up in the precise index.
struct PreciseHit {
    depths: kv_events::Depths,
    /// The prompt's full blocks.
    blocks: usize,
    /// The prompt's tokens.
    tokens: u64,
}

/// What a pipeline needs to look a prompt up in the pool's precise index.
struct Precise {
    kv: Arc<PoolKv>,
    pool: Arc<str>,
    tokenizer: Arc<dyn PromptTokenizer>,
    /// Per worker: its slot in the index.
    slots: Vec<Option<u8>>,
}

impl Precise {
    /// The index's identity (its address), to match a pick's kept lookup.
    fn id(&self) -> usize {
        Arc::as_ptr(&self.kv.index) as usize
    }
}

/// One request in flight counts as this many prompt tokens of wait: a sequence
/// that is decoding slows the engine's steps a little, while a prompt waiting for
/// its prefill delays the next request by that whole prefill (counted apart, in
/// `pending_tokens`). Among workers with no prefill queued, the shorter queue wins.
pub const QUEUE_TOKENS: f64 = 16.0;

/// Candidates kept on the stack during a pick (larger routes spill to the heap).
pub const INLINE_CANDIDATES: usize = 32;
pub(super) type Candidates = SmallVec<[Candidate; INLINE_CANDIDATES]>;
/// One [`Prepared`] per scorer.
type Prepareds = SmallVec<[Prepared; 8]>;

/// The mean queue of the candidates with fresh stats.
pub(super) fn mean_queue(cands: &[Candidate]) -> f64 {
    let (mut sum, mut n) = (0.0, 0.0);
    for c in cands.iter().filter(|c| !c.stale) {
        sum += c.queue;
        n += 1.0;
    }
    sum / f64::max(n, 1.0)
}

impl Pipeline {
    /// The preset `ctx.kind` names; for `prefix`, the core the
    /// [`PrefixPolicy`](super::PrefixPolicy) picks with (its own pick is not
    /// this pipeline's weighted one).
    pub fn new(ctx: &BuildContext<'_>) -> Pipeline {
        let r = &ctx.pool.routing;
        let (name, kinds, bounded, headroom): (_, Vec<(ScorerName, f64)>, _, _) = match ctx.kind {
            // The prefix policy's source of cached depths is its one scorer.
            PolicyKind::Prefix => {
                let source = match r.index {
                    PrefixSource::Approximate => "prefix",
                    PrefixSource::Auto | PrefixSource::Precise => "precise_prefix",
                };
                ("prefix", vec![(source.into(), 1.0)], true, false)
            }
            PolicyKind::Cost => (
                "cost",
                vec![("cost".into(), 1.0), ("queue".into(), 0.01)],
                false,
                true,
            ),
            PolicyKind::Session => (
                "session",
                vec![("session".into(), 1.0), ("queue".into(), 0.01)],
                true,
                false,
            ),
            PolicyKind::Slo => (
                "slo",
                vec![("slo".into(), 1.0), ("queue".into(), 0.01)],
                false,
                false,
            ),
            PolicyKind::Weighted => {
                let cost = r.scorers.iter().any(|(k, _)| &**k == "cost");
                ("weighted", r.scorers.clone(), true, cost)
            }
            // least_queue (and, defensively, anything else).
            _ => ("least_queue", vec![("queue".into(), 1.0)], false, false),
        };
        // Names were checked with the config (`scorers::unknown_names`); one that
        // slipped past (a config built in code) is skipped, loudly.
        let scorers = kinds
            .into_iter()
            .filter_map(|(k, w)| match scorers::build(&k) {
                Some(s) => Some((s, w)),
                None => {
                    tracing::warn!(pool = %ctx.pool.name, scorer = %k, "unknown scorer skipped");
                    None
                }
            });
        let mut p = Pipeline::with_scorers(ctx, scorers.collect());
        p.name = name;
        p.bounded = bounded;
        p.headroom = headroom;
        p.power_of_two = r.power_of_two && ctx.kind == PolicyKind::LeastQueue;
        p
    }

    /// A `weighted` pipeline over the given scorers (bounded load, no headroom
    /// rule): what [`Pipeline::new`] builds from the configured scorer names, and
    /// the way to try a scorer before it has a name.
    pub fn with_scorers(ctx: &BuildContext<'_>, scorers: Vec<(Box<dyn Scorer>, f64)>) -> Pipeline {
        let r = &ctx.pool.routing;
        let uses_prefix = scorers.iter().any(|(s, _)| s.uses_prefix());
        let precise = ctx
            .kv
            .filter(|_| scorers.iter().any(|(s, _)| s.uses_precise()))
            .and_then(|kv| {
                Some(Precise {
                    tokenizer: kv.tokenizer.clone()?,
                    slots: ctx
                        .workers
                        .iter()
                        .map(|w| kv.index.slot_of(&w.id))
                        .collect(),
                    kv: kv.clone(),
                    pool: Arc::from(ctx.pool.name.as_str()),
                })
            });
        let index = ctx.index.filter(|_| uses_prefix).cloned();
        let slots = match &index {
            Some(ix) => {
                let ids: Vec<Arc<str>> = ctx.workers.iter().map(|w| w.id.clone()).collect();
                ix.slots(&ids)
            }
            None => vec![0; ctx.workers.len()],
        };
        let mut slot_to_index =
            vec![u32::MAX; slots.iter().copied().max().unwrap_or(0) as usize + 1];
        for (i, &s) in slots.iter().enumerate() {
            if s != 0 {
                slot_to_index[s as usize] = i as u32;
            }
        }
        let eligible = ctx
            .workers
            .iter()
            .map(|w| {
                r.require_labels
                    .iter()
                    .all(|(k, v)| w.labels.get(k) == Some(v))
            })
            .collect();
        let prices = ctx
            .workers
            .iter()
            .map(|w| {
                ctx.pool
                    .workers
                    .iter()
                    .find(|wc| *wc.url == *w.id)
                    .map_or(0.0, |wc| wc.price_per_mtok)
            })
            .collect();
        Pipeline {
            name: "weighted",
            scorers,
            uses_prefix,
            bounded: true,
            headroom: false,
            power_of_two: false,
            load_epsilon: r.load_epsilon,
            load_slack: r.load_slack,
            target_queue: r.target_queue,
            stale_after_ms: r.stale_after.as_millis() as u64,
            block_bytes: r.block_bytes(),
            block_tokens: r.block_tokens.get() as u64,
            bytes_per_token: r.bytes_per_token.get() as u64,
            default_worker_blocks: r.default_worker_blocks,
            model_seed: xxh3_64(ctx.model.as_bytes()),
            eligible,
            prices,
            slots,
            slot_to_index,
            index,
            precise,
        }
    }

    /// The precise index's keys of the request's prompt blocks an engine can
    /// reuse, and the prompt's token count (`None`: not tokenized).
    fn prompt_keys<'r>(&self, p: &Precise, req: &'r RouteRequest<'_>) -> Option<(&'r [u64], u64)> {
        req.prompt_keys(|| {
            let (endpoint, body) = req.body?;
            let tokens = p.tokenizer.prompt_tokens(endpoint, body).ok()?;
            let keys = kv_events::reusable_prompt_keys(&tokens, p.kv.index.block_size());
            Some((keys, tokens.len() as u64))
        })
    }

    /// Per worker of the route, the prompt's blocks it holds by tier (or was
    /// just sent, pending at `now`), when the pool's precise index speaks for
    /// every worker; `None` otherwise.
    fn precise_lookup(&self, req: &RouteRequest<'_>, now: u64) -> Option<PreciseHit> {
        let p = self.precise.as_ref()?;
        if !p.kv.index.covers(&p.slots) {
            return None;
        }
        let (keys, tokens) = self.prompt_keys(p, req)?;
        let mut depths = [[0u32; 3]; MAX_WORKERS];
        p.kv.index.lookup_at(keys, &mut depths, now);
        Some(PreciseHit {
            depths,
            blocks: keys.len(),
            tokens,
        })
    }

    /// In precise mode, set each candidate's precise share and held tokens and
    /// return the largest share and the prompt's exact token count.
    fn precise_depths(
        &self,
        req: &RouteRequest<'_>,
        now: u64,
        cands: &mut [Candidate],
    ) -> Option<(f64, u64)> {
        let p = self.precise.as_ref()?;
        let hit = self.precise_lookup(req, now);
        req.keep_precise_held(hit.as_ref().map(|h| (p.id(), &h.depths)));
        let hit = hit?;
        let block = p.kv.index.block_size() as f64;
        let mut max = 0.0f64;
        for c in cands.iter_mut() {
            let Some(Some(slot)) = p.slots.get(c.i) else {
                continue;
            };
            let row = &hit.depths[*slot as usize];
            let weighted = kv_events::weighted_blocks(row, &p.kv.tier_weights);
            c.precise_blocks = row[2];
            c.precise = weighted / hit.blocks.max(1) as f64;
            c.held = weighted * block;
            max = max.max(c.precise);
        }
        Some((max, hit.tokens))
    }

    /// Cache space for placing the request's prefix, in blocks of the pick's
    /// index: each candidate's `footprint` and `capacity`, and (returned) the
    /// prefix's blocks. In precise mode the GPU blocks each engine's events say
    /// it holds and its published capacity (unbounded while unknown), so every
    /// replica sees the same; otherwise what the prefix index attributes to each
    /// worker. `None` without an index.
    pub(super) fn space(&self, view: &PickView<'_>, cands: &mut [Candidate]) -> Option<u64> {
        if let (true, Some(p)) = (view.precise, &self.precise) {
            let (keys, _) = self.prompt_keys(p, view.req)?;
            let block = p.kv.index.block_size() as u64;
            for c in cands.iter_mut() {
                let slot = p.slots.get(c.i).copied().flatten();
                c.footprint = slot.map_or(0, |s| {
                    p.kv.index.gpu_blocks(s) + p.kv.index.pending_blocks(s)
                });
                c.capacity = view.workers[c.i]
                    .state
                    .stats
                    .kv_capacity_tokens()
                    .map_or(u64::MAX, |t| (t / block).max(1));
            }
            return Some(keys.len() as u64);
        }
        let ix = self.index.as_ref()?;
        let fp = ix.footprints();
        for c in cands.iter_mut() {
            c.footprint = fp.get(self.slots[c.i]);
            c.capacity = ix.effective_capacity(self.capacity_blocks(&view.workers[c.i]));
        }
        Some(view.n_blocks as u64)
    }

    fn blocks<'r>(&self, req: &'r RouteRequest<'_>) -> &'r [u64] {
        req.blocks(|| {
            let Some(text) = &req.info.routing_text else {
                return Vec::new();
            };
            let seed = match &req.info.cache_salt {
                Some(salt) => xxh3_64_with_seed(salt.as_bytes(), self.model_seed),
                None => self.model_seed,
            };
            hash_blocks(text, seed, self.block_bytes)
        })
    }

    /// The stable key that breaks ties: the session key, else the prefix placement
    /// hash, else the whole routing text.
    fn tie_key(&self, req: &RouteRequest<'_>, blocks: &[u64]) -> u64 {
        if let Some(k) = self.scorers.iter().find_map(|(s, _)| s.tie_key(req)) {
            return k;
        }
        if let Some(&h) = blocks.get(blocks.len().min(PLACEMENT_BLOCKS).wrapping_sub(1)) {
            return h;
        }
        req.info
            .routing_text
            .as_ref()
            .map_or(self.model_seed, |t| xxh3_64_with_seed(t, self.model_seed))
    }

    /// The index of the best candidate among those `ok` admits: highest score;
    /// among equal positive scores the shorter wait (then the shorter wait this
    /// gateway knows of, which differs for stale workers); remaining ties by
    /// rendezvous weight on `key` (so zero-score ties — nobody has a preference —
    /// are decided the same way on every replica).
    fn best(
        cands: &[Candidate],
        workers: &[Arc<Worker>],
        key: u64,
        ok: impl Fn(&Candidate) -> bool,
    ) -> Option<usize> {
        let mut best: Option<(usize, f64, u64)> = None;
        for (k, c) in cands.iter().enumerate().filter(|(_, c)| ok(c)) {
            match best {
                None => best = Some((k, c.score, 0)),
                Some((bk, bs, mut bw)) => {
                    let by_wait = bs > TIE && (c.score - bs).abs() <= TIE;
                    let order =
                        (c.wait, c.own_wait).partial_cmp(&(cands[bk].wait, cands[bk].own_wait));
                    let less = order == Some(std::cmp::Ordering::Less);
                    let more = order == Some(std::cmp::Ordering::Greater);
                    if c.score > bs + TIE || (by_wait && less) {
                        best = Some((k, c.score, 0));
                    } else if c.score >= bs - TIE && !(by_wait && more) {
                        // A tie: a worker with fresh stats before a stale one (stale
                        // is never preferred), then rendezvous.
                        match (c.stale, cands[bk].stale) {
                            (false, true) => {
                                best = Some((k, c.score, 0));
                                continue;
                            }
                            (true, false) => continue,
                            _ => {}
                        }
                        // Compute rendezvous weights only now.
                        if bw == 0 {
                            bw = rendezvous::weight(key, workers[cands[bk].i].id_hash);
                            best = Some((bk, bs, bw));
                        }
                        let w = rendezvous::weight(key, workers[c.i].id_hash);
                        if w > bw {
                            best = Some((k, c.score, w));
                        }
                    }
                }
            }
        }
        best.map(|b| b.0)
    }

    fn pick_two(
        cands: &[Candidate],
        workers: &[Arc<Worker>],
        key: u64,
        rng: &mut dyn RngCore,
    ) -> usize {
        if cands.len() == 1 {
            return 0;
        }
        let a = rng.gen_range(0..cands.len());
        let mut b = rng.gen_range(0..cands.len() - 1);
        if b >= a {
            b += 1;
        }
        let pair = [cands[a], cands[b]];
        let k = Self::best(&pair, workers, key, |_| true).unwrap_or(0);
        [a, b][k]
    }
}

impl super::Policy for Pipeline {
    fn name(&self) -> &'static str {
        self.name
    }

    fn pick_at(
        &self,
        req: &RouteRequest<'_>,
        workers: &[Arc<Worker>],
        accept: &dyn Fn(usize) -> bool,
        now: u64,
        rng: &mut dyn RngCore,
    ) -> Option<Decision> {
        self.pick_impl(req, workers, accept, now, rng)
    }

    fn record(&self, d: &Decision, req: &RouteRequest<'_>, workers: &[Arc<Worker>]) {
        self.record_impl(d, req, workers)
    }

    fn estimate_cost(&self, d: &Decision, req: &RouteRequest<'_>) -> Option<f64> {
        self.estimate_cost_impl(d, req)
    }

    fn predicted_cached_tokens(&self, d: &Decision, req: &RouteRequest<'_>) -> Option<u64> {
        if let Some(p) = &self.precise {
            let slot = p.slots.get(d.index).copied().flatten();
            // The pick's own lookup when it made one, else a fresh one.
            let held = req.precise_held(p.id(), slot).or_else(|| {
                let hit = self.precise_lookup(req, crate::pool::stats::now_ms())?;
                Some(slot.map(|s| hit.depths[s as usize][2]))
            });
            req.set_predicted_precisely(held.is_some());
            if let Some(blocks) = held {
                return Some(u64::from(blocks?) * p.kv.index.block_size() as u64);
            }
        } else {
            req.set_predicted_precisely(false);
        }
        let ix = self.index.as_ref()?;
        let blocks = self.blocks(req);
        let slot = *self.slots.get(d.index)?;
        if blocks.is_empty() || slot == 0 {
            return Some(0);
        }
        let mut out = [(0u16, 0u32); REPLICAS];
        let m = ix.lookup(blocks, &mut out);
        let depth = out[..m].iter().find(|e| e.0 == slot).map_or(0, |e| e.1);
        Some(u64::from(depth) * self.block_tokens)
    }
}

impl Pipeline {
    fn pick_impl(
        &self,
        req: &RouteRequest<'_>,
        workers: &[Arc<Worker>],
        accept: &dyn Fn(usize) -> bool,
        now: u64,
        rng: &mut dyn RngCore,
    ) -> Option<Decision> {
        let mut cands = Candidates::new();
        let mut view = self.gather(req, workers, accept, now, &mut cands)?;
        let prepared = self.score(&view, &mut cands);
        view.cands = &cands;
        self.choose(&view, &prepared, rng)
    }

    /// Fill `cands` (the caller's, so that the inline buffer is never moved) and
    /// return what every scorer may look at (the view, without the candidates
    /// yet); `None` when no worker is eligible and accepted.
    pub(super) fn gather<'a>(
        &self,
        req: &'a RouteRequest<'a>,
        workers: &'a [Arc<Worker>],
        accept: &dyn Fn(usize) -> bool,
        now: u64,
        cands: &mut Candidates,
    ) -> Option<PickView<'a>> {
        self.candidates(workers, accept, now, cands);
        if cands.is_empty() {
            return None;
        }
        let blocks: &[u64] = if self.uses_prefix {
            self.blocks(req)
        } else {
            &[]
        };
        let key = self.tie_key(req, blocks);
        let max_depth = self.prefix_depths(blocks, cands);
        let approx_tokens = req
            .info
            .routing_text
            .as_ref()
            .map_or(0, |t| t.len() as u64 / self.bytes_per_token.max(1));
        let precise = self.precise_depths(req, now, cands);
        let (max_precise, prompt_tokens) = precise.unwrap_or((0.0, approx_tokens));
        let view = PickView {
            req,
            workers,
            cands: &[],
            max_wait: cands.iter().map(|c| c.wait).fold(0.0, f64::max),
            n_blocks: blocks.len(),
            max_depth,
            precise: precise.is_some(),
            max_precise,
            key,
            prompt_tokens,
            block_tokens: self.block_tokens,
        };
        Some(view)
    }

    /// The accepted, eligible workers with their loads at `now`. Stale stats
    /// count as fully loaded: as busy as the busiest fresh worker (never as idle,
    /// and never excluded, so that a few late scrapes cannot herd every request
    /// onto the workers whose scrape happened to succeed); among equally "full"
    /// workers, this gateway's own counts decide. When every candidate is stale,
    /// the gateway's own counts are all there is.
    fn candidates(
        &self,
        workers: &[Arc<Worker>],
        accept: &dyn Fn(usize) -> bool,
        now: u64,
        cands: &mut Candidates,
    ) {
        if workers.len() > INLINE_CANDIDATES {
            cands.reserve(workers.len());
        }
        for (i, w) in workers.iter().enumerate() {
            if !self.eligible.get(i).copied().unwrap_or(false) || !accept(i) {
                continue;
            }
            let l = w.state.stats.load(w.in_flight(), now, self.stale_after_ms);
            let wait = l.pending_tokens + QUEUE_TOKENS * l.queue;
            cands.push(Candidate {
                i,
                queue: l.queue,
                wait,
                own_wait: wait,
                kv: l.kv_usage,
                pending: l.pending_tokens,
                stale: l.freshness == Freshness::Stale,
                price: self.prices[i],
                room: true,
                fits: true,
                ..Default::default()
            });
        }
        let (mut fresh, mut max_q, mut max_w) = (false, 0.0f64, 0.0f64);
        for c in cands.iter().filter(|c| !c.stale) {
            fresh = true;
            max_q = max_q.max(c.queue);
            max_w = max_w.max(c.wait);
        }
        for c in cands.iter_mut() {
            if !fresh {
                c.stale = false;
            } else if c.stale {
                c.queue = c.queue.max(max_q);
                c.wait = c.wait.max(max_w);
            }
        }
    }

    /// Set how deep each candidate holds the prefix; the deepest.
    fn prefix_depths(&self, blocks: &[u64], cands: &mut [Candidate]) -> u32 {
        let mut max_depth = 0;
        if let (Some(ix), false) = (&self.index, blocks.is_empty()) {
            let mut out = [(0u16, 0u32); REPLICAS];
            let m = ix.lookup(blocks, &mut out);
            for &(slot, depth) in &out[..m] {
                let Some(&i) = self.slot_to_index.get(slot as usize) else {
                    continue;
                };
                if let Some(c) = cands.iter_mut().find(|c| c.i as u32 == i) {
                    c.depth = depth;
                    c.held = f64::from(depth) * self.block_tokens as f64;
                    max_depth = max_depth.max(depth);
                }
            }
        }
        max_depth
    }

    /// Prepare every scorer once, then set each candidate's weighted score.
    fn score(&self, view: &PickView<'_>, cands: &mut [Candidate]) -> Prepareds {
        // The scorers see the candidates (scores not yet set) while preparing.
        let prepared: Prepareds = {
            let v = PickView { cands, ..*view };
            self.scorers.iter().map(|(s, _)| s.prepare(&v)).collect()
        };
        for k in 0..cands.len() {
            let v = PickView { cands, ..*view };
            let c = &cands[k];
            let score = self
                .scorers
                .iter()
                .zip(&prepared)
                .map(|((s, w), p)| w * s.score(p, &v, c))
                .sum();
            cands[k].score = score;
        }
        prepared
    }

    /// The best-scored candidate within the spill rules, and why.
    fn choose(
        &self,
        view: &PickView<'_>,
        prepared: &[Prepared],
        rng: &mut dyn RngCore,
    ) -> Option<Decision> {
        let (cands, workers, key) = (view.cands, view.workers, view.key);
        if self.power_of_two {
            let k = Self::pick_two(cands, workers, key, rng);
            return Some(Decision::new(cands[k].i, Reason::LeastQueue));
        }
        let bound = (1.0 + self.load_epsilon) * mean_queue(cands) + self.load_slack;
        let restricted = |c: &Candidate| {
            (self.bounded && c.queue > bound) || (self.headroom && c.queue >= self.target_queue)
        };
        let preferred = Self::best(cands, workers, key, |_| true)?;
        let (chosen, spilled) = match Self::best(cands, workers, key, |c| !restricted(c)) {
            Some(k) => (k, k != preferred),
            None => {
                // Nobody has headroom: the least loaded.
                let k = cands
                    .iter()
                    .enumerate()
                    .min_by(|a, b| a.1.wait.total_cmp(&b.1.wait))
                    .map(|(k, _)| k)
                    .unwrap_or(preferred);
                (k, true)
            }
        };
        let c = &cands[chosen];
        let reason = if spilled {
            Reason::SpillOverload
        } else {
            self.reason(view, prepared, c)
        };
        Some(Decision::new(c.i, reason))
    }

    /// Why `c` won on its scores: a scorer's override (a new prefix), else the
    /// scorer that contributed most, else (nobody scored) the first scorer's idle
    /// reason.
    fn reason(&self, view: &PickView<'_>, prepared: &[Prepared], c: &Candidate) -> Reason {
        if let Some(r) = self
            .scorers
            .iter()
            .find_map(|(s, _)| s.override_reason(view))
        {
            return r;
        }
        self.scorers
            .iter()
            .zip(prepared)
            .map(|((s, w), p)| (s, w * s.score(p, view, c)))
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .filter(|t| t.1 > 0.0)
            .map(|t| t.0.reason())
            .or_else(|| self.scorers.first().map(|(s, _)| s.idle_reason()))
            .unwrap_or(Reason::LeastQueue)
    }

    /// The worker's KV capacity in index blocks: its published capacity in
    /// tokens at the measured bytes per token (else the configured one), or
    /// `default_worker_blocks` while unknown.
    pub(super) fn capacity_blocks(&self, w: &Worker) -> u64 {
        w.state
            .stats
            .kv_capacity_bytes(self.bytes_per_token as f64)
            .map_or(self.default_worker_blocks, |b| {
                (b / self.block_bytes as u64).max(1)
            })
    }

    fn record_impl(&self, d: &Decision, req: &RouteRequest<'_>, workers: &[Arc<Worker>]) {
        self.record_pending(d, req, workers);
        let Some(ix) = &self.index else { return };
        let (Some(&slot), Some(w)) = (self.slots.get(d.index), workers.get(d.index)) else {
            return;
        };
        let blocks = self.blocks(req);
        if slot == 0 || blocks.is_empty() {
            return;
        }
        let cap = self.capacity_blocks(w);
        ix.insert(slot, blocks, cap + cap / INDEX_SLACK_DIV);
    }

    /// The precise index counts the prompt as held on the chosen worker until
    /// its events can have told (`kv_events/pending.rs`).
    fn record_pending(&self, d: &Decision, req: &RouteRequest<'_>, workers: &[Arc<Worker>]) {
        let Some(p) = &self.precise else { return };
        let (Some(Some(slot)), Some(w)) = (p.slots.get(d.index), workers.get(d.index)) else {
            return;
        };
        let ttl = p.kv.pending_ttl_ms;
        let Some((keys, _)) = self.prompt_keys(p, req).filter(|_| ttl > 0) else {
            return;
        };
        let now = crate::pool::stats::now_ms();
        if !p.kv.index.note_pending(*slot, keys, now, now + ttl) {
            tracing::warn!(pool = %p.pool, worker = %w.id, "kv events: pending blocks full; decision not remembered");
            metrics::counter!(
                names::KV_BLOCKS_SKIPPED_TOTAL,
                names::L_POOL => p.pool.to_string(),
                names::L_WORKER => w.id.to_string(),
                names::L_REASON => "pending_full"
            )
            .increment(keys.len() as u64);
        }
    }

    fn estimate_cost_impl(&self, d: &Decision, req: &RouteRequest<'_>) -> Option<f64> {
        let price = *self.prices.get(d.index)?;
        if price <= 0.0 {
            return None;
        }
        let prompt =
            req.info.routing_text.as_ref().map_or(0, |t| t.len() as u64) / self.bytes_per_token;
        let tokens = prompt + req.info.max_tokens.unwrap_or(0);
        Some(price * tokens as f64 / 1e6)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::RequestInfo;
    use crate::config::{self, PoolConfig};
    use crate::pool::stats::now_ms;
    use crate::pool::stats::parse_metrics;
    use crate::pool::RequestSize;
    use crate::routing::Policy;
    use bytes::Bytes;

    fn pool(policy: &str, extra: &str) -> PoolConfig {
        let text = format!(
            "[[pools]]\nname=\"p\"\nmodels=[\"m\"]\npolicy=\"{policy}\"\nworkers=[{{url=\"http://w0:80\",price_per_mtok=3.0,labels={{region=\"eu\"}}}},{{url=\"http://w1:80\",price_per_mtok=1.0}},{{url=\"http://w2:80\",price_per_mtok=1.0}},{{url=\"http://w3:80\",price_per_mtok=2.0,labels={{region=\"eu\"}}}}]\n[pools.routing]\n{extra}\n"
        );
        config::first_pool(&text).unwrap()
    }

    struct Fixture {
        workers: Vec<Arc<Worker>>,
        /// The policy as `routing::build` makes it.
        policy: Box<dyn Policy>,
        /// The pipeline behind it (for `prefix`: the shared core).
        core: Pipeline,
    }

    fn fixture(policy: &str, extra: &str) -> Fixture {
        fixture_with(policy, extra, crate::routing::build)
    }

    /// A fixture whose pipeline `build` makes from the build context.
    fn fixture_with(
        policy: &str,
        extra: &str,
        build: impl FnOnce(&BuildContext<'_>) -> Box<dyn Policy>,
    ) -> Fixture {
        let pc = pool(policy, extra);
        let (workers, (policy, core)) =
            crate::routing::build_for_test(&pc, |ctx| (build(ctx), Pipeline::new(ctx)));
        Fixture {
            policy,
            core,
            workers,
        }
    }

    /// Give worker `i` a fresh scrape with `queue` running requests.
    fn set_queue(w: &Worker, queue: u64) {
        let text = format!("vllm:num_requests_running {queue}\n");
        w.state.stats.store(&parse_metrics(&text), now_ms());
    }

    fn chat(text: &str) -> RequestInfo {
        RequestInfo {
            routing_text: Some(Bytes::from(text.to_string())),
            ..Default::default()
        }
    }

    fn pick(f: &Fixture, info: &RequestInfo, session: Option<&str>) -> Decision {
        let req = RouteRequest::new(info, session);
        let d = f.policy.pick(&req, &f.workers, &|_| true).unwrap();
        f.policy.record(&d, &req, &f.workers);
        d
    }

    #[test]
    fn block_hashes_chain_and_drop_the_tail() {
        let a = hash_blocks(&[b'x'; 1000], 1, 256);
        assert_eq!(a.len(), 3);
        let mut t = vec![b'x'; 1000];
        t[600] = b'y';
        let b = hash_blocks(&t, 1, 256);
        assert_eq!(a[..2], b[..2]);
        assert_ne!(a[2], b[2]);
        assert_ne!(hash_blocks(&[b'x'; 1000], 2, 256)[0], a[0], "seed matters");
    }

    #[test]
    fn least_queue_prefers_the_shortest_queue_and_corrects_between_polls() {
        let f = fixture("least_queue", "");
        for (w, q) in f.workers.iter().zip([5, 2, 9, 7]) {
            set_queue(w, q);
        }
        let info = chat("hello");
        let d = pick(&f, &info, None);
        assert_eq!(d, Decision::new(1, Reason::LeastQueue));
        // A burst sent to w1 since the last scrape makes w0 the shortest.
        let _guards: Vec<_> = (0..4)
            .map(|_| f.workers[1].begin(None, RequestSize::default()))
            .collect();
        assert_eq!(pick(&f, &info, None).index, 0);
    }

    #[test]
    fn stale_worker_counts_as_loaded_not_idle() {
        let f = fixture("least_queue", "stats_interval_ms = 25\nstale_after_ms = 50");
        let t0 = 1_000;
        // w2 claims to be idle, but that was 100 ms ago.
        f.workers[2]
            .state
            .stats
            .store(&parse_metrics("vllm:num_requests_running 0\n"), t0);
        for (i, q) in [(0, 5), (1, 6), (3, 8)] {
            let text = format!("vllm:num_requests_running {q}\n");
            f.workers[i]
                .state
                .stats
                .store(&parse_metrics(&text), t0 + 100);
        }
        let info = RequestInfo::default();
        let req = RouteRequest::new(&info, None);
        let at = |now| {
            f.policy
                .pick_at(&req, &f.workers, &|_| true, now, &mut rand::thread_rng())
                .unwrap()
                .index
        };
        assert_eq!(at(t0 + 40), 2, "fresh and idle");
        assert_eq!(
            at(t0 + 101),
            0,
            "stale: as busy as the busiest fresh worker"
        );
        // When every worker is stale, the gateway's own counts still route.
        let _busy = f.workers[2].begin(None, RequestSize::default());
        let d = at(t0 + 1_000);
        assert_ne!(d, 2);
    }

    /// Late scrapes must not herd traffic onto the few workers whose scrape
    /// succeeded: a stale worker is as loaded as the busiest fresh one, not out.
    #[test]
    fn a_burst_spreads_when_most_stats_are_stale() {
        let f = fixture("least_queue", "stats_interval_ms = 25\nstale_after_ms = 50");
        let t0 = 1_000;
        for (i, w) in f.workers.iter().enumerate() {
            let at = if i == 0 { t0 + 100 } else { t0 };
            w.state
                .stats
                .store(&parse_metrics("vllm:num_requests_running 0\n"), at);
        }
        let mut guards = Vec::new();
        let mut per = [0; 4];
        for k in 0..8 {
            let info = chat(&format!("request {k}"));
            let req = RouteRequest::new(&info, None);
            let d = f
                .policy
                .pick_at(
                    &req,
                    &f.workers,
                    &|_| true,
                    t0 + 101,
                    &mut rand::thread_rng(),
                )
                .unwrap();
            per[d.index] += 1;
            guards.push(f.workers[d.index].begin(None, RequestSize::default()));
        }
        assert_eq!(per, [2, 2, 2, 2], "only w0 is fresh, yet the burst spreads");
    }

    /// A burst of requests between two scrapes spreads over the workers: each
    /// pick sees the requests the previous picks started.
    #[test]
    fn least_queue_spreads_a_burst_between_two_polls() {
        let f = fixture("least_queue", "");
        for w in &f.workers {
            set_queue(w, 0);
        }
        let mut guards = Vec::new();
        let mut per = [0; 4];
        for k in 0..12 {
            let info = chat(&format!("{k} {}", "x".repeat(4_000)));
            let d = pick(&f, &info, None);
            per[d.index] += 1;
            let size = RequestSize {
                bytes: 4_000,
                tokens: 1_000,
                prefill_tokens: 1_000,
            };
            guards.push(f.workers[d.index].begin(None, size));
        }
        assert_eq!(per, [3, 3, 3, 3]);
    }

    /// Requests that are decoding delay a new one far less than one waiting for
    /// its prefill: least_queue counts prefill work, not just requests.
    #[test]
    fn least_queue_prefers_decoding_requests_to_a_pending_prefill() {
        let f = fixture("least_queue", "");
        for w in &f.workers {
            set_queue(w, 0);
        }
        let prompt = RequestSize {
            bytes: 8_000,
            tokens: 2_000,
            prefill_tokens: 2_000,
        };
        let _waiting = [0, 2, 3].map(|i| f.workers[i].begin(None, prompt));
        // w1 runs three requests that have all produced their first token.
        let mut decoding: Vec<_> = (0..3).map(|_| f.workers[1].begin(None, prompt)).collect();
        decoding.iter_mut().for_each(|g| g.first_token());
        // w1 holds 4 requests, the others 1 each, but only w1 has no prefill queued.
        assert_eq!(pick(&f, &chat("next"), None).index, 1);
    }

    #[test]
    fn prefix_new_then_hit_then_spill() {
        let f = fixture("prefix", "block_tokens = 4");
        for w in &f.workers {
            set_queue(w, 0);
        }
        let system = "S".repeat(200);
        let a = chat(&format!("{system} question one"));
        let b = chat(&format!("{system} another question"));
        let d1 = pick(&f, &a, None);
        assert_eq!(d1.reason, Reason::NewPrefix);
        let d2 = pick(&f, &b, None);
        assert_eq!((d2.index, d2.reason), (d1.index, Reason::PrefixHit));
        // Overload the holder: the next request spills elsewhere and the prefix is
        // now replicated there.
        set_queue(&f.workers[d1.index], 50);
        let d3 = pick(&f, &b, None);
        assert_eq!(d3.reason, Reason::SpillOverload);
        assert_ne!(d3.index, d1.index);
        set_queue(&f.workers[d1.index], 0);
        set_queue(&f.workers[d3.index], 50);
        let d4 = pick(&f, &a, None);
        assert_eq!((d4.index, d4.reason), (d1.index, Reason::PrefixHit));
    }

    #[test]
    fn new_prefix_placement_is_the_same_on_every_replica() {
        // Two independent gateways (own indexes) place the same new prompt alike.
        let f1 = fixture("prefix", "");
        let f2 = fixture("prefix", "");
        let mut spread = std::collections::HashSet::new();
        for k in 0..40 {
            let info = chat(&format!("{k} {}", "p".repeat(2000)));
            let (a, b) = (pick(&f1, &info, None), pick(&f2, &info, None));
            assert_eq!(a, b);
            assert_eq!(a.reason, Reason::NewPrefix);
            spread.insert(a.index);
        }
        assert!(spread.len() >= 3, "new prefixes spread: {spread:?}");
    }

    /// New prefixes follow load when load differs: a worker with a prefill
    /// queued is not chosen while another has none.
    #[test]
    fn new_prefix_avoids_a_worker_with_prefill_queued() {
        let f1 = fixture("prefix", "");
        let f2 = fixture("prefix", "");
        for f in [&f1, &f2] {
            for w in &f.workers {
                set_queue(w, 0);
            }
        }
        let info = chat(&"n".repeat(3000));
        let first = pick(&f1, &info, None).index;
        // The first choice has a long prefill queued on f2: another worker takes it.
        let _busy = f2.workers[first].begin(
            None,
            RequestSize {
                bytes: 40_000,
                tokens: 10_000,
                prefill_tokens: 10_000,
            },
        );
        let d = pick(&f2, &info, None);
        assert_eq!(d.reason, Reason::NewPrefix);
        assert_ne!(d.index, first);
        // Once placed, the prefix stays there (a hit, not a new placement).
        assert_eq!(
            pick(&f2, &info, None),
            Decision::new(d.index, Reason::PrefixHit)
        );
    }

    /// Distinct prefixes spread over the workers' caches: a worker whose index
    /// is full does not take a new prefix while another has room (the way
    /// SGLang's cache_aware places new prompts on its smallest tree), so 16
    /// prompts over 4 workers with room for 4 each end up 4 per worker.
    #[test]
    fn new_prefixes_fill_the_caches_evenly() {
        // 4 prompts of 10 blocks (256 bytes) each fit a worker: room for 40
        // blocks = 10,240 bytes = 2,560 tokens at 4 bytes per token.
        let f = fixture("prefix", "");
        let cap = "vllm:num_requests_running 0\nvllm:cache_config_info{num_gpu_blocks=\"170\",block_size=\"16\"} 1\n";
        for w in &f.workers {
            w.state.stats.store(&parse_metrics(cap), now_ms());
        }
        let mut per = [0; 4];
        for k in 0..16 {
            let text = format!("{k:04}{}", "p".repeat(10 * 256 - 4));
            let d = pick(&f, &chat(&text), None);
            assert_eq!(d.reason, Reason::NewPrefix);
            per[d.index] += 1;
        }
        assert_eq!(per, [4, 4, 4, 4]);
    }

    /// A holder over the load bound (in requests) keeps its prefix while its
    /// requests are cheap there: replicating a long prompt costs a whole prefill.
    #[test]
    fn a_busy_holder_keeps_cheap_hits() {
        let f = fixture("prefix", "");
        for w in &f.workers {
            set_queue(w, 0);
        }
        let long = format!("{} question", "d".repeat(12_000));
        let first = pick(&f, &chat(&long), None).index;
        // Five requests decoding on the holder, none elsewhere: over the bound
        // (1.25 × 1.25 + 2), but 80 tokens of wait against a 3,000-token prefill.
        set_queue(&f.workers[first], 5);
        assert_eq!(
            pick(&f, &chat(&long), None),
            Decision::new(first, Reason::PrefixHit)
        );
    }

    /// Without a capacity limit, distinct prefixes still spread within the
    /// footprint bound ((1 + ε) × mean, ε = 0.25): 32 equal prefixes over 4
    /// workers, at most 10 on any.
    #[test]
    fn new_prefixes_keep_footprints_within_the_bound() {
        let f = fixture("prefix", "");
        for w in &f.workers {
            set_queue(w, 0);
        }
        let mut per = [0; 4];
        for k in 0..32 {
            let text = format!("{k:04}{}", "q".repeat(10 * 256 - 4));
            let d = pick(&f, &chat(&text), None);
            assert_eq!(d.reason, Reason::NewPrefix);
            per[d.index] += 1;
        }
        assert!(per.iter().all(|&n| n <= 10), "{per:?}");
    }

    /// The index's capacity follows the engine's capacity at the measured bytes
    /// per token: text that tokenises at 8 bytes per token fits twice the blocks
    /// the configured 4 would allow, so the index does not forget prompts the
    /// engine still holds.
    #[test]
    fn index_capacity_uses_the_measured_bytes_per_token() {
        let f = fixture("prefix", "");
        let w = &f.workers[0];
        let scrape = |tokens: u64| {
            let text = format!("vllm:num_requests_running 0\nvllm:prompt_tokens_total {tokens}\nvllm:cache_config_info{{num_gpu_blocks=\"64\",block_size=\"16\"}} 1\n");
            let mark = w.state.stats.mark();
            w.state
                .stats
                .store_marked(&parse_metrics(&text), now_ms(), mark);
        };
        scrape(1);
        // 1,024 KV tokens at 4 bytes per token: 16 blocks of 256 bytes.
        assert_eq!(f.core.capacity_blocks(w), 16);
        let mut g = w.begin(
            None,
            RequestSize {
                bytes: 8 * 16_384,
                tokens: 16_384,
                prefill_tokens: 16_384,
            },
        );
        g.first_token();
        drop(g);
        scrape(16_385);
        assert_eq!(w.state.stats.bytes_per_token(), Some(8.0));
        assert_eq!(f.core.capacity_blocks(w), 32);
    }

    #[test]
    fn cost_prefers_cheap_until_saturated() {
        let f = fixture("cost", "target_queue = 4");
        for w in &f.workers {
            set_queue(w, 0);
        }
        let info = RequestInfo {
            max_tokens: Some(1000),
            ..chat(&"x".repeat(4000))
        };
        let d = pick(&f, &info, None);
        assert!(d.index == 1 || d.index == 2);
        assert_eq!(d.reason, Reason::Cheapest);
        let req = RouteRequest::new(&info, None);
        let cost = f.policy.estimate_cost(&d, &req).unwrap();
        assert!((cost - 1.0 * 2000.0 / 1e6).abs() < 1e-12, "{cost}");
        set_queue(&f.workers[1], 4);
        set_queue(&f.workers[2], 5);
        let d = pick(&f, &info, None);
        assert_eq!((d.index, d.reason), (3, Reason::SpillOverload));
        set_queue(&f.workers[0], 9);
        set_queue(&f.workers[3], 9);
        // Nobody has headroom: the least loaded.
        assert_eq!(pick(&f, &info, None).index, 1);
    }

    #[test]
    fn session_is_sticky_and_moves_only_with_its_worker() {
        let f = fixture("session", "");
        for w in &f.workers {
            set_queue(w, 0);
        }
        let info = chat("hi");
        let d = pick(&f, &info, Some("alice"));
        assert_eq!(d.reason, Reason::Session);
        for _ in 0..5 {
            assert_eq!(pick(&f, &info, Some("alice")), d);
        }
        // The `user` field works too.
        let by_user = RequestInfo {
            user: Some("alice".into()),
            ..chat("hi")
        };
        assert_eq!(pick(&f, &by_user, None).index, d.index);
        // Refusing the owner moves the session; refusing another does not.
        let req = RouteRequest::new(&info, Some("alice"));
        let other = (d.index + 1) % 4;
        assert_eq!(
            f.policy
                .pick(&req, &f.workers, &|i| i != other)
                .unwrap()
                .index,
            d.index
        );
        assert_ne!(
            f.policy
                .pick(&req, &f.workers, &|i| i != d.index)
                .unwrap()
                .index,
            d.index
        );
        // No session key: least queue.
        set_queue(&f.workers[2], 0);
        for (i, w) in f.workers.iter().enumerate() {
            set_queue(w, if i == 2 { 0 } else { 3 });
        }
        assert_eq!(pick(&f, &info, None), Decision::new(2, Reason::LeastQueue));
    }

    #[test]
    fn label_filter_and_weighted_scorers() {
        let f = fixture(
            "weighted",
            "require_labels = { region = \"eu\" }\nscorers = [{ name = \"queue\", weight = 1.0 }, { name = \"kv\", weight = 0.5 }]",
        );
        for w in &f.workers {
            set_queue(w, 0);
        }
        for _ in 0..20 {
            let d = pick(&f, &chat("x"), None);
            assert!(d.index == 0 || d.index == 3, "{d:?}");
        }
        f.workers[0].state.stats.store(
            &parse_metrics("vllm:num_requests_running 1\nvllm:kv_cache_usage_perc 0.9\n"),
            now_ms(),
        );
        assert_eq!(
            pick(&f, &chat("x"), None),
            Decision::new(3, Reason::LeastQueue)
        );
        assert!(f
            .policy
            .pick(&RouteRequest::new(&chat("x"), None), &f.workers, &|i| i
                == 1)
            .is_none());
    }

    #[test]
    fn power_of_two_never_picks_the_worse_of_the_pair() {
        let f = fixture("least_queue", "power_of_two = true");
        for (w, q) in f.workers.iter().zip([0, 10, 20, 30]) {
            set_queue(w, q);
        }
        let mut seen = [0; 4];
        for _ in 0..200 {
            seen[pick(&f, &chat("x"), None).index] += 1;
        }
        assert_eq!(
            seen[3], 0,
            "the most loaded is worse than any partner: {seen:?}"
        );
        assert!(seen[0] > 0 && seen[1] > 0);
    }

    /// docs/architecture.md, "How to add a scorer": the toy scorer written as
    /// step 1 says (`scorers/last.rs`), tried as step 4 says, steers the pick.
    #[test]
    fn a_scorer_added_the_documented_way_steers_the_pick() {
        // Step 2 registered `last` (test builds only); step 3 names it in a pool.
        let plain = fixture(
            "weighted",
            r#"scorers = [{ name = "queue", weight = 1.0 }]"#,
        );
        let toy = fixture(
            "weighted",
            r#"scorers = [{ name = "queue", weight = 1.0 }, { name = "last", weight = 2.0 }]"#,
        );
        for f in [&plain, &toy] {
            for w in &f.workers {
                set_queue(w, 0);
            }
        }
        let mut plain_picks = std::collections::HashSet::new();
        for k in 0..20 {
            let info = chat(&format!("request {k}"));
            plain_picks.insert(pick(&plain, &info, None).index);
            assert_eq!(
                pick(&toy, &info, None),
                Decision::new(3, Reason::LeastQueue)
            );
        }
        assert!(plain_picks.len() > 1, "without it: {plain_picks:?}");
        // Its weight is weighed against the others': a loaded last worker loses.
        set_queue(&toy.workers[3], 40);
        assert_ne!(pick(&toy, &chat("x"), None).index, 3);
    }

    /// The doc shows the tested toy scorer verbatim.
    #[test]
    fn the_documented_scorer_is_the_tested_one() {
        let doc = include_str!("../../docs/architecture.md");
        let file = include_str!("scorers/last.rs");
        assert!(doc.contains(&format!("```rust\n{file}```")));
    }
}
