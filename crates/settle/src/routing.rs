//! Routing's moving parts shared by the API, the worker and the
//! reconciler (docs/routing.md): each provider's circuit breaker, fed by
//! the health every process records in the database, and the one way a
//! payment moves to the next provider of its route ([`fail_over`]).
//!
//! The breaker: a provider's calls are counted per second and per process
//! in `provider_health`; when, over [`BreakerPolicy::window`] (and since
//! its circuit last closed), at least [`BreakerPolicy::min_calls`] calls
//! were made and at least [`BreakerPolicy::error_rate`] of them failed
//! (no answer: `not_sent` or `unknown`), its circuit opens. An open
//! circuit is skipped by routing for [`BreakerPolicy::cool_down`]; then it
//! is half-open: routed to again, and the next call decides (a success
//! closes it, a failure opens it for another cool-down). Every decision is
//! a compare-and-set in the database, so processes agree; each process
//! reads the circuits at most every [`BreakerPolicy::read_every`].

use chrono::{DateTime, Utc};
use cobro_core::routing::{Move, Route};
use cobro_core::{AttemptId, Clock, Operation, PaymentId};
use cobro_store::routing::CircuitRow;
use cobro_store::{AttemptRow, NewAttempt, PaymentRow, Store, StoreError, WriteTx};
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// When a circuit opens and for how long.
#[derive(Clone, Debug)]
pub struct BreakerPolicy {
    /// The window a circuit's error rate is measured over.
    pub window: Duration,
    /// No circuit opens on fewer calls than this in the window.
    pub min_calls: i64,
    /// The share of failed calls that opens it.
    pub error_rate: f64,
    /// How long an open circuit is skipped before it is half-open.
    pub cool_down: Duration,
    /// How stale a process's view of the circuits may be.
    pub read_every: Duration,
}

impl Default for BreakerPolicy {
    fn default() -> Self {
        Self {
            window: Duration::from_secs(60),
            min_calls: 10,
            error_rate: 0.5,
            cool_down: Duration::from_secs(30),
            read_every: Duration::from_secs(1),
        }
    }
}

/// A circuit as routing sees it now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CircuitState {
    Closed,
    /// Its cool-down passed: routed to again; the next call decides.
    HalfOpen,
    /// Skipped by routing.
    Open,
}

impl CircuitState {
    pub fn as_str(self) -> &'static str {
        match self {
            CircuitState::Closed => "closed",
            CircuitState::HalfOpen => "half_open",
            CircuitState::Open => "open",
        }
    }

    fn gauge(self) -> u8 {
        match self {
            CircuitState::Closed => 0,
            CircuitState::HalfOpen => 1,
            CircuitState::Open => 2,
        }
    }
}

/// What a call told the breaker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CallHealth {
    /// The provider answered (a success, a decline, a refusal).
    Answered,
    /// No answer: it never left, or its outcome is unknown.
    Failed,
}

/// The circuits as last read, and when.
type Seen = Option<(DateTime<Utc>, Arc<Vec<CircuitRow>>)>;

/// The circuits of every provider, as the database holds them, read at
/// most every `read_every`; and the breaker that moves them.
pub struct Circuits {
    store: Store,
    clock: Arc<dyn Clock>,
    policy: BreakerPolicy,
    seen: Mutex<Seen>,
    /// Counts the moves this process made: a read that started before a
    /// move is not kept as the view of the circuits (it would hide the
    /// move until the view expires).
    moves: AtomicU64,
}

fn chrono(d: Duration) -> chrono::Duration {
    chrono::Duration::from_std(d).unwrap_or(chrono::Duration::MAX)
}

impl Circuits {
    pub fn new(store: Store, clock: Arc<dyn Clock>, policy: BreakerPolicy) -> Self {
        Self {
            store,
            clock,
            policy,
            seen: Mutex::new(None),
            moves: AtomicU64::new(0),
        }
    }

    async fn rows(&self, now: DateTime<Utc>) -> Result<Arc<Vec<CircuitRow>>, StoreError> {
        if let Some((at, rows)) = self.seen.lock().map(|s| s.clone()).ok().flatten()
            && now >= at
            && now - at < chrono(self.policy.read_every)
        {
            return Ok(rows);
        }
        let moves = self.moves.load(Ordering::SeqCst);
        let rows = Arc::new(self.store.circuits().await?);
        for row in rows.iter() {
            cobro_telemetry::metrics::circuit_state(&row.provider, self.state_of(row, now).gauge());
        }
        if let Ok(mut seen) = self.seen.lock()
            && self.moves.load(Ordering::SeqCst) == moves
        {
            *seen = Some((now, Arc::clone(&rows)));
        }
        Ok(rows)
    }

    fn forget(&self) {
        // Under the lock: a read finishing now either sees the new count
        // (and keeps nothing) or stored its view before this clears it.
        if let Ok(mut seen) = self.seen.lock() {
            self.moves.fetch_add(1, Ordering::SeqCst);
            *seen = None;
        }
    }

    fn state_of(&self, row: &CircuitRow, now: DateTime<Utc>) -> CircuitState {
        match (row.state.as_str(), row.opened_at) {
            ("open", Some(at)) if now < at.0 + chrono(self.policy.cool_down) => CircuitState::Open,
            ("open", _) => CircuitState::HalfOpen,
            _ => CircuitState::Closed,
        }
    }

    /// The circuits now; a failed read is logged and reads as none open:
    /// health is advice, and an unreadable circuit never stops a send or
    /// a create (nothing that is not proven moves anyway).
    async fn rows_or_none(&self, now: DateTime<Utc>) -> Arc<Vec<CircuitRow>> {
        self.rows(now).await.unwrap_or_else(|e| {
            tracing::warn!(error = %e, "the circuits could not be read: taken as closed");
            Arc::new(Vec::new())
        })
    }

    /// `provider`'s circuit now.
    pub async fn state(&self, provider: &str) -> CircuitState {
        let now = self.clock.now();
        self.rows_or_none(now)
            .await
            .iter()
            .find(|r| r.provider == provider)
            .map_or(CircuitState::Closed, |r| self.state_of(r, now))
    }

    /// The providers routing skips now.
    pub async fn open(&self) -> BTreeSet<String> {
        let now = self.clock.now();
        self.rows_or_none(now)
            .await
            .iter()
            .filter(|r| self.state_of(r, now) == CircuitState::Open)
            .map(|r| r.provider.clone())
            .collect()
    }

    /// Records a call to `provider` by process `owner` and moves its
    /// circuit if the call decides it. Answers the state it moved to.
    pub async fn record(
        &self,
        provider: &str,
        owner: &str,
        health: CallHealth,
        latency: Duration,
    ) -> Result<Option<CircuitState>, StoreError> {
        let now = self.clock.now();
        let failed = health == CallHealth::Failed;
        let latency_ms = i64::try_from(latency.as_millis()).unwrap_or(i64::MAX);
        self.store
            .record_provider_call(provider, now.timestamp(), owner, failed, latency_ms)
            .await?;
        let rows = self.rows(now).await?;
        let row = rows.iter().find(|r| r.provider == provider);
        let state = row.map_or(CircuitState::Closed, |r| self.state_of(r, now));
        let moved = match (state, health) {
            (CircuitState::HalfOpen, CallHealth::Answered) => self
                .store
                .close_circuit(provider, now)
                .await?
                .then_some(CircuitState::Closed),
            (CircuitState::HalfOpen, CallHealth::Failed) => {
                let cooled = now - chrono(self.policy.cool_down);
                self.store
                    .reopen_circuit(provider, "a half-open call failed", cooled, now)
                    .await?
                    .then_some(CircuitState::Open)
            }
            (CircuitState::Closed, CallHealth::Failed) => {
                let mut from = now - chrono(self.policy.window);
                if let Some(closed) = row.and_then(|r| r.closed_at) {
                    from = from.max(closed.0);
                }
                let window = self
                    .store
                    .provider_window(provider, from.timestamp())
                    .await?;
                let rate = window.errors as f64 / window.calls.max(1) as f64;
                if window.calls >= self.policy.min_calls && rate >= self.policy.error_rate {
                    let reason = format!(
                        "{} of {} calls failed in the last {}s",
                        window.errors,
                        window.calls,
                        self.policy.window.as_secs()
                    );
                    self.store
                        .open_circuit(provider, &reason, now)
                        .await?
                        .then_some(CircuitState::Open)
                } else {
                    None
                }
            }
            _ => None,
        };
        if let Some(to) = moved {
            self.forget();
            cobro_telemetry::metrics::circuit_state(provider, to.gauge());
            tracing::warn!(provider, to = to.as_str(), "provider circuit moved");
            // A window never reaches back further than this.
            let horizon = now - chrono(self.policy.window) * 2;
            self.store
                .purge_provider_health(horizon.timestamp())
                .await?;
        }
        Ok(moved)
    }
}

/// Why a payment may move on: the proof that its attempt at the current
/// provider had no effect.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NoEffectProof {
    /// A decline whose code says "try elsewhere" ([`SOFT_DECLINES`]).
    SoftDecline,
    /// Every send of the attempt provably never left (or it was never
    /// sent).
    NotSent,
    /// Never sent, and its provider's circuit is open.
    CircuitOpen,
    /// The consistent read found nothing (docs/proof-of-absence.md).
    NoEffect,
}

impl NoEffectProof {
    pub fn as_str(self) -> &'static str {
        match self {
            NoEffectProof::SoftDecline => "soft_decline",
            NoEffectProof::NotSent => "not_sent",
            NoEffectProof::CircuitOpen => "circuit_open",
            NoEffectProof::NoEffect => "no_effect",
        }
    }
}

/// Decline codes that mean "this provider could not do it now; another
/// may": the processor or issuer was unavailable, not the customer's card
/// refused. Every other decline is the card's answer, the same everywhere,
/// and ends the payment.
pub const SOFT_DECLINES: &[&str] = &[
    "try_again_later",
    "issuer_not_available",
    "processing_error",
    "reenter_transaction",
    "approve_with_id",
];

/// Whether a decline code lets the payment try the next provider.
pub fn is_soft_decline(code: &str) -> bool {
    SOFT_DECLINES.contains(&code)
}

/// Counts and logs a move [`fail_over`] made; [`FailOver::make`] has it
/// run once the move's transaction has committed.
fn note_failover(payment: PaymentId, from: &str, to: &str, proof: NoEffectProof) {
    cobro_telemetry::metrics::routing_failover(from, to, proof.as_str());
    tracing::warn!(
        payment_id = %payment, from, to, proof = proof.as_str(),
        "payment moved to the next provider of its route"
    );
}

/// Moves the payment of `attempt` (an authorisation already recorded
/// without effect in this transaction, its payment locked) to the next
/// provider of its route, and opens the intent's next attempt there under
/// a new provider key. `None`: there is no next provider (or the payment
/// has no route, moved meanwhile, or its merchant asked to cancel it), and
/// nothing was written.
pub async fn fail_over(
    tx: &mut WriteTx,
    attempt: &AttemptRow,
    payment: &PaymentRow,
    proof: (NoEffectProof, &str),
    open: &BTreeSet<String>,
    now: DateTime<Utc>,
) -> Result<Option<String>, StoreError> {
    match FailOver::plan(attempt, payment, proof, open, now) {
        Some(planned) => planned.make(tx, attempt, now).await,
        None => Ok(None),
    }
}

/// The move [`fail_over`] makes, decided before anything is written, for
/// a caller that must write something else first in the same transaction
/// only if the payment moves (the settle path returns a payment the
/// reconciler holds to `processing`).
#[derive(Clone, Debug)]
pub struct FailOver {
    payment: PaymentId,
    from: String,
    to: String,
    /// What proved that the attempt at `from` had no effect.
    proof: NoEffectProof,
    /// The route with this move recorded.
    route: Route,
}

impl FailOver {
    /// Where the payment of `attempt` would move, read from `payment` as
    /// locked in the caller's transaction; nothing is read or written.
    /// `None`: it does not move (see [`fail_over`]).
    pub fn plan(
        attempt: &AttemptRow,
        payment: &PaymentRow,
        proof: (NoEffectProof, &str),
        open: &BTreeSet<String>,
        now: DateTime<Utc>,
    ) -> Option<Self> {
        // A merchant who asked to cancel wants no charge anywhere: the
        // payment ends where it is (its held cancel follows the outcome).
        if attempt.operation != Operation::Authorize || payment.cancel_requested_at.is_some() {
            return None;
        }
        let mut route = payment.route.as_deref().and_then(Route::from_json)?;
        let current = attempt.provider.as_deref()?;
        if payment.provider.as_deref() != Some(current) {
            return None;
        }
        let next = route
            .next_after(current, &|p| open.contains(p))
            .map(str::to_owned)?;
        route.moves.push(Move {
            from: current.to_owned(),
            to: next.clone(),
            proof: format!("{}: {}", proof.0.as_str(), proof.1),
            attempt: attempt.id.to_string(),
            at: now.to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
        });
        Some(Self {
            payment: payment.id,
            from: current.to_owned(),
            to: next,
            proof: proof.0,
            route,
        })
    }

    /// Writes the move: the payment's provider and route compare-and-set
    /// from the current provider to the next, and the intent's next
    /// attempt enqueued there under a new provider key. `None`: the
    /// payment's provider changed since it was read, and nothing was
    /// written. The move is counted and logged once the caller's
    /// transaction commits (a dry run's rollback counts nothing).
    pub async fn make(
        self,
        tx: &mut WriteTx,
        attempt: &AttemptRow,
        now: DateTime<Utc>,
    ) -> Result<Option<String>, StoreError> {
        if !tx
            .move_to_provider(
                self.payment,
                &self.from,
                &self.to,
                &self.route.to_json(),
                now,
            )
            .await?
        {
            return Ok(None);
        }
        let id = AttemptId::new();
        tx.enqueue_attempt(
            &NewAttempt {
                id,
                intent: attempt.intent_id,
                payment: self.payment,
                refund: None,
                operation: Operation::Authorize,
                provider_key: uuid::Uuid::new_v4().to_string(),
                reference: cobro_core::attempt_reference(attempt.intent_name(), id),
            },
            now,
            now,
        )
        .await?;
        let Self {
            payment,
            from,
            to,
            proof,
            ..
        } = self;
        let noted = to.clone();
        tx.after_commit(move || note_failover(payment, &from, &noted, proof));
        Ok(Some(to))
    }
}
