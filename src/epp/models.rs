//! `GET /v1/models[/{id}]` answered by the picker itself, as the proxy answers
//! it: only the models the caller's key may use (`allowed_models`), and not at
//! all without a key where the configuration says so. An engine would list
//! its own models to anyone.

use crate::proxy::GatewayError;
use crate::server::Gateway;
use crate::tenancy::Tenant;

/// The model path a body-less `GET` names: `Some(None)` for the list,
/// `Some(Some(id))` for one model, `None` for any other path.
pub fn asked(method: &str, path: &str) -> Option<Option<String>> {
    if method != "GET" {
        return None;
    }
    let path = path.split_once('?').map_or(path, |(p, _)| p);
    match path.strip_prefix("/v1/models") {
        Some("" | "/") => Some(None),
        Some(rest) => rest.strip_prefix('/').map(|id| Some(id.to_string())),
        None => None,
    }
}

/// The JSON body of the answer for `tenant`: the list, or one model's card.
pub async fn answer(
    gw: &Gateway,
    tenant: &Tenant,
    id: Option<&str>,
) -> Result<Vec<u8>, GatewayError> {
    if tenant.key_id.is_none() && !gw.tenancy.load().lists_models_without_key() {
        return Err(crate::server::refused_by_tenancy(
            GatewayError::MissingApiKey,
        ));
    }
    let mut list = crate::server::model_list(gw).await;
    let snap = gw.routes.snapshot();
    list.data
        .retain(|c| snap.usable_by(&c.id, |m| tenant.allows(m)));
    let json = match id {
        None => serde_json::to_vec(&list),
        Some(id) => match list.data.into_iter().find(|c| c.id == id) {
            Some(card) => serde_json::to_vec(&card),
            // Also for a model it may not use: its existence is not confirmed.
            None => return Err(GatewayError::UnknownModel(crate::api::error::echo(id))),
        },
    };
    json.map_err(|e| GatewayError::InvalidRequest(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::asked;

    #[test]
    fn model_paths_are_recognised() {
        assert_eq!(asked("GET", "/v1/models"), Some(None));
        assert_eq!(asked("GET", "/v1/models?x=1"), Some(None));
        assert_eq!(asked("GET", "/v1/models/org/m"), Some(Some("org/m".into())));
        assert_eq!(asked("POST", "/v1/models"), None);
        assert_eq!(asked("GET", "/v1/modelsx"), None);
        assert_eq!(asked("GET", "/health"), None);
    }
}
