//! The request headers the gateway reads itself. Most requests carry none of
//! them, so [`Own::scan`] notes in one pass over the map which are present: a
//! lookup of an absent one is then a bit test instead of hashing its name into
//! the map (a dozen such lookups were a tenth of the gateway's own work).

use http::{HeaderMap, HeaderName, HeaderValue};

/// Header carrying the session id used by session-affine routing.
pub const SESSION_HEADER: HeaderName = HeaderName::from_static("x-session-id");
/// Header naming the tenant, honoured only with `tenancy.trust_tenant_header`.
pub const TENANT_HEADER: HeaderName = HeaderName::from_static("x-switchyard-tenant");
/// Header selecting the queueing priority class (`critical` … `sheddable`).
pub const PRIORITY_HEADER: HeaderName = HeaderName::from_static("x-switchyard-priority");
/// Header naming a policy to use instead of the pool's (honoured only when the
/// pool sets `allow_policy_override`).
pub const POLICY_HEADER: HeaderName = HeaderName::from_static("x-switchyard-policy");
/// Header restricting the regions a request may be served in: a residency zone
/// (`[residency]`), a declared region, or a comma-separated list of regions.
pub const RESIDENCY_HEADER: HeaderName = HeaderName::from_static("x-switchyard-residency");
/// Anthropic's API key header, read like `Authorization: Bearer`.
pub const API_KEY_HEADER: HeaderName = HeaderName::from_static("x-api-key");
/// The request's time-to-first-token objective, in milliseconds.
pub const TTFT_HEADER: HeaderName = HeaderName::from_static("x-slo-ttft-ms");
/// The request's time-per-output-token objective, in milliseconds.
pub const TPOT_HEADER: HeaderName = HeaderName::from_static("x-slo-tpot-ms");

/// One of the gateway's own request headers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Name {
    Session,
    Tenant,
    Priority,
    Policy,
    Residency,
    ApiKey,
    SloTtft,
    SloTpot,
    /// `Authorization`: not the gateway's own, but read on every request (the
    /// tenant's key), and most requests to a gateway without keys carry none.
    Authorization,
    /// W3C `traceparent`: read on every request, carried by few.
    TraceParent,
    /// `x-request-id`, kept when the client sends a sane one.
    RequestId,
}

/// In [`Name`]'s order.
static NAMES: [HeaderName; 11] = [
    SESSION_HEADER,
    TENANT_HEADER,
    PRIORITY_HEADER,
    POLICY_HEADER,
    RESIDENCY_HEADER,
    API_KEY_HEADER,
    TTFT_HEADER,
    TPOT_HEADER,
    http::header::AUTHORIZATION,
    HeaderName::from_static("traceparent"),
    HeaderName::from_static("x-request-id"),
];

impl Name {
    pub fn header(self) -> &'static HeaderName {
        &NAMES[self as usize]
    }

    fn of(name: &str) -> Option<Name> {
        Some(match name {
            "x-session-id" => Name::Session,
            "x-switchyard-tenant" => Name::Tenant,
            "x-switchyard-priority" => Name::Priority,
            "x-switchyard-policy" => Name::Policy,
            "x-switchyard-residency" => Name::Residency,
            "x-api-key" => Name::ApiKey,
            "x-slo-ttft-ms" => Name::SloTtft,
            "x-slo-tpot-ms" => Name::SloTpot,
            "authorization" => Name::Authorization,
            "traceparent" => Name::TraceParent,
            "x-request-id" => Name::RequestId,
            _ => return None,
        })
    }

    /// Steers routing or names the caller: a value that is not UTF-8 is
    /// refused rather than silently ignored.
    fn steers(self) -> bool {
        matches!(
            self,
            Name::Session | Name::Tenant | Name::Priority | Name::Policy | Name::Residency
        )
    }
}

/// Which of the gateway's own headers a request carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Own(u16);

impl Own {
    /// Every header counted as present: lookups go to the map (for a caller
    /// that has not scanned).
    pub const ANY: Own = Own(u16::MAX);

    /// One pass over `headers`. `Err(name)`: a steering header's value is not
    /// UTF-8.
    pub fn scan(headers: &HeaderMap) -> Result<Own, &'static str> {
        let mut bits = 0u16;
        for (name, value) in headers {
            if name == http::header::AUTHORIZATION {
                bits |= 1 << Name::Authorization as u16;
                continue;
            }
            let s = name.as_str();
            if s == "traceparent" {
                bits |= 1 << Name::TraceParent as u16;
                continue;
            }
            if !s.starts_with("x-") {
                continue;
            }
            let Some(n) = Name::of(s) else { continue };
            if n.steers() && std::str::from_utf8(value.as_bytes()).is_err() {
                return Err(n.header().as_str());
            }
            bits |= 1 << n as u16;
        }
        Ok(Own(bits))
    }

    pub fn has(self, n: Name) -> bool {
        self.0 & (1 << n as u16) != 0
    }

    /// The first value of header `n`, if the request has it.
    pub fn get(self, headers: &HeaderMap, n: Name) -> Option<&HeaderValue> {
        if self.has(n) {
            headers.get(n.header())
        } else {
            None
        }
    }

    /// [`Own::get`] as a string; a value that is not UTF-8 reads as absent.
    pub fn get_str(self, headers: &HeaderMap, n: Name) -> Option<&str> {
        self.get(headers, n).and_then(|v| v.to_str().ok())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scan_notes_present_headers_and_refuses_non_utf8_steering() {
        let mut h = HeaderMap::new();
        h.insert("content-type", HeaderValue::from_static("application/json"));
        h.insert("x-stainless-os", HeaderValue::from_static("Linux"));
        h.insert(SESSION_HEADER, HeaderValue::from_static("s-1"));
        h.insert(TTFT_HEADER, HeaderValue::from_static("200"));
        let own = Own::scan(&h).unwrap();
        assert_eq!(own.get_str(&h, Name::Session), Some("s-1"));
        assert_eq!(own.get_str(&h, Name::SloTtft), Some("200"));
        for n in [
            Name::Tenant,
            Name::Priority,
            Name::Policy,
            Name::ApiKey,
            Name::Authorization,
        ] {
            assert!(!own.has(n), "{n:?}");
        }
        assert!(!own.has(Name::TraceParent));
        h.insert(
            http::header::AUTHORIZATION,
            HeaderValue::from_static("Bearer k"),
        );
        h.insert("traceparent", HeaderValue::from_static("00-1-2-01"));
        let own = Own::scan(&h).unwrap();
        assert_eq!(own.get_str(&h, Name::Authorization), Some("Bearer k"));
        assert_eq!(own.get_str(&h, Name::TraceParent), Some("00-1-2-01"));
        assert_eq!(own.get_str(&h, Name::Session), Some("s-1"));
        // ANY looks everything up in the map.
        assert_eq!(Own::ANY.get_str(&h, Name::Session), Some("s-1"));
        assert_eq!(Own::ANY.get(&h, Name::Policy), None);
        for n in NAMES.iter() {
            assert_eq!(Name::of(n.as_str()).map(|n| n.header()), Some(n));
        }

        let bad = HeaderValue::from_bytes(b"caf\xe9").unwrap();
        h.insert(PRIORITY_HEADER, bad.clone());
        assert_eq!(Own::scan(&h), Err("x-switchyard-priority"));
        h.remove(PRIORITY_HEADER);
        // An API key is not steering: its value is checked where it is read.
        h.insert(API_KEY_HEADER, bad);
        assert!(Own::scan(&h).unwrap().has(Name::ApiKey));
    }
}
