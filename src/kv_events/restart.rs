//! Engine restarts seen through `/metrics`: the engine's process start time
//! (`process_start_time_seconds`, exported by vLLM's and SGLang's Python
//! process collector) changes when a new process serves the worker's address.
//!
//! The stats poller (`pool/stats.rs`) writes what each scrape says into the
//! worker's [`EngineStart`]; the worker's KV-event subscriber reads it on every
//! batch and probe through a [`StartWatch`] and resyncs when it changed. That
//! catches a restart the event stream cannot show: no replay endpoint to probe
//! and a new process that has published nothing yet (so no sequence going back).

use std::sync::atomic::{AtomicU64, Ordering};

/// The engine's start time as the last scrapes reported it. Shared by the
/// worker's stats (writer) and its subscriber (reader).
#[derive(Debug, Default)]
pub struct EngineStart {
    /// Start time in Unix milliseconds; meaningful once `scrapes` > 0.
    start_ms: AtomicU64,
    /// Scrapes that reported a start time, ever.
    scrapes: AtomicU64,
}

impl EngineStart {
    /// A scrape reported `secs` (Unix seconds); non-finite or negative values
    /// are ignored.
    pub fn observe(&self, secs: f64) {
        if !(secs.is_finite() && secs >= 0.0) {
            return;
        }
        self.start_ms
            .store((secs * 1000.0).round() as u64, Ordering::Relaxed);
        self.scrapes.fetch_add(1, Ordering::Release);
    }

    /// The newest start time reported, Unix ms; `None` before any.
    pub fn get_ms(&self) -> Option<u64> {
        let (n, ms) = self.read();
        (n > 0).then_some(ms)
    }

    /// (scrapes so far, the newest start time in Unix ms).
    fn read(&self) -> (u64, u64) {
        let n = self.scrapes.load(Ordering::Acquire);
        (n, self.start_ms.load(Ordering::Relaxed))
    }
}

/// What a [`StartWatch::check`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Seen {
    /// No new scrape, or the same start time.
    Same,
    /// The first start time since the last rebase, in Unix ms: now the known one.
    Adopted(u64),
    /// Another start time than the known one, in Unix ms: a new engine process.
    Restarted(u64),
}

/// A subscriber's view of its engine's start time.
#[derive(Debug)]
pub struct StartWatch {
    src: std::sync::Arc<EngineStart>,
    /// The start time of the engine the index currently describes.
    known: Option<u64>,
    /// Scrapes at the last rebase: only later ones speak for the new session.
    since: u64,
}

impl StartWatch {
    pub fn new(src: std::sync::Arc<EngineStart>) -> StartWatch {
        let since = src.read().0;
        StartWatch {
            src,
            known: None,
            since,
        }
    }

    /// The worker was resynced for another reason (start, reconnect, sequence
    /// reset): forget the known start and adopt the next scrape's, so a scrape
    /// that lags behind the resync does not count as a second restart.
    pub fn rebase(&mut self) {
        self.known = None;
        self.since = self.src.read().0;
    }

    /// Compare the scrapes' start time with the known one: a different one
    /// means the engine restarted (and becomes the known one).
    pub fn check(&mut self) -> Seen {
        let (n, start) = self.src.read();
        if n <= self.since {
            return Seen::Same;
        }
        match self.known.replace(start) {
            Some(k) if k == start => Seen::Same,
            Some(_) => Seen::Restarted(start),
            None => Seen::Adopted(start),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_changed_start_time_is_a_restart_once() {
        let s = Arc::new(EngineStart::default());
        let mut w = StartWatch::new(s.clone());
        assert_eq!(w.check(), Seen::Same, "nothing scraped yet");
        s.observe(1_700_000_000.25);
        assert_eq!(w.check(), Seen::Adopted(1_700_000_000_250));
        s.observe(1_700_000_000.25);
        assert_eq!(w.check(), Seen::Same);
        s.observe(1_700_000_300.5);
        assert_eq!(w.check(), Seen::Restarted(1_700_000_300_500));
        assert_eq!(w.check(), Seen::Same, "the new start time is adopted");
        s.observe(f64::NAN);
        s.observe(-1.0);
        assert_eq!(w.check(), Seen::Same, "bad values are ignored");
    }

    #[test]
    fn a_rebase_ignores_scrapes_from_before_it() {
        let s = Arc::new(EngineStart::default());
        let mut w = StartWatch::new(s.clone());
        s.observe(100.0);
        assert_eq!(w.check(), Seen::Adopted(100_000));
        // The stream showed the restart first (sequence reset) and resynced;
        // the scrape reporting the new start time comes later.
        w.rebase();
        assert_eq!(w.check(), Seen::Same, "no scrape since the resync");
        s.observe(200.0);
        assert_eq!(w.check(), Seen::Adopted(200_000), "not a second restart");
        s.observe(200.0);
        assert_eq!(w.check(), Seen::Same);
    }
}
