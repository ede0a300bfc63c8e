//! The structured access log: one JSON line per request, written by a background
//! task. The request path hands a record over with `try_send` on a bounded channel
//! and never waits; when the buffer is full the record is dropped and counted.
//! Records carry no secrets and no prompt or completion text.

use super::names;
use crate::config::observability::{AccessLogConfig, AccessLogTarget};
use metrics::counter;
use serde::Serialize;
use std::sync::Arc;
use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc;

/// One access-log line.
#[derive(Debug, Serialize)]
pub struct AccessRecord {
    /// RFC 3339 UTC time the request finished.
    pub ts: String,
    pub request_id: String,
    /// The client's address (socket peer, or the first untrusted
    /// `x-forwarded-for` hop behind `server.trusted_proxies`).
    pub client: Option<std::net::IpAddr>,
    pub tenant: Arc<str>,
    /// The queue class given (after the tenant's cap on the header).
    pub priority: &'static str,
    pub model: Option<Arc<str>>,
    pub endpoint: &'static str,
    pub pool: Option<Arc<str>>,
    pub worker: Option<Arc<str>>,
    pub region: Option<Arc<str>>,
    pub policy: Option<&'static str>,
    pub reason: Option<&'static str>,
    pub attempts: u32,
    pub status: u16,
    /// `completed`, `cancelled`, `error`, or `gateway_error` for the gateway's own answers.
    pub outcome: &'static str,
    /// `ok`, `client`, `gateway` or `upstream`.
    pub class: &'static str,
    /// The gateway's error reason, when it answered itself.
    pub error: Option<&'static str>,
    pub stream: bool,
    pub ttft_ms: Option<f64>,
    pub mean_itl_ms: Option<f64>,
    pub e2e_ms: f64,
    pub prompt_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
    pub output_tokens: u64,
    /// `reported` (the answer's usage) or `estimated` (it had none); absent
    /// when nothing was answered.
    pub usage: Option<&'static str>,
    pub predicted_cached_tokens: Option<u64>,
    /// What the worker's latency model predicted at dispatch (ms).
    pub predicted_ttft_ms: Option<f64>,
    pub predicted_tpot_ms: Option<f64>,
    /// Time held in the pool's flow-control queue (ms).
    pub queued_ms: Option<f64>,
    /// When the answering attempt was sent, ms after arrival.
    pub dispatched_ms: Option<f64>,
    /// The request's latency SLO was predicted unattainable; it was served anyway.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub slo_downgraded: bool,
    pub cost_usd: f64,
    pub request_bytes: u64,
    pub response_bytes: u64,
    pub trace_id: Option<String>,
}

/// The sending side; cheap to share.
pub struct AccessLog {
    tx: mpsc::Sender<AccessRecord>,
}

impl AccessLog {
    /// Start the writer task for `cfg`. Must run inside a tokio runtime.
    pub fn start(cfg: &AccessLogConfig) -> AccessLog {
        let (tx, rx) = mpsc::channel(cfg.buffer);
        let target = cfg.target.clone();
        tokio::spawn(async move {
            if let Err(e) = write_loop(target, rx).await {
                tracing::error!(error = %e, "access log writer stopped");
            }
        });
        AccessLog { tx }
    }

    /// Hand a record to the writer; drops (and counts) it when the buffer is full.
    pub fn log(&self, rec: AccessRecord) {
        if self.tx.try_send(rec).is_err() {
            counter!(names::ACCESS_LOG_DROPPED_TOTAL).increment(1);
        }
    }
}

async fn write_loop(
    target: AccessLogTarget,
    mut rx: mpsc::Receiver<AccessRecord>,
) -> std::io::Result<()> {
    let out: Box<dyn tokio::io::AsyncWrite + Send + Unpin> = match &target {
        AccessLogTarget::Stdout => Box::new(tokio::io::stdout()),
        AccessLogTarget::File(p) => Box::new(
            tokio::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .await?,
        ),
    };
    let mut out = tokio::io::BufWriter::new(out);
    let mut line = Vec::with_capacity(512);
    let written = counter!(names::ACCESS_LOG_RECORDS_TOTAL);
    while let Some(rec) = rx.recv().await {
        let mut batch = 0u64;
        let mut next = Some(rec);
        // Write whatever is queued, then flush once.
        while let Some(r) = next {
            line.clear();
            if serde_json::to_writer(&mut line, &r).is_ok() {
                line.push(b'\n');
                out.write_all(&line).await?;
                batch += 1;
            }
            next = rx.try_recv().ok();
        }
        out.flush().await?;
        written.increment(batch);
    }
    Ok(())
}

/// Current UTC time as RFC 3339 with milliseconds, without a date-time dependency.
pub fn rfc3339_now() -> String {
    let d = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    rfc3339(d.as_secs(), d.subsec_millis())
}

fn rfc3339(secs: u64, millis: u32) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Civil-from-days (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{millis:03}Z",
        rem / 3_600,
        rem % 3_600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_are_rfc3339() {
        assert_eq!(rfc3339(0, 0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(1_709_251_199, 5), "2024-02-29T23:59:59.005Z");
        assert_eq!(rfc3339(951_782_400, 999), "2000-02-29T00:00:00.999Z");
    }
}
