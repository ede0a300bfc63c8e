//! Opt-in busy polling for a serving thread (`server.busy_poll_us`).
//!
//! A parked serving thread sleeps in `epoll_wait`, and every request then costs
//! two wake-ups (the client's request, the worker's answer). On a virtual
//! machine a wake-up of an idle CPU is often the largest single cost of a fast
//! request. With busy polling on, each serving thread keeps polling its sockets
//! (a zero-timeout `epoll_wait` per turn) for a window after the last request
//! activity before it parks, so an answer or the next request that arrives
//! within the window is picked up without any wake-up.
//!
//! The price is CPU: while traffic flows, each serving thread spins its core
//! instead of sleeping, which takes that core from anything else on the host.
//! It suits deployments with cores dedicated to the gateway and answers that
//! come back within the window (embeddings, cached or short completions, health
//! probes); streamed tokens tens of milliseconds apart still park between them.
//! Off by default.
// Spinning measures wall time directly, below the clock's abstraction.
#![allow(clippy::disallowed_methods)]

use std::cell::Cell;
use std::future::poll_fn;
use std::task::{Poll, Waker};
use std::time::{Duration, Instant};

thread_local! {
    /// Bumped by [`touch`] on each request start and end on this thread.
    static ACTIVITY: Cell<u64> = const { Cell::new(0) };
    /// The spinner's waker while it is parked (no recent activity).
    static PARKED: Cell<Option<Waker>> = const { Cell::new(None) };
    /// Spin turns taken on this thread (tests read it).
    static TURNS: Cell<u64> = const { Cell::new(0) };
}

/// Mark request activity on this thread: restarts the spin window and wakes a
/// parked spinner. A thread-local increment (and a rare same-thread wake), so
/// it costs next to nothing when busy polling is off.
#[inline]
pub(crate) fn touch() {
    ACTIVITY.with(|a| a.set(a.get().wrapping_add(1)));
    if let Some(w) = PARKED.with(Cell::take) {
        w.wake();
    }
}

/// The spinner: run as a task on a current-thread runtime. While the last
/// activity is less than `window` old it yields after every turn, which makes
/// the runtime poll its sockets without blocking (tokio parks with a zero
/// timeout while a yielded task is waiting); then it parks until the next
/// [`touch`]. Time spent spinning is added to `spun_us` (microseconds).
pub(crate) async fn run(window: Duration, spun_us: metrics::Counter) {
    let mut seen = ACTIVITY.with(Cell::get);
    loop {
        // Spin: from the last activity until a whole window passes without any.
        let started = Instant::now();
        let mut until = started + window;
        loop {
            let now_seen = ACTIVITY.with(Cell::get);
            let now = Instant::now();
            if now_seen != seen {
                seen = now_seen;
                until = now + window;
            } else if now >= until {
                spun_us.increment((now - started).as_micros() as u64);
                break;
            }
            TURNS.with(|t| t.set(t.get() + 1));
            // Let anything else runnable on this CPU go first (the load
            // generator, a co-located engine): spinning must not starve them.
            std::thread::yield_now();
            tokio::task::yield_now().await;
        }
        // Park until the next request activity.
        poll_fn(|cx| {
            if ACTIVITY.with(Cell::get) != seen {
                return Poll::Ready(());
            }
            PARKED.with(|p| p.set(Some(cx.waker().clone())));
            Poll::Pending
        })
        .await;
        seen = ACTIVITY.with(Cell::get);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Yield until `cond` holds (at most `limit`), counting turns.
    async fn until(limit: Duration, what: &str, mut cond: impl FnMut() -> bool) {
        let end = Instant::now() + limit;
        while !cond() {
            assert!(Instant::now() < end, "timed out waiting for: {what}");
            tokio::task::yield_now().await;
        }
    }

    /// Spin turns this thread's spinner has taken so far.
    fn turns() -> u64 {
        TURNS.with(Cell::get)
    }

    fn parked() -> bool {
        PARKED.with(|p| {
            let w = p.take();
            let parked = w.is_some();
            p.set(w);
            parked
        })
    }

    #[tokio::test(flavor = "current_thread")]
    async fn spins_after_activity_parks_after_the_window_and_resumes_on_touch() {
        let window = Duration::from_millis(20);
        let spinner = tokio::spawn(run(window, metrics::Counter::noop()));
        // Idle at start: after its first window the spinner parks.
        until(Duration::from_secs(5), "the spinner parks", parked).await;
        // Parked: many turns of the runtime, no spin turns.
        let before = turns();
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        assert_eq!(turns(), before, "a parked spinner takes no turns");
        // Activity wakes it: it spins again.
        let touched = Instant::now();
        touch();
        // One turn proves it: a woken spinner takes at least one before it looks
        // at the clock, however late the thread runs.
        until(Duration::from_secs(5), "spinning after touch", || {
            turns() > before
        })
        .await;
        // Then parks again, not before a whole window after the activity.
        until(Duration::from_secs(5), "parks again", parked).await;
        assert!(
            touched.elapsed() >= window,
            "parked before its window passed"
        );
        spinner.abort();
    }
}
