//! Forced tool calls: which function `tool_choice` makes the model call, and
//! arguments made deterministically from the function's JSON schema.
//!
//! With `tool_choice` `"required"` or a named function, a real engine decodes a
//! call under a grammar built from the tools; the sim emits the arguments'
//! tokens one per step instead of pseudo-English. `"auto"`, `"none"` or no
//! `tool_choice` answer with text.

use serde_json::{json, Map, Value};

/// Nesting depth below which objects and arrays are left empty.
const MAX_DEPTH: usize = 4;
/// Most properties filled in one object.
const MAX_PROPERTIES: usize = 16;

/// The function a request forces, with the arguments the sim will generate.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ForcedCall {
    pub name: String,
    /// A JSON object, serialized.
    pub arguments: String,
}

/// Name and parameter schema of each function tool. Accepts the Chat
/// Completions shape `{"type":"function","function":{"name",..}}` and the
/// Responses shape `{"type":"function","name",..}`; other tool types
/// (built-in tools) are skipped.
fn functions(tools: &Value) -> Result<Vec<(&str, &Value)>, String> {
    let Some(list) = tools.as_array() else {
        return Err("tools: must be a list".into());
    };
    let mut out = Vec::new();
    for (i, t) in list.iter().enumerate() {
        if t.get("type").and_then(Value::as_str) != Some("function") {
            continue;
        }
        let f = t.get("function").filter(|f| f.is_object()).unwrap_or(t);
        let Some(name) = f.get("name").and_then(Value::as_str) else {
            return Err(format!("tools[{i}]: function name required"));
        };
        out.push((name, f.get("parameters").unwrap_or(&Value::Null)));
    }
    Ok(out)
}

/// The call `tool_choice` forces, or `None` when the model may answer with
/// text. `hint` is the last user message: under `"required"` the first tool
/// whose name it mentions is called, else the first tool.
pub(crate) fn forced(
    tools: Option<&Value>,
    tool_choice: Option<&Value>,
    hint: &str,
) -> Result<Option<ForcedCall>, String> {
    let tools = match tools {
        None | Some(Value::Null) => Vec::new(),
        Some(t) => functions(t)?,
    };
    let wanted = match tool_choice {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::String(s)) => match s.as_str() {
            "auto" | "none" => return Ok(None),
            "required" => None,
            other => return Err(format!("tool_choice: unknown value {other:?}")),
        },
        Some(Value::Object(o)) => {
            // {"type":"function","function":{"name"}} (chat) or {"type":"function","name"} (responses)
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .or_else(|| o.get("name"))
                .and_then(Value::as_str);
            match (o.get("type").and_then(Value::as_str), name) {
                (Some("function"), Some(n)) => Some(n),
                _ => {
                    return Err("tool_choice: expected \"auto\", \"none\", \"required\" or \
                         {\"type\": \"function\", \"function\": {\"name\": ...}}"
                        .into())
                }
            }
        }
        Some(_) => return Err("tool_choice: must be a string or an object".into()),
    };
    if tools.is_empty() {
        return Err("tool_choice: requires `tools` with at least one function".into());
    }
    let (name, params) = match wanted {
        Some(n) => *tools
            .iter()
            .find(|(t, _)| *t == n)
            .ok_or_else(|| format!("tool_choice: tool {n:?} is not among `tools`"))?,
        None => *tools
            .iter()
            .find(|(t, _)| hint.contains(t))
            .unwrap_or(&tools[0]),
    };
    Ok(Some(ForcedCall {
        name: name.to_string(),
        arguments: arguments(params).to_string(),
    }))
}

/// A JSON object satisfying the common parts of a parameters schema: required
/// properties (every property when `required` is absent), filled by type.
pub(crate) fn arguments(schema: &Value) -> Value {
    match value("", schema, 0) {
        v @ Value::Object(_) => v,
        _ => Value::Object(Map::new()),
    }
}

fn value(name: &str, schema: &Value, depth: usize) -> Value {
    let Some(s) = schema.as_object() else {
        return text(name, None);
    };
    for key in ["const", "default"] {
        if let Some(v) = s.get(key) {
            return v.clone();
        }
    }
    for key in ["enum", "examples"] {
        if let Some(v) = s.get(key).and_then(Value::as_array).and_then(|a| a.first()) {
            return v.clone();
        }
    }
    for key in ["anyOf", "oneOf", "allOf"] {
        if let Some(alts) = s.get(key).and_then(Value::as_array) {
            // Prefer an alternative that is not just `null`.
            let alt = alts
                .iter()
                .find(|a| a.get("type").and_then(Value::as_str) != Some("null"))
                .or(alts.first());
            if let Some(a) = alt {
                return value(name, a, depth);
            }
        }
    }
    let ty = match s.get("type") {
        Some(Value::String(t)) => t.as_str(),
        Some(Value::Array(ts)) => ts
            .iter()
            .filter_map(Value::as_str)
            .find(|t| *t != "null")
            .unwrap_or("null"),
        _ if s.contains_key("properties") => "object",
        _ if s.contains_key("items") => "array",
        _ => "string",
    };
    let bound = |k: &str| s.get(k).and_then(Value::as_f64);
    match ty {
        "object" => {
            let mut out = Map::new();
            if depth >= MAX_DEPTH {
                return Value::Object(out);
            }
            let props = s.get("properties").and_then(Value::as_object);
            let keys: Vec<&str> = match s.get("required").and_then(Value::as_array) {
                Some(req) => req.iter().filter_map(Value::as_str).collect(),
                None => props
                    .map(|p| p.keys().map(String::as_str).collect())
                    .unwrap_or_default(),
            };
            for k in keys.into_iter().take(MAX_PROPERTIES) {
                let sub = props.and_then(|p| p.get(k)).unwrap_or(&Value::Null);
                out.insert(k.to_string(), value(k, sub, depth + 1));
            }
            Value::Object(out)
        }
        "array" => {
            if depth >= MAX_DEPTH {
                return json!([]);
            }
            let item = s.get("items").unwrap_or(&Value::Null);
            json!([value(name, item, depth + 1)])
        }
        "integer" => {
            let lo = bound("minimum")
                .or_else(|| bound("exclusiveMinimum").map(|m| m.floor() + 1.0))
                .unwrap_or(1.0)
                .ceil();
            let v = match bound("maximum") {
                Some(hi) if hi < lo => hi.floor(),
                _ => lo,
            };
            json!(v as i64)
        }
        "number" => {
            let lo = bound("minimum").unwrap_or(1.5);
            let v = match bound("maximum") {
                Some(hi) if hi < lo => hi,
                _ => lo,
            };
            json!(v)
        }
        "boolean" => json!(true),
        "null" => Value::Null,
        _ => text(name, s.get("format").and_then(Value::as_str)),
    }
}

/// A plausible string for a property, from its format or its name.
fn text(name: &str, format: Option<&str>) -> Value {
    let by_format = match format {
        Some("date") => Some("2025-01-15"),
        Some("date-time") => Some("2025-01-15T12:00:00Z"),
        Some("time") => Some("12:00:00"),
        Some("email") => Some("user@example.com"),
        Some("uri" | "url") => Some("https://example.com"),
        Some("uuid") => Some("123e4567-e89b-12d3-a456-426614174000"),
        _ => None,
    };
    if let Some(t) = by_format {
        return json!(t);
    }
    let n = name.to_ascii_lowercase();
    let hints: &[(&str, &str)] = &[
        ("city", "Paris"),
        ("location", "Paris, France"),
        ("country", "France"),
        ("unit", "celsius"),
        ("lang", "en"),
        ("email", "user@example.com"),
        ("url", "https://example.com"),
        ("date", "2025-01-15"),
        ("time", "12:00"),
        ("name", "Alice"),
        ("query", "example query"),
        ("id", "item-1"),
    ];
    let t = hints
        .iter()
        .find(|(k, _)| n.contains(k))
        .map(|(_, v)| *v)
        .unwrap_or("example");
    json!(t)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> Value {
        json!([{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["fahrenheit", "celsius"]},
                "days": {"type": "integer", "minimum": 2, "maximum": 7},
                "detailed": {"type": "boolean"},
                "tags": {"type": "array", "items": {"type": "string"}},
                "note": {"type": ["string", "null"]}
            },
            "required": ["city", "unit", "days", "detailed", "tags"]
        }}}, {"type": "function", "function": {"name": "get_time", "parameters": {
            "type": "object", "properties": {"zone": {"type": "string"}}
        }}}])
    }

    #[test]
    fn required_properties_are_filled_by_type() {
        let call = forced(Some(&weather()), Some(&json!("required")), "hi")
            .unwrap()
            .unwrap();
        assert_eq!(call.name, "get_weather");
        let args: Value = serde_json::from_str(&call.arguments).unwrap();
        assert_eq!(
            args,
            json!({"city": "Paris", "unit": "fahrenheit", "days": 2, "detailed": true, "tags": ["example"]})
        );
    }

    #[test]
    fn named_choice_and_hint_pick_the_tool() {
        let named = json!({"type": "function", "function": {"name": "get_time"}});
        let call = forced(Some(&weather()), Some(&named), "").unwrap().unwrap();
        assert_eq!(call.name, "get_time");
        // No `required`: every property is filled.
        assert_eq!(call.arguments, r#"{"zone":"example"}"#);
        // Responses-style tools and tool_choice.
        let flat = json!([{"type": "function", "name": "lookup", "parameters": {}}]);
        let call = forced(
            Some(&flat),
            Some(&json!({"type": "function", "name": "lookup"})),
            "",
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            (call.name.as_str(), call.arguments.as_str()),
            ("lookup", "{}")
        );
        // "required" calls the tool the user mentions.
        let call = forced(Some(&weather()), Some(&json!("required")), "use get_time")
            .unwrap()
            .unwrap();
        assert_eq!(call.name, "get_time");
    }

    #[test]
    fn text_choices_and_bad_choices() {
        for c in [None, Some(json!("auto")), Some(json!("none"))] {
            assert_eq!(forced(Some(&weather()), c.as_ref(), "").unwrap(), None);
        }
        assert!(forced(None, Some(&json!("required")), "").is_err());
        assert!(forced(Some(&weather()), Some(&json!("sometimes")), "").is_err());
        let missing = json!({"type": "function", "function": {"name": "nope"}});
        assert!(forced(Some(&weather()), Some(&missing), "").is_err());
        assert!(forced(Some(&json!("x")), Some(&json!("required")), "").is_err());
    }

    #[test]
    fn nested_and_unusual_schemas() {
        let s = json!({"type": "object", "required": ["a", "b", "c", "d", "e"], "properties": {
            "a": {"type": "object", "required": ["x"], "properties": {"x": {"type": "number", "minimum": 3}}},
            "b": {"anyOf": [{"type": "null"}, {"type": "integer", "exclusiveMinimum": 5}]},
            "c": {"const": "fixed"},
            "d": {"type": "string", "format": "date"},
            "e": {"type": "string", "default": "dflt"}
        }});
        assert_eq!(
            arguments(&s),
            json!({"a": {"x": 3.0}, "b": 6, "c": "fixed", "d": "2025-01-15", "e": "dflt"})
        );
        assert_eq!(arguments(&Value::Null), json!({}));
        assert_eq!(arguments(&json!({"type": "string"})), json!({}));
    }
}
