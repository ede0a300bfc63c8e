//! Gateway-side tokenization: a request's prompt as the engine's tokens, so
//! routing can look it up in the engines' own KV-cache index and limits can use
//! exact prompt token counts. `hf` loads a Hugging Face model directory,
//! `template` renders chat templates the way vLLM does, `cache` keeps the
//! tokens of shared prompt segments.

mod cache;
mod conversation;
mod hf;
mod template;

pub use cache::{CacheStats, SegmentCache};
pub use hf::HfTokenizer;
pub use template::{ChatTemplate, ContentFormat};

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
