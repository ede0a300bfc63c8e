//! `GET /v1/models` shapes, read from workers and written to clients.

use serde::{Deserialize, Serialize};

#[derive(Debug, Serialize, Deserialize)]
pub struct ModelList {
    pub object: String,
    pub data: Vec<ModelCard>,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct ModelCard {
    pub id: String,
    #[serde(default = "model_object")]
    pub object: String,
    #[serde(default)]
    pub created: u64,
    #[serde(default = "owner")]
    pub owned_by: String,
}

fn model_object() -> String {
    "model".into()
}

fn owner() -> String {
    "switchyard".into()
}

impl ModelCard {
    /// A model the gateway serves, as `GET /v1/models[/{id}]` lists it.
    pub fn new(id: String) -> Self {
        ModelCard {
            id,
            object: model_object(),
            created: 0,
            owned_by: owner(),
        }
    }
}

impl ModelList {
    pub fn new(ids: impl IntoIterator<Item = String>) -> Self {
        ModelList {
            object: "list".into(),
            data: ids.into_iter().map(ModelCard::new).collect(),
        }
    }
}
