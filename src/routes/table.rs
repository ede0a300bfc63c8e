//! The snapshot of routes and the table that rebuilds it.

use crate::config::{Config, PolicyKind, PoolConfig, Residency};
use crate::pool::{PoolRuntime, PoolSet, Registry, Worker};
use crate::routing::{self, Policy, PrefixIndex, SpillState, WeightedSplit};
use crate::telemetry::{names, PairMetrics};
use arc_swap::ArcSwap;
use dashmap::DashMap;
use metrics::{counter, gauge, Counter, SharedString};
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

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
    /// A snapshot with no route yet.
    fn empty(config: Arc<Config>) -> Snapshot {
        Snapshot {
            config,
            pools: Vec::new(),
            routes: HashMap::new(),
            by_pool: HashMap::new(),
            splits: HashMap::new(),
        }
    }

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

    /// Whether a caller whose permission is `allows` (a configured model name)
    /// may use the served `name`: its model, or every target of a split.
    pub fn usable_by(&self, name: &str, allows: impl Fn(&str) -> bool) -> bool {
        if let Some(r) = self.routes.get(name) {
            return allows(&r.model);
        }
        self.splits.get(name).is_some_and(|s| {
            s.routes
                .iter()
                .all(|r| r.as_ref().is_some_and(|r| allows(&r.model)))
        })
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

/// Keeps the current [`Snapshot`] in step with the registry's pool set, and the
/// routing state that outlives rebuilds (prefix indexes, locality spill).
pub struct RouteTable {
    current: ArcSwap<Snapshot>,
    /// Prefix index per pool name.
    indexes: DashMap<Arc<str>, Arc<PrefixIndex>>,
    /// Locality spill state per pool name (its hysteresis).
    spill: DashMap<String, Arc<SpillState>>,
}

impl RouteTable {
    /// A table following `registry`: rebuilt, before the change returns, each
    /// time the pools change.
    pub fn follow(registry: &Registry) -> Arc<RouteTable> {
        let table = Arc::new(RouteTable {
            current: ArcSwap::from_pointee(Snapshot::empty(registry.config())),
            indexes: DashMap::new(),
            spill: DashMap::new(),
        });
        let weak = Arc::downgrade(&table);
        registry.subscribe(move |set| {
            if let Some(t) = weak.upgrade() {
                t.rebuild(set);
            }
        });
        table
    }

    /// The current snapshot (cheap; no lock).
    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.current.load_full()
    }

    fn rebuild(&self, set: &PoolSet) {
        let config = set.config.clone();
        self.indexes
            .retain(|name, _| config.pools.iter().any(|pc| *pc.name == **name));
        let mut routes: HashMap<String, Arc<ModelRoute>> = HashMap::new();
        let mut by_pool: HashMap<String, Arc<ModelRoute>> = HashMap::new();
        for pool in &set.pools {
            self.pool_routes(pool, &config, &mut routes, &mut by_pool);
        }
        let splits = splits(&config, &by_pool);
        self.current.store(Arc::new(Snapshot {
            config,
            pools: set.pools.clone(),
            routes,
            by_pool,
            splits,
        }));
    }

    /// The pool's prefix index (kept across rebuilds), when its policy or an
    /// allowed override uses one.
    fn index(&self, pc: &PoolConfig, workers: &[Arc<Worker>]) -> Option<Arc<PrefixIndex>> {
        routing::needs_index(pc).then(|| {
            let ix = self
                .indexes
                .entry(Arc::from(pc.name.as_str()))
                .or_insert_with(|| Arc::new(PrefixIndex::new(pc.routing.index_max_blocks)))
                .clone();
            ix.set_max_pairs(pc.routing.index_max_blocks);
            ix.set_workers(&workers.iter().map(|w| w.id.clone()).collect::<Vec<_>>());
            ix
        })
    }

    /// Add the routes of `pool`'s models, aliases and adapters (a name an
    /// earlier pool serves stays with it).
    fn pool_routes(
        &self,
        pool: &Arc<PoolRuntime>,
        config: &Config,
        routes: &mut HashMap<String, Arc<ModelRoute>>,
        by_pool: &mut HashMap<String, Arc<ModelRoute>>,
    ) {
        let pc = &pool.config;
        let parts = RouteParts {
            pool,
            config,
            index: self.index(pc, &pool.workers),
            spill: config.global.region.map(|_| {
                self.spill
                    .entry(pc.name.clone())
                    .or_insert_with(|| Arc::new(SpillState::new(&pc.name)))
                    .clone()
            }),
        };
        for (model, ws) in served(pool) {
            if routes.contains_key(&model) {
                // A discovered name already served by an earlier pool: first pool wins.
                continue;
            }
            let route = Arc::new(parts.route(&model, ws));
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
    }

    /// Set the prefix-index gauges.
    pub fn refresh_gauges(&self) {
        for ix in self.indexes.iter() {
            let pool = SharedString::from(ix.key().clone());
            let m = ix.memory();
            gauge!(names::PREFIX_INDEX_ENTRIES, names::L_POOL => pool.clone())
                .set(m.entries as f64);
            gauge!(names::PREFIX_INDEX_PAIRS, names::L_POOL => pool.clone()).set(m.pairs as f64);
            gauge!(names::PREFIX_INDEX_BYTES, names::L_POOL => pool.clone()).set(m.bytes as f64);
            counter!(names::PREFIX_INDEX_EVICTIONS_TOTAL, names::L_POOL => pool)
                .absolute(m.evictions);
        }
    }
}

/// Model name → the workers of `pool` serving it: the configured models (or
/// those its workers list, when none is configured) and its LoRA adapters,
/// which are routed like models (the name seeds prefix hashes too) and
/// forwarded unchanged, since the engine serves an adapter by its name.
fn served(pool: &PoolRuntime) -> Vec<(String, Vec<Arc<Worker>>)> {
    let (pc, workers) = (&pool.config, &pool.workers);
    let mut served: Vec<(String, Vec<Arc<Worker>>)> = Vec::new();
    if pc.models.is_empty() {
        let mut names = BTreeSet::new();
        for w in workers {
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
        served.extend(pc.models.iter().map(|m| (m.clone(), workers.clone())));
    }
    served.extend(
        pc.lora_adapters
            .iter()
            .map(|a| (a.clone(), workers.clone())),
    );
    served
}

/// What every route of one pool is built from.
struct RouteParts<'a> {
    pool: &'a Arc<PoolRuntime>,
    config: &'a Config,
    index: Option<Arc<PrefixIndex>>,
    spill: Option<Arc<SpillState>>,
}

impl RouteParts<'_> {
    /// The route of `model` over `workers`: the pool's policy, the allowed
    /// overrides, and metric handles per worker.
    fn route(&self, model: &str, workers: Vec<Arc<Worker>>) -> ModelRoute {
        let pc = &self.pool.config;
        let build = |kind| {
            routing::build(&routing::BuildContext {
                kind,
                model,
                pool: pc,
                workers: &workers,
                index: self.index.as_ref(),
                global: &self.config.global,
                spill: self.spill.as_ref(),
                kv: self.pool.kv.as_ref(),
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
        let model_label = SharedString::from(Arc::<str>::from(model));
        let pool_label = SharedString::from(self.pool.name.clone());
        let metrics = workers
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
        ModelRoute {
            model: Arc::from(model),
            pool: self.pool.clone(),
            policy: build(pc.policy),
            overrides,
            workers,
            metrics,
        }
    }
}

/// The split model names (`[[splits]]`) and the route of each target.
fn splits(
    config: &Config,
    by_pool: &HashMap<String, Arc<ModelRoute>>,
) -> HashMap<String, SplitRoute> {
    config
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
        .collect()
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
        let table = RouteTable::follow(&reg);
        let s = table.snapshot();
        assert_eq!(&*s.route("gpt-4o-mini").unwrap().model, "llama");
        assert!(s.route("qwen").is_none());
        // Discovery finds qwen on h:3 only.
        let w3 = s.pools[1].workers[1].clone();
        w3.state
            .discovered_models
            .store(Arc::new(vec!["qwen".into()]));
        reg.rebuild();
        let s2 = table.snapshot();
        let r = s2.route("qwen").unwrap();
        assert_eq!(r.workers.len(), 1);
        assert_eq!(&*r.workers[0].id, "http://h:3");
        // The live state survived the rebuild.
        assert!(Arc::ptr_eq(&r.workers[0].state, &w3.state));
        assert_eq!(s2.model_names(), vec!["gpt-4o-mini", "llama", "qwen"]);
    }
}
