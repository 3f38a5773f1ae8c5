//! Stripe's webhooks: `Stripe-Signature` and Stripe's event objects.
//!
//! ## Signature
//! `Stripe-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>.<raw
//! body>")>[,v1=...][,v0=...]`: one implementation with the fake's and
//! cobro's own (`cobro_core::signature`): any `v1` may match any of the
//! secrets (the current one and, while it rotates, the previous), compared
//! in constant time by `hmac`'s `verify_slice`; `v0` (Stripe's test-mode
//! scheme) and other schemes are ignored; `t` must be within the tolerance
//! (default [`StripeWebhooks::DEFAULT_TOLERANCE`], 300 s, Stripe's own) of
//! cobro's clock, either way.
//!
//! Either way is stricter than Stripe's libraries, which refuse only an
//! old `t` (stripe-python's `verify_header`: `timestamp < time.time() -
//! tolerance`; stripe-node: `timestampAge > tolerance`) and accept any
//! future one. cobro keeps the bound ahead too, on purpose:
//! - a `t` ahead of cobro's clock by more than the tolerance means one of
//!   the two clocks is wrong by over five minutes (Stripe's senders keep
//!   theirs; Stripe asks receivers to keep theirs by NTP), and an
//!   unbounded `t` would keep a captured delivery replayable for as long
//!   as the skew plus the tolerance;
//! - refusing costs no event: Stripe retries a refused delivery (for up to
//!   three days in live mode, three times over a few hours in a sandbox)
//!   and "generate[s] a new signature and timestamp for the new delivery
//!   attempt", so a short skew only delays it.
//!
//! The refusal says which side was out (`timestamp ahead of cobro's clock
//! beyond the tolerance`: cobro's clock is behind, or the header is
//! forged), for the operator who reads the log line.
//!
//! ## Events
//! | type | kind |
//! |---|---|
//! | `payment_intent.amount_capturable_updated` | `Authorized` |
//! | `payment_intent.succeeded` | `Captured` |
//! | `payment_intent.payment_failed` | `Declined` |
//! | `payment_intent.canceled` | `Voided` if it was charged and the charge did not fail; else `Declined` (it never held money) |
//! | `refund.created`, `refund.updated`, `refund.failed`, `charge.refund.updated` | by the refund's status: `succeeded` `RefundSucceeded`; `failed`, `canceled` `RefundFailed`; `pending`, `requires_action` `Other` (nothing yet) |
//! | `charge.refunded` and every other type | `Other` |
//!
//! `charge.refunded` carries the Charge, not the refund (Stripe: "listen to
//! `refund.created` for information about the refund"): it cannot be tied
//! to one refund attempt, so it proves nothing. An event whose object
//! carries no `cobro_reference` is not about anything cobro sent (the
//! Stripe account may have other traffic): it is `Other`, answered 200 and
//! kept as unmatched, rather than refused with a 400 Stripe would retry for
//! days.
//!
//! ## Never backwards
//! Stripe events carry no per-object sequence, and arrive duplicated and
//! out of order. The `sequence` is derived from the state order of the
//! object, then the event's `created` (whole seconds):
//! `sequence = rank * 10^10 + created`, where
//! - PaymentIntent: `requires_payment_method`, `requires_confirmation`,
//!   `requires_action`, `processing`, `requires_capture` are 1; `succeeded`
//!   and `canceled` (terminal) are 2;
//! - Refund: `pending`, `requires_action` are 1; `succeeded`, `failed`,
//!   `canceled` are 2;
//! - anything else is 0.
//!
//! So a terminal event beats every earlier state even within the same
//! second (an authorisation captured at once), an older event delivered
//! late is stale, and a redelivery has the same id and the same sequence.
//! (`created` stays below 10^10 until the year 2286.) A refund event raises
//! the payment's recorded sequence too; it can only exist once the
//! PaymentIntent succeeded and cobro recorded the capture (cobro refunds
//! captured payments only), so it never hides a PaymentIntent event cobro
//! still needs.

use super::objects::{PaymentIntent, Refund, cobro_amount};
use crate::webhook::{
    EventKind, FieldProblem, ProviderEvent, WebhookScheme, verify_signature_header,
};
use crate::{ProviderObject, ProviderStatus, metadata};
use reqwest::header::HeaderMap;
use serde_json::{Map, Value};
use std::time::Duration;

/// Stripe's scheme.
#[derive(Clone, Copy, Debug, Default)]
pub struct StripeWebhooks;

/// How far apart two ranks are in a derived sequence: above any `created`.
const RANK: i64 = 10_000_000_000;

impl StripeWebhooks {
    /// The signature header's name.
    pub const SIGNATURE_HEADER: &'static str = "stripe-signature";
    /// Stripe's own default tolerance for `t`.
    pub const DEFAULT_TOLERANCE: Duration = Duration::from_secs(300);

    fn kind(type_name: &str, object: &StripeObject) -> EventKind {
        match (type_name, object) {
            ("payment_intent.amount_capturable_updated", StripeObject::PaymentIntent(_)) => {
                EventKind::Authorized
            }
            ("payment_intent.succeeded", StripeObject::PaymentIntent(_)) => EventKind::Captured,
            ("payment_intent.payment_failed", StripeObject::PaymentIntent(_)) => {
                EventKind::Declined
            }
            // Voided only if it ever held money (`payment_intent_status`).
            ("payment_intent.canceled", StripeObject::PaymentIntent(intent)) => {
                match intent.cobro_status() {
                    ProviderStatus::Voided => EventKind::Voided,
                    _ => EventKind::Declined,
                }
            }
            (
                "refund.created" | "refund.updated" | "refund.failed" | "charge.refund.updated",
                StripeObject::Refund(r),
            ) => match r.status.as_deref() {
                Some("succeeded") => EventKind::RefundSucceeded,
                Some("failed" | "canceled") => EventKind::RefundFailed,
                _ => EventKind::Other,
            },
            _ => EventKind::Other,
        }
    }

    /// The state order of `object` (see the module doc).
    fn rank(object: &StripeObject) -> i64 {
        match object {
            StripeObject::PaymentIntent(pi) => match pi.status.as_str() {
                "requires_payment_method"
                | "requires_confirmation"
                | "requires_action"
                | "processing"
                | "requires_capture" => 1,
                "succeeded" | "canceled" => 2,
                _ => 0,
            },
            StripeObject::Refund(r) => match r.status.as_deref() {
                Some("pending" | "requires_action") => 1,
                Some("succeeded" | "failed" | "canceled") => 2,
                _ => 0,
            },
            StripeObject::Other(_) => 0,
        }
    }

    /// The derived sequence of an event about `object` created at
    /// `created` (unix seconds).
    fn sequence(object: &StripeObject, created: i64) -> i64 {
        Self::rank(object) * RANK + created
    }
}

/// The object an event carries, as far as cobro reads it.
enum StripeObject {
    PaymentIntent(PaymentIntent),
    Refund(Refund),
    /// A Charge or anything else: kept for the record only.
    Other(Map<String, Value>),
}

impl StripeObject {
    fn read(data: &Map<String, Value>) -> Result<Self, &'static str> {
        let value = Value::Object(data.clone());
        match data.get("object").and_then(Value::as_str) {
            Some("payment_intent") => serde_json::from_value(value)
                .map(StripeObject::PaymentIntent)
                .map_err(|_| "must be a PaymentIntent (id, status, amount, currency, metadata)"),
            Some("refund") => serde_json::from_value(value)
                .map(StripeObject::Refund)
                .map_err(|_| "must be a Refund (id, status, amount, currency, metadata)"),
            _ => Ok(StripeObject::Other(data.clone())),
        }
    }

    fn reference(&self) -> Option<String> {
        let metadata = match self {
            StripeObject::PaymentIntent(pi) => pi.metadata.as_ref(),
            StripeObject::Refund(r) => r.metadata.as_ref(),
            StripeObject::Other(_) => None,
        }?;
        metadata
            .get(metadata::REFERENCE)
            .filter(|r| !r.is_empty())
            .cloned()
    }

    fn into_object(self) -> ProviderObject {
        match self {
            StripeObject::PaymentIntent(pi) => pi.into_object(),
            StripeObject::Refund(r) => r.into_object(),
            StripeObject::Other(map) => {
                let text = |name: &str| map.get(name).and_then(Value::as_str).map(str::to_owned);
                let metadata = map
                    .get("metadata")
                    .and_then(Value::as_object)
                    .map(|m| {
                        m.iter()
                            .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_owned())))
                            .collect()
                    })
                    .unwrap_or_default();
                // Never a status cobro could read as proof (a Charge is
                // `succeeded` too).
                let status = format!(
                    "{}:{}",
                    text("object").unwrap_or_default(),
                    text("status").unwrap_or_default()
                );
                ProviderObject {
                    id: text("id").unwrap_or_default(),
                    status: ProviderStatus::Other(status),
                    reference: None,
                    // In cobro's minor units, as every object's.
                    amount: cobro_amount(
                        text("currency").as_deref(),
                        map.get("amount").and_then(Value::as_i64),
                    ),
                    amount_captured: None,
                    sequence: None,
                    currency: text("currency").map(|c| c.to_ascii_uppercase()),
                    capture_method: None,
                    charge: text("payment_intent"),
                    metadata,
                    next_action: None,
                    decline_code: None,
                    confirmable: false,
                }
            }
        }
    }
}

/// The refusal of a `t` older than the tolerance (cobro's shared wording).
const TOO_OLD: &str = "timestamp outside the tolerance";
/// The refusal of a `t` ahead of cobro's clock by more than the tolerance.
const AHEAD: &str = "timestamp ahead of cobro's clock beyond the tolerance";

/// The `t` of a `Stripe-Signature` header, when there is one to read.
fn signed_at(headers: &HeaderMap) -> Option<i64> {
    let header = headers
        .get(StripeWebhooks::SIGNATURE_HEADER)?
        .to_str()
        .ok()?;
    header
        .split(',')
        .find_map(|part| part.trim().strip_prefix("t="))
        .and_then(|t| t.parse().ok())
}

impl WebhookScheme for StripeWebhooks {
    /// `Stripe-Signature`, with `t` bounded both ways (see the module doc:
    /// stricter than Stripe's libraries, which accept any future `t`).
    fn verify(
        &self,
        headers: &HeaderMap,
        body: &[u8],
        secrets: &[&str],
        now: i64,
        tolerance: Duration,
    ) -> Result<(), &'static str> {
        verify_signature_header(
            headers,
            Self::SIGNATURE_HEADER,
            body,
            secrets,
            now,
            tolerance,
        )
        .map_err(|why| match why {
            TOO_OLD if signed_at(headers).is_some_and(|t| t > now) => AHEAD,
            other => other,
        })
    }

    fn parse(&self, body: &[u8]) -> Result<ProviderEvent, Vec<FieldProblem>> {
        let root = crate::webhook::json_object(body)?;
        let mut errors = Vec::new();
        let mut string = |name: &str| match root.get(name) {
            Some(Value::String(s)) if !s.is_empty() => Some(s.clone()),
            _ => {
                errors.push(FieldProblem::new(name, "must be a non-empty string"));
                None
            }
        };
        let id = string("id");
        let type_name = string("type");
        let created = root
            .get("created")
            .and_then(Value::as_i64)
            .filter(|c| (0..RANK).contains(c));
        if created.is_none() {
            errors.push(FieldProblem::new(
                "created",
                "must be unix seconds (a non-negative integer)",
            ));
        }
        let object = match root
            .get("data")
            .and_then(|d| d.get("object"))
            .and_then(Value::as_object)
        {
            Some(data) => match StripeObject::read(data) {
                Ok(object) => Some(object),
                Err(why) => {
                    errors.push(FieldProblem::new("data.object", why));
                    None
                }
            },
            None => {
                errors.push(FieldProblem::new("data.object", "must be an object"));
                None
            }
        };
        match (id, type_name, created, object) {
            (Some(id), Some(type_name), Some(created), Some(object)) if errors.is_empty() => {
                let reference = object.reference();
                let kind = match reference {
                    Some(_) => Self::kind(&type_name, &object),
                    None => EventKind::Other,
                };
                let sequence = Self::sequence(&object, created);
                Ok(ProviderEvent {
                    id,
                    type_name,
                    kind,
                    sequence,
                    reference: reference.unwrap_or_default(),
                    object: object.into_object(),
                })
            }
            _ => Err(errors),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use reqwest::header::HeaderValue;
    use serde_json::json;
    use std::collections::BTreeMap;

    const NOW: i64 = 1_800_000_000;
    const BODY: &[u8] = br#"{"id":"evt_1","object":"event"}"#;
    const SECRET: &str = "whsec_current";
    const PREVIOUS: &str = "whsec_previous";

    fn headers(value: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            StripeWebhooks::SIGNATURE_HEADER,
            HeaderValue::from_str(value).expect("ascii"),
        );
        h
    }

    fn check_with(value: &str, secrets: &[&str]) -> Result<(), &'static str> {
        StripeWebhooks.verify(
            &headers(value),
            BODY,
            secrets,
            NOW,
            StripeWebhooks::DEFAULT_TOLERANCE,
        )
    }

    fn check(value: &str) -> Result<(), &'static str> {
        check_with(value, &[SECRET])
    }

    fn v1(secret: &str, t: i64, body: &[u8]) -> String {
        // `t=<t>,v1=<hex>`: the header Stripe sends.
        cobro_core::signature::sign(&[secret], t, body)
    }

    fn hex_of(header: &str) -> &str {
        header.split_once(",v1=").expect("v1").1
    }

    #[test]
    fn a_signature_made_with_the_secret_verifies() {
        assert_eq!(check(&v1(SECRET, NOW, BODY)), Ok(()));
        assert_eq!(check(&v1(SECRET, NOW - 300, BODY)), Ok(()), "at the edge");
    }

    #[test]
    fn a_signature_made_with_another_secret_is_refused() {
        assert_eq!(
            check(&v1("whsec_other", NOW, BODY)),
            Err("no signature matches")
        );
        assert_eq!(
            StripeWebhooks.verify(
                &headers(&v1(SECRET, NOW, BODY)),
                b"{\"id\":\"evt_2\"}",
                &[SECRET],
                NOW,
                StripeWebhooks::DEFAULT_TOLERANCE
            ),
            Err("no signature matches"),
            "another body"
        );
    }

    #[test]
    fn one_valid_v1_among_several_is_enough_and_v0_is_ignored() {
        let good = v1(SECRET, NOW, BODY);
        let bad = v1("whsec_other", NOW, BODY);
        let header = format!(
            "t={NOW},v1={},v1={},v0={}",
            hex_of(&bad),
            hex_of(&good),
            hex_of(&bad)
        );
        assert_eq!(check(&header), Ok(()));
        // A valid digest under v0 proves nothing.
        let only_v0 = format!("t={NOW},v0={}", hex_of(&good));
        assert_eq!(check(&only_v0), Err("no signature matches"));
    }

    #[test]
    fn an_expired_timestamp_is_refused() {
        assert_eq!(check(&v1(SECRET, NOW - 301, BODY)), Err(TOO_OLD));
        assert_eq!(check(&v1(SECRET, NOW - 86_400, BODY)), Err(TOO_OLD));
    }

    /// Stripe's libraries accept any `t` in the future; cobro accepts one
    /// within the tolerance (a sender's clock slightly ahead) and refuses
    /// one beyond it, saying it was ahead (module doc: why).
    #[test]
    fn a_future_timestamp_is_accepted_within_the_tolerance_and_refused_beyond_it() {
        assert_eq!(check(&v1(SECRET, NOW + 1, BODY)), Ok(()));
        assert_eq!(check(&v1(SECRET, NOW + 300, BODY)), Ok(()), "at the edge");
        assert_eq!(check(&v1(SECRET, NOW + 301, BODY)), Err(AHEAD));
        assert_eq!(check(&v1(SECRET, NOW + 86_400, BODY)), Err(AHEAD));
        // Unsigned or forged, a far-future header is refused all the same.
        let forged = format!("t={},v1={}", NOW + 86_400, "00".repeat(32));
        assert_eq!(check(&forged), Err(AHEAD));
        // A smaller tolerance bounds both sides alike.
        let tight = Duration::from_secs(10);
        let at = |t: i64| {
            StripeWebhooks.verify(&headers(&v1(SECRET, t, BODY)), BODY, &[SECRET], NOW, tight)
        };
        assert_eq!(at(NOW + 10), Ok(()));
        assert_eq!(at(NOW + 11), Err(AHEAD));
        assert_eq!(at(NOW - 11), Err(TOO_OLD));
    }

    #[test]
    fn a_malformed_header_is_refused() {
        for bad in [
            String::new(),
            "garbage".to_owned(),
            format!("t={NOW}"),
            format!("v1={}", hex_of(&v1(SECRET, NOW, BODY))),
            format!("t=soon,v1={}", hex_of(&v1(SECRET, NOW, BODY))),
            format!("t={NOW},v1=zz"),
            format!("t={NOW},v1="),
        ] {
            assert!(check(&bad).is_err(), "{bad:?}");
        }
        let none = StripeWebhooks.verify(
            &HeaderMap::new(),
            BODY,
            &[SECRET],
            NOW,
            StripeWebhooks::DEFAULT_TOLERANCE,
        );
        assert_eq!(none, Err("header missing"));
        let mut twice = headers(&v1(SECRET, NOW, BODY));
        twice.append(
            StripeWebhooks::SIGNATURE_HEADER,
            HeaderValue::from_str(&v1(SECRET, NOW, BODY)).expect("ascii"),
        );
        assert_eq!(
            StripeWebhooks.verify(&twice, BODY, &[SECRET], NOW, Duration::from_secs(300)),
            Err("more than one header")
        );
    }

    #[test]
    fn a_signature_made_with_the_previous_secret_verifies_while_it_rotates() {
        let old = v1(PREVIOUS, NOW, BODY);
        assert_eq!(check_with(&old, &[SECRET, PREVIOUS]), Ok(()));
        assert_eq!(check_with(&old, &[SECRET]), Err("no signature matches"));
    }

    /// An event as Stripe sends it (API version 2024-06-20).
    fn event(id: &str, type_name: &str, created: i64, object: Value) -> Vec<u8> {
        serde_json::to_vec(&serde_json::json!({
            "id": id,
            "object": "event",
            "api_version": "2024-06-20",
            "created": created,
            "data": {"object": object},
            "livemode": false,
            "pending_webhooks": 1,
            "request": {"id": "req_1", "idempotency_key": "k-1"},
            "type": type_name,
        }))
        .expect("json")
    }

    fn intent(status: &str) -> Value {
        serde_json::json!({
            "id": "pi_1", "object": "payment_intent", "amount": 1999, "amount_capturable": 0,
            "amount_received": if status == "succeeded" { 1999 } else { 0 },
            "capture_method": "manual", "currency": "eur", "created": NOW - 10,
            "last_payment_error": if status == "requires_payment_method" {
                serde_json::json!({"type": "card_error", "code": "card_declined", "decline_code": "generic_decline"})
            } else { Value::Null },
            "latest_charge": "ch_1", "livemode": false,
            "metadata": {"cobro_reference": "o-1:authorize-v1/a", "cobro_attempt": "a"},
            "payment_method": "pm_1", "payment_method_types": ["card"], "status": status,
        })
    }

    fn refund(status: &str) -> Value {
        serde_json::json!({
            "id": "re_1", "object": "refund", "amount": 500, "charge": "ch_1", "created": NOW - 5,
            "currency": "eur", "metadata": {"cobro_reference": "o-1:refund-v1/r"},
            "payment_intent": "pi_1", "reason": null, "status": status,
        })
    }

    fn parse(body: &[u8]) -> ProviderEvent {
        StripeWebhooks.parse(body).expect("parses")
    }

    #[test]
    fn payment_intent_events_parse_into_cobros_kinds() {
        use crate::ProviderStatus as S;
        for (type_name, status, kind, object_status) in [
            (
                "payment_intent.amount_capturable_updated",
                "requires_capture",
                EventKind::Authorized,
                S::Authorized,
            ),
            (
                "payment_intent.succeeded",
                "succeeded",
                EventKind::Captured,
                S::Captured,
            ),
            (
                "payment_intent.payment_failed",
                "requires_payment_method",
                EventKind::Declined,
                S::Declined,
            ),
            (
                "payment_intent.canceled",
                "canceled",
                EventKind::Voided,
                S::Voided,
            ),
        ] {
            let e = parse(&event("evt_1", type_name, NOW, intent(status)));
            assert_eq!(e.kind, kind, "{type_name}");
            assert_eq!(e.type_name, type_name);
            assert_eq!(e.reference, "o-1:authorize-v1/a");
            assert_eq!(e.object.id, "pi_1");
            assert_eq!(e.object.status, object_status);
            assert_eq!(e.object.currency.as_deref(), Some("EUR"));
            assert_eq!(e.object.amount, Some(1999));
            assert_eq!(e.object.capture_method.as_deref(), Some("manual"));
        }
    }

    /// Canceled while it waited for the customer (never charged), or
    /// after its one charge was declined: it never held money, so its
    /// cancel is a decline, not a void that would contradict a payment
    /// cobro failed.
    #[test]
    fn a_payment_intent_canceled_without_holding_money_is_a_decline() {
        let mut never_charged = intent("requires_action");
        never_charged["status"] = "canceled".into();
        never_charged["latest_charge"] = Value::Null;
        let mut declined = intent("requires_payment_method");
        declined["status"] = "canceled".into();
        for object in [never_charged, declined] {
            let e = parse(&event("evt_c", "payment_intent.canceled", NOW, object));
            assert_eq!(e.kind, EventKind::Declined);
            assert_eq!(e.object.status, ProviderStatus::Declined);
        }
    }

    #[test]
    fn refund_events_parse_by_the_refunds_status() {
        for (type_name, status, kind) in [
            ("refund.created", "succeeded", EventKind::RefundSucceeded),
            ("refund.updated", "succeeded", EventKind::RefundSucceeded),
            (
                "charge.refund.updated",
                "succeeded",
                EventKind::RefundSucceeded,
            ),
            ("refund.failed", "failed", EventKind::RefundFailed),
            ("refund.updated", "canceled", EventKind::RefundFailed),
            ("refund.created", "pending", EventKind::Other),
            ("refund.updated", "requires_action", EventKind::Other),
        ] {
            let e = parse(&event("evt_1", type_name, NOW, refund(status)));
            assert_eq!(e.kind, kind, "{type_name} {status}");
            assert_eq!(e.reference, "o-1:refund-v1/r");
            assert_eq!(e.object.charge.as_deref(), Some("pi_1"));
            assert_eq!(e.object.amount, Some(500));
        }
    }

    #[test]
    fn event_amounts_are_read_in_cobros_minor_units() {
        let mut isk = intent("succeeded");
        isk["currency"] = json!("isk");
        isk["amount"] = json!(500_000);
        isk["amount_received"] = json!(500_000);
        let e = parse(&event("evt_1", "payment_intent.succeeded", NOW, isk));
        assert_eq!(e.object.currency.as_deref(), Some("ISK"));
        assert_eq!(e.object.amount, Some(5000));
        assert_eq!(e.object.amount_captured, Some(5000));
        let mut refund = refund("succeeded");
        refund["currency"] = json!("isk");
        refund["amount"] = json!(120_000);
        let e = parse(&event("evt_2", "refund.created", NOW, refund));
        assert_eq!(e.object.amount, Some(1200));
        let charge = json!({
            "id": "ch_1", "object": "charge", "amount": 500_000, "currency": "isk",
            "payment_intent": "pi_1", "status": "succeeded",
        });
        let e = parse(&event("evt_3", "charge.refunded", NOW, charge));
        assert_eq!(e.object.amount, Some(5000));
    }

    #[test]
    fn charge_refunded_and_other_types_prove_nothing() {
        let charge = serde_json::json!({
            "id": "ch_1", "object": "charge", "amount": 1999, "amount_refunded": 500,
            "currency": "eur", "payment_intent": "pi_1", "refunded": false, "status": "succeeded",
            "metadata": {"cobro_reference": "o-1:authorize-v1/a"},
        });
        let e = parse(&event("evt_1", "charge.refunded", NOW, charge));
        assert_eq!(e.kind, EventKind::Other);
        assert_eq!(e.object.id, "ch_1");
        assert_eq!(
            e.object.status,
            crate::ProviderStatus::Other("charge:succeeded".into()),
            "a Charge's `succeeded` is never read as a refund's"
        );
        let e = parse(&event(
            "evt_2",
            "payment_intent.created",
            NOW,
            intent("requires_payment_method"),
        ));
        assert_eq!(e.kind, EventKind::Other);
        // A PaymentIntent cobro did not create (no cobro_reference).
        let mut foreign = intent("succeeded");
        foreign["metadata"] = serde_json::json!({"order": "theirs"});
        let e = parse(&event("evt_3", "payment_intent.succeeded", NOW, foreign));
        assert_eq!(e.kind, EventKind::Other);
        assert_eq!(e.reference, "");
    }

    #[test]
    fn events_without_their_fields_are_refused_with_every_field_named() {
        let errors = StripeWebhooks
            .parse(br#"{"type":"","created":-1,"data":{}}"#)
            .expect_err("refused");
        let fields: Vec<&str> = errors.iter().map(|e| e.field.as_str()).collect();
        for field in ["id", "type", "created", "data.object"] {
            assert!(fields.contains(&field), "{field} in {fields:?}");
        }
        let broken = event(
            "evt_1",
            "payment_intent.succeeded",
            NOW,
            serde_json::json!({"object": "payment_intent", "id": "pi_1"}),
        );
        let errors = StripeWebhooks.parse(&broken).expect_err("no status");
        assert_eq!(errors[0].field, "data.object");
        assert!(StripeWebhooks.parse(b"not json").is_err());
        assert!(StripeWebhooks.parse(b"[1]").is_err());
        assert!(StripeWebhooks.parse(&[0xff, 0xfe]).is_err());
        let nul = StripeWebhooks
            .parse(b"{\"id\":\"evt\\u0000\"}")
            .expect_err("refused");
        assert_eq!(nul[0].field, "id");
    }

    #[test]
    fn a_terminal_event_is_newer_than_an_earlier_state_even_in_the_same_second() {
        let authorized = parse(&event(
            "evt_a",
            "payment_intent.amount_capturable_updated",
            NOW,
            intent("requires_capture"),
        ));
        let captured = parse(&event(
            "evt_c",
            "payment_intent.succeeded",
            NOW,
            intent("succeeded"),
        ));
        assert!(captured.sequence > authorized.sequence);
        // Delivered an hour late, the authorisation is still older.
        let late = parse(&event(
            "evt_a2",
            "payment_intent.amount_capturable_updated",
            NOW + 3600,
            intent("requires_capture"),
        ));
        assert!(captured.sequence > late.sequence);
        let pending = parse(&event("evt_p", "refund.created", NOW, refund("pending")));
        let done = parse(&event("evt_d", "refund.updated", NOW, refund("succeeded")));
        assert!(done.sequence > pending.sequence);
        // A refund that fails after it succeeded: the later event wins.
        let failed = parse(&event("evt_f", "refund.failed", NOW + 60, refund("failed")));
        assert!(failed.sequence > done.sequence);
        assert_eq!(captured.sequence, 2 * RANK + NOW);
    }

    /// Settle's gate, modelled: an event is new if its id was not seen,
    /// and applied only if its sequence is above what was recorded.
    fn deliver_all(events: &[&ProviderEvent]) -> (Option<String>, usize) {
        let mut seen = BTreeMap::new();
        let mut recorded = 0;
        let mut state = None;
        let mut applied = 0;
        for e in events {
            if seen.insert(e.id.clone(), ()).is_some() {
                continue;
            }
            if e.sequence <= recorded {
                continue;
            }
            recorded = e.sequence;
            state = Some(e.object.status.to_string());
            applied += 1;
        }
        (state, applied)
    }

    #[test]
    fn duplicates_and_reordered_deliveries_never_move_a_payment_backwards() {
        let authorized = parse(&event(
            "evt_a",
            "payment_intent.amount_capturable_updated",
            NOW,
            intent("requires_capture"),
        ));
        let captured = parse(&event(
            "evt_c",
            "payment_intent.succeeded",
            NOW + 1,
            intent("succeeded"),
        ));
        let redelivered = parse(&event(
            "evt_c",
            "payment_intent.succeeded",
            NOW + 1,
            intent("succeeded"),
        ));
        assert_eq!(
            redelivered.sequence, captured.sequence,
            "a redelivery is the same event"
        );
        let orders: [&[&ProviderEvent]; 4] = [
            &[&authorized, &captured, &redelivered],
            &[&captured, &authorized, &redelivered],
            &[&redelivered, &authorized, &captured],
            &[&captured, &redelivered, &authorized, &authorized],
        ];
        for order in orders {
            let (state, applied) = deliver_all(order);
            assert_eq!(
                state.as_deref(),
                Some("captured"),
                "{:?}",
                order.iter().map(|e| &e.id).collect::<Vec<_>>()
            );
            assert!(applied <= 2);
        }
        // Captured first: the late authorisation is never applied.
        assert_eq!(deliver_all(&[&captured, &authorized]).1, 1);
    }
}
