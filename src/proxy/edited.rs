//! A response body edited as it streams: each chunk passes through an [`Edit`],
//! which may hold back an unfinished tail (a match cut by a chunk boundary, an
//! event not yet ended); what is still held at the end is sent as it is.

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use std::pin::Pin;
use std::task::{ready, Context, Poll};

/// One way of editing a body's bytes.
pub(crate) trait Edit {
    /// The bytes to send for `data` (after what was held before).
    fn pass(&mut self, data: &Bytes) -> Bytes;
    /// What is held when the body ends.
    fn rest(&mut self) -> Bytes;
}

/// `inner` with its data frames edited by `E`.
pub(crate) struct Edited<B, E> {
    inner: B,
    edit: E,
    done: bool,
}

impl<B, E> Edited<B, E> {
    pub(crate) fn new(inner: B, edit: E) -> Self {
        Edited {
            inner,
            edit,
            done: false,
        }
    }
}

impl<B, E> Body for Edited<B, E>
where
    B: Body<Data = Bytes> + Unpin,
    E: Edit + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = self.get_mut();
        loop {
            if this.done {
                return Poll::Ready(None);
            }
            match ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => {
                        let out = this.edit.pass(&data);
                        if !out.is_empty() {
                            return Poll::Ready(Some(Ok(Frame::data(out))));
                        }
                    }
                    Err(frame) => return Poll::Ready(Some(Ok(frame))),
                },
                Some(Err(e)) => return Poll::Ready(Some(Err(e))),
                None => {
                    this.done = true;
                    let rest = this.edit.rest();
                    if !rest.is_empty() {
                        return Poll::Ready(Some(Ok(Frame::data(rest))));
                    }
                }
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
