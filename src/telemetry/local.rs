//! Per-thread counters and histograms for the request path.
//!
//! Every proxied request bumps a handful of counters and records two or three
//! latency histograms. Through the `metrics` recorder each of those is a few
//! locked read-modify-write instructions on memory every serving thread shares
//! (the exporter's histogram also pins a crossbeam epoch per sample); in the
//! overhead profile about 30 % of the samples in the binary sit just after a
//! locked instruction. Here each thread keeps its own running totals, written
//! with plain loads and stores (one writer per cell, so no update is lost), and
//! the Prometheus render reads them:
//!
//! - a counter's per-thread total is added to its `metrics` counter by [`flush`],
//!   which [`super::render`] calls first and the fleet ticker once a second (so the
//!   exporter still owns counters); a total whose cache went with a replaced
//!   routing snapshot is flushed a last time and dropped;
//! - a histogram is rendered here ([`render_into`]), summing the threads' buckets.
//!   Its series are kept by name and label values (bounded values only) for the
//!   life of the process, like the exporter's own registry, so they stay
//!   continuous across config reloads. Memory: about 260 bytes per live series per
//!   thread that recorded into it (28 buckets, sum, count), e.g. 3 MB for the three
//!   latency families of 64 workers on 64 serving threads; once no handle holds a
//!   series (its worker left), `flush` folds its threads' buckets into one set.

use foldhash::fast::RandomState;
use metrics::Counter;
use parking_lot::Mutex;
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::fmt::Write;
use std::sync::atomic::{
    fence, AtomicU64, Ordering::Acquire, Ordering::Relaxed, Ordering::Release,
};
use std::sync::{Arc, OnceLock};
use thread_local::ThreadLocal;

/// A running total written by one thread only: an add is a load and a store, no
/// locked instruction. Readers on other threads see a value that only grows.
#[derive(Default)]
pub struct LocalCount(AtomicU64);

impl LocalCount {
    #[inline]
    pub fn add(&self, n: u64) {
        self.0.store(self.0.load(Relaxed).wrapping_add(n), Relaxed);
    }

    pub fn get(&self) -> u64 {
        self.0.load(Relaxed)
    }
}

/// A per-thread total not yet handed to its `metrics` counter.
struct Pending {
    counter: Counter,
    count: Arc<LocalCount>,
    flushed: u64,
}

fn pending() -> &'static Mutex<Vec<Pending>> {
    static PENDING: OnceLock<Mutex<Vec<Pending>>> = OnceLock::new();
    PENDING.get_or_init(Default::default)
}

/// A new per-thread total for `counter`, flushed into it by [`flush`].
pub fn counter_slot(counter: Counter) -> Arc<LocalCount> {
    let count = Arc::new(LocalCount::default());
    pending().lock().push(Pending {
        counter,
        count: count.clone(),
        flushed: 0,
    });
    count
}

/// Add what every thread counted since the last flush to the `metrics` counters.
/// A total nobody else holds any more (its cache went with a replaced routing
/// snapshot) is flushed a last time and forgotten, so reloads leave nothing behind;
/// so are the per-thread buckets of histograms nobody holds (see
/// `compact_histograms`).
pub fn flush() {
    let mut all = pending().lock();
    all.retain_mut(|p| {
        let orphan = Arc::strong_count(&p.count) == 1;
        if orphan {
            // The last holder's adds happened before it dropped its reference.
            fence(Acquire);
        }
        let now = p.count.get();
        if now != p.flushed {
            p.counter.increment(now.wrapping_sub(p.flushed));
            p.flushed = now;
        }
        !orphan
    });
    drop(all);
    compact_histograms();
}

/// A counter with a running total per thread (see the module docs).
pub struct LocalCounter {
    counter: Counter,
    threads: ThreadLocal<Arc<LocalCount>>,
}

impl LocalCounter {
    pub fn new(counter: Counter) -> LocalCounter {
        LocalCounter {
            counter,
            threads: ThreadLocal::new(),
        }
    }

    #[inline]
    pub fn increment(&self, n: u64) {
        self.threads
            .get_or(|| counter_slot(self.counter.clone()))
            .add(n);
    }
}

/// One thread's values of a [`LocalMap`], by key, and the map's generation when
/// the thread last dropped forgotten keys.
#[derive(Default)]
struct ThreadValues<V> {
    generation: u64,
    values: HashMap<Arc<str>, Arc<V>, RandomState>,
}

/// Running totals (`V`, made of [`LocalCount`]s) per thread and per key, for an
/// aggregator that reads them all: [`LocalMap::entries`] lists every thread's
/// value of every key, and [`LocalMap::retain`] forgets keys (workers that left),
/// so the map stays as large as what is live.
pub struct LocalMap<V: Send + Sync> {
    threads: ThreadLocal<RefCell<ThreadValues<V>>>,
    all: Mutex<Vec<(Arc<str>, Arc<V>)>>,
    /// Bumped by `retain` when it forgets a key; each thread then drops its copies.
    generation: AtomicU64,
}

impl<V: Default + Send + Sync> Default for LocalMap<V> {
    fn default() -> Self {
        LocalMap {
            threads: ThreadLocal::new(),
            all: Mutex::new(Vec::new()),
            generation: AtomicU64::new(0),
        }
    }
}

impl<V: Default + Send + Sync> LocalMap<V> {
    /// Run `f` on this thread's value for `key`, created on first use.
    #[inline]
    pub fn with(&self, key: &str, f: impl FnOnce(&V)) {
        let mut mine = self.threads.get_or_default().borrow_mut();
        let generation = self.generation.load(Acquire);
        if mine.generation != generation {
            // Keys were forgotten: keep only values the aggregator still lists.
            let all = self.all.lock();
            mine.values
                .retain(|_, v| all.iter().any(|(_, live)| Arc::ptr_eq(live, v)));
            mine.generation = generation;
        }
        if let Some(v) = mine.values.get(key) {
            return f(v);
        }
        let (k, v): (Arc<str>, Arc<V>) = (Arc::from(key), Arc::default());
        self.all.lock().push((k.clone(), v.clone()));
        f(&v);
        mine.values.insert(k, v);
    }

    /// Every (key, one thread's value) pair so far.
    pub fn entries(&self) -> Vec<(Arc<str>, Arc<V>)> {
        self.all.lock().clone()
    }

    /// Forget the keys `keep` rejects (every thread's value of them).
    pub fn retain(&self, keep: impl Fn(&str) -> bool) {
        let mut all = self.all.lock();
        let before = all.len();
        all.retain(|(k, _)| keep(k));
        if all.len() != before {
            self.generation.fetch_add(1, Release);
        }
    }
}

/// One thread's buckets of a histogram: a count per bucket (the last is `+Inf`),
/// the sum of the samples (`f64` bits) and their number.
struct Cells {
    buckets: Box<[LocalCount]>,
    sum: AtomicU64,
    count: LocalCount,
}

/// A Prometheus histogram with fixed buckets, recorded per thread.
pub struct LocalHistogram {
    bounds: &'static [f64],
    threads: ThreadLocal<Cells>,
}

impl LocalHistogram {
    /// Record one sample (seconds, or whatever unit the family uses).
    #[inline]
    pub fn record(&self, v: f64) {
        let c = self.threads.get_or(|| Cells {
            buckets: (0..=self.bounds.len())
                .map(|_| LocalCount::default())
                .collect(),
            sum: AtomicU64::new(0f64.to_bits()),
            count: LocalCount::default(),
        });
        // Bucket `le = b` holds the samples `<= b`: the first bound not below `v`.
        let i = self.bounds.partition_point(|b| *b < v);
        c.buckets[i].add(1);
        c.count.add(1);
        c.sum
            .store((f64::from_bits(c.sum.load(Relaxed)) + v).to_bits(), Relaxed);
    }

    /// Add all threads' buckets, sum and count to `t`.
    fn add_to(&self, t: &mut Totals) {
        for c in self.threads.iter() {
            for (t, b) in t.buckets.iter_mut().zip(c.buckets.iter()) {
                *t += b.get();
            }
            t.sum += f64::from_bits(c.sum.load(Relaxed));
            t.count += c.count.get();
        }
    }
}

/// A histogram's buckets (not cumulative), sum and count.
#[derive(Clone)]
struct Totals {
    buckets: Vec<u64>,
    sum: f64,
    count: u64,
}

/// One series: what earlier handles recorded, folded into plain totals once no
/// handle held them (their worker left, their snapshot was replaced), and the live
/// per-thread histogram, if a handle exists.
struct Series {
    bounds: &'static [f64],
    base: Totals,
    live: Option<Arc<LocalHistogram>>,
}

impl Series {
    fn totals(&self) -> Totals {
        let mut t = self.base.clone();
        if let Some(h) = &self.live {
            h.add_to(&mut t);
        }
        t
    }
}

/// A histogram family: name, help text and buckets; its series by label text.
struct Family {
    help: &'static str,
    series: BTreeMap<String, Series>,
}

fn families() -> &'static Mutex<BTreeMap<&'static str, Family>> {
    static FAMILIES: OnceLock<Mutex<BTreeMap<&'static str, Family>>> = OnceLock::new();
    FAMILIES.get_or_init(Default::default)
}

/// The histogram `name` with these labels, created on first use. The same name
/// and labels always give the same histogram, so a series outlives reloads.
pub fn histogram(
    name: &'static str,
    help: &'static str,
    bounds: &'static [f64],
    labels: &[(&str, &str)],
) -> Arc<LocalHistogram> {
    let mut text = String::new();
    for (i, (k, v)) in labels.iter().enumerate() {
        let sep = if i == 0 { "" } else { "," };
        let _ = write!(text, "{sep}{k}=\"{}\"", escape(v));
    }
    let mut all = families().lock();
    let family = all.entry(name).or_insert_with(|| Family {
        help,
        series: BTreeMap::new(),
    });
    let series = family.series.entry(text).or_insert_with(|| Series {
        bounds,
        base: Totals {
            buckets: vec![0; bounds.len() + 1],
            sum: 0.0,
            count: 0,
        },
        live: None,
    });
    series
        .live
        .get_or_insert_with(|| {
            Arc::new(LocalHistogram {
                bounds,
                threads: ThreadLocal::new(),
            })
        })
        .clone()
}

/// Fold the per-thread buckets of histograms no handle holds any more into their
/// series' plain totals, so a series whose worker left keeps its counts in one
/// place instead of one per thread.
fn compact_histograms() {
    let mut all = families().lock();
    for s in all.values_mut().flat_map(|f| f.series.values_mut()) {
        if s.live.as_ref().is_some_and(|h| Arc::strong_count(h) == 1) {
            // The last holder's records happened before it dropped its reference.
            fence(Acquire);
            if let Some(h) = s.live.take() {
                h.add_to(&mut s.base);
            }
        }
    }
}

/// Append every histogram family in the Prometheus text format.
pub fn render_into(out: &mut String) {
    let all = families().lock();
    for (name, family) in all.iter() {
        let _ = writeln!(out, "# HELP {name} {}", family.help);
        let _ = writeln!(out, "# TYPE {name} histogram");
        for (labels, s) in &family.series {
            let Totals {
                buckets,
                sum,
                count,
            } = s.totals();
            let sep = if labels.is_empty() { "" } else { "," };
            let mut cumulative = 0;
            for (i, n) in buckets.iter().enumerate() {
                cumulative += n;
                match s.bounds.get(i) {
                    Some(b) => {
                        let _ =
                            writeln!(out, "{name}_bucket{{{labels}{sep}le=\"{b}\"}} {cumulative}");
                    }
                    None => {
                        let _ = writeln!(
                            out,
                            "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {cumulative}"
                        );
                    }
                }
            }
            let _ = writeln!(out, "{name}_sum{{{labels}}} {sum}");
            let _ = writeln!(out, "{name}_count{{{labels}}} {count}");
        }
    }
}

/// A label value escaped for the Prometheus text format.
pub(crate) fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOUNDS: &[f64] = &[0.01, 0.1, 1.0];

    fn sample(text: &str, line_start: &str) -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(line_start))
            .unwrap_or_else(|| panic!("no {line_start} in\n{text}"))
            .trim()
            .parse()
            .unwrap()
    }

    #[test]
    fn histogram_sums_every_thread_into_cumulative_buckets() {
        let h = histogram(
            "test_local_a_seconds",
            "help a",
            BOUNDS,
            &[("model", "m\"1")],
        );
        h.record(0.005);
        h.record(0.1);
        let h2 = h.clone();
        std::thread::spawn(move || {
            h2.record(0.5);
            h2.record(7.0);
        })
        .join()
        .unwrap();
        let mut out = String::new();
        render_into(&mut out);
        let l = "test_local_a_seconds_bucket{model=\"m\\\"1\",le=";
        assert_eq!(sample(&out, &format!("{l}\"0.01\"}}")), 1.0);
        assert_eq!(sample(&out, &format!("{l}\"0.1\"}}")), 2.0);
        assert_eq!(sample(&out, &format!("{l}\"1\"}}")), 3.0);
        assert_eq!(sample(&out, &format!("{l}\"+Inf\"}}")), 4.0);
        assert_eq!(
            sample(&out, "test_local_a_seconds_count{model=\"m\\\"1\"}"),
            4.0
        );
        let sum = sample(&out, "test_local_a_seconds_sum{model=\"m\\\"1\"}");
        assert!((sum - 7.605).abs() < 1e-9, "{sum}");
        assert_eq!(
            out.matches("# TYPE test_local_a_seconds histogram").count(),
            1
        );
    }

    #[test]
    fn a_histogram_nobody_holds_keeps_its_counts_in_one_place() {
        let h = histogram("test_local_c_seconds", "help c", BOUNDS, &[("worker", "w")]);
        h.record(0.05);
        let h2 = h.clone();
        std::thread::spawn(move || h2.record(0.5)).join().unwrap();
        let cells = Arc::downgrade(&h);
        drop(h);
        flush();
        assert!(
            cells.upgrade().is_none(),
            "per-thread buckets folded and freed"
        );
        // The worker comes back: its series continues from the folded totals.
        let again = histogram("test_local_c_seconds", "help c", BOUNDS, &[("worker", "w")]);
        again.record(5.0);
        let mut out = String::new();
        render_into(&mut out);
        assert_eq!(
            sample(&out, "test_local_c_seconds_count{worker=\"w\"}"),
            3.0
        );
        let l = "test_local_c_seconds_bucket{worker=\"w\",le=";
        assert_eq!(sample(&out, &format!("{l}\"0.1\"}}")), 1.0);
        assert_eq!(sample(&out, &format!("{l}\"1\"}}")), 2.0);
        assert_eq!(sample(&out, &format!("{l}\"+Inf\"}}")), 3.0);
    }

    #[test]
    fn the_same_labels_give_the_same_series() {
        let a = histogram("test_local_b_seconds", "help b", BOUNDS, &[("pool", "p")]);
        a.record(0.2);
        // A reload builds its handles again: the series continues.
        let b = histogram("test_local_b_seconds", "help b", BOUNDS, &[("pool", "p")]);
        b.record(0.3);
        let mut out = String::new();
        render_into(&mut out);
        assert_eq!(sample(&out, "test_local_b_seconds_count{pool=\"p\"}"), 2.0);
    }

    #[test]
    fn a_local_map_forgets_keys_on_each_thread_as_it_records() {
        let m: Arc<LocalMap<LocalCount>> = Arc::default();
        m.with("w1", |n| n.add(1));
        m.with("w2", |n| n.add(2));
        let m2 = m.clone();
        std::thread::spawn(move || m2.with("w1", |n| n.add(3)))
            .join()
            .unwrap();
        let total = |key: &str| -> u64 {
            m.entries()
                .iter()
                .filter(|(k, _)| &**k == key)
                .map(|(_, v)| v.get())
                .sum()
        };
        assert_eq!((total("w1"), total("w2")), (4, 2));
        // Entries are listed in creation order: this thread's w1, w2, the other's w1.
        let w1: Vec<_> = m
            .entries()
            .iter()
            .filter(|(k, _)| &**k == "w1")
            .map(|(_, v)| Arc::downgrade(v))
            .collect();
        m.retain(|k| k != "w1");
        assert_eq!(m.entries().len(), 1);
        // This thread drops its copy when it next records: a later w1 starts at zero.
        m.with("w1", |n| n.add(5));
        assert_eq!((total("w1"), total("w2")), (5, 2));
        assert!(w1[0].upgrade().is_none(), "this thread's old w1 is gone");
        // The other thread's stays until that thread records again (here: never).
        assert!(w1[1].upgrade().is_some());
    }

    /// A counter that keeps what it is given.
    struct Kept(AtomicU64);

    impl metrics::CounterFn for Kept {
        fn increment(&self, n: u64) {
            self.0.fetch_add(n, Relaxed);
        }
        fn absolute(&self, n: u64) {
            self.0.fetch_max(n, Relaxed);
        }
    }

    #[test]
    fn a_dropped_counter_is_flushed_once_more_then_forgotten() {
        let kept = Arc::new(Kept(AtomicU64::new(0)));
        let c = LocalCounter::new(Counter::from_arc(kept.clone()));
        c.increment(5);
        flush();
        assert_eq!(kept.0.load(Relaxed), 5);
        c.increment(2);
        let slot = Arc::downgrade(c.threads.iter().next().unwrap());
        // Its routing snapshot is replaced: the cache goes, its last counts do not.
        drop(c);
        flush();
        assert_eq!(kept.0.load(Relaxed), 7);
        assert!(slot.upgrade().is_none(), "the orphaned total is forgotten");
        flush();
        assert_eq!(kept.0.load(Relaxed), 7, "and counted only once");
    }

    #[test]
    fn counts_from_several_threads_are_all_flushed() {
        let c = Arc::new(LocalCounter::new(Counter::noop()));
        let n = Arc::new(LocalCount::default());
        let mut joins = Vec::new();
        for _ in 0..4 {
            let c = c.clone();
            joins.push(std::thread::spawn(move || {
                for _ in 0..1000 {
                    c.increment(1);
                }
            }));
        }
        for j in joins {
            j.join().unwrap();
        }
        let total: u64 = c.threads.iter().map(|t| t.get()).sum();
        assert_eq!(total, 4000);
        n.add(3);
        n.add(4);
        assert_eq!(n.get(), 7);
    }
}
