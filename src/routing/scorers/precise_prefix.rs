//! `precise_prefix`: the share of the request's prompt the worker holds by its own
//! KV-cache events (the pool's precise index, `kv_events/`), each block weighted
//! by the tier it sits in (GPU > CPU > disk). Where the pool has no usable precise
//! index (no tokenizer, a worker without events or refused, still syncing) it
//! scores like `prefix` on the approximate index instead.

use super::{Candidate, PickView, Prepared, Scorer};
use crate::routing::Reason;

pub struct PrecisePrefix;

impl Scorer for PrecisePrefix {
    fn score(&self, p: &Prepared, v: &PickView<'_>, c: &Candidate) -> f64 {
        if v.precise {
            c.precise
        } else {
            super::Prefix.score(p, v, c)
        }
    }

    fn reason(&self) -> Reason {
        Reason::PrefixHit
    }

    fn idle_reason(&self) -> Reason {
        Reason::NewPrefix
    }

    fn override_reason(&self, v: &PickView<'_>) -> Option<Reason> {
        if v.precise {
            (v.max_precise <= 0.0).then_some(Reason::NewPrefix)
        } else {
            super::Prefix.override_reason(v)
        }
    }

    fn uses_prefix(&self) -> bool {
        true
    }

    fn uses_precise(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{cand, with_view};
    use super::*;

    #[test]
    fn scores_the_precise_share_and_falls_back_to_the_approximate_one() {
        let cands = [cand(0, |c| {
            c.depth = 2;
            c.precise = 0.75;
        })];
        with_view(&cands, None, |mut v| {
            v.n_blocks = 8;
            v.max_depth = 2;
            let p = PrecisePrefix.prepare(&v);
            assert_eq!(PrecisePrefix.score(&p, &v, &cands[0]), 0.25, "approximate");
            v.precise = true;
            v.max_precise = 0.75;
            assert_eq!(PrecisePrefix.score(&p, &v, &cands[0]), 0.75, "precise");
            assert_eq!(PrecisePrefix.override_reason(&v), None);
            v.max_precise = 0.0;
            assert_eq!(PrecisePrefix.override_reason(&v), Some(Reason::NewPrefix));
        });
    }
}
