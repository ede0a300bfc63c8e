//! Utilities below every other layer: the millisecond clock (`clock`) and busy
//! polling of a serving thread's sockets (`busy_poll`). Any layer may call in; this imports nothing of ours.

pub mod busy_poll;
pub mod clock;
