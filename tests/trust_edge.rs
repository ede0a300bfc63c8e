//! Issue 31, the edge: what reaches the engines and the sockets. Engine control
//! routes and unknown paths never reach a worker unless the operator allows them
//! (and then control routes only for admin tenants); a second `serve` cannot
//! share a port in use; the admin API refuses hostile worker addresses in every
//! spelling, the gateway's own listeners and duplicate spellings.

mod support;

use axum::http::{Method, Uri};
use serde_json::{json, Value};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use support::*;
use switchyard::server::ServerHandle;

const ADMIN_KEY: &str = "sk-edge-admin-5f1c9a7e22";
const USER_KEY: &str = "sk-edge-user-0b3d8e6a41";
const ADMIN_TOKEN: &str = "edge-admin-token-8c2f71d0a9e4";

/// An upstream that records the path of every POST it gets and answers each
/// with a small chat completion: proof of what reached the engine.
struct Recorder {
    url: String,
    posts: Arc<Mutex<Vec<String>>>,
}

impl Recorder {
    async fn start() -> Recorder {
        let posts: Arc<Mutex<Vec<String>>> = Arc::default();
        let seen = posts.clone();
        let app = axum::Router::new().fallback(move |method: Method, uri: Uri| {
            let seen = seen.clone();
            async move {
                if method == Method::POST {
                    seen.lock().unwrap().push(uri.path().to_string());
                }
                axum::Json(json!({"id":"c","object":"chat.completion","choices":[],
                                  "usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}))
            }
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        Recorder { url, posts }
    }

    fn posts(&self) -> Vec<String> {
        self.posts.lock().unwrap().clone()
    }
}

fn tenants() -> String {
    std::env::set_var("SY_EDGE_ADMIN_KEY", ADMIN_KEY);
    std::env::set_var("SY_EDGE_USER_KEY", USER_KEY);
    "[[tenants]]\nname = \"ops\"\napi_key_env = \"SY_EDGE_ADMIN_KEY\"\nadmin = true\n\
     [[tenants]]\nname = \"app\"\napi_key_env = \"SY_EDGE_USER_KEY\"\n"
        .into()
}

/// POST `body` to `path` with an optional key: status and JSON body.
async fn post(gw: &str, path: &str, key: Option<&str>, body: Value) -> (u16, Value) {
    let mut r = client().post(format!("{gw}{path}")).json(&body);
    if let Some(k) = key {
        r = r.bearer_auth(k);
    }
    let r = r.send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

const CONTROL: &[&str] = &[
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/reset_prefix_cache",
    "/flush_cache",
    "/load_lora_adapter",
    "/update_weights_from_disk",
];

#[tokio::test]
async fn control_routes_and_unknown_paths_are_404_and_never_reach_the_engine() {
    let up = Recorder::start().await;
    let gw = gateway(&format!("{}{}", tenants(), pool_toml("m", &[&up.url], ""))).await;
    let url = gw.url();
    let body = json!({"model": "m", "lora_name": "x", "lora_path": "/etc/passwd"});
    for path in CONTROL
        .iter()
        .chain(&["/v1/foo", "/v1/custom/thing", "/v1/chat/completions/x"])
    {
        for key in [None, Some(USER_KEY), Some(ADMIN_KEY)] {
            let (status, err) = post(&url, path, key, body.clone()).await;
            assert_eq!(status, 404, "{path} {key:?}: {err}");
            assert_eq!(err["error"]["code"], "unknown_url", "{path}: {err}");
            assert!(
                err["error"]["message"].as_str().unwrap().contains(path),
                "{err}"
            );
        }
    }
    // The built-in inference routes still work; the engine saw only them.
    let (status, _) = post(
        &url,
        "/v1/chat/completions",
        Some(USER_KEY),
        json!({"model": "m", "messages": []}),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(up.posts(), ["/v1/chat/completions"]);
    let text = scrape(&url).await;
    let refused = |reason| {
        metric_sum(
            &text,
            "switchyard_route_refusals_total",
            &[("reason", reason)],
        )
    };
    assert!(
        refused("control_route") >= (CONTROL.len() * 3) as f64,
        "{text}"
    );
    assert!(refused("unknown_route") >= 9.0, "{text}");
    gw.shutdown().await;
}

#[tokio::test]
async fn allowed_control_routes_reach_only_their_pool_and_only_for_admin_keys() {
    let up = Recorder::start().await;
    let other = Recorder::start().await;
    let lines = "allow_control_routes = [\"/v1/load_lora_adapter\", \"/reset_prefix_cache\"]\n\
                 forward_routes = [\"/v1/custom/thing\"]";
    let toml = format!(
        "{}{}[[pools]]\nname = \"q\"\nmodels = [\"n\"]\nworkers = [{{ url = \"{}\" }}]\n",
        tenants(),
        pool_toml("m", &[&up.url], lines),
        other.url
    );
    let gw = gateway(&toml).await;
    let url = gw.url();
    let lora = json!({"model": "m", "lora_name": "x", "lora_path": "/models/x"});
    for key in [None, Some(USER_KEY)] {
        let (status, err) = post(&url, "/v1/load_lora_adapter", key, lora.clone()).await;
        assert_eq!(status, 403, "{key:?}: {err}");
        assert_eq!(err["error"]["type"], "permission_error", "{err}");
        assert_eq!(err["error"]["code"], "control_route_forbidden", "{err}");
    }
    assert!(up.posts().is_empty(), "{:?}", up.posts());
    // The admin tenant's key reaches the pool that allows the route.
    let (status, err) = post(&url, "/v1/load_lora_adapter", Some(ADMIN_KEY), lora).await;
    assert_eq!(status, 200, "{err}");
    let (status, _) = post(
        &url,
        "/reset_prefix_cache",
        Some(ADMIN_KEY),
        json!({"model": "m"}),
    )
    .await;
    assert_eq!(status, 200);
    // Not the pool that does not list it, admin or not.
    let (status, _) = post(
        &url,
        "/v1/load_lora_adapter",
        Some(ADMIN_KEY),
        json!({"model": "n"}),
    )
    .await;
    assert_eq!(status, 404);
    // A listed extra inference route is open to every caller of its pool only.
    let (status, _) = post(
        &url,
        "/v1/custom/thing",
        Some(USER_KEY),
        json!({"model": "m"}),
    )
    .await;
    assert_eq!(status, 200);
    let (status, _) = post(
        &url,
        "/v1/custom/thing",
        Some(USER_KEY),
        json!({"model": "n"}),
    )
    .await;
    assert_eq!(status, 404);
    assert_eq!(
        up.posts(),
        [
            "/v1/load_lora_adapter",
            "/reset_prefix_cache",
            "/v1/custom/thing"
        ]
    );
    assert!(other.posts().is_empty(), "{:?}", other.posts());
    let text = scrape(&url).await;
    assert!(
        metric_sum(
            &text,
            "switchyard_route_refusals_total",
            &[("reason", "not_admin")]
        ) >= 2.0
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn a_control_route_cannot_be_opened_to_every_caller() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .arg("check-config")
        .arg(config_file(
            "edge-forward-control",
            &pool_toml(
                "m",
                &["http://10.0.0.1:8000"],
                "forward_routes = [\"/v1/load_lora_adapter\"]",
            ),
        ))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(
            "pools[0].forward_routes[0]: `/v1/load_lora_adapter` is an engine control route"
        ),
        "{err}"
    );
}

#[tokio::test]
async fn a_second_serve_on_a_port_in_use_exits_naming_it_and_the_first_keeps_serving() {
    let s = sims(1, 50.0).await;
    let model = sim_model();
    let file = config_file("edge-second-serve", &pool_toml(&model, &[&s[0].url()], ""));
    let first = serve_binary(&file).await;
    let addr = first.url.trim_start_matches("http://").to_string();
    let second = tokio::process::Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args(["serve", "--listen", &addr, "--config"])
        .arg(&file)
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(60), second)
        .await
        .expect("the second serve exits")
        .unwrap();
    assert!(!out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!stdout.contains("ready"), "{stdout}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("server.listen {addr}")) && err.contains("already in use"),
        "{err}"
    );
    // Every request still reaches the first gateway (none went to a second one).
    for _ in 0..20 {
        assert_eq!(chat_status(&first.url, &model).await, 200);
    }
    let served = |text: &str| {
        metric_sum(
            text,
            "switchyard_requests_total",
            &[("endpoint", "chat_completions")],
        )
    };
    let text = eventually(Duration::from_secs(10), "20 requests recorded", || async {
        let text = scrape(&first.url).await;
        (served(&text) >= 20.0).then_some(text)
    })
    .await;
    assert_eq!(served(&text), 20.0, "{text}");
}

/// A gateway with the admin API; `allow_loopback` lets the admin API add
/// loopback workers (the own-listener and duplicate rules still apply).
async fn admin_gateway(worker: &str, allow_loopback: bool) -> (ServerHandle, String) {
    std::env::set_var("SY_EDGE_ADMIN_TOKEN", ADMIN_TOKEN);
    let toml = format!(
        "[admin]\nlisten = \"127.0.0.1:0\"\ntoken_env = \"SY_EDGE_ADMIN_TOKEN\"\nallow_loopback_workers = {allow_loopback}\n{}",
        pool_toml("m", &[worker], "")
    );
    let gw = gateway(&toml).await;
    let admin = format!("http://{}", gw.admin_addr.unwrap());
    (gw, admin)
}

async fn add_worker(admin: &str, url: &str) -> (u16, Value) {
    let r = client()
        .post(format!("{admin}/admin/workers"))
        .bearer_auth(ADMIN_TOKEN)
        .json(&json!({"pool": "p", "url": url}))
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

async fn worker_count(admin: &str) -> usize {
    let r = client()
        .get(format!("{admin}/admin/workers"))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap();
    r.json::<Value>().await.unwrap()["workers"]
        .as_array()
        .unwrap()
        .len()
}

#[tokio::test]
async fn the_admin_api_refuses_hostile_worker_addresses_in_every_spelling() {
    let up = Recorder::start().await;
    let (gw, admin) = admin_gateway(&up.url, false).await;
    for (url, rule) in [
        ("http://169.254.169.254/", "cloud metadata"),
        ("http://2852039166/", "cloud metadata"),
        ("http://0xA9FEA9FE", "cloud metadata"),
        ("http://0251.0376.0251.0376", "cloud metadata"),
        ("http://169.254.43518:80", "cloud metadata"),
        ("http://[::ffff:169.254.169.254]", "cloud metadata"),
        ("http://[fd00:ec2::254]", "cloud metadata"),
        (
            "http://metadata.google.internal/computeMetadata",
            "cloud metadata",
        ),
        ("http://Metadata.Google.Internal.", "cloud metadata"),
        ("http://100.100.100.200", "cloud metadata"),
        ("http://169.254.10.10:8000", "link-local"),
        ("http://[fe80::1]:8000", "link-local"),
        ("http://127.0.0.1:8000", "loopback"),
        ("http://localhost:8000", "loopback"),
        ("http://[::1]:8000", "loopback"),
        ("http://0.0.0.0:8000", "loopback"),
        ("http://2130706433:8000", "loopback"),
        ("http://user:pw@10.0.0.1:8000", "credentials"),
        ("http://10.0.0.1:8000/?x=1", "query"),
        ("file:///etc/passwd", "http:// or https://"),
    ] {
        let (status, err) = add_worker(&admin, url).await;
        assert_eq!(status, 400, "{url}: {err}");
        let msg = err["error"]["message"].as_str().unwrap();
        assert!(msg.contains(rule), "{url}: {msg}");
        assert!(!msg.contains(":pw@"), "{msg}");
    }
    assert_eq!(worker_count(&admin).await, 1);
    let text = scrape(&gw.url()).await;
    assert!(
        metric_sum(
            &text,
            "switchyard_worker_address_refusals_total",
            &[("source", "admin")]
        ) >= 20.0
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn the_admin_api_refuses_the_gateways_own_ports_and_duplicate_spellings() {
    let up = Recorder::start().await;
    let (gw, admin) = admin_gateway(&up.url, true).await;
    let (port, admin_port) = (gw.addr.port(), gw.admin_addr.unwrap().port());
    for url in [
        format!("http://127.0.0.1:{port}"),
        format!("http://localhost:{port}/"),
        format!("http://LOCALHOST:{port}"),
        format!("http://[::1]:{port}"),
        format!("http://[::ffff:127.0.0.1]:{port}"),
        format!("http://2130706433:{port}"),
        format!("http://127.0.0.1:{admin_port}"),
    ] {
        let (status, err) = add_worker(&admin, &url).await;
        assert_eq!(status, 400, "{url}: {err}");
        assert!(
            err["error"]["message"]
                .as_str()
                .unwrap()
                .contains("own listener"),
            "{url}: {err}"
        );
    }
    // The configured worker in other spellings is a duplicate.
    let upper = up.url.replace("http://", "HTTP://") + "/";
    for url in [up.url.clone(), format!("{}/", up.url), upper] {
        let (status, err) = add_worker(&admin, &url).await;
        assert_eq!(status, 409, "{url}: {err}");
    }
    // A new worker once; its second spelling is refused.
    let fresh = Recorder::start().await;
    let port = fresh.url.rsplit(':').next().unwrap().to_string();
    let (status, added) = add_worker(&admin, &format!("http://LocalHost:{port}/")).await;
    assert_eq!(status, 201, "{added}");
    assert_eq!(added["added"], format!("http://localhost:{port}"));
    let (status, _) = add_worker(&admin, &format!("http://localhost:{port}")).await;
    assert_eq!(status, 409);
    assert_eq!(worker_count(&admin).await, 2);
    // Any spelling names it for removal.
    let r = client()
        .delete(format!("{admin}/admin/workers"))
        .bearer_auth(ADMIN_TOKEN)
        .json(&json!({"url": format!("HTTP://localhost:{port}/")}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(worker_count(&admin).await, 1);
    // Nothing was ever sent to the gateway itself.
    assert!(up.posts().is_empty());
    gw.shutdown().await;
}

#[tokio::test]
async fn config_workers_pointing_at_metadata_or_the_gateway_are_refused() {
    let toml = "[server]\nlisten = \"127.0.0.1:18931\"\n\
                [[pools]]\nname = \"p\"\nmodels = [\"m\"]\n\
                workers = [{ url = \"http://0xA9FEA9FE\" }, { url = \"http://localhost:18931\" },\
                { url = \"http://10.0.0.1:80\" }, { url = \"http://10.0.0.1/\" }]\n";
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .arg("check-config")
        .arg(config_file("edge-config-workers", toml))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    for want in [
        "pools[0].workers[0].url: `http://169.254.169.254` is a cloud metadata service address",
        "pools[0].workers[1].url: `http://localhost:18931` is this gateway's own listener",
        "pools[0].workers[3].url: duplicate worker `http://10.0.0.1`",
    ] {
        assert!(err.contains(want), "{want}\n{err}");
    }
}
