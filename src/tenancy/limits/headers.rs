//! OpenAI's rate-limit headers: `x-ratelimit-{limit,remaining,reset}-{requests,tokens}`,
//! resets written as OpenAI writes them (`1s`, `6m0s`, `20ms`).

use super::gcra::Window;
use http::{HeaderMap, HeaderName, HeaderValue};

pub const LIMIT_REQUESTS: HeaderName = HeaderName::from_static("x-ratelimit-limit-requests");
pub const REMAINING_REQUESTS: HeaderName =
    HeaderName::from_static("x-ratelimit-remaining-requests");
pub const RESET_REQUESTS: HeaderName = HeaderName::from_static("x-ratelimit-reset-requests");
pub const LIMIT_TOKENS: HeaderName = HeaderName::from_static("x-ratelimit-limit-tokens");
pub const REMAINING_TOKENS: HeaderName = HeaderName::from_static("x-ratelimit-remaining-tokens");
pub const RESET_TOKENS: HeaderName = HeaderName::from_static("x-ratelimit-reset-tokens");

/// The tightest request and token windows of a request's scopes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RateHeaders {
    pub requests: Option<Window>,
    pub tokens: Option<Window>,
}

/// Keep the window with the fewest remaining units.
pub fn tighter(a: Option<Window>, b: Window) -> Option<Window> {
    Some(match a {
        Some(a) if a.remaining <= b.remaining => a,
        _ => b,
    })
}

impl RateHeaders {
    /// Nothing to write: no request or token limit applied.
    pub fn is_empty(&self) -> bool {
        self.requests.is_none() && self.tokens.is_none()
    }

    /// Write the headers of the limits that applied.
    pub fn write(&self, h: &mut HeaderMap) {
        let sets = [
            (
                self.requests,
                [LIMIT_REQUESTS, REMAINING_REQUESTS, RESET_REQUESTS],
            ),
            (self.tokens, [LIMIT_TOKENS, REMAINING_TOKENS, RESET_TOKENS]),
        ];
        for (w, [limit, remaining, reset]) in sets {
            let Some(w) = w else { continue };
            h.insert(limit, HeaderValue::from(w.limit));
            h.insert(remaining, HeaderValue::from(w.remaining));
            if let Ok(v) = HeaderValue::from_str(&duration(w.reset_ns)) {
                h.insert(reset, v);
            }
        }
    }
}

/// `20ms` below a second, else whole seconds rounded up as `1s`, `6m0s`, `1h2m3s`.
pub fn duration(ns: u64) -> String {
    if ns < 1_000_000_000 {
        return format!("{}ms", ns.div_ceil(1_000_000));
    }
    let s = ns.div_ceil(1_000_000_000);
    match (s / 3600, s % 3600 / 60, s % 60) {
        (0, 0, s) => format!("{s}s"),
        (0, m, s) => format!("{m}m{s}s"),
        (h, m, s) => format!("{h}h{m}m{s}s"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_are_written_as_openai_writes_them() {
        assert_eq!(duration(0), "0ms");
        assert_eq!(duration(19_500_000), "20ms");
        assert_eq!(duration(1_000_000_000), "1s");
        assert_eq!(duration(1_200_000_000), "2s");
        assert_eq!(duration(360_000_000_000), "6m0s");
        assert_eq!(duration(3_723_000_000_000), "1h2m3s");
    }

    #[test]
    fn every_header_of_an_applied_limit_is_written() {
        let mut h = HeaderMap::new();
        RateHeaders {
            requests: Some(Window {
                limit: 60,
                remaining: 59,
                reset_ns: 1_000_000_000,
            }),
            tokens: None,
        }
        .write(&mut h);
        assert_eq!(h[LIMIT_REQUESTS], "60");
        assert_eq!(h[REMAINING_REQUESTS], "59");
        assert_eq!(h[RESET_REQUESTS], "1s");
        assert!(h.get(LIMIT_TOKENS).is_none());
    }
}
