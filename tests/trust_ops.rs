//! Operating the gateway where trust meets operations (issue #31): certificates
//! outside their validity window refused at start, by `check-config` and on
//! rotation; shutdown that does not wait on idle HTTP/2 connections and ends a
//! stream cut at the drain deadline with the error event; `switchyard health`
//! over https; plain HTTP sent to a TLS port; and the KV block size learned from
//! the engines.

mod support;

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
