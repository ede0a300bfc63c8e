//! Anthropic's error body: `{"type":"error","error":{"type","message"}}`, and
//! the same as a named SSE `error` event.

use bytes::Bytes;
use serde_json::{json, Value};

/// Anthropic's error `type` for an HTTP status.
pub fn error_type(status: u16) -> &'static str {
    match status {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        s if s >= 500 => "api_error",
        _ => "invalid_request_error",
    }
}

fn value(kind: &str, message: &str) -> Value {
    json!({"type": "error", "error": {"type": kind, "message": message}})
}

/// The error body for `status`.
pub fn body(status: u16, message: &str) -> Bytes {
    Bytes::from(value(error_type(status), message).to_string())
}

/// The error as one SSE event, to end a stream that failed midway.
pub fn sse_event(kind: &str, message: &str) -> Bytes {
    Bytes::from(format!("event: error\ndata: {}\n\n", value(kind, message)))
}

/// An engine's OpenAI-shaped (or any) error body in Anthropic's shape: its
/// `error.message` (or FastAPI's `detail`, or the text itself) kept.
pub fn from_openai(status: u16, body: &[u8]) -> Bytes {
    let parsed: Option<Value> = serde_json::from_slice(body).ok();
    let message = parsed
        .as_ref()
        .and_then(|v| {
            v.pointer("/error/message")
                .or_else(|| v.get("message"))
                .or_else(|| v.get("detail"))
        })
        .map(|m| match m {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        })
        .unwrap_or_else(|| String::from_utf8_lossy(&body[..body.len().min(1024)]).into_owned());
    self::body(status, &message)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_matches_anthropic() {
        let v: Value = serde_json::from_slice(&body(404, "no such model")).unwrap();
        assert_eq!(v["type"], "error");
        assert_eq!(v["error"]["type"], "not_found_error");
        assert_eq!(v["error"]["message"], "no such model");
        let e = sse_event("api_error", "boom");
        assert!(e.starts_with(b"event: error\ndata: {") && e.ends_with(b"}\n\n"));
    }

    #[test]
    fn engine_errors_keep_their_message() {
        let b = from_openai(
            400,
            br#"{"error":{"message":"too long","type":"BadRequestError"}}"#,
        );
        let v: Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["message"], "too long");
        let v: Value = serde_json::from_slice(&from_openai(502, b"bad gateway")).unwrap();
        assert_eq!(v["error"]["message"], "bad gateway");
        assert_eq!(v["error"]["type"], "api_error");
    }
}
