//! A chat completion as a Messages answer: the first choice's text and tool
//! calls as content blocks, its finish reason as `stop_reason`, usage renamed.

use super::{message_id, stop_reason, usage};
use bytes::Bytes;
use serde_json::{json, Value};

/// The Messages body for a chat completion body.
pub fn from_chat(body: &[u8]) -> Result<Bytes, String> {
    let c: Value =
        serde_json::from_slice(body).map_err(|e| format!("invalid chat completion: {e}"))?;
    let choice = c
        .pointer("/choices/0")
        .ok_or("chat completion without choices")?;
    let msg = &choice["message"];
    let mut content = Vec::new();
    if let Some(t) = msg
        .get("content")
        .and_then(Value::as_str)
        .filter(|t| !t.is_empty())
    {
        content.push(json!({"type": "text", "text": t}));
    }
    for call in msg
        .get("tool_calls")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        content.push(tool_use(call));
    }
    // vLLM names the stop string that ended the text in `stop_reason`.
    let matched = choice.get("stop_reason").and_then(Value::as_str);
    let reason = stop_reason(choice.get("finish_reason").and_then(Value::as_str), matched);
    let out = json!({
        "id": message_id(c.get("id").and_then(Value::as_str)),
        "type": "message",
        "role": "assistant",
        "model": c.get("model").cloned().unwrap_or(Value::Null),
        "content": content,
        "stop_reason": reason,
        "stop_sequence": if reason == "stop_sequence" { json!(matched) } else { Value::Null },
        "usage": usage(c.get("usage")),
    });
    Ok(Bytes::from(out.to_string()))
}

/// A `tool_use` block for a chat tool call; arguments that are not a JSON
/// object (a model's malformed output) are kept under `_raw`.
pub(super) fn tool_use(call: &Value) -> Value {
    let args = call
        .pointer("/function/arguments")
        .and_then(Value::as_str)
        .unwrap_or("{}");
    let input = match serde_json::from_str::<Value>(args) {
        Ok(v @ Value::Object(_)) => v,
        _ => json!({"_raw": args}),
    };
    json!({
        "type": "tool_use",
        "id": call.get("id").cloned().unwrap_or(Value::Null),
        "name": call.pointer("/function/name").cloned().unwrap_or(Value::Null),
        "input": input,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_and_tool_calls_become_blocks() {
        let chat = json!({
            "id": "chatcmpl-1", "model": "m",
            "choices": [{"message": {"role": "assistant", "content": "Let me check.",
                "tool_calls": [{"id": "call_1", "type": "function",
                                "function": {"name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"}}]},
                "finish_reason": "tool_calls"}],
            "usage": {"prompt_tokens": 20, "completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": 16}},
        });
        let m: Value =
            serde_json::from_slice(&from_chat(chat.to_string().as_bytes()).unwrap()).unwrap();
        assert_eq!(m["id"], "msg_1");
        assert_eq!(m["type"], "message");
        assert_eq!(
            m["content"][0],
            json!({"type": "text", "text": "Let me check."})
        );
        assert_eq!(m["content"][1]["type"], "tool_use");
        assert_eq!(m["content"][1]["input"], json!({"city": "Oslo"}));
        assert_eq!(m["stop_reason"], "tool_use");
        assert_eq!(m["usage"]["input_tokens"], 4);
        assert_eq!(m["usage"]["cache_read_input_tokens"], 16);
        assert_eq!(m["usage"]["output_tokens"], 7);
    }

    #[test]
    fn matched_stop_string_is_a_stop_sequence() {
        let chat = json!({"id": "x", "model": "m", "choices": [{"message": {"content": "a"},
                          "finish_reason": "stop", "stop_reason": "END"}]});
        let m: Value =
            serde_json::from_slice(&from_chat(chat.to_string().as_bytes()).unwrap()).unwrap();
        assert_eq!(m["stop_reason"], "stop_sequence");
        assert_eq!(m["stop_sequence"], "END");
        assert!(from_chat(b"{}").is_err());
    }
}
