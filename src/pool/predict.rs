//! Online latency models: per worker (and pooled per accelerator kind), what the
//! next request's time to first token and time per output token will be, learnt
//! from the TTFT and inter-token gaps the gateway measures on every response.
//!
//! * TTFT ≈ a + b·uncached + c·waiting + d·running, where `uncached` is the
//!   request's prompt tokens the worker must prefill (thousands), `waiting` the
//!   prefill work queued ahead of it on the worker (thousands of tokens; the
//!   stats' `pending_tokens`, which counts waiting requests) and `running` the
//!   requests queued or running there;
//! * TPOT ≈ e + f·running (the batch the request decodes in).
//!
//! Each is a recursive-least-squares fit with exponential forgetting: O(1) per
//! update on fixed-size arrays, no allocation. Updates take a small lock (and
//! skip the sample when it is contended); predictions read the coefficients from
//! atomics, so routing never locks.

use super::stats::WorkerStats;
use arc_swap::ArcSwapOption;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

/// Samples a model needs before its own predictions are used (before that, the
/// worker's kind's model speaks for it, when it has enough).
pub const MIN_SAMPLES: u64 = 8;
/// Forgetting factor: a sample's weight halves after about 140 newer ones, so the
/// fit follows a worker whose behaviour changes (another tenant, a new model).
const LAMBDA: f64 = 0.995;
/// Initial covariance (weak prior around zero coefficients).
const P0: f64 = 1.0e4;
/// Label naming a worker's accelerator kind (workers sharing it share a model).
pub const KIND_LABEL: &str = "accelerator";

/// What the model knows about a request at dispatch.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Features {
    /// Prompt tokens the worker must prefill.
    pub uncached_tokens: f64,
    /// Prefill tokens queued ahead on the worker.
    pub waiting_tokens: f64,
    /// Requests queued or running on the worker.
    pub running: f64,
}

impl Features {
    /// The load `stats` shows now, for a request bringing `uncached_tokens`.
    pub fn of(stats: &WorkerStats, in_flight: u64, now: u64, uncached_tokens: u64) -> Features {
        // The newest scrape is used however old it is: the model learns from what
        // it saw, and a stale worker's features are still its best description.
        let load = stats.load(in_flight, now, u64::MAX);
        Features {
            uncached_tokens: uncached_tokens as f64,
            waiting_tokens: load.pending_tokens,
            running: load.queue,
        }
    }

    fn ttft_x(&self) -> [f64; 4] {
        [
            1.0,
            self.uncached_tokens / 1000.0,
            self.waiting_tokens / 1000.0,
            self.running,
        ]
    }

    fn tpot_x(&self) -> [f64; 2] {
        [1.0, self.running + 1.0]
    }
}

/// A request's dispatch as the model saw it: its features, the prediction
/// (`f32`; NaN: no prediction) and when it was sent (ms after arrival, set with
/// [`Dispatch::at`]).
#[derive(Clone, Copy, Debug)]
pub struct Dispatch([f32; 6]);

/// A [`Dispatch`] kept beside a request until its answer ends (the attempt
/// that answers writes last); empty until set.
#[derive(Debug)]
pub struct DispatchCell([AtomicU32; 6]);

impl Default for DispatchCell {
    fn default() -> Self {
        DispatchCell(std::array::from_fn(|_| AtomicU32::new(f32::NAN.to_bits())))
    }
}

impl DispatchCell {
    pub fn set(&self, d: Dispatch) {
        for (slot, v) in self.0.iter().zip(d.0) {
            slot.store(v.to_bits(), Ordering::Relaxed);
        }
    }

    /// Forget the dispatch: the answer came from somewhere it does not describe.
    pub fn clear(&self) {
        self.set(Dispatch([f32::NAN; 6]));
    }

    /// The last dispatch set; `None` before any (or after a clear).
    pub fn get(&self) -> Option<Dispatch> {
        let d = Dispatch(std::array::from_fn(|i| {
            f32::from_bits(self.0[i].load(Ordering::Relaxed))
        }));
        (!d.0[0].is_nan()).then_some(d)
    }
}

impl Dispatch {
    pub fn new(f: &Features, p: Option<Prediction>) -> Dispatch {
        let ttft = p.map_or(f32::NAN, |p| p.ttft_ms as f32);
        let tpot = p.and_then(|p| p.tpot_ms).map_or(f32::NAN, |t| t as f32);
        Dispatch([
            f.uncached_tokens as f32,
            f.waiting_tokens as f32,
            f.running as f32,
            ttft,
            tpot,
            0.0,
        ])
    }

    /// The same dispatch, sent `ms` after the request arrived.
    pub fn at(mut self, ms: f64) -> Dispatch {
        self.0[5] = ms as f32;
        self
    }

    /// When it was sent, ms after the request arrived.
    pub fn sent_ms(&self) -> f64 {
        f64::from(self.0[5])
    }

    pub fn features(&self) -> Features {
        Features {
            uncached_tokens: f64::from(self.0[0]),
            waiting_tokens: f64::from(self.0[1]),
            running: f64::from(self.0[2]),
        }
    }

    pub fn prediction(&self) -> Option<Prediction> {
        let some = |v: f32| (!v.is_nan()).then_some(f64::from(v));
        Some(Prediction {
            ttft_ms: some(self.0[3])?,
            tpot_ms: some(self.0[4]),
        })
    }
}

/// Predicted latencies of one request on one worker (milliseconds).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Prediction {
    pub ttft_ms: f64,
    /// `None` until decode gaps have been seen.
    pub tpot_ms: Option<f64>,
}

impl Prediction {
    /// The smallest relative headroom against the request's objectives,
    /// `(target − predicted) / target` (negative: missed), with `elapsed_ms`
    /// already spent counted against the TTFT target; `None` when the request
    /// sets no objective the prediction covers.
    pub fn headroom(&self, slo: &crate::api::Slo, elapsed_ms: f64) -> Option<f64> {
        let rel = |target: u32, predicted: f64| {
            let t = f64::from(target);
            (t - predicted) / t
        };
        let ttft = slo.ttft_ms.map(|t| rel(t, elapsed_ms + self.ttft_ms));
        let tpot = slo.tpot_ms.zip(self.tpot_ms).map(|(t, p)| rel(t, p));
        match (ttft, tpot) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

/// A recursive-least-squares fit of `N` coefficients.
#[derive(Debug)]
struct Rls<const N: usize> {
    theta: [f64; N],
    p: [[f64; N]; N],
}

impl<const N: usize> Default for Rls<N> {
    fn default() -> Self {
        let mut p = [[0.0; N]; N];
        for (i, row) in p.iter_mut().enumerate() {
            row[i] = P0;
        }
        Rls { theta: [0.0; N], p }
    }
}

impl<const N: usize> Rls<N> {
    /// Fold in one observation `y` at `x`.
    fn update(&mut self, x: [f64; N], y: f64) {
        let mut px = [0.0; N];
        for (i, v) in px.iter_mut().enumerate() {
            *v = (0..N).map(|j| self.p[i][j] * x[j]).sum();
        }
        let denom = LAMBDA + (0..N).map(|i| x[i] * px[i]).sum::<f64>();
        if !denom.is_finite() || denom <= 0.0 {
            return;
        }
        let err = y - dot(&self.theta, &x);
        for (i, row) in self.p.iter_mut().enumerate() {
            let k = px[i] / denom;
            self.theta[i] += k * err;
            for (cell, pxj) in row.iter_mut().zip(&px) {
                *cell = (*cell - k * pxj) / LAMBDA;
            }
        }
        self.bound();
    }

    /// No wind-up: in a direction the traffic never excites (e.g. `waiting` while
    /// the fleet is idle) forgetting would grow the covariance without bound, so
    /// each variance is capped at the prior's by scaling its row and column
    /// (D·P·D keeps P symmetric positive definite).
    fn bound(&mut self) {
        for i in 0..N {
            let v = self.p[i][i];
            if v > P0 {
                let s = (P0 / v).sqrt();
                for j in 0..N {
                    self.p[i][j] *= s;
                    self.p[j][i] *= s;
                }
            }
        }
    }
}

fn dot<const N: usize>(a: &[f64; N], b: &[f64; N]) -> f64 {
    (0..N).map(|i| a[i] * b[i]).sum()
}

/// Coefficients published for lock-free reads (f64 bits).
#[derive(Debug)]
struct Published<const N: usize> {
    theta: [AtomicU64; N],
    samples: AtomicU64,
}

impl<const N: usize> Default for Published<N> {
    fn default() -> Self {
        Published {
            theta: std::array::from_fn(|_| AtomicU64::new(0)),
            samples: AtomicU64::new(0),
        }
    }
}

impl<const N: usize> Published<N> {
    fn store(&self, theta: &[f64; N]) {
        for (slot, v) in self.theta.iter().zip(theta) {
            slot.store(v.to_bits(), Ordering::Relaxed);
        }
        self.samples.fetch_add(1, Ordering::Relaxed);
    }

    fn predict(&self, x: &[f64; N]) -> Option<f64> {
        if self.samples.load(Ordering::Relaxed) < MIN_SAMPLES {
            return None;
        }
        let theta: [f64; N] =
            std::array::from_fn(|i| f64::from_bits(self.theta[i].load(Ordering::Relaxed)));
        let y = dot(&theta, x);
        y.is_finite().then_some(y.max(0.0))
    }
}

/// One worker's (or one kind's) latency model.
#[derive(Debug, Default)]
pub struct LatencyModel {
    fit: Mutex<(Rls<4>, Rls<2>)>,
    ttft: Published<4>,
    tpot: Published<2>,
    /// The model of the worker's accelerator kind, fed alongside and used while
    /// this one has too few samples.
    kind: ArcSwapOption<LatencyModel>,
}

impl LatencyModel {
    /// Share `kind`'s model with the other workers of the same kind.
    pub fn set_kind(&self, kind: Option<Arc<LatencyModel>>) {
        self.kind.store(kind);
    }

    /// Samples of TTFT learnt so far.
    pub fn samples(&self) -> u64 {
        self.ttft.samples.load(Ordering::Relaxed)
    }

    /// Learn from one finished request: its features at dispatch, its measured
    /// TTFT and (streams with two or more tokens) mean inter-token gap.
    pub fn observe(&self, f: &Features, ttft_ms: f64, tpot_ms: Option<f64>) {
        if let Some(kind) = self.kind.load().as_deref() {
            kind.observe_own(f, ttft_ms, tpot_ms);
        }
        self.observe_own(f, ttft_ms, tpot_ms);
    }

    fn observe_own(&self, f: &Features, ttft_ms: f64, tpot_ms: Option<f64>) {
        if !ttft_ms.is_finite() || ttft_ms < 0.0 {
            return;
        }
        // A contended lock means another response of the same worker is being
        // learnt this instant; dropping this sample costs little.
        let Some(mut fit) = self.fit.try_lock() else {
            return;
        };
        fit.0.update(f.ttft_x(), ttft_ms);
        self.ttft.store(&fit.0.theta);
        if let Some(t) = tpot_ms.filter(|t| t.is_finite() && *t >= 0.0) {
            fit.1.update(f.tpot_x(), t);
            self.tpot.store(&fit.1.theta);
        }
    }

    /// The predicted latencies of a request with features `f`: this worker's
    /// model once it has [`MIN_SAMPLES`], else its kind's; `None` when neither
    /// has learnt enough.
    pub fn predict(&self, f: &Features) -> Option<Prediction> {
        let own = self.ttft.predict(&f.ttft_x());
        let (ttft, tpot) = match own {
            Some(t) => (t, self.tpot.predict(&f.tpot_x())),
            None => {
                let kind = self.kind.load();
                let k = kind.as_deref()?;
                (k.ttft.predict(&f.ttft_x())?, k.tpot.predict(&f.tpot_x()))
            }
        };
        Some(Prediction {
            ttft_ms: ttft,
            tpot_ms: tpot,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn feat(u: f64, w: f64, r: f64) -> Features {
        Features {
            uncached_tokens: u,
            waiting_tokens: w,
            running: r,
        }
    }

    /// A worker whose TTFT is 20 + 70·ktok + 60·kwaiting + 3·running ms (± 5 %),
    /// and TPOT 8 + 0.5·batch ms.
    fn truth(f: &Features) -> (f64, f64) {
        let t =
            20.0 + 70.0 * f.uncached_tokens / 1e3 + 60.0 * f.waiting_tokens / 1e3 + 3.0 * f.running;
        (t, 8.0 + 0.5 * (f.running + 1.0))
    }

    #[test]
    fn the_fit_converges_on_a_noisy_linear_worker() {
        let m = LatencyModel::default();
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for _ in 0..2000 {
            let f = feat(
                rng.gen_range(0.0..4000.0),
                rng.gen_range(0.0..8000.0),
                rng.gen_range(0.0..32.0_f64).floor(),
            );
            let (t, p) = truth(&f);
            let noise = 1.0 + rng.gen_range(-0.05..0.05);
            m.observe(&f, t * noise, Some(p * noise));
        }
        for f in [feat(100.0, 0.0, 1.0), feat(3000.0, 5000.0, 20.0)] {
            let got = m.predict(&f).unwrap();
            let (t, p) = truth(&f);
            assert!((got.ttft_ms - t).abs() / t < 0.1, "ttft {got:?} vs {t}");
            assert!(
                (got.tpot_ms.unwrap() - p).abs() / p < 0.1,
                "tpot {got:?} vs {p}"
            );
        }
    }

    #[test]
    fn the_fit_follows_a_worker_that_slows_down() {
        let m = LatencyModel::default();
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let mut feed = |scale: f64| {
            for _ in 0..1500 {
                let f = feat(rng.gen_range(0.0..2000.0), 0.0, rng.gen_range(0.0..8.0));
                m.observe(&f, scale * truth(&f).0, None);
            }
        };
        feed(1.0);
        feed(3.0);
        let f = feat(1000.0, 0.0, 2.0);
        let got = m.predict(&f).unwrap().ttft_ms;
        let want = 3.0 * truth(&f).0;
        assert!((got - want).abs() / want < 0.1, "{got} vs {want}");
    }

    #[test]
    fn a_new_worker_borrows_its_kinds_model_until_it_has_its_own() {
        let kind = Arc::new(LatencyModel::default());
        let (a, b) = (LatencyModel::default(), LatencyModel::default());
        a.set_kind(Some(kind.clone()));
        b.set_kind(Some(kind.clone()));
        let f = feat(500.0, 0.0, 1.0);
        assert_eq!(b.predict(&f), None, "nobody has learnt anything");
        for _ in 0..50 {
            a.observe(&f, 40.0, None);
        }
        assert_eq!(b.samples(), 0);
        let borrowed = b.predict(&f).expect("the kind's model speaks for b");
        assert!((borrowed.ttft_ms - 40.0).abs() < 1.0, "{borrowed:?}");
        for _ in 0..50 {
            b.observe(&f, 90.0, None);
        }
        let own = b.predict(&f).unwrap().ttft_ms;
        assert!((own - 90.0).abs() < 1.0, "b's own samples win: {own}");
    }

    #[test]
    fn a_dispatch_round_trips_through_its_cell() {
        let cell = DispatchCell::default();
        assert!(cell.get().is_none(), "nothing sent yet");
        let f = feat(300.0, 1200.0, 3.0);
        let p = Prediction {
            ttft_ms: 42.5,
            tpot_ms: None,
        };
        cell.set(Dispatch::new(&f, Some(p)).at(7.0));
        let d = cell.get().unwrap();
        assert_eq!(
            (d.features(), d.prediction(), d.sent_ms()),
            (f, Some(p), 7.0)
        );
        cell.set(Dispatch::new(&f, None));
        assert_eq!(cell.get().unwrap().prediction(), None);
    }

    #[test]
    fn bad_samples_are_ignored_and_predictions_stay_finite() {
        let m = LatencyModel::default();
        for _ in 0..MIN_SAMPLES {
            m.observe(&feat(1e3, 0.0, 1.0), f64::NAN, Some(f64::INFINITY));
            m.observe(&feat(1e3, 0.0, 1.0), -5.0, None);
        }
        assert_eq!(m.samples(), 0);
        for _ in 0..MIN_SAMPLES {
            m.observe(&feat(1e3, 0.0, 1.0), 50.0, None);
        }
        let p = m.predict(&feat(1e12, 1e12, 1e9)).unwrap();
        assert!(p.ttft_ms.is_finite() && p.ttft_ms >= 0.0 && p.tpot_ms.is_none());
    }
}
