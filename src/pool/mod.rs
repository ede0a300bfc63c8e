//! The worker registry: who the workers are, what they serve, and their live
//! counters. Requests read an immutable [`Snapshot`] through `ArcSwap`; background
//! tasks (model discovery, later stats and health) build and swap a new one.

pub mod admission;
pub mod dcgm;
pub mod discovery;
mod dns;
pub mod fleet;
pub mod gauges;
pub mod health;
mod inference_pool;
pub mod k8s;
pub mod predict;
mod registry;
pub mod scaling;
pub mod stats;
mod worker;

pub use discovery::spawn_model_discovery;
pub use dns::spawn_dns_discovery;
pub use health::spawn_health_checks;
pub use k8s::spawn_k8s_discovery;
pub use registry::{ModelRoute, PoolRuntime, Registry, Resolved, Snapshot, SplitRoute};
pub use stats::spawn_stats_poller;
pub use worker::{InFlightGuard, RequestSize, Role, Worker, WorkerState};
