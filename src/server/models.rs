//! `GET /v1/models[/{id}]`: every name the gateway serves (pool models,
//! aliases, LoRA adapters, split names) with the engines' metadata. One
//! available worker per pool is asked for its `/v1/models` (concurrently,
//! bounded in time), and the lists are reused for 10 s; a pool whose worker
//! does not answer is listed with bare cards and a warning (and asked again
//! next time). Aliases name their model as `parent`; adapters their
//! pool's base model.

use super::Gateway;
use crate::api::models::{ModelCard, ModelList};
use crate::pool::discovery;
use crate::routes::Snapshot;
use crate::runtime::clock;
use arc_swap::ArcSwapOption;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// Longest wait for one worker's model list.
const FETCH_TIMEOUT: Duration = Duration::from_secs(2);
/// How long the engines' lists are reused: without it every `/v1/models` would
/// reach one worker of every pool.
const CACHE_TTL: Duration = Duration::from_secs(10);

/// The last lists fetched, and when.
#[derive(Default)]
pub(super) struct CardCache(ArcSwapOption<(Instant, Fetched)>);

impl CardCache {
    /// The cached lists, if younger than [`CACHE_TTL`] and holding every pool
    /// of `snap` that has a worker to ask.
    fn fresh(&self, snap: &Snapshot) -> Option<Arc<(Instant, Fetched)>> {
        let c = self.0.load_full()?;
        let covers = snap
            .pools
            .iter()
            .all(|p| c.1.contains_key(&*p.name) || !p.workers.iter().any(|w| w.is_available()));
        (c.0.elapsed() < CACHE_TTL && covers).then_some(c)
    }
}

/// Every served name, with metadata.
pub async fn list(gw: &Gateway) -> ModelList {
    let snap = gw.routes.snapshot();
    let cached = match gw.model_cards.fresh(&snap) {
        Some(c) => c,
        None => {
            let c = Arc::new((clock::now(), fetch(gw, &snap).await));
            gw.model_cards.0.store(Some(c.clone()));
            c
        }
    };
    let fetched = &cached.1;
    ModelList::of(
        snap.model_names()
            .into_iter()
            .map(|name| card(&snap, fetched, name))
            .collect(),
    )
}

/// Pool name → the engine's cards by id.
type Fetched = HashMap<String, HashMap<String, ModelCard>>;

async fn fetch(gw: &Gateway, snap: &Snapshot) -> Fetched {
    let asks = snap.pools.iter().filter_map(|p| {
        let w = p.workers.iter().find(|w| w.is_available())?.clone();
        let (client, auth, pool) = (gw.client.clone(), p.upstream_auth.clone(), p.name.clone());
        Some(async move {
            let got =
                tokio::time::timeout(FETCH_TIMEOUT, discovery::fetch_cards(&client, &w, auth))
                    .await;
            match got {
                Ok(Ok(cards)) => Some((
                    pool.to_string(),
                    cards.into_iter().map(|c| (c.id.clone(), c)).collect(),
                )),
                Ok(Err(e)) => {
                    tracing::warn!(worker = %w.id, error = %e, "model metadata unavailable");
                    None
                }
                Err(_) => {
                    tracing::warn!(worker = %w.id, "model metadata timed out");
                    None
                }
            }
        })
    });
    futures_util::future::join_all(asks)
        .await
        .into_iter()
        .flatten()
        .collect()
}

/// The card of one served name.
fn card(snap: &Snapshot, fetched: &Fetched, name: String) -> ModelCard {
    let Some(route) = snap.route(&name) else {
        return ModelCard::new(name); // a split name: no one engine behind it
    };
    let pool = &route.pool;
    let engine = fetched.get(&*pool.name);
    let upstream = pool.config.upstream_model.as_deref();
    let find = |id: &str| engine.and_then(|m| m.get(upstream.unwrap_or(id)).or_else(|| m.get(id)));
    let adapter = pool.config.lora_adapters.contains(&name);
    let base_name = if adapter {
        pool.config.models.first().cloned().or_else(|| {
            pool.workers
                .iter()
                .find_map(|w| w.state.discovered_models.load().first().cloned())
        })
    } else {
        Some(route.model.to_string())
    };
    let base = base_name.as_deref().and_then(find);
    let own = find(&name);
    let mut c = ModelCard::new(name.clone());
    if let Some(e) = own.or(base) {
        c.created = e.created;
        c.owned_by = e.owned_by.clone();
        c.max_model_len = e.max_model_len.or(base.and_then(|b| b.max_model_len));
        c.root = e.root.clone();
    }
    c.parent = match (adapter, own.and_then(|o| o.parent.clone())) {
        (_, Some(p)) => Some(p),
        (true, None) => base_name,
        (false, None) if name != *route.model => Some(route.model.to_string()),
        _ => None,
    };
    c.root = c.root.or_else(|| Some(route.model.to_string()));
    c
}
