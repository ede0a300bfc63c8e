//! Tracing: W3C `traceparent` handling (always on: the worker gets one on every
//! attempt) and, when `tracing.otlp_endpoint` is set, spans for the request, its
//! admission, each routing decision and each upstream attempt, exported as
//! OTLP/HTTP JSON by a background task with a bounded buffer (drops counted).
//!
//! The exporter is built in rather than taken from the `opentelemetry-otlp` crates:
//! the spans are few and fixed, OTLP/HTTP JSON is part of the OTLP specification
//! (accepted by the OpenTelemetry Collector, Jaeger and Tempo), and it keeps the
//! protobuf/gRPC stacks out of the build (see `docs/observability.md`).

use super::names;
use super::record::{End, RequestRecord};
use crate::config::observability::TracingConfig;
use bytes::Bytes;
use http::HeaderValue;
use http_body_util::Full;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use metrics::counter;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use std::cell::RefCell;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;

pub const TRACEPARENT: http::HeaderName = http::HeaderName::from_static("traceparent");
/// Largest batch of spans in one export request.
const MAX_BATCH: usize = 512;

/// The trace a request belongs to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceContext {
    pub trace_id: u128,
    /// The caller's span, when the request came with a `traceparent`.
    pub parent_span_id: Option<u64>,
    /// The gateway's span for the whole request.
    pub span_id: u64,
    /// Spans are exported (and the flag propagated as sampled).
    pub sampled: bool,
    /// The caller's `traceparent`, forwarded unchanged when no spans are exported.
    pub incoming: Option<HeaderValue>,
}

/// Trace and span ids need to be unique enough not to collide, not secret: a
/// per-thread xoshiro generator (seeded from the OS) serves, without the
/// cryptographic generator and periodic reseeding of `rand::random`.
fn with_id_rng<T>(f: impl FnOnce(&mut SmallRng) -> T) -> T {
    thread_local! {
        static IDS: RefCell<SmallRng> = RefCell::new(SmallRng::from_entropy());
    }
    IDS.with(|r| f(&mut r.borrow_mut()))
}

fn nonzero_u64() -> u64 {
    loop {
        let v: u64 = with_id_rng(|r| r.gen());
        if v != 0 {
            return v;
        }
    }
}

pub fn new_span_id() -> u64 {
    nonzero_u64()
}

/// Parse `00-<32 hex>-<16 hex>-<2 hex>`; `None` when malformed or all-zero ids.
pub fn parse_traceparent(v: &str) -> Option<(u128, u64, bool)> {
    let mut it = v.trim().split('-');
    let version = it.next()?;
    let trace = it.next()?;
    let span = it.next()?;
    let flags = it.next()?;
    if version.len() != 2 || version == "ff" || trace.len() != 32 || span.len() != 16 {
        return None;
    }
    if flags.len() != 2 || (version == "00" && it.next().is_some()) {
        return None;
    }
    let hex = |s: &str| {
        s.bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
    };
    if !hex(version) || !hex(trace) || !hex(span) || !hex(flags) {
        return None;
    }
    let trace_id = u128::from_str_radix(trace, 16).ok()?;
    let span_id = u64::from_str_radix(span, 16).ok()?;
    let flags = u8::from_str_radix(flags, 16).ok()?;
    (trace_id != 0 && span_id != 0).then_some((trace_id, span_id, flags & 1 == 1))
}

impl TraceContext {
    /// From the request headers: continue the caller's trace, else start one.
    /// `sample_ratio` is `None` when spans are not exported.
    pub fn from_headers(headers: &http::HeaderMap, sample_ratio: Option<f64>) -> TraceContext {
        TraceContext::from_header(headers.get(TRACEPARENT), sample_ratio)
    }

    /// [`TraceContext::from_headers`], given the request's `traceparent` (if any).
    pub fn from_header(incoming: Option<&HeaderValue>, sample_ratio: Option<f64>) -> TraceContext {
        let incoming = incoming.cloned();
        let parsed = incoming
            .as_ref()
            .and_then(|v| v.to_str().ok())
            .and_then(parse_traceparent);
        let (trace_id, parent, parent_sampled) = match parsed {
            Some((t, s, f)) => (t, Some(s), Some(f)),
            None => (with_id_rng(|r| r.gen::<u128>()).max(1), None, None),
        };
        let sampled = match sample_ratio {
            None => false,
            Some(r) => parent_sampled.unwrap_or_else(|| with_id_rng(|g| g.gen::<f64>()) < r),
        };
        TraceContext {
            trace_id,
            parent_span_id: parent,
            span_id: new_span_id(),
            sampled,
            incoming: parsed.and(incoming),
        }
    }

    pub fn trace_id_hex(&self) -> String {
        format!("{:032x}", self.trace_id)
    }

    /// The `traceparent` for an upstream attempt whose span is `attempt_span`.
    /// Without exported spans, the caller's header goes on unchanged.
    pub fn upstream_header(&self, attempt_span: u64) -> HeaderValue {
        if !self.sampled {
            if let Some(v) = &self.incoming {
                return v.clone();
            }
        }
        // `00-{trace:032x}-{span:016x}-{flags:02x}`, by hand: once per attempt.
        let mut buf = *b"00-00000000000000000000000000000000-0000000000000000-00";
        hex_into(&mut buf[3..35], self.trace_id);
        hex_into(&mut buf[36..52], u128::from(attempt_span));
        hex_into(&mut buf[53..55], u128::from(u8::from(self.sampled)));
        HeaderValue::from_bytes(&buf).expect("hex is a valid header value")
    }
}

/// Lower-case hex of the low `out.len()` nibbles of `v`, most significant first
/// (ids written on the request path, where `format!` costs more than the id).
pub(crate) fn hex_into(out: &mut [u8], mut v: u128) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    for b in out.iter_mut().rev() {
        *b = HEX[(v & 0xf) as usize];
        v >>= 4;
    }
}

/// OTLP span kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpanKind {
    Internal = 1,
    Server = 2,
    Client = 3,
}

/// A finished span.
#[derive(Debug)]
pub struct Span {
    pub trace_id: u128,
    pub span_id: u64,
    pub parent: Option<u64>,
    pub name: &'static str,
    pub kind: SpanKind,
    pub start_ns: u64,
    pub end_ns: u64,
    pub attrs: Vec<(&'static str, Value)>,
    pub error: bool,
}

/// Unix time (ns) at which `at` happened.
pub fn unix_ns_at(at: Instant) -> u64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos() as u64;
    now.saturating_sub(at.elapsed().as_nanos() as u64)
}

/// The exporter's sending side.
pub struct Tracer {
    tx: mpsc::Sender<Span>,
}

impl Tracer {
    /// Start the exporter task. Must run inside a tokio runtime.
    pub fn start(cfg: &TracingConfig) -> Tracer {
        let (tx, rx) = mpsc::channel(cfg.buffer);
        tokio::spawn(export_loop(cfg.clone(), rx));
        Tracer { tx }
    }

    pub fn sample_ratio(cfg: Option<&TracingConfig>) -> Option<f64> {
        cfg.map(|c| c.sample_ratio)
    }

    /// Queue a span for export; dropped (and counted) when the buffer is full.
    pub fn record(&self, span: Span) {
        if self.tx.try_send(span).is_err() {
            counter!(names::TRACE_SPANS_DROPPED_TOTAL).increment(1);
        }
    }

    /// The request's own span, from arrival to the end of the response.
    pub fn end_request_span(&self, r: &RequestRecord<'_>) {
        let t = r.trace;
        if !t.sampled {
            return;
        }
        let outcome = match r.end {
            End::Proxied { outcome, .. } => outcome.as_str(),
            End::Refused { reason, .. } => reason,
        };
        let end = unix_ns_at(crate::runtime::clock::now());
        let mut attrs = vec![
            ("http.response.status_code", json!(r.status)),
            ("switchyard.outcome", json!(outcome)),
            ("switchyard.tenant", json!(&**r.tenant)),
            ("switchyard.attempts", json!(r.attempts)),
        ];
        let route = r.route();
        if let Some(p) = route.map(|x| &x.pool).or(r.pool) {
            attrs.push(("switchyard.pool", json!(&**p)));
        }
        if let Some(x) = route {
            attrs.push(("switchyard.worker", json!(&*x.worker)));
        }
        self.record(Span {
            trace_id: t.trace_id,
            span_id: t.span_id,
            parent: t.parent_span_id,
            name: "switchyard.request",
            kind: SpanKind::Server,
            start_ns: end.saturating_sub(r.elapsed().as_nanos() as u64),
            end_ns: end,
            attrs,
            error: r.status >= 500,
        });
    }

    /// Record a child span of a sampled request.
    pub fn child_span(&self, trace: &TraceContext, child: ChildSpan) {
        if !trace.sampled {
            return;
        }
        let end_ns = unix_ns_at(child.end);
        let took = child.end.saturating_duration_since(child.start).as_nanos() as u64;
        self.record(Span {
            trace_id: trace.trace_id,
            span_id: child.span_id,
            parent: Some(trace.span_id),
            name: child.name,
            kind: child.kind,
            start_ns: end_ns.saturating_sub(took),
            end_ns,
            attrs: child.attrs,
            error: child.error,
        });
    }
}

/// A child span of the request: an upstream attempt, the admission wait.
pub struct ChildSpan {
    pub name: &'static str,
    pub kind: SpanKind,
    pub span_id: u64,
    pub start: Instant,
    pub end: Instant,
    pub attrs: Vec<(&'static str, Value)>,
    pub error: bool,
}

/// The OTLP/HTTP JSON body for a batch of spans.
pub fn otlp_json(service: &str, spans: &[Span]) -> Value {
    let spans: Vec<Value> = spans
        .iter()
        .map(|s| {
            let mut v = json!({
                "traceId": format!("{:032x}", s.trace_id),
                "spanId": format!("{:016x}", s.span_id),
                "name": s.name,
                "kind": s.kind as u8,
                "startTimeUnixNano": s.start_ns.to_string(),
                "endTimeUnixNano": s.end_ns.to_string(),
                "attributes": s.attrs.iter().map(|(k, v)| json!({"key": k, "value": any_value(v)})).collect::<Vec<_>>(),
                "status": {"code": if s.error { 2 } else { 0 }},
            });
            if let Some(p) = s.parent {
                v["parentSpanId"] = json!(format!("{p:016x}"));
            }
            v
        })
        .collect();
    json!({
        "resourceSpans": [{
            "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": service}}]},
            "scopeSpans": [{"scope": {"name": "switchyard", "version": env!("CARGO_PKG_VERSION")}, "spans": spans}]
        }]
    })
}

fn any_value(v: &Value) -> Value {
    match v {
        Value::Bool(b) => json!({ "boolValue": b }),
        Value::Number(n) if n.is_i64() || n.is_u64() => json!({ "intValue": n.to_string() }),
        Value::Number(n) => json!({ "doubleValue": n }),
        Value::String(s) => json!({ "stringValue": s }),
        other => json!({ "stringValue": other.to_string() }),
    }
}

async fn export_loop(cfg: TracingConfig, mut rx: mpsc::Receiver<Span>) {
    let mut http = HttpConnector::new();
    http.set_connect_timeout(Some(Duration::from_secs(2)));
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build(http);
    let mut batch = Vec::with_capacity(MAX_BATCH);
    while rx.recv_many(&mut batch, MAX_BATCH).await > 0 {
        let body = otlp_json(&cfg.service_name, &batch).to_string();
        batch.clear();
        let req = http::Request::post(&cfg.traces_url)
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body)));
        let ok = match req {
            Ok(req) => matches!(
                tokio::time::timeout(Duration::from_secs(10), client.request(req)).await,
                Ok(Ok(r)) if r.status().is_success()
            ),
            Err(_) => false,
        };
        counter!(names::TRACE_EXPORTS_TOTAL, names::L_RESULT => if ok { "ok" } else { "error" })
            .increment(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparent_parsing() {
        let (t, s, f) =
            parse_traceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").unwrap();
        assert_eq!(t, 0x4bf92f3577b34da6a3ce929d0e0e4736);
        assert_eq!(s, 0x00f067aa0ba902b7);
        assert!(f);
        for bad in [
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "garbage",
        ] {
            assert!(parse_traceparent(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn upstream_header_continues_or_forwards() {
        let mut h = http::HeaderMap::new();
        let incoming = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        h.insert(TRACEPARENT, incoming.parse().unwrap());
        // Not exporting: the caller's header goes on unchanged.
        let off = TraceContext::from_headers(&h, None);
        assert_eq!(off.upstream_header(7), incoming);
        // Exporting: same trace, the attempt's span as parent, sampled.
        let on = TraceContext::from_headers(&h, Some(0.0));
        assert!(on.sampled, "a sampled parent is followed");
        assert_eq!(
            on.upstream_header(0xabc),
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000abc-01"
        );
        // No header, not exporting: a fresh trace, not sampled.
        let fresh = TraceContext::from_headers(&http::HeaderMap::new(), None);
        let v = fresh.upstream_header(1);
        let (t, s, f) = parse_traceparent(v.to_str().unwrap()).unwrap();
        assert_eq!((t, s, f), (fresh.trace_id, 1, false));
    }
}
