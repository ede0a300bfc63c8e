//! The edge settings of the listeners: TLS (certificate and key files, the admin
//! listener's client CA) and CORS for browser clients. Validation checks the
//! file's own values; `resolve::tls` then reads the PEM files.

use super::key::Key;
use super::Problems;
use serde::Deserialize;
use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

/// Default interval between checks of the certificate and key files for changes (ms).
pub const DEFAULT_TLS_RELOAD_MS: u64 = 2_000;
/// Default `max_age` of a CORS preflight answer (seconds).
pub const DEFAULT_CORS_MAX_AGE_S: u64 = 600;

/// `[server.tls]` / `[admin.tls]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTls {
    /// PEM file with the certificate chain, leaf first.
    pub cert: Option<String>,
    /// PEM file with the private key (PKCS#8, PKCS#1 or SEC1).
    pub key: Option<String>,
    /// PEM file of CAs whose client certificates the admin listener accepts;
    /// when set, a client without one is refused (admin only).
    pub client_ca: Option<String>,
    /// How often the files are checked for changes (ms); 0: never reloaded.
    pub reload_interval_ms: Option<u64>,
}

/// A TLS listener's files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsConfig {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub client_ca: Option<PathBuf>,
    /// Zero: the files are read once.
    pub reload_interval: Duration,
}

/// `[server.cors]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawCors {
    /// Origins allowed to call the API from a browser (`https://app.example`), or `["*"]`.
    #[serde(default)]
    pub allowed_origins: Vec<String>,
    /// Methods a preflight allows; default GET, POST, OPTIONS.
    pub allowed_methods: Option<Vec<String>>,
    /// Request headers a preflight allows; default authorization, content-type and
    /// the OpenAI SDK's own headers.
    pub allowed_headers: Option<Vec<String>>,
    /// How long a browser may cache a preflight answer (s).
    pub max_age_s: Option<u64>,
}

/// Which browser origins may call the API, and what a preflight allows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CorsConfig {
    /// Exact origins (lower case); empty when `any_origin`.
    pub origins: Vec<String>,
    pub any_origin: bool,
    /// Upper case, comma-joined for the preflight answer.
    pub methods: String,
    /// Lower case, comma-joined.
    pub headers: String,
    pub max_age: Duration,
}

const DEFAULT_CORS_HEADERS: &[&str] = &[
    "authorization",
    "content-type",
    "openai-organization",
    "openai-project",
    "x-request-id",
    "x-session-id",
    "x-stainless-arch",
    "x-stainless-lang",
    "x-stainless-os",
    "x-stainless-package-version",
    "x-stainless-retry-count",
    "x-stainless-runtime",
    "x-stainless-runtime-version",
    "x-stainless-timeout",
];

/// `[server.tls]` or `[admin.tls]` (`key` names it); `client_ca` only where allowed.
pub(crate) fn validate_tls(
    t: RawTls,
    key: &Key,
    client_ca_allowed: bool,
    p: &mut Problems,
) -> Option<TlsConfig> {
    let file = |name: &str, v: Option<String>, p: &mut Problems| match v {
        Some(f) if !f.is_empty() => Some(PathBuf::from(f)),
        _ => {
            p.push(format!(
                "{}: required when {key} is set (a PEM file)",
                key.field(name)
            ));
            None
        }
    };
    let cert = file("cert", t.cert, p);
    let tls_key = file("key", t.key, p);
    if t.client_ca.is_some() && !client_ca_allowed {
        p.push(format!(
            "{}: client certificates are checked on the admin listener only",
            key.field("client_ca")
        ));
    }
    Some(TlsConfig {
        cert: cert?,
        key: tls_key?,
        client_ca: t.client_ca.filter(|_| client_ca_allowed).map(PathBuf::from),
        reload_interval: Duration::from_millis(
            t.reload_interval_ms.unwrap_or(DEFAULT_TLS_RELOAD_MS),
        ),
    })
}

/// `[server.cors]`: `None` when no origin is allowed (CORS off).
pub(crate) fn validate_cors(c: RawCors, key: &Key, p: &mut Problems) -> Option<CorsConfig> {
    let any_origin = c.allowed_origins.iter().any(|o| o == "*");
    let mut origins = Vec::new();
    for (i, o) in c.allowed_origins.iter().enumerate() {
        if o == "*" {
            continue;
        }
        let ok = (o.starts_with("http://") || o.starts_with("https://"))
            && !o.ends_with('/')
            && o.bytes().all(|b| b.is_ascii_graphic());
        if !ok {
            p.push(format!(
                "{}: `{o}` is not an origin (scheme://host[:port], no path)",
                key.field("allowed_origins").index(i)
            ));
        }
        origins.push(o.to_ascii_lowercase());
    }
    let methods = c
        .allowed_methods
        .unwrap_or_else(|| vec!["GET".into(), "POST".into(), "OPTIONS".into()]);
    let headers = c
        .allowed_headers
        .unwrap_or_else(|| DEFAULT_CORS_HEADERS.iter().map(|s| s.to_string()).collect());
    let token =
        |s: &String| !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
    for (field, list) in [("allowed_methods", &methods), ("allowed_headers", &headers)] {
        for (i, v) in list.iter().enumerate() {
            if !token(v) {
                p.push(format!(
                    "{}: `{v}` is not a header token",
                    key.field(field).index(i)
                ));
            }
        }
    }
    if !any_origin && origins.is_empty() {
        return None;
    }
    Some(CorsConfig {
        origins: if any_origin { Vec::new() } else { origins },
        any_origin,
        methods: methods
            .iter()
            .map(|m| m.to_ascii_uppercase())
            .collect::<Vec<_>>()
            .join(", "),
        headers: headers
            .iter()
            .map(|h| h.to_ascii_lowercase())
            .collect::<Vec<_>>()
            .join(", "),
        max_age: Duration::from_secs(c.max_age_s.unwrap_or(DEFAULT_CORS_MAX_AGE_S)),
    })
}

/// Read a certificate chain and its key into a rustls `CertifiedKey`: every
/// file readable and PEM, the key one rustls can sign with, and the key the
/// leaf certificate's. Used to validate the config and on every reload.
pub fn load_certified_key(tls: &TlsConfig) -> Result<rustls::sign::CertifiedKey, String> {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};
    let certs = read_certs(&tls.cert)?;
    let key = PrivateKeyDer::from_pem_file(&tls.key)
        .map_err(|e| format!("`{}`: no private key read: {e}", tls.key.display()))?;
    let provider = rustls::crypto::ring::default_provider();
    let certs: Vec<CertificateDer<'static>> = certs;
    let ders: Vec<&[u8]> = certs.iter().map(|c| c.as_ref()).collect();
    let shown = tls.cert.display().to_string();
    super::cert_validity::check_chain(&ders, super::cert_validity::unix_now(), &shown)?;
    rustls::sign::CertifiedKey::from_der(certs, key, &provider).map_err(|e| {
        format!(
            "`{}` and `{}` do not form a usable certificate and key: {e}",
            tls.cert.display(),
            tls.key.display()
        )
    })
}

/// When a loaded chain stops working: the earliest `notAfter` of its
/// certificates, in Unix seconds (the `switchyard_tls_certificate_expiry_seconds` gauge).
pub fn chain_not_after(key: &rustls::sign::CertifiedKey) -> Option<i64> {
    key.cert
        .iter()
        .map(|c| {
            super::cert_validity::Validity::of_der(c)
                .ok()
                .map(|v| v.not_after)
        })
        .min()
        .flatten()
}

/// The CAs of a `client_ca` file as a root store.
pub fn load_client_roots(path: &std::path::Path) -> Result<rustls::RootCertStore, String> {
    let mut roots = rustls::RootCertStore::empty();
    for c in read_certs(path)? {
        roots
            .add(c)
            .map_err(|e| format!("`{}`: {e}", path.display()))?;
    }
    Ok(roots)
}

/// Every certificate of a PEM file; at least one.
fn read_certs(
    path: &std::path::Path,
) -> Result<Vec<rustls_pki_types::CertificateDer<'static>>, String> {
    use rustls_pki_types::pem::PemObject;
    let shown = path.display();
    let certs = rustls_pki_types::CertificateDer::pem_file_iter(path)
        .map_err(|e| format!("`{shown}`: {e}"))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("`{shown}`: {e}"))?;
    if certs.is_empty() {
        return Err(format!("`{shown}`: no PEM certificate in the file"));
    }
    Ok(certs)
}

/// An address block (`10.0.0.0/8`, `fd00::/8`, or one address) of
/// `server.trusted_proxies`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cidr {
    net: IpAddr,
    bits: u8,
}

impl Cidr {
    /// `addr/bits` or a bare address; `None` for anything else (host bits set
    /// are refused: `10.0.0.1/8` is a typo, not a network).
    pub fn parse(s: &str) -> Option<Cidr> {
        let (a, bits) = match s.split_once('/') {
            Some((a, b)) => (a, Some(b.parse::<u8>().ok()?)),
            None => (s, None),
        };
        let net: IpAddr = a.parse().ok()?;
        let max = if net.is_ipv4() { 32 } else { 128 };
        let bits = bits.unwrap_or(max);
        let c = Cidr { net, bits };
        (bits <= max && c.contains(net) && c.masked(net) == net).then_some(c)
    }

    /// `ip` is in the block (an IPv4-mapped IPv6 address counts as IPv4).
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = ip.to_canonical();
        ip.is_ipv4() == self.net.is_ipv4() && self.masked(ip) == self.net
    }

    fn masked(&self, ip: IpAddr) -> IpAddr {
        match ip {
            IpAddr::V4(v) => {
                let m = u32::MAX.checked_shl(32 - u32::from(self.bits)).unwrap_or(0);
                IpAddr::V4((u32::from(v) & m).into())
            }
            IpAddr::V6(v) => {
                let m = u128::MAX
                    .checked_shl(128 - u32::from(self.bits))
                    .unwrap_or(0);
                IpAddr::V6((u128::from(v) & m).into())
            }
        }
    }
}

/// `server.trusted_proxies`: each entry an address or CIDR block.
pub(crate) fn validate_trusted_proxies(raw: Vec<String>, key: &Key, p: &mut Problems) -> Vec<Cidr> {
    raw.iter()
        .enumerate()
        .filter_map(|(i, s)| {
            let c = Cidr::parse(s.trim());
            if c.is_none() {
                p.push(format!(
                    "{}: `{s}` is not an address or a CIDR block such as 10.0.0.0/8",
                    key.index(i)
                ));
            }
            c
        })
        .collect()
}

#[cfg(test)]
mod tests {
    const POOL: &str =
        "[[pools]]\nmodels = [\"m\"]\nworkers = [{ url = \"http://127.0.0.1:9000\" }]\n";

    fn problems(text: &str) -> String {
        let text = format!("{text}\n{POOL}");
        match crate::config::parse(&text).and_then(|r| r.validate()) {
            Ok(_) => String::new(),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn tls_needs_both_files_readable_and_client_ca_only_on_admin() {
        let e = problems("[server.tls]\ncert = \"/nonexistent/c.pem\"");
        assert!(e.contains("server.tls.key: required"), "{e}");
        let e = problems("[server.tls]\ncert = \"/nonexistent/c.pem\"\nkey = \"/nonexistent/k.pem\"\nclient_ca = \"x\"");
        assert!(
            e.contains(
                "server.tls.client_ca: client certificates are checked on the admin listener only"
            ),
            "{e}"
        );
        assert!(e.contains("server.tls: `/nonexistent/c.pem`"), "{e}");
    }

    #[test]
    fn cors_origins_and_tokens_are_checked() {
        let e = problems("[server.cors]\nallowed_origins = [\"app.example\", \"https://ok.example/\"]\nallowed_headers = [\"bad header\"]");
        assert!(
            e.contains("server.cors.allowed_origins[0]: `app.example` is not an origin"),
            "{e}"
        );
        assert!(e.contains("server.cors.allowed_origins[1]"), "{e}");
        assert!(e.contains("server.cors.allowed_headers[0]"), "{e}");
        let c = crate::config::parse(&format!(
            "[server.cors]\nallowed_origins = [\"https://App.example\"]\n{POOL}"
        ))
        .and_then(|r| r.validate())
        .unwrap();
        let cors = c.server.cors.unwrap();
        assert_eq!(cors.origins, ["https://app.example"]);
        assert!(cors.headers.contains("authorization") && cors.methods.contains("POST"));
        assert!(problems("[server]\nmax_json_depth = 0").contains("server.max_json_depth"));
        assert!(problems("[server]\nmax_json_depth = 500").contains("server.max_json_depth"));
    }
}
