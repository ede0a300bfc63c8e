//! The route table: for each model name a client may ask for, the pool, the
//! policy and the workers that serve it. Built on the pool layer's
//! [`PoolSet`](crate::pool::PoolSet) (rebuilt on each of its changes) with the
//! routing layer's policies; requests read an immutable [`Snapshot`] and keep
//! the one they started with.

mod table;

pub use table::{ModelRoute, Resolved, RouteTable, Snapshot, SplitRoute};
