//! The floor of Switchyard's HTTP stack, as a benchmark target: a reverse proxy
//! built from the same parts (hyper HTTP/1 server and client connections, one
//! current-thread tokio runtime per CPU on `SO_REUSEPORT` listeners, a
//! per-thread keep-alive pool) that does nothing else: no parsing, routing,
//! metrics or timeouts. `benches/overhead.py` runs it next to the gateway (when
//! it is built; `BARE_BIN` names another path), so the gap between the two is
//! what the gateway's own work costs.
//!
//!   cargo run --release --example bare_proxy -- 127.0.0.1:8081 127.0.0.1:8000

use bytes::Bytes;
use http::{header, HeaderValue, Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::client::conn::http1 as client_h1;
use hyper::server::conn::http1 as server_h1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use std::cell::RefCell;
use std::net::SocketAddr;
use std::rc::Rc;

type Body = http_body_util::combinators::BoxBody<Bytes, hyper::Error>;

fn main() -> std::io::Result<()> {
    let mut args = std::env::args().skip(1);
    let (Some(listen), Some(upstream)) = (args.next(), args.next()) else {
        eprintln!("usage: bare_proxy LISTEN_ADDR UPSTREAM_ADDR");
        std::process::exit(2);
    };
    let listen: SocketAddr = listen.parse().map_err(std::io::Error::other)?;
    let upstream: SocketAddr = upstream.parse().map_err(std::io::Error::other)?;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    // The gateway's own SO_REUSEPORT binding, one listener per thread.
    let listeners = switchyard::server::shards::bind(listen, threads)?;
    let addr = listeners[0].local_addr()?;
    let handles: Vec<_> = listeners
        .into_iter()
        .map(|l| std::thread::spawn(move || serve(l, upstream)))
        .collect();
    println!("bare_proxy ready url=http://{addr}");
    for h in handles {
        let _ = h.join();
    }
    Ok(())
}

fn serve(listener: std::net::TcpListener, upstream: SocketAddr) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, async move {
        let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
        let pool: Rc<RefCell<Vec<client_h1::SendRequest<Full<Bytes>>>>> = Rc::default();
        let host = HeaderValue::from_str(&upstream.to_string()).expect("host");
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let _ = stream.set_nodelay(true);
            let pool = pool.clone();
            let host = host.clone();
            tokio::task::spawn_local(async move {
                let svc = service_fn(move |req| forward(req, upstream, pool.clone(), host.clone()));
                let _ = server_h1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
}

async fn forward(
    req: Request<Incoming>,
    upstream: SocketAddr,
    pool: Rc<RefCell<Vec<client_h1::SendRequest<Full<Bytes>>>>>,
    host: HeaderValue,
) -> Result<Response<Body>, hyper::Error> {
    let (mut parts, body) = req.into_parts();
    let body = body.collect().await?.to_bytes();
    parts.headers.remove(header::CONNECTION);
    parts.headers.insert(header::HOST, host);
    let req = Request::from_parts(parts, Full::new(body));
    let idle = {
        let mut p = pool.borrow_mut();
        let i = p.iter().position(|tx| tx.is_ready());
        i.map(|i| p.swap_remove(i))
    };
    let mut tx = match idle {
        Some(tx) => tx,
        None => {
            let Ok(stream) = tokio::net::TcpStream::connect(upstream).await else {
                let empty = Full::new(Bytes::new()).map_err(|never| match never {});
                let mut resp = Response::new(empty.boxed());
                *resp.status_mut() = http::StatusCode::BAD_GATEWAY;
                return Ok(resp);
            };
            let _ = stream.set_nodelay(true);
            let (tx, conn) = client_h1::handshake(TokioIo::new(stream)).await?;
            tokio::task::spawn_local(conn);
            tx
        }
    };
    let sent = tx.send_request(req);
    pool.borrow_mut().push(tx);
    let resp = sent.await?;
    let (mut parts, body) = resp.into_parts();
    parts.headers.remove(header::CONNECTION);
    Ok(Response::from_parts(parts, body.boxed()))
}
