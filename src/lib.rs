//! Switchyard: an L7 inference gateway for OpenAI-compatible engines.
//!
//! Layers, highest first: `server` (listeners, limits, handlers) → `proxy` (forward,
//! retry, observe; P/D) → `routing` / `tenancy` → `pool` (workers, snapshot) →
//! `upstream` (client) → `telemetry` → `config`, `api`, `runtime`. A layer uses
//! only layers below it (`tests/layers.rs` checks; docs/architecture.md#layers).
#![forbid(unsafe_code)]

pub mod api;
pub mod cli;
pub mod config;
pub mod demo;
pub mod epp;
pub mod pool;
pub mod proxy;
pub mod routing;
pub mod runtime;
pub mod server;
pub mod sim;
pub mod telemetry;
pub mod tenancy;
pub mod upstream;
