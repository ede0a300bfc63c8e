//! The engine endpoints beside generation, through `switchyard serve`:
//! tokenize/detokenize, rerank and score routed by their `model`, and audio
//! uploads streamed to the worker as they arrive.

mod support;

use serde_json::{json, Value};
use std::time::Duration;
use support::*;

async fn post(url: &str, body: Value) -> (u16, Value) {
    let r = client().post(url).json(&body).send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap())
}

#[tokio::test]
async fn tokenize_rerank_and_score_reach_a_worker_of_the_model() {
    let sims = sims(2, 20.0).await;
    let model = sim_model();
    let u = urls(&sims);
    let file = config_file("endpoints", &pool_toml(&model, &[&u[0], &u[1]], ""));
    let gw = serve_binary(&file).await;
    let base = &gw.url;

    let (st, t) = post(
        &format!("{base}/tokenize"),
        json!({"model": model, "prompt": "The water"}),
    )
    .await;
    assert_eq!(st, 200, "{t}");
    assert_eq!(t["count"], json!(2), "{t}");
    assert!(t["max_model_len"].as_u64().unwrap() > 0);
    let (st, d) = post(
        &format!("{base}/detokenize"),
        json!({"model": model, "tokens": t["tokens"]}),
    )
    .await;
    assert_eq!(st, 200, "{d}");
    assert_eq!(d["prompt"], "The water");

    let docs = json!(["a cat sat", "the river water is green", "green water"]);
    for path in ["/v1/rerank", "/rerank", "/v2/rerank"] {
        let (st, r) = post(
            &format!("{base}{path}"),
            json!({"model": model, "query": "green river water", "documents": docs, "top_n": 2}),
        )
        .await;
        assert_eq!(st, 200, "{path}: {r}");
        let order: Vec<u64> = r["results"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x["index"].as_u64().unwrap())
            .collect();
        assert_eq!(order, vec![1, 2], "{path}: {r}");
    }
    for path in ["/v1/score", "/score"] {
        let (st, r) = post(
            &format!("{base}{path}"),
            json!({"model": model, "text_1": "green water", "text_2": ["green water", "a cat"]}),
        )
        .await;
        assert_eq!(st, 200, "{path}: {r}");
        assert_eq!(r["data"][0]["score"], json!(1.0), "{r}");
        assert_eq!(r["data"][1]["score"], json!(0.0), "{r}");
    }
    // The gateway needs the model to route; it says so in OpenAI's shape.
    let (st, e) = post(&format!("{base}/tokenize"), json!({"prompt": "x"})).await;
    assert_eq!(st, 400, "{e}");
    assert_eq!(e["error"]["param"], "model", "{e}");
    let (st, e) = post(
        &format!("{base}/v1/rerank"),
        json!({"model": "nope", "query": "q"}),
    )
    .await;
    assert_eq!(st, 404, "{e}");
    assert_eq!(e["error"]["code"], "model_not_found", "{e}");
}

const BOUNDARY: &str = "sYbOuNdArY";

/// The multipart head: the model field, then the file part's headers.
fn upload_head(model: &str) -> String {
    format!(
        "--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\n{model}\r\n\
         --{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\
         Content-Type: audio/wav\r\n\r\n"
    )
}

#[tokio::test]
async fn an_audio_upload_reaches_the_worker_before_the_client_finished_sending() {
    let sims = sims(1, 20.0).await;
    let model = sim_model();
    let u = urls(&sims);
    let file = config_file(
        "audio",
        &format!(
            "[server]\nmax_body_bytes = 4000000\n{}",
            pool_toml(&model, &[&u[0]], "")
        ),
    );
    let gw = serve_binary(&file).await;
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<bytes::Bytes, std::io::Error>>(4);
    let stream = tokio_stream::wrappers::ReceiverStream::new(rx);
    let head = upload_head(&model);
    let chunk = vec![b'A'; 256 * 1024];
    let tail = format!("\r\n--{BOUNDARY}--\r\n");
    let total = head.len() + 2 * chunk.len() + tail.len();
    let req = client()
        .post(format!("{}/v1/audio/transcriptions", gw.url))
        .header(
            "content-type",
            format!("multipart/form-data; boundary={BOUNDARY}"),
        )
        .body(reqwest::Body::wrap_stream(stream))
        .send();
    let answer = tokio::spawn(req);
    tx.send(Ok(head.into_bytes().into())).await.unwrap();
    tx.send(Ok(chunk.clone().into())).await.unwrap();
    // The worker sees the upload while the client still holds the rest of it:
    // a gateway that buffered the body would forward nothing yet.
    eventually(Duration::from_secs(10), "first bytes at the worker", || {
        let n = sims[0].audio_bytes_received();
        async move { (n > 0).then_some(()) }
    })
    .await;
    assert!(sims[0].audio_bytes_received() < total as u64);
    tx.send(Ok(chunk.into())).await.unwrap();
    tx.send(Ok(tail.into_bytes().into())).await.unwrap();
    drop(tx);
    let r = answer.await.unwrap().unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(
        v["text"],
        format!("{total} bytes of audio"),
        "every byte forwarded unchanged"
    );
    assert_eq!(sims[0].audio_bytes_received(), total as u64);

    // Translations too; over the limit, and without a model: OpenAI-shaped errors.
    let small = format!("{}AAAA\r\n--{BOUNDARY}--\r\n", upload_head(&model));
    let send = |path: &'static str, body: Vec<u8>| {
        client()
            .post(format!("{}{path}", gw.url))
            .header(
                "content-type",
                format!("multipart/form-data; boundary={BOUNDARY}"),
            )
            .body(body)
            .send()
    };
    let r = send("/v1/audio/translations", small.into_bytes())
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    // Over the limit by its declared length: refused before the body is read
    // (the client still holds the rest, so the answer is not lost in a reset).
    let (big_tx, big_rx) = tokio::sync::mpsc::channel::<Result<bytes::Bytes, std::io::Error>>(1);
    big_tx
        .send(Ok(upload_head(&model).into_bytes().into()))
        .await
        .unwrap();
    let r = client()
        .post(format!("{}/v1/audio/transcriptions", gw.url))
        .header(
            "content-type",
            format!("multipart/form-data; boundary={BOUNDARY}"),
        )
        .header("content-length", "4000001")
        .body(reqwest::Body::wrap_stream(
            tokio_stream::wrappers::ReceiverStream::new(big_rx),
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 413);
    drop(big_tx);
    let no_model = format!(
        "--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\r\nAAAA\r\n--{BOUNDARY}--\r\n"
    );
    let r = send("/v1/audio/transcriptions", no_model.into_bytes())
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["param"], "model", "{v}");
    let r = client()
        .post(format!("{}/v1/audio/transcriptions", gw.url))
        .json(&json!({"model": model}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400, "a JSON body is not an upload");
}

#[tokio::test]
async fn models_merge_pools_aliases_and_adapters_with_engine_metadata() {
    let sims = sims(1, 20.0).await;
    let model = sim_model();
    let u = urls(&sims);
    let file = config_file(
        "models",
        &pool_toml(
            &model,
            &[&u[0]],
            "aliases = [\"tiny-alias\"]\nlora_adapters = [\"my-lora\"]",
        ),
    );
    let gw = serve_binary(&file).await;
    let list: Value = get_json(&format!("{}/v1/models", gw.url)).await;
    let card = |id: &str| {
        list["data"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["id"] == id)
            .unwrap_or_else(|| panic!("{id} listed: {list}"))
            .clone()
    };
    let max_len = sims[0].config().max_model_len;
    let base = card(&model);
    assert_eq!(base["max_model_len"], json!(max_len), "{base}");
    assert_eq!(base["owned_by"], "vllm", "the engine's owner: {base}");
    assert_eq!(base["root"], json!(model));
    assert!(base.get("parent").is_none(), "{base}");
    let alias = card("tiny-alias");
    assert_eq!(alias["parent"], json!(model), "{alias}");
    assert_eq!(alias["max_model_len"], json!(max_len));
    let lora = card("my-lora");
    assert_eq!(lora["parent"], json!(model), "{lora}");
    assert_eq!(lora["max_model_len"], json!(max_len));
    let one: Value = get_json(&format!("{}/v1/models/tiny-alias", gw.url)).await;
    assert_eq!(one["parent"], json!(model), "{one}");
    // The engines' lists are reused for a while: with the only engine gone, the
    // next listing still carries its metadata, without asking it.
    sims[0].kill();
    let again: Value = get_json(&format!("{}/v1/models/{model}", gw.url)).await;
    assert_eq!(again["max_model_len"], json!(max_len), "{again}");
}
