//! The second step of validation: what the file points to outside itself. Once
//! the file's own content is checked (without reading anything else: `mod.rs`,
//! `global.rs`, `observability.rs`), secrets are read from their environment
//! variables, here and nowhere else, and CA files are read.

use super::admin::weak_token;
use super::key::Key;
use super::tenancy::{TenancyConfig, TenantConfig};
use super::{AdminConfig, PoolConfig, Problems};
use std::net::SocketAddr;

/// The admin listener before its token is read. `listen` is `None` when rejected.
pub(crate) struct PendingAdmin {
    pub listen: Option<SocketAddr>,
    pub token_env: String,
    pub tls: Option<super::TlsConfig>,
    pub allow_loopback_workers: bool,
}

/// A tenant (`key` is `tenants[N]`) before its API key is read.
pub(crate) struct PendingTenant {
    pub key: Key,
    pub api_key_env: Option<String>,
    /// Everything but `api_key`.
    pub config: TenantConfig,
}

/// `[tenancy]` and `[[tenants]]` before the keys are read.
pub(crate) struct PendingTenancy {
    pub tenants: Vec<PendingTenant>,
    pub trust_tenant_header: bool,
    pub require_key: bool,
    pub anonymous: super::tenancy::AnonymousClaims,
    pub list_models_without_key: bool,
}

/// The admin token: set, and not too weak to accept.
pub(crate) fn admin(a: Option<PendingAdmin>, p: &mut Problems) -> Option<AdminConfig> {
    let a = a?;
    let token = p.secret("admin.token_env", &a.token_env)?;
    if let Some(why) = weak_token(token.expose()) {
        let var = &a.token_env;
        p.push(format!("admin.token_env: the token in `{var}` {why}"));
        return None;
    }
    Some(AdminConfig {
        listen: a.listen?,
        token,
        tls: a.tls,
        allow_loopback_workers: a.allow_loopback_workers,
    })
}

/// Shortest Responses id key accepted, in bytes (128 bits as hex).
const MIN_ID_KEY: usize = 32;

/// The key that signs Responses ids: set and long enough when configured;
/// unset, a note that ids will hold on one process only.
pub(crate) fn id_key(var: Option<String>, p: &mut Problems) -> Option<super::Secret> {
    let Some(var) = var else {
        p.note(
            "server.id_key_env: not set; Responses ids are signed with a random key per process, so \
             another replica, or this one after a restart, answers 404 for them (set it to a \
             variable holding a shared secret, e.g. `openssl rand -hex 32`)"
                .into(),
        );
        return None;
    };
    let key = p.secret("server.id_key_env", &var)?;
    if key.expose().len() < MIN_ID_KEY || weak_token(key.expose()).is_some() {
        p.push(format!(
            "server.id_key_env: the key in `{var}` must be at least {MIN_ID_KEY} random characters (e.g. `openssl rand -hex 32`)"
        ));
        return None;
    }
    Some(key)
}

/// Each pool's upstream API key (`key_envs[i]` names pool `i`'s variable) and
/// its CA file, which must be readable.
pub(crate) fn pools(pools: &mut [PoolConfig], key_envs: &[Option<String>], p: &mut Problems) {
    for (i, (pool, var)) in pools.iter_mut().zip(key_envs).enumerate() {
        let key = Key::new("pools").index(i);
        pool.upstream_api_key = var
            .as_deref()
            .and_then(|var| p.secret(&key.field("upstream_api_key_env"), var));
        if let Some(f) = &pool.upstream_ca_file {
            if let Err(e) = std::fs::read(f) {
                p.push(format!("{}: `{f}`: {e}", key.field("upstream_ca_file")));
            }
        }
    }
}

/// The tenants' API keys, each one tenant's; a tenant whose key variable is
/// not set is left out.
pub(crate) fn tenancy(t: PendingTenancy, p: &mut Problems) -> TenancyConfig {
    let mut tenants: Vec<TenantConfig> = Vec::new();
    for t in t.tenants {
        let mut config = t.config;
        if let Some(var) = &t.api_key_env {
            let key_env = t.key.field("api_key_env");
            let Some(api_key) = p.secret(&key_env, var) else {
                continue;
            };
            if tenants.iter().any(|o| o.api_key.as_ref() == Some(&api_key)) {
                p.push(format!(
                    "{key_env}: the key in `{var}` is already another tenant's"
                ));
            }
            config.api_key = Some(api_key);
        }
        tenants.push(config);
    }
    TenancyConfig {
        tenants,
        trust_tenant_header: t.trust_tenant_header,
        require_key: t.require_key,
        limits: Default::default(),
        anonymous: t.anonymous,
        list_models_without_key: t.list_models_without_key && !t.require_key,
    }
}

/// A listener's certificate, key and client CA files: readable, PEM, and a key
/// that belongs to the certificate.
pub(crate) fn tls(key: &str, tls: Option<&super::TlsConfig>, p: &mut Problems) {
    let Some(t) = tls else { return };
    if let Err(e) = super::load_certified_key(t) {
        p.push(format!("{key}: {e}"));
    }
    if let Some(ca) = &t.client_ca {
        if let Err(e) = super::load_client_roots(ca) {
            p.push(format!("{key}.client_ca: {e}"));
        }
    }
}
