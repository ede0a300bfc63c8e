//! The attempt machinery of one request on one pool, as named phases: *select*
//! a worker (waiting in the pool queue when every candidate is at its limit; a
//! last-resort worker for a retry), *begin* the attempt (retry accounting and
//! backoff, the decision recorded), *send* it, and *settle* its outcome: answer,
//! retry elsewhere while nothing reached the client and the budget allows, or
//! stop. Who was to blame for failed attempts is settled when the request ends.

use super::error::GatewayError;
use super::forward::{
    charge, respond, retryable_status, send_attempt, Failure, ForwardContext, RouteNote, Sent,
};
use crate::api::headers::Name;
use crate::config::HealthConfig;
use crate::pool::flow::{saturation, FlowQueue, Place, Preemption, Priority, QueueError};
use crate::pool::{InFlightGuard, Role};
use crate::routes::ModelRoute;
use crate::routing::{Decision, Policy, Reason, RouteRequest};
use crate::telemetry;
use crate::telemetry::names;
use crate::telemetry::trace::{new_span_id, ChildSpan, SpanKind};
use axum::body::Body;
use http::Response;
use hyper::body::Incoming;
use metrics::counter;
use metrics::SharedString;
use smallvec::SmallVec;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tokio::time::Instant;

/// Forward to a worker chosen by the route's policy, retrying elsewhere on
/// retryable failures (within the pool's retry budget), queueing when every
/// eligible worker is at its concurrency limit, and return the observed response.
/// In a disaggregated pool, prefill-only workers are not eligible.
pub async fn forward_aggregated(ctx: &ForwardContext<'_>) -> Result<Response<Body>, GatewayError> {
    let mut run = Attempts::new(ctx);
    while run.attempt < ctx.route.pool.config.max_attempts {
        let Some(decision) = run.select().await? else {
            break;
        };
        if run.attempt == 0 {
            super::slo::check(ctx, run.policy, &run.rreq, &decision, &|i| run.eligible(i))?;
        }
        let pick = run.begin(&decision).await;
        // Boxed: an attempt's state is a few KB, and Rust futures hold an awaited
        // future's state inline (often twice), then are moved whole; boxing it
        // keeps the request's future under 4 KB instead of over 20 KB.
        let send = Box::pin(send_attempt(
            ctx,
            decision.index,
            ctx.body.clone(),
            pick.size,
            run.deadline,
            run.reserved.take(),
        ));
        let sent = match run.preemptible() {
            None => send.await,
            Some((_registered, rx)) => {
                tokio::select! {
                    sent = send => sent,
                    // Cancelled before its answer: the attempt (and its in-flight
                    // slot) is dropped here, which hands the slot to the waiter.
                    Ok(()) = rx => {
                        run.preempted(&decision)?;
                        continue;
                    }
                }
            }
        };
        match run.settle(&decision, sent) {
            Settled::Answer(resp, guard) => return Ok(run.answer(&decision, &pick, resp, guard)),
            Settled::Retry => continue,
            Settled::Stop => break,
        }
    }
    Err(run.fail())
}

/// What an attempt's outcome means for the request.
enum Settled {
    Answer(Response<Incoming>, InFlightGuard),
    Retry,
    Stop,
}

/// What `begin` learned about the chosen worker for the rest of the attempt.
struct Pick {
    predicted: Option<u64>,
    /// `predicted` came from the precise (KV-event) index.
    precise: bool,
    est_cost: Option<f64>,
    size: crate::pool::RequestSize,
}

/// One request's attempts on one pool.
struct Attempts<'c, 'a> {
    ctx: &'c ForwardContext<'a>,
    /// The pool's policy, or the one the request names when the pool allows it.
    policy: &'c dyn Policy,
    rreq: RouteRequest<'c>,
    deadline: Instant,
    pool_label: SharedString,
    /// Workers tried so far: a few, kept inline.
    tried: SmallVec<[usize; 4]>,
    attempt: u32,
    last_err: Option<GatewayError>,
    /// Failed attempts as `worker=outcome`, logged when the request fails (only
    /// allocated on failures).
    trail: Vec<String>,
    stop: &'static str,
    blame: Blame<'c>,
    /// When the current pick started (only a trace span needs it).
    pick_start: Option<Instant>,
    /// The request's class (header, else `normal`).
    prio: Priority,
    /// Its place in the pool's queue while it waits or holds a turn.
    place: Option<Place<'c>>,
    /// It was granted a turn: it may pick although others wait.
    turn: bool,
    /// It was preempted: it queues again ahead of its class.
    front: bool,
    /// The slot the last pick took on its worker, until the attempt is sent.
    reserved: Option<crate::pool::Reservation>,
    /// The last pick turned down a worker with room as too slow for it.
    declined: bool,
}

impl<'c, 'a> Attempts<'c, 'a> {
    fn new(ctx: &'c ForwardContext<'a>) -> Self {
        let route = ctx.route;
        let pool_label = route.pool.metrics.name.clone();
        let asked = ctx.own.get_str(&ctx.parts.headers, Name::Policy);
        let policy = match asked.map(|name| route.override_policy(name)) {
            Some(Some(p)) => {
                telemetry::record_policy_override(&pool_label, p.name());
                p
            }
            Some(None) => {
                // The pool allows no override, or names no such policy.
                crate::tenancy::claims::noted("policy", "ignored", &ctx.tags.tenant.name);
                &*route.policy
            }
            None => &*route.policy,
        };
        route.pool.retry_budget.on_request();
        Attempts {
            ctx,
            policy,
            rreq: ctx.route_request(),
            deadline: ctx.deadline(),
            pool_label,
            tried: SmallVec::new(),
            attempt: 0,
            last_err: None,
            trail: Vec::new(),
            stop: "no_candidate",
            blame: Blame::new(route, ctx.health),
            pick_start: None,
            prio: super::flow::priority(ctx),
            place: None,
            turn: false,
            front: false,
            reserved: None,
            declined: false,
        }
    }

    /// Worker `i` may take this request now: available, not tried, not
    /// prefill-only in a disaggregated pool, inside the residency.
    fn eligible(&self, i: usize) -> bool {
        let w = &self.ctx.route.workers[i];
        w.is_available()
            && !self.tried.contains(&i)
            && !(self.skip_prefill() && w.role == Role::Prefill)
            && self.ctx.allows(w)
    }

    fn skip_prefill(&self) -> bool {
        self.ctx.route.pool.config.disaggregation.is_some()
    }

    /// Phase: select. The policy's pick among eligible workers with room (see
    /// `pool::flow::saturation`); while every eligible one is saturated — or
    /// others of this class or above are waiting — wait in the pool's queue and
    /// pick again when given the turn (the best worker *then*); on a
    /// retry with nobody left, a last-resort worker. `None`: no worker can take
    /// the request.
    async fn select(&mut self) -> Result<Option<Decision>, GatewayError> {
        let route = self.ctx.route;
        let pinned = self.ctx.pinned.map(|p| p.index);
        if let Some(p) = self.ctx.pinned.filter(|p| !p.generates) {
            // A by-id call: to the owner, holding no slot (see `Pinned`).
            return Ok((!self.tried.contains(&p.index)).then(|| owner(p.index)));
        }
        let queue = route.pool.queue.as_deref();
        loop {
            if let Some(q) = queue.filter(|q| !self.turn && q.must_wait(self.prio)) {
                self.wait(q).await?;
                continue;
            }
            self.pick_start = self.ctx.tags.tracing().then(crate::runtime::clock::now);
            let cfg = &route.pool.config;
            // Only the stats-based saturation rules need the clock.
            let now = cfg
                .flow
                .as_ref()
                .map_or(0, |_| crate::runtime::clock::now_ms());
            self.rreq.elapsed_ms = self.ctx.start.elapsed().as_secs_f64() * 1e3;
            let slow = self.slow_workers();
            let over = self.over_share();
            let free =
                |i: usize| self.eligible(i) && saturation::has_room(cfg, &route.workers[i], now);
            let room =
                |i: usize| free(i) && !(over && saturation::in_reserve(cfg, &route.workers[i]));
            let accept = |i: usize| room(i) && !slow.contains(&i);
            let pick = match pinned {
                // A continuation: its owner, when it has room, like any pick.
                Some(o) => accept(o).then(|| owner(o)),
                None => self.policy.pick(&self.rreq, &route.workers, &accept),
            };
            if let Some(d) = pick {
                // The slot is taken before anyone else is given a turn; lost to
                // another thread in between, pick again.
                if queue.is_some() {
                    let limit = cfg.max_concurrency_per_worker;
                    match route.workers[d.index].try_reserve(limit, route.pool.queue.as_ref()) {
                        Some(r) => self.reserved = Some(r.with_share(self.share())),
                        None => continue,
                    }
                }
                self.dispatched(queue);
                return Ok(Some(d));
            }
            let saturated = match pinned {
                Some(o) => self.eligible(o),
                None => (0..route.workers.len()).any(|i| self.eligible(i)),
            };
            // Turned down a worker with room (too slow, its free slots kept
            // for others, or not the owner): the waiters behind may take it.
            let other_free = |i: usize| Some(i) != pinned && free(i);
            self.declined = slow.iter().any(|&i| room(i))
                || (over && (0..route.workers.len()).any(free))
                || (pinned.is_some() && (0..route.workers.len()).any(other_free));
            match queue {
                Some(q) if saturated => self.wait(q).await?,
                _ => {
                    // Giving up a turn: the next waiter may find what this one did not.
                    if self.place.take().is_some() {
                        queue.inspect(|q| q.release());
                    }
                    return Ok(self.last_resort());
                }
            }
        }
    }

    /// The request's flow holds more than its share of the pool's tokens in
    /// flight while another flow is active: a worker's reserved slots are not
    /// for it (`pool::flow::share`).
    fn over_share(&self) -> bool {
        let Some(q) = self.shares() else {
            return false;
        };
        let t = super::flow::ticket(self.ctx, self.prio, false);
        q.over_share(t.flow, t.weight)
    }

    /// The request's tokens, counted in its flow's share while it is in flight.
    fn share(&self) -> Option<crate::pool::flow::ShareGuard> {
        let q = self.shares()?;
        let t = super::flow::ticket(self.ctx, self.prio, false);
        q.share(t.flow, t.weight, t.cost)
    }

    /// The pool's queue, when it keeps slots for flows within their share.
    fn shares(&self) -> Option<&'c Arc<FlowQueue>> {
        let pool = &self.ctx.route.pool;
        let flow = pool.config.flow.as_ref()?;
        (flow.reserved(pool.config.max_concurrency_per_worker) > 0)
            .then_some(pool.queue.as_ref())
            .flatten()
    }

    /// The eligible workers this request holds out against for now, as too slow
    /// for it next to the best one while a slot on a fast one is expected soon
    /// (`saturation::holds_for_faster`; flow-control pools whose workers all
    /// have a latency model).
    fn slow_workers(&self) -> SmallVec<[usize; 4]> {
        let route = self.ctx.route;
        let mut slow = SmallVec::new();
        if self.ctx.pinned.is_some() {
            return slow; // only the owner will do, however slow
        }
        let (Some(flow), Some(q)) = (route.pool.config.flow.as_ref(), route.pool.queue.as_deref())
        else {
            return slow;
        };
        if flow.hold_for_faster <= 0.0 {
            return slow;
        }
        // Sized as the models learn (exact once a pick tokenized the prompt).
        let size = self.ctx.size_exact(&self.rreq, 0);
        let mut preds: SmallVec<[(usize, crate::pool::predict::Prediction); 8]> = SmallVec::new();
        for i in (0..route.workers.len()).filter(|&i| self.eligible(i)) {
            match route.workers[i].predict(size) {
                Some(p) => preds.push((i, p)),
                None => return slow, // a worker without a model: no judgement
            }
        }
        let best = preds
            .iter()
            .map(|p| p.1.ttft_ms)
            .fold(f64::INFINITY, f64::min);
        let fast_ms = flow.hold_for_faster * best;
        if preds.iter().all(|(_, p)| p.ttft_ms <= fast_ms) {
            return slow; // nobody much slower: no need to look at the queue
        }
        // How fast the fast workers free slots: each holds a request for about
        // its TTFT plus the expected output at its time per token.
        let out = self
            .ctx
            .info
            .max_tokens
            .unwrap_or(flow.expected_output_tokens) as f64;
        let slots = (route.pool.config.max_concurrency_per_worker)
            .max(flow.max_running.unwrap_or(0))
            .max(1) as f64;
        let per_s: f64 = preds
            .iter()
            .filter(|(_, p)| p.ttft_ms <= fast_ms)
            .map(|(_, p)| slots * 1e3 / (p.ttft_ms + p.tpot_ms.unwrap_or(0.0) * out).max(1.0))
            .sum();
        let wait = saturation::expected_wait_ms(q.ahead(&self.place), per_s);
        let (ratio, waited) = (flow.hold_for_faster, self.rreq.elapsed_ms);
        let holds = |ms: f64| saturation::holds_for_faster(ratio, ms, best, wait, waited);
        slow.extend(preds.iter().filter(|(_, p)| holds(p.ttft_ms)).map(|p| p.0));
        slow
    }

    /// Wait in the pool's queue for a turn (at the kept place after the first
    /// time); the time waited is the request's. A request that can no longer
    /// meet its TTFT objective leaves at once (see `slo::hold_until`).
    async fn wait(&mut self, q: &'c FlowQueue) -> Result<(), GatewayError> {
        let mut ticket = super::flow::ticket(self.ctx, self.prio, self.front);
        ticket.declined = std::mem::take(&mut self.declined);
        let size = self.ctx.size_exact(&self.rreq, 0);
        let hold = super::slo::hold_until(self.ctx, size, &|i| self.eligible(i));
        let waited = crate::runtime::clock::now();
        if let Some((_, best)) = hold.filter(|(by, _)| *by <= waited) {
            // Shed before queueing: leave the place (and hand on a turn) now.
            if self.place.take().is_some() {
                q.release();
            }
            return Err(super::slo::shed_held(self.ctx, best));
        }
        let r = Box::pin(q.wait(&ticket, &mut self.place, hold.map(|h| h.0))).await;
        self.ctx.tags.add_queued(waited.elapsed());
        self.turn = r.is_ok();
        r.map_err(|e| match (e, hold) {
            (QueueError::Objective, Some((_, best))) => super::slo::shed_held(self.ctx, best),
            (e, _) => super::flow::queue_error(self.ctx, e),
        })
    }

    /// A pick succeeded: if it came from the queue, leave it (handing the turn
    /// on) and count the tenant's dispatched tokens.
    fn dispatched(&mut self, queue: Option<&FlowQueue>) {
        self.turn = false;
        self.front = false;
        if let (Some(q), Some(place)) = (queue, self.place.take()) {
            counter!(names::FLOW_DISPATCHED_TOKENS_TOTAL, names::L_POOL => self.pool_label.clone(),
                names::L_TENANT => self.ctx.tags.tenant_label.clone())
            .increment(super::flow::ticket(self.ctx, self.prio, false).cost);
            q.dispatched(Some(place));
        }
    }

    /// Register the attempt about to be sent as preemptible, when the pool
    /// preempts and a class above this one exists.
    fn preemptible(
        &self,
    ) -> Option<(
        crate::pool::flow::Preemptible<'c>,
        tokio::sync::oneshot::Receiver<()>,
    )> {
        let q = self.ctx.route.pool.queue.as_deref()?;
        (q.preemption() != Preemption::Off && self.prio != Priority::Critical)
            .then(|| q.preemptible(self.prio))
    }

    /// The attempt on `decision` was preempted before answering: take it back
    /// (not a failure of the worker, not an attempt) and queue again ahead of the
    /// class, or refuse with a retryable error, as the pool says.
    fn preempted(&mut self, decision: &Decision) -> Result<(), GatewayError> {
        self.tried.retain(|i| *i != decision.index);
        self.attempt = self.attempt.saturating_sub(1);
        self.front = true;
        tracing::info!(request_id = ?self.ctx.request_id, pool = %self.ctx.route.pool.name,
            class = self.prio.as_str(), "preempted by a higher class before answering");
        match self
            .ctx
            .route
            .pool
            .queue
            .as_deref()
            .map(FlowQueue::preemption)
        {
            Some(Preemption::Reject) => Err(GatewayError::Preempted(
                self.ctx.route.pool.name.to_string(),
            )),
            _ => Ok(()),
        }
    }

    /// Last resort for a retry: a worker already tried (not the one that just
    /// failed) or cooling down after a 429 — better than failing a request that
    /// another attempt could still save. Preferably one that answered this
    /// request (a 5xx may not repeat) over one whose connection broke or hung,
    /// and among those the one failing least for everybody else right now.
    fn last_resort(&self) -> Option<Decision> {
        if self.attempt == 0 || self.ctx.pinned.is_some() {
            return None;
        }
        let route = self.ctx.route;
        let ok = |i: usize| last_resort(route, i, &self.tried, self.skip_prefill(), &self.rreq);
        let answered = |i: usize| ok(i) && !self.blame.broke(i);
        let d = pick_fewest_failures(self.policy, &self.rreq, route, &answered)
            .or_else(|| pick_fewest_failures(self.policy, &self.rreq, route, &ok))?;
        counter!(names::LAST_RESORT_RETRIES_TOTAL, names::L_POOL => self.pool_label.clone())
            .increment(1);
        Some(d)
    }

    /// Phase: begin an attempt on the chosen worker. A retry is counted and
    /// backs off first; the decision is recorded (and taught to the policy).
    async fn begin(&mut self, decision: &Decision) -> Pick {
        let ctx = self.ctx;
        let policy = self.policy;
        if self.attempt > 0 {
            counter!(names::RETRIES_TOTAL, names::L_POOL => self.pool_label.clone()).increment(1);
            let b = crate::runtime::clock::now();
            Box::pin(backoff(ctx.route.pool.config.retry_backoff, self.attempt)).await;
            ctx.tags.add_waited(b.elapsed());
        }
        self.attempt += 1;
        ctx.route
            .pool
            .metrics
            .record_decision(policy.name(), decision.reason.as_str());
        // Before `record`, which teaches the index this request's blocks.
        let predicted = policy.predicted_cached_tokens(decision, &self.rreq);
        policy.record(decision, &self.rreq, &ctx.route.workers);
        let est_cost = policy.estimate_cost(decision, &self.rreq);
        self.tried.push(decision.index);
        if let Some(pick_start) = self.pick_start {
            ctx.tags.child_span(ChildSpan {
                name: "switchyard.route",
                kind: SpanKind::Internal,
                span_id: new_span_id(),
                start: pick_start,
                end: crate::runtime::clock::now(),
                attrs: vec![
                    ("switchyard.policy", policy.name().into()),
                    ("switchyard.reason", decision.reason.as_str().into()),
                    (
                        "switchyard.worker",
                        ctx.route.workers[decision.index].id.as_ref().into(),
                    ),
                ],
                error: false,
            });
        }
        Pick {
            predicted,
            precise: self.rreq.predicted_precisely(),
            est_cost,
            size: ctx.size_exact(&self.rreq, predicted.unwrap_or(0)),
        }
    }

    /// Phase: settle an attempt's outcome. A response is the answer unless its
    /// status is worth a retry that is still allowed; an error retries when it
    /// is retryable and allowed, else stops the request.
    fn settle(&mut self, decision: &Decision, (result, failure): Sent) -> Settled {
        self.blame.record(decision.index, failure);
        let worker = &self.ctx.route.workers[decision.index];
        match result {
            Ok((resp, guard)) => {
                let status = resp.status();
                if retryable_status(status) {
                    self.trail
                        .push(format!("{}={}", worker.id, status.as_u16()));
                    match self.may_retry() {
                        Ok(()) => {
                            tracing::debug!(worker = %worker.id, %status, "retrying on another worker");
                            return Settled::Retry;
                        }
                        Err(why) => log_failed(self.ctx, &self.trail, why),
                    }
                }
                Settled::Answer(resp, guard)
            }
            Err(err) => {
                self.trail.push(format!("{}={}", worker.id, err.reason()));
                let retry = err.retryable();
                self.last_err = Some(err);
                if !retry {
                    self.stop = "not_retryable";
                    return Settled::Stop;
                }
                match self.may_retry() {
                    Ok(()) => Settled::Retry,
                    Err(why) => {
                        self.stop = why;
                        Settled::Stop
                    }
                }
            }
        }
    }

    /// Phase: on response. The worker's answer goes to the client, observed.
    fn answer(
        &self,
        decision: &Decision,
        pick: &Pick,
        resp: Response<Incoming>,
        guard: InFlightGuard,
    ) -> Response<Body> {
        if let Some(usd) = pick.est_cost {
            telemetry::record_estimated_cost(&self.pool_label, usd);
        }
        let note = RouteNote {
            index: decision.index,
            policy: self.policy.name(),
            reason: decision.reason,
            prefill: None,
            est_cost_usd: pick.est_cost,
            precise: pick.precise,
        };
        respond(self.ctx, resp, note, pick.predicted, guard, self.deadline)
    }

    fn may_retry(&self) -> Result<(), &'static str> {
        // Only the owner holds a pinned request's state; an upload was sent.
        if self.ctx.upload.is_some() || self.ctx.pinned.is_some() {
            return Err("not_replayable");
        }
        may_retry(
            self.ctx.route,
            &self.rreq,
            &self.tried,
            self.attempt,
            self.deadline,
            &self.pool_label,
        )
    }

    /// No answer: log the attempts and return the last error (or why no worker
    /// could take the request).
    fn fail(mut self) -> GatewayError {
        log_failed(self.ctx, &self.trail, self.stop);
        self.last_err.take().unwrap_or_else(|| self.ctx.no_worker())
    }
}

/// One line per request that failed (or is passed a worker's error) after its
/// attempts: which workers answered what, and why no further attempt was made
/// (`attempts`, `deadline`, `no_candidate`, `budget`, `not_retryable`,
/// `not_replayable`).
fn log_failed(ctx: &ForwardContext<'_>, trail: &[String], stop: &'static str) {
    tracing::warn!(
        request_id = ?ctx.request_id,
        model = %ctx.route.model,
        attempts = %trail.join(","),
        stop,
        "request failed"
    );
}

/// Who is to blame for a request's failed attempts, settled when the request is
/// done (dropped). If the request succeeded in the end, every failure was its
/// worker's and is charged. If it failed, a failure seen on two or more workers
/// (the same status, resets, timeouts, 429s) is taken as the request's own — a
/// query of death, a per-key limit upstream, a fault the client asked for — and
/// charged to none of them; the others are charged. Otherwise one such request
/// retried over the pool ejects or cools down healthy workers one after the
/// other and shrinks the pool for everybody else. Refused connections are always
/// charged. The charge comes a few attempts late at most.
pub(super) struct Blame<'a> {
    route: &'a ModelRoute,
    cfg: &'a HealthConfig,
    /// This request's failed attempts (allocated only on failures).
    failures: Vec<(usize, Failure)>,
    succeeded: bool,
}

impl<'a> Blame<'a> {
    pub(super) fn new(route: &'a ModelRoute, cfg: &'a HealthConfig) -> Self {
        Blame {
            route,
            cfg,
            failures: Vec::new(),
            succeeded: false,
        }
    }

    /// Attempt on worker `idx` ended with `failure` (`None`: it succeeded).
    pub(super) fn record(&mut self, idx: usize, failure: Option<Failure>) {
        match failure {
            Some(f) => self.failures.push((idx, f)),
            None => self.succeeded = true,
        }
    }

    /// Worker `idx`'s connection broke or hung on this request.
    fn broke(&self, idx: usize) -> bool {
        self.failures.iter().any(|&(i, f)| {
            i == idx && matches!(f, Failure::Broken | Failure::Timeout | Failure::Connect)
        })
    }
}

impl Drop for Blame<'_> {
    fn drop(&mut self) {
        let mut own = false;
        for &(i, f) in &self.failures {
            let repeated = self.failures.iter().any(|&(j, g)| g == f && j != i);
            if !self.succeeded && repeated && f.may_be_the_requests() {
                own = true;
            } else {
                charge(self.route, self.cfg, i, f);
            }
        }
        if own {
            counter!(names::REQUEST_CAUSED_FAILURES_TOTAL,
                names::L_POOL => SharedString::from(self.route.pool.name.clone()))
            .increment(1);
        }
    }
}

/// Another attempt is allowed: attempts left, time left, an untried worker able to
/// take it, and the pool's retry budget has a retry to spend (checked last: it takes
/// one). Otherwise, why not.
fn may_retry(
    route: &ModelRoute,
    rreq: &RouteRequest<'_>,
    tried: &[usize],
    attempt: u32,
    deadline: Instant,
    pool_label: &SharedString,
) -> Result<(), &'static str> {
    let pool = &route.pool;
    if attempt >= pool.config.max_attempts {
        return Err("attempts");
    }
    if crate::runtime::clock::now() >= deadline {
        return Err("deadline");
    }
    let skip_prefill = pool.config.disaggregation.is_some();
    let candidate = (0..route.workers.len()).any(|i| {
        (route.workers[i].is_available() && !tried.contains(&i) && rreq.allows(&route.workers[i]))
            || last_resort(route, i, tried, skip_prefill, rreq)
    });
    if !candidate {
        return Err("no_candidate");
    }
    if pool.retry_budget.try_retry() {
        Ok(())
    } else {
        counter!(names::RETRY_BUDGET_EXHAUSTED_TOTAL, names::L_POOL => pool_label.clone())
            .increment(1);
        Err("budget")
    }
}

/// May worker `i` take a retry when no untried available worker is left? Not
/// ejected or draining (a 429 cooldown is tolerated), not the worker that failed
/// last, not prefill-only in a disaggregated pool, and allowed by the residency.
fn last_resort(
    route: &ModelRoute,
    i: usize,
    tried: &[usize],
    skip_prefill: bool,
    rreq: &RouteRequest<'_>,
) -> bool {
    let w = &route.workers[i];
    w.state.healthy.load(Ordering::Relaxed)
        && !w.state.draining.load(Ordering::Relaxed)
        && tried.last() != Some(&i)
        && !(skip_prefill && w.role == Role::Prefill)
        && rreq.allows(w)
}

/// The policy's pick among the workers `ok` admits that have the fewest
/// consecutive failures (as charged so far).
fn pick_fewest_failures(
    policy: &dyn Policy,
    req: &RouteRequest<'_>,
    route: &ModelRoute,
    ok: &dyn Fn(usize) -> bool,
) -> Option<Decision> {
    let failures = |i: usize| {
        route.workers[i]
            .state
            .health
            .consecutive_failures
            .load(Ordering::Relaxed)
    };
    let fewest = (0..route.workers.len())
        .filter(|&i| ok(i))
        .map(failures)
        .min()?;
    policy.pick(req, &route.workers, &|i| ok(i) && failures(i) == fewest)
}

/// The decision for a pinned request: its owner.
fn owner(index: usize) -> Decision {
    Decision {
        index,
        reason: Reason::Owner,
        cross: None,
        spill: None,
    }
}

/// Jittered exponential backoff before retry number `attempt` (1-based).
pub(super) async fn backoff(base: std::time::Duration, attempt: u32) {
    if base.is_zero() {
        return;
    }
    let cap = base.saturating_mul(1 << attempt.min(6));
    let d = cap.mul_f64(rand::random::<f64>());
    tokio::time::sleep(d).await;
}
