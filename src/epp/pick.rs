//! One decision, the same as the proxy's: inspect the body, resolve the model
//! (aliases and splits) to a route, let the route's policy pick a worker under
//! its concurrency limit, then the next-best distinct workers as fallbacks. The
//! pick is recorded (decision metric, prefix index) as the proxy records it.

use crate::api::{self, RequestInfo};
use crate::config::Residency;
use crate::pool::{RequestSize, Role, Worker};
use crate::proxy::{self, GatewayError, POLICY_HEADER, SESSION_HEADER};
use crate::routes::{ModelRoute, Snapshot};
use crate::routing::{Decision, Policy, RouteRequest};
use bytes::Bytes;
use http::HeaderMap;
use smallvec::SmallVec;
use std::sync::Arc;

/// What the picker decided for one request.
pub struct Choice {
    pub route: Arc<ModelRoute>,
    /// Indexes into `route.workers`: the pick first, then the fallbacks in order.
    pub picked: SmallVec<[usize; 4]>,
    pub decision: Decision,
    pub policy: &'static str,
    /// Prompt tokens the policy expects the picked worker to have cached.
    pub predicted: Option<u64>,
    pub info: RequestInfo,
    /// The body to send upstream instead, when it must change (a split's target
    /// model, or a pool's upstream model name).
    pub body: Option<Bytes>,
}

impl Choice {
    /// `ip:port` of each picked worker, primary first, comma-separated.
    pub fn endpoints(&self) -> String {
        let mut out = String::new();
        for &i in &self.picked {
            if !out.is_empty() {
                out.push(',');
            }
            out.push_str(&endpoint(&self.route.workers[i]));
        }
        out
    }

    /// How much prefill work the request brings to the picked worker.
    pub fn size(&self) -> RequestSize {
        RequestSize::estimate(
            self.info
                .routing_text
                .as_ref()
                .map_or(0, |t| t.len() as u64),
            self.route.pool.config.routing.bytes_per_token,
            self.predicted.unwrap_or(0),
        )
    }
}

/// A worker's address as the data plane dials it: `host:port`, the scheme's
/// default port filled in.
pub fn endpoint(w: &Worker) -> String {
    match w.authority.port_u16() {
        Some(_) => w.authority.as_str().to_string(),
        None => {
            let port = if w.scheme == http::uri::Scheme::HTTPS {
                443
            } else {
                80
            };
            format!("{}:{port}", w.authority.host())
        }
    }
}

/// Decide where the request with `headers` and `body` goes, with up to
/// `fallbacks` further workers. `residency`: where it may be served.
pub fn decide(
    snap: &Snapshot,
    headers: &HeaderMap,
    body: &Bytes,
    residency: Option<&Residency>,
    fallbacks: usize,
    tenant: &str,
) -> Result<Choice, GatewayError> {
    let r = resolve(snap, headers, body, residency)?;
    choose(r, headers, residency, fallbacks, tenant)
}

/// A request's body inspected and its model resolved, before any pick: what
/// the tenant's permissions and limits are checked against.
pub struct Resolved {
    pub route: Arc<ModelRoute>,
    pub info: RequestInfo,
    /// The body to send upstream instead, when it must change.
    pub body: Option<Bytes>,
}

/// Inspect `body` and resolve its model (aliases, splits) to a route.
pub fn resolve(
    snap: &Snapshot,
    headers: &HeaderMap,
    body: &Bytes,
    residency: Option<&Residency>,
) -> Result<Resolved, GatewayError> {
    let info = api::inspect(body).map_err(|e| match e {
        api::inspect::InspectError::Malformed(m) => GatewayError::MalformedJson(m),
        api::inspect::InspectError::TooDeep(limit) => GatewayError::JsonTooDeep(limit),
    })?;
    let name = info.model.as_deref().ok_or(GatewayError::MissingModel)?;
    let session = headers
        .get(SESSION_HEADER)
        .and_then(|v| v.to_str().ok())
        .or(info.user.as_deref());
    let resolved = snap
        .resolve(name, session, residency)
        .ok_or_else(|| GatewayError::UnknownModel(api::error::echo(name)))?;
    let route = resolved.route.clone();
    let mut new_body = resolved
        .split
        .then(|| proxy::rewrite_model(body, Some(&route.model)))
        .transpose()?;
    if let Some(m) = route.pool.config.upstream_model.as_deref() {
        new_body = Some(proxy::rewrite_model(
            new_body.as_ref().unwrap_or(body),
            Some(m),
        )?);
    }
    Ok(Resolved {
        route,
        info,
        body: new_body,
    })
}

/// The pick for a resolved request: the route's policy (or the override the
/// pool allows), then up to `fallbacks` further workers; recorded.
pub fn choose(
    r: Resolved,
    headers: &HeaderMap,
    residency: Option<&Residency>,
    fallbacks: usize,
    tenant: &str,
) -> Result<Choice, GatewayError> {
    let Resolved {
        route,
        info,
        body: new_body,
    } = r;
    let asked = headers.get(POLICY_HEADER).and_then(|v| v.to_str().ok());
    let policy = match asked.map(|n| route.override_policy(n)) {
        Some(Some(p)) => p,
        Some(None) => {
            crate::tenancy::claims::noted("policy", "ignored", tenant);
            &*route.policy
        }
        None => &*route.policy,
    };
    let rreq = RouteRequest::new(
        &info,
        headers.get(SESSION_HEADER).and_then(|v| v.to_str().ok()),
    )
    .with_residency(residency);
    let (decision, picked) = pick(&route, policy, &rreq, fallbacks)?;
    route
        .pool
        .metrics
        .record_decision(policy.name(), decision.reason.as_str());
    // Before `record`, which teaches the index this request's blocks.
    let predicted = policy.predicted_cached_tokens(&decision, &rreq);
    policy.record(&decision, &rreq, &route.workers);
    let policy = policy.name();
    drop(rreq);
    Ok(Choice {
        route,
        picked,
        decision,
        policy,
        predicted,
        info,
        body: new_body,
    })
}

/// The policy's pick among workers able to take the request now, then the
/// next-best distinct ones (ignoring the concurrency limit: they serve only if
/// the pick fails). Errors: every candidate at its limit (429), none at all (503).
fn pick(
    route: &ModelRoute,
    policy: &dyn Policy,
    rreq: &RouteRequest<'_>,
    fallbacks: usize,
) -> Result<(Decision, SmallVec<[usize; 4]>), GatewayError> {
    let limit = route.pool.config.max_concurrency_per_worker;
    let skip_prefill = route.pool.config.disaggregation.is_some();
    let eligible = |i: usize| {
        let w = &route.workers[i];
        w.is_available() && rreq.allows(w) && !(skip_prefill && w.role == Role::Prefill)
    };
    let under_limit = |i: usize| limit == 0 || route.workers[i].in_flight() < limit;
    let Some(decision) = policy.pick(rreq, &route.workers, &|i| eligible(i) && under_limit(i))
    else {
        let model = rreq.info.model.clone().unwrap_or_default();
        return Err(if (0..route.workers.len()).any(eligible) {
            GatewayError::QueueFull(route.pool.name.to_string())
        } else if let Some(r) = rreq.residency {
            GatewayError::ResidencyUnavailable {
                residency: r.name.clone(),
                regions: "none available".into(),
                model,
            }
        } else {
            GatewayError::NoHealthyWorker(model)
        });
    };
    let mut picked: SmallVec<[usize; 4]> = SmallVec::new();
    picked.push(decision.index);
    while picked.len() <= fallbacks {
        let next = policy.pick(rreq, &route.workers, &|i| {
            eligible(i) && !picked.contains(&i)
        });
        match next {
            Some(d) => picked.push(d.index),
            None => break,
        }
    }
    Ok((decision, picked))
}

/// A request without a body to route on (a `GET`, or a filter that sends no
/// body): the available worker with the highest rendezvous score for its path.
pub fn by_path(snap: &Snapshot, path: &str) -> Option<Arc<Worker>> {
    let key = xxhash_rust::xxh3::xxh3_64(path.as_bytes());
    snap.workers()
        .filter(|w| w.is_available())
        .max_by_key(|w| crate::routing::rendezvous::weight(key, w.id_hash))
        .cloned()
}
