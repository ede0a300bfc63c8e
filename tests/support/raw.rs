//! Raw HTTP/1 over a socket, for requests a client library refuses to send.

use std::net::SocketAddr;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Generous bound for "the server closes it": the timeouts under test are
/// hundreds of milliseconds, this only keeps a broken build from hanging.
pub const SAFETY: Duration = Duration::from_secs(60);

/// Read until the server closes the connection; what it sent before that.
pub async fn read_to_close(s: &mut TcpStream) -> String {
    let mut out = Vec::new();
    tokio::time::timeout(SAFETY, s.read_to_end(&mut out))
        .await
        .expect("the server closes the connection")
        .ok();
    String::from_utf8_lossy(&out).into_owned()
}

/// Send raw bytes on a fresh connection (`Connection: close` is the caller's to
/// add) and read the whole answer.
pub async fn raw(addr: SocketAddr, bytes: &[u8]) -> String {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(bytes).await.unwrap();
    read_to_close(&mut s).await
}

/// The status code of a raw answer.
pub fn status_of(answer: &str) -> u16 {
    answer
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {answer:?}"))
}
