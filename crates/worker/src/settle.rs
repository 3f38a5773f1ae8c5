//! Applying what the provider proved about an attempt: ONE code path for
//! the worker (a provider answer), the reconciler (a status query) and
//! webhooks (a provider event), so the three can never disagree.
//!
//! Everything here runs inside the caller's transaction and is a chain of
//! compare-and-sets: the attempt must still be unresolved, the payment (or
//! refund) must still be in the state the transition starts from. A proof
//! that arrives second finds the attempt settled and changes nothing.

use chrono::{DateTime, Utc};
use cobro_core::{
    AccountId, AttemptId, AttemptState, Operation, PaymentEvent, PaymentId, PaymentStatus,
    RefundId, RefundStatus,
};
use cobro_store::settle::PaymentOutcome;
use cobro_store::{AttemptRow, StoreError, WriteTx};

/// What the provider proved about one attempt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Proof {
    /// The operation took effect. `captured`: the charge is captured (an
    /// automatic-capture authorisation, or a capture).
    Succeeded {
        provider_ref: String,
        captured: bool,
    },
    /// A definitive decline.
    Declined { code: String, message: String },
    /// A definitive refusal of the request.
    Failed { code: String, message: String },
}

/// What applying a proof did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Applied {
    /// The attempt was settled; the payment moved `before` -> `after`
    /// (equal when only a refund moved).
    Settled { before: String, after: String },
    /// Someone recorded this attempt's outcome first: nothing changed.
    AlreadySettled,
}

fn attempt_state(proof: &Proof) -> AttemptState {
    match proof {
        Proof::Succeeded { .. } => AttemptState::Succeeded,
        Proof::Declined { .. } => AttemptState::Declined,
        Proof::Failed { .. } => AttemptState::Failed,
    }
}

fn ids(attempt: &AttemptRow) -> (AttemptId, PaymentId, Option<RefundId>) {
    (
        AttemptId::from_uuid(attempt.id.0),
        PaymentId::from_uuid(attempt.payment_id.0),
        attempt.refund_id.map(|r| RefundId::from_uuid(r.0)),
    )
}

fn corrupt(what: impl Into<String>) -> StoreError {
    StoreError::Corrupt(what.into())
}

/// Applies `proof` to `attempt` and to its payment or refund.
pub async fn apply_proof(
    tx: &mut WriteTx,
    attempt: &AttemptRow,
    proof: &Proof,
    now: DateTime<Utc>,
) -> Result<Applied, StoreError> {
    let (attempt_id, payment_id, refund_id) = ids(attempt);
    let provider_ref = match proof {
        Proof::Succeeded { provider_ref, .. } => Some(provider_ref.as_str()),
        _ => None,
    };
    let note = match proof {
        Proof::Declined { code, .. } | Proof::Failed { code, .. } => Some(code.as_str()),
        Proof::Succeeded { .. } => None,
    };
    if !tx
        .resolve_attempt(attempt_id, attempt_state(proof), provider_ref, note, now)
        .await?
    {
        return Ok(Applied::AlreadySettled);
    }
    let operation = Operation::parse(&attempt.operation)
        .ok_or_else(|| corrupt(format!("operation {}", attempt.operation)))?;
    let payment = tx
        .payment_by_id(payment_id)
        .await?
        .ok_or_else(|| corrupt("attempt without payment"))?;
    let before = payment.status()?;

    if operation == Operation::Refund {
        let refund_id = refund_id.ok_or_else(|| corrupt("refund attempt without refund"))?;
        let refund = tx
            .refund_by_id(refund_id)
            .await?
            .ok_or_else(|| corrupt("missing refund"))?;
        let from = RefundStatus::parse(&refund.status).ok_or_else(|| corrupt("refund status"))?;
        let (to, failure) = match proof {
            Proof::Succeeded { .. } => (RefundStatus::Succeeded, None),
            Proof::Declined { code, message } | Proof::Failed { code, message } => (
                RefundStatus::Failed,
                Some((code.as_str(), message.as_str())),
            ),
        };
        tx.settle_refund(refund_id, from, to, provider_ref, failure, now)
            .await?;
        let after = tx
            .payment_by_id(payment_id)
            .await?
            .map(|p| p.status)
            .unwrap_or_default();
        return Ok(Applied::Settled {
            before: before.as_str().to_owned(),
            after,
        });
    }

    let event = match (operation, proof) {
        (Operation::Authorize, Proof::Succeeded { captured: true, .. }) => PaymentEvent::Captured,
        (Operation::Authorize, Proof::Succeeded { .. }) => PaymentEvent::Authorized,
        (Operation::Authorize, Proof::Declined { .. }) => PaymentEvent::Declined,
        (Operation::Authorize, Proof::Failed { .. }) => PaymentEvent::Failed,
        (Operation::Capture, Proof::Succeeded { .. }) => PaymentEvent::Captured,
        (Operation::Capture, _) => PaymentEvent::CaptureRefused,
        (Operation::Cancel, Proof::Succeeded { .. }) => PaymentEvent::Voided,
        (Operation::Cancel, _) => PaymentEvent::VoidRefused,
        (Operation::Refund, _) => unreachable_refund()?,
    };
    let after = match before.apply(event) {
        Ok(after) => after,
        Err(illegal) => {
            // The payment already moved (e.g. a webhook recorded it): keep
            // the attempt settled, leave the payment as it is.
            tracing::warn!(payment_id = %payment_id, error = %illegal, "proof does not apply to the payment's state");
            return Ok(Applied::Settled {
                before: before.as_str().to_owned(),
                after: before.as_str().to_owned(),
            });
        }
    };
    let outcome = PaymentOutcome {
        provider_ref: match operation {
            Operation::Authorize => provider_ref.map(str::to_owned),
            _ => None,
        },
        amount_captured: (after == PaymentStatus::Captured).then_some(payment.amount),
        failure: match proof {
            Proof::Declined { code, message } | Proof::Failed { code, message } => {
                Some((code.clone(), message.clone()))
            }
            Proof::Succeeded { .. } => None,
        },
    };
    let Some(settled) = tx
        .settle_payment(payment_id, before, after, &outcome, now)
        .await?
    else {
        return Err(corrupt("payment moved inside the transaction"));
    };
    // A cancel asked for while the authorisation was unknown is carried out
    // now that it is known to be an authorisation: never before, never twice.
    if after == PaymentStatus::Authorized && settled.cancel_requested_at.is_some() {
        let canceling = after
            .apply(PaymentEvent::CancelRequested)
            .map_err(|e| corrupt(e.to_string()))?;
        if tx
            .settle_payment(
                payment_id,
                after,
                canceling,
                &PaymentOutcome::default(),
                now,
            )
            .await?
            .is_some()
        {
            let account = AccountId::from_uuid(settled.account_id.0);
            let name = tx
                .next_intent_name(account, &settled.order_ref, Operation::Cancel)
                .await?;
            tx.open_intent(account, payment_id, None, Operation::Cancel, &name, now)
                .await?;
            return Ok(Applied::Settled {
                before: before.as_str().to_owned(),
                after: canceling.as_str().to_owned(),
            });
        }
    }
    Ok(Applied::Settled {
        before: before.as_str().to_owned(),
        after: after.as_str().to_owned(),
    })
}

fn unreachable_refund() -> Result<PaymentEvent, StoreError> {
    Err(corrupt("refunds are settled above"))
}

/// Hands an attempt whose outcome stays unknown to the reconciler: the
/// attempt becomes `reconciling` and, for an authorisation or a refund,
/// the resource shows `requires_reconciliation`. Captures and cancels stay
/// `capturing`/`canceling`, which the reconciler watches.
pub async fn hand_to_reconciler(
    tx: &mut WriteTx,
    attempt: &AttemptRow,
    reason: &str,
    now: DateTime<Utc>,
) -> Result<bool, StoreError> {
    let (attempt_id, payment_id, refund_id) = ids(attempt);
    if !tx
        .resolve_attempt(
            attempt_id,
            AttemptState::Reconciling,
            None,
            Some(reason),
            now,
        )
        .await?
    {
        return Ok(false);
    }
    match Operation::parse(&attempt.operation) {
        Some(Operation::Authorize) => {
            let to = PaymentStatus::Processing
                .apply(PaymentEvent::OutcomeUnknown)
                .map_err(|e| corrupt(e.to_string()))?;
            tx.settle_payment(
                payment_id,
                PaymentStatus::Processing,
                to,
                &PaymentOutcome::default(),
                now,
            )
            .await?;
        }
        Some(Operation::Refund) => {
            if let Some(refund) = refund_id {
                tx.settle_refund(
                    refund,
                    RefundStatus::Processing,
                    RefundStatus::RequiresReconciliation,
                    None,
                    None,
                    now,
                )
                .await?;
            }
        }
        _ => {}
    }
    Ok(true)
}
