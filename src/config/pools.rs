//! `[[pools]]`: each pool's models, workers, retries, queue, disaggregation and
//! engine, with their defaults; then what spans pools (names, fallbacks, the
//! region labels of workers).

use super::discovery::{validate_dns, validate_kubernetes};
use super::key::Key;
use super::problems::Problems;
use super::{engine_routes, flow, global, kv_events, ms, no_pool, worker_url};
use super::{
    DnsConfig, FlowConfig, GlobalConfig, KubernetesConfig, KvEndpoints, KvEventsConfig, PolicyKind,
    RawDisagg, RawPool, RawWorker, RoutingConfig, Secret, TokenizerConfig,
};
use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

/// Default number of attempts (first try included) before the gateway gives up.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 3;
/// Retry-budget defaults: retries ≤ 20 % of recent requests + a reserve of 10.
pub const DEFAULT_RETRY_BUDGET_RATIO: f64 = 0.2;
pub const DEFAULT_RETRY_BUDGET_MIN: u32 = 10;
pub const DEFAULT_RETRY_BACKOFF_MS: u64 = 2;
/// Queue defaults (used when `max_concurrency_per_worker` is set).
pub const DEFAULT_QUEUE_SIZE: usize = 1_024;
pub const DEFAULT_QUEUE_TIMEOUT_MS: u64 = 10_000;
/// Disaggregation defaults.
pub const DEFAULT_MIN_UNCACHED_TOKENS: u64 = 512;
pub const DEFAULT_BOOTSTRAP_PORT: u16 = 8998;
pub const DEFAULT_MAX_PREFILL_RESPONSE_BYTES: usize = 1024 * 1024;

/// The engine a pool's workers run, for what differs between them: how a
/// request is cancelled.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum EngineKind {
    /// vLLM stops a request when its connection closes.
    #[default]
    Vllm,
    /// SGLang is told with `POST /abort_request {"rid": ...}`; the gateway sets
    /// `rid` in each request body it forwards.
    Sglang,
}

/// How a disaggregated pool hands a request from prefill to decode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DisaggMode {
    /// vLLM NIXL connector: prefill first (`max_tokens: 1`), then decode with the
    /// returned `kv_transfer_params`.
    Vllm,
    /// SGLang: both at once with `bootstrap_host/port/room`.
    Sglang,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DisaggConfig {
    pub mode: DisaggMode,
    pub min_uncached_tokens: u64,
    pub bootstrap_port: u16,
    pub max_prefill_response_bytes: usize,
}

#[derive(Clone, Debug)]
pub struct PoolConfig {
    pub name: String,
    /// Model names served. Empty: discovered from the workers' `/v1/models`.
    pub models: Vec<String>,
    /// Extra names clients may use for this pool's first model.
    pub aliases: Vec<String>,
    pub policy: PolicyKind,
    pub max_attempts: u32,
    /// Forward the client's credential headers (`Authorization`, `x-api-key`,
    /// `api-key`, `x-goog-api-key`) upstream.
    pub pass_client_auth: bool,
    /// Headers kept at the gateway by default to forward anyway (lower case).
    pub forward_headers: Vec<String>,
    /// Bearer token injected upstream (value resolved from the named env var).
    pub upstream_api_key: Option<Secret>,
    pub workers: Vec<WorkerConfig>,
    /// Policy and stats settings (`[pools.routing]`).
    pub routing: RoutingConfig,
    pub retry_budget_ratio: f64,
    pub retry_budget_min: u32,
    pub retry_backoff: Duration,
    /// 0 = unlimited.
    pub max_concurrency_per_worker: u64,
    pub queue_size: usize,
    pub queue_timeout: Duration,
    /// `[pools.flow_control]`; `None`: the plain concurrency-limit queue.
    pub flow: Option<FlowConfig>,
    pub dns: Option<DnsConfig>,
    pub disaggregation: Option<DisaggConfig>,
    pub upstream_model: Option<String>,
    /// How `/v1/messages` reaches this pool's workers.
    pub anthropic: AnthropicMode,
    pub upstream_ca_file: Option<String>,
    /// Pool names, in order.
    pub fallback: Vec<String>,
    pub lora_adapters: Vec<String>,
    /// Extra inference paths forwarded to this pool for any caller.
    pub forward_routes: Vec<String>,
    /// Engine control paths forwarded to this pool for admin tenants only.
    pub allow_control_routes: Vec<String>,
    pub kubernetes: Option<KubernetesConfig>,
    /// How prompts are tokenized for the precise index; `None`: approximate only.
    pub tokenizer: Option<TokenizerConfig>,
    /// `[pools.kv_events]` (defaults when absent).
    pub kv_events: KvEventsConfig,
    /// `sglang` when set so, or when the pool disaggregates SGLang-style.
    pub engine: EngineKind,
    /// Streamed chat/completions requests ask the engine for usage (billing is
    /// exact); the usage chunk is stripped for clients that did not ask.
    pub request_usage: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub struct WorkerConfig {
    /// Normalised base URL, no trailing slash: `http://host:port[/prefix]`.
    pub url: String,
    pub labels: BTreeMap<String, String>,
    /// USD per 1M tokens (prompt + output); 0 when not configured.
    pub price_per_mtok: f64,
    /// The engine's KV-event endpoints, when it publishes them.
    pub kv_events: Option<KvEndpoints>,
}

/// The validated pools, with what later checks need from the file.
pub(super) struct ValidPools {
    pub(super) pools: Vec<PoolConfig>,
    /// Model names, aliases and LoRA adapters served by some pool.
    pub(super) models: HashSet<String>,
    /// Per pool, the index in the file of each accepted worker.
    pub(super) worker_indices: Vec<Vec<usize>>,
    /// Per pool, the variable holding its upstream API key (read in `resolve`).
    pub(super) upstream_api_key_envs: Vec<Option<String>>,
}

/// `[[pools]]`: each pool, then what depends on all of them (names, fallbacks).
pub(super) fn validate_pools(
    raw: Vec<RawPool>,
    rules: &worker_url::AddressRules<'_>,
    p: &mut Problems,
) -> ValidPools {
    let mut valid = ValidPools {
        pools: Vec::new(),
        models: HashSet::new(),
        worker_indices: Vec::new(),
        upstream_api_key_envs: Vec::new(),
    };
    let mut names = HashSet::new();
    for (i, mut rp) in raw.into_iter().enumerate() {
        let key = Key::new("pools").index(i);
        valid
            .upstream_api_key_envs
            .push(rp.upstream_api_key_env.take());
        let name = rp.name.clone().unwrap_or_else(|| format!("pool-{i}"));
        if name.is_empty() {
            p.push(format!("{}: must not be empty", key.field("name")));
        }
        if !names.insert(name.clone()) {
            p.push(format!(
                "{}: duplicate pool name `{name}`",
                key.field("name")
            ));
        }
        let (pool, indices) = validate_pool(&key, name, rp, rules, &mut valid.models, p);
        valid.pools.push(pool);
        valid.worker_indices.push(indices);
    }
    if valid.pools.is_empty() {
        p.push("pools: at least one pool (or a --worker flag) is required".into());
    }
    check_pool_references(&valid.pools, p);
    valid
}

/// A pool's policy; `None` when rejected (checks that depend on it are skipped).
fn pool_policy(key: &Key, policy: Option<&str>, p: &mut Problems) -> Option<PolicyKind> {
    let key = key.field("policy");
    match policy {
        None if p.reported(&key) => None,
        None => Some(PolicyKind::RoundRobin),
        Some(s) => PolicyKind::parse(s).or_else(|| {
            p.push(format!(
                "{key}: unknown policy `{s}` (expected one of: {})",
                PolicyKind::names()
            ));
            None
        }),
    }
}

/// Models, aliases and LoRA adapters: not empty, and each served by one pool
/// only (`models` holds the names of the pools before).
fn check_model_names(key: &Key, rp: &RawPool, models: &mut HashSet<String>, p: &mut Problems) {
    for (list, names) in [
        ("models", &rp.models),
        ("aliases", &rp.aliases),
        ("lora_adapters", &rp.lora_adapters),
    ] {
        for (j, m) in names.iter().enumerate() {
            let at = key.field(list).index(j);
            if m.is_empty() {
                p.push(format!("{at}: empty model name"));
            } else if !models.insert(m.clone()) {
                p.push(format!(
                    "{at}: model name `{m}` is served by more than one pool"
                ));
            }
        }
    }
    let models_key = key.field("models");
    if !rp.aliases.is_empty() && rp.models.is_empty() && !p.reported(&models_key) {
        p.push(format!(
            "{}: aliases need at least one entry in {models_key}",
            key.field("aliases")
        ));
    }
}

/// One pool (its name checked already); also the file index of each accepted worker.
fn validate_pool(
    key: &Key,
    name: String,
    rp: RawPool,
    rules: &worker_url::AddressRules<'_>,
    models: &mut HashSet<String>,
    p: &mut Problems,
) -> (PoolConfig, Vec<usize>) {
    let policy = pool_policy(key, rp.policy.as_deref(), p);
    check_model_names(key, &rp, models, p);
    let max_attempts = rp.max_attempts.unwrap_or(DEFAULT_MAX_ATTEMPTS);
    if max_attempts == 0 {
        p.push(format!("{}: must be at least 1", key.field("max_attempts")));
    }
    let routing = rp.routing.validate(&key.field("routing"), policy, p);
    let disaggregated = rp.disaggregation.is_some();
    let (workers, indices) =
        validate_workers(&key.field("workers"), rp.workers, disaggregated, rules, p);
    let dns = rp
        .dns
        .map(|d| validate_dns(d, &key.field("dns"), disaggregated, p));
    let kubernetes = rp
        .kubernetes
        .map(|k| validate_kubernetes(k, &key.field("kubernetes"), p));
    // Not when a worker was rejected: that problem is reported already.
    let workers_key = key.field("workers");
    if workers.is_empty() && dns.is_none() && kubernetes.is_none() && !p.reported(&workers_key) {
        p.push(format!(
            "{workers_key}: a pool needs at least one worker (or a dns or kubernetes section)"
        ));
    }
    let disaggregation = rp
        .disaggregation
        .map(|d| validate_disagg(d, &key.field("disaggregation"), p));
    let retry_budget_ratio = rp.retry_budget_ratio.unwrap_or(DEFAULT_RETRY_BUDGET_RATIO);
    if !(0.0..=1.0).contains(&retry_budget_ratio) {
        p.push(format!(
            "{}: must be between 0.0 and 1.0, got {retry_budget_ratio}",
            key.field("retry_budget_ratio")
        ));
    }
    let queue_timeout_key = key.field("queue_timeout_ms");
    let queue_timeout = ms(
        p,
        &queue_timeout_key,
        rp.queue_timeout_ms,
        DEFAULT_QUEUE_TIMEOUT_MS,
    );
    let forward_headers = forward_headers(key, &rp.forward_headers, p);
    let engine = match rp.engine.as_deref() {
        None if disaggregation
            .as_ref()
            .is_some_and(|d| d.mode == DisaggMode::Sglang) =>
        {
            EngineKind::Sglang
        }
        None | Some("vllm") => EngineKind::Vllm,
        Some("sglang") => EngineKind::Sglang,
        Some(other) => {
            p.push(format!(
                "{}: unknown engine `{other}` (expected one of: vllm, sglang)",
                key.field("engine")
            ));
            EngineKind::Vllm
        }
    };
    let (forward_routes, allow_control_routes) =
        engine_routes::validate(key, rp.forward_routes, rp.allow_control_routes, p);
    let pool = PoolConfig {
        name,
        models: rp.models,
        aliases: rp.aliases,
        policy: policy.unwrap_or(PolicyKind::RoundRobin),
        max_attempts: max_attempts.max(1),
        pass_client_auth: rp.pass_client_auth.unwrap_or(false),
        forward_headers,
        // Read in `resolve`, after every pure check.
        upstream_api_key: None,
        workers,
        routing,
        retry_budget_ratio,
        retry_budget_min: rp.retry_budget_min.unwrap_or(DEFAULT_RETRY_BUDGET_MIN),
        retry_backoff: Duration::from_millis(
            rp.retry_backoff_ms.unwrap_or(DEFAULT_RETRY_BACKOFF_MS),
        ),
        max_concurrency_per_worker: rp.max_concurrency_per_worker.unwrap_or(0),
        queue_size: rp.queue_size.unwrap_or(DEFAULT_QUEUE_SIZE),
        queue_timeout,
        flow: rp
            .flow_control
            .map(|f| flow::validate_flow(&key.field("flow_control"), f, queue_timeout, p)),
        dns,
        disaggregation,
        upstream_model: rp.upstream_model,
        anthropic: anthropic_mode(key, rp.anthropic.as_deref(), p),
        upstream_ca_file: rp.upstream_ca_file,
        fallback: rp.fallback,
        lora_adapters: rp.lora_adapters,
        forward_routes,
        allow_control_routes,
        kubernetes,
        tokenizer: rp
            .tokenizer
            .and_then(|t| kv_events::validate_tokenizer(&key.field("tokenizer"), t, p)),
        kv_events: kv_events::validate_kv_events(
            &key.field("kv_events"),
            rp.kv_events.unwrap_or_default(),
            p,
        ),
        engine,
        request_usage: rp.request_usage.unwrap_or(true),
    };
    kv_events::check_prefix_source(key, &pool, &indices, p);
    (pool, indices)
}

/// A pool's static workers (`key` is `pools[N].workers`), and the index in the
/// file of each one accepted.
fn validate_workers(
    key: &Key,
    raw: Vec<RawWorker>,
    disaggregated: bool,
    rules: &worker_url::AddressRules<'_>,
    p: &mut Problems,
) -> (Vec<WorkerConfig>, Vec<usize>) {
    let mut workers = Vec::new();
    let mut seen = HashSet::new();
    let mut indices = Vec::new();
    for (j, w) in raw.into_iter().enumerate() {
        let key = key.index(j);
        if disaggregated {
            check_role(&key.field("labels"), &w.labels, p);
        }
        let checked = worker_url::WorkerUrl::parse(&w.url)
            .and_then(|u| u.check(worker_url::Origin::Config, rules).map(|()| u.url));
        let url = match checked {
            Ok(url) => url,
            Err(e) => {
                p.push(format!("{}: {e}", key.field("url")));
                continue;
            }
        };
        if !seen.insert(url.clone()) {
            p.push(format!("{}: duplicate worker `{url}`", key.field("url")));
        }
        let price = w.price_per_mtok.unwrap_or(0.0);
        if !(price.is_finite() && price >= 0.0) {
            p.push(format!(
                "{}: must be a finite number >= 0 (got {price})",
                key.field("price_per_mtok")
            ));
        }
        let kv_events = kv_events::validate_endpoints(&key, w.kv_events, w.kv_replay, p);
        workers.push(WorkerConfig {
            url,
            labels: w.labels,
            price_per_mtok: price,
            kv_events,
        });
        indices.push(j);
    }
    (workers, indices)
}

/// How a pool serves Anthropic Messages (`/v1/messages`) requests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AnthropicMode {
    /// Forward unchanged to the engine's own `/v1/messages` (vLLM serves it).
    #[default]
    Passthrough,
    /// Convert to `/v1/chat/completions` and the answer back, for engines
    /// without the Messages API.
    Translate,
}

/// `pools[i].anthropic`.
fn anthropic_mode(key: &Key, mode: Option<&str>, p: &mut Problems) -> AnthropicMode {
    match mode {
        None | Some("passthrough") => AnthropicMode::Passthrough,
        Some("translate") => AnthropicMode::Translate,
        Some(other) => {
            p.push(format!(
                "{}: unknown mode `{other}` (expected one of: passthrough, translate)",
                key.field("anthropic")
            ));
            AnthropicMode::Passthrough
        }
    }
}

/// `[pools.disaggregation]`.
fn validate_disagg(d: RawDisagg, key: &Key, p: &mut Problems) -> DisaggConfig {
    let mode = match d.mode.as_str() {
        "vllm" => DisaggMode::Vllm,
        "sglang" => DisaggMode::Sglang,
        other => {
            p.push(format!(
                "{}: unknown mode `{other}` (expected one of: vllm, sglang)",
                key.field("mode")
            ));
            DisaggMode::Vllm
        }
    };
    DisaggConfig {
        mode,
        min_uncached_tokens: d.min_uncached_tokens.unwrap_or(DEFAULT_MIN_UNCACHED_TOKENS),
        bootstrap_port: d.bootstrap_port.unwrap_or(DEFAULT_BOOTSTRAP_PORT),
        max_prefill_response_bytes: d
            .max_prefill_response_bytes
            .unwrap_or(DEFAULT_MAX_PREFILL_RESPONSE_BYTES),
    }
}

/// Pool names (`:` is reserved) and fallbacks, which name other pools.
fn check_pool_references(pools: &[PoolConfig], p: &mut Problems) {
    for (i, pool) in pools.iter().enumerate() {
        let key = Key::new("pools").index(i);
        if pool.name.contains(':') {
            let name = key.field("name");
            p.push(format!("{name}: `:` is reserved, got `{}`", pool.name));
        }
        let fallback = key.field("fallback");
        for f in &pool.fallback {
            if f == &pool.name {
                p.push(format!("{fallback}: a pool cannot fall back to itself"));
            } else if !pools.iter().any(|q| &q.name == f) {
                let names: Vec<&str> = pools.iter().map(|q| q.name.as_str()).collect();
                p.push(format!("{fallback}: {}", no_pool(f, &names)));
            }
        }
    }
}

/// Static region labels must name a declared region (a typo would otherwise put
/// a worker outside every residency zone). Nothing to check without regions.
pub(super) fn check_region_labels(pools: &ValidPools, global: &GlobalConfig, p: &mut Problems) {
    if global.regions.is_empty() {
        return;
    }
    let mut check = |key: Key, labels: &BTreeMap<String, String>| {
        if let Some(r) = labels.get(global::REGION_LABEL) {
            if global.region_id(r).is_none() {
                p.push(format!(
                    "{}: unknown region `{r}` (declared: {})",
                    key.field("labels").field(global::REGION_LABEL),
                    global.names(global.all_regions())
                ));
            }
        }
    };
    for (i, pool) in pools.pools.iter().enumerate() {
        let key = Key::new("pools").index(i);
        for (w, j) in pool.workers.iter().zip(&pools.worker_indices[i]) {
            check(key.field("workers").index(*j), &w.labels);
        }
        if let Some(d) = &pool.dns {
            check(key.field("dns"), &d.labels);
        }
    }
}

/// Values of the worker label `role` in a disaggregated pool.
const ROLES: [&str; 3] = ["prefill", "decode", "both"];

pub(super) fn check_role(key: &Key, labels: &BTreeMap<String, String>, p: &mut Problems) {
    if let Some(r) = labels.get("role").filter(|r| !ROLES.contains(&r.as_str())) {
        p.push(format!(
            "{}: unknown role `{r}` (expected one of: {})",
            key.field("role"),
            ROLES.join(", ")
        ));
    }
}

/// A pool's `forward_headers`: valid header names, lower-cased.
fn forward_headers(key: &Key, names: &[String], p: &mut Problems) -> Vec<String> {
    names
        .iter()
        .enumerate()
        .filter_map(|(i, n)| match http::HeaderName::try_from(n.as_str()) {
            Ok(h) => Some(h.as_str().to_string()),
            Err(_) => {
                p.push(format!(
                    "{}: `{n}` is not a valid header name",
                    key.field("forward_headers").index(i)
                ));
                None
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tests::{check, POOL};
    use crate::config::{normalize_worker_url, DEFAULT_LISTEN, DEFAULT_MAX_BODY_BYTES};

    #[test]
    fn minimal_pool_gets_defaults() {
        let c = check(
            r#"
            [[pools]]
            name = "p"
            models = ["m"]
            workers = [{ url = "http://127.0.0.1:9000/" }]
            "#,
        )
        .unwrap();
        assert_eq!(c.server.listen, DEFAULT_LISTEN.parse().unwrap());
        assert_eq!(c.pools[0].workers[0].url, "http://127.0.0.1:9000");
        assert_eq!(c.pools[0].policy, PolicyKind::RoundRobin);
        assert_eq!(c.server.max_body_bytes, DEFAULT_MAX_BODY_BYTES);
    }

    #[test]
    fn worker_urls_with_credentials_are_rejected_without_the_password() {
        for (url, shown) in [
            (
                "http://alice:s3cret-pw@10.0.0.5:8000/v1",
                "http://alice:***@10.0.0.5:8000/v1",
            ),
            ("https://tok3n-s3cret@h:1", "https://***@h:1"),
            ("alice:s3cret-pw@h:1", "alice:***@h:1"),
        ] {
            let e = normalize_worker_url(url).unwrap_err();
            assert!(!e.contains("s3cret"), "{e}");
            assert!(e.contains(shown) && e.contains("not allowed"), "{e}");
        }
        // A path may contain `@`.
        assert!(normalize_worker_url("http://h:1/@x").is_ok());
        let e = check(&format!(
            "{POOL}[[pools]]\nmodels = [\"n\"]\nworkers = [{{ url = \"http://bob:hunter2@h:2\" }}]\n"
        ))
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("pools[1].workers[0].url: `http://bob:***@h:2`"),
            "{e}"
        );
        assert!(
            !e.contains("hunter2") && !e.contains("at least one worker"),
            "{e}"
        );
    }

    #[test]
    fn enum_like_values_list_the_valid_ones() {
        let e = check(
            r#"
            [[pools]]
            models = ["m"]
            aliases = ["m"]
            workers = [{ url = "http://h:1", labels = { role = "prefil" } }]
            [pools.disaggregation]
            mode = "nixl"
            [[pools]]
            models = ["n"]
            fallback = ["nope"]
            anthropic = "convert"
            workers = [{ url = "http://h:2", labels = { role = "anything" } }]
            "#,
        )
        .unwrap_err()
        .to_string();
        for needle in [
            "pools[0].workers[0].labels.role: unknown role `prefil` (expected one of: prefill, decode, both)",
            "pools[0].disaggregation.mode: unknown mode `nixl` (expected one of: vllm, sglang)",
            "pools[0].aliases[0]: model name `m` is served by more than one pool",
            "pools[1].fallback: no pool named `nope` (pools: pool-0, pool-1)",
            "pools[1].anthropic: unknown mode `convert` (expected one of: passthrough, translate)",
        ] {
            assert!(e.contains(needle), "missing `{needle}` in:\n{e}");
        }
        // Without disaggregation the role label is free-form.
        assert!(!e.contains("anything"), "{e}");
    }

    #[test]
    fn aliases_and_adapters_are_named_by_their_own_index() {
        let e = check(
            r#"
            [[pools]]
            models = ["m", "n"]
            aliases = ["a", ""]
            lora_adapters = ["l", "m"]
            workers = [{ url = "http://h:1" }]
            [[pools]]
            models = ["o"]
            lora_adapters = ["", "a"]
            workers = [{ url = "http://h:2" }]
            "#,
        )
        .unwrap_err();
        assert_eq!(
            e.problems,
            [
                "pools[0].aliases[1]: empty model name",
                "pools[0].lora_adapters[1]: model name `m` is served by more than one pool",
                "pools[1].lora_adapters[0]: empty model name",
                "pools[1].lora_adapters[1]: model name `a` is served by more than one pool",
            ]
        );
    }
}
