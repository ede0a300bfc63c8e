//! Header rules at the proxy boundary: hop-by-hop headers never cross, client
//! credentials cross only when the pool allows it.

use http::header::{self, HeaderMap, HeaderName};

/// Hop-by-hop headers (RFC 9110 §7.6.1) plus proxy credentials.
const HOP_BY_HOP: &[HeaderName] = &[
    header::CONNECTION,
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

fn is_hop_by_hop(name: &HeaderName) -> bool {
    HOP_BY_HOP.contains(name)
        || name.as_str() == "keep-alive"
        || name.as_str() == "proxy-connection"
}

/// Remove hop-by-hop headers, including any the `Connection` header names.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // One pass over the few names first: most messages carry none of them, and
    // looking each listed name up by hash costs more than this scan.
    if !headers.keys().any(is_hop_by_hop) {
        return;
    }
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for n in named {
        headers.remove(n);
    }
    let keys: Vec<HeaderName> = headers
        .keys()
        .filter(|k| is_hop_by_hop(k))
        .cloned()
        .collect();
    for k in keys {
        headers.remove(k);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn a_connection_header_alone_is_stripped_with_what_it_names() {
        let mut h = HeaderMap::new();
        h.insert(header::CONNECTION, "x-hop".parse().unwrap());
        h.insert("x-hop", "1".parse().unwrap());
        h.insert(header::ACCEPT, "*/*".parse().unwrap());
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1);
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
