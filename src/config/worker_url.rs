//! Worker addresses: one normalised spelling per address, and the rules for
//! where a worker may point. Used by config validation, the admin API and
//! discovery (DNS, Kubernetes), so a hostile spelling is refused wherever a
//! worker enters. Here rather than in `pool/` because config validation (layer 0)
//! needs it and may import nothing of ours.
//!
//! Normalising uses the `url` crate's WHATWG host parser, which reads every
//! spelling of an IPv4 address (`2852039166`, `0xA9FEA9FE`, `0251.0376.0251.0376`,
//! `169.254.43518`) as the address it names, lowercases names and drops a
//! scheme's default port.

use std::borrow::Cow;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// A worker URL in its one normalised spelling, with what it points at.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerUrl {
    /// `scheme://host[:port][/path]`: lowercase host, numeric IPv4 spellings and
    /// IPv4-mapped IPv6 written as dotted IPv4, no default port, no trailing slash.
    pub url: String,
    pub host: Host,
    /// The port connections go to (the scheme's default when none is written).
    pub port: u16,
}

/// A worker's host: an address, or a name resolved when connecting.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Host {
    Ip(IpAddr),
    Name(String),
}

/// Where a worker address came from: it decides whether loopback is accepted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    /// The config file or the command line: the operator wrote it.
    Config,
    /// `POST /admin/workers`.
    Admin,
    /// DNS or Kubernetes discovery (names and selectors the operator configured).
    Discovery,
}

/// What a worker address may point at, beyond the always-refused own listeners.
#[derive(Clone, Copy, Debug, Default)]
pub struct AddressRules<'a> {
    /// `[server] allow_link_local_workers`: link-local and cloud metadata accepted.
    pub allow_link_local: bool,
    /// `[admin] allow_loopback_workers`: loopback accepted from the admin API.
    pub allow_admin_loopback: bool,
    /// The gateway's own listeners (client, admin): never a worker.
    pub own: &'a [SocketAddr],
}

/// Names that reach a cloud provider's instance metadata service.
const METADATA_NAMES: &[&str] = &[
    "metadata.google.internal",
    "metadata.goog",
    "metadata",
    "instance-data",
    "instance-data.ec2.internal",
    "metadata.azure.internal",
    "metadata.tencentyun.com",
];

/// Cloud metadata addresses outside 169.254/16 (AWS's IPv6 one, Alibaba's).
const METADATA_ADDRS: &[IpAddr] = &[
    IpAddr::V6(Ipv6Addr::new(0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254)),
    IpAddr::V4(Ipv4Addr::new(100, 100, 100, 200)),
];

/// What an address is, for the rules.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A cloud provider's instance metadata service.
    Metadata,
    /// 169.254.0.0/16 or fe80::/10.
    LinkLocal,
    /// 127/8, ::1, `localhost`, or the unspecified address (which reaches this host).
    Loopback,
    Other,
}

/// `url` with the password of its userinfo (or a lone user name, which may be a
/// token) replaced by `***`, for messages.
pub(super) fn redact_userinfo(url: &str) -> Cow<'_, str> {
    let start = url.find("://").map_or(0, |i| i + 3);
    let end = url[start..]
        .find(['/', '?', '#'])
        .map_or(url.len(), |i| start + i);
    let Some(at) = url[start..end].rfind('@').map(|i| start + i) else {
        return Cow::Borrowed(url);
    };
    let masked = match url[start..at].split_once(':') {
        Some((user, _)) => format!("{user}:***"),
        None => "***".to_string(),
    };
    Cow::Owned(format!("{}{masked}{}", &url[..start], &url[at..]))
}

impl WorkerUrl {
    /// Parse and normalise: http/https only, a host, no userinfo, no query or
    /// fragment. Messages never show a password.
    pub fn parse(s: &str) -> Result<WorkerUrl, String> {
        let shown = redact_userinfo(s);
        if matches!(shown, Cow::Owned(_)) {
            return Err(format!(
                "`{shown}`: user credentials (`user:password@`) are not allowed in a worker URL (they would show in metrics, the dashboard and the upstream Host header); use upstream_api_key_env for a bearer token"
            ));
        }
        let scheme = s.split_once("://").map(|(s, _)| s.to_ascii_lowercase());
        if !matches!(scheme.as_deref(), Some("http" | "https")) {
            return Err(format!("`{s}` must start with http:// or https://"));
        }
        // Strict first (no backslashes, no `http:///x`), then WHATWG normalisation.
        let uri: http::Uri = s.parse().map_err(|e| format!("`{s}` is not a URL: {e}"))?;
        if uri.authority().is_none_or(|a| a.host().is_empty()) {
            return Err(format!("`{s}` has no host"));
        }
        if uri.query().is_some() || s.contains('#') {
            return Err(format!("`{s}` must not have a query string or fragment"));
        }
        let parsed = url::Url::parse(s).map_err(|e| format!("`{s}` is not a URL: {e}"))?;
        let host = match parsed.host() {
            Some(url::Host::Ipv4(a)) => Host::Ip(IpAddr::V4(a)),
            Some(url::Host::Ipv6(a)) => Host::Ip(unmap(a)),
            Some(url::Host::Domain(d)) => Host::Name(d.trim_end_matches('.').to_string()),
            None => return Err(format!("`{s}` has no host")),
        };
        let port = parsed.port_or_known_default().unwrap_or(80);
        let mut url = format!("{}://{}", parsed.scheme(), host_text(&host));
        if parsed.port().is_some() {
            url.push_str(&format!(":{port}"));
        }
        url.push_str(parsed.path().trim_end_matches('/'));
        Ok(WorkerUrl { url, host, port })
    }

    /// What the host is, without resolving a name (`localhost` is loopback).
    pub fn kind(&self) -> Kind {
        match &self.host {
            Host::Ip(ip) => kind_of(*ip),
            Host::Name(n) if METADATA_NAMES.contains(&n.as_str()) => Kind::Metadata,
            Host::Name(n) if n == "localhost" || n.ends_with(".localhost") => Kind::Loopback,
            Host::Name(_) => Kind::Other,
        }
    }

    /// Check this address against the rules for `origin`; the error names the rule.
    pub fn check(&self, origin: Origin, rules: &AddressRules<'_>) -> Result<(), String> {
        self.check_as(self.kind(), self.own_ip(), origin, rules)
    }

    /// [`check`](Self::check) for one address a name resolved to.
    pub fn check_resolved(
        &self,
        ip: IpAddr,
        origin: Origin,
        rules: &AddressRules<'_>,
    ) -> Result<(), String> {
        let ip = match ip {
            IpAddr::V6(a) => unmap(a),
            v4 => v4,
        };
        self.check_as(kind_of(ip), Some(ip), origin, rules)
            .map_err(|e| format!("{e} (`{}` resolves to {ip})", host_text(&self.host)))
    }

    fn own_ip(&self) -> Option<IpAddr> {
        match (&self.host, self.kind()) {
            (Host::Ip(ip), _) => Some(*ip),
            (Host::Name(_), Kind::Loopback) => Some(IpAddr::V4(Ipv4Addr::LOCALHOST)),
            _ => None,
        }
    }

    fn check_as(
        &self,
        kind: Kind,
        ip: Option<IpAddr>,
        origin: Origin,
        rules: &AddressRules<'_>,
    ) -> Result<(), String> {
        let url = &self.url;
        if ip.is_some_and(|ip| is_own(ip, self.port, rules.own)) {
            return Err(format!(
                "`{url}` is this gateway's own listener (a worker there would send every request back to the gateway in a loop)"
            ));
        }
        match kind {
            Kind::Metadata if !rules.allow_link_local => Err(format!(
                "`{url}` is a cloud metadata service address; refused unless [server] allow_link_local_workers = true"
            )),
            Kind::LinkLocal if !rules.allow_link_local => Err(format!(
                "`{url}` is a link-local address (169.254.0.0/16, fe80::/10); refused unless [server] allow_link_local_workers = true"
            )),
            Kind::Loopback if origin == Origin::Admin && !rules.allow_admin_loopback => Err(format!(
                "`{url}` is a loopback address; the admin API accepts one only with [admin] allow_loopback_workers = true"
            )),
            _ => Ok(()),
        }
    }
}

/// An IPv4 address carried in IPv6 (mapped `::ffff:a.b.c.d`, NAT64
/// `64:ff9b::a.b.c.d`, or the old compatible `::a.b.c.d`) as that IPv4 address.
fn unmap(a: Ipv6Addr) -> IpAddr {
    if let Some(v4) = a.to_ipv4_mapped() {
        return IpAddr::V4(v4);
    }
    let s = a.segments();
    let tail = Ipv4Addr::new((s[6] >> 8) as u8, s[6] as u8, (s[7] >> 8) as u8, s[7] as u8);
    let nat64 = s[..6] == [0x64, 0xff9b, 0, 0, 0, 0];
    let compatible = s[..6] == [0; 6] && u32::from(tail) > 1;
    if nat64 || compatible {
        IpAddr::V4(tail)
    } else {
        IpAddr::V6(a)
    }
}

fn host_text(h: &Host) -> String {
    match h {
        Host::Ip(IpAddr::V6(a)) => format!("[{a}]"),
        Host::Ip(a) => a.to_string(),
        Host::Name(n) => n.clone(),
    }
}

/// What an address is.
pub fn kind_of(ip: IpAddr) -> Kind {
    if METADATA_ADDRS.contains(&ip) {
        return Kind::Metadata;
    }
    match ip {
        IpAddr::V4(a) if a.octets() == [169, 254, 169, 254] => Kind::Metadata,
        IpAddr::V4(a) if a.is_link_local() => Kind::LinkLocal,
        IpAddr::V6(a) if (a.segments()[0] & 0xffc0) == 0xfe80 => Kind::LinkLocal,
        a if a.is_loopback() || a.is_unspecified() => Kind::Loopback,
        _ => Kind::Other,
    }
}

/// `ip:port` reaches one of the gateway's own listeners: same port, and the
/// address is the listener's, or the listener takes every address and this one
/// is loopback, unspecified or one of this host's.
fn is_own(ip: IpAddr, port: u16, own: &[SocketAddr]) -> bool {
    own.iter().filter(|l| l.port() == port).any(|l| {
        ip == l.ip()
            || (l.ip().is_loopback() && (ip.is_loopback() || ip.is_unspecified()))
            || (l.ip().is_unspecified() && (kind_of(ip) == Kind::Loopback || is_local(ip)))
    })
}

/// `ip` belongs to this host: a socket can be bound to it.
fn is_local(ip: IpAddr) -> bool {
    std::net::TcpListener::bind(SocketAddr::new(ip, 0)).is_ok()
}

/// Normalise a worker URL (see [`WorkerUrl::parse`]).
pub fn normalize_worker_url(s: &str) -> Result<String, String> {
    WorkerUrl::parse(s).map(|w| w.url)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn own() -> Vec<SocketAddr> {
        vec![
            "0.0.0.0:8080".parse().unwrap(),
            "127.0.0.1:9090".parse().unwrap(),
        ]
    }

    fn check(url: &str, origin: Origin) -> Result<String, String> {
        let own = own();
        let rules = AddressRules {
            own: &own,
            ..Default::default()
        };
        let w = WorkerUrl::parse(url)?;
        w.check(origin, &rules).map(|()| w.url)
    }

    #[test]
    fn spellings_of_one_address_normalise_alike() {
        for (given, want) in [
            ("http://H:80/", "http://h"),
            ("http://h", "http://h"),
            ("HTTP://Worker.Example:8000//", "http://worker.example:8000"),
            ("https://h:443/v1/", "https://h/v1"),
            ("http://2852039166/", "http://169.254.169.254"),
            ("http://0xA9FEA9FE", "http://169.254.169.254"),
            ("http://0251.0376.0251.0376:80", "http://169.254.169.254"),
            ("http://169.254.43518", "http://169.254.169.254"),
            ("http://[::ffff:169.254.169.254]", "http://169.254.169.254"),
            (
                "http://[::FFFF:A9FE:A9FE]:8000",
                "http://169.254.169.254:8000",
            ),
            ("http://[FD00:EC2:0::254]", "http://[fd00:ec2::254]"),
            (
                "http://metadata.google.internal./",
                "http://metadata.google.internal",
            ),
        ] {
            assert_eq!(WorkerUrl::parse(given).unwrap().url, want, "{given}");
        }
    }

    #[test]
    fn malformed_urls_are_refused_with_the_rule() {
        for (url, rule) in [
            ("ftp://h", "http:// or https://"),
            ("http://h:1/x?y=1", "query"),
            ("http://h:1/x#frag", "fragment"),
            ("http://u:pw@h", "credentials"),
            ("h:1", "http:// or https://"),
            ("file:///etc/passwd", "http:// or https://"),
            ("gopher://h:70", "http:// or https://"),
        ] {
            let e = WorkerUrl::parse(url).unwrap_err();
            assert!(e.contains(rule), "{url}: {e}");
        }
    }

    #[test]
    fn metadata_and_link_local_are_refused_in_every_spelling() {
        for url in [
            "http://169.254.169.254",
            "http://2852039166/",
            "http://0xA9FEA9FE",
            "http://[::ffff:169.254.169.254]",
            "http://[64:ff9b::a9fe:a9fe]",
            "http://[fd00:ec2::254]",
            "http://metadata.google.internal",
            "http://METADATA.GOOGLE.INTERNAL.",
            "http://100.100.100.200",
            "http://169.254.1.2:8000",
            "http://[fe80::1]:8000",
        ] {
            for origin in [Origin::Config, Origin::Admin, Origin::Discovery] {
                let e = check(url, origin).unwrap_err();
                assert!(e.contains("allow_link_local_workers"), "{url}: {e}");
            }
        }
        let w = WorkerUrl::parse("http://0xA9FEA9FE").unwrap();
        let rules = AddressRules {
            allow_link_local: true,
            ..Default::default()
        };
        assert!(w.check(Origin::Admin, &rules).is_ok());
    }

    #[test]
    fn loopback_is_the_operators_choice_not_the_admin_apis() {
        for url in [
            "http://127.0.0.1:8000",
            "http://localhost:8000",
            "http://[::1]:8000",
            "http://0.0.0.0:8000",
            "http://2130706433:8000",
        ] {
            assert!(check(url, Origin::Config).is_ok(), "{url}");
            assert!(check(url, Origin::Discovery).is_ok(), "{url}");
            let e = check(url, Origin::Admin).unwrap_err();
            assert!(e.contains("allow_loopback_workers"), "{url}: {e}");
        }
        let w = WorkerUrl::parse("http://localhost:8000").unwrap();
        let rules = AddressRules {
            allow_admin_loopback: true,
            ..Default::default()
        };
        assert!(w.check(Origin::Admin, &rules).is_ok());
    }

    #[test]
    fn the_gateways_own_listeners_are_refused_in_any_spelling() {
        for url in [
            "http://127.0.0.1:8080",
            "http://localhost:8080",
            "http://[::1]:8080",
            "http://0.0.0.0:8080",
            "http://[::ffff:127.0.0.1]:8080",
            "http://127.0.0.1:9090/",
            "http://LOCALHOST:9090",
        ] {
            for origin in [Origin::Config, Origin::Discovery] {
                let e = check(url, origin).unwrap_err();
                assert!(e.contains("own listener"), "{url}: {e}");
            }
        }
        // Another port of this host is not the gateway.
        assert!(check("http://127.0.0.1:8081", Origin::Config).is_ok());
        // A name resolved to the gateway's address is refused too.
        let own = own();
        let rules = AddressRules {
            own: &own,
            ..Default::default()
        };
        let w = WorkerUrl::parse("http://engine.internal:8080").unwrap();
        assert!(w.check(Origin::Admin, &rules).is_ok());
        let e = w
            .check_resolved("127.0.0.1".parse().unwrap(), Origin::Admin, &rules)
            .unwrap_err();
        assert!(
            e.contains("own listener") && e.contains("resolves to"),
            "{e}"
        );
    }
}
