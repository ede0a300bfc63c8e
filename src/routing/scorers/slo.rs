//! `slo`: the most headroom against the request's latency objectives, by each
//! worker's learnt latency model (`pool::predict`). A candidate predicted to meet
//! every objective scores in [0.5, 1] by its smallest relative headroom; one
//! predicted to miss scores below 0.5, less the further it misses; time the
//! request already spent (in the gateway's queue) counts against its TTFT
//! objective. Without
//! objectives, the shortest predicted time to first token wins. A worker whose
//! model has not learnt enough yet scores 1, so that every worker gets the
//! samples it needs (the queue scorer of the `slo` preset then spreads them).

use super::{Candidate, PickView, Prepared, Scorer};
use crate::pool::predict::{Features, Prediction};
use crate::routing::Reason;

pub struct Slo;

/// What `c`'s model predicts for the request, its cached prefix discounted.
pub fn predict(v: &PickView<'_>, c: &Candidate) -> Option<Prediction> {
    let cached = u64::from(c.depth) * v.block_tokens;
    let f = Features {
        uncached_tokens: v.prompt_tokens.saturating_sub(cached) as f64,
        waiting_tokens: c.pending,
        running: c.queue,
    };
    v.workers.get(c.i)?.state.latency.predict(&f)
}

impl Scorer for Slo {
    /// `lo`: the shortest predicted TTFT among the candidates (ms).
    fn prepare(&self, v: &PickView<'_>) -> Prepared {
        let lo = v
            .cands
            .iter()
            .filter_map(|c| predict(v, c))
            .map(|p| p.ttft_ms)
            .fold(f64::INFINITY, f64::min);
        Prepared {
            lo,
            ..Default::default()
        }
    }

    fn score(&self, prep: &Prepared, v: &PickView<'_>, c: &Candidate) -> f64 {
        let Some(p) = predict(v, c) else {
            return 1.0;
        };
        match p.headroom(&v.req.info.slo, v.req.elapsed_ms) {
            Some(h) if h >= 0.0 => 0.5 + 0.5 * h.min(1.0),
            Some(h) => 0.5 / (1.0 - h),
            None => prep.lo.max(1.0) / p.ttft_ms.max(1.0),
        }
    }

    fn reason(&self) -> Reason {
        Reason::SloHeadroom
    }

    /// A cached prefix shortens the prefill the model predicts.
    fn uses_prefix(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{cand, with_view};
    use super::*;
    use crate::api::{RequestInfo, Slo as Objectives};
    use crate::routing::RouteRequest;

    /// Teach worker `w` of the view a flat TTFT of `ms` and TPOT of `tpot`.
    fn teach(v: &PickView<'_>, w: usize, ms: f64, tpot: f64) {
        for _ in 0..64 {
            v.workers[w]
                .state
                .latency
                .observe(&Features::default(), ms, Some(tpot));
        }
    }

    fn scores_for(slo: Objectives, cands: &[Candidate]) -> Vec<f64> {
        with_view(cands, None, |v| {
            let info = RequestInfo {
                slo,
                ..Default::default()
            };
            let req = RouteRequest::new(&info, None);
            let v = PickView { req: &req, ..v };
            teach(&v, 0, 40.0, 10.0);
            teach(&v, 1, 200.0, 60.0);
            let p = Slo.prepare(&v);
            cands.iter().map(|c| Slo.score(&p, &v, c)).collect()
        })
    }

    #[test]
    fn headroom_orders_workers_and_a_miss_scores_below_a_hit() {
        let cands = [cand(0, |_| {}), cand(1, |_| {}), cand(2, |_| {})];
        let tight = Objectives {
            ttft_ms: Some(100),
            tpot_ms: None,
        };
        let s = scores_for(tight, &cands);
        assert!((s[0] - 0.8).abs() < 0.02, "40 ms against 100 ms: {s:?}");
        assert!(s[1] < 0.5, "200 ms misses 100 ms: {s:?}");
        assert_eq!(s[2], 1.0, "an unlearnt worker is explored: {s:?}");
        let tpot = Objectives {
            ttft_ms: Some(1000),
            tpot_ms: Some(50),
        };
        let s = scores_for(tpot, &cands);
        assert!(s[0] > 0.5 && s[1] < 0.5, "60 ms/token misses 50: {s:?}");
        let none = scores_for(Objectives::default(), &cands);
        assert!(
            (none[0] - 1.0).abs() < 0.02 && (none[1] - 0.2).abs() < 0.02,
            "{none:?}"
        );
    }
}
