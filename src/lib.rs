//! Switchyard: an L7 inference gateway for OpenAI-compatible engines.
//!
//! Layers, highest first: `server` (listeners, limits, handlers) → `proxy` (forward,
//! retry, observe; P/D) → `routing` / `tenancy` → `pool` (workers, snapshot) →
//! `upstream` (client) → `telemetry` → `config`, `api`, `runtime`. A layer uses
//! only layers below it (`tests/layers.rs` checks; docs/architecture.md#layers).
#![forbid(unsafe_code)]
// clippy.toml names what is banned; the ban holds for the gateway's own code (tests
// and benches, which are not on the request path, allow it in Cargo.toml).
#![deny(clippy::disallowed_methods, clippy::disallowed_types)]

pub mod api;
pub mod cli;
pub mod config;
pub mod demo;
pub mod epp;
pub mod kv_events;
pub mod pool;
pub mod proxy;
pub mod routes;
pub mod routing;
pub mod runtime;
pub mod server;
pub mod sim;
pub mod telemetry;
pub mod tenancy;
pub mod tokenize;
pub mod upstream;
