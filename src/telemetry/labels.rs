//! Bounded label values: the first `limit` distinct values of a label are used as
//! they are; every later one becomes `other` (and is counted), so a misbehaving
//! client or a large fleet cannot blow up the number of series.

use super::names;
use crate::config::OTHER_LABEL;
use dashmap::DashMap;
use metrics::{counter, SharedString};
use std::sync::Mutex;

pub struct BoundedLabels {
    label: &'static str,
    limit: usize,
    seen: DashMap<Box<str>, SharedString>,
    /// Serialises admissions so the limit is exact; lookups of known values never take it.
    admit: Mutex<()>,
}

impl BoundedLabels {
    pub fn new(label: &'static str, limit: usize) -> BoundedLabels {
        BoundedLabels {
            label,
            limit,
            seen: DashMap::new(),
            admit: Mutex::new(()),
        }
    }

    /// The label value to use for `v`.
    pub fn get(&self, v: &str) -> SharedString {
        if let Some(s) = self.seen.get(v) {
            return s.clone();
        }
        let _g = self.admit.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = self.seen.get(v) {
            return s.clone();
        }
        if self.seen.len() >= self.limit {
            counter!(names::LABEL_OVERFLOW_TOTAL, names::L_LABEL => self.label).increment(1);
            return SharedString::const_str(OTHER_LABEL);
        }
        let s = SharedString::from(v.to_string());
        self.seen.insert(v.into(), s.clone());
        s
    }

    pub fn len(&self) -> usize {
        self.seen.len()
    }

    pub fn is_empty(&self) -> bool {
        self.seen.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_beyond_the_limit_are_other() {
        let l = BoundedLabels::new("tenant", 2);
        assert_eq!(&*l.get("a"), "a");
        assert_eq!(&*l.get("b"), "b");
        assert_eq!(&*l.get("c"), OTHER_LABEL);
        assert_eq!(&*l.get("a"), "a");
        assert_eq!(l.len(), 2);
    }
}
