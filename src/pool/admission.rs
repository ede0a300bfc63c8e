//! Backpressure: when every eligible worker of a pool is at its concurrency limit,
//! requests wait here — bounded in size and time, FIFO within a priority class —
//! and are woken when a request of the pool finishes.

use crate::telemetry::names;
use metrics::{histogram, SharedString};
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tokio::sync::oneshot;
use tokio::time::Instant;

/// Priority classes, highest first (`x-switchyard-priority: high|normal|low`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Priority {
    High = 0,
    Normal = 1,
    Low = 2,
}

impl Priority {
    pub fn parse(s: Option<&str>) -> Priority {
        match s {
            Some("high") => Priority::High,
            Some("low") => Priority::Low,
            _ => Priority::Normal,
        }
    }
}

/// Why a request could not wait.
#[derive(Debug, PartialEq, Eq)]
pub enum QueueError {
    Full,
    Timeout,
}

pub struct AdmissionQueue {
    pool: SharedString,
    capacity: usize,
    timeout: Duration,
    waiting: AtomicUsize,
    classes: [Mutex<VecDeque<oneshot::Sender<()>>>; 3],
}

impl AdmissionQueue {
    pub fn new(pool: SharedString, capacity: usize, timeout: Duration) -> Self {
        AdmissionQueue {
            pool,
            capacity,
            timeout,
            waiting: AtomicUsize::new(0),
            classes: Default::default(),
        }
    }

    pub fn depth(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
    }

    /// Wait to be woken by a finishing request (then the caller picks again), up to
    /// the queue timeout counted from `started`. A release that lands between the
    /// caller's failed pick and joining the queue is not lost for long: the next
    /// finishing request wakes the waiter.
    pub async fn wait(&self, prio: Priority, started: Instant) -> Result<(), QueueError> {
        if self.waiting.fetch_add(1, Ordering::AcqRel) >= self.capacity {
            self.waiting.fetch_sub(1, Ordering::AcqRel);
            return Err(QueueError::Full);
        }
        let (tx, rx) = oneshot::channel();
        self.classes[prio as usize].lock().push_back(tx);
        let deadline = started + self.timeout;
        let r = tokio::time::timeout_at(deadline, rx).await;
        self.waiting.fetch_sub(1, Ordering::AcqRel);
        histogram!(names::QUEUE_WAIT_SECONDS, names::L_POOL => self.pool.clone())
            .record(started.elapsed().as_secs_f64());
        match r {
            Ok(_) => Ok(()),
            Err(_) => Err(QueueError::Timeout),
        }
    }

    /// A request of this pool finished: wake the first waiter of the highest class.
    pub fn release(&self) {
        if self.waiting.load(Ordering::Acquire) == 0 {
            return;
        }
        for class in &self.classes {
            let mut q = class.lock();
            while let Some(tx) = q.pop_front() {
                if tx.send(()).is_ok() {
                    return;
                }
                // That waiter timed out already; try the next.
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[tokio::test(start_paused = true)]
    async fn full_queue_refuses_and_waiters_time_out() {
        let q = Arc::new(AdmissionQueue::new(
            "p".into(),
            1,
            Duration::from_millis(100),
        ));
        let q2 = q.clone();
        let first = tokio::spawn(async move {
            q2.wait(Priority::Normal, crate::runtime::clock::now())
                .await
        });
        tokio::task::yield_now().await;
        assert_eq!(q.depth(), 1);
        assert_eq!(
            q.wait(Priority::Normal, crate::runtime::clock::now()).await,
            Err(QueueError::Full)
        );
        assert_eq!(first.await.unwrap(), Err(QueueError::Timeout));
    }

    #[tokio::test(start_paused = true)]
    async fn high_priority_is_woken_first() {
        let q = Arc::new(AdmissionQueue::new("p".into(), 8, Duration::from_secs(10)));
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for (name, prio) in [
            ("low", Priority::Low),
            ("normal", Priority::Normal),
            ("high", Priority::High),
        ] {
            let (q, order) = (q.clone(), order.clone());
            tasks.push(tokio::spawn(async move {
                q.wait(prio, crate::runtime::clock::now()).await.unwrap();
                order.lock().push(name);
            }));
            tokio::task::yield_now().await;
        }
        for _ in 0..3 {
            q.release();
            tokio::task::yield_now().await;
        }
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(*order.lock(), vec!["high", "normal", "low"]);
    }
}
