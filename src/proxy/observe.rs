//! The response observer: a pass-through body that forwards upstream frames
//! untouched while it measures TTFT, inter-token gaps, tokens and usage, enforces
//! the idle and total deadlines, and ends a failed SSE stream with an explicit error
//! event. Metrics are recorded once, when the body ends or is dropped.

use super::RequestTags;
use crate::api::ErrorBody;
use crate::pool::InFlightGuard;
use crate::telemetry::{self, names, End, Outcome, PairMetrics, RequestMetrics, RouteTags};
use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use memchr::memmem;
use metrics::counter;
use serde::Deserialize;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::LazyLock;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::time::{Instant, Sleep};

/// Longest partial SSE line carried between chunks; longer lines are classified
/// from their first part only.
const MAX_LINE_CARRY: usize = 64 * 1024;
/// Bytes of a non-streamed body kept to find `usage` at its end.
const TAIL_BYTES: usize = 8 * 1024;

static USAGE: LazyLock<memmem::Finder<'static>> =
    LazyLock::new(|| memmem::Finder::new(b"\"usage\":"));
/// Fields whose non-empty string value means the event carries generated output.
static CONTENT_KEYS: LazyLock<[memmem::Finder<'static>; 7]> = LazyLock::new(|| {
    [
        // Anthropic's `input_json_delta` and `thinking_delta`.
        memmem::Finder::new(b"\"partial_json\":\""),
        memmem::Finder::new(b"\"thinking\":\""),
        memmem::Finder::new(b"\"content\":\""),
        memmem::Finder::new(b"\"text\":\""),
        memmem::Finder::new(b"\"delta\":\""),
        memmem::Finder::new(b"\"arguments\":\""),
        memmem::Finder::new(b"\"reasoning_content\":\""),
    ]
});

/// OpenAI `usage` (only the fields we count), or the Responses and Anthropic
/// names for the same.
#[derive(Debug, Default, Clone, Copy, Deserialize, PartialEq, Eq)]
pub struct Usage {
    #[serde(default, alias = "input_tokens")]
    pub prompt_tokens: u64,
    #[serde(default, alias = "output_tokens")]
    pub completion_tokens: u64,
    #[serde(default, alias = "input_tokens_details")]
    pub prompt_tokens_details: Option<PromptDetails>,
    /// Anthropic: prompt tokens read from the prefix cache, not in `input_tokens`.
    #[serde(default)]
    pub cache_read_input_tokens: Option<u64>,
    /// Anthropic: prompt tokens written to the cache, not in `input_tokens`.
    #[serde(default)]
    pub cache_creation_input_tokens: Option<u64>,
}

impl Usage {
    /// A later usage report of the same answer over this one: Anthropic streams
    /// send the input in `message_start` and only the output in `message_delta`.
    fn update(self, later: Usage) -> Usage {
        let pick = |new: u64, old: u64| if new > 0 { new } else { old };
        Usage {
            prompt_tokens: pick(later.prompt_tokens, self.prompt_tokens),
            completion_tokens: pick(later.completion_tokens, self.completion_tokens),
            prompt_tokens_details: later.prompt_tokens_details.or(self.prompt_tokens_details),
            cache_read_input_tokens: later
                .cache_read_input_tokens
                .or(self.cache_read_input_tokens),
            cache_creation_input_tokens: later
                .cache_creation_input_tokens
                .or(self.cache_creation_input_tokens),
        }
    }

    /// In OpenAI's terms: Anthropic's cache reads and writes join the prompt,
    /// and the reads are its cached tokens.
    fn normalized(self) -> Usage {
        if self.cache_read_input_tokens.is_none() && self.cache_creation_input_tokens.is_none() {
            return self;
        }
        let read = self.cache_read_input_tokens.unwrap_or(0);
        let written = self.cache_creation_input_tokens.unwrap_or(0);
        Usage {
            prompt_tokens: self.prompt_tokens + read + written,
            prompt_tokens_details: Some(PromptDetails {
                cached_tokens: Some(read),
            }),
            cache_read_input_tokens: None,
            cache_creation_input_tokens: None,
            ..self
        }
    }
}

#[derive(Debug, Default, Clone, Copy, Deserialize, PartialEq, Eq)]
pub struct PromptDetails {
    #[serde(default)]
    pub cached_tokens: Option<u64>,
}

/// Parse the `usage` object that starts right after `"usage":` in `rest`, if any.
fn parse_usage(rest: &[u8]) -> Option<Usage> {
    let mut it = serde_json::Deserializer::from_slice(rest).into_iter::<Option<Usage>>();
    it.next().and_then(Result::ok).flatten()
}

/// Labels and limits for one observed response.
pub struct ObserveParams {
    pub start: Instant,
    pub metrics: Arc<PairMetrics>,
    /// Index into `telemetry::ENDPOINTS`.
    pub endpoint: usize,
    pub status: u16,
    pub sse: bool,
    pub idle: Duration,
    pub deadline: Instant,
    pub guard: InFlightGuard,
    /// Request context for metrics labels, cost, access log and trace.
    pub tags: Arc<RequestTags>,
    /// The route this response took.
    pub route: RouteTags,
    /// How to tell the engine when the client leaves (SGLang pools); other
    /// engines see the connection close. Boxed: it holds a whole upstream
    /// client, and every observer would otherwise carry room for one (an
    /// observer over 1 KiB takes the allocator's slow path).
    pub cancel: Option<Box<super::cancel::Cancel>>,
    /// End a failed stream with Anthropic's `error` event instead of OpenAI's.
    pub anthropic_errors: bool,
    /// Prompt tokens estimated from the request, counted when the answer
    /// reports no usage (`None`: the endpoint bills no tokens).
    pub prompt_estimate: Option<u64>,
}

/// Measurements taken from the bytes as they pass.
struct Observer {
    p: ObserveParams,
    first_content: Option<Instant>,
    last_content: Option<Instant>,
    content_events: u64,
    /// Sum of inter-token gaps, for the mean ITL.
    itl_sum: Duration,
    response_bytes: u64,
    usage: Option<Usage>,
    /// Partial SSE line carried to the next chunk.
    lines: Lines,
    /// The end of a non-SSE body, where `usage` is.
    tail: Tail,
    outcome: Option<Outcome>,
}

impl Observer {
    fn new(p: ObserveParams) -> Observer {
        Observer {
            p,
            first_content: None,
            last_content: None,
            content_events: 0,
            itl_sum: Duration::ZERO,
            response_bytes: 0,
            usage: None,
            lines: Lines::default(),
            tail: Tail::default(),
            outcome: None,
        }
    }

    fn on_data(&mut self, chunk: &Bytes, now: Instant) {
        self.response_bytes += chunk.len() as u64;
        if !self.p.sse {
            // A whole answer is arriving: the prefill is long done.
            self.p.guard.first_token();
            self.tail.push(chunk);
            return;
        }
        // Taken out for the loop (a moved `Vec`, no copy) so lines can reach `self`.
        let mut lines = std::mem::take(&mut self.lines);
        lines.feed(chunk, |line| self.on_line(line, now));
        self.lines = lines;
    }

    fn on_line(&mut self, line: &[u8], now: Instant) {
        let Some(facts) = read_line(line) else {
            return;
        };
        if let Some(u) = facts.usage {
            self.usage = Some(self.usage.map_or(u, |old| old.update(u)));
        }
        if facts.content {
            match self.last_content {
                None => {
                    self.first_content = Some(now);
                    // Its prefill no longer delays the worker's next requests.
                    self.p.guard.first_token();
                }
                Some(prev) => {
                    let gap = now.duration_since(prev);
                    self.p.metrics.itl.record(gap.as_secs_f64());
                    self.p.tags.sinks.record_itl(gap);
                    self.itl_sum += gap;
                }
            }
            self.last_content = Some(now);
            self.content_events += 1;
        }
    }

    fn on_end(&mut self) {
        // The answer is out: the client's next request may follow at once.
        crate::runtime::busy_poll::touch();
        if !self.p.sse {
            self.usage = self.tail.usage();
        } else {
            let mut lines = std::mem::take(&mut self.lines);
            let now = crate::runtime::clock::now();
            lines.finish(|line| self.on_line(line, now));
        }
    }
}

/// SSE line framing across chunks. A line split over chunks is carried (up to
/// `MAX_LINE_CARRY` bytes; a longer one is judged by its start), every other
/// line is handed on in place, without a copy.
#[derive(Default)]
struct Lines {
    carry: Vec<u8>,
}

impl Lines {
    /// Call `f` with each line `chunk` completes, without its `\n`.
    fn feed(&mut self, chunk: &[u8], mut f: impl FnMut(&[u8])) {
        let mut rest = chunk;
        if !self.carry.is_empty() {
            let Some(i) = memchr::memchr(b'\n', rest) else {
                self.keep(rest);
                return;
            };
            self.keep(&rest[..i]);
            f(&self.carry);
            self.carry.clear();
            rest = &rest[i + 1..];
        }
        while let Some(i) = memchr::memchr(b'\n', rest) {
            f(&rest[..i]);
            rest = &rest[i + 1..];
        }
        self.keep(rest);
    }

    /// The stream ended: a last line without its `\n`, if any.
    fn finish(&mut self, mut f: impl FnMut(&[u8])) {
        if !self.carry.is_empty() {
            f(&self.carry);
            self.carry.clear();
        }
    }

    fn keep(&mut self, bytes: &[u8]) {
        let room = MAX_LINE_CARRY.saturating_sub(self.carry.len());
        self.carry
            .extend_from_slice(&bytes[..bytes.len().min(room)]);
    }
}

/// What an SSE `data:` line says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct LineFacts {
    usage: Option<Usage>,
    /// It carries generated output (a token for TTFT and ITL).
    content: bool,
}

/// The facts of one SSE line; `None` for anything but a `data:` line (comments,
/// `event:`, `[DONE]`).
fn read_line(line: &[u8]) -> Option<LineFacts> {
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let data = line.strip_prefix(b"data:")?;
    let data = data.strip_prefix(b" ").unwrap_or(data);
    if data == b"[DONE]" {
        return None;
    }
    let usage = USAGE
        .find(data)
        .and_then(|pos| parse_usage(&data[pos + 8..]));
    Some(LineFacts {
        usage,
        content: carries_content(data),
    })
}

/// The observer's scanning without its metrics, for the fuzz targets.
#[doc(hidden)]
pub mod fuzzing {
    use super::{read_line, Lines, Tail, Usage};

    /// Longest line carried between chunks.
    pub const MAX_LINE_CARRY: usize = super::MAX_LINE_CARRY;

    /// The lines an SSE body cut into `chunks` yields, a last unterminated one included.
    pub fn sse_lines(chunks: &[&[u8]]) -> Vec<Vec<u8>> {
        let mut lines = Lines::default();
        let mut out = Vec::new();
        for c in chunks {
            lines.feed(c, |l| out.push(l.to_vec()));
        }
        lines.finish(|l| out.push(l.to_vec()));
        out
    }

    /// For a `data:` line: whether it carries output, and its usage.
    pub fn sse_line(line: &[u8]) -> Option<(bool, Option<Usage>)> {
        read_line(line).map(|f| (f.content, f.usage))
    }

    /// The usage a non-streamed body cut into `chunks` ends with.
    pub fn body_usage(chunks: &[&[u8]]) -> Option<Usage> {
        let mut t = Tail::default();
        for c in chunks {
            t.push(&bytes::Bytes::copy_from_slice(c));
        }
        t.usage()
    }
}

/// The end of a body, at least its last `TAIL_BYTES` (at most twice that): the
/// latest chunk, shared rather than copied, and up to `TAIL_BYTES` before it,
/// copied only when the body comes in several chunks.
#[derive(Default)]
struct Tail {
    last: Bytes,
    before: Vec<u8>,
}

impl Tail {
    fn push(&mut self, chunk: &Bytes) {
        if chunk.len() >= TAIL_BYTES {
            self.before.clear();
        } else if !self.last.is_empty() {
            let prev = std::mem::take(&mut self.last);
            let prev = &prev[prev.len().saturating_sub(TAIL_BYTES)..];
            let over = (self.before.len() + prev.len()).saturating_sub(TAIL_BYTES);
            self.before.drain(..over.min(self.before.len()));
            self.before.extend_from_slice(prev);
        }
        self.last = chunk.clone();
    }

    /// The last `usage` object in the kept bytes.
    fn usage(&self) -> Option<Usage> {
        let last = &self.last[self.last.len().saturating_sub(TAIL_BYTES)..];
        let joined;
        let tail = if self.before.is_empty() {
            last
        } else {
            joined = [&self.before[..], last].concat();
            &joined[..]
        };
        let key = USAGE_KEY.needle().len();
        // Usage closes the body: the last KiB is searched forward (the vector
        // prefilter makes that far cheaper than a reverse search), the rest
        // only if it is not there.
        let near = tail.len().saturating_sub(1024);
        let pos = USAGE_KEY.find_iter(&tail[near..]).last().map(|p| near + p);
        pos.or_else(|| USAGE_KEY_REV.rfind(&tail[..(near + key - 1).min(tail.len())]))
            .and_then(|pos| parse_usage(&tail[pos + key..]))
    }
}

/// Built once: `memmem::find`/`rfind` build their searcher on every call.
static USAGE_KEY: LazyLock<memmem::Finder<'static>> =
    LazyLock::new(|| memmem::Finder::new(b"\"usage\":"));
static USAGE_KEY_REV: LazyLock<memmem::FinderRev<'static>> =
    LazyLock::new(|| memmem::FinderRev::new(USAGE_KEY.needle()));

static RESPONSES_TYPE: LazyLock<memmem::Finder<'static>> =
    LazyLock::new(|| memmem::Finder::new(b"\"type\":\"response."));

fn carries_content(data: &[u8]) -> bool {
    // A Responses API event carries new output only if it is a `….delta`; the
    // closing `….done` / `response.completed` events repeat the whole text.
    if let Some(i) = RESPONSES_TYPE.find(data) {
        let name = &data[i + RESPONSES_TYPE.needle().len()..];
        let end = memchr::memchr(b'"', name).unwrap_or(name.len());
        if !name[..end].ends_with(b".delta") {
            return false;
        }
    }
    CONTENT_KEYS.iter().any(|f| {
        f.find_iter(data)
            .any(|i| data.get(i + f.needle().len()).is_some_and(|&b| b != b'"'))
    })
}

impl Drop for Observer {
    fn drop(&mut self) {
        let outcome = self.outcome.unwrap_or(Outcome::Cancelled);
        if outcome == Outcome::Cancelled {
            match self.p.cancel.take() {
                Some(c) => c.fire(),
                None => super::cancel::count(&self.p.route.worker, "connection_closed"),
            }
        }
        let usage = self.usage.map(Usage::normalized);
        let u = usage.unwrap_or_default();
        // No usage from a billed answer that got through: estimate, loudly.
        let estimated = usage.is_none()
            && self.p.prompt_estimate.is_some()
            && (200..300).contains(&self.p.status);
        if estimated {
            super::usage::estimated(&self.p.route.pool);
        }
        let m = RequestMetrics {
            ttft: self.first_content.map(|t| t.duration_since(self.p.start)),
            e2e: self.p.start.elapsed(),
            prompt_tokens: usage
                .map(|u| u.prompt_tokens)
                .or(self.p.prompt_estimate.filter(|_| estimated)),
            usage_estimated: estimated,
            cached_tokens: u.prompt_tokens_details.and_then(|d| d.cached_tokens),
            output_tokens: if usage.is_some() {
                u.completion_tokens
            } else {
                self.content_events
            },
            mean_itl: (self.content_events > 1)
                .then(|| self.itl_sum / (self.content_events - 1) as u32),
            response_bytes: self.response_bytes,
        };
        self.learn(outcome, &m);
        self.p.tags.finish(
            telemetry::ENDPOINTS[self.p.endpoint],
            self.p.status,
            End::Proxied {
                route: &self.p.route,
                pair: &self.p.metrics,
                outcome,
                m: &m,
            },
        );
    }
}

impl Observer {
    /// Feed the worker's latency model (a completed answer with a measured
    /// TTFT, counted from the answering attempt's dispatch: time before it, in
    /// the gateway's queue or on failed attempts, is not the worker's) and put
    /// its prediction on the record.
    fn learn(&mut self, outcome: Outcome, m: &RequestMetrics) {
        let Some(dispatch) = self.p.tags.dispatch.get() else {
            return;
        };
        let sent = Duration::from_secs_f64(dispatch.sent_ms().max(0.0) / 1e3);
        self.p.route.dispatched_ms = Some(dispatch.sent_ms());
        if let Some(p) = dispatch.prediction() {
            // From arrival, as TTFT is measured.
            self.p.route.predicted_ttft_ms = Some(dispatch.sent_ms() + p.ttft_ms);
            self.p.route.predicted_tpot_ms = p.tpot_ms;
        }
        let Some(ttft) = m.ttft else { return };
        if outcome == Outcome::Completed && self.p.status < 400 {
            self.p
                .guard
                .learn(&dispatch, ttft.saturating_sub(sent), m.mean_itl);
        }
    }
}

/// The observer without a body of its own: whoever sees the response's bytes
/// (the Endpoint Picker, which gets them as ext_proc messages) feeds it. Records
/// the same metrics as an [`ObservedBody`], once, when finished or dropped.
pub struct ResponseObserver(Observer);

impl ResponseObserver {
    pub fn new(p: ObserveParams) -> ResponseObserver {
        ResponseObserver(Observer::new(p))
    }

    /// A chunk of the response body as it passes.
    pub fn on_data(&mut self, chunk: &Bytes) {
        self.0.on_data(chunk, crate::runtime::clock::now());
    }

    /// The body ended normally (dropping it unfinished counts as cancelled).
    pub fn finish(mut self) {
        self.0.on_end();
        self.0.outcome = Some(Outcome::Completed);
    }
}

enum Phase {
    Streaming,
    /// The upstream failed; the error event (if SSE) is still to be sent.
    Failing(Option<Bytes>),
    Done,
}

/// The response body handed to the client.
pub struct ObservedBody<B> {
    inner: B,
    /// The idle/total deadline timer, made the first time the upstream is not
    /// ready: a response that arrives whole never needs one.
    timer: Option<Pin<Box<Sleep>>>,
    /// The gateway's drain cut, waited on by an SSE stream once it waits for
    /// the upstream: at the drain deadline the stream ends with its error event.
    cut: Option<Pin<Box<dyn Future<Output = ()> + Send + Sync>>>,
    last_activity: Instant,
    /// Boxed: the body is moved through a few wrappers on its way out, and the
    /// observer is most of its size.
    obs: Box<Observer>,
    phase: Phase,
}

impl<B> ObservedBody<B> {
    pub fn new(inner: B, p: ObserveParams) -> Self {
        ObservedBody {
            inner,
            timer: None,
            cut: None,
            last_activity: crate::runtime::clock::now(),
            obs: Box::new(Observer::new(p)),
            phase: Phase::Streaming,
        }
    }

    /// The upstream body ended normally.
    fn finish(&mut self) {
        if matches!(self.phase, Phase::Streaming) {
            self.obs.on_end();
            self.obs.outcome = Some(Outcome::Completed);
            self.phase = Phase::Done;
        }
    }

    /// The drain deadline passed while this stream waits: fail it with the
    /// error event (counted for the shutdown log) and `true`.
    fn drain_cut(&mut self, cx: &mut Context<'_>) -> bool {
        let live = &self.obs.p.tags.live;
        let cut = self.cut.get_or_insert_with(|| live.cut_signal());
        if cut.as_mut().poll(cx).is_pending() {
            return false;
        }
        live.count_cut();
        self.fail(
            "drain_deadline",
            "The gateway is shutting down: the stream was cut at its drain deadline (server.drain_timeout_ms)",
        );
        true
    }

    fn fail(&mut self, reason: &'static str, message: &str) {
        counter!(
            names::STREAM_ERRORS_TOTAL,
            names::L_MODEL => self.obs.p.metrics.model.clone(),
            names::L_WORKER => self.obs.p.metrics.worker.clone(),
            names::L_REASON => reason
        )
        .increment(1);
        tracing::warn!(worker = %self.obs.p.metrics.worker, reason, "response failed mid-body");
        self.obs.outcome = Some(Outcome::Error);
        let event = match (self.obs.p.sse, self.obs.p.anthropic_errors) {
            (false, _) => None,
            (true, true) => Some(crate::api::anthropic::error::sse_event(
                "api_error",
                message,
            )),
            (true, false) => {
                let kind = if reason == "drain_deadline" {
                    "server_error"
                } else {
                    "upstream_error"
                };
                Some(ErrorBody::new(message, kind, None, Some(reason)).to_sse_event())
            }
        };
        self.phase = Phase::Failing(event);
    }
}

impl<B> Body for ObservedBody<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: std::fmt::Display,
{
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        loop {
            match &mut this.phase {
                Phase::Done => return Poll::Ready(None),
                Phase::Failing(event) => {
                    return match event.take() {
                        Some(ev) => Poll::Ready(Some(Ok(Frame::data(ev)))),
                        None if this.obs.p.sse => {
                            this.phase = Phase::Done;
                            Poll::Ready(None)
                        }
                        None => {
                            this.phase = Phase::Done;
                            // Not SSE: abort the body so the client sees the truncation.
                            Poll::Ready(Some(Err("upstream failed mid-response".into())))
                        }
                    };
                }
                Phase::Streaming => {}
            }
            match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    let now = crate::runtime::clock::now();
                    this.last_activity = now;
                    if let Some(data) = frame.data_ref() {
                        this.obs.on_data(data, now);
                    }
                    // hyper stops polling a body with a known length once it has
                    // written every byte, and drops it without asking for the end:
                    // finish here so a complete response is not counted as cancelled.
                    if this.inner.is_end_stream() {
                        this.finish();
                    }
                    return Poll::Ready(Some(Ok(frame)));
                }
                Poll::Ready(Some(Err(e))) => {
                    let msg = format!("The upstream worker failed mid-response: {e}");
                    this.fail("upstream_reset", &msg);
                    continue;
                }
                Poll::Ready(None) => {
                    this.finish();
                    return Poll::Ready(None);
                }
                Poll::Pending => {}
            }
            if this.obs.p.sse && this.drain_cut(cx) {
                continue;
            }
            // Deadlines: the timer is re-armed lazily, only when it fires early.
            let due = (this.last_activity + this.obs.p.idle).min(this.obs.p.deadline);
            let timer = this
                .timer
                .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(due)));
            if timer.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            if crate::runtime::clock::now() >= due {
                let (reason, msg) = if due == this.obs.p.deadline {
                    (
                        "total_timeout",
                        "The request exceeded the gateway's total timeout",
                    )
                } else {
                    ("idle_timeout", "The upstream worker stopped sending data")
                };
                this.fail(reason, msg);
                continue;
            }
            timer.as_mut().reset(due);
            if timer.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match self.phase {
            Phase::Done => true,
            Phase::Streaming => self.inner.is_end_stream(),
            Phase::Failing(_) => false,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self.phase {
            Phase::Streaming => self.inner.size_hint(),
            _ => SizeHint::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_detection() {
        assert!(!carries_content(
            br#"{"choices":[{"delta":{"role":"assistant","content":""}}]}"#
        ));
        assert!(carries_content(
            br#"{"choices":[{"delta":{"content":"Hi"}}]}"#
        ));
        assert!(carries_content(br#"{"choices":[{"text":" there"}]}"#));
        assert!(carries_content(
            br#"{"type":"response.output_text.delta","delta":"x"}"#
        ));
        assert!(carries_content(
            br#"{"delta":"{\"a","item_id":"fc_1","type":"response.function_call_arguments.delta"}"#
        ));
        // The closing events repeat the text: no new output.
        for done in [
            br#"{"type":"response.output_text.done","text":"Hello there"}"#.as_slice(),
            br#"{"part":{"type":"output_text","text":"Hello there"},"type":"response.content_part.done"}"#,
            br#"{"type":"response.completed","response":{"output":[{"content":[{"text":"Hello"}]}]}}"#,
        ] {
            assert!(!carries_content(done), "{}", String::from_utf8_lossy(done));
        }
        assert!(!carries_content(
            br#"{"choices":[],"usage":{"prompt_tokens":3}}"#
        ));
    }

    #[test]
    fn lines_are_the_same_wherever_the_chunks_are_cut() {
        let body = b"data: {\"a\":1}\r\n\r\n: c\ndata: [DONE]\n\nlast";
        let whole = fuzzing::sse_lines(&[body]);
        assert_eq!(whole.len(), 6);
        assert_eq!(whole[5], b"last");
        for i in 0..=body.len() {
            for j in i..=body.len() {
                let cut = fuzzing::sse_lines(&[&body[..i], &body[i..j], &body[j..]]);
                assert_eq!(cut, whole, "cut at {i}, {j}");
            }
        }
        assert_eq!(fuzzing::sse_line(b"data: [DONE]"), None);
        assert_eq!(
            fuzzing::sse_line(b"data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}]}\r"),
            Some((true, None))
        );
    }

    #[test]
    fn usage_is_found_across_chunks() {
        let body = br#"{"choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":12,"completion_tokens":5}}"#;
        for cut in [1, 40, 60, body.len() - 3] {
            let mut t = Tail::default();
            t.push(&Bytes::copy_from_slice(&body[..cut]));
            t.push(&Bytes::copy_from_slice(&body[cut..]));
            t.push(&Bytes::new());
            let u = t.usage().unwrap_or_else(|| panic!("cut at {cut}"));
            assert_eq!((u.prompt_tokens, u.completion_tokens), (12, 5));
        }
        // Three pieces, the key itself split.
        let mut t = Tail::default();
        let at = body.windows(7).position(|w| w == b"\"usage\"").unwrap() + 3;
        for piece in [&body[..at], &body[at..at + 2], &body[at + 2..]] {
            t.push(&Bytes::copy_from_slice(piece));
        }
        assert_eq!(t.usage().map(|u| u.completion_tokens), Some(5));
        // Only the last TAIL_BYTES count.
        let mut t = Tail::default();
        t.push(&Bytes::from_static(br#""usage":{"prompt_tokens":1}"#));
        t.push(&Bytes::from(vec![b' '; TAIL_BYTES]));
        assert_eq!(t.usage(), None);
        // Usage further back than the last KiB, or across its start.
        for pad in (950..1100).step_by(3) {
            let mut body = br#"{"id":"x","usage":{"prompt_tokens":3}"#.to_vec();
            body.extend(std::iter::repeat_n(b' ', pad));
            body.push(b'}');
            let mut t = Tail::default();
            t.push(&Bytes::from(body));
            t.push(&Bytes::new());
            assert_eq!(t.usage().map(|u| u.prompt_tokens), Some(3), "pad {pad}");
        }
    }

    #[test]
    fn anthropic_usage_is_merged_across_events_and_normalized() {
        let mut o: Option<Usage> = None;
        for data in [
            br#"{"type":"message_start","message":{"usage":{"input_tokens":4,"output_tokens":1,"cache_read_input_tokens":16}}}"#.as_slice(),
            br#"{"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":9}}"#,
        ] {
            let u = parse_usage(&data[USAGE.find(data).unwrap() + 8..]).unwrap();
            o = Some(o.map_or(u, |old| old.update(u)));
        }
        let u = o.unwrap().normalized();
        assert_eq!((u.prompt_tokens, u.completion_tokens), (20, 9));
        assert_eq!(u.prompt_tokens_details.unwrap().cached_tokens, Some(16));
        assert!(carries_content(
            br#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hi"}}"#
        ));
        assert!(carries_content(
            br#"{"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":"{"a"}}"#
        ));
        assert!(!carries_content(
            br#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#
        ));
    }

    #[test]
    fn usage_parses_after_key() {
        let data = br#"{"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":5,"total_tokens":17,"prompt_tokens_details":{"cached_tokens":8}}}"#;
        let pos = USAGE.find(data).unwrap();
        let u = parse_usage(&data[pos + 8..]).unwrap();
        assert_eq!(u.prompt_tokens, 12);
        assert_eq!(u.completion_tokens, 5);
        assert_eq!(u.prompt_tokens_details.unwrap().cached_tokens, Some(8));
        assert!(parse_usage(b"null,\"x\":1}").is_none());
    }
}
