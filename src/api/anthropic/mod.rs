//! Anthropic's Messages API (`POST /v1/messages`): its error body, and the
//! translation to and from OpenAI chat completions for pools whose engines do
//! not serve the Messages API themselves (`anthropic = "translate"`).
//!
//! Usage follows Anthropic's meaning: `input_tokens` are the prompt tokens *not*
//! read from the prefix cache, `cache_read_input_tokens` those that were.

pub mod error;
pub mod request;
pub mod response;
pub mod stream;

/// The Messages API's own required fields, checked before routing so every
/// pool answers the same: `messages`, and `max_tokens` to create a message.
pub fn check(endpoint: super::Endpoint, info: &super::RequestInfo) -> Result<(), String> {
    if info.routing_text.is_none() {
        return Err("messages: field required".into());
    }
    if endpoint == super::Endpoint::Messages && info.max_tokens.is_none() {
        return Err("max_tokens: field required".into());
    }
    Ok(())
}

/// Where a chat completion's fields land in a Messages answer.
fn stop_reason(finish: Option<&str>, matched_stop: Option<&str>) -> &'static str {
    match finish {
        Some("length") => "max_tokens",
        Some("tool_calls") | Some("function_call") => "tool_use",
        Some("stop") if matched_stop.is_some() => "stop_sequence",
        _ => "end_turn",
    }
}

/// Chat `usage` as Messages `usage`.
fn usage(u: Option<&serde_json::Value>) -> serde_json::Value {
    let n = |v: Option<&serde_json::Value>| v.and_then(serde_json::Value::as_u64).unwrap_or(0);
    let prompt = n(u.and_then(|u| u.get("prompt_tokens")));
    let cached = n(u
        .and_then(|u| u.get("prompt_tokens_details"))
        .and_then(|d| d.get("cached_tokens")));
    serde_json::json!({
        "input_tokens": prompt.saturating_sub(cached),
        "output_tokens": n(u.and_then(|u| u.get("completion_tokens"))),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    })
}

/// A Messages id for a chat completion id: `msg_` and the id's own part.
fn message_id(chat_id: Option<&str>) -> String {
    let id = chat_id.unwrap_or_default();
    let id = id.strip_prefix("chatcmpl-").unwrap_or(id);
    if id.is_empty() {
        format!("msg_{:016x}", rand::random::<u64>())
    } else {
        format!("msg_{id}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn usage_splits_cached_from_uncached_input() {
        let u = json!({"prompt_tokens": 30, "completion_tokens": 5,
                       "prompt_tokens_details": {"cached_tokens": 16}});
        let m = usage(Some(&u));
        assert_eq!(m["input_tokens"], 14);
        assert_eq!(m["cache_read_input_tokens"], 16);
        assert_eq!(m["output_tokens"], 5);
        assert_eq!(usage(None)["input_tokens"], 0);
    }

    #[test]
    fn stop_reasons() {
        assert_eq!(stop_reason(Some("stop"), None), "end_turn");
        assert_eq!(stop_reason(Some("stop"), Some("END")), "stop_sequence");
        assert_eq!(stop_reason(Some("length"), None), "max_tokens");
        assert_eq!(stop_reason(Some("tool_calls"), None), "tool_use");
        assert_eq!(message_id(Some("chatcmpl-abc")), "msg_abc");
    }
}
