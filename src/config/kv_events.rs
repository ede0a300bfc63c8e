//! `tokenizer` and `[pools.kv_events]`: how a pool learns what its engines hold
//! from their KV-cache events, and how the gateway tokenizes prompts to look them
//! up. Per worker, `kv_events` / `kv_replay` name the engine's ZeroMQ endpoints.

use super::key::Key;
use super::problems::Problems;
use serde::Deserialize;
use std::time::Duration;

/// Default tokens per engine KV block (vLLM's default).
pub const DEFAULT_KV_BLOCK_SIZE: usize = 16;
/// Default bound on blocks indexed per worker.
pub const DEFAULT_KV_MAX_BLOCKS: usize = 1 << 20;
/// Default interval between replay probes while the event stream is quiet.
pub const DEFAULT_KV_PROBE_MS: u64 = 1000;
/// Default time a routing decision counts as cached on its worker before the
/// engine's own events confirm it.
pub const DEFAULT_KV_PENDING_MS: u64 = 2000;
/// Default tier weights: a block in host memory costs a copy to the device, one on
/// disk a read and a copy; both beat recomputing the prefill.
pub const DEFAULT_TIER_WEIGHTS: [f64; 3] = [1.0, 0.8, 0.5];

/// A pool's `tokenizer`: `"sim"`, or `{ kind = "hf", path, chat_template }`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum RawTokenizer {
    Name(String),
    Table(RawTokenizerTable),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTokenizerTable {
    pub kind: String,
    pub path: Option<String>,
    pub chat_template: Option<String>,
}

/// How the gateway turns a request into the engine's prompt tokens.
#[derive(Clone, Debug, PartialEq)]
pub enum TokenizerConfig {
    /// The simulated engine's tokenizer and chat template.
    Sim,
    /// A Hugging Face `tokenizer.json` and a Jinja chat template.
    Hf {
        path: String,
        chat_template: Option<String>,
    },
}

/// `[pools.kv_events]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawKvEvents {
    pub block_size: Option<usize>,
    pub topic: Option<String>,
    pub max_blocks_per_worker: Option<usize>,
    pub probe_interval_ms: Option<u64>,
    pub pending_ttl_ms: Option<u64>,
    pub tier_weights: Option<RawTierWeights>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTierWeights {
    pub gpu: Option<f64>,
    pub cpu: Option<f64>,
    pub disk: Option<f64>,
}

/// A pool's KV-event settings, validated.
#[derive(Clone, Debug, PartialEq)]
pub struct KvEventsConfig {
    /// Tokens per engine block; an engine reporting another size is refused.
    pub block_size: usize,
    /// `block_size` was not configured: the first engine's report sets it.
    pub learn_block_size: bool,
    /// ZeroMQ topic subscribed to ("" = every topic).
    pub topic: String,
    pub max_blocks_per_worker: usize,
    /// A quiet stream is probed through the replay endpoint this often (lost
    /// trailing events, a restarted engine).
    pub probe_interval: Duration,
    /// A prompt just sent to a worker counts as held there this long (or until
    /// its events tell), so requests sharing a new prefix that arrive while the
    /// first is in prefill follow it instead of copying it elsewhere. 0: off.
    pub pending_ttl: Duration,
    /// Score of a cached token by tier: GPU, CPU, disk.
    pub tier_weights: [f64; 3],
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        KvEventsConfig {
            block_size: DEFAULT_KV_BLOCK_SIZE,
            learn_block_size: true,
            topic: String::new(),
            max_blocks_per_worker: DEFAULT_KV_MAX_BLOCKS,
            probe_interval: Duration::from_millis(DEFAULT_KV_PROBE_MS),
            pending_ttl: Duration::from_millis(DEFAULT_KV_PENDING_MS),
            tier_weights: DEFAULT_TIER_WEIGHTS,
        }
    }
}

/// A worker's engine event endpoints (`kv_events`, `kv_replay`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvEndpoints {
    pub events: String,
    pub replay: Option<String>,
}

pub(super) fn validate_tokenizer(
    key: &Key,
    raw: RawTokenizer,
    p: &mut Problems,
) -> Option<TokenizerConfig> {
    let (kind, table) = match raw {
        RawTokenizer::Name(n) => (n, None),
        RawTokenizer::Table(t) => (t.kind.clone(), Some(t)),
    };
    match (kind.as_str(), table) {
        ("sim", _) => Some(TokenizerConfig::Sim),
        ("hf", Some(t)) => match t.path {
            Some(path) if !path.is_empty() => Some(TokenizerConfig::Hf {
                path,
                chat_template: t.chat_template,
            }),
            _ => {
                p.push(format!(
                    "{}: required for kind = \"hf\" (the model directory holding tokenizer.json and tokenizer_config.json)",
                    key.field("path")
                ));
                None
            }
        },
        (other, _) => {
            p.push(format!(
                "{key}: unknown tokenizer {other:?}: expected \"sim\" or {{ kind = \"hf\", path = \"…/tokenizer.json\", chat_template = \"…\" }}"
            ));
            None
        }
    }
}

pub(super) fn validate_kv_events(key: &Key, raw: RawKvEvents, p: &mut Problems) -> KvEventsConfig {
    let d = KvEventsConfig::default();
    let block_size = raw.block_size.unwrap_or(d.block_size);
    if block_size == 0 {
        p.push(format!(
            "{}: must be greater than 0",
            key.field("block_size")
        ));
    }
    let max_blocks = raw.max_blocks_per_worker.unwrap_or(d.max_blocks_per_worker);
    if max_blocks == 0 {
        p.push(format!(
            "{}: must be greater than 0",
            key.field("max_blocks_per_worker")
        ));
    }
    let probe = raw.probe_interval_ms.unwrap_or(DEFAULT_KV_PROBE_MS);
    if probe == 0 {
        p.push(format!(
            "{}: must be greater than 0",
            key.field("probe_interval_ms")
        ));
    }
    let w = raw.tier_weights.unwrap_or_default();
    let tier_weights = [
        w.gpu.unwrap_or(DEFAULT_TIER_WEIGHTS[0]),
        w.cpu.unwrap_or(DEFAULT_TIER_WEIGHTS[1]),
        w.disk.unwrap_or(DEFAULT_TIER_WEIGHTS[2]),
    ];
    for (name, v) in ["gpu", "cpu", "disk"].iter().zip(tier_weights) {
        if !(0.0..=1.0).contains(&v) {
            p.push(format!(
                "{}: must be between 0.0 and 1.0, got {v}",
                key.field("tier_weights").field(name)
            ));
        }
    }
    KvEventsConfig {
        block_size: block_size.max(1),
        learn_block_size: raw.block_size.is_none(),
        topic: raw.topic.unwrap_or_default(),
        max_blocks_per_worker: max_blocks.max(1),
        probe_interval: Duration::from_millis(probe.max(1)),
        pending_ttl: Duration::from_millis(raw.pending_ttl_ms.unwrap_or(DEFAULT_KV_PENDING_MS)),
        tier_weights,
    }
}

/// A worker's `kv_events` / `kv_replay` (`key` is the worker's).
pub(super) fn validate_endpoints(
    key: &Key,
    events: Option<String>,
    replay: Option<String>,
    p: &mut Problems,
) -> Option<KvEndpoints> {
    let check = |field: &str, v: &str, p: &mut Problems| {
        if !v.starts_with("tcp://") || !v[6..].contains(':') {
            p.push(format!(
                "{}: expected a ZeroMQ TCP endpoint like tcp://HOST:PORT, got {v:?}",
                key.field(field)
            ));
        }
    };
    if let Some(r) = &replay {
        check("kv_replay", r, p);
        if events.is_none() {
            p.push(format!("{}: needs kv_events too", key.field("kv_replay")));
        }
    }
    let events = events?;
    check("kv_events", &events, p);
    Some(KvEndpoints { events, replay })
}

/// `[pools.routing].index`: `precise` needs what the precise index is built
/// from (a tokenizer, every worker's `kv_events`; discovered workers publish
/// none), and a setting other than `auto` must reach the `prefix` policy.
pub(super) fn check_prefix_source(
    key: &Key,
    pool: &super::PoolConfig,
    file_index: &[usize],
    p: &mut Problems,
) {
    use super::{PolicyKind, PrefixSource};
    let source = pool.routing.index;
    let at = key.field("routing").field("index");
    if source != PrefixSource::Auto
        && pool.policy != PolicyKind::Prefix
        && !pool.routing.allow_policy_override
    {
        p.push(format!(
            "{at}: applies to the `prefix` policy only (in `weighted` mixes name the `precise_prefix` or `prefix` scorer)"
        ));
    }
    if source != PrefixSource::Precise {
        return;
    }
    if pool.tokenizer.is_none() {
        p.push(format!(
            "{at}: `precise` needs the pool's {} (to compute the engine's prompt tokens)",
            key.field("tokenizer")
        ));
    }
    if pool.dns.is_some() || pool.kubernetes.is_some() {
        p.push(format!(
            "{at}: `precise` needs every worker's kv_events, and discovered workers have none"
        ));
    }
    for (w, &i) in pool.workers.iter().zip(file_index) {
        if w.kv_events.is_none() {
            p.push(format!(
                "{at}: `precise` needs kv_events on every worker; {} has none",
                key.field("workers").index(i)
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    fn problems(pool_lines: &str, worker: &str) -> Vec<String> {
        let text = format!(
            "[[pools]]\nname = \"p\"\nmodels = [\"m\"]\nworkers = [{{ url = \"http://h:1\"{worker} }}]\n{pool_lines}\n"
        );
        match crate::config::parse(&text).and_then(|r| r.validate()) {
            Ok(_) => Vec::new(),
            Err(e) => e.problems,
        }
    }

    #[test]
    fn accepts_the_sim_tokenizer_and_worker_endpoints() {
        let text = "[[pools]]\nname = \"p\"\nmodels = [\"m\"]\ntokenizer = \"sim\"\nworkers = [{ url = \"http://h:1\", kv_events = \"tcp://h:5557\", kv_replay = \"tcp://h:5558\" }]\n[pools.kv_events]\nblock_size = 32\ntier_weights = { cpu = 0.5 }\n";
        let c = crate::config::parse(text).unwrap().validate().unwrap();
        let p = &c.pools[0];
        assert_eq!(p.tokenizer, Some(super::TokenizerConfig::Sim));
        assert_eq!(p.kv_events.block_size, 32);
        assert_eq!(p.kv_events.tier_weights, [1.0, 0.5, 0.5]);
        let ep = p.workers[0].kv_events.as_ref().unwrap();
        assert_eq!(
            (ep.events.as_str(), ep.replay.as_deref()),
            ("tcp://h:5557", Some("tcp://h:5558"))
        );
    }

    #[test]
    fn rejections_name_their_keys() {
        assert!(problems("tokenizer = { kind = \"hf\", path = \"m/\" }", "").is_empty());
        assert!(problems("tokenizer = { kind = \"hf\" }", "")[0]
            .starts_with("pools[0].tokenizer.path: required for kind = \"hf\""));
        assert!(problems("tokenizer = \"gpt\"", "")[0]
            .starts_with("pools[0].tokenizer: unknown tokenizer \"gpt\""));
        assert_eq!(
            problems("", ", kv_events = \"http://h:5557\""),
            ["pools[0].workers[0].kv_events: expected a ZeroMQ TCP endpoint like tcp://HOST:PORT, got \"http://h:5557\""]
        );
        assert_eq!(
            problems("", ", kv_replay = \"tcp://h:5558\""),
            ["pools[0].workers[0].kv_replay: needs kv_events too"]
        );
        assert_eq!(
            problems(
                "[pools.kv_events]\nblock_size = 0\ntier_weights = { disk = 2.0 }",
                ""
            ),
            [
                "pools[0].kv_events.block_size: must be greater than 0",
                "pools[0].kv_events.tier_weights.disk: must be between 0.0 and 1.0, got 2",
            ]
        );
    }
}
