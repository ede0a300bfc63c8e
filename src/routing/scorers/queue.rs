//! `queue`: a shorter estimated wait scores higher.

use super::{Candidate, PickView, Prepared, Scorer};
use crate::routing::pipeline::QUEUE_TOKENS;
use crate::routing::Reason;

pub struct Queue;

impl Scorer for Queue {
    fn score(&self, _: &Prepared, view: &PickView<'_>, c: &Candidate) -> f64 {
        1.0 - c.wait / (view.max_wait + QUEUE_TOKENS)
    }

    fn reason(&self) -> Reason {
        Reason::LeastQueue
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{cand, scores};
    use super::*;

    #[test]
    fn the_shorter_wait_scores_higher() {
        let cands = [cand(0, |c| c.wait = 0.0), cand(1, |c| c.wait = 48.0)];
        assert_eq!(scores(&Queue, &cands, None), [1.0, 0.25]);
    }
}
