//! An attempt's provider call, built from its stored rows, and what the
//! provider's answer to it proves. The worker sends it; the reconciler
//! replays it under the same key inside the key's retention, where the
//! provider's answer is a consistent read of what the key did
//! (docs/proof-of-absence.md).

use crate::apply::{ChargeNow, Proof};
use crate::evidence::{Fit, charge_now, fit, identity, proof_from};
use cobro_core::{CaptureMethod, Operation};
use cobro_provider::{
    AuthorizeRequest, Mutation, NextAction, Outcome, ProviderObject, ProviderStatus, RefundRequest,
};
use cobro_store::{AttemptRow, PaymentRow, RefundRow};

/// A call ready to be made, exactly as every send of the attempt makes it
/// (the provider refuses the same key with other parameters).
#[derive(Clone, Debug)]
pub enum Call {
    Authorize(AuthorizeRequest),
    Capture(String),
    Void(String),
    Refund(RefundRequest),
}

impl Call {
    /// The call of `attempt` (of `payment`, and `refund` for a refund);
    /// `None` when it can never be made (a capture, void or refund without
    /// a known charge).
    pub fn of(
        attempt: &AttemptRow,
        payment: &PaymentRow,
        refund: Option<&RefundRow>,
    ) -> Option<Self> {
        let metadata = identity(attempt, payment);
        let charge = payment.provider_ref.clone();
        match attempt.operation {
            Operation::Authorize => Some(Call::Authorize(AuthorizeRequest {
                amount: payment.amount,
                currency: payment.currency.code().to_owned(),
                payment_method: payment.payment_method.clone(),
                capture: payment.capture_method == CaptureMethod::Automatic,
                reference: attempt.reference.clone(),
                metadata,
                return_url: payment.return_url.clone(),
            })),
            Operation::Capture => charge.map(Call::Capture),
            Operation::Cancel => charge.map(Call::Void),
            Operation::Refund => charge.map(|charge| {
                Call::Refund(RefundRequest {
                    charge,
                    amount: refund.map(|r| r.amount).unwrap_or_default(),
                    reference: attempt.reference.clone(),
                    metadata,
                })
            }),
        }
    }

    pub fn mutation(&self) -> Mutation<'_> {
        match self {
            Call::Authorize(r) => Mutation::Authorize(r),
            Call::Capture(charge) => Mutation::Capture(charge),
            Call::Void(charge) => Mutation::Void(charge),
            Call::Refund(r) => Mutation::Refund(r),
        }
    }
}

/// What an answer proves about the attempt, after checking it is its own.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answered {
    /// A proof, and what the provider said (JSON of its object, or empty).
    Proof(Proof, String),
    /// An object under the attempt's identity with other terms: the reason
    /// and what the provider said.
    Conflict(String, String),
    NotSent(String),
    /// Nothing left cobro (no connection): `NotSent`, and proof that this
    /// send reached no one.
    NotConnected(String),
    Unknown(String),
    /// The attempt's own object, not final yet (Stripe's `processing`, a
    /// status cobro does not know): a resend under the same key would only
    /// replay this answer, so only a query can see it end.
    InProgress(String),
    /// The attempt's own object waits for the customer (3-D Secure): its
    /// id, the action, and what the provider said.
    RequiresAction {
        provider_ref: String,
        action: NextAction,
        said: String,
    },
}

/// What `outcome`, the answer to `attempt`'s own call, proves: an object
/// that is not provably this attempt's is never adopted.
pub fn judge_answer(
    attempt: &AttemptRow,
    payment: &PaymentRow,
    refund: Option<&RefundRow>,
    outcome: Outcome,
) -> Answered {
    let said = |object: &ProviderObject| serde_json::to_string(object).unwrap_or_default();
    let operation = attempt.operation;
    match outcome {
        Outcome::Succeeded(object) => match fit(operation, attempt, payment, refund, &object) {
            Fit::Ours => match proof_from(operation, &object) {
                Some(proof) => Answered::Proof(proof, said(&object)),
                None if operation == Operation::Authorize
                    && object.status == ProviderStatus::RequiresAction =>
                {
                    Answered::RequiresAction {
                        said: said(&object),
                        action: object.next_action.clone().unwrap_or_default(),
                        provider_ref: object.id,
                    }
                }
                None => Answered::InProgress(format!(
                    "the provider answered {} {} (in progress)",
                    object.id, object.status
                )),
            },
            // Worded as the reconciler words it, so a finding is kept once
            // whoever makes it.
            Fit::Mismatch(why) => {
                Answered::Conflict(format!("{}: {why}", object.id), said(&object))
            }
            Fit::NotOurs(why) => Answered::Unknown(format!("an answer that proves nothing: {why}")),
        },
        Outcome::Declined {
            code,
            message,
            object,
        } => Answered::Proof(
            Proof::Declined { code, message },
            object.as_ref().map(said).unwrap_or_default(),
        ),
        Outcome::Failed {
            code,
            message,
            object,
        } => {
            // The charge sent with a refusal is the truth only when it is
            // this payment's charge.
            // A cancel refused because the PaymentIntent is canceled already
            // (never charged): what the cancel wanted, nothing held.
            let charge = object
                .as_ref()
                .filter(|o| payment.provider_ref.as_deref() == Some(o.id.as_str()))
                .and_then(|o| {
                    charge_now(o).or_else(|| {
                        let closed = operation == Operation::Cancel
                            && o.status == ProviderStatus::Declined
                            && !o.confirmable;
                        closed.then_some(ChargeNow::Voided)
                    })
                });
            let text = object.as_ref().map(said).unwrap_or_default();
            Answered::Proof(
                Proof::Failed {
                    code,
                    message,
                    charge,
                },
                text,
            )
        }
        Outcome::NotSent(reason) => Answered::NotSent(reason),
        Outcome::NotConnected(reason) => Answered::NotConnected(reason),
        Outcome::Unknown(reason) => Answered::Unknown(reason),
    }
}
