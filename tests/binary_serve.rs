//! `switchyard serve` as a process: thread-per-core serving (several threads, each
//! with its own SO_REUSEPORT listener) answers every connection, drains in-flight
//! streams on SIGTERM and exits cleanly; busy polling spins after requests and
//! parks when idle.

mod support;

use std::process::Stdio;
use std::time::Duration;
use support::*;
use tokio::io::{AsyncBufReadExt, BufReader};

fn chat(model: &str, max_tokens: u32) -> serde_json::Value {
    serde_json::json!({"model": model, "stream": true, "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "hello from the binary test"}]})
}

/// The process's threads (Linux `/proc`): name and `/proc/PID/task/TID` path.
fn threads(pid: u32) -> Vec<(String, std::path::PathBuf)> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|d| {
            d.filter_map(|e| {
                let path = e.ok()?.path();
                let comm = std::fs::read_to_string(path.join("comm")).ok()?;
                Some((comm.trim().to_string(), path))
            })
            .collect()
        })
        .unwrap_or_default()
}

/// `switchyard serve --listen 127.0.0.1:0 ARGS...`: the child, its pid and URL.
async fn start(args: &[&str]) -> (tokio::process::Child, u32, String) {
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args(["serve", "--listen", "127.0.0.1:0"])
        .args(args)
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
    (child, pid, url)
}

/// Wait until the gateway at `url` has discovered its models (`/ready` is 200).
async fn ready(url: &str) {
    eventually(Duration::from_secs(10), "models discovered", || {
        let url = url.to_string();
        async move {
            let r = client().get(format!("{url}/ready")).send().await.ok()?;
            (r.status() == 200).then_some(())
        }
    })
    .await;
}

/// CPU time (user + system, clock ticks) of the process's serving threads.
fn serving_cpu_ticks(pid: u32) -> u64 {
    threads(pid)
        .into_iter()
        .filter(|(name, _)| name.starts_with("switchyard-serv"))
        .filter_map(|(_, path)| {
            let stat = std::fs::read_to_string(path.join("stat")).ok()?;
            // Fields after the `(comm)`: state is the 3rd field, utime the 14th, stime the 15th.
            let rest = &stat[stat.rfind(')')? + 2..];
            let f: Vec<&str> = rest.split_whitespace().collect();
            Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
        })
        .sum()
}

#[tokio::test]
async fn serve_on_several_threads_answers_every_connection_and_drains_on_sigterm() {
    let s = sims(2, 0.5).await;
    let model = sim_model();
    let (mut child, pid, url) = start(&[
        "--threads",
        "3",
        "--worker",
        &s[0].url(),
        "--worker",
        &s[1].url(),
    ])
    .await;
    // A thread names itself as it starts: wait until all three have.
    eventually(Duration::from_secs(10), "three serving threads", || {
        let n = threads(pid)
            .into_iter()
            .filter(|(n, _)| n.starts_with("switchyard-serv"))
            .count();
        async move { (n == 3).then_some(()) }
    })
    .await;
    ready(&url).await;

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

#[tokio::test]
async fn busy_polling_spins_after_requests_and_parks_when_idle() {
    let s = sims(1, 0.05).await;
    let model = sim_model();
    let (_child, pid, url) = start(&[
        "--threads",
        "1",
        "--busy-poll-us",
        "5000",
        "--worker",
        &s[0].url(),
    ])
    .await;
    ready(&url).await;
    for _ in 0..20 {
        assert_eq!(chat_status(&url, &model).await, 200);
    }
    // Each spin is counted when its window ends with no new request activity.
    let spun = eventually(Duration::from_secs(10), "busy-poll time counted", || {
        let url = url.clone();
        async move {
            let v = metric_sum(
                &scrape(&url).await,
                "switchyard_busy_poll_microseconds_total",
                &[],
            );
            (v > 0.0).then_some(v)
        }
    })
    .await;
    assert!(spun >= 5_000.0, "at least one whole 5 ms window: {spun} µs");
    // Idle: the serving thread parks. Over 600 ms without requests it uses a
    // small part of that (a thread that kept spinning would use all of it).
    // The sleep is the idle period being measured, not a wait for an event.
    let tck = 100.0; // USER_HZ, the unit of /proc's utime and stime on Linux
    let before = serving_cpu_ticks(pid);
    tokio::time::sleep(Duration::from_millis(600)).await;
    let used_ms = (serving_cpu_ticks(pid) - before) as f64 * 1000.0 / tck;
    assert!(
        used_ms < 200.0,
        "serving thread busy while idle: {used_ms} ms of 600"
    );
}

/// The soft and hard open-file limits of a process (Linux `/proc/PID/limits`).
fn open_file_limits(pid: u32) -> (String, String) {
    let text = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let line = text
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .expect("Max open files line");
    let f: Vec<&str> = line.split_whitespace().collect();
    (f[3].to_string(), f[4].to_string())
}

#[tokio::test]
async fn the_binary_raises_its_open_file_limit_and_logs_without_colour() {
    let sims = sims(1, 1.0).await;
    let worker = urls(&sims)[0].clone();
    // Started with a low soft limit (a shell lowers it, then execs the binary in
    // the same process), so the test shows the binary raising it.
    let mut child = tokio::process::Command::new("sh")
        .args(["-c", "ulimit -Sn 256 && exec \"$0\" \"$@\""])
        .arg(env!("CARGO_BIN_EXE_switchyard"))
        .args(["serve", "--listen", "127.0.0.1:0", "--worker", &worker])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("binary starts");
    let pid = child.id().unwrap();
    let mut err = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut logged = String::new();
    tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(l) = err.next_line().await.unwrap() {
            logged.push_str(&l);
            logged.push('\n');
            if l.contains("switchyard listening") {
                return;
            }
        }
        panic!("binary exited: {logged}");
    })
    .await
    .expect("listening log line");
    let (soft, hard) = open_file_limits(pid);
    assert_eq!(soft, hard, "soft limit raised to the hard one");
    assert_ne!(soft, "256", "the soft limit was left as started");
    assert!(logged.contains("open-file limit"), "{logged}");
    assert!(logged.contains("max_connections"), "{logged}");
    assert!(
        !logged.contains('\u{1b}'),
        "colour codes in a piped log: {logged}"
    );
    child.kill().await.unwrap();
}

#[tokio::test]
async fn a_worker_without_models_is_reported_instead_of_ready() {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let dead = format!("http://{}", l.local_addr().unwrap());
    drop(l);
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args(["serve", "--listen", "127.0.0.1:0", "--worker", &dead])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("binary starts");
    let mut out = BufReader::new(child.stdout.take().unwrap()).lines();
    let first = tokio::time::timeout(Duration::from_secs(30), out.next_line())
        .await
        .expect("a first line")
        .unwrap()
        .expect("stdout open");
    assert!(first.starts_with("switchyard listening url="), "{first}");
    assert!(first.contains("not ready"), "{first}");
    assert!(first.contains(&dead), "{first}");
    let mut err = BufReader::new(child.stderr.take().unwrap()).lines();
    tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(l) = err.next_line().await.unwrap() {
            if l.contains("WARN") && l.contains("model discovery failed") && l.contains(&dead) {
                return;
            }
        }
        panic!("no discovery warning");
    })
    .await
    .expect("discovery warning");
    child.kill().await.unwrap();
}

#[tokio::test]
async fn the_demo_names_a_taken_port_and_the_flag_to_change_it() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args(["demo", "--workers", "1", "--listen", &addr])
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&addr) && err.contains("--listen"), "{err}");
}
