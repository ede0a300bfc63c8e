//! Chat templates rendered with `minijinja`, configured like the jinja2
//! environment Hugging Face `apply_chat_template` (and so vLLM) uses:
//! `trim_blocks`, `lstrip_blocks`, loop controls, Python string methods,
//! `raise_exception`, `strftime_now` and a `tojson` that prints what Python's
//! `json.dumps` prints (`", "` and `": "` separators, non-ASCII kept).

use super::TokenizeError;
use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Output, State, Value};
use std::fmt::Write as _;

const NAME: &str = "chat";

/// How a template wants `message.content`: a string, or OpenAI-style parts
/// (`[{"type": "text", "text": ...}]`) when it loops over the content.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ContentFormat {
    String,
    OpenAi,
}

/// A compiled chat template and the special tokens it may reference.
pub struct ChatTemplate {
    env: Environment<'static>,
    format: ContentFormat,
    specials: Vec<(String, String)>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("format", &self.format)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compile `source`; `specials` are the template variables such as
    /// `("bos_token", "<s>")` that `tokenizer_config.json` defines.
    pub fn new(source: &str, specials: Vec<(String, String)>) -> Result<Self, TokenizeError> {
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| TokenizeError::Invalid(format!("chat template syntax: {e}")))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.set_formatter(py_formatter);
        env.add_template_owned(NAME, source.to_owned())
            .map_err(|e| TokenizeError::Invalid(format!("chat template: {e:#}")))?;
        Ok(ChatTemplate {
            env,
            format: detect_content_format(source),
            specials,
        })
    }

    pub fn content_format(&self) -> ContentFormat {
        self.format
    }

    /// Render the conversation. `extra` holds request-given template variables
    /// (`chat_template_kwargs`); they never replace the fixed ones.
    pub fn render(
        &self,
        messages: Value,
        tools: Option<Value>,
        add_generation_prompt: bool,
        extra: &[(String, Value)],
    ) -> Result<String, TokenizeError> {
        let mut ctx: Vec<(String, Value)> = self
            .specials
            .iter()
            .map(|(k, v)| (k.clone(), Value::from(v.as_str())))
            .collect();
        ctx.extend(extra.iter().cloned());
        ctx.push(("messages".into(), messages));
        ctx.push(("tools".into(), tools.unwrap_or(Value::from(()))));
        ctx.push(("documents".into(), Value::from(())));
        ctx.push((
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        ));
        let ctx: std::collections::BTreeMap<String, Value> = ctx.into_iter().collect();
        let tmpl = self
            .env
            .get_template(NAME)
            .map_err(|e| TokenizeError::Invalid(e.to_string()))?;
        tmpl.render(ctx)
            .map_err(|e| TokenizeError::Invalid(format!("chat template: {}", root_message(&e))))
    }
}

/// Print values as jinja2 prints them (Python's `str`): `True`, `None`, `1e+20`,
/// `['a', 1]`; strings and undefined as minijinja does.
fn py_formatter(out: &mut Output, state: &mut State, value: &Value) -> Result<(), Error> {
    match value.kind() {
        ValueKind::Bool | ValueKind::None | ValueKind::Seq | ValueKind::Map => {
            let mut s = String::new();
            py_repr(value, &mut s)?;
            out.write_str(&s).map_err(Error::from)
        }
        ValueKind::Number if !value.is_integer() => out
            .write_str(&py_float(f64::try_from(value.clone())?))
            .map_err(Error::from),
        _ => minijinja::escape_formatter(out, state, value),
    }
}

/// Python's `repr` of a value (`str` for the top-level scalars).
fn py_repr(v: &Value, out: &mut String) -> Result<(), Error> {
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if v.is_true() { "True" } else { "False" }),
        ValueKind::Number if v.is_integer() => out.push_str(&v.to_string()),
        ValueKind::Number => out.push_str(&py_float(f64::try_from(v.clone())?)),
        ValueKind::String => py_str_repr(v.as_str().unwrap_or(""), out),
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            for (i, item) in v.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_repr(&item, out)?;
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            for (i, k) in v.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_repr(&k, out)?;
                out.push_str(": ");
                py_repr(&v.get_item(&k)?, out)?;
            }
            out.push('}');
        }
        _ => out.push_str(&v.to_string()),
    }
    Ok(())
}

fn py_str_repr(s: &str, out: &mut String) {
    let q = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(q);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == q => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(q);
}

/// The template's own message for `raise_exception`, else minijinja's.
fn root_message(e: &Error) -> String {
    match e.kind() {
        ErrorKind::InvalidOperation => e.detail().unwrap_or("invalid operation").to_owned(),
        _ => e.to_string(),
    }
}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

/// `strftime_now(fmt)`: the current UTC date, for templates (Llama 3.1) that
/// print today's date. Supports the directives those templates use.
fn strftime_now(fmt: String) -> Result<Value, Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    Ok(Value::from(strftime(&fmt, secs)))
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

/// Python `strftime` for `%d %m %Y %y %b %B %H %M %S %%` at `secs` since the epoch (UTC).
pub(crate) fn strftime(fmt: &str, secs: i64) -> String {
    let (y, m, d) = civil_from_days(secs.div_euclid(86_400));
    let tod = secs.rem_euclid(86_400);
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let _ = match chars.next() {
            Some('d') => write!(out, "{d:02}"),
            Some('m') => write!(out, "{m:02}"),
            Some('Y') => write!(out, "{y}"),
            Some('y') => write!(out, "{:02}", y.rem_euclid(100)),
            Some('b') => write!(out, "{}", &MONTHS[m as usize - 1][..3]),
            Some('B') => write!(out, "{}", MONTHS[m as usize - 1]),
            Some('H') => write!(out, "{:02}", tod / 3600),
            Some('M') => write!(out, "{:02}", tod / 60 % 60),
            Some('S') => write!(out, "{:02}", tod % 60),
            Some('%') => write!(out, "%"),
            Some(o) => write!(out, "%{o}"),
            None => write!(out, "%"),
        };
    }
    out
}

/// Days since 1970-01-01 → (year, month, day), proleptic Gregorian.
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// `tojson` as transformers defines it: `json.dumps(x, ensure_ascii=False,
/// indent=indent, separators=separators, sort_keys=sort_keys)`.
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match (v.as_i64(), v.as_str()) {
            (Some(n), _) => Some(" ".repeat(n.max(0) as usize)),
            (_, Some(s)) => Some(s.to_owned()),
            _ => return Err(Error::new(ErrorKind::InvalidOperation, "bad indent")),
        },
    };
    let (item_sep, key_sep) = match separators {
        Some(s) if !s.is_none() => (
            s.get_item(&Value::from(0))?.to_string(),
            s.get_item(&Value::from(1))?.to_string(),
        ),
        _ if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        _ => (", ".to_owned(), ": ".to_owned()),
    };
    let opts = JsonOpts {
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.unwrap_or(false),
        ensure_ascii: ensure_ascii.unwrap_or(false),
    };
    let mut out = String::new();
    dump(&value, &opts, 0, &mut out)?;
    Ok(Value::from(out))
}

struct JsonOpts {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

fn dump(v: &Value, o: &JsonOpts, depth: usize, out: &mut String) -> Result<(), Error> {
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number if v.is_integer() => out.push_str(&v.to_string()),
        ValueKind::Number => out.push_str(&py_float(f64::try_from(v.clone())?)),
        ValueKind::String | ValueKind::Bytes | ValueKind::Plain | ValueKind::Invalid => {
            dump_str(&v.to_string(), o.ensure_ascii, out)
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            dump_items(items.len(), o, depth, out, '[', ']', |i, out| {
                dump(&items[i], o, depth + 1, out)
            })?;
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if o.sort_keys {
                keys.sort();
            }
            dump_items(keys.len(), o, depth, out, '{', '}', |i, out| {
                dump_str(&keys[i].to_string(), o.ensure_ascii, out);
                out.push_str(&o.key_sep);
                dump(&v.get_item(&keys[i])?, o, depth + 1, out)
            })?;
        }
        _ => dump_str(&v.to_string(), o.ensure_ascii, out),
    }
    Ok(())
}

/// A JSON container with Python's layout: `indent` puts each item on its own line.
fn dump_items(
    n: usize,
    o: &JsonOpts,
    depth: usize,
    out: &mut String,
    open: char,
    close: char,
    mut item: impl FnMut(usize, &mut String) -> Result<(), Error>,
) -> Result<(), Error> {
    out.push(open);
    if n == 0 {
        out.push(close);
        return Ok(());
    }
    let newline = |out: &mut String, d: usize| {
        if let Some(ind) = &o.indent {
            out.push('\n');
            for _ in 0..d {
                out.push_str(ind);
            }
        }
    };
    for i in 0..n {
        if i > 0 {
            out.push_str(&o.item_sep);
        }
        newline(out, depth + 1);
        item(i, out)?;
    }
    newline(out, depth);
    out.push(close);
    Ok(())
}

fn dump_str(s: &str, ensure_ascii: bool, out: &mut String) {
    // serde_json escapes exactly what Python's json.dumps escapes with ensure_ascii=False.
    let quoted = serde_json::to_string(s).unwrap_or_default();
    if !ensure_ascii {
        out.push_str(&quoted);
        return;
    }
    for c in quoted.chars() {
        if c.is_ascii() {
            out.push(c);
        } else {
            let mut buf = [0u16; 2];
            for unit in c.encode_utf16(&mut buf) {
                let _ = write!(out, "\\u{unit:04x}");
            }
        }
    }
}

/// Python's `repr(float)`: shortest round-trip digits, `.0` on integral values,
/// exponent form outside `1e-4 <= |x| < 1e16`.
pub(crate) fn py_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let a = f.abs();
    if a != 0.0 && !(1e-4..1e16).contains(&a) {
        let s = format!("{f:e}");
        let (mant, exp) = s.split_once('e').unwrap_or((&s, "0"));
        let (sign, digits) = match exp.strip_prefix('-') {
            Some(d) => ('-', d),
            None => ('+', exp),
        };
        return format!("{mant}e{sign}{digits:0>2}");
    }
    let s = format!("{f}");
    if s.contains('.') {
        s
    } else {
        format!("{s}.0")
    }
}

/// vLLM's content-format detection, approximated on the template text: the
/// template wants OpenAI-style parts when it loops over a message's `content`
/// (`{% for part in message['content'] %}`), where `message` is a loop
/// variable over `messages` (or over a variable set from it).
pub(crate) fn detect_content_format(source: &str) -> ContentFormat {
    let tags = statements(source);
    let mut lists = vec!["messages".to_owned()];
    let mut changed = true;
    while changed {
        changed = false;
        for t in &tags {
            if let Some((lhs, rhs)) = t.strip_prefix("set ").and_then(|r| r.split_once('=')) {
                let (lhs, rhs) = (lhs.trim(), rhs.trim());
                if refers_to_any(rhs, &lists) && !lists.iter().any(|l| l == lhs) {
                    lists.push(lhs.to_owned());
                    changed = true;
                }
            }
        }
    }
    let loops: Vec<(&str, &str)> = tags
        .iter()
        .filter_map(|t| t.strip_prefix("for ")?.split_once(" in "))
        .map(|(a, b)| (a.trim(), b.trim()))
        .collect();
    let items: Vec<&str> = loops
        .iter()
        .filter(|(_, iter)| refers_to_any(iter, &lists))
        .map(|(target, _)| *target)
        .collect();
    let over_content = loops.iter().any(|(_, iter)| {
        let base = iter.split('|').next().unwrap_or("").trim();
        items.iter().any(|m| {
            [
                format!("{m}['content']"),
                format!("{m}[\"content\"]"),
                format!("{m}.content"),
            ]
            .iter()
            .any(|p| base == p || base.starts_with(&format!("{p}[")))
        })
    });
    if over_content {
        ContentFormat::OpenAi
    } else {
        ContentFormat::String
    }
}

/// `expr` is one of `names`, a subscript or slice of it, or it filtered.
fn refers_to_any(expr: &str, names: &[String]) -> bool {
    let base = expr.split('|').next().unwrap_or("").trim();
    let head: String = base
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect();
    names.contains(&head) && (base.len() == head.len() || base[head.len()..].starts_with('['))
}

/// The statements inside `{% ... %}` tags, whitespace-control marks removed.
fn statements(source: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        let after = &rest[start + 2..];
        let Some(end) = after.find("%}") else { break };
        let inner = after[..end].trim_matches(|c| c == '-' || c == '+').trim();
        out.push(inner.split_whitespace().collect::<Vec<_>>().join(" "));
        rest = &after[end + 2..];
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(src: &str, messages: serde_json::Value) -> String {
        let t = ChatTemplate::new(src, vec![("bos_token".into(), "<s>".into())]).unwrap();
        t.render(
            serde_json::from_value::<Value>(messages).unwrap(),
            None,
            true,
            &[],
        )
        .unwrap()
    }

    #[test]
    fn trims_blocks_like_jinja2() {
        let src = "{% for m in messages %}\n  {% if m.role == 'user' %}\nU:{{ m.content }}\n  {% endif %}\n{% endfor %}";
        let out = render(src, serde_json::json!([{"role": "user", "content": "hi"}]));
        assert_eq!(out, "U:hi\n");
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        let src = "{{ x | tojson }}|{{ x | tojson(indent=2) }}";
        let t = ChatTemplate::new(src, vec![]).unwrap();
        let env_ctx = vec![(
            "x".to_owned(),
            serde_json::from_str::<Value>(r#"{"b": [1, 2.5, "é<"], "a": null, "c": 1e20}"#)
                .unwrap(),
        )];
        let out = t.render(Value::from(()), None, false, &env_ctx).unwrap();
        assert_eq!(
            out,
            "{\"b\": [1, 2.5, \"é<\"], \"a\": null, \"c\": 1e+20}|{\n  \"b\": [\n    1,\n    2.5,\n    \"é<\"\n  ],\n  \"a\": null,\n  \"c\": 1e+20\n}"
        );
    }

    #[test]
    fn python_string_methods_and_loop_controls() {
        let src = "{% for m in messages %}{% if loop.index0 == 1 %}{% break %}{% endif %}{{ m.content.strip().upper() }}{% endfor %}";
        let out = render(
            src,
            serde_json::json!([{"role": "user", "content": " a "}, {"role": "user", "content": "b"}]),
        );
        assert_eq!(out, "A");
    }

    #[test]
    fn raise_exception_is_an_invalid_request() {
        let src = "{{ raise_exception('Conversation roles must alternate') }}";
        let t = ChatTemplate::new(src, vec![]).unwrap();
        let err = t.render(Value::from(()), None, true, &[]).unwrap_err();
        assert!(
            matches!(err, TokenizeError::Invalid(ref m) if m.contains("roles must alternate")),
            "{err}"
        );
    }

    #[test]
    fn values_print_as_python_prints_them() {
        let src = "{{ t }} {{ n }} {{ f }} {{ l }} {{ d }} {{ s }}";
        let t = ChatTemplate::new(src, vec![]).unwrap();
        let ctx: Vec<(String, Value)> =
            serde_json::from_str::<Vec<(String, Value)>>(
                r#"[["t", true], ["n", null], ["f", 2.0], ["l", ["a'b", 1, false]], ["d", {"k": "v\n"}], ["s", "plain"]]"#,
            )
            .unwrap();
        let out = t.render(Value::from(()), None, false, &ctx).unwrap();
        assert_eq!(out, r#"True None 2.0 ["a'b", 1, False] {'k': 'v\n'} plain"#);
    }

    #[test]
    fn strftime_formats_dates() {
        // 2024-07-26 13:05:09 UTC
        assert_eq!(
            strftime("%d %b %Y %H:%M:%S %%", 1_721_999_109),
            "26 Jul 2024 13:05:09 %"
        );
        assert_eq!(strftime("%B %m %y", 0), "January 01 70");
    }

    #[test]
    fn python_float_repr() {
        for (f, s) in [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (1e16, "1e+16"),
            (1.5e-7, "1.5e-07"),
            (-2.0, "-2.0"),
            (123456.75, "123456.75"),
        ] {
            assert_eq!(py_float(f), s);
        }
    }

    #[test]
    fn content_format_follows_content_loops() {
        assert_eq!(
            detect_content_format("{% for m in messages %}{{ m['content'] }}{% endfor %}"),
            ContentFormat::String
        );
        assert_eq!(
            detect_content_format("{%- for message in messages %}{%- for part in message['content'] | selectattr('type') %}{{ part.text }}{% endfor %}{% endfor %}"),
            ContentFormat::OpenAi
        );
        assert_eq!(
            detect_content_format("{% set loop_messages = messages[1:] %}{% for m in loop_messages %}{% for c in m.content %}{% endfor %}{% endfor %}"),
            ContentFormat::OpenAi
        );
    }
}
