//! The engine endpoints beside generation that clients call, with simple
//! deterministic answers in vLLM's shapes: `/tokenize`, `/detokenize`,
//! `/v1/rerank` (also `/rerank`, `/v2/rerank`), `/v1/score` (also `/score`)
//! and the audio uploads `/v1/audio/transcriptions` and `/translations`.
//!
//! Relevance is the share of the query's distinct words found in the
//! document, so a test can predict the order. An audio upload is read as a
//! stream and answered with its size.

use std::collections::HashSet;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use http_body_util::BodyExt;
use serde_json::{json, Value};

use super::api::{bad, check_model, now_secs, parse_json, ApiError};
use super::engine::vocab;
use super::{tokenizer, Shared};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

type S = State<Arc<Shared>>;

fn answer(r: Result<Value, ApiError>) -> Response {
    match r {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

fn model_of(s: &Shared, v: &Value) -> Result<String, ApiError> {
    check_model(s, v.get("model").and_then(Value::as_str).map(String::from))
}

/// `POST /tokenize`: `prompt` (or chat `messages`) → token ids.
pub(super) async fn tokenize(State(s): S, body: Bytes) -> Response {
    answer((|| {
        let v = parse_json(&body)?;
        model_of(&s, &v)?;
        let tokens = match (v.get("prompt"), v.get("messages")) {
            (Some(Value::String(p)), _) => tokenizer::encode(p),
            (_, Some(Value::Array(m))) => tokenizer::encode_chat(m.iter().map(|m| {
                (
                    m["role"].as_str().unwrap_or("user"),
                    m["content"].as_str().unwrap_or_default(),
                )
            })),
            _ => return Err(bad("prompt: field required (a string), or messages")),
        };
        Ok(
            json!({"count": tokens.len(), "max_model_len": s.cfg.max_model_len,
                  "tokens": tokens, "token_strs": null}),
        )
    })())
}

/// `POST /detokenize`: token ids → text. Ids of the generated vocabulary
/// decode to their text; others to `<|id|>`.
pub(super) async fn detokenize(State(s): S, body: Bytes) -> Response {
    answer((|| {
        let v = parse_json(&body)?;
        model_of(&s, &v)?;
        let Some(ids) = v.get("tokens").and_then(Value::as_array) else {
            return Err(bad("tokens: field required (a list of token ids)"));
        };
        let voc = vocab();
        let mut text = String::new();
        for id in ids {
            let id = id
                .as_u64()
                .ok_or_else(|| bad("tokens: token ids must be non-negative integers"))?;
            match voc.ids.iter().position(|&x| u64::from(x) == id) {
                Some(i) => text.push_str(&voc.text[i]),
                None => text.push_str(&format!("<|{id}|>")),
            }
        }
        Ok(json!({"prompt": text}))
    })())
}

fn words(t: &str) -> HashSet<String> {
    t.split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
        .map(str::to_lowercase)
        .collect()
}

/// Share of the query's distinct words present in `doc`.
fn relevance(query: &str, doc: &str) -> f64 {
    let q = words(query);
    if q.is_empty() {
        return 0.0;
    }
    let d = words(doc);
    q.iter().filter(|w| d.contains(*w)).count() as f64 / q.len() as f64
}

fn text_of(v: &Value) -> Option<&str> {
    v.as_str().or_else(|| v.get("text").and_then(Value::as_str))
}

/// `POST /v1/rerank` (Jina/Cohere style): documents by relevance, best first.
pub(super) async fn rerank(State(s): S, body: Bytes) -> Response {
    answer((|| {
        let v = parse_json(&body)?;
        let model = model_of(&s, &v)?;
        let query = v
            .get("query")
            .and_then(Value::as_str)
            .ok_or_else(|| bad("query: field required"))?;
        let docs = v
            .get("documents")
            .and_then(Value::as_array)
            .filter(|d| !d.is_empty())
            .ok_or_else(|| bad("documents: field required (a non-empty list)"))?;
        let mut results = Vec::new();
        let mut tokens = tokenizer::count(query);
        for (i, d) in docs.iter().enumerate() {
            let text = text_of(d).ok_or_else(|| bad(format!("documents[{i}]: must be text")))?;
            tokens += tokenizer::count(text);
            results.push((i, text, relevance(query, text)));
        }
        results.sort_by(|a, b| b.2.total_cmp(&a.2).then(a.0.cmp(&b.0)));
        let top = v
            .get("top_n")
            .and_then(Value::as_u64)
            .map_or(results.len(), |n| n as usize);
        let results: Vec<Value> = results
            .into_iter()
            .take(top)
            .map(|(i, t, r)| json!({"index": i, "document": {"text": t}, "relevance_score": r}))
            .collect();
        Ok(
            json!({"id": format!("rerank-{}", uuid::Uuid::new_v4().simple()), "model": model,
                  "usage": {"total_tokens": tokens}, "results": results}),
        )
    })())
}

/// `POST /v1/score`: `text_1` against each of `text_2`.
pub(super) async fn score(State(s): S, body: Bytes) -> Response {
    answer((|| {
        let v = parse_json(&body)?;
        let model = model_of(&s, &v)?;
        let one = v
            .get("text_1")
            .and_then(Value::as_str)
            .ok_or_else(|| bad("text_1: field required"))?;
        let two: Vec<&str> = match v.get("text_2") {
            Some(Value::String(t)) => vec![t.as_str()],
            Some(Value::Array(a)) => a.iter().filter_map(Value::as_str).collect(),
            _ => {
                return Err(bad(
                    "text_2: field required (a string or a list of strings)",
                ))
            }
        };
        let data: Vec<Value> = two
            .iter()
            .enumerate()
            .map(|(i, t)| json!({"index": i, "object": "score", "score": relevance(one, t)}))
            .collect();
        let tokens: usize = tokenizer::count(one) * two.len()
            + two.iter().map(|t| tokenizer::count(t)).sum::<usize>();
        Ok(
            json!({"id": format!("score-{}", uuid::Uuid::new_v4().simple()), "object": "list",
                  "created": now_secs(), "model": model, "data": data,
                  "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}),
        )
    })())
}

/// `POST /v1/audio/transcriptions` and `/translations`: the multipart body is
/// read as it arrives (counted in [`Shared::audio_bytes`] frame by frame, so a
/// test can see an upload arrive before it is complete) and described.
pub(super) async fn audio(State(s): S, body: Body) -> Response {
    let mut body = body;
    let mut bytes = 0u64;
    let mut head = Vec::new();
    while let Some(frame) = body.frame().await {
        let Ok(frame) = frame else {
            return bad("the upload broke off").into_response();
        };
        if let Ok(data) = frame.into_data() {
            bytes += data.len() as u64;
            s.audio_bytes.fetch_add(data.len() as u64, Relaxed);
            if head.len() < 4096 {
                head.extend_from_slice(&data[..data.len().min(4096 - head.len())]);
            }
        }
    }
    let has_file = memchr::memmem::find(&head, b"name=\"file\"").is_some();
    if !has_file {
        return bad("file: field required").into_response();
    }
    axum::Json(json!({
        "text": format!("{bytes} bytes of audio"),
        "usage": {"type": "duration", "seconds": bytes / 32_000},
    }))
    .into_response()
}
