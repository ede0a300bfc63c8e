//! One client connection and the limits a slow or hostile client meets before its
//! request reaches the proxy: time to complete the first request's headers, time
//! with no request at all, header count and size, transfer codings other than
//! chunked, and a bare LF in an HTTP/1 header section. Each connection the
//! gateway closes for one of these is counted by reason.

use crate::proxy::GatewayError;
use crate::telemetry::names;
use hyper_util::server::graceful::GracefulConnection;
use std::future::Future;
use std::io::IoSlice;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::watch;

/// Why the gateway closed a client connection (the `reason` label).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Closed {
    /// Request headers not complete in time (on HTTP/1.1 this includes a
    /// keep-alive connection left idle for the header timeout).
    HeaderTimeout,
    /// No request started for the idle timeout.
    IdleTimeout,
    /// The request body did not arrive in time.
    BodyTimeout,
    /// A header section the gateway refuses to interpret (bare LF, unsupported
    /// transfer coding).
    BadFraming,
    /// Still open during a drain once no request was left anywhere: a client
    /// that did not answer the GOAWAY (an idle pooled connection nobody reads).
    DrainIdle,
}

/// What the server asks of its connections.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Stop {
    #[default]
    Serve,
    /// Draining: finish what is in flight, take nothing new (HTTP/2: GOAWAY).
    Graceful,
    /// Nothing is in flight any more: close now.
    Now,
}

impl Closed {
    fn as_str(self) -> &'static str {
        match self {
            Closed::HeaderTimeout => "header_timeout",
            Closed::IdleTimeout => "idle_timeout",
            Closed::BodyTimeout => "body_timeout",
            Closed::BadFraming => "bad_framing",
            Closed::DrainIdle => "drain_idle",
        }
    }

    /// Count one connection closed for this reason.
    pub(crate) fn count(self) {
        metrics::counter!(names::CONNECTIONS_CLOSED_TOTAL, names::L_REASON => self.as_str())
            .increment(1);
    }
}

/// What the serving side knows about one connection; shared by its I/O wrapper,
/// its service and its watchdog.
#[derive(Default)]
pub(crate) struct ConnState {
    /// Requests whose headers arrived.
    requests: AtomicU64,
    /// The I/O wrapper saw a bare LF in a header section.
    bare_lf: AtomicBool,
}

/// The request-level limits checked before a request is handed to a handler.
#[derive(Clone, Copy, Debug)]
pub(crate) struct HeaderLimits {
    pub max_headers: usize,
    pub max_header_bytes: usize,
}

impl HeaderLimits {
    pub(crate) fn of(cfg: &crate::config::ServerConfig) -> Self {
        HeaderLimits {
            max_headers: cfg.max_headers,
            max_header_bytes: cfg.max_header_bytes,
        }
    }
}

impl ConnTimeouts {
    pub(crate) fn of(cfg: &crate::config::ServerConfig) -> Self {
        ConnTimeouts {
            header: cfg.header_read_timeout,
            idle: cfg.idle_timeout,
        }
    }
}

/// What [`ConnState::admit`]'s pass over a request's headers noticed, so the
/// next step need not look it up again.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Noticed {
    /// The request has an `Origin` header (a browser's: CORS applies).
    pub origin: bool,
}

impl ConnState {
    /// A request's headers arrived: check what the protocol layer leaves to us.
    /// Counts the request for the idle watchdog.
    pub(crate) fn admit<B>(
        &self,
        req: &http::Request<B>,
        limits: HeaderLimits,
    ) -> Result<Noticed, GatewayError> {
        self.requests.fetch_add(1, Ordering::Relaxed);
        if self.bare_lf.load(Ordering::Relaxed) {
            Closed::BadFraming.count();
            return Err(GatewayError::BadFraming(
                "a header line ends in a bare LF; lines must end in CRLF",
            ));
        }
        let headers = req.headers();
        if headers.len() > limits.max_headers {
            return Err(GatewayError::HeadersTooLarge(format!(
                "{} headers, more than the limit of {}",
                headers.len(),
                limits.max_headers
            )));
        }
        // One pass: the section's size, and which rare headers need a look.
        let (mut bytes, mut te) = (0usize, false);
        let mut noticed = Noticed::default();
        for (k, v) in headers {
            bytes += k.as_str().len() + v.len() + 4;
            te |= k == http::header::TRANSFER_ENCODING;
            noticed.origin |= k == http::header::ORIGIN;
        }
        if bytes > limits.max_header_bytes {
            return Err(GatewayError::HeadersTooLarge(format!(
                "{bytes} bytes of headers, more than the limit of {}",
                limits.max_header_bytes
            )));
        }
        if let Some(te) = te
            .then(|| headers.get(http::header::TRANSFER_ENCODING))
            .flatten()
        {
            let only_chunked = headers
                .get_all(http::header::TRANSFER_ENCODING)
                .iter()
                .flat_map(|v| v.as_bytes().split(|&b| b == b','))
                .all(|c| c.trim_ascii().eq_ignore_ascii_case(b"chunked"));
            if !only_chunked {
                Closed::BadFraming.count();
                let shown = String::from_utf8_lossy(te.as_bytes());
                return Err(GatewayError::UnsupportedTransferEncoding(
                    crate::api::error::echo(&shown),
                ));
            }
        }
        Ok(noticed)
    }

    fn requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }
}

/// The connection-level timeouts the watchdog enforces.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ConnTimeouts {
    /// From accept to the first request's complete headers.
    pub header: Duration,
    /// Longest time with no request starting.
    pub idle: Duration,
}

/// What woke a connection's driver.
enum Event<R> {
    Ended(R),
    Stop,
    /// The stop signal's sender is gone.
    Orphaned,
    Check,
}

/// Drive one connection to its end. Before its first request's headers arrive,
/// the connection has `header` time, and is then dropped (nothing is in flight).
/// After that, a connection on which no request started for `idle` is shut
/// down gracefully: a response still streaming finishes first. A `stop` signal
/// (the server draining) shuts it down gracefully too, and [`Stop::Now`] drops it.
pub(crate) async fn drive<C>(
    conn: C,
    state: &ConnState,
    timeouts: ConnTimeouts,
    mut stop: watch::Receiver<Stop>,
) where
    C: GracefulConnection<Error = Box<dyn std::error::Error + Send + Sync>>,
{
    tokio::pin!(conn);
    let mut seen = 0;
    let check = tokio::time::sleep(timeouts.header);
    tokio::pin!(check);
    let mut closing = *stop.borrow_and_update() >= Stop::Graceful;
    if closing {
        conn.as_mut().graceful_shutdown();
    }
    // A second handle on the stop signal, to ask whether it changed without
    // polling `changed` on every wake-up (a cooperative-budget poll and a
    // waker registration each time, several times per request).
    let probe = stop.clone();
    loop {
        let event = {
            let changed = stop.changed();
            tokio::pin!(changed);
            // The connection is what is ready on almost every wake. The check timer
            // is polled only to register it and once it has fired: between, its
            // registration stands (same task), so a request pays nothing for it.
            let mut registered = false;
            let mut watching = false;
            std::future::poll_fn(|cx| {
                if let Poll::Ready(r) = conn.as_mut().poll(cx) {
                    return Poll::Ready(Event::Ended(r));
                }
                // Polled once to register the waker (same task, so it stands),
                // then again only once the signal has changed or its sender is gone.
                if !watching || probe.has_changed().unwrap_or(true) {
                    watching = true;
                    if let Poll::Ready(r) = changed.as_mut().poll(cx) {
                        return Poll::Ready(match r {
                            Ok(()) => Event::Stop,
                            // The server is gone: nothing will signal again.
                            Err(_) => Event::Orphaned,
                        });
                    }
                }
                if closing {
                    return Poll::Pending;
                }
                if !registered || check.is_elapsed() {
                    registered = true;
                    if check.as_mut().poll(cx).is_ready() {
                        return Poll::Ready(Event::Check);
                    }
                }
                Poll::Pending
            })
            .await
        };
        match event {
            Event::Ended(r) => {
                if let Err(e) = r {
                    if e.downcast_ref::<hyper::Error>()
                        .is_some_and(hyper::Error::is_timeout)
                    {
                        Closed::HeaderTimeout.count();
                    }
                }
                return;
            }
            Event::Stop => match *stop.borrow_and_update() {
                Stop::Serve => {}
                Stop::Graceful => {
                    if !closing {
                        closing = true;
                        conn.as_mut().graceful_shutdown();
                    }
                }
                Stop::Now => {
                    Closed::DrainIdle.count();
                    return;
                }
            },
            Event::Orphaned => {
                // Nothing will signal again: finish what is in flight and close.
                if !closing {
                    conn.as_mut().graceful_shutdown();
                }
                let _ = std::future::poll_fn(|cx| conn.as_mut().poll(cx)).await;
                return;
            }
            Event::Check => {
                let now_seen = state.requests();
                if now_seen == 0 {
                    Closed::HeaderTimeout.count();
                    return;
                }
                if now_seen == seen {
                    Closed::IdleTimeout.count();
                    closing = true;
                    conn.as_mut().graceful_shutdown();
                } else {
                    seen = now_seen;
                    check
                        .as_mut()
                        .reset(crate::runtime::clock::now() + timeouts.idle);
                }
            }
        }
    }
}

/// Where the header scanner is in the byte stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// Reading a header section: every LF must follow a CR.
    Headers,
    /// Past a header section, until the next response is written.
    Body,
    /// Not HTTP/1 (the HTTP/2 preface), or already flagged.
    Off,
}

const H2_PREFACE_START: &[u8] = b"PRI * HTTP/2.0";

/// A client socket that watches HTTP/1 header sections for a bare LF. `httparse`
/// accepts a lone LF as a line end, so `X-A: 1\nX-B: 2` becomes two headers:
/// a request another proxy passed as one header would reach a worker as two.
/// The scan covers bytes from the start of a request to its empty line, re-arming
/// when a final (non-1xx) response starts; bodies are never scanned.
pub(crate) struct Scanned<T> {
    io: T,
    state: Arc<ConnState>,
    mode: Mode,
    /// Something was read already (the HTTP/2 preface can only come first).
    started: bool,
    /// The last byte read.
    prev: u8,
    /// Bytes since the last LF.
    line_len: usize,
    /// Non-empty lines seen in this header section (empty lines before the
    /// request line are allowed and do not end it).
    lines: usize,
}

impl<T> Scanned<T> {
    pub(crate) fn new(io: T, state: Arc<ConnState>) -> Self {
        Scanned {
            io,
            state,
            mode: Mode::Headers,
            started: false,
            prev: 0,
            line_len: 0,
            lines: 0,
        }
    }

    fn scan(&mut self, bytes: &[u8]) {
        if !self.started && bytes.starts_with(H2_PREFACE_START) {
            self.mode = Mode::Off;
        }
        self.started |= !bytes.is_empty();
        if self.mode != Mode::Headers || bytes.is_empty() {
            return;
        }
        let mut line_start = 0usize;
        for i in memchr::memchr_iter(b'\n', bytes) {
            let before = if i > 0 { bytes[i - 1] } else { self.prev };
            if before != b'\r' {
                self.state.bare_lf.store(true, Ordering::Relaxed);
                self.mode = Mode::Off;
                return;
            }
            let len = if line_start == 0 {
                self.line_len + i
            } else {
                i - line_start
            };
            line_start = i + 1;
            if len > 1 {
                self.lines += 1;
            } else if self.lines > 0 {
                // The empty line: the header section ends here.
                self.mode = Mode::Body;
                return;
            }
        }
        self.line_len = if line_start == 0 {
            self.line_len + bytes.len()
        } else {
            bytes.len() - line_start
        };
        self.prev = bytes[bytes.len() - 1];
    }

    /// A final response starting: the next bytes read begin a new request.
    fn wrote(&mut self, first: &[u8]) {
        if self.mode == Mode::Body
            && first.len() > 9
            && first.starts_with(b"HTTP/1.")
            && first[9] != b'1'
        {
            self.mode = Mode::Headers;
            self.prev = 0;
            self.line_len = 0;
            self.lines = 0;
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Scanned<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let r = Pin::new(&mut this.io).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = r {
            let filled = buf.filled();
            if filled.len() > before {
                this.scan(&filled[before..]);
            }
        }
        r
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Scanned<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        this.wrote(buf);
        Pin::new(&mut this.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        if let Some(first) = bufs.iter().find(|b| !b.is_empty()) {
            this.wrote(first);
        }
        Pin::new(&mut this.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scanner() -> Scanned<()> {
        Scanned::new((), Arc::default())
    }

    fn flagged(s: &Scanned<()>) -> bool {
        s.state.bare_lf.load(Ordering::Relaxed)
    }

    #[test]
    fn crlf_headers_pass_and_the_body_is_not_scanned() {
        let mut s = scanner();
        s.scan(b"POST /v1/x HTTP/1.1\r\nHost: a\r\n\r\n{\"a\":\n1}");
        assert!(!flagged(&s));
        assert_eq!(s.mode, Mode::Body);
    }

    #[test]
    fn a_bare_lf_is_flagged_even_split_over_reads() {
        let mut s = scanner();
        s.scan(b"GET / HTTP/1.1\r\nX-A: 1\nX-B: 2\r\n\r\n");
        assert!(flagged(&s));
        let mut s = scanner();
        s.scan(b"GET / HTTP/1.1\r");
        s.scan(b"\nX-A: 1");
        assert!(!flagged(&s));
        s.scan(b"\n");
        assert!(flagged(&s));
    }

    #[test]
    fn the_empty_line_is_found_across_reads_and_leading_crlf_does_not_end_it() {
        let mut s = scanner();
        s.scan(b"\r\nGET / HTTP/1.1\r\nHost: a\r");
        assert_eq!(s.mode, Mode::Headers);
        s.scan(b"\n\r");
        assert_eq!(s.mode, Mode::Headers);
        s.scan(b"\nbody\n");
        assert_eq!(s.mode, Mode::Body);
        assert!(!flagged(&s));
    }

    #[test]
    fn a_final_response_rearms_and_an_interim_one_does_not() {
        let mut s = scanner();
        s.scan(b"POST / HTTP/1.1\r\nExpect: 100-continue\r\n\r\n");
        s.wrote(b"HTTP/1.1 100 Continue\r\n\r\n");
        s.scan(b"{\n}");
        assert!(!flagged(&s));
        s.wrote(b"HTTP/1.1 200 OK\r\n");
        s.scan(b"GET / HTTP/1.1\nHost: a\r\n\r\n");
        assert!(flagged(&s));
    }

    #[test]
    fn http2_is_not_scanned() {
        let mut s = scanner();
        s.scan(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\n\x04");
        assert!(!flagged(&s));
    }
}
