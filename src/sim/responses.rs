//! The OpenAI Responses API (`POST /v1/responses`) as vLLM serves it with
//! its response store on: the input items (after the conversation of
//! `previous_response_id`, if any) become a chat conversation, generation goes
//! through the same engine as chat, and the answer is a `response` object, or a
//! stream of named SSE events (`event: TYPE` + `data: {json}`, each with `type`
//! and `sequence_number`, no `[DONE]`). Responses with `store` (the default)
//! are kept in memory, at most [`STORE_CAPACITY`] (oldest dropped first), so
//! only this engine can continue them or answer `GET`/`DELETE
//! /v1/responses/{id}` for them.

use std::collections::{HashMap, VecDeque};
use std::fmt::Write as _;
use std::sync::{Mutex, PoisonError};

use axum::body::Bytes;
use axum::http::StatusCode;
use serde_json::{json, Map, Value};

use super::api::{api_error, bad, content_text, now_secs, ApiError, Output, Totals};

/// Stored responses kept per engine.
pub const STORE_CAPACITY: usize = 1024;

/// (role, text) turns of a conversation.
pub(super) type Turns = Vec<(String, String)>;

/// A stored response: its object and the conversation it ends.
struct Stored {
    object: Value,
    turns: Turns,
}

/// The engine's stored responses, bounded, oldest evicted first.
#[derive(Default)]
pub(crate) struct Store {
    inner: Mutex<(HashMap<String, Stored>, VecDeque<String>)>,
}

impl Store {
    fn with<R>(&self, f: impl FnOnce(&mut (HashMap<String, Stored>, VecDeque<String>)) -> R) -> R {
        f(&mut self.inner.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Keep `object` (with id `id`) and the conversation it ends.
    pub(super) fn put(&self, id: &str, object: Value, turns: Turns) {
        self.with(|(map, order)| {
            if map.len() >= STORE_CAPACITY {
                while let Some(old) = order.pop_front() {
                    if map.remove(&old).is_some() {
                        break;
                    }
                }
            }
            map.insert(id.to_string(), Stored { object, turns });
            order.push_back(id.to_string());
            if order.len() > 2 * STORE_CAPACITY {
                // Deleted ids linger in the order until evicted; drop them.
                order.retain(|k| map.contains_key(k));
            }
        });
    }

    fn turns(&self, id: &str) -> Option<Turns> {
        self.with(|(map, _)| map.get(id).map(|s| s.turns.clone()))
    }

    pub(super) fn get(&self, id: &str) -> Option<Value> {
        self.with(|(map, _)| map.get(id).map(|s| s.object.clone()))
    }

    /// The input items of a stored response (its conversation without the
    /// answer), as an OpenAI list.
    pub(super) fn input_items(&self, id: &str) -> Option<Value> {
        let mut turns = self.turns(id)?;
        turns.pop();
        let data: Vec<Value> = turns
            .iter()
            .enumerate()
            .map(|(i, (role, text))| {
                json!({"id": format!("msg_{i}"), "type": "message", "role": role,
                       "content": [{"type": "input_text", "text": text}]})
            })
            .collect();
        let (first, last) = (
            data.first().map(|d| d["id"].clone()),
            data.last().map(|d| d["id"].clone()),
        );
        Some(json!({"object": "list", "data": data, "first_id": first,
                    "last_id": last, "has_more": false}))
    }

    pub(super) fn delete(&self, id: &str) -> bool {
        self.with(|(map, _)| map.remove(id).is_some())
    }
}

/// The 404 vLLM answers for a response it does not hold.
pub(super) fn not_found(id: &str, param: Option<&'static str>) -> ApiError {
    api_error(
        StatusCode::NOT_FOUND,
        format!("Response with id '{id}' not found."),
        param,
    )
}

/// (role, text) of the conversation: the stored conversation of
/// `previous_response_id`, `instructions` as a system turn, then `input` (a
/// string, or a list of message, `function_call` and `function_call_output`
/// items).
pub(super) fn messages(v: &Value, store: &Store) -> Result<Turns, ApiError> {
    if v.get("background").and_then(Value::as_bool) == Some(true) {
        return Err(bad(
            "background: the simulator does not run responses in the background",
        ));
    }
    let mut out = match v.get("previous_response_id").and_then(Value::as_str) {
        Some(id) => store
            .turns(id)
            .ok_or_else(|| not_found(id, Some("previous_response_id")))?,
        None => Vec::new(),
    };
    match v.get("instructions") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => out.push(("system".to_string(), s.clone())),
        Some(_) => return Err(bad("instructions: must be a string")),
    }
    match v.get("input") {
        Some(Value::String(s)) => out.push(("user".to_string(), s.clone())),
        Some(Value::Array(items)) if !items.is_empty() => {
            for (i, item) in items.iter().enumerate() {
                out.push(input_item(i, item)?);
            }
        }
        Some(Value::Array(_)) => return Err(bad("input: must not be empty")),
        _ => return Err(bad("input: field required (a string or a list of items)")),
    }
    Ok(out)
}

fn input_item(i: usize, item: &Value) -> Result<(String, String), ApiError> {
    let field = |k: &str| item.get(k).and_then(Value::as_str);
    match field("type") {
        None | Some("message") => {
            let role =
                field("role").ok_or_else(|| bad(format!("input[{i}].role: field required")))?;
            let text = content_text(item.get("content"), &format!("input[{i}].content"))?;
            Ok((role.to_string(), text))
        }
        Some("function_call") => Ok((
            "assistant".to_string(),
            field("arguments").unwrap_or_default().to_string(),
        )),
        Some("function_call_output") => {
            let output = match item.get("output") {
                Some(Value::String(s)) => s.clone(),
                Some(other) => other.to_string(),
                None => String::new(),
            };
            Ok(("tool".to_string(), output))
        }
        Some(other) => Err(bad(format!(
            "input[{i}]: items of type {other:?} are not supported by the simulator"
        ))),
    }
}

/// Request fields a response object repeats, with OpenAI's defaults.
pub(super) fn echo(v: &Value) -> Map<String, Value> {
    let mut m = Map::new();
    for (k, default) in [
        ("instructions", Value::Null),
        ("max_output_tokens", Value::Null),
        ("metadata", Value::Null),
        ("parallel_tool_calls", json!(true)),
        ("temperature", json!(1.0)),
        ("tool_choice", json!("auto")),
        ("tools", json!([])),
        ("top_p", json!(1.0)),
        ("user", Value::Null),
        ("previous_response_id", Value::Null),
        ("store", json!(true)),
    ] {
        let val = v
            .get(k)
            .filter(|x| !x.is_null())
            .cloned()
            .unwrap_or(default);
        m.insert(k.to_string(), val);
    }
    m
}

/// A `response` object.
pub(super) fn object(
    echo: &Map<String, Value>,
    id: &str,
    created: u64,
    model: &str,
    status: &str,
    output: Value,
    usage: Value,
) -> Value {
    let mut o = json!({
        "id": id, "object": "response", "created_at": created, "status": status,
        "model": model, "output": output, "usage": usage, "error": null,
        "incomplete_details": null, "reasoning": null,
        "text": {"format": {"type": "text"}}, "truncation": "disabled",
        "background": false, "service_tier": "auto",
    });
    if let Some(map) = o.as_object_mut() {
        map.extend(echo.iter().map(|(k, v)| (k.clone(), v.clone())));
    }
    o
}

/// Usage in the Responses API's names.
pub(super) fn usage(t: &Totals) -> Value {
    json!({"input_tokens": t.prompt, "input_tokens_details": {"cached_tokens": t.cached},
           "output_tokens": t.completion, "output_tokens_details": {"reasoning_tokens": 0},
           "total_tokens": t.prompt + t.completion})
}

/// The output item of a choice: an assistant message, or a function call.
pub(super) fn item(o: &Output, text: &str, status: &str) -> Value {
    item_with_id(o, &item_id(o), text, status)
}

fn item_id(o: &Output) -> String {
    let prefix = match o {
        Output::Text => "msg_",
        Output::Tool { .. } => "fc_",
    };
    format!("{prefix}{}", uuid::Uuid::new_v4().simple())
}

fn item_with_id(o: &Output, id: &str, text: &str, status: &str) -> Value {
    match o {
        Output::Text => {
            let content = if status == "in_progress" {
                json!([])
            } else {
                json!([part(text)])
            };
            json!({"type": "message", "id": id, "status": status, "role": "assistant",
                   "content": content})
        }
        Output::Tool { call_id, call } => json!({
            "type": "function_call", "id": id, "call_id": call_id, "name": call.name,
            "arguments": text, "status": status,
        }),
    }
}

fn part(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
}

/// Writes one streamed response: `response.created` and
/// `response.in_progress` at once, the output item and its content part at the
/// first token, one delta per token, then the `.done` events and
/// `response.completed` with the usage.
pub(super) struct Stream {
    id: String,
    created: u64,
    model: String,
    echo: Map<String, Value>,
    seq: u64,
    item_id: String,
    text: String,
    /// The completed response object, once `end` wrote it.
    pub(super) done: Option<Value>,
}

impl Stream {
    pub(super) fn new(id: String, model: &str, echo: Map<String, Value>) -> Stream {
        Stream {
            id,
            created: now_secs(),
            model: model.to_string(),
            echo,
            seq: 0,
            item_id: String::new(),
            text: String::new(),
            done: None,
        }
    }

    /// Append one event; `data` gets its `type` and `sequence_number`.
    fn event(&mut self, out: &mut String, ty: &str, mut data: Value) {
        if let Some(m) = data.as_object_mut() {
            m.insert("type".into(), json!(ty));
            m.insert("sequence_number".into(), json!(self.seq));
        }
        self.seq += 1;
        let _ = write!(out, "event: {ty}\ndata: {data}\n\n");
    }

    fn object(&self, status: &str, output: Value, usage: Value) -> Value {
        object(
            &self.echo,
            &self.id,
            self.created,
            &self.model,
            status,
            output,
            usage,
        )
    }

    pub(super) fn start(&mut self) -> Bytes {
        let mut out = String::new();
        let r = self.object("in_progress", json!([]), Value::Null);
        self.event(&mut out, "response.created", json!({"response": r}));
        self.event(&mut out, "response.in_progress", json!({"response": r}));
        Bytes::from(out)
    }

    pub(super) fn token(&mut self, o: &Output, first: bool, text: &str) -> Bytes {
        let mut out = String::new();
        if first {
            self.item_id = item_id(o);
            let item = item_with_id(o, &self.item_id, "", "in_progress");
            self.event(
                &mut out,
                "response.output_item.added",
                json!({"output_index": 0, "item": item}),
            );
            if let Output::Text = o {
                let data = json!({"item_id": self.item_id, "output_index": 0, "content_index": 0,
                                  "part": part("")});
                self.event(&mut out, "response.content_part.added", data);
            }
        }
        self.text.push_str(text);
        let data = match o {
            Output::Text => json!({"item_id": self.item_id, "output_index": 0, "content_index": 0,
                                   "delta": text, "logprobs": []}),
            Output::Tool { .. } => {
                json!({"item_id": self.item_id, "output_index": 0, "delta": text})
            }
        };
        let ty = match o {
            Output::Text => "response.output_text.delta",
            Output::Tool { .. } => "response.function_call_arguments.delta",
        };
        self.event(&mut out, ty, data);
        Bytes::from(out)
    }

    pub(super) fn end(&mut self, o: &Output, totals: &Totals) -> Bytes {
        let mut out = String::new();
        let text = std::mem::take(&mut self.text);
        let id = self.item_id.clone();
        match o {
            Output::Text => {
                let data = json!({"item_id": id, "output_index": 0, "content_index": 0,
                                  "text": text, "logprobs": []});
                self.event(&mut out, "response.output_text.done", data);
                let data = json!({"item_id": id, "output_index": 0, "content_index": 0,
                                  "part": part(&text)});
                self.event(&mut out, "response.content_part.done", data);
            }
            Output::Tool { call, .. } => {
                let data = json!({"item_id": id, "output_index": 0, "name": call.name,
                                  "arguments": text});
                self.event(&mut out, "response.function_call_arguments.done", data);
            }
        }
        let item = item_with_id(o, &id, &text, "completed");
        self.event(
            &mut out,
            "response.output_item.done",
            json!({"output_index": 0, "item": item}),
        );
        let r = self.object("completed", json!([item]), usage(totals));
        self.event(&mut out, "response.completed", json!({"response": r}));
        self.done = Some(r);
        Bytes::from(out)
    }

    pub(super) fn error(&mut self, message: &str) -> Bytes {
        let mut out = String::new();
        let data = json!({"code": "server_error", "message": message, "param": null});
        self.event(&mut out, "error", data);
        Bytes::from(out)
    }
}

/// Store a completed response (unless the request said `store: false`): its
/// object and the conversation, the answer appended as an assistant turn.
pub(super) fn remember(store: &Store, object: &Value, mut turns: Turns) {
    if object.get("store").and_then(Value::as_bool) == Some(false) {
        return;
    }
    let Some(id) = object.get("id").and_then(Value::as_str) else {
        return;
    };
    let answer: String = object
        .get("output")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .map(|item| match item.get("content").and_then(Value::as_array) {
            Some(parts) => parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .collect::<String>(),
            None => item
                .get("arguments")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string(),
        })
        .collect();
    turns.push(("assistant".to_string(), answer));
    store.put(id, object.clone(), turns);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_is_bounded_and_forgets_the_oldest() {
        let store = Store::default();
        for i in 0..STORE_CAPACITY + 10 {
            store.put(&format!("resp_{i}"), json!({}), Vec::new());
        }
        assert!(store.get("resp_0").is_none());
        assert!(store.get("resp_9").is_none());
        assert!(store.get("resp_10").is_some());
        assert!(store.delete(&format!("resp_{}", STORE_CAPACITY + 9)));
        assert_eq!(store.with(|(m, _)| m.len()), STORE_CAPACITY - 1);
    }
}
