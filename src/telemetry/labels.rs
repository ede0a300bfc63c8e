//! Bounded label values: the first `limit` distinct values of a label are used as
//! they are; every later one becomes `other` (and is counted), so a misbehaving
//! client or a large fleet cannot blow up the number of series.

use super::names;
use crate::config::OTHER_LABEL;
use dashmap::DashMap;
use foldhash::fast::RandomState;
use metrics::{counter, SharedString};
use parking_lot::Mutex;
use std::cell::RefCell;
use std::sync::Arc;
use thread_local::ThreadLocal;

/// Label value for "not applicable" (no worker, no pool).
pub const NONE_LABEL: &str = "none";
/// Region of a worker without a `region` label.
pub const UNKNOWN_REGION: &str = "unknown";
/// Worker label naming the region.
pub const REGION_LABEL_KEY: &str = crate::config::global::REGION_LABEL;
/// Worker label naming the price tier.
pub const TIER_LABEL_KEY: &str = "tier";

type LocalMap = hashbrown::HashMap<Box<str>, SharedString, RandomState>;

pub struct BoundedLabels {
    label: &'static str,
    limit: usize,
    seen: DashMap<Box<str>, SharedString, RandomState>,
    /// Serialises admissions so the limit is exact; lookups of known values never take it.
    admit: Mutex<()>,
    /// Each thread's copy of the admitted values it has used: the request path
    /// finds its label without touching a lock another thread shares.
    local: ThreadLocal<RefCell<LocalMap>>,
}

/// A label value whose clones share one allocation. `SharedString::from(String)`
/// makes an owned value, and every clone of an owned value copies the string:
/// label values are cloned into metric keys on each request.
pub fn shared(v: &str) -> SharedString {
    SharedString::from(Arc::<str>::from(v))
}

impl BoundedLabels {
    pub fn new(label: &'static str, limit: usize) -> BoundedLabels {
        BoundedLabels {
            label,
            limit,
            seen: DashMap::with_hasher(RandomState::default()),
            admit: Mutex::new(()),
            local: ThreadLocal::new(),
        }
    }

    /// The label value to use for `v`.
    pub fn get(&self, v: &str) -> SharedString {
        let local = self.local.get_or_default();
        if let Some(s) = local.borrow().get(v) {
            return s.clone();
        }
        match self.admitted(v) {
            Some(s) => {
                // Only admitted values: the local maps stay within the limit too.
                // The thread's own copy of the text, so the reference counts that
                // requests bump are not shared with other threads.
                let mine = shared(&s);
                local.borrow_mut().insert(v.into(), mine.clone());
                mine
            }
            None => SharedString::const_str(OTHER_LABEL),
        }
    }

    /// The shared value for `v`, admitting it while there is room.
    fn admitted(&self, v: &str) -> Option<SharedString> {
        if let Some(s) = self.seen.get(v) {
            return Some(s.clone());
        }
        let _g = self.admit.lock();
        if let Some(s) = self.seen.get(v) {
            return Some(s.clone());
        }
        if self.seen.len() >= self.limit {
            counter!(names::LABEL_OVERFLOW_TOTAL, names::L_LABEL => self.label).increment(1);
            return None;
        }
        let s = shared(v);
        self.seen.insert(v.into(), s.clone());
        Some(s)
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
