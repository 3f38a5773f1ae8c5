#![doc = include_str!("../README.md")]

use chrono::{DateTime, Utc};
use cobro_core::{
    AttemptId, AttemptState, Clock, IntentId, Operation, PaymentEvent, PaymentId, PaymentStatus,
    RefundId, RefundStatus, RunId,
};
use cobro_provider::{Provider, ProviderObject, QueryError};
use cobro_store::audit::NewDecision;
use cobro_store::settle::PaymentOutcome;
use cobro_store::{AttemptRow, NewAttempt, Store, StoreError, WriteTx};
use cobro_worker::{Applied, Proof, apply_proof};
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

#[derive(Clone, Debug)]
pub struct ReconcilerConfig {
    /// Who decides, for the audit trail (`reconciler:<host>` or `operator:<name>`).
    pub actor: String,
    /// The provider's documented search consistency delay: "not found" is
    /// proof of no effect only once this long has passed since the last send.
    pub search_lag: Duration,
    /// Unknown attempts not sent for this long, and captures, voids and
    /// refunds waiting this long, are examined too (a worker may be gone).
    pub stuck_after: Duration,
    /// Unresolved this long after the first send: `needs_review`.
    pub escalate_after: Duration,
    /// After proof of no effect: a new attempt with a new provider key
    /// (true), or fail the payment with an explicit reason (false).
    pub retry_on_no_effect: bool,
    /// Attempts examined per run at most.
    pub limit: u32,
}

impl Default for ReconcilerConfig {
    fn default() -> Self {
        Self {
            actor: format!("reconciler:{}", std::process::id()),
            search_lag: Duration::from_secs(60),
            stuck_after: Duration::from_secs(300),
            escalate_after: Duration::from_secs(24 * 3600),
            retry_on_no_effect: true,
            limit: 1000,
        }
    }
}

/// What one run looks at.
#[derive(Clone, Debug, Default)]
pub struct Scope {
    pub payment: Option<PaymentId>,
    /// Only attempts last sent longer ago than this.
    pub older_than: Option<Duration>,
}

/// The verdict on one attempt.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "verdict")]
pub enum Verdict {
    /// The provider proved an outcome and it was applied.
    Resolved { outcome: String },
    /// Proven to have had no effect; a new attempt with a new key was scheduled.
    Retried,
    /// Proven to have had no effect; failed with an explicit reason (policy).
    FailedNoEffect,
    /// Nothing proven (query failed, charge in progress, "not found" within
    /// the search lag): checked again on the next run.
    StillUnknown { reason: String },
    /// Unresolved past the horizon: `needs_review`.
    Escalated,
    /// Another reconciler, a webhook or the worker decided first.
    AlreadySettled,
}

/// One examined attempt, for the summary and `--json`.
#[derive(Clone, Debug, Serialize)]
pub struct Examined {
    pub payment_id: String,
    pub attempt_id: String,
    pub reference: String,
    pub operation: String,
    /// What the provider said (or why nothing).
    pub provider_said: serde_json::Value,
    #[serde(flatten)]
    pub verdict: Verdict,
    /// In a dry run: what would have been applied.
    pub applied: bool,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct Summary {
    pub run_id: Option<String>,
    pub dry_run: bool,
    pub examined: usize,
    pub resolved: BTreeMap<String, usize>,
    pub retried: usize,
    pub failed_no_effect: usize,
    pub still_unknown: usize,
    pub escalated: usize,
    pub already_settled: usize,
    pub items: Vec<Examined>,
}

impl Summary {
    /// Anything left that a human or a later run must look at.
    pub fn unresolved(&self) -> usize {
        self.still_unknown + self.escalated
    }

    fn count(&mut self, verdict: &Verdict) {
        match verdict {
            Verdict::Resolved { outcome } => {
                *self.resolved.entry(outcome.clone()).or_default() += 1
            }
            Verdict::Retried => self.retried += 1,
            Verdict::FailedNoEffect => self.failed_no_effect += 1,
            Verdict::StillUnknown { .. } => self.still_unknown += 1,
            Verdict::Escalated => self.escalated += 1,
            Verdict::AlreadySettled => self.already_settled += 1,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Everything a decision about one attempt needs to know.
#[derive(Clone, Copy)]
struct Ctx<'a> {
    attempt: &'a AttemptRow,
    run: Option<RunId>,
    dry_run: bool,
    /// What the provider said, for the audit row.
    said: &'a serde_json::Value,
    now: DateTime<Utc>,
}

/// What the provider's answer proves about an attempt.
enum Finding {
    Proof(Proof),
    /// Proven: the provider has no effect of this attempt.
    NoEffect,
    /// Nothing proven.
    Unknown(String),
}

pub struct Reconciler<P: Provider> {
    store: Store,
    provider: Arc<P>,
    clock: Arc<dyn Clock>,
    config: ReconcilerConfig,
}

fn to_chrono(d: Duration) -> chrono::Duration {
    chrono::Duration::from_std(d).unwrap_or(chrono::Duration::MAX)
}

fn said(objects: &Result<Vec<ProviderObject>, QueryError>) -> serde_json::Value {
    match objects {
        Ok(list) => serde_json::json!({ "found": list }),
        Err(e) => serde_json::json!({ "query_error": e.to_string() }),
    }
}

impl<P: Provider> Reconciler<P> {
    pub fn new(
        store: Store,
        provider: Arc<P>,
        clock: Arc<dyn Clock>,
        config: ReconcilerConfig,
    ) -> Self {
        Self {
            store,
            provider,
            clock,
            config,
        }
    }

    /// One reconciliation run: examine every candidate, ask the provider,
    /// apply what it proves (unless `dry_run`), audit every decision.
    /// `progress(done, total)` is called after each attempt.
    pub async fn run(
        &self,
        scope: &Scope,
        dry_run: bool,
        trigger: &str,
        progress: &(dyn Fn(usize, usize) + Sync),
    ) -> Result<Summary, ReconcileError> {
        let now = self.clock.now();
        let stuck = scope.older_than.unwrap_or(self.config.stuck_after);
        let mut candidates = self
            .store
            .reconcile_candidates(now - to_chrono(stuck), scope.payment, self.config.limit)
            .await?;
        if let Some(older) = scope.older_than {
            let cutoff = now - to_chrono(older);
            candidates.retain(|a| a.last_send_at.is_none_or(|t| t.0 < cutoff));
        }
        let run_id = if dry_run {
            None
        } else {
            Some(
                self.store
                    .start_run(trigger, &self.config.actor, dry_run, now)
                    .await?,
            )
        };
        let mut summary = Summary {
            run_id: run_id.map(|r| r.to_string()),
            dry_run,
            ..Default::default()
        };
        let total = candidates.len();
        for (i, attempt) in candidates.iter().enumerate() {
            let item = self.examine(attempt, run_id, dry_run).await?;
            summary.count(&item.verdict);
            summary.examined += 1;
            summary.items.push(item);
            progress(i + 1, total);
        }
        if let Some(run) = run_id {
            let mut brief = summary.clone();
            brief.items.clear();
            let text = serde_json::to_string(&brief).unwrap_or_default();
            self.store.finish_run(run, &text, self.clock.now()).await?;
        }
        tracing::info!(
            examined = summary.examined,
            still_unknown = summary.still_unknown,
            escalated = summary.escalated,
            dry_run,
            "reconciliation run finished"
        );
        Ok(summary)
    }

    async fn examine(
        &self,
        attempt: &AttemptRow,
        run: Option<RunId>,
        dry_run: bool,
    ) -> Result<Examined, ReconcileError> {
        let operation = Operation::parse(&attempt.operation)
            .ok_or_else(|| StoreError::Corrupt(format!("operation {}", attempt.operation)))?;
        let payment_id = PaymentId::from_uuid(attempt.payment_id.0);
        let payment = self
            .store
            .payment_unscoped(payment_id)
            .await?
            .ok_or_else(|| StoreError::Corrupt("attempt without payment".into()))?;
        // The question, asked with no transaction open.
        let answer = match operation {
            Operation::Authorize => match &attempt.provider_ref {
                Some(id) => self
                    .provider
                    .get_charge(id)
                    .await
                    .map(|c| c.into_iter().collect()),
                None => self.provider.search_charges(&attempt.reference).await,
            },
            Operation::Capture | Operation::Cancel => match &payment.provider_ref {
                Some(id) => self
                    .provider
                    .get_charge(id)
                    .await
                    .map(|c| c.into_iter().collect()),
                None => Ok(Vec::new()),
            },
            Operation::Refund => self.provider.search_refunds(&attempt.reference).await,
        };
        let provider_said = said(&answer);
        let now = self.clock.now();
        let finding = self.judge(attempt, operation, answer, now);
        let ctx = Ctx {
            attempt,
            run,
            dry_run,
            said: &provider_said,
            now,
        };
        let verdict = match finding {
            Finding::Unknown(reason) if self.past_horizon(attempt, now) => {
                self.escalate(&ctx, &payment.status, &reason).await?
            }
            Finding::Unknown(reason) => Verdict::StillUnknown { reason },
            Finding::Proof(proof) => self.adopt(&ctx, &proof).await?,
            Finding::NoEffect => self.no_effect(&ctx, operation).await?,
        };
        tracing::info!(attempt_id = %attempt.id.0, reference = %attempt.reference, ?verdict, dry_run, "reconcile.decide");
        Ok(Examined {
            payment_id: payment_id.to_string(),
            attempt_id: attempt.id.0.to_string(),
            reference: attempt.reference.clone(),
            operation: attempt.operation.clone(),
            provider_said,
            applied: !dry_run
                && !matches!(
                    verdict,
                    Verdict::StillUnknown { .. } | Verdict::AlreadySettled
                ),
            verdict,
        })
    }

    /// What the provider's answer proves. Pure: no IO.
    fn judge(
        &self,
        attempt: &AttemptRow,
        operation: Operation,
        answer: Result<Vec<ProviderObject>, QueryError>,
        now: DateTime<Utc>,
    ) -> Finding {
        let found = match answer {
            Ok(found) => found,
            Err(e) => {
                return Finding::Unknown(format!(
                    "the provider query failed, which proves nothing: {e}"
                ));
            }
        };
        let by_status =
            |wanted: &[&str]| found.iter().find(|o| wanted.contains(&o.status.as_str()));
        let proof = match operation {
            Operation::Authorize => {
                let succeeded: Vec<_> = found
                    .iter()
                    .filter(|o| matches!(o.status.as_str(), "authorized" | "captured" | "voided"))
                    .collect();
                if succeeded.len() > 1 {
                    tracing::error!(reference = %attempt.reference, charges = succeeded.len(), "more than one charge for one reference");
                }
                if let Some(charge) = succeeded.first() {
                    Some(Proof::Succeeded {
                        provider_ref: charge.id.clone(),
                        captured: charge.status == "captured",
                    })
                } else {
                    by_status(&["declined"]).map(|c| Proof::Declined {
                        code: "card_declined".into(),
                        message: format!("declined at the provider ({})", c.id),
                    })
                }
            }
            Operation::Capture => by_status(&["captured", "voided", "declined"])
                .map(|c| charge_settled(c, "captured")),
            Operation::Cancel => {
                by_status(&["voided", "captured", "declined"]).map(|c| charge_settled(c, "voided"))
            }
            Operation::Refund => match by_status(&["succeeded", "failed"]) {
                Some(r) if r.status == "succeeded" => Some(Proof::Succeeded {
                    provider_ref: r.id.clone(),
                    captured: false,
                }),
                Some(r) => Some(Proof::Failed {
                    code: "refund_failed".into(),
                    message: format!("refund {} failed at the provider", r.id),
                }),
                None => None,
            },
        };
        if let Some(proof) = proof {
            return Finding::Proof(proof);
        }
        if found
            .iter()
            .any(|o| o.status == "pending" || o.status == "processing")
        {
            return Finding::Unknown("the provider reports it in progress".into());
        }
        // Nothing found. That is proof of no effect only for an attempt the
        // worker no longer sends, and only once the provider's search has
        // had time to see its last send.
        if attempt.state != AttemptState::Reconciling.as_str() {
            return Finding::Unknown("not found; the worker still owns this attempt".into());
        }
        let last = attempt
            .last_send_at
            .map(|t| t.0)
            .unwrap_or(attempt.created_at.0);
        if now < last + to_chrono(self.config.search_lag) {
            return Finding::Unknown(format!(
                "not found, but the provider's search lag ({} s) has not passed since the last send",
                self.config.search_lag.as_secs()
            ));
        }
        Finding::NoEffect
    }

    fn past_horizon(&self, attempt: &AttemptRow, now: DateTime<Utc>) -> bool {
        let since = attempt
            .first_send_at
            .map(|t| t.0)
            .unwrap_or(attempt.created_at.0);
        now >= since + to_chrono(self.config.escalate_after)
    }

    fn decision(
        &self,
        ctx: &Ctx<'_>,
        before: &str,
        after: &str,
        decision: &str,
        reason: Option<String>,
    ) -> NewDecision {
        let Ctx {
            attempt, run, said, ..
        } = *ctx;
        NewDecision {
            run_id: run,
            payment: PaymentId::from_uuid(attempt.payment_id.0),
            refund: attempt.refund_id.map(|r| RefundId::from_uuid(r.0)),
            attempt: Some(AttemptId::from_uuid(attempt.id.0)),
            state_before: before.to_owned(),
            state_after: after.to_owned(),
            provider_said: said.to_string(),
            decision: decision.to_owned(),
            actor: self.config.actor.clone(),
            reason,
        }
    }

    async fn adopt(&self, ctx: &Ctx<'_>, proof: &Proof) -> Result<Verdict, ReconcileError> {
        let Ctx {
            attempt,
            run: _,
            dry_run,
            said: _,
            now,
        } = *ctx;
        let outcome = match proof {
            Proof::Succeeded { .. } => "succeeded",
            Proof::Declined { .. } => "declined",
            Proof::Failed { .. } => "failed",
        };
        let mut tx = self.store.begin().await?;
        let applied = apply_proof(&mut tx, attempt, proof, now).await?;
        let Applied::Settled { before, after } = applied else {
            tx.rollback().await?;
            return Ok(Verdict::AlreadySettled);
        };
        let d = self.decision(ctx, &before, &after, &format!("adopt_{outcome}"), None);
        tx.record_decision(&d, now).await?;
        finish(tx, dry_run).await?;
        Ok(Verdict::Resolved {
            outcome: outcome.into(),
        })
    }

    async fn no_effect(
        &self,
        ctx: &Ctx<'_>,
        operation: Operation,
    ) -> Result<Verdict, ReconcileError> {
        let Ctx {
            attempt,
            run: _,
            dry_run,
            said: _,
            now,
        } = *ctx;
        let payment_id = PaymentId::from_uuid(attempt.payment_id.0);
        let refund_id = attempt.refund_id.map(|r| RefundId::from_uuid(r.0));
        let mut tx = self.store.begin().await?;
        if !tx
            .resolve_attempt(
                AttemptId::from_uuid(attempt.id.0),
                AttemptState::NoEffect,
                None,
                Some("proven no effect at the provider"),
                now,
            )
            .await?
        {
            tx.rollback().await?;
            return Ok(Verdict::AlreadySettled);
        }
        let payment = tx
            .payment_by_id(payment_id)
            .await?
            .ok_or_else(|| StoreError::Corrupt("missing payment".into()))?;
        let before = payment.status()?;
        let (verdict, after) = if self.config.retry_on_no_effect {
            // A new attempt of the same intent, under a NEW provider key:
            // the old one is proven to have done nothing.
            tx.enqueue_attempt(
                &NewAttempt {
                    intent: IntentId::from_uuid(attempt.intent_id.0),
                    payment: payment_id,
                    refund: refund_id,
                    operation,
                    provider_key: uuid::Uuid::new_v4().to_string(),
                    reference: attempt.reference.clone(),
                },
                now,
                now,
            )
            .await?;
            let after = match operation {
                Operation::Authorize => {
                    self.move_payment(
                        &mut tx,
                        payment_id,
                        before,
                        PaymentEvent::RetryScheduled,
                        None,
                        now,
                    )
                    .await?
                }
                Operation::Refund => {
                    if let Some(r) = refund_id {
                        tx.settle_refund(
                            r,
                            RefundStatus::RequiresReconciliation,
                            RefundStatus::Processing,
                            None,
                            None,
                            now,
                        )
                        .await?;
                    }
                    before
                }
                _ => before,
            };
            (Verdict::Retried, after)
        } else {
            let failure = (
                "no_effect_at_provider".to_owned(),
                "the provider has no record of this attempt; not retried by policy".to_owned(),
            );
            let after = match operation {
                Operation::Authorize => {
                    self.move_payment(
                        &mut tx,
                        payment_id,
                        before,
                        PaymentEvent::Failed,
                        Some(failure),
                        now,
                    )
                    .await?
                }
                Operation::Capture => {
                    self.move_payment(
                        &mut tx,
                        payment_id,
                        before,
                        PaymentEvent::CaptureRefused,
                        Some(failure),
                        now,
                    )
                    .await?
                }
                Operation::Cancel => {
                    self.move_payment(
                        &mut tx,
                        payment_id,
                        before,
                        PaymentEvent::VoidRefused,
                        Some(failure),
                        now,
                    )
                    .await?
                }
                Operation::Refund => {
                    if let Some(r) = refund_id {
                        let from = tx
                            .refund_by_id(r)
                            .await?
                            .and_then(|r| RefundStatus::parse(&r.status))
                            .unwrap_or(RefundStatus::RequiresReconciliation);
                        tx.settle_refund(
                            r,
                            from,
                            RefundStatus::Failed,
                            None,
                            Some((&failure.0, &failure.1)),
                            now,
                        )
                        .await?;
                    }
                    before
                }
            };
            (Verdict::FailedNoEffect, after)
        };
        let name = if verdict == Verdict::Retried {
            "no_effect_retry"
        } else {
            "no_effect_fail"
        };
        let d = self.decision(
            ctx,
            before.as_str(),
            after.as_str(),
            name,
            Some("not found after the search lag".into()),
        );
        tx.record_decision(&d, now).await?;
        finish(tx, dry_run).await?;
        Ok(verdict)
    }

    /// Moves the payment by `event` with a compare-and-set; returns where it
    /// ended (unchanged when the event does not apply to its state).
    async fn move_payment(
        &self,
        tx: &mut WriteTx,
        id: PaymentId,
        from: PaymentStatus,
        event: PaymentEvent,
        failure: Option<(String, String)>,
        now: DateTime<Utc>,
    ) -> Result<PaymentStatus, ReconcileError> {
        let Ok(to) = from.apply(event) else {
            return Ok(from);
        };
        let outcome = PaymentOutcome {
            failure,
            ..Default::default()
        };
        Ok(
            match tx.settle_payment(id, from, to, &outcome, now).await? {
                Some(_) => to,
                None => from,
            },
        )
    }

    async fn escalate(
        &self,
        ctx: &Ctx<'_>,
        status: &str,
        reason: &str,
    ) -> Result<Verdict, ReconcileError> {
        let Ctx {
            attempt,
            run: _,
            dry_run,
            said: _,
            now,
        } = *ctx;
        let payment_id = PaymentId::from_uuid(attempt.payment_id.0);
        let before = PaymentStatus::parse(status)
            .ok_or_else(|| StoreError::Corrupt(format!("payment status {status}")))?;
        if before == PaymentStatus::NeedsReview {
            return Ok(Verdict::Escalated);
        }
        let mut tx = self.store.begin().await?;
        let after = self
            .move_payment(
                &mut tx,
                payment_id,
                before,
                PaymentEvent::Escalated,
                None,
                now,
            )
            .await?;
        if let Some(r) = attempt.refund_id.map(|r| RefundId::from_uuid(r.0)) {
            tx.settle_refund(
                r,
                RefundStatus::RequiresReconciliation,
                RefundStatus::NeedsReview,
                None,
                None,
                now,
            )
            .await?;
        }
        let d = self.decision(
            ctx,
            before.as_str(),
            after.as_str(),
            "escalate",
            Some(reason.to_owned()),
        );
        tx.record_decision(&d, now).await?;
        finish(tx, dry_run).await?;
        tracing::warn!(payment_id = %payment_id, reference = %attempt.reference, "unresolved past the horizon: needs_review");
        Ok(Verdict::Escalated)
    }
}

/// What a charge in a final status proves about a capture or a void: the
/// status that operation produces (`done`) proves it; any other final status
/// means it can never happen.
fn charge_settled(charge: &ProviderObject, done: &str) -> Proof {
    if charge.status == done {
        Proof::Succeeded {
            provider_ref: charge.id.clone(),
            captured: done == "captured",
        }
    } else {
        Proof::Failed {
            code: format!("charge_{}", charge.status),
            message: format!(
                "the charge is {} and can no longer be {done}",
                charge.status
            ),
        }
    }
}

/// Commits, or in a dry run rolls back what was computed.
async fn finish(tx: WriteTx, dry_run: bool) -> Result<(), StoreError> {
    if dry_run {
        tx.rollback().await
    } else {
        tx.commit().await
    }
}

/// An operator's resolution of a payment in `needs_review`.
#[derive(Clone, Debug)]
pub struct ManualResolution {
    pub payment: PaymentId,
    pub outcome: ManualOutcome,
    pub provider_ref: Option<String>,
    pub operator: String,
    pub reason: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ManualOutcome {
    Authorized,
    Captured,
    Declined,
    Failed,
}

#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    #[error("no such payment")]
    NotFound,
    #[error("the payment is {0}; only a payment in needs_review can be resolved by hand")]
    NotInReview(String),
    #[error("an authorized or captured outcome needs the provider's charge id (--provider-ref)")]
    ProviderRefRequired,
    #[error("the payment changed while resolving; look again")]
    Conflict,
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Applies an operator's resolution: only from `needs_review`, by
/// compare-and-set, through the same path as a provider proof, audited
/// with who and why.
pub async fn resolve_by_hand(
    store: &Store,
    r: &ManualResolution,
    now: DateTime<Utc>,
) -> Result<String, ResolveError> {
    let mut tx = store.begin().await?;
    let payment = tx
        .payment_by_id(r.payment)
        .await?
        .ok_or(ResolveError::NotFound)?;
    if payment.status != PaymentStatus::NeedsReview.as_str() {
        return Err(ResolveError::NotInReview(payment.status));
    }
    let proof = match r.outcome {
        ManualOutcome::Authorized | ManualOutcome::Captured => Proof::Succeeded {
            provider_ref: r
                .provider_ref
                .clone()
                .ok_or(ResolveError::ProviderRefRequired)?,
            captured: r.outcome == ManualOutcome::Captured,
        },
        ManualOutcome::Declined => Proof::Declined {
            code: "resolved_declined".into(),
            message: r.reason.clone(),
        },
        ManualOutcome::Failed => Proof::Failed {
            code: "resolved_failed".into(),
            message: r.reason.clone(),
        },
    };
    let attempts = store.attempts_for_payment(r.payment).await?;
    let attempt = attempts
        .iter()
        .rev()
        .find(|a| {
            a.operation == Operation::Authorize.as_str()
                && AttemptState::parse(&a.state).is_some_and(|s| s.is_unresolved())
        })
        .ok_or(ResolveError::Conflict)?;
    let Applied::Settled { before, after } = apply_proof(&mut tx, attempt, &proof, now).await?
    else {
        return Err(ResolveError::Conflict);
    };
    tx.record_decision(
        &NewDecision {
            run_id: None,
            payment: r.payment,
            refund: None,
            attempt: Some(AttemptId::from_uuid(attempt.id.0)),
            state_before: before,
            state_after: after.clone(),
            provider_said: serde_json::json!({ "operator_asserted": format!("{:?}", r.outcome), "provider_ref": r.provider_ref }).to_string(),
            decision: "manual_resolve".into(),
            actor: format!("operator:{}", r.operator),
            reason: Some(r.reason.clone()),
        },
        now,
    )
    .await?;
    tx.commit().await?;
    Ok(after)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn charge(status: &str) -> ProviderObject {
        ProviderObject {
            id: "ch_1".into(),
            status: status.into(),
            reference: None,
            amount: None,
            amount_captured: None,
            sequence: None,
        }
    }

    #[test]
    fn a_charges_final_status_proves_its_capture_or_void_and_refutes_the_other() {
        let captured = Proof::Succeeded {
            provider_ref: "ch_1".into(),
            captured: true,
        };
        let voided = Proof::Succeeded {
            provider_ref: "ch_1".into(),
            captured: false,
        };
        assert_eq!(charge_settled(&charge("captured"), "captured"), captured);
        assert_eq!(charge_settled(&charge("voided"), "voided"), voided);
        for (status, done) in [
            ("voided", "captured"),
            ("declined", "captured"),
            ("captured", "voided"),
            ("declined", "voided"),
        ] {
            match charge_settled(&charge(status), done) {
                Proof::Failed { code, .. } => assert_eq!(code, format!("charge_{status}")),
                other => panic!("{status} must refute {done}: {other:?}"),
            }
        }
    }
}
