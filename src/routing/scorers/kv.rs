//! `kv`: lower KV-cache usage scores higher; stale stats score 0.

use super::{Candidate, PickView, Prepared, Scorer};
use crate::routing::Reason;

pub struct Kv;

impl Scorer for Kv {
    fn score(&self, _: &Prepared, _: &PickView<'_>, c: &Candidate) -> f64 {
        if c.stale {
            0.0
        } else {
            1.0 - c.kv
        }
    }

    fn reason(&self) -> Reason {
        Reason::LeastKv
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{cand, scores};
    use super::*;

    #[test]
    fn free_cache_scores_higher_and_stale_scores_nothing() {
        let cands = [
            cand(0, |c| c.kv = 0.25),
            cand(1, |c| c.kv = 1.0),
            cand(2, |c| c.stale = true),
        ];
        assert_eq!(scores(&Kv, &cands, None), [0.75, 0.0, 0.0]);
    }
}
