//! Retry budget: retries may not exceed `min + ratio × requests` over the last ten
//! seconds, so retries cannot multiply the load of an outage.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::LazyLock;
use tokio::time::Instant;

const SLOTS: usize = 10;

static EPOCH: LazyLock<Instant> = LazyLock::new(crate::runtime::clock::now);

/// Counts per one-second slot; slots older than the window are ignored.
#[derive(Default)]
struct Window {
    secs: [AtomicU64; SLOTS],
    counts: [AtomicU64; SLOTS],
}

impl Window {
    fn add(&self, now: u64) {
        let i = (now as usize) % SLOTS;
        let s = self.secs[i].load(Ordering::Acquire);
        if s != now
            && self.secs[i]
                .compare_exchange(s, now, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        {
            self.counts[i].store(0, Ordering::Release);
        }
        self.counts[i].fetch_add(1, Ordering::AcqRel);
    }

    fn sum(&self, now: u64) -> u64 {
        (0..SLOTS)
            .filter(|&i| {
                let s = self.secs[i].load(Ordering::Acquire);
                s + SLOTS as u64 > now && s <= now
            })
            .map(|i| self.counts[i].load(Ordering::Acquire))
            .sum()
    }
}

pub struct RetryBudget {
    ratio: f64,
    min: u64,
    requests: Window,
    retries: Window,
}

impl RetryBudget {
    pub fn new(ratio: f64, min: u32) -> Self {
        RetryBudget {
            ratio,
            min: u64::from(min),
            requests: Window::default(),
            retries: Window::default(),
        }
    }

    fn now() -> u64 {
        // Seconds since the epoch, offset by one so slot 0 starts "old".
        EPOCH.elapsed().as_secs() + SLOTS as u64
    }

    /// Count a new client request.
    pub fn on_request(&self) {
        self.requests.add(Self::now());
    }

    /// Take one retry from the budget, if there is one.
    pub fn try_retry(&self) -> bool {
        let now = Self::now();
        let allowed = self.min as f64 + self.ratio * self.requests.sum(now) as f64;
        if (self.retries.sum(now) as f64) < allowed {
            self.retries.add(now);
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retries_are_bounded_by_ratio_plus_reserve() {
        let b = RetryBudget::new(0.1, 2);
        for _ in 0..50 {
            b.on_request();
        }
        let granted = (0..100).filter(|_| b.try_retry()).count();
        assert_eq!(granted, 7); // 2 + 0.1 × 50
    }
}
