//! The JSON representations of payments and refunds. One function per
//! resource, so a POST's stored answer, a GET and a tombstone replay can
//! never disagree on shape.

use chrono::{DateTime, SecondsFormat, Utc};
use cobro_store::{AttemptRow, DbTime, PaymentRow, RefundRow};
use serde::Serialize;
use std::collections::BTreeMap;

#[derive(Serialize, utoipa::ToSchema)]
pub struct Failure {
    pub code: String,
    pub message: Option<String>,
}

/// One provider attempt, as a merchant may see it: never the provider key.
#[derive(Serialize, utoipa::ToSchema)]
pub struct AttemptView {
    pub number: usize,
    pub operation: String,
    pub reference: String,
    pub state: String,
    pub sends: i32,
    pub first_send_at: Option<String>,
    pub last_send_at: Option<String>,
}

#[derive(Serialize, utoipa::ToSchema)]
pub struct PaymentView {
    pub id: String,
    pub intent: String,
    pub order_ref: String,
    pub amount: i64,
    pub currency: String,
    pub capture_method: String,
    pub status: String,
    pub amount_captured: i64,
    pub amount_refunded: i64,
    pub provider_ref: Option<String>,
    pub failure: Option<Failure>,
    pub cancel_requested: bool,
    pub description: Option<String>,
    pub metadata: BTreeMap<String, String>,
    pub created_at: String,
    pub updated_at: String,
    /// Absent in list answers (one query per page, not per payment).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attempts: Option<Vec<AttemptView>>,
}

#[derive(Serialize, utoipa::ToSchema)]
pub struct RefundView {
    pub id: String,
    pub payment_id: String,
    pub intent: String,
    pub amount: i64,
    pub reason: Option<String>,
    pub status: String,
    pub provider_ref: Option<String>,
    pub failure: Option<Failure>,
    pub created_at: String,
    pub updated_at: String,
}

pub fn time(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Micros, true)
}

fn opt_time(t: Option<DbTime>) -> Option<String> {
    t.map(|t| time(t.0))
}

fn failure(code: &Option<String>, message: &Option<String>) -> Option<Failure> {
    code.as_ref().map(|code| Failure {
        code: code.clone(),
        message: message.clone(),
    })
}

pub fn payment(row: &PaymentRow, attempts: Option<&[AttemptRow]>) -> PaymentView {
    PaymentView {
        id: row.id.0.to_string(),
        intent: row.intent.clone(),
        order_ref: row.order_ref.clone(),
        amount: row.amount,
        currency: row.currency.clone(),
        capture_method: row.capture_method.clone(),
        status: row.status.clone(),
        amount_captured: row.amount_captured,
        amount_refunded: row.amount_refunded,
        provider_ref: row.provider_ref.clone(),
        failure: failure(&row.failure_code, &row.failure_message),
        cancel_requested: row.cancel_requested_at.is_some(),
        description: row.description.clone(),
        metadata: serde_json::from_str(&row.metadata).unwrap_or_default(),
        created_at: time(row.created_at.0),
        updated_at: time(row.updated_at.0),
        attempts: attempts.map(|attempts| {
            attempts
                .iter()
                .enumerate()
                .map(|(i, a)| AttemptView {
                    number: i + 1,
                    operation: a.operation.clone(),
                    reference: a.reference.clone(),
                    state: a.state.clone(),
                    sends: a.send_count,
                    first_send_at: opt_time(a.first_send_at),
                    last_send_at: opt_time(a.last_send_at),
                })
                .collect()
        }),
    }
}

pub fn refund(row: &RefundRow) -> RefundView {
    RefundView {
        id: row.id.0.to_string(),
        payment_id: row.payment_id.0.to_string(),
        intent: row.intent.clone(),
        amount: row.amount,
        reason: row.reason.clone(),
        status: row.status.clone(),
        provider_ref: row.provider_ref.clone(),
        failure: failure(&row.failure_code, &row.failure_message),
        created_at: time(row.created_at.0),
        updated_at: time(row.updated_at.0),
    }
}
