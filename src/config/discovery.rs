//! `[pools.dns]` and `[pools.kubernetes]`: workers a pool discovers rather than
//! lists (see `pool/dns.rs` and `pool/k8s.rs`).

use super::key::Key;
use super::pools::check_role;
use super::problems::Problems;
use super::{ms, normalize_worker_url, RawDns, RawKubernetes};
use std::collections::BTreeMap;
use std::time::Duration;

/// Default DNS re-resolution interval (ms).
pub const DEFAULT_DNS_INTERVAL_MS: u64 = 5_000;

/// Workers discovered by resolving a DNS name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DnsConfig {
    pub name: String,
    pub port: u16,
    pub interval: Duration,
    pub labels: BTreeMap<String, String>,
}

/// Workers discovered from Kubernetes pods (see `pool/k8s.rs`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KubernetesConfig {
    pub namespace: String,
    pub label_selector: Option<String>,
    /// Fallback port when the pod has no (valid) `port_annotation`.
    pub port: Option<u16>,
    pub port_annotation: Option<String>,
    /// Pod label → worker label.
    pub label_map: BTreeMap<String, String>,
    /// `None`: `kube::Config::infer()` (in-cluster service account, then kubeconfig).
    pub api_url: Option<String>,
    /// An `InferencePool` whose selector and target port are watched and used
    /// instead of `label_selector` and `port` (`port_annotation` still wins).
    pub inference_pool: Option<String>,
}

/// `[pools.dns]`.
pub(super) fn validate_dns(
    d: RawDns,
    key: &Key,
    disaggregated: bool,
    p: &mut Problems,
) -> DnsConfig {
    if disaggregated {
        check_role(&key.field("labels"), &d.labels, p);
    }
    if d.name.is_empty() {
        p.push(format!("{}: must not be empty", key.field("name")));
    }
    if d.port == 0 {
        p.push(format!("{}: must be greater than 0", key.field("port")));
    }
    DnsConfig {
        name: d.name,
        port: d.port,
        interval: ms(
            p,
            &key.field("interval_ms"),
            d.interval_ms,
            DEFAULT_DNS_INTERVAL_MS,
        ),
        labels: d.labels,
    }
}

/// `[pools.kubernetes]`.
pub(super) fn validate_kubernetes(
    k: RawKubernetes,
    key: &Key,
    p: &mut Problems,
) -> KubernetesConfig {
    if k.namespace.is_empty() {
        p.push(format!("{}: must not be empty", key.field("namespace")));
    }
    if k.port == Some(0) {
        p.push(format!("{}: must be greater than 0", key.field("port")));
    }
    if k.port.is_none() && k.port_annotation.is_none() && k.inference_pool.is_none() {
        p.push(format!(
            "{key}: set `port`, `port_annotation`, or both (the annotation wins when present), or `inference_pool`"
        ));
    }
    if k.inference_pool.as_deref() == Some("") {
        p.push(format!(
            "{}: must not be empty",
            key.field("inference_pool")
        ));
    }
    if k.port_annotation.as_deref() == Some("") {
        let annotation = key.field("port_annotation");
        p.push(format!("{annotation}: must not be empty"));
    }
    for (from, to) in &k.label_map {
        if from.is_empty() || to.is_empty() {
            p.push(format!(
                "{}: empty label name in `{from}` = `{to}`",
                key.field("label_map")
            ));
        }
    }
    let api_url = k.api_url.and_then(|u| match normalize_worker_url(&u) {
        Ok(u) => Some(u),
        Err(e) => {
            p.push(format!("{}: {e}", key.field("api_url")));
            None
        }
    });
    KubernetesConfig {
        namespace: k.namespace,
        label_selector: k.label_selector.filter(|s| !s.is_empty()),
        port: k.port,
        port_annotation: k.port_annotation,
        label_map: k.label_map,
        api_url,
        inference_pool: k.inference_pool,
    }
}

#[cfg(test)]
mod tests {
    use crate::config::tests::check;

    #[test]
    fn kubernetes_section_is_enough_for_a_pool() {
        let c = check(
            r#"
            [[pools]]
            models = ["m"]
            [pools.kubernetes]
            namespace = "inference"
            label_selector = "app=vllm"
            port_annotation = "switchyard.io/port"
            label_map = { "topology.kubernetes.io/region" = "region" }
            api_url = "http://127.0.0.1:6443/"
            "#,
        )
        .unwrap();
        let k = c.pools[0].kubernetes.as_ref().unwrap();
        assert_eq!(k.namespace, "inference");
        assert_eq!(k.port, None);
        assert_eq!(k.api_url.as_deref(), Some("http://127.0.0.1:6443"));
        assert_eq!(k.label_map["topology.kubernetes.io/region"], "region");
    }

    #[test]
    fn kubernetes_rejections_name_the_key() {
        let e = check(
            r#"
            [[pools]]
            models = ["m"]
            [pools.kubernetes]
            namespace = ""
            api_url = "ftp://x"
            label_map = { "a" = "" }
            "#,
        )
        .unwrap_err()
        .to_string();
        for needle in [
            "pools[0].kubernetes.namespace: must not be empty",
            "pools[0].kubernetes: set `port`, `port_annotation`",
            "pools[0].kubernetes.api_url",
            "pools[0].kubernetes.label_map",
        ] {
            assert!(e.contains(needle), "missing `{needle}` in:\n{e}");
        }
        let e =
            check("[[pools]]\nmodels = [\"m\"]\n[pools.kubernetes]\nnamespace = \"n\"\nprot = 1\n")
                .unwrap_err()
                .to_string();
        assert!(e.contains("prot"), "{e}");
        let e = check(
            "[[pools]]\nmodels = [\"m\"]\n[pools.kubernetes]\nnamespace = \"n\"\ninference_pool = \"\"\n",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("pools[0].kubernetes.inference_pool: must not be empty"),
            "{e}"
        );
    }

    #[test]
    fn an_inference_pool_stands_in_for_the_port() {
        let c = check(
            "[[pools]]\nmodels = [\"m\"]\n[pools.kubernetes]\nnamespace = \"n\"\ninference_pool = \"llama\"\n",
        )
        .unwrap();
        let k = c.pools[0].kubernetes.as_ref().unwrap();
        assert_eq!(k.inference_pool.as_deref(), Some("llama"));
    }
}
