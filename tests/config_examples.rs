//! Every example config shipped in `config/` must validate; `switchyard
//! check-config` reports every problem of a file at once.

#[test]
fn example_configs_validate() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
    let mut n = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            switchyard::config::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            n += 1;
        }
    }
    assert!(n >= 1, "no example configs found");
}

/// The configs shipped for containers (`docker/*.toml`: the image's default and
/// the Compose files') validate too; their secrets are not set here.
#[test]
fn container_configs_validate() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docker");
    let mut n = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            let (ok, out, err) =
                switchyard(&["check-config", "--no-secrets", path.to_str().unwrap()]);
            assert!(ok, "{}: {err}", path.display());
            assert!(out.contains(": ok ("), "{out}");
            n += 1;
        }
    }
    assert!(
        n >= 3,
        "expected the image's and both Compose configs, found {n}"
    );
}

/// Run `switchyard ARGS…`: (success, stdout, stderr).
fn switchyard(args: &[&str]) -> (bool, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args(args)
        .env_remove("SWITCHYARD_EXAMPLE_UNSET_KEY")
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A config file in the temp directory, named after the test.
fn file(name: &str, text: &str) -> String {
    let path = std::env::temp_dir().join(format!("switchyard-{}-{name}.toml", std::process::id()));
    std::fs::write(&path, text).unwrap();
    path.to_str().unwrap().to_string()
}

#[test]
fn check_config_reports_every_problem_in_one_run() {
    let path = file(
        "three-problems",
        r#"
[server]
max_connections = "many"
lisen = "127.0.0.1:8080"

[[pools]]
models = ["m"]
policy = "fastest"
workers = [{ url = "http://127.0.0.1:9000" }]
"#,
    );
    let (ok, _, err) = switchyard(&["check-config", &path]);
    assert!(!ok, "{err}");
    for needle in [
        "server.max_connections: invalid type: string \"many\", expected a non-negative integer",
        "server.lisen: unknown key (did you mean `listen`?)",
        "pools[0].policy: unknown policy `fastest` (expected one of: round_robin, random,",
    ] {
        assert!(err.contains(needle), "missing `{needle}` in:\n{err}");
    }
    std::fs::remove_file(path).unwrap();
}

#[test]
fn check_config_loads_each_pools_tokenizer() {
    let fixture =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-tokenizer");
    let pools = |dir: &str| {
        format!(
            "[[pools]]\nname = \"p\"\nmodels = [\"m\"]\npolicy = \"prefix\"\ntokenizer = {{ kind = \"hf\", path = \"{dir}\" }}\nworkers = [{{ url = \"http://127.0.0.1:9000\" }}]\n"
        )
    };
    let good = file("tokenizer-good", &pools(fixture.to_str().unwrap()));
    let (ok, out, err) = switchyard(&["check-config", &good]);
    assert!(ok && out.contains(": ok ("), "{out}{err}");
    let bad = file("tokenizer-missing", &pools("/nonexistent/model-dir"));
    let (ok, _, err) = switchyard(&["check-config", &bad]);
    assert!(!ok, "a missing tokenizer passed");
    assert!(err.contains("pools[0].tokenizer: "), "{err}");
    for f in [good, bad] {
        std::fs::remove_file(f).unwrap();
    }
}

#[test]
fn check_config_without_secrets_notes_unset_variables() {
    let path = file(
        "secrets",
        r#"
[[pools]]
models = ["m"]
upstream_api_key_env = "SWITCHYARD_EXAMPLE_UNSET_KEY"
workers = [{ url = "http://127.0.0.1:9000" }]
"#,
    );
    let (ok, _, err) = switchyard(&["check-config", &path]);
    assert!(!ok);
    assert!(
        err.contains("pools[0].upstream_api_key_env: environment variable `SWITCHYARD_EXAMPLE_UNSET_KEY` is not set"),
        "{err}"
    );
    let (ok, out, err) = switchyard(&["check-config", "--no-secrets", &path]);
    assert!(ok, "{err}");
    assert!(out.contains(": ok (1 pools, 1 workers"), "{out}");
    assert!(
        out.contains("note: pools[0].upstream_api_key_env: environment variable `SWITCHYARD_EXAMPLE_UNSET_KEY` is not set"),
        "{out}"
    );
    std::fs::remove_file(path).unwrap();
}

#[test]
fn unknown_policy_flag_lists_the_policies() {
    let (ok, _, err) = switchyard(&["serve", "--policy", "fastest", "--worker", "http://h:1"]);
    assert!(!ok);
    assert!(
        err.contains("fastest") && err.contains("round_robin") && err.contains("weighted"),
        "{err}"
    );
}
