//! The picker's admission, the proxy's rules on the data plane's behalf: who
//! is calling (the key, before any body is read), at which class, from which
//! client address, and the calls the picker cannot serve safely (stored
//! responses by id). Every refusal is finished like the proxy's: counted, and
//! an access-log line with the tenant and the client address.

use crate::api::headers::{Name, Own};
use crate::api::Endpoint;
use crate::config::Config;
use crate::proxy::{GatewayError, RequestTags};
use crate::server::Gateway;
use crate::telemetry::trace::TraceContext;
use crate::telemetry::End;
use envoy_types::pb::google::protobuf::{value::Kind, Struct};
use http::{HeaderMap, HeaderValue};
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use tokio::time::Instant;

/// The Envoy attribute naming the downstream peer (`request_attributes`).
const SOURCE_ADDRESS: &str = "source.address";

/// The client's address: the peer the data plane saw (its `source.address`
/// attribute, when the filter sends it), else the data plane itself (the gRPC
/// peer); `x-forwarded-for` only behind `[server] trusted_proxies`, as in
/// proxy mode.
pub fn client(
    grpc_peer: Option<IpAddr>,
    attributes: &HashMap<String, Struct>,
    headers: &HeaderMap,
    config: &Config,
) -> Option<IpAddr> {
    let seen = attributes
        .values()
        .find_map(|s| match &s.fields.get(SOURCE_ADDRESS)?.kind {
            Some(Kind::StringValue(v)) => parse_addr(v),
            _ => None,
        });
    crate::server::client_addr::client(seen.or(grpc_peer), headers, &config.server.trusted_proxies)
}

/// `ip:port`, `[v6]:port` or a bare address.
fn parse_addr(v: &str) -> Option<IpAddr> {
    v.parse::<SocketAddr>()
        .map(|s| s.ip())
        .or_else(|_| v.parse::<IpAddr>())
        .ok()
}

/// A stored-response call by id (`GET`/`DELETE /v1/responses/{id}`,
/// `/cancel`, `/input_items`): the picker cannot rewrite the gateway's signed
/// ids into the engine's, nor bind them to a tenant, so it serves none.
pub fn stored_by_id(path: &str) -> Option<GatewayError> {
    let path = path.split_once('?').map_or(path, |(p, _)| p);
    path.strip_prefix("/v1/responses/")
        .filter(|rest| !rest.is_empty())
        .map(|_| GatewayError::ProxyModeOnly {
            what: "A stored response's id in the path",
            param: None,
        })
}

/// A continuation (`previous_response_id`) is refused for the same reason.
pub fn continuation() -> GatewayError {
    GatewayError::ProxyModeOnly {
        what: "`previous_response_id`",
        param: Some("previous_response_id"),
    }
}

/// One request's identity as the headers give it.
pub struct Caller<'a> {
    pub gw: &'a Gateway,
    pub config: &'a Arc<Config>,
    pub headers: &'a HeaderMap,
    pub request_id: &'a HeaderValue,
    pub client: Option<IpAddr>,
}

impl Caller<'_> {
    /// The request's tags: its tenant (a key that is presented must be
    /// recognised), its class capped by the tenant's claim rules, its trace.
    /// Returns the gateway's header scan too (the objective headers read it).
    pub fn admit(&self) -> Result<(RequestTags, Own), GatewayError> {
        let own = Own::scan(self.headers).map_err(GatewayError::InvalidHeader)?;
        let tenant = self
            .gw
            .tenancy
            .load()
            .resolve(self.headers, own, &self.gw.keys)
            .map_err(|r| crate::server::refused_by_tenancy(r.into()))?;
        let priority = tenant
            .claims
            .priority(own.get_str(self.headers, Name::Priority), &tenant.name)
            .map_err(GatewayError::InvalidRequest)?;
        let sample = self
            .config
            .observability
            .tracing
            .as_ref()
            .map(|t| t.sample_ratio);
        let trace = TraceContext::from_header(own.get(self.headers, Name::TraceParent), sample);
        let mut tags = self.tags(tenant, trace);
        tags.priority = priority;
        Ok((tags, own))
    }

    /// Tags for a request refused before its tenant was proven: `anonymous`.
    pub fn anonymous(&self) -> RequestTags {
        let tenant = self.gw.tenancy.load().anonymous();
        self.tags(tenant, TraceContext::from_header(None, None))
    }

    fn tags(&self, tenant: crate::tenancy::Tenant, trace: TraceContext) -> RequestTags {
        let mut tags = RequestTags::new(
            &self.gw.sinks,
            self.config.clone(),
            self.request_id.clone(),
            tenant,
            trace,
            &self.gw.drain,
        );
        tags.client = self.client;
        tags
    }
}

/// Finish a refused request as the proxy does: the error metric, and the
/// access-log line (which also settles any admission as refused: nothing is
/// charged for a request no worker saw).
pub fn finish_refused(
    tags: &RequestTags,
    e: &GatewayError,
    endpoint: Endpoint,
    model: Option<&str>,
    start: Instant,
) {
    let status = e.status().as_u16();
    crate::telemetry::record_gateway_error(model, e.reason(), status);
    tags.finish(
        endpoint.as_str(),
        status,
        End::Refused {
            model,
            class: e.class(),
            reason: e.reason(),
            elapsed: start.elapsed(),
        },
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_paths_by_id_are_recognised() {
        for p in [
            "/v1/responses/resp_1",
            "/v1/responses/resp_1/cancel",
            "/v1/responses/resp_1/input_items?limit=2",
        ] {
            assert!(stored_by_id(p).is_some(), "{p}");
        }
        for p in ["/v1/responses", "/v1/responses/", "/v1/chat/completions"] {
            assert!(stored_by_id(p).is_none(), "{p}");
        }
    }

    #[test]
    fn source_addresses_parse_in_every_form() {
        assert_eq!(parse_addr("10.1.2.3:5555"), "10.1.2.3".parse().ok());
        assert_eq!(parse_addr("[2001:db8::1]:80"), "2001:db8::1".parse().ok());
        assert_eq!(parse_addr("10.1.2.3"), "10.1.2.3".parse().ok());
        assert_eq!(parse_addr("pipe:/x"), None);
    }
}
