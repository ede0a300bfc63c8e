//! The engine task: a continuous-batching scheduler after vLLM's V1 scheduler
//! (waiting queue, running batch, chunked prefill, prefix cache, preemption),
//! with a step time that grows with the batch and the uncached prefill tokens.
//!
//! One task per simulated engine runs the step loop; requests talk to it over
//! channels. An idle engine sleeps in `recv`, it never spins.

use std::collections::VecDeque;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::sync::mpsc;
use tokio::time::Instant;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::kv::{self, CacheEvent, KvCache};
use super::metrics::Stats;
use super::tokenizer::token_id;
use super::SimConfig;

/// Why a sequence finished, as in the OpenAI `finish_reason`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    Stop,
    Length,
}

impl Finish {
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
        }
    }
}

/// What the engine tells one request. `index` is the sequence's
/// [`Submit::index`] (the choice index when a request samples several).
#[derive(Debug)]
pub enum Event {
    /// One generated token: an index into [`vocab`], or `None` for the next
    /// token of the sequence's [`Submit::script`]. `finish` is set on the last
    /// one, which is followed by `Done`.
    Token {
        index: u32,
        tok: Option<u16>,
        finish: Option<Finish>,
    },
    /// The sequence is complete.
    Done {
        index: u32,
        reason: Finish,
        prompt_tokens: usize,
        completion_tokens: usize,
        cached_tokens: usize,
        /// KV block ids of the prompt (only when `want_blocks`).
        blocks: Vec<u32>,
    },
    /// The engine could not run the request.
    Failed(String),
}

/// KV for the prompt arrives from a remote prefill engine (P/D decode side).
#[derive(Clone, Copy, Debug)]
pub struct Remote {
    /// Extra simulated milliseconds before the transfer can start (e.g. the
    /// peer's prefill time when both are sent at once, SGLang style).
    pub extra_ms: f64,
}

/// One sequence for the engine. A request that samples several choices
/// (`n`, `best_of`) submits one per choice, with the same prompt and indices
/// 0, 1, ..., as vLLM V1 fans parallel sampling out into child requests.
#[derive(Debug)]
pub struct Submit {
    pub tokens: Vec<u32>,
    /// Already checked: prompt + max_tokens <= max_model_len.
    pub max_tokens: usize,
    pub ignore_eos: bool,
    /// Choice index: echoed in events, and mixed into the sampling seed so
    /// sibling choices differ (index 0 samples as a lone request would).
    pub index: u32,
    /// Output fixed in advance (e.g. a tool call's arguments): emitted token by
    /// token, then the sequence stops, unless `max_tokens` cuts it first.
    pub script: Option<Arc<[u32]>>,
    /// One of several choices sampled from this prompt: its full prompt blocks
    /// enter the prefix cache as soon as they are scheduled (vLLM V1 caches
    /// blocks at allocation), so siblings admitted with it reuse them instead
    /// of prefilling the prompt again.
    pub parallel: bool,
    pub salt: Option<String>,
    pub remote: Option<Remote>,
    pub want_blocks: bool,
    pub arrived: Instant,
    pub events: mpsc::UnboundedSender<Event>,
}

/// The generated-text vocabulary: every entry is a single token under the
/// sim tokenizer, so generated text re-tokenizes to the same ids.
pub struct Vocab {
    pub text: Vec<String>,
    pub ids: Vec<u32>,
    words: usize,
}

const WORDS: &[&str] = &[
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by",
    "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an",
    "had", "they", "you", "were", "their", "one", "all", "we", "can", "her", "has", "there",
    "been", "if", "more", "when", "will", "would", "who", "so", "no", "model", "token", "cache",
    "batch", "route", "queue", "fast", "small", "large", "data", "time", "work", "world", "light",
    "water", "river", "stone", "green", "early", "later", "often", "since", "under", "while",
];

/// The shared vocabulary: for each word `" w"`, `"W"` and `" W"`, then `","` and `"."`.
pub fn vocab() -> &'static Vocab {
    static V: OnceLock<Vocab> = OnceLock::new();
    V.get_or_init(|| {
        let mut text = Vec::new();
        for w in WORDS {
            let mut cap = w.to_string();
            cap[..1].make_ascii_uppercase();
            text.push(format!(" {w}"));
            text.push(cap.clone());
            text.push(format!(" {cap}"));
        }
        text.push(",".into());
        text.push(".".into());
        let ids = text.iter().map(|t| token_id(t)).collect();
        Vocab {
            text,
            ids,
            words: WORDS.len(),
        }
    })
}

impl Vocab {
    fn word(&self, i: usize, form: usize) -> u16 {
        (i * 3 + form) as u16
    }
    fn comma(&self) -> u16 {
        (self.words * 3) as u16
    }
    fn period(&self) -> u16 {
        (self.words * 3 + 1) as u16
    }
}

/// Engine parameters (a copy of the relevant [`SimConfig`] fields).
#[derive(Clone, Debug)]
pub struct Params {
    pub model: String,
    pub seed: u64,
    pub time_scale: f64,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub block_size: usize,
    pub num_blocks: usize,
    pub max_model_len: usize,
    pub prefix_caching: bool,
    pub preemption: bool,
    pub step_base_ms: f64,
    pub per_seq_ms: f64,
    pub per_prefill_token_ms: f64,
    pub kv_transfer_base_ms: f64,
    pub kv_transfer_per_token_ms: f64,
    pub cpu_offload_blocks: usize,
    pub cpu_load_per_token_ms: f64,
    pub mean_output_tokens: f64,
}

impl Params {
    pub fn from_config(c: &SimConfig) -> Self {
        Params {
            model: c.model.clone(),
            seed: c.seed,
            time_scale: c.time_scale,
            max_num_seqs: c.max_num_seqs,
            max_num_batched_tokens: c.max_num_batched_tokens,
            block_size: c.block_size,
            num_blocks: c.num_blocks,
            max_model_len: c.max_model_len,
            prefix_caching: c.enable_prefix_caching,
            preemption: c.preemption,
            step_base_ms: c.step_base_ms,
            per_seq_ms: c.per_seq_ms,
            per_prefill_token_ms: c.per_prefill_token_ms,
            kv_transfer_base_ms: c.kv_transfer_base_ms,
            kv_transfer_per_token_ms: c.kv_transfer_per_token_ms,
            cpu_offload_blocks: c.cpu_offload_blocks,
            cpu_load_per_token_ms: c.cpu_load_per_token_ms,
            mean_output_tokens: c.mean_output_tokens as f64,
        }
    }

    /// Wall-clock duration of `ms` simulated milliseconds.
    pub fn real(&self, ms: f64) -> Duration {
        Duration::from_secs_f64((ms / self.time_scale).max(0.0) / 1000.0)
    }
}

struct Seq {
    index: u32,
    script: Option<Arc<[u32]>>,
    parallel: bool,
    tokens: Vec<u32>,
    prompt_len: usize,
    max_tokens: usize,
    eos_len: Option<usize>,
    computed: usize,
    scheduled: usize,
    blocks: Vec<u32>,
    hashes: Vec<u64>,
    root: u64,
    /// Its blocks are salted (`cache_salt`).
    salted: bool,
    rng: SmallRng,
    sentence_start: bool,
    comma_ok: bool,
    arrived: Instant,
    last_token_at: Option<Instant>,
    cached_tokens: usize,
    admitted_once: bool,
    remote: Option<Remote>,
    ready_at: Option<Instant>,
    want_blocks: bool,
    events: mpsc::UnboundedSender<Event>,
}

impl Seq {
    fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }
    fn transferring(&self, now: Instant) -> bool {
        self.ready_at.is_some_and(|t| t > now)
    }
    /// Blocks needed for the longest this sequence can get.
    fn max_len(&self, max_model_len: usize) -> usize {
        (self.prompt_len + self.max_tokens).min(max_model_len)
    }
    /// The next output token: its [`vocab`] index (`None` when scripted) and id.
    fn next_token(&mut self) -> (Option<u16>, u32) {
        if let Some(script) = &self.script {
            if let Some(&id) = script.get(self.generated()) {
                return (None, id);
            }
        }
        let tok = self.sample();
        (Some(tok), vocab().ids[tok as usize])
    }

    /// Sample the next output token.
    fn sample(&mut self) -> u16 {
        let v = vocab();
        let first = self.generated() == 0;
        if self.sentence_start {
            self.sentence_start = false;
            self.comma_ok = true;
            let w = self.rng.gen_range(0..v.words);
            return v.word(w, if first { 1 } else { 2 });
        }
        let r: f64 = self.rng.gen();
        if r < 0.07 {
            self.sentence_start = true;
            return v.period();
        }
        if r < 0.14 && self.comma_ok {
            self.comma_ok = false;
            return v.comma();
        }
        self.comma_ok = true;
        v.word(self.rng.gen_range(0..v.words), 0)
    }
}

fn blocks_for(tokens: usize, bs: usize) -> usize {
    tokens.div_ceil(bs)
}

/// For a parallel-sampling sequence, enter the full prompt blocks this step
/// computes into the prefix cache now rather than when the step ends, so a
/// sibling admitted in the same step finds them (vLLM V1 caches at allocation).
fn cache_ahead(kv: &mut KvCache, s: &Seq, bs: usize) {
    if !s.parallel {
        return;
    }
    let upto = (s.computed + s.scheduled).min(s.prompt_len) / bs;
    for b in s.computed / bs..upto {
        commit(kv, s, b, bs);
    }
}

/// Enter sequence `s`'s full block `b` into the prefix cache (recorded as
/// stored, with its parent and tokens, when the engine publishes KV events).
fn commit(kv: &mut KvCache, s: &Seq, b: usize, bs: usize) {
    if let (Some(&blk), Some(&h)) = (s.blocks.get(b), s.hashes.get(b)) {
        let parent = b.checked_sub(1).and_then(|p| s.hashes.get(p).copied());
        let tokens = &s.tokens[b * bs..(b + 1) * bs];
        kv.commit_block(blk, h, parent, tokens, s.salted);
    }
}

/// A waiting sequence's cached prefix: the GPU blocks holding its start, and
/// the block indexes after them that the CPU tier holds (loaded back, not
/// computed; none for a remote prefill, whose KV arrives whole). Never the block
/// holding the last prompt token: at least one token is computed.
fn cached_prefix(kv: &KvCache, s: &Seq, bs: usize) -> (Vec<u32>, std::ops::Range<usize>) {
    let max_hit = (s.tokens.len() - 1) / bs;
    let hit = kv.lookup(&s.hashes, max_hit);
    let g = hit.len();
    if s.remote.is_some() {
        return (hit, g..g);
    }
    let end = max_hit.min(s.hashes.len());
    let cpu = kv.cpu_run(&s.hashes[g.min(end)..end]);
    (hit, g..g + cpu)
}

/// The scheduler state of one engine.
pub struct Engine {
    p: Params,
    kv: KvCache,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    rx: mpsc::Receiver<Submit>,
    stats: Arc<Stats>,
    deadline: Instant,
    /// Where the KV events of each step go, when the engine publishes them.
    kv_events: Option<mpsc::Sender<Vec<CacheEvent>>>,
}

impl Engine {
    pub fn new(p: Params, rx: mpsc::Receiver<Submit>, stats: Arc<Stats>) -> Self {
        let kv = KvCache::new(p.num_blocks, p.block_size, p.prefix_caching)
            .with_cpu_offload(p.cpu_offload_blocks);
        Engine {
            p,
            kv,
            waiting: VecDeque::new(),
            running: Vec::new(),
            rx,
            stats,
            deadline: Instant::now(),
            kv_events: None,
        }
    }

    /// Publish the prefix cache's events to `tx` (one batch per step).
    pub fn with_kv_events(mut self, tx: mpsc::Sender<Vec<CacheEvent>>) -> Self {
        self.kv.record_events();
        self.kv_events = Some(tx);
        self
    }

    /// Hand the step's KV events to the publisher (dropped, with a log line, if
    /// it has fallen a whole queue behind).
    fn flush_kv_events(&mut self) {
        let Some(tx) = &self.kv_events else { return };
        let events = self.kv.take_events();
        if events.is_empty() {
            return;
        }
        match tx.try_send(events) {
            Ok(()) => {
                self.stats.kv_event_batches.fetch_add(1, Relaxed);
            }
            Err(_) => tracing::warn!("sim: KV event publisher behind; events dropped"),
        }
    }

    fn admit(&mut self, s: Submit) {
        let root = kv::root_hash(&self.p.model, s.salt.as_deref());
        let salted = s.salt.is_some();
        let mut key = Vec::with_capacity(s.tokens.len() * 4);
        for t in &s.tokens {
            key.extend_from_slice(&t.to_le_bytes());
        }
        // Choice 0 keeps the request's own seed; siblings get distinct ones.
        let seed = self.p.seed ^ u64::from(s.index).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let mut rng = SmallRng::seed_from_u64(xxh3_64_with_seed(&key, seed));
        let eos_len = if let Some(script) = &s.script {
            Some(script.len())
        } else if s.ignore_eos {
            None
        } else {
            let u: f64 = rng.gen_range(f64::EPSILON..1.0);
            Some(1 + (-u.ln() * self.p.mean_output_tokens) as usize)
        };
        let mut hashes = Vec::new();
        kv::extend_hashes(root, &mut hashes, &s.tokens, self.p.block_size);
        let prompt_len = s.tokens.len();
        self.waiting.push_back(Seq {
            index: s.index,
            script: s.script,
            parallel: s.parallel,
            tokens: s.tokens,
            prompt_len,
            max_tokens: s.max_tokens,
            eos_len,
            computed: 0,
            scheduled: 0,
            blocks: Vec::new(),
            hashes,
            root,
            salted,
            rng,
            sentence_start: true,
            comma_ok: true,
            arrived: s.arrived,
            last_token_at: None,
            cached_tokens: 0,
            admitted_once: false,
            remote: s.remote,
            ready_at: None,
            want_blocks: s.want_blocks,
            events: s.events,
        });
    }

    /// Blocks the running sequences may still need (only without preemption,
    /// where admission reserves a sequence's whole length up front).
    fn reserved(&self) -> usize {
        if self.p.preemption {
            return 0;
        }
        let bs = self.p.block_size;
        self.running
            .iter()
            .map(|s| blocks_for(s.max_len(self.p.max_model_len), bs).saturating_sub(s.blocks.len()))
            .sum()
    }

    fn preempt_last(&mut self) {
        if let Some(mut s) = self.running.pop() {
            self.kv.release(&s.blocks);
            s.blocks.clear();
            s.computed = 0;
            s.scheduled = 0;
            s.ready_at = None;
            s.remote = None;
            self.stats.preemptions.fetch_add(1, Relaxed);
            self.waiting.push_front(s);
        }
    }

    fn abort(&mut self, s: Seq) {
        self.kv.release(&s.blocks);
        self.stats.finished_abort.fetch_add(1, Relaxed);
    }

    /// Decide this step's work: returns (sequences, uncached prefill tokens).
    fn schedule(&mut self, now: Instant) -> (usize, usize) {
        let bs = self.p.block_size;
        let mut budget = self.p.max_num_batched_tokens;
        let mut preempted = false;
        let (mut seqs, mut prefill) = (0, 0);

        // Drop running sequences whose client went away.
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].events.is_closed() {
                let s = self.running.remove(i);
                self.abort(s);
            } else {
                i += 1;
            }
        }

        // 1. Running sequences, oldest first.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            if self.running[i].transferring(now) {
                i += 1;
                continue;
            }
            let s = &self.running[i];
            let n = (s.tokens.len() - s.computed).min(budget);
            let need = blocks_for(s.computed + n, bs).saturating_sub(s.blocks.len());
            let mut ok = true;
            while need > self.kv.free_blocks() {
                if self.p.preemption && self.running.len() > i + 1 {
                    self.preempt_last();
                    preempted = true;
                } else {
                    ok = false;
                    break;
                }
            }
            if !ok {
                if self.p.preemption {
                    // Lowest priority itself: back to the waiting queue.
                    self.preempt_last();
                    preempted = true;
                }
                break;
            }
            if let Some(new) = self.kv.allocate(need) {
                let s = &mut self.running[i];
                s.blocks.extend(new);
                if s.computed < s.tokens.len() - 1 {
                    prefill += n;
                }
                s.scheduled = n;
                cache_ahead(&mut self.kv, s, bs);
                budget -= n;
                seqs += 1;
            }
            i += 1;
        }

        // 2. Waiting sequences, FCFS, while the batch and the KV cache allow.
        while !preempted && budget > 0 && self.running.len() < self.p.max_num_seqs {
            let Some(s) = self.waiting.front() else { break };
            if s.events.is_closed() {
                if let Some(s) = self.waiting.pop_front() {
                    self.abort(s);
                }
                continue;
            }
            let transfer = s.remote.is_some();
            let (hit, on_cpu) = cached_prefix(&self.kv, s, bs);
            let hit_tokens = (hit.len() + on_cpu.len()) * bs;
            let remote_tokens = if transfer { s.prompt_len - 1 } else { 0 };
            let computed = hit_tokens.max(remote_tokens);
            let load = !on_cpu.is_empty();
            let n = if transfer || load {
                0
            } else {
                (s.tokens.len() - computed).min(budget)
            };
            // With a remote transfer, hold blocks for the whole prompt now.
            let held = if transfer {
                s.tokens.len()
            } else {
                computed + n
            };
            let need = blocks_for(held, bs) - hit.len();
            let ok = if self.p.preemption {
                self.kv.can_take(&hit, need)
            } else {
                let whole = blocks_for(s.max_len(self.p.max_model_len), bs) - hit.len();
                self.kv.can_take(&hit, whole + self.reserved())
            };
            if !ok {
                break;
            }
            let Some(mut s) = self.waiting.pop_front() else {
                break;
            };
            self.kv.touch(&hit);
            self.kv.cpu_touch(&s.hashes[on_cpu.clone()]);
            let mut blocks = hit;
            blocks.extend(self.kv.allocate(need).unwrap_or_default());
            s.blocks = blocks;
            s.computed = computed;
            // The loaded blocks are on the GPU again.
            for b in on_cpu.clone() {
                commit(&mut self.kv, &s, b, bs);
            }
            if !s.admitted_once {
                s.admitted_once = true;
                s.cached_tokens = hit_tokens;
                self.stats
                    .prefix_queries
                    .fetch_add(s.prompt_len as u64, Relaxed);
                // Local (GPU) hits; what the CPU tier adds counts as external,
                // as vLLM counts a KV connector's.
                let cpu_tokens = (on_cpu.len() * bs) as u64;
                let gpu_tokens = hit_tokens as u64 - cpu_tokens;
                self.stats.prefix_hits.fetch_add(gpu_tokens, Relaxed);
                if self.stats.offload {
                    self.stats
                        .external_queries
                        .fetch_add(s.prompt_len as u64 - gpu_tokens, Relaxed);
                    self.stats.external_hits.fetch_add(cpu_tokens, Relaxed);
                }
                self.stats
                    .prompt_tokens
                    .fetch_add(s.prompt_len as u64, Relaxed);
            }
            if let Some(r) = s.remote {
                let tokens = remote_tokens.saturating_sub(hit_tokens) as f64;
                let ms = r.extra_ms
                    + self.p.kv_transfer_base_ms
                    + self.p.kv_transfer_per_token_ms * tokens;
                s.ready_at = Some(now + self.p.real(ms));
                s.remote = None;
            } else if load {
                let ms = self.p.cpu_load_per_token_ms * (on_cpu.len() * bs) as f64;
                s.ready_at = Some(now + self.p.real(ms));
            } else {
                if s.computed < s.tokens.len() - 1 {
                    prefill += n;
                }
                s.scheduled = n;
                cache_ahead(&mut self.kv, &s, bs);
                budget -= n;
                seqs += 1;
            }
            self.running.push(s);
        }
        (seqs, prefill)
    }

    /// Apply a finished step: advance sequences, emit tokens, finish.
    fn complete(&mut self, now: Instant) -> usize {
        let bs = self.p.block_size;
        let mut emitted = 0;
        let mut i = 0;
        while i < self.running.len() {
            let s = &mut self.running[i];
            if s.scheduled == 0 {
                i += 1;
                continue;
            }
            let before = s.computed / bs;
            s.computed += s.scheduled;
            s.scheduled = 0;
            kv::extend_hashes(s.root, &mut s.hashes, &s.tokens[..s.computed], bs);
            for b in before..s.computed / bs {
                commit(&mut self.kv, s, b, bs);
            }
            if s.computed < s.tokens.len() {
                i += 1;
                continue; // chunked prefill in progress
            }
            let (tok, id) = s.next_token();
            s.tokens.push(id);
            emitted += 1;
            let gen = s.generated();
            match s.last_token_at {
                None => self.stats.ttft.observe((now - s.arrived).as_secs_f64()),
                Some(t) => self.stats.itl.observe((now - t).as_secs_f64()),
            }
            s.last_token_at = Some(now);
            self.stats.generation_tokens.fetch_add(1, Relaxed);
            let reason = if s.eos_len.is_some_and(|e| gen >= e) && gen < s.max_tokens {
                Some(Finish::Stop)
            } else if gen >= s.max_tokens || s.tokens.len() >= self.p.max_model_len {
                Some(Finish::Length)
            } else {
                None
            };
            if s.events
                .send(Event::Token {
                    index: s.index,
                    tok,
                    finish: reason,
                })
                .is_err()
            {
                let s = self.running.remove(i);
                self.abort(s);
                continue;
            }
            let Some(reason) = reason else {
                i += 1;
                continue;
            };
            let s = self.running.remove(i);
            let prompt_blocks = blocks_for(s.prompt_len, bs).min(s.blocks.len());
            let _ = s.events.send(Event::Done {
                index: s.index,
                reason,
                prompt_tokens: s.prompt_len,
                completion_tokens: s.generated(),
                cached_tokens: s.cached_tokens,
                blocks: if s.want_blocks {
                    s.blocks[..prompt_blocks].to_vec()
                } else {
                    Vec::new()
                },
            });
            match reason {
                Finish::Stop => self.stats.finished_stop.fetch_add(1, Relaxed),
                Finish::Length => self.stats.finished_length.fetch_add(1, Relaxed),
            };
            self.stats.e2e.observe((now - s.arrived).as_secs_f64());
            self.kv.release(&s.blocks);
        }
        emitted
    }

    fn publish(&mut self, now: Instant) {
        self.flush_kv_events();
        let transferring = self.running.iter().filter(|s| s.transferring(now)).count();
        self.stats
            .running
            .store((self.running.len() - transferring) as u64, Relaxed);
        self.stats
            .waiting
            .store((self.waiting.len() + transferring) as u64, Relaxed);
        self.stats
            .kv_used_blocks
            .store(self.kv.used_blocks() as u64, Relaxed);
    }

    /// Run until every request sender is gone.
    pub async fn run(mut self) {
        loop {
            if self.running.is_empty() && self.waiting.is_empty() {
                self.publish(Instant::now());
                match self.rx.recv().await {
                    Some(s) => self.admit(s),
                    None => return,
                }
            }
            while let Ok(s) = self.rx.try_recv() {
                self.admit(s);
            }
            let now = Instant::now();
            let (seqs, prefill) = self.schedule(now);
            self.publish(now);
            if seqs == 0 {
                if self.running.is_empty() {
                    // Nothing runs and the head of the queue cannot start:
                    // it can never fit, so fail it rather than stall.
                    if let Some(s) = self.waiting.pop_front() {
                        let _ = s
                            .events
                            .send(Event::Failed("request does not fit in the KV cache".into()));
                        self.abort(s);
                    }
                    continue;
                }
                // Only transfers in flight (or a stall): wait for the next
                // transfer to land or a new request.
                let wake = self
                    .running
                    .iter()
                    .filter_map(|s| s.ready_at)
                    .filter(|&t| t > now)
                    .min();
                match wake {
                    Some(t) => {
                        tokio::select! {
                            _ = tokio::time::sleep_until(t) => {}
                            m = self.rx.recv() => match m {
                                Some(s) => self.admit(s),
                                None => return,
                            },
                        }
                    }
                    None => match self.rx.recv().await {
                        Some(s) => self.admit(s),
                        None => return,
                    },
                }
                continue;
            }
            let ms = self.p.step_base_ms
                + self.p.per_seq_ms * seqs as f64
                + self.p.per_prefill_token_ms * prefill as f64;
            let dur = self.p.real(ms);
            // Keep an accurate average step time despite the timer's 1 ms
            // granularity: chain deadlines while the engine stays busy.
            let base = if self.deadline + Duration::from_millis(2) < now {
                now
            } else {
                self.deadline
            };
            self.deadline = base + dur;
            tokio::time::sleep_until(self.deadline).await;
            let done_at = Instant::now();
            let emitted = self.complete(done_at);
            self.flush_kv_events();
            let tput = if ms > 0.0 {
                emitted as f64 / (ms / 1000.0)
            } else {
                0.0
            };
            self.stats
                .gen_throughput_bits
                .store(tput.to_bits(), Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::tokenizer;

    #[test]
    fn vocabulary_entries_are_single_tokens() {
        let v = vocab();
        for t in &v.text {
            assert_eq!(tokenizer::pieces(t), vec![t.as_str()], "{t:?}");
        }
    }

    fn params() -> Params {
        Params::from_config(&SimConfig {
            time_scale: 1.0,
            step_base_ms: 10.0,
            per_seq_ms: 0.0,
            per_prefill_token_ms: 1.0,
            block_size: 4,
            num_blocks: 64,
            max_model_len: 256,
            max_num_batched_tokens: 64,
            max_num_seqs: 4,
            ..SimConfig::default()
        })
    }

    async fn collect(mut rx: mpsc::UnboundedReceiver<Event>) -> (Vec<u16>, Option<Event>) {
        let mut toks = Vec::new();
        while let Some(e) = rx.recv().await {
            match e {
                Event::Token { tok, .. } => toks.push(tok.expect("sampled token")),
                other => return (toks, Some(other)),
            }
        }
        (toks, None)
    }

    fn submit(
        tx: &mpsc::Sender<Submit>,
        tokens: Vec<u32>,
        max: usize,
    ) -> mpsc::UnboundedReceiver<Event> {
        let (etx, erx) = mpsc::unbounded_channel();
        tx.try_send(Submit {
            tokens,
            max_tokens: max,
            ignore_eos: true,
            index: 0,
            script: None,
            parallel: false,
            salt: None,
            remote: None,
            want_blocks: false,
            arrived: Instant::now(),
            events: etx,
        })
        .unwrap();
        erx
    }

    #[tokio::test(start_paused = true)]
    async fn prefill_time_and_prefix_hit() {
        let (tx, rx) = mpsc::channel(16);
        let stats = Arc::new(Stats::new(64, 4));
        tokio::spawn(Engine::new(params(), rx, stats.clone()).run());
        let prompt: Vec<u32> = (0..41).collect();

        let t0 = Instant::now();
        let (toks, done) = collect(submit(&tx, prompt.clone(), 3)).await;
        assert_eq!(toks.len(), 3);
        // prefill: 10 + 41 tokens (chunk of 64) = 51 ms, then 2 decode steps.
        assert_eq!(Instant::now() - t0, Duration::from_millis(51 + 20));
        assert!(matches!(
            done,
            Some(Event::Done {
                cached_tokens: 0,
                reason: Finish::Length,
                ..
            })
        ));

        let t1 = Instant::now();
        let (_, done) = collect(submit(&tx, prompt.clone(), 1)).await;
        // 40 of 41 tokens are cached (10 full blocks); 1 token left to prefill.
        assert!(
            matches!(
                done,
                Some(Event::Done {
                    cached_tokens: 40,
                    ..
                })
            ),
            "{done:?}"
        );
        assert_eq!(Instant::now() - t1, Duration::from_millis(10));
        assert_eq!(stats.prefix_hits.load(Relaxed), 40);
        assert_eq!(stats.prefix_queries.load(Relaxed), 82);
    }

    /// Submit `n` sibling sequences of one request on a shared event channel.
    fn submit_n(
        tx: &mpsc::Sender<Submit>,
        tokens: Vec<u32>,
        max: usize,
        n: u32,
        script: Option<Arc<[u32]>>,
    ) -> mpsc::UnboundedReceiver<Event> {
        let (etx, erx) = mpsc::unbounded_channel();
        for index in 0..n {
            tx.try_send(Submit {
                tokens: tokens.clone(),
                max_tokens: max,
                ignore_eos: true,
                index,
                script: script.clone(),
                parallel: n > 1,
                salt: None,
                remote: None,
                want_blocks: false,
                arrived: Instant::now(),
                events: etx.clone(),
            })
            .unwrap();
        }
        erx
    }

    #[tokio::test(start_paused = true)]
    async fn parallel_siblings_share_the_prompt_prefill() {
        let (tx, rx) = mpsc::channel(16);
        let stats = Arc::new(Stats::new(64, 4));
        tokio::spawn(Engine::new(params(), rx, stats.clone()).run());
        let prompt: Vec<u32> = (0..41).collect();
        let t0 = Instant::now();
        let mut events = submit_n(&tx, prompt, 3, 3, None);
        let mut toks: Vec<Vec<u16>> = vec![Vec::new(); 3];
        let mut done = Vec::new();
        let mut first_token_at = None;
        while done.len() < 3 {
            match events.recv().await.expect("event") {
                Event::Token { index, tok, .. } => {
                    first_token_at.get_or_insert(Instant::now() - t0);
                    toks[index as usize].push(tok.expect("sampled"));
                }
                Event::Done {
                    index,
                    cached_tokens,
                    ..
                } => done.push((index, cached_tokens)),
                Event::Failed(m) => panic!("{m}"),
            }
        }
        // One step prefills the prompt once (10 + 41 ms): each sibling found
        // 40 tokens cached and computes only its last prompt token, which
        // costs no prefill time (as for any cached prompt).
        assert_eq!(first_token_at, Some(Duration::from_millis(51)));
        done.sort();
        assert_eq!(done, vec![(0, 0), (1, 40), (2, 40)]);
        assert!(toks.iter().all(|t| t.len() == 3));
        assert_ne!(toks[0], toks[1], "siblings sample different text");
        assert_ne!(toks[1], toks[2]);
        assert_eq!(stats.generation_tokens.load(Relaxed), 9);
        assert_eq!(stats.finished_length.load(Relaxed), 3);
    }

    /// One request of `prompt` alone: its time to done (1 token) and cached tokens.
    async fn timed(tx: &mpsc::Sender<Submit>, prompt: &[u32]) -> (Duration, usize) {
        let t0 = Instant::now();
        match collect(submit(tx, prompt.to_vec(), 1)).await.1 {
            Some(Event::Done { cached_tokens, .. }) => (Instant::now() - t0, cached_tokens),
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_prefix_offloaded_to_cpu_is_cached_but_costs_its_load() {
        // 16 blocks of 4 tokens on the GPU: two other 41-token prompts evict
        // the first one, which the CPU tier keeps.
        let p = Params {
            num_blocks: 16,
            cpu_offload_blocks: 64,
            cpu_load_per_token_ms: 0.25,
            ..params()
        };
        let (tx, rx) = mpsc::channel(16);
        tokio::spawn(Engine::new(p, rx, Arc::new(Stats::new(16, 4))).run());
        let prompt: Vec<u32> = (0..41).collect();
        let (miss, cached) = timed(&tx, &prompt).await;
        assert_eq!((miss, cached), (Duration::from_millis(51), 0));
        let (gpu_hit, cached) = timed(&tx, &prompt).await;
        assert_eq!((gpu_hit, cached), (Duration::from_millis(10), 40));
        for base in [100, 200] {
            timed(&tx, &(base..base + 41).collect::<Vec<_>>()).await;
        }
        let (cpu_hit, cached) = timed(&tx, &prompt).await;
        assert_eq!(cached, 40, "loaded back from the CPU tier: cached");
        assert!(
            gpu_hit < cpu_hit && cpu_hit < miss,
            "{gpu_hit:?} < {cpu_hit:?} < {miss:?}"
        );
        // Loaded back, the prefix is on the GPU again.
        assert_eq!(timed(&tx, &prompt).await, (gpu_hit, 40));
    }

    #[tokio::test(start_paused = true)]
    async fn lone_requests_of_the_same_prompt_do_not_share_within_a_step() {
        // Only parallel siblings cache ahead: two separate requests sent
        // together both prefill the whole prompt in one step (10 + 2 x 21 ms).
        let (tx, rx) = mpsc::channel(16);
        let stats = Arc::new(Stats::new(64, 4));
        tokio::spawn(Engine::new(params(), rx, stats).run());
        let prompt: Vec<u32> = (0..21).collect();
        let t0 = Instant::now();
        let a = submit(&tx, prompt.clone(), 1);
        let b = submit(&tx, prompt, 1);
        let (ra, rb) = tokio::join!(collect(a), collect(b));
        assert_eq!(Instant::now() - t0, Duration::from_millis(52));
        for r in [ra, rb] {
            assert!(matches!(
                r.1,
                Some(Event::Done {
                    cached_tokens: 0,
                    ..
                })
            ));
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_script_is_emitted_then_stops() {
        let (tx, rx) = mpsc::channel(16);
        let stats = Arc::new(Stats::new(64, 4));
        tokio::spawn(Engine::new(params(), rx, stats.clone()).run());
        let script: Arc<[u32]> = Arc::from(vec![7u32, 8, 9]);
        // Room for more: the script ends it with `stop`.
        let mut events = submit_n(&tx, vec![1, 2, 3], 10, 1, Some(script.clone()));
        let mut n = 0;
        loop {
            match events.recv().await.expect("event") {
                Event::Token { tok, finish, .. } => {
                    assert_eq!(tok, None);
                    n += 1;
                    assert_eq!(finish, (n == 3).then_some(Finish::Stop));
                }
                Event::Done {
                    reason,
                    completion_tokens,
                    ..
                } => {
                    assert_eq!((reason, completion_tokens), (Finish::Stop, 3));
                    break;
                }
                Event::Failed(m) => panic!("{m}"),
            }
        }
        // max_tokens shorter than the script cuts it: `length`.
        let (toks, done) = collect_script(submit_n(&tx, vec![1, 2, 3], 2, 1, Some(script))).await;
        assert_eq!(toks, 2);
        assert!(matches!(
            done,
            Some(Event::Done {
                reason: Finish::Length,
                ..
            })
        ));
    }

    async fn collect_script(mut rx: mpsc::UnboundedReceiver<Event>) -> (usize, Option<Event>) {
        let mut n = 0;
        while let Some(e) = rx.recv().await {
            match e {
                Event::Token { .. } => n += 1,
                other => return (n, Some(other)),
            }
        }
        (n, None)
    }

    #[tokio::test(start_paused = true)]
    async fn batch_cap_makes_requests_wait() {
        let (tx, rx) = mpsc::channel(16);
        let stats = Arc::new(Stats::new(64, 4));
        tokio::spawn(Engine::new(params(), rx, stats.clone()).run());
        let rxs: Vec<_> = (0..6).map(|i| submit(&tx, vec![i; 3], 5)).collect();
        tokio::time::sleep(Duration::from_millis(15)).await;
        assert_eq!(stats.running.load(Relaxed), 4);
        assert_eq!(stats.waiting.load(Relaxed), 2);
        for r in rxs {
            assert_eq!(collect(r).await.0.len(), 5);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn kv_exhaustion_preempts_newest() {
        let mut p = params();
        p.num_blocks = 10; // 40 tokens
        let (tx, rx) = mpsc::channel(16);
        let stats = Arc::new(Stats::new(10, 4));
        tokio::spawn(Engine::new(p, rx, stats.clone()).run());
        let a = submit(&tx, vec![1; 8], 20);
        let b = submit(&tx, vec![2; 8], 20);
        let (ra, rb) = tokio::join!(collect(a), collect(b));
        assert_eq!(ra.0.len(), 20);
        assert_eq!(rb.0.len(), 20);
        assert!(stats.preemptions.load(Relaxed) >= 1);
        assert_eq!(stats.kv_used_blocks.load(Relaxed), 0);
    }
}
