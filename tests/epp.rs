//! `switchyard epp` over gRPC, driven as Envoy's ext_proc filter drives it: the
//! binary in front of simulated workers, a tonic client sending the
//! `ProcessingRequest`s of each body mode and checking the answers' order, the
//! destination header and `envoy.lb` metadata (pick + fallbacks), the response
//! path and the picker's metrics. The real Envoy runs in tests/envoy/.

mod support;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation::Mutation, processing_request::Request, processing_response::Response,
    CommonResponse, HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse,
    ProtocolConfiguration,
};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};
use std::process::Stdio;
use std::time::Duration;
use support::{metric_sum, scrape, sim_model, sims, urls};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Streaming;

/// A running `switchyard epp`: the child and its two addresses.
struct Epp {
    _child: tokio::process::Child,
    grpc: String,
    http: String,
}

/// Start `switchyard epp` over `workers` (one pool, prefix policy) with `extra`
/// TOML lines under `[server]`, and wait for its ready line.
async fn epp(workers: &[String], fallbacks: usize, server_extra: &str) -> Epp {
    let dir = std::env::temp_dir().join(format!("epp-test-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("epp.toml");
    let mut text = format!("[server]\nlisten = \"127.0.0.1:0\"\n{server_extra}\n\n");
    text += &format!(
        "[[pools]]\nname = \"p\"\nmodels = [\"{}\"]\npolicy = \"prefix\"\n",
        sim_model()
    );
    for u in workers {
        text += &format!("\n[[pools.workers]]\nurl = \"{u}\"\n");
    }
    std::fs::write(&cfg, text).unwrap();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args(["epp", "--grpc-listen", "127.0.0.1:0", "--fallbacks"])
        .arg(fallbacks.to_string())
        .arg("--config")
        .arg(&cfg)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("binary starts");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let (grpc, http) = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(l) = lines.next_line().await.unwrap() {
            if let Some(rest) = l.strip_prefix("switchyard epp ready grpc=") {
                let (g, u) = rest.split_once(" url=").expect("grpc and url");
                return (g.to_string(), u.to_string());
            }
        }
        panic!("epp exited before its ready line");
    })
    .await
    .expect("ready line");
    Epp {
        _child: child,
        grpc,
        http,
    }
}

/// One ext_proc stream, as the data plane holds it.
struct Stream {
    tx: mpsc::Sender<ProcessingRequest>,
    rx: Streaming<ProcessingResponse>,
}

impl Stream {
    async fn open(epp: &Epp) -> Stream {
        let mut client = ExternalProcessorClient::connect(format!("http://{}", epp.grpc))
            .await
            .expect("grpc connects");
        let (tx, rx) = mpsc::channel(16);
        let rx = client
            .process(ReceiverStream::new(rx))
            .await
            .expect("stream opens")
            .into_inner();
        Stream { tx, rx }
    }

    async fn send(&self, r: Request, mode: Option<BodySendMode>) {
        let msg = ProcessingRequest {
            request: Some(r),
            protocol_config: mode.map(|m| ProtocolConfiguration {
                request_body_mode: m as i32,
                response_body_mode: m as i32,
                ..Default::default()
            }),
            ..Default::default()
        };
        self.tx.send(msg).await.expect("stream open");
    }

    async fn send_served(&self, r: Request, served: &str) {
        let lb = Struct {
            fields: [(
                "x-gateway-destination-endpoint-served".to_string(),
                Value {
                    kind: Some(Kind::StringValue(served.into())),
                },
            )]
            .into(),
        };
        let msg = ProcessingRequest {
            request: Some(r),
            metadata_context: Some(Metadata {
                filter_metadata: [("envoy.lb".to_string(), lb)].into(),
                ..Default::default()
            }),
            ..Default::default()
        };
        self.tx.send(msg).await.expect("stream open");
    }

    async fn next(&mut self) -> ProcessingResponse {
        tokio::time::timeout(Duration::from_secs(10), self.rx.message())
            .await
            .expect("an answer")
            .expect("no grpc error")
            .expect("stream not closed")
    }
}

fn headers(pairs: &[(&str, &str)], end_of_stream: bool) -> Request {
    Request::RequestHeaders(HttpHeaders {
        headers: Some(HeaderMap {
            headers: pairs
                .iter()
                .map(|(k, v)| HeaderValue {
                    key: k.to_string(),
                    raw_value: v.as_bytes().to_vec(),
                    ..Default::default()
                })
                .collect(),
        }),
        end_of_stream,
        ..Default::default()
    })
}

fn post() -> Request {
    headers(
        &[
            (":method", "POST"),
            (":path", "/v1/chat/completions"),
            ("content-type", "application/json"),
        ],
        false,
    )
}

fn body(bytes: &[u8], end_of_stream: bool) -> Request {
    Request::RequestBody(HttpBody {
        body: bytes.to_vec(),
        end_of_stream,
        ..Default::default()
    })
}

fn response_body(bytes: &[u8], end_of_stream: bool) -> Request {
    Request::ResponseBody(HttpBody {
        body: bytes.to_vec(),
        end_of_stream,
        ..Default::default()
    })
}

fn chat_body(model: &str, prefix: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "model": model, "stream": true, "max_tokens": 4,
        "messages": [{"role": "system", "content": prefix}, {"role": "user", "content": "go"}]
    }))
    .unwrap()
}

fn common(r: &ProcessingResponse) -> &CommonResponse {
    match r.response.as_ref().expect("a response") {
        Response::RequestHeaders(h) | Response::ResponseHeaders(h) => h.response.as_ref(),
        Response::RequestBody(b) | Response::ResponseBody(b) => b.response.as_ref(),
        other => panic!("not a headers/body answer: {other:?}"),
    }
    .expect("common response")
}

/// The destination header an answer sets, if any.
fn destination(r: &ProcessingResponse) -> Option<String> {
    common(r)
        .header_mutation
        .as_ref()?
        .set_headers
        .iter()
        .filter_map(|h| h.header.as_ref())
        .find(|h| h.key == "x-gateway-destination-endpoint")
        .map(|h| String::from_utf8(h.raw_value.clone()).unwrap())
}

/// `envoy.lb` / `x-gateway-destination-endpoint` of an answer's dynamic metadata.
fn metadata_destination(r: &ProcessingResponse) -> Option<String> {
    let lb = r.dynamic_metadata.as_ref()?.fields.get("envoy.lb")?;
    let Some(Kind::StructValue(s)) = &lb.kind else {
        return None;
    };
    match &s.fields.get("x-gateway-destination-endpoint")?.kind {
        Some(Kind::StringValue(v)) => Some(v.clone()),
        _ => None,
    }
}

fn streamed(r: &ProcessingResponse) -> (Vec<u8>, bool) {
    match common(r)
        .body_mutation
        .as_ref()
        .and_then(|m| m.mutation.as_ref())
    {
        Some(Mutation::StreamedResponse(s)) => (s.body.clone(), s.end_of_stream),
        other => panic!("not a streamed body: {other:?}"),
    }
}

fn authority(url: &str) -> &str {
    url.trim_start_matches("http://").trim_end_matches('/')
}

#[tokio::test]
async fn full_duplex_routes_after_the_whole_body_with_fallbacks_and_observes_the_response() {
    let sims = sims(3, 8.0).await;
    let epp = epp(&urls(&sims), 2, "").await;
    let mut s = Stream::open(&epp).await;
    let payload = chat_body(&sim_model(), "full duplex");
    let (a, b) = payload.split_at(payload.len() / 2);
    s.send(post(), Some(BodySendMode::FullDuplexStreamed)).await;
    s.send(body(a, false), None).await;
    s.send(body(b, true), None).await;
    // Nothing is answered before the body is whole: the first answer is the
    // headers', carrying the route.
    let h = s.next().await;
    assert!(
        matches!(h.response, Some(Response::RequestHeaders(_))),
        "{h:?}"
    );
    let dest = destination(&h).expect("destination header");
    assert_eq!(metadata_destination(&h).as_deref(), Some(dest.as_str()));
    let picked: Vec<&str> = dest.split(',').collect();
    let urls = urls(&sims);
    let mut all: Vec<&str> = urls.iter().map(|u| authority(u)).collect();
    let mut sorted = picked.clone();
    sorted.sort();
    all.sort();
    assert_eq!(sorted, all, "the pick and two distinct fallbacks: {dest}");
    let bd = s.next().await;
    assert_eq!(
        streamed(&bd),
        (payload.clone(), true),
        "the body is sent on whole"
    );

    // The response path: the picker sees the served endpoint, headers and SSE.
    let served = picked[1];
    s.send_served(
        headers(
            &[(":status", "200"), ("content-type", "text/event-stream")],
            false,
        )
        .into_response(),
        served,
    )
    .await;
    assert!(matches!(
        s.next().await.response,
        Some(Response::ResponseHeaders(_))
    ));
    let sse = b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":3}}\n\ndata: [DONE]\n\n";
    s.send(response_body(sse, true), None).await;
    let rb = s.next().await;
    assert_eq!(
        streamed(&rb),
        (sse.to_vec(), true),
        "the response passes unchanged"
    );
    drop(s);
    let text = scrape(&epp.http).await;
    let picked_n = metric_sum(
        &text,
        "switchyard_epp_decisions_total",
        &[("result", "picked")],
    );
    assert_eq!(picked_n, 1.0);
    assert!(metric_sum(&text, "switchyard_epp_decision_seconds", &[]) >= 1.0);
    let worker = format!("http://{served}");
    let out = metric_sum(
        &text,
        "switchyard_tokens_total",
        &[("worker", worker.as_str()), ("kind", "output")],
    );
    assert_eq!(
        out, 3.0,
        "usage recorded for the worker that served:\n{text}"
    );
}

trait IntoResponse {
    fn into_response(self) -> Request;
}

impl IntoResponse for Request {
    fn into_response(self) -> Request {
        match self {
            Request::RequestHeaders(h) => Request::ResponseHeaders(h),
            other => other,
        }
    }
}

#[tokio::test]
async fn buffered_body_answer_carries_the_route_and_a_shared_prefix_sticks() {
    let sims = sims(3, 8.0).await;
    let epp = epp(&urls(&sims), 0, "").await;
    let prefix = "a long shared system prompt ".repeat(40);
    let mut first = None;
    for _ in 0..4 {
        let mut s = Stream::open(&epp).await;
        s.send(post(), Some(BodySendMode::Buffered)).await;
        let h = s.next().await;
        assert!(matches!(h.response, Some(Response::RequestHeaders(_))));
        assert_eq!(
            destination(&h),
            None,
            "headers pass before the body is seen"
        );
        s.send(body(&chat_body(&sim_model(), &prefix), true), None)
            .await;
        let b = s.next().await;
        assert!(
            matches!(b.response, Some(Response::RequestBody(_))),
            "{b:?}"
        );
        let dest = destination(&b).expect("destination on the body answer");
        assert!(!dest.contains(','), "no fallbacks asked: {dest}");
        assert_eq!(metadata_destination(&b).as_deref(), Some(dest.as_str()));
        assert_eq!(*first.get_or_insert(dest.clone()), dest, "prefix affinity");
    }
}

#[tokio::test]
async fn streamed_body_is_switched_to_buffered_and_errors_are_immediate_responses() {
    let sims = sims(1, 8.0).await;
    let epp = epp(&urls(&sims), 2, "max_body_bytes = 2048").await;

    let mut s = Stream::open(&epp).await;
    s.send(post(), Some(BodySendMode::Streamed)).await;
    let h = s.next().await;
    let mode = h.mode_override.expect("a mode override");
    assert_eq!(mode.request_body_mode, BodySendMode::Buffered as i32);
    // Not honoured (the filter forbids overrides): chunks pass, the last routes.
    s.send(body(b"{\"model\":", false), None).await;
    assert_eq!(destination(&s.next().await), None);
    s.send(
        body(format!("\"{}\"}}", sim_model()).as_bytes(), true),
        None,
    )
    .await;
    let one = sims[0].url();
    assert_eq!(
        destination(&s.next().await).as_deref(),
        Some(authority(&one))
    );

    let immediate = |r: ProcessingResponse| match r.response {
        Some(Response::ImmediateResponse(i)) => i,
        other => panic!("not an immediate response: {other:?}"),
    };
    let mut s = Stream::open(&epp).await;
    s.send(post(), Some(BodySendMode::FullDuplexStreamed)).await;
    s.send(body(&chat_body("no-such-model", "x"), true), None)
        .await;
    let i = immediate(s.next().await);
    assert_eq!(i.status.unwrap().code, 404);
    let err: serde_json::Value = serde_json::from_slice(&i.body).unwrap();
    assert_eq!(err["error"]["code"], "model_not_found", "{err}");

    let mut s = Stream::open(&epp).await;
    s.send(post(), Some(BodySendMode::FullDuplexStreamed)).await;
    s.send(body(&vec![b' '; 4096], false), None).await;
    assert_eq!(immediate(s.next().await).status.unwrap().code, 413);

    let text = scrape(&epp.http).await;
    for (result, status) in [("unknown_model", "404"), ("body_too_large", "413")] {
        let n = metric_sum(
            &text,
            "switchyard_epp_decisions_total",
            &[("result", result), ("status", status)],
        );
        assert_eq!(n, 1.0, "{result}:\n{text}");
    }
}

#[tokio::test]
async fn a_request_without_a_body_goes_to_an_available_worker() {
    let sims = sims(2, 8.0).await;
    let epp = epp(&urls(&sims), 0, "").await;
    let mut s = Stream::open(&epp).await;
    s.send(
        headers(&[(":method", "GET"), (":path", "/v1/models")], true),
        Some(BodySendMode::FullDuplexStreamed),
    )
    .await;
    let h = s.next().await;
    let dest = destination(&h).expect("a destination");
    assert!(sims.iter().any(|x| authority(&x.url()) == dest), "{dest}");
}

#[tokio::test]
async fn grpc_health_reports_liveness_and_readiness() {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{health_client::HealthClient, HealthCheckRequest};
    let sims = sims(1, 8.0).await;
    let epp = epp(&urls(&sims), 0, "").await;
    let channel = tonic::transport::Channel::from_shared(format!("http://{}", epp.grpc))
        .unwrap()
        .connect()
        .await
        .expect("grpc connects");
    let mut client = HealthClient::new(channel);
    for service in [
        "liveness",
        "readiness",
        "",
        "envoy.service.ext_proc.v3.ExternalProcessor",
    ] {
        let c = client.clone();
        support::eventually(Duration::from_secs(10), service, || {
            let mut c = c.clone();
            async move {
                let r = c
                    .check(HealthCheckRequest {
                        service: service.into(),
                    })
                    .await
                    .ok()?;
                (r.into_inner().status == ServingStatus::Serving as i32).then_some(())
            }
        })
        .await;
    }
    let unknown = client
        .check(HealthCheckRequest {
            service: "no.such.Service".into(),
        })
        .await;
    assert_eq!(unknown.unwrap_err().code(), tonic::Code::NotFound);
}

/// Answers observed through the picker teach the worker's latency model, as
/// proxied ones do: after its first samples, its predictions are exported.
#[tokio::test]
async fn observed_answers_teach_the_workers_latency_model() {
    let sims = sims(1, 8.0).await;
    let epp = epp(&urls(&sims), 0, "").await;
    let sse = b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\ndata: [DONE]\n\n";
    let mut served = String::new();
    for i in 0..12 {
        let mut s = Stream::open(&epp).await;
        s.send(post(), Some(BodySendMode::FullDuplexStreamed)).await;
        s.send(body(&chat_body(&sim_model(), &format!("q{i}")), true), None)
            .await;
        served = destination(&s.next().await).expect("destination");
        s.next().await; // the body, passed on
        let ok = headers(
            &[(":status", "200"), ("content-type", "text/event-stream")],
            false,
        );
        s.send_served(ok.into_response(), &served).await;
        s.next().await;
        s.send(response_body(sse, true), None).await;
        s.next().await;
    }
    let text = scrape(&epp.http).await;
    let worker = format!("http://{served}");
    let predicted = metric_sum(
        &text,
        "switchyard_predicted_ttft_seconds_count",
        &[("worker", worker.as_str())],
    );
    assert!(predicted >= 1.0, "no predictions for {worker}:\n{text}");
}

/// Issue 31: engine control paths never get a destination from the picker,
/// whatever the body (the picker has no admin scope to check).
#[tokio::test]
async fn engine_control_paths_are_refused_before_a_pick() {
    let sims = sims(1, 8.0).await;
    let epp = epp(&urls(&sims), 0, "").await;
    for (path, end) in [
        ("/v1/load_lora_adapter", false),
        ("/reset_prefix_cache?x=1", true),
        ("/flush_cache", true),
    ] {
        let mut s = Stream::open(&epp).await;
        s.send(
            headers(&[(":method", "POST"), (":path", path)], end),
            Some(BodySendMode::FullDuplexStreamed),
        )
        .await;
        match s.next().await.response {
            Some(Response::ImmediateResponse(i)) => {
                assert_eq!(i.status.unwrap().code, 404, "{path}");
            }
            other => panic!("{path}: not refused: {other:?}"),
        }
    }
    let text = scrape(&epp.http).await;
    let n = metric_sum(
        &text,
        "switchyard_route_refusals_total",
        &[("reason", "control_route")],
    );
    assert_eq!(n, 3.0, "{text}");
}
