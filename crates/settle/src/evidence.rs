//! Whether a provider object is provably about one attempt
//! (docs/evidence.md §7.1).
//!
//! cobro sends every attempt under a reference unique to it
//! (`{intent}/{attempt id}`) and with its identity as metadata
//! ([`cobro_provider::metadata`]). An answer, a search hit, a GET or a
//! webhook proves something about an attempt only when it carries that
//! identity AND is what the attempt asked for: amount, currency, capture
//! mode (and for a refund, the charge). The worker, the reconciler and
//! webhooks all ask [`fit`]; none of them adopts anything else.

use crate::apply::{ChargeNow, Proof};
use cobro_core::{CaptureMethod, Operation};
use cobro_provider::{ProviderObject, ProviderStatus as S, metadata};
use cobro_store::{AttemptRow, PaymentRow, RefundRow};
use std::collections::BTreeMap;

/// How a provider object relates to an attempt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fit {
    /// Provably this attempt's object.
    Ours,
    /// Not provably this attempt's (another identity, or fields missing to
    /// tell): never adopted for it.
    NotOurs(String),
    /// Carries this attempt's identity but is not what it asked for: a
    /// conflict an operator must see.
    Mismatch(String),
}

/// Attempts made before references were unique carry the bare intent name
/// and were sent without metadata; they keep being sent exactly so (the
/// provider would refuse the same key with other parameters).
fn is_legacy(attempt: &AttemptRow) -> bool {
    !attempt.reference.contains('/')
}

/// The metadata sent with every call of `attempt`.
pub fn identity(attempt: &AttemptRow, payment: &PaymentRow) -> BTreeMap<String, String> {
    if is_legacy(attempt) {
        return BTreeMap::new();
    }
    let intent = attempt
        .reference
        .rsplit_once('/')
        .map(|(intent, _)| intent)
        .unwrap_or(&attempt.reference);
    BTreeMap::from([
        (metadata::ACCOUNT.to_owned(), payment.account_id.to_string()),
        (metadata::PAYMENT.to_owned(), payment.id.to_string()),
        (metadata::INTENT.to_owned(), intent.to_owned()),
        (metadata::ATTEMPT.to_owned(), attempt.id.to_string()),
    ])
}

/// Whether `object` carries `attempt`'s identity (reference and, where the
/// provider echoes it, metadata).
fn carries_identity(attempt: &AttemptRow, payment: &PaymentRow, object: &ProviderObject) -> Fit {
    match object.reference.as_deref() {
        Some(r) if r == attempt.reference => {}
        Some(other) => return Fit::NotOurs(format!("reference {other} is another attempt's")),
        None => return Fit::NotOurs("the object carries no reference".into()),
    }
    for (key, wanted) in identity(attempt, payment) {
        match object.metadata.get(&key) {
            Some(found) if *found == wanted => {}
            Some(found) => {
                return Fit::NotOurs(format!("metadata {key} is {found}, not {wanted}"));
            }
            // A provider that does not echo metadata: the unique reference
            // alone identifies the attempt.
            None if object.metadata.is_empty() => {}
            None => return Fit::NotOurs(format!("metadata {key} is missing")),
        }
    }
    Fit::Ours
}

/// How `object` relates to `attempt` of `operation` (its payment, and its
/// refund for a refund attempt).
pub fn fit(
    operation: Operation,
    attempt: &AttemptRow,
    payment: &PaymentRow,
    refund: Option<&RefundRow>,
    object: &ProviderObject,
) -> Fit {
    match operation {
        // A capture or void acts on the charge cobro already adopted (after
        // checking it here), so the charge id is the identity.
        Operation::Capture | Operation::Cancel => match payment.provider_ref.as_deref() {
            Some(charge) if charge == object.id => Fit::Ours,
            _ => Fit::NotOurs(format!("{} is not this payment's charge", object.id)),
        },
        Operation::Authorize => {
            let identity = carries_identity(attempt, payment, object);
            if identity != Fit::Ours {
                return identity;
            }
            charge_fits(payment, object)
        }
        Operation::Refund => {
            let identity = carries_identity(attempt, payment, object);
            if identity != Fit::Ours {
                return identity;
            }
            let Some(refund) = refund else {
                return Fit::NotOurs("no refund to compare with".into());
            };
            if object.amount != Some(refund.amount) {
                return Fit::Mismatch(format!(
                    "refund amount {:?}, asked for {}",
                    object.amount, refund.amount
                ));
            }
            match (object.charge.as_deref(), payment.provider_ref.as_deref()) {
                (Some(found), Some(ours)) if found != ours => {
                    Fit::Mismatch(format!("refund of charge {found}, not {ours}"))
                }
                _ => Fit::Ours,
            }
        }
    }
}

/// Amount, currency and capture mode of a charge under the attempt's
/// identity, against what the payment asked for.
fn charge_fits(payment: &PaymentRow, object: &ProviderObject) -> Fit {
    match object.amount {
        Some(a) if a == payment.amount => {}
        Some(a) => return Fit::Mismatch(format!("amount {a}, asked for {}", payment.amount)),
        None => return Fit::NotOurs("the charge reports no amount".into()),
    }
    match object.currency.as_deref() {
        Some(c) if c.eq_ignore_ascii_case(payment.currency.code()) => {}
        Some(c) => {
            return Fit::Mismatch(format!("currency {c}, asked for {}", payment.currency));
        }
        None => return Fit::NotOurs("the charge reports no currency".into()),
    }
    if let Some(mode) = object.capture_method.as_deref()
        && mode != payment.capture_method.as_str()
    {
        return Fit::Mismatch(format!(
            "capture method {mode}, asked for {}",
            payment.capture_method
        ));
    }
    let automatic = payment.capture_method == CaptureMethod::Automatic;
    match (automatic, &object.status) {
        (_, S::Declined | S::Captured) | (false, S::Authorized | S::Voided) => Fit::Ours,
        (true, S::Authorized | S::Voided) => Fit::Mismatch(format!(
            "an automatic-capture charge reported {}",
            object.status
        )),
        // Under the attempt's identity and terms, in a status that is not
        // final (Stripe's `processing`, a status cobro does not know): the
        // attempt's own charge, in progress. `proof_from` proves nothing
        // from it, and it is never "not found" (docs/proof-of-absence.md).
        _ => Fit::Ours,
    }
}

/// Whether a capture or void of `object` has not happened yet: the charge
/// is still authorized, or (a void) the PaymentIntent is still open for
/// another confirmation ([`ProviderObject::confirmable`]). Like "not
/// found", that proves the operation had no effect only by the rules of
/// a proof of absence.
pub fn not_done_yet(operation: Operation, object: &ProviderObject) -> bool {
    match operation {
        Operation::Capture => object.status == S::Authorized,
        Operation::Cancel => object.status == S::Authorized || object.confirmable,
        _ => false,
    }
}

/// The status a charge is in now, when it is one a capture or void can end in.
pub fn charge_now(object: &ProviderObject) -> Option<ChargeNow> {
    match object.status {
        S::Authorized => Some(ChargeNow::Authorized),
        S::Captured => Some(ChargeNow::Captured {
            amount: object.amount_captured.or(object.amount).unwrap_or_default(),
        }),
        S::Voided => Some(ChargeNow::Voided),
        _ => None,
    }
}

/// What an object that [`fit`]s an attempt of `operation` proves; `None`:
/// nothing yet (in progress).
pub fn proof_from(operation: Operation, object: &ProviderObject) -> Option<Proof> {
    let status = &object.status;
    match operation {
        Operation::Authorize => match status {
            S::Captured | S::Authorized | S::Voided => Some(Proof::Succeeded {
                provider_ref: object.id.clone(),
                captured: *status == S::Captured,
            }),
            // The provider's code when the object carries one, so that a
            // soft decline read after its answer was lost still moves the
            // payment on (docs/routing.md §2).
            S::Declined => Some(Proof::Declined {
                code: object
                    .decline_code
                    .clone()
                    .unwrap_or_else(|| "card_declined".into()),
                message: format!("declined at the provider ({})", object.id),
            }),
            _ => None,
        },
        Operation::Capture | Operation::Cancel => {
            let done = if operation == Operation::Capture {
                S::Captured
            } else {
                S::Voided
            };
            if *status == done {
                return Some(Proof::Succeeded {
                    provider_ref: object.id.clone(),
                    captured: done == S::Captured,
                });
            }
            // Still authorized (or, for a void, a PaymentIntent still open
            // for another confirmation): the capture or void has not
            // happened (yet); only an explicit refusal carries that as its
            // truth.
            if not_done_yet(operation, object) {
                return None;
            }
            // A PaymentIntent canceled before it ever held money (one left
            // waiting for its customer, canceled as abandoned or after a
            // failed confirmation): the cancel took effect and nothing was
            // voided.
            if operation == Operation::Cancel && *status == S::Declined {
                return Some(Proof::Succeeded {
                    provider_ref: object.id.clone(),
                    captured: false,
                });
            }
            let charge = charge_now(object)?;
            Some(Proof::Failed {
                code: format!("charge_{status}"),
                message: format!("the charge is {status} and can no longer be {done}"),
                charge: Some(charge),
            })
        }
        Operation::Refund => match status {
            S::Succeeded => Some(Proof::Succeeded {
                provider_ref: object.id.clone(),
                captured: false,
            }),
            S::Failed | S::Canceled => Some(Proof::Failed {
                code: "refund_failed".into(),
                message: format!("refund {} {status} at the provider", object.id),
                charge: None,
            }),
            _ => None,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cobro_store::DbTime;
    use uuid::Uuid;

    fn now() -> DbTime {
        DbTime(chrono::DateTime::from_timestamp(1_800_000_000, 0).expect("instant"))
    }

    fn payment(capture: &str) -> PaymentRow {
        PaymentRow {
            id: cobro_core::PaymentId::new(),
            account_id: cobro_core::AccountId::new(),
            order_ref: "o-1".into(),
            intent: "o-1:authorize-v1".into(),
            amount: 1999,
            currency: cobro_core::Currency::parse("EUR").expect("EUR"),
            capture_method: CaptureMethod::parse(capture).expect("capture method"),
            payment_method: "pm_card_visa".into(),
            description: None,
            metadata: "{}".into(),
            status: cobro_core::PaymentStatus::Processing,
            amount_captured: 0,
            amount_refund_reserved: 0,
            amount_refunded: 0,
            provider_ref: None,
            provider_sequence: 0,
            failure_code: None,
            failure_message: None,
            cancel_requested_at: None,
            status_changed_at: now(),
            created_at: now(),
            updated_at: now(),
            review_reason: None,
            review_from: None,
            provider: None,
            return_url: None,
            next_action: None,
            action_expires_at: None,
            action_refreshed_at: None,
            route: None,
        }
    }

    fn attempt(payment: &PaymentRow) -> AttemptRow {
        let id = Uuid::now_v7();
        AttemptRow {
            id: cobro_core::AttemptId::from_uuid(id),
            intent_id: cobro_core::IntentId::new(),
            payment_id: payment.id,
            refund_id: None,
            operation: Operation::Authorize,
            provider_key: "k".into(),
            reference: cobro_core::attempt_reference(
                "o-1:authorize-v1",
                cobro_core::AttemptId::from_uuid(id),
            ),
            state: cobro_core::AttemptState::Reconciling,
            send_count: 1,
            first_send_at: Some(now()),
            last_send_at: Some(now()),
            provider_ref: None,
            last_error: None,
            created_at: now(),
            updated_at: now(),
            provider: None,
            provider_request_id: None,
            provider_replayed: false,
        }
    }

    fn charge(a: &AttemptRow, p: &PaymentRow, status: &str) -> ProviderObject {
        ProviderObject {
            id: "ch_1".into(),
            status: status.into(),
            reference: Some(a.reference.clone()),
            amount: Some(p.amount),
            amount_captured: None,
            sequence: None,
            currency: Some(p.currency.to_string()),
            capture_method: Some(p.capture_method.to_string()),
            charge: None,
            metadata: identity(a, p),
            next_action: None,
            decline_code: None,
            confirmable: false,
        }
    }

    fn judge(a: &AttemptRow, p: &PaymentRow, o: &ProviderObject) -> Fit {
        fit(Operation::Authorize, a, p, None, o)
    }

    #[test]
    fn the_attempts_own_charge_fits() {
        let p = payment("automatic");
        let a = attempt(&p);
        assert_eq!(judge(&a, &p, &charge(&a, &p, "captured")), Fit::Ours);
        let manual = payment("manual");
        let m = attempt(&manual);
        for status in ["authorized", "captured", "voided", "declined"] {
            assert_eq!(
                judge(&m, &manual, &charge(&m, &manual, status)),
                Fit::Ours,
                "{status}"
            );
        }
    }

    #[test]
    fn another_accounts_charge_under_the_same_order_ref_is_not_ours() {
        let mine = payment("automatic");
        let theirs = payment("automatic");
        let a = attempt(&mine);
        let b = attempt(&theirs);
        // Same intent name, different attempt: another reference.
        assert!(matches!(
            judge(&a, &mine, &charge(&b, &theirs, "captured")),
            Fit::NotOurs(_)
        ));
        // Even under our reference, another account's identity is not ours.
        let mut forged = charge(&a, &mine, "captured");
        forged.metadata = identity(&a, &theirs);
        assert!(matches!(judge(&a, &mine, &forged), Fit::NotOurs(_)));
    }

    #[test]
    fn our_identity_with_other_terms_is_a_mismatch() {
        let p = payment("automatic");
        let a = attempt(&p);
        let mut other_amount = charge(&a, &p, "captured");
        other_amount.amount = Some(700);
        assert!(matches!(judge(&a, &p, &other_amount), Fit::Mismatch(_)));
        let mut other_currency = charge(&a, &p, "captured");
        other_currency.currency = Some("USD".into());
        assert!(matches!(judge(&a, &p, &other_currency), Fit::Mismatch(_)));
        let mut other_mode = charge(&a, &p, "captured");
        other_mode.capture_method = Some("manual".into());
        assert!(matches!(judge(&a, &p, &other_mode), Fit::Mismatch(_)));
        // An automatic payment answered `authorized` did not get what it asked.
        assert!(matches!(
            judge(&a, &p, &charge(&a, &p, "authorized")),
            Fit::Mismatch(_)
        ));
        // A charge without the fields to tell proves nothing.
        let mut bare = charge(&a, &p, "captured");
        bare.amount = None;
        assert!(matches!(judge(&a, &p, &bare), Fit::NotOurs(_)));
    }

    #[test]
    fn a_charge_under_our_identity_in_a_status_that_is_not_final_is_ours_and_in_progress() {
        for capture in ["automatic", "manual"] {
            let p = payment(capture);
            let a = attempt(&p);
            for status in [
                "processing",
                "requires_action",
                "a_status_stripe_adds_later",
            ] {
                let object = charge(&a, &p, status);
                assert_eq!(
                    judge(&a, &p, &object),
                    Fit::Ours,
                    "{capture} {status}: the attempt's own charge, never absent"
                );
                assert_eq!(
                    proof_from(Operation::Authorize, &object),
                    None,
                    "{status} proves no outcome yet"
                );
            }
        }
    }

    #[test]
    fn a_charges_final_status_proves_its_capture_or_void_and_ends_the_other_in_its_truth() {
        let p = payment("manual");
        let a = attempt(&p);
        let proof = |op, status| proof_from(op, &charge(&a, &p, status));
        assert!(matches!(
            proof(Operation::Capture, "captured"),
            Some(Proof::Succeeded { captured: true, .. })
        ));
        assert!(matches!(
            proof(Operation::Cancel, "voided"),
            Some(Proof::Succeeded {
                captured: false,
                ..
            })
        ));
        assert!(matches!(
            proof(Operation::Cancel, "captured"),
            Some(Proof::Failed {
                charge: Some(ChargeNow::Captured { amount: 1999 }),
                ..
            })
        ));
        assert!(matches!(
            proof(Operation::Capture, "voided"),
            Some(Proof::Failed {
                charge: Some(ChargeNow::Voided),
                ..
            })
        ));
        assert_eq!(proof(Operation::Capture, "declined"), None);
        assert_eq!(
            proof(Operation::Capture, "authorized"),
            None,
            "an unfinished capture is not a refused one"
        );
        assert_eq!(proof(Operation::Cancel, "authorized"), None);
    }

    #[test]
    fn a_declined_charge_proves_a_decline_with_its_own_code_or_card_declined() {
        let p = payment("automatic");
        let a = attempt(&p);
        let code = |object: &ProviderObject| match proof_from(Operation::Authorize, object) {
            Some(Proof::Declined { code, .. }) => code,
            other => panic!("not a decline: {other:?}"),
        };
        let mut declined = charge(&a, &p, "declined");
        assert_eq!(code(&declined), "card_declined", "no code: the card's own");
        declined.decline_code = Some("try_again_later".into());
        assert_eq!(code(&declined), "try_again_later");
        assert!(crate::routing::is_soft_decline(&code(&declined)));
        declined.decline_code = Some("insufficient_funds".into());
        assert_eq!(code(&declined), "insufficient_funds");
        // A code on an object that is not declined proves nothing of it.
        let mut captured = charge(&a, &p, "captured");
        captured.decline_code = Some("try_again_later".into());
        assert!(matches!(
            proof_from(Operation::Authorize, &captured),
            Some(Proof::Succeeded { captured: true, .. })
        ));
    }

    #[test]
    fn a_refund_must_match_its_amount_and_charge() {
        let mut p = payment("automatic");
        p.provider_ref = Some("ch_1".into());
        let mut a = attempt(&p);
        a.operation = Operation::Refund;
        let refund = RefundRow {
            id: cobro_core::RefundId::new(),
            account_id: p.account_id,
            payment_id: p.id,
            intent: "o-1:refund-v1".into(),
            amount: 700,
            reason: None,
            status: cobro_core::RefundStatus::Processing,
            provider_ref: None,
            failure_code: None,
            failure_message: None,
            status_changed_at: now(),
            created_at: now(),
            updated_at: now(),
            reference: None,
        };
        let mut object = charge(&a, &p, "succeeded");
        object.id = "re_1".into();
        object.amount = Some(700);
        object.charge = Some("ch_1".into());
        assert_eq!(
            fit(Operation::Refund, &a, &p, Some(&refund), &object),
            Fit::Ours
        );
        object.charge = Some("ch_other".into());
        assert!(matches!(
            fit(Operation::Refund, &a, &p, Some(&refund), &object),
            Fit::Mismatch(_)
        ));
    }
}
