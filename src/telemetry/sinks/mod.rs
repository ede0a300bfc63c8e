//! Where a finished request goes: each concern is a small sink fed the same
//! [`RequestRecord`], in order — the Prometheus families, throughput, cost, cache
//! accuracy, the dashboard series, the trace span and the access log.

pub mod cache;
pub mod cost;
pub mod requests;
pub mod series;
pub mod throughput;

use super::access_log::{self, AccessLog, AccessRecord};
use super::labels::BoundedLabels;
use super::record::{End, RequestRecord, RouteTags};
use super::trace::Tracer;
use super::{names, RequestMetrics};
use crate::config::Config;
use cache::CacheAccuracy;
use cost::CostTotals;
use series::{SecondSample, Series};
use std::sync::Arc;
use std::time::Duration;
use throughput::Throughput;

pub struct Sinks {
    pub tenants: BoundedLabels,
    pub regions: BoundedLabels,
    pub throughput: Throughput,
    pub costs: CostTotals,
    pub cache: CacheAccuracy,
    pub series: Series,
    pub tracer: Option<Tracer>,
    access_log: Option<AccessLog>,
}

impl Sinks {
    /// Build from the config; starts the access-log writer and the span exporter
    /// when configured (needs a tokio runtime).
    pub fn new(config: &Config) -> Arc<Sinks> {
        let o = &config.observability;
        Arc::new(Sinks {
            tenants: BoundedLabels::new(names::L_TENANT, o.max_tenant_labels),
            regions: BoundedLabels::new(names::L_REGION, o.max_region_labels),
            throughput: Throughput::default(),
            costs: CostTotals::default(),
            cache: CacheAccuracy::default(),
            series: Series::new(o.dashboard_window_s),
            tracer: o.tracing.as_ref().map(Tracer::start),
            access_log: o.access_log.as_ref().map(AccessLog::start),
        })
    }

    /// Record one inter-token gap in the dashboard aggregates.
    pub fn record_itl(&self, gap: Duration) {
        self.series.record_itl(gap);
    }

    /// Feed a finished request to every sink, once; returns its cost (USD).
    pub fn finish(&self, r: &RequestRecord<'_>) -> f64 {
        requests::count_request(r);
        let cost_usd = match r.end {
            End::Proxied { route, pair, m, .. } => self.answered(r, route, pair, m),
            End::Refused { .. } => {
                self.series.record(SecondSample {
                    error: true,
                    output_tokens: 0,
                    nano_usd: 0,
                    ttft: None,
                });
                0.0
            }
        };
        if let Some(t) = &self.tracer {
            t.end_request_span(r);
        }
        if let Some(log) = &self.access_log {
            log.log(access_record(r, cost_usd));
        }
        cost_usd
    }

    /// The sinks only an answered request feeds; returns its cost (USD).
    fn answered(
        &self,
        r: &RequestRecord<'_>,
        route: &RouteTags,
        pair: &super::PairMetrics,
        m: &RequestMetrics,
    ) -> f64 {
        if let Some(t) = m.ttft {
            pair.ttft.record(t.as_secs_f64());
            if let Some(p) = route.predicted_ttft_ms {
                let actual = t.as_secs_f64();
                pair.predicted_ttft.record(p / 1e3);
                pair.ttft_error
                    .record((p / 1e3 - actual).abs() / actual.max(1e-6));
            }
        }
        pair.e2e.record(m.e2e.as_secs_f64());
        let toks = super::cost::TokenCounts {
            prompt: m.prompt_tokens.unwrap_or(0),
            cached: m.cached_tokens.unwrap_or(0),
            output: m.output_tokens,
        };
        requests::count_tokens(r, route, pair, toks);
        self.throughput
            .record(&route.worker, &route.pool, toks.processed(), m.ttft);
        let usd = cost::price(
            r.prices,
            &pair.model,
            &route.pool,
            route.tier.as_deref(),
            toks,
            || self.throughput.tokens_per_s(&route.worker),
        );
        let nano = self
            .costs
            .add(&pair.model, &route.region, r.tenant_label, usd);
        // An estimate says nothing about what the engine had cached.
        let reported = m.prompt_tokens.is_some() && !m.usage_estimated;
        if let (Some(pred), true) = (route.predicted_cached_tokens, reported) {
            self.cache
                .record(&route.pool, route.precise, pred, toks.cached);
        }
        self.series.record(SecondSample {
            error: r.class() != "ok",
            output_tokens: toks.output,
            nano_usd: nano,
            ttft: m.ttft,
        });
        usd
    }

    /// Append the families rendered outside `metrics` to `out`.
    pub fn render_into(&self, out: &mut String) {
        self.costs.render_into(out);
    }

    /// Set the scrape-time gauges.
    pub fn refresh_gauges(&self) {
        self.cache.refresh_gauges();
    }
}

/// The access-log line of a finished request.
fn access_record(r: &RequestRecord<'_>, cost_usd: f64) -> AccessRecord {
    let (route, m) = match r.end {
        End::Proxied { route, m, .. } => (Some(route), Some(m)),
        End::Refused { .. } => (None, None),
    };
    let model = match r.end {
        End::Proxied { pair, .. } => Some(Arc::from(&*pair.model)),
        End::Refused { model, .. } => model.map(Arc::from),
    };
    AccessRecord {
        ts: access_log::rfc3339_now(),
        request_id: r.request_id.to_str().unwrap_or("").to_string(),
        client: r.client,
        tenant: r.tenant.clone(),
        priority: r.priority,
        model,
        endpoint: r.endpoint,
        pool: route.map(|x| &x.pool).or(r.pool).map(|p| Arc::from(&**p)),
        worker: route.map(|x| x.worker.clone()),
        region: route.map(|x| Arc::from(&*x.region)),
        policy: route.map(|x| x.policy),
        reason: route.map(|x| x.reason),
        attempts: r.attempts,
        status: r.status,
        outcome: r.outcome(),
        class: r.class(),
        error: match r.end {
            End::Refused { reason, .. } => Some(reason),
            End::Proxied { .. } => None,
        },
        stream: r.stream,
        ttft_ms: m.and_then(|m| m.ttft).map(ms),
        mean_itl_ms: m.and_then(|m| m.mean_itl).map(ms),
        e2e_ms: ms(r.elapsed()),
        prompt_tokens: m.and_then(|m| m.prompt_tokens),
        cached_tokens: m.and_then(|m| m.cached_tokens),
        output_tokens: m.map_or(0, |m| m.output_tokens),
        usage: m.filter(|m| m.prompt_tokens.is_some()).map(|m| {
            if m.usage_estimated {
                "estimated"
            } else {
                "reported"
            }
        }),
        predicted_cached_tokens: route.and_then(|x| x.predicted_cached_tokens),
        predicted_ttft_ms: route.and_then(|x| x.predicted_ttft_ms).map(round_ms),
        predicted_tpot_ms: route.and_then(|x| x.predicted_tpot_ms).map(round_ms),
        queued_ms: route.map(|x| round_ms(x.queued_ms)),
        dispatched_ms: route.and_then(|x| x.dispatched_ms).map(round_ms),
        slo_downgraded: route.is_some_and(|x| x.slo_downgraded),
        cost_usd,
        request_bytes: r.request_bytes,
        response_bytes: m.map_or(0, |m| m.response_bytes),
        trace_id: r.trace.sampled.then(|| r.trace.trace_id_hex()),
    }
}

fn round_ms(v: f64) -> f64 {
    (v * 1e3).round() / 1e3
}

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
