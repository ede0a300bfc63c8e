//! Every metric name, label key and help text, in one place. Tests and docs import
//! these rather than retyping strings.

use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};

pub const REQUESTS_TOTAL: &str = "switchyard_requests_total";
pub const TTFT_SECONDS: &str = "switchyard_ttft_seconds";
pub const ITL_SECONDS: &str = "switchyard_itl_seconds";
pub const E2E_SECONDS: &str = "switchyard_e2e_seconds";
// Help text of the histograms recorded per thread (`telemetry::local`), which
// renders them itself.
pub const TTFT_HELP: &str =
    "Time from request arrival at the gateway to the first response event carrying generated content.";
pub const ITL_HELP: &str = "Gap between successive content events of a streamed response.";
pub const E2E_HELP: &str = "Time from request arrival to the end of the response body.";
pub const PREDICTED_TTFT_SECONDS: &str = "switchyard_predicted_ttft_seconds";
pub const PREDICTED_TTFT_HELP: &str =
    "Time to first token the worker's latency model predicted at dispatch, for answers whose TTFT was measured (compare with switchyard_ttft_seconds).";
pub const TTFT_PREDICTION_ERROR: &str = "switchyard_ttft_prediction_error_ratio";
pub const TTFT_PREDICTION_ERROR_HELP: &str =
    "Absolute error of the predicted time to first token relative to the measured one (|predicted - actual| / actual).";
/// Buckets of the relative prediction error.
pub const ERROR_RATIO_BUCKETS: &[f64] = &[0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0];
pub const SLO_DECISIONS_TOTAL: &str = "switchyard_slo_decisions_total";
pub const TOKENS_TOTAL: &str = "switchyard_tokens_total";
pub const GATEWAY_ERRORS_TOTAL: &str = "switchyard_gateway_errors_total";
pub const UPSTREAM_ATTEMPTS_TOTAL: &str = "switchyard_upstream_attempts_total";
pub const STREAM_ERRORS_TOTAL: &str = "switchyard_stream_errors_total";
pub const ROUTING_DECISIONS_TOTAL: &str = "switchyard_routing_decisions_total";
pub const WORKER_IN_FLIGHT: &str = "switchyard_worker_in_flight";
pub const WORKER_HEALTHY: &str = "switchyard_worker_healthy";
pub const WORKER_QUEUE: &str = "switchyard_worker_queue";
pub const WORKER_WAITING: &str = "switchyard_worker_waiting";
pub const WORKER_RUNNING: &str = "switchyard_worker_running";
pub const WORKER_KV_USAGE_RATIO: &str = "switchyard_worker_kv_usage_ratio";
pub const WORKER_STATS_AGE_SECONDS: &str = "switchyard_worker_stats_age_seconds";
pub const WORKER_GPU_UTILIZATION_RATIO: &str = "switchyard_worker_gpu_utilization_ratio";
pub const WORKER_GPU_MEMORY_USED_BYTES: &str = "switchyard_worker_gpu_memory_used_bytes";
pub const WORKER_GPU_MEMORY_FREE_BYTES: &str = "switchyard_worker_gpu_memory_free_bytes";
pub const WORKER_GPU_THROTTLE_REASONS: &str = "switchyard_worker_gpu_throttle_reasons";
pub const STATS_POLL_ERRORS_TOTAL: &str = "switchyard_stats_poll_errors_total";
pub const PREFIX_INDEX_ENTRIES: &str = "switchyard_prefix_index_entries";
pub const PREFIX_INDEX_PAIRS: &str = "switchyard_prefix_index_pairs";
pub const PREFIX_INDEX_BYTES: &str = "switchyard_prefix_index_bytes";
pub const PREFIX_INDEX_EVICTIONS_TOTAL: &str = "switchyard_prefix_index_evictions_total";
pub const ESTIMATED_COST_MICRODOLLARS_TOTAL: &str =
    "switchyard_routing_estimated_cost_microdollars_total";
pub const POLICY_OVERRIDES_TOTAL: &str = "switchyard_routing_policy_overrides_total";
pub const WORKER_STATE: &str = "switchyard_worker_state";
pub const EJECTIONS_TOTAL: &str = "switchyard_worker_ejections_total";
pub const EJECTIONS_REFUSED_TOTAL: &str = "switchyard_worker_ejections_refused_total";
pub const WORKER_OVERLOADED_TOTAL: &str = "switchyard_worker_overloaded_total";
pub const RETRIES_TOTAL: &str = "switchyard_retries_total";
pub const RETRY_BUDGET_EXHAUSTED_TOTAL: &str = "switchyard_retry_budget_exhausted_total";
pub const QUEUE_DEPTH: &str = "switchyard_queue_depth";
pub const QUEUE_WAIT_SECONDS: &str = "switchyard_queue_wait_seconds";
pub const FLOW_REQUESTS_TOTAL: &str = "switchyard_flow_requests_total";
pub const FLOW_SHED_TOTAL: &str = "switchyard_flow_shed_total";
pub const FLOW_MAP_FULL_TOTAL: &str = "switchyard_flow_map_full_total";
pub const FLOW_DISPATCHED_TOKENS_TOTAL: &str = "switchyard_flow_dispatched_tokens_total";
pub const CONNECTIONS_OPEN: &str = "switchyard_connections_open";
pub const CONNECTIONS_CLOSED_TOTAL: &str = "switchyard_connections_closed_total";
pub const BUSY_POLL_MICROSECONDS: &str = "switchyard_busy_poll_microseconds_total";
pub const CONFIG_RELOADS_TOTAL: &str = "switchyard_config_reloads_total";
pub const TLS_CERT_RELOADS_TOTAL: &str = "switchyard_tls_certificate_reloads_total";
pub const TLS_HANDSHAKE_FAILURES_TOTAL: &str = "switchyard_tls_handshake_failures_total";
pub const TLS_CERT_EXPIRY_SECONDS: &str = "switchyard_tls_certificate_expiry_seconds";
pub const CORS_REFUSED_TOTAL: &str = "switchyard_cors_refused_total";
pub const LIMIT_REFUSALS_TOTAL: &str = "switchyard_limit_refusals_total";
pub const ROUTE_REFUSALS_TOTAL: &str = "switchyard_route_refusals_total";
pub const WORKER_ADDRESS_REFUSALS_TOTAL: &str = "switchyard_worker_address_refusals_total";
pub const CLIENT_CLAIMS_TOTAL: &str = "switchyard_client_claims_total";
pub const LIMITS_STORE_ERRORS_TOTAL: &str = "switchyard_limits_store_errors_total";
pub const LIMITS_STORE_FAILOVERS_TOTAL: &str = "switchyard_limits_store_failovers_total";
pub const LIMITS_STORE_RETRIES_TOTAL: &str = "switchyard_limits_store_retries_total";
pub const FALLBACKS_TOTAL: &str = "switchyard_fallbacks_total";
pub const LAST_RESORT_RETRIES_TOTAL: &str = "switchyard_last_resort_retries_total";
pub const CANCELLATIONS_TOTAL: &str = "switchyard_cancellations_total";
pub const STORED_ID_REFUSALS_TOTAL: &str = "switchyard_stored_id_refusals_total";
pub const REQUEST_CAUSED_FAILURES_TOTAL: &str = "switchyard_request_caused_failures_total";
pub const DISAGG_DECISIONS_TOTAL: &str = "switchyard_disagg_decisions_total";
pub const DISAGG_LEG_SECONDS: &str = "switchyard_disagg_leg_seconds";
pub const DISAGG_LEG_FAILURES_TOTAL: &str = "switchyard_disagg_leg_failures_total";

// ---- Gateway-side tokenization ----
pub const TOKENIZE_CACHE_HITS_TOTAL: &str = "switchyard_tokenize_cache_hits_total";
pub const TOKENIZE_CACHE_MISSES_TOTAL: &str = "switchyard_tokenize_cache_misses_total";
pub const TOKENIZE_CACHE_EVICTIONS_TOTAL: &str = "switchyard_tokenize_cache_evictions_total";
pub const TOKENIZE_CACHE_TOKENS: &str = "switchyard_tokenize_cache_tokens";
pub const TOKENIZE_ERRORS_TOTAL: &str = "switchyard_tokenize_errors_total";

// ---- Global routing ----
pub const SPLIT_DECISIONS_TOTAL: &str = "switchyard_split_decisions_total";
pub const CROSS_REGION_REQUESTS_TOTAL: &str = "switchyard_cross_region_requests_total";
pub const LOCALITY_SPILLING: &str = "switchyard_locality_spilling";
pub const FALLBACKS_SKIPPED_TOTAL: &str = "switchyard_fallbacks_skipped_total";

// ---- Observability and cost ----
pub const COST_USD_TOTAL: &str = "switchyard_cost_usd_total";
pub const USAGE_ESTIMATED_TOTAL: &str = "switchyard_usage_estimated_total";
pub const GATEWAY_OVERHEAD_SECONDS: &str = "switchyard_gateway_overhead_seconds";
pub const GATEWAY_OVERHEAD_HELP: &str = "Time a request spent in the gateway itself: arrival to response head, minus upstream waits, queue waits and retry backoff.";
pub const PROCESS_CPU_SECONDS_TOTAL: &str = "switchyard_process_cpu_seconds_total";
pub const PROCESS_RESIDENT_MEMORY_BYTES: &str = "switchyard_process_resident_memory_bytes";
pub const CACHE_PREDICTED_TOKENS_TOTAL: &str = "switchyard_cache_predicted_tokens_total";
pub const CACHE_ACTUAL_TOKENS_TOTAL: &str = "switchyard_cache_actual_tokens_total";
pub const CACHE_PREDICTIONS_TOTAL: &str = "switchyard_cache_predictions_total";
pub const CACHE_PREDICTION_RATIO: &str = "switchyard_cache_prediction_ratio";
// ---- Engine KV-cache events and the precise index ----
pub const KV_EVENTS_TOTAL: &str = "switchyard_kv_events_total";
pub const KV_BLOCKS_SKIPPED_TOTAL: &str = "switchyard_kv_blocks_skipped_total";
pub const KV_RESYNCS_TOTAL: &str = "switchyard_kv_resyncs_total";
pub const KV_REFUSALS_TOTAL: &str = "switchyard_kv_refusals_total";
pub const KV_INDEX_BLOCKS: &str = "switchyard_kv_index_blocks";
pub const KV_INDEX_CAPACITY_BLOCKS: &str = "switchyard_kv_index_capacity_blocks";
pub const KV_INDEX_LAG_SECONDS: &str = "switchyard_kv_index_lag_seconds";
pub const KV_WORKER_STATE: &str = "switchyard_kv_worker_state";
pub const KV_ENGINE_START_SECONDS: &str = "switchyard_kv_engine_start_time_seconds";
pub const KV_INDEX_LOOKUP_MISMATCH_TOTAL: &str = "switchyard_kv_index_lookup_mismatch_total";
pub const KV_BLOCK_SIZE_MISMATCH: &str = "switchyard_kv_block_size_mismatch";
pub const L_MEDIUM: &str = "medium";
pub const POOL_IMBALANCE_RATIO: &str = "switchyard_pool_imbalance_ratio";
pub const POOL_IDLE_WORKERS: &str = "switchyard_pool_idle_workers";
pub const POOL_SATURATION_RATIO: &str = "switchyard_pool_saturation_ratio";
pub const POOL_REPLICAS: &str = "switchyard_pool_replicas";
pub const POOL_DESIRED_REPLICAS: &str = "switchyard_pool_desired_replicas";
pub const ACCESS_LOG_RECORDS_TOTAL: &str = "switchyard_access_log_records_total";
pub const ACCESS_LOG_DROPPED_TOTAL: &str = "switchyard_access_log_dropped_total";
pub const TRACE_SPANS_DROPPED_TOTAL: &str = "switchyard_trace_spans_dropped_total";
pub const TRACE_EXPORTS_TOTAL: &str = "switchyard_trace_exports_total";
pub const LABEL_OVERFLOW_TOTAL: &str = "switchyard_label_overflow_total";

// ---- Endpoint Picker mode (`switchyard epp`) ----
pub const EPP_DECISIONS_TOTAL: &str = "switchyard_epp_decisions_total";
pub const EPP_DECISION_SECONDS: &str = "switchyard_epp_decision_seconds";
pub const EPP_STREAMS_TOTAL: &str = "switchyard_epp_streams_total";

pub const L_REGION: &str = "region";
pub const L_TENANT: &str = "tenant";
pub const L_CLASS: &str = "class";
/// Flow-control event: `queued`, `dispatched`, `preempted`.
pub const L_EVENT: &str = "event";
pub const L_LABEL: &str = "label";

pub const L_MODEL: &str = "model";
pub const L_WORKER: &str = "worker";
pub const L_POOL: &str = "pool";
pub const L_ENDPOINT: &str = "endpoint";
pub const L_STATUS: &str = "status";
pub const L_OUTCOME: &str = "outcome";
pub const L_KIND: &str = "kind";
pub const L_REASON: &str = "reason";
pub const L_RESULT: &str = "result";
/// Which listener: `client` or `admin`.
pub const L_LISTENER: &str = "listener";
pub const L_POLICY: &str = "policy";
pub const L_STATE: &str = "state";
pub const L_MODE: &str = "mode";
pub const L_LEG: &str = "leg";
pub const L_TARGET: &str = "target";
pub const L_FROM: &str = "from";
pub const L_TO: &str = "to";
pub const L_STICKY: &str = "sticky";
pub const L_OP: &str = "op";
pub const L_SOURCE: &str = "source";
/// A client claim: `priority`, `slo`, `policy`.
pub const L_CLAIM: &str = "claim";
/// What became of a claim: `capped`, `ignored`.
pub const L_ACTION: &str = "action";

/// Register help text and units for every metric.
pub fn describe() {
    describe_kv_events();
    describe_counter!(
        LIMITS_STORE_ERRORS_TOTAL,
        "Failed calls to the shared limits store (Redis), by op (admit, settle, release, renew); on_redis_error decides what admit failures do."
    );
    describe_counter!(
        LIMITS_STORE_FAILOVERS_TOTAL,
        "Requests whose limits could not be checked because the shared store failed, by result: admitted_unlimited (on_redis_error = open) or refused (closed)."
    );
    describe_counter!(
        LIMITS_STORE_RETRIES_TOTAL,
        "Background calls to the shared limits store retried until they answer, by op (release: take back an admit that timed out; settle) and result (ok, failed after about a minute, dropped when too many wait)."
    );
    describe_counter!(
        ROUTE_REFUSALS_TOTAL,
        "Requests for paths the gateway does not forward, by reason: unknown_route (no built-in route, forward_routes or allow_control_routes entry), control_route (a known engine control route no pool allows), not_admin (an allowed control route called without an admin tenant's key)."
    );
    describe_counter!(
        WORKER_ADDRESS_REFUSALS_TOTAL,
        "Worker addresses refused by the address rules, by source: admin (POST /admin/workers), dns, k8s."
    );
    describe_counter!(
        CLIENT_CLAIMS_TOTAL,
        "Client headers asking for more than the tenant may have, by claim (priority, slo, policy) and action (capped: lowered to what the tenant may have; ignored: not honoured at all)."
    );
    describe_counter!(
        LIMIT_REFUSALS_TOTAL,
        "Requests refused by tenancy, by reason: missing_api_key, invalid_api_key, model_not_allowed, or the limit's name (requests_per_minute, tokens_per_minute, max_concurrent_requests, daily_budget_usd, monthly_budget_usd)."
    );
    describe_counter!(
        STORED_ID_REFUSALS_TOTAL,
        "Stored-response ids refused as not found without reaching an engine, by reason: format (not an id the gateway issues), legacy (the old unsigned resp_sy format), mac (not signed for the calling tenant with this gateway's id key); engine_id counts engine ids passed on unsigned."
    );
    describe_counter!(
        CANCELLATIONS_TOTAL,
        "Responses the client left before their end, by worker and how the engine was told (connection_closed; abort_sent or abort_failed for SGLang's /abort_request)."
    );
    describe_counter!(
        REQUESTS_TOTAL,
        "Proxied requests by model, worker, endpoint, final status and outcome (completed, cancelled, error)."
    );
    describe_counter!(
        TOKENS_TOTAL,
        "Tokens by kind: prompt and cached (from usage) and output (usage, else counted content events)."
    );
    describe_counter!(
        GATEWAY_ERRORS_TOTAL,
        "Requests the gateway answered with its own error, by reason and status."
    );
    describe_counter!(
        UPSTREAM_ATTEMPTS_TOTAL,
        "Upstream attempts by worker and result (ok, connect_error, timeout, status_5xx, status_429, ...)."
    );
    describe_counter!(
        STREAM_ERRORS_TOTAL,
        "Responses that failed after the first byte reached the client, by reason (upstream_reset, idle_timeout, total_timeout, drain_deadline: cut at the shutdown's drain deadline)."
    );
    describe_counter!(
        ROUTING_DECISIONS_TOTAL,
        "Routing decisions by pool, policy and reason."
    );
    describe_gauge!(
        WORKER_IN_FLIGHT,
        "Requests in flight per worker, as counted by the gateway."
    );
    describe_gauge!(
        WORKER_HEALTHY,
        "1 when the worker takes new requests, 0 when ejected or draining."
    );
    describe_observability();
    describe_routing();
    describe_tokenize();
    describe_epp();
    describe_flow();
    describe_counter!(
        LAST_RESORT_RETRIES_TOTAL,
        "Retries sent to an already-tried or cooling-down worker because no untried available worker was left."
    );
    describe_counter!(
        REQUEST_CAUSED_FAILURES_TOTAL,
        "Requests whose failure repeated on a second worker (same status, reset or timeout): taken as the request's own, not charged to worker health."
    );
    describe_counter!(
        USAGE_ESTIMATED_TOTAL,
        "Answers that reported no token usage, by pool: their prompt tokens are estimated from the request and their output tokens counted from the stream."
    );
    describe_counter!(
        FALLBACKS_TOTAL,
        "Requests handed from a pool to the next pool of its fallback chain, by pool and target."
    );
    describe_counter!(
        FALLBACKS_SKIPPED_TOTAL,
        "Fallback pools passed over because none of their workers is in the request's residency, by pool and target."
    );
    describe_counter!(
        SPLIT_DECISIONS_TOTAL,
        "Requests for a split model name resolved to one of its pools, by model, pool and sticky (true: by session key)."
    );
    describe_counter!(
        CROSS_REGION_REQUESTS_TOTAL,
        "Routed attempts sent outside the gateway's region, by from/to region and reason (local_unhealthy, local_overloaded, local_exhausted, no_local_worker, residency, within_budget)."
    );
    describe_gauge!(
        LOCALITY_SPILLING,
        "1 while a pool's local tier spills new requests to other regions (overloaded or unhealthy), else 0."
    );
}

/// Help text for the KV-event metrics.
fn describe_kv_events() {
    describe_counter!(
        KV_EVENTS_TOTAL,
        "Engine KV-event batches per worker by kind: received (live), applied, replayed (fetched from the replay endpoint), lost (never received nor replayed), duplicate, undecodable."
    );
    describe_counter!(
        KV_BLOCKS_SKIPPED_TOTAL,
        "Stored blocks left out of the precise index per worker, by reason: unchained (parent unknown or salted), over_capacity (max_blocks_per_worker reached)."
    );
    describe_counter!(
        KV_RESYNCS_TOTAL,
        "Times a worker's index entries were dropped and rebuilt, by reason: start, cleared (AllBlocksCleared), sequence_reset, reconnect."
    );
    describe_counter!(
        KV_REFUSALS_TOTAL,
        "Workers whose events do not fit the pool's configuration, by reason (block_size, token_ids): the pool routes on the approximate index."
    );
    describe_gauge!(
        KV_BLOCK_SIZE_MISMATCH,
        "Workers of the pool whose engine reports a KV block size other than the pool's (configured or learned): their events are refused and the pool routes on the approximate index."
    );
    describe_gauge!(
        KV_INDEX_BLOCKS,
        "Blocks the precise index holds per worker and medium (gpu, cpu, disk)."
    );
    describe_gauge!(
        KV_INDEX_CAPACITY_BLOCKS,
        "The most blocks the precise index keeps per worker (kv_events.max_blocks_per_worker)."
    );
    describe_gauge!(
        KV_INDEX_LAG_SECONDS,
        "Age of the newest event batch applied for a worker, at the time it was applied (engine clock to gateway clock)."
    );
    describe_gauge!(
        KV_ENGINE_START_SECONDS,
        "The engine process's start time (Unix seconds) its KV-event subscriber goes by, from the worker's /metrics: a change resyncs the worker (reason restart)."
    );
    describe_counter!(
        KV_INDEX_LOOKUP_MISMATCH_TOTAL,
        "Sampled precise-index lookups (1 in 256) whose fast search differed from the full walk: some engine holds a block without its parent, so depths may be overstated."
    );
    describe_gauge!(
        KV_WORKER_STATE,
        "A worker's standing in the precise index: 0 absent, 1 syncing, 2 live, 3 refused."
    );
}

/// Help text for the Endpoint Picker's own metrics.
fn describe_epp() {
    describe_counter!(
        EPP_DECISIONS_TOTAL,
        "Endpoint Picker decisions by result (picked, or the error reason) and status."
    );
    describe_histogram!(
        EPP_DECISION_SECONDS,
        Unit::Seconds,
        "Endpoint Picker decision time: body inspected, model resolved, worker and fallbacks picked."
    );
    describe_counter!(
        EPP_STREAMS_TOTAL,
        "ext_proc streams by the request body mode Envoy announced (buffered, streamed, full_duplex_streamed, none)."
    );
}

/// Help text for the observability and cost metrics.
fn describe_observability() {
    describe_gauge!(
        PROCESS_RESIDENT_MEMORY_BYTES,
        "Resident memory of the gateway process."
    );
    describe_counter!(
        CACHE_PREDICTED_TOKENS_TOTAL,
        "Prompt tokens the router predicted the chosen worker had cached, over requests with a prediction and usage."
    );
    describe_counter!(
        CACHE_ACTUAL_TOKENS_TOTAL,
        "Cached prompt tokens the worker reported in usage, over the same requests."
    );
    describe_counter!(
        CACHE_PREDICTIONS_TOTAL,
        "Requests with a cache prediction, by result: hit (both > 0), false_hit (predicted, none cached), missed_hit (not predicted, cached), miss."
    );
    describe_gauge!(
        CACHE_PREDICTION_RATIO,
        "Actual cached tokens / predicted cached tokens since start (1 = perfect; < 1 over-prediction)."
    );
    describe_gauge!(
        POOL_IMBALANCE_RATIO,
        "Max / mean of per-worker load (queue, else in-flight) over a pool's available workers; 1 when balanced or idle."
    );
    describe_gauge!(
        POOL_IDLE_WORKERS,
        "Available workers with no new request for telemetry.idle_worker_after_ms while another worker of the pool has requests waiting."
    );
    describe_gauge!(
        POOL_SATURATION_RATIO,
        "Pool load against its scaling targets: the largest of queue/target, KV usage/target and TTFT p90/target."
    );
    describe_gauge!(POOL_REPLICAS, "Available workers in the pool.");
    describe_gauge!(
        POOL_DESIRED_REPLICAS,
        "Recommended replica count for the pool (see docs/observability.md for the formula)."
    );
    describe_counter!(ACCESS_LOG_RECORDS_TOTAL, "Access-log records written.");
    describe_counter!(
        ACCESS_LOG_DROPPED_TOTAL,
        "Access-log records dropped because the writer's buffer was full."
    );
    describe_counter!(
        TRACE_SPANS_DROPPED_TOTAL,
        "Spans dropped because the exporter's buffer was full."
    );
    describe_counter!(
        TRACE_EXPORTS_TOTAL,
        "OTLP export requests by result (ok, error)."
    );
    describe_counter!(
        LABEL_OVERFLOW_TOTAL,
        "Label values mapped to `other` because the label's configured limit was reached."
    );
}

/// Help text for the worker-stats and routing metrics.
fn describe_routing() {
    describe_gauge!(
        WORKER_GPU_UTILIZATION_RATIO,
        "Mean GPU utilisation of the worker's GPUs (0..1) from its DCGM exporter (workers labelled dcgm_url)."
    );
    describe_gauge!(
        WORKER_GPU_MEMORY_USED_BYTES,
        Unit::Bytes,
        "GPU frame-buffer memory used, summed over the worker's GPUs, from its DCGM exporter."
    );
    describe_gauge!(
        WORKER_GPU_MEMORY_FREE_BYTES,
        Unit::Bytes,
        "GPU frame-buffer memory free, summed over the worker's GPUs, from its DCGM exporter."
    );
    describe_gauge!(
        WORKER_GPU_THROTTLE_REASONS,
        "DCGM clock-throttle reasons of the worker's GPUs, OR-ed (bitmask; 0: none, 1: idle)."
    );
    describe_counter!(
        SLO_DECISIONS_TOTAL,
        "Requests with a latency objective by what the latency models said at their first pick, per pool: met (some worker is predicted to meet it), unknown (a model has not learnt enough), downgraded (served anyway) or shed."
    );
    describe_gauge!(
        WORKER_QUEUE,
        "Estimated requests queued or running on the worker as routing sees it: waiting + running from the last scrape, corrected by requests started and finished since."
    );
    describe_gauge!(
        WORKER_WAITING,
        "Waiting requests reported by the worker's last /metrics scrape."
    );
    describe_gauge!(
        WORKER_RUNNING,
        "Running requests reported by the worker's last /metrics scrape."
    );
    describe_counter!(
        BUSY_POLL_MICROSECONDS,
        "Time serving threads spent busy polling (server.busy_poll_us), in microseconds: CPU spent to skip wake-ups."
    );
    describe_gauge!(
        CONNECTIONS_OPEN,
        "Client connections the gateway currently holds open."
    );
    describe_counter!(
        TLS_CERT_RELOADS_TOTAL,
        "Certificate reloads after the files changed on disk, by listener and result (ok, rejected: unreadable, not matching its key, expired or not yet valid; the old certificate stays)."
    );
    describe_gauge!(
        TLS_CERT_EXPIRY_SECONDS,
        Unit::Seconds,
        "When the certificate chain a listener serves expires: the earliest notAfter of its certificates, in Unix seconds (alert on it minus time())."
    );
    describe_counter!(
        TLS_HANDSHAKE_FAILURES_TOTAL,
        "TLS handshakes that failed, by listener and reason (error, timeout: not done within the header timeout, plaintext_http: a plain HTTP request, answered 400)."
    );
    describe_counter!(
        CORS_REFUSED_TOTAL,
        "Browser requests and preflights from an origin server.cors does not allow."
    );
    describe_counter!(
        CONNECTIONS_CLOSED_TOTAL,
        "Client connections the gateway closed, by reason: header_timeout, idle_timeout, body_timeout, bad_framing, drain_idle (open during a drain with nothing in flight: the client did not answer GOAWAY)."
    );
    describe_gauge!(
        WORKER_KV_USAGE_RATIO,
        "KV-cache usage (0..1) reported by the worker's last /metrics scrape."
    );
    describe_gauge!(
        WORKER_STATS_AGE_SECONDS,
        Unit::Seconds,
        "Age of the worker's last successful /metrics scrape (-1 if never scraped)."
    );
    describe_counter!(
        STATS_POLL_ERRORS_TOTAL,
        "Failed /metrics scrapes by worker (connect error, bad status, timeout, unknown dialect)."
    );
    describe_gauge!(
        PREFIX_INDEX_ENTRIES,
        "Distinct prefix blocks tracked by the pool's prefix index."
    );
    describe_gauge!(
        PREFIX_INDEX_PAIRS,
        "(block, worker) pairs held by the pool's prefix index; bounded by index_max_blocks."
    );
    describe_gauge!(
        PREFIX_INDEX_BYTES,
        Unit::Bytes,
        "Estimated memory of the pool's prefix index (map capacity plus per-worker LRU rings)."
    );
    describe_counter!(
        PREFIX_INDEX_EVICTIONS_TOTAL,
        "(block, worker) pairs evicted from the pool's prefix index by the per-worker LRU bound."
    );
    describe_counter!(
        ESTIMATED_COST_MICRODOLLARS_TOTAL,
        "Estimated cost of routed requests in micro-USD: worker price_per_mtok × (prompt bytes / bytes_per_token + max_tokens)."
    );
    describe_counter!(
        POLICY_OVERRIDES_TOTAL,
        "Requests whose x-switchyard-policy header was honoured, by pool and policy."
    );
}

fn describe_tokenize() {
    describe_counter!(
        TOKENIZE_CACHE_HITS_TOTAL,
        "Prompt segments whose tokens came from the gateway's tokenization cache."
    );
    describe_counter!(
        TOKENIZE_CACHE_MISSES_TOTAL,
        "Prompt segments the gateway tokenized because they were not cached."
    );
    describe_counter!(
        TOKENIZE_CACHE_EVICTIONS_TOTAL,
        "Segments evicted from the tokenization cache to stay within its token bound."
    );
    describe_gauge!(
        TOKENIZE_CACHE_TOKENS,
        "Tokens held by the tokenization caches (bounded per model)."
    );
    describe_counter!(
        TOKENIZE_ERRORS_TOTAL,
        "Requests the gateway could not tokenize, by reason (unsupported, invalid)."
    );
}

/// Flow control (`pool/flow/`): the gateway's queue per pool and priority class.
fn describe_flow() {
    describe_gauge!(
        QUEUE_DEPTH,
        "Requests held in the pool's flow-control queue, by pool and priority class."
    );
    describe_histogram!(
        QUEUE_WAIT_SECONDS,
        "Time a dispatched request waited in the pool's queue, by pool and priority class."
    );
    describe_counter!(
        FLOW_REQUESTS_TOTAL,
        "Flow-control events by pool, priority class and event (queued, dispatched, preempted)."
    );
    describe_counter!(
        FLOW_SHED_TOTAL,
        "Requests the queue refused or dropped, by pool, class and reason (full, ttl, evicted, slo)."
    );
    describe_counter!(
        FLOW_MAP_FULL_TOTAL,
        "Queued requests whose fairness flow could not be remembered (flow map at max_flows)."
    );
    describe_counter!(
        FLOW_DISPATCHED_TOKENS_TOTAL,
        "Token cost (prompt + expected output) dispatched after queueing, by pool and tenant: each tenant's share."
    );
}
