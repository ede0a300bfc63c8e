//! Kubernetes discovery against a fake API server written here with axum: it serves
//! `GET /api/v1/namespaces/{ns}/pods` as a list (with a resourceVersion) and, with
//! `watch=true`, as a stream of newline-delimited ADDED/MODIFIED/DELETED events
//! replayed from the requested resourceVersion. Pods point at simulated workers
//! (pod IP 127.0.0.1, port annotation = the sim's port). The gateway talks to it
//! through the real `kube` client and kube-runtime watcher.
//!
//! Not covered here (see docs/operations.md): a real cluster, TLS and service-account
//! auth (`kube::Config::infer()`), RBAC, 410 Gone re-lists, bookmarks, pagination.

mod support;

use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use support::*;

const NS: &str = "inference";

/// The fake API server's state: current pods, an event log (for watch replay from a
/// resourceVersion) and a switch that makes every call fail.
#[derive(Default)]
struct Fake {
    inner: Mutex<Inner>,
    /// Wakes open watch streams when an event is logged or the server breaks.
    bump: Option<tokio::sync::watch::Sender<u64>>,
    broken: AtomicBool,
    /// Requests answered with an error while broken.
    refused: AtomicUsize,
    /// Label selectors seen on list/watch calls.
    selectors: Mutex<Vec<String>>,
}

#[derive(Default)]
struct Inner {
    rv: u64,
    pods: BTreeMap<String, Value>,
    /// (resourceVersion, JSON line)
    log: Vec<(u64, String)>,
}

impl Fake {
    fn new() -> Arc<Fake> {
        let (tx, _) = tokio::sync::watch::channel(0);
        Arc::new(Fake {
            bump: Some(tx),
            ..Default::default()
        })
    }

    fn bump(&self) {
        self.bump.as_ref().unwrap().send_modify(|v| *v += 1);
    }

    /// ADDED or MODIFIED, depending on whether the pod exists.
    fn put(&self, mut pod: Value) {
        let mut g = self.inner.lock().unwrap();
        g.rv += 1;
        let name = pod["metadata"]["name"].as_str().unwrap().to_string();
        pod["metadata"]["resourceVersion"] = json!(g.rv.to_string());
        let kind = if g.pods.contains_key(&name) {
            "MODIFIED"
        } else {
            "ADDED"
        };
        let line = json!({"type": kind, "object": pod}).to_string();
        let rv = g.rv;
        g.log.push((rv, line));
        g.pods.insert(name, pod);
        drop(g);
        self.bump();
    }

    fn delete(&self, name: &str) {
        let mut g = self.inner.lock().unwrap();
        g.rv += 1;
        let mut pod = g.pods.remove(name).expect("pod exists");
        pod["metadata"]["resourceVersion"] = json!(g.rv.to_string());
        let line = json!({"type": "DELETED", "object": pod}).to_string();
        let rv = g.rv;
        g.log.push((rv, line));
        drop(g);
        self.bump();
    }

    /// Fail every call and cut open watches (`true`), or heal (`false`).
    fn set_broken(&self, b: bool) {
        self.broken.store(b, Ordering::SeqCst);
        self.bump();
    }
}

/// Equality-only label selector (`a=b,c=d`), enough for these tests.
fn matches(selector: Option<&String>, pod: &Value) -> bool {
    selector.is_none_or(|sel| {
        sel.split(',').filter(|t| !t.is_empty()).all(|term| {
            let (k, v) = term.split_once('=').expect("equality selector");
            pod["metadata"]["labels"][k].as_str() == Some(v)
        })
    })
}

fn status_error(code: u16, msg: &str) -> Response {
    let body = json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                      "message": msg, "reason": "InternalError", "code": code});
    (
        http::StatusCode::from_u16(code).unwrap(),
        [("content-type", "application/json")],
        body.to_string(),
    )
        .into_response()
}

async fn pods(
    State(fake): State<Arc<Fake>>,
    Path(ns): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    if fake.broken.load(Ordering::SeqCst) {
        fake.refused.fetch_add(1, Ordering::SeqCst);
        return status_error(500, "fake API server is broken");
    }
    if ns != NS {
        return status_error(404, "no such namespace");
    }
    let selector = q.get("labelSelector").cloned();
    fake.selectors
        .lock()
        .unwrap()
        .push(selector.clone().unwrap_or_default());
    if q.get("watch").map(String::as_str) != Some("true") {
        let g = fake.inner.lock().unwrap();
        let items: Vec<&Value> = g
            .pods
            .values()
            .filter(|p| matches(selector.as_ref(), p))
            .collect();
        let body = json!({"kind": "PodList", "apiVersion": "v1",
                          "metadata": {"resourceVersion": g.rv.to_string()}, "items": items});
        return ([("content-type", "application/json")], body.to_string()).into_response();
    }
    // Watch: replay events after the requested resourceVersion, then follow live.
    let from: u64 = q
        .get("resourceVersion")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let rx = fake.bump.as_ref().unwrap().subscribe();
    let stream = futures_util::stream::unfold(
        (fake.clone(), rx, from, selector),
        |(fake, mut rx, mut from, selector)| async move {
            loop {
                if fake.broken.load(Ordering::SeqCst) {
                    return None; // the connection ends, as when an API server restarts
                }
                let next = {
                    let g = fake.inner.lock().unwrap();
                    g.log
                        .iter()
                        .find(|(rv, line)| {
                            *rv > from && {
                                let ev: Value = serde_json::from_str(line).unwrap();
                                matches(selector.as_ref(), &ev["object"])
                            }
                        })
                        .cloned()
                };
                if let Some((rv, line)) = next {
                    from = rv;
                    let chunk = bytes::Bytes::from(format!("{line}\n"));
                    return Some((Ok::<_, std::io::Error>(chunk), (fake, rx, from, selector)));
                }
                // No event after `from` yet. Skip past non-matching ones, then wait.
                from = fake.inner.lock().unwrap().rv.max(from);
                if rx.changed().await.is_err() {
                    return None;
                }
            }
        },
    );
    (
        [("content-type", "application/json")],
        Body::from_stream(stream),
    )
        .into_response()
}

async fn fake_api() -> (Arc<Fake>, String) {
    let fake = Fake::new();
    let app = axum::Router::new()
        .route("/api/v1/namespaces/{ns}/pods", axum::routing::get(pods))
        .with_state(fake.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (fake, url)
}

/// A pod of the simulated engine at `port`, labelled for the selector and the label map.
fn pod(name: &str, port: u16, ready: bool, region: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "uid": format!("uid-{name}"),
                     "labels": {"app": "sim", "topology.kubernetes.io/region": region,
                                "switchyard.io/role": "decode"},
                     "annotations": {"switchyard.io/port": port.to_string()}},
        "spec": {"containers": [{"name": "engine", "image": "sim"}]},
        "status": {"phase": "Running", "podIP": "127.0.0.1",
                   "conditions": [{"type": "Ready", "status": if ready {"True"} else {"False"}}]}
    })
}

fn gateway_toml(model: &str, api_url: &str) -> String {
    format!(
        r#"[[pools]]
name = "k"
models = ["{model}"]
[pools.kubernetes]
namespace = "{NS}"
label_selector = "app=sim"
port_annotation = "switchyard.io/port"
label_map = {{ "topology.kubernetes.io/region" = "region", "switchyard.io/role" = "role" }}
api_url = "{api_url}"
"#
    )
}

/// URLs of the pool's workers and their labels, sorted.
fn workers(gw: &switchyard::server::ServerHandle) -> Vec<(String, BTreeMap<String, String>)> {
    let mut v: Vec<_> = gw
        .gateway
        .registry
        .snapshot()
        .workers()
        .map(|w| (w.id.to_string(), w.labels.clone()))
        .collect();
    v.sort();
    v
}

async fn wait_for_urls(gw: &switchyard::server::ServerHandle, want: &[String], what: &str) {
    let mut want = want.to_vec();
    want.sort();
    eventually(Duration::from_secs(10), what, || {
        let have: Vec<String> = workers(gw).into_iter().map(|(u, _)| u).collect();
        let ok = have == want;
        async move { ok.then_some(()) }
    })
    .await;
}

/// A Ready pod becomes a routable worker with its labels mapped; a not-ready pod
/// (and a pod outside the label selector) does not.
#[tokio::test]
async fn ready_pods_become_routable_workers_with_mapped_labels() {
    let s = sims(3, 20.0).await;
    let model = sim_model();
    let (fake, api) = fake_api().await;
    fake.put(pod("ready", s[0].addr().port(), true, "eu-west"));
    fake.put(pod("starting", s[1].addr().port(), false, "eu-west"));
    let mut other = pod("other-app", s[2].addr().port(), true, "eu-west");
    other["metadata"]["labels"]["app"] = json!("something-else");
    fake.put(other);

    let gw = gateway(&gateway_toml(&model, &api)).await;
    wait_for_urls(&gw, &[s[0].url()], "the ready pod becomes a worker").await;
    let (_, labels) = &workers(&gw)[0];
    let want: BTreeMap<String, String> = [
        ("region".to_string(), "eu-west".to_string()),
        ("role".to_string(), "decode".to_string()),
    ]
    .into();
    assert_eq!(labels, &want);
    for _ in 0..6 {
        assert_eq!(chat_status(&gw.url(), &model).await, 200);
    }
    assert_eq!(s[0].requests_received(), 6);
    assert_eq!(s[1].requests_received(), 0, "not-ready pod got traffic");
    assert_eq!(
        s[2].requests_received(),
        0,
        "pod outside the selector got traffic"
    );
    assert!(fake
        .selectors
        .lock()
        .unwrap()
        .iter()
        .all(|s| s == "app=sim"));
    gw.shutdown().await;
}

/// Watch events move the pool: MODIFIED to Ready joins, MODIFIED to not-ready
/// leaves, DELETED leaves; requests follow.
#[tokio::test]
async fn watch_events_add_and_remove_workers() {
    let s = sims(2, 20.0).await;
    let model = sim_model();
    let (a, b) = (s[0].addr().port(), s[1].addr().port());
    let (fake, api) = fake_api().await;
    fake.put(pod("a", a, true, "us"));
    fake.put(pod("b", b, false, "us"));
    let gw = gateway(&gateway_toml(&model, &api)).await;
    wait_for_urls(&gw, &[s[0].url()], "a only").await;

    fake.put(pod("b", b, true, "us"));
    wait_for_urls(&gw, &[s[0].url(), s[1].url()], "b joins when Ready").await;

    fake.delete("a");
    wait_for_urls(&gw, &[s[1].url()], "a leaves when DELETED").await;
    let before = s[0].requests_received();
    for _ in 0..4 {
        assert_eq!(chat_status(&gw.url(), &model).await, 200);
    }
    assert_eq!(
        s[0].requests_received(),
        before,
        "deleted pod still got traffic"
    );

    fake.put(pod("b", b, false, "us"));
    wait_for_urls(&gw, &[], "b leaves when not Ready").await;
    assert_ne!(chat_status(&gw.url(), &model).await, 200);
    gw.shutdown().await;
}

/// While the API server fails, the last known workers keep serving; the watcher
/// retries with backoff and picks up what changed during the outage.
#[tokio::test]
async fn watch_errors_keep_the_last_known_set_and_recover() {
    let s = sims(2, 20.0).await;
    let model = sim_model();
    let (fake, api) = fake_api().await;
    fake.put(pod("a", s[0].addr().port(), true, "us"));
    let gw = gateway(&gateway_toml(&model, &api)).await;
    wait_for_urls(&gw, &[s[0].url()], "a discovered").await;

    fake.set_broken(true);
    eventually(Duration::from_secs(10), "watcher retried", || {
        let n = fake.refused.load(Ordering::SeqCst);
        async move { (n >= 2).then_some(()) }
    })
    .await;
    assert_eq!(workers(&gw).len(), 1, "an API error emptied the pool");
    assert_eq!(chat_status(&gw.url(), &model).await, 200);

    // A pod added during the outage reaches the gateway once the watch resumes.
    fake.put(pod("b", s[1].addr().port(), true, "us"));
    fake.set_broken(false);
    wait_for_urls(
        &gw,
        &[s[0].url(), s[1].url()],
        "b discovered after recovery",
    )
    .await;
    gw.shutdown().await;
}

/// A fake API server with pods and Gateway API Inference Extension
/// `InferencePool`s (each kind its own store, served by the same handler).
async fn fake_api_with_pools() -> (Arc<Fake>, Arc<Fake>, String) {
    let (pods_fake, pools_fake) = (Fake::new(), Fake::new());
    let app = axum::Router::new()
        .route(
            "/api/v1/namespaces/{ns}/pods",
            axum::routing::get(pods).with_state(pods_fake.clone()),
        )
        .route(
            "/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools",
            axum::routing::get(pods).with_state(pools_fake.clone()),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (pods_fake, pools_fake, url)
}

fn inference_pool(name: &str, app: &str, port: u16) -> Value {
    json!({
        "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
        "metadata": {"name": name, "namespace": NS, "uid": format!("uid-{name}")},
        "spec": {"selector": {"matchLabels": {"app": app}},
                 "targetPorts": [{"number": port}],
                 "endpointPickerRef": {"name": "switchyard-epp", "port": {"number": 9002}}}
    })
}

/// An `InferencePool` names the pods (its selector) and their port (its target
/// port): Ready pods it selects become workers on that port; a changed pool moves
/// the workers; a deleted one empties the pool. Another InferencePool in the
/// namespace changes nothing.
#[tokio::test]
async fn an_inference_pool_selects_the_pods_and_their_port() {
    let s = sims(2, 20.0).await;
    let model = sim_model();
    let (pods_fake, pools_fake, api) = fake_api_with_pools().await;
    let (a, b) = (s[0].addr().port(), s[1].addr().port());
    // Pods without port annotations: the port comes from the InferencePool.
    let mut blue = pod("blue", 0, true, "eu");
    blue["metadata"]["labels"]["app"] = json!("blue");
    blue["metadata"]["annotations"] = json!({});
    let mut green = blue.clone();
    green["metadata"]["name"] = json!("green");
    green["metadata"]["uid"] = json!("uid-green");
    green["metadata"]["labels"]["app"] = json!("green");
    pods_fake.put(blue);
    pods_fake.put(green);
    pools_fake.put(inference_pool("other", "green", b));
    pools_fake.put(inference_pool("llm", "blue", a));
    let toml = format!(
        "[[pools]]\nname = \"k\"\nmodels = [\"{model}\"]\n[pools.kubernetes]\nnamespace = \"{NS}\"\ninference_pool = \"llm\"\napi_url = \"{api}\"\n"
    );
    let gw = gateway(&toml).await;
    wait_for_urls(&gw, &[s[0].url()], "the pool's pods on its target port").await;
    for _ in 0..3 {
        assert_eq!(chat_status(&gw.url(), &model).await, 200);
    }
    assert_eq!(s[0].requests_received(), 3);

    pools_fake.put(inference_pool("llm", "green", b));
    wait_for_urls(&gw, &[s[1].url()], "the changed selector and port").await;
    assert!(pods_fake
        .selectors
        .lock()
        .unwrap()
        .iter()
        .any(|sel| sel == "app=green"));

    pools_fake.delete("llm");
    wait_for_urls(&gw, &[], "a deleted InferencePool empties the pool").await;
    gw.shutdown().await;
}
