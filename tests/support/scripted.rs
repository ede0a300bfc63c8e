//! A scriptable upstream for tests that must control exactly what a worker does:
//! it records the headers it received and streams events only when told to.

use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::Bytes;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc;

#[derive(Default)]
pub struct Recorded {
    pub headers: Vec<BTreeMap<String, String>>,
    pub bodies: Vec<serde_json::Value>,
}

pub struct Scripted {
    pub url: String,
    pub recorded: Arc<Mutex<Recorded>>,
    /// Each message sent here becomes one SSE `data:` event of the open stream;
    /// dropping the sender ends the stream.
    pub events: Arc<Mutex<Option<mpsc::UnboundedReceiver<String>>>>,
}

#[derive(Clone)]
struct St {
    recorded: Arc<Mutex<Recorded>>,
    events: Arc<Mutex<Option<mpsc::UnboundedReceiver<String>>>>,
}

async fn models() -> Json<serde_json::Value> {
    Json(serde_json::json!({"object":"list","data":[{"id":"scripted","object":"model"}]}))
}

async fn chat(State(st): State<St>, headers: HeaderMap, body: Bytes) -> Response {
    let map = headers
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_str().unwrap_or("").to_string()))
        .collect();
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    {
        let mut rec = st.recorded.lock().unwrap();
        rec.headers.push(map);
        rec.bodies.push(v.clone());
    }
    if v["stream"] == true {
        let rx = st.events.lock().unwrap().take();
        let stream = futures_util::stream::unfold(rx, |rx| async move {
            let mut rx = rx?;
            let ev = rx.recv().await?;
            Some((
                Ok::<_, std::io::Error>(Bytes::from(format!("data: {ev}\n\n"))),
                Some(rx),
            ))
        });
        return Response::builder()
            .header("content-type", "text/event-stream")
            .body(Body::from_stream(stream))
            .unwrap();
    }
    Response::builder()
        .header("content-type", "application/json")
        .header("connection", "x-hop")
        .header("x-hop", "secret")
        .body(Body::from(
            r#"{"id":"c","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}"#,
        ))
        .unwrap()
}

impl Scripted {
    pub async fn start() -> (Scripted, mpsc::UnboundedSender<String>) {
        Self::start_with(None).await
    }

    /// Serve over TLS with `tls`'s certificate (an external provider stand-in);
    /// the URL is then `https://localhost:PORT`.
    pub async fn start_tls(
        tls: Arc<rustls::ServerConfig>,
    ) -> (Scripted, mpsc::UnboundedSender<String>) {
        Self::start_with(Some(tls)).await
    }

    async fn start_with(
        tls: Option<Arc<rustls::ServerConfig>>,
    ) -> (Scripted, mpsc::UnboundedSender<String>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let st = St {
            recorded: Default::default(),
            events: Arc::new(Mutex::new(Some(rx))),
        };
        let app = Router::new()
            .route("/v1/models", get(models))
            .route("/v1/chat/completions", post(chat))
            .route("/v1/responses", post(chat))
            .route("/v1/messages", post(chat))
            .route("/v1/custom/thing", post(chat))
            .with_state(st.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let url = match &tls {
            None => format!("http://127.0.0.1:{port}"),
            Some(_) => format!("https://localhost:{port}"),
        };
        match tls {
            None => {
                tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
            }
            Some(cfg) => {
                let acceptor = tokio_rustls::TlsAcceptor::from(cfg);
                tokio::spawn(async move {
                    while let Ok((tcp, _)) = listener.accept().await {
                        let (acceptor, app) = (acceptor.clone(), app.clone());
                        tokio::spawn(async move {
                            let Ok(tls) = acceptor.accept(tcp).await else {
                                return;
                            };
                            let svc = hyper_util::service::TowerToHyperService::new(app);
                            let _ = hyper_util::server::conn::auto::Builder::new(
                                hyper_util::rt::TokioExecutor::new(),
                            )
                            .serve_connection(hyper_util::rt::TokioIo::new(tls), svc)
                            .await;
                        });
                    }
                });
            }
        }
        (
            Scripted {
                url,
                recorded: st.recorded,
                events: st.events,
            },
            tx,
        )
    }
}
