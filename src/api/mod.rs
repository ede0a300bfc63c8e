//! The few OpenAI wire shapes the gateway reads or writes: the request features it
//! inspects for routing, the error body, and the models list.

pub mod anthropic;
pub mod error;
pub mod headers;
pub mod inspect;
pub mod models;
pub mod slo;

pub use error::ErrorBody;
pub use inspect::{inspect, Endpoint, RequestInfo};
pub use slo::Slo;
