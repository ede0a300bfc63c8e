//! Issued keys shared through the limits store's Redis, so every replica knows
//! the keys any of them issued: a hash `switchyard:keys` of id → tenant, creation
//! time and the key's SHA-256 (never the key). Each replica copies it into its
//! own [`IssuedKeys`] every second, so lookups stay local and synchronous; a key
//! created or revoked on one replica reaches the others within that second.

use super::keys::{IssuedKey, IssuedKeys, MAX_ISSUED_KEYS};
use redis::aio::ConnectionManager;
use redis::AsyncCommands;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

const HASH: &str = "switchyard:keys";
/// How often each replica copies the shared keys.
const SYNC_EVERY: Duration = Duration::from_secs(1);
const TIMEOUT: Duration = Duration::from_secs(2);

fn hex(d: &[u8]) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

fn encode(e: &IssuedKey) -> String {
    format!("{}\t{}\t{}", e.tenant, e.created, hex(&e.digest))
}

fn decode(id: &str, v: &str) -> Option<IssuedKey> {
    let mut parts = v.split('\t');
    let (tenant, created, digest) = (parts.next()?, parts.next()?, parts.next()?);
    let mut d = [0u8; 32];
    if digest.len() != 64 {
        return None;
    }
    for (i, o) in d.iter_mut().enumerate() {
        *o = u8::from_str_radix(digest.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(IssuedKey {
        id: Arc::from(id),
        tenant: Arc::from(tenant),
        digest: d,
        created: created.parse().ok()?,
    })
}

/// Publish a newly issued key.
pub async fn publish(mut conn: ConnectionManager, e: &IssuedKey) -> Result<(), String> {
    let call = conn.hset::<_, _, _, ()>(HASH, &*e.id, encode(e));
    match tokio::time::timeout(TIMEOUT, call).await {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(_) => Err("timed out".into()),
    }
}

/// Remove a revoked key.
pub async fn remove(mut conn: ConnectionManager, id: &str) -> Result<(), String> {
    let call = conn.hdel::<_, _, ()>(HASH, id);
    match tokio::time::timeout(TIMEOUT, call).await {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(_) => Err("timed out".into()),
    }
}

/// Copy the shared keys into `keys` every second, for as long as the gateway runs.
pub fn spawn_sync(conn: ConnectionManager, keys: Arc<IssuedKeys>) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(SYNC_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let mut c = conn.clone();
            let call = c.hgetall::<_, HashMap<String, String>>(HASH);
            match tokio::time::timeout(TIMEOUT, call).await {
                Ok(Ok(all)) => {
                    let entries = all
                        .iter()
                        .filter_map(|(id, v)| decode(id, v))
                        .take(MAX_ISSUED_KEYS)
                        .collect();
                    keys.replace_all(entries);
                }
                // The limits store counts and logs Redis failures; the copy
                // keeps the last keys it saw.
                Ok(Err(e)) => tracing::debug!(error = %e, "shared keys not copied"),
                Err(_) => tracing::debug!("shared keys not copied: timed out"),
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_round_trip_without_the_key() {
        let keys = IssuedKeys::default();
        let (e, key) = keys.create("acme", 42).unwrap();
        let text = encode(&e);
        assert!(!text.contains(&key[10..]));
        let back = decode(&e.id, &text).unwrap();
        assert_eq!(
            (back.tenant, back.created, back.digest),
            (e.tenant, 42, e.digest)
        );
        assert!(decode("x", "acme\t1\tzz").is_none());
    }
}
