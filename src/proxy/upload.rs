//! Multipart uploads (`/v1/audio/transcriptions`, `/translations`) forwarded
//! without holding them: the request is read only until its `model` form
//! field is found (parsed with `multer` over the bytes read so far), then the
//! bytes read and the rest of the client's stream go upstream unchanged, bounded
//! by the body limit.
//!
//! The OpenAI SDKs send form fields before the file, so the peek is usually
//! the first frame. A `model` sent after the file makes the whole body (up to
//! the limit) be read first. A streamed upload is sent once: no retry, no
//! fallback pool.

use super::GatewayError;
use crate::upstream::{BoxError, UpstreamBody};
use bytes::Bytes;
use futures_util::StreamExt;
use http_body::Frame;
use http_body_util::{BodyExt, BodyStream, Limited, StreamBody};
use parking_lot::Mutex;

/// A streamed upload, taken by the one attempt that sends it (a lock because
/// the forwarding context is shared by reference; taken once, never contended).
#[derive(Debug)]
pub struct Upload(Mutex<Option<UpstreamBody>>);

impl Upload {
    /// The body for the attempt; `None` once sent.
    pub(crate) fn take(&self) -> Option<UpstreamBody> {
        self.0.lock().take()
    }
}

/// What the bytes read so far say about the `model` field.
enum Peek {
    Found(String),
    /// The field may still come.
    NeedMore,
    /// A file part came first: the model (if any) is behind it.
    FileFirst,
    /// The whole body was read and has no `model` field.
    Absent,
}

/// The boundary of a `multipart/form-data` request, or why there is none.
pub fn boundary(headers: &http::HeaderMap) -> Result<String, GatewayError> {
    let ct = headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    multer::parse_boundary(ct).map_err(|_| {
        GatewayError::MalformedMultipart(
            "send the upload as multipart/form-data with a boundary".into(),
        )
    })
}

/// Read `body` until its `model` field is known; the model and the upload to
/// forward (the bytes read, then the rest of `body`, at most `limit` in all).
pub async fn split_model<B>(
    mut body: B,
    boundary: &str,
    limit: usize,
) -> Result<(String, Upload), GatewayError>
where
    B: http_body::Body<Data = Bytes> + Send + Unpin + 'static,
    B::Error: Into<BoxError>,
{
    let mut read: Vec<Bytes> = Vec::new();
    let mut len = 0usize;
    let mut eof = false;
    let mut file_first = false;
    let model = loop {
        if !file_first || eof {
            match peek(&read, boundary, eof).await? {
                Peek::Found(m) => break m,
                Peek::Absent => return Err(GatewayError::MissingModel),
                Peek::FileFirst => file_first = true,
                Peek::NeedMore => {}
            }
        }
        match body.frame().await {
            None => eof = true,
            Some(Err(e)) => return Err(GatewayError::BodyRead(e.into().to_string())),
            Some(Ok(f)) => {
                if let Ok(data) = f.into_data() {
                    len += data.len();
                    if len > limit {
                        return Err(GatewayError::BodyTooLarge(limit));
                    }
                    read.push(data);
                }
            }
        }
    };
    let head = futures_util::stream::iter(read.into_iter().map(|b| Ok(Frame::data(b))));
    let rest = BodyStream::new(Limited::new(body, limit - len));
    let stream = head.chain(rest);
    let upload = UpstreamBody::streamed(StreamBody::new(stream));
    Ok((model, Upload(Mutex::new(Some(upload)))))
}

/// Parse the bytes read so far with `multer`.
async fn peek(read: &[Bytes], boundary: &str, eof: bool) -> Result<Peek, GatewayError> {
    // multer needs an owned stream: the chunks are cheap `Bytes` clones.
    let chunks: Vec<Result<Bytes, std::io::Error>> = read.iter().cloned().map(Ok).collect();
    let mut form = multer::Multipart::new(futures_util::stream::iter(chunks), boundary);
    loop {
        match form.next_field().await {
            Ok(Some(field)) if field.name() == Some("model") => {
                return match field.text().await {
                    Ok(m) if !m.trim().is_empty() => Ok(Peek::Found(m.trim().to_string())),
                    Ok(_) => Err(GatewayError::MissingModel),
                    Err(_) if !eof => Ok(Peek::NeedMore),
                    Err(e) => Err(GatewayError::MalformedMultipart(e.to_string())),
                };
            }
            Ok(Some(field)) if field.file_name().is_some() && !eof => return Ok(Peek::FileFirst),
            Ok(Some(_)) => continue,
            Ok(None) if eof => return Ok(Peek::Absent),
            Ok(None) => return Ok(Peek::NeedMore),
            Err(_) if !eof => return Ok(Peek::NeedMore),
            Err(e) => return Err(GatewayError::MalformedMultipart(e.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::StreamBody;

    fn form(parts: &[(&str, Option<&str>, &str)]) -> String {
        let mut s = String::new();
        for (name, file, value) in parts {
            s.push_str("--XyZ\r\nContent-Disposition: form-data; name=\"");
            s.push_str(name);
            s.push('"');
            if let Some(f) = file {
                s.push_str(&format!("; filename=\"{f}\"\r\nContent-Type: audio/wav"));
            }
            s.push_str("\r\n\r\n");
            s.push_str(value);
            s.push_str("\r\n");
        }
        s.push_str("--XyZ--\r\n");
        s
    }

    fn body(
        text: String,
        chunk: usize,
    ) -> impl http_body::Body<Data = Bytes, Error = std::io::Error> + Send + Unpin + 'static {
        let chunks: Vec<Result<Frame<Bytes>, std::io::Error>> = text
            .into_bytes()
            .chunks(chunk)
            .map(|c| Ok(Frame::data(Bytes::copy_from_slice(c))))
            .collect();
        StreamBody::new(futures_util::stream::iter(chunks))
    }

    async fn forwarded(u: Upload) -> String {
        let b = u.take().unwrap().collect().await.unwrap().to_bytes();
        String::from_utf8(b.to_vec()).unwrap()
    }

    #[tokio::test]
    async fn finds_the_model_in_any_chunking_and_forwards_every_byte() {
        let text = form(&[
            ("model", None, "whisper-1"),
            ("file", Some("a.wav"), &"A".repeat(300)),
        ]);
        for chunk in [1, 7, 64, 4096] {
            let (m, u) = split_model(body(text.clone(), chunk), "XyZ", 1 << 20)
                .await
                .unwrap();
            assert_eq!(m, "whisper-1");
            assert_eq!(forwarded(u).await, text, "chunk {chunk}");
        }
        // The model after the file: found once the body is read.
        let late = form(&[("file", Some("a.wav"), "AAAA"), ("model", None, "w2")]);
        let (m, u) = split_model(body(late.clone(), 5), "XyZ", 1 << 20)
            .await
            .unwrap();
        assert_eq!(m, "w2");
        assert_eq!(forwarded(u).await, late);
    }

    #[tokio::test]
    async fn no_model_and_too_large_are_errors() {
        let text = form(&[("file", Some("a.wav"), "AAAA")]);
        let e = split_model(body(text, 3), "XyZ", 1 << 20)
            .await
            .unwrap_err();
        assert!(matches!(e, GatewayError::MissingModel), "{e}");
        let big = form(&[
            ("file", Some("a.wav"), &"A".repeat(5000)),
            ("model", None, "m"),
        ]);
        let e = split_model(body(big, 100), "XyZ", 1000).await.unwrap_err();
        assert!(matches!(e, GatewayError::BodyTooLarge(1000)), "{e}");
        // Past the peek, the limit still holds on the forwarded stream.
        let text = form(&[
            ("model", None, "m"),
            ("file", Some("a.wav"), &"A".repeat(5000)),
        ]);
        let (_, u) = split_model(body(text, 100), "XyZ", 1000).await.unwrap();
        assert!(u.take().unwrap().collect().await.is_err());
    }
}
