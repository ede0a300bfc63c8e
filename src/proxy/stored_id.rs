//! Gateway-issued Responses ids with an authenticated owner.
//!
//! An engine keeps a stored response in its own memory and answers for it to
//! whoever names its id, so the gateway must decide who may name one. An id it
//! hands out is `resp_syv2<token><mac><engine id>`: `<token>` (16 hex digits)
//! locates the worker that stored it (`affinity::owner_token`), `<mac>` is 32
//! hex digits (128 bits) of HMAC-SHA256, keyed by `server.id_key_env`, over the
//! tenant that created it, the token and the engine's id. An id only verifies
//! for the tenant it was issued to, with the key of the gateways that issued it;
//! anything else — tampered, another tenant's, an old unsigned `resp_sy` id, a
//! raw engine id — is refused as not found, without reaching an engine.
//!
//! Without a configured key each process draws a random one: ids then hold
//! only on the process that issued them (startup says so).

use crate::config::Secret;
use crate::tenancy::Tenant;
use ring::hmac;
use subtle::ConstantTimeEq;

/// The prefix of ids this gateway issues (`v`: not a hex digit, so the old
/// unsigned format `resp_sy<hex>` never parses as this one).
pub const MARK: &str = "resp_syv2";
/// The prefix of the old, unsigned format (refused).
const LEGACY: &str = "resp_sy";
/// Hex digits of the owner token.
const TOKEN_HEX: usize = 16;
/// Bytes of the MAC kept (128 bits), written as twice as many hex digits.
const MAC_BYTES: usize = 16;
/// Longest engine id accepted, in bytes.
pub const MAX_ENGINE_ID: usize = 128;
/// Longest gateway id accepted, in bytes.
pub const MAX_ID: usize = MARK.len() + TOKEN_HEX + 2 * MAC_BYTES + MAX_ENGINE_ID;
/// Domain separation: the MAC of these ids is never valid for anything else.
const DOMAIN: &[u8] = b"switchyard stored response id v2\0";

/// The key that signs and verifies response ids. `Debug` never shows it.
pub struct IdKey {
    key: hmac::Key,
    /// From the config (shared by replicas), or drawn at start.
    configured: bool,
}

impl std::fmt::Debug for IdKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdKey")
            .field("key", &"***")
            .field("configured", &self.configured)
            .finish()
    }
}

/// Why an id was refused (the `reason` label of
/// `switchyard_stored_id_refusals_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// Not an id this gateway issues: wrong prefix, length or characters.
    Format,
    /// The old unsigned `resp_sy` format.
    Legacy,
    /// Well formed, but not signed for this tenant with this key.
    Mac,
}

impl Refusal {
    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::Format => "format",
            Refusal::Legacy => "legacy",
            Refusal::Mac => "mac",
        }
    }
}

/// A verified id: the owner's token and the engine's own id.
#[derive(Debug, PartialEq, Eq)]
pub struct Verified<'a> {
    pub token: u64,
    pub engine_id: &'a str,
}

impl IdKey {
    /// The configured key, else a random one for this process.
    pub fn new(configured: Option<&Secret>) -> IdKey {
        match configured {
            Some(s) => IdKey {
                key: hmac::Key::new(hmac::HMAC_SHA256, s.expose().as_bytes()),
                configured: true,
            },
            None => {
                let rng = ring::rand::SystemRandom::new();
                let key = hmac::Key::generate(hmac::HMAC_SHA256, &rng)
                    .expect("the system random source works");
                IdKey {
                    key,
                    configured: false,
                }
            }
        }
    }

    /// The key came from the config (ids survive restarts and other replicas).
    pub fn is_configured(&self) -> bool {
        self.configured
    }

    /// The signer of ids `tenant` gets for responses stored by the worker
    /// with `token`: the MAC state after the fixed part, cloned per id.
    pub fn issuer(&self, tenant: &Tenant, token: u64) -> Issuer {
        let mut ctx = hmac::Context::with_key(&self.key);
        ctx.update(DOMAIN);
        ctx.update(&[u8::from(tenant.authenticated)]);
        ctx.update(&(tenant.name.len() as u64).to_be_bytes());
        ctx.update(tenant.name.as_bytes());
        ctx.update(&token.to_be_bytes());
        Issuer {
            ctx,
            prefix: format!("{MARK}{token:016x}"),
        }
    }

    /// `id` if it was issued to `tenant` under this key.
    pub fn verify<'i>(&self, tenant: &Tenant, id: &'i str) -> Result<Verified<'i>, Refusal> {
        let (token, mac, engine_id) = split(id)?;
        let expected = self.issuer(tenant, token).mac(engine_id);
        if bool::from(expected[..].ct_eq(&mac[..])) {
            Ok(Verified { token, engine_id })
        } else {
            Err(Refusal::Mac)
        }
    }
}

/// Signs the ids of one tenant's responses from one worker.
#[derive(Clone)]
pub struct Issuer {
    ctx: hmac::Context,
    /// `resp_syv2<token>`.
    prefix: String,
}

impl Issuer {
    fn mac(&self, engine_id: &str) -> [u8; MAC_BYTES] {
        let mut ctx = self.ctx.clone();
        ctx.update(engine_id.as_bytes());
        let tag = ctx.sign();
        let mut out = [0u8; MAC_BYTES];
        out.copy_from_slice(&tag.as_ref()[..MAC_BYTES]);
        out
    }

    /// The id the client sees for `engine_id`; `None` for an engine id the
    /// gateway would not accept back (see [`engine_id_ok`]).
    pub fn issue(&self, engine_id: &str) -> Option<String> {
        if !engine_id_ok(engine_id) {
            return None;
        }
        let mut id = String::with_capacity(self.prefix.len() + 2 * MAC_BYTES + engine_id.len());
        id.push_str(&self.prefix);
        for b in self.mac(engine_id) {
            id.push(char::from(HEX[usize::from(b >> 4)]));
            id.push(char::from(HEX[usize::from(b & 15)]));
        }
        id.push_str(engine_id);
        Some(id)
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

/// An engine id the gateway signs and sends on: 1 to [`MAX_ENGINE_ID`] bytes of
/// ASCII letters, digits, `_` and `-` (nothing that could change the engine
/// path it is put in: no `/`, `?`, `%`, `#`, `.`).
pub fn engine_id_ok(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= MAX_ENGINE_ID
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// The parts of a well-formed id: token, MAC, engine id.
fn split(id: &str) -> Result<(u64, [u8; MAC_BYTES], &str), Refusal> {
    if id.len() > MAX_ID {
        return Err(Refusal::Format);
    }
    let Some(rest) = id.strip_prefix(MARK) else {
        return Err(if id.starts_with(LEGACY) {
            Refusal::Legacy
        } else {
            Refusal::Format
        });
    };
    let hex_len = TOKEN_HEX + 2 * MAC_BYTES;
    let (hex, engine_id) = rest.split_at_checked(hex_len).ok_or(Refusal::Format)?;
    if !engine_id_ok(engine_id) || !hex.bytes().all(|b| HEX.contains(&b)) {
        return Err(Refusal::Format);
    }
    let token = u64::from_str_radix(&hex[..TOKEN_HEX], 16).map_err(|_| Refusal::Format)?;
    let mut mac = [0u8; MAC_BYTES];
    for (i, pair) in hex.as_bytes()[TOKEN_HEX..].chunks(2).enumerate() {
        mac[i] = (nibble(pair[0]) << 4) | nibble(pair[1]);
    }
    Ok((token, mac, engine_id))
}

/// A lowercase hex digit's value (checked by the caller).
fn nibble(b: u8) -> u8 {
    match b {
        b'0'..=b'9' => b - b'0',
        _ => b - b'a' + 10,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn tenant(name: &str, authenticated: bool) -> Tenant {
        Tenant {
            name: Arc::from(name),
            authenticated,
            residency: None,
            key_id: None,
            policy: None,
            slo: Default::default(),
            claims: Default::default(),
        }
    }

    #[test]
    fn an_id_verifies_for_its_tenant_only() {
        let key = IdKey::new(Some(&Secret::new("k".repeat(32))));
        let (a, b) = (tenant("a", true), tenant("b", true));
        let id = key.issuer(&a, 7).issue("resp_abc123").unwrap();
        assert!(id.starts_with(MARK), "{id}");
        let v = key.verify(&a, &id).unwrap();
        assert_eq!((v.token, v.engine_id), (7, "resp_abc123"));
        assert_eq!(key.verify(&b, &id), Err(Refusal::Mac));
        // The same name unauthenticated (a header-named tenant) is another owner.
        assert_eq!(key.verify(&tenant("a", false), &id), Err(Refusal::Mac));
        // Another key (another deployment, or a per-process random one).
        assert_eq!(IdKey::new(None).verify(&a, &id), Err(Refusal::Mac));
        let same = IdKey::new(Some(&Secret::new("k".repeat(32))));
        assert!(same.verify(&a, &id).is_ok(), "replicas sharing a key agree");
    }

    #[test]
    fn tampering_with_any_part_is_refused() {
        let key = IdKey::new(None);
        let a = tenant("a", true);
        let id = key.issuer(&a, 0xabc).issue("resp_1").unwrap();
        for at in MARK.len()..id.len() {
            let mut b = id.clone().into_bytes();
            b[at] = if b[at] == b'0' { b'1' } else { b'0' };
            let t = String::from_utf8(b).unwrap();
            assert!(key.verify(&a, &t).is_err(), "changed at {at}: {t}");
        }
        let other_token = format!("{MARK}{:016x}{}", 0xabd, &id[MARK.len() + TOKEN_HEX..]);
        assert_eq!(key.verify(&a, &other_token), Err(Refusal::Mac));
    }

    #[test]
    fn malformed_and_legacy_ids_are_refused_by_format() {
        let key = IdKey::new(None);
        let a = tenant("a", true);
        let good = key.issuer(&a, 1).issue("resp_1").unwrap();
        let legacy = format!("resp_sy{:016x}resp_1", 1);
        assert_eq!(key.verify(&a, &legacy), Err(Refusal::Legacy));
        for bad in [
            "resp_1".to_string(),
            String::new(),
            MARK.to_string(),
            good.to_uppercase(),
            format!("{good}/x"),
            format!("{good}%2F"),
            format!("{good}?a=b"),
            format!("{good}{}", "x".repeat(MAX_ENGINE_ID)),
            good[..good.len() - 6].to_string(),
        ] {
            assert!(key.verify(&a, &bad).is_err(), "{bad}");
        }
        assert!(key.issuer(&a, 1).issue("resp/../x").is_none());
        assert!(key.issuer(&a, 1).issue("").is_none());
        assert!(key.issuer(&a, 1).issue(&"x".repeat(129)).is_none());
    }

    #[test]
    fn debug_shows_no_key() {
        let key = IdKey::new(Some(&Secret::new("super-secret-id-key-0123456789")));
        let d = format!("{key:?}");
        assert!(!d.contains("super-secret"), "{d}");
    }
}
