//! What a client may claim, tried from the hostile side against the real
//! `switchyard serve` / `switchyard epp` binaries in front of simulated engines:
//! a `low` tenant and an anonymous caller asking for `critical` are queued at
//! their own class (shown by the queue's per-class depth, the answer order and
//! the access log), an unknown class is a 400, a wrong key is a 401 (logged
//! with the client's address, never the key) although keys are optional,
//! `x-forwarded-for` counts only from a trusted proxy, `/v1/models` shows what
//! the key may use, the picker caps priority too, and `check-config` warns
//! about open configurations.

mod support;

use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;
use support::{eventually, metric_sum, scrape, serve_binary_with, sim_model};
use switchyard::sim::SimHandle;

const LOW_KEY: &str = "sk-low-trust-claims-8c1f0e";
const ACME_KEY: &str = "sk-acme-trust-claims-27ad9b";

/// A gateway process and the files it writes.
struct Gw {
    _child: tokio::process::Child,
    url: String,
    access_log: std::path::PathBuf,
}

/// Start the binary with `toml` (`{log}` replaced by the access log's path).
async fn serve(name: &str, toml: &str) -> Gw {
    let file = support::config_file(&format!("trust-{name}"), "");
    let log = file.with_file_name("access.jsonl");
    let _ = std::fs::remove_file(&log);
    let text = format!(
        "[access_log]\nenabled = true\npath = \"{}\"\n{toml}",
        log.display()
    );
    std::fs::write(&file, text).unwrap();
    let env = [
        ("SY_TRUST_LOW_KEY", LOW_KEY),
        ("SY_TRUST_ACME_KEY", ACME_KEY),
    ];
    let r = serve_binary_with(&file, &env, None).await;
    Gw {
        _child: r.child,
        url: r.url,
        access_log: log,
    }
}

/// A slow simulated engine: a blocking stream holds its one slot until dropped.
async fn slow_sim() -> SimHandle {
    let cfg = switchyard::sim::SimConfig {
        time_scale: 0.2,
        ..switchyard::sim::SimConfig::profile("tiny").unwrap()
    };
    switchyard::sim::spawn(cfg).await.expect("sim starts")
}

fn body(max_tokens: u32, stream: bool) -> Value {
    json!({"model": sim_model(), "max_tokens": max_tokens, "ignore_eos": true, "stream": stream,
           "messages": [{"role": "user", "content": "who goes first"}]})
}

/// POST a chat completion with `headers`: status and JSON body.
async fn post(url: &str, headers: &[(&str, &str)], b: &Value) -> (u16, Value) {
    let mut req = support::client()
        .post(format!("{url}/v1/chat/completions"))
        .json(b);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let r = req.send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// A stream that holds the worker's only slot until the task is aborted.
fn blocker(url: &str) -> tokio::task::JoinHandle<()> {
    let url = url.to_string();
    tokio::spawn(async move {
        let r = support::client()
            .post(format!("{url}/v1/chat/completions"))
            .json(&body(2000, true))
            .send()
            .await
            .unwrap();
        let _ = r.text().await;
    })
}

/// Wait until pool `p`'s queue holds `n` requests of `class`.
async fn queued(url: &str, class: &str, n: f64) {
    eventually(Duration::from_secs(20), "requests queued", || async move {
        let m = scrape(url).await;
        let depth = metric_sum(
            &m,
            "switchyard_queue_depth",
            &[("pool", "p"), ("class", class)],
        );
        (depth == n).then_some(())
    })
    .await
}

/// The access-log lines once `pred` holds for one of them.
async fn log_line(path: &std::path::Path, pred: impl Fn(&Value) -> bool) -> Value {
    eventually(Duration::from_secs(10), "access-log line", || {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        let found = text
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .find(|v| pred(v));
        async move { found }
    })
    .await
}

fn claims(m: &str, claim: &str, action: &str) -> f64 {
    metric_sum(
        m,
        "switchyard_client_claims_total",
        &[("claim", claim), ("action", action)],
    )
}

/// A pool of one slot (`max_concurrency_per_worker = 1`) with a queue.
fn queued_pool(sim: &SimHandle) -> String {
    format!(
        "[[pools]]\nname = \"p\"\nmodels = [\"{}\"]\nmax_concurrency_per_worker = 1\n\
         workers = [{{ url = \"{}\" }}]\n[pools.flow_control]\nmax_waiting = 16\n",
        sim_model(),
        sim.url()
    )
}

#[tokio::test]
async fn a_low_tenant_asking_for_critical_is_queued_as_low() {
    let s = slow_sim().await;
    let gw = serve(
        "low",
        &format!(
            "[[tenants]]\nname = \"lowco\"\napi_key_env = \"SY_TRUST_LOW_KEY\"\npriority = \"low\"\n{}",
            queued_pool(&s)
        ),
    )
    .await;
    let hold = blocker(&gw.url);
    eventually(Duration::from_secs(20), "the slot taken", || async {
        (s.requests_received() >= 1).then_some(())
    })
    .await;
    let order = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let send = |who: &'static str, headers: Vec<(&'static str, String)>| {
        let (url, order) = (gw.url.clone(), order.clone());
        tokio::spawn(async move {
            let h: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
            let (st, _) = post(&url, &h, &body(3, false)).await;
            order.lock().push(who);
            st
        })
    };
    let bearer = format!("Bearer {LOW_KEY}");
    let low = send(
        "lowco",
        vec![
            ("authorization", bearer),
            ("x-switchyard-priority", "critical".into()),
        ],
    );
    queued(&gw.url, "low", 1.0).await;
    let normal = send("anonymous", vec![]);
    queued(&gw.url, "normal", 1.0).await;
    let m = scrape(&gw.url).await;
    let crit = metric_sum(
        &m,
        "switchyard_queue_depth",
        &[("pool", "p"), ("class", "critical")],
    );
    assert_eq!(crit, 0.0, "nothing waits as critical");
    assert!(claims(&m, "priority", "capped") >= 1.0);
    hold.abort();
    assert_eq!(low.await.unwrap(), 200);
    assert_eq!(normal.await.unwrap(), 200);
    assert_eq!(
        *order.lock(),
        ["anonymous", "lowco"],
        "the normal request that came later went first"
    );
    let line = log_line(&gw.access_log, |v| v["tenant"] == "lowco").await;
    assert_eq!(line["priority"], "low", "{line}");
    assert_eq!(line["status"], 200);
}

#[tokio::test]
async fn anonymous_critical_is_capped_and_an_unknown_class_refused() {
    let s = slow_sim().await;
    let gw = serve("anon", &queued_pool(&s)).await;
    let hold = blocker(&gw.url);
    eventually(Duration::from_secs(20), "the slot taken", || async {
        (s.requests_received() >= 1).then_some(())
    })
    .await;
    let url = gw.url.clone();
    let crit = tokio::spawn(async move {
        post(
            &url,
            &[("x-switchyard-priority", "critical")],
            &body(3, false),
        )
        .await
    });
    queued(&gw.url, "normal", 1.0).await;
    let m = scrape(&gw.url).await;
    assert_eq!(
        metric_sum(
            &m,
            "switchyard_queue_depth",
            &[("pool", "p"), ("class", "critical")]
        ),
        0.0
    );
    // An unknown class: a 400 naming the classes, not a silent `normal`.
    let (st, v) = post(
        &gw.url,
        &[("x-switchyard-priority", "urgent")],
        &body(3, false),
    )
    .await;
    assert_eq!(st, 400, "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("urgent") && msg.contains("critical, high, normal, low"),
        "{msg}"
    );
    hold.abort();
    assert_eq!(crit.await.unwrap().0, 200);
    let line = log_line(&gw.access_log, |v| v["status"] == 400).await;
    assert_eq!(line["error"], "invalid_request", "{line}");
    let served = log_line(&gw.access_log, |v| {
        v["status"] == 200 && v["output_tokens"] == 3
    })
    .await;
    assert_eq!(served["priority"], "normal", "{served}");
}

#[tokio::test]
async fn a_wrong_key_is_refused_and_logged_with_the_client_address() {
    let s = support::sims(1, 20.0).await;
    let gw = serve(
        "keys",
        &format!(
            "[[tenants]]\nname = \"acme\"\napi_key_env = \"SY_TRUST_ACME_KEY\"\n{}",
            support::pool_toml(&sim_model(), &[s[0].url().as_str()], "")
        ),
    )
    .await;
    // Keys are optional, but a wrong one is not served as anonymous.
    let wrong = "sk-acme-trust-claims-WRONG";
    let (st, v) = post(
        &gw.url,
        &[
            ("authorization", &format!("Bearer {wrong}")),
            ("x-request-id", "wrong-key-1"),
        ],
        &body(2, false),
    )
    .await;
    assert_eq!(st, 401, "{v}");
    assert_eq!(v["error"]["code"], "invalid_api_key");
    let (st, _) = post(&gw.url, &[("x-api-key", wrong)], &body(2, false)).await;
    assert_eq!(st, 401);
    assert_eq!(s[0].requests_received(), 0, "nothing reached the engine");
    // No key at all is anonymous; the right key is acme.
    assert_eq!(post(&gw.url, &[], &body(2, false)).await.0, 200);
    let acme = format!("Bearer {ACME_KEY}");
    assert_eq!(
        post(&gw.url, &[("authorization", &acme)], &body(2, false))
            .await
            .0,
        200
    );
    let line = log_line(&gw.access_log, |v| v["request_id"] == "wrong-key-1").await;
    assert_eq!(line["status"], 401);
    assert_eq!(line["error"], "invalid_api_key");
    assert_eq!(line["client"], "127.0.0.1");
    assert_eq!(line["tenant"], "anonymous");
    let text = std::fs::read_to_string(&gw.access_log).unwrap();
    assert!(
        !text.contains(wrong) && !text.contains(ACME_KEY),
        "no key in the log"
    );
}

#[tokio::test]
async fn forwarded_for_is_believed_only_from_trusted_proxies() {
    let s = support::sims(1, 20.0).await;
    let gw = serve(
        "xff",
        &format!(
            "[server]\ntrusted_proxies = [\"127.0.0.2\"]\n{}",
            support::pool_toml(&sim_model(), &[s[0].url().as_str()], "")
        ),
    )
    .await;
    let from = |src: &str| {
        reqwest::Client::builder()
            .local_address(src.parse::<std::net::IpAddr>().unwrap())
            .build()
            .unwrap()
    };
    // The client forges a left-most hop; the trusted proxy appended the real one.
    let xff = "6.6.6.6, 203.0.113.7";
    for (src, id) in [("127.0.0.1", "xff-untrusted"), ("127.0.0.2", "xff-trusted")] {
        let r = from(src)
            .post(format!("{}/v1/chat/completions", gw.url))
            .header("x-forwarded-for", xff)
            .header("x-request-id", id)
            .json(&body(2, false))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    let untrusted = log_line(&gw.access_log, |v| v["request_id"] == "xff-untrusted").await;
    assert_eq!(
        untrusted["client"], "127.0.0.1",
        "an untrusted peer's header is ignored"
    );
    let trusted = log_line(&gw.access_log, |v| v["request_id"] == "xff-trusted").await;
    assert_eq!(
        trusted["client"], "203.0.113.7",
        "the first untrusted hop, not the forged one"
    );
}

#[tokio::test]
async fn the_model_list_shows_what_the_key_may_use() {
    let s = support::sims(1, 20.0).await;
    let u = s[0].url();
    let gw = serve(
        "models",
        &format!(
            "[tenancy]\nlist_models_without_key = false\n\
             [[tenants]]\nname = \"acme\"\napi_key_env = \"SY_TRUST_ACME_KEY\"\nallowed_models = [\"{m}\"]\n\
             [[pools]]\nname = \"a\"\nmodels = [\"{m}\"]\nworkers = [{{ url = \"{u}\" }}]\n\
             [[pools]]\nname = \"b\"\nmodels = [\"secret-model\"]\nupstream_model = \"{m}\"\nworkers = [{{ url = \"{u}\" }}]\n",
            m = sim_model()
        ),
    )
    .await;
    let get = |path: &str, key: Option<&str>| {
        let mut r = support::client().get(format!("{}{path}", gw.url));
        if let Some(k) = key {
            r = r.bearer_auth(k);
        }
        r.send()
    };
    let r = get("/v1/models", Some(ACME_KEY)).await.unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    let ids: Vec<&str> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, [sim_model().as_str()]);
    let m = sim_model();
    assert_eq!(
        get(&format!("/v1/models/{m}"), Some(ACME_KEY))
            .await
            .unwrap()
            .status(),
        200
    );
    assert_eq!(
        get("/v1/models/secret-model", Some(ACME_KEY))
            .await
            .unwrap()
            .status(),
        404,
        "a model the key may not use does not exist for it"
    );
    assert_eq!(get("/v1/models", None).await.unwrap().status(), 401);
    assert_eq!(
        get("/v1/models", Some("sk-nope")).await.unwrap().status(),
        401
    );
}

#[tokio::test]
async fn check_config_warns_about_open_configurations() {
    let hash = "0".repeat(64);
    let open = support::config_file(
        "trust-check-open",
        &format!(
            "[admin]\nlisten = \"0.0.0.0:9901\"\ntoken_env = \"SY_TRUST_ADMIN_TOKEN\"\n\
             [tenancy]\ntrust_tenant_header = true\nanonymous_max_priority = \"high\"\n\
             [[tenants]]\nname = \"acme\"\nkey_sha256 = \"{hash}\"\nallowed_models = [\"lama-*\", \"m\"]\n\
             [[pools]]\nname = \"p\"\nmodels = [\"m\"]\nworkers = [{{ url = \"http://127.0.0.1:9\" }}]\n"
        ),
    );
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args(["check-config", "--no-secrets"])
        .arg(&open)
        .env(
            "SY_TRUST_ADMIN_TOKEN",
            "trust-claims-admin-token-5e8f2a91c0d4",
        )
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    for want in [
        "warning: tenancy.require_key: false while tenants have API keys",
        "warning: tenancy.trust_tenant_header: true",
        "warning: tenancy.anonymous_max_priority: `high`",
        "warning: admin.listen: 0.0.0.0:9901 is not a loopback address",
        "warning: tenants[0].allowed_models[0]: `lama-*` matches no configured model",
    ] {
        assert!(text.contains(want), "missing {want:?} in:\n{text}");
    }
    assert!(!text.contains("allowed_models[1]"), "{text}");
    // An unknown class in a tenant's priority is an error, not a warning.
    let bad = support::config_file(
        "trust-check-bad",
        "[[tenants]]\nname = \"t\"\npriority = \"urgent\"\n\
         [[pools]]\nname = \"p\"\nmodels = [\"m\"]\nworkers = [{ url = \"http://127.0.0.1:9\" }]\n",
    );
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args(["check-config", "--no-secrets"])
        .arg(&bad)
        .output()
        .unwrap();
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.status.success(), "{all}");
    assert!(
        all.contains("tenants[0].priority: unknown priority class `urgent`"),
        "{all}"
    );
}

/// `switchyard epp` over `worker` (one pool), its gRPC address once ready.
async fn epp(worker: &str) -> (tokio::process::Child, String) {
    let file = support::config_file(
        "trust-epp",
        &format!(
            "[server]\nlisten = \"127.0.0.1:0\"\n[[tenants]]\nname = \"lowco\"\nkey_sha256 = \"{}\"\npriority = \"low\"\n\
             [[pools]]\nname = \"p\"\nmodels = [\"{}\"]\nworkers = [{{ url = \"{worker}\" }}]\n",
            switchyard::tenancy::keys::digest(LOW_KEY.as_bytes())
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>(),
            sim_model()
        ),
    );
    let (child, line) = support::spawn_binary_line(
        &[
            "epp",
            "--grpc-listen",
            "127.0.0.1:0",
            "--config",
            file.to_str().unwrap(),
        ],
        "switchyard epp ready",
    )
    .await;
    (child, support::line_field(&line, "grpc"))
}

/// One buffered ext_proc exchange with request `headers` and a chat body:
/// the headers the picker sets on the route, or the immediate answer's status.
async fn pick(grpc: &str, headers: &[(&str, &str)]) -> Result<Vec<(String, String)>, u32> {
    use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
    use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
    use envoy_types::pb::envoy::service::ext_proc::v3::{
        processing_request::Request, processing_response::Response, HttpBody, HttpHeaders,
        ProcessingRequest,
    };
    let mut client = ExternalProcessorClient::connect(format!("http://{grpc}"))
        .await
        .unwrap();
    let mut all = vec![(":method", "POST"), (":path", "/v1/chat/completions")];
    all.extend_from_slice(headers);
    let h = Request::RequestHeaders(HttpHeaders {
        headers: Some(HeaderMap {
            headers: all
                .iter()
                .map(|(k, v)| HeaderValue {
                    key: k.to_string(),
                    raw_value: v.as_bytes().to_vec(),
                    ..Default::default()
                })
                .collect(),
        }),
        ..Default::default()
    });
    let b = Request::RequestBody(HttpBody {
        body: serde_json::to_vec(&body(2, false)).unwrap(),
        end_of_stream: true,
        ..Default::default()
    });
    let msgs = [h, b].map(|r| ProcessingRequest {
        request: Some(r),
        ..Default::default()
    });
    let mut rx = client
        .process(tokio_stream::iter(msgs))
        .await
        .unwrap()
        .into_inner();
    loop {
        let msg = tokio::time::timeout(Duration::from_secs(10), rx.message())
            .await
            .expect("an answer")
            .unwrap()
            .expect("stream open");
        match msg.response.unwrap() {
            Response::RequestBody(b) => {
                let set = b.response.unwrap().header_mutation.unwrap().set_headers;
                return Ok(set
                    .into_iter()
                    .filter_map(|o| o.header)
                    .map(|h| (h.key, String::from_utf8(h.raw_value).unwrap()))
                    .collect());
            }
            Response::ImmediateResponse(i) => return Err(i.status.unwrap().code as u32),
            _ => continue,
        }
    }
}

#[tokio::test]
async fn the_picker_caps_priority_too() {
    let s = support::sims(1, 20.0).await;
    let (_child, grpc) = epp(&s[0].url()).await;
    let priority = |set: Vec<(String, String)>| {
        set.into_iter()
            .find(|(k, _)| k == "x-switchyard-priority")
            .map(|(_, v)| v)
    };
    let anon = pick(&grpc, &[("x-switchyard-priority", "critical")]).await;
    assert_eq!(priority(anon.unwrap()).as_deref(), Some("normal"));
    let bearer = format!("Bearer {LOW_KEY}");
    let low = pick(
        &grpc,
        &[
            ("authorization", &bearer),
            ("x-switchyard-priority", "critical"),
        ],
    )
    .await;
    assert_eq!(priority(low.unwrap()).as_deref(), Some("low"));
    let lower = pick(&grpc, &[("x-switchyard-priority", "low")]).await;
    assert_eq!(
        priority(lower.unwrap()).as_deref(),
        Some("low"),
        "lowering is free"
    );
    assert_eq!(
        pick(&grpc, &[("x-switchyard-priority", "urgent")]).await,
        Err(400)
    );
    assert_eq!(
        pick(&grpc, &[("authorization", "Bearer sk-wrong")]).await,
        Err(401)
    );
}

/// A pool forwarding `x-switchyard-priority` tells its upstream the class the
/// gateway granted, never the client's ask; the `x-slo-*` headers the client
/// sent reach the upstream only as far as they were honoured.
#[tokio::test]
async fn the_upstream_sees_the_granted_claims_not_the_asked_ones() {
    let (up, _tx) = support::scripted::Scripted::start().await;
    let gw = serve(
        "fwd-claims",
        &support::pool_toml(
            "scripted",
            &[up.url.as_str()],
            "forward_headers = [\"x-switchyard-priority\"]",
        ),
    )
    .await;
    let b = json!({"model": "scripted", "messages": [{"role": "user", "content": "hi"}]});
    let asked = [
        ("x-switchyard-priority", "critical"),
        ("x-slo-ttft-ms", "5"),
        ("x-slo-tpot-ms", "1"),
    ];
    assert_eq!(post(&gw.url, &asked, &b).await.0, 200);
    assert_eq!(post(&gw.url, &[], &b).await.0, 200);
    let seen = up.recorded.lock().unwrap().headers.clone();
    assert_eq!(seen.len(), 2);
    // Anonymous callers are capped at `normal` and may not set objectives.
    assert_eq!(seen[0]["x-switchyard-priority"], "normal", "{:?}", seen[0]);
    assert!(!seen[0].contains_key("x-slo-ttft-ms"), "{:?}", seen[0]);
    assert!(!seen[0].contains_key("x-slo-tpot-ms"), "{:?}", seen[0]);
    // No ask: the class the request was scheduled with.
    assert_eq!(seen[1]["x-switchyard-priority"], "normal", "{:?}", seen[1]);
}

/// With objectives allowed, the upstream sees the honoured values; a pool
/// that does not forward the priority header never sees one.
#[tokio::test]
async fn honoured_objectives_are_forwarded_and_priority_stays_unless_allowed() {
    let (up, _tx) = support::scripted::Scripted::start().await;
    let gw = serve(
        "fwd-slo",
        &format!(
            "[tenancy]\nanonymous_allow_slo_headers = true\nanonymous_max_priority = \"high\"\n{}",
            support::pool_toml("scripted", &[up.url.as_str()], "")
        ),
    )
    .await;
    let b = json!({"model": "scripted", "messages": [{"role": "user", "content": "hi"}]});
    let asked = [
        ("x-switchyard-priority", "critical"),
        ("x-slo-tpot-ms", "900"),
    ];
    assert_eq!(post(&gw.url, &asked, &b).await.0, 200);
    let seen = up.recorded.lock().unwrap().headers[0].clone();
    assert_eq!(seen["x-slo-tpot-ms"], "900", "{seen:?}");
    assert!(!seen.contains_key("x-slo-ttft-ms"), "{seen:?}");
    assert!(!seen.contains_key("x-switchyard-priority"), "{seen:?}");
}

/// Refusals before any handler runs (431 headers, 400 framing, 405 method,
/// 404 path) reach the access log with status, error and client address
/// (`x-forwarded-for` believed only from a trusted proxy), and never a
/// credential or an oversized header value.
#[tokio::test]
async fn refusals_before_the_handler_reach_the_access_log() {
    let (up, _tx) = support::scripted::Scripted::start().await;
    let gw = serve(
        "pre-handler",
        &format!(
            "[server]\nmax_headers = 20\nmax_header_bytes = 4096\ntrusted_proxies = [\"127.0.0.2\"]\n{}",
            support::pool_toml("scripted", &[up.url.as_str()], "")
        ),
    )
    .await;
    let secret = "Bearer sk-never-in-the-log-5d2e";
    // Over `max_header_bytes` but within hyper's read buffer: the gateway's own check.
    let big = "b".repeat(5000);
    let proxy = reqwest::Client::builder()
        .local_address("127.0.0.2".parse::<std::net::IpAddr>().unwrap())
        .build()
        .unwrap();
    let chat = format!("{}/v1/chat/completions", gw.url);
    // 431 from a trusted proxy: the client is the forwarded address.
    let req = proxy
        .post(&chat)
        .header("authorization", secret)
        .header("x-forwarded-for", "203.0.113.7")
        .header("x-request-id", "pre-431")
        .header("x-big", &big);
    assert_eq!(req.send().await.unwrap().status(), 431);
    // 400: a header line ending in a bare LF, from an untrusted peer whose
    // forwarded-for is ignored.
    let addr: std::net::SocketAddr = gw.url.trim_start_matches("http://").parse().unwrap();
    let bare_lf = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Request-Id: pre-400\r\n\
        X-Forwarded-For: 6.6.6.6\r\nX-A: 1\nX-B: 2\r\nContent-Length: 2\r\n\r\n{}";
    let answer = support::raw::raw(addr, bare_lf.as_bytes()).await;
    assert_eq!(support::raw::status_of(&answer), 400, "{answer}");
    // 405 and 404.
    let r = support::client()
        .get(&chat)
        .header("x-request-id", "pre-405")
        .header("authorization", secret)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 405);
    for (method, path, id) in [
        ("POST", "/v1/not_a_route", "pre-404-post"),
        ("GET", "/nope", "pre-404-get"),
    ] {
        let r = support::client()
            .request(method.parse().unwrap(), format!("{}{path}", gw.url))
            .header("x-request-id", id)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 404, "{path}");
    }
    let expect = [
        ("pre-431", 431, "headers_too_large", "203.0.113.7"),
        ("pre-400", 400, "bad_framing", "127.0.0.1"),
        ("pre-405", 405, "method_not_allowed", "127.0.0.1"),
        ("pre-404-post", 404, "not_found", "127.0.0.1"),
        ("pre-404-get", 404, "not_found", "127.0.0.1"),
    ];
    for (id, status, error, client) in expect {
        let line = log_line(&gw.access_log, |v| v["request_id"] == id).await;
        assert_eq!(line["status"], status, "{line}");
        assert_eq!(line["error"], error, "{line}");
        assert_eq!(line["client"], client, "{line}");
        assert_eq!(line["tenant"], "anonymous", "{line}");
    }
    let text = std::fs::read_to_string(&gw.access_log).unwrap();
    assert!(!text.contains("sk-never-in-the-log"), "no credential");
    assert!(!text.contains(&big[..100]), "no header value");
    assert!(up.recorded.lock().unwrap().bodies.is_empty());
}
