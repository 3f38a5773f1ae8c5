//! Liveness and readiness: no authentication, no idempotency.

use crate::AppState;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use axum::{Json, Router};
use serde_json::{Value, json};

pub(crate) fn routes() -> Router<AppState> {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
}

/// The process is up; says nothing about its dependencies.
async fn healthz() -> Json<Value> {
    Json(json!({ "status": "ok" }))
}

/// Ready to serve: the database answers. Fails while it is unreachable so a
/// load balancer stops sending traffic that could not be recorded.
async fn readyz(State(state): State<AppState>) -> (StatusCode, Json<Value>) {
    match state.store.ping().await {
        Ok(()) => (StatusCode::OK, Json(json!({ "status": "ready" }))),
        Err(error) => {
            tracing::warn!(error = %error, "readiness check failed: database unreachable");
            (
                StatusCode::SERVICE_UNAVAILABLE,
                Json(json!({ "status": "unavailable", "database": "unreachable" })),
            )
        }
    }
}

/// Prometheus text: payments per unsettled status and the age of the oldest
/// in each (`needs_review` and `requires_reconciliation` are what on-call
/// alerts on). Read from the database, so every process reports the same.
async fn metrics(State(state): State<AppState>) -> axum::response::Response {
    use axum::response::IntoResponse;
    let counts = match state.store.unsettled_counts().await {
        Ok(c) => c,
        Err(error) => {
            tracing::warn!(error = %error, "metrics: database unreachable");
            return (StatusCode::SERVICE_UNAVAILABLE, "# database unreachable\n").into_response();
        }
    };
    let now = state.clock.now();
    let mut text = String::from(
        "# HELP cobro_payments_unsettled Payments in an unsettled status.\n\
         # TYPE cobro_payments_unsettled gauge\n",
    );
    let statuses = [
        "processing",
        "requires_reconciliation",
        "needs_review",
        "capturing",
        "canceling",
    ];
    for status in statuses {
        let n = counts
            .iter()
            .find(|c| c.status == status)
            .map_or(0, |c| c.count);
        text.push_str(&format!(
            "cobro_payments_unsettled{{status=\"{status}\"}} {n}\n"
        ));
    }
    text.push_str(
        "# HELP cobro_payments_oldest_unsettled_seconds Age of the oldest payment in each unsettled status.\n\
         # TYPE cobro_payments_oldest_unsettled_seconds gauge\n",
    );
    for status in statuses {
        let age = counts
            .iter()
            .find(|c| c.status == status)
            .and_then(|c| c.oldest)
            .map_or(0, |t| (now - t.0).num_seconds().max(0));
        text.push_str(&format!(
            "cobro_payments_oldest_unsettled_seconds{{status=\"{status}\"}} {age}\n"
        ));
    }
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4",
        )],
        text,
    )
        .into_response()
}
