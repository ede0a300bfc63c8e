//! `switchyard health`: a one-shot HTTP(S) probe of a running gateway, so
//! container images without curl (distroless) can still have a `HEALTHCHECK`,
//! with TLS on or off: `--config` probes the listener the configuration
//! describes (its port, and https when `[server.tls]` is set).

use bytes::Bytes;
use http_body_util::Empty;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// `switchyard health` flags.
#[derive(clap::Args, Debug, Clone)]
pub struct HealthArgs {
    /// URL to probe (`http://` or `https://`); any 2xx answer is healthy.
    #[arg(
        long,
        default_value = "http://127.0.0.1:8080/health",
        conflicts_with = "config"
    )]
    pub url: String,
    /// Probe the gateway this configuration file describes, on loopback:
    /// `server.listen`'s port, https when `[server.tls]` is set (its own
    /// certificate is not name-checked: the probe only reads a status).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// PEM CA certificates to trust for an https URL (default: the public web roots).
    #[arg(long)]
    pub ca_file: Option<PathBuf>,
    /// Do not verify the server's certificate (a loopback self-probe of a gateway
    /// whose certificate names its public host).
    #[arg(long)]
    pub insecure: bool,
    /// Give up after this many milliseconds.
    #[arg(long, default_value_t = 2000)]
    pub timeout_ms: u64,
}

/// What to probe and how far to trust its certificate.
struct Target {
    url: String,
    verify: bool,
}

impl HealthArgs {
    fn target(&self) -> anyhow::Result<Target> {
        let Some(path) = &self.config else {
            return Ok(Target {
                url: self.url.clone(),
                verify: !self.insecure,
            });
        };
        let cfg = crate::config::read_file(path)?
            .validate(crate::config::Secrets::Optional)?
            .config;
        let tls = cfg.server.tls.is_some();
        let port = cfg.server.listen.port();
        let host = match cfg.server.listen.ip() {
            std::net::IpAddr::V6(ip) if !ip.is_unspecified() => format!("[{ip}]"),
            std::net::IpAddr::V4(ip) if !ip.is_unspecified() => ip.to_string(),
            std::net::IpAddr::V6(_) => "[::1]".into(),
            std::net::IpAddr::V4(_) => "127.0.0.1".into(),
        };
        let scheme = if tls { "https" } else { "http" };
        Ok(Target {
            url: format!("{scheme}://{host}:{port}/health"),
            verify: !tls && !self.insecure,
        })
    }
}

/// GET the URL once: `Ok` with the status line on 2xx, an error naming the URL otherwise.
pub async fn probe(args: &HealthArgs) -> anyhow::Result<String> {
    let target = args.target()?;
    let url = &target.url;
    let uri: http::Uri = url
        .parse()
        .map_err(|e| anyhow::anyhow!("--url `{url}`: {e}"))?;
    if !matches!(uri.scheme_str(), Some("http" | "https")) {
        anyhow::bail!("--url `{url}`: only http:// and https:// URLs are probed");
    }
    let connector = connector(args.ca_file.as_deref(), target.verify)?;
    let client: Client<_, Empty<Bytes>> = Client::builder(TokioExecutor::new()).build(connector);
    let timeout = Duration::from_millis(args.timeout_ms);
    let status = match tokio::time::timeout(timeout, client.get(uri)).await {
        Err(_) => anyhow::bail!("{url}: no answer within {timeout:?}"),
        Ok(Err(e)) => anyhow::bail!("{url}: {}", chain(&e)),
        Ok(Ok(resp)) => resp.status(),
    };
    if !status.is_success() {
        anyhow::bail!("{url}: unhealthy ({status})");
    }
    Ok(format!("{url}: {status}"))
}

/// http and https; https trusting `ca_file` (else the web roots), or anything
/// when `verify` is off.
fn connector(
    ca_file: Option<&std::path::Path>,
    verify: bool,
) -> anyhow::Result<HttpsConnector<HttpConnector>> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()?;
    let tls = if verify {
        let roots = match ca_file {
            Some(f) => crate::config::load_client_roots(f).map_err(anyhow::Error::msg)?,
            None => {
                let mut r = rustls::RootCertStore::empty();
                r.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
                r
            }
        };
        builder.with_root_certificates(roots).with_no_client_auth()
    } else {
        builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AnyCertificate(provider)))
            .with_no_client_auth()
    };
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    Ok(hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http1()
        .wrap_connector(http))
}

/// Accepts any certificate (`--insecure`, or a `--config` self-probe), still
/// checking the handshake's signatures so the TLS session itself is sound.
#[derive(Debug)]
struct AnyCertificate(Arc<CryptoProvider>);

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        let algs = &self.0.signature_verification_algorithms;
        rustls::crypto::verify_tls12_signature(message, cert, dss, algs)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        let algs = &self.0.signature_verification_algorithms;
        rustls::crypto::verify_tls13_signature(message, cert, dss, algs)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// An error and its causes, `outer: inner: …` (hyper's own message is only "client error").
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}
