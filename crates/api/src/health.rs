//! Liveness and readiness: no authentication, no idempotency.

use crate::AppState;
use axum::extract::State;
use axum::http::StatusCode;
use axum::{Json, Router};
use chrono::{DateTime, Utc};
use cobro_core::{PaymentStatus, RefundStatus};
use cobro_store::conflicts::ConflictKind;
use cobro_store::{Store, StoreError};
use serde::Serialize;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

/// `GET /metrics` alone, for a process that serves no API (`cobro worker
/// --metrics-listen`).
pub fn metrics_router(state: AppState) -> Router {
    let (router, _) = OpenApiRouter::new()
        .routes(routes!(metrics))
        .split_for_parts();
    router.with_state(state)
}

pub(crate) fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(healthz))
        .routes(routes!(readyz))
        .routes(routes!(metrics))
}

/// Answer of `/healthz` and `/readyz`.
#[derive(Serialize, utoipa::ToSchema)]
struct HealthStatus {
    /// `unreachable` when readyz fails.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    database: Option<&'static str>,
    /// `ok` (healthz), `ready` or `unavailable` (readyz).
    status: &'static str,
}

impl HealthStatus {
    fn is(status: &'static str) -> Json<Self> {
        Json(Self {
            database: None,
            status,
        })
    }
}

/// Liveness
///
/// The process is up; says nothing about its dependencies.
#[utoipa::path(
    get,
    path = "/healthz",
    operation_id = "healthz",
    tag = "operations",
    responses((status = 200, description = "Up.", body = HealthStatus,
        example = json!({"status": "ok"}))),
)]
async fn healthz() -> Json<HealthStatus> {
    HealthStatus::is("ok")
}

/// Readiness
///
/// Ready to serve: the database answers. Fails while it is unreachable,
/// so a load balancer stops sending traffic that could not be recorded.
#[utoipa::path(
    get,
    path = "/readyz",
    operation_id = "readyz",
    tag = "operations",
    responses(
        (status = 200, description = "Ready.", body = HealthStatus,
            example = json!({"status": "ready"})),
        (status = 503, description = "The database is unreachable.", body = HealthStatus,
            example = json!({"status": "unavailable", "database": "unreachable"})),
    ),
)]
async fn readyz(State(state): State<AppState>) -> (StatusCode, Json<HealthStatus>) {
    match state.store.ping().await {
        Ok(()) => (StatusCode::OK, HealthStatus::is("ready")),
        Err(error) => {
            tracing::warn!(error = %error, "readiness check failed: database unreachable");
            let mut down = HealthStatus::is("unavailable");
            down.database = Some("unreachable");
            (StatusCode::SERVICE_UNAVAILABLE, down)
        }
    }
}

/// How long the scrape waits for the database before reporting it down.
const DATABASE_DEADLINE: std::time::Duration = std::time::Duration::from_secs(2);

/// Metrics
///
/// Prometheus text: this process's counters and histograms (requests,
/// provider calls, the worker, the reconciler, idempotency refusals,
/// redundant and conflicting evidence), then what the database says now
/// (payments and refunds per unsettled status with the age of the oldest,
/// the outbox, unknown attempts by age, open conflicts). The database part
/// is read at scrape time, so every process reports the same; when the
/// database does not answer within 2 s the scrape still succeeds, with
/// `cobro_metrics_database_up 0` and no database series (a stale value
/// would be a lie, an absent one is not). No token.
#[utoipa::path(
    get,
    path = "/metrics",
    operation_id = "metrics",
    tag = "operations",
    responses(
        (status = 200, description = "Prometheus text exposition format.", content_type = "text/plain", body = String),
        (status = 503, description = "The database is unreachable.", content_type = "text/plain", body = String),
    ),
)]
async fn metrics(State(state): State<AppState>) -> axum::response::Response {
    use axum::response::IntoResponse;
    let mut text = cobro_telemetry::metrics::render();
    let now = state.clock.now();
    let read = tokio::time::timeout(DATABASE_DEADLINE, database_metrics(&state.store, now)).await;
    let up = match read {
        Ok(Ok(database)) => {
            text.push_str(&database);
            1
        }
        Ok(Err(error)) => {
            tracing::warn!(error = %error, "metrics: database unreachable");
            0
        }
        Err(_) => {
            tracing::warn!("metrics: the database did not answer in time");
            0
        }
    };
    gauge_header(
        &mut text,
        "cobro_metrics_database_up",
        "1 when this scrape could read the database-derived series, 0 when it could not (they are then absent).",
    );
    text.push_str(&format!("cobro_metrics_database_up {up}\n"));
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4",
        )],
        text,
    )
        .into_response()
}

fn gauge_header(text: &mut String, name: &str, help: &str) {
    text.push_str(&format!("# HELP {name} {help}\n# TYPE {name} gauge\n"));
}

fn age_seconds(now: DateTime<Utc>, since: Option<DateTime<Utc>>) -> i64 {
    since.map_or(0, |t| (now - t).num_seconds().max(0))
}

const CONFLICT_KINDS: [ConflictKind; 7] = [
    ConflictKind::EffectAfterNoEffect,
    ConflictKind::OtherObject,
    ConflictKind::Mismatch,
    ConflictKind::SeveralObjects,
    ConflictKind::Unmatched,
    ConflictKind::MissingAtProvider,
    ConflictKind::BooksDrift,
];

/// The database-derived series, all or nothing. Every label value is
/// written, zeros included, so alert expressions never meet a missing
/// series while the database answers.
async fn database_metrics(store: &Store, now: DateTime<Utc>) -> Result<String, StoreError> {
    let payments = store.unsettled_counts().await?;
    let refunds = store.refund_unsettled_counts().await?;
    let outbox = store.outbox_depth(now).await?;
    let unknown = store.unknown_attempts(now).await?;
    let conflicts = store.open_conflict_counts().await?;
    let orphans = store.open_orphan_count().await?;
    let mut text = String::new();
    let payment = |status: PaymentStatus| payments.iter().find(|c| c.status == status);
    gauge_header(
        &mut text,
        "cobro_payments_unsettled",
        "Payments in an unsettled status.",
    );
    for &status in PaymentStatus::UNSETTLED {
        let n = payment(status).map_or(0, |c| c.count);
        text.push_str(&format!(
            "cobro_payments_unsettled{{status=\"{status}\"}} {n}\n"
        ));
    }
    gauge_header(
        &mut text,
        "cobro_payments_oldest_unsettled_seconds",
        "Age of the oldest payment in each unsettled status (since it entered it).",
    );
    for &status in PaymentStatus::UNSETTLED {
        let age = age_seconds(now, payment(status).and_then(|c| c.oldest).map(|t| t.0));
        text.push_str(&format!(
            "cobro_payments_oldest_unsettled_seconds{{status=\"{status}\"}} {age}\n"
        ));
    }
    let refund = |status: RefundStatus| refunds.iter().find(|c| c.status == status);
    gauge_header(
        &mut text,
        "cobro_refunds_unsettled",
        "Refunds in an unsettled status.",
    );
    for &status in RefundStatus::UNSETTLED {
        let n = refund(status).map_or(0, |c| c.count);
        text.push_str(&format!(
            "cobro_refunds_unsettled{{status=\"{status}\"}} {n}\n"
        ));
    }
    gauge_header(
        &mut text,
        "cobro_refunds_oldest_unsettled_seconds",
        "Age of the oldest refund in each unsettled status (since it entered it).",
    );
    for &status in RefundStatus::UNSETTLED {
        let age = age_seconds(now, refund(status).and_then(|c| c.oldest).map(|t| t.0));
        text.push_str(&format!(
            "cobro_refunds_oldest_unsettled_seconds{{status=\"{status}\"}} {age}\n"
        ));
    }
    gauge_header(
        &mut text,
        "cobro_outbox_pending",
        "Outbox rows not done (due, leased or waiting for a retry).",
    );
    text.push_str(&format!("cobro_outbox_pending {}\n", outbox.pending));
    gauge_header(
        &mut text,
        "cobro_outbox_due",
        "Outbox rows due now and not leased by a worker.",
    );
    text.push_str(&format!("cobro_outbox_due {}\n", outbox.due));
    gauge_header(
        &mut text,
        "cobro_outbox_oldest_due_seconds",
        "How long the oldest due outbox row has been waiting for a worker (0 when none is due).",
    );
    text.push_str(&format!(
        "cobro_outbox_oldest_due_seconds {}\n",
        age_seconds(now, outbox.oldest_due)
    ));
    gauge_header(
        &mut text,
        "cobro_attempts_unknown",
        "Provider attempts whose outcome is unknown (unknown or reconciling), by time since their first send.",
    );
    for (age, n) in &unknown.by_age {
        text.push_str(&format!("cobro_attempts_unknown{{age=\"{age}\"}} {n}\n"));
    }
    gauge_header(
        &mut text,
        "cobro_attempts_unknown_oldest_seconds",
        "Since when the oldest unknown outcome is unknown (seconds since its first send; 0 when none).",
    );
    text.push_str(&format!(
        "cobro_attempts_unknown_oldest_seconds {}\n",
        age_seconds(now, unknown.oldest)
    ));
    gauge_header(
        &mut text,
        "cobro_evidence_conflicts_open",
        "Conflicting evidence kept and not yet resolved by an operator (table evidence_conflicts), by kind.",
    );
    for kind in CONFLICT_KINDS {
        let kind = kind.as_str();
        let n = conflicts
            .iter()
            .find(|(k, _)| k == kind)
            .map_or(0, |(_, n)| *n);
        text.push_str(&format!(
            "cobro_evidence_conflicts_open{{kind=\"{kind}\"}} {n}\n"
        ));
    }
    gauge_header(
        &mut text,
        "cobro_books_orphans_open",
        "Objects at the provider with cobro's metadata and no attempt of cobro's, not yet resolved by an operator (table books_orphans; docs/books.md).",
    );
    text.push_str(&format!("cobro_books_orphans_open {orphans}\n"));
    Ok(text)
}
