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
    CommonResponse, HttpBody, HttpHeaders, ImmediateResponse, ProcessingRequest,
    ProcessingResponse, ProtocolConfiguration,
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
    epp_with(workers, fallbacks, server_extra, "").await
}

/// [`epp`] with `tail` (top-level tables: tenants, access log) after the pool.
async fn epp_with(workers: &[String], fallbacks: usize, server_extra: &str, tail: &str) -> Epp {
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
    text += &format!("\n{tail}\n");
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

    assert_one_decision_each(&epp, &[("unknown_model", "404"), ("body_too_large", "413")]).await;
}

#[tokio::test]
async fn a_request_without_a_body_goes_to_an_available_worker() {
    let sims = sims(2, 8.0).await;
    let epp = epp(&urls(&sims), 0, "").await;
    let mut s = Stream::open(&epp).await;
    // `/v1/models` is answered by the picker itself (the caller's list).
    s.send(
        headers(&[(":method", "GET"), (":path", "/version")], true),
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

// ---- Issue 31: the picker holds requests to the proxy's trust rules ----

const NARROW_KEY: &str = "sk-epp-narrow-5d1e2f";
const RPM_KEY: &str = "sk-epp-rpm-7a9b3c";
const TOK_KEY: &str = "sk-epp-tok-0c4d8e";
const CONC_KEY: &str = "sk-epp-conc-9f2a6b";

fn sha256_hex(key: &str) -> String {
    switchyard::tenancy::keys::digest(key.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A picker with keyed tenants (one limit each) and an access log, over one sim.
async fn tenant_epp(
    name: &str,
    server_extra: &str,
) -> (Epp, std::path::PathBuf, Vec<switchyard::sim::SimHandle>) {
    let sims = sims(1, 8.0).await;
    let log = std::env::temp_dir().join(format!("epp-{name}-{}.jsonl", uuid::Uuid::new_v4()));
    let tail = format!(
        r#"[access_log]
enabled = true
path = "{log}"
[[tenants]]
name = "narrow"
key_sha256 = "{narrow}"
allowed_models = ["other-*"]
[[tenants]]
name = "rpm"
key_sha256 = "{rpm}"
[tenants.limits]
requests_per_minute = 2
[[tenants]]
name = "tok"
key_sha256 = "{tok}"
[tenants.limits]
tokens_per_minute = 600
[[tenants]]
name = "conc"
key_sha256 = "{conc}"
[tenants.limits]
max_concurrent_requests = 1
"#,
        log = log.display(),
        narrow = sha256_hex(NARROW_KEY),
        rpm = sha256_hex(RPM_KEY),
        tok = sha256_hex(TOK_KEY),
        conc = sha256_hex(CONC_KEY),
    );
    let epp = epp_with(&urls(&sims), 0, server_extra, &tail).await;
    (epp, log, sims)
}

/// The picker's answer to one request: a pick (the stream kept for the
/// response path) or an immediate response.
enum Answer {
    Picked(String, Stream),
    Refused(ImmediateResponse),
}

impl Answer {
    fn refused(self) -> ImmediateResponse {
        match self {
            Answer::Refused(i) => i,
            Answer::Picked(d, _) => panic!("picked {d}, expected a refusal"),
        }
    }

    fn picked(self) -> Stream {
        match self {
            Answer::Picked(_, s) => s,
            Answer::Refused(i) => panic!(
                "refused {:?}: {}",
                i.status,
                String::from_utf8_lossy(&i.body)
            ),
        }
    }
}

/// One full-duplex request: `hs` (with `:method`, `:path`), then `body` if
/// any; `source`: the `source.address` attribute the data plane reports.
async fn ask(
    epp: &Epp,
    hs: &[(&str, &str)],
    body_bytes: Option<&[u8]>,
    source: Option<&str>,
) -> Answer {
    let mut s = Stream::open(epp).await;
    let attributes = source.map(|a| {
        let fields = [(
            "source.address".to_string(),
            Value {
                kind: Some(Kind::StringValue(a.into())),
            },
        )];
        (
            "envoy.filters.http.ext_proc".to_string(),
            Struct {
                fields: fields.into(),
            },
        )
    });
    let first = ProcessingRequest {
        request: Some(headers(hs, body_bytes.is_none())),
        protocol_config: Some(ProtocolConfiguration {
            request_body_mode: BodySendMode::FullDuplexStreamed as i32,
            response_body_mode: BodySendMode::FullDuplexStreamed as i32,
            ..Default::default()
        }),
        attributes: attributes.into_iter().collect(),
        ..Default::default()
    };
    s.tx.send(first).await.expect("stream open");
    if let Some(b) = body_bytes {
        // The picker may have answered the headers already and closed.
        let _ =
            s.tx.send(ProcessingRequest {
                request: Some(body(b, true)),
                ..Default::default()
            })
            .await;
    }
    let r = s.next().await;
    if let Some(Response::ImmediateResponse(i)) = r.response {
        return Answer::Refused(i);
    }
    let dest = destination(&r).expect("a destination");
    if body_bytes.is_some() {
        s.next().await; // the body, passed on
    }
    Answer::Picked(dest, s)
}

/// The picked request's answer: SSE with `usage`, through the picker. Returns
/// the headers the picker added to the response.
async fn answer(s: &mut Stream, prompt: u64, output: u64) -> Vec<(String, String)> {
    let ok = headers(
        &[(":status", "200"), ("content-type", "text/event-stream")],
        false,
    );
    s.send(ok.into_response(), None).await;
    let h = s.next().await;
    let added = common(&h)
        .header_mutation
        .iter()
        .flat_map(|m| &m.set_headers)
        .filter_map(|h| h.header.as_ref())
        .map(|h| {
            (
                h.key.clone(),
                String::from_utf8_lossy(&h.raw_value).into_owned(),
            )
        })
        .collect();
    let sse = format!(
        "data: {{\"choices\":[{{\"delta\":{{\"content\":\"hi\"}}}}]}}\n\n\
         data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":{prompt},\"completion_tokens\":{output}}}}}\n\ndata: [DONE]\n\n"
    );
    s.send(response_body(sse.as_bytes(), true), None).await;
    s.next().await;
    added
}

fn chat_post(key: &str, request_id: &str) -> Vec<(&'static str, String)> {
    vec![
        (":method", "POST".into()),
        (":path", "/v1/chat/completions".into()),
        ("content-type", "application/json".into()),
        ("authorization", format!("Bearer {key}")),
        ("x-request-id", request_id.into()),
    ]
}

fn refs<'a>(v: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    v.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

fn chat_max(max_tokens: u64) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "model": sim_model(), "stream": true, "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "hello"}]
    }))
    .unwrap()
}

fn error_of(i: &ImmediateResponse) -> serde_json::Value {
    serde_json::from_slice::<serde_json::Value>(&i.body).unwrap()["error"].clone()
}

fn immediate_header(i: &ImmediateResponse, name: &str) -> Option<String> {
    i.headers
        .as_ref()?
        .set_headers
        .iter()
        .filter_map(|h| h.header.as_ref())
        .find(|h| h.key == name)
        .map(|h| String::from_utf8_lossy(&h.raw_value).into_owned())
}

async fn log_line(path: &std::path::Path, request_id: &str) -> serde_json::Value {
    support::eventually(Duration::from_secs(10), "access-log line", || {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        let found = text
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .find(|v| v["request_id"] == request_id);
        async move { found }
    })
    .await
}

/// A tenant not allowed the model gets no pick (403); over its request rate
/// a 429 with `Retry-After`; both logged with the tenant and the client.
#[tokio::test]
async fn the_picker_refuses_models_a_tenant_may_not_use_and_requests_over_its_rate() {
    let (epp, log, sims) = tenant_epp("rpm", "").await;
    let h = chat_post(NARROW_KEY, "epp-narrow-1");
    let i = ask(
        &epp,
        &refs(&h),
        Some(&chat_max(4)),
        Some("203.0.113.7:4444"),
    )
    .await
    .refused();
    assert_eq!(i.status.unwrap().code, 403);
    assert_eq!(error_of(&i)["code"], "model_not_allowed");
    let line = log_line(&log, "epp-narrow-1").await;
    assert_eq!(line["status"], 403);
    assert_eq!(line["tenant"], "narrow");
    assert_eq!(line["client"], "203.0.113.7");

    for n in 0..2 {
        let h = chat_post(RPM_KEY, &format!("epp-rpm-{n}"));
        ask(&epp, &refs(&h), Some(&chat_max(4)), None)
            .await
            .picked();
    }
    let h = chat_post(RPM_KEY, "epp-rpm-2");
    let i = ask(&epp, &refs(&h), Some(&chat_max(4)), None)
        .await
        .refused();
    assert_eq!(i.status.unwrap().code, 429);
    assert_eq!(error_of(&i)["param"], "requests_per_minute");
    assert!(immediate_header(&i, "retry-after").is_some(), "{i:?}");
    let line = log_line(&log, "epp-rpm-2").await;
    assert_eq!(line["status"], 429);
    assert_eq!(line["tenant"], "rpm");
    assert_eq!(
        line["client"], "127.0.0.1",
        "the gRPC peer without an attribute"
    );
    assert_eq!(
        sims[0].requests_received(),
        0,
        "the picker forwards nothing itself"
    );
    assert_one_decision_each(
        &epp,
        &[("model_not_allowed", "403"), ("requests_per_minute", "429")],
    )
    .await;
}

/// Tokens per minute: the worst case (`max_tokens`) is reserved at the pick;
/// a request over the whole limit can never fit (400); a completed answer's
/// usage settles its reservation, one whose answer is never seen keeps it.
#[tokio::test]
async fn the_picker_reserves_the_worst_case_and_settles_on_the_observed_usage() {
    let (epp, _log, _sims) = tenant_epp("tok", "").await;
    let never = chat_post(TOK_KEY, "epp-tok-never");
    let i = ask(&epp, &refs(&never), Some(&chat_max(2000)), None)
        .await
        .refused();
    assert_eq!(i.status.unwrap().code, 400);
    assert_eq!(error_of(&i)["code"], "request_exceeds_limit");

    let h = chat_post(TOK_KEY, "epp-tok-1");
    let mut first = ask(&epp, &refs(&h), Some(&chat_max(250)), None)
        .await
        .picked();
    let h = chat_post(TOK_KEY, "epp-tok-2");
    let second = ask(&epp, &refs(&h), Some(&chat_max(250)), None)
        .await
        .picked();
    drop(second); // its answer is never seen: the reservation stands
    let h = chat_post(TOK_KEY, "epp-tok-3");
    let i = ask(&epp, &refs(&h), Some(&chat_max(250)), None)
        .await
        .refused();
    assert_eq!(
        i.status.unwrap().code,
        429,
        "two worst cases fill 600 tokens"
    );
    assert_eq!(error_of(&i)["param"], "tokens_per_minute");
    // The first answer used 10 tokens: its reservation is refunded.
    let added = answer(&mut first, 5, 5).await;
    assert!(
        added.iter().any(|(k, _)| k.starts_with("x-ratelimit-")),
        "the tenant's rate headers on the response: {added:?}"
    );
    let h = chat_post(TOK_KEY, "epp-tok-4");
    ask(&epp, &refs(&h), Some(&chat_max(250)), None)
        .await
        .picked();
}

/// A concurrency slot is held from the pick until the exchange ends: the
/// answer's end, or the data plane dropping the stream.
#[tokio::test]
async fn the_pickers_concurrency_slots_are_released_when_exchanges_end() {
    let (epp, _log, _sims) = tenant_epp("conc", "").await;
    let h = chat_post(CONC_KEY, "epp-conc-1");
    let mut held = ask(&epp, &refs(&h), Some(&chat_max(4)), None)
        .await
        .picked();
    let i = ask(&epp, &refs(&h), Some(&chat_max(4)), None)
        .await
        .refused();
    assert_eq!(i.status.unwrap().code, 429);
    assert_eq!(error_of(&i)["param"], "max_concurrent_requests");
    answer(&mut held, 3, 3).await;
    // Released at the answer's end (the picker answered it only after).
    let again = ask(&epp, &refs(&h), Some(&chat_max(4)), None)
        .await
        .picked();
    let i = ask(&epp, &refs(&h), Some(&chat_max(4)), None)
        .await
        .refused();
    assert_eq!(i.status.unwrap().code, 429);
    // The data plane drops the stream without a response: released too.
    drop(again);
    let epp = &epp;
    let h = &h;
    support::eventually(Duration::from_secs(10), "slot released", || async move {
        match ask(epp, &refs(h), Some(&chat_max(4)), None).await {
            Answer::Picked(..) => Some(()),
            Answer::Refused(_) => None,
        }
    })
    .await;
}

/// Stored responses cannot be bound to their tenant by the picker: by-id
/// calls and continuations are refused with a clear error, never picked.
#[tokio::test]
async fn stored_state_calls_are_refused_by_the_picker() {
    let sims = sims(1, 8.0).await;
    let epp = epp(&urls(&sims), 0, "").await;
    for (method, path) in [
        ("GET", "/v1/responses/resp_abc"),
        ("DELETE", "/v1/responses/resp_abc"),
        ("POST", "/v1/responses/resp_abc/cancel"),
        ("GET", "/v1/responses/resp_abc/input_items?limit=1"),
    ] {
        let i = ask(&epp, &[(":method", method), (":path", path)], None, None)
            .await
            .refused();
        assert_eq!(i.status.unwrap().code, 501, "{method} {path}");
        assert_eq!(error_of(&i)["code"], "proxy_mode_required", "{path}");
    }
    let cont = serde_json::to_vec(&serde_json::json!({
        "model": sim_model(), "input": "and then?", "previous_response_id": "resp_abc"
    }))
    .unwrap();
    let hs = [(":method", "POST"), (":path", "/v1/responses")];
    let i = ask(&epp, &hs, Some(&cont), None).await.refused();
    assert_eq!(i.status.unwrap().code, 501);
    assert_eq!(error_of(&i)["param"], "previous_response_id");
    let fresh =
        serde_json::to_vec(&serde_json::json!({"model": sim_model(), "input": "hi"})).unwrap();
    ask(&epp, &hs, Some(&fresh), None).await.picked();
}

/// A request without a body is admitted too: a wrong key is a 401, logged
/// with the client (`x-forwarded-for` believed only from a trusted peer).
#[tokio::test]
async fn a_bodyless_request_with_a_wrong_key_is_refused_and_logged_with_its_client() {
    let (epp, log, _sims) = tenant_epp("keys", "trusted_proxies = [\"127.0.0.1\"]").await;
    let wrong = "sk-epp-WRONG";
    let bearer = format!("Bearer {wrong}");
    let get = |id: &'static str, xff: &'static str| {
        vec![
            (":method", "GET".to_string()),
            (":path", "/v1/models".to_string()),
            ("authorization", bearer.clone()),
            ("x-request-id", id.to_string()),
            ("x-forwarded-for", xff.to_string()),
        ]
    };
    // Through a trusted peer (the gRPC peer, 127.0.0.1): its forwarded client.
    let h = get("epp-wrong-1", "6.6.6.6, 198.51.100.4");
    let i = ask(&epp, &refs(&h), None, None).await.refused();
    assert_eq!(i.status.unwrap().code, 401);
    assert_eq!(error_of(&i)["code"], "invalid_api_key");
    // The data plane names an untrusted peer: its header proves nothing.
    let h = get("epp-wrong-2", "198.51.100.4");
    let i = ask(&epp, &refs(&h), None, Some("203.0.113.9:5000"))
        .await
        .refused();
    assert_eq!(i.status.unwrap().code, 401);
    let line = log_line(&log, "epp-wrong-1").await;
    assert_eq!(line["status"], 401);
    assert_eq!(line["tenant"], "anonymous");
    assert_eq!(line["client"], "198.51.100.4");
    let line = log_line(&log, "epp-wrong-2").await;
    assert_eq!(line["client"], "203.0.113.9");
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(!text.contains(wrong), "no key in the log");
    // The picker answers the model list itself, showing what the key may use.
    let list = |key: &'static str, path: &'static str| {
        let auth = format!("Bearer {key}");
        let epp = &epp;
        async move {
            let hs = [
                (":method", "GET"),
                (":path", path),
                ("authorization", &auth),
            ];
            ask(epp, &hs, None, None).await.refused()
        }
    };
    let all = list(RPM_KEY, "/v1/models").await;
    assert_eq!(all.status.unwrap().code, 200);
    let v: serde_json::Value = serde_json::from_slice(&all.body).unwrap();
    let ids: Vec<&str> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, [sim_model()], "{v}");
    let narrow = list(NARROW_KEY, "/v1/models").await;
    let v: serde_json::Value = serde_json::from_slice(&narrow.body).unwrap();
    assert_eq!(
        v["data"],
        serde_json::json!([]),
        "a model it may not use is not listed"
    );
    let one = format!("/v1/models/{}", sim_model());
    let one: &'static str = Box::leak(one.into_boxed_str());
    assert_eq!(list(RPM_KEY, one).await.status.unwrap().code, 200);
    assert_eq!(list(NARROW_KEY, one).await.status.unwrap().code, 404);
}

/// Each `(result, status)` pair counted exactly once in the picker's decisions.
async fn assert_one_decision_each(epp: &Epp, pairs: &[(&str, &str)]) {
    let text = scrape(&epp.http).await;
    for &(result, status) in pairs {
        let n = metric_sum(
            &text,
            "switchyard_epp_decisions_total",
            &[("result", result), ("status", status)],
        );
        assert_eq!(n, 1.0, "{result}:\n{text}");
    }
}
