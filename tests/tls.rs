//! TLS termination against a generated CA: HTTPS over HTTP/1.1 and HTTP/2 chosen
//! by ALPN, a certificate replaced on disk served to the next connection (and a
//! broken replacement refused), a stalled handshake bounded by the header
//! timeout, client-certificate authentication on the admin listener, and the
//! `serve --tls-cert --tls-key` quick start as a process.

mod support;

use serde_json::json;
use std::process::Stdio;
use std::time::Duration;
use support::tls::{connect, negotiated, temp_dir, write_pair, Ca, Sender};
use support::{eventually, gateway, metric_sum, pool_toml, sim_model, sims, urls};
use switchyard::telemetry::names;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};

fn chat(model: &str) -> serde_json::Value {
    json!({"model": model, "max_tokens": 4,
        "messages": [{"role": "user", "content": "hello over TLS"}]})
}

/// A gateway in front of one simulated worker, TLS on with `tls_lines` added to `[server.tls]`.
async fn tls_gateway(
    dir: &std::path::Path,
    ca: &Ca,
    server_extra: &str,
    tls_lines: &str,
) -> (
    switchyard::server::ServerHandle,
    Vec<switchyard::sim::SimHandle>,
) {
    let (cert, key) = write_pair(dir, "server", &ca.server("gateway-1"));
    let s = sims(1, 50.0).await;
    let u = urls(&s);
    let gw = gateway(&format!(
        "[server]\n{server_extra}\n[server.tls]\ncert = {cert:?}\nkey = {key:?}\n{tls_lines}\n{}",
        pool_toml(&sim_model(), &[u[0].as_str()], "")
    ))
    .await;
    assert!(gw.url().starts_with("https://"), "{}", gw.url());
    (gw, s)
}

#[tokio::test]
async fn https_serves_http1_and_http2_chosen_by_alpn() {
    let dir = temp_dir("tls-alpn");
    let ca = Ca::new("alpn CA");
    let (gw, _sims) = tls_gateway(&dir, &ca, "", "").await;
    let model = sim_model();
    for (offer, want) in [
        (&[b"h2".as_slice(), b"http/1.1"][..], b"h2".as_slice()),
        (&[b"http/1.1".as_slice()][..], b"http/1.1"),
    ] {
        let s = connect(gw.addr, &ca.der(), offer, None).await.unwrap();
        assert_eq!(negotiated(&s).0.as_deref(), Some(want));
        let mut send = Sender::over(s).await.unwrap();
        let (status, body) = send
            .send("POST", "/v1/chat/completions", Some(&chat(&model)), None)
            .await
            .unwrap();
        assert_eq!(status, 200, "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["object"], "chat.completion");
        // Several requests on one connection.
        let (status, _) = send.send("GET", "/v1/models", None, None).await.unwrap();
        assert_eq!(status, 200);
    }
    // A client that does not trust the gateway's CA is refused by its own side.
    let other = Ca::new("untrusted CA");
    assert!(connect(gw.addr, &other.der(), &[b"h2"], None)
        .await
        .is_err());
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_certificate_replaced_on_disk_is_served_to_the_next_connection() {
    let dir = temp_dir("tls-reload");
    let ca = Ca::new("reload CA");
    let (gw, _sims) = tls_gateway(&dir, &ca, "", "reload_interval_ms = 50").await;
    let model = sim_model();
    let first = connect(gw.addr, &ca.der(), &[b"http/1.1"], None)
        .await
        .unwrap();
    let old_cert = negotiated(&first).1;
    let mut open = Sender::over(first).await.unwrap();
    assert_eq!(
        open.send("GET", "/v1/models", None, None).await.unwrap().0,
        200
    );

    let next = ca.server("gateway-2");
    write_pair(&dir, "server", &next);
    let served = eventually(
        Duration::from_secs(20),
        "the new certificate served",
        || {
            let ca = ca.der();
            let want = next.der.clone();
            async move {
                let s = connect(gw.addr, &ca, &[b"h2"], None).await.ok()?;
                (negotiated(&s).1 == want).then_some(s)
            }
        },
    )
    .await;
    assert_ne!(old_cert, next.der);
    let mut fresh = Sender::over(served).await.unwrap();
    let (status, body) = fresh
        .send("POST", "/v1/chat/completions", Some(&chat(&model)), None)
        .await
        .unwrap();
    assert_eq!(status, 200, "{body}");
    // The connection opened before the swap was not dropped.
    assert_eq!(
        open.send("GET", "/v1/models", None, None).await.unwrap().0,
        200
    );

    // A broken replacement is refused: counted, and the last good one stays.
    let reloads = |result: &str| {
        let text = gw.gateway.metrics.render();
        metric_sum(
            &text,
            names::TLS_CERT_RELOADS_TOTAL,
            &[("listener", "client"), ("result", result)],
        )
    };
    assert!(reloads("ok") >= 1.0);
    support::tls::replace(&dir.join("server.pem"), b"not a certificate");
    eventually(Duration::from_secs(20), "the broken file rejected", || {
        let r = reloads("rejected");
        async move { (r >= 1.0).then_some(()) }
    })
    .await;
    let s = connect(gw.addr, &ca.der(), &[b"h2"], None).await.unwrap();
    assert_eq!(negotiated(&s).1, next.der);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_stalled_handshake_gives_its_slot_back_within_the_header_timeout() {
    let dir = temp_dir("tls-stall");
    let ca = Ca::new("stall CA");
    let (gw, _sims) = tls_gateway(
        &dir,
        &ca,
        "max_connections = 1\nheader_read_timeout_ms = 300",
        "",
    )
    .await;
    // Holds the only slot and never sends a ClientHello.
    let mut silent = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    let mut buf = [0u8; 16];
    assert_eq!(
        silent.read(&mut buf).await.unwrap_or(0),
        0,
        "closed, nothing sent"
    );
    let s = connect(gw.addr, &ca.der(), &[b"http/1.1"], None)
        .await
        .unwrap();
    let mut send = Sender::over(s).await.unwrap();
    assert_eq!(
        send.send("GET", "/health", None, None).await.unwrap().0,
        200
    );
    let text = gw.gateway.metrics.render();
    let timeouts = metric_sum(
        &text,
        names::TLS_HANDSHAKE_FAILURES_TOTAL,
        &[("listener", "client"), ("reason", "timeout")],
    );
    assert!(timeouts >= 1.0, "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn the_admin_listener_requires_a_client_certificate_from_its_ca() {
    const TOKEN: &str = "7c1e9a4f0b3d8e2a6c5f";
    std::env::set_var("SWITCHYARD_TLS_ADMIN_TOKEN", TOKEN);
    let dir = temp_dir("tls-admin");
    let ca = Ca::new("admin CA");
    let (cert, key) = write_pair(&dir, "admin", &ca.server("admin"));
    let client_ca = dir.join("clients.pem");
    std::fs::write(&client_ca, ca.pem()).unwrap();
    let s = sims(1, 50.0).await;
    let u = urls(&s);
    let gw = gateway(&format!(
        "[admin]\nlisten = \"127.0.0.1:0\"\ntoken_env = \"SWITCHYARD_TLS_ADMIN_TOKEN\"\n\
         [admin.tls]\ncert = {cert:?}\nkey = {key:?}\nclient_ca = {client_ca:?}\n{}",
        pool_toml(&sim_model(), &[u[0].as_str()], "")
    ))
    .await;
    let admin = gw.admin_addr.expect("admin listener");
    let operator = ca.client("operator");
    let s = connect(admin, &ca.der(), &[b"http/1.1"], Some(&operator))
        .await
        .unwrap();
    let mut send = Sender::over(s).await.unwrap();
    let (status, body) = send
        .send("GET", "/admin/workers", None, Some(TOKEN))
        .await
        .unwrap();
    assert_eq!(status, 200, "{body}");
    // No certificate, or one from another CA: no request is answered. (With
    // TLS 1.3 the refusal may surface only on the first read.)
    let stranger = Ca::new("other CA").client("stranger");
    for cert in [None, Some(&stranger)] {
        let answered = async {
            let s = connect(admin, &ca.der(), &[b"http/1.1"], cert).await.ok()?;
            let mut send = Sender::over(s).await.ok()?;
            send.send("GET", "/admin/workers", None, Some(TOKEN))
                .await
                .ok()
        }
        .await;
        assert!(
            answered.is_none(),
            "answered without a valid client certificate: {answered:?}"
        );
    }
    let text = gw.gateway.metrics.render();
    let refused = metric_sum(
        &text,
        names::TLS_HANDSHAKE_FAILURES_TOTAL,
        &[("listener", "admin"), ("reason", "error")],
    );
    assert!(refused >= 2.0, "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn serve_with_tls_flags_prints_an_https_url_and_check_config_checks_the_files() {
    let dir = temp_dir("tls-cli");
    let ca = Ca::new("cli CA");
    let (cert, key) = write_pair(&dir, "server", &ca.server("cli"));
    let s = sims(1, 50.0).await;
    let u = urls(&s);
    let bin = env!("CARGO_BIN_EXE_switchyard");
    let mut child = tokio::process::Command::new(bin)
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--threads",
            "1",
            "--worker",
            &u[0],
        ])
        .arg("--tls-cert")
        .arg(&cert)
        .arg("--tls-key")
        .arg(&key)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let url = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(l) = lines.next_line().await.unwrap() {
            if let Some(u) = l.strip_prefix("switchyard ready url=") {
                return u.to_string();
            }
        }
        panic!("exited before the ready line");
    })
    .await
    .unwrap();
    let addr = url
        .strip_prefix("https://")
        .expect("an https url")
        .parse()
        .unwrap();
    let s = connect(addr, &ca.der(), &[b"h2"], None).await.unwrap();
    let mut send = Sender::over(s).await.unwrap();
    let (status, body) = send
        .send(
            "POST",
            "/v1/chat/completions",
            Some(&chat(&sim_model())),
            None,
        )
        .await
        .unwrap();
    assert_eq!(status, 200, "{body}");
    let _ = child.kill().await;

    // check-config loads the pair: a key that is not the certificate's is named.
    let (_, other_key) = write_pair(&dir, "other", &ca.server("other"));
    let file = dir.join("gw.toml");
    let write_cfg = |key: &std::path::Path| {
        std::fs::write(
            &file,
            format!(
                "[server.tls]\ncert = {cert:?}\nkey = {key:?}\n{}",
                pool_toml("m", &["http://127.0.0.1:9"], "")
            ),
        )
        .unwrap();
    };
    write_cfg(&key);
    let ok = std::process::Command::new(bin)
        .args(["check-config"])
        .arg(&file)
        .output()
        .unwrap();
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    assert!(String::from_utf8_lossy(&ok.stdout).contains("TLS"));
    write_cfg(&other_key);
    let bad = std::process::Command::new(bin)
        .args(["check-config"])
        .arg(&file)
        .output()
        .unwrap();
    assert!(!bad.status.success());
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(
        err.contains("server.tls:") && err.contains("do not form"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
