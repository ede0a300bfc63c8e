//! Engine KV-cache events → the precise index that routing reads.
//!
//! vLLM and SGLang publish what their prefix caches store and evict (ZeroMQ,
//! msgpack; `wire.rs`, format in `docs/routing.md`). Per worker with `kv_events`
//! configured a [`subscriber`] task follows the stream (gaps fetched from the
//! replay endpoint, resync on start, restart and cache reset) and applies it
//! (`apply.rs`) to its pool's [`KvIndex`] (`index.rs`): block key → the workers
//! holding the block, by tier. The worker's stats poller reports the engine's
//! process start time ([`EngineStart`], `restart.rs`) so a restart resyncs too.
//! Routing looks a request's prompt tokens up there
//! (`routing/scorers/precise_prefix.rs`).
//!
//! Layering: fed by the pool (the registry starts a [`PoolKv`] per pool and syncs
//! its subscribers with the worker set), read by routing; it uses only config,
//! telemetry and the tokenizer below it.

mod apply;
mod check;
pub mod index;
mod pending;
mod restart;
mod search;
mod sequence;
pub mod subscriber;
pub mod wire;

pub use apply::{Refusal, WorkerBlocks};
pub use check::CHECK_EVERY;
pub use index::{
    prompt_keys, reusable_prompt_keys, weighted_blocks, Depths, KvIndex, SlotState, MAX_WORKERS,
};
pub use pending::MAX_PENDING_KEYS;
pub use restart::EngineStart;
pub use sequence::{Sequencer, Step};

use crate::config::{KvEndpoints, KvEventsConfig, PoolConfig};
use crate::tokenize::{self, PromptTokenizer};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;

/// A pool's precise-routing state: its index, tokenizer and subscribers. Kept by
/// the registry across rebuilds, like the approximate index.
pub struct PoolKv {
    pub index: Arc<KvIndex>,
    /// `None` when the pool sets no `tokenizer`: the index is kept (events are
    /// still followed and counted) but routing stays approximate.
    pub tokenizer: Option<Arc<dyn PromptTokenizer>>,
    pub tier_weights: [f64; 3],
    /// How long a routing decision counts as held before its events confirm
    /// it (ms; 0: not at all).
    pub pending_ttl_ms: u64,
    cfg: KvEventsConfig,
    tasks: Mutex<HashMap<Arc<str>, Task>>,
}

/// A worker's subscriber: what it was started with, and how to stop it.
struct Task {
    endpoints: KvEndpoints,
    start: Arc<EngineStart>,
    abort: tokio::task::AbortHandle,
}

/// A worker to subscribe to: its id, event endpoints, and the start time its
/// stats poller reports.
pub struct KvWorker {
    pub id: Arc<str>,
    pub endpoints: KvEndpoints,
    pub start: Arc<EngineStart>,
}

impl PoolKv {
    /// The state for pool `pc`, or `None` when none of its workers publishes events.
    pub fn new(pc: &PoolConfig) -> Option<PoolKv> {
        if pc.workers.iter().all(|w| w.kv_events.is_none()) {
            return None;
        }
        let tokenizer = match pc.tokenizer.as_ref().map(tokenize::build) {
            Some(Ok(t)) => Some(t),
            Some(Err(e)) => {
                tracing::error!(pool = %pc.name, error = %e, "kv events: no tokenizer; routing on the approximate prefix index");
                None
            }
            None => None,
        };
        Some(PoolKv {
            index: Arc::new(index_for(pc)),
            tokenizer,
            tier_weights: pc.kv_events.tier_weights,
            pending_ttl_ms: pc.kv_events.pending_ttl.as_millis() as u64,
            cfg: pc.kv_events.clone(),
            tasks: Mutex::new(HashMap::new()),
        })
    }

    /// Whether `pc` can keep this state (same block size and settings);
    /// otherwise the registry builds a new one.
    pub fn fits(&self, pc: &PoolConfig) -> bool {
        self.cfg == pc.kv_events && self.tokenizer.is_some() == pc.tokenizer.is_some()
    }

    /// Start a subscriber for each of `workers` with endpoints that has none (or
    /// whose endpoints changed) and stop those of workers no longer listed. Slots
    /// are claimed here, so a route built right after sees them.
    pub fn sync(&self, pool: &str, workers: &[KvWorker]) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            tracing::error!(pool, "kv events: no runtime to subscribe on");
            return;
        };
        let mut tasks = self.tasks.lock();
        tasks.retain(|id, t| {
            let keep = workers.iter().any(|w| {
                w.id == *id && w.endpoints == t.endpoints && Arc::ptr_eq(&w.start, &t.start)
            });
            if !keep {
                t.abort.abort();
            }
            keep
        });
        for w in workers {
            if tasks.contains_key(&w.id) || self.index.claim(&w.id).is_none() {
                continue;
            }
            let sub = subscriber::Subscriber {
                pool: Arc::from(pool),
                worker: w.id.clone(),
                endpoints: w.endpoints.clone(),
                cfg: self.cfg.clone(),
                index: self.index.clone(),
                start: w.start.clone(),
            };
            let h = rt.spawn(sub.run());
            let task = Task {
                endpoints: w.endpoints.clone(),
                start: w.start.clone(),
                abort: h.abort_handle(),
            };
            tasks.insert(w.id.clone(), task);
        }
    }
}

impl Drop for PoolKv {
    fn drop(&mut self) {
        let tasks = self.tasks.get_mut();
        for (_, t) in tasks.drain() {
            t.abort.abort();
        }
    }
}

/// A pool's index: its block size pinned by `[pools.kv_events] block_size`,
/// else learned from the first engine that reports one.
fn index_for(pc: &crate::config::PoolConfig) -> KvIndex {
    let ix = KvIndex::for_pool(&pc.name, pc.kv_events.block_size);
    if pc.kv_events.learn_block_size {
        ix.learning_block_size()
    } else {
        ix
    }
}
