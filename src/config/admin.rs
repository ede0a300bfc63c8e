//! `[admin]`: the authenticated admin listener, and the strength its token
//! needs (checked in `resolve.rs`, where the token is read).

use super::key::Key;
use super::problems::Problems;
use super::server::listen_addr;
use super::{edge, resolve, RawAdmin, Secret, TlsConfig};
use std::net::SocketAddr;

/// The authenticated admin listener.
#[derive(Clone, Debug)]
pub struct AdminConfig {
    pub listen: SocketAddr,
    pub token: Secret,
    /// Serve over TLS; with `client_ca`, only clients with a certificate from it.
    pub tls: Option<TlsConfig>,
    /// `POST /admin/workers` may add loopback workers.
    pub allow_loopback_workers: bool,
}

/// Why an admin token is too weak to accept, if it is: too short, one repeated
/// character, or a single run of consecutive characters (`abcdef…`, `123456…`).
pub(super) fn weak_token(t: &str) -> Option<&'static str> {
    let b = t.as_bytes();
    if b.len() < 16 {
        return Some("must be at least 16 characters");
    }
    if b.iter().all(|&c| c == b[0]) {
        return Some("is one character repeated; use a random token (e.g. `openssl rand -hex 32`)");
    }
    let step = b[1].wrapping_sub(b[0]);
    if (step == 1 || step == 255) && b.windows(2).all(|w| w[1].wrapping_sub(w[0]) == step) {
        return Some(
            "is a run of consecutive characters; use a random token (e.g. `openssl rand -hex 32`)",
        );
    }
    None
}

/// `[admin]`: `None` when off (no `listen`) or rejected; the token is read in `resolve`.
pub(super) fn validate_admin(a: RawAdmin, p: &mut Problems) -> Option<resolve::PendingAdmin> {
    let listen = a.listen?;
    let listen = listen_addr("admin.listen", &listen, p);
    let Some(token_env) = a.token_env else {
        p.push("admin.token_env: required when admin.listen is set (the admin API is always authenticated)".into());
        return None;
    };
    let tls = a
        .tls
        .and_then(|t| edge::validate_tls(t, &Key::new("admin").field("tls"), true, p));
    Some(resolve::PendingAdmin {
        listen,
        token_env,
        tls,
        allow_loopback_workers: a.allow_loopback_workers.unwrap_or(false),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weak_admin_tokens_are_refused() {
        assert!(weak_token("short").is_some());
        assert!(weak_token(&"a".repeat(32)).is_some());
        assert!(weak_token("abcdefghijklmnopq").is_some());
        assert!(weak_token(
            "9876543210fedcba"
                .chars()
                .take(10)
                .collect::<String>()
                .as_str()
        )
        .is_some());
        assert!(weak_token("3f9c1a7e52b04d6e8a1f").is_none());
    }
}
