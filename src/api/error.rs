//! OpenAI's error body: `{"error": {"message", "type", "param", "code"}}`.

use bytes::Bytes;
use serde::Serialize;

#[derive(Debug, Serialize)]
pub struct ErrorBody<'a> {
    pub error: ErrorDetail<'a>,
}

#[derive(Debug, Serialize)]
pub struct ErrorDetail<'a> {
    pub message: &'a str,
    #[serde(rename = "type")]
    pub kind: &'a str,
    pub param: Option<&'a str>,
    pub code: Option<&'a str>,
}

impl<'a> ErrorBody<'a> {
    pub fn new(
        message: &'a str,
        kind: &'a str,
        param: Option<&'a str>,
        code: Option<&'a str>,
    ) -> Self {
        ErrorBody {
            error: ErrorDetail {
                message,
                kind,
                param,
                code,
            },
        }
    }

    pub fn to_bytes(&self) -> Bytes {
        Bytes::from(serde_json::to_vec(self).unwrap_or_else(|_| b"{}".to_vec()))
    }

    /// The same error as one SSE event, used to end a stream that failed midway.
    pub fn to_sse_event(&self) -> Bytes {
        let mut v = b"data: ".to_vec();
        v.extend_from_slice(&self.to_bytes());
        v.extend_from_slice(b"\n\n");
        Bytes::from(v)
    }
}

/// Longest piece of client input an error message repeats.
const ECHO_LIMIT: usize = 64;

/// Client input as an error message repeats it: at most [`ECHO_LIMIT`] bytes
/// (cut at a character boundary, marked with `…`), control characters escaped.
pub fn echo(s: &str) -> String {
    let mut end = s.len().min(ECHO_LIMIT);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    let mut out: String = s[..end].escape_debug().collect();
    if end < s.len() {
        out.push('…');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn echoed_input_is_bounded_and_escaped() {
        assert_eq!(echo("gpt-4o"), "gpt-4o");
        let long = "é".repeat(100_000);
        let e = echo(&long);
        assert!(e.len() <= ECHO_LIMIT + '…'.len_utf8(), "{}", e.len());
        assert!(e.ends_with('…'));
        assert_eq!(echo("a\nb"), "a\\nb");
    }

    #[test]
    fn shape_matches_openai() {
        let b = ErrorBody::new(
            "no such model",
            "invalid_request_error",
            Some("model"),
            Some("model_not_found"),
        );
        let v: serde_json::Value = serde_json::from_slice(&b.to_bytes()).unwrap();
        assert_eq!(v["error"]["message"], "no such model");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["param"], "model");
        assert_eq!(v["error"]["code"], "model_not_found");
        let e = b.to_sse_event();
        assert!(e.starts_with(b"data: {") && e.ends_with(b"}\n\n"));
    }
}
