//! A request body turned into what the engine tokenizes, as vLLM builds it: chat
//! messages normalised into the conversation a template sees (text parts joined
//! with `\n` for string-content templates, tool-call arguments parsed into
//! objects, tools as `{"type", "function": {"name", "description", "parameters"}}`),
//! a completion prompt, or token ids passed through.

use super::template::ContentFormat;
use super::TokenizeError;
use crate::api::inspect::Endpoint;
use indexmap::IndexMap;
use minijinja::Value;
use serde::Deserialize;
use std::sync::Arc;

/// What to tokenize.
pub(crate) enum Prompt {
    /// Render through the chat template, then encode.
    Chat(Chat),
    /// Encode as is; `add_special_tokens` lets the tokenizer add BOS.
    Text {
        text: String,
        add_special_tokens: bool,
    },
    /// Token ids given by the client.
    Tokens(Arc<[u32]>),
}

pub(crate) struct Chat {
    pub messages: Value,
    pub tools: Option<Value>,
    pub add_generation_prompt: bool,
    pub add_special_tokens: bool,
    pub extra: Vec<(String, Value)>,
}

#[derive(Deserialize)]
struct ChatBody {
    messages: Vec<Message>,
    #[serde(default)]
    tools: Option<Vec<Tool>>,
    #[serde(default = "yes")]
    add_generation_prompt: bool,
    #[serde(default)]
    continue_final_message: bool,
    #[serde(default)]
    add_special_tokens: bool,
    #[serde(default)]
    chat_template_kwargs: Option<IndexMap<String, Value>>,
}

fn yes() -> bool {
    true
}

#[derive(Deserialize)]
struct Message {
    role: String,
    #[serde(default)]
    content: Option<Content>,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    tool_calls: Option<Vec<IndexMap<String, Value>>>,
    #[serde(default)]
    tool_call_id: Option<String>,
    #[serde(default)]
    reasoning: Option<String>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<IndexMap<String, Value>>),
}

#[derive(Deserialize)]
struct Tool {
    function: Function,
}

#[derive(Deserialize)]
struct Function {
    name: String,
    #[serde(default)]
    description: Option<String>,
    #[serde(default)]
    parameters: Option<Value>,
}

/// Parse `body` as a request to `endpoint`.
pub(crate) fn parse(
    endpoint: Endpoint,
    body: &[u8],
    format: ContentFormat,
) -> Result<Prompt, TokenizeError> {
    match endpoint {
        Endpoint::ChatCompletions => chat(body, format).map(Prompt::Chat),
        Endpoint::Completions => completion(body),
        Endpoint::Responses => responses(body, format).map(Prompt::Chat),
        other => Err(TokenizeError::Unsupported(format!(
            "the {} endpoint has no prompt to tokenize",
            other.as_str()
        ))),
    }
}

fn invalid(e: serde_json::Error) -> TokenizeError {
    TokenizeError::Invalid(format!("request body: {e}"))
}

fn chat(body: &[u8], format: ContentFormat) -> Result<Chat, TokenizeError> {
    let b: ChatBody = serde_json::from_slice(body).map_err(invalid)?;
    if b.continue_final_message {
        return Err(TokenizeError::Unsupported(
            "continue_final_message is not tokenized by the gateway".into(),
        ));
    }
    let messages = b
        .messages
        .into_iter()
        .map(|m| message(m, format))
        .collect::<Result<Vec<_>, _>>()?;
    let tools = b
        .tools
        .map(|ts| Value::from(ts.into_iter().map(tool).collect::<Vec<_>>()));
    let extra = b
        .chat_template_kwargs
        .unwrap_or_default()
        .into_iter()
        .collect();
    Ok(Chat {
        messages: Value::from(messages),
        tools,
        add_generation_prompt: b.add_generation_prompt,
        add_special_tokens: b.add_special_tokens,
        extra,
    })
}

/// One conversation message with vLLM's keys, in vLLM's order.
fn message(m: Message, format: ContentFormat) -> Result<Value, TokenizeError> {
    let mut out: IndexMap<String, Value> = IndexMap::new();
    out.insert("role".into(), Value::from(m.role.as_str()));
    out.insert("content".into(), content(m.content, format)?);
    if m.role == "assistant" {
        if let Some(calls) = m.tool_calls.filter(|c| !c.is_empty()) {
            let calls = calls
                .into_iter()
                .map(tool_call)
                .collect::<Result<Vec<_>, _>>()?;
            out.insert("tool_calls".into(), Value::from(calls));
        }
        if let Some(r) = m.reasoning {
            out.insert("reasoning".into(), Value::from(r.as_str()));
            out.insert("reasoning_content".into(), Value::from(r));
        }
    } else if m.role == "tool" {
        if let Some(id) = m.tool_call_id {
            out.insert("tool_call_id".into(), Value::from(id));
        }
    }
    if let Some(name) = m.name {
        out.insert("name".into(), Value::from(name));
    }
    Ok(obj(out))
}

/// Text parts joined with `\n` (string templates) or as `{"type": "text"}` parts.
fn content(c: Option<Content>, format: ContentFormat) -> Result<Value, TokenizeError> {
    let texts = match c {
        None => Vec::new(),
        Some(Content::Text(s)) => vec![s],
        Some(Content::Parts(parts)) => parts
            .iter()
            .filter_map(|p| part_text(p).transpose())
            .collect::<Result<Vec<_>, _>>()?,
    };
    Ok(match format {
        ContentFormat::String => Value::from(texts.join("\n")),
        ContentFormat::OpenAi => Value::from(
            texts
                .into_iter()
                .map(|t| {
                    let mut p: IndexMap<String, Value> = IndexMap::new();
                    p.insert("type".into(), Value::from("text"));
                    p.insert("text".into(), Value::from(t));
                    obj(p)
                })
                .collect::<Vec<_>>(),
        ),
    })
}

/// The text of a content part; `None` for a text part without text (vLLM skips
/// it); an error for media, which the gateway cannot turn into tokens.
fn part_text(p: &IndexMap<String, Value>) -> Result<Option<String>, TokenizeError> {
    let kind = p.get("type").and_then(|t| t.as_str()).unwrap_or("");
    let key = match kind {
        "text" | "input_text" | "output_text" => "text",
        "refusal" => "refusal",
        "" => return Err(TokenizeError::Invalid("content part without a type".into())),
        other => {
            return Err(TokenizeError::Unsupported(format!(
                "content part of type {other:?} is not tokenized by the gateway"
            )))
        }
    };
    match p.get(key) {
        None => Ok(None),
        Some(v) if v.is_none() => Ok(None),
        Some(v) => match v.as_str() {
            Some(s) => Ok(Some(s.to_owned())),
            None => Err(TokenizeError::Invalid(format!(
                "content part `{key}` must be a string"
            ))),
        },
    }
}

/// A tool call with `function.arguments` parsed from its JSON string (`{}` when empty).
fn tool_call(mut call: IndexMap<String, Value>) -> Result<Value, TokenizeError> {
    if let Some(f) = call.get("function").cloned() {
        let mut func: IndexMap<String, Value> = IndexMap::new();
        for key in f.try_iter().map_err(|_| bad_call())? {
            let v = f.get_item(&key).map_err(|_| bad_call())?;
            func.insert(key.to_string(), v);
        }
        let args = func.get("arguments").cloned().unwrap_or(Value::from(()));
        let parsed = match args.as_str() {
            Some("") => empty_object(),
            Some(s) => serde_json::from_str::<Value>(s).map_err(|e| {
                TokenizeError::Invalid(format!("tool call arguments are not JSON: {e}"))
            })?,
            None if args.is_none() || args.is_undefined() => empty_object(),
            None => args,
        };
        func.insert("arguments".into(), parsed);
        call.insert("function".into(), obj(func));
    }
    Ok(obj(call))
}

fn bad_call() -> TokenizeError {
    TokenizeError::Invalid("tool call `function` must be an object".into())
}

fn empty_object() -> Value {
    obj(IndexMap::<String, Value>::new())
}

fn tool(t: Tool) -> Value {
    let mut f: IndexMap<String, Value> = IndexMap::new();
    f.insert("name".into(), Value::from(t.function.name));
    f.insert(
        "description".into(),
        t.function
            .description
            .map(Value::from)
            .unwrap_or(Value::from(())),
    );
    f.insert(
        "parameters".into(),
        t.function.parameters.unwrap_or(Value::from(())),
    );
    let mut out: IndexMap<String, Value> = IndexMap::new();
    out.insert("type".into(), Value::from("function"));
    out.insert("function".into(), obj(f));
    obj(out)
}

#[derive(Deserialize)]
struct CompletionBody {
    prompt: serde_json::Value,
    #[serde(default = "yes")]
    add_special_tokens: bool,
}

fn completion(body: &[u8]) -> Result<Prompt, TokenizeError> {
    let b: CompletionBody = serde_json::from_slice(body).map_err(invalid)?;
    let prompt = match b.prompt {
        serde_json::Value::Array(mut items) if items.len() == 1 && !items[0].is_number() => {
            items.remove(0)
        }
        p => p,
    };
    match prompt {
        serde_json::Value::String(text) => Ok(Prompt::Text {
            text,
            add_special_tokens: b.add_special_tokens,
        }),
        serde_json::Value::Array(items) => items
            .iter()
            .map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok()))
            .collect::<Option<Vec<u32>>>()
            .map(|ids| Prompt::Tokens(ids.into()))
            .ok_or_else(|| {
                TokenizeError::Unsupported(
                    "`prompt` must be one string or one array of token ids".into(),
                )
            }),
        _ => Err(TokenizeError::Invalid(
            "`prompt` must be a string or an array of token ids".into(),
        )),
    }
}

#[derive(Deserialize)]
struct ResponsesBody {
    input: ResponsesInput,
    #[serde(default)]
    instructions: Option<String>,
    #[serde(default)]
    tools: Option<serde_json::Value>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum ResponsesInput {
    Text(String),
    Items(Vec<Item>),
}

#[derive(Deserialize)]
struct Item {
    #[serde(default, rename = "type")]
    kind: Option<String>,
    #[serde(default)]
    role: Option<String>,
    #[serde(default)]
    content: Option<Content>,
}

/// A Responses request as chat: `instructions` as the system message, then the
/// `input` string as a user message or each message item in turn.
fn responses(body: &[u8], format: ContentFormat) -> Result<Chat, TokenizeError> {
    let b: ResponsesBody = serde_json::from_slice(body).map_err(invalid)?;
    if b.tools.as_ref().is_some_and(|t| !t.is_null()) {
        return Err(TokenizeError::Unsupported(
            "responses requests with tools are not tokenized by the gateway".into(),
        ));
    }
    let mut msgs = Vec::new();
    if let Some(sys) = b.instructions {
        msgs.push(text_message("system", sys));
    }
    match b.input {
        ResponsesInput::Text(t) => msgs.push(text_message("user", t)),
        ResponsesInput::Items(items) => {
            for it in items {
                let (Some(role), None | Some("message")) = (it.role, it.kind.as_deref()) else {
                    return Err(TokenizeError::Unsupported(
                        "only message items of a responses input are tokenized by the gateway"
                            .into(),
                    ));
                };
                msgs.push(Message {
                    role,
                    content: it.content,
                    name: None,
                    tool_calls: None,
                    tool_call_id: None,
                    reasoning: None,
                });
            }
        }
    }
    let messages = msgs
        .into_iter()
        .map(|m| message(m, format))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Chat {
        messages: Value::from(messages),
        tools: None,
        add_generation_prompt: true,
        add_special_tokens: false,
        extra: Vec::new(),
    })
}

fn text_message(role: &str, text: String) -> Message {
    Message {
        role: role.into(),
        content: Some(Content::Text(text)),
        name: None,
        tool_calls: None,
        tool_call_id: None,
        reasoning: None,
    }
}

/// A template map keeping insertion order.
fn obj(pairs: IndexMap<String, Value>) -> Value {
    Value::from_object(
        pairs
            .into_iter()
            .map(|(k, v)| (Value::from(k), v))
            .collect::<IndexMap<Value, Value>>(),
    )
}

#[cfg(test)]
mod tests {
    use super::super::template::ChatTemplate;
    use super::*;

    fn render(src: &str, body: &str) -> String {
        let t = ChatTemplate::new(src, vec![]).unwrap();
        let Prompt::Chat(c) = parse(
            Endpoint::ChatCompletions,
            body.as_bytes(),
            t.content_format(),
        )
        .unwrap() else {
            panic!("chat")
        };
        t.render(c.messages, c.tools, c.add_generation_prompt, &c.extra)
            .unwrap()
    }

    #[test]
    fn tool_calls_and_tools_reach_the_template_as_vllm_passes_them() {
        let body = r#"{"tools":[{"type":"function","function":{"name":"f","parameters":{"z":1,"a":2}}}],
            "messages":[{"role":"user","content":"q"},
            {"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{\"b\": 1, \"a\": [true, null]}"}}]},
            {"role":"tool","tool_call_id":"c1","content":"r","extra":"dropped"}]}"#;
        let out = render(
            "{{ messages[1].tool_calls[0].function.arguments | tojson }}|{{ tools | tojson }}|{{ messages[1].content | tojson }}|{{ messages[2] | tojson }}",
            body,
        );
        assert_eq!(
            out,
            r#"{"b": 1, "a": [true, null]}|[{"type": "function", "function": {"name": "f", "description": null, "parameters": {"z": 1, "a": 2}}}]|""|{"role": "tool", "content": "r", "tool_call_id": "c1"}"#
        );
    }

    #[test]
    fn content_parts_are_joined_or_kept_by_template_format() {
        let body = r#"{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}]}"#;
        assert_eq!(render("{{ messages[0].content }}", body), "a\nb");
        let parts = "{% for m in messages %}{% for p in m['content'] %}[{{ p.text }}]{% endfor %}{% endfor %}";
        assert_eq!(render(parts, body), "[a][b]");
    }

    #[test]
    fn request_template_kwargs_do_not_replace_the_fixed_variables() {
        let body = r#"{"add_generation_prompt":false,"chat_template_kwargs":{"enable_thinking":true,"messages":[]},"messages":[{"role":"user","content":"x"}]}"#;
        assert_eq!(
            render(
                "{{ enable_thinking }} {{ messages | length }} {{ add_generation_prompt }}",
                body
            ),
            "True 1 False"
        );
    }
}
