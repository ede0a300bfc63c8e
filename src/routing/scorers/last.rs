//! `last` (a toy): the later a worker comes in the route, the higher it scores.

use super::{Candidate, PickView, Prepared, Scorer};
use crate::routing::Reason;

pub struct Last;

impl Scorer for Last {
    fn score(&self, _: &Prepared, v: &PickView<'_>, c: &Candidate) -> f64 {
        c.i as f64 / v.workers.len().saturating_sub(1).max(1) as f64
    }

    fn reason(&self) -> Reason {
        Reason::LeastQueue // a toy: it borrows an existing reason
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{cand, scores};
    use super::*;

    #[test]
    fn the_last_worker_scores_one() {
        let cands = [cand(0, |_| {}), cand(2, |_| {}), cand(4, |_| {})];
        assert_eq!(scores(&Last, &cands, None), [0.0, 0.5, 1.0]);
    }
}
