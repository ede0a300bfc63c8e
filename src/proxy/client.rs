//! The pooled upstream HTTP client (hyper-util, keep-alive, HTTP/1.1 and HTTP/2).
//! `https://` workers (external providers) go through rustls with the `ring`
//! provider, trusting the webpki roots plus any CA files the config names.

use bytes::Bytes;
use http_body_util::Full;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::{Client, ResponseFuture};
use hyper_util::rt::{TokioExecutor, TokioTimer};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::CertificateDer;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// Request bodies are kept whole (`Bytes`) so an attempt can be replayed.
pub type UpstreamBody = Full<Bytes>;

/// Cheap to clone; all clones share one connection pool.
#[derive(Clone)]
pub struct UpstreamClient {
    inner: Client<HttpsConnector<HttpConnector>, UpstreamBody>,
}

impl UpstreamClient {
    /// A client trusting the webpki roots and the PEM certificates in `extra_ca_files`.
    pub fn new(
        connect_timeout: Duration,
        extra_ca_files: &[String],
    ) -> std::io::Result<UpstreamClient> {
        let mut roots = rustls::RootCertStore::empty();
        roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
        for file in extra_ca_files {
            for cert in load_pem(Path::new(file))? {
                roots
                    .add(cert)
                    .map_err(|e| std::io::Error::other(format!("{file}: {e}")))?;
            }
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(std::io::Error::other)?
            .with_root_certificates(roots)
            .with_no_client_auth();
        let mut http = HttpConnector::new();
        http.set_nodelay(true);
        http.set_connect_timeout(Some(connect_timeout));
        http.set_keepalive(Some(Duration::from_secs(60)));
        http.enforce_http(false);
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_all_versions()
            .wrap_connector(http);
        let inner = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(Duration::from_secs(90))
            .pool_max_idle_per_host(usize::MAX)
            .build(connector);
        Ok(UpstreamClient { inner })
    }

    pub fn request(&self, req: http::Request<UpstreamBody>) -> ResponseFuture {
        self.inner.request(req)
    }
}

fn load_pem(path: &Path) -> std::io::Result<Vec<CertificateDer<'static>>> {
    CertificateDer::pem_file_iter(path)
        .map_err(|e| std::io::Error::other(format!("{}: {e}", path.display())))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| std::io::Error::other(format!("{}: {e}", path.display())))
}
