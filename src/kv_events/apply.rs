//! One worker's events applied to the pool's [`KvIndex`]: the engine's block
//! hashes resolved to the gateway's keys (parents and removals name engine
//! hashes), the configuration checked, memory bounded.

use super::index::{block_key, KvIndex, ROOT_KEY};
use super::wire::{Event, Tier};
use std::collections::HashMap;

/// Why a worker's events cannot drive precise routing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The engine's blocks are another size than the pool's: its configured
    /// `block_size`, or the one learned from the first engine that reported.
    BlockSize { engine: usize, pool: usize },
    /// A stored event's token ids do not cover its blocks.
    Tokens,
}

impl Refusal {
    /// The metric label.
    pub fn label(&self) -> &'static str {
        match self {
            Refusal::BlockSize { .. } => "block_size",
            Refusal::Tokens => "token_ids",
        }
    }
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::BlockSize { engine, pool } => write!(
                f,
                "the engine's KV blocks hold {engine} tokens but the pool's block size is {pool} (kv_events.block_size, or learned from its first engine)"
            ),
            Refusal::Tokens => write!(f, "a BlockStored event's token_ids do not cover its blocks"),
        }
    }
}

/// What applying one event did, for the counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Applied {
    /// Blocks whose parent was unknown (history lost) or salted: not indexed.
    pub unchained: u64,
    /// Blocks not indexed because the worker is at its bound.
    pub over_capacity: u64,
    /// The engine cleared its cache.
    pub cleared: bool,
}

/// A block the worker holds: its key and a bit per tier.
#[derive(Clone, Copy)]
struct Held {
    key: u64,
    tiers: u8,
}

/// The per-worker state a subscriber keeps (single writer).
pub struct WorkerBlocks {
    slot: u8,
    block_size: usize,
    max_blocks: usize,
    held: HashMap<u64, Held>,
    per_tier: [u64; 3],
}

impl WorkerBlocks {
    pub fn new(slot: u8, block_size: usize, max_blocks: usize) -> WorkerBlocks {
        WorkerBlocks {
            slot,
            block_size,
            max_blocks,
            held: HashMap::new(),
            per_tier: [0; 3],
        }
    }

    /// Blocks held per tier.
    pub fn per_tier(&self) -> [u64; 3] {
        self.per_tier
    }

    /// Apply one event.
    pub fn apply(&mut self, ix: &KvIndex, ev: &Event) -> Result<Applied, Refusal> {
        let mut out = Applied::default();
        match ev {
            Event::Stored {
                block_hashes,
                parent,
                token_ids,
                block_size,
                salted,
                tier,
            } => {
                if token_ids.is_empty() && *tier != Tier::Gpu {
                    self.copy(ix, block_hashes, *tier, &mut out);
                    return Ok(out);
                }
                if !ix.adopt_block_size(*block_size) {
                    return Err(Refusal::BlockSize {
                        engine: *block_size,
                        pool: ix.block_size(),
                    });
                }
                self.block_size = *block_size;
                if token_ids.len() != block_hashes.len() * block_size {
                    return Err(Refusal::Tokens);
                }
                let first = match parent {
                    None => Some(ROOT_KEY),
                    Some(p) => self.held.get(p).map(|h| h.key),
                };
                self.store(
                    ix,
                    block_hashes,
                    first.filter(|_| !salted),
                    token_ids,
                    *tier,
                    &mut out,
                );
            }
            Event::Removed { block_hashes, tier } => {
                for h in block_hashes {
                    self.remove(ix, *h, *tier);
                }
            }
            Event::AllCleared => {
                self.clear(ix);
                out.cleared = true;
            }
        }
        Ok(out)
    }

    fn store(
        &mut self,
        ix: &KvIndex,
        hashes: &[u64],
        first_parent: Option<u64>,
        tokens: &[u32],
        tier: Tier,
        out: &mut Applied,
    ) {
        let Some(mut parent) = first_parent else {
            out.unchained += hashes.len() as u64;
            return;
        };
        let bit = 1u8 << tier as u8;
        for (h, toks) in hashes.iter().zip(tokens.chunks_exact(self.block_size)) {
            let key = block_key(parent, toks);
            parent = key;
            let known = self.held.contains_key(h);
            if !known && self.held.len() >= self.max_blocks {
                out.over_capacity += 1;
                continue;
            }
            let e = self.held.entry(*h).or_insert(Held { key, tiers: 0 });
            if e.key != key {
                // The engine reused a hash for other tokens: trust the newest.
                let old = *e;
                *e = Held { key, tiers: 0 };
                for t in Tier::ALL
                    .into_iter()
                    .filter(|t| old.tiers & (1 << *t as u8) != 0)
                {
                    ix.remove(self.slot, old.key, t);
                    self.per_tier[t as usize] -= 1;
                }
            }
            if e.tiers & bit == 0 {
                e.tiers |= bit;
                self.per_tier[tier as usize] += 1;
                ix.insert(self.slot, key, tier);
            }
        }
    }

    /// A store without tokens in another tier, as vLLM's offloading connector
    /// publishes it: copies of blocks the worker already holds (by the engine's
    /// hash), so their keys are known. Blocks never seen are skipped (counted
    /// `unchained`). Its `block_size` (0, or the offload block size, which may
    /// span several engine blocks) is not checked: only known hashes count.
    fn copy(&mut self, ix: &KvIndex, hashes: &[u64], tier: Tier, out: &mut Applied) {
        let bit = 1u8 << tier as u8;
        for h in hashes {
            match self.held.get_mut(h) {
                Some(e) if e.tiers & bit == 0 => {
                    e.tiers |= bit;
                    self.per_tier[tier as usize] += 1;
                    ix.insert(self.slot, e.key, tier);
                }
                Some(_) => {}
                None => out.unchained += 1,
            }
        }
    }

    fn remove(&mut self, ix: &KvIndex, h: u64, tier: Tier) {
        let bit = 1u8 << tier as u8;
        let Some(e) = self.held.get_mut(&h) else {
            return;
        };
        if e.tiers & bit != 0 {
            e.tiers &= !bit;
            self.per_tier[tier as usize] -= 1;
            ix.remove(self.slot, e.key, tier);
        }
        if e.tiers == 0 {
            self.held.remove(&h);
        }
    }

    /// Forget every block of this worker (engine restart, cache reset, resync).
    pub fn clear(&mut self, ix: &KvIndex) {
        for (_, e) in self.held.drain() {
            for t in Tier::ALL {
                if e.tiers & (1 << t as u8) != 0 {
                    ix.remove(self.slot, e.key, t);
                }
            }
        }
        self.per_tier = [0; 3];
    }
}

#[cfg(test)]
mod tests {
    use super::super::index::{prompt_keys, Depths, MAX_WORKERS};
    use super::*;
    use std::sync::Arc;

    fn stored(
        hashes: &[u64],
        parent: Option<u64>,
        tokens: std::ops::Range<u32>,
        tier: Tier,
    ) -> Event {
        Event::Stored {
            block_hashes: hashes.to_vec(),
            parent,
            token_ids: tokens.collect(),
            block_size: 4,
            salted: false,
            tier,
        }
    }

    fn depth(ix: &KvIndex, slot: u8, tokens: std::ops::Range<u32>) -> [u32; 3] {
        let mut d: Depths = [[0; 3]; MAX_WORKERS];
        ix.lookup(&prompt_keys(&tokens.collect::<Vec<_>>(), 4), &mut d);
        d[slot as usize]
    }

    #[test]
    fn stored_blocks_chain_through_engine_hashes_and_removals_follow() {
        let ix = KvIndex::new(4);
        let slot = ix.claim(&Arc::from("w")).unwrap();
        let mut w = WorkerBlocks::new(slot, 4, 100);
        w.apply(&ix, &stored(&[11, 12], None, 0..8, Tier::Gpu))
            .unwrap();
        // A continuation in a later event names its parent by engine hash.
        w.apply(&ix, &stored(&[13], Some(12), 8..12, Tier::Gpu))
            .unwrap();
        assert_eq!(depth(&ix, slot, 0..14), [3, 3, 3]);
        // Offloaded to CPU, then dropped from the GPU: still held, one tier down.
        w.apply(&ix, &stored(&[13], Some(12), 8..12, Tier::Cpu))
            .unwrap();
        w.apply(
            &ix,
            &Event::Removed {
                block_hashes: vec![13],
                tier: Tier::Gpu,
            },
        )
        .unwrap();
        assert_eq!(depth(&ix, slot, 0..14), [2, 3, 3]);
        assert_eq!(w.per_tier(), [2, 1, 0]);
        let unknown_parent = w
            .apply(&ix, &stored(&[20], Some(99), 0..4, Tier::Gpu))
            .unwrap();
        assert_eq!(unknown_parent.unchained, 1);
        let r = w.apply(&ix, &Event::AllCleared).unwrap();
        assert!(r.cleared);
        assert_eq!(depth(&ix, slot, 0..14), [0, 0, 0]);
        assert_eq!((ix.pairs(), ix.keys()), (0, 0));
    }

    #[test]
    fn a_tokenless_cpu_store_copies_known_blocks_to_the_cpu_tier() {
        let ix = KvIndex::new(4);
        let slot = ix.claim(&Arc::from("w")).unwrap();
        let mut w = WorkerBlocks::new(slot, 4, 100);
        w.apply(&ix, &stored(&[11, 12], None, 0..8, Tier::Gpu))
            .unwrap();
        // vLLM's offloading connector: engine hashes, no parent, no tokens,
        // block size 0; then the GPU evicts the block.
        let offloaded = Event::Stored {
            block_hashes: vec![12, 99],
            parent: None,
            token_ids: Vec::new(),
            block_size: 0,
            salted: false,
            tier: Tier::Cpu,
        };
        let a = w.apply(&ix, &offloaded).unwrap();
        assert_eq!(a.unchained, 1, "99 was never stored on the GPU");
        w.apply(
            &ix,
            &Event::Removed {
                block_hashes: vec![12],
                tier: Tier::Gpu,
            },
        )
        .unwrap();
        assert_eq!(depth(&ix, slot, 0..9), [1, 2, 2]);
        assert_eq!(w.per_tier(), [1, 1, 0]);
        w.apply(
            &ix,
            &Event::Removed {
                block_hashes: vec![12],
                tier: Tier::Cpu,
            },
        )
        .unwrap();
        assert_eq!(depth(&ix, slot, 0..9), [1, 1, 1]);
        assert_eq!(w.per_tier(), [1, 0, 0]);
    }

    #[test]
    fn refuses_another_block_size_and_bounds_memory() {
        let ix = KvIndex::new(4);
        let slot = ix.claim(&Arc::from("w")).unwrap();
        let mut w = WorkerBlocks::new(slot, 4, 2);
        let mut e = stored(&[1], None, 0..4, Tier::Gpu);
        if let Event::Stored { block_size, .. } = &mut e {
            *block_size = 16;
        }
        assert_eq!(
            w.apply(&ix, &e),
            Err(Refusal::BlockSize {
                engine: 16,
                pool: 4
            })
        );
        assert_eq!(
            w.apply(&ix, &stored(&[1, 2], None, 0..4, Tier::Gpu)),
            Err(Refusal::Tokens)
        );
        let r = w
            .apply(&ix, &stored(&[1, 2, 3], None, 0..12, Tier::Gpu))
            .unwrap();
        assert_eq!(r.over_capacity, 1);
        assert_eq!(ix.pairs(), 2);
    }

    #[test]
    fn an_unpinned_block_size_is_set_by_the_first_report_then_pinned() {
        let ix = KvIndex::new(16).learning_block_size();
        let (a, b) = (
            ix.claim(&Arc::from("a")).unwrap(),
            ix.claim(&Arc::from("b")).unwrap(),
        );
        let (mut wa, mut wb) = (WorkerBlocks::new(a, 16, 10), WorkerBlocks::new(b, 16, 10));
        // The first engine reports blocks of 4: the pool's size becomes 4.
        wa.apply(&ix, &stored(&[1, 2], None, 0..8, Tier::Gpu))
            .unwrap();
        assert_eq!((ix.block_size(), ix.pairs()), (4, 2));
        let mut e = stored(&[7], None, 0..16, Tier::Gpu);
        if let Event::Stored { block_size, .. } = &mut e {
            *block_size = 16;
        }
        assert_eq!(
            wb.apply(&ix, &e),
            Err(Refusal::BlockSize {
                engine: 16,
                pool: 4
            })
        );
        assert_eq!(ix.block_size(), 4);
    }
}
