//! Where workers may point, applied where they enter at run time: the admin
//! API ([`admit_admin_worker`]) and discovery (`Registry::keep_allowed`, on
//! every list DNS or Kubernetes hands over). The rules and the normalisation
//! are `config::worker_url`'s, the same the config file's workers pass.

use super::Registry;
use crate::config::worker_url::{AddressRules, Host, Origin, WorkerUrl};
use crate::config::WorkerConfig;
use crate::telemetry::names;
use std::net::SocketAddr;
use std::time::Duration;

/// How long the admin API waits for a worker name to resolve.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(2);

impl Registry {
    /// Record one of the gateway's own listener addresses (as bound, so an
    /// ephemeral port is known): workers pointing there are refused.
    pub fn note_listener(&self, addr: SocketAddr) {
        self.own.lock().push(addr);
    }

    /// Check `url` against the current rules for `origin`.
    fn check_worker(
        &self,
        url: &WorkerUrl,
        ip: Option<std::net::IpAddr>,
        origin: Origin,
    ) -> Result<(), String> {
        let own = self.own.lock().clone();
        let config = self.config();
        let rules = AddressRules {
            allow_link_local: config.server.allow_link_local_workers,
            allow_admin_loopback: config
                .admin
                .as_ref()
                .is_some_and(|a| a.allow_loopback_workers),
            own: &own,
        };
        match ip {
            Some(ip) => url.check_resolved(ip, origin, &rules),
            None => url.check(origin, &rules),
        }
    }

    /// The discovered workers that pass the rules; each refused one is logged
    /// and counted (`source`: `dns`, `k8s`).
    pub(super) fn keep_allowed(
        &self,
        source: &str,
        workers: Vec<WorkerConfig>,
    ) -> Vec<WorkerConfig> {
        workers
            .into_iter()
            .filter(|w| {
                let checked = WorkerUrl::parse(&w.url)
                    .and_then(|u| self.check_worker(&u, None, Origin::Discovery));
                if let Err(e) = &checked {
                    refused(source);
                    tracing::warn!(source, error = %e, "discovered worker refused");
                }
                checked.is_ok()
            })
            .collect()
    }
}

fn refused(source: &str) {
    let source = match source {
        "dns" => "dns",
        "k8s" => "k8s",
        "admin" => "admin",
        _ => "other",
    };
    metrics::counter!(names::WORKER_ADDRESS_REFUSALS_TOTAL, names::L_SOURCE => source).increment(1);
}

/// A worker URL sent to `POST /admin/workers`, normalised and checked; a name
/// is resolved and every address it has must pass too (a name pointing at the
/// metadata service or the gateway is refused like the address). The error
/// names the rule.
pub async fn admit_admin_worker(registry: &Registry, raw: &str) -> Result<WorkerUrl, String> {
    let result = admit(registry, raw).await;
    if result.is_err() {
        refused("admin");
    }
    result
}

async fn admit(registry: &Registry, raw: &str) -> Result<WorkerUrl, String> {
    let url = WorkerUrl::parse(raw)?;
    registry.check_worker(&url, None, Origin::Admin)?;
    let Host::Name(name) = &url.host else {
        return Ok(url);
    };
    let lookup = tokio::net::lookup_host((name.as_str(), url.port));
    let addrs = match tokio::time::timeout(RESOLVE_TIMEOUT, lookup).await {
        Ok(Ok(addrs)) => addrs.collect::<Vec<_>>(),
        Ok(Err(e)) => return Err(format!("`{}`: the name does not resolve ({e}), so its addresses cannot be checked", url.url)),
        Err(_) => return Err(format!("`{}`: the name did not resolve within {RESOLVE_TIMEOUT:?}, so its addresses cannot be checked", url.url)),
    };
    for a in addrs {
        registry.check_worker(&url, Some(a.ip()), Origin::Admin)?;
    }
    Ok(url)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker(url: &str) -> WorkerConfig {
        WorkerConfig {
            url: url.into(),
            labels: Default::default(),
            price_per_mtok: 0.0,
            kv_events: None,
        }
    }

    fn registry(server_lines: &str) -> std::sync::Arc<Registry> {
        let text = format!(
            "[server]\nlisten = \"0.0.0.0:18080\"\n{server_lines}\n[[pools]]\nname = \"p\"\nmodels = [\"m\"]\nworkers = [{{ url = \"http://10.0.0.1:8000\" }}]\n"
        );
        Registry::new(crate::config::parse(&text).unwrap().validate().unwrap())
    }

    fn urls(reg: &Registry) -> Vec<String> {
        reg.snapshot().workers().map(|w| w.id.to_string()).collect()
    }

    #[test]
    fn discovery_keeps_only_addresses_the_rules_allow() {
        let reg = registry("");
        reg.note_listener("127.0.0.1:41000".parse().unwrap());
        let found = [
            "http://169.254.169.254:8000",
            "http://[fe80::1]:8000",
            "http://127.0.0.1:18080",
            "http://127.0.0.1:41000",
            "http://10.0.0.2:8000",
            "http://127.0.0.1:8001",
        ];
        reg.set_discovered_workers("p", "dns", found.iter().map(|u| worker(u)).collect());
        assert_eq!(
            urls(&reg),
            [
                "http://10.0.0.1:8000",
                "http://10.0.0.2:8000",
                "http://127.0.0.1:8001"
            ]
        );
        // The operator may allow link-local workers; the own listeners stay refused.
        let reg = registry("allow_link_local_workers = true");
        reg.set_discovered_workers("p", "k8s", found.iter().map(|u| worker(u)).collect());
        assert_eq!(urls(&reg).len(), 6, "{:?}", urls(&reg));
        assert!(!urls(&reg).iter().any(|u| u.ends_with(":18080")));
    }
}
