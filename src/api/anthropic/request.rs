//! A Messages request as a chat completions request: the system prompt (a
//! string or text blocks) becomes the first message, content blocks become
//! chat content, `tool_use` / `tool_result` blocks become assistant
//! `tool_calls` and `tool` messages, and the sampling fields are renamed.

use bytes::Bytes;
use serde_json::{json, Map, Value};

/// Why a Messages request cannot be translated, in the client's terms.
pub type Invalid = String;

/// Sampling fields that keep their name.
const SAME_NAME: &[&str] = &[
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stream",
];

/// The chat completions body for a Messages body.
pub fn to_chat(body: &[u8]) -> Result<Bytes, Invalid> {
    let req: Map<String, Value> =
        serde_json::from_slice(body).map_err(|e| format!("invalid JSON: {e}"))?;
    let mut out = Map::new();
    for k in SAME_NAME {
        if let Some(v) = req.get(*k).filter(|v| !v.is_null()) {
            out.insert((*k).into(), v.clone());
        }
    }
    if req.get("stream").and_then(Value::as_bool) == Some(true) {
        out.insert("stream_options".into(), json!({"include_usage": true}));
    }
    if let Some(stop) = req.get("stop_sequences").filter(|v| !v.is_null()) {
        out.insert("stop".into(), stop.clone());
    }
    if let Some(user) = req
        .get("metadata")
        .and_then(|m| m.get("user_id"))
        .filter(|v| v.is_string())
    {
        out.insert("user".into(), user.clone());
    }
    out.insert("messages".into(), Value::Array(messages(&req)?));
    if let Some(tools) = req.get("tools").filter(|v| !v.is_null()) {
        out.insert("tools".into(), self::tools(tools)?);
    }
    if let Some(choice) = req.get("tool_choice").filter(|v| !v.is_null()) {
        tool_choice(choice, &mut out)?;
    }
    serde_json::to_vec(&out)
        .map(Bytes::from)
        .map_err(|e| e.to_string())
}

/// The system prompt, then each message (a message may become several).
fn messages(req: &Map<String, Value>) -> Result<Vec<Value>, Invalid> {
    let mut out = Vec::new();
    match req.get("system") {
        None | Some(Value::Null) => {}
        Some(s) => out.push(json!({"role": "system", "content": system_text(s)?})),
    }
    let Some(list) = req.get("messages").and_then(Value::as_array) else {
        return Err("messages: field required (a list)".into());
    };
    for (i, m) in list.iter().enumerate() {
        message(i, m, &mut out)?;
    }
    Ok(out)
}

fn system_text(s: &Value) -> Result<String, Invalid> {
    match s {
        Value::String(t) => Ok(t.clone()),
        Value::Array(blocks) => blocks
            .iter()
            .enumerate()
            .map(
                |(j, b)| match (b.get("type").and_then(Value::as_str), b.get("text")) {
                    (Some("text"), Some(Value::String(t))) => Ok(t.as_str()),
                    _ => Err(format!("system[{j}]: only text blocks are supported")),
                },
            )
            .collect::<Result<Vec<_>, _>>()
            .map(|parts| parts.join("\n")),
        _ => Err("system: must be a string or a list of text blocks".into()),
    }
}

/// One message: its text and images as chat content, an assistant's
/// `tool_use` blocks as `tool_calls`, a user's `tool_result` blocks as `tool`
/// messages (placed first: they answer the previous assistant turn).
fn message(i: usize, m: &Value, out: &mut Vec<Value>) -> Result<(), Invalid> {
    let role = match m.get("role").and_then(Value::as_str) {
        Some(r @ ("user" | "assistant")) => r,
        _ => {
            return Err(format!(
                "messages[{i}].role: must be \"user\" or \"assistant\""
            ))
        }
    };
    let blocks = match m.get("content") {
        Some(Value::String(s)) => {
            out.push(json!({"role": role, "content": s}));
            return Ok(());
        }
        Some(Value::Array(b)) => b,
        _ => {
            return Err(format!(
                "messages[{i}].content: must be a string or a list of blocks"
            ))
        }
    };
    let mut parts = Vec::new();
    let mut calls = Vec::new();
    for (j, b) in blocks.iter().enumerate() {
        block(b, &mut parts, &mut calls, out)
            .map_err(|e| format!("messages[{i}].content[{j}]: {e}"))?;
    }
    if parts.is_empty() && calls.is_empty() {
        return Ok(()); // only tool results: already pushed
    }
    let mut msg = json!({"role": role});
    if !parts.is_empty() {
        msg["content"] = content(parts);
    }
    if !calls.is_empty() {
        msg["tool_calls"] = Value::Array(calls);
    }
    out.push(msg);
    Ok(())
}

/// Chat content: a string when it is only text, else a list of parts.
fn content(parts: Vec<Value>) -> Value {
    let all_text = parts.iter().all(|p| p["type"] == "text");
    if all_text {
        let texts: Vec<&str> = parts.iter().filter_map(|p| p["text"].as_str()).collect();
        Value::String(texts.join("\n"))
    } else {
        Value::Array(parts)
    }
}

fn block(
    b: &Value,
    parts: &mut Vec<Value>,
    calls: &mut Vec<Value>,
    out: &mut Vec<Value>,
) -> Result<(), Invalid> {
    let field = |k: &str| b.get(k).and_then(Value::as_str);
    match field("type") {
        Some("text") => parts.push(json!({"type": "text", "text": field("text").unwrap_or("")})),
        Some("image") => {
            parts.push(json!({"type": "image_url", "image_url": {"url": image_url(b)?}}))
        }
        Some("tool_use") => calls.push(json!({
            "id": field("id").ok_or("tool_use: `id` required")?,
            "type": "function",
            "function": {
                "name": field("name").ok_or("tool_use: `name` required")?,
                "arguments": b.get("input").unwrap_or(&json!({})).to_string(),
            },
        })),
        Some("tool_result") => out.push(json!({
            "role": "tool",
            "tool_call_id": field("tool_use_id").ok_or("tool_result: `tool_use_id` required")?,
            "content": tool_result_text(b.get("content"))?,
        })),
        // Reasoning an earlier answer showed: not part of a chat prompt.
        Some("thinking" | "redacted_thinking") => {}
        Some(other) => {
            return Err(format!(
                "block type `{other}` cannot be translated to chat completions"
            ))
        }
        None => return Err("`type` required".into()),
    }
    Ok(())
}

fn image_url(b: &Value) -> Result<String, Invalid> {
    let src = b.get("source").ok_or("image: `source` required")?;
    let s = |k: &str| src.get(k).and_then(Value::as_str);
    match s("type") {
        Some("url") => Ok(s("url").ok_or("image: `source.url` required")?.to_string()),
        Some("base64") => Ok(format!(
            "data:{};base64,{}",
            s("media_type").unwrap_or("image/png"),
            s("data").ok_or("image: `source.data` required")?
        )),
        _ => Err("image: `source.type` must be \"base64\" or \"url\"".into()),
    }
}

fn tool_result_text(c: Option<&Value>) -> Result<String, Invalid> {
    match c {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(items)) => Ok(items
            .iter()
            .filter_map(|it| it.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join("\n")),
        Some(_) => Err("tool_result: `content` must be a string or a list of blocks".into()),
    }
}

/// `tools`: each custom tool as a function.
fn tools(t: &Value) -> Result<Value, Invalid> {
    let list = t.as_array().ok_or("tools: must be a list")?;
    list.iter()
        .enumerate()
        .map(|(i, tool)| {
            let name = tool
                .get("name")
                .and_then(Value::as_str)
                .ok_or_else(|| format!("tools[{i}].name: field required"))?;
            let mut f = json!({"name": name,
                               "parameters": tool.get("input_schema").cloned().unwrap_or(json!({"type": "object"}))});
            if let Some(d) = tool.get("description").filter(|d| d.is_string()) {
                f["description"] = d.clone();
            }
            Ok(json!({"type": "function", "function": f}))
        })
        .collect::<Result<Vec<_>, Invalid>>()
        .map(Value::Array)
}

/// `tool_choice`: `auto`, `any` (→ `required`), `none`, or a named tool.
fn tool_choice(c: &Value, out: &mut Map<String, Value>) -> Result<(), Invalid> {
    let choice = match (c.get("type").and_then(Value::as_str), c.get("name")) {
        (Some("auto"), _) => json!("auto"),
        (Some("any"), _) => json!("required"),
        (Some("none"), _) => json!("none"),
        (Some("tool"), Some(Value::String(n))) => json!({"type": "function", "function": {"name": n}}),
        _ => return Err("tool_choice: expected {\"type\": \"auto\" | \"any\" | \"none\"} or {\"type\": \"tool\", \"name\": ...}".into()),
    };
    out.insert("tool_choice".into(), choice);
    if c.get("disable_parallel_tool_use").and_then(Value::as_bool) == Some(true) {
        out.insert("parallel_tool_calls".into(), json!(false));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(v: Value) -> Value {
        serde_json::from_slice(&to_chat(v.to_string().as_bytes()).unwrap()).unwrap()
    }

    #[test]
    fn system_sampling_and_metadata() {
        let c = chat(json!({
            "model": "m", "max_tokens": 9, "stream": true, "temperature": 0.5, "top_p": 0.9,
            "top_k": 5, "stop_sequences": ["END"], "metadata": {"user_id": "u1"},
            "system": [{"type": "text", "text": "be brief"}, {"type": "text", "text": "and kind"}],
            "messages": [{"role": "user", "content": "hi"}],
        }));
        assert_eq!(
            c["messages"][0],
            json!({"role": "system", "content": "be brief\nand kind"})
        );
        assert_eq!(c["messages"][1], json!({"role": "user", "content": "hi"}));
        assert_eq!(c["max_tokens"], 9);
        assert_eq!(c["stop"], json!(["END"]));
        assert_eq!(c["user"], "u1");
        assert_eq!(c["top_k"], 5);
        assert_eq!(c["stream_options"]["include_usage"], true);
    }

    #[test]
    fn tool_use_round_trip_becomes_tool_calls_and_tool_messages() {
        let c = chat(json!({
            "model": "m", "max_tokens": 9,
            "tools": [{"name": "get_weather", "description": "d", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": true},
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "checking"},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                    {"type": "text", "text": "thanks"}]},
            ],
        }));
        let m = &c["messages"];
        assert_eq!(m[0], json!({"role": "user", "content": "weather?"}));
        assert_eq!(m[1]["content"], "checking");
        assert_eq!(m[1]["tool_calls"][0]["id"], "toolu_1");
        assert_eq!(
            m[1]["tool_calls"][0]["function"]["arguments"],
            r#"{"city":"Oslo"}"#
        );
        assert_eq!(
            m[2],
            json!({"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"})
        );
        assert_eq!(m[3], json!({"role": "user", "content": "thanks"}));
        assert_eq!(c["tools"][0]["function"]["name"], "get_weather");
        assert_eq!(
            c["tools"][0]["function"]["parameters"],
            json!({"type": "object"})
        );
        assert_eq!(c["tool_choice"]["function"]["name"], "get_weather");
        assert_eq!(c["parallel_tool_calls"], false);
        let any = chat(
            json!({"model": "m", "max_tokens": 1, "tools": [{"name": "f"}],
                              "tool_choice": {"type": "any"}, "messages": [{"role": "user", "content": "x"}]}),
        );
        assert_eq!(any["tool_choice"], "required");
    }

    #[test]
    fn untranslatable_input_is_named() {
        let e = |v: Value| to_chat(v.to_string().as_bytes()).unwrap_err();
        assert!(e(json!({"model": "m"})).contains("messages: field required"));
        assert!(e(json!({"messages": [{"role": "system", "content": "x"}]}))
            .contains("messages[0].role"));
        let doc = json!({"messages": [{"role": "user", "content": [{"type": "document"}]}]});
        assert!(e(doc).contains("messages[0].content[0]: block type `document`"));
        assert!(to_chat(b"{").unwrap_err().contains("invalid JSON"));
    }
}
