//! Switchyard: an L7 inference gateway for OpenAI-compatible engines.
//!
//! Layers, in request order: `server` (listener, limits, errors) → `api` (inspect the
//! body) → `routing` (pick a worker from a `pool` snapshot) → `proxy` (forward,
//! retry, observe) → `telemetry` (metrics). `config` is read by all and imports none.
#![forbid(unsafe_code)]

pub mod api;
pub mod cli;
pub mod config;
pub mod dashboard;
pub mod demo;
pub mod disagg;
pub mod pool;
pub mod proxy;
pub mod routing;
pub mod server;
pub mod sim;
pub mod telemetry;
pub mod tenancy;
