//! The pools: which workers each one has (configured, added at run time,
//! discovered), their live state, and the per-pool state that outlives
//! reloads. Built whenever the config or a worker list changes and swapped
//! atomically as an immutable [`PoolSet`]; whoever builds on it (the route
//! table) subscribes to the changes.

use super::flow::{saturation, FlowQueue, QueueLimits};
use super::worker::{Worker, WorkerState};
use crate::config::{Config, PoolConfig, WorkerConfig};
use crate::kv_events::{KvWorker, PoolKv};
use crate::upstream::retry_budget::RetryBudget;
use arc_swap::ArcSwap;
use dashmap::DashMap;
use http::HeaderValue;
use metrics::SharedString;
use parking_lot::Mutex;
use std::collections::BTreeSet;
use std::sync::Arc;

/// The queue bounds of pool `pc` (flow-control settings, else the plain queue's).
fn limits(pc: &PoolConfig) -> QueueLimits {
    let flow = pc
        .flow
        .clone()
        .unwrap_or_else(|| crate::config::FlowConfig::defaults(pc.queue_timeout));
    QueueLimits {
        max_count: pc.queue_size,
        max_bytes: flow.max_queued_bytes,
        ttl: flow.ttl,
        max_flows: flow.max_flows,
        preemption: flow.preemption,
    }
}

/// A pool as the request path sees it.
pub struct PoolRuntime {
    pub name: Arc<str>,
    pub config: PoolConfig,
    pub workers: Vec<Arc<Worker>>,
    /// `Authorization` value injected upstream, when the pool has an API key.
    pub upstream_auth: Option<HeaderValue>,
    /// The engines' KV-event subscribers and precise index (kept across
    /// rebuilds), when a worker publishes events.
    pub kv: Option<Arc<PoolKv>>,
    pub retry_budget: Arc<RetryBudget>,
    /// Present when the pool limits concurrency per worker.
    pub queue: Option<Arc<FlowQueue>>,
    /// The pool's metric handles (overhead, routing decisions).
    pub metrics: crate::telemetry::PoolMetrics,
}

/// One immutable view of the pools and their workers.
pub struct PoolSet {
    pub config: Arc<Config>,
    pub pools: Vec<Arc<PoolRuntime>>,
}

impl PoolSet {
    /// Every distinct worker, in config order.
    pub fn workers(&self) -> impl Iterator<Item = &Arc<Worker>> {
        let mut seen = BTreeSet::new();
        self.pools
            .iter()
            .flat_map(|p| p.workers.iter())
            .filter(move |w| seen.insert(w.id.clone()))
    }
}

/// Called with each new [`PoolSet`], right after it is stored.
type Listener = Box<dyn Fn(&Arc<PoolSet>) + Send + Sync>;

/// Owns the current pool set and the live state of every worker ever configured
/// (kept by URL, so a reload does not reset counters of unchanged workers).
pub struct Registry {
    current: ArcSwap<PoolSet>,
    listeners: Mutex<Vec<Listener>>,
    config: ArcSwap<Config>,
    states: DashMap<Arc<str>, Arc<WorkerState>>,
    /// Workers added at run time (admin API, DNS), by pool name.
    dynamic: DashMap<String, Vec<WorkerConfig>>,
    /// Configured workers removed through the admin API, by URL.
    removed: DashMap<String, ()>,
    /// Per-pool state that outlives rebuilds.
    budgets: DashMap<String, Arc<RetryBudget>>,
    queues: DashMap<String, Arc<FlowQueue>>,
    /// KV-event subscribers and precise index per pool name (outlive rebuilds).
    kv: DashMap<String, Arc<PoolKv>>,
    /// Latency models pooled per accelerator kind (label `accelerator`), shared
    /// by that kind's workers; bounded by the distinct labels configured.
    kinds: DashMap<String, Arc<super::predict::LatencyModel>>,
    /// The gateway's own listener addresses: never a worker (`addresses.rs`).
    pub(super) own: Mutex<Vec<std::net::SocketAddr>>,
}

/// Why a worker could not be added.
#[derive(Debug, PartialEq, Eq)]
pub enum AddWorkerError {
    NoPool(String),
    /// The pools already have a worker at this (normalised) URL.
    Duplicate(String),
}

impl std::fmt::Display for AddWorkerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AddWorkerError::NoPool(p) => write!(f, "no pool named `{p}`"),
            AddWorkerError::Duplicate(u) => write!(f, "a worker `{u}` is already in the pools"),
        }
    }
}

impl Registry {
    /// The tokenizer of pool `pool`, when it has one (`tokenizer` with KV events):
    /// limits count prompt tokens with it exactly.
    pub fn prompt_tokenizer(
        &self,
        pool: &str,
    ) -> Option<Arc<dyn crate::tokenize::PromptTokenizer>> {
        self.kv.get(pool)?.tokenizer.clone()
    }

    /// The pool's KV-event state (kept across rebuilds while its settings hold),
    /// its subscribers synced with `workers`; `None` when no worker publishes events.
    fn pool_kv(&self, pc: &PoolConfig, workers: &[Arc<Worker>]) -> Option<Arc<PoolKv>> {
        let fresh = || PoolKv::new(pc).map(Arc::new);
        let kv = match self.kv.get(&pc.name).map(|k| k.clone()) {
            Some(k) if k.fits(pc) => k,
            _ => match fresh() {
                Some(k) => {
                    self.kv.insert(pc.name.clone(), k.clone());
                    k
                }
                None => {
                    self.kv.remove(&pc.name);
                    return None;
                }
            },
        };
        let with_events: Vec<_> = workers
            .iter()
            .filter_map(|w| {
                let wc = pc.workers.iter().find(|wc| *wc.url == *w.id)?;
                Some(KvWorker {
                    id: w.id.clone(),
                    endpoints: wc.kv_events.clone()?,
                    start: w.state.stats.engine_start.clone(),
                })
            })
            .collect();
        kv.sync(&pc.name, &with_events);
        Some(kv)
    }

    /// The shared latency model of `wc`'s accelerator kind, if labelled.
    fn kind_model(&self, wc: &WorkerConfig) -> Option<Arc<super::predict::LatencyModel>> {
        let kind = wc.labels.get(super::predict::KIND_LABEL)?;
        Some(self.kinds.entry(kind.clone()).or_default().clone())
    }

    pub fn new(config: Config) -> Arc<Registry> {
        // Configured fixed ports are known now; bound ones are noted by the server.
        let own = std::iter::once(config.server.listen)
            .chain(config.admin.as_ref().map(|a| a.listen))
            .filter(|a| a.port() != 0)
            .collect();
        let config = Arc::new(config);
        let reg = Registry {
            current: ArcSwap::from_pointee(PoolSet {
                config: config.clone(),
                pools: Vec::new(),
            }),
            listeners: Mutex::new(Vec::new()),
            config: ArcSwap::new(config),
            states: DashMap::new(),
            dynamic: DashMap::new(),
            removed: DashMap::new(),
            budgets: DashMap::new(),
            queues: DashMap::new(),
            kv: DashMap::new(),
            kinds: DashMap::new(),
            own: Mutex::new(own),
        };
        reg.rebuild();
        Arc::new(reg)
    }

    /// The current pool set (cheap; no lock).
    pub fn snapshot(&self) -> Arc<PoolSet> {
        self.current.load_full()
    }

    /// Call `f` with the current pool set now and with every new one, in the
    /// thread that builds it (so a change is seen before its caller returns).
    pub fn subscribe(&self, f: impl Fn(&Arc<PoolSet>) + Send + Sync + 'static) {
        let mut listeners = self.listeners.lock();
        f(&self.snapshot());
        listeners.push(Box::new(f));
    }

    pub fn config(&self) -> Arc<Config> {
        self.config.load_full()
    }

    /// Replace the configuration (already validated) and rebuild. Workers whose URL
    /// is unchanged keep their live state; per-pool budgets and queues are rebuilt
    /// for pools whose settings changed.
    pub fn apply_config(&self, config: Config) {
        let old = self.config.load_full();
        for p in &config.pools {
            let same = old.pools.iter().any(|o| {
                o.name == p.name
                    && o.retry_budget_ratio == p.retry_budget_ratio
                    && o.retry_budget_min == p.retry_budget_min
                    && o.queue_size == p.queue_size
                    && o.queue_timeout == p.queue_timeout
                    && o.flow == p.flow
            });
            if !same {
                self.budgets.remove(&p.name);
                self.queues.remove(&p.name);
            }
        }
        self.config.store(Arc::new(config));
        self.rebuild();
    }

    /// Add a worker to a pool at run time. Errors name the problem.
    pub fn add_worker(&self, pool: &str, worker: WorkerConfig) -> Result<(), AddWorkerError> {
        let config = self.config.load_full();
        if !config.pools.iter().any(|p| p.name == pool) {
            return Err(AddWorkerError::NoPool(pool.to_string()));
        }
        let mut list = self.dynamic.entry(pool.to_string()).or_default();
        // Under the pool's entry lock, so two concurrent adds cannot both pass.
        let listed = self.snapshot().workers().any(|w| *w.id == *worker.url)
            || list.iter().any(|w| w.url == worker.url);
        if listed && !self.removed.contains_key(&worker.url) {
            return Err(AddWorkerError::Duplicate(worker.url));
        }
        self.removed.remove(&worker.url);
        list.retain(|w| w.url != worker.url);
        list.push(worker);
        drop(list);
        self.rebuild();
        Ok(())
    }

    /// Remove a worker (configured or added) from every pool. In-flight requests finish.
    pub fn remove_worker(&self, url: &str) -> bool {
        let known = self.snapshot().workers().any(|w| &*w.id == url);
        if known {
            self.removed.insert(url.to_string(), ());
            for mut list in self.dynamic.iter_mut() {
                list.retain(|w| w.url != url);
            }
            self.rebuild();
        }
        known
    }

    /// Replace the workers a discovery `source` (e.g. `dns`, `k8s`) found for a
    /// pool; rebuilds only on change.
    pub fn set_discovered_workers(&self, pool: &str, source: &str, workers: Vec<WorkerConfig>) {
        let workers = self.keep_allowed(source, workers);
        let key = format!("{source}:{pool}");
        if self.dynamic.get(&key).is_some_and(|w| *w == workers) {
            return;
        }
        self.dynamic.insert(key, workers);
        self.rebuild();
    }

    /// Live state of a worker by URL.
    pub fn worker_state(&self, url: &str) -> Option<Arc<WorkerState>> {
        self.states.get(url).map(|s| s.clone())
    }

    /// Rebuild the pool set from the config, the workers added or discovered
    /// and the discovered models, store it and tell the subscribers. One at a
    /// time, so subscribers see the sets in the order they were stored.
    pub fn rebuild(&self) {
        let listeners = self.listeners.lock();
        let config = self.config.load_full();
        self.kv
            .retain(|name, _| config.pools.iter().any(|pc| pc.name == *name));
        let pools = config
            .pools
            .iter()
            .map(|pc| self.pool(pc, &config))
            .collect();
        let set = Arc::new(PoolSet { config, pools });
        self.current.store(set.clone());
        for f in listeners.iter() {
            f(&set);
        }
        drop(listeners);
        // Workers may have appeared (the routes are built by now): a waiter
        // gets a turn to look.
        self.kick_queues();
    }

    /// Every pool's queue gets a turn to look for room (a stats scrape landed,
    /// the pools were rebuilt).
    pub fn kick_queues(&self) {
        for q in self.queues.iter() {
            q.release();
        }
    }

    /// One pool as configured now, with its workers and kept state.
    fn pool(&self, pc: &PoolConfig, config: &Config) -> Arc<PoolRuntime> {
        let workers = self.workers(pc, config);
        let upstream_auth = pc
            .upstream_api_key
            .as_ref()
            .and_then(|k| HeaderValue::from_str(&format!("Bearer {}", k.expose())).ok())
            .map(|mut v| {
                v.set_sensitive(true);
                v
            });
        let retry_budget = self
            .budgets
            .entry(pc.name.clone())
            .or_insert_with(|| {
                Arc::new(RetryBudget::new(pc.retry_budget_ratio, pc.retry_budget_min))
            })
            .clone();
        let queue = saturation::limits(pc).then(|| {
            self.queues
                .entry(pc.name.clone())
                .or_insert_with(|| Arc::new(FlowQueue::new(pc.name.clone().into(), limits(pc))))
                .clone()
        });
        Arc::new(PoolRuntime {
            name: Arc::from(pc.name.as_str()),
            config: pc.clone(),
            kv: self.pool_kv(pc, &workers),
            workers,
            upstream_auth,
            retry_budget,
            queue,
            metrics: crate::telemetry::PoolMetrics::new(SharedString::from(Arc::<str>::from(
                pc.name.as_str(),
            ))),
        })
    }

    /// A pool's workers: configured, added by the admin API (keyed by the pool
    /// name) and discovered (keyed `source:pool`), less the removed ones; each
    /// with its live state, kept by URL.
    fn workers(&self, pc: &PoolConfig, config: &Config) -> Vec<Arc<Worker>> {
        let mut worker_cfgs: Vec<WorkerConfig> = pc.workers.clone();
        let suffix = format!(":{}", pc.name);
        for entry in self.dynamic.iter() {
            if entry.key() != &pc.name && !entry.key().ends_with(&suffix) {
                continue;
            }
            for w in entry.value() {
                if !worker_cfgs.iter().any(|c| c.url == w.url) {
                    worker_cfgs.push(w.clone());
                }
            }
        }
        worker_cfgs.retain(|w| !self.removed.contains_key(&w.url));
        worker_cfgs
            .iter()
            .filter_map(|wc| {
                let state = self
                    .states
                    .entry(Arc::from(wc.url.as_str()))
                    .or_default()
                    .clone();
                state.latency.set_kind(self.kind_model(wc));
                match Worker::new(&wc.url, wc.labels.clone(), state) {
                    Ok(mut w) => {
                        w.region = wc
                            .labels
                            .get(crate::config::global::REGION_LABEL)
                            .and_then(|r| config.global.region_id(r));
                        Some(Arc::new(w))
                    }
                    Err(e) => {
                        tracing::error!(worker = %wc.url, error = %e, "skipping worker");
                        None
                    }
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config;

    fn cfg(text: &str) -> Config {
        config::parse(text).unwrap().validate().unwrap()
    }

    #[test]
    fn workers_keep_their_state_and_subscribers_see_every_change() {
        let reg = Registry::new(cfg(r#"
            [[pools]]
            name = "a"
            models = ["llama"]
            workers = [{ url = "http://h:1" }]
        "#));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s2 = seen.clone();
        reg.subscribe(move |set| s2.lock().push(set.workers().count()));
        let before = reg.snapshot().pools[0].workers[0].state.clone();
        let h2 = WorkerConfig {
            url: "http://h:2".into(),
            labels: Default::default(),
            price_per_mtok: 0.0,
            kv_events: None,
        };
        reg.add_worker("a", h2).unwrap();
        assert_eq!(*seen.lock(), vec![1, 2]);
        let after = reg.snapshot();
        assert!(Arc::ptr_eq(&after.pools[0].workers[0].state, &before));
        assert!(reg.remove_worker("http://h:1"));
        assert_eq!(*seen.lock(), vec![1, 2, 1]);
    }
}
