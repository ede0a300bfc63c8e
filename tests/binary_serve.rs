//! `switchyard serve` as a process: thread-per-core serving (several threads, each
//! with its own SO_REUSEPORT listener) answers every connection, drains in-flight
//! streams on SIGTERM and exits cleanly.

mod support;

use std::process::Stdio;
use std::time::Duration;
use support::*;
use tokio::io::{AsyncBufReadExt, BufReader};

fn chat(model: &str, max_tokens: u32) -> serde_json::Value {
    serde_json::json!({"model": model, "stream": true, "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "hello from the binary test"}]})
}

/// Names of the process's threads (Linux `/proc`).
fn thread_names(pid: u32) -> Vec<String> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|d| {
            d.filter_map(|e| std::fs::read_to_string(e.ok()?.path().join("comm")).ok())
                .map(|s| s.trim().to_string())
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test]
async fn serve_on_several_threads_answers_every_connection_and_drains_on_sigterm() {
    let s = sims(2, 0.5).await;
    let model = sim_model();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args(["serve", "--listen", "127.0.0.1:0", "--threads", "3"])
        .args(["--worker", &s[0].url(), "--worker", &s[1].url()])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("binary starts");
    let pid = child.id().expect("pid");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let url = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(l) = lines.next_line().await.unwrap() {
            if let Some(u) = l.strip_prefix("switchyard ready url=") {
                return u.to_string();
            }
        }
        panic!("binary exited before printing its url");
    })
    .await
    .expect("ready line");
    // A thread names itself as it starts: wait until all three have.
    eventually(Duration::from_secs(10), "three serving threads", || {
        let n = thread_names(pid)
            .into_iter()
            .filter(|n| n.starts_with("switchyard-serv"))
            .count();
        async move { (n == 3).then_some(()) }
    })
    .await;
    eventually(Duration::from_secs(10), "models discovered", || {
        let url = url.clone();
        async move {
            let r = client().get(format!("{url}/ready")).send().await.ok()?;
            (r.status() == 200).then_some(())
        }
    })
    .await;

    // 24 streams, each on its own connection: the kernel spreads them over the
    // three listeners; every one must be answered in full.
    let mut streams = Vec::new();
    for _ in 0..24 {
        let (url, body) = (url.clone(), chat(&model, 40));
        streams.push(tokio::spawn(async move {
            let c = reqwest::Client::builder()
                .pool_max_idle_per_host(0)
                .build()
                .unwrap();
            let r = c
                .post(format!("{url}/v1/chat/completions"))
                .json(&body)
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), r.text().await.unwrap_or_default())
        }));
    }
    eventually(Duration::from_secs(10), "all streams started", || {
        let n = s[0].requests_received() + s[1].requests_received();
        async move { (n >= 24).then_some(()) }
    })
    .await;
    // SIGTERM while they are mid-stream: they finish, then the process exits 0.
    let running = sim_metric(&s[0].url(), "vllm:num_requests_running").await
        + sim_metric(&s[1].url(), "vllm:num_requests_running").await;
    assert!(running > 0.0, "streams still running when SIGTERM is sent");
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    for t in streams {
        let (status, text) = t.await.unwrap();
        assert_eq!(status, 200);
        assert!(text.ends_with("data: [DONE]\n\n"), "stream cut: {text}");
    }
    let exit = tokio::time::timeout(Duration::from_secs(20), child.wait())
        .await
        .expect("exits after draining")
        .unwrap();
    assert!(exit.success(), "exit status {exit}");
    assert!(
        client().get(format!("{url}/health")).send().await.is_err(),
        "listeners closed"
    );
}
