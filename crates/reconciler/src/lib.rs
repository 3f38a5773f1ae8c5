#![doc = include_str!("../README.md")]

pub mod books;

use chrono::{DateTime, Utc};
use cobro_core::{
    AttemptId, AttemptState, Clock, Decision, Operation, PaymentEvent, PaymentId, PaymentStatus,
    RefundStatus, RunId,
};
use cobro_provider::{
    NextAction, Provider, ProviderObject, ProviderStatus, QueryError, Sent, Window,
};
use cobro_settle::apply::{awaiting_customer, cancel_while_open};
use cobro_settle::call::{Answered, Call, judge_answer};
use cobro_settle::evidence::{not_done_yet, proof_from};
use cobro_settle::routing::{NoEffectProof, fail_over};
use cobro_settle::{
    Applied, Fit, Proof, Source, apply_proof, await_customer, fit, settle_held_cancels,
    stop_the_line,
};
use cobro_store::audit::NewDecision;
use cobro_store::conflicts::ConflictKind;
use cobro_store::settle::PaymentOutcome;
use cobro_store::{
    AttemptRow, NewAttempt, PaymentRow, ProviderScope, RefundRow, Store, StoreError, WriteTx,
};
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

mod manual;
pub use manual::{ManualOutcome, ManualResolution, ResolveError, invoked_by, resolve_by_hand};

#[derive(Clone, Debug)]
pub struct ReconcilerConfig {
    /// Who decides, for the audit trail (`reconciler:<host>` or `operator:<name>`).
    pub actor: String,
    /// The clock skew allowed between cobro's hosts, its database and the
    /// provider: the consistent list that proves no effect starts this long
    /// before the first send, and the last send's window closes this long
    /// after it could have reached the provider
    /// (docs/proof-of-absence.md).
    pub clock_skew: Duration,
    /// How long one provider call may take (the worker's timeout): a send
    /// may reach the provider until then.
    pub request_timeout: Duration,
    /// How long the provider may still act on a request after it reached
    /// it (a request held in its queue). Inside the key window a replay of
    /// the attempt's key answers "in progress" for such a request; where no
    /// replay is made (past the key window, in review), a consistent read
    /// proves no effect only once the last send's lifetime is over too:
    /// last send + request timeout + this + skew. cobro sets the provider's
    /// key retention (no provider acts on a request whose key it has
    /// forgotten; docs/proof-of-absence.md, "How long a request lives").
    pub request_lifetime: Duration,
    /// How long the provider keeps an idempotency key, less the margin the
    /// worker keeps: until `first send + key_window`, the attempt's own key
    /// is replayed before "no effect" is decided (a request still executing
    /// under it answers "in progress", never absence). `None`: no replay.
    pub key_window: Option<Duration>,
    /// Unknown attempts not sent for this long, attempts sent and never
    /// recorded, and captures, voids and refunds waiting this long, are
    /// examined too (a worker may be gone).
    pub stuck_after: Duration,
    /// Unresolved this long after the first send: `needs_review`.
    pub escalate_after: Duration,
    /// After proof of no effect: a new attempt with a new provider key
    /// (true), or fail the payment with an explicit reason (false).
    pub retry_on_no_effect: bool,
    /// How far this host's clock may be from the database's before it
    /// proves no absence: every host's send times are bounded against that
    /// one clock, so a reconciler off it by more could judge a window
    /// closed that is not. `None`: not checked (tests on a manual clock).
    /// cobro sets half the `clock_skew`.
    pub max_clock_gap: Option<Duration>,
    /// Candidates read per page; a run pages through all of them.
    pub page: u32,
    /// Whose attempts this reconciler examines: those sent to the one
    /// provider it asks (each configured provider has its own reconciler,
    /// with that provider's `clock_skew`, `request_timeout` and key window), or every
    /// attempt (`None`: a single-provider setup, tests).
    pub provider: Option<ProviderScope>,
    /// How long a payment found waiting for its customer (3-D Secure)
    /// waits before it is canceled as abandoned (the worker's
    /// `action_expiry`).
    pub action_expiry: Duration,
}

impl Default for ReconcilerConfig {
    fn default() -> Self {
        Self {
            actor: format!("reconciler:{}", std::process::id()),
            clock_skew: Duration::from_secs(10),
            request_timeout: Duration::from_secs(10),
            request_lifetime: Duration::ZERO,
            key_window: Some(Duration::from_secs(23 * 3600)),
            stuck_after: Duration::from_secs(300),
            escalate_after: Duration::from_secs(24 * 3600),
            retry_on_no_effect: true,
            max_clock_gap: None,
            page: 500,
            provider: None,
            action_expiry: Duration::from_secs(3600),
        }
    }
}

/// What one run looks at.
#[derive(Clone, Debug, Default)]
pub struct Scope {
    pub payment: Option<PaymentId>,
    /// Only attempts last sent longer ago than this.
    pub older_than: Option<Duration>,
    /// Stop after this many candidates (`None`: every candidate, page by
    /// page).
    pub max: Option<usize>,
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
    /// Proven to have had no effect while the payment is in `needs_review`:
    /// recorded, nothing enabled; the operator decides.
    NoEffectInReview,
    /// Nothing proven (query failed, charge in progress, "not found" by a
    /// search only, or before the last send's window closed): checked again
    /// on the next run.
    StillUnknown { reason: String },
    /// Unresolved past the horizon: `needs_review`.
    Escalated,
    /// Evidence that contradicts the record or does not match the attempt:
    /// kept, `needs_review`, nothing adopted.
    Conflict { kind: String, detail: String },
    /// Another reconciler, a webhook or the worker decided first.
    AlreadySettled,
    /// Examining it failed (a store error); the next run tries again.
    Error { error: String },
}

impl Verdict {
    /// The verdict's name, as in `--json` (and the `verdict` label).
    pub fn name(&self) -> &'static str {
        match self {
            Verdict::Resolved { .. } => "resolved",
            Verdict::Retried => "retried",
            Verdict::FailedNoEffect => "failed_no_effect",
            Verdict::NoEffectInReview => "no_effect_in_review",
            Verdict::StillUnknown { .. } => "still_unknown",
            Verdict::Escalated => "escalated",
            Verdict::Conflict { .. } => "conflict",
            Verdict::AlreadySettled => "already_settled",
            Verdict::Error { .. } => "error",
        }
    }
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
    pub no_effect_in_review: usize,
    pub still_unknown: usize,
    pub escalated: usize,
    pub conflicts: usize,
    pub already_settled: usize,
    pub errors: usize,
    /// The run stopped at `Scope::max` with candidates left.
    pub truncated: bool,
    pub items: Vec<Examined>,
}

impl Summary {
    /// Anything left that a human or a later run must look at.
    pub fn unresolved(&self) -> usize {
        self.still_unknown + self.escalated + self.conflicts + self.no_effect_in_review
    }

    /// Adds `other`'s counts and items to this summary (one run per
    /// provider, shown as one). The run id stays this run's.
    pub fn absorb(&mut self, other: Summary) {
        self.run_id = self.run_id.take().or(other.run_id);
        self.examined += other.examined;
        for (outcome, n) in other.resolved {
            *self.resolved.entry(outcome).or_default() += n;
        }
        self.retried += other.retried;
        self.failed_no_effect += other.failed_no_effect;
        self.no_effect_in_review += other.no_effect_in_review;
        self.still_unknown += other.still_unknown;
        self.escalated += other.escalated;
        self.conflicts += other.conflicts;
        self.already_settled += other.already_settled;
        self.errors += other.errors;
        self.truncated |= other.truncated;
        self.items.extend(other.items);
    }

    fn count(&mut self, verdict: &Verdict) {
        match verdict {
            Verdict::Resolved { outcome } => {
                *self.resolved.entry(outcome.clone()).or_default() += 1
            }
            Verdict::Retried => self.retried += 1,
            Verdict::FailedNoEffect => self.failed_no_effect += 1,
            Verdict::NoEffectInReview => self.no_effect_in_review += 1,
            Verdict::StillUnknown { .. } => self.still_unknown += 1,
            Verdict::Escalated => self.escalated += 1,
            Verdict::Conflict { .. } => self.conflicts += 1,
            Verdict::AlreadySettled => self.already_settled += 1,
            Verdict::Error { .. } => self.errors += 1,
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
    /// Evidence under the attempt's identity that cannot be adopted.
    Conflict(ConflictKind, String),
    /// Nothing proven.
    Unknown(String),
    /// The attempt's own object waits for the customer (3-D Secure): not
    /// unknown, never escalated; recorded `requires_action`.
    RequiresAction(String, NextAction),
}

pub struct Reconciler<P: Provider> {
    store: Store,
    provider: Arc<P>,
    clock: Arc<dyn Clock>,
    config: ReconcilerConfig,
}

/// A setting as a time span, capped at a century: added to a time, a
/// span near `chrono::Duration::MAX` overflows and panics, and no
/// window, lifetime or horizon of cobro's means anything past that.
fn to_chrono(d: Duration) -> chrono::Duration {
    chrono::Duration::from_std(d)
        .unwrap_or(chrono::Duration::MAX)
        .min(chrono::Duration::days(36_525))
}

fn said(answer: &Result<Answer, QueryError>) -> serde_json::Value {
    match answer {
        Ok(Answer {
            found,
            consistent: Ok(()),
        }) => serde_json::json!({ "found": found }),
        Ok(Answer {
            found,
            consistent: Err(why),
        }) => serde_json::json!({ "found": found, "no_consistent_read": why }),
        Err(e) => serde_json::json!({ "query_error": e.to_string() }),
    }
}

/// What the provider said about an attempt: the objects found, and
/// whether they came from a strongly consistent read (a GET by id, a list
/// by creation time or of a charge's refunds), whose emptiness can prove
/// absence; `Err(why)`: they came from a search, which proves nothing when
/// it finds nothing.
struct Answer {
    found: Vec<ProviderObject>,
    consistent: Result<(), String>,
}

/// What replaying the attempt's own key told.
enum Replay {
    /// Not replayed: the key may be forgotten, or the payment is in review.
    Skipped,
    /// A dry run, where a real run would replay the key now (and decide
    /// nothing "no effect" from the replay's answer).
    DryRun,
    /// The provider answered, without executing anything, an indeterminate
    /// answer it stored under the key (a 5xx Stripe saved):
    /// the list is read again to adopt what the request made, and nothing
    /// found proves nothing yet. The attempt as re-read after the replay
    /// was recorded as a send.
    Over(AttemptRow),
    /// The answer proves an outcome, a conflict, or nothing yet.
    Answered(Answered, AttemptRow),
}

/// The intent name an attempt's reference was made of.
fn intent_of(attempt: &AttemptRow) -> &str {
    attempt.intent_name()
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

    /// One reconciliation run: examine every candidate (page by page), ask
    /// the provider, apply what it proves (unless `dry_run`), audit every
    /// decision. A failure on one candidate is counted (`errors`) and the
    /// run goes on; the run row is always finished.
    /// `progress(done, total_so_far)` is called after each attempt.
    #[tracing::instrument(
        name = "reconcile.run",
        skip_all,
        fields(
            trigger,
            dry_run,
            actor = %self.config.actor,
            examined = tracing::field::Empty,
            unresolved = tracing::field::Empty,
        )
    )]
    pub async fn run(
        &self,
        scope: &Scope,
        dry_run: bool,
        trigger: &str,
        progress: &(dyn Fn(usize, usize) + Sync),
    ) -> Result<Summary, ReconcileError> {
        let started = self.clock.now();
        let stuck = scope.older_than.unwrap_or(self.config.stuck_after);
        let run_id = if dry_run {
            None
        } else {
            Some(
                self.store
                    .start_run(trigger, &self.config.actor, dry_run, started)
                    .await?,
            )
        };
        let mut summary = Summary {
            run_id: run_id.map(|r| r.to_string()),
            dry_run,
            ..Default::default()
        };
        let outcome = self
            .examine_all(
                scope,
                stuck,
                started,
                run_id,
                dry_run,
                &mut summary,
                progress,
            )
            .await;
        // Payments waiting for their customer are not unknown: they are
        // read by their provider id, and canceled once expired.
        let outcome = match outcome {
            Ok(()) if !dry_run && scope.payment.is_none() => {
                self.sweep_waiting(started - to_chrono(stuck)).await
            }
            other => other,
        };
        if let Some(run) = run_id {
            let mut brief = summary.clone();
            brief.items.clear();
            let text = serde_json::to_string(&brief).unwrap_or_default();
            self.store.finish_run(run, &text, self.clock.now()).await?;
        }
        outcome?;
        let span = tracing::Span::current();
        span.record("examined", summary.examined);
        span.record("unresolved", summary.unresolved());
        tracing::info!(
            examined = summary.examined,
            still_unknown = summary.still_unknown,
            escalated = summary.escalated,
            conflicts = summary.conflicts,
            errors = summary.errors,
            dry_run,
            "reconciliation run finished"
        );
        Ok(summary)
    }

    /// Payments waiting for their customer (3-D Secure) whose status is
    /// older than `changed_before`: each PaymentIntent is read by its id
    /// (outside any transaction). A final state is adopted through the one
    /// settle path; one still waiting past `action_expires_at` is canceled
    /// at the provider through the outbox (the payment `canceling`, then
    /// `canceled` by the cancel's proof, or `captured` when the customer
    /// completed first and the provider refuses the cancel).
    async fn sweep_waiting(&self, changed_before: DateTime<Utc>) -> Result<(), ReconcileError> {
        let waiting = self
            .store
            .waiting_for_customers(
                changed_before,
                self.config.page,
                self.config.provider.as_ref(),
            )
            .await?;
        for attempt in &waiting {
            let payment_id = attempt.payment_id;
            let Some(payment) = self.store.payment_any_account(payment_id).await? else {
                continue;
            };
            let Some(charge) = payment.provider_ref.as_deref() else {
                continue;
            };
            let object = match self.provider.get_charge(charge).await {
                Ok(Some(object)) => object,
                Ok(None) | Err(_) => {
                    tracing::warn!(payment_id = %payment_id, "a payment waiting for its customer could not be read at the provider; the next run reads it again");
                    continue;
                }
            };
            let now = self.clock.now();
            let said = serde_json::json!({ "found": [&object] });
            let ctx = Ctx {
                attempt,
                run: None,
                dry_run: false,
                said: &said,
                now,
            };
            if !matches!(
                fit(Operation::Authorize, attempt, &payment, None, &object),
                Fit::Ours
            ) {
                continue;
            }
            if let Some(proof) = proof_from(Operation::Authorize, &object) {
                let verdict = self.adopt(&ctx, &proof).await?;
                tracing::info!(payment_id = %payment_id, ?verdict, "a payment waiting for its customer ended");
                continue;
            }
            if payment.action_expires_at.is_some_and(|at| at.0 <= now) {
                self.expire(&payment, now).await?;
            }
        }
        Ok(())
    }

    /// Abandoned: the payment goes `canceling` with a cancel intent (its
    /// attempt in the outbox, due now) in one transaction; the worker
    /// cancels the PaymentIntent under the attempt's own key.
    async fn expire(&self, payment: &PaymentRow, now: DateTime<Utc>) -> Result<(), ReconcileError> {
        let payment_id = payment.id;
        let account = payment.account_id;
        let mut tx = self.store.begin().await?;
        let Some(current) = tx.lock_payment_any_account(payment_id).await? else {
            tx.rollback().await?;
            return Ok(());
        };
        let Ok(to) = current.status.apply(PaymentEvent::ActionExpired) else {
            // It ended meanwhile (a webhook was faster).
            tx.rollback().await?;
            return Ok(());
        };
        let Some(moved) = tx
            .transition_payment(account, payment_id, current.status, to, now)
            .await?
        else {
            tx.rollback().await?;
            return Ok(());
        };
        let released = cobro_settle::apply::cancel_open_intent(&mut tx, &moved, now).await?;
        tx.commit().await?;
        tracing::info!(payment_id = %payment_id, merchants_cancel = released, "a payment left waiting for its customer expired: its PaymentIntent is canceled");
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    async fn examine_all(
        &self,
        scope: &Scope,
        stuck: Duration,
        started: DateTime<Utc>,
        run_id: Option<RunId>,
        dry_run: bool,
        summary: &mut Summary,
        progress: &(dyn Fn(usize, usize) + Sync),
    ) -> Result<(), ReconcileError> {
        let cutoff = started - to_chrono(stuck);
        let mut after: Option<AttemptId> = None;
        loop {
            let page = self
                .store
                .reconcile_candidates_of(
                    cutoff,
                    scope.payment,
                    after,
                    self.config.page,
                    self.config.provider.as_ref(),
                )
                .await?;
            // The cursor passes an unreadable row too: it names its id.
            let Some(last) = page.last() else { break };
            after = Some(match last {
                Ok(a) => a.id,
                Err(bad) => bad.id,
            });
            let full = page.len() == self.config.page as usize;
            for candidate in &page {
                if let Ok(attempt) = candidate
                    && scope.older_than.is_some()
                    && attempt.last_send_at.is_some_and(|t| t.0 >= cutoff)
                {
                    continue;
                }
                if scope.max.is_some_and(|max| summary.examined >= max) {
                    summary.truncated = true;
                    return Ok(());
                }
                let item = match candidate {
                    Ok(attempt) => match self.examine(attempt, run_id, dry_run).await {
                        Ok(item) => item,
                        Err(ReconcileError::Store(e)) => {
                            tracing::error!(attempt_id = %attempt.id, error = %e, "examining an attempt failed; the next run tries again");
                            Examined {
                                payment_id: attempt.payment_id.to_string(),
                                attempt_id: attempt.id.to_string(),
                                reference: attempt.reference.clone(),
                                operation: attempt.operation.to_string(),
                                provider_said: serde_json::Value::Null,
                                verdict: Verdict::Error {
                                    error: e.to_string(),
                                },
                                applied: false,
                            }
                        }
                    },
                    // Unreadable (a stored value no known variant matches):
                    // reported like any failed examination, and the run goes on.
                    Err(bad) => {
                        tracing::error!(attempt_id = %bad.id, error = %bad.error, "a candidate attempt cannot be read; the next run tries again");
                        Examined {
                            payment_id: bad.payment_id.to_string(),
                            attempt_id: bad.id.to_string(),
                            reference: String::new(),
                            operation: String::new(),
                            provider_said: serde_json::Value::Null,
                            verdict: Verdict::Error {
                                error: bad.error.to_string(),
                            },
                            applied: false,
                        }
                    }
                };
                if let Verdict::Error { .. } = item.verdict
                    && !dry_run
                {
                    cobro_telemetry::metrics::reconcile_verdict("error");
                }
                summary.count(&item.verdict);
                summary.examined += 1;
                summary.items.push(item);
                progress(summary.examined, summary.examined);
            }
            if !full {
                break;
            }
        }
        Ok(())
    }

    /// Everything the provider says about an attempt, asked with no
    /// transaction open: a strongly consistent read where the provider
    /// offers one (GET by id; the list by creation time over the attempt's
    /// window; the list of the charge's refunds), else its search, plus
    /// what a stale worker kept of the provider's answer to this attempt's
    /// own key. `replay_follows`: whether a replay of the attempt's key
    /// follows this read before anything is decided ([`Reconciler::window`]).
    async fn ask(
        &self,
        attempt: &AttemptRow,
        operation: Operation,
        payment: &PaymentRow,
        replay_follows: bool,
    ) -> Result<Answer, QueryError> {
        let by_id = |id: &str| {
            let id = id.to_owned();
            async move {
                self.provider.get_charge(&id).await.map(|c| Answer {
                    found: c.into_iter().collect(),
                    consistent: Ok(()),
                })
            }
        };
        let mut answer = match operation {
            Operation::Authorize => match &attempt.provider_ref {
                Some(id) => by_id(id).await?,
                None => {
                    let window = self.window(attempt, replay_follows);
                    match self.provider.list_charges(&attempt.reference, window).await {
                        Ok(found) => Answer {
                            found,
                            consistent: Ok(()),
                        },
                        // The search may still find the charge: evidence
                        // like any other, never proof that there is none.
                        Err(listing) => Answer {
                            found: self.provider.search_charges(&attempt.reference).await?,
                            consistent: Err(listing.to_string()),
                        },
                    }
                }
            },
            Operation::Capture | Operation::Cancel => match &payment.provider_ref {
                Some(id) => by_id(id).await?,
                None => Answer {
                    found: Vec::new(),
                    consistent: Err("no charge is known to ask about".into()),
                },
            },
            Operation::Refund => {
                let charge = payment.provider_ref.as_deref();
                let listed = match charge {
                    Some(charge) => self.provider.list_refunds(&attempt.reference, charge).await,
                    None => Err(QueryError("no charge is known to list refunds of".into())),
                };
                match listed {
                    Ok(found) => Answer {
                        found,
                        consistent: Ok(()),
                    },
                    Err(listing) => Answer {
                        found: self
                            .provider
                            .search_refunds(&attempt.reference, charge)
                            .await?,
                        consistent: Err(listing.to_string()),
                    },
                }
            }
        };
        let observed = self
            .store
            .observations_of_attempt_any_account(attempt.id)
            .await
            .map_err(|e| QueryError(format!("reading observations: {e}")))?;
        for (_, _, detail) in observed {
            let Ok(object) = serde_json::from_str::<ProviderObject>(&detail) else {
                continue;
            };
            if answer.found.iter().any(|o| o.id == object.id) {
                continue;
            }
            // A charge's status now beats what the stale worker heard.
            let fresh = match operation {
                Operation::Refund => None,
                _ => self.provider.get_charge(&object.id).await.ok().flatten(),
            };
            answer.found.push(fresh.unwrap_or(object));
        }
        Ok(answer)
    }

    /// The creation times a list must cover to find anything the attempt
    /// made (the provider's whole seconds, widened outwards): from its first
    /// send less the skew allowance to the last moment the provider could
    /// make an object for it. When a replay of the key follows the read
    /// (`replay_follows`), that is the moment its last send could no longer
    /// reach the provider (last send, plus the request timeout, plus the
    /// allowance): a request the provider still holds answers the replay
    /// "in progress", and one it acted on since leaves a stored answer,
    /// after which the list is read again over the replay's window. With
    /// no replay (past the key window, in review, an operator's verdict) it
    /// is the end of the last send's lifetime ([`Reconciler::outlived`]): a
    /// request held in the provider's queue makes its object when it is
    /// let through, dated then, and a list that stopped at the send's
    /// window would miss it (explorer seeds 402680 and 403916: a second
    /// charge under a new key). "No effect" is judged only from a list
    /// asked after that moment (see [`Reconciler::judge`]), so the bound
    /// hides nothing the attempt's sends could make, and keeps the list to
    /// the attempt's own window however late the reconciler asks.
    fn window(&self, attempt: &AttemptRow, replay_follows: bool) -> Window {
        let first = attempt
            .first_send_at
            .map(|t| t.0)
            .unwrap_or(attempt.created_at.0);
        let skew = to_chrono(self.config.clock_skew);
        let until = if replay_follows {
            self.closed(attempt)
        } else {
            self.outlived(attempt)
        };
        Window {
            from: (first - skew).timestamp(),
            to: Some((until + chrono::TimeDelta::seconds(1)).timestamp()),
        }
    }

    /// When the attempt's last send can no longer reach the provider: the
    /// last send (a replay counts as one), plus the request timeout for
    /// each request a send makes, plus the skew allowance. A refund's send
    /// is two requests at Stripe (it reads its PaymentIntent's charge, then
    /// posts the refund), each with its own timeout, so its refund may
    /// reach Stripe two timeouts after the send began (the books allow the
    /// same, `Books::send_reach`).
    fn closed(&self, attempt: &AttemptRow) -> DateTime<Utc> {
        let last = attempt
            .last_send_at
            .map(|t| t.0)
            .unwrap_or(attempt.created_at.0);
        let requests = if attempt.operation == Operation::Refund {
            2
        } else {
            1
        };
        last + to_chrono(self.config.request_timeout) * requests + to_chrono(self.config.clock_skew)
    }

    /// The ladder's last rung before "no effect": while the provider still
    /// keeps the attempt's key, the attempt's own call is replayed under
    /// it. A request still executing answers "in progress" (so a held or
    /// slow request is never taken for absence); one that never reached
    /// the provider executes now, once; one that ended answers what the
    /// provider stored. The replay is recorded as a send first (the
    /// attempt's last send moves, so a later proof covers it too).
    async fn replay(
        &self,
        attempt: &AttemptRow,
        payment: &PaymentRow,
        refund: Option<&RefundRow>,
        dry_run: bool,
    ) -> Result<Replay, ReconcileError> {
        // Judged again now, at the send: past the key window the provider
        // may have forgotten the key, and would charge anew.
        let now = self.clock.now();
        let call = Call::of(attempt, payment, refund);
        let Some(call) = call.filter(|_| self.replayable(attempt, payment, refund, now)) else {
            return Ok(Replay::Skipped);
        };
        if dry_run {
            return Ok(Replay::DryRun);
        }
        // Pinned to the sends the read covered: a replay by another
        // reconciler since then may have made the key's first effect, and a
        // stored answer replayed to this one would then be taken for an
        // earlier send's, which the read did cover (a second charge).
        let id = attempt.id;
        let Some(sent) = self
            .store
            .record_replay(id, attempt.send_count, now)
            .await?
        else {
            return Ok(Replay::Answered(
                Answered::Unknown(
                    "the attempt was settled or sent again meanwhile: read again next run".into(),
                ),
                attempt.clone(),
            ));
        };
        let Sent { outcome, call } = self
            .provider
            .send(&attempt.provider_key, call.mutation())
            .await;
        let stored = call.is_some_and(|c| c.replayed);
        Ok(match judge_answer(&sent, payment, refund, outcome) {
            Answered::Unknown(_) if stored => Replay::Over(sent),
            answered => Replay::Answered(answered, sent),
        })
    }

    /// Whether the attempt's own call may be replayed under its key at
    /// `now`: inside the key window (`first send + key_window`), with the
    /// payment or refund out of review (cobro sends nothing for one in
    /// review), and with a call that can be made.
    fn replayable(
        &self,
        attempt: &AttemptRow,
        payment: &PaymentRow,
        refund: Option<&RefundRow>,
        now: DateTime<Utc>,
    ) -> bool {
        let Some(key_window) = self.config.key_window else {
            return false;
        };
        let first = attempt
            .first_send_at
            .map(|t| t.0)
            .unwrap_or(attempt.created_at.0);
        let in_review = payment.status == PaymentStatus::NeedsReview
            || refund.is_some_and(|r| r.status == RefundStatus::NeedsReview);
        !in_review
            && now < first + to_chrono(key_window)
            && Call::of(attempt, payment, refund).is_some()
    }

    /// In span `reconcile.examine`, linked to the trace of the request that
    /// made the attempt (from its outbox row): a link, not a child, since
    /// one run examines many payments' attempts.
    #[tracing::instrument(
        name = "reconcile.examine",
        skip_all,
        fields(
            attempt_id = %attempt.id,
            payment_id = %attempt.payment_id,
            intent = intent_of(attempt),
            operation = %attempt.operation,
            provider = self.provider.name(),
            verdict = tracing::field::Empty,
        )
    )]
    async fn examine(
        &self,
        attempt: &AttemptRow,
        run: Option<RunId>,
        dry_run: bool,
    ) -> Result<Examined, ReconcileError> {
        if cobro_telemetry::tracing_active() {
            let (traceparent, tracestate) = self.store.trace_context_of(attempt.id).await?;
            cobro_telemetry::link_to_stored(
                &tracing::Span::current(),
                traceparent.as_deref(),
                tracestate.as_deref(),
            );
        }
        let operation = attempt.operation;
        let payment_id = attempt.payment_id;
        let payment = self
            .store
            .payment_any_account(payment_id)
            .await?
            .ok_or_else(|| StoreError::Corrupt("attempt without payment".into()))?;
        let refund = match attempt.refund_id {
            Some(r) => self.store.refund_any_account(r).await?,
            None => None,
        };
        // An attempt made before references were unique carries the bare
        // intent name, which another account may share: evidence found by
        // it proves nothing unless no other attempt has that reference.
        if !attempt.reference.contains('/')
            && self
                .store
                .attempts_with_reference(&attempt.reference)
                .await?
                > 1
        {
            let reason =
                "a legacy reference shared by several attempts: resolve by hand".to_owned();
            let ctx = Ctx {
                attempt,
                run,
                dry_run,
                said: &serde_json::Value::Null,
                now: self.clock.now(),
            };
            let verdict = self
                .undecided(&ctx, operation, &payment, refund.as_ref(), reason)
                .await?;
            return Ok(Examined {
                payment_id: payment_id.to_string(),
                attempt_id: attempt.id.to_string(),
                reference: attempt.reference.clone(),
                operation: attempt.operation.to_string(),
                provider_said: serde_json::Value::Null,
                applied: !dry_run && verdict == Verdict::Escalated,
                verdict,
            });
        }
        // An answer tells what the provider's search showed when it was
        // asked, so "not found" is judged against that moment: the answer may
        // come back late, or be read after a pause, when the lag has passed
        // for what the search did not yet show.
        let clock_off = self.clock_off().await?;
        let asked_at = self.clock.now();
        let replay_follows = self.replayable(attempt, &payment, refund.as_ref(), asked_at);
        let answer = self.ask(attempt, operation, &payment, replay_follows).await;
        let provider_said = said(&answer);
        let now = self.clock.now();
        let finding = self.judge(
            attempt,
            operation,
            &payment,
            refund.as_ref(),
            answer,
            asked_at,
            clock_off.clone(),
        );
        let ctx = Ctx {
            attempt,
            run,
            dry_run,
            said: &provider_said,
            now,
        };
        let verdict = match finding {
            Finding::Unknown(reason) => {
                self.undecided(&ctx, operation, &payment, refund.as_ref(), reason)
                    .await?
            }
            Finding::Proof(proof) => self.adopt(&ctx, &proof).await?,
            Finding::RequiresAction(provider_ref, action) => {
                self.await_customer(&ctx, &provider_ref, &action).await?
            }
            Finding::NoEffect => {
                match self
                    .replay(attempt, &payment, refund.as_ref(), dry_run)
                    .await?
                {
                    // The key window closed between the read and the
                    // replay: the read stopped at the send's window, which
                    // a request let through late can pass. The next run
                    // reads to the end of the request's lifetime.
                    Replay::Skipped if replay_follows => {
                        let reason = "not found by the consistent read, and the key window closed before the key could be replayed: read again over the request's lifetime".to_owned();
                        self.undecided(&ctx, operation, &payment, refund.as_ref(), reason)
                            .await?
                    }
                    // No replay asked the provider whether a request under
                    // the key is still queued: the read proves absence only
                    // past the last send's lifetime.
                    Replay::Skipped if asked_at < self.outlived(attempt) => {
                        let reason = format!(
                            "not found by the consistent read, but a request sent under its key may still be acted on until {} (the provider's request lifetime), and no replay of the key was possible",
                            self.outlived(attempt).to_rfc3339()
                        );
                        self.undecided(&ctx, operation, &payment, refund.as_ref(), reason)
                            .await?
                    }
                    Replay::Skipped => self.no_effect(&ctx, operation).await?,
                    // Inside the key window a real run replays the key
                    // first, and no replay's answer is "no effect".
                    Replay::DryRun => Verdict::StillUnknown {
                        reason: "not found; a real run replays the key first".into(),
                    },
                    // The key holds a stored indeterminate answer (a 5xx
                    // Stripe saved): whatever made it ran before this
                    // replay returned, perhaps after the read above (a
                    // request that read covered, held at the provider and
                    // run late; another reconciler's replay). Read again,
                    // over the replay's window, to adopt what it made. But
                    // nothing found is no proof: the provider documents
                    // such an answer as indeterminate and may still
                    // complete the request by itself while it keeps the
                    // key, which no replay would see. The attempt stays
                    // unknown until the request's lifetime is over (past
                    // the key window, with no replay) or the horizon.
                    Replay::Over(sent) => {
                        let again = self.ask(&sent, operation, &payment, true).await;
                        let said_again = said(&again);
                        let asked_again = self.clock.now();
                        let ctx = Ctx {
                            attempt: &sent,
                            said: &said_again,
                            ..ctx
                        };
                        match self.judge(
                            attempt,
                            operation,
                            &payment,
                            refund.as_ref(),
                            again,
                            asked_again,
                            clock_off,
                        ) {
                            Finding::NoEffect => {
                                let reason = format!(
                                    "not found, but the provider saved an indeterminate answer (a 5xx) under the key and may still complete the request while it keeps the key, until {}",
                                    self.outlived(&sent).to_rfc3339()
                                );
                                self.undecided(&ctx, operation, &payment, refund.as_ref(), reason)
                                    .await?
                            }
                            Finding::Proof(proof) => self.adopt(&ctx, &proof).await?,
                            Finding::RequiresAction(provider_ref, action) => {
                                self.await_customer(&ctx, &provider_ref, &action).await?
                            }
                            Finding::Conflict(kind, detail) => {
                                self.conflict(&ctx, kind, &detail).await?
                            }
                            Finding::Unknown(reason) => {
                                self.undecided(&ctx, operation, &payment, refund.as_ref(), reason)
                                    .await?
                            }
                        }
                    }
                    Replay::Answered(answered, sent) => {
                        self.replayed(&ctx, &sent, answered, operation, &payment, refund.as_ref())
                            .await?
                    }
                }
            }
            Finding::Conflict(kind, detail) => self.conflict(&ctx, kind, &detail).await?,
        };
        tracing::Span::current().record("verdict", verdict.name());
        if !dry_run {
            cobro_telemetry::metrics::reconcile_verdict(verdict.name());
        }
        tracing::info!(attempt_id = %attempt.id, reference = %attempt.reference, ?verdict, dry_run, "reconcile.decide");
        Ok(Examined {
            payment_id: payment_id.to_string(),
            attempt_id: attempt.id.to_string(),
            reference: attempt.reference.clone(),
            operation: attempt.operation.to_string(),
            provider_said,
            applied: !dry_run
                && !matches!(
                    verdict,
                    Verdict::StillUnknown { .. } | Verdict::AlreadySettled | Verdict::Error { .. }
                ),
            verdict,
        })
    }

    /// What the provider's answer, asked for at `asked_at`, proves. Pure:
    /// no IO. Only objects that provably belong to the attempt count
    /// ([`fit`]); one under its identity with other terms, or several, is a
    /// conflict. `clock_off`: why this host's clock may not judge a window
    /// now ([`Reconciler::clock_off`]), which turns "no effect" into unknown.
    #[allow(clippy::too_many_arguments)]
    fn judge(
        &self,
        attempt: &AttemptRow,
        operation: Operation,
        payment: &PaymentRow,
        refund: Option<&RefundRow>,
        answer: Result<Answer, QueryError>,
        asked_at: DateTime<Utc>,
        clock_off: Option<String>,
    ) -> Finding {
        let Answer { found, consistent } = match answer {
            Ok(answer) => answer,
            Err(e) => {
                return Finding::Unknown(format!(
                    "the provider query failed, which proves nothing: {e}"
                ));
            }
        };
        let mut ours = Vec::new();
        // For a capture or void, a charge still authorized (or a
        // PaymentIntent still open) is no effect yet: like "not found", it
        // proves no effect only by the rules below.
        let not_yet = |o: &ProviderObject| not_done_yet(operation, o);
        for object in found.iter().filter(|o| !not_yet(o)) {
            match fit(operation, attempt, payment, refund, object) {
                Fit::Ours => ours.push(object),
                Fit::Mismatch(why) => {
                    return Finding::Conflict(
                        ConflictKind::Mismatch,
                        format!("{}: {why}", object.id),
                    );
                }
                Fit::NotOurs(why) => {
                    tracing::debug!(object = %object.id, why, "not this attempt's object");
                }
            }
        }
        let proofs: Vec<Proof> = ours
            .iter()
            .filter_map(|o| proof_from(operation, o))
            .collect();
        let moved_money = |p: &&Proof| matches!(p, Proof::Succeeded { .. });
        if matches!(operation, Operation::Authorize | Operation::Refund)
            && proofs.iter().filter(moved_money).count() > 1
        {
            let ids: Vec<&str> = ours.iter().map(|o| o.id.as_str()).collect();
            return Finding::Conflict(
                ConflictKind::SeveralObjects,
                format!("several effects under one attempt: {}", ids.join(", ")),
            );
        }
        if let Some(proof) = proofs.iter().find(|p| moved_money(p)) {
            return Finding::Proof(proof.clone());
        }
        // A decline (or a void) proves the attempt ended without money only
        // if no other object under its identity may still take some: a
        // decline taken over one still in progress would end the payment,
        // or move it to another provider, while this one could still charge.
        if ours.len() > proofs.len() && !proofs.is_empty() {
            return Finding::Unknown(
                "one object of this attempt is final without money, another is still in progress"
                    .into(),
            );
        }
        if let Some(proof) = proofs.first() {
            return Finding::Proof(proof.clone());
        }
        if operation == Operation::Authorize
            && let Some(waiting) = ours
                .iter()
                .find(|o| o.status == ProviderStatus::RequiresAction)
        {
            return Finding::RequiresAction(
                waiting.id.clone(),
                waiting.next_action.clone().unwrap_or_default(),
            );
        }
        if !ours.is_empty() {
            return Finding::Unknown("the provider reports it in progress".into());
        }
        // Nothing found. That is proof of no effect only for an attempt the
        // worker no longer sends, only from a strongly consistent read (a
        // search that finds nothing proves nothing, however long ago the
        // send was), and only once its last send can no longer reach the
        // provider (request timeout plus the skew allowance): the read was
        // asked after that, so it covers everything the send could make.
        if attempt.state != AttemptState::Reconciling {
            return Finding::Unknown("not found; the worker still owns this attempt".into());
        }
        if let Err(why) = consistent {
            return Finding::Unknown(format!(
                "not found by the search, which proves nothing, and no consistent read was possible: {why}"
            ));
        }
        if asked_at < self.closed(attempt) {
            return Finding::Unknown(
                "not found, but the last send could still reach the provider when it was asked"
                    .into(),
            );
        }
        if let Some(why) = clock_off {
            return Finding::Unknown(why);
        }
        Finding::NoEffect
    }

    /// Why this host's clock may not judge a window now: farther from the
    /// database's than `max_clock_gap` (measured around one round trip,
    /// whose half counts against it). `None`: within the bound, or none set.
    async fn clock_off(&self) -> Result<Option<String>, ReconcileError> {
        let Some(max) = self.config.max_clock_gap else {
            return Ok(None);
        };
        let before = self.clock.now();
        let database = self.store.database_now().await?;
        let after = self.clock.now();
        let half_trip = (after - before) / 2;
        let gap = database - (before + half_trip);
        cobro_telemetry::metrics::clock_gap(gap.as_seconds_f64());
        if gap.abs() + half_trip <= to_chrono(max) {
            return Ok(None);
        }
        let why = format!(
            "not found, but this host's clock is {:.3} s off the database's clock, more than the {} s allowed: no absence is proven until the clocks agree",
            gap.as_seconds_f64(),
            max.as_secs_f64()
        );
        tracing::error!(gap_seconds = gap.as_seconds_f64(), "{why}");
        Ok(Some(why))
    }

    /// What the replay of the attempt's key proved, applied like any other
    /// finding: a proof is adopted, a conflict stops the line, nothing yet
    /// waits (and escalates at the horizon).
    async fn replayed(
        &self,
        ctx: &Ctx<'_>,
        sent: &AttemptRow,
        answered: Answered,
        operation: Operation,
        payment: &PaymentRow,
        refund: Option<&RefundRow>,
    ) -> Result<Verdict, ReconcileError> {
        let (said, reason) = match &answered {
            Answered::Proof(_, said)
            | Answered::Conflict(_, said)
            | Answered::RequiresAction { said, .. } => (said.clone(), None),
            Answered::NotSent(why)
            | Answered::NotConnected(why)
            | Answered::Unknown(why)
            | Answered::InProgress(why) => (String::new(), Some(why.clone())),
        };
        let said = serde_json::json!({ "replayed_key": said, "before": ctx.said });
        let ctx = Ctx {
            attempt: sent,
            said: &said,
            ..*ctx
        };
        match answered {
            Answered::Proof(proof, _) => self.adopt(&ctx, &proof).await,
            Answered::Conflict(why, _) => self.conflict(&ctx, ConflictKind::Mismatch, &why).await,
            Answered::RequiresAction {
                provider_ref,
                action,
                ..
            } => self.await_customer(&ctx, &provider_ref, &action).await,
            Answered::NotSent(_)
            | Answered::NotConnected(_)
            | Answered::Unknown(_)
            | Answered::InProgress(_) => {
                let reason = format!(
                    "not found by the consistent read, but the replay of its key proves nothing yet: {}",
                    reason.unwrap_or_default()
                );
                if self.past_horizon(sent, ctx.now) {
                    self.escalate(&ctx, operation, payment, refund, &reason)
                        .await
                } else {
                    Ok(Verdict::StillUnknown { reason })
                }
            }
        }
    }

    /// Still unknown; needs review once past the horizon.
    async fn undecided(
        &self,
        ctx: &Ctx<'_>,
        operation: Operation,
        payment: &PaymentRow,
        refund: Option<&RefundRow>,
        reason: String,
    ) -> Result<Verdict, ReconcileError> {
        if self.past_horizon(ctx.attempt, ctx.now) {
            self.escalate(ctx, operation, payment, refund, &reason)
                .await
        } else {
            Ok(Verdict::StillUnknown { reason })
        }
    }

    /// When no request sent under the attempt's key can be acted on any
    /// more: its window's close plus the provider's request lifetime.
    fn outlived(&self, attempt: &AttemptRow) -> DateTime<Utc> {
        self.closed(attempt) + to_chrono(self.config.request_lifetime)
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
        decision: Decision,
        reason: Option<String>,
    ) -> NewDecision {
        let Ctx {
            attempt, run, said, ..
        } = *ctx;
        NewDecision {
            run_id: run,
            payment: attempt.payment_id,
            refund: attempt.refund_id,
            attempt: Some(attempt.id),
            state_before: before.to_owned(),
            state_after: after.to_owned(),
            provider_said: said.to_string(),
            decision,
            actor: self.config.actor.clone(),
            reason,
        }
    }

    async fn adopt(&self, ctx: &Ctx<'_>, proof: &Proof) -> Result<Verdict, ReconcileError> {
        let said = ctx.said.to_string();
        let source = Source {
            name: &self.config.actor,
            said: &said,
        };
        let mut tx = self.store.begin().await?;
        let verdict = match apply_proof(&mut tx, ctx.attempt, proof, &source, ctx.now).await? {
            Applied::Settled { before, after } => {
                let d = self.decision(ctx, &before, &after, proof.decision(), None);
                tx.record_decision(&d, ctx.now).await?;
                Verdict::Resolved {
                    outcome: proof.outcome().into(),
                }
            }
            Applied::Conflict { kind, detail } => Verdict::Conflict {
                kind: kind.as_str().into(),
                detail,
            },
            Applied::AlreadySettled => {
                tx.rollback().await?;
                return Ok(Verdict::AlreadySettled);
            }
        };
        finish(tx, ctx.dry_run).await?;
        Ok(verdict)
    }

    /// The attempt's own object waits for its customer: recorded like the
    /// worker records that answer ([`cobro_settle::await_customer`]).
    async fn await_customer(
        &self,
        ctx: &Ctx<'_>,
        provider_ref: &str,
        action: &NextAction,
    ) -> Result<Verdict, ReconcileError> {
        let mut tx = self.store.begin().await?;
        let expires_at = ctx.now + to_chrono(self.config.action_expiry);
        let verdict = match await_customer(
            &mut tx,
            ctx.attempt,
            provider_ref,
            action,
            expires_at,
            ctx.now,
        )
        .await?
        {
            Applied::AlreadySettled => {
                tx.rollback().await?;
                return Ok(Verdict::AlreadySettled);
            }
            _ => Verdict::Resolved {
                outcome: "requires_action".into(),
            },
        };
        finish(tx, ctx.dry_run).await?;
        Ok(verdict)
    }

    async fn conflict(
        &self,
        ctx: &Ctx<'_>,
        kind: ConflictKind,
        detail: &str,
    ) -> Result<Verdict, ReconcileError> {
        let said = ctx.said.to_string();
        let source = Source {
            name: &self.config.actor,
            said: &said,
        };
        let payment = ctx.attempt.payment_id;
        let mut tx = self.store.begin().await?;
        let current = tx
            .lock_payment_any_account(payment)
            .await?
            .ok_or_else(|| StoreError::Corrupt("missing payment".into()))?;
        // The same finding again: kept once. A new finding on a payment
        // already in review is kept too (the operator must see it).
        let attempt_id = ctx.attempt.id;
        if tx.conflict_is_open(attempt_id, kind, detail).await? {
            tx.rollback().await?;
            return Ok(Verdict::Conflict {
                kind: kind.as_str().into(),
                detail: detail.to_owned(),
            });
        }
        stop_the_line(
            &mut tx,
            Some(ctx.attempt),
            Some(payment),
            kind,
            detail,
            &source,
            ctx.now,
        )
        .await?;
        let d = self.decision(
            ctx,
            current.status.as_str(),
            PaymentStatus::NeedsReview.as_str(),
            Decision::Conflict,
            Some(detail.to_owned()),
        );
        tx.record_decision(&d, ctx.now).await?;
        finish(tx, ctx.dry_run).await?;
        Ok(Verdict::Conflict {
            kind: kind.as_str().into(),
            detail: detail.to_owned(),
        })
    }

    /// Proof of no effect, applied pinned to the state and last send the
    /// reconciler read; whatever it enables (a new attempt with a new key)
    /// is written only if the compare-and-set of the state it depends on
    /// succeeds, in the same transaction.
    async fn no_effect(
        &self,
        ctx: &Ctx<'_>,
        operation: Operation,
    ) -> Result<Verdict, ReconcileError> {
        let Ctx {
            attempt,
            dry_run,
            now,
            ..
        } = *ctx;
        let payment_id = attempt.payment_id;
        let refund_id = attempt.refund_id;
        let mut tx = self.store.begin().await?;
        // Lock order: the payment row, then the attempt.
        tx.lock_payment_any_account(payment_id).await?;
        if !tx
            .resolve_no_effect(attempt.id, attempt.last_send_at.map(|t| t.0), now)
            .await?
        {
            tx.rollback().await?;
            return Ok(Verdict::AlreadySettled);
        }
        let payment = tx
            .lock_payment_any_account(payment_id)
            .await?
            .ok_or_else(|| StoreError::Corrupt("missing payment".into()))?;
        let before = payment.status;
        let refund_status = match refund_id {
            Some(r) => tx.refund_any_account(r).await?.map(|r| r.status),
            None => None,
        };
        let in_review = before == PaymentStatus::NeedsReview
            || refund_status == Some(RefundStatus::NeedsReview);
        // Money the provider showed for another attempt of this refund (a
        // late effect, kept as a conflict) is this refund's: failing the
        // refund would release its amount to be refunded again.
        let kept_effect = operation == Operation::Refund
            && tx
                .open_conflict_of_attempt(attempt.id, ConflictKind::EffectAfterNoEffect)
                .await?
                .is_some();
        let (verdict, after, name) = if let (true, Operation::Refund, Some(r), Some(from), false) =
            (in_review, operation, refund_id, refund_status, kept_effect)
        {
            // A refund proven without effect while it (or its payment) is
            // in review is failed: nothing is sent, and its reservation is
            // released, so the payment can be refunded again (a refund
            // left in review would hold its amount for ever).
            tx.settle_refund(
                r,
                from,
                RefundStatus::Failed,
                None,
                Some((
                    "no_effect_at_provider",
                    "the provider has no record of this refund; refund again if it is still owed",
                )),
                now,
            )
            .await?;
            (Verdict::FailedNoEffect, before, Decision::NoEffectFail)
        } else if in_review
            && operation == Operation::Cancel
            && payment.next_action.is_some()
            && awaiting_customer(&mut tx, payment_id).await?.is_some()
            && let Some(after) = cancel_while_open(&mut tx, &payment, None, now).await?
        {
            // The cancel of a PaymentIntent that never held money, escalated
            // and now proven without effect: the customer may still confirm
            // it, so it goes out again (a new intent), unless the payment
            // is stopped for conflicting evidence (an operator decides).
            (Verdict::Retried, after, Decision::NoEffectRetry)
        } else if in_review {
            // Recorded, nothing enabled: needs_review blocks every new send.
            (
                Verdict::NoEffectInReview,
                before,
                Decision::NoEffectInReview,
            )
        } else if self.config.retry_on_no_effect
            || (operation == Operation::Cancel
                && payment.next_action.is_some()
                && awaiting_customer(&mut tx, payment_id).await?.is_some())
        {
            // (A cancel of a PaymentIntent that never held money moves
            // none: it is sent again whatever the policy, since "refused"
            // would show the payment `authorized`.)
            // The state the new attempt depends on moves first; zero rows
            // means nothing is created.
            let moved = match operation {
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
                Operation::Refund => match refund_id {
                    Some(r) => tx
                        .settle_refund(
                            r,
                            RefundStatus::RequiresReconciliation,
                            RefundStatus::Processing,
                            None,
                            None,
                            now,
                        )
                        .await?
                        .map(|_| before),
                    None => None,
                },
                Operation::Capture | Operation::Cancel => {
                    let waiting = if operation == Operation::Capture {
                        PaymentStatus::Capturing
                    } else {
                        PaymentStatus::Canceling
                    };
                    (before == waiting).then_some(before)
                }
            };
            let Some(after) = moved else {
                tx.rollback().await?;
                return Ok(Verdict::AlreadySettled);
            };
            // An authorisation moves on to the next provider of its
            // route when it has one (docs/routing.md); the circuits are
            // that provider's worker's to consult.
            let rerouted = if operation == Operation::Authorize {
                let proof = (NoEffectProof::NoEffect, "not found by a consistent read");
                fail_over(&mut tx, attempt, &payment, proof, &BTreeSet::new(), now).await?
            } else {
                None
            };
            if let Some(to) = rerouted {
                let d = self.decision(
                    ctx,
                    before.as_str(),
                    after.as_str(),
                    Decision::NoEffectRetry,
                    Some(format!(
                        "not found by a consistent read covering the attempt's window; \
                         moved to provider {to}"
                    )),
                );
                tx.record_decision(&d, now).await?;
                finish(tx, dry_run).await?;
                return Ok(Verdict::Retried);
            }
            // A new attempt of the same intent, under a NEW provider key:
            // the old one is proven to have done nothing.
            let id = AttemptId::new();
            tx.enqueue_attempt(
                &NewAttempt {
                    id,
                    intent: attempt.intent_id,
                    payment: payment_id,
                    refund: refund_id,
                    operation,
                    provider_key: uuid::Uuid::new_v4().to_string(),
                    reference: cobro_core::attempt_reference(intent_of(attempt), id),
                },
                now,
                now,
            )
            .await?;
            (Verdict::Retried, after, Decision::NoEffectRetry)
        } else {
            let failure = (
                "no_effect_at_provider".to_owned(),
                "the provider has no record of this attempt; not retried by policy".to_owned(),
            );
            let event = match operation {
                Operation::Authorize => Some(PaymentEvent::Failed),
                Operation::Capture => Some(PaymentEvent::CaptureRefused),
                Operation::Cancel => Some(PaymentEvent::VoidRefused),
                Operation::Refund => None,
            };
            let after = match event {
                Some(event) => {
                    let after = self
                        .move_payment(&mut tx, payment_id, before, event, Some(failure), now)
                        .await?
                        .unwrap_or(before);
                    if operation == Operation::Authorize && after == PaymentStatus::Failed {
                        let failed = tx
                            .lock_payment_any_account(payment_id)
                            .await?
                            .ok_or_else(|| StoreError::Corrupt("missing payment".into()))?;
                        settle_held_cancels(&mut tx, &failed, after, now).await?;
                    }
                    after
                }
                None => {
                    if let (Some(r), Some(from)) = (refund_id, refund_status) {
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
            (Verdict::FailedNoEffect, after, Decision::NoEffectFail)
        };
        let d = self.decision(
            ctx,
            before.as_str(),
            after.as_str(),
            name,
            Some("not found by a consistent read covering the attempt's window".into()),
        );
        tx.record_decision(&d, now).await?;
        finish(tx, dry_run).await?;
        Ok(verdict)
    }

    /// Moves the payment by `event` with a compare-and-set; `None` when the
    /// event does not apply to its state or the state moved.
    async fn move_payment(
        &self,
        tx: &mut WriteTx,
        id: PaymentId,
        from: PaymentStatus,
        event: PaymentEvent,
        failure: Option<(String, String)>,
        now: DateTime<Utc>,
    ) -> Result<Option<PaymentStatus>, ReconcileError> {
        let Ok(to) = from.apply(event) else {
            return Ok(None);
        };
        let outcome = PaymentOutcome {
            failure,
            ..Default::default()
        };
        Ok(tx
            .settle_payment(id, from, to, &outcome, now)
            .await?
            .map(|_| to))
    }

    /// Past the horizon: the payment (authorisation, capture, void) or the
    /// refund goes to `needs_review`, once; later runs find it there and
    /// write nothing more.
    async fn escalate(
        &self,
        ctx: &Ctx<'_>,
        operation: Operation,
        payment: &PaymentRow,
        refund: Option<&RefundRow>,
        reason: &str,
    ) -> Result<Verdict, ReconcileError> {
        let Ctx {
            attempt,
            dry_run,
            now,
            ..
        } = *ctx;
        let mut tx = self.store.begin().await?;
        // Lock order: the payment row first, as everywhere.
        tx.lock_payment_any_account(payment.id).await?;
        let (before, after) = if operation == Operation::Refund {
            let Some(refund) = refund else {
                tx.rollback().await?;
                return Ok(Verdict::Escalated);
            };
            let from = refund.status;
            if from == RefundStatus::NeedsReview {
                tx.rollback().await?;
                return Ok(Verdict::Escalated);
            }
            let moved = tx
                .settle_refund(refund.id, from, RefundStatus::NeedsReview, None, None, now)
                .await?;
            if moved.is_none() {
                tx.rollback().await?;
                return Ok(Verdict::AlreadySettled);
            }
            (
                from.as_str().to_owned(),
                RefundStatus::NeedsReview.as_str().to_owned(),
            )
        } else {
            let before = payment.status;
            if before == PaymentStatus::NeedsReview {
                tx.rollback().await?;
                return Ok(Verdict::Escalated);
            }
            // A decline waiting for its PaymentIntent's cancel keeps its
            // code through the review (only such a payment: anywhere else
            // a review shows no failure, as it always did).
            let kept = payment
                .failure_code
                .clone()
                .zip(payment.failure_message.clone())
                .filter(|_| before == PaymentStatus::Canceling && payment.next_action.is_some());
            let Some(after) = self
                .move_payment(
                    &mut tx,
                    payment.id,
                    before,
                    PaymentEvent::Escalated,
                    kept,
                    now,
                )
                .await?
            else {
                tx.rollback().await?;
                return Ok(Verdict::StillUnknown {
                    reason: format!("past the horizon, and {before} cannot be escalated: {reason}"),
                });
            };
            tx.set_review_reason(
                payment.id,
                &format!("unresolved past the horizon: {reason}"),
            )
            .await?;
            (before.as_str().to_owned(), after.as_str().to_owned())
        };
        let d = self.decision(
            ctx,
            &before,
            &after,
            Decision::Escalate,
            Some(reason.to_owned()),
        );
        tx.record_decision(&d, now).await?;
        finish(tx, dry_run).await?;
        tracing::warn!(payment_id = %attempt.payment_id, reference = %attempt.reference, "unresolved past the horizon: needs_review");
        Ok(Verdict::Escalated)
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
