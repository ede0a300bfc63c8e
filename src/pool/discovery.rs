//! Model discovery for pools configured without `models`: each worker's
//! `/v1/models` is read on start and then periodically; a change rebuilds the snapshot.

use super::Registry;
use crate::api::models::ModelList;
use crate::upstream::UpstreamClient;
use http_body_util::BodyExt;
use std::sync::Arc;
use std::time::Duration;

/// Spawn the discovery loop. Returns once every discovered worker has been asked once.
pub async fn spawn_model_discovery(registry: Arc<Registry>, client: UpstreamClient) {
    discover_once(&registry, &client).await;
    tokio::spawn(async move {
        loop {
            let every = registry.config().server.model_discovery_interval;
            tokio::time::sleep(every).await;
            discover_once(&registry, &client).await;
        }
    });
}

async fn discover_once(registry: &Registry, client: &UpstreamClient) {
    let snap = registry.snapshot();
    let mut changed = false;
    let mut asks = Vec::new();
    for pool in snap.pools.iter().filter(|p| p.config.models.is_empty()) {
        for w in &pool.workers {
            let w = w.clone();
            let client = client.clone();
            let auth = pool.upstream_auth.clone();
            asks.push(tokio::spawn(async move {
                let r = fetch_models(&client, &w, auth).await;
                (w, r)
            }));
        }
    }
    for a in asks {
        let Ok((w, r)) = a.await else { continue };
        match r {
            Ok(mut models) => {
                if w.state.discovery_error.swap(None).is_some() {
                    tracing::info!(worker = %w.id, "model discovery works again");
                }
                models.sort();
                if models.is_empty() {
                    tracing::warn!(worker = %w.id, "the worker's /v1/models lists no model");
                }
                if **w.state.discovered_models.load() != models {
                    tracing::info!(worker = %w.id, ?models, "discovered models");
                    w.state.discovered_models.store(Arc::new(models));
                    changed = true;
                }
            }
            Err(e) => note_failure(&w, format!("{e:#}")),
        }
    }
    if changed {
        registry.rebuild();
    }
}

/// Keep a failed discovery's reason on the worker (for `/ready`'s explanation);
/// warn once per new reason rather than on every retry.
fn note_failure(w: &super::Worker, reason: String) {
    let same = w
        .state
        .discovery_error
        .load()
        .as_deref()
        .is_some_and(|r| *r == reason);
    if !same {
        tracing::warn!(worker = %w.id, error = %reason, "model discovery failed: the worker's models are not served until it answers /v1/models");
        w.state.discovery_error.store(Some(Arc::new(reason)));
    }
}

async fn fetch_models(
    client: &UpstreamClient,
    w: &super::Worker,
    auth: Option<http::HeaderValue>,
) -> anyhow::Result<Vec<String>> {
    Ok(fetch_cards(client, w, auth)
        .await?
        .into_iter()
        .map(|m| m.id)
        .collect())
}

/// A worker's `GET /v1/models` cards (with the engine's metadata).
pub async fn fetch_cards(
    client: &UpstreamClient,
    w: &super::Worker,
    auth: Option<http::HeaderValue>,
) -> anyhow::Result<Vec<crate::api::models::ModelCard>> {
    let uri = format!("{}/v1/models", w.id);
    let mut req = http::Request::get(uri).body(Default::default())?;
    if let Some(a) = auth {
        req.headers_mut().insert(http::header::AUTHORIZATION, a);
    }
    let resp = tokio::time::timeout(Duration::from_secs(5), client.request(req)).await??;
    if !resp.status().is_success() {
        anyhow::bail!("status {}", resp.status());
    }
    let body = tokio::time::timeout(Duration::from_secs(5), resp.into_body().collect())
        .await??
        .to_bytes();
    let list: ModelList = serde_json::from_slice(&body)?;
    Ok(list.data)
}
