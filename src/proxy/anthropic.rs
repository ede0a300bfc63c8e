//! Anthropic Messages on pools that translate (`anthropic = "translate"`): the
//! request body becomes a chat completions request, and the engine's answer
//! (observed first, so telemetry reads the chat shape it knows) is turned
//! back into a Messages answer, event stream or error.

use crate::api::anthropic::{error, response, stream::StreamTranslator};
use crate::api::Endpoint;
use crate::config::{AnthropicMode, PoolConfig};
use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use std::pin::Pin;
use std::task::{Context, Poll};

/// The path a translated Messages request takes upstream.
pub(crate) const CHAT_PATH: &str = "/v1/chat/completions";
/// Largest non-streamed chat answer translated; a larger one is an error.
const MAX_WHOLE_BYTES: usize = 32 << 20;

/// Does `pool` translate requests that came in on `endpoint`?
pub(crate) fn translates(pool: &PoolConfig, endpoint: Endpoint) -> bool {
    endpoint == Endpoint::Messages && pool.anthropic == AnthropicMode::Translate
}

enum Mode {
    /// An SSE chat stream, translated event by event.
    Stream(StreamTranslator),
    /// A whole JSON answer (or error), translated at its end.
    Whole { status: u16, buf: BytesMut },
}

/// The client's body for a translated answer.
pub(crate) struct TranslatedBody<B> {
    inner: B,
    mode: Mode,
    done: bool,
}

impl<B> TranslatedBody<B> {
    pub(crate) fn new(inner: B, sse: bool, status: u16) -> Self {
        let mode = if sse && status < 300 {
            Mode::Stream(StreamTranslator::new())
        } else {
            Mode::Whole {
                status,
                buf: BytesMut::new(),
            }
        };
        TranslatedBody {
            inner,
            mode,
            done: false,
        }
    }

    /// The translation of the next bytes (`None`: the body ended).
    fn translate(&mut self, data: Option<&Bytes>) -> Result<Option<Bytes>, &'static str> {
        match (&mut self.mode, data) {
            (Mode::Stream(t), Some(d)) => {
                let mut out = Vec::new();
                t.feed(d, &mut out);
                Ok(Some(Bytes::from(out)))
            }
            (Mode::Stream(t), None) => {
                let mut out = Vec::new();
                t.finish(&mut out);
                Ok(Some(Bytes::from(out)))
            }
            (Mode::Whole { buf, .. }, Some(d)) => {
                if buf.len() + d.len() > MAX_WHOLE_BYTES {
                    return Err("the engine's answer is too large to translate");
                }
                buf.extend_from_slice(d);
                Ok(None)
            }
            (Mode::Whole { status, buf }, None) => Ok(Some(whole(*status, buf))),
        }
    }
}

/// A whole answer in Messages shape: a message, or an error.
fn whole(status: u16, body: &[u8]) -> Bytes {
    if status >= 300 {
        return error::from_openai(status, body);
    }
    response::from_chat(body).unwrap_or_else(|e| {
        tracing::warn!(error = %e, "could not translate the engine's answer to a message");
        error::body(
            502,
            &format!("The engine's answer could not be translated: {e}"),
        )
    })
}

impl<B> Body for TranslatedBody<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        loop {
            if this.done {
                return Poll::Ready(None);
            }
            let data = match std::task::ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(d) => Some(d),
                    Err(_) => continue, // trailers: nothing to translate
                },
                Some(Err(e)) => return Poll::Ready(Some(Err(e.into()))),
                None => {
                    this.done = true;
                    None
                }
            };
            match this.translate(data.as_ref()) {
                Ok(Some(out)) if !out.is_empty() => return Poll::Ready(Some(Ok(Frame::data(out)))),
                Ok(_) => continue,
                Err(e) => return Poll::Ready(Some(Err(e.into()))),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}
