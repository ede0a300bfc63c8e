//! Header rules at the proxy boundary: hop-by-hop headers never cross, client
//! credentials and the gateway's own control headers cross only when the pool
//! allows it.

use crate::api::headers::{PRIORITY_HEADER, TPOT_HEADER, TTFT_HEADER};
use crate::api::Slo;
use crate::config::flow::Priority;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};

/// Hop-by-hop headers (RFC 9110 §7.6.1: `Connection`, `TE`, `Trailer`,
/// `Transfer-Encoding`, `Upgrade`, `Keep-Alive`, `Proxy-Connection`) plus proxy
/// credentials. One match on the name's text: every header of every request
/// and response is asked, and a list of names compared one by one cost more.
fn is_hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "proxy-authenticate"
            | "proxy-authorization"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
            | "keep-alive"
            | "proxy-connection"
    )
}

/// Client credentials a gateway key or a tenant key travels in; forwarded only
/// with the pool's `pass_client_auth` (or named in its `forward_headers`).
const CREDENTIALS: &[&str] = &["authorization", "x-api-key", "api-key", "x-goog-api-key"];

/// Headers that stay at the gateway unless the pool's `forward_headers` names
/// them: cookies, and the gateway's own `x-switchyard-*` control headers.
fn gateway_only(name: &str) -> bool {
    name == "cookie" || name.starts_with("x-switchyard-")
}

/// Does a client request header stay at the gateway on its way to this pool?
/// `allow` is the pool's `forward_headers` (lower-case names).
pub fn stays_at_gateway(name: &HeaderName, pass_client_auth: bool, allow: &[String]) -> bool {
    let n = name.as_str();
    let denied = if CREDENTIALS.contains(&n) {
        !pass_client_auth
    } else {
        gateway_only(n)
    };
    denied && !allow.iter().any(|a| a == n)
}

/// Remove hop-by-hop headers, including any the `Connection` header names.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // One pass over the few names first: most messages carry none of them, and
    // looking each listed name up by hash costs more than this scan.
    let mut hop = headers.keys().filter(|k| is_hop_by_hop(k));
    match (hop.next(), hop.next()) {
        (None, _) => return,
        // The usual upstream answer says only `Connection: keep-alive`: one
        // removal, without parsing the value's list or scanning again.
        (Some(k), None) if k == header::CONNECTION && names_no_header(headers) => {
            headers.remove(header::CONNECTION);
            return;
        }
        _ => {}
    }
    // Without collecting into vectors or building names: this runs on every
    // upstream response that says `Connection: keep-alive`.
    match headers.get_all(header::CONNECTION).iter().count() {
        0 => {}
        1 => {
            if let Some(v) = headers.remove(header::CONNECTION) {
                remove_listed(headers, &v);
            }
        }
        _ => {
            let values: Vec<HeaderValue> = headers
                .get_all(header::CONNECTION)
                .iter()
                .cloned()
                .collect();
            headers.remove(header::CONNECTION);
            for v in &values {
                remove_listed(headers, v);
            }
        }
    }
    while let Some(k) = headers.keys().find(|k| is_hop_by_hop(k)).cloned() {
        headers.remove(k);
    }
}

/// Every `Connection` value is one of the usual options (`keep-alive`,
/// `close`), which name no other header to remove.
fn names_no_header(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .all(|v| usual_option(v.as_bytes().trim_ascii()))
}

/// `close` names no header and `Keep-Alive` is hop-by-hop anyway.
fn usual_option(name: &[u8]) -> bool {
    name.eq_ignore_ascii_case(b"keep-alive") || name.eq_ignore_ascii_case(b"close")
}

/// A copy of `src` without its hop-by-hop headers and without those `drop` names,
/// with room for `extra` more. Building the copy costs the same as a clone but
/// leaves room for the headers the caller adds, so inserting them does not grow it.
pub fn forwardable(src: &HeaderMap, extra: usize, drop: impl Fn(&HeaderName) -> bool) -> HeaderMap {
    let mut out = HeaderMap::with_capacity(src.keys_len() + extra);
    let mut connection = false;
    for (name, value) in src {
        if is_hop_by_hop(name) {
            connection |= name == header::CONNECTION;
        } else if !drop(name) {
            out.append(name.clone(), value.clone());
        }
    }
    // Most requests carry no `Connection` header: no lookup for one then.
    if connection {
        for v in src.get_all(header::CONNECTION) {
            remove_listed(&mut out, v);
        }
    }
    out
}

/// The claims a forwarded request states are the ones the gateway granted
/// (`tenancy::claims`), never the client's raw asks: an engine or a gateway
/// further on that reads them must not see a class or objective the tenant
/// may not have. With the pool forwarding `x-switchyard-priority`, it carries
/// the granted class (also when the client sent none); `x-slo-*` headers a
/// client sent are replaced by the granted objectives (absent where none was granted).
pub fn state_granted_claims(
    out: &mut HeaderMap,
    asked_slo: bool,
    allow: &[String],
    priority: Priority,
    slo: Slo,
) {
    if allow.iter().any(|a| a == PRIORITY_HEADER.as_str()) {
        out.insert(PRIORITY_HEADER, HeaderValue::from_static(priority.as_str()));
    }
    if !asked_slo {
        return;
    }
    for (name, ms) in [(TTFT_HEADER, slo.ttft_ms), (TPOT_HEADER, slo.tpot_ms)] {
        match ms {
            Some(ms) => out.insert(name, HeaderValue::from(ms)),
            None => out.remove(name),
        };
    }
}

/// Remove the headers a `Connection` value lists. A `&str` name is looked up
/// case-insensitively without allocating; one that is not a valid name matches nothing.
/// The usual options, `keep-alive` and `close`, are skipped without a lookup
/// (see [`usual_option`]).
fn remove_listed(headers: &mut HeaderMap, connection: &HeaderValue) {
    let Ok(v) = connection.to_str() else { return };
    for name in v.split(',').map(str::trim) {
        if !name.is_empty() && !usual_option(name.as_bytes()) {
            headers.remove(name);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_forwardable_copy_drops_hop_by_hop_listed_and_chosen_names() {
        let mut h = HeaderMap::new();
        h.insert(header::CONNECTION, "x-hop".parse().unwrap());
        h.insert("x-hop", "1".parse().unwrap());
        h.insert(header::TRANSFER_ENCODING, "chunked".parse().unwrap());
        h.insert(header::AUTHORIZATION, "Bearer s".parse().unwrap());
        h.append("x-multi", "a".parse().unwrap());
        h.append("x-multi", "b".parse().unwrap());
        let out = forwardable(&h, 2, |n| n == header::AUTHORIZATION);
        assert_eq!(out.len(), 2, "{out:?}");
        let multi: Vec<_> = out.get_all("x-multi").iter().collect();
        assert_eq!(multi, ["a", "b"]);
    }

    #[test]
    fn credentials_and_gateway_headers_stay_unless_the_pool_opts_in() {
        let n = |s: &'static str| HeaderName::from_static(s);
        for cred in ["authorization", "x-api-key", "api-key", "x-goog-api-key"] {
            assert!(stays_at_gateway(&n(cred), false, &[]), "{cred}");
            assert!(!stays_at_gateway(&n(cred), true, &[]), "{cred}");
        }
        assert!(stays_at_gateway(&n("cookie"), true, &[]));
        assert!(!stays_at_gateway(&n("cookie"), false, &["cookie".into()]));
        assert!(stays_at_gateway(&n("x-switchyard-tenant"), true, &[]));
        assert!(!stays_at_gateway(
            &n("x-switchyard-tenant"),
            false,
            &["x-switchyard-tenant".into()]
        ));
        assert!(!stays_at_gateway(
            &n("x-api-key"),
            false,
            &["x-api-key".into()]
        ));
        assert!(!stays_at_gateway(&n("content-type"), false, &[]));
        assert!(!stays_at_gateway(&n("x-request-id"), false, &[]));
    }

    #[test]
    fn strips_hop_by_hop_and_connection_named() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            "keep-alive, x-secret-hop".parse().unwrap(),
        );
        h.insert("keep-alive", "timeout=5".parse().unwrap());
        h.insert("proxy-connection", "keep-alive".parse().unwrap());
        h.insert("x-secret-hop", "1".parse().unwrap());
        h.insert(header::TRANSFER_ENCODING, "chunked".parse().unwrap());
        h.insert(header::CONTENT_TYPE, "application/json".parse().unwrap());
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1);
        assert!(h.contains_key(header::CONTENT_TYPE));
    }

    #[test]
    fn hop_by_hop_names() {
        for n in [
            header::CONNECTION,
            header::PROXY_AUTHENTICATE,
            header::PROXY_AUTHORIZATION,
            header::TE,
            header::TRAILER,
            header::TRANSFER_ENCODING,
            header::UPGRADE,
            HeaderName::from_static("keep-alive"),
            HeaderName::from_static("proxy-connection"),
        ] {
            assert!(is_hop_by_hop(&n), "{n}");
        }
        for n in [header::CONTENT_LENGTH, header::HOST, header::AUTHORIZATION] {
            assert!(!is_hop_by_hop(&n), "{n}");
        }
        assert!(!is_hop_by_hop(&HeaderName::from_static("x-keep-alive")));
    }

    #[test]
    fn a_lone_usual_connection_option_is_removed_and_nothing_else() {
        for v in ["keep-alive", " Keep-Alive ", "close"] {
            let mut h = HeaderMap::new();
            h.insert(header::CONNECTION, v.parse().unwrap());
            h.insert(header::CONTENT_TYPE, "application/json".parse().unwrap());
            h.insert("x-other", "1".parse().unwrap());
            strip_hop_by_hop(&mut h);
            assert_eq!(h.len(), 2, "{v}: {h:?}");
            assert!(!h.contains_key(header::CONNECTION), "{v}");
        }
        // The usual option beside another hop-by-hop header: both go.
        let mut h = HeaderMap::new();
        h.insert(header::CONNECTION, "keep-alive".parse().unwrap());
        h.insert("keep-alive", "timeout=5".parse().unwrap());
        h.insert(header::ACCEPT, "*/*".parse().unwrap());
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1, "{h:?}");
    }

    #[test]
    fn a_connection_header_alone_is_stripped_with_what_it_names() {
        let mut h = HeaderMap::new();
        h.insert(header::CONNECTION, "x-hop".parse().unwrap());
        h.insert("x-hop", "1".parse().unwrap());
        h.insert(header::ACCEPT, "*/*".parse().unwrap());
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1);
        // Several `Connection` headers, names in any case: all of them listed go.
        let mut h = HeaderMap::new();
        h.append(header::CONNECTION, "X-One".parse().unwrap());
        h.append(header::CONNECTION, "x-two, ,bad name".parse().unwrap());
        h.insert("x-one", "1".parse().unwrap());
        h.insert("x-two", "2".parse().unwrap());
        h.insert(header::ACCEPT, "*/*".parse().unwrap());
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1, "{h:?}");
        // Nothing hop-by-hop: left exactly as it was.
        let mut clean = HeaderMap::new();
        clean.insert(header::ACCEPT, "*/*".parse().unwrap());
        clean.append("x-custom", "a".parse().unwrap());
        clean.append("x-custom", "b".parse().unwrap());
        let before = clean.clone();
        strip_hop_by_hop(&mut clean);
        assert_eq!(clean, before);
    }
}
