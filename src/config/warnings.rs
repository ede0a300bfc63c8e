//! Open configurations: settings that are valid but let clients do more than
//! an operator may expect. `check-config` prints each as a `warning:` line and
//! `serve` logs them at start; none of them stops the gateway.

use super::Config;
use std::net::SocketAddr;

/// The warnings of a validated configuration, in a stable order.
pub fn open_warnings(c: &Config) -> Vec<String> {
    let mut w = Vec::new();
    tenancy(c, &mut w);
    admin(
        c.admin.as_ref().map(|a| (a.listen, a.tls.is_some())),
        &mut w,
    );
    allowed_models(c, &mut w);
    w
}

fn tenancy(c: &Config, w: &mut Vec<String>) {
    let t = &c.tenancy;
    let keyed = t
        .tenants
        .iter()
        .any(|t| t.api_key.is_some() || t.key_sha256.is_some());
    if keyed && !t.require_key {
        w.push(
            "tenancy.require_key: false while tenants have API keys; a request without a \
             key is served as `anonymous`, outside every tenant's allowed_models and limits"
                .into(),
        );
    }
    if t.trust_tenant_header {
        w.push(
            "tenancy.trust_tenant_header: true; any client that reaches the listener may \
             name a tenant with x-switchyard-tenant (only behind a proxy that sets it)"
                .into(),
        );
    }
    let anon = &t.anonymous;
    if anon.max_priority < super::flow::Priority::Normal {
        w.push(format!(
            "tenancy.anonymous_max_priority: `{}`; callers without a key may jump the queue",
            anon.max_priority.as_str()
        ));
    }
    if anon.allow_slo_headers {
        w.push(
            "tenancy.anonymous_allow_slo_headers: true; callers without a key may set \
             any latency objective"
                .into(),
        );
    }
}

/// The admin API reachable beyond this host without TLS.
fn admin(a: Option<(SocketAddr, bool)>, w: &mut Vec<String>) {
    let Some((listen, tls)) = a else { return };
    if !listen.ip().is_loopback() && !tls {
        w.push(format!(
            "admin.listen: {listen} is not a loopback address and admin.tls is not set; \
             the admin token crosses the network in clear text"
        ));
    }
}

/// `allowed_models` entries that match no configured model name (a typo
/// silently denies). Skipped when a pool discovers its models.
fn allowed_models(c: &Config, w: &mut Vec<String>) {
    if c.pools.iter().any(|p| p.models.is_empty()) {
        return;
    }
    let names: Vec<&str> = c
        .pools
        .iter()
        .flat_map(|p| p.models.iter().chain(&p.aliases).chain(&p.lora_adapters))
        .map(String::as_str)
        .chain(c.global.splits.iter().map(|s| s.model.as_str()))
        .collect();
    for (i, t) in c.tenancy.tenants.iter().enumerate() {
        for (j, g) in t.allowed_models.iter().enumerate() {
            if !names.iter().any(|n| glob(g, n)) {
                w.push(format!(
                    "tenants[{i}].allowed_models[{j}]: `{g}` matches no configured model"
                ));
            }
        }
    }
}

/// `pattern` matches `s`, where `*` matches any run of characters.
pub fn glob(pattern: &str, s: &str) -> bool {
    let Some((first, rest)) = pattern.split_once('*') else {
        return pattern == s;
    };
    let Some(mut tail) = s.strip_prefix(first) else {
        return false;
    };
    let mut parts: Vec<&str> = rest.split('*').collect();
    let last = parts.pop().unwrap_or_default();
    for part in parts {
        match tail.find(part) {
            Some(at) => tail = &tail[at + part.len()..],
            None => return false,
        }
    }
    tail.len() >= last.len() && tail.ends_with(last)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_admin_api_off_this_host_without_tls_is_warned_about() {
        let mut w = Vec::new();
        admin(Some(("127.0.0.1:9000".parse().unwrap(), false)), &mut w);
        admin(Some(("0.0.0.0:9000".parse().unwrap(), true)), &mut w);
        admin(None, &mut w);
        assert!(w.is_empty(), "{w:?}");
        admin(Some(("0.0.0.0:9000".parse().unwrap(), false)), &mut w);
        assert_eq!(w.len(), 1);
        assert!(w[0].starts_with("admin.listen: 0.0.0.0:9000"), "{w:?}");
    }

    #[test]
    fn globs_match_exactly_or_by_star() {
        assert!(glob("m", "m") && !glob("m", "m2"));
        assert!(glob("llama-*-8b", "llama-3-8b") && glob("llama-*-8b", "llama--8b"));
        assert!(!glob("llama-*-8b", "llama-3-70b"));
        assert!(glob("*", "") && glob("a*b*c", "aXbYc") && !glob("a*b", "ab-"));
    }
}
