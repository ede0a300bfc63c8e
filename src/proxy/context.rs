//! The request's context: everything known about one request from admission on,
//! shared (behind an `Arc`) by the forwarding phases and the response observer,
//! and turned into one [`RequestRecord`] for the telemetry sinks when it ends.

use crate::config::flow::Priority;
use crate::config::Config;
use crate::pool::Worker;
use crate::telemetry::labels::{REGION_LABEL_KEY, TIER_LABEL_KEY, UNKNOWN_REGION};
use crate::telemetry::trace::{ChildSpan, TraceContext};
use crate::telemetry::{End, RequestRecord, RouteTags, Sinks};
use crate::tenancy::Tenant;
use http::HeaderValue;
use metrics::SharedString;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Attempts and time spent waiting are atomics; the route a response took is in
/// its [`RouteTags`].
pub struct RequestTags {
    pub sinks: Arc<Sinks>,
    pub config: Arc<Config>,
    pub request_id: HeaderValue,
    /// Who is calling (residency and tenant labels use it).
    pub tenant: Tenant,
    pub tenant_label: SharedString,
    pub request_bytes: u64,
    pub stream: bool,
    pub trace: TraceContext,
    /// The pool the model name resolved to.
    pub pool: Option<SharedString>,
    /// Its queue class: the priority header as far as the tenant may ask
    /// (`tenancy::claims`), else the tenant's default.
    pub priority: Priority,
    /// The client's address (the socket peer, or the first untrusted
    /// `x-forwarded-for` hop behind a trusted proxy), for the access log.
    pub client: Option<IpAddr>,
    /// The request's share of its tenant's limits: concurrency slots held until
    /// this context drops, the token estimate corrected at `finish`. Boxed:
    /// only tenants with limits have one, and every request's context is
    /// moved into its `Arc` (a shared-store hold is a few hundred bytes).
    pub admitted: Option<Box<crate::tenancy::limits::Admitted>>,
    attempts: AtomicU32,
    /// Time spent waiting on workers, the pool queue and retry backoff (ns).
    waited_ns: AtomicU64,
    /// The part of `waited_ns` spent held in the pool's flow-control queue.
    queued_ns: AtomicU64,
    /// No worker was predicted to meet the request's latency objective; it was
    /// served anyway.
    slo_downgraded: AtomicBool,
    /// The answering attempt's dispatch (load met, prediction) for the latency model.
    pub dispatch: crate::pool::predict::DispatchCell,
    /// Counts the request alive for the gateway's drain; a stream still
    /// running at the drain deadline is cut through it.
    pub live: crate::runtime::drain::Live,
}

impl RequestTags {
    pub fn new(
        sinks: &Arc<Sinks>,
        config: Arc<Config>,
        request_id: HeaderValue,
        tenant: Tenant,
        trace: TraceContext,
        drain: &crate::runtime::drain::Drain,
    ) -> RequestTags {
        RequestTags {
            live: drain.live(),
            tenant_label: sinks.tenants.get(&tenant.name),
            priority: tenant.claims.default,
            client: None,
            sinks: sinks.clone(),
            config,
            request_id,
            tenant,
            request_bytes: 0,
            stream: false,
            trace,
            pool: None,
            admitted: None,
            attempts: AtomicU32::new(0),
            waited_ns: AtomicU64::new(0),
            queued_ns: AtomicU64::new(0),
            slo_downgraded: AtomicBool::new(false),
            dispatch: Default::default(),
        }
    }

    /// The route a response took, for its observer.
    pub fn route(
        &self,
        pool: &SharedString,
        worker: &Worker,
        policy: &'static str,
        reason: &'static str,
        predicted_cached_tokens: Option<u64>,
        precise: bool,
    ) -> RouteTags {
        let region = worker
            .labels
            .get(REGION_LABEL_KEY)
            .map_or(UNKNOWN_REGION, String::as_str);
        RouteTags {
            pool: pool.clone(),
            worker: worker.id.clone(),
            tier: worker.labels.get(TIER_LABEL_KEY).map(|s| s.as_str().into()),
            region: self.sinks.regions.get(region),
            policy,
            reason,
            predicted_cached_tokens,
            precise,
            predicted_ttft_ms: None,
            predicted_tpot_ms: None,
            queued_ms: self.queued().as_secs_f64() * 1e3,
            dispatched_ms: None,
            slo_downgraded: self.slo_downgraded(),
        }
    }

    /// Mark the request as served below its latency objective.
    pub fn downgrade_slo(&self) {
        self.slo_downgraded.store(true, Ordering::Relaxed);
    }

    pub fn slo_downgraded(&self) -> bool {
        self.slo_downgraded.load(Ordering::Relaxed)
    }

    /// Count an upstream attempt; returns its number (1-based).
    pub fn add_attempt(&self) -> u32 {
        self.attempts.fetch_add(1, Ordering::Relaxed) + 1
    }

    pub fn attempts(&self) -> u32 {
        self.attempts.load(Ordering::Relaxed)
    }

    /// Add time spent waiting outside the gateway's own work.
    pub fn add_waited(&self, d: Duration) {
        self.waited_ns
            .fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
    }

    pub fn waited(&self) -> Duration {
        Duration::from_nanos(self.waited_ns.load(Ordering::Relaxed))
    }

    /// Add time spent held in the pool's queue (it is waited time too).
    pub fn add_queued(&self, d: Duration) {
        self.queued_ns
            .fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
        self.add_waited(d);
    }

    pub fn queued(&self) -> Duration {
        Duration::from_nanos(self.queued_ns.load(Ordering::Relaxed))
    }

    /// Spans are being exported for this request.
    pub fn tracing(&self) -> bool {
        self.trace.sampled && self.sinks.tracer.is_some()
    }

    /// Record a child span of the request (no-op unless the trace is exported).
    pub fn child_span(&self, span: ChildSpan) {
        if let Some(t) = &self.sinks.tracer {
            t.child_span(&self.trace, span);
        }
    }

    /// Phase: finish. The request ended (answered, failed or refused): every
    /// sink is fed once, and its limits learn the tokens it used and its cost.
    pub fn finish(&self, endpoint: &'static str, status: u16, end: End<'_>) {
        let (used, refused) = match &end {
            End::Proxied { m, .. } => (m.prompt_tokens.map(|p| p + m.output_tokens), false),
            // Refused by the gateway (or the client's own fault) after
            // admission: nothing is charged. An upstream failure keeps the
            // request counted (a worker was tried).
            End::Refused { class, .. } => (Some(0), *class != "upstream"),
        };
        let usd = self.sinks.finish(&RequestRecord {
            request_id: &self.request_id,
            tenant: &self.tenant.name,
            tenant_label: &self.tenant_label,
            trace: &self.trace,
            prices: &self.config.observability.prices,
            endpoint,
            status,
            attempts: self.attempts(),
            stream: self.stream,
            request_bytes: self.request_bytes,
            pool: self.pool.as_ref(),
            client: self.client,
            priority: self.priority.as_str(),
            end,
        });
        if let Some(a) = &self.admitted {
            a.settle(crate::tenancy::limits::Usage {
                tokens: used,
                usd,
                refused,
            });
        }
    }
}
