//! Applying a provider's event, for every provider alike: the event is
//! already verified and parsed by its provider's
//! [`WebhookScheme`](cobro_provider::WebhookScheme).
//!
//! One transaction per delivery. The event id is inserted first under its
//! unique key (a redelivery finds it and changes nothing); the event is
//! matched to the one attempt its reference names and must
//! [`fit`](crate::fit) it (identity, amount, currency, capture mode); what it
//! proves goes through [`apply_proof`](crate::apply_proof) (the one code path
//! the worker and the reconciler use too; here as
//! [`apply_proof_locked`](crate::apply_proof_locked), the payment being
//! locked already) with an audit row, and the outcome
//! is stored with the event. What fits nothing, or contradicts the record,
//! is kept as a conflict. The caller answers the provider only after the
//! commit, so a lost acknowledgement costs a harmless redelivery.
//!
//! Ordering: `sequence` is the provider's per-charge counter, and
//! `payments.provider_sequence` how far cobro has recorded the charge the
//! payment adopted (`provider_ref`). An event of that charge is applied only
//! when it is newer, and raises it (compare-and-set); an older one is stored
//! as `ignored_stale`. An event of any other charge is not ordered against
//! it: it is fitted to the attempt it names like any evidence (a charge
//! found for an attempt recorded no effect is a conflict, not stale).
//! Refund events are not gated: a refund only ever adds to what is
//! refunded, and the refund attempt's own state is the gate.

use crate::apply::{Applied, Proof, Source, apply_proof_locked, stop_the_line};
use crate::evidence::{Fit, fit, proof_from};
use chrono::{DateTime, Utc};
use cobro_core::{
    AttemptState, Decision, Operation, PaymentEvent, PaymentId, PaymentStatus, RefundStatus,
};
use cobro_provider::{EventKind, ProviderEvent, ProviderObject, ProviderStatus};
use cobro_store::audit::NewDecision;
use cobro_store::conflicts::ConflictKind;
use cobro_store::settle::PaymentOutcome;
use cobro_store::webhooks::{NewWebhookEvent, WebhookOutcome};
use cobro_store::{AttemptRow, PaymentRow, ProviderScope, RefundRow, Store, StoreError, WriteTx};

/// Runs one delivery of `event` (whose raw body is `payload`) from the
/// provider `scope` names (received at its route, verified with its
/// secret) to its committed outcome (`applied`, `duplicate_delivery`,
/// `ignored_stale`, `conflict`, `unmatched`...). It proves things only
/// about that provider's attempts.
pub async fn deliver(
    store: &Store,
    scope: &ProviderScope,
    event: &ProviderEvent,
    payload: &str,
    now: DateTime<Utc>,
) -> Result<&'static str, StoreError> {
    let provider = scope.name.as_str();
    let receipt = NewWebhookEvent {
        provider,
        event_id: &event.id,
        event_type: &event.type_name,
        sequence: event.sequence,
        payload,
    };
    let mut tx = store.begin().await?;
    if !tx.insert_webhook_event(&receipt, now).await? {
        tx.rollback().await?;
        return Ok("duplicate_delivery");
    }
    let (outcome, payment) = process(&mut tx, scope, event, payload, now).await?;
    tx.record_webhook_outcome(provider, &event.id, outcome, payment)
        .await?;
    tx.commit().await?;
    Ok(outcome.as_str())
}

/// Matches the event to the one attempt it is about and applies what it
/// proves, inside `tx`. The event's reference is unique to one attempt
/// (`{intent}/{attempt id}`); what the event carries must also fit that
/// attempt. Evidence that names nothing of cobro's, or contradicts what is
/// recorded, is kept as a conflict and never adopted.
async fn process(
    tx: &mut WriteTx,
    scope: &ProviderScope,
    event: &ProviderEvent,
    payload: &str,
    now: DateTime<Utc>,
) -> Result<(WebhookOutcome, Option<PaymentId>), StoreError> {
    let kind = event.kind;
    let provider = scope.name.as_str();
    let actor = format!("webhook:{provider}");
    let source = Source {
        name: &actor,
        said: payload,
    };
    if kind == EventKind::Other {
        return Ok((WebhookOutcome::Unmatched, None));
    }
    let named = tx
        .attempts_by_reference_any_account(&event.reference)
        .await?;
    // Only this provider's attempts: an event received at provider A's
    // route, signed with A's secret, proves nothing about what was sent to
    // provider B (whose events come signed with B's). An attempt recorded
    // before providers were named is the default provider's.
    let (named, elsewhere): (Vec<AttemptRow>, Vec<AttemptRow>) =
        named
            .into_iter()
            .partition(|a| match a.provider.as_deref() {
                Some(sent_to) => sent_to == provider,
                None => scope.is_default,
            });
    if named.is_empty() && !elsewhere.is_empty() {
        let detail = format!(
            "event {} ({}) from provider {provider} names an attempt sent to another provider",
            event.id, event.type_name
        );
        unmatched(tx, &detail, &source, now).await?;
        return Ok((WebhookOutcome::Unmatched, None));
    }
    let [named] = named.as_slice() else {
        // Nothing of cobro's (or, for attempts made before references were
        // unique, several accounts' attempts): reported, never guessed from.
        let detail = format!(
            "event {} ({}) names {} attempts of cobro's",
            event.id,
            event.type_name,
            named.len()
        );
        unmatched(tx, &detail, &source, now).await?;
        return Ok((WebhookOutcome::Unmatched, None));
    };
    let payment_id = named.payment_id;
    // The event arrives in the provider's trace (or none): a link leads to
    // the trace of the request that made the attempt it is about.
    let span = tracing::Span::current();
    span.record("payment_id", tracing::field::display(payment_id));
    span.record("attempt_id", tracing::field::display(named.id));
    if cobro_telemetry::tracing_active() {
        let (traceparent, tracestate) = tx.trace_context_of(named.id).await?;
        cobro_telemetry::link_to_stored(&span, traceparent.as_deref(), tracestate.as_deref());
    }
    let payment = tx
        .lock_payment_any_account(payment_id)
        .await?
        .ok_or_else(|| StoreError::Corrupt("attempt without payment".into()))?;
    // `sequence` numbers the events of one charge, and `provider_sequence`
    // is how far cobro has recorded the charge the payment adopted
    // (`provider_ref`): only that charge's events can be behind it. Another
    // charge's event (one made after all for an attempt recorded no
    // effect, the double charge that record denies) is fitted to the
    // attempt it names like any evidence, never "stale" by another
    // charge's count.
    let charge = match kind {
        EventKind::RefundSucceeded | EventKind::RefundFailed => event.object.charge.as_deref(),
        _ => Some(event.object.id.as_str()),
    };
    let adopted = charge.is_some() && payment.provider_ref.as_deref() == charge;
    if kind.is_charge() && adopted && event.sequence <= payment.provider_sequence {
        return Ok((WebhookOutcome::IgnoredStale, Some(payment_id)));
    }
    let attempt = target_attempt(tx, named, &payment, kind, adopted).await?;
    let operation = attempt.operation;
    let refund = match attempt.refund_id {
        Some(r) => tx.refund_any_account(r).await?,
        None => None,
    };
    // Set when this event's authorisation is the one that adopts the charge.
    let mut adopts = false;
    let outcome = match fit(
        operation,
        &attempt,
        &payment,
        refund.as_ref(),
        &event.object,
    ) {
        Fit::Ours => {
            match provider_moved(tx, &attempt, &payment, refund.as_ref(), &event.object, now)
                .await?
            {
                Some(moved) => {
                    let reason = format!(
                        "event {} ({}, sequence {}): {}",
                        event.id, event.type_name, event.sequence, moved.why
                    );
                    let source = Source {
                        name: &actor,
                        said: payload,
                    };
                    record_move(tx, &attempt, moved, &source, reason, now).await?;
                    WebhookOutcome::Applied
                }
                None => match proof_from(operation, &event.object) {
                    None => WebhookOutcome::Unmatched,
                    Some(proof) => {
                        match apply_proof_locked(tx, &attempt, &payment, &proof, &source, now)
                            .await?
                        {
                            Applied::AlreadySettled => WebhookOutcome::DuplicateEffect,
                            Applied::Conflict { .. } => WebhookOutcome::Conflict,
                            Applied::Settled { before, after } => {
                                adopts = operation == Operation::Authorize
                                    && matches!(proof, Proof::Succeeded { .. })
                                    && payment.provider_ref.is_none();
                                let decision = NewDecision {
                                    run_id: None,
                                    payment: payment_id,
                                    refund: attempt.refund_id,
                                    attempt: Some(attempt.id),
                                    state_before: before,
                                    state_after: after,
                                    provider_said: payload.to_owned(),
                                    decision: proof.decision().to_owned(),
                                    actor: actor.clone(),
                                    reason: Some(format!(
                                        "event {} ({}, sequence {})",
                                        event.id, event.type_name, event.sequence
                                    )),
                                };
                                tx.record_decision(&decision, now).await?;
                                WebhookOutcome::Applied
                            }
                        }
                    }
                },
            }
        }
        Fit::Mismatch(why) => {
            stop_the_line(
                tx,
                Some(&attempt),
                Some(payment_id),
                ConflictKind::Mismatch,
                &why,
                &source,
                now,
            )
            .await?;
            WebhookOutcome::Conflict
        }
        Fit::NotOurs(why) => {
            let detail = format!("event {} does not fit its attempt: {why}", event.id);
            unmatched(tx, &detail, &source, now).await?;
            WebhookOutcome::Unmatched
        }
    };
    // What is recorded about the adopted charge now goes at least this far
    // (an effect already recorded by the worker counts too), as it does
    // when this event's authorisation is the one that adopts it. An event
    // of the adopted charge got here newer than the payment's sequence,
    // read under the payment's lock (a row lock on PostgreSQL, the one
    // writer on SQLite), so nothing can have raised it in between.
    if adopted || adopts {
        let raised = tx
            .raise_provider_sequence(payment_id, event.sequence)
            .await?;
        if kind.is_charge() && adopted && !raised {
            return Err(StoreError::Corrupt(format!(
                "payment {payment_id}'s provider sequence moved while it was locked"
            )));
        }
    }
    Ok((outcome, Some(payment_id)))
}

/// What the provider did on its own to what cobro had settled.
pub(crate) struct Moved {
    pub(crate) decision: Decision,
    pub(crate) before: String,
    pub(crate) after: String,
    pub(crate) why: &'static str,
}

/// Writes the decision of a provider move ([`provider_moved`]) of
/// `attempt`, in the transaction that applied it.
pub(crate) async fn record_move(
    tx: &mut WriteTx,
    attempt: &AttemptRow,
    moved: Moved,
    source: &Source<'_>,
    reason: String,
    now: DateTime<Utc>,
) -> Result<(), StoreError> {
    let decision = NewDecision {
        run_id: None,
        payment: attempt.payment_id,
        refund: attempt.refund_id,
        attempt: Some(attempt.id),
        state_before: moved.before,
        state_after: moved.after,
        provider_said: source.said.to_owned(),
        decision: moved.decision,
        actor: source.name.to_owned(),
        reason: Some(reason),
    };
    tx.record_decision(&decision, now).await
}

/// An event that shows the provider moved, on its own, what cobro had
/// settled, applied as that move (with the merchant's event, written by
/// the schema's trigger), in the webhook's transaction under the payment's
/// lock; `None` for any other event, which is then judged as evidence.
///
/// - An authorisation cobro holds (`authorized`, the attempt `succeeded`,
///   the payment's own charge) shown voided, with no capture or cancel of
///   cobro's open ([`target_attempt`] sends the event to those): the
///   provider released it (Stripe cancels a PaymentIntent left uncaptured
///   for seven days). The payment is `canceled`; no money was taken.
/// - A refund cobro recorded `succeeded` (the same provider object) shown
///   `failed` or `canceled`: the provider could not return the money after
///   all (Stripe's `refund.failed`, a closed card account). The refund is
///   `failed`, its amount refundable again, the payment's status follows.
pub(crate) async fn provider_moved(
    tx: &mut WriteTx,
    attempt: &AttemptRow,
    payment: &PaymentRow,
    refund: Option<&RefundRow>,
    object: &ProviderObject,
    now: DateTime<Utc>,
) -> Result<Option<Moved>, StoreError> {
    if attempt.state != AttemptState::Succeeded {
        return Ok(None);
    }
    let payment_id = payment.id;
    match (attempt.operation, refund) {
        (Operation::Authorize, _)
            if object.status == ProviderStatus::Voided
                && payment.status == PaymentStatus::Authorized
                && payment.provider_ref.as_deref() == Some(object.id.as_str()) =>
        {
            let after = PaymentStatus::Authorized
                .apply(PaymentEvent::VoidedByProvider)
                .map_err(|e| StoreError::Corrupt(e.to_string()))?;
            if tx
                .settle_payment(
                    payment_id,
                    payment.status,
                    after,
                    &PaymentOutcome::default(),
                    now,
                )
                .await?
                .is_none()
            {
                return Err(StoreError::Corrupt(format!(
                    "payment {payment_id} moved while it was locked"
                )));
            }
            Ok(Some(Moved {
                decision: Decision::ProviderVoided,
                before: payment.status.as_str().to_owned(),
                after: after.as_str().to_owned(),
                why: "the provider voided the authorisation on its own",
            }))
        }
        (Operation::Refund, Some(refund))
            if refund.status == RefundStatus::Succeeded
                && matches!(
                    object.status,
                    ProviderStatus::Failed | ProviderStatus::Canceled
                )
                && refund.provider_ref.as_deref() == Some(object.id.as_str()) =>
        {
            let message = format!(
                "refund {} {} at the provider after it succeeded",
                object.id, object.status
            );
            let id = refund.id;
            if tx
                .fail_succeeded_refund(id, ("refund_failed", &message), now)
                .await?
                .is_none()
            {
                return Err(StoreError::Corrupt(format!(
                    "refund {id} moved while its payment was locked"
                )));
            }
            Ok(Some(Moved {
                decision: Decision::ProviderFailedRefund,
                before: RefundStatus::Succeeded.as_str().to_owned(),
                after: RefundStatus::Failed.as_str().to_owned(),
                why: "the provider failed the refund after it had succeeded",
            }))
        }
        _ => Ok(None),
    }
}

/// Keeps evidence that is about no attempt of cobro's as an unmatched
/// conflict: reported, never adopted.
async fn unmatched(
    tx: &mut WriteTx,
    detail: &str,
    source: &Source<'_>,
    now: DateTime<Utc>,
) -> Result<(), StoreError> {
    stop_the_line(tx, None, None, ConflictKind::Unmatched, detail, source, now).await
}

/// The attempt a charge or refund event is about. The reference names the
/// attempt that created the object (the authorisation of a charge, the
/// refund of a refund); a capture or a void of the payment's charge
/// (`adopted`) is the payment's unresolved capture or cancel attempt, once
/// the authorisation is settled. Cobro captures and voids only the charge
/// it adopted, so another charge's event is about the attempt it names.
async fn target_attempt(
    tx: &mut WriteTx,
    named: &AttemptRow,
    payment: &PaymentRow,
    kind: EventKind,
    adopted: bool,
) -> Result<AttemptRow, StoreError> {
    // A PaymentIntent cobro canceled because its customer never paid (a
    // decline while it was open, an expiry): its `canceled` event is about
    // that cancel, whatever the authorisation shows. Stripe clears the
    // last error when the PaymentIntent is updated (a cancel is), so one
    // whose confirmation failed reads "voided" then, which the
    // authorisation, waiting or declined, would take for a contradiction.
    let never_paid = matches!(
        named.state,
        AttemptState::AwaitingCustomer | AttemptState::Declined
    );
    if kind == EventKind::Voided
        && named.operation == Operation::Authorize
        && never_paid
        && adopted
        && payment.next_action.is_some()
        && let Some(cancel) = tx
            .attempts_of_payment_any_account(payment.id)
            .await?
            .into_iter()
            .rev()
            .find(|a| {
                a.operation == Operation::Cancel
                    && (a.state.is_unresolved() || a.state == AttemptState::Succeeded)
                    && a.state != AttemptState::Held
            })
    {
        return Ok(cancel);
    }
    let authorisation_open = named.state.is_unresolved();
    if named.operation != Operation::Authorize || authorisation_open || !adopted {
        return Ok(named.clone());
    }
    let follow_ups: &[Operation] = match kind {
        EventKind::Captured => &[Operation::Capture, Operation::Cancel],
        EventKind::Voided => &[Operation::Cancel, Operation::Capture],
        _ => return Ok(named.clone()),
    };
    // One read, under the payment's lock. For each operation in turn, the
    // attempt the event is about is that operation's newest unresolved
    // one, unless that one is held (a held cancel has not been sent).
    let open = tx.open_follow_ups_any_account(payment.id).await?;
    for &operation in follow_ups {
        if let Some(attempt) = open.iter().find(|a| a.operation == operation)
            && attempt.state != AttemptState::Held
        {
            return Ok(attempt.clone());
        }
    }
    Ok(named.clone())
}
