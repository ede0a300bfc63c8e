//! Reading TOML into the raw (serde) shapes without stopping at the first problem.
//!
//! The text is parsed into a TOML value (a syntax error ends the reading), then
//! deserialized. Each failure names its key path (`serde_path_to_error`); it is
//! reported, the value is set aside in the TOML value, and deserialization runs
//! again, until it succeeds. Setting aside means: an unknown key is removed; a
//! wrongly typed value is removed (so its default applies), or replaced by an
//! empty array or table where one was expected; a missing required key, or an
//! array element that cannot be removed without shifting the later ones, gets a
//! stand-in value. Problems at or under a set-aside key are not reported again,
//! nor is a missing key that an unknown key in the same table is a misspelling of.

use super::problems::Problems;
use serde::de::DeserializeOwned;
use serde_path_to_error::Segment;
use std::collections::HashMap;
use toml::Value;

/// Enough repairs for any real file; a safeguard against repairing in circles.
const MAX_REPAIRS: usize = 10_000;

/// Read `text` as a `T`, reporting every unknown key and wrongly typed value.
pub(super) fn read<T: DeserializeOwned + Default>(text: &str, problems: &mut Problems) -> T {
    let mut doc = match text.parse::<toml::Table>() {
        Ok(t) => Value::Table(t),
        Err(e) => {
            problems.unreadable(e.to_string().trim().to_string());
            return T::default();
        }
    };
    let mut seen = Seen::default();
    for _ in 0..MAX_REPAIRS {
        let e = match serde_path_to_error::deserialize::<_, T>(doc.clone()) {
            Ok(t) => return t,
            Err(e) => e,
        };
        let path: Vec<Segment> = e.path().iter().cloned().collect();
        if !repair(&mut doc, &path, e.inner().message(), problems, &mut seen) {
            problems.unreadable(format!(
                "{}: {} (could not read past this)",
                key(&path),
                e.inner().message()
            ));
            return T::default();
        }
    }
    problems.unreadable("too many problems to read the file".into());
    T::default()
}

/// The key path of `path`, as problems name keys: `pools[0].workers[1].url`.
fn key(path: &[Segment]) -> String {
    let mut k = String::new();
    for s in path {
        match s {
            Segment::Seq { index } => k.push_str(&format!("[{index}]")),
            Segment::Map { key } => {
                if !k.is_empty() {
                    k.push('.');
                }
                k.push_str(key);
            }
            Segment::Enum { variant } => k.push_str(&format!(".{variant}")),
            Segment::Unknown => k.push_str(".?"),
        }
    }
    k
}

/// What the repairs so far have met.
#[derive(Default)]
struct Seen {
    /// Repairs per key path.
    tries: HashMap<String, usize>,
    /// (table key path, unknown key in it).
    unknown: Vec<(String, String)>,
}

/// Set aside the value at `path` that failed with `message`; false if impossible.
fn repair(
    doc: &mut Value,
    path: &[Segment],
    message: &str,
    problems: &mut Problems,
    seen: &mut Seen,
) -> bool {
    let k = key(path);
    let tries = &mut seen.tries;
    if let Some(rest) = message.strip_prefix("unknown field `") {
        // The path ends with the unknown key itself.
        let (name, expected) = rest.split_once("`, ").unwrap_or((rest, ""));
        let hint = expected
            .split('`')
            .skip(1)
            .step_by(2)
            .filter(|valid| misspelt(name, valid))
            .min_by_key(|valid| distance(name, valid))
            .map(|valid| format!(" (did you mean `{valid}`?)"))
            .unwrap_or_default();
        problems.reject(&k, format!("{k}: unknown key{hint}, {expected}"));
        let table = key(&path[..path.len().saturating_sub(1)]);
        seen.unknown.push((table, name.to_string()));
        return remove(doc, path);
    }
    if let Some(rest) = message.strip_prefix("missing field `") {
        let field = rest.trim_end_matches('`');
        let fk = if k.is_empty() {
            field.to_string()
        } else {
            format!("{k}.{field}")
        };
        let typo = seen
            .unknown
            .iter()
            .any(|(table, name)| *table == k && misspelt(name, field));
        if typo {
            // Its misspelling was reported as an unknown key.
            problems.set_aside(&fk);
        } else {
            problems.reject(&fk, format!("{fk}: required key is missing"));
        }
        *tries.entry(fk).or_default() += 1;
        return match at(doc, path) {
            Some(Value::Table(t)) => {
                t.insert(field.to_string(), Value::String(String::new()));
                true
            }
            _ => false,
        };
    }
    // A value of the wrong type or out of range.
    let expected = match message.rsplit_once(", expected ") {
        Some((head, expected)) => {
            let expected = toml_terms(expected);
            problems.reject(&k, format!("{k}: {head}, expected {expected}"));
            expected
        }
        None => {
            problems.reject(&k, format!("{k}: {message}"));
            String::new()
        }
    };
    let n = tries.entry(k).or_default();
    *n += 1;
    let stand_in = match expected.as_str() {
        "an array" => Some(Value::Array(Vec::new())),
        "a table" => Some(Value::Table(toml::Table::new())),
        _ if *n > 3 => None,
        "a string" => Some(Value::String(String::new())),
        "a boolean" => Some(Value::Boolean(false)),
        "a number" => Some(Value::Float(0.0)),
        e if e.contains("integer") => Some(Value::Integer(0)),
        _ => None,
    };
    match (stand_in, path.last()) {
        // An empty array or table stands in best: nothing in it, nothing to miss.
        (Some(v @ (Value::Array(_) | Value::Table(_))), _) => set(doc, path, v),
        // A key: removed, its default applies (a required one comes back as missing).
        (_, Some(Segment::Map { .. })) if *n == 1 => remove(doc, path),
        (Some(v), _) => set(doc, path, v),
        (None, _) => remove(doc, path),
    }
}

/// Whether `typed` looks like a misspelling of `key`: at most two edits apart
/// (one for keys of up to four letters).
fn misspelt(typed: &str, key: &str) -> bool {
    distance(typed, key) <= if key.len() <= 4 { 1 } else { 2 }
}

/// Edits (insert, delete, replace a character) from `a` to `b` (Levenshtein).
fn distance(a: &str, b: &str) -> usize {
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    // One row of the distance table at a time.
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.iter().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != cb)).min(row[j] + 1).min(cur + 1);
            prev = cur;
        }
    }
    row[b.len()]
}

/// serde's names of the expected types, in TOML's words.
fn toml_terms(expected: &str) -> String {
    match expected {
        "a sequence" => "an array".into(),
        "a map" => "a table".into(),
        e if e.starts_with("struct ") => "a table".into(),
        "usize" | "u64" | "u32" => "a non-negative integer".into(),
        "u16" => "an integer from 0 to 65535".into(),
        "u8" => "an integer from 0 to 255".into(),
        "f64" | "f32" => "a number".into(),
        e => e.into(),
    }
}

/// The value at `path`.
fn at<'a>(doc: &'a mut Value, path: &[Segment]) -> Option<&'a mut Value> {
    path.iter().try_fold(doc, |v, s| match (v, s) {
        (Value::Table(t), Segment::Map { key }) => t.get_mut(key),
        (Value::Array(a), Segment::Seq { index }) => a.get_mut(*index),
        _ => None,
    })
}

fn set(doc: &mut Value, path: &[Segment], value: Value) -> bool {
    match at(doc, path) {
        Some(v) if *v != value => {
            *v = value;
            true
        }
        _ => false,
    }
}

fn remove(doc: &mut Value, path: &[Segment]) -> bool {
    let Some((last, parent)) = path.split_last() else {
        return false;
    };
    match (at(doc, parent), last) {
        (Some(Value::Table(t)), Segment::Map { key }) => t.remove(key).is_some(),
        (Some(Value::Array(a)), Segment::Seq { index }) if *index < a.len() => {
            a.remove(*index);
            true
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RawConfig;

    fn problems(text: &str) -> Vec<String> {
        let mut p = Problems::default();
        let _: RawConfig = read(text, &mut p);
        p.error().map(|e| e.problems).unwrap_or_default()
    }

    #[test]
    fn every_unknown_key_and_type_error_is_reported() {
        let p = problems(
            r#"
            [server]
            lisen = "127.0.0.1:1"
            max_connections = "many"
            [health]
            max_ejected_percent = 300
            [[pools]]
            workers = [{ urll = "http://h:1" }, "http://h:2", { url = 3 }]
            models = ["a", 1]
            [[pools]]
            workers = "http://h:3"
            polcy = "prefix"
            [servr]
            "#,
        );
        let expected = [
            "server.lisen: unknown key (did you mean `listen`?), expected one of `listen`,",
            "server.max_connections: invalid type: string \"many\", expected a non-negative integer",
            "health.max_ejected_percent: invalid value: integer `300`, expected an integer from 0 to 255",
            "pools[0].workers[0].urll: unknown key (did you mean `url`?), expected one of `url`, `labels`, `price_per_mtok`",
            "pools[0].workers[1]: invalid type: string \"http://h:2\", expected a table",
            "pools[0].workers[2].url: invalid type: integer `3`, expected a string",
            "pools[0].models[1]: invalid type: integer `1`, expected a string",
            "pools[1].workers: invalid type: string \"http://h:3\", expected an array",
            "pools[1].polcy: unknown key (did you mean `policy`?)",
            "servr: unknown key (did you mean `server`?), expected one of `server`, `pools`,",
        ];
        for e in expected {
            assert!(
                p.iter().any(|x| x.starts_with(e)),
                "missing `{e}` in {p:#?}"
            );
        }
        // The urll worker's missing url is a consequence: not reported.
        assert_eq!(p.len(), expected.len(), "{p:#?}");
    }

    #[test]
    fn a_missing_required_key_is_named_once() {
        let p = problems("[[pools]]\n[pools.dns]\nport = \"x\"\n");
        assert_eq!(
            p,
            [
                "pools[0].dns.port: invalid type: string \"x\", expected an integer from 0 to 65535",
                "pools[0].dns.name: required key is missing",
            ],
        );
    }

    #[test]
    fn a_syntax_error_ends_reading() {
        let mut p = Problems::default();
        let _: RawConfig = read("[server]\nlisten = \n", &mut p);
        assert!(p.is_unreadable());
        let e = p.error().unwrap().to_string();
        assert!(e.contains("line 2"), "{e}");
    }
}
