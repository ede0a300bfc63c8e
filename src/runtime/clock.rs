//! The gateway's millisecond clock: one monotonic scale for stats ages, health
//! and routing state, on tokio's clock so paused-time tests can move it.

use std::sync::OnceLock;
use tokio::time::Instant;

/// Milliseconds on the gateway's monotonic clock (tokio's, so paused-time tests
/// work). Starts at 1 so that 0 can mean "never".
pub fn now_ms() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    let epoch = *EPOCH.get_or_init(now);
    now().saturating_duration_since(epoch).as_millis() as u64 + 1
}

/// The current instant: the one place the gateway reads the time (`clippy.toml`
/// bans `Instant::now` elsewhere), on tokio's clock.
#[allow(clippy::disallowed_methods)]
#[inline]
pub fn now() -> Instant {
    Instant::now()
}
