//! TLS termination for the client and admin listeners. The certificate is served
//! through a resolver holding an `ArcSwap<CertifiedKey>`: a watcher polls the
//! files' modification stamps and swaps in a new certificate for the next
//! handshake, so open connections keep theirs and nothing is dropped. A file that
//! does not load, or a certificate outside its validity window, keeps the old
//! certificate (log line and metric). The served chain's expiry is a gauge. ALPN
//! offers h2 and http/1.1; a handshake must finish within the header timeout.

use crate::config::{chain_not_after, load_certified_key, load_client_roots, TlsConfig};
use crate::telemetry::names;
use arc_swap::ArcSwap;
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use std::sync::{Arc, Weak};
use std::time::{Duration, SystemTime};
use tokio::net::TcpStream;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

/// A listener's TLS side: the acceptor and the listener's name for metrics.
#[derive(Clone)]
pub(crate) struct Tls {
    acceptor: TlsAcceptor,
    listener: &'static str,
}

impl Tls {
    /// Load the files and start the watcher (when `reload_interval` is not zero).
    /// `listener` is the metric label: `client` or `admin`.
    pub(crate) fn new(cfg: &TlsConfig, listener: &'static str) -> std::io::Result<Tls> {
        // Stamped before the files are read: a change made while they load (or
        // before the watcher first runs) is seen as a change.
        let seen = stamp(cfg);
        let key = load_certified_key(cfg).map_err(std::io::Error::other)?;
        export_expiry(&key, listener);
        let resolver = Arc::new(CertResolver {
            current: ArcSwap::from_pointee(key),
        });
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(std::io::Error::other)?;
        let builder = match &cfg.client_ca {
            Some(ca) => {
                let roots = load_client_roots(ca).map_err(std::io::Error::other)?;
                let verifier = WebPkiClientVerifier::builder_with_provider(roots.into(), provider)
                    .build()
                    .map_err(std::io::Error::other)?;
                builder.with_client_cert_verifier(verifier)
            }
            None => builder.with_no_client_auth(),
        };
        let mut server = builder.with_cert_resolver(resolver.clone());
        server.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        if !cfg.reload_interval.is_zero() {
            let resolver = Arc::downgrade(&resolver);
            tokio::spawn(watch(resolver, cfg.clone(), seen, listener));
        }
        Ok(Tls {
            acceptor: TlsAcceptor::from(Arc::new(server)),
            listener,
        })
    }

    /// The handshake, bounded by `limit` (the header timeout): a client that
    /// stalls it gives its connection slot back. A client speaking plain HTTP
    /// is told in plain HTTP to use https. Failures are counted.
    pub(crate) async fn accept(
        &self,
        stream: TcpStream,
        limit: Duration,
    ) -> Option<TlsStream<TcpStream>> {
        let handshake = async {
            if plaintext_http(&stream).await {
                refuse_plaintext(stream).await;
                return Err("plaintext_http");
            }
            self.acceptor.accept(stream).await.map_err(|e| {
                tracing::debug!(listener = self.listener, error = %e, "TLS handshake failed");
                "error"
            })
        };
        let reason = match tokio::time::timeout(limit, handshake).await {
            Ok(Ok(s)) => return Some(s),
            Ok(Err(reason)) => reason,
            Err(_) => "timeout",
        };
        metrics::counter!(
            names::TLS_HANDSHAKE_FAILURES_TOTAL,
            names::L_LISTENER => self.listener,
            names::L_REASON => reason
        )
        .increment(1);
        None
    }
}

/// The client's first byte is an uppercase ASCII letter (`GET`, `POST`, `PRI`):
/// a plain HTTP request, where a TLS client starts with a handshake record (0x16).
async fn plaintext_http(stream: &TcpStream) -> bool {
    let mut first = [0u8; 1];
    matches!(stream.peek(&mut first).await, Ok(1) if first[0].is_ascii_uppercase())
}

/// What a plain HTTP client gets on a TLS port: a 400 it can read, then the close.
async fn refuse_plaintext(mut stream: TcpStream) {
    use tokio::io::AsyncWriteExt;
    const BODY: &str = "This port speaks TLS: use https:// instead of http://.\n";
    let answer = format!(
        "HTTP/1.1 400 Bad Request\r\ncontent-type: text/plain; charset=utf-8\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{BODY}",
        BODY.len()
    );
    let _ = stream.write_all(answer.as_bytes()).await;
    let _ = stream.shutdown().await;
}

/// Serves whatever certificate was loaded last.
#[derive(Debug)]
struct CertResolver {
    current: ArcSwap<CertifiedKey>,
}

impl ResolvesServerCert for CertResolver {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current.load_full())
    }
}

/// Set the listener's expiry gauge from a chain about to be served.
fn export_expiry(key: &CertifiedKey, listener: &'static str) {
    if let Some(t) = chain_not_after(key) {
        metrics::gauge!(names::TLS_CERT_EXPIRY_SECONDS, names::L_LISTENER => listener)
            .set(t as f64);
    }
}

/// What identifies a version of the files: each one's modification time and length.
type Stamp = [Option<(SystemTime, u64)>; 2];

fn stamp(cfg: &TlsConfig) -> Stamp {
    [&cfg.cert, &cfg.key].map(|p| {
        let m = std::fs::metadata(p).ok()?;
        Some((m.modified().ok()?, m.len()))
    })
}

/// Log (once) that the certificate being served has expired since it was
/// loaded: every new handshake fails until the files are replaced. Returns
/// whether it has been told, so a rotation re-arms it.
fn tell_expired(resolver: &CertResolver, listener: &'static str, told: bool) -> bool {
    let Some(not_after) = chain_not_after(&resolver.current.load()) else {
        return told;
    };
    let expired = not_after < crate::config::cert_validity::unix_now();
    if expired && !told {
        tracing::error!(
            listener,
            not_after = %crate::config::cert_validity::show(not_after),
            "the TLS certificate being served has expired; clients' handshakes fail until it is replaced"
        );
    }
    expired
}

/// Poll the files; on a change, load them and swap the certificate in, or keep
/// the old one if they do not load (a half-written pair is retried at the next
/// change). Ends when the listener's resolver is gone.
async fn watch(
    resolver: Weak<CertResolver>,
    cfg: TlsConfig,
    mut seen: Stamp,
    listener: &'static str,
) {
    let mut tick = tokio::time::interval(cfg.reload_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut expired_told = false;
    loop {
        tick.tick().await;
        let Some(resolver) = resolver.upgrade() else {
            return;
        };
        expired_told = tell_expired(&resolver, listener, expired_told);
        let now = stamp(&cfg);
        if now == seen {
            continue;
        }
        seen = now;
        let result = match load_certified_key(&cfg) {
            Ok(key) => {
                export_expiry(&key, listener);
                resolver.current.store(Arc::new(key));
                tracing::info!(listener, cert = %cfg.cert.display(), "TLS certificate reloaded");
                "ok"
            }
            Err(e) => {
                tracing::error!(listener, error = %e, "TLS certificate reload rejected; keeping the current one");
                "rejected"
            }
        };
        metrics::counter!(
            names::TLS_CERT_RELOADS_TOTAL,
            names::L_LISTENER => listener,
            names::L_RESULT => result
        )
        .increment(1);
    }
}
