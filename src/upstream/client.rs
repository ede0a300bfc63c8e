//! The pooled upstream HTTP client, keep-alive, HTTP/1.1 and HTTP/2.
//!
//! Plain `http://` workers (the engines of a fleet: the hot path) go through
//! hyper's own HTTP/1 connections in a small pool per thread: a request is
//! written on a connection owned by the thread serving it, and nothing else
//! (no pool lock, no task per request, no host formatting) is in the way.
//! `https://` workers (external providers) go through hyper-util's pooled client
//! and rustls with the `ring` provider, trusting the webpki roots plus any CA
//! files the config names.

use http::uri::{Authority, Scheme};
use http::{header, HeaderValue, Request, Response, Uri};
use hyper::body::Incoming;
use hyper::client::conn::http1;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::CertificateDer;
use std::cell::RefCell;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use super::UpstreamBody;

type Inner = Client<HttpsConnector<HttpConnector>, UpstreamBody>;

/// Idle HTTP/1 connections kept per upstream and thread; more are closed.
const MAX_IDLE_PER_UPSTREAM: usize = 512;
/// An idle HTTP/1 connection unused this long is closed rather than reused.
const IDLE_TIMEOUT: Duration = Duration::from_secs(90);

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// hyper-util pools owned by this thread ([`UpstreamClient::pin_to_thread`]),
    /// keyed by client id. Usually empty or one entry.
    static THREAD_POOLS: RefCell<Vec<(u64, Inner)>> = const { RefCell::new(Vec::new()) };
    /// This thread's HTTP/1 connections, per client id and upstream.
    static H1_POOLS: RefCell<Vec<H1Pool>> = const { RefCell::new(Vec::new()) };
}

/// One upstream's connections on one thread. Connections stay listed while they
/// carry a request; one is reused when hyper says it is ready for another.
struct H1Pool {
    client: u64,
    authority: Authority,
    conns: Vec<(http1::SendRequest<UpstreamBody>, Instant)>,
}

/// Why an upstream request failed: the connection could not be made, or the
/// request failed on it.
#[derive(Debug)]
pub struct UpstreamError {
    connect: bool,
    source: Box<dyn std::error::Error + Send + Sync>,
}

impl UpstreamError {
    /// The connection could not be established (nothing was sent).
    pub fn is_connect(&self) -> bool {
        self.connect
    }

    fn connect(e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        UpstreamError {
            connect: true,
            source: e.into(),
        }
    }

    fn request(e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        UpstreamError {
            connect: false,
            source: e.into(),
        }
    }
}

impl std::fmt::Display for UpstreamError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.connect {
            "connect error"
        } else {
            "request failed"
        })
    }
}

impl std::error::Error for UpstreamError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.source)
    }
}

impl From<hyper_util::client::legacy::Error> for UpstreamError {
    fn from(e: hyper_util::client::legacy::Error) -> Self {
        UpstreamError {
            connect: e.is_connect(),
            source: Box::new(e),
        }
    }
}

/// Cheap to clone; clones share their connections (per thread for `http://`
/// upstreams; one hyper-util pool for `https://` ones, except on threads that
/// took their own with [`UpstreamClient::pin_to_thread`]).
#[derive(Clone)]
pub struct UpstreamClient {
    id: u64,
    connect_timeout: Duration,
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
            connect_timeout,
            inner: build(connector.clone()),
            connector,
        })
    }

    /// Give the calling thread a hyper-util pool of its own for this client's
    /// `https://` upstreams. Thread-per-core serving calls it on each serving
    /// thread, so a request and the upstream connection carrying it live on one
    /// thread's runtime and no wake-up crosses threads. (`http://` upstreams
    /// always use per-thread connections.)
    pub fn pin_to_thread(&self) {
        THREAD_POOLS.with(|p| {
            let mut p = p.borrow_mut();
            if !p.iter().any(|(id, _)| *id == self.id) {
                p.push((self.id, build(self.connector.clone())));
            }
        });
    }

    /// Send `req` (absolute URI) and wait for the response head. Dropping the
    /// future, or the response body before its end, closes the connection, which
    /// is how an engine learns to abort the request.
    pub async fn request(
        &self,
        req: Request<UpstreamBody>,
    ) -> Result<Response<Incoming>, UpstreamError> {
        if req.uri().scheme() == Some(&Scheme::HTTP) {
            if let Some(authority) = req.uri().authority().cloned() {
                return self.request_h1(req, authority).await;
            }
        }
        let fut = THREAD_POOLS.with(|p| match p.borrow().iter().find(|(id, _)| *id == self.id) {
            Some((_, own)) => own.request(req),
            None => self.inner.request(req),
        });
        Ok(fut.await?)
    }

    /// A plain-HTTP request with an absolute URI: put in origin form with a
    /// `Host` header, then [`Self::request_origin`].
    async fn request_h1(
        &self,
        mut req: Request<UpstreamBody>,
        authority: Authority,
    ) -> Result<Response<Incoming>, UpstreamError> {
        let host = HeaderValue::from_str(authority.as_str()).map_err(UpstreamError::request)?;
        req.headers_mut().insert(header::HOST, host);
        *req.uri_mut() = origin_form(req.uri());
        self.request_origin(&authority, req).await
    }

    /// A plain-HTTP request to `authority` whose URI is already in origin form
    /// and whose `Host` header is set (the proxy's hot path builds both from
    /// values the worker keeps, rather than parsing an absolute URI back), on
    /// one of this thread's connections to `authority` or on a new one. A
    /// request a reused connection never wrote (it closed under us) is sent
    /// again on a new connection.
    pub async fn request_origin(
        &self,
        authority: &Authority,
        mut req: Request<UpstreamBody>,
    ) -> Result<Response<Incoming>, UpstreamError> {
        if let Some(mut tx) = self.checkout(authority) {
            let sent = tx.try_send_request(req);
            self.checkin(authority, tx);
            match sent.await {
                Ok(resp) => return Ok(resp),
                Err(mut e) => match e.take_message() {
                    Some(r) => req = r,
                    None => return Err(UpstreamError::request(e.into_error())),
                },
            }
        }
        // Boxed: a new connection is the rare case, and its (large) state would
        // otherwise be moved with every request's future.
        let mut tx = Box::pin(self.connect(authority)).await?;
        let sent = tx.send_request(req);
        self.checkin(authority, tx);
        sent.await.map_err(UpstreamError::request)
    }

    /// A ready idle connection to `authority` on this thread, if any. Closed and
    /// long-idle connections are dropped on the way.
    fn checkout(&self, authority: &Authority) -> Option<http1::SendRequest<UpstreamBody>> {
        H1_POOLS.with(|p| {
            let mut pools = p.borrow_mut();
            let pool = pools
                .iter_mut()
                .find(|p| p.client == self.id && p.authority == *authority)?;
            let now = crate::runtime::clock::now();
            let mut i = pool.conns.len();
            while i > 0 {
                i -= 1;
                let (tx, since) = &pool.conns[i];
                if tx.is_closed() || (tx.is_ready() && now - *since > IDLE_TIMEOUT) {
                    pool.conns.swap_remove(i);
                } else if tx.is_ready() {
                    return Some(pool.conns.swap_remove(i).0);
                }
            }
            None
        })
    }

    /// Close this thread's idle connections unused for `IDLE_TIMEOUT` and
    /// forget closed ones, so connections to upstreams no longer routed to do
    /// not linger. Thread-per-core serving calls it once a tick.
    pub fn sweep_idle_connections() {
        H1_POOLS.with(|p| {
            let mut pools = p.borrow_mut();
            let now = crate::runtime::clock::now();
            for pool in pools.iter_mut() {
                pool.conns.retain(|(tx, since)| {
                    !(tx.is_closed() || (tx.is_ready() && now - *since > IDLE_TIMEOUT))
                });
            }
            pools.retain(|pool| !pool.conns.is_empty());
        })
    }

    /// List a connection that just took a request; it is reused once ready.
    fn checkin(&self, authority: &Authority, tx: http1::SendRequest<UpstreamBody>) {
        H1_POOLS.with(|p| {
            let mut pools = p.borrow_mut();
            let pool = match pools
                .iter()
                .position(|p| p.client == self.id && p.authority == *authority)
            {
                Some(i) => &mut pools[i],
                None => {
                    pools.push(H1Pool {
                        client: self.id,
                        authority: authority.clone(),
                        conns: Vec::new(),
                    });
                    pools.last_mut().expect("just pushed")
                }
            };
            if pool.conns.len() < MAX_IDLE_PER_UPSTREAM {
                pool.conns.push((tx, crate::runtime::clock::now()));
            }
        })
    }

    /// Open a new HTTP/1 connection (within the connect timeout) and drive it in
    /// a task of its own.
    async fn connect(
        &self,
        authority: &Authority,
    ) -> Result<http1::SendRequest<UpstreamBody>, UpstreamError> {
        let host = authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']');
        let port = authority.port_u16().unwrap_or(80);
        let stream = match tokio::time::timeout(
            self.connect_timeout,
            tokio::net::TcpStream::connect((host, port)),
        )
        .await
        {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => return Err(UpstreamError::connect(e)),
            Err(_) => {
                return Err(UpstreamError::connect(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!(
                        "connect to {authority} timed out after {:?}",
                        self.connect_timeout
                    ),
                )))
            }
        };
        let _ = stream.set_nodelay(true);
        let _ = socket2::SockRef::from(&stream)
            .set_tcp_keepalive(&socket2::TcpKeepalive::new().with_time(Duration::from_secs(60)));
        let (tx, conn) = http1::handshake(TokioIo::new(stream))
            .await
            .map_err(UpstreamError::connect)?;
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "upstream connection closed with an error");
            }
        });
        Ok(tx)
    }
}

/// `uri`'s path and query alone (origin form), `/` if it has none.
pub(crate) fn origin_form(uri: &Uri) -> Uri {
    uri.path_and_query()
        .cloned()
        .map_or_else(|| Uri::from_static("/"), Uri::from)
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

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Connections this thread keeps, over every pool.
    fn pooled() -> usize {
        H1_POOLS.with(|p| p.borrow().iter().map(|p| p.conns.len()).sum())
    }

    #[tokio::test]
    async fn the_sweep_forgets_connections_the_upstream_closed() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let authority: Authority = listener.local_addr().unwrap().to_string().parse().unwrap();
        // Answer one request, then close the connection.
        tokio::spawn(async move {
            let (mut sock, _) = listener.accept().await.unwrap();
            let mut buf = Vec::new();
            while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                let mut chunk = [0u8; 1024];
                let n = sock.read(&mut chunk).await.unwrap();
                assert!(n > 0, "client closed before sending a request");
                buf.extend_from_slice(&chunk[..n]);
            }
            sock.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                .await
                .unwrap();
        });
        let client = UpstreamClient::new(Duration::from_secs(5), &[]).unwrap();
        let mut req = Request::new(UpstreamBody::default());
        *req.uri_mut() = Uri::from_static("/v1/models");
        req.headers_mut().insert(
            header::HOST,
            HeaderValue::from_str(authority.as_str()).unwrap(),
        );
        let resp = client.request_origin(&authority, req).await.unwrap();
        assert_eq!(resp.status(), 200);
        drop(resp);
        assert_eq!(pooled(), 1, "the connection is kept for reuse");
        // The connection task sees the close on its own schedule: sweep until it
        // has (bounded), then the pool is empty.
        tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                UpstreamClient::sweep_idle_connections();
                if pooled() == 0 {
                    break;
                }
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("a closed connection stays pooled after sweeps");
    }
}
