//! Tests that span sections: reading and validation together, the order and
//! pruning of problems, secrets and files read after the checks. Helpers
//! shared with the sections' own tests.

use super::*;

pub(super) fn check(text: &str) -> Result<Config, ConfigError> {
    parse(text)?.validate()
}

pub(super) const ONE_POOL: &str =
    "[[pools]]\nmodels = [\"m\"]\nworkers = [{ url = \"http://127.0.0.1:9000\" }]\n";

#[test]
fn debug_of_a_config_shows_no_secret() {
    let vars = [
        (
            "SWITCHYARD_TEST_DEBUG_ADMIN_TOKEN",
            "adm-3f9c1a7e52b04d6e8a1f",
        ),
        ("SWITCHYARD_TEST_DEBUG_TENANT_KEY", "sk-tenant-8a1f3f9c1a7e"),
        ("SWITCHYARD_TEST_DEBUG_UPSTREAM_KEY", "sk-upstream-52b04d6e"),
    ];
    for (var, value) in vars {
        std::env::set_var(var, value);
    }
    let c = check(
        r#"
        [admin]
        listen = "127.0.0.1:9001"
        token_env = "SWITCHYARD_TEST_DEBUG_ADMIN_TOKEN"
        [[tenants]]
        name = "acme"
        api_key_env = "SWITCHYARD_TEST_DEBUG_TENANT_KEY"
        [[pools]]
        models = ["m"]
        upstream_api_key_env = "SWITCHYARD_TEST_DEBUG_UPSTREAM_KEY"
        workers = [{ url = "http://h:1" }]
        "#,
    )
    .unwrap();
    assert_eq!(c.admin.as_ref().unwrap().token.expose(), vars[0].1);
    assert_eq!(
        c.tenancy.tenants[0].api_key.as_ref().unwrap().expose(),
        vars[1].1
    );
    let upstream = c.pools[0].upstream_api_key.as_ref().unwrap();
    assert_eq!(upstream.expose(), vars[2].1);
    for shown in [
        format!("{c:?}"),
        format!("{c:#?}"),
        format!("{:?}", c.tenancy.tenants),
    ] {
        for (_, value) in vars {
            assert!(!shown.contains(value), "`{value}` shown in {shown}");
        }
    }
    let admin = format!("{:?}", c.admin);
    assert!(admin.contains("token: ***"), "{admin}");
    let pool = format!("{:?}", c.pools[0]);
    assert!(pool.contains("upstream_api_key: Some(***)"), "{pool}");
}

#[test]
fn secrets_and_files_are_read_after_the_file_is_checked() {
    let e = check(
        r#"
        [admin]
        listen = "127.0.0.1:9001"
        token_env = "SWITCHYARD_TEST_RESOLVE_UNSET_TOKEN"
        [[pools]]
        models = ["m"]
        upstream_ca_file = "/nonexistent/switchyard-test-ca.pem"
        workers = [{ url = "ftp://h:1" }]
        "#,
    )
    .unwrap_err();
    let keys: Vec<&str> = e
        .problems
        .iter()
        .map(|p| p.split_once(": ").unwrap().0)
        .collect();
    assert_eq!(
        keys,
        [
            "pools[0].workers[0].url",
            "admin.token_env",
            "pools[0].upstream_ca_file"
        ],
        "{e}"
    );
}

#[test]
fn unknown_key_is_named() {
    let e = check("[server]\nlisten = \"127.0.0.1:1\"\nlisen = 3\n").unwrap_err();
    assert!(e.to_string().contains("lisen"), "{e}");
}

#[test]
fn every_problem_is_reported_with_its_path() {
    let e = check(
        r#"
        [server]
        listen = "nope"
        [server.timeouts]
        connect_ms = 0
        [[pools]]
        name = "a"
        policy = "fastest"
        models = ["m"]
        workers = [{ url = "ftp://x" }]
        [[pools]]
        name = "a"
        models = ["m"]
        workers = []
        "#,
    )
    .unwrap_err();
    let all = e.to_string();
    for needle in [
        "server.listen",
        "server.timeouts.connect_ms",
        "pools[0].policy: unknown policy `fastest`",
        "pools[0].workers[0].url",
        "pools[1].name: duplicate",
        "served by more than one pool",
        "pools[1].workers: a pool needs at least one worker",
    ] {
        assert!(all.contains(needle), "missing `{needle}` in:\n{all}");
    }
}

/// Read and validate like `check-config`: reading and validation problems together.
pub(super) fn check_all(text: &str, secrets: Secrets) -> Result<Checked, ConfigError> {
    read(text).validate(secrets)
}

pub(super) const POOL: &str =
    "[[pools]]\nname = \"p\"\nmodels = [\"m\"]\nworkers = [{ url = \"http://127.0.0.1:9000\" }]\n";

#[test]
fn type_errors_unknown_keys_and_bad_values_are_reported_together() {
    let e = check_all(
        r#"
        [server]
        max_connections = "many"
        [health]
        intervl_ms = 5
        [[pools]]
        models = ["m"]
        policy = "fastest"
        workers = [{ url = "http://h:1" }]
        "#,
        Secrets::Required,
    )
    .unwrap_err();
    assert_eq!(
        e.problems,
        [
            "health.intervl_ms: unknown key (did you mean `interval_ms`?), expected one of `interval_ms`, `timeout_ms`, `path`, `unhealthy_threshold`, `healthy_threshold`, `eject_after_failures`, `base_ejection_ms`, `max_ejection_ms`, `max_ejected_percent`, `overload_cooldown_ms`",
            "server.max_connections: invalid type: string \"many\", expected a non-negative integer",
            "pools[0].policy: unknown policy `fastest` (expected one of: round_robin, random, least_queue, prefix, cost, session, weighted, slo)",
        ]
    );
}

#[test]
fn a_syntax_error_is_reported_alone() {
    let e = check_all("[server\nlisten = 1\n", Secrets::Required).unwrap_err();
    assert_eq!(e.problems.len(), 1, "{e}");
    assert!(e.problems[0].contains("line 1"), "{e}");
}

#[test]
fn consequences_of_a_rejection_are_not_reported() {
    let e = check_all(
        r#"
        [[pools]]
        name = "a"
        models = ["a"]
        policy = "weigthed"
        workers = [{ url = "ftp://h:1" }]
        [pools.routing]
        scorers = [{ name = "queue", weight = 1.0 }]
        [[pools]]
        name = "b"
        models = ["b"]
        workers = [{ urll = "http://h:2" }]
        [[pools]]
        name = "c"
        models = 3
        aliases = ["c-alias"]
        workers = ["http://h:3"]
        [[pools]]
        name = "d"
        models = ["d"]
        workers = "http://h:4"
        "#,
        Secrets::Required,
    )
    .unwrap_err();
    let starts: Vec<&str> = e
        .problems
        .iter()
        .map(|p| p.split_once(": ").unwrap().0)
        .collect();
    assert_eq!(
        starts,
        [
            "pools[1].workers[0].urll",
            "pools[2].models",
            "pools[2].workers[0]",
            "pools[3].workers",
            "pools[0].policy",
            "pools[0].workers[0].url",
        ],
        "{e}"
    );
}

#[test]
fn a_mistyped_section_hides_nothing_else_and_adds_nothing() {
    // `[pools]` where `[[pools]]` was meant: no "at least one pool", and
    // references to pools are not reported again.
    let e = check_all(
        "[pools]\nname = \"p\"\n[scaling.pools.p]\nmax_replicas = 2\n[[splits]]\nmodel = \"s\"\ntargets = [{ pool = \"p\", weight = 1 }]\n[health]\ntimeout_ms = 0\n",
        Secrets::Required,
    )
    .unwrap_err();
    assert_eq!(
        e.problems,
        [
            "pools: invalid type: map, expected an array",
            "health.timeout_ms: must be greater than 0"
        ]
    );
}

#[test]
fn the_responses_id_key_is_read_checked_and_noted_when_absent() {
    let with = |var: &str| format!("[server]\nid_key_env = \"{var}\"\n{ONE_POOL}");
    let c = check_all(ONE_POOL, Secrets::Required).unwrap();
    assert!(c.config.server.id_key.is_none());
    assert!(
        c.notes
            .iter()
            .any(|n| n.starts_with("server.id_key_env: not set")),
        "{:?}",
        c.notes
    );
    std::env::set_var("SWITCHYARD_TEST_SHORT_ID_KEY", "0123abcd");
    let e = check_all(&with("SWITCHYARD_TEST_SHORT_ID_KEY"), Secrets::Required)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(
            "server.id_key_env: the key in `SWITCHYARD_TEST_SHORT_ID_KEY` must be at least 32"
        ),
        "{e}"
    );
    let e = check_all(&with("SWITCHYARD_TEST_UNSET_ID_KEY"), Secrets::Required)
        .unwrap_err()
        .to_string();
    assert!(e.contains("server.id_key_env: environment variable"), "{e}");
    let key = "5e0f1d2c3b4a69788796a5b4c3d2e1f0";
    std::env::set_var("SWITCHYARD_TEST_GOOD_ID_KEY", key);
    let c = check_all(&with("SWITCHYARD_TEST_GOOD_ID_KEY"), Secrets::Required).unwrap();
    assert_eq!(
        c.config.server.id_key.as_ref().map(Secret::expose),
        Some(key)
    );
    assert!(!format!("{:?}", c.config).contains(key), "Debug redacts it");
    assert!(c.notes.iter().all(|n| !n.contains("id_key")));
}

#[test]
fn unset_secrets_are_notes_when_optional() {
    let text = r#"
        [admin]
        listen = "127.0.0.1:9001"
        token_env = "SWITCHYARD_TEST_UNSET_ADMIN_TOKEN"
        [[tenants]]
        name = "acme"
        api_key_env = "SWITCHYARD_TEST_UNSET_TENANT_KEY"
        [[pools]]
        models = ["m"]
        upstream_api_key_env = "SWITCHYARD_TEST_UNSET_UPSTREAM_KEY"
        workers = [{ url = "http://h:1" }]
        "#;
    let vars = [
        "SWITCHYARD_TEST_UNSET_ADMIN_TOKEN",
        "SWITCHYARD_TEST_UNSET_TENANT_KEY",
        "SWITCHYARD_TEST_UNSET_UPSTREAM_KEY",
    ];
    let e = check_all(text, Secrets::Required).unwrap_err();
    let c = check_all(text, Secrets::Optional).unwrap();
    for v in vars {
        assert!(e.problems.iter().any(|p| p.contains(v)), "{v} in {e}");
        assert!(
            c.notes.iter().any(|n| n.contains(v)),
            "{v} in {:?}",
            c.notes
        );
    }
    assert!(c.config.pools[0].upstream_api_key.is_none());
    // Set values are still checked, and the rest of the file too.
    std::env::set_var("SWITCHYARD_TEST_SHORT_ADMIN_TOKEN", "short");
    let e = check_all(
        &text
            .replace("UNSET_ADMIN", "SHORT_ADMIN")
            .replace("name = \"acme\"", "name = \"acme\"\nresidency = \"mars\""),
        Secrets::Optional,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains(
            "admin.token_env: the token in `SWITCHYARD_TEST_SHORT_ADMIN_TOKEN` must be at least 16"
        ),
        "{e}"
    );
    assert!(e.contains("tenants[0].residency: `mars`"), "{e}");
}

#[test]
fn missing_api_key_env_is_an_error() {
    let e = check(
        r#"
        [[pools]]
        models = ["m"]
        upstream_api_key_env = "SWITCHYARD_TEST_SURELY_UNSET_VAR"
        workers = [{ url = "http://h:1" }]
        "#,
    )
    .unwrap_err();
    assert!(e.to_string().contains("pools[0].upstream_api_key_env"));
}
