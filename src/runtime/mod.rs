//! Utilities below every other layer: the millisecond clock (`clock`), busy
//! polling of a serving thread's sockets (`busy_poll`) and a gateway's drain
//! (`drain`: requests alive, the cut at the drain deadline). Any layer may call in; this imports nothing of ours.

pub mod busy_poll;
pub mod clock;
pub mod drain;
