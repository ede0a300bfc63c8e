//! One upstream engine and its shared live state.

use super::flow::{FlowQueue, ShareGuard};
use super::health::HealthState;
use super::predict::{Dispatch, Features, LatencyModel, Prediction};
use super::stats::WorkerStats;
use arc_swap::ArcSwap;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

/// What a worker does in a disaggregated pool (label `role`; default `both`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Prefill,
    Decode,
    Both,
}

impl Role {
    pub fn from_label(v: Option<&str>) -> Role {
        match v {
            Some("prefill") => Role::Prefill,
            Some("decode") => Role::Decode,
            _ => Role::Both,
        }
    }
}

/// A worker as seen by one snapshot. Cheap to clone; the live state is shared
/// across snapshots (and reloads) as long as the worker's URL is unchanged.
#[derive(Debug)]
pub struct Worker {
    /// Normalised base URL; also the worker's identity and metric label.
    pub id: Arc<str>,
    pub scheme: http::uri::Scheme,
    pub authority: http::uri::Authority,
    /// `authority` as a `Host` header value, built once.
    pub host: http::HeaderValue,
    /// Path prefix before `/v1/...`, without trailing slash (usually empty).
    pub path_prefix: Arc<str>,
    pub labels: BTreeMap<String, String>,
    pub role: Role,
    /// The declared region of the `region` label (set by the registry); `None`
    /// when unlabelled or not declared in `[regions]`.
    pub region: Option<crate::config::RegionId>,
    /// xxh3 of `id`, computed once for rendezvous hashing.
    pub id_hash: u64,
    pub state: Arc<WorkerState>,
}

/// Live counters of a worker; atomics only, written on the request path.
#[derive(Debug)]
pub struct WorkerState {
    pub in_flight: AtomicU64,
    pub requests: AtomicU64,
    pub failures: AtomicU64,
    pub healthy: AtomicBool,
    pub draining: AtomicBool,
    /// Models from the worker's `/v1/models` (discovered pools only).
    pub discovered_models: ArcSwap<Vec<String>>,
    /// Why the last model discovery failed, while it keeps failing.
    pub discovery_error: arc_swap::ArcSwapOption<String>,
    /// Engine stats from the poller plus the gateway's corrections (`pool::stats`).
    pub stats: WorkerStats,
    pub health: HealthState,
    /// Learnt TTFT/TPOT model (`pool::predict`), fed when responses finish.
    pub latency: LatencyModel,
}

impl Default for WorkerState {
    fn default() -> Self {
        WorkerState {
            in_flight: AtomicU64::new(0),
            requests: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            healthy: AtomicBool::new(true),
            draining: AtomicBool::new(false),
            discovered_models: ArcSwap::from_pointee(Vec::new()),
            discovery_error: arc_swap::ArcSwapOption::empty(),
            stats: WorkerStats::default(),
            health: HealthState::default(),
            latency: LatencyModel::default(),
        }
    }
}

impl Worker {
    /// `healthy`, `ejected`, `draining` or `overloaded`: the state the admin API
    /// and the dashboard show.
    pub fn state_name(&self) -> &'static str {
        let s = &self.state;
        if !s.healthy.load(Ordering::Relaxed) {
            "ejected"
        } else if s.draining.load(Ordering::Relaxed) {
            "draining"
        } else if s.health.overloaded.load(Ordering::Relaxed) {
            "overloaded"
        } else {
            "healthy"
        }
    }

    /// Build from a normalised URL (see `config::normalize_worker_url`).
    pub fn new(
        url: &str,
        labels: BTreeMap<String, String>,
        state: Arc<WorkerState>,
    ) -> Result<Worker, String> {
        let uri: http::Uri = url.parse().map_err(|e| format!("{url}: {e}"))?;
        let parts = uri.into_parts();
        let scheme = parts.scheme.ok_or_else(|| format!("{url}: no scheme"))?;
        let authority = parts.authority.ok_or_else(|| format!("{url}: no host"))?;
        let host =
            http::HeaderValue::from_str(authority.as_str()).map_err(|e| format!("{url}: {e}"))?;
        let prefix = parts
            .path_and_query
            .map(|p| p.path().trim_end_matches('/').to_string())
            .unwrap_or_default();
        Ok(Worker {
            id: Arc::from(url),
            scheme,
            authority,
            host,
            path_prefix: Arc::from(prefix),
            role: Role::from_label(labels.get("role").map(String::as_str)),
            region: None,
            labels,
            id_hash: xxhash_rust::xxh3::xxh3_64(url.as_bytes()),
            state,
        })
    }

    /// A plain `http://` worker: served over this thread's HTTP/1 connections.
    pub fn is_plain_http(&self) -> bool {
        self.scheme == http::uri::Scheme::HTTP
    }

    /// Eligible for new requests: not ejected, not draining, not cooling down after a 429.
    pub fn is_available(&self) -> bool {
        self.state.healthy.load(Ordering::Relaxed)
            && !self.state.draining.load(Ordering::Relaxed)
            && !self.state.health.overloaded.load(Ordering::Relaxed)
    }

    /// Count a request as in flight until the guard drops; the guard then wakes a
    /// request waiting in `queue`, if any. `size` says how much prefill work the
    /// request brings; it counts as pending until [`InFlightGuard::first_token`] or
    /// the drop.
    pub fn begin(&self, queue: Option<&Arc<FlowQueue>>, size: RequestSize) -> InFlightGuard {
        self.state.in_flight.fetch_add(1, Ordering::Relaxed);
        self.started(queue.cloned(), size)
    }

    /// Take a slot at pick time, before the request is sent: it counts as in
    /// flight at once, so a request dispatched from the queue on another thread
    /// meanwhile sees the worker as it will be. [`Worker::begin_reserved`] turns
    /// it into the request's guard; dropped unused, it frees the slot.
    pub fn reserve(&self, queue: Option<&Arc<FlowQueue>>) -> Reservation {
        self.state.in_flight.fetch_add(1, Ordering::Relaxed);
        Reservation {
            slot: Some((self.state.clone(), queue.cloned())),
            share: None,
        }
    }

    /// [`Worker::reserve`] only while fewer than `limit` are in flight (0: no
    /// limit), atomically: two threads picking the worker's last slot at once
    /// cannot both take it.
    pub fn try_reserve(&self, limit: u64, queue: Option<&Arc<FlowQueue>>) -> Option<Reservation> {
        self.state
            .in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (limit == 0 || n < limit).then_some(n + 1)
            })
            .ok()?;
        Some(Reservation {
            slot: Some((self.state.clone(), queue.cloned())),
            share: None,
        })
    }

    /// [`Worker::begin`] on a slot [`Worker::reserve`] took.
    pub fn begin_reserved(&self, mut r: Reservation, size: RequestSize) -> InFlightGuard {
        let queue = r.slot.take().and_then(|(_, q)| q);
        let mut guard = self.started(queue, size);
        guard.share = r.share.take();
        guard
    }

    fn started(&self, queue: Option<Arc<FlowQueue>>, size: RequestSize) -> InFlightGuard {
        self.state.requests.fetch_add(1, Ordering::Relaxed);
        self.state
            .stats
            .note_started(size.tokens, size.prefill_tokens);
        InFlightGuard {
            state: self.state.clone(),
            queue,
            prefill: Some((size.prefill_tokens, size.bytes)),
            share: None,
        }
    }

    /// The request's dispatch as the latency model sees it: the load it meets
    /// (take it before [`Worker::begin`] adds the request's own) and the
    /// prediction.
    pub fn dispatch(&self, size: RequestSize) -> Dispatch {
        let f = self.features(size);
        Dispatch::new(&f, self.state.latency.predict(&f))
    }

    /// What the latency model would see for a request of `size` sent now.
    pub fn features(&self, size: RequestSize) -> Features {
        Features::of(
            &self.state.stats,
            self.in_flight(),
            super::stats::now_ms(),
            size.prefill_tokens,
        )
    }

    /// The latencies the worker's model predicts for a request of `size` sent now.
    pub fn predict(&self, size: RequestSize) -> Option<Prediction> {
        self.state.latency.predict(&self.features(size))
    }

    pub fn in_flight(&self) -> u64 {
        self.state.in_flight.load(Ordering::Relaxed)
    }
}

/// The size of a request as routing estimates it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RequestSize {
    /// Bytes of routing text (prompt).
    pub bytes: u64,
    /// Estimated prompt tokens.
    pub tokens: u64,
    /// Estimated prompt tokens the worker must prefill (not cached there).
    pub prefill_tokens: u64,
}

impl RequestSize {
    /// Estimated from the routing text's length at `bytes_per_token`, `cached`
    /// of its tokens expected in the worker's prefix cache.
    pub fn estimate(text_bytes: u64, bytes_per_token: std::num::NonZeroU32, cached: u64) -> Self {
        let tokens = text_bytes / u64::from(bytes_per_token.get());
        RequestSize {
            bytes: text_bytes,
            tokens,
            prefill_tokens: tokens.saturating_sub(cached),
        }
    }
}

/// A slot taken on a worker by a pick whose request is not sent yet.
pub struct Reservation {
    slot: Option<(Arc<WorkerState>, Option<Arc<FlowQueue>>)>,
    /// The request's tokens in its flow's share, held as long as the slot
    /// (boxed: most pools keep no shares, and the guard moves with every body).
    share: Option<Box<ShareGuard>>,
}

impl Reservation {
    /// Hold `share` with the slot (and the guard it becomes).
    pub fn with_share(mut self, share: Option<ShareGuard>) -> Self {
        self.share = share.map(Box::new);
        self
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if let Some((state, queue)) = self.slot.take() {
            state.in_flight.fetch_sub(1, Ordering::Relaxed);
            drop(self.share.take());
            if let Some(q) = queue {
                q.release();
            }
        }
    }
}

/// Decrements the worker's in-flight count when the response body ends or is dropped.
pub struct InFlightGuard {
    state: Arc<WorkerState>,
    queue: Option<Arc<FlowQueue>>,
    /// Prefill tokens still counted as pending on the worker, and the prompt bytes.
    prefill: Option<(u64, u64)>,
    share: Option<Box<ShareGuard>>,
}

impl InFlightGuard {
    pub fn state(&self) -> &Arc<WorkerState> {
        &self.state
    }

    /// Teach the worker's latency model what a request dispatched as `d`
    /// measured (a completed answer's TTFT and mean inter-token gap).
    pub fn learn(
        &self,
        d: &Dispatch,
        ttft: std::time::Duration,
        tpot: Option<std::time::Duration>,
    ) {
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        self.state
            .latency
            .observe(&d.features(), ms(ttft), tpot.map(ms));
    }

    /// The first token arrived: the request's prefill is done (idempotent).
    pub fn first_token(&mut self) {
        if let Some((tokens, bytes)) = self.prefill.take() {
            self.state.stats.note_prefilled(tokens, Some(bytes));
        }
    }
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        if let Some((tokens, _)) = self.prefill.take() {
            self.state.stats.note_prefilled(tokens, None);
        }
        self.state.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.state.stats.note_finished();
        // The share first: the waiter woken next judges the shares as they are.
        drop(self.share.take());
        if let Some(q) = &self.queue {
            q.release();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guard_decrements_on_drop() {
        let w = Worker::new("http://h:1/pre", BTreeMap::new(), Default::default()).unwrap();
        assert_eq!(&*w.path_prefix, "/pre");
        let g1 = w.begin(None, RequestSize::default());
        let g2 = w.begin(None, RequestSize::default());
        assert_eq!(w.in_flight(), 2);
        drop(g1);
        assert_eq!(w.in_flight(), 1);
        drop(g2);
        assert_eq!(w.in_flight(), 0);
        assert_eq!(w.state.requests.load(Ordering::Relaxed), 2);
        // A reservation counts at once; it becomes the guard or is given back.
        let r = w.reserve(None);
        assert_eq!(w.in_flight(), 1);
        drop(r);
        assert_eq!(w.in_flight(), 0);
        let g = w.begin_reserved(w.reserve(None), RequestSize::default());
        assert_eq!(w.in_flight(), 1);
        assert!(w.try_reserve(1, None).is_none(), "the last slot is taken");
        drop(g);
        assert_eq!(w.in_flight(), 0);
        assert!(w.try_reserve(1, None).is_some());
    }
}
