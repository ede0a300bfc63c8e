//! Bad input against the real binary (`switchyard serve` in front of `switchyard
//! sim`): truncated and malformed JSON, a 100 MB body, deep nesting, invalid
//! UTF-8, header injection and slowloris. Each case gets a clear 4xx or a
//! timeout, and a well-behaved client running alongside the whole time keeps
//! getting answers: after every case it has completed more requests and none
//! of its requests has failed.

mod support;

use serde_json::json;
use std::net::SocketAddr;
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use support::raw::{raw, read_to_close, status_of, SAFETY};
use support::{client, eventually};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::process::{Child, Command};

const MAX_BODY: usize = 1 << 20;

/// Start `switchyard ARGS...` and wait for the stdout line starting with `prefix`.
async fn start(args: &[&str], prefix: &str) -> (Child, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("binary starts");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let line = tokio::time::timeout(SAFETY, async {
        while let Some(l) = lines.next_line().await.unwrap() {
            if l.starts_with(prefix) {
                return l;
            }
        }
        panic!("exited before printing {prefix:?}");
    })
    .await
    .expect("ready line");
    // Keep draining stdout so the child never blocks on a full pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    (child, line)
}

fn field(line: &str, name: &str) -> String {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(&format!("{name}=")))
        .unwrap_or_else(|| panic!("no {name}= in {line:?}"))
        .trim_end_matches(',')
        .to_string()
}

/// A simulated worker and a gateway in front of it, as processes.
struct Fleet {
    _sim: Child,
    _gw: Child,
    url: String,
    addr: SocketAddr,
    model: String,
    _dir: TempDir,
}

struct TempDir(std::path::PathBuf);
impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

async fn fleet() -> Fleet {
    let (sim, line) = start(
        &["sim", "--port", "0", "--time-scale", "50"],
        "switchyard-sim ready",
    )
    .await;
    let (sim_url, model) = (field(&line, "url"), field(&line, "model"));
    let dir = std::env::temp_dir().join(format!("switchyard-bad-input-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("gw.toml");
    std::fs::write(
        &file,
        format!(
            "[server]\nlisten = \"127.0.0.1:0\"\nthreads = 1\nmax_body_bytes = {MAX_BODY}\n\
             header_read_timeout_ms = 500\nbody_read_timeout_ms = 1000\nmax_json_depth = 32\n\
             [[pools]]\nname = \"p\"\nworkers = [{{ url = \"{sim_url}\" }}]\n"
        ),
    )
    .unwrap();
    let (gw, line) = start(
        &["serve", "--config", file.to_str().unwrap()],
        "switchyard ready",
    )
    .await;
    let url = field(&line, "url");
    let addr = url.trim_start_matches("http://").parse().unwrap();
    Fleet {
        _sim: sim,
        _gw: gw,
        url,
        addr,
        model,
        _dir: TempDir(dir),
    }
}

/// A client sending ordinary chat requests in a loop, counting answers.
struct Bystander {
    ok: Arc<AtomicU64>,
    failed: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Bystander {
    fn start(f: &Fleet) -> Bystander {
        let (ok, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let (o, x) = (ok.clone(), failed.clone());
        let url = format!("{}/v1/chat/completions", f.url);
        let body = json!({"model": f.model, "max_tokens": 2,
            "messages": [{"role": "user", "content": "are you still there?"}]});
        let task = tokio::spawn(async move {
            let c = client();
            loop {
                let served = match c.post(&url).json(&body).send().await {
                    Ok(r) => r.status() == 200 && r.bytes().await.is_ok(),
                    Err(_) => false,
                };
                let count = if served { &o } else { &x };
                count.fetch_add(1, Ordering::Relaxed);
            }
        });
        Bystander { ok, failed, task }
    }

    /// After a case: the bystander completed more requests, and none failed.
    async fn still_served(&self, case: &str) {
        let before = self.ok.load(Ordering::Relaxed);
        eventually(
            SAFETY,
            &format!("the bystander served after {case}"),
            || {
                let now = self.ok.load(Ordering::Relaxed);
                async move { (now >= before + 3).then_some(()) }
            },
        )
        .await;
        assert_eq!(
            self.failed.load(Ordering::Relaxed),
            0,
            "a bystander request failed during {case}"
        );
    }
}

fn post(path: &str, headers: &str, body: &[u8]) -> Vec<u8> {
    let mut out = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n{headers}Content-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(body);
    out
}

/// POST `body` to chat completions; status and the OpenAI error (message, code).
async fn chat_error(f: &Fleet, headers: &str, body: &[u8]) -> (u16, String, String) {
    let answer = raw(f.addr, &post("/v1/chat/completions", headers, body)).await;
    let status = status_of(&answer);
    let json = answer.split("\r\n\r\n").nth(1).unwrap_or("");
    let v: serde_json::Value =
        serde_json::from_str(json).unwrap_or_else(|e| panic!("{e}: not JSON: {answer:?}"));
    let s = |k: &str| v["error"][k].as_str().unwrap_or_default().to_string();
    (status, s("message"), s("code"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_a_clear_4xx_or_a_timeout_and_others_are_unaffected() {
    let f = fleet().await;
    let by = Bystander::start(&f);
    by.still_served("start").await;

    malformed_json(&f).await;
    by.still_served("malformed JSON").await;
    deep_nesting(&f).await;
    by.still_served("deep nesting").await;
    invalid_utf8(&f).await;
    by.still_served("invalid UTF-8").await;
    hundred_megabytes(&f).await;
    by.still_served("a 100 MB body").await;
    header_injection(&f).await;
    by.still_served("header injection").await;
    slowloris(&f, &by).await;
    by.still_served("slowloris").await;
    by.task.abort();
}

async fn malformed_json(f: &Fleet) {
    let m = &f.model;
    let truncated = format!(r#"{{"model":"{m}","messages":[{{"role":"user","content":"hi"#);
    for body in [
        truncated.as_str(),
        "{",
        "{\"model\":",
        "{model: 1}",
        "{\"model\":\"x\",}",
        "nul",
        "\u{0}\u{0}",
        "[1,2",
    ] {
        let (status, message, _) = chat_error(f, "", body.as_bytes()).await;
        assert_eq!(status, 400, "{body:?}: {message}");
        assert!(message.contains("JSON"), "{body:?}: {message}");
    }
}

async fn deep_nesting(f: &Fleet) {
    for depth in [33usize, 200, 100_000] {
        let body = format!(
            r#"{{"model":"{}","messages":{}{}}}"#,
            f.model,
            "[".repeat(depth),
            "]".repeat(depth)
        );
        let (status, message, code) = chat_error(f, "", body.as_bytes()).await;
        assert_eq!(
            (status, code.as_str()),
            (400, "json_too_deep"),
            "{depth}: {message}"
        );
        assert!(message.contains("32 levels"), "{message}");
    }
    // Within the limit it is served (the worker gets to judge the content).
    let ok = format!(
        r#"{{"model":"{}","max_tokens":1,"messages":[{{"role":"user","content":"x"}}],"metadata":{}{}}}"#,
        f.model,
        "[".repeat(20),
        "]".repeat(20)
    );
    let answer = raw(f.addr, &post("/v1/chat/completions", "", ok.as_bytes())).await;
    assert_ne!(status_of(&answer), 400, "{answer}");
}

async fn invalid_utf8(f: &Fleet) {
    let mut body = br#"{"model":"bad"#.to_vec();
    body.extend_from_slice(b"\xff\xfe");
    body.extend_from_slice(br#"","messages":[]}"#);
    let (status, message, _) = chat_error(f, "", &body).await;
    assert_eq!(status, 400, "{message}");
    assert!(message.contains("not valid UTF-8"), "{message}");
    let mut header = b"x-session-id: s".to_vec();
    header.extend_from_slice(b"\xc3\x28\r\n");
    let ok = format!(r#"{{"model":"{}","messages":[]}}"#, f.model);
    let mut req =
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n".to_vec();
    req.extend_from_slice(&header);
    req.extend_from_slice(format!("Content-Length: {}\r\n\r\n{ok}", ok.len()).as_bytes());
    let answer = raw(f.addr, &req).await;
    assert_eq!(status_of(&answer), 400, "{answer}");
    assert!(
        answer.contains("x-session-id") && answer.contains("invalid_header"),
        "{answer}"
    );
}

/// 100 MB announced, and 100 MB streamed chunked: refused at the limit, long
/// before the client could send it all (the gateway never holds it).
async fn hundred_megabytes(f: &Fleet) {
    const HUNDRED_MB: usize = 100 << 20;
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {HUNDRED_MB}\r\n\r\n"
    );
    let mut s = TcpStream::connect(f.addr).await.unwrap();
    s.write_all(head.as_bytes()).await.unwrap();
    let answer = read_to_close(&mut s).await;
    assert_eq!(status_of(&answer), 413, "{answer}");
    assert!(answer.contains("request_too_large"), "{answer}");

    let mut s = TcpStream::connect(f.addr).await.unwrap();
    s.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
        .await
        .unwrap();
    let chunk = {
        let data = vec![b' '; 64 << 10];
        let mut c = format!("{:x}\r\n", data.len()).into_bytes();
        c.extend_from_slice(&data);
        c.extend_from_slice(b"\r\n");
        c
    };
    let (mut rd, mut wr) = s.into_split();
    let writer = tokio::spawn(async move {
        let mut sent = 0usize;
        while sent < HUNDRED_MB {
            if wr.write_all(&chunk).await.is_err() {
                break;
            }
            sent += chunk.len();
        }
        sent
    });
    let mut answer = Vec::new();
    tokio::time::timeout(SAFETY, rd.read_to_end(&mut answer))
        .await
        .expect("answered")
        .ok();
    let answer = String::from_utf8_lossy(&answer).into_owned();
    assert_eq!(status_of(&answer), 413, "{answer}");
    let sent = writer.await.unwrap();
    assert!(
        sent < HUNDRED_MB,
        "the whole 100 MB was accepted ({sent} bytes)"
    );
}

/// CR or LF inside a header value, NUL, and a header line with no colon: the
/// request never reaches a handler.
async fn header_injection(f: &Fleet) {
    let body = format!(r#"{{"model":"{}","messages":[]}}"#, f.model);
    for injected in [
        &b"X-A: one\rX-Injected: two\r\n"[..],
        b"X-A: one\nX-Injected: two\r\n",
        b"X-A: one\x00two\r\n",
        b"X-Request-Id: abc\r\n\r\nGET /smuggled HTTP/1.1\r\n",
        b"Not a header line\r\n",
    ] {
        let mut req =
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n".to_vec();
        req.extend_from_slice(injected);
        req.extend_from_slice(format!("Content-Length: {}\r\n\r\n{body}", body.len()).as_bytes());
        let answer = raw(f.addr, &req).await;
        let shown = String::from_utf8_lossy(injected);
        assert!(
            !answer.contains("chat.completion"),
            "{shown:?} was served: {answer}"
        );
        if !answer.is_empty() {
            let status = status_of(&answer);
            assert!((400..500).contains(&status), "{shown:?}: {answer}");
        }
    }
}

/// Many connections trickling their headers a byte at a time: each is closed at
/// the header timeout, and the bystander keeps being served meanwhile.
async fn slowloris(f: &Fleet, by: &Bystander) {
    let mut tasks = Vec::new();
    for _ in 0..50 {
        let addr = f.addr;
        tasks.push(tokio::spawn(async move {
            let mut s = TcpStream::connect(addr).await.unwrap();
            for b in b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: "
                .iter()
                .cycle()
            {
                if s.write_all(&[*b]).await.is_err() {
                    return true;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                let mut buf = [0u8; 1];
                if let Ok(Ok(0)) = tokio::time::timeout(Duration::ZERO, s.read(&mut buf)).await {
                    return true;
                }
            }
            false
        }));
    }
    by.still_served("slowloris in progress").await;
    for t in tasks {
        let closed = tokio::time::timeout(SAFETY, t)
            .await
            .expect("closed in time")
            .unwrap();
        assert!(closed);
    }
}
