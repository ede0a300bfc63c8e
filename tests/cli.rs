//! The binary's packaging-facing commands: `--version` with the git revision,
//! shell completions (checked by the shells themselves where installed), and
//! `switchyard health`, the container HEALTHCHECK probe, against a live gateway.

mod support;

use std::process::Output;
use support::*;

const BIN: &str = env!("CARGO_BIN_EXE_switchyard");

async fn run(args: &[&str]) -> Output {
    tokio::process::Command::new(BIN)
        .args(args)
        .output()
        .await
        .expect("binary runs")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The revision build.rs should have found: git's short HEAD, or `unknown`.
fn expected_revision() -> String {
    std::process::Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into())
}

#[tokio::test]
async fn version_names_the_package_version_and_git_revision() {
    let o = run(&["--version"]).await;
    assert!(o.status.success(), "{}", stderr(&o));
    let want = format!(
        "switchyard {} (git {})",
        env!("CARGO_PKG_VERSION"),
        expected_revision()
    );
    assert_eq!(stdout(&o).trim(), want);
}

#[tokio::test]
async fn completions_cover_the_subcommands_for_each_shell() {
    for (shell, marker) in [
        ("bash", "complete -F _switchyard"),
        ("zsh", "#compdef switchyard"),
        ("fish", "complete -c switchyard"),
    ] {
        let o = run(&["completions", shell]).await;
        assert!(o.status.success(), "{shell}: {}", stderr(&o));
        let script = stdout(&o);
        assert!(script.contains(marker), "{shell}: no `{marker}`");
        for sub in ["serve", "check-config", "sim", "health", "completions"] {
            assert!(script.contains(sub), "{shell}: `{sub}` not completed");
        }
    }
    let o = run(&["completions", "tcsh"]).await;
    assert!(!o.status.success());
    assert!(stderr(&o).contains("possible values"), "{}", stderr(&o));
}

/// The bash script parses (`bash -n`) and, sourced, completes a subcommand.
#[tokio::test]
async fn bash_completion_script_completes_subcommands() {
    let o = run(&["completions", "bash"]).await;
    let path =
        std::env::temp_dir().join(format!("switchyard-{}-completion.bash", std::process::id()));
    std::fs::write(&path, &o.stdout).unwrap();
    let script = format!(
        "source {}; COMP_WORDS=(switchyard check-c); COMP_CWORD=1; _switchyard switchyard check-c switchyard; echo \"${{COMPREPLY[@]}}\"",
        path.display()
    );
    let out = tokio::process::Command::new("bash")
        .args(["-c", &script])
        .output()
        .await
        .expect("bash runs");
    std::fs::remove_file(&path).unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out).trim(), "check-config");
}

#[tokio::test(flavor = "multi_thread")]
async fn health_exits_zero_only_on_a_2xx_answer() {
    let workers = sims(1, 1.0).await;
    let model = sim_model();
    let gw = gateway(&pool_toml(&model, &[&workers[0].url()], "")).await;
    let ok = run(&["health", "--url", &format!("{}/health", gw.url())]).await;
    assert!(ok.status.success(), "{}", stderr(&ok));
    assert!(stdout(&ok).contains("200 OK"), "{}", stdout(&ok));

    // A pool whose models cannot be discovered: `/ready` answers 503.
    let unready =
        gateway("[[pools]]\nname = \"p\"\nworkers = [{ url = \"http://127.0.0.1:1\" }]\n").await;
    let url = format!("{}/ready", unready.url());
    let o = run(&["health", "--url", &url]).await;
    assert!(!o.status.success());
    assert!(stderr(&o).contains("unhealthy (503"), "{}", stderr(&o));

    // Nothing listening.
    let o = run(&["health", "--url", "http://127.0.0.1:1/health"]).await;
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("http://127.0.0.1:1/health:"),
        "{}",
        stderr(&o)
    );

    // https is probed too (tests/trust_ops.rs has a TLS gateway): nothing there.
    let o = run(&["health", "--url", "https://127.0.0.1:1/health"]).await;
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("https://127.0.0.1:1/health:"),
        "{}",
        stderr(&o)
    );
}
