//! Fault injection: the `Faults` settings (flags, `POST /sim/faults`,
//! [`SimHandle::set_faults`](super::SimHandle::set_faults)) and the
//! per-request `x-sim-fault` header.
//!
//! Fault delays (`slow:MS`, latency spikes) are wall-clock milliseconds and are
//! *not* divided by `time_scale`, so a resilience test can aim at a timeout.

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Name of the request header that forces a fault on one request.
pub const FAULT_HEADER: &str = "x-sim-fault";

/// Faults applied to generation requests (`/v1/chat/completions`,
/// `/v1/completions`, `/v1/embeddings`). Also the JSON body of
/// `POST /sim/faults`; missing fields take their defaults (no fault).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Faults {
    /// Fraction (0–1) of requests answered with `error_status`.
    pub error_rate: f64,
    /// Status for `error_rate` errors; 0 means 500.
    pub error_status: u16,
    /// `/health` answers 503.
    pub health_fail: bool,
    /// Close the listening socket: new connections are refused until cleared.
    pub refuse_connections: bool,
    /// Fraction (0–1) of requests delayed by `spike_ms` before their first token.
    pub spike_rate: f64,
    /// Wall-clock milliseconds of a latency spike.
    pub spike_ms: u64,
    /// An `x-sim-fault` value applied to every request that has no header.
    pub always: Option<String>,
}

/// One parsed `x-sim-fault` value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Answer with this status and an OpenAI error body.
    Status(u16),
    /// Accept and never answer.
    Hang,
    /// Drop the connection without a response.
    Reset,
    /// Wait this many wall-clock milliseconds before the first token.
    Slow(u64),
    /// Send this many tokens, then abort the connection mid-body.
    DieAfter(u32),
}

impl Fault {
    /// Parse a header value; `None` for anything unrecognised.
    pub fn parse(s: &str) -> Option<Fault> {
        let s = s.trim();
        match s {
            "hang" => return Some(Fault::Hang),
            "reset" => return Some(Fault::Reset),
            _ => {}
        }
        if let Some(ms) = s.strip_prefix("slow:") {
            return ms.trim().parse().ok().map(Fault::Slow);
        }
        if let Some(n) = s.strip_prefix("die-after:") {
            return n.trim().parse().ok().map(Fault::DieAfter);
        }
        match s.parse::<u16>() {
            Ok(code) if (100..=599).contains(&code) => Some(Fault::Status(code)),
            _ => None,
        }
    }
}

impl Faults {
    /// Check ranges; the message names the field.
    pub fn validate(&self) -> Result<(), String> {
        if !(0.0..=1.0).contains(&self.error_rate) {
            return Err("error_rate must be within 0..=1".into());
        }
        if !(0.0..=1.0).contains(&self.spike_rate) {
            return Err("spike_rate must be within 0..=1".into());
        }
        if self.error_status != 0 && !(100..=599).contains(&self.error_status) {
            return Err("error_status must be an HTTP status (100..=599)".into());
        }
        if let Some(a) = &self.always {
            if Fault::parse(a).is_none() {
                return Err(format!("always: unknown fault {a:?}"));
            }
        }
        Ok(())
    }

    /// Decide the fault for request number `n` (arrival order), given its
    /// header (already parsed). Deterministic in (`seed`, `n`).
    pub fn decide(&self, seed: u64, n: u64, header: Option<Fault>) -> Option<Fault> {
        if header.is_some() {
            return header;
        }
        if let Some(f) = self.always.as_deref().and_then(Fault::parse) {
            return Some(f);
        }
        if self.error_rate > 0.0 && unit(seed, n, 1) < self.error_rate {
            let code = if self.error_status == 0 {
                500
            } else {
                self.error_status
            };
            return Some(Fault::Status(code));
        }
        if self.spike_rate > 0.0 && unit(seed, n, 2) < self.spike_rate {
            return Some(Fault::Slow(self.spike_ms));
        }
        None
    }
}

/// Uniform number in [0, 1) from (seed, n, stream).
fn unit(seed: u64, n: u64, stream: u64) -> f64 {
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(&n.to_le_bytes());
    b[8..].copy_from_slice(&stream.to_le_bytes());
    (xxh3_64_with_seed(&b, seed) >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_header_values() {
        assert_eq!(Fault::parse("500"), Some(Fault::Status(500)));
        assert_eq!(Fault::parse("429"), Some(Fault::Status(429)));
        assert_eq!(Fault::parse("hang"), Some(Fault::Hang));
        assert_eq!(Fault::parse("reset"), Some(Fault::Reset));
        assert_eq!(Fault::parse("slow:250"), Some(Fault::Slow(250)));
        assert_eq!(Fault::parse("die-after:3"), Some(Fault::DieAfter(3)));
        assert_eq!(Fault::parse("slow:x"), None);
        assert_eq!(Fault::parse("42"), None);
        assert_eq!(Fault::parse("nonsense"), None);
    }

    #[test]
    fn error_rate_is_deterministic_and_close_to_rate() {
        let f = Faults {
            error_rate: 0.3,
            error_status: 503,
            ..Faults::default()
        };
        let run = |seed| {
            (0..2000)
                .map(|n| f.decide(seed, n, None))
                .collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
        let errors = run(7).iter().filter(|d| d.is_some()).count();
        assert!((500..700).contains(&errors), "{errors}");
        assert!(run(7).iter().flatten().all(|d| *d == Fault::Status(503)));
    }

    #[test]
    fn header_wins_and_validation() {
        let f = Faults {
            always: Some("hang".into()),
            ..Faults::default()
        };
        assert_eq!(f.decide(0, 0, Some(Fault::Reset)), Some(Fault::Reset));
        assert_eq!(f.decide(0, 0, None), Some(Fault::Hang));
        assert!(f.validate().is_ok());
        assert!(Faults {
            error_rate: 2.0,
            ..Faults::default()
        }
        .validate()
        .is_err());
        assert!(Faults {
            always: Some("x".into()),
            ..Faults::default()
        }
        .validate()
        .is_err());
    }
}
