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
use std::cell::RefCell;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Request bodies are kept whole (`Bytes`) so an attempt can be replayed.
pub type UpstreamBody = Full<Bytes>;

type Inner = Client<HttpsConnector<HttpConnector>, UpstreamBody>;

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// Connection pools owned by this thread ([`UpstreamClient::pin_to_thread`]),
    /// keyed by client id. Usually empty or one entry.
    static THREAD_POOLS: RefCell<Vec<(u64, Inner)>> = const { RefCell::new(Vec::new()) };
}

/// Cheap to clone; all clones share one connection pool, except on threads that
/// took their own with [`UpstreamClient::pin_to_thread`].
#[derive(Clone)]
pub struct UpstreamClient {
    id: u64,
    connector: HttpsConnector<HttpConnector>,
    inner: Inner,
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
        Ok(UpstreamClient {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            inner: build(connector.clone()),
            connector,
        })
    }

    /// Give the calling thread a connection pool of its own for this client.
    /// Thread-per-core serving calls it on each serving thread, so a request and
    /// the upstream connection carrying it live on one thread's runtime and no
    /// wake-up crosses threads. Other threads keep using the shared pool.
    pub fn pin_to_thread(&self) {
        THREAD_POOLS.with(|p| {
            let mut p = p.borrow_mut();
            if !p.iter().any(|(id, _)| *id == self.id) {
                p.push((self.id, build(self.connector.clone())));
            }
        });
    }

    pub fn request(&self, req: http::Request<UpstreamBody>) -> ResponseFuture {
        THREAD_POOLS.with(|p| match p.borrow().iter().find(|(id, _)| *id == self.id) {
            Some((_, own)) => own.request(req),
            None => self.inner.request(req),
        })
    }
}

fn build(connector: HttpsConnector<HttpConnector>) -> Inner {
    Client::builder(TokioExecutor::new())
        .pool_timer(TokioTimer::new())
        .pool_idle_timeout(Duration::from_secs(90))
        .pool_max_idle_per_host(usize::MAX)
        .build(connector)
}

fn load_pem(path: &Path) -> std::io::Result<Vec<CertificateDer<'static>>> {
    CertificateDer::pem_file_iter(path)
        .map_err(|e| std::io::Error::other(format!("{}: {e}", path.display())))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| std::io::Error::other(format!("{}: {e}", path.display())))
}
