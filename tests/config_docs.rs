//! Every configuration key is documented: `switchyard check-config` is given a
//! file with an unknown key in every section, and each key its errors list as
//! expected must appear in `docs/*.md` as code (a backtick span or a fenced
//! block, e.g. `drain_timeout_ms`, `[pools.dns]`, `server.listen`).

use std::collections::BTreeSet;

/// An unknown key `zzz` in every section of the configuration.
const PROBE: &str = r#"
zzz = 1
[server]
zzz = 1
[server.timeouts]
zzz = 1
[health]
zzz = 1
[admin]
zzz = 1
[telemetry]
zzz = 1
[access_log]
zzz = 1
[tracing]
zzz = 1
[tenancy]
zzz = 1
[[tenants]]
zzz = 1
[tenants.limits]
zzz = 1
[limits]
zzz = 1
[[prices]]
zzz = 1
[scaling]
zzz = 1
[scaling.pools.p]
zzz = 1
[regions.r]
zzz = 1
[locality]
zzz = 1
[[splits]]
zzz = 1
targets = [{ pool = "p", weight = 1, zzz = 1 }]
[[pools]]
zzz = 1
workers = [{ url = "http://127.0.0.1:9", zzz = 1 }]
[pools.routing]
zzz = 1
scorers = [{ name = "queue", weight = 1, zzz = 1 }]
[pools.kubernetes]
zzz = 1
[pools.dns]
zzz = 1
[pools.disaggregation]
zzz = 1
[pools.flow_control]
zzz = 1
ttl_ms = { zzz = 1 }
"#;

/// Top-level tables whose keys are names the user chooses (zones), not fixed keys.
const FREE_FORM: &[&str] = &["residency"];

/// `(section path, keys it accepts)` from check-config's unknown-key errors.
fn accepted_keys() -> Vec<(String, Vec<String>)> {
    let path = std::env::temp_dir().join(format!("switchyard-{}-probe.toml", std::process::id()));
    std::fs::write(&path, PROBE).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args(["check-config", "--no-secrets", path.to_str().unwrap()])
        .output()
        .unwrap();
    std::fs::remove_file(&path).unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    err.lines()
        .filter_map(|l| {
            let (section, expected) = l
                .trim()
                .strip_prefix("- ")?
                .split_once("zzz: unknown key, expected ")?;
            let keys = expected
                .split('`')
                .skip(1)
                .step_by(2)
                .map(String::from)
                .collect();
            Some((section.trim_end_matches('.').to_string(), keys))
        })
        .collect()
}

/// Identifiers inside code in markdown: fenced blocks and backtick spans.
fn code_identifiers(markdown: &str) -> BTreeSet<String> {
    let mut code = String::new();
    for (i, part) in markdown.split("```").enumerate() {
        if i % 2 == 1 {
            code.push_str(part);
        } else {
            for (j, span) in part.split('`').enumerate() {
                if j % 2 == 1 {
                    code.push_str(span);
                    code.push('\n');
                }
            }
        }
        code.push('\n');
    }
    code.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| !w.is_empty())
        .map(String::from)
        .collect()
}

fn documented() -> BTreeSet<String> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs");
    let mut words = BTreeSet::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "md") {
            words.extend(code_identifiers(&std::fs::read_to_string(path).unwrap()));
        }
    }
    words
}

#[test]
fn code_identifiers_come_from_code_only() {
    let words =
        code_identifiers("prose_word `server.listen` and\n```toml\n[pools.dns]\nport = 1\n```\n");
    let want: BTreeSet<String> = ["server", "listen", "toml", "pools", "dns", "port", "1"]
        .map(String::from)
        .into();
    assert_eq!(words, want);
}

#[test]
fn every_config_key_is_documented() {
    let sections = accepted_keys();
    // One error per probed section, or the probe itself stopped being read.
    assert_eq!(sections.len(), 28, "{sections:?}");
    let top = &sections
        .iter()
        .find(|(s, _)| s.is_empty())
        .expect("top level")
        .1;
    let probed: BTreeSet<&str> = sections
        .iter()
        .filter_map(|(s, _)| s.split(['.', '[']).next().filter(|s| !s.is_empty()))
        .collect();
    for key in top.iter().filter(|k| !FREE_FORM.contains(&k.as_str())) {
        assert!(
            probed.contains(key.as_str()),
            "section `{key}` is not probed: add it to PROBE"
        );
    }
    let docs = documented();
    let missing: Vec<String> = sections
        .iter()
        .flat_map(|(s, keys)| {
            keys.iter()
                .filter(|k| !docs.contains(*k))
                .map(move |k| format!("{s}.{k}"))
        })
        .collect();
    assert!(
        missing.is_empty(),
        "config keys not documented in docs/*.md: {missing:?}"
    );
}
