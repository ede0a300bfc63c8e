//! The pooled upstream HTTP client (hyper-util, keep-alive, HTTP/1.1 and h2c).

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::{Client, ResponseFuture};
use hyper_util::rt::{TokioExecutor, TokioTimer};
use std::time::Duration;

/// Request bodies are kept whole (`Bytes`) so an attempt can be replayed.
pub type UpstreamBody = Full<Bytes>;

/// Cheap to clone; all clones share one connection pool.
#[derive(Clone)]
pub struct UpstreamClient {
    inner: Client<HttpConnector, UpstreamBody>,
}

impl UpstreamClient {
    pub fn new(connect_timeout: Duration) -> UpstreamClient {
        let mut http = HttpConnector::new();
        http.set_nodelay(true);
        http.set_connect_timeout(Some(connect_timeout));
        http.set_keepalive(Some(Duration::from_secs(60)));
        let inner = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(Duration::from_secs(90))
            .pool_max_idle_per_host(usize::MAX)
            .build(http);
        UpstreamClient { inner }
    }

    pub fn request(&self, req: http::Request<UpstreamBody>) -> ResponseFuture {
        self.inner.request(req)
    }
}
