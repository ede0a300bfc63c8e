//! `prefix`: the fraction of the request's leading prefix blocks the worker holds
//! (prefix index); a prefix nobody holds names the decision `new_prefix`.

use super::{Candidate, PickView, Prepared, Scorer};
use crate::routing::Reason;

pub struct Prefix;

impl Scorer for Prefix {
    fn score(&self, _: &Prepared, v: &PickView<'_>, c: &Candidate) -> f64 {
        if v.n_blocks == 0 {
            0.0
        } else {
            c.depth as f64 / v.n_blocks as f64
        }
    }

    fn reason(&self) -> Reason {
        Reason::PrefixHit
    }

    fn idle_reason(&self) -> Reason {
        Reason::NewPrefix
    }

    fn override_reason(&self, v: &PickView<'_>) -> Option<Reason> {
        (v.n_blocks > 0 && v.max_depth == 0).then_some(Reason::NewPrefix)
    }

    fn uses_prefix(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{cand, with_view};
    use super::*;

    #[test]
    fn scores_the_held_fraction_and_names_a_new_prefix() {
        let cands = [cand(0, |c| c.depth = 2), cand(1, |_| {})];
        with_view(&cands, None, |mut v| {
            v.n_blocks = 8;
            v.max_depth = 2;
            let p = Prefix.prepare(&v);
            assert_eq!(Prefix.score(&p, &v, &cands[0]), 0.25);
            assert_eq!(Prefix.score(&p, &v, &cands[1]), 0.0);
            assert_eq!(Prefix.override_reason(&v), None);
            v.max_depth = 0;
            assert_eq!(Prefix.override_reason(&v), Some(Reason::NewPrefix));
        });
    }
}
