//! `switchyard check-config --probe`: the configuration against the live engines.
//! Each configured worker of a pool with KV events is scraped once (`/metrics`,
//! short timeout, all at once) for the KV block size it serves; a size other
//! than `[pools.kv_events] block_size`, or engines of one pool disagreeing, is
//! an error naming the key, the worker and both sizes (the engine's events
//! would be refused and the pool would route approximately). A worker that
//! does not answer is a warning: it cannot be judged. Plain `check-config`
//! never opens a connection.

use crate::config::{self, Config, ConfigError, PoolConfig, Secrets};
use crate::pool::stats::scrape_once;
use crate::upstream::UpstreamClient;
use std::time::Duration;

/// How long one worker gets to answer.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// What one worker said.
struct Answer {
    pool: usize,
    url: String,
    /// `Ok(None)`: answered without a block size.
    size: anyhow::Result<Option<u64>>,
}

/// `check-config --probe`: the offline summary, then a line per probed worker;
/// an error listing every disagreement.
pub async fn check_config_probe(
    path: &std::path::Path,
    secrets: Secrets,
) -> anyhow::Result<String> {
    let mut out = super::check_config(path, secrets)?;
    let c = config::read_file(path)?.validate(secrets)?.config;
    let answers = probe_all(&c).await?;
    let mut problems = Vec::new();
    for (i, pc) in c.pools.iter().enumerate() {
        let mine: Vec<&Answer> = answers.iter().filter(|a| a.pool == i).collect();
        report(i, pc, &mine, &mut out, &mut problems);
    }
    if problems.is_empty() {
        Ok(out)
    } else {
        println!("{out}");
        Err(ConfigError { problems }.into())
    }
}

/// Scrape every worker of every pool with KV events, concurrently.
async fn probe_all(c: &Config) -> anyhow::Result<Vec<Answer>> {
    let ca_files: Vec<String> = c
        .pools
        .iter()
        .filter_map(|p| p.upstream_ca_file.clone())
        .collect();
    let client = UpstreamClient::new(PROBE_TIMEOUT, &ca_files)?;
    let mut set = tokio::task::JoinSet::new();
    for (i, pc) in c.pools.iter().enumerate() {
        if pc.workers.iter().all(|w| w.kv_events.is_none()) {
            continue;
        }
        let auth = pc
            .upstream_api_key
            .as_ref()
            .and_then(|k| http::HeaderValue::from_str(&format!("Bearer {}", k.expose())).ok());
        for w in pc.workers.iter().filter(|w| w.kv_events.is_some()) {
            let (client, auth, url) = (client.clone(), auth.clone(), w.url.clone());
            set.spawn(async move {
                let size = scrape_once(&client, &url, auth.as_ref(), PROBE_TIMEOUT)
                    .await
                    .map(|s| s.kv_block_size);
                Answer { pool: i, url, size }
            });
        }
    }
    let mut answers = Vec::new();
    while let Some(a) = set.join_next().await {
        answers.push(a?);
    }
    answers.sort_by(|a, b| (a.pool, &a.url).cmp(&(b.pool, &b.url)));
    Ok(answers)
}

/// Pool `i`'s lines and problems: each worker against the configured size, or
/// (unset) against the first worker that reported one.
fn report(
    i: usize,
    pc: &PoolConfig,
    answers: &[&Answer],
    out: &mut String,
    problems: &mut Vec<String>,
) {
    let configured = (!pc.kv_events.learn_block_size).then_some(pc.kv_events.block_size as u64);
    let first = answers
        .iter()
        .find_map(|a| a.size.as_ref().ok().copied().flatten());
    let (want, source) = match configured {
        Some(c) => (Some(c), "configured"),
        None => (first, "learned from the first engine"),
    };
    for a in answers {
        match &a.size {
            Err(e) => out.push_str(&format!(
                "\nwarning: pools[{i}] ({}): {}: probe failed, not checked: {e:#}",
                pc.name, a.url
            )),
            Ok(None) => out.push_str(&format!(
                "\nwarning: pools[{i}] ({}): {} reports no KV block size in its /metrics (vllm:cache_config_info, sglang:page_size): not checked",
                pc.name, a.url
            )),
            Ok(Some(r)) if Some(*r) != want => problems.push(match configured {
                Some(c) => format!(
                    "pools[{i}].kv_events.block_size: {c}, but worker {} serves KV block size {r}: its events would be refused and pool {} would route on the approximate index; set block_size = {r} or remove it to learn the size from the engines",
                    a.url, pc.name
                ),
                None => format!(
                    "pools[{i}].workers: engines of pool {} disagree on the KV block size: {} serves {r}, another {}; the pool would refuse one side's events",
                    pc.name, a.url, want.unwrap_or(0)
                ),
            }),
            Ok(Some(r)) => out.push_str(&format!(
                "\nprobe: pools[{i}] ({}): {} serves KV block size {r} ({source}: ok)",
                pc.name, a.url
            )),
        }
    }
}
