//! A request's prompt as the engine tokenizes it, for routing on the engines' own
//! KV-cache contents (`kv_events/`): the gateway must compute the same token ids the
//! engine will, so a prompt's blocks can be looked up in the precise index.
//!
//! [`PromptTokenizer`] is the interface; [`sim::SimTokenizer`] tokenizes exactly as
//! `switchyard sim` does (same chat template, same ids). Which one a pool uses is
//! its `tokenizer` setting ([`build`]).

pub mod sim;

use crate::config::TokenizerConfig;
use std::sync::Arc;

/// A request's prompt as the engine tokenizes it.
pub trait PromptTokenizer: Send + Sync {
    /// The prompt tokens the engine would build from this request body (chat
    /// messages rendered through the model's chat template with the generation prompt).
    fn prompt_tokens(
        &self,
        endpoint: crate::api::inspect::Endpoint,
        body: &[u8],
    ) -> Result<std::sync::Arc<[u32]>, TokenizeError>;
}
#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    #[error("{0}")]
    Unsupported(String),
    #[error("{0}")]
    Invalid(String),
}

/// The tokenizer a pool's `tokenizer` setting names.
pub fn build(cfg: &TokenizerConfig) -> Result<Arc<dyn PromptTokenizer>, String> {
    match cfg {
        TokenizerConfig::Sim => Ok(Arc::new(sim::SimTokenizer)),
        TokenizerConfig::Hf { .. } => Err("hf tokenizer not built in".into()),
    }
}
