//! Switchyard: an L7 inference gateway for OpenAI-compatible engines.
#![forbid(unsafe_code)]

pub mod sim;
