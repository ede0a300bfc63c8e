//! Module dependencies point one way: a folder of `src/` may use only folders of
//! lower layers. This reads every source file's `crate::…` paths and fails on an
//! edge that points up or sideways, naming the file and line.

use std::collections::BTreeMap;
use std::path::Path;

/// Layer of each top-level module: higher layers may use lower ones.
const LAYERS: &[(&str, u8)] = &[
    ("config", 0),
    ("api", 0),
    ("runtime", 0),
    ("sim", 0),
    ("telemetry", 1),
    ("upstream", 2),
    ("tokenize", 2),
    ("kv_events", 3),
    ("pool", 4),
    ("routing", 5),
    ("tenancy", 5),
    ("routes", 6),
    ("proxy", 7),
    ("server", 8),
    ("cli", 9),
    ("demo", 9),
    ("epp", 10),
];

fn layer(m: &str) -> Option<u8> {
    LAYERS.iter().find(|(n, _)| *n == m).map(|(_, l)| *l)
}

/// The top-level modules a source text refers to as `crate::name` or inside
/// `crate::{a, b::c}`, with the line of each reference.
fn references(text: &str) -> Vec<(String, usize)> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let mut rest = line;
        while let Some(at) = rest.find("crate::") {
            rest = &rest[at + "crate::".len()..];
            if let Some(group) = rest.strip_prefix('{') {
                let end = group.find('}').unwrap_or(group.len());
                for part in group[..end].split(',') {
                    let name: String = part
                        .trim()
                        .chars()
                        .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                        .collect();
                    out.push((name, i + 1));
                }
            } else {
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                    .collect();
                out.push((name, i + 1));
            }
        }
    }
    out
}

fn sources(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            sources(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

#[test]
fn module_dependencies_point_down() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    let mut edges: BTreeMap<(String, String), String> = BTreeMap::new();
    for f in &files {
        let rel = f.strip_prefix(&src).unwrap();
        let first = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy();
        let top = first.trim_end_matches(".rs").to_string();
        if top == "lib" || top == "main" {
            continue;
        }
        assert!(layer(&top).is_some(), "src/{top} has no layer in LAYERS");
        let text = std::fs::read_to_string(f).unwrap();
        for (to, line) in references(&text) {
            if to != top && layer(&to).is_some() {
                edges
                    .entry((top.clone(), to))
                    .or_insert_with(|| format!("src/{}:{line}", rel.display()));
            }
        }
    }
    let wrong: Vec<String> = edges
        .iter()
        .filter(|((from, to), _)| layer(to) >= layer(from))
        .map(|((from, to), at)| format!("{from} -> {to} ({at})"))
        .collect();
    assert!(
        wrong.is_empty(),
        "dependencies that point up or sideways: {wrong:#?}"
    );
}

#[test]
fn references_are_read_from_paths_and_groups() {
    let refs = references("use crate::{pool::Worker, telemetry};\nlet x = crate::routing::pick();");
    let names: Vec<&str> = refs.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["pool", "telemetry", "routing"]);
    assert_eq!(refs[2].1, 2);
}
