//! `[pools.flow_control]`: when a pool's workers count as saturated, how long and
//! how much the gateway holds requests for them, in which order (priority
//! classes, then weighted fair queuing in tokens within a class), and whether a
//! waiting request may preempt a lower-class one that has not answered yet.
//! The priority classes live here too, so tenants and headers name them alike.

use super::key::Key;
use super::problems::Problems;
use serde::Deserialize;
use std::collections::HashMap;
use std::time::Duration;

/// Default bound on request-body bytes held in one pool's queue (64 MiB).
pub const DEFAULT_MAX_QUEUED_BYTES: u64 = 64 << 20;
/// Default output tokens expected from a request without `max_tokens`.
pub const DEFAULT_EXPECTED_OUTPUT_TOKENS: u64 = 256;
/// Default bound on fairness flows remembered per priority class.
pub const DEFAULT_MAX_FLOWS: usize = 1024;
/// Default `hold_for_faster`: a worker predicted over twice as slow to first
/// token as the best one is passed over (for a while).
pub const DEFAULT_HOLD_FOR_FASTER: f64 = 2.0;

/// Priority classes, highest first (`x-switchyard-priority`, a tenant's
/// default). Strict between classes: a class waits while any above it waits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Priority {
    Critical = 0,
    High = 1,
    Normal = 2,
    Low = 3,
}

impl Priority {
    /// Every class, highest first (index = `as usize`).
    pub const ALL: [Priority; 4] = [
        Priority::Critical,
        Priority::High,
        Priority::Normal,
        Priority::Low,
    ];

    /// The classes' names, highest first, for messages.
    pub const NAMES: &'static str = "critical, high, normal, low";

    /// The class named exactly `s` (lower case), if any.
    pub fn from_name(s: &str) -> Option<Priority> {
        Priority::ALL.into_iter().find(|p| p.as_str() == s)
    }

    /// The class's name, also its metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Priority::Critical => "critical",
            Priority::High => "high",
            Priority::Normal => "normal",
            Priority::Low => "low",
        }
    }
}

/// What happens to a preempted request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Preemption {
    Off,
    /// Cancelled upstream and queued again, ahead of its class.
    Requeue,
    /// Cancelled upstream and answered 503 with `Retry-After`.
    Reject,
}

/// What the fairness flows are keyed by.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FairnessKey {
    Tenant,
    /// A request header (lower case); requests without it share one flow.
    Header(String),
}

/// `[pools.flow_control]` as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawFlowControl {
    pub max_running: Option<u64>,
    pub max_waiting: Option<u64>,
    pub max_kv_usage: Option<f64>,
    pub max_queued_bytes: Option<u64>,
    pub ttl_ms: Option<RawTtl>,
    pub fairness_key: Option<String>,
    #[serde(default)]
    pub weights: HashMap<String, f64>,
    pub expected_output_tokens: Option<u64>,
    pub max_flows: Option<usize>,
    pub preemption: Option<String>,
    pub scale_from_zero: Option<bool>,
    pub hold_for_faster: Option<f64>,
    pub reserved_slots: Option<u64>,
}

/// `ttl_ms = { critical = …, high = …, normal = …, low = … }`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTtl {
    pub critical: Option<u64>,
    pub high: Option<u64>,
    pub normal: Option<u64>,
    pub low: Option<u64>,
}

/// A pool's flow control, validated. Saturation limits of `None` are not checked.
#[derive(Clone, Debug, PartialEq)]
pub struct FlowConfig {
    /// Saturated at this many requests running on the engine (last scrape).
    pub max_running: Option<u64>,
    /// Saturated at this many requests waiting inside the engine (last scrape).
    pub max_waiting: Option<u64>,
    /// Saturated at this KV-cache usage (0–1, last scrape).
    pub max_kv_usage: Option<f64>,
    pub max_queued_bytes: u64,
    /// Longest wait per class, indexed by `Priority as usize`.
    pub ttl: [Duration; 4],
    pub fairness_key: FairnessKey,
    /// Flow key → weight (default 1).
    pub weights: HashMap<String, f64>,
    pub expected_output_tokens: u64,
    pub max_flows: usize,
    pub preemption: Preemption,
    /// Wait (within the TTL) when the pool has no ready worker at all.
    pub scale_from_zero: bool,
    /// A worker with room whose predicted TTFT for a request is over this many
    /// times the best eligible worker's (busy ones included) counts as
    /// saturated for it while a slot on a fast worker is expected sooner than
    /// the slow one would answer (0: off).
    pub hold_for_faster: f64,
    /// Slots of each worker a flow over its share of the tokens in flight may
    /// not take while another flow is active (`None`: a quarter of the limit).
    pub reserved_slots: Option<u64>,
}

impl FlowConfig {
    /// Flow control with every default; `ttl` for every class.
    pub fn defaults(ttl: Duration) -> Self {
        FlowConfig {
            max_running: None,
            max_waiting: None,
            max_kv_usage: None,
            max_queued_bytes: DEFAULT_MAX_QUEUED_BYTES,
            ttl: [ttl; 4],
            fairness_key: FairnessKey::Tenant,
            weights: HashMap::new(),
            expected_output_tokens: DEFAULT_EXPECTED_OUTPUT_TOKENS,
            max_flows: DEFAULT_MAX_FLOWS,
            preemption: Preemption::Off,
            scale_from_zero: false,
            hold_for_faster: DEFAULT_HOLD_FOR_FASTER,
            reserved_slots: None,
        }
    }

    /// The slots of a worker limited to `limit` in flight kept from flows over
    /// their share: as configured (default a quarter), always fewer than `limit`.
    pub fn reserved(&self, limit: u64) -> u64 {
        self.reserved_slots
            .unwrap_or(limit / 4)
            .min(limit.saturating_sub(1))
    }

    /// The weight of flow `key` (1 unless configured).
    pub fn weight(&self, key: &str) -> f64 {
        self.weights.get(key).copied().unwrap_or(1.0)
    }
}

/// Validate `[pools.flow_control]`; `queue_timeout` is the default TTL.
pub(super) fn validate_flow(
    key: &Key,
    raw: RawFlowControl,
    queue_timeout: Duration,
    p: &mut Problems,
) -> FlowConfig {
    let d = FlowConfig::defaults(queue_timeout);
    if let Some(kv) = raw.max_kv_usage {
        if !(kv > 0.0 && kv <= 1.0) {
            p.push(format!(
                "{}: must be in (0, 1], got {kv}",
                key.field("max_kv_usage")
            ));
        }
    }
    let zeros = [
        ("max_queued_bytes", raw.max_queued_bytes == Some(0)),
        ("max_flows", raw.max_flows == Some(0)),
    ];
    for (name, zero) in zeros {
        if zero {
            p.push(format!("{}: must be greater than 0", key.field(name)));
        }
    }
    if let Some(r) = raw.hold_for_faster {
        if !(r == 0.0 || (r.is_finite() && r >= 1.0)) {
            p.push(format!(
                "{}: must be 0 (off) or a ratio >= 1, got {r}",
                key.field("hold_for_faster")
            ));
        }
    }
    for (flow, w) in &raw.weights {
        if !(w.is_finite() && *w > 0.0) {
            p.push(format!(
                "{}: must be a number > 0, got {w}",
                key.field("weights").field(flow)
            ));
        }
    }
    FlowConfig {
        max_running: raw.max_running,
        max_waiting: raw.max_waiting,
        max_kv_usage: raw.max_kv_usage,
        max_queued_bytes: raw.max_queued_bytes.unwrap_or(d.max_queued_bytes).max(1),
        ttl: ttl(key, raw.ttl_ms.unwrap_or_default(), queue_timeout, p),
        fairness_key: fairness_key(key, raw.fairness_key.as_deref(), p),
        weights: raw.weights,
        expected_output_tokens: raw
            .expected_output_tokens
            .unwrap_or(d.expected_output_tokens),
        max_flows: raw.max_flows.unwrap_or(d.max_flows).max(1),
        preemption: preemption(key, raw.preemption.as_deref(), p),
        scale_from_zero: raw.scale_from_zero.unwrap_or(false),
        hold_for_faster: raw.hold_for_faster.unwrap_or(d.hold_for_faster),
        reserved_slots: raw.reserved_slots,
    }
}

fn ttl(key: &Key, raw: RawTtl, default: Duration, p: &mut Problems) -> [Duration; 4] {
    let mut out = [default; 4];
    for (i, v) in [raw.critical, raw.high, raw.normal, raw.low]
        .into_iter()
        .enumerate()
    {
        match v {
            Some(0) => p.push(format!(
                "{}: must be greater than 0",
                key.field("ttl_ms").field(Priority::ALL[i].as_str())
            )),
            Some(ms) => out[i] = Duration::from_millis(ms),
            None => {}
        }
    }
    out
}

fn fairness_key(key: &Key, raw: Option<&str>, p: &mut Problems) -> FairnessKey {
    match raw {
        None | Some("tenant") => FairnessKey::Tenant,
        Some(s) => match s.strip_prefix("header:") {
            Some(h) if http::HeaderName::from_bytes(h.as_bytes()).is_ok() => {
                FairnessKey::Header(h.to_ascii_lowercase())
            }
            _ => {
                p.push(format!(
                    "{}: expected \"tenant\" or \"header:NAME\", got {s:?}",
                    key.field("fairness_key")
                ));
                FairnessKey::Tenant
            }
        },
    }
}

fn preemption(key: &Key, raw: Option<&str>, p: &mut Problems) -> Preemption {
    match raw {
        None | Some("off") => Preemption::Off,
        Some("requeue") => Preemption::Requeue,
        Some("reject") => Preemption::Reject,
        Some(other) => {
            p.push(format!(
                "{}: unknown mode `{other}` (expected one of: off, requeue, reject)",
                key.field("preemption")
            ));
            Preemption::Off
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserved_slots_default_to_a_quarter_and_leave_one_slot() {
        let mut f = FlowConfig::defaults(Duration::from_secs(1));
        assert_eq!((f.reserved(8), f.reserved(3), f.reserved(0)), (2, 0, 0));
        f.reserved_slots = Some(5);
        assert_eq!((f.reserved(8), f.reserved(4), f.reserved(1)), (5, 3, 0));
    }

    #[test]
    fn priority_names_round_trip_and_unknown_ones_are_none() {
        for p in Priority::ALL {
            assert_eq!(Priority::from_name(p.as_str()), Some(p));
            assert!(Priority::NAMES.contains(p.as_str()));
        }
        assert_eq!(Priority::from_name("urgent"), None);
        assert_eq!(Priority::from_name("Critical"), None);
        assert!(Priority::Critical < Priority::Low);
    }

    #[test]
    fn rejections_name_their_keys() {
        let raw: RawFlowControl = toml::from_str(
            r#"
            max_kv_usage = 1.5
            max_flows = 0
            fairness_key = "cookie"
            preemption = "sometimes"
            weights = { a = 0.0 }
            ttl_ms = { low = 0 }
            hold_for_faster = 0.5
            "#,
        )
        .unwrap();
        let mut p = Problems::default();
        validate_flow(
            &Key::new("pools").index(0).field("flow_control"),
            raw,
            Duration::from_secs(1),
            &mut p,
        );
        let text = format!("{p:?}");
        for k in [
            "pools[0].flow_control.max_kv_usage",
            "pools[0].flow_control.max_flows",
            "pools[0].flow_control.fairness_key",
            "pools[0].flow_control.preemption",
            "pools[0].flow_control.weights.a",
            "pools[0].flow_control.ttl_ms.low",
            "pools[0].flow_control.hold_for_faster",
        ] {
            assert!(text.contains(k), "{k} missing from:\n{text}");
        }
    }
}
