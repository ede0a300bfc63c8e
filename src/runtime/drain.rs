//! One gateway's drain: how many requests are alive, and the cut at the drain
//! deadline. The server starts the drain and cuts; each response body still
//! streaming waits on [`Live::cut_signal`] and ends with its error event when
//! cut, so a client sees why its stream stopped. The counts let the shutdown log
//! say what actually happened (requests that finished, streams cut).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use tokio::sync::Notify;

/// Not started: the in-flight count at the drain's start is unknown.
const NOT_STARTED: u64 = u64::MAX;

/// Shared by a gateway and every request it serves.
#[derive(Clone)]
pub struct Drain(Arc<Inner>);

struct Inner {
    cut: AtomicBool,
    notify: Notify,
    /// Woken when the last request alive ends during a drain.
    ended: Notify,
    /// Requests alive (a [`Live`] each).
    live: AtomicU64,
    /// Requests alive when the drain started.
    at_start: AtomicU64,
    /// Requests alive at the deadline (`NOT_STARTED`: not cut).
    at_cut: AtomicU64,
    /// Streams that ended with the error event at the deadline.
    cut_streams: AtomicU64,
    /// Requests with no answer yet at the deadline, answered 503.
    refused: AtomicU64,
}

impl Default for Drain {
    fn default() -> Self {
        Drain(Arc::new(Inner {
            cut: AtomicBool::new(false),
            notify: Notify::new(),
            ended: Notify::new(),
            live: AtomicU64::new(0),
            at_start: AtomicU64::new(NOT_STARTED),
            at_cut: AtomicU64::new(NOT_STARTED),
            cut_streams: AtomicU64::new(0),
            refused: AtomicU64::new(0),
        }))
    }
}

/// What a drain did, for its log line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DrainReport {
    /// Requests alive when it started.
    pub at_start: u64,
    /// Streams cut at the deadline with the error event.
    pub cut: u64,
    /// Requests still waiting for an answer (body, queue, upstream's first
    /// byte) at the deadline, answered 503 `drain_deadline`.
    pub refused: u64,
    /// Requests alive at the deadline (cut streams and refused ones included);
    /// 0 when every request finished before it.
    pub at_deadline: u64,
}

impl Drain {
    /// Count one request alive until the returned guard drops.
    pub fn live(&self) -> Live {
        self.0.live.fetch_add(1, Ordering::Relaxed);
        Live(self.0.clone())
    }

    /// Note the requests alive as the drain starts (the first call counts:
    /// every serving thread of one gateway starts it).
    pub fn begin(&self) {
        let alive = self.0.live.load(Ordering::Relaxed);
        let _ = self.0.at_start.compare_exchange(
            NOT_STARTED,
            alive,
            Ordering::Relaxed,
            Ordering::Relaxed,
        );
    }

    /// Requests alive now.
    pub fn alive(&self) -> u64 {
        self.0.live.load(Ordering::Relaxed)
    }

    /// Resolves once no request is alive (checked again on each end).
    pub async fn quiet(&self) {
        loop {
            let ended = self.0.ended.notified();
            tokio::pin!(ended);
            ended.as_mut().enable();
            if self.alive() == 0 {
                return;
            }
            ended.await;
        }
    }

    /// The drain deadline passed: every stream still waiting ends now.
    pub fn cut(&self) {
        let alive = self.0.live.load(Ordering::Relaxed);
        let _ = self.0.at_cut.compare_exchange(
            NOT_STARTED,
            alive,
            Ordering::Relaxed,
            Ordering::Relaxed,
        );
        self.0.cut.store(true, Ordering::Release);
        self.0.notify.notify_waiters();
    }

    /// Resolves at the drain deadline: a request with no answer yet then
    /// gets a 503 instead of a cut connection. Not boxed: one per request.
    pub async fn deadline(&self) {
        loop {
            let notified = self.0.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.0.cut.load(Ordering::Acquire) {
                return;
            }
            notified.await;
        }
    }

    /// A request without an answer was refused at the deadline.
    pub fn count_refused(&self) {
        self.0.refused.fetch_add(1, Ordering::Relaxed);
    }

    pub fn report(&self) -> DrainReport {
        let known = |a: &AtomicU64| match a.load(Ordering::Relaxed) {
            NOT_STARTED => 0,
            n => n,
        };
        DrainReport {
            at_start: known(&self.0.at_start),
            cut: self.0.cut_streams.load(Ordering::Relaxed),
            refused: self.0.refused.load(Ordering::Relaxed),
            at_deadline: known(&self.0.at_cut),
        }
    }
}

/// One request alive; dropped when it ends.
pub struct Live(Arc<Inner>);

impl Live {
    /// Resolves when the drain deadline cuts the gateway's streams (made once per
    /// streaming response, and only when it has to wait for the upstream).
    pub fn cut_signal(&self) -> Pin<Box<dyn Future<Output = ()> + Send + Sync>> {
        let inner = self.0.clone();
        Box::pin(async move {
            loop {
                let notified = inner.notify.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                if inner.cut.load(Ordering::Acquire) {
                    return;
                }
                notified.await;
            }
        })
    }

    /// This request's stream was cut at the deadline.
    pub fn count_cut(&self) {
        self.0.cut_streams.fetch_add(1, Ordering::Relaxed);
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        let was = self.0.live.fetch_sub(1, Ordering::Relaxed);
        if was == 1 && self.0.at_start.load(Ordering::Relaxed) != NOT_STARTED {
            self.0.ended.notify_waiters();
        }
    }
}

impl std::fmt::Debug for Live {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Live")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_cut_wakes_waiters_registered_before_and_after_it() {
        let d = Drain::default();
        let (a, b) = (d.live(), d.live());
        d.begin();
        let waiting = tokio::spawn(a.cut_signal());
        tokio::task::yield_now().await;
        d.cut();
        waiting.await.unwrap();
        b.cut_signal().await;
        b.count_cut();
        d.deadline().await;
        d.count_refused();
        drop(a);
        assert_eq!(
            d.report(),
            DrainReport {
                at_start: 2,
                cut: 1,
                refused: 1,
                at_deadline: 2
            }
        );
    }
}
