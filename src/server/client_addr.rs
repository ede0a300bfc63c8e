//! The client's address for the access log: the socket peer, unless the peer
//! is one of `server.trusted_proxies`; then `x-forwarded-for` is read from the
//! right (each trusted proxy appends the address it saw) and the first hop that
//! is not a trusted proxy is the client. Hops left of it were written by the
//! client itself and prove nothing; a hop that is not an address stops the walk
//! at the last proxy that vouched for what it saw.

use crate::config::Cidr;
use http::HeaderMap;
use std::net::IpAddr;

/// The socket peer of a request, carried in its extensions to the router's
/// handlers (the hot path passes it directly).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Peer(pub Option<IpAddr>);

/// The client behind `peer` given the request's `x-forwarded-for` headers.
pub(crate) fn client(
    peer: Option<IpAddr>,
    headers: &HeaderMap,
    trusted: &[Cidr],
) -> Option<IpAddr> {
    let mut client = peer?.to_canonical();
    if !is_trusted(client, trusted) {
        return Some(client);
    }
    let hops = headers
        .get_all("x-forwarded-for")
        .iter()
        .rev()
        .flat_map(|v| v.as_bytes().rsplit(|&b| b == b','));
    for hop in hops {
        let Some(ip) = parse_hop(hop) else { break };
        client = ip;
        if !is_trusted(ip, trusted) {
            break;
        }
    }
    Some(client)
}

fn is_trusted(ip: IpAddr, trusted: &[Cidr]) -> bool {
    trusted.iter().any(|c| c.contains(ip))
}

/// One `x-forwarded-for` element: an address, perhaps bracketed IPv6.
fn parse_hop(hop: &[u8]) -> Option<IpAddr> {
    let s = std::str::from_utf8(hop).ok()?.trim();
    let s = s
        .strip_prefix('[')
        .and_then(|s| s.strip_suffix(']'))
        .unwrap_or(s);
    s.parse::<IpAddr>().ok().map(|ip| ip.to_canonical())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn xff(values: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append("x-forwarded-for", v.parse().unwrap());
        }
        h
    }

    fn ip(s: &str) -> Option<IpAddr> {
        Some(s.parse().unwrap())
    }

    #[test]
    fn forwarded_for_is_believed_only_from_trusted_proxies() {
        let trusted = [Cidr::parse("10.0.0.0/8").unwrap()];
        let h = xff(&["6.6.6.6, 203.0.113.9, 10.0.0.2"]);
        // An untrusted peer: its header is ignored.
        assert_eq!(client(ip("198.51.100.1"), &h, &trusted), ip("198.51.100.1"));
        // A trusted one: the first untrusted hop from the right, not the
        // left-most (the client wrote that one itself).
        assert_eq!(client(ip("10.0.0.1"), &h, &trusted), ip("203.0.113.9"));
        // Several header lines read as one list.
        let h = xff(&["6.6.6.6", "203.0.113.9", "10.0.0.2"]);
        assert_eq!(client(ip("10.0.0.1"), &h, &trusted), ip("203.0.113.9"));
        // Only proxies: the left-most of them.
        let h = xff(&["10.0.0.3, 10.0.0.2"]);
        assert_eq!(client(ip("10.0.0.1"), &h, &trusted), ip("10.0.0.3"));
        // Garbage stops the walk at the last proxy that vouched.
        let h = xff(&["203.0.113.9, junk, 10.0.0.2"]);
        assert_eq!(client(ip("10.0.0.1"), &h, &trusted), ip("10.0.0.2"));
        // No header: the peer.
        assert_eq!(
            client(ip("10.0.0.1"), &HeaderMap::new(), &trusted),
            ip("10.0.0.1")
        );
        // Nothing trusted: always the peer.
        let h = xff(&["203.0.113.9"]);
        assert_eq!(client(ip("10.0.0.1"), &h, &[]), ip("10.0.0.1"));
        assert_eq!(client(None, &h, &trusted), None);
        let h = xff(&["[2001:db8::1]"]);
        assert_eq!(client(ip("10.0.0.1"), &h, &trusted), ip("2001:db8::1"));
    }
}
