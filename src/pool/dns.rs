//! DNS discovery: a pool's `dns.name` is re-resolved periodically and every address
//! becomes a worker `http://ADDR:port` (headless Kubernetes services, Consul DNS).
//! Workers that keep their address keep their live state.

use super::Registry;
use crate::config::WorkerConfig;
use std::collections::BTreeSet;
use std::sync::Arc;

/// Start one resolver task per pool with a `dns` section (re-read on each tick so
/// reloads are picked up).
pub fn spawn_dns_discovery(registry: Arc<Registry>) {
    tokio::spawn(async move {
        loop {
            let config = registry.config();
            let mut every = std::time::Duration::from_secs(5);
            for pool in &config.pools {
                let Some(dns) = &pool.dns else { continue };
                every = every.min(dns.interval);
                match resolve(&dns.name, dns.port).await {
                    Ok(addrs) => {
                        let workers = addrs
                            .into_iter()
                            .map(|a| WorkerConfig {
                                url: format!("http://{a}"),
                                labels: dns.labels.clone(),
                                price_per_mtok: 0.0,
                                kv_events: None,
                            })
                            .collect();
                        registry.set_discovered_workers(&pool.name, "dns", workers);
                    }
                    // Keep the last known set: a DNS hiccup must not empty a pool.
                    Err(e) => {
                        tracing::warn!(pool = %pool.name, name = %dns.name, error = %e, "DNS resolution failed")
                    }
                }
            }
            tokio::time::sleep(every).await;
        }
    });
}

async fn resolve(name: &str, port: u16) -> std::io::Result<BTreeSet<std::net::SocketAddr>> {
    Ok(tokio::net::lookup_host((name, port)).await?.collect())
}
