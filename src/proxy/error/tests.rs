//! The error table walked variant by variant.

use super::*;

/// Every refusal the limits can produce: each kind, passable later or never.
fn refusals() -> Vec<crate::tenancy::limits::Refusal> {
    use crate::tenancy::limits::gcra::Window;
    use crate::tenancy::limits::headers::RateHeaders;
    let kinds = [
        LimitKind::Requests,
        LimitKind::Tokens,
        LimitKind::Concurrency,
        LimitKind::DailyBudget,
        LimitKind::MonthlyBudget,
        LimitKind::StoreUnavailable,
    ];
    let window = Window {
        limit: 10,
        remaining: 0,
        reset_ns: 6_000_000_000,
    };
    let headers = RateHeaders {
        requests: Some(window),
        tokens: None,
    };
    let refusal = |kind, never| crate::tenancy::limits::Refusal {
        never,
        kind,
        scope: "tenant `acme`".into(),
        limit: "10 per minute".into(),
        retry_after_s: 7,
        headers,
    };
    let mut all: Vec<_> = kinds.iter().map(|&k| refusal(k, false)).collect();
    all.extend(kinds.iter().map(|&k| refusal(k, true)));
    all
}

/// One error of each variant (several for payload-dependent rows).
fn one_of_each() -> Vec<GatewayError> {
    use GatewayError::*;
    let w: Arc<str> = Arc::from("http://10.0.0.7:8000");
    let s = |x: &str| x.to_string();
    let mut all = vec![
        MalformedJson(s("eof")),
        JsonTooDeep(64),
        InvalidHeader("x-session-id"),
        MissingModel,
        InvalidRequest(s("bad")),
        NotSupported(s("no")),
        UnknownModel(s("m")),
        BodyTooLarge(1024),
        BodyRead(s("reset")),
        BodyTimeout(Duration::from_secs(3)),
        UnsupportedMediaType(s("text/plain")),
        MalformedMultipart(s("no boundary")),
        HeadersTooLarge(s("64 KiB")),
        UnsupportedTransferEncoding(s("gzip")),
        BadFraming("both Content-Length and Transfer-Encoding"),
        TenantNeedsKey,
        MissingApiKey,
        InvalidApiKey,
        ModelNotAllowed(s("m")),
        MethodNotAllowed {
            method: s("PUT"),
            path: s("/v1/models"),
        },
        NotFound(s("/v2")),
        ControlRouteForbidden(s("/sleep")),
        NoHealthyWorker(s("m")),
        ResidencyUnavailable {
            residency: Arc::from("eu"),
            regions: s("eu-west"),
            model: s("m"),
        },
        InvalidResidency {
            value: s("mars"),
            known: s("eu, us"),
        },
        QueueFull(s("p")),
        QueueTimeout(s("p")),
        QueueEvicted(s("p")),
        Preempted(s("p")),
        ResponseOwnerGone(s("resp_1")),
        ResponseOwnerUnavailable {
            id: s("resp_1"),
            detail: s("refused"),
        },
        UnknownResponse {
            id: s("resp_1"),
            param: None,
        },
        UnknownResponse {
            id: s("resp_1"),
            param: Some("previous_response_id"),
        },
        ProxyModeOnly {
            what: "GET /v1/responses/{id}",
            param: None,
        },
        ProxyModeOnly {
            what: "previous_response_id",
            param: Some("previous_response_id"),
        },
        SloUnattainable {
            model: s("m"),
            predicted_ttft_ms: 900,
            retry_after_s: 4,
        },
        DrainDeadline,
        UpstreamConnect {
            worker: w.clone(),
            detail: s("refused"),
        },
        UpstreamFailed {
            worker: w.clone(),
            detail: s("reset"),
        },
        UpstreamTimeout {
            worker: w,
            after: Duration::from_secs(30),
        },
    ];
    all.extend(refusals().into_iter().map(|r| Limited(Box::new(r))));
    all
}

/// The variant's position in the enum. No wildcard: a new variant does not
/// compile until it is listed here, and then fails `the_table_is_total`
/// until `one_of_each` constructs it.
fn ordinal(e: &GatewayError) -> usize {
    use GatewayError::*;
    match e {
        MalformedJson(_) => 0,
        JsonTooDeep(_) => 1,
        InvalidHeader(_) => 2,
        MissingModel => 3,
        InvalidRequest(_) => 4,
        NotSupported(_) => 5,
        UnknownModel(_) => 6,
        BodyTooLarge(_) => 7,
        BodyRead(_) => 8,
        BodyTimeout(_) => 9,
        UnsupportedMediaType(_) => 10,
        MalformedMultipart(_) => 11,
        HeadersTooLarge(_) => 12,
        UnsupportedTransferEncoding(_) => 13,
        BadFraming(_) => 14,
        TenantNeedsKey => 15,
        MissingApiKey => 16,
        InvalidApiKey => 17,
        ModelNotAllowed(_) => 18,
        Limited(_) => 19,
        MethodNotAllowed { .. } => 20,
        NotFound(_) => 21,
        ControlRouteForbidden(_) => 22,
        NoHealthyWorker(_) => 23,
        ResidencyUnavailable { .. } => 24,
        InvalidResidency { .. } => 25,
        QueueFull(_) => 26,
        QueueTimeout(_) => 27,
        QueueEvicted(_) => 28,
        Preempted(_) => 29,
        ResponseOwnerGone(_) => 30,
        ResponseOwnerUnavailable { .. } => 31,
        UnknownResponse { .. } => 32,
        ProxyModeOnly { .. } => 33,
        SloUnattainable { .. } => 34,
        DrainDeadline => 35,
        UpstreamConnect { .. } => 36,
        UpstreamFailed { .. } => 37,
        UpstreamTimeout { .. } => 38,
    }
}
const VARIANTS: usize = 39;

/// Every variant is constructed, and reason labels are few, well-formed
/// and name one variant each (a dashboard can tell them apart).
#[test]
fn the_table_is_total() {
    let all = one_of_each();
    let seen: std::collections::BTreeSet<usize> = all.iter().map(ordinal).collect();
    let missing: Vec<usize> = (0..VARIANTS).filter(|i| !seen.contains(i)).collect();
    assert!(missing.is_empty(), "variants not constructed: {missing:?}");
    let mut owner = std::collections::HashMap::new();
    for e in &all {
        let reason = e.kind().reason;
        let snake = |s: &str| {
            !s.is_empty() && s.len() <= 40 && s.bytes().all(|b| b.is_ascii_lowercase() || b == b'_')
        };
        assert!(snake(reason), "{reason}");
        assert!(e.kind().code.is_none_or(snake), "{e:?}");
        let first = *owner.entry(reason).or_insert(ordinal(e));
        assert_eq!(first, ordinal(e), "`{reason}` labels two variants");
    }
    // One label per variant, plus one per limit kind for `Limited`.
    assert_eq!(owner.len(), VARIANTS - 1 + 6);
}

/// The columns of each row agree with each other.
#[test]
fn the_table_is_consistent() {
    for e in one_of_each() {
        let k = e.kind();
        let s = k.status.as_u16();
        assert!(
            k.status.is_client_error() || k.status.is_server_error(),
            "{e:?}"
        );
        if k.retryable {
            assert!(k.falls_back && k.fault == Fault::Upstream, "{e:?}");
            assert!(s == 502 || s == 504, "{e:?}");
        }
        if k.falls_back {
            assert!(k.fault != Fault::Client && (s == 429 || s >= 500), "{e:?}");
        }
        // Retry-After on every 429 and 503, and only there.
        assert_eq!(k.retry_after_s.is_some(), s == 429 || s == 503, "{e:?}");
        let expected_type = match s {
            401 => vec![AUTHENTICATION],
            403 => vec![PERMISSION],
            429 => vec![RATE_LIMITED, QUOTA],
            503 => vec![UNAVAILABLE],
            502 | 504 => vec![UPSTREAM],
            _ => vec![INVALID],
        };
        assert!(expected_type.contains(&k.openai_type), "{e:?}");
        assert_eq!(
            k.fault == Fault::Upstream,
            k.openai_type == UPSTREAM,
            "{e:?}"
        );
        // The accessors read the row.
        assert_eq!(e.status(), k.status);
        assert_eq!(e.reason(), k.reason);
        assert_eq!(e.class(), k.fault.as_str());
        assert_eq!(e.retryable(), k.retryable);
        assert_eq!(e.falls_back(), k.falls_back);
        assert_eq!(e.closes_connection(), k.closes_connection);
    }
}

/// The answer carries the row: status, OpenAI body, Retry-After, Connection.
#[test]
fn answers_follow_the_table() {
    for e in one_of_each() {
        let k = e.kind();
        let r: Response<bytes::Bytes> = e.to_response();
        assert_eq!(r.status(), k.status);
        let v: serde_json::Value = serde_json::from_slice(r.body()).unwrap();
        assert_eq!(v["error"]["type"], k.openai_type, "{e:?}");
        assert_eq!(v["error"]["code"].as_str(), k.code, "{e:?}");
        assert_eq!(v["error"]["param"].as_str(), k.param, "{e:?}");
        let header = |name| {
            r.headers()
                .get(name)
                .map(|v| v.to_str().unwrap().to_owned())
        };
        let after = k.retry_after_s.map(|s| s.to_string());
        assert_eq!(header(header::RETRY_AFTER), after, "{e:?}");
        let close = k.closes_connection.then(|| "close".to_owned());
        assert_eq!(header(header::CONNECTION), close, "{e:?}");
    }
}

/// Payload-dependent rows: a refusal's kind and passability, the SLO's wait.
#[test]
fn payload_rows() {
    for r in refusals() {
        let (never, kind, after) = (r.never, r.kind, r.retry_after_s);
        let k = GatewayError::Limited(Box::new(r)).kind();
        assert_eq!(k.reason, kind.as_str());
        let (status, ty, code, retry_after) = match kind {
            _ if never => (400, INVALID, "request_exceeds_limit", None),
            LimitKind::StoreUnavailable => {
                (503, UNAVAILABLE, "limits_store_unavailable", Some(after))
            }
            k if k.is_budget() => (429, QUOTA, "insufficient_quota", Some(after)),
            _ => (429, RATE_LIMITED, "rate_limit_exceeded", Some(after)),
        };
        assert_eq!(k.status.as_u16(), status, "{kind:?} never={never}");
        assert_eq!((k.openai_type, k.code), (ty, Some(code)));
        assert_eq!(k.retry_after_s, retry_after);
    }
    let slo = GatewayError::SloUnattainable {
        model: "m".into(),
        predicted_ttft_ms: 1,
        retry_after_s: 9,
    };
    assert_eq!(slo.kind().retry_after_s, Some(9));
    assert_eq!(GatewayError::InvalidHeader("x-a").kind().param, Some("x-a"));
}

#[test]
fn statuses_and_retryability() {
    let w: Arc<str> = Arc::from("http://w");
    let cases = [
        (GatewayError::MalformedJson("x".into()), 400, false),
        (GatewayError::MissingModel, 400, false),
        (GatewayError::UnknownModel("m".into()), 404, false),
        (GatewayError::BodyTooLarge(1), 413, false),
        (GatewayError::NoHealthyWorker("m".into()), 503, false),
        (
            GatewayError::UpstreamConnect {
                worker: w.clone(),
                detail: "refused".into(),
            },
            502,
            true,
        ),
        (
            GatewayError::UpstreamTimeout {
                worker: w,
                after: Duration::from_secs(1),
            },
            504,
            true,
        ),
    ];
    for (e, status, retry) in cases {
        assert_eq!(e.status().as_u16(), status, "{e}");
        assert_eq!(e.retryable(), retry, "{e}");
        let r: Response<bytes::Bytes> = e.to_response();
        let v: serde_json::Value = serde_json::from_slice(r.body()).unwrap();
        assert!(v["error"]["message"].is_string());
        let r: Response<bytes::Bytes> = e.to_response_for(true, false);
        let v: serde_json::Value = serde_json::from_slice(r.body()).unwrap();
        assert_eq!(v["type"], "error");
        assert!(v["error"]["type"].is_string() && v["error"]["message"].is_string());
    }
}
