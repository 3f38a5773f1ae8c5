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
    AccountId, AttemptId, AttemptState, Decision, Operation, PaymentEvent, PaymentId,
    PaymentStatus, RefundId, RefundStatus,
};
use cobro_store::conflicts::{ConflictKind, NewConflict};
use cobro_store::settle::PaymentOutcome;
use cobro_store::{AttemptRow, PaymentRow, StoreError, WriteTx};

/// A charge's status as the provider reports it now, sent with a refused
/// capture or void (or found by the reconciler): the truth the payment
/// ends in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChargeNow {
    Authorized,
    Captured { amount: i64 },
    Voided,
}

impl ChargeNow {
    pub fn as_str(self) -> &'static str {
        match self {
            ChargeNow::Authorized => "authorized",
            ChargeNow::Captured { .. } => "captured",
            ChargeNow::Voided => "voided",
        }
    }
}

/// Whether a payment in `status` already shows the charge's `truth` (a
/// refusal's charge; `None` or still authorized: nothing moved), or is
/// under review, where an operator decides.
fn agrees(status: PaymentStatus, truth: Option<ChargeNow>) -> bool {
    use PaymentStatus as S;
    match truth {
        None | Some(ChargeNow::Authorized) => true,
        Some(ChargeNow::Captured { .. }) => matches!(
            status,
            S::Captured | S::PartiallyRefunded | S::Refunded | S::NeedsReview
        ),
        Some(ChargeNow::Voided) => matches!(status, S::Canceled | S::NeedsReview),
    }
}

/// Whether a payment in `status` already shows what an authorisation's
/// `proof` says (its money held, or captured), so adopting it again
/// changes nothing.
fn already_shows(status: PaymentStatus, proof: &Proof) -> bool {
    use PaymentStatus as S;
    match proof {
        Proof::Succeeded { captured: true, .. } => {
            matches!(status, S::Captured | S::PartiallyRefunded | S::Refunded)
        }
        Proof::Succeeded {
            captured: false, ..
        } => matches!(
            status,
            S::Authorized
                | S::Capturing
                | S::Canceling
                | S::Canceled
                | S::Captured
                | S::PartiallyRefunded
                | S::Refunded
        ),
        _ => false,
    }
}

/// What the provider proved about one attempt (already checked by
/// [`crate::evidence::fit`] to be about that attempt).
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
    /// A definitive refusal of the request. For a capture or a void,
    /// `charge` is the charge's status when the provider reported it: a
    /// void refused because the charge was captured ends `captured`.
    Failed {
        code: String,
        message: String,
        charge: Option<ChargeNow>,
    },
}

impl Proof {
    /// What adopting it is called in the audit trail.
    pub fn decision(&self) -> Decision {
        match self {
            Proof::Succeeded { .. } => Decision::AdoptSucceeded,
            Proof::Declined { .. } => Decision::AdoptDeclined,
            Proof::Failed { .. } => Decision::AdoptFailed,
        }
    }

    pub fn outcome(&self) -> &'static str {
        match self {
            Proof::Succeeded { .. } => "succeeded",
            Proof::Declined { .. } => "declined",
            Proof::Failed { .. } => "failed",
        }
    }
}

/// Who brought a proof and what exactly it said: written with any conflict
/// it causes.
#[derive(Clone, Copy, Debug)]
pub struct Source<'a> {
    /// `worker`, `reconciler`, `webhook:<provider>`, `operator:<name>`.
    pub name: &'a str,
    /// The provider's words (JSON), as received.
    pub said: &'a str,
}

/// What applying a proof did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Applied {
    /// The attempt was settled; the payment moved `before` -> `after`
    /// (equal when only a refund moved).
    Settled { before: String, after: String },
    /// Someone recorded this same outcome first: nothing changed.
    AlreadySettled,
    /// The proof contradicts what is recorded for the attempt: kept as a
    /// conflict, the payment is in `needs_review`, nothing adopted.
    Conflict { kind: ConflictKind, detail: String },
}

fn attempt_state(proof: &Proof) -> AttemptState {
    match proof {
        Proof::Succeeded { .. } => AttemptState::Succeeded,
        Proof::Declined { .. } => AttemptState::Declined,
        Proof::Failed { .. } => AttemptState::Failed,
    }
}

pub(crate) fn ids(attempt: &AttemptRow) -> (AttemptId, PaymentId, Option<RefundId>) {
    (attempt.id, attempt.payment_id, attempt.refund_id)
}

fn corrupt(what: impl Into<String>) -> StoreError {
    StoreError::Corrupt(what.into())
}

/// Keeps evidence cobro will not adopt and stops the line: the conflict
/// row, and the payment (with a refund in flight) to `needs_review` with
/// the reason, which blocks every new send for it.
pub async fn stop_the_line(
    tx: &mut WriteTx,
    attempt: Option<&AttemptRow>,
    payment: Option<PaymentId>,
    kind: ConflictKind,
    detail: &str,
    source: &Source<'_>,
    now: DateTime<Utc>,
) -> Result<(), StoreError> {
    let refund = attempt.and_then(|a| a.refund_id);
    tx.record_conflict(
        &NewConflict {
            payment,
            refund,
            attempt: attempt.map(|a| a.id),
            source: source.name,
            kind,
            detail,
            evidence: source.said,
        },
        now,
    )
    .await?;
    if let Some(payment) = payment {
        let reason = format!("{}: {detail}", kind.as_str());
        tx.flag_for_review(payment, refund, &reason, now).await?;
    }
    match payment {
        Some(payment) => {
            tracing::error!(payment_id = %payment, kind = kind.as_str(), detail, source = source.name, "conflicting provider evidence: payment needs review")
        }
        // Evidence about no payment of cobro's (an event at the wrong
        // provider's route, a charge cobro never asked for): kept, and no
        // payment is stopped.
        None => tracing::error!(
            kind = kind.as_str(),
            detail,
            source = source.name,
            "provider evidence about no payment of cobro's: kept as a conflict"
        ),
    }
    cobro_telemetry::metrics::evidence_conflict(kind.as_str(), source.name);
    Ok(())
}

/// Stops the line for `attempt` and answers [`Applied::Conflict`]: the one
/// way `apply_proof` refuses a proof.
async fn refuse(
    tx: &mut WriteTx,
    attempt: &AttemptRow,
    kind: ConflictKind,
    detail: String,
    source: &Source<'_>,
    now: DateTime<Utc>,
) -> Result<Applied, StoreError> {
    let payment = attempt.payment_id;
    stop_the_line(tx, Some(attempt), Some(payment), kind, &detail, source, now).await?;
    Ok(Applied::Conflict { kind, detail })
}

/// Whether `proof` contradicts what is recorded for an attempt that is
/// already settled (`None`: it proves the same again).
fn contradiction(recorded: &AttemptRow, proof: &Proof) -> Option<(ConflictKind, String)> {
    let state = recorded.state;
    match proof {
        Proof::Succeeded { provider_ref, .. } if state.recorded_no_money() => Some((
            ConflictKind::EffectAfterNoEffect,
            format!(
                "the provider shows {provider_ref} for an attempt recorded {}",
                state.as_str()
            ),
        )),
        Proof::Succeeded { provider_ref, .. } => match recorded.provider_ref.as_deref() {
            Some(known)
                if known != provider_ref
                    && recorded.operation != Operation::Capture
                    && recorded.operation != Operation::Cancel =>
            {
                Some((
                    ConflictKind::OtherObject,
                    format!("the provider shows {provider_ref}, cobro recorded {known}"),
                ))
            }
            _ => None,
        },
        Proof::Declined { .. } if state == AttemptState::Succeeded => Some((
            ConflictKind::OtherObject,
            "the provider reports a decline for an attempt recorded succeeded".to_owned(),
        )),
        _ => None,
    }
}

/// Whether a capture's or void's success, offered for an attempt recorded
/// with no effect, belongs to a later attempt of the same operation.
///
/// A charge's state carries no attempt identity: once "no effect" of
/// capture A1 was recorded, its retry A2 (a new key) captures the charge,
/// and a reconciler that asked about A1 before that decision (two run at
/// once) then reads "captured" for A1. That is A2's effect, not a
/// contradiction: a charge is captured or voided at most once, whichever
/// attempt asked, so nothing can have moved twice. Authorisations and
/// refunds carry their attempt's own identity, so for them it stays a
/// conflict.
async fn retried_since(
    tx: &mut WriteTx,
    recorded: &AttemptRow,
    proof: &Proof,
) -> Result<bool, StoreError> {
    let charge_state =
        recorded.operation == Operation::Capture || recorded.operation == Operation::Cancel;
    if !charge_state || !matches!(proof, Proof::Succeeded { .. }) {
        return Ok(false);
    }
    let later = tx
        .attempts_of_payment_any_account(recorded.payment_id)
        .await?
        .into_iter()
        .any(|a| {
            a.operation == recorded.operation
                && a.id != recorded.id
                && (a.created_at.0, a.id) > (recorded.created_at.0, recorded.id)
        });
    Ok(later)
}

/// Applies `proof` to `attempt` and to its payment or refund: the ONE path
/// for the worker, the reconciler, webhooks and operators. In span
/// `settle.apply_proof`; a proof of what was already recorded counts as a
/// redundant effect (`cobro_redundant_effects_total`).
///
/// `attempt` is what the caller read of the attempt in this transaction or
/// before it; it need not be current (a compare-and-set decides), except
/// that a settled one is taken as recorded: settled states are final
/// ([`AttemptState::can_become`]), so the row cannot have changed since.
pub async fn apply_proof(
    tx: &mut WriteTx,
    attempt: &AttemptRow,
    proof: &Proof,
    source: &Source<'_>,
    now: DateTime<Utc>,
) -> Result<Applied, StoreError> {
    apply_proof_in(tx, attempt, None, proof, source, now).await
}

/// [`apply_proof`] for a caller that has already locked the attempt's
/// payment in this transaction (`lock_payment_any_account`) and changed
/// nothing of it since: `payment` is that row, so it is not read again.
pub async fn apply_proof_locked(
    tx: &mut WriteTx,
    attempt: &AttemptRow,
    payment: &PaymentRow,
    proof: &Proof,
    source: &Source<'_>,
    now: DateTime<Utc>,
) -> Result<Applied, StoreError> {
    if payment.id != attempt.payment_id {
        return Err(corrupt(
            "apply_proof_locked given another attempt's payment",
        ));
    }
    apply_proof_in(tx, attempt, Some(payment), proof, source, now).await
}

async fn apply_proof_in(
    tx: &mut WriteTx,
    attempt: &AttemptRow,
    locked: Option<&PaymentRow>,
    proof: &Proof,
    source: &Source<'_>,
    now: DateTime<Utc>,
) -> Result<Applied, StoreError> {
    let span = tracing::info_span!(
        "settle.apply_proof",
        attempt_id = %attempt.id,
        payment_id = %attempt.payment_id,
        operation = %attempt.operation,
        source = cobro_telemetry::metrics::source_label(source.name),
        proof = proof.outcome(),
        applied = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
    );
    let applied = tracing::Instrument::instrument(
        apply_proof_in_span(tx, attempt, locked, proof, source, now),
        span.clone(),
    )
    .await
    .inspect_err(|_| {
        span.record("applied", "error");
        span.record("otel.status_code", "ERROR");
    })?;
    let name = match &applied {
        Applied::Settled { .. } => "settled",
        Applied::AlreadySettled => {
            cobro_telemetry::metrics::redundant_effect(source.name);
            "already_settled"
        }
        Applied::Conflict { .. } => "conflict",
    };
    span.record("applied", name);
    Ok(applied)
}

async fn apply_proof_in_span(
    tx: &mut WriteTx,
    attempt: &AttemptRow,
    locked: Option<&PaymentRow>,
    proof: &Proof,
    source: &Source<'_>,
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
    // Lock order everywhere: the payment row, then the attempt.
    let payment = match locked {
        Some(payment) => payment.clone(),
        None => tx
            .lock_payment_any_account(payment_id)
            .await?
            .ok_or_else(|| corrupt("attempt without payment"))?,
    };
    if let Some(applied) = declined_while_open(tx, attempt, &payment, proof, now).await? {
        return Ok(applied);
    }
    // A copy that shows the attempt settled is what is recorded (settled
    // states are final): the compare-and-set below would change nothing
    // and its re-read would return the same row.
    let settled_before = !attempt.state.is_unresolved();
    if settled_before
        || !tx
            .resolve_attempt(attempt_id, attempt_state(proof), provider_ref, note, now)
            .await?
    {
        let recorded = if settled_before {
            attempt.clone()
        } else {
            tx.attempt_any_account(attempt_id)
                .await?
                .ok_or_else(|| corrupt("attempt vanished"))?
        };
        return match contradiction(&recorded, proof) {
            Some(_) if retried_since(tx, &recorded, proof).await? => Ok(Applied::AlreadySettled),
            Some((kind, detail)) => refuse(tx, &recorded, kind, detail, source, now).await,
            None => Ok(Applied::AlreadySettled),
        };
    }
    let operation = attempt.operation;
    // A payment stopped by conflicting evidence stays stopped: the attempt
    // is settled (what it proved is kept), the payment waits for an
    // operator. A refund still settles (below): its money moved, and the
    // payment's status stays in review either way.
    if operation != Operation::Refund
        && payment.status == PaymentStatus::NeedsReview
        && tx.has_open_conflicts(payment_id).await?
    {
        let detail = format!(
            "{} of attempt {} arrived while the payment is under review for conflicting evidence",
            proof.outcome(),
            attempt.id
        );
        return refuse(tx, attempt, ConflictKind::OtherObject, detail, source, now).await;
    }
    let before = payment.status;
    if let Some(applied) = soft_decline_moves_on(tx, attempt, &payment, proof, now).await? {
        return Ok(applied);
    }

    if operation == Operation::Refund {
        let refund_id = refund_id.ok_or_else(|| corrupt("refund attempt without refund"))?;
        let refund = tx
            .refund_any_account(refund_id)
            .await?
            .ok_or_else(|| corrupt("missing refund"))?;
        let from = refund.status;
        let (to, failure) = match proof {
            Proof::Succeeded { .. } => (RefundStatus::Succeeded, None),
            Proof::Declined { code, message } | Proof::Failed { code, message, .. } => (
                RefundStatus::Failed,
                Some((code.as_str(), message.as_str())),
            ),
        };
        tx.settle_refund(refund_id, from, to, provider_ref, failure, now)
            .await?;
        let after = tx
            .lock_payment_any_account(payment_id)
            .await?
            .map(|p| p.status.as_str().to_owned())
            .unwrap_or_default();
        return Ok(Applied::Settled {
            before: before.as_str().to_owned(),
            after,
        });
    }

    let truth = match proof {
        Proof::Failed { charge, .. } => *charge,
        _ => None,
    };
    let event = match (operation, proof) {
        (Operation::Authorize, Proof::Succeeded { captured: true, .. }) => PaymentEvent::Captured,
        (Operation::Authorize, Proof::Succeeded { .. }) => PaymentEvent::Authorized,
        (Operation::Authorize, Proof::Declined { .. }) => PaymentEvent::Declined,
        (Operation::Authorize, Proof::Failed { .. }) => PaymentEvent::Failed,
        (Operation::Capture, Proof::Succeeded { .. }) => PaymentEvent::Captured,
        (Operation::Cancel, Proof::Succeeded { .. }) => PaymentEvent::Voided,
        // A refused capture or void ends where the charge really is.
        (_, _) => match truth {
            Some(ChargeNow::Captured { .. }) => PaymentEvent::Captured,
            Some(ChargeNow::Voided) => PaymentEvent::Voided,
            _ if operation == Operation::Capture => PaymentEvent::CaptureRefused,
            _ => PaymentEvent::VoidRefused,
        },
    };
    // The cancel of a PaymentIntent whose authorisation still waits for
    // the customer (abandoned past its expiry, or declined while open):
    // only a payment whose customer was asked to act has one.
    let unauthorised = if operation == Operation::Cancel && payment.next_action.is_some() {
        awaiting_customer(tx, payment_id).await?
    } else {
        None
    };
    let closes_a_decline = matches!(
        before,
        PaymentStatus::Canceling | PaymentStatus::NeedsReview
    ) && payment.failure_code.is_some();
    let event = match (event, &unauthorised) {
        (PaymentEvent::Voided, Some(_)) if closes_a_decline => PaymentEvent::DeclineClosed,
        // Never authorised, so never back to `authorized`: the provider
        // shows the PaymentIntent neither canceled nor charged.
        (PaymentEvent::VoidRefused, Some(_)) => {
            let detail = format!(
                "the provider refused cancel attempt {} of a PaymentIntent that never held \
                 money, and shows it neither canceled nor charged",
                attempt.id
            );
            return refuse(tx, attempt, ConflictKind::OtherObject, detail, source, now).await;
        }
        (event, _) => event,
    };
    // A 3-D Secure authorisation proven after its payment already shows
    // it: the expiry's cancel was refused because the customer completed,
    // and the refusal carried the charge first. The same truth, twice.
    if operation == Operation::Authorize
        && payment.next_action.is_some()
        && already_shows(before, proof)
    {
        return Ok(Applied::Settled {
            before: before.as_str().to_owned(),
            after: before.as_str().to_owned(),
        });
    }
    let after = match before.apply(event) {
        Ok(after) => after,
        // Money moved that the payment's state cannot take (an operator
        // decided otherwise meanwhile): never dropped, a conflict.
        Err(illegal) if matches!(proof, Proof::Succeeded { .. }) => {
            let detail = format!(
                "{illegal}: the provider proved {} for attempt {}",
                proof.outcome(),
                attempt.id
            );
            return refuse(tx, attempt, ConflictKind::OtherObject, detail, source, now).await;
        }
        // A refusal that carries where the charge really is, which the
        // payment's state cannot take (an operator set it `authorized`
        // while this void or capture still waited to go out, and the charge
        // moved): what cobro shows is wrong, so it is a conflict too.
        Err(illegal) if !agrees(before, truth) => {
            let detail = format!(
                "{illegal}: the provider refused attempt {} and shows the charge {}",
                attempt.id,
                truth.map_or("authorized", ChargeNow::as_str)
            );
            return refuse(tx, attempt, ConflictKind::OtherObject, detail, source, now).await;
        }
        Err(illegal) => {
            // A refusal of something that no longer matters: keep the
            // attempt settled, leave the payment as it is.
            tracing::warn!(payment_id = %payment_id, error = %illegal, "proof does not apply to the payment's state");
            return Ok(Applied::Settled {
                before: before.as_str().to_owned(),
                after: before.as_str().to_owned(),
            });
        }
    };
    let amount_captured = match truth {
        Some(ChargeNow::Captured { amount }) => Some(amount),
        _ => (after == PaymentStatus::Captured).then_some(payment.amount),
    };
    let outcome = PaymentOutcome {
        provider_ref: match operation {
            Operation::Authorize => provider_ref.map(str::to_owned),
            _ => None,
        },
        amount_captured,
        failure: match proof {
            // The decline it closes is what the payment ends with.
            _ if event == PaymentEvent::DeclineClosed => payment
                .failure_code
                .clone()
                .zip(payment.failure_message.clone()),
            Proof::Declined { code, message } | Proof::Failed { code, message, .. } => {
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
    // The authorisation that waited is over, as the payment now shows:
    // declined, or paid by the customer after all (the cancel refused with
    // the charge captured).
    if let Some(waiting) = unauthorised {
        match event {
            PaymentEvent::DeclineClosed => {
                let note = settled.failure_code.as_deref();
                tx.resolve_attempt(waiting.id, AttemptState::Declined, None, note, now)
                    .await?;
            }
            PaymentEvent::Captured => {
                let paid = settled.provider_ref.as_deref();
                let note = Some("paid by the customer before the cancel");
                tx.resolve_attempt(waiting.id, AttemptState::Succeeded, paid, note, now)
                    .await?;
            }
            _ => {}
        }
    }
    if operation == Operation::Authorize && !after.authorisation_pending() {
        let after = settle_held_cancels(tx, &settled, after, now).await?;
        return Ok(Applied::Settled {
            before: before.as_str().to_owned(),
            after: after.as_str().to_owned(),
        });
    }
    Ok(Applied::Settled {
        before: before.as_str().to_owned(),
        after: after.as_str().to_owned(),
    })
}

/// A soft decline of an authorisation (its code says "try elsewhere",
/// [`crate::routing::SOFT_DECLINES`]), the attempt just recorded
/// `declined`: the payment moves to the next provider of its route instead
/// of ending declined, when it has one ([`crate::routing::fail_over`] says
/// when). `None`: it ends as any decline.
///
/// The payment is `processing` when the worker reads the decline in the
/// answer (or a webhook brings it first), or `requires_reconciliation`
/// when the answer was lost and the reconciler (or a webhook) reads the
/// declined object afterwards: the same proof, so the same move, and the
/// payment goes back to `processing` at the next provider in the same
/// transaction, as after the reconciler's "no effect".
async fn soft_decline_moves_on(
    tx: &mut WriteTx,
    attempt: &AttemptRow,
    payment: &PaymentRow,
    proof: &Proof,
    now: DateTime<Utc>,
) -> Result<Option<Applied>, StoreError> {
    let Proof::Declined { code, .. } = proof else {
        return Ok(None);
    };
    let before = payment.status;
    if attempt.operation != Operation::Authorize
        || !crate::routing::is_soft_decline(code)
        || !matches!(
            before,
            PaymentStatus::Processing | PaymentStatus::RequiresReconciliation
        )
    {
        return Ok(None);
    }
    // The circuits are the next provider's worker's to consult: an
    // attempt never sent at an open provider moves on again from there.
    let open = std::collections::BTreeSet::new();
    let proof = (crate::routing::NoEffectProof::SoftDecline, code.as_str());
    let Some(planned) = crate::routing::FailOver::plan(attempt, payment, proof, &open, now) else {
        return Ok(None);
    };
    // Back to `processing` first, so that the move's `payment.rerouted`
    // shows the payment as it is after it; only once the move is certain,
    // so that a payment that cannot move ends declined from where it was.
    let after = match before {
        PaymentStatus::RequiresReconciliation => {
            let after = before
                .apply(PaymentEvent::RetryScheduled)
                .map_err(|e| corrupt(e.to_string()))?;
            let payment_id = payment.id;
            let outcome = PaymentOutcome::default();
            if tx
                .settle_payment(payment_id, before, after, &outcome, now)
                .await?
                .is_none()
            {
                return Err(corrupt("payment moved inside the transaction"));
            }
            after
        }
        _ => before,
    };
    if planned.make(tx, attempt, now).await?.is_none() {
        // The payment is locked and its provider was read under the lock.
        return Err(corrupt("payment moved inside the transaction"));
    }
    Ok(Some(Applied::Settled {
        before: before.as_str().to_owned(),
        after: after.as_str().to_owned(),
    }))
}

/// A decline after the customer was asked to act (a failed 3-D Secure
/// challenge, a card declined after it) leaves Stripe's PaymentIntent open
/// (`requires_payment_method`) and its client secret in the customer's
/// browser: confirmed again with another card, it would charge beside the
/// order's next payment. So the authorisation is not over: its attempt
/// keeps waiting (`awaiting_customer`, so that a payment the customer
/// makes meanwhile is adopted, not a contradiction), the payment goes
/// `canceling` with the decline as its failure, and the PaymentIntent's
/// cancel goes out through the outbox; the cancel's proof ends the
/// payment `declined` and the attempt with it. `None`: not such a decline
/// (or a payment stopped for conflicting evidence: an operator decides).
async fn declined_while_open(
    tx: &mut WriteTx,
    attempt: &AttemptRow,
    payment: &PaymentRow,
    proof: &Proof,
    now: DateTime<Utc>,
) -> Result<Option<Applied>, StoreError> {
    // An operator's unverified "failed" is no money moved too: the same.
    let (Proof::Declined { code, message }
    | Proof::Failed {
        code,
        message,
        charge: None,
    }) = proof
    else {
        return Ok(None);
    };
    if attempt.operation != Operation::Authorize
        || attempt.state != AttemptState::AwaitingCustomer
        || payment.next_action.is_none()
    {
        return Ok(None);
    }
    let before = payment.status;
    // Its PaymentIntent is being canceled already (this decline again, or
    // the expiry's cancel): that cancel closes it.
    if before == PaymentStatus::Canceling {
        return Ok(Some(Applied::AlreadySettled));
    }
    let failure = (code.clone(), message.clone());
    Ok(cancel_while_open(tx, payment, Some(failure), now)
        .await?
        .map(|after| Applied::Settled {
            before: before.as_str().to_owned(),
            after: after.as_str().to_owned(),
        }))
}

/// Moves a payment whose PaymentIntent is open and never held money (its
/// authorisation waits for the customer) to `canceling` and sends the
/// PaymentIntent's cancel ([`cancel_open_intent`]), in the caller's
/// transaction, the payment locked: after a decline (`failure`), or from
/// `needs_review` when a cancel escalated there is proven without effect
/// (`None`). The payment's own failure, if it has one, is kept: it is the
/// first decline's. `None`: the payment cannot move so (a payment stopped
/// for conflicting evidence waits for an operator).
pub async fn cancel_while_open(
    tx: &mut WriteTx,
    payment: &PaymentRow,
    failure: Option<(String, String)>,
    now: DateTime<Utc>,
) -> Result<Option<PaymentStatus>, StoreError> {
    let before = payment.status;
    let Ok(after) = before.apply(PaymentEvent::DeclinedWhileOpen) else {
        return Ok(None);
    };
    if before == PaymentStatus::NeedsReview && tx.has_open_conflicts(payment.id).await? {
        return Ok(None);
    }
    let kept = payment
        .failure_code
        .clone()
        .zip(payment.failure_message.clone());
    let outcome = PaymentOutcome {
        failure: kept.or(failure),
        ..PaymentOutcome::default()
    };
    let Some(moved) = tx
        .settle_payment(payment.id, before, after, &outcome, now)
        .await?
    else {
        return Err(corrupt("payment moved inside the transaction"));
    };
    cancel_open_intent(tx, &moved, now).await?;
    // Any other cancel the merchant asked for meanwhile: nothing left.
    settle_held_cancels(tx, &moved, after, now).await?;
    Ok(Some(after))
}

/// The payment's authorisation attempt that still waits for its customer,
/// if any: its PaymentIntent never held money.
pub async fn awaiting_customer(
    tx: &mut WriteTx,
    payment: PaymentId,
) -> Result<Option<AttemptRow>, StoreError> {
    Ok(tx
        .attempts_of_payment_any_account(payment)
        .await?
        .into_iter()
        .find(|a| a.operation == Operation::Authorize && a.state == AttemptState::AwaitingCustomer))
}

/// The provider answered (or a read showed) that the customer must act
/// (3-D Secure) on `attempt`'s own object `provider_ref`: the attempt
/// waits (`awaiting_customer`: answered, never resent, never a new key, no
/// outbox row) and the payment moves to `requires_action` with the action
/// the merchant's front end uses, until `expires_at`. In the caller's
/// transaction, compare-and-sets like [`apply_proof`]: an attempt settled
/// meanwhile (a webhook was faster) is [`Applied::AlreadySettled`].
pub async fn await_customer(
    tx: &mut WriteTx,
    attempt: &AttemptRow,
    provider_ref: &str,
    action: &cobro_provider::NextAction,
    expires_at: DateTime<Utc>,
    now: DateTime<Utc>,
) -> Result<Applied, StoreError> {
    let (attempt_id, payment_id, _) = ids(attempt);
    if attempt.operation != Operation::Authorize {
        return Err(corrupt("only an authorisation waits for the customer"));
    }
    let payment = tx
        .lock_payment_any_account(payment_id)
        .await?
        .ok_or_else(|| corrupt("attempt without payment"))?;
    if !tx
        .resolve_attempt(
            attempt_id,
            AttemptState::AwaitingCustomer,
            Some(provider_ref),
            Some("waiting for the customer to authenticate"),
            now,
        )
        .await?
    {
        return Ok(Applied::AlreadySettled);
    }
    let before = payment.status;
    let Ok(after) = before.apply(PaymentEvent::ActionRequired) else {
        // Under review (an operator decides): the attempt waits all the
        // same, the payment stays where it is.
        return Ok(Applied::Settled {
            before: before.as_str().to_owned(),
            after: before.as_str().to_owned(),
        });
    };
    let shown = action
        .for_merchant(payment.return_url.as_deref())
        .to_string();
    if tx
        .require_action(payment_id, before, provider_ref, &shown, expires_at, now)
        .await?
        .is_none()
    {
        return Err(corrupt("payment moved inside the transaction"));
    }
    Ok(Applied::Settled {
        before: before.as_str().to_owned(),
        after: after.as_str().to_owned(),
    })
}

/// Sends the cancel of `payment`'s open PaymentIntent through the outbox
/// (due now), in the caller's transaction, the payment locked and already
/// `canceling` (abandoned past its expiry, or declined while open). A
/// cancel the merchant asked for while the customer was awaited (held for
/// the outcome) is the one sent, under its own key, not a second intent
/// beside it that would leave it held for ever; otherwise cobro opens a
/// cancel intent of its own. `true`: it was the merchant's.
pub async fn cancel_open_intent(
    tx: &mut WriteTx,
    payment: &PaymentRow,
    now: DateTime<Utc>,
) -> Result<bool, StoreError> {
    // One already on its way (a decline after an escalated cancel) is the
    // one: a second would only be refused as already canceled. One read:
    // the held cancels are among the payment's attempts.
    let cancels: Vec<AttemptRow> = tx
        .attempts_of_payment_any_account(payment.id)
        .await?
        .into_iter()
        .filter(|a| a.operation == Operation::Cancel)
        .collect();
    let on_its_way = cancels
        .iter()
        .any(|a| a.state.is_unresolved() && a.state != AttemptState::Held);
    if on_its_way {
        return Ok(false);
    }
    let released = match cancels.iter().find(|a| a.state == AttemptState::Held) {
        Some(first) => tx.release_held(first.id, now).await?,
        None => false,
    };
    if !released {
        let account = payment.account_id;
        let name = tx
            .next_intent_name(account, &payment.order_ref, Operation::Cancel)
            .await?;
        tx.open_intent(account, payment.id, None, Operation::Cancel, &name, now)
            .await?;
    }
    Ok(released)
}

/// A cancel asked for while the authorisation was unknown runs now that
/// the outcome is known: once, if it is an authorisation (the payment goes
/// `canceling` and the held attempt becomes sendable, in this
/// transaction); otherwise it ends `failed` with the payment's truth. Every
/// path that moves a payment out of an authorisation-pending status calls
/// it (proofs, "no effect" failures, operators).
pub async fn settle_held_cancels(
    tx: &mut WriteTx,
    payment: &cobro_store::PaymentRow,
    status: PaymentStatus,
    now: DateTime<Utc>,
) -> Result<PaymentStatus, StoreError> {
    let payment_id = payment.id;
    let mut status = status;
    for held in tx.held_attempts_any_account(payment_id).await? {
        let held_id = held.id;
        if status == PaymentStatus::Authorized {
            let canceling = status
                .apply(PaymentEvent::CancelRequested)
                .map_err(|e| corrupt(e.to_string()))?;
            if tx
                .settle_payment(
                    payment_id,
                    status,
                    canceling,
                    &PaymentOutcome::default(),
                    now,
                )
                .await?
                .is_some()
                && tx.release_held(held_id, now).await?
            {
                status = canceling;
                continue;
            }
        }
        let note = format!("the payment is {status}; nothing to cancel");
        tx.resolve_attempt(held_id, AttemptState::Failed, None, Some(&note), now)
            .await?;
    }
    Ok(status)
}

/// A cancel asked for while the authorisation is unknown: an intent of its
/// own whose attempt is `held` (its provider key already generated and
/// stored) until the authorisation is proven.
pub async fn hold_cancel(
    tx: &mut WriteTx,
    account: AccountId,
    payment: &cobro_store::PaymentRow,
    now: DateTime<Utc>,
) -> Result<AttemptRow, StoreError> {
    let payment_id = payment.id;
    let name = tx
        .next_intent_name(account, &payment.order_ref, Operation::Cancel)
        .await?;
    let intent = tx
        .insert_intent(account, payment_id, None, Operation::Cancel, &name, now)
        .await?;
    let attempt_id = AttemptId::new();
    tx.hold_attempt(
        &cobro_store::NewAttempt {
            id: attempt_id,
            intent,
            payment: payment_id,
            refund: None,
            operation: Operation::Cancel,
            provider_key: uuid::Uuid::new_v4().to_string(),
            reference: cobro_core::attempt_reference(name.as_str(), attempt_id),
        },
        now,
    )
    .await
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
    // Lock order: the payment row, then the attempt.
    tx.lock_payment_any_account(payment_id).await?;
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
    match attempt.operation {
        Operation::Authorize => {
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
        Operation::Refund => {
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
