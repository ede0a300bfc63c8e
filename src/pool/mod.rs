//! The pools and their workers: who the workers are, what they serve, and their
//! live counters. An immutable [`PoolSet`] is swapped through `ArcSwap` when
//! the config or a worker list changes; background tasks (discovery, health,
//! stats) keep the workers' state current.

mod addresses;
pub mod block_size;
pub mod dcgm;
pub mod discovery;
mod dns;
pub mod fleet;
pub mod flow;
pub mod gauges;
pub mod health;
mod inference_pool;
pub mod k8s;
pub mod predict;
mod registry;
pub mod scaling;
pub mod stats;
mod worker;

pub use addresses::admit_admin_worker;
pub use discovery::spawn_model_discovery;
pub use dns::spawn_dns_discovery;
pub use health::spawn_health_checks;
pub use k8s::spawn_k8s_discovery;
pub use registry::{AddWorkerError, PoolRuntime, PoolSet, Registry};
pub use stats::spawn_stats_poller;
pub use worker::{InFlightGuard, RequestSize, Reservation, Role, Worker, WorkerState};
