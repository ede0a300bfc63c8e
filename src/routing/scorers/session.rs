//! `session`: 1 for the rendezvous owner (among the candidates) of the request's
//! session key, else 0; the session key also breaks ties.

use super::{Candidate, PickView, Prepared, Scorer};
use crate::routing::{rendezvous, Reason, RouteRequest};
use xxhash_rust::xxh3::xxh3_64;

pub struct Session;

impl Scorer for Session {
    fn prepare(&self, v: &PickView<'_>) -> Prepared {
        let index = v.req.session_key().and_then(|_| {
            rendezvous::pick(v.key, v.cands.iter().map(|c| (c.i, v.workers[c.i].id_hash)))
        });
        Prepared {
            index,
            ..Default::default()
        }
    }

    fn score(&self, p: &Prepared, _: &PickView<'_>, c: &Candidate) -> f64 {
        (p.index == Some(c.i)) as u8 as f64
    }

    fn reason(&self) -> Reason {
        Reason::Session
    }

    fn tie_key(&self, req: &RouteRequest<'_>) -> Option<u64> {
        req.session_key().map(|s| xxh3_64(s.as_bytes()))
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{cand, scores};
    use super::*;

    #[test]
    fn only_the_owner_scores_and_only_with_a_session_key() {
        let cands = [cand(0, |_| {}), cand(1, |_| {}), cand(2, |_| {})];
        let s = scores(&Session, &cands, Some("alice"));
        assert_eq!(s.iter().sum::<f64>(), 1.0, "{s:?}");
        assert_eq!(scores(&Session, &cands, None), [0.0; 3]);
    }
}
