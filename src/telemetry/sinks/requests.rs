//! The Prometheus request and token families. An answered request counts through
//! its (model, worker) pair's per-thread handles; the gateway's own answers are
//! rare and go through the registry.

use super::super::labels::NONE_LABEL;
use super::super::record::{End, RequestRecord};
use super::super::{
    cost::TokenCounts, names, status_label, Borrowed, PairMetrics, RouteTags, TokenCounters,
    TOKEN_KINDS,
};
use metrics::{counter, SharedString};

/// Count the request in `switchyard_requests_total`.
pub fn count_request(r: &RequestRecord<'_>) {
    match r.end {
        End::Proxied { route, pair, .. } => count_proxied(r, route, pair),
        End::Refused { model, .. } => count_refused(r, model),
    }
}

fn count_proxied(r: &RequestRecord<'_>, route: &RouteTags, pair: &PairMetrics) {
    let key = (
        &route.pool,
        &route.region,
        r.tenant_label,
        r.endpoint,
        status_label(r.status),
        r.class(),
        r.outcome(),
    );
    pair.requests.increment(
        &Borrowed(key),
        1,
        |(pool, region, tenant, endpoint, status, class, outcome)| {
            counter!(
                names::REQUESTS_TOTAL,
                names::L_MODEL => pair.model.clone(),
                names::L_POOL => pool.clone(),
                names::L_WORKER => pair.worker.clone(),
                names::L_REGION => region.clone(),
                names::L_TENANT => tenant.clone(),
                names::L_ENDPOINT => *endpoint,
                names::L_STATUS => *status,
                names::L_CLASS => *class,
                names::L_OUTCOME => *outcome
            )
        },
    );
}

fn count_refused(r: &RequestRecord<'_>, model: Option<&str>) {
    // The gateway answered itself: no worker, so no region either.
    let none = SharedString::const_str(NONE_LABEL);
    counter!(
        names::REQUESTS_TOTAL,
        names::L_MODEL => SharedString::from(model.unwrap_or(NONE_LABEL).to_string()),
        names::L_POOL => r.pool.cloned().unwrap_or(none.clone()),
        names::L_WORKER => none.clone(),
        names::L_REGION => none,
        names::L_TENANT => r.tenant_label.clone(),
        names::L_ENDPOINT => r.endpoint,
        names::L_STATUS => status_label(r.status),
        names::L_CLASS => r.class(),
        names::L_OUTCOME => "gateway_error"
    )
    .increment(1);
}

/// Count an answered request's tokens in `switchyard_tokens_total`: one cache
/// lookup for the request's labels, then a counter per kind it used.
pub fn count_tokens(
    r: &RequestRecord<'_>,
    route: &RouteTags,
    pair: &PairMetrics,
    toks: TokenCounts,
) {
    let counts = [toks.prompt, toks.cached, toks.output];
    if counts == [0; 3] {
        return;
    }
    pair.tokens.with(
        &Borrowed((&route.pool, &route.region, r.tenant_label)),
        |_| TokenCounters::default(),
        |(pool, region, tenant), c| {
            for (i, (kind, n)) in TOKEN_KINDS.into_iter().zip(counts).enumerate() {
                if n == 0 {
                    continue;
                }
                c.add(i, n, || {
                    counter!(
                        names::TOKENS_TOTAL,
                        names::L_MODEL => pair.model.clone(),
                        names::L_POOL => pool.clone(),
                        names::L_WORKER => pair.worker.clone(),
                        names::L_REGION => region.clone(),
                        names::L_TENANT => tenant.clone(),
                        names::L_KIND => kind
                    )
                });
            }
        },
    );
}
