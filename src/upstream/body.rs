//! The body of an upstream request: usually the client's bytes, kept whole so
//! an attempt can be replayed; an upload too large to hold (audio) is a stream,
//! sent once.

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::Full;
use std::pin::Pin;
use std::task::{Context, Poll};

/// An error a streamed request body may end with.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A request body towards a worker.
#[derive(Debug)]
pub enum UpstreamBody {
    /// The whole body in memory (every JSON request).
    Whole(Full<Bytes>),
    /// Bytes forwarded as they arrive from the client.
    Streamed(UnsyncBoxBody<Bytes, BoxError>),
}

impl UpstreamBody {
    pub fn streamed<B>(body: B) -> Self
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        use http_body_util::BodyExt;
        UpstreamBody::Streamed(UnsyncBoxBody::new(body.map_err(Into::into)))
    }
}

impl Default for UpstreamBody {
    fn default() -> Self {
        UpstreamBody::Whole(Full::default())
    }
}

impl From<Bytes> for UpstreamBody {
    fn from(b: Bytes) -> Self {
        UpstreamBody::Whole(Full::new(b))
    }
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.get_mut() {
            UpstreamBody::Whole(b) => Pin::new(b)
                .poll_frame(cx)
                .map(|f| f.map(|r| r.map_err(|never| match never {}))),
            UpstreamBody::Streamed(b) => Pin::new(b).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            UpstreamBody::Whole(b) => b.is_end_stream(),
            UpstreamBody::Streamed(b) => b.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            UpstreamBody::Whole(b) => b.size_hint(),
            UpstreamBody::Streamed(b) => b.size_hint(),
        }
    }
}
