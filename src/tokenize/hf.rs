//! A Hugging Face model directory's tokenizer: `tokenizer.json` (the
//! `tokenizers` crate, pure-Rust regex backend) and `tokenizer_config.json`
//! (chat template, special tokens, `add_bos_token`). Prompts are built as vLLM
//! builds them: chat is rendered through the template and encoded without adding
//! special tokens (the template writes them); a completion prompt is encoded
//! with them (the tokenizer's post-processor adds BOS where the model wants it).

use super::cache::{CacheStats, SegmentCache};
use super::conversation::{self, Chat, Prompt};
use super::template::{ChatTemplate, ContentFormat};
use super::{PromptTokenizer, TokenizeError};
use crate::api::inspect::Endpoint;
use crate::telemetry::names;
use serde_json::Value as Json;
use std::path::Path;
use std::sync::Arc;
use tokenizers::Tokenizer;

/// Cached segment tokens per tokenizer unless told otherwise (~4 MB).
pub const DEFAULT_CACHE_TOKENS: usize = 1 << 20;

/// A model's tokenizer and chat template, with a cache of shared segments.
pub struct HfTokenizer {
    tok: Tokenizer,
    template: Option<ChatTemplate>,
    cache: SegmentCache,
    bos: Option<u32>,
    add_bos: Option<bool>,
}

impl std::fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfTokenizer")
            .field("template", &self.template)
            .field("cache", &self.cache)
            .finish_non_exhaustive()
    }
}

fn load_err(what: &Path, e: impl std::fmt::Display) -> TokenizeError {
    TokenizeError::Invalid(format!("{}: {e}", what.display()))
}

impl HfTokenizer {
    /// Load `dir/tokenizer.json` and `dir/tokenizer_config.json`. The chat
    /// template is `chat_template_override`, else the config's `chat_template`,
    /// else `dir/chat_template.jinja`; without one, chat requests are unsupported.
    pub fn from_dir(
        dir: impl AsRef<Path>,
        chat_template_override: Option<String>,
    ) -> Result<Self, TokenizeError> {
        Self::from_dir_with_cache(dir, chat_template_override, DEFAULT_CACHE_TOKENS)
    }

    /// As [`HfTokenizer::from_dir`], caching at most `cache_tokens` segment tokens.
    pub fn from_dir_with_cache(
        dir: impl AsRef<Path>,
        chat_template_override: Option<String>,
        cache_tokens: usize,
    ) -> Result<Self, TokenizeError> {
        let dir = dir.as_ref();
        let tok_path = dir.join("tokenizer.json");
        let mut tok = Tokenizer::from_file(&tok_path).map_err(|e| load_err(&tok_path, e))?;
        // The engine never truncates or pads a prompt while building it.
        tok.with_truncation(None)
            .map_err(|e| load_err(&tok_path, e))?;
        tok.with_padding(None);
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg: Json = match std::fs::read(&cfg_path) {
            Ok(b) => serde_json::from_slice(&b).map_err(|e| load_err(&cfg_path, e))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Json::Null,
            Err(e) => return Err(load_err(&cfg_path, e)),
        };
        let specials = special_token_vars(&cfg);
        let source = match chat_template_override {
            Some(t) => Some(t),
            None => config_template(&cfg)
                .or_else(|| std::fs::read_to_string(dir.join("chat_template.jinja")).ok()),
        };
        let template = source
            .map(|s| ChatTemplate::new(&s, specials.clone()))
            .transpose()?;
        let bos = specials
            .iter()
            .find(|(k, _)| k == "bos_token")
            .and_then(|(_, v)| tok.token_to_id(v));
        let cache = segment_cache(&tok, cache_tokens);
        Ok(HfTokenizer {
            template,
            cache,
            bos,
            add_bos: cfg.get("add_bos_token").and_then(Json::as_bool),
            tok,
        })
    }

    /// Tokens of `text` as the tokenizer encodes it whole (no cache).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizeError> {
        let enc = self
            .tok
            .encode_fast(text, add_special_tokens)
            .map_err(|e| TokenizeError::Invalid(format!("tokenizer: {e}")))?;
        let mut ids = enc.get_ids().to_vec();
        if add_special_tokens && self.add_bos == Some(true) {
            if let Some(bos) = self.bos.filter(|b| ids.first() != Some(b)) {
                ids.insert(0, bos);
            }
        }
        Ok(ids)
    }

    /// The chat prompt text the template renders for a chat or responses body.
    pub fn render(&self, endpoint: Endpoint, body: &[u8]) -> Result<String, TokenizeError> {
        match conversation::parse(endpoint, body, self.content_format())? {
            Prompt::Chat(chat) => self.render_chat(&chat),
            _ => Err(TokenizeError::Unsupported(
                "only chat prompts are rendered".into(),
            )),
        }
    }

    /// The number of prompt tokens (what `usage.prompt_tokens` will say).
    pub fn count(&self, endpoint: Endpoint, body: &[u8]) -> Result<usize, TokenizeError> {
        self.prompt_tokens(endpoint, body).map(|t| t.len())
    }

    pub fn cache_stats(&self) -> CacheStats {
        self.cache.stats()
    }

    fn content_format(&self) -> ContentFormat {
        self.template
            .as_ref()
            .map_or(ContentFormat::String, ChatTemplate::content_format)
    }

    fn render_chat(&self, chat: &Chat) -> Result<String, TokenizeError> {
        let Some(t) = &self.template else {
            return Err(TokenizeError::Unsupported(
                "the model has no chat template".into(),
            ));
        };
        t.render(
            chat.messages.clone(),
            chat.tools.clone(),
            chat.add_generation_prompt,
            &chat.extra,
        )
    }

    fn tokens(&self, endpoint: Endpoint, body: &[u8]) -> Result<Arc<[u32]>, TokenizeError> {
        match conversation::parse(endpoint, body, self.content_format())? {
            Prompt::Tokens(ids) => Ok(ids),
            Prompt::Text {
                text,
                add_special_tokens,
            } => self.encode(&text, add_special_tokens).map(Into::into),
            Prompt::Chat(chat) => {
                let text = self.render_chat(&chat)?;
                if chat.add_special_tokens {
                    return self.encode(&text, true).map(Into::into);
                }
                self.cache
                    .encode(&text, |s| self.encode(s, false))
                    .map(Into::into)
            }
        }
    }
}

impl PromptTokenizer for HfTokenizer {
    fn prompt_tokens(&self, endpoint: Endpoint, body: &[u8]) -> Result<Arc<[u32]>, TokenizeError> {
        let r = self.tokens(endpoint, body);
        if let Err(e) = &r {
            let reason = match e {
                TokenizeError::Unsupported(_) => "unsupported",
                TokenizeError::Invalid(_) => "invalid",
            };
            metrics::counter!(names::TOKENIZE_ERRORS_TOTAL, names::L_REASON => reason).increment(1);
        }
        r
    }
}

/// The config's chat template: a string, or the `default` of a named list.
fn config_template(cfg: &Json) -> Option<String> {
    match cfg.get("chat_template")? {
        Json::String(s) => Some(s.clone()),
        Json::Array(named) => named
            .iter()
            .find(|t| t.get("name").and_then(Json::as_str) == Some("default"))
            .and_then(|t| t.get("template")?.as_str().map(str::to_owned)),
        _ => None,
    }
}

/// `bos_token`, `eos_token`, ... as the template sees them (strings, also when
/// the config writes them as `{"content": ...}` objects).
fn special_token_vars(cfg: &Json) -> Vec<(String, String)> {
    [
        "bos_token",
        "eos_token",
        "unk_token",
        "pad_token",
        "sep_token",
        "cls_token",
        "mask_token",
    ]
    .iter()
    .filter_map(|k| {
        let v = cfg.get(*k)?;
        let s = v.as_str().or_else(|| v.get("content")?.as_str())?;
        Some(((*k).to_owned(), s.to_owned()))
    })
    .collect()
}

/// A segment cache cutting at the tokenizer's verbatim added tokens, or a
/// disabled one (budget 0) where cutting could change the result: an added
/// token that strips whitespace or must stand alone, or a Metaspace
/// pre-tokenizer that treats the text's first piece differently.
fn segment_cache(tok: &Tokenizer, budget: usize) -> SegmentCache {
    let added = tok.get_added_tokens_decoder();
    let irregular = added
        .values()
        .any(|t| !t.normalized && (t.lstrip || t.rstrip || t.single_word));
    let first_only = tok
        .get_pre_tokenizer()
        .and_then(|p| serde_json::to_string(p).ok())
        .is_some_and(|s| s.contains("\"prepend_scheme\":\"first\""));
    let splits: Vec<(String, u32)> = added
        .into_iter()
        .filter(|(_, t)| !t.normalized)
        .map(|(id, t)| (t.content, id))
        .collect();
    if irregular || first_only {
        tracing::warn!(
            irregular_added_tokens = irregular,
            first_piece_prefix = first_only,
            "prompt segment cache disabled: this tokenizer's result can depend on text across a special token"
        );
        return SegmentCache::new(splits, 0);
    }
    SegmentCache::new(splits, budget)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const TINY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/tiny-tokenizer");

    fn tiny(cache_tokens: usize) -> HfTokenizer {
        HfTokenizer::from_dir_with_cache(TINY, None, cache_tokens).unwrap()
    }

    fn chat(messages: serde_json::Value) -> Vec<u8> {
        serde_json::to_vec(&serde_json::json!({"model": "m", "messages": messages})).unwrap()
    }

    fn id(t: &HfTokenizer, s: &str) -> u32 {
        t.tok.token_to_id(s).unwrap()
    }

    #[test]
    fn chat_is_the_rendered_template_encoded_without_added_specials() {
        let t = tiny(DEFAULT_CACHE_TOKENS);
        let body = chat(serde_json::json!([{"role": "user", "content": "Hello world"}]));
        let ids = t.prompt_tokens(Endpoint::ChatCompletions, &body).unwrap();
        let text = t.render(Endpoint::ChatCompletions, &body).unwrap();
        assert_eq!(text, "<s><|user|>\nHello world<|end|>\n<|assistant|>\n");
        assert_eq!(&ids[..], &t.encode(&text, false).unwrap()[..]);
        assert_eq!(ids[0], id(&t, "<s>"), "BOS once, from the template");
        assert_eq!(ids.iter().filter(|&&i| i == id(&t, "<s>")).count(), 1);
        assert_eq!(
            t.count(Endpoint::ChatCompletions, &body).unwrap(),
            ids.len()
        );
    }

    #[test]
    fn a_shared_prefix_is_served_from_the_cache() {
        let t = tiny(DEFAULT_CACHE_TOKENS);
        let system = "You are a helpful assistant. ".repeat(40);
        let a = chat(
            serde_json::json!([{"role": "system", "content": system}, {"role": "user", "content": "first question"}]),
        );
        let b = chat(
            serde_json::json!([{"role": "system", "content": system}, {"role": "user", "content": "second question"}]),
        );
        t.prompt_tokens(Endpoint::ChatCompletions, &a).unwrap();
        let before = t.cache_stats();
        let ids = t.prompt_tokens(Endpoint::ChatCompletions, &b).unwrap();
        let after = t.cache_stats();
        assert_eq!(after.hits, before.hits + 1, "{before:?} -> {after:?}");
        let full = t
            .encode(&t.render(Endpoint::ChatCompletions, &b).unwrap(), false)
            .unwrap();
        assert_eq!(&ids[..], &full[..]);
    }

    #[test]
    fn completions_encode_text_and_pass_token_ids_through() {
        let t = tiny(DEFAULT_CACHE_TOKENS);
        let ids = t
            .prompt_tokens(Endpoint::Completions, br#"{"model":"m","prompt":[7,8,9]}"#)
            .unwrap();
        assert_eq!(&ids[..], &[7, 8, 9]);
        let ids = t
            .prompt_tokens(
                Endpoint::Completions,
                br#"{"model":"m","prompt":["def f(x):"]}"#,
            )
            .unwrap();
        assert_eq!(&ids[..], &t.encode("def f(x):", true).unwrap()[..]);
    }

    #[test]
    fn bad_and_unsupported_requests_are_errors_not_panics() {
        let t = tiny(DEFAULT_CACHE_TOKENS);
        let cases: &[(Endpoint, &[u8], bool)] = &[
            (Endpoint::ChatCompletions, b"not json", false),
            (Endpoint::ChatCompletions, br#"{"messages": "hi"}"#, false),
            (Endpoint::ChatCompletions, br#"{"messages": [{"content": "no role"}]}"#, false),
            (Endpoint::ChatCompletions, br#"{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}"#, true),
            (Endpoint::ChatCompletions, br#"{"messages": [{"role": "assistant", "content": null, "tool_calls": [{"function": {"name": "f", "arguments": "{not json"}}]}]}"#, false),
            (Endpoint::Completions, br#"{"prompt": 5}"#, false),
            (Endpoint::Completions, br#"{"prompt": ["a", "b"]}"#, true),
            (Endpoint::Embeddings, br#"{"input": "x"}"#, true),
            (Endpoint::Responses, br#"{"input": [{"type": "function_call_output", "output": "x"}]}"#, true),
        ];
        for (ep, body, unsupported) in cases {
            match t.prompt_tokens(*ep, body) {
                Err(TokenizeError::Unsupported(_)) if *unsupported => {}
                Err(TokenizeError::Invalid(_)) if !*unsupported => {}
                other => panic!("{}: {other:?}", String::from_utf8_lossy(body)),
            }
        }
    }

    #[test]
    fn a_model_without_chat_template_tokenizes_completions_only() {
        let dir = std::env::temp_dir().join(format!("sy-tok-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(format!("{TINY}/tokenizer.json"), dir.join("tokenizer.json")).unwrap();
        let t = HfTokenizer::from_dir(&dir, None).unwrap();
        let body = chat(serde_json::json!([{"role": "user", "content": "x"}]));
        assert!(matches!(
            t.prompt_tokens(Endpoint::ChatCompletions, &body),
            Err(TokenizeError::Unsupported(_))
        ));
        assert!(t
            .prompt_tokens(Endpoint::Completions, br#"{"prompt":"x"}"#)
            .is_ok());
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(
            HfTokenizer::from_dir(&dir, None).is_err(),
            "a missing directory is an error"
        );
    }

    #[test]
    fn tokenizers_that_strip_around_specials_are_not_cut() {
        let mut t = tiny(DEFAULT_CACHE_TOKENS);
        t.tok
            .add_special_tokens([tokenizers::AddedToken::from("<x>", true).rstrip(true)])
            .expect("the token is added");
        let cache = segment_cache(&t.tok, 1 << 16);
        let text = format!("{}<x>   spaced<|end|>{}", "a".repeat(80), "b".repeat(80));
        let whole = t.encode(&text, false).unwrap();
        assert_eq!(cache.encode(&text, |s| t.encode(s, false)).unwrap(), whole);
        assert_eq!(
            cache.stats().misses,
            0,
            "the disabled cache encodes whole texts"
        );
    }

    fn fragment() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("<s>".to_owned()),
            Just("<|user|>".to_owned()),
            Just("<|end|>".to_owned()),
            Just("<|assistant|>".to_owned()),
            Just("<|end".to_owned()),
            Just("\n".to_owned()),
            Just("  ".to_owned()),
            "[a-z ]{1,90}",
            "[ -~]{1,40}",
            "\\PC{1,12}",
            Just("def f(x):\n    return x  # é ünïcødé 🙂\n".repeat(3)),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(96))]
        /// Cutting at special tokens never changes the tokens, cached or not,
        /// with and without evictions.
        #[test]
        fn cached_encoding_equals_a_full_encoding(parts in proptest::collection::vec(fragment(), 1..24)) {
            let text: String = parts.concat();
            for t in [&*CACHED, &*SMALL] {
                let whole = t.encode(&text, false).unwrap();
                for _ in 0..2 {
                    let cut = t.cache.encode(&text, |s| t.encode(s, false)).unwrap();
                    prop_assert_eq!(&cut, &whole);
                }
            }
        }
    }

    static CACHED: std::sync::LazyLock<HfTokenizer> =
        std::sync::LazyLock::new(|| tiny(DEFAULT_CACHE_TOKENS));
    static SMALL: std::sync::LazyLock<HfTokenizer> = std::sync::LazyLock::new(|| tiny(16 * 40));
}
