//! Chat completion chunks (`data: {json}` … `data: [DONE]`) as the Messages
//! event sequence: `message_start`, `ping`, per content block
//! `content_block_start` / `content_block_delta` (`text_delta`,
//! `input_json_delta`) / `content_block_stop`, then `message_delta` (stop
//! reason, usage) and `message_stop`. An `{"error":…}` chunk becomes an
//! `error` event.

use super::{message_id, stop_reason, usage};
use serde_json::{json, Value};

/// Longest partial line carried between chunks; a longer one is an error.
const MAX_LINE: usize = 1 << 20;

/// The open content block.
#[derive(Clone, Copy, PartialEq)]
enum Block {
    Text,
    /// A tool call, by its index in the chunks' `tool_calls`.
    Tool(u64),
}

/// Translates one streamed chat completion, chunk by chunk.
#[derive(Default)]
pub struct StreamTranslator {
    line: Vec<u8>,
    started: bool,
    open: Option<Block>,
    /// Index of the next content block.
    next: u64,
    finish: Option<String>,
    matched_stop: Option<String>,
    usage: Option<Value>,
    done: bool,
}

impl StreamTranslator {
    pub fn new() -> Self {
        Self::default()
    }

    /// Translate the next bytes of the chat stream; the events go to `out`.
    pub fn feed(&mut self, chunk: &[u8], out: &mut Vec<u8>) {
        let mut rest = chunk;
        while let Some(i) = memchr::memchr(b'\n', rest) {
            if self.line.is_empty() {
                self.on_line(&rest[..i], out);
            } else {
                let mut line = std::mem::take(&mut self.line);
                line.extend_from_slice(&rest[..i]);
                self.on_line(&line, out);
            }
            rest = &rest[i + 1..];
        }
        if self.line.len() + rest.len() > MAX_LINE {
            self.line.clear();
            return self.fail("api_error", "the engine sent an over-long stream line", out);
        }
        self.line.extend_from_slice(rest);
    }

    /// The chat stream ended: close the message if `[DONE]` did not.
    pub fn finish(&mut self, out: &mut Vec<u8>) {
        if !self.line.is_empty() {
            let line = std::mem::take(&mut self.line);
            self.on_line(&line, out);
        }
        self.close(out);
    }

    fn on_line(&mut self, line: &[u8], out: &mut Vec<u8>) {
        if self.done {
            return;
        }
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let Some(data) = line.strip_prefix(b"data:") else {
            return;
        };
        let data = data.strip_prefix(b" ").unwrap_or(data);
        if data == b"[DONE]" {
            return self.close(out);
        }
        match serde_json::from_slice::<Value>(data) {
            Ok(v) if v.get("error").is_some() => {
                let msg = v.pointer("/error/message").and_then(Value::as_str);
                self.fail("api_error", msg.unwrap_or("the engine failed"), out);
            }
            Ok(v) => self.on_chunk(&v, out),
            Err(e) => self.fail(
                "api_error",
                &format!("unreadable chunk from the engine: {e}"),
                out,
            ),
        }
    }

    fn on_chunk(&mut self, c: &Value, out: &mut Vec<u8>) {
        if !self.started {
            self.started = true;
            let message = json!({
                "id": message_id(c.get("id").and_then(Value::as_str)), "type": "message",
                "role": "assistant", "model": c.get("model").cloned().unwrap_or(Value::Null),
                "content": [], "stop_reason": null, "stop_sequence": null, "usage": usage(None),
            });
            event(
                out,
                "message_start",
                &json!({"type": "message_start", "message": message}),
            );
            event(out, "ping", &json!({"type": "ping"}));
        }
        if let Some(u) = c.get("usage").filter(|u| u.is_object()) {
            self.usage = Some(u.clone());
        }
        let Some(choice) = c.pointer("/choices/0") else {
            return;
        };
        let delta = &choice["delta"];
        if let Some(t) = delta
            .get("content")
            .and_then(Value::as_str)
            .filter(|t| !t.is_empty())
        {
            self.open_block(Block::Text, json!({"type": "text", "text": ""}), out);
            self.delta(json!({"type": "text_delta", "text": t}), out);
        }
        for call in delta
            .get("tool_calls")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            self.on_tool_call(call, out);
        }
        if let Some(f) = choice.get("finish_reason").and_then(Value::as_str) {
            self.finish = Some(f.to_string());
            self.matched_stop = choice
                .get("stop_reason")
                .and_then(Value::as_str)
                .map(String::from);
        }
    }

    fn on_tool_call(&mut self, call: &Value, out: &mut Vec<u8>) {
        let index = call.get("index").and_then(Value::as_u64).unwrap_or(0);
        if call.get("id").is_some_and(Value::is_string) || self.open != Some(Block::Tool(index)) {
            let block = json!({"type": "tool_use", "id": call.get("id").cloned().unwrap_or(Value::Null),
                               "name": call.pointer("/function/name").cloned().unwrap_or(Value::Null),
                               "input": {}});
            self.close_block(out);
            self.open_block(Block::Tool(index), block, out);
        }
        if let Some(a) = call
            .pointer("/function/arguments")
            .and_then(Value::as_str)
            .filter(|a| !a.is_empty())
        {
            self.delta(json!({"type": "input_json_delta", "partial_json": a}), out);
        }
    }

    /// Make `kind` the open block, closing another first.
    fn open_block(&mut self, kind: Block, start: Value, out: &mut Vec<u8>) {
        if self.open == Some(kind) {
            return;
        }
        self.close_block(out);
        let index = self.next;
        event(
            out,
            "content_block_start",
            &json!({"type": "content_block_start", "index": index, "content_block": start}),
        );
        self.open = Some(kind);
    }

    fn delta(&mut self, delta: Value, out: &mut Vec<u8>) {
        let index = self.next;
        event(
            out,
            "content_block_delta",
            &json!({"type": "content_block_delta", "index": index, "delta": delta}),
        );
    }

    fn close_block(&mut self, out: &mut Vec<u8>) {
        if self.open.take().is_some() {
            event(
                out,
                "content_block_stop",
                &json!({"type": "content_block_stop", "index": self.next}),
            );
            self.next += 1;
        }
    }

    /// End the message: the open block, the stop reason and usage, `message_stop`.
    fn close(&mut self, out: &mut Vec<u8>) {
        if self.done {
            return;
        }
        if !self.started {
            return self.fail(
                "api_error",
                "the engine's stream ended before any output",
                out,
            );
        }
        self.done = true;
        self.close_block(out);
        let reason = stop_reason(self.finish.as_deref(), self.matched_stop.as_deref());
        let seq = if reason == "stop_sequence" {
            json!(self.matched_stop)
        } else {
            Value::Null
        };
        event(
            out,
            "message_delta",
            &json!({"type": "message_delta",
              "delta": {"stop_reason": reason, "stop_sequence": seq},
              "usage": usage(self.usage.as_ref())}),
        );
        event(out, "message_stop", &json!({"type": "message_stop"}));
    }

    fn fail(&mut self, kind: &str, message: &str, out: &mut Vec<u8>) {
        self.done = true;
        out.extend_from_slice(&super::error::sse_event(kind, message));
    }
}

fn event(out: &mut Vec<u8>, name: &str, data: &Value) {
    out.extend_from_slice(b"event: ");
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(b"\ndata: ");
    out.extend_from_slice(data.to_string().as_bytes());
    out.extend_from_slice(b"\n\n");
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The events of a translated stream, as (name, data).
    fn events(chat: &str, cut: usize) -> Vec<(String, Value)> {
        let mut t = StreamTranslator::new();
        let mut out = Vec::new();
        let (a, b) = chat.as_bytes().split_at(cut.min(chat.len()));
        t.feed(a, &mut out);
        t.feed(b, &mut out);
        t.finish(&mut out);
        let text = String::from_utf8(out).unwrap();
        text.split("\n\n")
            .filter(|e| !e.is_empty())
            .map(|e| {
                let (name, data) = e.split_once('\n').unwrap();
                (
                    name.trim_start_matches("event: ").to_string(),
                    serde_json::from_str(data.trim_start_matches("data: ")).unwrap(),
                )
            })
            .collect()
    }

    const TEXT: &str = concat!(
        "data: {\"id\":\"chatcmpl-7\",\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n",
        "data: {\"id\":\"chatcmpl-7\",\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hel\"}}]}\n\n",
        "data: {\"id\":\"chatcmpl-7\",\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"lo\"},\"finish_reason\":\"length\"}]}\n\n",
        "data: {\"id\":\"chatcmpl-7\",\"model\":\"m\",\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":2,\"prompt_tokens_details\":{\"cached_tokens\":4}}}\n\n",
        "data: [DONE]\n\n",
    );

    #[test]
    fn text_stream_has_the_full_event_sequence() {
        for cut in [0, 17, 150, 300, TEXT.len() - 3] {
            let ev = events(TEXT, cut);
            let names: Vec<&str> = ev.iter().map(|(n, _)| n.as_str()).collect();
            assert_eq!(
                names,
                [
                    "message_start",
                    "ping",
                    "content_block_start",
                    "content_block_delta",
                    "content_block_delta",
                    "content_block_stop",
                    "message_delta",
                    "message_stop"
                ],
                "cut {cut}"
            );
            assert_eq!(ev[0].1["message"]["id"], "msg_7");
            assert_eq!(
                ev[3].1["delta"],
                json!({"type": "text_delta", "text": "Hel"})
            );
            assert_eq!(ev[6].1["delta"]["stop_reason"], "max_tokens");
            assert_eq!(ev[6].1["usage"]["output_tokens"], 2);
            assert_eq!(ev[6].1["usage"]["input_tokens"], 5);
            assert_eq!(ev[6].1["usage"]["cache_read_input_tokens"], 4);
        }
    }

    #[test]
    fn tool_calls_become_tool_use_blocks_with_json_deltas() {
        let chat = concat!(
            "data: {\"id\":\"c\",\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"ok\"}}]}\n\n",
            "data: {\"id\":\"c\",\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"call_1\",\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":\"\"}}]}}]}\n\n",
            "data: {\"id\":\"c\",\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"{\\\"a\\\":\"}}]}}]}\n\n",
            "data: {\"id\":\"c\",\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"1}\"}}]},\"finish_reason\":\"tool_calls\"}]}\n\n",
            "data: [DONE]\n\n",
        );
        let ev = events(chat, 0);
        let names: Vec<&str> = ev.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "message_start",
                "ping",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop"
            ]
        );
        assert_eq!(ev[5].1["index"], 1);
        assert_eq!(
            ev[5].1["content_block"],
            json!({"type": "tool_use", "id": "call_1", "name": "f", "input": {}})
        );
        assert_eq!(
            ev[6].1["delta"],
            json!({"type": "input_json_delta", "partial_json": "{\"a\":"})
        );
        assert_eq!(ev[9].1["delta"]["stop_reason"], "tool_use");
    }

    #[test]
    fn an_error_chunk_becomes_an_error_event() {
        let chat = "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"a\"}}]}\n\ndata: {\"error\":{\"message\":\"boom\",\"type\":\"upstream_error\"}}\n\n";
        let ev = events(chat, 5);
        let last = ev.last().unwrap();
        assert_eq!(last.0, "error");
        assert_eq!(last.1["error"]["message"], "boom");
        assert!(ev.iter().all(|(n, _)| n != "message_stop"));
    }
}
