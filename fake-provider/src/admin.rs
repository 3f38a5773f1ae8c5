//! `/__admin`: the control API over HTTP, mounted only when `admin` is on.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::extract::rejection::JsonRejection;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::config::{WebhookDialect, WebhookTarget};
use crate::control::Control;
use crate::faults::FaultRule;
use crate::state::Shared;

pub(crate) fn routes() -> Router<Arc<Shared>> {
    Router::new()
        .route(
            "/__admin/faults",
            post(add_fault).get(list_faults).delete(clear_faults),
        )
        .route("/__admin/clock", get(clock))
        .route("/__admin/clock/advance", post(advance_clock))
        .route("/__admin/ledger", get(ledger))
        .route("/__admin/webhooks", put(set_webhook).delete(remove_webhook))
        .route(
            "/__admin/webhooks/dialect",
            put(set_webhook_dialect).get(webhook_dialect),
        )
        .route("/__admin/webhooks/deliveries", get(deliveries))
        .route("/__admin/requests", get(requests))
        .route("/__admin/held", get(held))
        .route("/__admin/held/release", post(release_held))
}

type Admin = State<Arc<Shared>>;

/// `{"id": n}`.
#[derive(Serialize, Deserialize)]
pub(crate) struct FaultId {
    pub(crate) id: u64,
}

/// `{"seconds": n}`; fractions allowed.
#[derive(Serialize, Deserialize)]
pub(crate) struct Advance {
    pub(crate) seconds: f64,
}

/// `PUT /__admin/webhooks`: a target, optionally with the dialect of its
/// events (left as it is when absent).
#[derive(Serialize, Deserialize)]
pub(crate) struct TargetBody {
    #[serde(flatten)]
    pub(crate) target: WebhookTarget,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) dialect: Option<WebhookDialect>,
}

/// `{"dialect": "fake" | "stripe"}`.
#[derive(Serialize, Deserialize)]
pub(crate) struct DialectBody {
    pub(crate) dialect: WebhookDialect,
}

/// `{"held": n}`: requests held by `hold_effect` faults.
#[derive(Serialize, Deserialize)]
pub(crate) struct Held {
    pub(crate) held: usize,
}

/// `{"released": n}`: held requests whose effect was just made.
#[derive(Serialize, Deserialize)]
pub(crate) struct Released {
    pub(crate) released: usize,
}

/// `{"now": RFC 3339}`.
#[derive(Serialize, Deserialize)]
pub(crate) struct Now {
    pub(crate) now: DateTime<Utc>,
}

fn bad_request(message: impl std::fmt::Display) -> Response {
    let body = serde_json::json!({"error": {"type": "invalid_request_error", "code": "parameter_invalid", "message": message.to_string()}});
    (StatusCode::BAD_REQUEST, Json(body)).into_response()
}

async fn add_fault(State(shared): Admin, rule: Result<Json<FaultRule>, JsonRejection>) -> Response {
    let rule = match rule {
        Ok(Json(rule)) => rule,
        Err(rejection) => return bad_request(rejection.body_text()),
    };
    if let Err(message) = rule.validate() {
        return bad_request(message);
    }
    Json(FaultId {
        id: Control::new(shared).add_fault(rule),
    })
    .into_response()
}

async fn list_faults(State(shared): Admin) -> Response {
    Json(Control::new(shared).faults()).into_response()
}

async fn clear_faults(State(shared): Admin) -> StatusCode {
    Control::new(shared).clear_faults();
    StatusCode::NO_CONTENT
}

async fn clock(State(shared): Admin) -> Json<Now> {
    Json(Now {
        now: Control::new(shared).now(),
    })
}

async fn advance_clock(
    State(shared): Admin,
    advance: Result<Json<Advance>, JsonRejection>,
) -> Response {
    let seconds = match advance {
        Ok(Json(Advance { seconds })) => seconds,
        Err(rejection) => return bad_request(rejection.body_text()),
    };
    let Ok(by) = Duration::try_from_secs_f64(seconds) else {
        return bad_request("seconds must be a finite, non-negative number");
    };
    let control = Control::new(shared);
    control.advance_clock(by);
    Json(Now { now: control.now() }).into_response()
}

async fn ledger(State(shared): Admin) -> Response {
    Json(Control::new(shared).ledger()).into_response()
}

async fn set_webhook(
    State(shared): Admin,
    body: Result<Json<TargetBody>, JsonRejection>,
) -> Response {
    match body {
        Ok(Json(TargetBody { target, dialect })) => {
            let control = Control::new(shared);
            if let Some(dialect) = dialect {
                control.set_webhook_dialect(dialect);
            }
            control.set_webhook(Some(target));
            StatusCode::NO_CONTENT.into_response()
        }
        Err(rejection) => bad_request(rejection.body_text()),
    }
}

async fn set_webhook_dialect(
    State(shared): Admin,
    body: Result<Json<DialectBody>, JsonRejection>,
) -> Response {
    match body {
        Ok(Json(DialectBody { dialect })) => {
            Control::new(shared).set_webhook_dialect(dialect);
            StatusCode::NO_CONTENT.into_response()
        }
        Err(rejection) => bad_request(rejection.body_text()),
    }
}

async fn webhook_dialect(State(shared): Admin) -> Json<DialectBody> {
    Json(DialectBody {
        dialect: Control::new(shared).webhook_dialect(),
    })
}

async fn remove_webhook(State(shared): Admin) -> StatusCode {
    Control::new(shared).set_webhook(None);
    StatusCode::NO_CONTENT
}

async fn deliveries(State(shared): Admin) -> Response {
    Json(Control::new(shared).webhook_deliveries()).into_response()
}

/// `GET /__admin/requests`: the last API requests with their trace context.
async fn requests(State(shared): Admin) -> Response {
    Json(Control::new(shared).requests()).into_response()
}

/// `GET /__admin/held`: how many requests `hold_effect` faults hold.
async fn held(State(shared): Admin) -> Json<Held> {
    Json(Held {
        held: Control::new(shared).held(),
    })
}

/// `POST /__admin/held/release`: makes every held request's effect now.
async fn release_held(State(shared): Admin) -> Json<Released> {
    Json(Released {
        released: Control::new(shared).release_held(),
    })
}
