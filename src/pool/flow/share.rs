//! Each fairness flow's share of a pool's busy slots, counted in tokens.
//!
//! The fair queue orders waiters, but a slot once taken is held until its
//! answer ends. Between another tenant's bursts a tenant sending long prompts
//! would take every free slot, and the short requests of the next burst would
//! wait for long ones to finish. So a flow holding more than its weighted share
//! of the tokens in flight, while another flow is active, may not take a
//! worker's last reserved slots (`reserved_slots`, see `saturation::in_reserve`).
//! A flow stays active for [`LINGER_MS`] after its last request ends, so a
//! tenant between two bursts keeps its claim.

use std::collections::HashMap;
use std::sync::Arc;

/// How long a flow with nothing in flight still counts as active (ms).
pub const LINGER_MS: u64 = 1_000;

#[derive(Debug)]
struct Load {
    tokens: u64,
    weight: f64,
    /// When its last request ended (ms; meaningful while `tokens` is 0).
    idle_since: u64,
}

/// Tokens in flight per flow (bounded by `max_flows`).
#[derive(Debug)]
pub struct Shares {
    flows: HashMap<Arc<str>, Load>,
    max_flows: usize,
}

impl Shares {
    pub fn new(max_flows: usize) -> Self {
        Shares {
            flows: HashMap::new(),
            max_flows: max_flows.max(1),
        }
    }

    /// `flow` sent a request costing `tokens`; `None` when no room is left to
    /// track one more flow (it is then never judged over its share).
    pub fn start(&mut self, flow: &str, weight: f64, tokens: u64, now: u64) -> Option<Arc<str>> {
        if let Some(key) = self.flows.get_key_value(flow).map(|(k, _)| k.clone()) {
            if let Some(l) = self.flows.get_mut(flow) {
                l.tokens += tokens;
                l.weight = weight;
            }
            return Some(key);
        }
        if self.flows.len() >= self.max_flows {
            self.flows.retain(|_, l| active(l, now));
            if self.flows.len() >= self.max_flows {
                return None;
            }
        }
        let key: Arc<str> = Arc::from(flow);
        let load = Load {
            tokens,
            weight,
            idle_since: now,
        };
        self.flows.insert(key.clone(), load);
        Some(key)
    }

    /// A request of `flow` costing `tokens` ended.
    pub fn end(&mut self, flow: &str, tokens: u64, now: u64) {
        if let Some(l) = self.flows.get_mut(flow) {
            l.tokens = l.tokens.saturating_sub(tokens);
            if l.tokens == 0 {
                l.idle_since = now;
            }
        }
    }

    /// `flow` (weight `weight`) holds more than its weighted share of the
    /// tokens in flight while some other flow is active.
    pub fn over(&self, flow: &str, weight: f64, now: u64) -> bool {
        let (mut total, mut weights, mut others) = (0u64, weight, false);
        for (k, l) in self.flows.iter().filter(|(_, l)| active(l, now)) {
            total += l.tokens;
            if &**k != flow {
                weights += l.weight;
                others = true;
            }
        }
        let mine = self.flows.get(flow).map_or(0, |l| l.tokens);
        others && mine as f64 * weights > weight * total as f64
    }
}

fn active(l: &Load, now: u64) -> bool {
    l.tokens > 0 || now.saturating_sub(l.idle_since) < LINGER_MS
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flow_over_its_token_share_is_judged_over_while_another_is_active() {
        let mut s = Shares::new(8);
        assert!(!s.over("noisy", 1.0, 0), "nothing in flight");
        s.start("noisy", 1.0, 5_000, 0);
        assert!(!s.over("noisy", 1.0, 0), "alone: all of it is its share");
        s.start("quiet", 1.0, 500, 0);
        assert!(s.over("noisy", 1.0, 0));
        assert!(!s.over("quiet", 1.0, 0));
        // Weights scale the share: 10:1 gives the noisy flow 10/11 of 5,500.
        assert!(!s.over("noisy", 10.0, 0));
        // The quiet flow's request ends: it still counts for LINGER_MS.
        s.end("quiet", 500, 100);
        assert!(s.over("noisy", 1.0, 100 + LINGER_MS - 1));
        assert!(!s.over("noisy", 1.0, 100 + LINGER_MS));
    }

    #[test]
    fn tracked_flows_are_bounded_and_idle_ones_make_room() {
        let mut s = Shares::new(2);
        assert!(s.start("a", 1.0, 10, 0).is_some());
        assert!(s.start("b", 1.0, 10, 0).is_some());
        assert!(s.start("c", 1.0, 10, 0).is_none(), "full: not tracked");
        assert!(!s.over("c", 1.0, 0), "an untracked flow is never over");
        s.end("a", 10, 0);
        assert!(s.start("c", 1.0, 10, LINGER_MS).is_some(), "a went idle");
        assert!(s.start("a", 1.0, 10, LINGER_MS).is_none());
    }
}
