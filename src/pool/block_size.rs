//! KV block sizes: what each engine's `/metrics` reports (vLLM's
//! `cache_config_info` `block_size`, SGLang's `page_size`) against the size the
//! pool's precise index hashes prompts with. A disagreement means the engine's
//! events are refused and the pool routes on the approximate index, so it is
//! shown where operators look: `/ready`'s detail, the dashboard status, the
//! gauge `switchyard_kv_block_size_mismatch{pool}` and one log line per change.
//! An unset `[pools.kv_events] block_size` is learned here from the first
//! report, before any event arrives.

use super::registry::{PoolRuntime, PoolSet};
use super::worker::Worker;
use crate::config::PrefixSource;
use crate::telemetry::names;
use serde::Serialize;
use std::sync::atomic::Ordering;

/// A pool's block size as its index uses it and its engines report it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PoolBlockSize {
    pub pool: String,
    /// `[pools.routing] index`: `precise` (required), `auto` or `approximate`.
    pub index: &'static str,
    /// Tokens per block the index hashes with; `None` while still learning.
    pub block_size: Option<usize>,
    /// `[pools.kv_events] block_size` when set; `None`: learned.
    pub configured: Option<usize>,
    /// Every engine agrees with `block_size` (or none reported yet).
    pub precise_ready: bool,
    pub workers: Vec<WorkerBlockSize>,
    /// The workers whose reported size differs from `block_size`.
    pub mismatches: Vec<Mismatch>,
}

/// One engine's report.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct WorkerBlockSize {
    pub worker: String,
    /// From its `/metrics`; `None` until a scrape says.
    pub reported: Option<u64>,
}

/// An engine whose blocks differ from the pool's.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Mismatch {
    pub worker: String,
    pub configured: Option<usize>,
    pub pool_block_size: usize,
    pub reported: u64,
}

impl PoolBlockSize {
    /// One line for logs and `/ready`'s warnings.
    pub fn describe(&self, m: &Mismatch) -> String {
        let source = match m.configured {
            Some(_) => "configured in [pools.kv_events] block_size",
            None => "learned from its first engine",
        };
        format!(
            "pool {}: worker {} reports KV block size {} but the pool's is {} ({source}); its events are refused and the pool routes on the approximate index",
            self.pool, m.worker, m.reported, m.pool_block_size
        )
    }
}

fn index_name(s: PrefixSource) -> &'static str {
    match s {
        PrefixSource::Auto => "auto",
        PrefixSource::Precise => "precise",
        PrefixSource::Approximate => "approximate",
    }
}

/// A worker's reported size, 0 when none.
fn reported(w: &Worker) -> u64 {
    w.state.stats.kv_block_size.load(Ordering::Relaxed)
}

/// The pool's state, or `None` when no worker publishes KV events (its block
/// size then matters to nothing).
pub fn status(p: &PoolRuntime) -> Option<PoolBlockSize> {
    let kv = p.kv.as_ref()?;
    let pinned = kv.index.pinned_block_size();
    let cfg = &p.config.kv_events;
    let configured = (!cfg.learn_block_size).then_some(cfg.block_size);
    let mut workers = Vec::new();
    let mut mismatches = Vec::new();
    for w in p
        .workers
        .iter()
        .filter(|w| kv.index.slot_of(&w.id).is_some())
    {
        let r = reported(w);
        workers.push(WorkerBlockSize {
            worker: w.id.to_string(),
            reported: (r > 0).then_some(r),
        });
        match pinned {
            Some(size) if r > 0 && r != size as u64 => mismatches.push(Mismatch {
                worker: w.id.to_string(),
                configured,
                pool_block_size: size,
                reported: r,
            }),
            _ => {}
        }
    }
    Some(PoolBlockSize {
        pool: p.name.to_string(),
        index: index_name(p.config.routing.index),
        block_size: pinned,
        configured,
        precise_ready: mismatches.is_empty(),
        workers,
        mismatches,
    })
}

/// Every pool's state that has one (pools with KV events).
pub fn statuses(set: &PoolSet) -> Vec<PoolBlockSize> {
    set.pools.iter().filter_map(|p| status(p)).collect()
}

/// Set `switchyard_kv_block_size_mismatch{pool}` (workers disagreeing) for every
/// pool with KV events.
pub fn refresh_gauges(set: &PoolSet) {
    for s in statuses(set) {
        metrics::gauge!(names::KV_BLOCK_SIZE_MISMATCH, names::L_POOL => s.pool.clone())
            .set(s.mismatches.len() as f64);
    }
}

/// Worker `w`'s scrape reported a block size: a learning pool adopts it (before
/// any event), and a change in whether it disagrees is logged once.
pub fn observe(set: &PoolSet, w: &Worker) {
    let r = reported(w);
    if r == 0 {
        return;
    }
    for p in set
        .pools
        .iter()
        .filter(|p| p.workers.iter().any(|x| x.id == w.id))
    {
        let Some(kv) = p.kv.as_ref().filter(|kv| kv.index.slot_of(&w.id).is_some()) else {
            continue;
        };
        if kv.index.pinned_block_size().is_none() {
            kv.index.adopt_block_size(r as usize);
        }
        let Some(s) = status(p) else { continue };
        note(&s, w, r);
    }
}

/// Log when worker `w` starts or stops disagreeing with its pool (not on every scrape).
fn note(s: &PoolBlockSize, w: &Worker, r: u64) {
    let flagged = &w.state.stats.kv_block_size_flagged;
    match s.mismatches.iter().find(|m| *m.worker == *w.id) {
        Some(m) if flagged.swap(r, Ordering::Relaxed) != r => {
            tracing::warn!(pool = %s.pool, worker = %w.id, configured = ?m.configured,
                pool_block_size = m.pool_block_size, reported = r, index = s.index,
                "{}", s.describe(m));
        }
        None if flagged.swap(0, Ordering::Relaxed) != 0 => {
            tracing::info!(pool = %s.pool, worker = %w.id, block_size = r,
                "kv block size: the worker now agrees with its pool");
        }
        _ => {}
    }
}
