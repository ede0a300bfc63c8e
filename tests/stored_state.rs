//! Stored state belongs to the tenant that created it, tried as a hostile
//! tenant would: real gateways in front of simulated engines (which keep
//! Responses in memory and answer anyone who names an id). Another tenant's
//! id, a tampered one, one signed by another deployment or in the old unsigned
//! format is not found (404, without reaching an engine, counted); the owner's
//! model's permissions and limits apply to every by-id call and continuation;
//! a continuation waits in its owner's queue for a slot like any request; and
//! gateways sharing an id key accept each other's ids.

mod support;

use reqwest::Method;
use serde_json::{json, Value};
use std::time::Duration;
use support::*;
use switchyard::sim::SimHandle;
use switchyard::telemetry::names::STORED_ID_REFUSALS_TOTAL;

const KEY_A: &str = "sk-stored-tenant-a-4b1d9e";
const KEY_B: &str = "sk-stored-tenant-b-7c2f0a";
/// The id key gateways share (through `SY_STORED_ID_KEY`).
const ID_KEY: &str = "8f2c4e6a0b1d3f5e7a9c2b4d6f8e0a1c";

/// Held by the tests that count refusals: the metrics recorder is one per
/// test process, so their counts are read as differences, one test at a time.
static COUNTING: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn set_env() {
    std::env::set_var("SY_STORED_KEY_A", KEY_A);
    std::env::set_var("SY_STORED_KEY_B", KEY_B);
    std::env::set_var("SY_STORED_ID_KEY", ID_KEY);
    std::env::set_var("SY_STORED_OTHER_ID_KEY", "0d9e8f7a6b5c4d3e2f1a0b9c8d7e6f5a");
}

/// Tenants `a` and `b` (`b_lines` inside b's table), pools over `pools`
/// (name, model, sims, extra pool lines), ids signed with `id_key_var`.
fn config(id_key_var: &str, b_lines: &str, pools: &[(&str, &str, &[&SimHandle], &str)]) -> String {
    let mut t = format!(
        "[server]\nid_key_env = \"{id_key_var}\"\n[tenancy]\nrequire_key = true\n\
         [[tenants]]\nname = \"a\"\napi_key_env = \"SY_STORED_KEY_A\"\n\
         [[tenants]]\nname = \"b\"\napi_key_env = \"SY_STORED_KEY_B\"\n{b_lines}\n"
    );
    for (name, model, sims, extra) in pools {
        let workers: Vec<String> = sims
            .iter()
            .map(|s| format!("{{ url = \"{}\" }}", s.url()))
            .collect();
        t.push_str(&format!(
            "[[pools]]\nname = \"{name}\"\nmodels = [\"{model}\"]\n{extra}\nworkers = [{}]\n",
            workers.join(", ")
        ));
    }
    t
}

async fn sim(time_scale: f64) -> SimHandle {
    let cfg = switchyard::sim::SimConfig {
        time_scale,
        ..switchyard::sim::SimConfig::profile("tiny").unwrap()
    };
    switchyard::sim::spawn(cfg).await.expect("sim starts")
}

/// `method path` as the tenant with `key`: status and JSON body.
async fn call(
    url: &str,
    key: &str,
    method: Method,
    path: &str,
    body: Option<Value>,
) -> (u16, Value) {
    let mut req = client()
        .request(method, format!("{url}{path}"))
        .bearer_auth(key);
    if let Some(b) = body {
        req = req.json(&b);
    }
    let r = req.send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// A stored response created by the tenant with `key`; its gateway id.
async fn create(url: &str, key: &str, model: &str) -> String {
    let body = json!({"model": model, "input": "remember the tide", "max_output_tokens": 3});
    let (status, v) = call(url, key, Method::POST, "/v1/responses", Some(body)).await;
    assert_eq!(status, 200, "{v}");
    v["id"].as_str().unwrap().to_string()
}

fn continuation(model: &str, prev: &str) -> Value {
    json!({"model": model, "input": "and then?", "max_output_tokens": 3,
           "previous_response_id": prev})
}

/// The answer is the gateway's "not found", in OpenAI's shape.
fn not_found(status: u16, v: &Value, what: &str) {
    assert_eq!(status, 404, "{what}: {v}");
    assert_eq!(v["error"]["code"], "response_not_found", "{what}: {v}");
    assert_eq!(v["error"]["type"], "invalid_request_error", "{what}: {v}");
}

async fn refusals(url: &str, reason: &str) -> f64 {
    metric_sum(
        &scrape(url).await,
        STORED_ID_REFUSALS_TOTAL,
        &[("reason", reason)],
    )
}

#[tokio::test]
async fn another_tenant_cannot_read_cancel_delete_list_or_continue_a_response() {
    let _counting = COUNTING.lock().await;
    set_env();
    let s = sim(20.0).await;
    let model = sim_model();
    let gw = gateway(&config("SY_STORED_ID_KEY", "", &[("p", &model, &[&s], "")])).await;
    let url = gw.url();
    let id = create(&url, KEY_A, &model).await;
    assert!(id.starts_with("resp_syv2"), "{id}");
    let generated = s.requests_received();
    // One recorder per test process: counted as differences.
    let macs = refusals(&url, "mac").await;

    let by_id = [
        (Method::GET, format!("/v1/responses/{id}")),
        (Method::GET, format!("/v1/responses/{id}/input_items")),
        (Method::POST, format!("/v1/responses/{id}/cancel")),
        (Method::DELETE, format!("/v1/responses/{id}")),
    ];
    for (m, path) in &by_id {
        let (status, v) = call(&url, KEY_B, m.clone(), path, None).await;
        not_found(status, &v, &format!("b: {m} {path}"));
    }
    let (status, v) = call(
        &url,
        KEY_B,
        Method::POST,
        "/v1/responses",
        Some(continuation(&model, &id)),
    )
    .await;
    not_found(status, &v, "b continues a's response");
    assert_eq!(v["error"]["param"], "previous_response_id", "{v}");
    assert_eq!(
        s.requests_received(),
        generated,
        "b's continuation never reached the engine"
    );
    assert_eq!(refusals(&url, "mac").await - macs, 5.0);

    // Tenant a still has it (b's DELETE did not reach the engine) and may do
    // everything with it.
    let (status, v) = call(
        &url,
        KEY_A,
        Method::GET,
        &format!("/v1/responses/{id}"),
        None,
    )
    .await;
    assert_eq!((status, v["id"].as_str()), (200, Some(&*id)), "{v}");
    let (status, v) = call(
        &url,
        KEY_A,
        Method::GET,
        &format!("/v1/responses/{id}/input_items"),
        None,
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        v["data"][0]["content"][0]["text"], "remember the tide",
        "{v}"
    );
    let (status, v) = call(
        &url,
        KEY_A,
        Method::POST,
        &format!("/v1/responses/{id}/cancel"),
        None,
    )
    .await;
    assert_eq!(
        status, 400,
        "the engine's own answer for a finished response: {v}"
    );
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("synchronous"),
        "{v}"
    );
    let (status, v) = call(
        &url,
        KEY_A,
        Method::POST,
        "/v1/responses",
        Some(continuation(&model, &id)),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["previous_response_id"], json!(id), "{v}");
    let (status, v) = call(
        &url,
        KEY_A,
        Method::DELETE,
        &format!("/v1/responses/{id}"),
        None,
    )
    .await;
    assert_eq!((status, &v["deleted"]), (200, &json!(true)), "{v}");
    gw.shutdown().await;
}

#[tokio::test]
async fn forged_legacy_and_path_crafted_ids_are_not_found() {
    let _counting = COUNTING.lock().await;
    set_env();
    let (s1, s2) = (sim(20.0).await, sim(20.0).await);
    let model = sim_model();
    let pool = [("p", &*model, &[&s1, &s2][..], "policy = \"round_robin\"")];
    let gw = gateway(&config("SY_STORED_ID_KEY", "", &pool)).await;
    let url = gw.url();
    let id = create(&url, KEY_A, &model).await;
    let other = loop {
        // Round robin: the next one is stored by the other worker.
        let o = create(&url, KEY_A, &model).await;
        if o[9..25] != id[9..25] {
            break o;
        }
    };
    let before = [
        refusals(&url, "mac").await,
        refusals(&url, "legacy").await,
        refusals(&url, "format").await,
    ];
    let flip = |s: &str, at: usize| {
        let mut b = s.as_bytes().to_vec();
        b[at] = if b[at] == b'0' { b'1' } else { b'0' };
        String::from_utf8(b).unwrap()
    };
    let forged = [
        // A MAC digit changed.
        flip(&id, 30),
        // The other worker's token with this id's MAC and engine id.
        format!("{}{}", &other[..25], &id[25..]),
        // The engine's own id, and the old unsigned format for it.
        id[57..].to_string(),
        format!("resp_sy{}{}", &id[9..25], &id[57..]),
    ];
    for f in &forged {
        let (status, v) = call(
            &url,
            KEY_A,
            Method::GET,
            &format!("/v1/responses/{f}"),
            None,
        )
        .await;
        not_found(status, &v, f);
        let (status, v) = call(
            &url,
            KEY_A,
            Method::POST,
            "/v1/responses",
            Some(continuation(&model, f)),
        )
        .await;
        not_found(status, &v, f);
    }
    // Path tricks: an encoded slash, a dot segment, a query in the id.
    for path in [
        format!("/v1/responses/{id}%2F..%2Fcancel"),
        format!("/v1/responses/{id}%3Fx=1"),
        format!("/v1/responses/..%2Fresponses%2F{}", &id[57..]),
    ] {
        let (status, v) = call(&url, KEY_A, Method::GET, &path, None).await;
        not_found(status, &v, &path);
    }
    assert_eq!(
        refusals(&url, "mac").await - before[0],
        4.0,
        "flipped and moved MACs"
    );
    assert_eq!(refusals(&url, "legacy").await - before[1], 2.0);
    assert_eq!(refusals(&url, "format").await - before[2], 5.0);
    // The real ids still work.
    for good in [&id, &other] {
        let (status, v) = call(
            &url,
            KEY_A,
            Method::GET,
            &format!("/v1/responses/{good}"),
            None,
        )
        .await;
        assert_eq!(status, 200, "{v}");
    }
    gw.shutdown().await;
}

#[tokio::test]
async fn gateways_sharing_an_id_key_accept_each_others_ids_and_others_do_not() {
    let _counting = COUNTING.lock().await;
    set_env();
    let s = sim(20.0).await;
    let model = sim_model();
    let pool = [("p", &*model, &[&s][..], "")];
    let one = gateway(&config("SY_STORED_ID_KEY", "", &pool)).await;
    let two = gateway(&config("SY_STORED_ID_KEY", "", &pool)).await;
    let other = gateway(&config("SY_STORED_OTHER_ID_KEY", "", &pool)).await;
    let id = create(&one.url(), KEY_A, &model).await;
    let (status, v) = call(
        &two.url(),
        KEY_A,
        Method::GET,
        &format!("/v1/responses/{id}"),
        None,
    )
    .await;
    assert_eq!(status, 200, "a replica with the same key: {v}");
    let body = Some(continuation(&model, &id));
    let (status, v) = call(
        &two.url(),
        KEY_A,
        Method::POST,
        "/v1/responses",
        body.clone(),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let (status, v) = call(
        &other.url(),
        KEY_A,
        Method::GET,
        &format!("/v1/responses/{id}"),
        None,
    )
    .await;
    not_found(status, &v, "another deployment's key");
    let (status, v) = call(&other.url(), KEY_A, Method::POST, "/v1/responses", body).await;
    not_found(status, &v, "another deployment's key");
    for g in [one, two, other] {
        g.shutdown().await;
    }
}

#[tokio::test]
async fn the_owners_model_decides_permission_and_pays_the_limits() {
    set_env();
    let (s1, s2) = (sim(20.0).await, sim(20.0).await);
    let m1 = sim_model();
    let m2 = format!("{m1}-two");
    // The sims serve one model name: m2's pool sends it as m1.
    let rename = format!("upstream_model = \"{m1}\"");
    let pools = [
        ("p1", &*m1, &[&s1][..], ""),
        ("p2", &*m2, &[&s2][..], &*rename),
    ];
    // On `open`, b may use both models, with two requests a minute on m2;
    // `narrow` (same id key) lets b use m1 only.
    let limits = format!("[tenants.model_limits.\"{m2}\"]\nrequests_per_minute = 2");
    let open = gateway(&config("SY_STORED_ID_KEY", &limits, &pools)).await;
    let only_m1 = format!("allowed_models = [\"{m1}\"]");
    let narrow = gateway(&config("SY_STORED_ID_KEY", &only_m1, &pools)).await;
    let id = create(&open.url(), KEY_B, &m2).await;
    let generated = s2.requests_received();

    // Through `narrow`, b's own id on m2 is refused whatever model it names.
    let body = Some(continuation(&m1, &id));
    let (status, v) = call(
        &narrow.url(),
        KEY_B,
        Method::POST,
        "/v1/responses",
        body.clone(),
    )
    .await;
    assert_eq!(status, 403, "{v}");
    assert_eq!(v["error"]["code"], "model_not_allowed", "{v}");
    let (status, v) = call(
        &narrow.url(),
        KEY_B,
        Method::GET,
        &format!("/v1/responses/{id}"),
        None,
    )
    .await;
    assert_eq!(status, 403, "{v}");
    assert_eq!(
        s2.requests_received(),
        generated,
        "nothing reached m2's worker"
    );

    // Through `open`, a continuation naming m1 is served by m2's worker and
    // charged to m2: the creation and this one use m2's two requests.
    let (status, v) = call(
        &open.url(),
        KEY_B,
        Method::POST,
        "/v1/responses",
        body.clone(),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(s2.requests_received(), generated + 1);
    let (status, v) = call(&open.url(), KEY_B, Method::POST, "/v1/responses", body).await;
    assert_eq!(status, 429, "m2's limit: {v}");
    // m1 itself is not charged.
    let fresh = json!({"model": m1, "input": "hi", "max_output_tokens": 2});
    for _ in 0..3 {
        let (status, v) = call(
            &open.url(),
            KEY_B,
            Method::POST,
            "/v1/responses",
            Some(fresh.clone()),
        )
        .await;
        assert_eq!(status, 200, "{v}");
    }
    open.shutdown().await;
    narrow.shutdown().await;
}

/// A streamed chat completion that holds a slot until the task is aborted.
fn blocker(url: &str, model: &str) -> tokio::task::JoinHandle<()> {
    let (url, model) = (url.to_string(), model.to_string());
    tokio::spawn(async move {
        let body = json!({"model": model, "messages": [{"role": "user", "content": "go on"}],
                          "max_tokens": 2000, "ignore_eos": true, "stream": true});
        let r = client()
            .post(format!("{url}/v1/chat/completions"))
            .bearer_auth(KEY_A)
            .json(&body)
            .send()
            .await
            .unwrap();
        let _ = r.text().await;
    })
}

async fn queued(url: &str, n: f64) {
    eventually(Duration::from_secs(20), "requests queued", || async move {
        let m = scrape(url).await;
        (metric_sum(&m, "switchyard_queue_depth", &[("pool", "p")]) == n).then_some(())
    })
    .await
}

#[tokio::test]
async fn a_continuation_waits_for_a_slot_on_its_owner_and_lets_others_pass() {
    set_env();
    let (s1, s2) = (sim(0.2).await, sim(0.2).await);
    let model = sim_model();
    let lines = "policy = \"round_robin\"\nmax_concurrency_per_worker = 1";
    let gw = gateway(&config(
        "SY_STORED_ID_KEY",
        "",
        &[("p", &model, &[&s1, &s2], lines)],
    ))
    .await;
    let url = gw.url();
    let id = create(&url, KEY_A, &model).await;
    let (owner, free) = if s1.requests_received() == 1 {
        (&s1, &s2)
    } else {
        (&s2, &s1)
    };
    // Fill the owner's only slot; a blocker that lands on the other worker
    // is let go again.
    let mut on_owner = None;
    while on_owner.is_none() {
        let (before, total) = (
            owner.requests_received(),
            s1.requests_received() + s2.requests_received(),
        );
        let b = blocker(&url, &model);
        eventually(Duration::from_secs(20), "blocker dispatched", || async {
            (s1.requests_received() + s2.requests_received() > total).then_some(())
        })
        .await;
        if owner.requests_received() > before {
            on_owner = Some(b);
        } else {
            b.abort();
        }
    }
    eventually(Duration::from_secs(20), "other worker idle", || async {
        (sim_metric(&free.url(), "vllm:num_requests_running").await == 0.0).then_some(())
    })
    .await;

    // The continuation waits in the queue although the other worker is free.
    let (u, body) = (url.clone(), continuation(&model, &id));
    let cont =
        tokio::spawn(
            async move { call(&u, KEY_A, Method::POST, "/v1/responses", Some(body)).await },
        );
    queued(&url, 1.0).await;
    let at_owner = owner.requests_received();
    // A plain request is not held behind it: it takes the free worker.
    let plain = json!({"model": model, "input": "meanwhile", "max_output_tokens": 2});
    let (status, v) = call(&url, KEY_A, Method::POST, "/v1/responses", Some(plain)).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        owner.requests_received(),
        at_owner,
        "still queued, not at its owner"
    );
    assert!(!cont.is_finished());
    // The owner's slot frees: the continuation is served there.
    on_owner.unwrap().abort();
    let (status, v) = cont.await.unwrap();
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        owner.requests_received(),
        at_owner + 1,
        "served by its owner"
    );
    gw.shutdown().await;
}
