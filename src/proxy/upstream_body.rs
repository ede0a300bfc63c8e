//! The body a pool's engines get, built once for each pool a request tries: a
//! Messages request translated to chat (pools that translate), the model
//! renamed for an external upstream, SGLang's `rid` set so a leaving client's
//! request can be aborted (always the gateway's own, unique: a client that
//! chose it, or reused another request's id, could abort someone else's), and usage asked for on streams so every request's
//! tokens are exact. Edits that need a parse share one; the usual request is
//! sent as it came (no copy), or with usage asked for by one splice.

use super::{anthropic, usage, GatewayError};
use crate::api::anthropic::request;
use crate::api::{Endpoint, RequestInfo};
use crate::config::{AnthropicMode, EngineKind, PoolConfig};
use bytes::{BufMut, Bytes, BytesMut};
use http::HeaderValue;
use serde_json::{Map, Value};

/// The request body as `pool` takes it. `body` is the client's (after any
/// continuation rewrite); `info` was read from it.
pub fn for_pool(
    body: &Bytes,
    info: &RequestInfo,
    pool: &PoolConfig,
    endpoint: Endpoint,
    request_id: &HeaderValue,
) -> Result<Bytes, GatewayError> {
    if endpoint == Endpoint::CountTokens && pool.anthropic == AnthropicMode::Translate {
        return Err(GatewayError::NotSupported(format!(
            "count_tokens is not available on pool `{}`: its engines do not serve the Messages API",
            pool.name
        )));
    }
    let translated = anthropic::translates(pool, endpoint);
    let chat;
    let body = if translated {
        // The chat request asks for usage itself.
        chat = request::to_chat(body).map_err(GatewayError::InvalidRequest)?;
        &chat
    } else {
        body
    };
    let rid = sglang_rid(pool, endpoint, translated, request_id);
    let edits = Edits {
        model: pool.upstream_model.as_deref(),
        rid: rid.as_deref(),
        usage: !translated && usage::asks(info, pool, endpoint),
    };
    edits.apply(body, info.has_stream_options)
}

/// What one pool changes in a body.
struct Edits<'a> {
    model: Option<&'a str>,
    /// SGLang's request id (replacing any the client set).
    rid: Option<&'a str>,
    /// Set `stream_options.include_usage`.
    usage: bool,
}

impl Edits<'_> {
    fn apply(&self, body: &Bytes, has_stream_options: bool) -> Result<Bytes, GatewayError> {
        let parse =
            self.model.is_some() || self.rid.is_some() || (self.usage && has_stream_options);
        if parse {
            return self.rewrite(body);
        }
        if self.usage {
            return Ok(splice_usage(body));
        }
        Ok(body.clone())
    }

    /// Parse, edit and serialize again.
    fn rewrite(&self, body: &Bytes) -> Result<Bytes, GatewayError> {
        let malformed = |e: serde_json::Error| GatewayError::MalformedJson(e.to_string());
        let mut v: Map<String, Value> = serde_json::from_slice(body).map_err(malformed)?;
        if let Some(name) = self.model {
            v.insert("model".into(), Value::String(name.to_string()));
        }
        if let Some(rid) = self.rid {
            v.insert("rid".into(), Value::String(rid.to_string()));
        }
        if self.usage {
            match v.get_mut("stream_options") {
                Some(Value::Object(o)) => {
                    o.insert("include_usage".into(), Value::Bool(true));
                }
                _ => {
                    let mut o = Map::new();
                    o.insert("include_usage".into(), Value::Bool(true));
                    v.insert("stream_options".into(), Value::Object(o));
                }
            }
        }
        serde_json::to_vec(&v).map(Bytes::from).map_err(malformed)
    }
}

/// The `rid` an SGLang pool's generation requests carry: the request id (for
/// reading engine logs) and a suffix unique to this process and body, so no
/// two requests share one even when a client sends another's request id.
fn sglang_rid(
    pool: &PoolConfig,
    endpoint: Endpoint,
    translated: bool,
    request_id: &HeaderValue,
) -> Option<String> {
    static PREFIX: std::sync::LazyLock<u32> = std::sync::LazyLock::new(rand::random);
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    let generates = translated
        || matches!(
            endpoint,
            Endpoint::ChatCompletions | Endpoint::Completions | Endpoint::Responses
        );
    if pool.engine != EngineKind::Sglang || !generates {
        return None;
    }
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let id = request_id.to_str().unwrap_or("request");
    Some(format!("{id}.{:08x}{n:x}", *PREFIX))
}

const USAGE_MEMBER: &[u8] = br#""stream_options":{"include_usage":true}"#;

/// `body` (an object without `stream_options`) with the usage option as its
/// first member: one copy, no parse.
fn splice_usage(body: &Bytes) -> Bytes {
    let Some(open) = body.iter().position(|&b| b == b'{') else {
        return body.clone();
    };
    let rest = &body[open + 1..];
    let empty = rest.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'}');
    let mut out = BytesMut::with_capacity(body.len() + USAGE_MEMBER.len() + 1);
    out.put_slice(&body[..=open]);
    out.put_slice(USAGE_MEMBER);
    if !empty {
        out.put_u8(b',');
    }
    out.put_slice(rest);
    out.freeze()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::inspect;

    fn pool(extra: &str) -> PoolConfig {
        let toml = format!(
            "[[pools]]\nname = \"p\"\nmodels = [\"m\"]\nworkers = [{{ url = \"http://a:1\" }}]\n{extra}"
        );
        crate::config::parse(&toml)
            .and_then(|r| r.validate())
            .unwrap()
            .pools
            .remove(0)
    }

    fn send(body: &'static str, pool: &PoolConfig, endpoint: Endpoint) -> Value {
        let body = Bytes::from_static(body.as_bytes());
        let info = inspect::inspect(&body).unwrap();
        let rid = HeaderValue::from_static("req-1");
        let out = for_pool(&body, &info, pool, endpoint, &rid).unwrap();
        serde_json::from_slice(&out).unwrap()
    }

    #[test]
    fn streams_ask_for_usage_and_other_requests_are_unchanged() {
        let p = pool("");
        let chat = Endpoint::ChatCompletions;
        let v = send(r#" { "model":"m","stream":true}"#, &p, chat);
        assert_eq!(v["stream_options"]["include_usage"], true);
        assert_eq!(v["model"], "m");
        let v = send(
            r#"{"model":"m","stream":true,"stream_options":null}"#,
            &p,
            chat,
        );
        assert_eq!(v["stream_options"]["include_usage"], true);
        let v = send(
            r#"{"model":"m","stream":true,"stream_options":{"continuous_usage_stats":false}}"#,
            &p,
            chat,
        );
        assert_eq!(v["stream_options"]["include_usage"], true);
        assert_eq!(v["stream_options"]["continuous_usage_stats"], false);
        let plain = r#"{"model":"m","stream":false}"#;
        assert_eq!(send(plain, &p, chat).get("stream_options"), None);
        let emb = r#"{"model":"m","stream":true}"#;
        assert_eq!(
            send(emb, &p, Endpoint::Embeddings).get("stream_options"),
            None
        );
        let off = pool("request_usage = false");
        let v = send(r#"{"model":"m","stream":true}"#, &off, chat);
        assert_eq!(v.get("stream_options"), None);
    }

    #[test]
    fn an_empty_object_gets_a_lone_member() {
        let out = splice_usage(&Bytes::from_static(b"{ }"));
        assert_eq!(&out[..], br#"{"stream_options":{"include_usage":true} }"#);
    }

    #[test]
    fn edits_share_one_rewrite() {
        let p = pool("engine = \"sglang\"\nupstream_model = \"up\"");
        let v = send(
            r#"{"model":"m","stream":true}"#,
            &p,
            Endpoint::ChatCompletions,
        );
        assert_eq!(v["model"], "up");
        let rid = v["rid"].as_str().unwrap();
        assert!(rid.starts_with("req-1."), "{rid}");
        assert_eq!(v["stream_options"]["include_usage"], true);
        // A client's own rid (perhaps another request's) is replaced, and the
        // same request id twice still gives two rids.
        let own = send(r#"{"model":"m","rid":"mine"}"#, &p, Endpoint::Completions);
        let own = own["rid"].as_str().unwrap();
        assert!(own.starts_with("req-1.") && own != rid, "{own} {rid}");
        let other = send(r#"{"model":"m"}"#, &p, Endpoint::Other);
        assert_eq!(other.get("rid"), None);
        let vllm = send(r#"{"model":"m"}"#, &pool(""), Endpoint::Completions);
        assert_eq!(vllm.get("rid"), None);
    }
}
