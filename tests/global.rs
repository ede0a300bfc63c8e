//! Global routing pieces: fallback chains to an external HTTPS provider with model
//! rewrite and key injection, and LoRA adapters routed to the pools that have them.

mod support;

use std::sync::Arc;
use support::scripted::Scripted;
use support::*;

/// A CA the test trusts and a server config for `localhost` signed by it.
fn test_pki(dir: &std::path::Path) -> (std::path::PathBuf, Arc<rustls::ServerConfig>) {
    let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let leaf_key = rcgen::KeyPair::generate().unwrap();
    let leaf = rcgen::CertificateParams::new(vec!["localhost".to_string()])
        .unwrap()
        .signed_by(&leaf_key, &ca_cert, &ca_key)
        .unwrap();
    let ca_file = dir.join("ca.pem");
    std::fs::write(&ca_file, ca_cert.pem()).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![leaf.der().clone()],
            rustls_pki_types::PrivateKeyDer::Pkcs8(leaf_key.serialize_der().into()),
        )
        .unwrap();
    (ca_file, Arc::new(cfg))
}

#[tokio::test]
async fn down_pool_falls_back_to_an_https_provider_with_rewrite_and_key() {
    let dir = std::env::temp_dir().join(format!("switchyard-global-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (ca, tls) = test_pki(&dir);
    let (provider, _tx) = Scripted::start_tls(tls).await;
    std::env::set_var("SWITCHYARD_TEST_PROVIDER_KEY", "sk-provider");
    let dead = {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let gw = gateway(&format!(
        r#"
[[pools]]
name = "self-hosted"
models = ["llama-8b"]
fallback = ["provider"]
max_attempts = 1
workers = [{{ url = "{dead}" }}]

[[pools]]
name = "provider"
models = ["provider-only"]
upstream_model = "gpt-4o-mini"
upstream_api_key_env = "SWITCHYARD_TEST_PROVIDER_KEY"
upstream_ca_file = "{}"
workers = [{{ url = "{}" }}]
"#,
        ca.display(),
        provider.url
    ))
    .await;
    let r = client()
        .post(format!("{}/v1/chat/completions", gw.url()))
        .header("authorization", "Bearer client-key")
        .body(r#"{"model":"llama-8b","messages":[{"role":"user","content":"hi"}]}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    let rec = std::mem::take(&mut *provider.recorded.lock().unwrap());
    assert_eq!(rec.bodies.len(), 1, "the provider answered over TLS");
    assert_eq!(rec.bodies[0]["model"], "gpt-4o-mini");
    assert_eq!(rec.headers[0]["authorization"], "Bearer sk-provider");
    let m = scrape(&gw.url()).await;
    assert_eq!(
        metric_sum(
            &m,
            switchyard::telemetry::names::FALLBACKS_TOTAL,
            &[("pool", "self-hosted"), ("target", "provider")]
        ),
        1.0
    );
    gw.shutdown().await;
    std::fs::remove_dir_all(dir).ok();
}

#[tokio::test]
async fn an_untrusted_certificate_is_refused() {
    let dir = std::env::temp_dir().join(format!("switchyard-untrusted-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (_ca, tls) = test_pki(&dir);
    let (provider, _tx) = Scripted::start_tls(tls).await;
    let gw = gateway(&pool_toml("m", &[&provider.url], "max_attempts = 1")).await;
    let r = client()
        .post(format!("{}/v1/chat/completions", gw.url()))
        .body(r#"{"model":"m","messages":[]}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 502);
    assert!(provider.recorded.lock().unwrap().bodies.is_empty());
    gw.shutdown().await;
    std::fs::remove_dir_all(dir).ok();
}

#[tokio::test]
async fn lora_adapters_route_to_their_pool_unchanged() {
    let (base, _t1) = Scripted::start().await;
    let (lora, _t2) = Scripted::start().await;
    let gw = gateway(&format!(
        "[[pools]]\nname = \"base\"\nmodels = [\"llama\"]\nworkers = [{{ url = \"{}\" }}]\n\
         [[pools]]\nname = \"adapters\"\nmodels = [\"llama-lora-host\"]\nlora_adapters = [\"sql-lora\"]\nworkers = [{{ url = \"{}\" }}]\n",
        base.url, lora.url
    ))
    .await;
    let r = client()
        .post(format!("{}/v1/chat/completions", gw.url()))
        .body(r#"{"model":"sql-lora","messages":[]}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(base.recorded.lock().unwrap().bodies.is_empty());
    assert_eq!(lora.recorded.lock().unwrap().bodies[0]["model"], "sql-lora");
    let models: serde_json::Value = client()
        .get(format!("{}/v1/models", gw.url()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(models["data"]
        .as_array()
        .unwrap()
        .iter()
        .any(|m| m["id"] == "sql-lora"));
    gw.shutdown().await;
}
