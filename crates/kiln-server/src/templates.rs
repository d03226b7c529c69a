//! `GET /api/v1/templates`: what sandboxes can be made of.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use kiln_core::template::{Capabilities, TemplateInfo};
use serde::Serialize;
use utoipa::ToSchema;

use crate::AppState;
use crate::error::ErrorBody;

/// The installed templates, in order of preference.
#[derive(Debug, Serialize, ToSchema)]
pub struct TemplateList {
    pub templates: Vec<TemplateView>,
}

/// One template.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct TemplateView {
    /// Pass as `image` (or `language` in `/api/v1/sandboxes`).
    #[schema(example = "python")]
    pub id: String,
    #[schema(example = "CPython 3.15 on WebAssembly")]
    pub description: String,
    /// `wasm`, `native` or `vm`.
    #[schema(example = "wasm")]
    pub backend: String,
    /// `ephemeral` (a folder between executions) or `live` (a running box).
    #[schema(example = "ephemeral")]
    pub lifecycle: String,
    /// Languages code cells may use; the first is the default.
    #[schema(example = json!(["python"]))]
    pub languages: Vec<String>,
    pub capabilities: Capabilities,
    /// Image names this template honours: exact names and `repo:versions`.
    #[schema(example = json!(["python", "python3", "python:3.0–3.15"]))]
    pub images: Vec<String>,
}

impl From<&TemplateInfo> for TemplateView {
    fn from(t: &TemplateInfo) -> TemplateView {
        TemplateView {
            id: t.id.clone(),
            description: t.description.clone(),
            backend: t.backend.as_str().into(),
            lifecycle: t.lifecycle.as_str().into(),
            languages: t.languages.iter().map(|l| l.name().to_owned()).collect(),
            capabilities: t.capabilities.clone(),
            images: kiln_core::template::accepted(t),
        }
    }
}

/// List the templates sandboxes can be made from.
#[utoipa::path(get, path = "/api/v1/templates", tag = "v1 sandboxes",
    responses(
        (status = 200, description = "The installed templates", body = TemplateList),
        (status = 401, description = "No or bad API key", body = ErrorBody),
    ))]
pub async fn list(State(state): State<Arc<AppState>>) -> Json<TemplateList> {
    Json(TemplateList {
        templates: state
            .runtime
            .catalogue()
            .templates()
            .iter()
            .map(TemplateView::from)
            .collect(),
    })
}
