//! The outbox worker: claims due attempts, sends them to the provider under
//! their stored provider idempotency key, and records what it learned.
//!
//! Per attempt the database work is one fenced claim, one fenced "sent"
//! mark before the call, and one completing transaction after it; no
//! transaction is open while the provider is being called.

use crate::retry::{RetryBudget, backoff};
use chrono::{DateTime, Utc};
use cobro_core::{AttemptState, Clock, Operation};
use cobro_provider::{CallInfo, Outcome, Provider, Sent};
use cobro_settle::call::{Answered, Call, judge_answer};
use cobro_settle::routing::{CallHealth, CircuitState, Circuits, NoEffectProof, fail_over};
use cobro_settle::{Source, apply_proof, await_customer, hand_to_reconciler, stop_the_line};
use cobro_store::conflicts::ConflictKind;
use cobro_store::{
    Claim, PaymentRow, ProviderScope, RefundRow, SendMark, Store, StoreError, UnreadableClaim,
    WriteTx,
};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tokio::sync::{Notify, Semaphore, watch};
use tokio::task::JoinSet;

/// How often a worker without a LISTEN connection tries to make one.
const LISTEN_RETRY: Duration = Duration::from_secs(5);

#[derive(Clone, Debug)]
pub struct WorkerConfig {
    /// Identifies this worker in lease columns and logs.
    pub owner: String,
    /// How long a claim is ours without a heartbeat.
    pub lease: Duration,
    /// How often the lease is renewed while a call is in flight (lease = 3x).
    pub heartbeat: Duration,
    /// Rows taken by one claim statement.
    pub batch: u32,
    /// Provider calls in flight at once, per process.
    pub max_in_flight: usize,
    /// Fallback poll when no wake-up arrives.
    pub poll_interval: Duration,
    /// How long the provider remembers an idempotency key.
    pub key_retention: Duration,
    /// No send happens later than `first send + key_retention - safety_margin`:
    /// past that the provider could take the same key as a new charge.
    pub safety_margin: Duration,
    pub backoff_base: Duration,
    pub backoff_cap: Duration,
    /// Retries earned per first send.
    pub retry_ratio: f64,
    /// Retries earned per second of time (the budget's refill with time).
    pub retry_per_second: f64,
    /// The most retries the budget holds (it starts full).
    pub retry_max: f64,
    /// How long a row whose payment is under reconciliation or review
    /// waits before the worker looks at it again.
    pub blocked_recheck: Duration,
    /// Whose attempts this worker claims: one configured provider's (each
    /// provider has its own worker, key window and retry budget), or every
    /// provider's (`None`, for a single-provider setup and tests).
    pub provider: Option<ProviderScope>,
    /// How long a payment waits for its customer to authenticate (3-D
    /// Secure) before it is canceled as abandoned (default one hour).
    pub action_expiry: Duration,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        Self {
            owner: format!(
                "worker-{}-{}",
                std::process::id(),
                &uuid::Uuid::new_v4().simple().to_string()[..8]
            ),
            lease: Duration::from_secs(30),
            heartbeat: Duration::from_secs(10),
            batch: 16,
            max_in_flight: 32,
            poll_interval: Duration::from_secs(1),
            key_retention: Duration::from_secs(24 * 3600),
            safety_margin: Duration::from_secs(3600),
            backoff_base: Duration::from_millis(200),
            backoff_cap: Duration::from_secs(60),
            retry_ratio: 0.2,
            retry_per_second: 5.0,
            retry_max: 50.0,
            blocked_recheck: Duration::from_secs(60),
            provider: None,
            action_expiry: Duration::from_secs(3600),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// What processing one claim came to (for logs, metrics and tests).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// The provider's answer was recorded (`class` is the outcome class).
    Recorded { class: &'static str },
    /// Retried later with the same key.
    Rescheduled { class: &'static str },
    /// Handed to the reconciler (window closing, or unknown too long).
    HandedOver,
    /// The lease was lost: nothing was written over the new owner.
    LeaseLost,
    /// The retry budget is spent: the retry waits.
    BudgetWait,
    /// Nothing to do (the attempt was already settled).
    Skipped,
    /// Released unsent because the worker is shutting down.
    Released,
    /// Not sent: the payment or refund is under reconciliation or review.
    Blocked,
    /// The answer carried this attempt's identity but not what it asked
    /// for: kept as a conflict, the payment is in `needs_review`.
    Conflict,
    /// The payment moved to the next provider of its route: its attempt
    /// here is proven without effect (`proof`), and a new attempt waits
    /// at `to`.
    Rerouted { proof: &'static str, to: String },
    /// The claimed row's attempt could not be read (a stored value no
    /// known variant matches): reported, not sent, left leased, so it is
    /// reported again when the lease expires and never sent while unreadable.
    Unreadable,
}

pub struct Worker<P: Provider> {
    store: Store,
    provider: Arc<P>,
    clock: Arc<dyn Clock>,
    config: WorkerConfig,
    budget: RetryBudget,
    wake: Arc<Notify>,
    slots: Arc<Semaphore>,
    stopping: AtomicBool,
    /// Routing across providers (docs/routing.md): the circuits this
    /// worker reports its calls to and consults before a send. `None`: no
    /// routing (a payment stays at its provider).
    circuits: Option<Arc<Circuits>>,
}

/// Logs a leased row whose attempt could not be read. It is not released:
/// released, it would be claimed again at once, in a loop; leased, it comes
/// back once per lease period, the rest of its batch unaffected.
fn report_unreadable(bad: &UnreadableClaim) -> Step {
    tracing::error!(
        outbox_id = %bad.outbox_id,
        attempt_id = %bad.attempt.id,
        payment_id = %bad.attempt.payment_id,
        lease_token = bad.token,
        error = %bad.attempt.error,
        "claimed an outbox row whose attempt cannot be read; not sent, left leased"
    );
    Step::Unreadable
}

fn to_chrono(d: Duration) -> chrono::Duration {
    chrono::Duration::from_std(d).unwrap_or(chrono::Duration::MAX)
}

/// What the answer will be checked against.
struct Asked {
    payment: PaymentRow,
    refund: Option<RefundRow>,
}

impl<P: Provider> Worker<P> {
    pub fn new(
        store: Store,
        provider: Arc<P>,
        clock: Arc<dyn Clock>,
        config: WorkerConfig,
        wake: Arc<Notify>,
    ) -> Self {
        Self {
            budget: RetryBudget::new(
                config.retry_ratio,
                config.retry_per_second,
                config.retry_max,
            ),
            slots: Arc::new(Semaphore::new(config.max_in_flight.max(1))),
            store,
            provider,
            clock,
            config,
            wake,
            stopping: AtomicBool::new(false),
            circuits: None,
        }
    }

    /// Reports every call to `circuits` and moves payments along their
    /// route on proof of no effect.
    pub fn with_circuits(mut self, circuits: Arc<Circuits>) -> Self {
        self.circuits = Some(circuits);
        self
    }

    pub fn config(&self) -> &WorkerConfig {
        &self.config
    }

    /// The last instant at which an attempt first sent at `first` may be sent.
    fn send_deadline(&self, first: DateTime<Utc>) -> DateTime<Utc> {
        first + to_chrono(self.config.key_retention) - to_chrono(self.config.safety_margin)
    }

    /// Claims one batch and processes it to the end: the deterministic unit
    /// tests drive. Returns the step of every claimed row.
    pub async fn run_once(self: &Arc<Self>) -> Result<Vec<Step>, WorkerError> {
        let now = self.clock.now();
        let claimed = self
            .store
            .claim_due_for(
                &self.config.owner,
                now,
                now + to_chrono(self.config.lease),
                self.config.batch,
                self.config.provider.as_ref(),
            )
            .await?;
        let mut steps: Vec<Step> = claimed.unreadable.iter().map(report_unreadable).collect();
        let mut set = JoinSet::new();
        for claim in claimed.claims {
            let me = Arc::clone(self);
            set.spawn(async move { me.process(claim).await });
        }
        while let Some(done) = set.join_next().await {
            match done {
                Ok(Ok(step)) => steps.push(step),
                Ok(Err(e)) => return Err(e),
                Err(join) => tracing::error!(error = %join, "worker task panicked"),
            }
        }
        Ok(steps)
    }

    /// Runs until `shutdown` turns true: claims while there are free call
    /// slots, sleeps on a wake-up (in-process signal, PostgreSQL NOTIFY) or
    /// the poll interval. On shutdown it stops claiming and lets in-flight
    /// calls finish within `grace`; rows claimed but not yet sent are
    /// released for another worker.
    pub async fn run(self: Arc<Self>, mut shutdown: watch::Receiver<bool>, grace: Duration) {
        // The LISTEN connection: (re)made when missing, at most once per
        // LISTEN_RETRY; meanwhile, and whenever it is down, the worker polls.
        let mut signal = None;
        let mut listen_at = tokio::time::Instant::now();
        let mut tasks = JoinSet::new();
        tracing::info!(owner = %self.config.owner, "worker started");
        loop {
            if *shutdown.borrow() {
                break;
            }
            if signal.is_none() && tokio::time::Instant::now() >= listen_at {
                listen_at = tokio::time::Instant::now() + LISTEN_RETRY;
                match self.store.listen_for_work().await {
                    Ok(s) => signal = s,
                    Err(e) => {
                        tracing::warn!(error = %e, "no LISTEN connection; polling until it is back")
                    }
                }
            }
            while tasks.try_join_next().is_some() {}
            let free = self
                .slots
                .available_permits()
                .min(self.config.batch as usize) as u32;
            let mut claimed = 0;
            if free > 0 {
                let now = self.clock.now();
                match self
                    .store
                    .claim_due_for(
                        &self.config.owner,
                        now,
                        now + to_chrono(self.config.lease),
                        free,
                        self.config.provider.as_ref(),
                    )
                    .await
                {
                    Ok(batch) => {
                        claimed = batch.leased();
                        for bad in &batch.unreadable {
                            report_unreadable(bad);
                        }
                        for claim in batch.claims {
                            let Ok(permit) = Arc::clone(&self.slots).acquire_owned().await else {
                                break;
                            };
                            let me = Arc::clone(&self);
                            tasks.spawn(async move {
                                let _permit = permit;
                                if let Err(e) = me.process(claim).await {
                                    tracing::error!(error = %e, "processing an outbox row failed; its lease will expire and it will be retried");
                                }
                            });
                        }
                    }
                    Err(e) => tracing::warn!(error = %e, "claim failed"),
                }
            }
            if claimed as u32 == free && free > 0 {
                continue; // more may be due right now
            }
            // `true`: the LISTEN connection broke (or its server stopped
            // answering): it is dropped and made anew, never read again.
            let lost = async {
                match signal.as_mut() {
                    Some(s) => match s.recv().await {
                        Ok(()) => false,
                        Err(e) => {
                            tracing::warn!(error = %e, "LISTEN connection lost; polling until it is back");
                            true
                        }
                    },
                    None => std::future::pending::<bool>().await,
                }
            };
            let lost = tokio::select! {
                _ = shutdown.changed() => false,
                _ = self.wake.notified() => false,
                lost = lost => lost,
                _ = tokio::time::sleep(self.config.poll_interval) => false,
                Some(_) = tasks.join_next(), if free == 0 => false,
            };
            if lost {
                signal = None;
            }
        }
        self.stopping.store(true, Ordering::SeqCst);
        tracing::info!(
            in_flight = tasks.len(),
            "worker stopping: letting in-flight calls finish"
        );
        if tokio::time::timeout(grace, async { while tasks.join_next().await.is_some() {} })
            .await
            .is_err()
        {
            tracing::warn!(
                "grace period over with calls in flight; their leases will expire and they will be retried with the same key"
            );
            tasks.abort_all();
        }
    }

    /// Processes one claim in span `worker.process`, a child of the span
    /// that enqueued the row (the client's request, kept in the outbox
    /// row): a payment's work is one trace however long the row waited.
    /// Each claim of the row is one such span, so retries show in the
    /// payment's trace too.
    async fn process(&self, claim: Claim) -> Result<Step, WorkerError> {
        let attempt = &claim.attempt;
        let span = tracing::info_span!(
            "worker.process",
            attempt_id = %attempt.id,
            payment_id = %attempt.payment_id,
            intent = attempt.intent_name(),
            operation = %attempt.operation,
            provider = self.provider.name(),
            send_count = attempt.send_count,
            lease_token = claim.token,
            owner = %self.config.owner,
            step = tracing::field::Empty,
        );
        cobro_telemetry::set_parent_from_stored(
            &span,
            claim.traceparent.as_deref(),
            claim.tracestate.as_deref(),
        );
        let step = tracing::Instrument::instrument(self.process_claim(claim), span.clone()).await;
        if let Ok(step) = &step {
            span.record("step", tracing::field::debug(step));
            match step {
                Step::LeaseLost => cobro_telemetry::metrics::lease_lost(),
                Step::BudgetWait => cobro_telemetry::metrics::retry_budget_exhausted(),
                Step::HandedOver => cobro_telemetry::metrics::handed_over(),
                _ => {}
            }
        }
        step
    }

    async fn process_claim(&self, claim: Claim) -> Result<Step, WorkerError> {
        let attempt = &claim.attempt;
        let state = attempt.state;
        let now = self.clock.now();
        if !matches!(state, AttemptState::Pending | AttemptState::Unknown) {
            let mut tx = self.store.begin().await?;
            tx.finish_outbox(claim.outbox_id, claim.token, now).await?;
            tx.commit().await?;
            return Ok(Step::Skipped);
        }
        if let Some(first) = attempt.first_send_at
            && now >= self.send_deadline(first.0)
        {
            return self
                .hand_over(&claim, "provider key window closing", None)
                .await;
        }
        let (call, asked) = match self.prepare(&claim).await? {
            Ok(prepared) => prepared,
            Err((reason, asked)) => {
                let failed = Outcome::Failed {
                    code: "cannot_send".into(),
                    message: reason,
                    object: None,
                };
                return self.record(&claim, &asked, failed, None).await;
            }
        };
        if self.stopping.load(Ordering::SeqCst) {
            return self
                .reschedule(&claim, now, "released at shutdown", None)
                .await
                .map(|_| Step::Released);
        }
        if let Some(step) = self.leave_open_circuit(&claim, &asked).await? {
            return Ok(step);
        }
        if attempt.send_count > 0 {
            if !self.budget.try_retry(now) {
                let wait = backoff(
                    self.config.backoff_base,
                    self.config.backoff_cap,
                    attempt.send_count as u32,
                )
                .max(self.budget.next_token_in());
                self.reschedule(&claim, now + to_chrono(wait), "retry budget spent", None)
                    .await?;
                return Ok(Step::BudgetWait);
            }
        } else {
            self.budget.on_first_send();
        }
        // Fenced, and the schema's last word: a lost lease, an attempt
        // settled meanwhile, or a payment under reconciliation or review
        // stops the send before it happens.
        match self.store.record_send(&claim, now).await? {
            SendMark::Marked if attempt.send_count > 0 => {
                cobro_telemetry::metrics::retry(attempt.operation.verb())
            }
            SendMark::Marked => {}
            SendMark::LeaseLost => return Ok(Step::LeaseLost),
            SendMark::Settled => {
                let mut tx = self.store.begin().await?;
                tx.finish_outbox(claim.outbox_id, claim.token, now).await?;
                tx.commit().await?;
                return Ok(Step::Skipped);
            }
            SendMark::Blocked => {
                let due = now + to_chrono(self.config.blocked_recheck);
                self.reschedule(&claim, due, "payment under reconciliation or review", None)
                    .await?;
                return Ok(Step::Blocked);
            }
        }
        let heartbeat = Heartbeat::start(self, &claim);
        let started = std::time::Instant::now();
        let Sent { outcome, call } = self.send(call, &attempt.provider_key).await;
        // Under the heartbeat still: the lease outlives a slow report.
        self.report_call(&claim, &outcome, started.elapsed()).await;
        heartbeat.stop().await;
        tracing::info!(
            attempt_id = %attempt.id, reference = %attempt.reference, operation = %attempt.operation,
            sends = attempt.send_count + 1, class = outcome.class(),
            request_id = call.as_ref().and_then(|c| c.request_id.as_deref()),
            replayed = call.as_ref().is_some_and(|c| c.replayed),
            "provider.call"
        );
        self.record(&claim, &asked, outcome, call.as_ref()).await
    }

    /// What to send, from the stored rows, and what the answer must match.
    /// `Err(reason)`: the attempt can never be sent (a capture without a
    /// known charge).
    #[allow(clippy::type_complexity)]
    async fn prepare(
        &self,
        claim: &Claim,
    ) -> Result<Result<(Call, Asked), (String, Asked)>, WorkerError> {
        let attempt = &claim.attempt;
        let payment = self
            .store
            .payment_any_account(attempt.payment_id)
            .await?
            .ok_or_else(|| StoreError::Corrupt("attempt without payment".into()))?;
        let operation = attempt.operation;
        let refund = match attempt.refund_id {
            Some(id) => Some(
                self.store
                    .refund_any_account(id)
                    .await?
                    .ok_or_else(|| StoreError::Corrupt("missing refund".into()))?,
            ),
            None if operation == Operation::Refund => {
                return Err(StoreError::Corrupt("refund attempt without refund".into()).into());
            }
            None => None,
        };
        let call = Call::of(attempt, &payment, refund.as_ref());
        let asked = Asked { payment, refund };
        Ok(match call {
            Some(call) => Ok((call, asked)),
            None => Err(("no provider charge is known".to_owned(), asked)),
        })
    }

    async fn send(&self, call: Call, key: &str) -> Sent {
        self.provider.send(key, call.mutation()).await
    }

    /// Records an outcome in one transaction fenced by the claim's token,
    /// with what the provider said about the call (`call`: its request id,
    /// whether it replayed) in the same transaction.
    ///
    /// An unknown outcome the provider says not to retry
    /// (`Stripe-Should-Retry: false`), or one it replayed from the key's
    /// saved answers (`Idempotent-Replayed: true`: Stripe saves a 500 under
    /// the key), goes to the reconciler at once: a resend under the same
    /// key would only replay the saved answer, so only a query can tell
    /// what happened. Handing over shortens no wait on the path to "no
    /// effect": the reconciler waits out the key's lifetime whenever it
    /// was handed the attempt.
    async fn record(
        &self,
        claim: &Claim,
        asked: &Asked,
        outcome: Outcome,
        call: Option<&CallInfo>,
    ) -> Result<Step, WorkerError> {
        let now = self.clock.now();
        let class = outcome.class();
        let (proof, said) = match judge_answer(
            &claim.attempt,
            &asked.payment,
            asked.refund.as_ref(),
            outcome,
        ) {
            Answered::Proof(proof, said) => (proof, said),
            Answered::Conflict(why, said) => {
                return self.conflict(claim, asked, &why, &said, call).await;
            }
            // Nothing left cobro: the payment may move on (when every send
            // of the attempt was such a send), else the same key again.
            Answered::NotConnected(reason) => {
                if let Some(step) = self
                    .reroute(claim, asked, (NoEffectProof::NotSent, &reason), call)
                    .await?
                {
                    return Ok(step);
                }
                return self.retry_later(claim, class, &reason, call, true).await;
            }
            // The provider said it did not execute (429): the same key
            // again, never a move (an earlier try under the key may have
            // reached it through a proxy that retried).
            Answered::NotSent(reason) => {
                return self.retry_later(claim, class, &reason, call, false).await;
            }
            // Its own object, still in progress: resending the key would
            // replay the same answer for as long as the key lives, and each
            // resend would keep the attempt from ever looking stuck. The
            // reconciler reads the object until it ends.
            Answered::InProgress(reason) => {
                let reason =
                    format!("{reason}: a resend would replay it; only a query sees it end");
                return self.hand_over(claim, &reason, call).await;
            }
            // Not unknown: cobro knows exactly where it stands. The attempt
            // leaves the outbox and waits for proof of the customer's
            // outcome; it is never resent.
            Answered::RequiresAction {
                provider_ref,
                action,
                said,
            } => {
                return self
                    .await_customer(claim, &provider_ref, &action, &said, call)
                    .await;
            }
            Answered::Unknown(reason) if call.and_then(|c| c.should_retry) == Some(false) => {
                let reason = format!("{reason} (the provider says a retry would not help)");
                return self.hand_over(claim, &reason, call).await;
            }
            // The key's saved answer, replayed: every resend under the key
            // would replay it again until the key expires.
            Answered::Unknown(reason) if call.is_some_and(|c| c.replayed) => {
                let reason = format!("{reason} (a replay of the answer saved under the key)");
                return self.hand_over(claim, &reason, call).await;
            }
            Answered::Unknown(reason) => {
                return self.record_unknown(claim, &reason, now, call).await;
            }
        };
        let mut tx = self.store.begin().await?;
        if !tx.finish_outbox(claim.outbox_id, claim.token, now).await? {
            tx.rollback().await?;
            self.observe(claim, proof.outcome(), &said, now).await?;
            return Ok(Step::LeaseLost);
        }
        let source = Source {
            name: "worker",
            said: &said,
        };
        let applied = apply_proof(&mut tx, &claim.attempt, &proof, &source, now).await?;
        // After the payment's lock (taken by apply_proof): payment, then
        // attempt, as everywhere (a webhook settling it takes them so).
        note_call(&mut tx, claim, call).await?;
        tx.commit().await?;
        tracing::info!(attempt_id = %claim.attempt.id, ?applied, "outcome recorded");
        Ok(Step::Recorded { class })
    }

    /// A transaction whose first write ends the claim's outbox row, fenced
    /// by its token; `None` when the lease was lost (what the provider
    /// said, `class` and `said`, is kept as an observation instead).
    async fn finish_fenced(
        &self,
        claim: &Claim,
        class: &str,
        said: &str,
        now: DateTime<Utc>,
    ) -> Result<Option<WriteTx>, WorkerError> {
        let mut tx = self.store.begin().await?;
        if tx.finish_outbox(claim.outbox_id, claim.token, now).await? {
            return Ok(Some(tx));
        }
        tx.rollback().await?;
        self.observe(claim, class, said, now).await?;
        Ok(None)
    }

    /// The customer must act: in one transaction fenced by the claim, the
    /// outbox row ends, the attempt waits (`awaiting_customer`) and the
    /// payment moves to `requires_action` with its action and expiry.
    async fn await_customer(
        &self,
        claim: &Claim,
        provider_ref: &str,
        action: &cobro_provider::NextAction,
        said: &str,
        call: Option<&CallInfo>,
    ) -> Result<Step, WorkerError> {
        let now = self.clock.now();
        let Some(mut tx) = self
            .finish_fenced(claim, "requires_action", said, now)
            .await?
        else {
            return Ok(Step::LeaseLost);
        };
        let expires_at = now + to_chrono(self.config.action_expiry);
        let applied = await_customer(
            &mut tx,
            &claim.attempt,
            provider_ref,
            action,
            expires_at,
            now,
        )
        .await?;
        note_call(&mut tx, claim, call).await?;
        tx.commit().await?;
        tracing::info!(attempt_id = %claim.attempt.id, ?applied, "waiting for the customer");
        Ok(Step::Recorded {
            class: "requires_action",
        })
    }

    /// An answer under this attempt's identity that is not what it asked
    /// for: the attempt goes to the reconciler and the payment to
    /// `needs_review`, in one transaction fenced by the claim.
    async fn conflict(
        &self,
        claim: &Claim,
        asked: &Asked,
        why: &str,
        said: &str,
        call: Option<&CallInfo>,
    ) -> Result<Step, WorkerError> {
        let now = self.clock.now();
        let Some(mut tx) = self.finish_fenced(claim, "conflict", said, now).await? else {
            return Ok(Step::LeaseLost);
        };
        hand_to_reconciler(&mut tx, &claim.attempt, why, now).await?;
        let source = Source {
            name: "worker",
            said,
        };
        stop_the_line(
            &mut tx,
            Some(&claim.attempt),
            Some(asked.payment.id),
            ConflictKind::Mismatch,
            why,
            &source,
            now,
        )
        .await?;
        note_call(&mut tx, claim, call).await?;
        tx.commit().await?;
        Ok(Step::Conflict)
    }

    fn retry_delay(&self, claim: &Claim) -> chrono::Duration {
        to_chrono(backoff(
            self.config.backoff_base,
            self.config.backoff_cap,
            claim.attempt.send_count as u32,
        ))
    }

    /// An unknown outcome: retry with the same key while the provider still
    /// remembers it, else hand the attempt to the reconciler.
    async fn record_unknown(
        &self,
        claim: &Claim,
        reason: &str,
        now: DateTime<Utc>,
        call: Option<&CallInfo>,
    ) -> Result<Step, WorkerError> {
        let first = claim.attempt.first_send_at.map(|t| t.0).unwrap_or(now);
        let due = now + self.retry_delay(claim);
        if due >= self.send_deadline(first) {
            return self.hand_over(claim, reason, call).await;
        }
        let mut tx = self.store.begin().await?;
        if !tx
            .reschedule_outbox(claim.outbox_id, claim.token, due, now)
            .await?
        {
            tx.rollback().await?;
            self.observe(claim, "unknown", reason, now).await?;
            return Ok(Step::LeaseLost);
        }
        note_call(&mut tx, claim, call).await?;
        tx.resolve_attempt(
            claim.attempt.id,
            AttemptState::Unknown,
            None,
            Some(reason),
            now,
        )
        .await?;
        tx.commit().await?;
        Ok(Step::Rescheduled { class: "unknown" })
    }

    async fn hand_over(
        &self,
        claim: &Claim,
        reason: &str,
        call: Option<&CallInfo>,
    ) -> Result<Step, WorkerError> {
        let now = self.clock.now();
        let mut tx = self.store.begin().await?;
        if !tx.finish_outbox(claim.outbox_id, claim.token, now).await? {
            tx.rollback().await?;
            return Ok(Step::LeaseLost);
        }
        hand_to_reconciler(&mut tx, &claim.attempt, reason, now).await?;
        note_call(&mut tx, claim, call).await?;
        tx.commit().await?;
        tracing::warn!(attempt_id = %claim.attempt.id, reference = %claim.attempt.reference, reason, "attempt handed to the reconciler");
        Ok(Step::HandedOver)
    }

    async fn reschedule(
        &self,
        claim: &Claim,
        due: DateTime<Utc>,
        reason: &str,
        call: Option<&CallInfo>,
    ) -> Result<bool, WorkerError> {
        self.reschedule_counting(claim, due, reason, call, false)
            .await
    }

    /// The same attempt again under its key after the backoff
    /// ([`Step::Rescheduled`] as `class`, or [`Step::LeaseLost`]). A send
    /// that never left (`not_left`) is counted on the attempt
    /// (`sends_not_left`), so that an attempt whose every send never left
    /// can later move on without a query.
    async fn retry_later(
        &self,
        claim: &Claim,
        class: &'static str,
        reason: &str,
        call: Option<&CallInfo>,
        not_left: bool,
    ) -> Result<Step, WorkerError> {
        let due = self.clock.now() + self.retry_delay(claim);
        let ok = self
            .reschedule_counting(claim, due, reason, call, not_left)
            .await?;
        Ok(if ok {
            Step::Rescheduled { class }
        } else {
            Step::LeaseLost
        })
    }

    async fn reschedule_counting(
        &self,
        claim: &Claim,
        due: DateTime<Utc>,
        reason: &str,
        call: Option<&CallInfo>,
        not_left: bool,
    ) -> Result<bool, WorkerError> {
        let now = self.clock.now();
        let mut tx = self.store.begin().await?;
        let ok = tx
            .reschedule_outbox(claim.outbox_id, claim.token, due, now)
            .await?;
        if ok {
            note_call(&mut tx, claim, call).await?;
            if not_left {
                tx.count_send_not_left(claim.attempt.id).await?;
            }
        }
        tx.commit().await?;
        if !ok {
            self.observe(claim, "not_sent", reason, now).await?;
        }
        Ok(ok)
    }

    /// The provider this claim's attempt goes to.
    fn provider_of<'a>(&'a self, claim: &'a Claim) -> &'a str {
        claim
            .attempt
            .provider
            .as_deref()
            .unwrap_or_else(|| self.provider.name())
    }

    /// Tells the circuits how the call went (a failure to record it is
    /// logged: health is advice, never a reason to lose an answer).
    async fn report_call(&self, claim: &Claim, outcome: &cobro_provider::Outcome, took: Duration) {
        let Some(circuits) = &self.circuits else {
            return;
        };
        let health = match outcome {
            cobro_provider::Outcome::NotSent(_)
            | cobro_provider::Outcome::NotConnected(_)
            | cobro_provider::Outcome::Unknown(_) => CallHealth::Failed,
            _ => CallHealth::Answered,
        };
        let provider = self.provider_of(claim);
        if let Err(e) = circuits
            .record(provider, &self.config.owner, health, took)
            .await
        {
            tracing::warn!(error = %e, provider, "provider health not recorded");
        }
    }

    /// An authorisation never sent (or whose every send never left) at a
    /// provider whose circuit is open moves to the next provider of its
    /// route instead of being sent. `None`: it is sent here.
    async fn leave_open_circuit(
        &self,
        claim: &Claim,
        asked: &Asked,
    ) -> Result<Option<Step>, WorkerError> {
        let Some(circuits) = &self.circuits else {
            return Ok(None);
        };
        if claim.attempt.operation != Operation::Authorize
            || claim.attempt.state != AttemptState::Pending
            || circuits.state(self.provider_of(claim)).await != CircuitState::Open
        {
            return Ok(None);
        }
        self.reroute(
            claim,
            asked,
            (
                NoEffectProof::CircuitOpen,
                "never sent while the circuit was open",
            ),
            None,
        )
        .await
    }

    /// Moves the payment to the next provider of its route, in one
    /// transaction fenced by the claim, when `proof` shows this attempt
    /// had no effect: the attempt is recorded `no_effect` (it never left),
    /// and the intent's next attempt waits
    /// at the next provider. `None`: there is no next provider, the
    /// attempt may have left (a send whose outcome was never recorded), or
    /// the payment moved meanwhile; nothing was written.
    async fn reroute(
        &self,
        claim: &Claim,
        asked: &Asked,
        (proof, detail): (NoEffectProof, &str),
        call: Option<&CallInfo>,
    ) -> Result<Option<Step>, WorkerError> {
        let Some(circuits) = &self.circuits else {
            return Ok(None);
        };
        let attempt = &claim.attempt;
        if attempt.operation != Operation::Authorize || asked.payment.route.is_none() {
            return Ok(None);
        }
        let open = circuits.open().await;
        let now = self.clock.now();
        let id = attempt.id;
        let mut tx = self.store.begin().await?;
        if !tx.finish_outbox(claim.outbox_id, claim.token, now).await? {
            tx.rollback().await?;
            return Ok(Some(Step::LeaseLost));
        }
        let Some(payment) = tx.lock_payment_any_account(attempt.payment_id).await? else {
            tx.rollback().await?;
            return Ok(None);
        };
        // A soft decline moves on through `apply_proof` (the one settle
        // path, which webhooks and the reconciler share); here the proof is
        // that nothing ever left: this send (`NotSent`) and every earlier
        // one, or no send at all (`CircuitOpen`).
        if proof == NoEffectProof::NotSent {
            tx.count_send_not_left(id).await?;
        }
        let recorded = tx.resolve_never_left(id, detail, now).await?;
        let moved = if recorded && payment.status == cobro_core::PaymentStatus::Processing {
            fail_over(&mut tx, attempt, &payment, (proof, detail), &open, now).await?
        } else {
            None
        };
        let Some(to) = moved else {
            tx.rollback().await?;
            return Ok(None);
        };
        note_call(&mut tx, claim, call).await?;
        tx.commit().await?;
        self.wake.notify_one();
        Ok(Some(Step::Rerouted {
            proof: proof.as_str(),
            to,
        }))
    }

    /// A stale owner's knowledge, kept for the reconciler.
    async fn observe(
        &self,
        claim: &Claim,
        class: &str,
        detail: &str,
        now: DateTime<Utc>,
    ) -> Result<(), WorkerError> {
        tracing::warn!(attempt_id = %claim.attempt.id, class, "lease lost before recording: keeping the answer as an observation");
        self.store
            .record_observation(claim.attempt.id, claim.token, class, detail, now)
            .await?;
        Ok(())
    }
}

/// Writes what the provider said about the call on the attempt, in the
/// caller's transaction (the one whose fenced write records the outcome),
/// after anything that locks the payment: the lock order is payment, then
/// attempt, everywhere (the reverse deadlocked with a webhook settling the
/// same refund on PostgreSQL).
async fn note_call(
    tx: &mut WriteTx,
    claim: &Claim,
    call: Option<&CallInfo>,
) -> Result<(), WorkerError> {
    if let Some(call) = call {
        tx.record_call(claim.attempt.id, call.request_id.as_deref(), call.replayed)
            .await?;
    }
    Ok(())
}

/// Renews a claim's lease while its call is in flight.
struct Heartbeat {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl Heartbeat {
    fn start<P: Provider>(worker: &Worker<P>, claim: &Claim) -> Self {
        let (stop, mut stopped) = tokio::sync::oneshot::channel();
        let (store, clock) = (worker.store.clone(), Arc::clone(&worker.clock));
        let (every, lease) = (worker.config.heartbeat, to_chrono(worker.config.lease));
        let (outbox, token) = (claim.outbox_id, claim.token);
        let task = tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = &mut stopped => return,
                    _ = tokio::time::sleep(every) => {
                        let now = clock.now();
                        match store.renew_lease(outbox, token, now, now + lease).await {
                            Ok(true) => {}
                            // The row has a new owner: our answer will be
                            // kept as an observation, never written over it.
                            Ok(false) => return,
                            Err(e) => tracing::warn!(error = %e, "lease renewal failed"),
                        }
                    }
                }
            }
        });
        Self { stop, task }
    }

    async fn stop(self) {
        let _ = self.stop.send(());
        let _ = self.task.await;
    }
}
