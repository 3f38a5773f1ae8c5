//! What the books (docs/books.md) apply: a provider object that differs
//! from cobro's record, through the same moves a webhook applies
//! ([`provider_moved`](crate::webhook)), a refund made at the provider
//! without cobro, and the conflicts the books raise. Each is one
//! transaction under the payment's lock, re-reading what it decides from,
//! so two runs at once (or a run and a webhook) apply a move once.

use crate::apply::{Source, stop_the_line};
use crate::evidence::{Fit, fit};
use crate::webhook::{provider_moved, record_move};
use chrono::{DateTime, Utc};
use cobro_core::{AttemptId, Decision, IntentName, Operation, PaymentId, RefundId, RefundStatus};
use cobro_provider::{ProviderObject, ProviderStatus};
use cobro_store::audit::NewDecision;
use cobro_store::books::{AdoptedAttempt, intent_number};
use cobro_store::conflicts::ConflictKind;
use cobro_store::{AttemptRow, DbId, NewRefund, RefundRow, Store, StoreError, WriteTx};

/// What the books did with an object that differs from cobro's record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Drift {
    /// Applied as the provider's move, with its decision and event.
    Applied(Decision),
    /// Already as the provider says (a webhook or another run applied it
    /// first): nothing written.
    AlreadyRecorded,
    /// Contradicts cobro's record: kept as a conflict, the payment in review.
    Conflict(String),
    /// Kept already (an open conflict of the same finding): nothing written.
    ConflictKept,
}

/// Applies what the provider's `object` shows about `attempt` (found by
/// the object's `cobro_attempt` metadata): a provider move (an expired
/// authorisation voided, a refund failed after it succeeded) or, when no
/// move explains the difference, a conflict. `said` is the object as
/// listed (JSON), kept with the decision or the conflict.
pub async fn apply_drift(
    store: &Store,
    attempt: AttemptId,
    object: &ProviderObject,
    why: &str,
    actor: &str,
    said: &str,
    now: DateTime<Utc>,
) -> Result<Drift, StoreError> {
    let mut tx = store.begin().await?;
    let attempt = tx
        .attempt_any_account(attempt)
        .await?
        .ok_or_else(|| StoreError::Corrupt("the drifted attempt vanished".into()))?;
    let payment_id = attempt.payment_id;
    let payment = tx
        .lock_payment_any_account(payment_id)
        .await?
        .ok_or_else(|| StoreError::Corrupt("attempt without payment".into()))?;
    let refund = match attempt.refund_id {
        Some(r) => tx.refund_any_account(r).await?,
        None => None,
    };
    let source = Source { name: actor, said };
    let ours = fit(
        attempt.operation,
        &attempt,
        &payment,
        refund.as_ref(),
        object,
    ) == Fit::Ours;
    if ours
        && let Some(moved) =
            provider_moved(&mut tx, &attempt, &payment, refund.as_ref(), object, now).await?
    {
        let decision = moved.decision;
        let reason = format!("books: {}", moved.why);
        record_move(&mut tx, &attempt, moved, &source, reason, now).await?;
        tx.commit().await?;
        return Ok(Drift::Applied(decision));
    }
    let detail = format!("the provider's {} differs: {why}", object.id);
    let finding = Finding {
        attempt: Some(&attempt),
        payment: payment_id,
        kind: ConflictKind::BooksDrift,
        detail,
    };
    keep_once(tx, finding, &source, now).await
}

/// A conflict the books raise, about an attempt or (a refund made outside
/// cobro) only its payment.
struct Finding<'a> {
    attempt: Option<&'a AttemptRow>,
    payment: PaymentId,
    kind: ConflictKind,
    detail: String,
}

/// Keeps `finding` and stops the line, in `tx`, unless the same finding
/// is kept and open already (each run over an overlapping window sees it
/// again); commits or rolls back.
async fn keep_once(
    mut tx: WriteTx,
    finding: Finding<'_>,
    source: &Source<'_>,
    now: DateTime<Utc>,
) -> Result<Drift, StoreError> {
    let Finding {
        attempt,
        payment,
        kind,
        detail,
    } = finding;
    let kept = match attempt {
        Some(a) => {
            let id = a.id;
            tx.conflict_is_open(id, kind, &detail).await?
        }
        None => {
            tx.conflict_is_open_for_payment(payment, kind, &detail)
                .await?
        }
    };
    if kept {
        tx.rollback().await?;
        return Ok(Drift::ConflictKept);
    }
    stop_the_line(&mut tx, attempt, Some(payment), kind, &detail, source, now).await?;
    tx.commit().await?;
    Ok(Drift::Conflict(detail))
}

/// A refund made outside cobro (recorded by [`adopt_outside_refund`]) that
/// the provider failed after it succeeded: the refund `failed`, its amount
/// given back to the payment (refundable again, the status following), with
/// the refund's event and a decision, as a webhook applies it to a refund of
/// cobro's own (it carries no reference of cobro's, so no webhook can).
/// Once: a refund no longer `succeeded` is [`Drift::AlreadyRecorded`].
pub async fn fail_outside_refund(
    store: &Store,
    refund: &RefundRow,
    object: &ProviderObject,
    actor: &str,
    said: &str,
    now: DateTime<Utc>,
) -> Result<Drift, StoreError> {
    let mut tx = store.begin().await?;
    // The payment first, as every refund's settle path takes it.
    tx.lock_payment_any_account(refund.payment_id)
        .await?
        .ok_or_else(|| StoreError::Corrupt("the refunded payment vanished".into()))?;
    let message = format!(
        "refund {} {} at the provider after it succeeded",
        object.id, object.status
    );
    let failed = tx
        .fail_succeeded_refund(refund.id, ("refund_failed", &message), now)
        .await?;
    if failed.is_none() {
        tx.rollback().await?;
        return Ok(Drift::AlreadyRecorded);
    }
    let reason = format!(
        "books: refund {} made at the provider outside cobro failed there after it succeeded",
        object.id
    );
    let moved = (RefundStatus::Succeeded, RefundStatus::Failed);
    let decision = Decision::ProviderFailedRefund;
    let decided = Decided {
        actor,
        said,
        reason,
    };
    commit_refund_decision(
        tx,
        refund.payment_id,
        refund.id,
        moved,
        decision,
        decided,
        now,
    )
    .await
}

/// Who decided a refund's move from the books, on what, and why.
struct Decided<'a> {
    actor: &'a str,
    said: &'a str,
    reason: String,
}

/// Records the books' `decision` moving `refund` of `payment` from
/// `moved.0` to `moved.1`, and commits `tx`: the move applied.
async fn commit_refund_decision(
    mut tx: WriteTx,
    payment: PaymentId,
    refund: RefundId,
    moved: (RefundStatus, RefundStatus),
    decision: Decision,
    decided: Decided<'_>,
    now: DateTime<Utc>,
) -> Result<Drift, StoreError> {
    let row = NewDecision {
        run_id: None,
        payment,
        refund: Some(refund),
        attempt: None,
        state_before: moved.0.as_str().to_owned(),
        state_after: moved.1.as_str().to_owned(),
        provider_said: decided.said.to_owned(),
        decision,
        actor: decided.actor.to_owned(),
        reason: Some(decided.reason),
    };
    tx.record_decision(&row, now).await?;
    tx.commit().await?;
    Ok(Drift::Applied(decision))
}

/// Records a refund the provider made of `payment`'s charge without cobro
/// (no cobro metadata: the provider's dashboard): a `succeeded` refund of
/// the payment, its amount refunded, with the refund's event and a
/// decision. Once per provider refund: a refund already recorded under the
/// object's id is [`Drift::AlreadyRecorded`]. More than the payment can
/// still refund is a conflict.
pub async fn adopt_outside_refund(
    store: &Store,
    payment: PaymentId,
    object: &ProviderObject,
    actor: &str,
    said: &str,
    now: DateTime<Utc>,
) -> Result<Drift, StoreError> {
    let mut tx = store.begin().await?;
    let payment = tx
        .lock_payment_any_account(payment)
        .await?
        .ok_or_else(|| StoreError::Corrupt("the refunded payment vanished".into()))?;
    let payment_id = payment.id;
    if tx.refund_by_provider_ref(payment_id, &object.id).await? {
        tx.rollback().await?;
        return Ok(Drift::AlreadyRecorded);
    }
    let source = Source { name: actor, said };
    let amount = object.amount.unwrap_or_default();
    // Named after the provider's refund: no intent of cobro's made it.
    let intent =
        IntentName::from_stored(format!("{}:provider-refund/{}", payment.intent, object.id));
    let reason = "refunded at the provider outside cobro";
    let recorded = if object.status == ProviderStatus::Succeeded {
        record_succeeded_refund(&mut tx, &payment, intent, object, reason, now).await?
    } else {
        None
    };
    let Some(refund) = recorded else {
        let detail = format!(
            "the provider holds refund {} ({} of {}, {}) made outside cobro, which this payment \
             cannot record",
            object.id, amount, payment.amount_captured, object.status
        );
        let finding = Finding {
            attempt: None,
            payment: payment_id,
            kind: ConflictKind::BooksDrift,
            detail,
        };
        return keep_once(tx, finding, &source, now).await;
    };
    let reason = format!(
        "books: refund {} made at the provider outside cobro",
        object.id
    );
    let moved = (RefundStatus::Processing, RefundStatus::Succeeded);
    let decided = Decided {
        actor,
        said,
        reason,
    };
    let decision = Decision::ProviderRefunded;
    commit_refund_decision(tx, payment_id, refund, moved, decision, decided, now).await
}

/// Records `object`, a refund the provider shows `succeeded`, as a
/// succeeded refund of `payment` (locked by the caller) under `intent`:
/// its amount reserved and refunded, with the refund's events. `None`,
/// with nothing written, when the payment cannot refund that much (or
/// the object reports no amount).
async fn record_succeeded_refund(
    tx: &mut WriteTx,
    payment: &cobro_store::PaymentRow,
    intent: IntentName,
    object: &ProviderObject,
    reason: &str,
    now: DateTime<Utc>,
) -> Result<Option<RefundId>, StoreError> {
    let amount = object.amount.unwrap_or_default();
    let payment_id = payment.id;
    let account = payment.account_id;
    if amount <= 0
        || tx
            .reserve_refund(account, payment_id, amount, now)
            .await?
            .is_err()
    {
        return Ok(None);
    }
    let refund = NewRefund {
        id: RefundId::new(),
        account,
        payment: payment_id,
        intent,
        amount,
        reason: Some(reason.into()),
        reference: None,
    };
    tx.insert_refund(&refund, now).await?;
    let settled = tx
        .settle_refund(
            refund.id,
            RefundStatus::Processing,
            RefundStatus::Succeeded,
            Some(&object.id),
            None,
            now,
        )
        .await?;
    if settled.is_none() {
        return Err(StoreError::Corrupt("a refund just inserted moved".into()));
    }
    Ok(Some(refund.id))
}

/// A refund orphan an operator adopts: a refund carrying cobro's
/// metadata (its intent, attempt and reference) of a charge cobro holds,
/// read again at the provider just before.
#[derive(Clone, Debug)]
pub struct RefundAdoption<'a> {
    pub orphan: DbId,
    pub provider: &'a str,
    pub payment: PaymentId,
    pub object: &'a ProviderObject,
    pub intent: &'a str,
    pub attempt: AttemptId,
    pub reference: &'a str,
    pub actor: &'a str,
    pub reason: &'a str,
    pub said: &'a str,
}

/// What adopting a refund orphan did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RefundAdopted {
    /// Recorded as a succeeded refund of the payment, with its intent,
    /// attempt, events and decision; the orphan resolved.
    Adopted(RefundId),
    /// The orphan is no longer open: nothing written.
    NotOpen,
    /// A refund is recorded under the object's id already: nothing written.
    AlreadyRecorded,
    /// The payment cannot refund that much more: nothing written.
    CannotRecord(String),
}

/// Adopts a refund orphan into the payment that holds its charge, in one
/// transaction under the payment's lock: the refund moves the payment as
/// any succeeded refund does (`partially_refunded`, `refunded`) through
/// the same statements, under the intent and attempt its metadata names,
/// so the next books run matches it.
pub async fn adopt_refund_orphan(
    store: &Store,
    a: &RefundAdoption<'_>,
    now: DateTime<Utc>,
) -> Result<RefundAdopted, StoreError> {
    let mut tx = store.begin().await?;
    let payment = tx
        .lock_payment_any_account(a.payment)
        .await?
        .ok_or_else(|| StoreError::Corrupt("the refunded payment vanished".into()))?;
    if !tx
        .resolve_orphan_adopted(a.orphan, a.actor, a.reason, a.payment, now)
        .await?
    {
        tx.rollback().await?;
        return Ok(RefundAdopted::NotOpen);
    }
    if tx.refund_by_provider_ref(a.payment, &a.object.id).await? {
        tx.rollback().await?;
        return Ok(RefundAdopted::AlreadyRecorded);
    }
    let existing = tx
        .intents_of_order(payment.account_id, &payment.order_ref, Operation::Refund)
        .await?;
    if intent_number(a.intent) != Some(existing + 1) {
        tx.rollback().await?;
        return Ok(RefundAdopted::CannotRecord(format!(
            "its intent {} would leave a gap after the order's {existing} refund intent(s) \
             (cobro numbers the next refund after the count)",
            a.intent
        )));
    }
    let intent = IntentName::from_stored(a.intent.to_owned());
    let reason = "adopted by the books";
    let Some(refund) =
        record_succeeded_refund(&mut tx, &payment, intent, a.object, reason, now).await?
    else {
        tx.rollback().await?;
        return Ok(RefundAdopted::CannotRecord(format!(
            "refund {} of {:?} exceeds what payment {} can still refund",
            a.object.id, a.object.amount, a.payment
        )));
    };
    let attempt = AdoptedAttempt {
        provider: a.provider,
        account: payment.account_id,
        payment: a.payment,
        refund: Some(refund),
        operation: Operation::Refund,
        intent: a.intent,
        attempt: a.attempt,
        reference: a.reference,
        object: &a.object.id,
    };
    tx.insert_adopted_attempt(&attempt, now).await?;
    let decision = NewDecision {
        run_id: None,
        payment: a.payment,
        refund: Some(refund),
        attempt: Some(a.attempt),
        state_before: "orphan".into(),
        state_after: RefundStatus::Succeeded.as_str().to_owned(),
        provider_said: a.said.to_owned(),
        decision: Decision::BooksAdopted,
        actor: a.actor.to_owned(),
        reason: Some(a.reason.to_owned()),
    };
    tx.record_decision(&decision, now).await?;
    tx.commit().await?;
    Ok(RefundAdopted::Adopted(refund))
}

/// Raises a success cobro holds that the provider's ledger does not have
/// (critical): a conflict on the attempt, its payment in review. Once
/// while it is open.
pub async fn raise_missing(
    store: &Store,
    attempt: AttemptId,
    detail: &str,
    actor: &str,
    now: DateTime<Utc>,
) -> Result<Drift, StoreError> {
    let mut tx = store.begin().await?;
    let attempt_row = tx
        .attempt_any_account(attempt)
        .await?
        .ok_or_else(|| StoreError::Corrupt("the missing attempt vanished".into()))?;
    let source = Source {
        name: actor,
        said: "{}",
    };
    let finding = Finding {
        attempt: Some(&attempt_row),
        payment: attempt_row.payment_id,
        kind: ConflictKind::MissingAtProvider,
        detail: detail.to_owned(),
    };
    keep_once(tx, finding, &source, now).await
}
