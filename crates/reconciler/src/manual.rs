//! Manual resolution: an operator's verdict on an attempt the reconciler
//! could not decide (a payment or a refund in `needs_review`), checked
//! against the provider with the same evidence as the reconciler's own
//! verdicts, applied through the one settle path, audited.

use chrono::{DateTime, Utc};
use cobro_core::{
    AttemptId, AttemptState, Decision, Operation, PaymentId, PaymentStatus, RefundStatus,
};
use cobro_provider::Provider;
use cobro_settle::evidence::proof_from;
use cobro_settle::{Applied, ChargeNow, Fit, Proof, Source, apply_proof, fit, settle_held_cancels};
use cobro_store::audit::NewDecision;
use cobro_store::conflicts::ConflictKind;
use cobro_store::conflicts::ConflictRow;
use cobro_store::settle::PaymentOutcome;
use cobro_store::{AttemptRow, PaymentRow, RefundRow, Store, StoreError};

/// An operator's resolution of a payment in `needs_review`.
#[derive(Clone, Debug)]
pub struct ManualResolution {
    pub payment: PaymentId,
    /// The attempt the operator resolves (`cobro payments show` lists them).
    pub attempt: AttemptId,
    pub outcome: ManualOutcome,
    pub provider_ref: Option<String>,
    pub operator: String,
    pub reason: String,
    /// Who ran the command, whatever `operator` says: the OS user and host
    /// of the process (`user@host`, [`invoked_by`]).
    pub invoked_by: String,
    /// What the provider showed when the verdict was checked
    /// ([`crate::Reconciler::check_verdict`]); `None`: not verified (the
    /// operator vouched for it, `--unverified`), and the audit says so.
    pub verified: Option<String>,
}

/// This process's OS user and host, for the audit trail.
pub fn invoked_by() -> String {
    let host = whoami::fallible::hostname().unwrap_or_else(|_| "unknown-host".into());
    format!("{}@{host}", whoami::username())
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ManualOutcome {
    Authorized,
    Captured,
    Declined,
    Failed,
    Canceled,
}

impl ManualOutcome {
    fn status(self) -> PaymentStatus {
        match self {
            ManualOutcome::Authorized => PaymentStatus::Authorized,
            ManualOutcome::Captured => PaymentStatus::Captured,
            ManualOutcome::Declined => PaymentStatus::Declined,
            ManualOutcome::Failed => PaymentStatus::Failed,
            ManualOutcome::Canceled => PaymentStatus::Canceled,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    #[error("no such payment")]
    NotFound,
    #[error(
        "the payment is {0}; only a payment (or a refund) in needs_review can be resolved by hand"
    )]
    NotInReview(String),
    #[error("attempt {0} is not an attempt of this payment")]
    NotThisPaymentsAttempt(String),
    #[error(
        "attempt {0} may still be in flight (the worker owns it); wait for it to be handed over"
    )]
    InFlight(String),
    #[error("an authorized or captured outcome needs the provider's charge id (--provider-ref)")]
    ProviderRefRequired,
    #[error("outcome {outcome:?} does not apply to a {operation} attempt")]
    NotApplicable {
        outcome: ManualOutcome,
        operation: String,
    },
    #[error("the provider's evidence contradicts the verdict: {0}")]
    Contradicted(String),
    #[error(
        "the verdict could not be verified at the provider: {0}; an operator who knows better vouches for it with --unverified --reason"
    )]
    Unproven(String),
    #[error(
        "the verdict contradicts what cobro recorded from a proof: {0}; restore the proven outcome and compensate through the API (a refund or a cancel), which runs under its own key"
    )]
    ContradictsRecord(String),
    #[error(
        "cobro holds evidence of an effect of this attempt ({0}): a verdict that no money moved is refused while it is kept; name the object the provider made (--provider-ref) with its outcome"
    )]
    KeptEffect(String),
    #[error("the payment changed while resolving; look again")]
    Conflict,
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// What an operator's outcome proves about an unresolved attempt.
fn manual_proof(
    r: &ManualResolution,
    operation: Operation,
    payment: &PaymentRow,
) -> Result<Proof, ResolveError> {
    let not_applicable = || ResolveError::NotApplicable {
        outcome: r.outcome,
        operation: operation.as_str().to_owned(),
    };
    let refused = |charge| Proof::Failed {
        code: "resolved_by_operator".into(),
        message: r.reason.clone(),
        charge,
    };
    let charge = || {
        r.provider_ref
            .clone()
            .or_else(|| payment.provider_ref.clone())
            .ok_or(ResolveError::ProviderRefRequired)
    };
    Ok(match (operation, r.outcome) {
        (Operation::Authorize, ManualOutcome::Authorized | ManualOutcome::Captured) => {
            Proof::Succeeded {
                provider_ref: r
                    .provider_ref
                    .clone()
                    .ok_or(ResolveError::ProviderRefRequired)?,
                captured: r.outcome == ManualOutcome::Captured,
            }
        }
        (Operation::Authorize, ManualOutcome::Declined) => Proof::Declined {
            code: "resolved_declined".into(),
            message: r.reason.clone(),
        },
        (Operation::Authorize, ManualOutcome::Failed) => Proof::Failed {
            code: "resolved_failed".into(),
            message: r.reason.clone(),
            charge: None,
        },
        (Operation::Capture, ManualOutcome::Captured)
        | (Operation::Cancel, ManualOutcome::Canceled) => Proof::Succeeded {
            provider_ref: charge()?,
            captured: operation == Operation::Capture,
        },
        (Operation::Capture | Operation::Cancel, ManualOutcome::Authorized) => {
            refused(Some(ChargeNow::Authorized))
        }
        (Operation::Cancel, ManualOutcome::Captured) => refused(Some(ChargeNow::Captured {
            amount: payment.amount,
        })),
        (Operation::Capture, ManualOutcome::Canceled) => refused(Some(ChargeNow::Voided)),
        // A refund the operator found: succeeded (`captured`: the money went
        // back, with the provider's refund id) or failed.
        (Operation::Refund, ManualOutcome::Captured) => Proof::Succeeded {
            provider_ref: r
                .provider_ref
                .clone()
                .ok_or(ResolveError::ProviderRefRequired)?,
            captured: false,
        },
        (Operation::Refund, ManualOutcome::Failed | ManualOutcome::Declined) => refused(None),
        _ => return Err(not_applicable()),
    })
}

/// Applies an operator's resolution: only from `needs_review`, naming the
/// attempt it resolves, refused while any attempt of the payment may be in
/// flight, by compare-and-set, audited with who and why. An unresolved
/// attempt is settled through the same path as a provider proof; a payment
/// stopped by a conflict (its attempts already settled) is set to the
/// outcome the operator found at the provider, and its conflicts closed.
pub async fn resolve_by_hand(
    store: &Store,
    r: &ManualResolution,
    now: DateTime<Utc>,
) -> Result<String, ResolveError> {
    let mut tx = store.begin().await?;
    match resolve_in(&mut tx, r, now).await {
        Ok(after) => {
            tx.commit().await?;
            Ok(after)
        }
        // A refusal is answered only from what is committed: on SQLite the
        // rollback waits for the write group whose work this transaction
        // may have read (crates/store/src/group.rs).
        Err(refused) => {
            tx.rollback().await?;
            Err(refused)
        }
    }
}

/// [`resolve_by_hand`]'s reads and writes, in its transaction.
async fn resolve_in(
    tx: &mut cobro_store::WriteTx,
    r: &ManualResolution,
    now: DateTime<Utc>,
) -> Result<String, ResolveError> {
    let payment = tx
        .lock_payment_any_account(r.payment)
        .await?
        .ok_or(ResolveError::NotFound)?;
    let attempts = tx.attempts_of_payment_any_account(r.payment).await?;
    // A refund in review is resolved on its own, whatever its payment's
    // status (a captured payment keeps its status while a refund of it is
    // in review).
    let refund = match attempts.iter().find(|a| a.id == r.attempt) {
        Some(a) if a.operation == Operation::Refund => match a.refund_id {
            Some(id) => tx.refund_any_account(id).await?,
            None => None,
        },
        _ => None,
    };
    let refund_in_review = refund
        .as_ref()
        .is_some_and(|f| f.status == RefundStatus::NeedsReview);
    if payment.status != PaymentStatus::NeedsReview && !refund_in_review {
        return Err(ResolveError::NotInReview(payment.status.to_string()));
    }
    // In flight: sent and still the worker's; or another attempt the
    // reconciler is still working out (only the named one is decided here).
    if let Some(busy) = attempts.iter().find(|a| {
        let worker_owned =
            matches!(a.state, AttemptState::Pending | AttemptState::Unknown) && a.send_count > 0;
        // Refunds do not decide the payment's status: one still being
        // reconciled does not block resolving another attempt.
        let other_open = a.state == AttemptState::Reconciling
            && a.id != r.attempt
            && a.operation != Operation::Refund;
        worker_owned || other_open
    }) {
        return Err(ResolveError::InFlight(busy.id.to_string()));
    }
    let attempt = attempts
        .iter()
        .find(|a| a.id == r.attempt)
        .ok_or_else(|| ResolveError::NotThisPaymentsAttempt(r.attempt.to_string()))?;
    let operation = attempt.operation;
    // The charge a refund being reconciled is looked up under is the
    // payment's: it must not change under it.
    if r.provider_ref.as_ref().is_some_and(|given| {
        operation != Operation::Refund && payment.provider_ref.as_ref() != Some(given)
    }) && let Some(refunding) = attempts
        .iter()
        .find(|a| a.operation == Operation::Refund && a.state.is_unresolved())
    {
        return Err(ResolveError::InFlight(refunding.id.to_string()));
    }
    let operator = format!("operator:{}", r.operator);
    let provider_showed = r.verified.as_deref().map(|showed| {
        serde_json::from_str::<serde_json::Value>(showed).unwrap_or_else(|_| showed.into())
    });
    let asserted = serde_json::json!({
        "operator_asserted": format!("{:?}", r.outcome),
        "provider_ref": r.provider_ref,
        "invoked_by": r.invoked_by,
        "verified": r.verified.is_some(),
        "provider_showed": provider_showed,
    })
    .to_string();
    // Read under the payment's lock, so that a conflict kept between the
    // check at the provider and this transaction is not closed unseen
    // below (a conflict written after it re-flags the payment once this
    // commits: stop_the_line takes the same lock).
    let kept = tx
        .open_conflict_of_attempt(r.attempt, ConflictKind::EffectAfterNoEffect)
        .await?;
    refuse_over_kept_effect(r, operation, kept)?;
    let unresolved = attempt.state.is_unresolved();
    // The operator has looked at the evidence: the conflicts are closed
    // first, so the decision below is applied, not kept as one more.
    tx.resolve_conflicts(r.payment, now).await?;
    let (before, after) = if unresolved {
        let proof = manual_proof(r, operation, &payment)?;
        let source = Source {
            name: &operator,
            said: &asserted,
        };
        match apply_proof(tx, attempt, &proof, &source, now).await? {
            Applied::Settled { before, after } => (before, after),
            _ => return Err(ResolveError::Conflict),
        }
    } else if let Some(refund) = refund.filter(|_| refund_in_review) {
        // A refund attempt already settled (a proof of no effect recorded
        // while the refund was in review, before such proofs failed the
        // refund): the refund takes what its attempt proved, nothing else.
        let to = match (attempt.state, r.outcome) {
            (
                AttemptState::NoEffect | AttemptState::Failed | AttemptState::Declined,
                ManualOutcome::Failed | ManualOutcome::Declined,
            ) => RefundStatus::Failed,
            (AttemptState::Succeeded, ManualOutcome::Captured) => RefundStatus::Succeeded,
            (state, _) => {
                return Err(ResolveError::ContradictsRecord(format!(
                    "the refund's attempt is recorded {state}"
                )));
            }
        };
        let failure =
            (to == RefundStatus::Failed).then_some(("resolved_by_operator", r.reason.as_str()));
        tx.settle_refund(
            refund.id,
            RefundStatus::NeedsReview,
            to,
            attempt.provider_ref.as_deref(),
            failure,
            now,
        )
        .await?
        .ok_or(ResolveError::Conflict)?;
        (
            RefundStatus::NeedsReview.as_str().to_owned(),
            to.as_str().to_owned(),
        )
    } else {
        let mut to = r.outcome.status();
        // Proof is never overridden: money cobro recorded as moved stays
        // moved (compensate through the API instead).
        let succeeded = attempts
            .iter()
            .find(|a| a.operation == Operation::Authorize && a.state == AttemptState::Succeeded);
        let contradiction = match to {
            PaymentStatus::Failed | PaymentStatus::Declined | PaymentStatus::Canceled
                if payment.amount_captured > 0 =>
            {
                Some(format!(
                    "{} of {} was captured under charge {}",
                    payment.amount_captured,
                    payment.currency,
                    payment.provider_ref.as_deref().unwrap_or("-")
                ))
            }
            PaymentStatus::Failed | PaymentStatus::Declined => succeeded.map(|a| {
                format!(
                    "attempt {} succeeded with charge {}",
                    a.id,
                    a.provider_ref.as_deref().unwrap_or("-")
                )
            }),
            PaymentStatus::Authorized if payment.amount_captured > 0 => Some(format!(
                "{} of {} was captured",
                payment.amount_captured, payment.currency
            )),
            _ => None,
        };
        if let Some(recorded) = contradiction {
            return Err(ResolveError::ContradictsRecord(recorded));
        }
        // "Captured" is told apart by the amounts as they are now, not by
        // the status the conflict stopped: refunds settle while a payment
        // is in review (one that fails after it succeeded gives its amount
        // back), so `refunded` may have become `captured`, or the other
        // way. The captured and refunded amounts stay what they are.
        if to == PaymentStatus::Captured {
            to = captured_status(&payment);
        }
        if matches!(to, PaymentStatus::Authorized | PaymentStatus::Captured)
            && r.provider_ref.is_none()
            && payment.provider_ref.is_none()
        {
            return Err(ResolveError::ProviderRefRequired);
        }
        let outcome = PaymentOutcome {
            provider_ref: r.provider_ref.clone(),
            amount_captured: (to == PaymentStatus::Captured && payment.amount_captured == 0)
                .then_some(payment.amount),
            failure: to
                .is_terminal_failure()
                .then(|| ("resolved_by_operator".to_owned(), r.reason.clone())),
        };
        let settled = tx
            .settle_payment(r.payment, PaymentStatus::NeedsReview, to, &outcome, now)
            .await?
            .ok_or(ResolveError::Conflict)?;
        let to = settle_held_cancels(tx, &settled, to, now).await?;
        (
            PaymentStatus::NeedsReview.as_str().to_owned(),
            to.as_str().to_owned(),
        )
    };
    // An authorisation queued and never sent (a move to the next provider,
    // or a retry under a new key, enqueued before the line stopped): the
    // verdict decides the payment, so it never goes out now. Sent once the
    // payment left review, it charged a payment the operator had resolved,
    // beside whatever charge the verdict named. A worker about to send it
    // waits for this transaction (the payment's lock) and finds it settled.
    if operation != Operation::Refund {
        for queued in attempts.iter().filter(|a| {
            a.id != r.attempt
                && a.operation == Operation::Authorize
                && a.state == AttemptState::Pending
                && a.send_count == 0
        }) {
            let note = Some("never sent: superseded by an operator's verdict");
            tx.resolve_attempt(queued.id, AttemptState::NoEffect, None, note, now)
                .await?;
            tx.close_outbox_of(queued.id, now).await?;
        }
    }
    tx.record_decision(
        &NewDecision {
            run_id: None,
            payment: r.payment,
            refund: attempt.refund_id,
            attempt: Some(r.attempt),
            state_before: before,
            state_after: after.clone(),
            provider_said: asserted,
            decision: Decision::ManualResolve,
            actor: operator,
            reason: Some(r.reason.clone()),
        },
        now,
    )
    .await?;
    Ok(after)
}

/// Whether an outcome says that no money moved for the attempt's
/// operation: no charge, no refund, no capture, no void.
fn no_money_moved(operation: Operation, outcome: ManualOutcome) -> bool {
    matches!(
        (operation, outcome),
        (
            Operation::Authorize | Operation::Refund,
            ManualOutcome::Failed | ManualOutcome::Declined
        ) | (
            Operation::Capture | Operation::Cancel,
            ManualOutcome::Authorized
        )
    )
}

/// cobro's own kept evidence of an effect of the attempt (an
/// `effect_after_no_effect` conflict still open, `kept`) outweighs any read
/// bounded by the attempt's window and any operator's word: a verdict that
/// no money moved is refused while it is kept, unless it was checked at
/// the provider (`r.verified`) on a positive read: the object it names,
/// read by its id, or for a refund the provider's proof of its failure
/// ([`crate::Reconciler::check_verdict`] refuses a refund verdict that
/// rests on absence alone). A name an unverified verdict gives was never
/// read, so it does not count.
fn refuse_over_kept_effect(
    r: &ManualResolution,
    operation: Operation,
    kept: Option<ConflictRow>,
) -> Result<(), ResolveError> {
    let checked =
        r.verified.is_some() && (named(r, operation).is_some() || operation == Operation::Refund);
    match kept {
        Some(c) if no_money_moved(operation, r.outcome) && !checked => {
            Err(ResolveError::KeptEffect(c.detail))
        }
        _ => Ok(()),
    }
}

/// Whether what the provider proved supports the operator's outcome.
fn supports(operation: Operation, outcome: ManualOutcome, proof: &Proof) -> bool {
    use ManualOutcome as M;
    match proof {
        Proof::Succeeded { captured, .. } => matches!(
            (operation, outcome, captured),
            (Operation::Authorize, M::Authorized, false)
                | (Operation::Authorize, M::Captured, true)
                | (Operation::Capture, M::Captured, _)
                | (Operation::Cancel, M::Canceled, _)
                | (Operation::Refund, M::Captured, _)
        ),
        Proof::Declined { .. } | Proof::Failed { charge: None, .. } => {
            no_money_moved(operation, outcome)
        }
        // A refused capture or void: the charge is where the provider says.
        Proof::Failed {
            charge: Some(now), ..
        } => matches!(
            (now, outcome),
            (ChargeNow::Authorized, M::Authorized)
                | (ChargeNow::Captured { .. }, M::Captured)
                | (ChargeNow::Voided, M::Canceled)
        ),
    }
}

/// The proof's charge or refund id, when it names one.
fn proven_ref(proof: &Proof) -> Option<&str> {
    match proof {
        Proof::Succeeded { provider_ref, .. } => Some(provider_ref),
        _ => None,
    }
}

impl<P: Provider> crate::Reconciler<P> {
    /// Checks an operator's verdict at the provider, with the reconciler's
    /// own evidence path (the consistent read, the request lifetime, the
    /// attempt's identity), before [`resolve_by_hand`] applies it. A "no
    /// money moved" verdict needs the proof a reconciler would need to
    /// decide "no effect" itself; a success verdict needs the provider's
    /// object to be the attempt's and in the state the verdict names. Says
    /// what the provider showed, for the audit trail.
    pub async fn check_verdict(&self, r: &ManualResolution) -> Result<String, ResolveError> {
        let payment = self
            .store
            .payment_any_account(r.payment)
            .await?
            .ok_or(ResolveError::NotFound)?;
        let attempt = self
            .store
            .attempts_of_payment_any_account(r.payment)
            .await?
            .into_iter()
            .find(|a| a.id == r.attempt)
            .ok_or_else(|| ResolveError::NotThisPaymentsAttempt(r.attempt.to_string()))?;
        let refund = match attempt.refund_id {
            Some(id) => self.store.refund_any_account(id).await?,
            None => None,
        };
        // What [`resolve_by_hand`] would refuse is refused before asking.
        if payment.status != PaymentStatus::NeedsReview
            && refund
                .as_ref()
                .is_none_or(|f| f.status != RefundStatus::NeedsReview)
        {
            return Err(ResolveError::NotInReview(payment.status.to_string()));
        }
        let operation = attempt.operation;
        let clock_off = self.clock_off().await.map_err(|e| match e {
            crate::ReconcileError::Store(e) => ResolveError::Store(e),
        })?;
        let asked_at = self.clock.now();
        // No replay follows an operator's check: the list reaches the end
        // of the last send's lifetime.
        let answer = self.ask(&attempt, operation, &payment, false).await;
        let showed = crate::said(&answer).to_string();
        // A PaymentIntent whose confirmation failed stays open for another
        // one, and the customer's browser holds its client secret once the
        // customer was asked to act: "no money moved" frees the order, so
        // it waits until the PaymentIntent is canceled at the provider.
        let open = answer
            .as_ref()
            .ok()
            .and_then(|a| a.found.iter().find(|o| o.confirmable))
            .filter(|_| payment.next_action.is_some() && no_money_moved(operation, r.outcome));
        if let Some(open) = open {
            return Err(still_open(&open.id));
        }
        // Judged as an attempt the reconciler owns, whatever it recorded
        // since: the verdict stands on what the provider shows now.
        let judged = AttemptRow {
            state: AttemptState::Reconciling,
            ..attempt.clone()
        };
        let finding = match self.judge(
            &judged,
            operation,
            &payment,
            refund.as_ref(),
            answer,
            asked_at,
            clock_off,
        ) {
            crate::Finding::NoEffect if asked_at < self.outlived(&attempt) => {
                crate::Finding::Unknown(format!(
                    "not found, but a request sent under the attempt's key may still be acted on until {}",
                    self.outlived(&attempt).to_rfc3339()
                ))
            }
            finding => finding,
        };
        let outcome = r.outcome;
        let agrees = |proof: &Proof| {
            supports(operation, outcome, proof)
                && r.provider_ref
                    .as_deref()
                    .zip(proven_ref(proof))
                    .is_none_or(|(given, proven)| given == proven)
        };
        match finding {
            crate::Finding::Proof(proof) if agrees(&proof) => Ok(showed),
            crate::Finding::Proof(proof) => Err(ResolveError::Contradicted(format!(
                "the provider proves {} for this attempt{}",
                proof.outcome(),
                proven_ref(&proof).map_or(String::new(), |id| format!(" ({id})"))
            ))),
            // The list covers the attempt's window; an object the operator
            // names is read by its id, which no window bounds (a provider
            // that acted on a request past its timeout made it later).
            crate::Finding::NoEffect if let Some(id) = named(r, operation) => {
                self.check_named(id, &attempt, &payment, refund.as_ref(), &agrees)
                    .await
            }
            crate::Finding::NoEffect if no_money_moved(operation, outcome) => {
                // Refused here before the operator confirms; resolve_in
                // holds the same rule in its transaction.
                let kept = self
                    .store
                    .open_conflict_of_attempt(r.attempt, ConflictKind::EffectAfterNoEffect)
                    .await?;
                refuse_over_kept_effect(r, operation, kept).map(|()| showed)
            }
            crate::Finding::NoEffect => Err(ResolveError::Contradicted(
                "a consistent read covering the attempt's window found no effect of it".into(),
            )),
            crate::Finding::Conflict(_, detail) => Err(ResolveError::Unproven(format!(
                "the evidence conflicts: {detail}"
            ))),
            crate::Finding::RequiresAction(id, _) => Err(ResolveError::Unproven(format!(
                "{id} waits for the customer to authenticate: no outcome yet"
            ))),
            // The operator may know the object the reads could not reach
            // (the list failed): it must be the attempt's own, in the
            // verdict's state.
            crate::Finding::Unknown(reason) => match named(r, operation) {
                Some(id) => {
                    self.check_named(id, &attempt, &payment, refund.as_ref(), &agrees)
                        .await
                }
                None => Err(ResolveError::Unproven(reason)),
            },
        }
    }

    /// The verdict checked against `id`, the object the operator names,
    /// read by its id: it must be the attempt's own, in the verdict's state.
    async fn check_named(
        &self,
        id: &str,
        attempt: &AttemptRow,
        payment: &PaymentRow,
        refund: Option<&RefundRow>,
        agrees: &dyn Fn(&Proof) -> bool,
    ) -> Result<String, ResolveError> {
        let operation = attempt.operation;
        let object = self
            .provider
            .get_charge(id)
            .await
            .map_err(|e| ResolveError::Unproven(format!("{id} could not be read: {e}")))?
            .ok_or_else(|| {
                ResolveError::Contradicted(format!("the provider has no charge {id}"))
            })?;
        if let Fit::NotOurs(why) | Fit::Mismatch(why) =
            fit(operation, attempt, payment, refund, &object)
        {
            return Err(ResolveError::Contradicted(format!(
                "{id} is not this attempt's: {why}"
            )));
        }
        if object.confirmable && payment.next_action.is_some() {
            return Err(still_open(id));
        }
        match proof_from(operation, &object) {
            Some(proof) if agrees(&proof) => {
                Ok(serde_json::json!({ "found": [object] }).to_string())
            }
            Some(proof) => Err(ResolveError::Contradicted(format!(
                "{id} shows {}",
                proof.outcome()
            ))),
            None => Err(ResolveError::Unproven(format!("{id} is still in progress"))),
        }
    }
}

/// A verdict refused while `id`, a PaymentIntent whose client secret was
/// given out, is still open for another confirmation.
fn still_open(id: &str) -> ResolveError {
    ResolveError::Unproven(format!(
        "{id} is still open for another confirmation and its client secret was given out: \
         cancel it at the provider first"
    ))
}

/// The object an operator's verdict names, where it can be read by id (a
/// charge; refunds are found through their charge's reads).
fn named(r: &ManualResolution, operation: Operation) -> Option<&str> {
    r.provider_ref
        .as_deref()
        .filter(|_| operation != Operation::Refund)
}

/// What "captured" means for `payment` given what has been refunded of it:
/// `captured` with nothing refunded, `refunded` with all of it,
/// `partially_refunded` between.
fn captured_status(payment: &PaymentRow) -> PaymentStatus {
    let captured = if payment.amount_captured > 0 {
        payment.amount_captured
    } else {
        payment.amount
    };
    match payment.amount_refunded {
        0 => PaymentStatus::Captured,
        refunded if refunded >= captured => PaymentStatus::Refunded,
        _ => PaymentStatus::PartiallyRefunded,
    }
}
