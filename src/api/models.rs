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
    /// The model the engine loaded (an adapter's path for a LoRA adapter).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub root: Option<String>,
    /// The base model of an adapter; the model an alias names.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
    /// Longest prompt + output the engine accepts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_model_len: Option<u64>,
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
            root: None,
            parent: None,
            max_model_len: None,
        }
    }
}

impl ModelList {
    pub fn new(ids: impl IntoIterator<Item = String>) -> Self {
        Self::of(ids.into_iter().map(ModelCard::new).collect())
    }

    pub fn of(data: Vec<ModelCard>) -> Self {
        ModelList {
            object: "list".into(),
            data,
        }
    }
}
