//! Read only what routing needs from a request body, borrowing from the kept `Bytes`:
//! model, stream flags, user, cache salt and the span of the routing text
//! (`messages` / `prompt` / `input`). The body itself is forwarded unchanged.

use bytes::Bytes;
use serde::Deserialize;
use serde_json::value::RawValue;
use std::borrow::Cow;

/// The OpenAI endpoint a request came in on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    ChatCompletions,
    Completions,
    Embeddings,
    Responses,
    /// Anthropic's Messages API.
    Messages,
    /// Anthropic's `/v1/messages/count_tokens`.
    CountTokens,
    /// Any other `/v1/...` path carrying a JSON body with a `model`.
    Other,
}

impl Endpoint {
    pub fn as_str(self) -> &'static str {
        match self {
            Endpoint::ChatCompletions => "chat_completions",
            Endpoint::Completions => "completions",
            Endpoint::Embeddings => "embeddings",
            Endpoint::Responses => "responses",
            Endpoint::Messages => "messages",
            Endpoint::CountTokens => "count_tokens",
            Endpoint::Other => "other",
        }
    }

    /// Position in `telemetry::ENDPOINTS`.
    pub fn index(self) -> usize {
        self as usize
    }

    pub fn from_path(path: &str) -> Endpoint {
        match path {
            "/v1/chat/completions" => Endpoint::ChatCompletions,
            "/v1/completions" => Endpoint::Completions,
            "/v1/embeddings" => Endpoint::Embeddings,
            "/v1/responses" => Endpoint::Responses,
            "/v1/messages" => Endpoint::Messages,
            "/v1/messages/count_tokens" => Endpoint::CountTokens,
            _ => Endpoint::Other,
        }
    }

    /// Does the client speak Anthropic's Messages API (and expect its error shape)?
    pub fn is_anthropic(self) -> bool {
        matches!(self, Endpoint::Messages | Endpoint::CountTokens)
    }

    /// Answers carry token usage (and are billed on it).
    pub fn carries_usage(self) -> bool {
        !matches!(self, Endpoint::CountTokens | Endpoint::Other)
    }
}

/// Engine endpoints outside `/v1/{chat/completions,completions,embeddings,
/// responses}` whose JSON body names the `model` that routes them (vLLM serves
/// each; `/v1/...` paths not listed are routed the same way when they carry a
/// model).
pub const MODEL_PATHS: &[&str] = &[
    "/tokenize",
    "/detokenize",
    "/rerank",
    "/v1/rerank",
    "/v2/rerank",
    "/score",
    "/v1/score",
];

/// Routing features of one request.
#[derive(Clone, Debug, Default)]
pub struct RequestInfo {
    pub model: Option<String>,
    pub stream: bool,
    pub include_usage: bool,
    /// The body has a `stream_options` key (even `null`): an edit must merge
    /// into it rather than add a second one.
    pub has_stream_options: bool,
    pub user: Option<String>,
    pub cache_salt: Option<String>,
    /// The output cap: `max_completion_tokens`, `max_tokens` (OpenAI,
    /// Anthropic) or `max_output_tokens` (Responses).
    pub max_tokens: Option<u64>,
    /// Completions generated per request: the larger of `n` and `best_of`
    /// (a completion's `best_of` candidates are all generated).
    pub choices: Option<u64>,
    /// Raw JSON text of `messages` (chat), `prompt` (completions) or `input`
    /// (embeddings, responses): a zero-copy slice of the body. With a
    /// top-level `system` (Anthropic Messages), the system prompt's text
    /// followed by the messages' (a copy: the two are apart in the body).
    pub routing_text: Option<Bytes>,
    /// `previous_response_id` (Responses API): the stored response this request
    /// continues, which only its owner holds.
    pub previous_response_id: Option<String>,
    /// Latency objectives (headers or the tenant's defaults; set by the server).
    pub slo: super::Slo,
}

#[derive(Deserialize)]
struct Probe<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default, deserialize_with = "present")]
    stream_options: Option<Option<StreamOptions>>,
    #[serde(borrow, default)]
    user: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    cache_salt: Option<Cow<'a, str>>,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    max_completion_tokens: Option<u64>,
    #[serde(default)]
    max_output_tokens: Option<u64>,
    #[serde(default)]
    n: Option<u64>,
    #[serde(default)]
    best_of: Option<u64>,
    #[serde(borrow, default)]
    system: Option<&'a RawValue>,
    #[serde(borrow, default)]
    messages: Option<&'a RawValue>,
    #[serde(borrow, default)]
    prompt: Option<&'a RawValue>,
    #[serde(borrow, default)]
    input: Option<&'a RawValue>,
    #[serde(borrow, default)]
    previous_response_id: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: Option<bool>,
}

/// A field that is there, even as `null` (`Some(None)`), apart from one that is
/// absent (`None`, from `default`).
fn present<'de, D, T>(d: D) -> Result<Option<Option<T>>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    Option::<T>::deserialize(d).map(Some)
}

/// Why a body could not be inspected.
#[derive(Debug, PartialEq, Eq)]
pub enum InspectError {
    /// Not JSON, or not an object; the message is serde's.
    Malformed(String),
    /// Arrays and objects nest deeper than the limit (given).
    TooDeep(usize),
}

/// Refuse a body whose arrays and objects nest deeper than `max`, before it is
/// parsed (serde_json's own limit, 128, would answer with a recursion error).
/// String contents are skipped with `memchr`, so the scan costs little next to
/// the parse. Malformed JSON passes: the parser names that problem.
pub fn check_depth(body: &[u8], max: usize) -> Result<(), InspectError> {
    // Depth never exceeds the number of openings: one SIMD count decides the
    // usual body (brackets inside strings only make this conservative).
    if memchr::memchr2_iter(b'[', b'{', body).take(max + 1).count() <= max {
        return Ok(());
    }
    let mut depth = 0usize;
    let mut i = 0;
    while i < body.len() {
        match body[i] {
            b'"' => {
                // Skip to the closing quote, stepping over escapes.
                let mut j = i + 1;
                loop {
                    match memchr::memchr2(b'"', b'\\', &body[j.min(body.len())..]) {
                        Some(k) if body[j + k] == b'\\' => j += k + 2,
                        Some(k) => {
                            j += k;
                            break;
                        }
                        None => return Ok(()),
                    }
                }
                i = j;
            }
            b'[' | b'{' => {
                depth += 1;
                if depth > max {
                    return Err(InspectError::TooDeep(max));
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
        i += 1;
    }
    Ok(())
}

/// Parse the routing features. An empty body yields no features (GET-like paths).
pub fn inspect(body: &Bytes) -> Result<RequestInfo, InspectError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(RequestInfo::default());
    }
    let p: Probe<'_> = serde_json::from_slice(body).map_err(|e| explain(body, e))?;
    let slice = |raw: &RawValue| {
        let s = raw.get().as_bytes();
        // `raw` borrows from `body`, so its offset is within it.
        let start = s.as_ptr() as usize - body.as_ptr() as usize;
        body.slice(start..start + s.len())
    };
    let text = p.messages.or(p.prompt).or(p.input).map(slice);
    let text = match (p.system.filter(|s| s.get() != "null"), text) {
        (Some(system), Some(t)) => Some(Bytes::from([system.get().as_bytes(), &t[..]].concat())),
        (_, t) => t,
    };
    Ok(RequestInfo {
        model: p.model.map(Cow::into_owned),
        stream: p.stream.unwrap_or(false),
        include_usage: p
            .stream_options
            .as_ref()
            .and_then(|o| o.as_ref()?.include_usage)
            .unwrap_or(false),
        has_stream_options: p.stream_options.is_some(),
        user: p.user.map(Cow::into_owned),
        cache_salt: p.cache_salt.map(Cow::into_owned),
        max_tokens: p
            .max_completion_tokens
            .or(p.max_tokens)
            .or(p.max_output_tokens),
        choices: p.n.max(p.best_of),
        routing_text: text,
        previous_response_id: p.previous_response_id.map(Cow::into_owned),
        slo: Default::default(),
    })
}

/// What is wrong with a body the probe could not read, in the client's terms
/// (cold path: the body is parsed again, as a generic value).
fn explain(body: &[u8], e: serde_json::Error) -> InspectError {
    if let Err(bad) = std::str::from_utf8(body) {
        return InspectError::Malformed(format!(
            "the request body is not valid UTF-8 (invalid byte at offset {})",
            bad.valid_up_to()
        ));
    }
    let value: serde_json::Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(_) => return InspectError::Malformed(e.to_string()),
    };
    let Some(obj) = value.as_object() else {
        return InspectError::Malformed(format!(
            "the request body must be a JSON object, not {}",
            kind(&value)
        ));
    };
    const EXPECTED: &[(&str, &str)] = &[
        ("model", "a string"),
        ("stream", "a boolean"),
        ("stream_options", "an object"),
        ("user", "a string"),
        ("cache_salt", "a string"),
        ("max_tokens", "a non-negative integer"),
        ("max_completion_tokens", "a non-negative integer"),
        ("max_output_tokens", "a non-negative integer"),
        ("n", "a non-negative integer"),
        ("best_of", "a non-negative integer"),
        ("previous_response_id", "a string"),
    ];
    for (field, expected) in EXPECTED {
        if let Some(v) = obj.get(*field).filter(|v| !v.is_null()) {
            let ok = match *expected {
                "a string" => v.is_string(),
                "a boolean" => v.is_boolean(),
                "an object" => v.is_object(),
                _ => v.is_u64(),
            };
            if !ok {
                return InspectError::Malformed(format!(
                    "`{field}` must be {expected}, not {}",
                    kind(v)
                ));
            }
        }
    }
    InspectError::Malformed(e.to_string())
}

fn kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_caps_and_choices_are_read_from_every_api() {
        let read = |b: &'static [u8]| inspect(&Bytes::from_static(b)).unwrap();
        let r = read(br#"{"model":"m","input":"hi","max_output_tokens":9}"#);
        assert_eq!((r.max_tokens, r.choices), (Some(9), None));
        let c = read(br#"{"model":"m","prompt":"hi","max_tokens":5,"n":2,"best_of":3}"#);
        assert_eq!((c.max_tokens, c.choices), (Some(5), Some(3)));
        let Err(InspectError::Malformed(m)) = inspect(&Bytes::from_static(br#"{"n":-1}"#)) else {
            panic!("a negative n passed");
        };
        assert!(m.contains("`n` must be a non-negative integer"), "{m}");
    }

    #[test]
    fn nesting_is_counted_outside_strings_only() {
        let deep = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
        assert_eq!(check_depth(deep(64).as_bytes(), 64), Ok(()));
        assert_eq!(
            check_depth(deep(65).as_bytes(), 64),
            Err(InspectError::TooDeep(64))
        );
        // More openings than the limit, but side by side: the full scan decides.
        let wide = format!("[{}[]]", "[],".repeat(100));
        assert_eq!(check_depth(wide.as_bytes(), 2), Ok(()));
        assert_eq!(
            check_depth(wide.as_bytes(), 1),
            Err(InspectError::TooDeep(1))
        );
        let quoted = format!(r#"{{"a":"{}\"{}"}}"#, "[".repeat(200), "{".repeat(200));
        assert_eq!(check_depth(quoted.as_bytes(), 2), Ok(()));
        // Unterminated strings and escapes at the end do not read past the body.
        for tail in [&b"{\"abc"[..], b"{\"a\\", b"\"\\\\\\"] {
            assert_eq!(check_depth(tail, 1), Ok(()));
        }
    }

    #[test]
    fn invalid_utf8_in_a_routing_field_is_named() {
        let body = Bytes::from_static(b"{\"model\":\"m\xff\",\"prompt\":\"x\"}");
        let Err(InspectError::Malformed(m)) = inspect(&body) else {
            panic!("accepted invalid UTF-8");
        };
        assert!(m.contains("not valid UTF-8"), "{m}");
    }

    #[test]
    fn reads_routing_fields_and_slices_messages() {
        let body = Bytes::from_static(
            br#"{"model":"m","stream":true,"stream_options":{"include_usage":true},"user":"u1","messages":[{"role":"user","content":"hi"}],"max_tokens":7}"#,
        );
        let i = inspect(&body).unwrap();
        assert_eq!(i.model.as_deref(), Some("m"));
        assert!(i.stream && i.include_usage && i.has_stream_options);
        assert_eq!(i.user.as_deref(), Some("u1"));
        assert_eq!(i.max_tokens, Some(7));
        assert_eq!(
            &i.routing_text.unwrap()[..],
            br#"[{"role":"user","content":"hi"}]"#
        );
    }

    #[test]
    fn stream_options_present_even_as_null() {
        let info = |b: &'static [u8]| inspect(&Bytes::from_static(b)).unwrap();
        let absent = info(br#"{"model":"m","stream":true}"#);
        assert!(!absent.has_stream_options && !absent.include_usage);
        let null = info(br#"{"model":"m","stream":true,"stream_options":null}"#);
        assert!(null.has_stream_options && !null.include_usage);
        let other = info(br#"{"stream_options":{"include_obfuscation":false}}"#);
        assert!(other.has_stream_options && !other.include_usage);
    }

    #[test]
    fn system_prompt_leads_the_routing_text() {
        let body = Bytes::from_static(
            br#"{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"hi"}],"system":"be brief"}"#,
        );
        let i = inspect(&body).unwrap();
        assert_eq!(
            &i.routing_text.unwrap()[..],
            br#""be brief"[{"role":"user","content":"hi"}]"#
        );
        assert_eq!(i.max_tokens, Some(5));
        assert_eq!(Endpoint::from_path("/v1/messages"), Endpoint::Messages);
        assert!(Endpoint::from_path("/v1/messages/count_tokens").is_anthropic());
    }

    #[test]
    fn escaped_model_name_is_decoded() {
        let body = Bytes::from_static(br#"{"model":"a\/b","prompt":"x"}"#);
        let i = inspect(&body).unwrap();
        assert_eq!(i.model.as_deref(), Some("a/b"));
        assert_eq!(&i.routing_text.unwrap()[..], br#""x""#);
    }

    #[test]
    fn errors_name_the_problem_in_the_clients_terms() {
        let msg = |b: &'static [u8]| match inspect(&Bytes::from_static(b)) {
            Err(InspectError::Malformed(m)) => m,
            Err(e) => panic!("{e:?}"),
            Ok(_) => panic!("accepted"),
        };
        assert!(msg(b"[1,2,3]").contains("must be a JSON object, not an array"));
        assert!(msg(b"\"hello\"").contains("not a string"));
        assert!(msg(br#"{"model":5}"#).contains("`model` must be a string, not a number"));
        assert!(msg(br#"{"model":"m","stream":"yes"}"#).contains("`stream` must be a boolean"));
        assert!(msg(b"{\"model\":").contains("EOF"));
    }

    #[test]
    fn malformed_json_is_an_error() {
        assert!(inspect(&Bytes::from_static(b"{\"model\":")).is_err());
        assert!(inspect(&Bytes::from_static(b"[1,2]")).is_err());
        assert!(inspect(&Bytes::from_static(b"{\"model\":5}")).is_err());
    }

    #[test]
    fn empty_body_has_no_features() {
        let i = inspect(&Bytes::new()).unwrap();
        assert!(i.model.is_none() && !i.stream);
    }
}
