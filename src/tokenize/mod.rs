//! Gateway-side tokenization: a request's prompt as the engine's tokens, so
//! routing can look it up in the engines' own KV-cache index (`kv_events/`) and
//! limits can use exact prompt token counts. [`PromptTokenizer`] is the
//! interface: [`HfTokenizer`] loads a Hugging Face model directory (`template`
//! renders chat templates the way vLLM does, `cache` keeps the tokens of shared
//! prompt segments); [`sim::SimTokenizer`] tokenizes exactly as `switchyard sim`
//! does. Which one a pool uses is its `tokenizer` setting ([`build`]).

mod cache;
mod conversation;
mod hf;
pub mod sim;
mod template;

pub use cache::{CacheStats, SegmentCache};
pub use hf::HfTokenizer;
pub use template::{ChatTemplate, ContentFormat};

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

/// The tokenizer a pool's `tokenizer` setting names. An `hf` path may name the
/// model directory or its `tokenizer.json`; `chat_template` is a file whose text
/// replaces the model's own template.
pub fn build(cfg: &TokenizerConfig) -> Result<Arc<dyn PromptTokenizer>, String> {
    match cfg {
        TokenizerConfig::Sim => Ok(Arc::new(sim::SimTokenizer)),
        TokenizerConfig::Hf {
            path,
            chat_template,
        } => {
            let path = std::path::Path::new(path);
            if !path.exists() {
                return Err(format!("{}: no such file or directory", path.display()));
            }
            let dir = if path.is_file() {
                path.parent().unwrap_or(path)
            } else {
                path
            };
            let template = match chat_template {
                Some(f) => Some(
                    std::fs::read_to_string(f).map_err(|e| format!("chat template {f}: {e}"))?,
                ),
                None => None,
            };
            let t = HfTokenizer::from_dir(dir, template).map_err(|e| e.to_string())?;
            Ok(Arc::new(t))
        }
    }
}
