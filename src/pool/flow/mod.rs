//! Flow control: when every eligible worker of a pool is saturated (see
//! [`saturation`]), requests wait here instead of queueing blind inside one
//! engine, and are dispatched when capacity frees — a finishing request, a
//! stats scrape that shows room, a new worker — to the worker the policy picks
//! *then*. Strict order between priority classes; weighted fair queuing in
//! tokens within a class ([`wfq`]); bounded by count, body bytes and a TTL per
//! class; optionally a waiting request preempts a lower-class one that has not
//! answered yet.
//!
//! A woken waiter is granted *the turn*, not a worker: it picks again, and if
//! the capacity is gone by then it goes back to its place (its tag is kept).
//! One turn is out at a time: a release while it is out is remembered and
//! replayed when the turn comes back, so a slot freed meanwhile goes to the head
//! of the queue, never to whoever happened to be woken second. New requests
//! never pass a waiter of their class or above.

pub mod saturation;
pub mod share;
pub mod wfq;

pub use crate::config::{Preemption, Priority};

use crate::telemetry::names;
use metrics::{counter, gauge, histogram, SharedString};
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::oneshot;
use tokio::time::Instant;
use wfq::{Tag, Wfq};

/// Why a request could not wait, or stopped waiting.
#[derive(Debug, PartialEq, Eq)]
pub enum QueueError {
    /// The count or byte cap is reached (and nobody of a lower class to shed).
    Full,
    /// Its class's TTL passed.
    Timeout,
    /// Shed to make room for a higher class.
    Evicted,
    /// The request's own deadline (its latency objective, less the best
    /// predicted time to first token) came before its class's TTL.
    Objective,
}

impl QueueError {
    /// The `reason` label of the shed counter.
    pub fn reason(&self) -> &'static str {
        match self {
            QueueError::Full => "full",
            QueueError::Timeout => "ttl",
            QueueError::Evicted => "evicted",
            QueueError::Objective => "slo",
        }
    }
}

/// The queue's bounds and ordering settings.
#[derive(Clone, Debug)]
pub struct QueueLimits {
    pub max_count: usize,
    pub max_bytes: u64,
    /// Per class, indexed by `Priority as usize`.
    pub ttl: [Duration; 4],
    pub max_flows: usize,
    pub preemption: Preemption,
}

/// What a waiter is told.
enum Grant {
    Go,
    Shed,
}

struct Entry {
    tx: oneshot::Sender<Grant>,
    bytes: u64,
}

/// A dispatched request that may still be preempted (no answer yet).
struct Running {
    prio: Priority,
    cancel: oneshot::Sender<()>,
}

struct Inner {
    classes: [BTreeMap<Tag, Entry>; 4],
    wfq: [Wfq; 4],
    count: usize,
    bytes: u64,
    running: BTreeMap<u64, Running>,
    next_running: u64,
    /// Who holds the turn (class, tag, body bytes), if anyone. It is out of
    /// `classes` but still waiting, so it counts against the caps.
    turn: Option<(Priority, Tag, u64)>,
    /// A release came while the turn was out.
    again: bool,
    /// A waiter turned down a worker with room since the last dispatch: a
    /// newcomer may be the one to take it, so its arrival offers a turn.
    room_declined: bool,
}

impl Inner {
    /// Take the turn back from `p` if it holds it; whether a release is owed.
    fn return_turn(&mut self, p: &Place<'_>) -> bool {
        if self.turn != Some((p.prio, p.tag, p.bytes)) {
            return false;
        }
        self.turn = None;
        std::mem::take(&mut self.again)
    }

    /// Waiters held against the caps — queued, plus the one holding the turn —
    /// and their body bytes.
    fn held(&self) -> (usize, u64) {
        let (n, b) = self.turn.map_or((0, 0), |(_, _, b)| (1, b));
        (self.count + n, self.bytes + b)
    }
}

/// One pool's flow-control queue.
pub struct FlowQueue {
    pool: SharedString,
    limits: QueueLimits,
    inner: Mutex<Inner>,
    /// Per class: queued, or granted and not yet dispatched. Read without the
    /// lock to keep new requests behind waiters.
    pending: [AtomicUsize; 4],
    queued: AtomicUsize,
    /// Tokens in flight per fairness flow ([`share`]).
    shares: Mutex<share::Shares>,
}

/// A dispatched request's tokens, counted in its flow's share of the pool's
/// busy slots until dropped (with the request's in-flight guard).
pub struct ShareGuard {
    queue: Arc<FlowQueue>,
    flow: Arc<str>,
    tokens: u64,
}

impl Drop for ShareGuard {
    fn drop(&mut self) {
        let now = crate::runtime::clock::now_ms();
        self.queue.shares.lock().end(&self.flow, self.tokens, now);
    }
}

/// A request's place in the queue, kept across waits (so a waiter whose grant
/// came to nothing goes back to its place). Dropping it leaves the queue.
pub struct Place<'q> {
    queue: &'q FlowQueue,
    prio: Priority,
    tag: Tag,
    bytes: u64,
    started: Instant,
}

/// What a request brings to the queue.
pub struct Ticket<'a> {
    pub prio: Priority,
    /// The fairness flow (tenant or header value).
    pub flow: &'a str,
    pub weight: f64,
    /// Prompt tokens plus expected output tokens.
    pub cost: u64,
    /// Body bytes held while waiting.
    pub bytes: u64,
    /// Preempted once: placed ahead of its class (not charged to its flow again).
    pub front: bool,
    /// It turned down a worker with room (too slow for it): the turn goes on to
    /// the waiters behind it, one of whom may take that worker.
    pub declined: bool,
}

impl FlowQueue {
    pub fn new(pool: SharedString, limits: QueueLimits) -> Self {
        let wfq = std::array::from_fn(|_| Wfq::new(limits.max_flows));
        let shares = Mutex::new(share::Shares::new(limits.max_flows));
        FlowQueue {
            pool,
            limits,
            inner: Mutex::new(Inner {
                classes: Default::default(),
                wfq,
                count: 0,
                bytes: 0,
                running: BTreeMap::new(),
                next_running: 0,
                turn: None,
                again: false,
                room_declined: false,
            }),
            pending: Default::default(),
            queued: AtomicUsize::new(0),
            shares,
        }
    }

    /// Count `tokens` of `flow` (weight `weight`) in flight until the guard
    /// drops (`None`: too many flows tracked already).
    pub fn share(self: &Arc<Self>, flow: &str, weight: f64, tokens: u64) -> Option<ShareGuard> {
        let now = crate::runtime::clock::now_ms();
        let flow = self.shares.lock().start(flow, weight, tokens, now)?;
        Some(ShareGuard {
            queue: self.clone(),
            flow,
            tokens,
        })
    }

    /// `flow` holds more than its weighted share of the pool's tokens in
    /// flight while another flow is active (see [`share`]).
    pub fn over_share(&self, flow: &str, weight: f64) -> bool {
        let now = crate::runtime::clock::now_ms();
        self.shares.lock().over(flow, weight, now)
    }

    /// Requests waiting now.
    pub fn depth(&self) -> usize {
        self.queued.load(Ordering::Relaxed)
    }

    /// Requests waiting now in class `p`.
    pub fn depth_of(&self, p: Priority) -> usize {
        self.inner.lock().classes[p as usize].len()
    }

    pub fn preemption(&self) -> Preemption {
        self.limits.preemption
    }

    /// Waiters the holder of `place` would let go first: every waiter of a
    /// higher class and those ahead of it in its own (none without a place).
    pub fn ahead(&self, place: &Option<Place<'_>>) -> usize {
        let Some(p) = place else { return 0 };
        let inner = self.inner.lock();
        let higher: usize = inner.classes[..p.prio as usize]
            .iter()
            .map(BTreeMap::len)
            .sum();
        higher + inner.classes[p.prio as usize].range(..p.tag).count()
    }

    /// A request of class `prio` must queue even if a worker has room: someone
    /// of its class or above is waiting or about to dispatch.
    pub fn must_wait(&self, prio: Priority) -> bool {
        self.pending[..=prio as usize]
            .iter()
            .any(|n| n.load(Ordering::Acquire) > 0)
    }

    /// Join the queue (first time: stamped by the fair queue and checked against
    /// the caps; later: back to the kept place) and wait for a grant within the
    /// class's TTL, counted from the first wait, or until `by` if that comes
    /// first (the request's own deadline: [`QueueError::Objective`]).
    pub async fn wait<'q>(
        &'q self,
        ticket: &Ticket<'_>,
        place: &mut Option<Place<'q>>,
        by: Option<Instant>,
    ) -> Result<(), QueueError> {
        let (tx, rx) = oneshot::channel();
        let first = place.is_none();
        let (deadline, prio, owed, passed) = {
            let mut inner = self.inner.lock();
            if first {
                *place = Some(self.admit(&mut inner, ticket)?);
            }
            let p = place.as_ref().expect("admitted");
            // Back from a turn that found no room: hand the turn back.
            let owed = inner.return_turn(p);
            inner.classes[p.prio as usize].insert(p.tag, Entry { tx, bytes: p.bytes });
            inner.count += 1;
            inner.bytes += p.bytes;
            self.queued.fetch_add(1, Ordering::Relaxed);
            let passed = ticket.declined.then_some(p.tag);
            inner.room_declined |= ticket.declined;
            let probe = first && inner.turn.is_none() && inner.room_declined;
            (
                p.started + self.limits.ttl[p.prio as usize],
                p.prio,
                owed || probe,
                passed,
            )
        };
        self.set_depth(prio);
        match passed {
            Some(tag) => self.release_after(prio, tag, owed),
            None if owed => self.release(),
            None => {}
        }
        // One preemption per waiter, when it first queues.
        if first && self.limits.preemption != Preemption::Off {
            self.preempt_below(prio);
        }
        let (deadline, expired) = match by {
            Some(by) if by < deadline => (by, QueueError::Objective),
            _ => (deadline, QueueError::Timeout),
        };
        match tokio::time::timeout_at(deadline, rx).await {
            Ok(Ok(Grant::Go)) => Ok(()),
            Ok(Ok(Grant::Shed)) => Err(self.shed(place, QueueError::Evicted)),
            // The sender is only dropped by a grant that failed to send, i.e.
            // never while we hold the receiver; treat it as a timeout anyway.
            Ok(Err(_)) | Err(_) => Err(self.shed(place, expired)),
        }
    }

    /// First wait: caps (shedding a lower class's newest waiter to make room),
    /// then a fair-queue tag.
    fn admit<'q>(&'q self, inner: &mut Inner, t: &Ticket<'_>) -> Result<Place<'q>, QueueError> {
        loop {
            let (count, bytes) = inner.held();
            if count < self.limits.max_count
                && bytes.saturating_add(t.bytes) <= self.limits.max_bytes
            {
                break;
            }
            if !self.evict_below(inner, t.prio) {
                self.count_shed(t.prio, QueueError::Full.reason());
                return Err(QueueError::Full);
            }
        }
        let wfq = &mut inner.wfq[t.prio as usize];
        let (tag, kept) = if t.front {
            (wfq.front(), true)
        } else {
            wfq.stamp(t.flow, t.cost, t.weight)
        };
        if !kept {
            counter!(names::FLOW_MAP_FULL_TOTAL, names::L_POOL => self.pool.clone()).increment(1);
            tracing::debug!(pool = %self.pool, "flow map full: a flow's fair-queue history was not kept");
        }
        self.pending[t.prio as usize].fetch_add(1, Ordering::AcqRel);
        self.count_event(t.prio, "queued");
        Ok(Place {
            queue: self,
            prio: t.prio,
            tag,
            bytes: t.bytes,
            started: crate::runtime::clock::now(),
        })
    }

    /// Tell the newest waiter of the lowest class below `prio` to leave.
    fn evict_below(&self, inner: &mut Inner, prio: Priority) -> bool {
        for class in (prio as usize + 1..4).rev() {
            if let Some((_, e)) = inner.classes[class].pop_last() {
                inner.count -= 1;
                inner.bytes -= e.bytes;
                self.queued.fetch_sub(1, Ordering::Relaxed);
                let _ = e.tx.send(Grant::Shed);
                return true;
            }
        }
        false
    }

    /// A waiter stops waiting with `why`: counted, and its place dropped.
    fn shed(&self, place: &mut Option<Place<'_>>, why: QueueError) -> QueueError {
        if let Some(p) = place.take() {
            self.count_shed(p.prio, why.reason());
        }
        why
    }

    /// Give the turn to the first waiter of the highest class that has one (or,
    /// while the turn is out, remember to once it comes back).
    pub fn release(&self) {
        if self.queued.load(Ordering::Acquire) == 0 {
            return;
        }
        let mut inner = self.inner.lock();
        if inner.turn.is_some() {
            inner.again = true;
            return;
        }
        for class in 0..4 {
            if self.grant_first(&mut inner, class, None) {
                drop(inner);
                self.set_depth(Priority::ALL[class]);
                return;
            }
        }
    }

    /// The waiter at (`prio`, `tag`) turned down a worker with room: offer the
    /// turn to the waiters behind it, in order (a release `owed` meanwhile is
    /// replayed from the head when the turn comes back; nobody behind: now).
    fn release_after(&self, prio: Priority, tag: Tag, owed: bool) {
        let mut inner = self.inner.lock();
        if inner.turn.is_some() {
            inner.again |= owed;
            return;
        }
        for class in prio as usize..4 {
            let after = (class == prio as usize).then_some(tag);
            if self.grant_first(&mut inner, class, after) {
                inner.again = owed;
                drop(inner);
                self.set_depth(Priority::ALL[class]);
                return;
            }
        }
        drop(inner);
        if owed {
            self.release();
        }
    }

    /// Give the turn to the first live waiter of `class` (after `after`, if
    /// given); whether one took it.
    fn grant_first(&self, inner: &mut Inner, class: usize, after: Option<Tag>) -> bool {
        use std::ops::Bound::{Excluded, Unbounded};
        let from = after.map_or(Unbounded, Excluded);
        while let Some(tag) = inner.classes[class]
            .range((from, Unbounded))
            .next()
            .map(|(t, _)| *t)
        {
            let e = inner.classes[class].remove(&tag).expect("just seen");
            inner.count -= 1;
            inner.bytes -= e.bytes;
            self.queued.fetch_sub(1, Ordering::Relaxed);
            if e.tx.send(Grant::Go).is_ok() {
                inner.turn = Some((Priority::ALL[class], tag, e.bytes));
                return true;
            }
            // That waiter left already (timed out, client gone).
        }
        false
    }

    /// The request holding `place` picked a worker: it leaves the queue for
    /// good, and the next waiter is given its turn (there may be more room).
    pub fn dispatched(&self, place: Option<Place<'_>>) {
        if let Some(p) = place {
            self.count_event(p.prio, "dispatched");
            histogram!(names::QUEUE_WAIT_SECONDS, names::L_POOL => self.pool.clone(),
                names::L_CLASS => p.prio.as_str())
            .record(p.started.elapsed().as_secs_f64());
            // Virtual time follows the requests that leave with a worker, not
            // every turn given (a turn may be handed down the queue and declined).
            {
                let mut inner = self.inner.lock();
                inner.wfq[p.prio as usize].served(p.tag);
                inner.room_declined = false;
            }
            // Dropping the place returns the turn; pass it on (maybe more room).
            drop(p);
            self.release();
        }
    }

    /// Register a dispatched request of class `prio` as preemptible until it
    /// answers (drop the returned guard then); the receiver fires on preemption.
    pub fn preemptible(&self, prio: Priority) -> (Preemptible<'_>, oneshot::Receiver<()>) {
        let (cancel, rx) = oneshot::channel();
        let mut inner = self.inner.lock();
        let id = inner.next_running;
        inner.next_running += 1;
        inner.running.insert(id, Running { prio, cancel });
        (Preemptible { queue: self, id }, rx)
    }

    /// Cancel the newest preemptible request of the lowest class below `prio`.
    fn preempt_below(&self, prio: Priority) {
        let mut inner = self.inner.lock();
        let victim = inner
            .running
            .iter()
            .filter(|(_, r)| r.prio > prio)
            .max_by_key(|(id, r)| (r.prio, **id))
            .map(|(id, _)| *id);
        if let Some(r) = victim.and_then(|id| inner.running.remove(&id)) {
            drop(inner);
            if r.cancel.send(()).is_ok() {
                self.count_event(r.prio, "preempted");
            }
        }
    }

    fn count_event(&self, p: Priority, event: &'static str) {
        counter!(names::FLOW_REQUESTS_TOTAL, names::L_POOL => self.pool.clone(),
            names::L_CLASS => p.as_str(), names::L_EVENT => event)
        .increment(1);
    }

    fn count_shed(&self, p: Priority, reason: &'static str) {
        counter!(names::FLOW_SHED_TOTAL, names::L_POOL => self.pool.clone(),
            names::L_CLASS => p.as_str(), names::L_REASON => reason)
        .increment(1);
    }

    fn set_depth(&self, p: Priority) {
        let n = self.depth_of(p);
        gauge!(names::QUEUE_DEPTH, names::L_POOL => self.pool.clone(), names::L_CLASS => p.as_str())
            .set(n as f64);
    }
}

impl Drop for Place<'_> {
    /// Leaving the queue for any reason: out of `pending`, and out of the map if
    /// still in it (a client that went away while waiting).
    fn drop(&mut self) {
        let q = self.queue;
        q.pending[self.prio as usize].fetch_sub(1, Ordering::AcqRel);
        let mut inner = q.inner.lock();
        let owed = inner.return_turn(self);
        let removed = inner.classes[self.prio as usize].remove(&self.tag);
        if let Some(e) = &removed {
            inner.count -= 1;
            inner.bytes -= e.bytes;
            q.queued.fetch_sub(1, Ordering::Relaxed);
        }
        drop(inner);
        if removed.is_some() {
            q.set_depth(self.prio);
        }
        if owed {
            q.release();
        }
    }
}

/// A dispatched request's registration as preemptible; dropped once it answers.
pub struct Preemptible<'q> {
    queue: &'q FlowQueue,
    id: u64,
}

impl Drop for Preemptible<'_> {
    fn drop(&mut self) {
        self.queue.inner.lock().running.remove(&self.id);
    }
}

#[cfg(test)]
mod tests;
