//! `[pools.routing]`: the routing policies a pool can name, its scorers and the
//! settings of the prefix index and the stats poller, with their defaults.

use super::key::Key;
use super::problems::Problems;
use super::{RawRouting, RawScorer};
use std::collections::BTreeMap;
use std::fmt;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

/// Default size of a prefix-index block, in approximate tokens.
pub const DEFAULT_BLOCK_TOKENS: u32 = 64;
/// Default bytes of routing text counted as one token.
pub const DEFAULT_BYTES_PER_TOKEN: u32 = 4;
/// Default bounded-load factor ε: spill when load > (1 + ε) × mean + slack.
pub const DEFAULT_LOAD_EPSILON: f64 = 0.25;
/// Default absolute slack of the load bound, in requests.
pub const DEFAULT_LOAD_SLACK: f64 = 2.0;
/// Default interval between two scrapes of a worker's `/metrics` (ms).
pub const DEFAULT_STATS_INTERVAL_MS: u64 = 100;
/// Smallest accepted `stats_interval_ms`.
pub const MIN_STATS_INTERVAL_MS: u64 = 25;
/// Default age after which a worker's stats count as stale (ms).
pub const DEFAULT_STALE_AFTER_MS: u64 = 1_000;
/// Default estimated queue (requests) under which a worker has headroom (`cost`).
pub const DEFAULT_TARGET_QUEUE: f64 = 8.0;
/// Default hard cap on (block, worker) pairs in one pool's prefix index.
pub const DEFAULT_INDEX_MAX_BLOCKS: u64 = 1 << 20;
/// Default per-worker index capacity (blocks) while `vllm:cache_config_info` is unknown.
pub const DEFAULT_WORKER_BLOCKS: u64 = 16_384;

/// Routing policies a pool can name. Their behaviour lives in `routing/`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PolicyKind {
    RoundRobin,
    Random,
    LeastQueue,
    Prefix,
    Cost,
    Session,
    /// An explicit list of scorers with weights (`[pools.routing].scorers`).
    Weighted,
    /// The most headroom against the request's latency objectives (`slo` scorer).
    Slo,
}

impl PolicyKind {
    pub const ALL: &'static [PolicyKind] = &[
        PolicyKind::RoundRobin,
        PolicyKind::Random,
        PolicyKind::LeastQueue,
        PolicyKind::Prefix,
        PolicyKind::Cost,
        PolicyKind::Session,
        PolicyKind::Weighted,
        PolicyKind::Slo,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            PolicyKind::RoundRobin => "round_robin",
            PolicyKind::Random => "random",
            PolicyKind::LeastQueue => "least_queue",
            PolicyKind::Prefix => "prefix",
            PolicyKind::Cost => "cost",
            PolicyKind::Session => "session",
            PolicyKind::Weighted => "weighted",
            PolicyKind::Slo => "slo",
        }
    }

    pub fn parse(s: &str) -> Option<PolicyKind> {
        Self::ALL.iter().copied().find(|p| p.as_str() == s)
    }

    /// The policy names, comma-separated (for messages).
    pub fn names() -> String {
        Self::ALL
            .iter()
            .map(|p| p.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// A scorer's name in `[pools.routing].scorers`. Routing owns the list of names
/// (`routing::scorers`), and `routing::scorers::unknown_names` reports the rest.
pub type ScorerName = Arc<str>;

/// Per-pool routing settings (`[pools.routing]`), validated.
#[derive(Clone, Debug, PartialEq)]
pub struct RoutingConfig {
    /// Prefix block size in approximate tokens.
    pub block_tokens: NonZeroU32,
    /// Bytes of routing text per approximate token.
    pub bytes_per_token: NonZeroU32,
    /// Bounded-load factor ε (≥ 0).
    pub load_epsilon: f64,
    /// Absolute slack of the load bound, in requests (≥ 0).
    pub load_slack: f64,
    /// Interval between scrapes of each worker's `/metrics`.
    pub stats_interval: Duration,
    /// Stats older than this are stale: the worker is scored as fully loaded.
    pub stale_after: Duration,
    /// Honour the `x-switchyard-policy` request header.
    pub allow_policy_override: bool,
    /// `least_queue`: compare two random candidates instead of all.
    pub power_of_two: bool,
    /// `cost`: a worker whose estimated queue reaches this has no headroom.
    pub target_queue: f64,
    /// Hard cap on (block, worker) pairs in the pool's prefix index.
    pub index_max_blocks: u64,
    /// Per-worker index capacity while the worker's KV capacity is unknown.
    pub default_worker_blocks: u64,
    /// Only workers whose labels include all of these are eligible.
    pub require_labels: BTreeMap<String, String>,
    /// Scorers and weights of a `weighted` pool (empty for the presets).
    pub scorers: Vec<(ScorerName, f64)>,
    /// Regions within this round trip (ms) of the gateway's region count as local
    /// for this pool (0: only the gateway's own region).
    pub max_added_latency_ms: u32,
    /// A request whose latency objective no worker is predicted to meet.
    pub slo_unattainable: SloUnattainable,
    /// Where the `prefix` policy reads cached depths from.
    pub index: PrefixSource,
}

/// Where the `prefix` policy reads how much of a prompt each worker holds
/// (`[pools.routing].index`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PrefixSource {
    /// The precise index when the pool has one (a tokenizer and workers with
    /// `kv_events`), else the approximate index.
    #[default]
    Auto,
    /// The precise index; the config must give it a tokenizer and every worker
    /// `kv_events`. While it cannot speak for every worker (one still syncing,
    /// refused or without events) the approximate index stands in.
    Precise,
    /// Always the approximate index (what this gateway sent where); events, if
    /// configured, are still followed and counted.
    Approximate,
}

/// What happens to a request whose latency objective no worker is predicted to
/// meet (`[pools.routing].slo_unattainable`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SloUnattainable {
    /// Served anyway on the chosen worker, marked (`x-switchyard-slo: downgraded`).
    #[default]
    Downgrade,
    /// Refused at once with 503 and `Retry-After`.
    Shed,
}

impl Default for RoutingConfig {
    fn default() -> Self {
        RoutingConfig {
            block_tokens: NonZeroU32::new(DEFAULT_BLOCK_TOKENS).expect("non-zero"),
            bytes_per_token: NonZeroU32::new(DEFAULT_BYTES_PER_TOKEN).expect("non-zero"),
            load_epsilon: DEFAULT_LOAD_EPSILON,
            load_slack: DEFAULT_LOAD_SLACK,
            stats_interval: Duration::from_millis(DEFAULT_STATS_INTERVAL_MS),
            stale_after: Duration::from_millis(DEFAULT_STALE_AFTER_MS),
            allow_policy_override: false,
            power_of_two: false,
            target_queue: DEFAULT_TARGET_QUEUE,
            index_max_blocks: DEFAULT_INDEX_MAX_BLOCKS,
            default_worker_blocks: DEFAULT_WORKER_BLOCKS,
            require_labels: BTreeMap::new(),
            scorers: Vec::new(),
            max_added_latency_ms: 0,
            slo_unattainable: SloUnattainable::Downgrade,
            index: PrefixSource::Auto,
        }
    }
}

impl RoutingConfig {
    /// Bytes of routing text per prefix block.
    pub fn block_bytes(&self) -> usize {
        self.block_tokens.get() as usize * self.bytes_per_token.get() as usize
    }
}

impl RawRouting {
    /// Validate, pushing problems under `key` (e.g. `pools[0].routing`);
    /// `policy` is `None` when the pool's policy was rejected.
    pub(super) fn validate(
        self,
        key: &Key,
        policy: Option<PolicyKind>,
        p: &mut Problems,
    ) -> RoutingConfig {
        let d = RoutingConfig::default();
        let nz = |v: Option<u32>, name: &str, def: NonZeroU32, p: &mut Problems| match v {
            None => def,
            Some(v) => NonZeroU32::new(v).unwrap_or_else(|| {
                p.push(format!("{}: must be at least 1", key.field(name)));
                def
            }),
        };
        let block_tokens = nz(self.block_tokens, "block_tokens", d.block_tokens, p);
        let bytes_per_token = nz(
            self.bytes_per_token,
            "bytes_per_token",
            d.bytes_per_token,
            p,
        );
        let non_neg = |v: Option<f64>, name: &str, def: f64, p: &mut Problems| {
            let v = v.unwrap_or(def);
            if !(v.is_finite() && v >= 0.0) {
                let k = key.field(name);
                p.push(format!("{k}: must be a finite number >= 0 (got {v})"));
                return def;
            }
            v
        };
        let load_epsilon = non_neg(self.load_epsilon, "load_epsilon", d.load_epsilon, p);
        let load_slack = non_neg(self.load_slack, "load_slack", d.load_slack, p);
        let target_queue = non_neg(self.target_queue, "target_queue", d.target_queue, p);
        let (interval_ms, stale_ms) =
            stats_timing(key, self.stats_interval_ms, self.stale_after_ms, p);
        let at_least_one = |v: Option<u64>, name: &str, def: u64, p: &mut Problems| {
            let v = v.unwrap_or(def);
            if v == 0 {
                p.push(format!("{}: must be at least 1", key.field(name)));
            }
            v.max(1)
        };
        let index_max_blocks = self.index_max_blocks;
        let index_max_blocks = at_least_one(
            index_max_blocks,
            "index_max_blocks",
            DEFAULT_INDEX_MAX_BLOCKS,
            p,
        );
        let worker_blocks = self.default_worker_blocks;
        let default_worker_blocks = at_least_one(
            worker_blocks,
            "default_worker_blocks",
            DEFAULT_WORKER_BLOCKS,
            p,
        );
        let scorers = validate_scorers(&key.field("scorers"), self.scorers.as_deref(), policy, p);
        RoutingConfig {
            block_tokens,
            bytes_per_token,
            load_epsilon,
            load_slack,
            stats_interval: Duration::from_millis(interval_ms),
            stale_after: Duration::from_millis(stale_ms.max(interval_ms + 1)),
            allow_policy_override: self.allow_policy_override.unwrap_or(false),
            power_of_two: self.power_of_two.unwrap_or(false),
            target_queue,
            index_max_blocks,
            default_worker_blocks,
            require_labels: self.require_labels,
            scorers,
            max_added_latency_ms: self.max_added_latency_ms.unwrap_or(0),
            slo_unattainable: match self.slo_unattainable.as_deref() {
                None | Some("downgrade") => SloUnattainable::Downgrade,
                Some("shed") => SloUnattainable::Shed,
                Some(other) => {
                    p.push(format!(
                        "{}: expected `downgrade` or `shed` (got `{other}`)",
                        key.field("slo_unattainable")
                    ));
                    SloUnattainable::Downgrade
                }
            },
            index: match self.index.as_deref() {
                None | Some("auto") => PrefixSource::Auto,
                Some("precise") => PrefixSource::Precise,
                Some("approximate") => PrefixSource::Approximate,
                Some(other) => {
                    p.push(format!(
                        "{}: expected `auto`, `precise` or `approximate` (got `{other}`)",
                        key.field("index")
                    ));
                    PrefixSource::Auto
                }
            },
        }
    }
}

/// The stats poller's interval and staleness (ms) under `key`: the interval at
/// least [`MIN_STATS_INTERVAL_MS`], staleness longer than the interval.
fn stats_timing(
    key: &Key,
    interval_ms: Option<u64>,
    stale_after_ms: Option<u64>,
    p: &mut Problems,
) -> (u64, u64) {
    let interval_ms = interval_ms.unwrap_or(DEFAULT_STATS_INTERVAL_MS);
    if interval_ms < MIN_STATS_INTERVAL_MS {
        p.push(format!(
            "{}: must be at least {MIN_STATS_INTERVAL_MS} (got {interval_ms})",
            key.field("stats_interval_ms")
        ));
    }
    let interval_ms = interval_ms.max(MIN_STATS_INTERVAL_MS);
    let stale_ms = stale_after_ms.unwrap_or(DEFAULT_STALE_AFTER_MS.max(interval_ms * 3));
    if stale_ms <= interval_ms {
        p.push(format!(
            "{}: must be greater than stats_interval_ms ({interval_ms}), got {stale_ms}",
            key.field("stale_after_ms")
        ));
    }
    (interval_ms, stale_ms)
}

/// `[pools.routing].scorers` (`key`): only with (and required by) policy
/// `weighted`; each name once, with finite weights > 0 (which names exist is
/// routing's to say).
fn validate_scorers(
    key: &Key,
    raw: Option<&[RawScorer]>,
    policy: Option<PolicyKind>,
    p: &mut Problems,
) -> Vec<(ScorerName, f64)> {
    match (raw, policy) {
        (None, Some(PolicyKind::Weighted)) => {
            p.push(format!("{key}: policy `weighted` needs a list of scorers"))
        }
        (Some(_), Some(policy)) if policy != PolicyKind::Weighted => p.push(format!(
            "{key}: only valid with policy = \"weighted\" (this pool's policy is `{policy}`)"
        )),
        _ => {}
    }
    let mut scorers = Vec::new();
    for (i, s) in raw.unwrap_or_default().iter().enumerate() {
        let at = key.index(i);
        if !(s.weight.is_finite() && s.weight > 0.0) {
            p.push(format!(
                "{}: must be a finite number > 0 (got {})",
                at.field("weight"),
                s.weight
            ));
            continue;
        }
        if scorers
            .iter()
            .any(|(k, _): &(ScorerName, f64)| **k == *s.name)
        {
            let name = at.field("name");
            p.push(format!("{name}: scorer `{}` listed twice", s.name));
            continue;
        }
        scorers.push((ScorerName::from(s.name.as_str()), s.weight));
    }
    if raw.is_some_and(|v| v.is_empty()) {
        p.push(format!("{key}: must not be empty"));
    }
    scorers
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tests::{check, check_all};
    use crate::config::Secrets;

    #[test]
    fn latency_objective_settings_are_checked() {
        let text = r#"
            [[tenants]]
            name = "acme"
            api_key_env = "SWITCHYARD_TEST_UNSET_SLO_KEY"
            slo_ttft_ms = 0
            slo_tpot_ms = 4000000
            [[pools]]
            models = ["m"]
            policy = "slo"
            workers = [{ url = "http://h:1" }]
            [pools.routing]
            slo_unattainable = "panic"
            "#;
        let e = check_all(text, Secrets::Optional).unwrap_err().to_string();
        for needle in [
            "tenants[0].slo_ttft_ms: must be between 1 and 3600000 ms",
            "tenants[0].slo_tpot_ms: must be between 1 and 3600000 ms",
            "pools[0].routing.slo_unattainable: expected `downgrade` or `shed` (got `panic`)",
        ] {
            assert!(e.contains(needle), "missing `{needle}` in:\n{e}");
        }
        let ok = text
            .replace("= 0", "= 200")
            .replace("4000000", "30")
            .replace("panic", "shed");
        let c = check_all(&ok, Secrets::Optional).unwrap().config;
        assert_eq!(c.pools[0].policy, PolicyKind::Slo);
        assert_eq!(c.pools[0].routing.slo_unattainable, SloUnattainable::Shed);
    }

    #[test]
    fn the_prefix_policys_index_setting_is_checked() {
        let text = r#"
            [[pools]]
            models = ["m"]
            policy = "least_queue"
            workers = [{ url = "http://h:1", kv_events = "tcp://h:5557" }, { url = "http://h:2" }]
            [pools.routing]
            index = "precise"
            [[pools]]
            models = ["n"]
            policy = "prefix"
            workers = [{ url = "http://h:3" }]
            [pools.routing]
            index = "exact"
            "#;
        let e = check_all(text, Secrets::Optional).unwrap_err().to_string();
        for needle in [
            "pools[0].routing.index: applies to the `prefix` policy only",
            "pools[0].routing.index: `precise` needs the pool's pools[0].tokenizer",
            "pools[0].routing.index: `precise` needs kv_events on every worker; pools[0].workers[1] has none",
            "pools[1].routing.index: expected `auto`, `precise` or `approximate` (got `exact`)",
        ] {
            assert!(e.contains(needle), "missing `{needle}` in:\n{e}");
        }
        let ok = text
            .replace("least_queue", "prefix")
            .replace("policy = \"prefix\"\n            workers = [{ url", "policy = \"prefix\"\n            tokenizer = \"sim\"\n            workers = [{ url")
            .replace("{ url = \"http://h:2\" }", "{ url = \"http://h:2\", kv_events = \"tcp://h:5558\" }")
            .replace("exact", "approximate");
        let c = check_all(&ok, Secrets::Optional).unwrap().config;
        assert_eq!(c.pools[0].routing.index, PrefixSource::Precise);
        assert_eq!(c.pools[1].routing.index, PrefixSource::Approximate);
        let auto = check_all(
            &ok.replace("\"approximate\"", "\"auto\""),
            Secrets::Optional,
        );
        assert_eq!(
            auto.unwrap().config.pools[1].routing.index,
            PrefixSource::Auto
        );
    }

    #[test]
    fn routing_defaults_and_settings() {
        let c = check(
            r#"
            [[pools]]
            models = ["m"]
            policy = "prefix"
            workers = [{ url = "http://h:1", price_per_mtok = 0.5 }]
            [pools.routing]
            block_tokens = 32
            stats_interval_ms = 50
            allow_policy_override = true
            require_labels = { region = "eu" }
            "#,
        )
        .unwrap();
        let p = &c.pools[0];
        assert_eq!(p.policy, PolicyKind::Prefix);
        assert_eq!(p.routing.block_bytes(), 32 * 4);
        assert_eq!(p.routing.stats_interval, Duration::from_millis(50));
        assert_eq!(
            p.routing.stale_after,
            Duration::from_millis(DEFAULT_STALE_AFTER_MS)
        );
        assert!(p.routing.allow_policy_override);
        assert_eq!(p.routing.require_labels["region"], "eu");
        assert_eq!(p.workers[0].price_per_mtok, 0.5);
        let d = check("[[pools]]\nmodels=[\"m\"]\nworkers=[{url=\"http://h:1\"}]\n").unwrap();
        assert_eq!(d.pools[0].routing, RoutingConfig::default());
    }

    #[test]
    fn weighted_scorers_parse() {
        let c = check(
            r#"
            [[pools]]
            models = ["m"]
            policy = "weighted"
            workers = [{ url = "http://h:1" }]
            [pools.routing]
            scorers = [{ name = "prefix", weight = 1.0 }, { name = "queue", weight = 0.5 }]
            "#,
        )
        .unwrap();
        assert_eq!(
            c.pools[0].routing.scorers,
            vec![("prefix".into(), 1.0), ("queue".into(), 0.5)]
        );
    }

    #[test]
    fn routing_rejections_name_their_keys() {
        let e = check(
            r#"
            [[pools]]
            models = ["m"]
            policy = "prefix"
            workers = [{ url = "http://h:1", price_per_mtok = -1.0 }]
            [pools.routing]
            block_tokens = 0
            load_epsilon = -0.5
            stats_interval_ms = 10
            stale_after_ms = 20
            index_max_blocks = 0
            scorers = [{ name = "queue", weight = 1.0 }]
            [[pools]]
            models = ["n"]
            policy = "weighted"
            workers = [{ url = "http://h:2" }]
            [pools.routing]
            scorers = [{ name = "vibes", weight = 1.0 }, { name = "queue", weight = 0.0 }]
            [[pools]]
            models = ["o"]
            policy = "weighted"
            workers = [{ url = "http://h:3" }]
            "#,
        )
        .unwrap_err();
        let all = e.to_string();
        for needle in [
            "pools[0].workers[0].price_per_mtok",
            "pools[0].routing.block_tokens: must be at least 1",
            "pools[0].routing.load_epsilon",
            "pools[0].routing.stats_interval_ms: must be at least 25",
            "pools[0].routing.stale_after_ms",
            "pools[0].routing.index_max_blocks",
            "pools[0].routing.scorers: only valid with policy = \"weighted\"",
            "pools[1].routing.scorers[1].weight",
            "pools[2].routing.scorers: policy `weighted` needs a list",
        ] {
            assert!(all.contains(needle), "missing `{needle}` in:\n{all}");
        }
        let e = check("[[pools]]\nmodels=[\"m\"]\nworkers=[{url=\"http://h:1\"}]\n[pools.routing]\nblok_tokens=3\n")
            .unwrap_err();
        assert!(e.to_string().contains("blok_tokens"), "{e}");
    }
}
