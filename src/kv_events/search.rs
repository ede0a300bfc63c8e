//! How deep each worker holds a prompt, from the holder masks of its blocks.
//!
//! [`walk`] reads every block in order; exact whatever the holdings. [`search`]
//! reads O(distinct depths × log blocks) of them, relying on the engines'
//! holdings being **prefix-closed**: vLLM and SGLang store a block only after its
//! parent and free a request's blocks tail-first, so the workers holding block i
//! (per cumulative tier) are a subset of those holding block i-1. Then a range
//! whose two ends have the same masks holds no depth change and is skipped; the
//! search gallops from the start (blocks 1, 3, 7, 15, …, so a prompt nobody holds
//! past a few blocks stays cheap) and bisects each galloped range whose ends
//! differ. On prefix-closed holdings both give the same depths; the index runs
//! [`walk`] beside [`search`] on a sample of lookups and counts disagreements.

use super::index::{Depths, MAX_WORKERS};

/// Cumulative holder masks of one block, one bit per worker slot:
/// `[gpu, gpu|cpu, any tier]`.
pub(super) type Masks = [u64; 3];

const NONE: Masks = [0; 3];

/// Depths by visiting every block in order, until nobody holds one.
pub(super) fn walk(n: usize, mut probe: impl FnMut(usize) -> Masks, out: &mut Depths) {
    *out = [[0; 3]; MAX_WORKERS];
    let mut alive = [u64::MAX; 3];
    for i in 0..n {
        let next = and(alive, probe(i));
        set_depths(alive, next, i, out);
        alive = next;
        if alive[2] == 0 {
            return;
        }
    }
    set_depths(alive, NONE, n, out);
}

/// Depths by galloping then bisecting over block positions (module docs): the
/// same as [`walk`] when holdings are prefix-closed.
pub(super) fn search(n: usize, mut probe: impl FnMut(usize) -> Masks, out: &mut Depths) {
    *out = [[0; 3]; MAX_WORKERS];
    if n == 0 {
        return;
    }
    let mut a = probe(0);
    let mut lo = 0;
    let mut step = 1;
    while a[2] != 0 {
        if lo == n - 1 {
            set_depths(a, NONE, n, out);
            return;
        }
        let hi = (lo + step).min(n - 1);
        let mut b = and(a, probe(hi));
        if b != a {
            b = bisect(lo, a, hi, b, &mut probe, out);
        }
        (lo, a, step) = (hi, b, step * 2);
    }
}

/// Resolve the depths of the workers in `a` but not `b` (the masks at blocks
/// `lo` < `hi`): each holds `lo` and not `hi`, so its depth is in (lo, hi].
/// Returns `b` less any worker a probe in between found missing, so a hole seen
/// on the way is not forgotten (only holes between probes are).
fn bisect(
    lo: usize,
    a: Masks,
    hi: usize,
    b: Masks,
    probe: &mut impl FnMut(usize) -> Masks,
    out: &mut Depths,
) -> Masks {
    if hi == lo + 1 {
        set_depths(a, b, hi, out);
        return b;
    }
    let mid = lo + (hi - lo) / 2;
    let mut m = and(a, probe(mid));
    if m != a {
        m = bisect(lo, a, mid, m, probe, out);
    }
    let b = and(b, m);
    if m != b {
        return bisect(mid, m, hi, b, probe, out);
    }
    b
}

#[inline]
fn and(a: Masks, b: Masks) -> Masks {
    [a[0] & b[0], a[1] & b[1], a[2] & b[2]]
}

/// Workers in `before` but not `after` (per tier) hold `depth` blocks.
#[inline]
fn set_depths(before: Masks, after: Masks, depth: usize, out: &mut Depths) {
    for t in 0..3 {
        let mut gone = before[t] & !after[t];
        while gone != 0 {
            out[gone.trailing_zeros() as usize][t] = depth as u32;
            gone &= gone - 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Per-block masks from per-worker depths (each `[gpu, gpu+cpu, any]`,
    /// non-decreasing), so prefix-closed by construction.
    fn masks_of(depths: &[[u32; 3]], n: usize) -> Vec<Masks> {
        (0..n)
            .map(|i| {
                let mut m = NONE;
                for (w, d) in depths.iter().enumerate() {
                    for t in 0..3 {
                        m[t] |= u64::from((i as u32) < d[t]) << w;
                    }
                }
                m
            })
            .collect()
    }

    fn both(masks: &[Masks]) -> (Depths, Depths, usize) {
        let (mut w, mut s) = ([[0; 3]; MAX_WORKERS], [[0; 3]; MAX_WORKERS]);
        walk(masks.len(), |i| masks[i], &mut w);
        let mut probes = 0;
        let probe = |i: usize| {
            probes += 1;
            masks[i]
        };
        search(masks.len(), probe, &mut s);
        (w, s, probes)
    }

    /// Random prefix-closed holdings: up to 64 workers, each with its depths
    /// per tier drawn from a few shared values (so many workers tie), all
    /// tiers, some beyond the prompt.
    fn holdings() -> impl Strategy<Value = (Vec<[u32; 3]>, usize)> {
        (1usize..300, 1usize..=MAX_WORKERS).prop_flat_map(|(n, workers)| {
            let depth = prop_oneof![Just(0u32), 0u32..=(n as u32 + 2), 0u32..4];
            let row = (depth.clone(), depth.clone(), depth).prop_map(|(g, c, d)| {
                let mut r = [g, c, d];
                r.sort_unstable();
                r
            });
            (proptest::collection::vec(row, workers), Just(n))
        })
    }

    proptest! {
        #[test]
        fn search_equals_walk_on_prefix_closed_holdings((depths, n) in holdings()) {
            let (w, s, _) = both(&masks_of(&depths, n));
            prop_assert_eq!(w, s);
            for (i, d) in depths.iter().enumerate() {
                let want = d.map(|x| x.min(n as u32));
                prop_assert_eq!(w[i], want);
            }
        }
    }

    #[test]
    fn a_prompt_held_by_nobody_past_a_few_blocks_is_cheap() {
        let masks = masks_of(&[[3, 3, 4]; 10], 2048);
        let (w, s, probes) = both(&masks);
        assert_eq!((w, s[0]), (s, [3, 3, 4]));
        assert!(probes <= 8, "{probes} probes");
        let (_, s, probes) = both(&masks_of(&[[0, 0, 0]], 2048));
        assert_eq!((s[0], probes), ([0, 0, 0], 1));
        let (w, s, probes) = both(&[]);
        assert_eq!((w, probes), (s, 0));
    }

    #[test]
    fn probes_grow_with_distinct_depths_not_blocks() {
        let depths: Vec<[u32; 3]> = (0..64).map(|i| [(i + 1) * 32; 3]).collect();
        let (w, s, probes) = both(&masks_of(&depths, 2048));
        assert_eq!(w, s);
        assert!(probes < 2048 / 4, "{probes} probes");
    }

    #[test]
    fn a_hole_makes_them_differ() {
        // Worker 0 holds blocks 0..=9 except 5: the walk stops at 5.
        let mut masks = masks_of(&[[10, 10, 10]], 16);
        masks[5] = NONE;
        let (w, s, _) = both(&masks);
        assert_eq!(w[0], [5, 5, 5]);
        assert_ne!(w, s);
    }

    #[test]
    fn a_hole_a_probe_saw_is_not_forgotten() {
        // Worker 0 holds block 0 on the GPU, 1 on the CPU, 2 on disk, 3 on the
        // GPU (a hole in its GPU+CPU tier); worker 1 blocks 0-2 on the GPU, so
        // the search bisects over block 2 and sees the hole.
        let masks = [[3, 3, 3], [2, 3, 3], [2, 2, 3], [1, 1, 1]];
        let (w, s, _) = both(&masks);
        assert_eq!(w, s);
        assert_eq!((s[0], s[1]), ([1, 2, 4], [3, 3, 3]));
    }
}
