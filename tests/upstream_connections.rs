//! Upstream connection reuse: keep-alive connections carry request after request,
//! and a connection the worker closed is never a failed request.

mod support;

use std::sync::{Arc, Mutex};
use support::{chat_status, gateway, metric_sum, pool_toml, scrape};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

const BODY: &str = r#"{"id":"c","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}"#;

/// A raw HTTP/1.1 worker answering every request with `BODY`. It records, per
/// chat request, the number of the connection that carried it; with
/// `close_after_each` it closes the connection after each answer without saying
/// so (as an engine's idle timeout does).
async fn raw_worker(close_after_each: bool) -> (String, Arc<Mutex<Vec<usize>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let chats = Arc::new(Mutex::new(Vec::new()));
    let seen = chats.clone();
    tokio::spawn(async move {
        let mut n = 0;
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                return;
            };
            n += 1;
            let conn = n;
            let seen = seen.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                loop {
                    // One request: the head, then Content-Length bytes of body.
                    let head_end = loop {
                        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            break i + 4;
                        }
                        let mut chunk = [0u8; 4096];
                        match sock.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(k) => buf.extend_from_slice(&chunk[..k]),
                        }
                    };
                    let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
                    let len: usize = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .map_or(0, |v| v.trim().parse().unwrap());
                    while buf.len() < head_end + len {
                        let mut chunk = [0u8; 4096];
                        match sock.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(k) => buf.extend_from_slice(&chunk[..k]),
                        }
                    }
                    buf.drain(..head_end + len);
                    if head.starts_with("post /v1/chat/completions") {
                        seen.lock().unwrap().push(conn);
                    }
                    let resp = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{BODY}",
                        BODY.len()
                    );
                    if sock.write_all(resp.as_bytes()).await.is_err() {
                        return;
                    }
                    if close_after_each {
                        return;
                    }
                }
            });
        }
    });
    (url, chats)
}

/// A gateway over one raw worker, after `n` sequential chat requests (each
/// checked to succeed); the worker's URL and, per request, its connection.
async fn after_requests(
    close_after_each: bool,
    n: usize,
) -> (switchyard::server::ServerHandle, String, Vec<usize>) {
    let (url, chats) = raw_worker(close_after_each).await;
    let gw = gateway(&pool_toml("raw", &[url.as_str()], "")).await;
    for _ in 0..n {
        assert_eq!(chat_status(&gw.url(), "raw").await, 200);
    }
    let conns = chats.lock().unwrap().clone();
    assert_eq!(conns.len(), n);
    (gw, url, conns)
}

#[tokio::test]
async fn sequential_requests_reuse_upstream_connections() {
    let (gw, _, conns) = after_requests(false, 20).await;
    // A request may find its predecessor's connection not yet marked ready (the
    // connection task has not run since the answer ended) and open another, so
    // a loaded machine can see a second connection; never one per request.
    let mut distinct = conns.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert!(
        distinct.len() <= 5,
        "20 sequential requests over {} connections: {conns:?}",
        distinct.len()
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn a_connection_the_worker_closed_is_not_a_failure() {
    let (gw, url, conns) = after_requests(true, 10).await;
    let mut distinct = conns.clone();
    distinct.dedup();
    assert_eq!(distinct.len(), 10, "the worker closed every connection");
    let text = scrape(&gw.url()).await;
    let ok = metric_sum(
        &text,
        "switchyard_upstream_attempts_total",
        &[("worker", &url), ("result", "ok")],
    );
    let all = metric_sum(
        &text,
        "switchyard_upstream_attempts_total",
        &[("worker", &url)],
    );
    assert_eq!(ok, 10.0, "{text}");
    assert_eq!(all, 10.0, "a closed connection counted as a failed attempt");
    gw.shutdown().await;
}
