//! The JSON representations of payments and refunds. One function per
//! resource, so a POST's stored answer, a GET and a tombstone replay can
//! never disagree on shape.

use chrono::{DateTime, SecondsFormat, Utc};
use cobro_store::{AttemptRow, DbTime, PaymentRow, RefundRow};
use serde::Serialize;
use std::collections::BTreeMap;

/// Why a payment or refund was declined or failed.
#[derive(Serialize, utoipa::ToSchema)]
pub struct Failure {
    /// The provider's (or cobro's) stable code, e.g. `card_declined`.
    #[schema(example = "card_declined")]
    pub code: String,
    pub message: Option<String>,
}

/// One provider attempt, as a merchant may see it: never the provider key.
#[derive(Serialize, utoipa::ToSchema)]
#[schema(as = Attempt)]
pub struct AttemptView {
    /// 1 for the first attempt of this payment, in creation order.
    #[schema(minimum = 1)]
    pub number: usize,
    #[schema(value_type = crate::openapi::OperationSchema)]
    pub operation: String,
    /// The provider reference: the intent name, sent as the charge's
    /// merchant reference.
    #[schema(example = "pedido-842:authorize-v1")]
    pub reference: String,
    #[schema(value_type = crate::openapi::AttemptStateSchema)]
    pub state: String,
    /// How many times this attempt was sent (retries reuse its provider key).
    #[schema(minimum = 0)]
    pub sends: i32,
    #[schema(format = DateTime)]
    pub first_send_at: Option<String>,
    #[schema(format = DateTime)]
    pub last_send_at: Option<String>,
    /// The provider it was sent to.
    #[schema(example = "stripe")]
    pub provider: Option<String>,
}

/// How a payment was routed across providers.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct RoutingView {
    /// The account's rule that matched; `null`: the default chain.
    pub rule: Option<String>,
    /// The providers the payment may go to, in order; its first attempt
    /// went to the first.
    pub chain: Vec<String>,
    /// Why, in words.
    pub reason: String,
    /// Each move to the next provider of the chain, oldest first.
    pub moves: Vec<RoutingMoveView>,
}

/// A payment's move from one provider to the next, with the proof that
/// its attempt at the first had no effect.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct RoutingMoveView {
    #[schema(example = "fake")]
    pub from: String,
    #[schema(example = "stripe")]
    pub to: String,
    /// `soft_decline: <code>`, `not_sent: ...`, `circuit_open: ...` or
    /// `no_effect: ...`.
    #[schema(example = "soft_decline: try_again_later")]
    pub proof: String,
    /// The attempt proven without effect.
    #[schema(format = Uuid)]
    pub attempt: String,
    #[schema(format = DateTime)]
    pub at: String,
}

impl From<cobro_core::routing::Route> for RoutingView {
    fn from(route: cobro_core::routing::Route) -> Self {
        RoutingView {
            rule: route.rule,
            chain: route.chain,
            reason: route.reason,
            moves: route
                .moves
                .into_iter()
                .map(|m| RoutingMoveView {
                    from: m.from,
                    to: m.to,
                    proof: m.proof,
                    attempt: m.attempt,
                    at: m.at,
                })
                .collect(),
        }
    }
}

/// A payment.
#[derive(Serialize, utoipa::ToSchema)]
#[schema(as = Payment)]
pub struct PaymentView {
    #[schema(format = Uuid, example = "0193a7c4-5f2e-7d41-9b7a-2c1d3e4f5a6b")]
    pub id: String,
    /// `{order_ref}:authorize-v{n}`: the intent that created the payment.
    #[schema(example = "pedido-842:authorize-v1")]
    pub intent: String,
    #[schema(example = "pedido-842")]
    pub order_ref: String,
    #[schema(value_type = crate::openapi::AmountSchema)]
    pub amount: i64,
    #[schema(value_type = crate::openapi::CurrencySchema)]
    pub currency: String,
    #[schema(value_type = crate::openapi::CaptureMethodSchema)]
    pub capture_method: String,
    #[schema(value_type = crate::openapi::PaymentStatusSchema)]
    pub status: String,
    /// Minor units captured so far.
    #[schema(minimum = 0)]
    pub amount_captured: i64,
    /// Minor units refunded so far.
    #[schema(minimum = 0)]
    pub amount_refunded: i64,
    /// The provider's charge id, once known.
    pub provider_ref: Option<String>,
    /// Set when declined or failed.
    pub failure: Option<Failure>,
    /// A cancel was asked while the authorisation outcome was unknown; it
    /// is carried out once the outcome is known.
    pub cancel_requested: bool,
    pub description: Option<String>,
    /// The request's metadata (`{}` when none was sent).
    pub metadata: BTreeMap<String, String>,
    #[schema(format = DateTime)]
    pub created_at: String,
    #[schema(format = DateTime)]
    pub updated_at: String,
    /// Where the provider sends the customer back after authenticating
    /// (3-D Secure), as given on create.
    #[schema(format = "uri", example = "https://shop.example/pedido-842/vuelta")]
    pub return_url: Option<String>,
    /// While `requires_action`: what the merchant's front end does with
    /// the customer. `{"type": "redirect_to_url", "redirect_to_url":
    /// {"url": ..., "return_url": ...}}` (send the customer to `url`; the
    /// provider sends them back to `return_url`), or `{"type":
    /// "use_stripe_sdk"}`; with Stripe, `client_secret` too (for
    /// Stripe.js). `null` in every other status.
    #[schema(value_type = Option<Object>)]
    pub next_action: Option<serde_json::Value>,
    /// While `requires_action`: when the payment is canceled as abandoned
    /// if the customer has not finished by then.
    #[schema(format = DateTime)]
    pub action_expires_at: Option<String>,
    /// The provider its current attempt goes to, and the one that holds
    /// its charge once it has one.
    #[schema(example = "stripe")]
    pub provider: Option<String>,
    /// How it was routed (docs/routing.md); `null` for a payment made
    /// before routing.
    pub routing: Option<RoutingView>,
    /// The provider attempts (never the provider key itself). Absent in list
    /// answers (one query per page, not per payment) and in the answers of
    /// capture and cancel.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub attempts: Option<Vec<AttemptView>>,
}

/// A refund of a payment.
#[derive(Serialize, utoipa::ToSchema)]
#[schema(as = Refund)]
pub struct RefundView {
    #[schema(format = Uuid)]
    pub id: String,
    #[schema(format = Uuid)]
    pub payment_id: String,
    /// `{order_ref}:refund-v{n}`.
    #[schema(example = "pedido-842:refund-v1")]
    pub intent: String,
    #[schema(value_type = crate::openapi::AmountSchema)]
    pub amount: i64,
    pub reason: Option<String>,
    #[schema(value_type = crate::openapi::RefundStatusSchema)]
    pub status: String,
    /// The provider's refund id, once known.
    pub provider_ref: Option<String>,
    /// Set when the refund failed.
    pub failure: Option<Failure>,
    #[schema(format = DateTime)]
    pub created_at: String,
    #[schema(format = DateTime)]
    pub updated_at: String,
    /// The merchant's reference for the refund, unique per payment, when
    /// it gave one.
    pub reference: Option<String>,
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
    let waiting = row.status == cobro_core::PaymentStatus::RequiresAction;
    PaymentView {
        id: row.id.to_string(),
        intent: row.intent.clone(),
        order_ref: row.order_ref.clone(),
        amount: row.amount,
        currency: row.currency.to_string(),
        capture_method: row.capture_method.to_string(),
        status: row.status.to_string(),
        amount_captured: row.amount_captured,
        amount_refunded: row.amount_refunded,
        provider_ref: row.provider_ref.clone(),
        failure: failure(&row.failure_code, &row.failure_message),
        cancel_requested: row.cancel_requested_at.is_some(),
        description: row.description.clone(),
        metadata: serde_json::from_str(&row.metadata).unwrap_or_default(),
        created_at: time(row.created_at.0),
        updated_at: time(row.updated_at.0),
        return_url: row.return_url.clone(),
        next_action: row
            .next_action
            .as_deref()
            .filter(|_| waiting)
            .and_then(|text| serde_json::from_str(text).ok()),
        action_expires_at: opt_time(row.action_expires_at).filter(|_| waiting),
        provider: row.provider.clone(),
        routing: row
            .route
            .as_deref()
            .and_then(cobro_core::routing::Route::from_json)
            .map(RoutingView::from),
        attempts: attempts.map(|attempts| {
            attempts
                .iter()
                .enumerate()
                .map(|(i, a)| AttemptView {
                    number: i + 1,
                    operation: a.operation.to_string(),
                    reference: a.reference.clone(),
                    state: a.state.to_string(),
                    sends: a.send_count,
                    first_send_at: opt_time(a.first_send_at),
                    last_send_at: opt_time(a.last_send_at),
                    provider: a.provider.clone(),
                })
                .collect()
        }),
    }
}

pub fn refund(row: &RefundRow) -> RefundView {
    RefundView {
        id: row.id.to_string(),
        payment_id: row.payment_id.to_string(),
        intent: row.intent.clone(),
        amount: row.amount,
        reason: row.reason.clone(),
        status: row.status.to_string(),
        provider_ref: row.provider_ref.clone(),
        failure: failure(&row.failure_code, &row.failure_message),
        created_at: time(row.created_at.0),
        updated_at: time(row.updated_at.0),
        reference: row.reference.clone(),
    }
}
