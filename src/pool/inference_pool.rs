//! Gateway API Inference Extension discovery. A pool's `kubernetes.inference_pool`
//! names an `InferencePool` (`inference.networking.k8s.io/v1`) in its namespace;
//! the object's `spec.selector.matchLabels` and `spec.targetPorts[0].number` say
//! which pods serve and on which port. The object is watched: when its target
//! changes, the pod watcher (`k8s::watch_pods`) restarts with the new selector
//! and port; when it is deleted, the pool empties; when it names no usable
//! target, the last one is kept and a warning logged.

use super::k8s::{watch_pods, Backoff, BACKOFF_FIRST, BACKOFF_MAX, SOURCE};
use super::Registry;
use crate::config::KubernetesConfig;
use futures_util::StreamExt;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::watcher::{self, Event};
use serde_json::Value;
use std::collections::BTreeMap;
use std::sync::Weak;
use tokio::task::JoinHandle;

pub const GROUP: &str = "inference.networking.k8s.io";
pub const VERSION: &str = "v1";
pub const KIND: &str = "InferencePool";
pub const PLURAL: &str = "inferencepools";

/// Which pods an InferencePool selects, and their port.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    /// `matchLabels` as a label selector, `k=v` terms in key order.
    pub selector: String,
    pub port: u16,
}

/// The target an InferencePool's `spec` names, or why it names none.
pub fn target(spec: &Value) -> Result<Target, String> {
    let labels: BTreeMap<&str, &str> = spec
        .pointer("/selector/matchLabels")
        .and_then(Value::as_object)
        .ok_or("spec.selector.matchLabels is missing")?
        .iter()
        .map(|(k, v)| Some((k.as_str(), v.as_str()?)))
        .collect::<Option<_>>()
        .ok_or("spec.selector.matchLabels has a value that is not a string")?;
    if labels.is_empty() {
        return Err("spec.selector.matchLabels is empty".into());
    }
    let port = spec
        .pointer("/targetPorts/0/number")
        .and_then(Value::as_u64)
        .and_then(|n| u16::try_from(n).ok())
        .filter(|&n| n > 0)
        .ok_or("spec.targetPorts[0].number is missing or not a port")?;
    let selector = labels
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",");
    Ok(Target { selector, port })
}

/// What one watch event means for the named pool object.
#[derive(Debug, PartialEq)]
enum Change {
    Set(Result<Target, String>),
    Gone,
}

/// Follows the named object through watch events; `listed` tracks whether a
/// re-list has seen it (a re-list without it means it was deleted meanwhile).
struct Tracker {
    name: String,
    listed: bool,
}

impl Tracker {
    fn on(&mut self, ev: &Event<DynamicObject>) -> Option<Change> {
        let ours = |o: &DynamicObject| o.metadata.name.as_deref() == Some(self.name.as_str());
        match ev {
            Event::Init => {
                self.listed = false;
                None
            }
            Event::InitApply(o) | Event::Apply(o) if ours(o) => {
                self.listed = true;
                let spec = o.data.get("spec").cloned().unwrap_or(Value::Null);
                Some(Change::Set(target(&spec)))
            }
            Event::Delete(o) if ours(o) => Some(Change::Gone),
            Event::InitDone if !self.listed => Some(Change::Gone),
            _ => None,
        }
    }
}

/// The running pod watcher, aborted when replaced or dropped (the supervisor
/// aborting this pool's task drops it).
struct PodWatch {
    target: Target,
    task: JoinHandle<()>,
}

impl Drop for PodWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Watch the InferencePool `name` and keep a pod watcher on its target.
pub async fn watch(
    registry: Weak<Registry>,
    pool: String,
    cfg: KubernetesConfig,
    client: kube::Client,
    name: String,
) {
    let ar =
        ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(GROUP, VERSION, KIND), PLURAL);
    let api: kube::Api<DynamicObject> =
        kube::Api::namespaced_with(client.clone(), &cfg.namespace, &ar);
    let mut events = watcher::watcher(api, watcher::Config::default()).boxed();
    let mut tracker = Tracker {
        name,
        listed: false,
    };
    let mut pods: Option<PodWatch> = None;
    let mut backoff = Backoff::new(BACKOFF_FIRST, BACKOFF_MAX);
    while let Some(ev) = events.next().await {
        let ev = match ev {
            Ok(ev) => ev,
            Err(e) => {
                let delay = backoff.next_delay();
                tracing::warn!(pool = %pool, error = %e, retry_in = ?delay, "inferencepool watch failed");
                tokio::time::sleep(delay).await;
                continue;
            }
        };
        backoff.reset();
        match tracker.on(&ev) {
            Some(Change::Set(Ok(t))) if pods.as_ref().map(|p| &p.target) != Some(&t) => {
                tracing::info!(pool = %pool, inference_pool = %tracker.name, selector = %t.selector, port = t.port, "inferencepool target");
                let pod_cfg = KubernetesConfig {
                    label_selector: Some(t.selector.clone()),
                    port: Some(t.port),
                    ..cfg.clone()
                };
                let task = tokio::spawn(watch_pods(
                    registry.clone(),
                    pool.clone(),
                    pod_cfg,
                    client.clone(),
                ));
                pods = Some(PodWatch { target: t, task });
            }
            Some(Change::Set(Err(why))) => {
                tracing::warn!(pool = %pool, inference_pool = %tracker.name, %why, "inferencepool names no usable target; keeping the last one");
            }
            Some(Change::Gone) if pods.is_some() => {
                tracing::warn!(pool = %pool, inference_pool = %tracker.name, "inferencepool is gone; the pool has no workers");
                pods = None;
                if let Some(r) = registry.upgrade() {
                    r.set_discovered_workers(&pool, SOURCE, Vec::new());
                }
            }
            _ => {}
        }
        if registry.strong_count() == 0 {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn object(name: &str, spec: Value) -> DynamicObject {
        serde_json::from_value(json!({
            "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": name, "namespace": "ns"}, "spec": spec
        }))
        .unwrap()
    }

    #[test]
    fn the_target_is_the_sorted_match_labels_and_the_first_port() {
        let spec = json!({"selector": {"matchLabels": {"tier": "gpu", "app": "vllm"}},
                          "targetPorts": [{"number": 8000}],
                          "endpointPickerRef": {"name": "switchyard-epp"}});
        assert_eq!(
            target(&spec),
            Ok(Target {
                selector: "app=vllm,tier=gpu".into(),
                port: 8000
            })
        );
        for bad in [
            json!({"targetPorts": [{"number": 8000}]}),
            json!({"selector": {"matchLabels": {}}, "targetPorts": [{"number": 8000}]}),
            json!({"selector": {"matchLabels": {"app": "x"}}, "targetPorts": []}),
            json!({"selector": {"matchLabels": {"app": "x"}}, "targetPorts": [{"number": 70000}]}),
        ] {
            assert!(target(&bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_tracker_follows_only_the_named_pool_and_notices_a_silent_deletion() {
        let spec =
            json!({"selector": {"matchLabels": {"app": "a"}}, "targetPorts": [{"number": 1}]});
        let mut t = Tracker {
            name: "mine".into(),
            listed: false,
        };
        assert_eq!(t.on(&Event::Init), None);
        assert_eq!(t.on(&Event::InitApply(object("other", spec.clone()))), None);
        assert!(matches!(
            t.on(&Event::InitApply(object("mine", spec.clone()))),
            Some(Change::Set(Ok(_)))
        ));
        assert_eq!(t.on(&Event::InitDone), None);
        assert_eq!(
            t.on(&Event::Delete(object("mine", spec.clone()))),
            Some(Change::Gone)
        );
        // A re-list that no longer has it: deleted while the watch was down.
        t.on(&Event::Init);
        assert_eq!(t.on(&Event::InitDone), Some(Change::Gone));
    }
}
