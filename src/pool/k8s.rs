//! Kubernetes discovery: for each pool with a `kubernetes` section, watch the pods
//! matching its label selector in its namespace (kube-runtime's watcher: list, then
//! watch from that resource version, re-list when the server says so). Every Ready,
//! non-terminating pod with an IP becomes `http://POD_IP:PORT`; mapped pod labels
//! become worker labels. Watch errors keep the last known set and retry with backoff.
//!
//! A supervisor re-reads the config every second, so a reload that adds, changes or
//! removes a pool's `kubernetes` section starts, restarts or stops its watcher.

use super::Registry;
use crate::config::{KubernetesConfig, WorkerConfig};
use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher::{self, Event};
use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Weak};
use std::time::Duration;
use tokio::task::JoinHandle;

/// Discovery source name passed to [`Registry::set_discovered_workers`].
pub const SOURCE: &str = "k8s";
/// How often the supervisor looks for added, changed or removed sections.
const SUPERVISE_EVERY: Duration = Duration::from_secs(1);
/// Retry delays after a watch error: doubles from the first to the last, reset on success.
pub(super) const BACKOFF_FIRST: Duration = Duration::from_millis(200);
pub(super) const BACKOFF_MAX: Duration = Duration::from_secs(30);

/// Start the supervisor. It holds the registry weakly and stops with it.
pub fn spawn_k8s_discovery(registry: &Arc<Registry>) {
    let weak = Arc::downgrade(registry);
    tokio::spawn(async move {
        let mut running: HashMap<String, (KubernetesConfig, JoinHandle<()>)> = HashMap::new();
        loop {
            let Some(registry) = weak.upgrade() else {
                break;
            };
            let config = registry.config();
            drop(registry);
            let wanted: HashMap<&str, &KubernetesConfig> = config
                .pools
                .iter()
                .filter_map(|p| Some((p.name.as_str(), p.kubernetes.as_ref()?)))
                .collect();
            running.retain(|pool, (cfg, task)| {
                let keep = wanted.get(pool.as_str()) == Some(&&*cfg);
                if !keep {
                    task.abort();
                    if let Some(r) = weak.upgrade() {
                        r.set_discovered_workers(pool, SOURCE, Vec::new());
                    }
                }
                keep
            });
            for (pool, cfg) in wanted {
                if !running.contains_key(pool) {
                    let task = tokio::spawn(watch_pool(weak.clone(), pool.into(), cfg.clone()));
                    running.insert(pool.into(), (cfg.clone(), task));
                }
            }
            tokio::time::sleep(SUPERVISE_EVERY).await;
        }
        for (_, (_, task)) in running {
            task.abort();
        }
    });
}

async fn client(cfg: &KubernetesConfig) -> anyhow::Result<kube::Client> {
    let mut kc = match &cfg.api_url {
        Some(url) => kube::Config::new(url.parse()?),
        None => kube::Config::infer().await?,
    };
    kc.default_namespace = cfg.namespace.clone();
    Ok(kube::Client::try_from(kc)?)
}

/// One pool's watcher: runs until aborted by the supervisor or the registry is
/// gone. With an `inference_pool`, the pool's selector and port come from it.
async fn watch_pool(registry: Weak<Registry>, pool: String, cfg: KubernetesConfig) {
    let client = connect(&pool, &cfg).await;
    match cfg.inference_pool.clone() {
        Some(name) => {
            super::inference_pool::watch(registry, pool, cfg, client, name).await;
        }
        None => watch_pods(registry, pool, cfg, client).await,
    }
}

/// A client for `cfg`'s API server, retried with backoff until it can be built.
async fn connect(pool: &str, cfg: &KubernetesConfig) -> kube::Client {
    let mut backoff = Backoff::new(BACKOFF_FIRST, BACKOFF_MAX);
    loop {
        match client(cfg).await {
            Ok(c) => return c,
            Err(e) => {
                tracing::warn!(pool = %pool, error = %e, "kubernetes client setup failed");
                tokio::time::sleep(backoff.next_delay()).await;
            }
        }
    }
}

/// Watch the pods `cfg` selects and hand the Ready ones to the registry.
pub(super) async fn watch_pods(
    registry: Weak<Registry>,
    pool: String,
    cfg: KubernetesConfig,
    client: kube::Client,
) {
    let mut backoff = Backoff::new(BACKOFF_FIRST, BACKOFF_MAX);
    let api: kube::Api<Pod> = kube::Api::namespaced(client, &cfg.namespace);
    let mut wc = watcher::Config::default();
    if let Some(sel) = &cfg.label_selector {
        wc = wc.labels(sel);
    }
    let mut events = watcher::watcher(api, wc).boxed();
    let mut pods = PodSet::new(cfg.clone());
    while let Some(ev) = events.next().await {
        match ev {
            Ok(ev) => {
                backoff.reset();
                if let Some(workers) = pods.apply(ev) {
                    let Some(r) = registry.upgrade() else { return };
                    tracing::info!(pool = %pool, workers = workers.len(), "kubernetes workers updated");
                    r.set_discovered_workers(&pool, SOURCE, workers);
                }
            }
            // Keep the last known set: an API-server hiccup must not empty a pool.
            // The watcher resumes from its last resource version on the next poll.
            Err(e) => {
                let delay = backoff.next_delay();
                tracing::warn!(pool = %pool, error = %e, retry_in = ?delay, "kubernetes watch failed");
                tokio::time::sleep(delay).await;
            }
        }
        if registry.strong_count() == 0 {
            return;
        }
    }
}

/// The worker a pod stands for, if it should receive traffic: Ready condition
/// true, not terminating, an IP, and a port (annotation first, then the config's).
pub fn pod_worker(pod: &Pod, cfg: &KubernetesConfig) -> Option<WorkerConfig> {
    if pod.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let status = pod.status.as_ref()?;
    let ready = status
        .conditions
        .iter()
        .flatten()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    if !ready {
        return None;
    }
    let ip: IpAddr = status.pod_ip.as_deref()?.parse().ok()?;
    let annotated = cfg.port_annotation.as_ref().and_then(|a| {
        let v = pod.metadata.annotations.as_ref()?.get(a)?;
        match v.trim().parse::<u16>() {
            Ok(p) if p > 0 => Some(p),
            _ => {
                tracing::warn!(pod = ?pod.metadata.name, annotation = %a, value = %v, "invalid port annotation");
                None
            }
        }
    });
    let port = annotated.or(cfg.port)?;
    let pod_labels = pod.metadata.labels.as_ref();
    let labels = cfg
        .label_map
        .iter()
        .filter_map(|(from, to)| Some((to.clone(), pod_labels?.get(from)?.clone())))
        .collect();
    Some(WorkerConfig {
        url: format!("http://{}", SocketAddr::new(ip, port)),
        labels,
        price_per_mtok: 0.0,
        kv_events: None,
    })
}

/// Eligible pods by name, fed with watcher events. `apply` returns the new worker
/// list when it may have changed (the registry ignores an identical list).
pub struct PodSet {
    cfg: KubernetesConfig,
    current: BTreeMap<String, WorkerConfig>,
    /// Pods listed since the last `Init`; replaces `current` on `InitDone`.
    relist: Option<BTreeMap<String, WorkerConfig>>,
    synced: bool,
}

impl PodSet {
    pub fn new(cfg: KubernetesConfig) -> PodSet {
        PodSet {
            cfg,
            current: BTreeMap::new(),
            relist: None,
            synced: false,
        }
    }

    pub fn apply(&mut self, ev: Event<Pod>) -> Option<Vec<WorkerConfig>> {
        match ev {
            Event::Init => {
                self.relist = Some(BTreeMap::new());
                None
            }
            Event::InitApply(pod) => {
                let w = pod_worker(&pod, &self.cfg);
                if let (Some(list), Some(w), Some(name)) =
                    (self.relist.as_mut(), w, pod.metadata.name)
                {
                    list.insert(name, w);
                }
                None
            }
            Event::InitDone => {
                self.current = self.relist.take().unwrap_or_default();
                self.synced = true;
                Some(self.workers())
            }
            Event::Apply(pod) => {
                let name = pod.metadata.name.clone()?;
                match pod_worker(&pod, &self.cfg) {
                    Some(w) => self.current.insert(name, w),
                    None => self.current.remove(&name),
                };
                self.synced.then(|| self.workers())
            }
            Event::Delete(pod) => {
                self.current.remove(pod.metadata.name.as_deref()?);
                self.synced.then(|| self.workers())
            }
        }
    }

    /// Workers in pod-name order, one per URL.
    pub fn workers(&self) -> Vec<WorkerConfig> {
        let mut seen = std::collections::HashSet::new();
        self.current
            .values()
            .filter(|w| seen.insert(w.url.clone()))
            .cloned()
            .collect()
    }
}

/// Exponential backoff with full doubling and a cap; pure, so tests need no clock.
pub(super) struct Backoff {
    first: Duration,
    max: Duration,
    next: Duration,
}

impl Backoff {
    pub(super) fn new(first: Duration, max: Duration) -> Backoff {
        Backoff {
            first,
            max,
            next: first,
        }
    }

    pub(super) fn next_delay(&mut self) -> Duration {
        let d = self.next;
        self.next = (self.next * 2).min(self.max);
        d
    }

    pub(super) fn reset(&mut self) {
        self.next = self.first;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn cfg() -> KubernetesConfig {
        KubernetesConfig {
            namespace: "ns".into(),
            label_selector: Some("app=vllm".into()),
            port: Some(8000),
            port_annotation: Some("switchyard.io/port".into()),
            label_map: [
                (
                    "topology.kubernetes.io/region".to_string(),
                    "region".to_string(),
                ),
                ("switchyard.io/role".to_string(), "role".to_string()),
            ]
            .into(),
            api_url: None,
            inference_pool: None,
        }
    }

    fn pod(name: &str, ip: Option<&str>, ready: bool, extra: serde_json::Value) -> Pod {
        let mut v = json!({
            "metadata": {"name": name, "namespace": "ns",
                         "labels": {"app": "vllm", "topology.kubernetes.io/region": "eu",
                                    "switchyard.io/role": "decode", "other": "x"}},
            "status": {"conditions": [{"type": "Ready", "status": if ready {"True"} else {"False"}}]}
        });
        if let Some(ip) = ip {
            v["status"]["podIP"] = json!(ip);
        }
        if let serde_json::Value::Object(m) = extra {
            for (k, x) in m {
                v["metadata"][k] = x;
            }
        }
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn ready_pod_maps_to_worker_with_mapped_labels() {
        let w = pod_worker(&pod("a", Some("10.0.0.5"), true, json!({})), &cfg()).unwrap();
        assert_eq!(w.url, "http://10.0.0.5:8000");
        assert_eq!(w.labels.len(), 2, "{:?}", w.labels);
        assert_eq!(w.labels["region"], "eu");
        assert_eq!(w.labels["role"], "decode");
    }

    #[test]
    fn unready_ipless_and_terminating_pods_are_not_workers() {
        let c = cfg();
        assert!(pod_worker(&pod("a", Some("10.0.0.5"), false, json!({})), &c).is_none());
        assert!(pod_worker(&pod("a", None, true, json!({})), &c).is_none());
        let terminating = pod(
            "a",
            Some("10.0.0.5"),
            true,
            json!({"deletionTimestamp": "2026-01-01T00:00:00Z"}),
        );
        assert!(pod_worker(&terminating, &c).is_none());
    }

    #[test]
    fn port_annotation_wins_then_falls_back_and_ipv6_is_bracketed() {
        let c = cfg();
        let a = json!({"annotations": {"switchyard.io/port": "9001"}});
        assert_eq!(
            pod_worker(&pod("a", Some("10.0.0.5"), true, a), &c)
                .unwrap()
                .url,
            "http://10.0.0.5:9001"
        );
        let bad = json!({"annotations": {"switchyard.io/port": "http"}});
        assert_eq!(
            pod_worker(&pod("a", Some("fd00::5"), true, bad), &c)
                .unwrap()
                .url,
            "http://[fd00::5]:8000"
        );
        let no_fallback = KubernetesConfig { port: None, ..c };
        assert!(pod_worker(&pod("a", Some("10.0.0.5"), true, json!({})), &no_fallback).is_none());
    }

    #[test]
    fn pod_set_follows_list_and_watch_events() {
        let mut s = PodSet::new(cfg());
        assert_eq!(s.apply(Event::Init), None);
        assert_eq!(
            s.apply(Event::InitApply(pod(
                "a",
                Some("10.0.0.1"),
                true,
                json!({})
            ))),
            None
        );
        assert_eq!(
            s.apply(Event::InitApply(pod(
                "b",
                Some("10.0.0.2"),
                false,
                json!({})
            ))),
            None
        );
        let urls = |v: Vec<WorkerConfig>| v.into_iter().map(|w| w.url).collect::<Vec<_>>();
        assert_eq!(
            urls(s.apply(Event::InitDone).unwrap()),
            ["http://10.0.0.1:8000"]
        );
        // b turns ready, a stops being ready, then b is deleted.
        let b = pod("b", Some("10.0.0.2"), true, json!({}));
        assert_eq!(urls(s.apply(Event::Apply(b.clone())).unwrap()).len(), 2);
        let a = pod("a", Some("10.0.0.1"), false, json!({}));
        assert_eq!(
            urls(s.apply(Event::Apply(a)).unwrap()),
            ["http://10.0.0.2:8000"]
        );
        assert!(s.apply(Event::Delete(b)).unwrap().is_empty());
        // A re-list replaces the set wholesale (pods deleted while disconnected vanish).
        s.apply(Event::Apply(pod("c", Some("10.0.0.3"), true, json!({}))));
        s.apply(Event::Init);
        s.apply(Event::InitApply(pod(
            "d",
            Some("10.0.0.4"),
            true,
            json!({}),
        )));
        assert_eq!(
            urls(s.apply(Event::InitDone).unwrap()),
            ["http://10.0.0.4:8000"]
        );
    }

    #[test]
    fn backoff_doubles_caps_and_resets() {
        let mut b = Backoff::new(Duration::from_millis(200), Duration::from_millis(700));
        let d: Vec<u64> = (0..4).map(|_| b.next_delay().as_millis() as u64).collect();
        assert_eq!(d, [200, 400, 700, 700]);
        b.reset();
        assert_eq!(b.next_delay(), Duration::from_millis(200));
    }
}
