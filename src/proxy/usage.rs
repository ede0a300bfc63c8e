//! Usage on every streamed request. A client that streams without
//! `stream_options.include_usage` gets no token counts, and neither would the
//! gateway: cost, token limits and budgets would be guesses. So the gateway asks
//! the engine for usage (`upstream_body`), reads it as it passes (`observe`),
//! and strips the usage chunk from the stream of a client that did not ask.

use super::edited::{Edit, Edited};
use crate::api::{Endpoint, RequestInfo};
use crate::config::PoolConfig;
use crate::telemetry::names;
use bytes::{Bytes, BytesMut};
use memchr::memmem;
use serde::de::IgnoredAny;
use serde::Deserialize;

/// Does the gateway ask `pool`'s engine for usage the client did not ask for?
pub(crate) fn asks(info: &RequestInfo, pool: &PoolConfig, endpoint: Endpoint) -> bool {
    pool.request_usage
        && info.stream
        && !info.include_usage
        && matches!(endpoint, Endpoint::ChatCompletions | Endpoint::Completions)
}

/// A billed answer came without usage: its tokens are estimated. Counted per
/// pool, and logged once per pool so a misconfigured upstream is noticed.
pub(crate) fn estimated(pool: &metrics::SharedString) {
    metrics::counter!(names::USAGE_ESTIMATED_TOTAL, names::L_POOL => pool.clone()).increment(1);
    static WARNED: std::sync::LazyLock<dashmap::DashSet<String>> =
        std::sync::LazyLock::new(dashmap::DashSet::new);
    if WARNED.len() < 64 && WARNED.insert(pool.to_string()) {
        tracing::warn!(pool = %pool, "an answer carried no usage: its tokens are estimated (switchyard_usage_estimated_total)");
    }
}

/// The client's event stream without the usage-only chunk the gateway asked for.
/// Whole events pass as they complete; only an unfinished one is held.
pub(crate) fn strip<B>(inner: B) -> Edited<B, UsageOnly> {
    Edited::new(inner, UsageOnly::default())
}

/// The strip edit: the unfinished event held.
#[derive(Default)]
pub(crate) struct UsageOnly {
    held: BytesMut,
}

impl Edit for UsageOnly {
    /// The complete events of what was held plus `data`, without usage-only
    /// ones; the unfinished rest stays held.
    fn pass(&mut self, data: &Bytes) -> Bytes {
        // The usual chunk: whole events, none with usage, nothing held: as is.
        let whole = data.ends_with(b"\n\n") || data.ends_with(b"\r\n\r\n");
        if self.held.is_empty() && whole && USAGE.find(data).is_none() {
            return data.clone();
        }
        self.held.extend_from_slice(data);
        let Some(end) = last_event_end(&self.held) else {
            return Bytes::new();
        };
        let events = self.held.split_to(end).freeze();
        if USAGE.find(&events).is_none() {
            return events;
        }
        let mut out = BytesMut::with_capacity(events.len());
        for ev in split_events(&events) {
            if !usage_only(ev) {
                out.extend_from_slice(ev);
            }
        }
        out.freeze()
    }

    fn rest(&mut self) -> Bytes {
        self.held.split().freeze()
    }
}

static USAGE: std::sync::LazyLock<memmem::Finder<'static>> =
    std::sync::LazyLock::new(|| memmem::Finder::new(b"\"usage\""));

/// The end (after its blank line) of the last complete event in `buf`.
fn last_event_end(buf: &[u8]) -> Option<usize> {
    let lf = memmem::rfind(buf, b"\n\n").map(|i| i + 2);
    let crlf = memmem::rfind(buf, b"\r\n\r\n").map(|i| i + 4);
    lf.max(crlf)
}

/// `buf` (complete events) cut after each blank line.
fn split_events(buf: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut rest = buf;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let lf = memmem::find(rest, b"\n\n").map(|i| i + 2);
        let crlf = memmem::find(rest, b"\r\n\r\n").map(|i| i + 4);
        let end = match (lf, crlf) {
            (Some(a), Some(b)) => a.min(b),
            (a, b) => a.or(b).unwrap_or(rest.len()),
        };
        let (ev, tail) = rest.split_at(end);
        rest = tail;
        Some(ev)
    })
}

#[derive(Deserialize)]
struct Chunk {
    #[serde(default)]
    choices: Option<Vec<IgnoredAny>>,
    #[serde(default)]
    usage: Option<IgnoredAny>,
}

/// An event whose one `data:` line is a chunk with usage and no choices.
fn usage_only(event: &[u8]) -> bool {
    let text = event.trim_ascii();
    let Some(json) = text.strip_prefix(b"data:") else {
        return false;
    };
    if USAGE.find(json).is_none() || memchr::memchr(b'\n', json).is_some() {
        return false;
    }
    match serde_json::from_slice::<Chunk>(json.trim_ascii()) {
        Ok(c) => c.usage.is_some() && c.choices.is_some_and(|c| c.is_empty()),
        Err(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STREAM: &[u8] =
        b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}],\"usage\":null}\n\n\
data: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1}}\n\n\
data: [DONE]\n\n";

    fn strip_in_pieces(cut: usize) -> Vec<u8> {
        let mut s = UsageOnly::default();
        let stream = Bytes::from_static(STREAM);
        let mut out = s.pass(&stream.slice(..cut)).to_vec();
        out.extend_from_slice(&s.pass(&stream.slice(cut..)));
        out.extend_from_slice(&s.rest());
        out
    }

    #[test]
    fn the_usage_chunk_is_dropped_wherever_the_stream_is_cut() {
        let want = b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}],\"usage\":null}\n\ndata: [DONE]\n\n";
        for cut in 0..=STREAM.len() {
            assert_eq!(strip_in_pieces(cut), want, "cut at {cut}");
        }
    }

    #[test]
    fn chunks_with_choices_or_without_usage_stay() {
        assert!(!usage_only(
            b"data: {\"choices\":[{}],\"usage\":{\"prompt_tokens\":1}}\n\n"
        ));
        assert!(!usage_only(b"data: {\"choices\":[],\"usage\":null}\n\n"));
        assert!(!usage_only(b"data: [DONE]\n\n"));
        assert!(!usage_only(b": comment \"usage\"\n\n"));
        assert!(usage_only(
            b"data: {\"choices\": [], \"usage\": {\"prompt_tokens\": 1}}\r\n\r\n"
        ));
    }
}
