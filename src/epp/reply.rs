//! The ext_proc answers the picker sends, built from plain values: continue,
//! route (the destination header and the `envoy.lb` dynamic metadata), stream a
//! body back (full-duplex mode), and an immediate OpenAI-shaped error.

use crate::proxy::GatewayError;
use bytes::Bytes;
use envoy_types::pb::envoy::config::core::v3::{
    header_value_option::HeaderAppendAction, HeaderValue, HeaderValueOption,
};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::{
    processing_mode::{BodySendMode, HeaderSendMode},
    ProcessingMode,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation::Mutation, processing_response::Response, BodyMutation, BodyResponse,
    CommonResponse, HeaderMutation, HeadersResponse, ImmediateResponse, ProcessingResponse,
    StreamedBodyResponse, TrailersResponse,
};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};

/// The header (and metadata key) carrying the picked endpoints, `ip:port[,ip:port…]`.
pub const DESTINATION: &str = "x-gateway-destination-endpoint";
/// The metadata key under which the data plane reports the endpoint that served.
pub const SERVED: &str = "x-gateway-destination-endpoint-served";
/// The dynamic-metadata namespace of the picked endpoints.
pub const LB_NAMESPACE: &str = "envoy.lb";

/// Which half of the exchange an answer belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Request,
    Response,
}

fn wrap(r: Response) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(r),
        ..Default::default()
    }
}

fn headers_response(side: Side, common: CommonResponse) -> ProcessingResponse {
    let h = HeadersResponse {
        response: Some(common),
    };
    wrap(match side {
        Side::Request => Response::RequestHeaders(h),
        Side::Response => Response::ResponseHeaders(h),
    })
}

fn body_response(side: Side, common: CommonResponse) -> ProcessingResponse {
    let b = BodyResponse {
        response: Some(common),
    };
    wrap(match side {
        Side::Request => Response::RequestBody(b),
        Side::Response => Response::ResponseBody(b),
    })
}

/// Headers pass unchanged.
pub fn continue_headers(side: Side) -> ProcessingResponse {
    headers_response(side, CommonResponse::default())
}

/// Response headers pass with `add` set (the tenant's rate-limit headers).
pub fn continue_response_headers(add: &http::HeaderMap) -> ProcessingResponse {
    if add.is_empty() {
        return continue_headers(Side::Response);
    }
    let set_headers = add
        .iter()
        .filter_map(|(k, v)| Some(set_header(k.as_str(), v.to_str().ok()?)))
        .collect();
    headers_response(
        Side::Response,
        CommonResponse {
            header_mutation: Some(HeaderMutation {
                set_headers,
                remove_headers: Vec::new(),
            }),
            ..Default::default()
        },
    )
}

/// A body chunk passes unchanged (buffered and streamed modes).
pub fn continue_body(side: Side) -> ProcessingResponse {
    body_response(side, CommonResponse::default())
}

/// Trailers pass unchanged.
pub fn continue_trailers(side: Side) -> ProcessingResponse {
    let t = TrailersResponse::default();
    wrap(match side {
        Side::Request => Response::RequestTrailers(t),
        Side::Response => Response::ResponseTrailers(t),
    })
}

/// Request headers pass, and the request body is to come buffered whole: how a
/// picker turns a `STREAMED` request body into one it can route on (honoured
/// when the filter sets `allow_mode_override`).
pub fn continue_headers_buffer_body(response_body_mode: i32) -> ProcessingResponse {
    let mut r = continue_headers(Side::Request);
    r.mode_override = Some(ProcessingMode {
        request_header_mode: HeaderSendMode::Send as i32,
        response_header_mode: HeaderSendMode::Send as i32,
        request_body_mode: BodySendMode::Buffered as i32,
        response_body_mode,
        ..Default::default()
    });
    r
}

/// The routing mutation: the destination header (the endpoints, primary first),
/// a new `content-length` when the body changed, and where the body itself is
/// replaced (buffered mode).
pub struct Route<'a> {
    pub endpoints: &'a str,
    pub new_body_len: Option<usize>,
    /// The class the request was given: `x-switchyard-priority` is set to it,
    /// so what follows the picker sees the capped class, not the client's claim.
    pub priority: Option<&'static str>,
}

impl Route<'_> {
    fn common(&self, replaced: Option<Bytes>) -> CommonResponse {
        let mut set = vec![set_header(DESTINATION, self.endpoints)];
        if let Some(n) = self.new_body_len {
            set.push(set_header("content-length", &n.to_string()));
        }
        if let Some(p) = self.priority {
            set.push(set_header("x-switchyard-priority", p));
        }
        CommonResponse {
            header_mutation: Some(HeaderMutation {
                set_headers: set,
                remove_headers: Vec::new(),
            }),
            body_mutation: replaced.map(|b| BodyMutation {
                mutation: Some(Mutation::Body(b.to_vec())),
            }),
            ..Default::default()
        }
    }

    /// `envoy.lb: { x-gateway-destination-endpoint: "<endpoints>" }`.
    fn metadata(&self) -> Struct {
        let inner = Struct {
            fields: [(DESTINATION.to_string(), string(self.endpoints))].into(),
        };
        Struct {
            fields: [(
                LB_NAMESPACE.to_string(),
                Value {
                    kind: Some(Kind::StructValue(inner)),
                },
            )]
            .into(),
        }
    }

    /// The answer to the request headers (full-duplex mode: sent once the body is in).
    pub fn on_headers(&self) -> ProcessingResponse {
        let mut r = headers_response(Side::Request, self.common(None));
        r.dynamic_metadata = Some(self.metadata());
        r
    }

    /// The answer to the (last) request body chunk in buffered or streamed mode,
    /// with the body replaced when it changed.
    pub fn on_body(&self, replaced: Option<Bytes>) -> ProcessingResponse {
        let mut r = body_response(Side::Request, self.common(replaced));
        r.dynamic_metadata = Some(self.metadata());
        r
    }
}

/// Full-duplex mode: send `body` on, as one streamed chunk.
pub fn streamed_body(side: Side, body: Vec<u8>, end_of_stream: bool) -> ProcessingResponse {
    body_response(
        side,
        CommonResponse {
            body_mutation: Some(BodyMutation {
                mutation: Some(Mutation::StreamedResponse(StreamedBodyResponse {
                    body,
                    end_of_stream,
                    ..Default::default()
                })),
            }),
            ..Default::default()
        },
    )
}

/// The data plane answers the client itself with `e` in OpenAI's error shape.
pub fn immediate(e: &GatewayError) -> ProcessingResponse {
    let resp = e.to_response::<Bytes>();
    let headers = resp
        .headers()
        .iter()
        .filter(|(k, _)| *k != http::header::CONNECTION)
        .filter_map(|(k, v)| Some(set_header(k.as_str(), v.to_str().ok()?)))
        .collect();
    wrap(Response::ImmediateResponse(ImmediateResponse {
        status: Some(HttpStatus {
            code: i32::from(resp.status().as_u16()),
        }),
        headers: Some(HeaderMutation {
            set_headers: headers,
            remove_headers: Vec::new(),
        }),
        body: resp.into_body().to_vec(),
        details: format!("switchyard_epp_{}", e.reason()),
        ..Default::default()
    }))
}

/// The data plane answers the client itself with `body`, a JSON `200` (the
/// model list the picker serves as the proxy does).
pub fn immediate_json(body: Vec<u8>) -> ProcessingResponse {
    wrap(Response::ImmediateResponse(ImmediateResponse {
        status: Some(HttpStatus { code: 200 }),
        headers: Some(HeaderMutation {
            set_headers: vec![set_header("content-type", "application/json")],
            remove_headers: Vec::new(),
        }),
        body,
        details: "switchyard_epp_models".into(),
        ..Default::default()
    }))
}

fn set_header(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_string(),
            raw_value: value.as_bytes().to_vec(),
            ..Default::default()
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..Default::default()
    }
}

fn string(s: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(s.to_string())),
    }
}

/// A string value at `namespace.key` of a metadata map (the served endpoint).
pub fn metadata_str<'a>(
    filter_metadata: &'a std::collections::HashMap<String, Struct>,
    namespace: &str,
    key: &str,
) -> Option<&'a str> {
    match filter_metadata
        .get(namespace)?
        .fields
        .get(key)?
        .kind
        .as_ref()?
    {
        Kind::StringValue(s) => Some(s),
        _ => None,
    }
}
