//! Baseline policies: round robin and uniform random. They ignore load and
//! prefixes, which makes them the yardstick the real policies are measured against.

use super::{Decision, Policy, Reason, RouteRequest};
use crate::pool::Worker;
use rand::{Rng, RngCore};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// The first acceptable index at or after `start`, wrapping around `n`.
fn first_accepted(
    start: usize,
    n: usize,
    accept: &dyn Fn(usize) -> bool,
    reason: Reason,
) -> Option<Decision> {
    (0..n)
        .map(|k| (start + k) % n)
        .find(|&i| accept(i))
        .map(|index| Decision::new(index, reason))
}

/// Next acceptable worker after a shared rotating cursor. The cursor moves when
/// a decision is recorded, not when one is picked: a pick that is not sent (a
/// dry run, a request held and picked again) does not skip a worker.
#[derive(Default)]
pub struct RoundRobin {
    next: AtomicUsize,
}

impl Policy for RoundRobin {
    fn name(&self) -> &'static str {
        "round_robin"
    }

    fn pick_at(
        &self,
        _req: &RouteRequest<'_>,
        workers: &[Arc<Worker>],
        accept: &dyn Fn(usize) -> bool,
        _now: u64,
        _rng: &mut dyn RngCore,
    ) -> Option<Decision> {
        let start = self.next.load(Ordering::Relaxed);
        first_accepted(start, workers.len(), accept, Reason::RoundRobin)
    }

    /// Needs neither the clock nor randomness: the default `pick` would read both.
    fn pick(
        &self,
        req: &RouteRequest<'_>,
        workers: &[Arc<Worker>],
        accept: &dyn Fn(usize) -> bool,
    ) -> Option<Decision> {
        self.pick_at(
            req,
            workers,
            accept,
            0,
            &mut rand::rngs::mock::StepRng::new(0, 0),
        )
    }

    fn record(&self, decision: &Decision, _req: &RouteRequest<'_>, _workers: &[Arc<Worker>]) {
        self.next.store(decision.index + 1, Ordering::Relaxed);
    }
}

/// A uniformly random acceptable worker.
pub struct RandomPolicy;

impl Policy for RandomPolicy {
    fn name(&self) -> &'static str {
        "random"
    }

    fn pick_at(
        &self,
        _req: &RouteRequest<'_>,
        workers: &[Arc<Worker>],
        accept: &dyn Fn(usize) -> bool,
        _now: u64,
        rng: &mut dyn RngCore,
    ) -> Option<Decision> {
        if workers.is_empty() {
            return None;
        }
        let start = rng.gen_range(0..workers.len());
        first_accepted(start, workers.len(), accept, Reason::Random)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::RequestInfo;
    use crate::routing::test_support::workers;

    fn req(info: &RequestInfo) -> RouteRequest<'_> {
        RouteRequest::new(info, None)
    }

    #[test]
    fn round_robin_cycles_and_skips_refused() {
        let ws = workers(3);
        let info = RequestInfo::default();
        let rr = RoundRobin::default();
        let r = req(&info);
        let sent = |accept: &dyn Fn(usize) -> bool| {
            let d = rr.pick(&r, &ws, accept).unwrap();
            rr.record(&d, &r, &ws);
            d.index
        };
        let picks: Vec<usize> = (0..6).map(|_| sent(&|_| true)).collect();
        assert_eq!(picks, vec![0, 1, 2, 0, 1, 2]);
        for _ in 0..6 {
            assert_ne!(sent(&|i| i != 1), 1);
        }
        // A pick that is not sent moves nothing.
        let next = rr.pick(&r, &ws, &|_| true).unwrap().index;
        assert_eq!(rr.pick(&r, &ws, &|_| true).unwrap().index, next);
        assert!(rr.pick(&req(&info), &ws, &|_| false).is_none());
        assert!(rr.pick(&req(&info), &[], &|_| true).is_none());
    }

    #[test]
    fn random_covers_all_and_honours_accept() {
        let ws = workers(4);
        let info = RequestInfo::default();
        let mut seen = [0u32; 4];
        for _ in 0..400 {
            let d = RandomPolicy.pick(&req(&info), &ws, &|i| i != 2).unwrap();
            seen[d.index] += 1;
        }
        assert_eq!(seen[2], 0);
        assert!(seen[0] > 50 && seen[1] > 50 && seen[3] > 50, "{seen:?}");
    }
}
