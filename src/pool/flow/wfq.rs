//! Weighted fair queuing in tokens within one priority class: self-clocked
//! virtual time (SCFQ). A request of flow `f` costing `c` tokens at weight `w`
//! gets the finish tag `max(V, last[f]) + c / w`; requests leave in tag order and
//! `V` becomes the tag of the one leaving. A flow sending 10× the tokens gets tags
//! 10× further apart, so it cannot take more than its share while others wait.
//! Flows whose last tag is behind `V` are idle and forgotten (bounded map).

use std::collections::HashMap;
use std::sync::Arc;

/// Virtual-time units per token of cost (so fractional weights keep precision).
const UNITS_PER_TOKEN: f64 = 1000.0;

/// A waiting request's place: its finish tag, then arrival order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Tag {
    pub finish: u64,
    pub seq: u64,
}

/// One class's virtual clock and its flows' last finish tags.
#[derive(Debug)]
pub struct Wfq {
    vtime: u64,
    seq: u64,
    last: HashMap<Arc<str>, u64>,
    max_flows: usize,
}

impl Wfq {
    pub fn new(max_flows: usize) -> Self {
        Wfq {
            vtime: 0,
            seq: 0,
            last: HashMap::new(),
            max_flows: max_flows.max(1),
        }
    }

    /// The tag of a new request of `flow` costing `cost` tokens at `weight`.
    /// `false` in the second place: the flow map was full of active flows, so this
    /// flow's history is not kept (its later requests start from `V` again).
    pub fn stamp(&mut self, flow: &str, cost: u64, weight: f64) -> (Tag, bool) {
        let step = ((cost.max(1) as f64) * UNITS_PER_TOKEN / weight.max(1e-6)).min(1e15) as u64;
        let start = self.last.get(flow).copied().unwrap_or(0).max(self.vtime);
        let finish = start.saturating_add(step);
        self.seq += 1;
        let tag = Tag {
            finish,
            seq: self.seq,
        };
        let kept = match self.last.get_mut(flow) {
            Some(l) => {
                *l = finish;
                true
            }
            None => {
                if self.last.len() >= self.max_flows {
                    let v = self.vtime;
                    self.last.retain(|_, l| *l > v);
                }
                let room = self.last.len() < self.max_flows;
                if room {
                    self.last.insert(Arc::from(flow), finish);
                }
                room
            }
        };
        (tag, kept)
    }

    /// A tag ahead of every waiting request of this class (a preempted request
    /// coming back; its flow was charged when it first queued).
    pub fn front(&mut self) -> Tag {
        self.seq += 1;
        Tag {
            finish: self.vtime.saturating_sub(1),
            seq: self.seq,
        }
    }

    /// The request tagged `tag` left the queue: the virtual clock moves to it.
    pub fn served(&mut self, tag: Tag) {
        self.vtime = self.vtime.max(tag.finish);
    }

    /// Flows remembered now.
    pub fn flows(&self) -> usize {
        self.last.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// Enqueue `(flow, cost)` in order, then drain: the flows in leaving order.
    fn drain(
        w: &mut Wfq,
        reqs: &[(&'static str, u64)],
        weight: &dyn Fn(&str) -> f64,
    ) -> Vec<&'static str> {
        let mut q = BTreeMap::new();
        for &(f, c) in reqs {
            q.insert(w.stamp(f, c, weight(f)).0, f);
        }
        let mut out = Vec::new();
        while let Some((tag, f)) = q.pop_first() {
            w.served(tag);
            out.push(f);
        }
        out
    }

    #[test]
    fn equal_costs_alternate_between_flows() {
        let mut w = Wfq::new(16);
        let mut reqs = vec![("a", 100); 4];
        reqs.extend([("b", 100); 2]);
        assert_eq!(
            drain(&mut w, &reqs, &|_| 1.0),
            ["a", "b", "a", "b", "a", "a"]
        );
    }

    #[test]
    fn a_flow_sending_ten_times_the_tokens_waits_its_turn() {
        let mut w = Wfq::new(16);
        let mut reqs = vec![("heavy", 1000); 5];
        reqs.extend([("light", 100); 5]);
        let order = drain(&mut w, &reqs, &|_| 1.0);
        // Every light request (500 tokens in all) leaves before the heavy
        // flow's second (it has had 1000 tokens by then).
        let second_heavy = order
            .iter()
            .enumerate()
            .filter(|(_, f)| **f == "heavy")
            .nth(1)
            .unwrap()
            .0;
        let last_light = order.iter().rposition(|f| *f == "light").unwrap();
        assert!(last_light < second_heavy, "{order:?}");
    }

    #[test]
    fn weights_scale_the_share() {
        let mut w = Wfq::new(16);
        let mut reqs = vec![("a", 100); 6];
        reqs.extend([("b", 100); 6]);
        let order = drain(&mut w, &reqs, &|f| if f == "a" { 2.0 } else { 1.0 });
        let first6 = &order[..6];
        assert_eq!(first6.iter().filter(|f| **f == "a").count(), 4, "{order:?}");
    }

    #[test]
    fn a_late_flow_does_not_get_credit_for_idle_time() {
        let mut w = Wfq::new(16);
        let order = drain(&mut w, &[("a", 100), ("a", 100), ("a", 100)], &|_| 1.0);
        assert_eq!(order.len(), 3);
        // "b" arrives after "a" was served: it starts at V, not at 0.
        let order = drain(&mut w, &[("a", 100), ("b", 100), ("b", 100)], &|_| 1.0);
        assert_eq!(order, ["a", "b", "b"]);
    }

    #[test]
    fn the_flow_map_stays_bounded() {
        let mut w = Wfq::new(4);
        let mut last = None;
        // Active flows (nothing served) fill the map; the rest are not kept.
        for i in 0..10 {
            let (tag, kept) = w.stamp(&format!("f{i}"), 10, 1.0);
            assert_eq!(kept, i < 4);
            assert!(w.flows() <= 4);
            last = Some(tag);
        }
        // Once served past them, they are idle and make room.
        w.served(last.unwrap());
        assert!(w.stamp("new", 10, 1.0).1);
        assert_eq!(w.flows(), 1);
    }
}
