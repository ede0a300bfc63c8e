//! Thread-per-core serving for `switchyard serve`: one single-threaded tokio
//! runtime per serving thread, each with its own `SO_REUSEPORT` listener and its
//! own upstream connection pool. A request is accepted, routed, forwarded and
//! answered on one thread, so no wake-up crosses threads on the hot path (the
//! largest single cost of a multi-threaded work-stealing runtime at this scale).
//! Background work (health checks, stats polling, discovery, telemetry) stays on
//! the runtime that started the gateway.

use super::{serve_with_permits, Gateway};
use std::net::SocketAddr;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;
use tokio::sync::watch;

/// Bind `n` listeners on `addr` with `SO_REUSEPORT`, so the kernel spreads new
/// connections over them, once no other process listens there
/// (`server/listen.rs`). Port 0 picks one free port shared by all of them.
pub fn bind(addr: SocketAddr, n: usize) -> std::io::Result<Vec<std::net::TcpListener>> {
    super::listen::bind_shared(addr, n, "server.listen")
}

/// Serving threads started by [`start`]; [`Shards::join`] waits for their drain.
pub struct Shards {
    threads: Vec<JoinHandle<()>>,
}

/// Start one serving thread per listener. Each serves until `stop` turns true,
/// then drains for up to `drain`. The connection cap is shared by all of them.
pub fn start(
    gw: Arc<Gateway>,
    listeners: Vec<std::net::TcpListener>,
    stop: watch::Receiver<bool>,
    drain: Duration,
) -> std::io::Result<Shards> {
    let cap = gw.registry.config().server.max_connections;
    let permits = Arc::new(tokio::sync::Semaphore::new(cap));
    let busy_poll = gw.registry.config().server.busy_poll;
    let mut threads = Vec::with_capacity(listeners.len());
    for (i, listener) in listeners.into_iter().enumerate() {
        let gw = gw.clone();
        let permits = permits.clone();
        let mut stop = stop.clone();
        let t = std::thread::Builder::new()
            .name(format!("switchyard-serve-{i}"))
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        tracing::error!(error = %e, shard = i, "cannot build the serving runtime");
                        return;
                    }
                };
                rt.block_on(async move {
                    gw.client.pin_to_thread();
                    tokio::spawn(housekeeping());
                    if !busy_poll.is_zero() {
                        let spun =
                            metrics::counter!(crate::telemetry::names::BUSY_POLL_MICROSECONDS);
                        tokio::spawn(crate::runtime::busy_poll::run(busy_poll, spun));
                    }
                    let listener = match tokio::net::TcpListener::from_std(listener) {
                        Ok(l) => l,
                        Err(e) => {
                            tracing::error!(error = %e, shard = i, "cannot register the listener");
                            return;
                        }
                    };
                    let signal = async move {
                        let _ = stop.wait_for(|v| *v).await;
                    };
                    if let Err(e) = serve_with_permits(listener, gw, signal, drain, permits).await {
                        tracing::error!(error = %e, shard = i, "serving thread stopped");
                    }
                });
            })?;
        threads.push(t);
    }
    Ok(Shards { threads })
}

/// How often a serving thread does its housekeeping.
const TICK: Duration = Duration::from_secs(1);

/// A serving thread's periodic chores: close idle upstream connections.
///
/// The tick also keeps the runtime's timer wheel from being empty. tokio wakes a
/// parked runtime through its eventfd whenever a timer is armed earlier than the
/// driver's next wake-up. With no timer pending, the deadlines a request arms
/// (header read, first byte, idle) did that once per request when the thread had
/// been idle: a `write` to the eventfd and a needless event-loop turn. With this
/// tick pending, every deadline at least a tick away is armed without waking
/// anything.
async fn housekeeping() {
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        crate::upstream::UpstreamClient::sweep_idle_connections();
    }
}

impl Shards {
    /// Wait (blocking) until every serving thread has drained and exited.
    pub fn join(self) {
        for t in self.threads {
            let _ = t.join();
        }
    }
}
