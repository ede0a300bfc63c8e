//! Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`)
//! as vLLM serves it: the system prompt and content blocks become a chat
//! conversation, generation goes through the same engine as chat, and the
//! answer is a `message` object, or the Messages event stream (`message_start`,
//! `ping`, `content_block_start`, `content_block_delta`…, `content_block_stop`,
//! `message_delta`, `message_stop`). Errors use Anthropic's shape.

use std::fmt::Write as _;

use axum::body::Bytes;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

use super::api::{bad, ApiError, Output, Totals};

/// (role, text) of the conversation: `system` (a string or text blocks) as a
/// system turn, then each message; `tool_use` blocks as their input's JSON,
/// `tool_result` blocks as a tool turn.
pub(super) fn messages(v: &Value) -> Result<Vec<(String, String)>, ApiError> {
    let mut out = Vec::new();
    match v.get("system") {
        None | Some(Value::Null) => {}
        Some(s) => out.push(("system".to_string(), blocks_text(s, "system")?)),
    }
    let Some(list) = v.get("messages").and_then(Value::as_array) else {
        return Err(bad("messages: Field required"));
    };
    for (i, m) in list.iter().enumerate() {
        let role = m.get("role").and_then(Value::as_str).unwrap_or_default();
        if role != "user" && role != "assistant" {
            return Err(bad(format!(
                "messages.{i}.role: Input should be 'user' or 'assistant'"
            )));
        }
        let what = format!("messages.{i}.content");
        for (r, text) in message_turns(role, m.get("content"), &what)? {
            out.push((r, text));
        }
    }
    Ok(out)
}

fn message_turns(
    role: &str,
    c: Option<&Value>,
    what: &str,
) -> Result<Vec<(String, String)>, ApiError> {
    let blocks = match c {
        Some(Value::String(s)) => return Ok(vec![(role.to_string(), s.clone())]),
        Some(Value::Array(b)) => b,
        _ => {
            return Err(bad(format!(
                "{what}: Input should be a string or a list of blocks"
            )))
        }
    };
    let mut turns = Vec::new();
    let mut text = String::new();
    for b in blocks {
        match b.get("type").and_then(Value::as_str) {
            Some("text") => text.push_str(b.get("text").and_then(Value::as_str).unwrap_or("")),
            Some("tool_use") => text.push_str(&b.get("input").unwrap_or(&json!({})).to_string()),
            Some("tool_result") => {
                let t =
                    blocks_text(b.get("content").unwrap_or(&Value::Null), what).unwrap_or_default();
                turns.push(("tool".to_string(), t));
            }
            _ => {}
        }
    }
    if !text.is_empty() || turns.is_empty() {
        turns.push((role.to_string(), text));
    }
    Ok(turns)
}

fn blocks_text(v: &Value, what: &str) -> Result<String, ApiError> {
    match v {
        Value::Null => Ok(String::new()),
        Value::String(s) => Ok(s.clone()),
        Value::Array(b) => Ok(b
            .iter()
            .filter_map(|x| x.get("text").and_then(Value::as_str))
            .collect()),
        _ => Err(bad(format!(
            "{what}: Input should be a string or a list of text blocks"
        ))),
    }
}

/// `tools` and `tool_choice` in the chat shape the tool planner reads:
/// `any` forces some tool, `{"type":"tool","name"}` a named one.
pub(super) fn chat_tools(v: &Value) -> (Option<Value>, Option<Value>) {
    let tools = v.get("tools").and_then(Value::as_array).map(|list| {
        Value::Array(
            list.iter()
                .map(|t| {
                    json!({"type": "function", "function": {
                    "name": t.get("name").cloned().unwrap_or(Value::Null),
                    "parameters": t.get("input_schema").cloned().unwrap_or(Value::Null)}})
                })
                .collect(),
        )
    });
    let choice = v
        .get("tool_choice")
        .map(|c| match c.get("type").and_then(Value::as_str) {
            Some("any") => json!("required"),
            Some("tool") => {
                json!({"type": "function", "name": c.get("name").cloned().unwrap_or(Value::Null)})
            }
            Some("none") => json!("none"),
            _ => json!("auto"),
        });
    (tools, choice)
}

/// Messages usage: `input_tokens` excludes the prompt tokens read from cache.
fn usage(t: &Totals) -> Value {
    json!({"input_tokens": t.prompt.saturating_sub(t.cached), "output_tokens": t.completion,
           "cache_creation_input_tokens": 0, "cache_read_input_tokens": t.cached})
}

/// Anthropic's `stop_reason` for a chat finish reason.
fn stop_reason(finish: Option<&str>) -> &'static str {
    match finish {
        Some("length") => "max_tokens",
        Some("tool_calls") => "tool_use",
        _ => "end_turn",
    }
}

fn content_block(o: &Output, text: &str) -> Value {
    match o {
        Output::Text => json!({"type": "text", "text": text}),
        Output::Tool { call_id, call } => json!({"type": "tool_use", "id": tool_id(call_id),
            "name": call.name, "input": serde_json::from_str::<Value>(text).unwrap_or(json!({}))}),
    }
}

fn tool_id(call_id: &str) -> String {
    format!("toolu_{}", call_id.trim_start_matches("call_"))
}

/// A whole `message` answer.
pub(super) fn object(
    id: &str,
    model: &str,
    o: &Output,
    text: &str,
    finish: Option<&str>,
    t: &Totals,
) -> Value {
    json!({"id": id, "type": "message", "role": "assistant", "model": model,
           "content": [content_block(o, text)], "stop_reason": stop_reason(finish),
           "stop_sequence": null, "usage": usage(t)})
}

/// `POST /v1/messages/count_tokens`: `{"input_tokens": N}`.
pub(super) fn count(tokens: usize) -> Response {
    axum::Json(json!({"input_tokens": tokens})).into_response()
}

/// An error in Anthropic's shape.
pub(super) fn error(status: StatusCode, message: &str) -> Response {
    let kind = match status.as_u16() {
        404 => "not_found_error",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        s if s >= 500 => "api_error",
        _ => "invalid_request_error",
    };
    let body = json!({"type": "error", "error": {"type": kind, "message": message}});
    let mut r = (status, axum::Json(body)).into_response();
    if status == StatusCode::TOO_MANY_REQUESTS {
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    r
}

/// Writes one streamed message.
pub(super) struct Stream {
    id: String,
    model: String,
    finish: Option<String>,
}

impl Stream {
    pub(super) fn new(id: String, model: &str) -> Stream {
        Stream {
            id,
            model: model.to_string(),
            finish: None,
        }
    }

    fn event(out: &mut String, data: Value) {
        let ty = data["type"].as_str().unwrap_or_default().to_string();
        let _ = write!(out, "event: {ty}\ndata: {data}\n\n");
    }

    /// `message_start` and a `ping`, sent once the request is accepted.
    pub(super) fn start(&mut self) -> Bytes {
        let mut out = String::new();
        let message = json!({"id": self.id, "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": 0, "output_tokens": 0}});
        Self::event(
            &mut out,
            json!({"type": "message_start", "message": message}),
        );
        Self::event(&mut out, json!({"type": "ping"}));
        Bytes::from(out)
    }

    pub(super) fn token(
        &mut self,
        o: &Output,
        first: bool,
        text: &str,
        fin: Option<&str>,
    ) -> Bytes {
        let mut out = String::new();
        if first {
            let block = match o {
                Output::Text => json!({"type": "text", "text": ""}),
                Output::Tool { call_id, call } => {
                    json!({"type": "tool_use", "id": tool_id(call_id), "name": call.name, "input": {}})
                }
            };
            Self::event(
                &mut out,
                json!({"type": "content_block_start", "index": 0, "content_block": block}),
            );
        }
        let delta = match o {
            Output::Text => json!({"type": "text_delta", "text": text}),
            Output::Tool { .. } => json!({"type": "input_json_delta", "partial_json": text}),
        };
        Self::event(
            &mut out,
            json!({"type": "content_block_delta", "index": 0, "delta": delta}),
        );
        if let Some(f) = fin {
            self.finish = Some(f.to_string());
        }
        Bytes::from(out)
    }

    /// Close the block; the stop reason and the usage (the input included,
    /// known only now); `message_stop`.
    pub(super) fn end(&mut self, totals: &Totals) -> Bytes {
        let mut out = String::new();
        Self::event(&mut out, json!({"type": "content_block_stop", "index": 0}));
        Self::event(
            &mut out,
            json!({"type": "message_delta",
            "delta": {"stop_reason": stop_reason(self.finish.as_deref()), "stop_sequence": null},
            "usage": usage(totals)}),
        );
        Self::event(&mut out, json!({"type": "message_stop"}));
        Bytes::from(out)
    }

    pub(super) fn error(&mut self, message: &str) -> Bytes {
        let mut out = String::new();
        Self::event(
            &mut out,
            json!({"type": "error", "error": {"type": "api_error", "message": message}}),
        );
        Bytes::from(out)
    }
}
