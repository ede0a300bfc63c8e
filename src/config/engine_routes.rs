//! Which engine paths the gateway forwards besides its own inference routes: a
//! small built-in list, each pool's `forward_routes` (any caller) and
//! `allow_control_routes` (admin tenants only). Anything else is a 404, so an
//! engine's control surface (LoRA loading, cache resets, weight updates) is
//! never reachable by default.

use super::key::Key;
use super::problems::Problems;
use std::collections::HashSet;

/// `POST` inference paths without a route of their own in the gateway, forwarded
/// by their body's `model` to any caller.
pub const DEFAULT_FORWARD_ROUTES: &[&str] = &[
    "/v1/audio/speech",
    "/v1/moderations",
    "/v1/images/generations",
];

/// Engine control paths of vLLM and SGLang: admin-only, through
/// `allow_control_routes`, never `forward_routes`.
pub const CONTROL_ROUTES: &[&str] = &[
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/load_lora_adapter",
    "/unload_lora_adapter",
    "/reset_prefix_cache",
    "/reset_mm_cache",
    "/flush_cache",
    "/sleep",
    "/wake_up",
    "/collective_rpc",
    "/start_profile",
    "/stop_profile",
    "/abort_request",
    "/pause",
    "/resume",
    "/pause_generation",
    "/continue_generation",
    "/scale_elastic_ep",
    "/update_weights_from_disk",
    "/update_weights_from_tensor",
    "/update_weights_from_distributed",
    "/init_weights_update_group",
    "/release_memory_occupation",
    "/resume_memory_occupation",
    "/configure_logging",
    "/set_internal_state",
];

/// Paths the gateway answers itself or routes already: not configurable here.
const GATEWAY_PATHS: &[&str] = &[
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
    "/v1/models",
    "/health",
    "/ready",
    "/metrics",
];

/// Longest configurable path.
const MAX_PATH_LEN: usize = 256;

/// Check one pool's `forward_routes` and `allow_control_routes` (`key` is
/// `pools[N]`); returns them as given when valid.
pub(super) fn validate(
    key: &Key,
    forward: Vec<String>,
    control: Vec<String>,
    p: &mut Problems,
) -> (Vec<String>, Vec<String>) {
    let mut seen = HashSet::new();
    for (field, list) in [
        ("forward_routes", &forward),
        ("allow_control_routes", &control),
    ] {
        for (i, path) in list.iter().enumerate() {
            let at = key.field(field).index(i);
            if let Some(why) = path_problem(path) {
                p.push(format!("{at}: `{path}` {why}"));
            } else if !seen.insert(path.as_str()) {
                p.push(format!("{at}: `{path}` is listed twice"));
            } else if field == "forward_routes" && CONTROL_ROUTES.contains(&path.as_str()) {
                p.push(format!(
                    "{at}: `{path}` is an engine control route; list it in allow_control_routes (admin tenants only)"
                ));
            }
        }
    }
    (forward, control)
}

/// Why `path` cannot be a configured route, if it cannot.
fn path_problem(path: &str) -> Option<&'static str> {
    let shape = path.starts_with('/')
        && path.len() <= MAX_PATH_LEN
        && !path.contains("//")
        && path
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"/_.-".contains(&b));
    if !shape {
        return Some("must be a path like /v1/load_lora_adapter (letters, digits, `/_.-`, at most 256 bytes)");
    }
    let own = GATEWAY_PATHS.contains(&path)
        || DEFAULT_FORWARD_ROUTES.contains(&path)
        || ["/admin", "/dashboard", "/v1/responses/", "/v1/models/"]
            .iter()
            .any(|p| path.starts_with(p));
    own.then_some("is served by the gateway already")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn problems(forward: &[&str], control: &[&str]) -> Vec<String> {
        let mut p = Problems::default();
        let v = |l: &[&str]| l.iter().map(|s| s.to_string()).collect();
        validate(&Key::new("pools").index(0), v(forward), v(control), &mut p);
        p.error().map_or(Vec::new(), |e| e.problems)
    }

    #[test]
    fn routes_are_paths_the_gateway_does_not_serve() {
        assert!(problems(
            &["/v1/custom/thing"],
            &["/v1/load_lora_adapter", "/flush_cache"]
        )
        .is_empty());
        let p = problems(
            &[
                "v1/x",
                "/v1/chat/completions",
                "/v1/load_lora_adapter",
                "/a?b",
            ],
            &["/v1/x", "/v1/x", "/admin/workers"],
        );
        let want = [
            "pools[0].forward_routes[0]: `v1/x` must be a path",
            "pools[0].forward_routes[1]: `/v1/chat/completions` is served by the gateway already",
            "pools[0].forward_routes[2]: `/v1/load_lora_adapter` is an engine control route",
            "pools[0].forward_routes[3]: `/a?b` must be a path",
            "pools[0].allow_control_routes[1]: `/v1/x` is listed twice",
            "pools[0].allow_control_routes[2]: `/admin/workers` is served by the gateway already",
        ];
        assert_eq!(p.len(), want.len(), "{p:#?}");
        for (got, want) in p.iter().zip(want) {
            assert!(got.starts_with(want), "{got} / {want}");
        }
    }
}
