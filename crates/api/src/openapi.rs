//! `/openapi.json`: the machine-readable contract.

use crate::AppState;
use axum::routing::get;
use axum::{Json, Router};

pub(crate) fn routes() -> Router<AppState> {
    Router::new().route("/openapi.json", get(|| async { Json(document()) }))
}

pub fn document() -> serde_json::Value {
    serde_json::json!({})
}
