//! Stripe's JSON objects as the dialect renders them from the engine: a
//! PaymentIntent (from its [`Intent`] record and engine charge), a Charge,
//! a Refund and an Event. Only the fields the subset needs, with Stripe's
//! names and types: unix `created`, lower-case `currency`, ids as strings.

use chrono::{DateTime, Utc};
use serde_json::{Value, json};

use super::{API_VERSION, Intent, Requires};
use crate::model::{Charge, ChargeStatus, Refund};

/// A PaymentIntent's status, from its record and its charge.
pub(crate) fn intent_status(intent: &Intent, charge: Option<&Charge>) -> &'static str {
    if intent.canceled.is_some() {
        return "canceled";
    }
    match charge.map(|charge| charge.status) {
        Some(ChargeStatus::Processing) => "processing",
        Some(ChargeStatus::Authorized) => "requires_capture",
        Some(ChargeStatus::Captured) => "succeeded",
        Some(ChargeStatus::Declined) => "requires_payment_method",
        Some(ChargeStatus::Voided) => "canceled",
        None => match intent.requires {
            Requires::PaymentMethod => "requires_payment_method",
            Requires::Confirmation => "requires_confirmation",
            Requires::Action => "requires_action",
        },
    }
}

/// A PaymentIntent's `client_secret`, as Stripe shapes it.
pub(crate) fn client_secret(id: &str) -> String {
    format!("{id}_secret_fake")
}

pub(crate) fn intent_json(intent: &Intent, charge: Option<&Charge>) -> Value {
    let status = intent_status(intent, charge);
    let amount_capturable = match (status, charge) {
        ("requires_capture", Some(charge)) => charge.amount,
        _ => 0,
    };
    let last_payment_error = match (status, charge) {
        ("requires_payment_method", Some(charge)) => charge.decline().map(|decline| {
            json!({
                "type": "card_error",
                "code": "card_declined",
                "decline_code": decline.decline_code,
                "message": decline.message,
                "charge": charge.id,
                "payment_method": {"id": charge.payment_method, "object": "payment_method"},
            })
        }),
        _ => None,
    };
    let last_payment_error = last_payment_error.or_else(|| {
        (status == "requires_payment_method" && intent.authentication_failed).then(|| {
            json!({
                "type": "invalid_request_error",
                "code": "payment_intent_authentication_failure",
                "message": "The provided PaymentMethod has failed authentication. You can provide payment_method_data or a new PaymentMethod to attempt to fulfill this PaymentIntent again.",
                "payment_method": {"id": intent.payment_method, "object": "payment_method"},
            })
        })
    });
    // As Stripe: a redirect when the confirmation gave a `return_url`,
    // else an action only Stripe.js can run.
    let next_action = (status == "requires_action").then(|| match &intent.return_url {
        Some(return_url) => json!({
            "type": "redirect_to_url",
            "redirect_to_url": {"url": intent.challenge_url, "return_url": return_url},
        }),
        None => {
            json!({"type": "use_stripe_sdk", "use_stripe_sdk": {"type": "three_d_secure_redirect"}})
        }
    });
    json!({
        "id": intent.id,
        "object": "payment_intent",
        "amount": intent.amount,
        "amount_capturable": amount_capturable,
        "amount_received": charge.map_or(0, |charge| charge.amount_captured),
        "canceled_at": intent.canceled.as_ref().map(|canceled| canceled.at.timestamp()),
        "cancellation_reason": intent.canceled.as_ref().and_then(|canceled| canceled.reason),
        "capture_method": intent.capture_method,
        "client_secret": client_secret(&intent.id),
        "confirmation_method": "automatic",
        "created": intent.created.timestamp(),
        "currency": intent.currency,
        "customer": null,
        "description": null,
        "last_payment_error": last_payment_error,
        "latest_charge": intent.charge,
        "livemode": false,
        "metadata": intent.metadata,
        "next_action": next_action,
        "payment_method": intent.payment_method,
        "payment_method_types": intent.payment_method_types,
        "status": status,
    })
}

/// A Charge (as `charge.refunded` carries it). Stripe's charge `status` is
/// `succeeded` once authorized, captured or not (`captured` tells which),
/// `pending` while `processing`, `failed` when declined.
pub(crate) fn charge_json(charge: &Charge, payment_intent: Option<&str>) -> Value {
    let declined = charge.status == ChargeStatus::Declined;
    let status = match charge.status {
        ChargeStatus::Declined => "failed",
        ChargeStatus::Processing => "pending",
        _ => "succeeded",
    };
    let decline = charge.decline();
    json!({
        "id": charge.id,
        "object": "charge",
        "amount": charge.amount,
        "amount_captured": charge.amount_captured,
        "amount_refunded": charge.amount_refunded,
        "captured": charge.status == ChargeStatus::Captured,
        "created": charge.created.timestamp(),
        "currency": charge.currency.to_ascii_lowercase(),
        "failure_code": decline.map(|_| "card_declined"),
        "failure_message": decline.map(|decline| decline.message),
        "livemode": false,
        "metadata": charge.metadata,
        "paid": !declined && charge.status != ChargeStatus::Processing,
        "payment_intent": payment_intent,
        "payment_method": charge.payment_method,
        "refunded": charge.amount_captured > 0 && charge.amount_refunded >= charge.amount_captured,
        "status": status,
    })
}

pub(crate) fn refund_json(
    refund: &Refund,
    payment_intent: Option<&str>,
    reason: Option<&str>,
) -> Value {
    json!({
        "id": refund.id,
        "object": "refund",
        "amount": refund.amount,
        "balance_transaction": null,
        "charge": refund.charge,
        "created": refund.created.timestamp(),
        "currency": refund.currency.to_ascii_lowercase(),
        "metadata": refund.metadata,
        "payment_intent": payment_intent,
        "reason": reason,
        "status": refund.status.as_str(),
    })
}

/// What caused an event: the API request's id and idempotency key.
#[derive(Clone, Copy)]
pub(crate) struct Cause<'a> {
    pub(crate) request_id: Option<&'a str>,
    pub(crate) idempotency_key: Option<&'a str>,
}

/// An event's body. Stripe events carry no per-object sequence; `created`
/// (seconds) is the only order they give.
pub(crate) fn event_body(
    id: &str,
    kind: &str,
    created: DateTime<Utc>,
    object: &Value,
    cause: Cause<'_>,
) -> Vec<u8> {
    let event = json!({
        "id": id,
        "object": "event",
        "api_version": API_VERSION,
        "created": created.timestamp(),
        "data": {"object": object},
        "livemode": false,
        "pending_webhooks": 1,
        "request": {"id": cause.request_id, "idempotency_key": cause.idempotency_key},
        "type": kind,
    });
    serde_json::to_vec(&event).unwrap_or_default()
}
