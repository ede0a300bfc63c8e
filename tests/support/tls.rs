//! A generated CA and certificates for TLS tests (rcgen), and a TLS client over
//! hyper that says which ALPN protocol and certificate the server presented.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rcgen::{BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair};
use rustls_pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

/// A certificate authority that signs server and client certificates.
pub struct Ca {
    cert: rcgen::Certificate,
    key: KeyPair,
}

/// A signed certificate and its key, in PEM and DER.
pub struct Leaf {
    pub cert_pem: String,
    pub key_pem: String,
    pub der: CertificateDer<'static>,
    key_der: Vec<u8>,
}

impl Leaf {
    pub fn key(&self) -> PrivateKeyDer<'static> {
        PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.key_der.clone()))
    }
}

impl Ca {
    pub fn new(name: &str) -> Ca {
        let key = KeyPair::generate().unwrap();
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.distinguished_name.push(DnType::CommonName, name);
        let cert = p.self_signed(&key).unwrap();
        Ca { cert, key }
    }

    pub fn pem(&self) -> String {
        self.cert.pem()
    }

    pub fn der(&self) -> CertificateDer<'static> {
        self.cert.der().clone()
    }

    /// A server certificate for localhost and 127.0.0.1, named `cn`.
    pub fn server(&self, cn: &str) -> Leaf {
        self.leaf(cn, ExtendedKeyUsagePurpose::ServerAuth)
    }

    /// A client certificate named `cn`.
    pub fn client(&self, cn: &str) -> Leaf {
        self.leaf(cn, ExtendedKeyUsagePurpose::ClientAuth)
    }

    /// A server certificate valid only from `not_before` to `not_after` ((y, m, d)).
    pub fn server_valid(
        &self,
        cn: &str,
        not_before: (i32, u8, u8),
        not_after: (i32, u8, u8),
    ) -> Leaf {
        self.leaf_with(cn, ExtendedKeyUsagePurpose::ServerAuth, |p| {
            p.not_before = rcgen::date_time_ymd(not_before.0, not_before.1, not_before.2);
            p.not_after = rcgen::date_time_ymd(not_after.0, not_after.1, not_after.2);
        })
    }

    fn leaf(&self, cn: &str, usage: ExtendedKeyUsagePurpose) -> Leaf {
        self.leaf_with(cn, usage, |_| {})
    }

    fn leaf_with(
        &self,
        cn: &str,
        usage: ExtendedKeyUsagePurpose,
        edit: impl FnOnce(&mut CertificateParams),
    ) -> Leaf {
        let key = KeyPair::generate().unwrap();
        let mut p =
            CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()]).unwrap();
        p.distinguished_name.push(DnType::CommonName, cn);
        p.extended_key_usages = vec![usage];
        edit(&mut p);
        let cert = p.signed_by(&key, &self.cert, &self.key).unwrap();
        Leaf {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            der: cert.der().clone(),
            key_der: key.serialize_der(),
        }
    }
}

/// Write `leaf` as `dir/NAME.pem` and `dir/NAME.key`, each replaced atomically
/// (written beside, then renamed), so a watcher never reads half a file.
pub fn write_pair(dir: &Path, name: &str, leaf: &Leaf) -> (PathBuf, PathBuf) {
    let cert = dir.join(format!("{name}.pem"));
    let key = dir.join(format!("{name}.key"));
    replace(&cert, leaf.cert_pem.as_bytes());
    replace(&key, leaf.key_pem.as_bytes());
    (cert, key)
}

pub fn replace(path: &Path, bytes: &[u8]) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// A fresh temporary directory under the target dir, removed by the caller's drop.
pub fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "switchyard-{tag}-{}-{}",
        std::process::id(),
        rand_suffix()
    ));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn rand_suffix() -> u64 {
    use std::time::{SystemTime, UNIX_EPOCH};
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
}

/// Connect with TLS trusting `ca`, offering `alpn`, optionally with a client certificate.
pub async fn connect(
    addr: SocketAddr,
    ca: &CertificateDer<'static>,
    alpn: &[&[u8]],
    client_cert: Option<&Leaf>,
) -> std::io::Result<TlsStream<TcpStream>> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.clone()).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots);
    let mut cfg = match client_cert {
        Some(l) => builder
            .with_client_auth_cert(vec![l.der.clone()], l.key())
            .unwrap(),
        None => builder.with_no_client_auth(),
    };
    cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(cfg));
    let tcp = TcpStream::connect(addr).await?;
    connector
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
}

/// The protocol ALPN chose and the certificate the server presented.
pub fn negotiated(s: &TlsStream<TcpStream>) -> (Option<Vec<u8>>, CertificateDer<'static>) {
    let (_, conn) = s.get_ref();
    let alpn = conn.alpn_protocol().map(|p| p.to_vec());
    let cert = conn.peer_certificates().unwrap()[0].clone().into_owned();
    (alpn, cert)
}

/// A request sender over one TLS connection, HTTP/2 if ALPN chose it.
pub enum Sender {
    H1(hyper::client::conn::http1::SendRequest<Full<Bytes>>),
    H2(hyper::client::conn::http2::SendRequest<Full<Bytes>>),
}

impl Sender {
    pub async fn over(s: TlsStream<TcpStream>) -> hyper::Result<Sender> {
        let h2 = s.get_ref().1.alpn_protocol() == Some(b"h2");
        let io = TokioIo::new(s);
        if h2 {
            let (send, conn) =
                hyper::client::conn::http2::handshake(TokioExecutor::new(), io).await?;
            tokio::spawn(conn);
            Ok(Sender::H2(send))
        } else {
            let (send, conn) = hyper::client::conn::http1::handshake(io).await?;
            tokio::spawn(conn);
            Ok(Sender::H1(send))
        }
    }

    /// Send `method path` with an optional JSON body and bearer token; status and body.
    pub async fn send(
        &mut self,
        method: &str,
        path: &str,
        body: Option<&serde_json::Value>,
        bearer: Option<&str>,
    ) -> hyper::Result<(u16, String)> {
        let mut req = http::Request::builder()
            .method(method)
            .uri(format!("https://localhost{path}"))
            .header("host", "localhost");
        if let Some(t) = bearer {
            req = req.header("authorization", format!("Bearer {t}"));
        }
        let bytes = match body {
            Some(b) => {
                req = req.header("content-type", "application/json");
                Bytes::from(b.to_string())
            }
            None => Bytes::new(),
        };
        let req = req.body(Full::new(bytes)).unwrap();
        let resp = match self {
            Sender::H1(s) => {
                s.ready().await?;
                s.send_request(req).await?
            }
            Sender::H2(s) => {
                s.ready().await?;
                s.send_request(req).await?
            }
        };
        let status = resp.status().as_u16();
        let body = resp.into_body().collect().await?.to_bytes();
        Ok((status, String::from_utf8_lossy(&body).into_owned()))
    }
}
