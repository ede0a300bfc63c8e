//! A request's latency objectives: `x-slo-ttft-ms` (time to first token) and
//! `x-slo-tpot-ms` (time per output token), in milliseconds, each falling back
//! to the tenant's default.

use super::headers::{Name, Own};
use http::HeaderMap;

pub use super::headers::{TPOT_HEADER, TTFT_HEADER};
/// The largest objective accepted (one hour; the config's tenant defaults
/// share the bound, `config::observability::MAX_SLO_MS`).
pub const MAX_SLO_MS: u32 = 3_600_000;

/// Latency targets of one request (ms); `None`: no target.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Slo {
    pub ttft_ms: Option<u32>,
    pub tpot_ms: Option<u32>,
}

impl Slo {
    /// The request has a target.
    pub fn is_set(&self) -> bool {
        self.ttft_ms.is_some() || self.tpot_ms.is_some()
    }

    /// The request's targets from its headers, each defaulting to `defaults`'.
    /// A header that is not a whole number of milliseconds in 1..=[`MAX_SLO_MS`]
    /// (or appears twice) is an error naming it.
    pub fn from_headers(headers: &HeaderMap, own: Own, defaults: Slo) -> Result<Slo, String> {
        Ok(Slo {
            ttft_ms: one(headers, own, Name::SloTtft)?.or(defaults.ttft_ms),
            tpot_ms: one(headers, own, Name::SloTpot)?.or(defaults.tpot_ms),
        })
    }
}

fn one(headers: &HeaderMap, own: Own, name: Name) -> Result<Option<u32>, String> {
    if !own.has(name) {
        return Ok(None);
    }
    let name = name.header();
    let mut values = headers.get_all(name).iter();
    let Some(v) = values.next() else {
        return Ok(None);
    };
    let bad = || {
        format!(
            "Header `{name}` must be a whole number of milliseconds between 1 and {MAX_SLO_MS}, given once"
        )
    };
    if values.next().is_some() {
        return Err(bad());
    }
    let text = v.to_str().map_err(|_| bad())?.trim();
    match text.parse::<u32>() {
        Ok(ms) if (1..=MAX_SLO_MS).contains(&ms) && text.bytes().all(|b| b.is_ascii_digit()) => {
            Ok(Some(ms))
        }
        _ => Err(bad()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderName;

    fn headers(pairs: &[(&HeaderName, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, v.parse().unwrap());
        }
        h
    }

    #[test]
    fn headers_override_the_tenants_defaults() {
        let d = Slo {
            ttft_ms: Some(500),
            tpot_ms: Some(50),
        };
        let s = Slo::from_headers(&headers(&[(&TTFT_HEADER, " 200 ")]), Own::ANY, d).unwrap();
        assert_eq!(s.ttft_ms, Some(200));
        assert_eq!(s.tpot_ms, Some(50));
        assert_eq!(
            Slo::from_headers(&HeaderMap::new(), Own::ANY, Slo::default()).unwrap(),
            Slo::default()
        );
        assert!(!Slo::default().is_set());
    }

    #[test]
    fn bad_values_are_refused_with_the_headers_name() {
        for v in ["0", "-5", "1.5", "abc", "", "+7", "3600001", "99999999999"] {
            let e = Slo::from_headers(&headers(&[(&TPOT_HEADER, v)]), Own::ANY, Slo::default())
                .unwrap_err();
            assert!(e.contains("x-slo-tpot-ms"), "{v}: {e}");
        }
        let twice = headers(&[(&TTFT_HEADER, "5"), (&TTFT_HEADER, "6")]);
        assert!(Slo::from_headers(&twice, Own::ANY, Slo::default()).is_err());
    }
}
