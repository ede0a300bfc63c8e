//! API keys as the gateway keeps them: a SHA-256 digest and a short public id,
//! never the key. Keys the admin API creates look like `sk-sy-<id>-<secret>`:
//! the id finds the entry, the digest is compared in constant time. Keys from the
//! config may have any form; they are found by their digest.

use dashmap::DashMap;
use ring::rand::SecureRandom;
use std::sync::Arc;
use subtle::ConstantTimeEq;

/// Prefix of the keys the gateway issues.
pub const ISSUED_PREFIX: &str = "sk-sy-";
/// Length of an issued key's public id.
const ID_LEN: usize = 8;
/// Length of an issued key's secret part.
const SECRET_LEN: usize = 32;
/// Admin-created keys kept at most: creating more is refused.
pub const MAX_ISSUED_KEYS: usize = 10_000;
const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";

/// SHA-256 of a key.
pub type Digest = [u8; 32];

pub fn digest(key: &[u8]) -> Digest {
    let d = ring::digest::digest(&ring::digest::SHA256, key);
    let mut out = [0u8; 32];
    out.copy_from_slice(d.as_ref());
    out
}

/// Constant-time equality of two digests.
pub fn same(a: &Digest, b: &Digest) -> bool {
    a.ct_eq(b).into()
}

/// The public id of an issued key (`sk-sy-<id>-…`), if the key has that form.
pub fn issued_id(key: &[u8]) -> Option<&str> {
    let rest = key.strip_prefix(ISSUED_PREFIX.as_bytes())?;
    let id = rest.get(..ID_LEN)?;
    (rest.get(ID_LEN) == Some(&b'-'))
        .then(|| std::str::from_utf8(id).ok())
        .flatten()
}

/// The public id of a configured key: its own if it is in the issued form,
/// else `cfg-` and the first hex digits of its digest (which reveal nothing).
pub fn config_id(key: Option<&[u8]>, digest: &Digest) -> String {
    if let Some(id) = key.and_then(issued_id) {
        return id.to_string();
    }
    let hex: String = digest[..4].iter().map(|b| format!("{b:02x}")).collect();
    format!("cfg-{hex}")
}

/// One admin-created key: its digest and whose it is.
#[derive(Clone)]
pub struct IssuedKey {
    pub id: Arc<str>,
    pub tenant: Arc<str>,
    pub digest: Digest,
    /// Unix seconds.
    pub created: u64,
}

impl std::fmt::Debug for IssuedKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IssuedKey")
            .field("id", &self.id)
            .field("tenant", &self.tenant)
            .finish_non_exhaustive()
    }
}

/// The keys created through the admin API (they outlive config reloads).
#[derive(Default)]
pub struct IssuedKeys {
    by_id: DashMap<Arc<str>, IssuedKey>,
}

/// Why a key could not be created.
#[derive(Debug, PartialEq, Eq)]
pub enum IssueError {
    Full,
    Random,
}

impl IssuedKeys {
    /// Create a key for `tenant`: the entry, and the key itself (shown once).
    pub fn create(&self, tenant: &str, now_unix: u64) -> Result<(IssuedKey, String), IssueError> {
        if self.by_id.len() >= MAX_ISSUED_KEYS {
            return Err(IssueError::Full);
        }
        let rng = ring::rand::SystemRandom::new();
        let mut bytes = [0u8; ID_LEN + SECRET_LEN];
        rng.fill(&mut bytes).map_err(|_| IssueError::Random)?;
        let chars: String = bytes
            .iter()
            .map(|b| ALPHABET[*b as usize % ALPHABET.len()] as char)
            .collect();
        let (id, secret) = chars.split_at(ID_LEN);
        let key = format!("{ISSUED_PREFIX}{id}-{secret}");
        let entry = IssuedKey {
            id: Arc::from(id),
            tenant: Arc::from(tenant),
            digest: digest(key.as_bytes()),
            created: now_unix,
        };
        if self.by_id.contains_key(id) {
            // 36^8 ids: a clash is next to impossible; refuse rather than overwrite.
            return Err(IssueError::Random);
        }
        self.by_id.insert(entry.id.clone(), entry.clone());
        Ok((entry, key))
    }

    /// The entry of `key`, if it is a live issued key.
    pub fn find(&self, key: &[u8], d: &Digest) -> Option<IssuedKey> {
        let id = issued_id(key)?;
        let e = self.by_id.get(id)?;
        same(&e.digest, d).then(|| e.clone())
    }

    /// Forget a key; false if there was none with that id.
    pub fn revoke(&self, id: &str) -> bool {
        self.by_id.remove(id).is_some()
    }

    /// Make the issued keys exactly `entries` (the shared store's copy).
    pub fn replace_all(&self, entries: Vec<IssuedKey>) {
        let ids: std::collections::HashSet<Arc<str>> =
            entries.iter().map(|e| e.id.clone()).collect();
        self.by_id.retain(|id, _| ids.contains(id));
        for e in entries {
            self.by_id.insert(e.id.clone(), e);
        }
    }

    /// Every issued key, oldest first.
    pub fn list(&self) -> Vec<IssuedKey> {
        let mut v: Vec<IssuedKey> = self.by_id.iter().map(|e| e.value().clone()).collect();
        v.sort_by(|a, b| (a.created, &a.id).cmp(&(b.created, &b.id)));
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn created_keys_are_found_by_id_and_digest_and_revoked() {
        let keys = IssuedKeys::default();
        let (e, key) = keys.create("acme", 7).unwrap();
        assert!(key.starts_with(ISSUED_PREFIX));
        assert_eq!(issued_id(key.as_bytes()), Some(&*e.id));
        let found = keys.find(key.as_bytes(), &digest(key.as_bytes())).unwrap();
        assert_eq!(&*found.tenant, "acme");
        // Same id, wrong secret: not found.
        let mut wrong = key.clone().into_bytes();
        let last = wrong.len() - 1;
        wrong[last] = if wrong[last] == b'a' { b'b' } else { b'a' };
        assert!(keys.find(&wrong, &digest(&wrong)).is_none());
        assert_eq!(keys.list().len(), 1);
        assert!(!format!("{:?}", keys.list()).contains(&key[ISSUED_PREFIX.len() + 9..]));
        assert!(keys.revoke(&e.id));
        assert!(!keys.revoke(&e.id));
        assert!(keys.find(key.as_bytes(), &digest(key.as_bytes())).is_none());
    }

    #[test]
    fn config_ids_never_show_the_key() {
        let d = digest(b"sk-acme-123");
        let id = config_id(Some(b"sk-acme-123"), &d);
        assert!(id.starts_with("cfg-") && !id.contains("acme"));
        let issued = b"sk-sy-abcd1234-zzzz";
        assert_eq!(config_id(Some(issued), &digest(issued)), "abcd1234");
        assert_eq!(issued_id(b"sk-sy-short"), None);
    }
}
