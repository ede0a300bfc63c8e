//! The simulated engine's tokenizer as a [`PromptTokenizer`]: the same parsing
//! of the request body and the same chat template as `switchyard sim`
//! (`sim::api::prompt_token_ids`), so the gateway's block keys for a prompt are
//! the ones the sim's KV events carry.

use super::{PromptTokenizer, TokenizeError};
use crate::api::inspect::Endpoint;
use crate::sim::api::{prompt_token_ids, PromptKind};
use std::sync::Arc;

/// `tokenizer = "sim"`.
pub struct SimTokenizer;

impl PromptTokenizer for SimTokenizer {
    fn prompt_tokens(&self, endpoint: Endpoint, body: &[u8]) -> Result<Arc<[u32]>, TokenizeError> {
        let kind = match endpoint {
            Endpoint::ChatCompletions => PromptKind::Chat,
            Endpoint::Completions => PromptKind::Completion,
            Endpoint::Responses => PromptKind::Responses,
            e => {
                return Err(TokenizeError::Unsupported(format!(
                    "{} requests have no prompt to look up",
                    e.as_str()
                )))
            }
        };
        prompt_token_ids(kind, body)
            .map(Arc::from)
            .map_err(TokenizeError::Invalid)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_matches_the_sims_template() {
        let body = br#"{"model":"m","messages":[{"role":"user","content":"hi there"}]}"#;
        let ids = SimTokenizer
            .prompt_tokens(Endpoint::ChatCompletions, body)
            .unwrap();
        assert_eq!(
            &ids[..],
            &crate::sim::tokenizer::encode_chat([("user", "hi there")])[..]
        );
        assert!(matches!(
            SimTokenizer.prompt_tokens(Endpoint::Embeddings, body),
            Err(TokenizeError::Unsupported(_))
        ));
        assert!(matches!(
            SimTokenizer.prompt_tokens(Endpoint::ChatCompletions, b"{"),
            Err(TokenizeError::Invalid(_))
        ));
    }
}
