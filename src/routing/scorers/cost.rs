//! `cost`: a cheaper `price_per_mtok` scores higher, scaled over the candidates'
//! price range.

use super::{Candidate, PickView, Prepared, Scorer};
use crate::routing::Reason;

pub struct Cost;

impl Scorer for Cost {
    fn prepare(&self, view: &PickView<'_>) -> Prepared {
        let (mut lo, mut hi) = (f64::MAX, f64::MIN);
        for c in view.cands {
            lo = lo.min(c.price);
            hi = hi.max(c.price);
        }
        Prepared {
            lo,
            hi,
            index: None,
        }
    }

    fn score(&self, p: &Prepared, _: &PickView<'_>, c: &Candidate) -> f64 {
        if p.hi > p.lo {
            1.0 - (c.price - p.lo) / (p.hi - p.lo)
        } else {
            1.0
        }
    }

    fn reason(&self) -> Reason {
        Reason::Cheapest
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{cand, scores};
    use super::*;

    #[test]
    fn cheaper_scores_higher_and_equal_prices_all_score_one() {
        let cands = [cand(0, |c| c.price = 3.0), cand(1, |c| c.price = 1.0)];
        assert_eq!(scores(&Cost, &cands, None), [0.0, 1.0]);
        let same = [cand(0, |c| c.price = 2.0), cand(1, |c| c.price = 2.0)];
        assert_eq!(scores(&Cost, &same, None), [1.0, 1.0]);
    }
}
