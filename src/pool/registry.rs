//! The routing snapshot: model name → route (pool, policy, workers serving it).
//! Built from config plus discovered models whenever either changes, then swapped
//! atomically; requests in flight keep the snapshot they started with.

use super::admission::AdmissionQueue;
use super::worker::{Worker, WorkerState};
use crate::config::{Config, PolicyKind, PoolConfig, Residency, WorkerConfig};
use crate::kv_events::PoolKv;
use crate::routing::{self, Policy, PrefixIndex, SpillState, WeightedSplit};
use crate::telemetry::{names, PairMetrics};
use crate::upstream::retry_budget::RetryBudget;
use arc_swap::ArcSwap;
use dashmap::DashMap;
use http::HeaderValue;
use metrics::{counter, Counter, SharedString};
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

/// A pool as the request path sees it.
pub struct PoolRuntime {
    pub name: Arc<str>,
    pub config: PoolConfig,
    pub workers: Vec<Arc<Worker>>,
    /// `Authorization` value injected upstream, when the pool has an API key.
    pub upstream_auth: Option<HeaderValue>,
    /// The pool's prefix index (kept by the registry across rebuilds), when its
    /// policy or an allowed override uses one.
    pub prefix_index: Option<Arc<PrefixIndex>>,
    pub retry_budget: Arc<RetryBudget>,
    /// Present when the pool limits concurrency per worker.
    pub queue: Option<Arc<AdmissionQueue>>,
    /// The pool's metric handles (overhead, routing decisions).
    pub metrics: crate::telemetry::PoolMetrics,
}

/// Where requests for one model name go.
pub struct ModelRoute {
    /// The model name as configured (aliases resolve to it); used as a metric label.
    pub model: Arc<str>,
    pub pool: Arc<PoolRuntime>,
    pub policy: Box<dyn Policy>,
    /// The other policies a request may ask for with `x-switchyard-policy`
    /// (empty unless the pool sets `allow_policy_override`).
    pub overrides: Vec<Box<dyn Policy>>,
    /// The pool's workers that serve this model.
    pub workers: Vec<Arc<Worker>>,
    /// Metric handles per worker, aligned with `workers`.
    pub metrics: Vec<Arc<PairMetrics>>,
}

impl ModelRoute {
    /// The policy named `name` among the allowed overrides.
    pub fn override_policy(&self, name: &str) -> Option<&dyn Policy> {
        self.overrides
            .iter()
            .find(|p| p.name() == name)
            .map(|p| &**p)
    }
}

/// A split model name: its weights and the route of each target pool.
pub struct SplitRoute {
    pub split: WeightedSplit,
    /// The first model's route of each target pool, aligned with the split's
    /// targets (`None` while a discovered pool has no model yet).
    pub routes: Vec<Option<Arc<ModelRoute>>>,
    /// `switchyard_split_decisions_total` per target: [by draw, by session].
    counters: Vec<[Counter; 2]>,
}

/// One immutable view of everything routing needs.
pub struct Snapshot {
    pub config: Arc<Config>,
    pub pools: Vec<Arc<PoolRuntime>>,
    /// Model names and aliases → route.
    pub routes: HashMap<String, Arc<ModelRoute>>,
    /// Pool name → the route of its first model (fallback chains land there).
    pub by_pool: HashMap<String, Arc<ModelRoute>>,
    /// Split model names (`[[splits]]`) → their targets.
    pub splits: HashMap<String, SplitRoute>,
}

/// Where a requested model name leads.
pub struct Resolved<'a> {
    pub route: &'a Arc<ModelRoute>,
    /// The name came from a split: the body's model must become `route.model`.
    pub split: bool,
}

impl Snapshot {
    pub fn route(&self, model: &str) -> Option<&Arc<ModelRoute>> {
        self.routes.get(model)
    }

    /// The route for a requested name: a pool's model, alias or adapter, else a
    /// split resolved by `session` (sticky) or by weight. Split targets without an
    /// available worker the `residency` allows are passed over while another has one.
    pub fn resolve(
        &self,
        model: &str,
        session: Option<&str>,
        residency: Option<&Residency>,
    ) -> Option<Resolved<'_>> {
        if let Some(route) = self.routes.get(model) {
            return Some(Resolved {
                route,
                split: false,
            });
        }
        let s = self.splits.get(model)?;
        let usable = |i: usize| {
            s.routes[i].as_ref().is_some_and(|r| {
                r.workers
                    .iter()
                    .any(|w| w.is_available() && residency.is_none_or(|res| res.admits(w.region)))
            })
        };
        let i = s.split.pick(session, usable);
        let route = s.routes.get(i)?.as_ref()?;
        s.counters[i][session.is_some() as usize].increment(1);
        Some(Resolved { route, split: true })
    }

    /// The route a fallback to `pool` uses.
    pub fn pool_route(&self, pool: &str) -> Option<&Arc<ModelRoute>> {
        self.by_pool.get(pool)
    }

    /// Names clients may request, sorted (aliases included).
    pub fn model_names(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .routes
            .keys()
            .chain(self.splits.keys())
            .cloned()
            .collect();
        v.sort();
        v
    }

    /// Every model has at least one worker able to take a request.
    pub fn is_ready(&self) -> bool {
        !self.routes.is_empty()
            && self
                .pools
                .iter()
                .all(|p| p.workers.iter().any(|w| w.is_available()))
            && self
                .routes
                .values()
                .all(|r| r.workers.iter().any(|w| w.is_available()))
    }

    /// What keeps the gateway from being ready, in a person's terms (empty
    /// when [`Snapshot::is_ready`]).
    pub fn unready_reasons(&self) -> Vec<String> {
        let mut out = Vec::new();
        for p in self.pools.iter() {
            if p.workers.is_empty() {
                out.push(format!("pool `{}` has no worker", p.name));
                continue;
            }
            let serves_any = self.routes.values().any(|r| Arc::ptr_eq(&r.pool, p));
            if !serves_any {
                let why: Vec<String> = p
                    .workers
                    .iter()
                    .map(|w| match w.state.discovery_error.load().as_deref() {
                        Some(e) => format!("{}: {e}", w.id),
                        None => format!("{}: no model listed yet", w.id),
                    })
                    .collect();
                out.push(format!(
                    "pool `{}` serves no model yet ({})",
                    p.name,
                    why.join("; ")
                ));
            } else if !p.workers.iter().any(|w| w.is_available()) {
                out.push(format!("pool `{}` has no available worker", p.name));
            }
        }
        if self.pools.is_empty() {
            out.push("no pool is configured".into());
        }
        out
    }

    /// Every distinct worker, in config order.
    pub fn workers(&self) -> impl Iterator<Item = &Arc<Worker>> {
        let mut seen = BTreeSet::new();
        self.pools
            .iter()
            .flat_map(|p| p.workers.iter())
            .filter(move |w| seen.insert(w.id.clone()))
    }
}

/// Owns the current snapshot and the live state of every worker ever configured
/// (kept by URL, so a reload does not reset counters of unchanged workers).
pub struct Registry {
    current: ArcSwap<Snapshot>,
    config: ArcSwap<Config>,
    states: DashMap<Arc<str>, Arc<WorkerState>>,
    /// Prefix index per pool name; outlives snapshots.
    indexes: DashMap<Arc<str>, Arc<PrefixIndex>>,
    /// Workers added at run time (admin API, DNS), by pool name.
    dynamic: DashMap<String, Vec<WorkerConfig>>,
    /// Configured workers removed through the admin API, by URL.
    removed: DashMap<String, ()>,
    /// Per-pool state that outlives rebuilds.
    budgets: DashMap<String, Arc<RetryBudget>>,
    queues: DashMap<String, Arc<AdmissionQueue>>,
    /// Locality spill state per pool name (hysteresis outlives rebuilds).
    spill: DashMap<String, Arc<SpillState>>,
    /// KV-event subscribers and precise index per pool name (outlive rebuilds).
    kv: DashMap<String, Arc<PoolKv>>,
    /// Latency models pooled per accelerator kind (label `accelerator`), shared
    /// by that kind's workers; bounded by the distinct labels configured.
    kinds: DashMap<String, Arc<super::predict::LatencyModel>>,
}

impl Registry {
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
                Some((w.id.clone(), wc.kv_events.clone()?))
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
        let config = Arc::new(config);
        let reg = Registry {
            current: ArcSwap::from_pointee(Snapshot {
                config: config.clone(),
                pools: Vec::new(),
                routes: HashMap::new(),
                by_pool: HashMap::new(),
                splits: HashMap::new(),
            }),
            config: ArcSwap::new(config),
            states: DashMap::new(),
            indexes: DashMap::new(),
            dynamic: DashMap::new(),
            removed: DashMap::new(),
            budgets: DashMap::new(),
            queues: DashMap::new(),
            spill: DashMap::new(),
            kv: DashMap::new(),
            kinds: DashMap::new(),
        };
        reg.rebuild();
        Arc::new(reg)
    }

    /// The current snapshot (cheap; no lock).
    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.current.load_full()
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
    pub fn add_worker(&self, pool: &str, worker: WorkerConfig) -> Result<(), String> {
        let config = self.config.load_full();
        if !config.pools.iter().any(|p| p.name == pool) {
            return Err(format!("no pool named `{pool}`"));
        }
        self.removed.remove(&worker.url);
        let mut list = self.dynamic.entry(pool.to_string()).or_default();
        if !list.iter().any(|w| w.url == worker.url) {
            list.push(worker);
        }
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

    /// Rebuild the snapshot from the config and the discovered models.
    pub fn rebuild(&self) {
        let config = self.config.load_full();
        self.kv
            .retain(|name, _| config.pools.iter().any(|pc| pc.name == *name));
        let mut pools = Vec::new();
        let mut routes: HashMap<String, Arc<ModelRoute>> = HashMap::new();
        let mut by_pool: HashMap<String, Arc<ModelRoute>> = HashMap::new();
        for pc in &config.pools {
            let mut worker_cfgs: Vec<WorkerConfig> = pc.workers.clone();
            // Admin-added workers are keyed by the pool name, discovered ones by
            // `source:pool`.
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
            let workers: Vec<Arc<Worker>> = worker_cfgs
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
                .collect();
            let upstream_auth = pc
                .upstream_api_key
                .as_ref()
                .and_then(|k| HeaderValue::from_str(&format!("Bearer {}", k.expose())).ok())
                .map(|mut v| {
                    v.set_sensitive(true);
                    v
                });
            let prefix_index = routing::needs_index(pc).then(|| {
                let ix = self
                    .indexes
                    .entry(Arc::from(pc.name.as_str()))
                    .or_insert_with(|| Arc::new(PrefixIndex::new(pc.routing.index_max_blocks)))
                    .clone();
                ix.set_max_pairs(pc.routing.index_max_blocks);
                ix.set_workers(&workers.iter().map(|w| w.id.clone()).collect::<Vec<_>>());
                ix
            });
            let kv = self.pool_kv(pc, &workers);
            let retry_budget = self
                .budgets
                .entry(pc.name.clone())
                .or_insert_with(|| {
                    Arc::new(RetryBudget::new(pc.retry_budget_ratio, pc.retry_budget_min))
                })
                .clone();
            let queue = (pc.max_concurrency_per_worker > 0).then(|| {
                self.queues
                    .entry(pc.name.clone())
                    .or_insert_with(|| {
                        Arc::new(AdmissionQueue::new(
                            pc.name.clone().into(),
                            pc.queue_size,
                            pc.queue_timeout,
                        ))
                    })
                    .clone()
            });
            let pool = Arc::new(PoolRuntime {
                name: Arc::from(pc.name.as_str()),
                config: pc.clone(),
                workers: workers.clone(),
                upstream_auth,
                prefix_index: prefix_index.clone(),
                retry_budget,
                queue,
                metrics: crate::telemetry::PoolMetrics::new(SharedString::from(Arc::<str>::from(
                    pc.name.as_str(),
                ))),
            });
            let spill = config.global.region.map(|_| {
                self.spill
                    .entry(pc.name.clone())
                    .or_insert_with(|| Arc::new(SpillState::new(&pc.name)))
                    .clone()
            });
            // model name → workers serving it
            let mut served: Vec<(String, Vec<Arc<Worker>>)> = Vec::new();
            if pc.models.is_empty() {
                let mut names = BTreeSet::new();
                for w in &workers {
                    names.extend(w.state.discovered_models.load().iter().cloned());
                }
                for name in names {
                    let ws = workers
                        .iter()
                        .filter(|w| w.state.discovered_models.load().contains(&name))
                        .cloned()
                        .collect();
                    served.push((name, ws));
                }
            } else {
                for m in &pc.models {
                    served.push((m.clone(), workers.clone()));
                }
            }
            // LoRA adapters: routed like models (the name seeds prefix hashes too) and
            // forwarded unchanged, since the engine serves the adapter by that name.
            for a in &pc.lora_adapters {
                served.push((a.clone(), workers.clone()));
            }
            for (model, ws) in served {
                if routes.contains_key(&model) {
                    // A discovered name already served by an earlier pool: first pool wins.
                    continue;
                }
                let build = |kind| {
                    routing::build(&routing::BuildContext {
                        kind,
                        model: &model,
                        pool: pc,
                        workers: &ws,
                        index: prefix_index.as_ref(),
                        global: &config.global,
                        spill: spill.as_ref(),
                        kv: kv.as_ref(),
                    })
                };
                let overrides = if pc.routing.allow_policy_override {
                    PolicyKind::ALL
                        .iter()
                        .copied()
                        .filter(|k| *k != pc.policy && *k != PolicyKind::Weighted)
                        .map(build)
                        .collect()
                } else {
                    Vec::new()
                };
                let model_label = SharedString::from(Arc::<str>::from(model.as_str()));
                let pool_label = SharedString::from(pool.name.clone());
                let metrics = ws
                    .iter()
                    .map(|w| {
                        let region = w
                            .labels
                            .get(crate::config::global::REGION_LABEL)
                            .map_or("unknown", String::as_str);
                        Arc::new(PairMetrics::new(
                            model_label.clone(),
                            pool_label.clone(),
                            SharedString::from(w.id.clone()),
                            crate::telemetry::labels::shared(region),
                        ))
                    })
                    .collect();
                let route = Arc::new(ModelRoute {
                    model: Arc::from(model.as_str()),
                    pool: pool.clone(),
                    policy: build(pc.policy),
                    overrides,
                    workers: ws,
                    metrics,
                });
                routes.insert(model.clone(), route.clone());
                by_pool
                    .entry(pc.name.clone())
                    .or_insert_with(|| route.clone());
                if pc.models.first() == Some(&model) {
                    for a in &pc.aliases {
                        routes.insert(a.clone(), route.clone());
                    }
                }
            }
            pools.push(pool);
        }
        let splits = config
            .global
            .splits
            .iter()
            .map(|sc| {
                let model = SharedString::from(Arc::<str>::from(sc.model.as_str()));
                let split = SplitRoute {
                    split: WeightedSplit::new(sc.targets.iter().map(|(p, w)| (p.as_str(), *w))),
                    routes: sc
                        .targets
                        .iter()
                        .map(|(p, _)| by_pool.get(p).cloned())
                        .collect(),
                    counters: sc
                        .targets
                        .iter()
                        .map(|(p, _)| {
                            let pool = SharedString::from(Arc::<str>::from(p.as_str()));
                            [false, true].map(|sticky| {
                                counter!(names::SPLIT_DECISIONS_TOTAL,
                                    names::L_MODEL => model.clone(),
                                    names::L_POOL => pool.clone(),
                                    names::L_STICKY => if sticky { "true" } else { "false" })
                            })
                        })
                        .collect(),
                };
                (sc.model.clone(), split)
            })
            .collect();
        self.current.store(Arc::new(Snapshot {
            config,
            pools,
            routes,
            by_pool,
            splits,
        }));
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
    fn aliases_and_discovered_models_route() {
        let reg = Registry::new(cfg(r#"
            [[pools]]
            name = "a"
            models = ["llama"]
            aliases = ["gpt-4o-mini"]
            workers = [{ url = "http://h:1" }]
            [[pools]]
            name = "b"
            workers = [{ url = "http://h:2" }, { url = "http://h:3" }]
        "#));
        let s = reg.snapshot();
        assert_eq!(&*s.route("gpt-4o-mini").unwrap().model, "llama");
        assert!(s.route("qwen").is_none());
        // Discovery finds qwen on h:3 only.
        let w3 = s.pools[1].workers[1].clone();
        w3.state
            .discovered_models
            .store(Arc::new(vec!["qwen".into()]));
        reg.rebuild();
        let s2 = reg.snapshot();
        let r = s2.route("qwen").unwrap();
        assert_eq!(r.workers.len(), 1);
        assert_eq!(&*r.workers[0].id, "http://h:3");
        // The live state survived the rebuild.
        assert!(Arc::ptr_eq(&r.workers[0].state, &w3.state));
        assert_eq!(s2.model_names(), vec!["gpt-4o-mini", "llama", "qwen"]);
    }
}
