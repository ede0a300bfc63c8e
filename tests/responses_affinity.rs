//! Responses API continuation affinity through several `switchyard serve`
//! processes: a conversation continued with `previous_response_id` reaches the
//! worker that stored it on every replica (the sims keep responses in memory
//! and refuse ids they do not hold), stored responses are read and deleted on
//! their owner, and a lost owner gets the documented errors.

mod support;

use serde_json::{json, Value};
use std::time::Duration;
use support::*;

/// The Responses id key every replica shares (through `ID_KEY_VAR`).
const ID_KEY_VAR: &str = "SY_AFFINITY_ID_KEY";
const ID_KEY: &str = "3c5e7a9b1d2f4e6a8c0b2d4f6e8a0c1e";

/// A round-robin pool over `workers`, so a turn without affinity would move.
fn config(model: &str, workers: &[&str]) -> String {
    std::env::set_var(ID_KEY_VAR, ID_KEY);
    format!(
        "[server]\ndebug_headers = true\nid_key_env = \"{ID_KEY_VAR}\"\n{}",
        pool_toml(model, workers, "policy = \"round_robin\"")
    )
}

/// One turn: the status, the response id, and (when streamed) every id the
/// events carried.
async fn turn(url: &str, body: Value) -> (u16, Value, Vec<String>) {
    let r = client()
        .post(format!("{url}/v1/responses"))
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    if body["stream"] != json!(true) || status != 200 {
        let v: Value = r.json().await.unwrap();
        return (status, v, Vec::new());
    }
    let text = r.text().await.unwrap();
    let mut ids = Vec::new();
    let mut last = Value::Null;
    for data in text.lines().filter_map(|l| l.strip_prefix("data: ")) {
        let e: Value = serde_json::from_str(data).unwrap();
        if let Some(id) = e["response"]["id"].as_str() {
            ids.push(id.to_string());
            last = e["response"].clone();
        }
    }
    assert!(
        text.contains("event: response.completed"),
        "stream completed: {text}"
    );
    (status, last, ids)
}

async fn successes(url: &str) -> f64 {
    sim_metric(url, "vllm:request_success_total").await
}

#[tokio::test]
async fn a_conversation_stays_on_its_worker_across_replicas() {
    let sims = sims(3, 20.0).await;
    let model = sim_model();
    let u = urls(&sims);
    let dir = std::env::temp_dir().join(format!("switchyard-affinity-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("gw.toml");
    std::fs::write(&file, config(&model, &[&u[0], &u[1], &u[2]])).unwrap();
    let mut replicas = Vec::new();
    for _ in 0..3 {
        replicas.push(serve_binary_with(&file, &[(ID_KEY_VAR, ID_KEY)], None).await);
    }

    // Five turns, round-robin over the replicas, turns 2 and 4 streamed.
    let mut prev: Option<String> = None;
    for t in 0..5 {
        let mut body = json!({"model": model, "input": format!("turn {t} of the story"),
                              "max_output_tokens": 4, "stream": t % 2 == 1});
        if let Some(p) = &prev {
            body["previous_response_id"] = json!(p);
        }
        let (status, resp, events) = turn(&replicas[t % 3].url, body).await;
        assert_eq!(status, 200, "turn {t}: {resp}");
        let id = resp["id"].as_str().unwrap().to_string();
        assert!(id.starts_with("resp_syv2"), "gateway-issued id: {id}");
        assert_eq!(resp["previous_response_id"].as_str(), prev.as_deref());
        for e in &events {
            assert_eq!(e, &id, "every streamed event names the gateway id");
        }
        if t % 2 == 1 {
            assert!(events.len() >= 2, "created and completed events");
        }
        prev = Some(id);
    }
    let mut served = Vec::new();
    for url in &u {
        served.push(successes(url).await);
    }
    served.sort_by(f64::total_cmp);
    assert_eq!(
        served,
        vec![0.0, 0.0, 5.0],
        "one worker served all five turns"
    );
    let owner = {
        let mut o = 0;
        for (i, url) in u.iter().enumerate() {
            if successes(url).await == 5.0 {
                o = i;
            }
        }
        o
    };
    let last = prev.clone().unwrap();

    // The stored response is read and deleted on its owner, from any replica.
    let got: Value = get_json(&format!("{}/v1/responses/{last}", replicas[2].url)).await;
    assert_eq!(got["id"], json!(last), "{got}");
    let foreign = client()
        .get(format!("{}/v1/responses/resp_123", replicas[1].url))
        .send()
        .await
        .unwrap();
    assert_eq!(foreign.status(), 404);
    let v: Value = foreign.json().await.unwrap();
    assert_eq!(v["error"]["code"], "response_not_found", "{v}");

    // Owner killed: a continuation gets 503 naming the owner; the full input
    // goes elsewhere as usual.
    sims[owner].kill();
    let follow = json!({"model": model, "input": "turn 6", "max_output_tokens": 4,
                        "previous_response_id": last});
    let (status, v, _) = turn(&replicas[0].url, follow.clone()).await;
    assert_eq!(status, 503, "{v}");
    assert_eq!(v["error"]["code"], "response_owner_unavailable", "{v}");
    let full = json!({"model": model, "max_output_tokens": 4,
                      "input": [{"role": "user", "content": "the whole story again"}]});
    let (status, v, _) = turn(&replicas[1].url, full).await;
    assert_eq!(status, 200, "{v}");

    // Owner removed from the config (reloaded on SIGHUP): 404 naming the reason.
    let rest: Vec<&str> = (0..3).filter(|&i| i != owner).map(|i| &*u[i]).collect();
    std::fs::write(&file, config(&model, &rest)).unwrap();
    for r in &replicas {
        let pid = r.child.id().unwrap().to_string();
        std::process::Command::new("kill")
            .args(["-HUP", &pid])
            .status()
            .unwrap();
    }
    for r in &replicas {
        eventually(Duration::from_secs(10), "config reloaded", || {
            let url = r.url.clone();
            async move {
                let m = scrape(&url).await;
                let n = metric_sum(
                    &m,
                    switchyard::telemetry::names::CONFIG_RELOADS_TOTAL,
                    &[("result", "ok")],
                );
                (n >= 1.0).then_some(())
            }
        })
        .await;
    }
    for r in &replicas {
        let (status, v, _) = turn(&r.url, follow.clone()).await;
        assert_eq!(status, 404, "{v}");
        assert_eq!(v["error"]["code"], "response_owner_gone", "{v}");
        assert_eq!(v["error"]["param"], "previous_response_id", "{v}");
    }
    for mut r in replicas {
        r.child.kill().await.ok();
    }
    std::fs::remove_dir_all(dir).ok();
}

#[tokio::test]
async fn a_stored_response_is_deleted_on_its_owner() {
    let sims = sims(2, 20.0).await;
    let model = sim_model();
    let u = urls(&sims);
    let gw = gateway(&config(&model, &[&u[0], &u[1]])).await;
    let (status, v, _) = turn(
        &gw.url(),
        json!({"model": model, "input": "remember me", "max_output_tokens": 3}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let id = v["id"].as_str().unwrap();
    let url = format!("{}/v1/responses/{id}", gw.url());
    // Round-robin would alternate; the owner answers every time.
    for _ in 0..3 {
        let r = client().get(&url).send().await.unwrap();
        assert_eq!(r.status(), 200);
    }
    let del: Value = client()
        .delete(&url)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(del["deleted"], json!(true), "{del}");
    assert_eq!(del["id"], json!(id), "the deletion names the gateway id");
    let r = client().get(&url).send().await.unwrap();
    assert_eq!(r.status(), 404, "deleted on the owner");
    // A continuation of a deleted response: the engine's own 404.
    let (status, v, _) = turn(
        &gw.url(),
        json!({"model": model, "input": "again", "previous_response_id": id}),
    )
    .await;
    assert_eq!(status, 404, "{v}");
    gw.shutdown().await;
}
