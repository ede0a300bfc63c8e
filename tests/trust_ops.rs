//! Operating the gateway where trust meets operations (issue #31): certificates
//! outside their validity window refused at start, by `check-config` and on
//! rotation; shutdown that does not wait on idle HTTP/2 connections and ends a
//! stream cut at the drain deadline with the error event; `switchyard health`
//! over https; plain HTTP sent to a TLS port; and the KV block size learned from
//! the engines.

mod support;

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use support::tls::{connect, negotiated, temp_dir, write_pair, Ca, Leaf};
use support::{eventually, gateway, metric_sum, pool_toml, sim_model, sims, urls};
use switchyard::telemetry::names;

/// Dates well outside any test run.
const EXPIRED: ((i32, u8, u8), (i32, u8, u8)) = ((2000, 1, 1), (2001, 1, 1));
const NOT_YET: ((i32, u8, u8), (i32, u8, u8)) = ((2090, 1, 1), (2091, 1, 1));
const CURRENT: ((i32, u8, u8), (i32, u8, u8)) = ((2000, 1, 1), (2090, 6, 1));

fn leaf(ca: &Ca, cn: &str, window: ((i32, u8, u8), (i32, u8, u8))) -> Leaf {
    ca.server_valid(cn, window.0, window.1)
}

#[tokio::test]
async fn serve_and_check_config_refuse_a_certificate_outside_its_validity_window() {
    let dir = temp_dir("trust-expired");
    let ca = Ca::new("validity CA");
    let bin = env!("CARGO_BIN_EXE_switchyard");
    for (name, window, want) in [
        ("expired", EXPIRED, "expired: notAfter 2001-01-01T00:00:00Z"),
        (
            "future",
            NOT_YET,
            "not valid yet: notBefore 2090-01-01T00:00:00Z",
        ),
    ] {
        let (cert, key) = write_pair(&dir, name, &leaf(&ca, name, window));
        let out = tokio::time::timeout(
            Duration::from_secs(60),
            tokio::process::Command::new(bin)
                .args(["serve", "--listen", "127.0.0.1:0", "--threads", "1"])
                .args(["--worker", "http://127.0.0.1:9"])
                .arg("--tls-cert")
                .arg(&cert)
                .arg("--tls-key")
                .arg(&key)
                .kill_on_drop(true)
                .output(),
        )
        .await
        .expect("serve exits instead of serving")
        .unwrap();
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        assert!(!out.status.success(), "{name}: serve started: {stdout}");
        assert!(!stdout.contains("switchyard ready"), "{stdout}");
        assert!(
            stderr.contains("server.tls:") && stderr.contains(want),
            "{name}: {stderr}"
        );

        let file = dir.join(format!("{name}.toml"));
        std::fs::write(
            &file,
            format!(
                "[server.tls]\ncert = {cert:?}\nkey = {key:?}\n{}",
                pool_toml("m", &["http://127.0.0.1:9"], "")
            ),
        )
        .unwrap();
        let out = std::process::Command::new(bin)
            .arg("check-config")
            .arg(&file)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{name}: check-config passed");
        assert!(stderr.contains(want), "{name}: {stderr}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn rotation_to_an_expired_certificate_keeps_the_old_one_and_counts_the_rejection() {
    let dir = temp_dir("trust-rotate");
    let ca = Ca::new("rotation CA");
    let good = leaf(&ca, "good", CURRENT);
    let (cert, key) = write_pair(&dir, "server", &good);
    let s = sims(1, 50.0).await;
    let u = urls(&s);
    let gw = gateway(&format!(
        "[server.tls]\ncert = {cert:?}\nkey = {key:?}\nreload_interval_ms = 50\n{}",
        pool_toml(&sim_model(), &[u[0].as_str()], "")
    ))
    .await;
    let metric = |name: &str, labels: &[(&str, &str)]| {
        metric_sum(&gw.gateway.metrics.render(), name, labels)
    };
    // 2090-06-01T00:00:00Z, the served chain's notAfter.
    let good_expiry = 3_799_958_400.0;
    assert_eq!(
        metric(names::TLS_CERT_EXPIRY_SECONDS, &[("listener", "client")]),
        good_expiry
    );

    for (n, window) in [(1.0, EXPIRED), (2.0, NOT_YET)] {
        write_pair(&dir, "server", &leaf(&ca, "bad", window));
        eventually(Duration::from_secs(30), "the rotation rejected", || {
            let r = metric(
                names::TLS_CERT_RELOADS_TOTAL,
                &[("listener", "client"), ("result", "rejected")],
            );
            async move { (r >= n).then_some(()) }
        })
        .await;
        // New handshakes still get the good chain, and succeed.
        let s = connect(gw.addr, &ca.der(), &[b"h2"], None).await.unwrap();
        assert_eq!(negotiated(&s).1, good.der);
        let mut send = support::tls::Sender::over(s).await.unwrap();
        assert_eq!(
            send.send("GET", "/health", None, None).await.unwrap().0,
            200
        );
    }
    let ok = metric(
        names::TLS_CERT_RELOADS_TOTAL,
        &[("listener", "client"), ("result", "ok")],
    );
    assert_eq!(ok, 0.0, "a rejected certificate was counted as ok");
    assert_eq!(
        metric(names::TLS_CERT_EXPIRY_SECONDS, &[("listener", "client")]),
        good_expiry
    );
    let _ = std::fs::remove_dir_all(&dir);
}

fn stream_chat(model: &str, max_tokens: u32) -> serde_json::Value {
    serde_json::json!({"model": model, "stream": true, "max_tokens": max_tokens,
        "ignore_eos": true, "messages": [{"role": "user", "content": "drain"}]})
}

/// SIGTERM to a child process.
fn terminate(child: &tokio::process::Child) {
    let pid = child.id().expect("running").to_string();
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    assert!(killed.success());
}

/// A client socket that stops reading once `paused`: a connection idle in a
/// client's pool that nobody polls.
struct DeafWhenIdle {
    io: tokio::net::TcpStream,
    paused: Arc<AtomicBool>,
}

impl tokio::io::AsyncRead for DeafWhenIdle {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if self.paused.load(Ordering::Relaxed) {
            return Poll::Pending;
        }
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for DeafWhenIdle {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[tokio::test]
async fn an_idle_http2_connection_does_not_hold_the_process_for_the_drain_timeout() {
    let s = sims(1, 50.0).await;
    let model = sim_model();
    let file = support::config_file(
        "trust-h2-idle",
        &format!(
            "[server]\ndrain_timeout_ms = 60000\nunready_grace_ms = 0\nthreads = 1\n{}",
            pool_toml(&model, &[&s[0].url()], "")
        ),
    );
    let log = file.with_file_name("stderr.log");
    let mut gw = support::serve_binary_with(&file, &[], Some(&log)).await;
    let addr = gw.url.strip_prefix("http://").unwrap().to_string();
    // HTTP/2 with prior knowledge (h2c): one request answered, then idle, and
    // like a pooled client connection nobody reads: the gateway's GOAWAY and
    // its PING are never answered.
    let tcp = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let paused = Arc::new(AtomicBool::new(false));
    let io = DeafWhenIdle {
        io: tcp,
        paused: paused.clone(),
    };
    let (mut send, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(io),
    )
    .await
    .unwrap();
    let conn = tokio::spawn(conn);
    let body = serde_json::json!({"model": model, "max_tokens": 2,
        "messages": [{"role": "user", "content": "h2"}]});
    let req = http::Request::post(format!("http://{addr}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from(
            body.to_string(),
        )))
        .unwrap();
    let resp = send.send_request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    http_body_util::BodyExt::collect(resp.into_body())
        .await
        .unwrap();
    paused.store(true, Ordering::Relaxed);

    terminate(&gw.child);
    // Nothing is in flight: the process must not sit out the 60 s drain timeout.
    let exit = tokio::time::timeout(Duration::from_secs(45), gw.child.wait())
        .await
        .expect("exited before the drain timeout")
        .unwrap();
    assert!(exit.success(), "{exit}");
    conn.abort();
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("drained: 0 requests finished"), "{text}");
    assert!(!text.contains("deadline"), "{text}");
}

#[tokio::test]
async fn a_stream_still_running_at_the_drain_deadline_ends_with_the_error_event() {
    let s = sims(1, 0.05).await;
    let model = sim_model();
    let gw = gateway(&format!(
        "[server]\nunready_grace_ms = 0\ndrain_timeout_ms = 300\n{}",
        pool_toml(&model, &[&s[0].url()], "")
    ))
    .await;
    let mut resp = support::client()
        .post(format!("{}/v1/chat/completions", gw.url()))
        .json(&stream_chat(&model, 1000))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let first = resp.chunk().await.unwrap().expect("the stream started");
    let mut text = String::from_utf8_lossy(&first).into_owned();
    let gateway = gw.gateway.clone();
    let stopping = tokio::spawn(gw.shutdown());
    while let Some(c) = resp.chunk().await.expect("the stream ends cleanly") {
        text.push_str(&String::from_utf8_lossy(&c));
    }
    let last = text.trim_end().rsplit("\n\n").next().unwrap();
    let event: serde_json::Value =
        serde_json::from_str(last.strip_prefix("data: ").expect("an SSE data line")).unwrap();
    assert_eq!(event["error"]["code"], "drain_deadline", "{text}");
    assert!(!text.contains("[DONE]"), "{text}");
    stopping.await.unwrap();
    let report = gateway.drain.report();
    assert_eq!((report.at_start, report.cut), (1, 1), "{report:?}");
}

/// An engine that takes chat requests and never answers them (its health
/// probe answers): each request's arrival is sent on the returned channel.
async fn silent_engine() -> (String, tokio::sync::mpsc::UnboundedReceiver<()>) {
    use axum::routing::{get, post};
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let hold = move || {
        let tx = tx.clone();
        async move {
            let _ = tx.send(());
            std::future::pending::<&'static str>().await
        }
    };
    let app = axum::Router::new()
        .route("/health", get(|| async { "ok" }))
        .route("/v1/chat/completions", post(hold));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, rx)
}

#[tokio::test]
async fn a_request_still_waiting_for_its_first_byte_at_the_drain_deadline_gets_a_503() {
    let (engine, mut arrived) = silent_engine().await;
    let gw = gateway(&format!(
        "[server]\nunready_grace_ms = 0\ndrain_timeout_ms = 300\n{}",
        pool_toml("silent", &[&engine], "")
    ))
    .await;
    let url = gw.url();
    let waiting = tokio::spawn(async move {
        support::client()
            .post(format!("{url}/v1/chat/completions"))
            .json(&serde_json::json!({"model": "silent", "messages": [{"role": "user", "content": "hi"}]}))
            .send()
            .await
            .unwrap()
    });
    arrived
        .recv()
        .await
        .expect("the request reached the engine");
    let gateway = gw.gateway.clone();
    let stopping = tokio::spawn(gw.shutdown());
    let resp = waiting.await.unwrap();
    assert_eq!(resp.status(), 503);
    assert_eq!(resp.headers()["retry-after"], "1");
    let body: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(body["error"]["code"], "drain_deadline", "{body}");
    assert_eq!(body["error"]["type"], "service_unavailable", "{body}");
    stopping.await.unwrap();
    let report = gateway.drain.report();
    assert_eq!(
        (report.at_deadline, report.refused, report.cut),
        (1, 1, 0),
        "{report:?}"
    );
}

/// `switchyard ARGS…` to completion: success, stdout and stderr.
async fn run_binary(args: &[&str]) -> (bool, String, String) {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args(args)
        .kill_on_drop(true)
        .output()
        .await
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn health_probes_https_by_url_and_by_config_and_plain_http_on_a_tls_port_is_told() {
    let dir = temp_dir("trust-health");
    let ca = Ca::new("health CA");
    let (cert, key) = write_pair(&dir, "server", &leaf(&ca, "gw", CURRENT));
    let ca_file = dir.join("ca.pem");
    std::fs::write(&ca_file, ca.pem()).unwrap();
    let s = sims(1, 50.0).await;
    let tls = format!("[server.tls]\ncert = {cert:?}\nkey = {key:?}\n");
    let pool = pool_toml(&sim_model(), &[s[0].url().as_str()], "");
    let gw = gateway(&format!("{tls}{pool}")).await;
    let port = gw.addr.port();
    let https = format!("https://127.0.0.1:{port}/health");
    let ca_arg = ca_file.to_str().unwrap();

    let (ok, out, err) = run_binary(&["health", "--url", &https, "--ca-file", ca_arg]).await;
    assert!(ok, "{err}");
    assert!(out.contains("200"), "{out}");
    // Not trusting the gateway's CA is a failure, not a pass.
    let (ok, _, err) = run_binary(&["health", "--url", &https]).await;
    assert!(!ok && err.contains(&https), "{err}");
    // The Dockerfile's form: the port and scheme from the configuration.
    let file = dir.join("gw.toml");
    std::fs::write(
        &file,
        format!("[server]\nlisten = \"0.0.0.0:{port}\"\n{tls}{pool}"),
    )
    .unwrap();
    let (ok, out, err) = run_binary(&["health", "--config", file.to_str().unwrap()]).await;
    assert!(ok, "{err}");
    assert!(
        out.starts_with(&format!("https://127.0.0.1:{port}/health: 200")),
        "{out}"
    );
    let dockerfile = include_str!("../docker/Dockerfile");
    assert!(
        dockerfile.contains(r#""health", "--config", "/etc/switchyard/switchyard.toml""#),
        "the image's HEALTHCHECK probes by its configuration"
    );

    // Plain HTTP sent to the TLS port gets an answer it can read.
    let (ok, _, err) = run_binary(&[
        "health",
        "--url",
        &format!("http://127.0.0.1:{port}/health"),
    ])
    .await;
    assert!(!ok && err.contains("400"), "{err}");
    let mut tcp = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    tcp.write_all(b"GET /v1/models HTTP/1.1\r\nhost: gw\r\n\r\n")
        .await
        .unwrap();
    let mut answer = String::new();
    tokio::time::timeout(Duration::from_secs(10), tcp.read_to_string(&mut answer))
        .await
        .expect("answered and closed")
        .unwrap();
    assert!(
        answer.starts_with("HTTP/1.1 400 Bad Request\r\n"),
        "{answer}"
    );
    assert!(answer.ends_with("This port speaks TLS: use https:// instead of http://.\n"));
    let plaintext = metric_sum(
        &gw.gateway.metrics.render(),
        names::TLS_HANDSHAKE_FAILURES_TOTAL,
        &[("listener", "client"), ("reason", "plaintext_http")],
    );
    assert!(plaintext >= 2.0, "{plaintext}");
    // TLS clients are unaffected.
    let s = connect(gw.addr, &ca.der(), &[b"h2"], None).await.unwrap();
    let mut send = support::tls::Sender::over(s).await.unwrap();
    assert_eq!(
        send.send("GET", "/health", None, None).await.unwrap().0,
        200
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn demo_policy_lists_its_valid_values() {
    let (ok, _, err) = run_binary(&["demo", "--policy", "fastest"]).await;
    assert!(!ok);
    assert!(
        err.contains("invalid value 'fastest'")
            && err.contains("prefix")
            && err.contains("round_robin"),
        "{err}"
    );
}
