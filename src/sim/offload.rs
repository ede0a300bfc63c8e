//! The CPU offload tier of the simulated KV cache, after vLLM's KV offloading
//! (`--kv-offloading-size`, the `OffloadingConnector` with its LRU manager): a
//! block evicted from the GPU keeps a copy in host memory, bounded by a number
//! of blocks, least recently used out first. A prompt whose prefix continues in
//! this tier loads those blocks back instead of recomputing them.

use std::collections::{BTreeMap, HashMap};

/// Block hashes held in CPU memory, in LRU order.
#[derive(Debug)]
pub struct CpuTier {
    capacity: usize,
    /// Hash → its last-use stamp.
    stamp: HashMap<u64, u64>,
    /// Stamp → hash: the first entry is the least recently used.
    order: BTreeMap<u64, u64>,
    clock: u64,
}

impl CpuTier {
    pub fn new(capacity: usize) -> CpuTier {
        CpuTier {
            capacity,
            stamp: HashMap::new(),
            order: BTreeMap::new(),
            clock: 0,
        }
    }

    /// Blocks held.
    pub fn held(&self) -> usize {
        self.stamp.len()
    }

    pub fn contains(&self, h: u64) -> bool {
        self.stamp.contains_key(&h)
    }

    /// Mark `h` most recently used, if held.
    pub fn touch(&mut self, h: u64) {
        if let Some(s) = self.stamp.get_mut(&h) {
            self.order.remove(s);
            self.clock += 1;
            *s = self.clock;
            self.order.insert(self.clock, h);
        }
    }

    /// Keep a copy of `h`. Returns whether it is new here, and the hashes that
    /// fell out to make room (least recently used first).
    pub fn insert(&mut self, h: u64) -> (bool, Vec<u64>) {
        if self.capacity == 0 {
            return (false, Vec::new());
        }
        if self.contains(h) {
            self.touch(h);
            return (false, Vec::new());
        }
        let mut out = Vec::new();
        while self.stamp.len() >= self.capacity {
            let Some((_, old)) = self.order.pop_first() else {
                break;
            };
            self.stamp.remove(&old);
            out.push(old);
        }
        self.clock += 1;
        self.stamp.insert(h, self.clock);
        self.order.insert(self.clock, h);
        (true, out)
    }

    /// How many of `hashes`, from the first, are held.
    pub fn run(&self, hashes: &[u64]) -> usize {
        hashes.iter().take_while(|h| self.contains(**h)).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_lru_with_touch() {
        let mut t = CpuTier::new(2);
        assert_eq!(t.insert(1), (true, vec![]));
        assert_eq!(t.insert(2), (true, vec![]));
        t.touch(1);
        assert_eq!(t.insert(3), (true, vec![2]), "2 is the least recently used");
        assert_eq!(t.insert(1), (false, vec![]), "already held: touched");
        assert_eq!(t.run(&[1, 3, 2]), 2);
        assert_eq!(t.held(), 2);
        let mut off = CpuTier::new(0);
        assert_eq!(off.insert(1), (false, vec![]));
        assert_eq!(off.held(), 0);
    }
}
