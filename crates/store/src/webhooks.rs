//! Provider webhook events: the receipt of each event (deduplicated by the
//! primary key `(provider, event_id)`), the lookups that match an event to
//! cobro's attempts, and the per-payment provider sequence that keeps old
//! events from moving a payment backwards.
//!
//! Everything here runs inside the caller's [`WriteTx`], so an event's
//! receipt, its effect and its outcome commit together or not at all. The
//! purge of old event ids lives with the other purges (`purge.rs`).

use crate::payments::ATTEMPT_COLUMNS;
use crate::{AttemptRow, DbId, DbTime, Result, Store, StoreError, WriteTx, on_pool, on_tx};
use chrono::{DateTime, Utc};
use cobro_core::{AttemptState, Operation, PaymentId};

/// An event as received, before its effect is known.
#[derive(Clone, Debug)]
pub struct NewWebhookEvent<'a> {
    /// The provider name of the route (`fake`).
    pub provider: &'a str,
    /// The provider's event id (`evt_...`): the deduplication key.
    pub event_id: &'a str,
    /// e.g. `charge.captured`.
    pub event_type: &'a str,
    /// The provider's per-charge sequence after the event's effect.
    pub sequence: i64,
    /// The raw body, kept as received (audit and the reconciler read it).
    pub payload: &'a str,
}

pub use cobro_core::WebhookOutcome;

/// A stored event, read back.
#[derive(Clone, Debug, sqlx::FromRow)]
pub struct WebhookEventRow {
    pub provider: String,
    pub event_id: String,
    pub event_type: String,
    pub sequence: i64,
    pub payment_id: Option<PaymentId>,
    pub outcome: WebhookOutcome,
    pub payload: String,
    pub received_at: DbTime,
}

const EVENT_COLUMNS: &str =
    "provider, event_id, event_type, sequence, payment_id, outcome, payload, received_at";

/// The outcome column while the transaction that inserted the row is still
/// deciding; never visible after a commit.
const RECEIVED: &str = "received";

impl WriteTx {
    /// Records the receipt of an event. `false`: this `(provider, event_id)`
    /// is already stored (a redelivery) and nothing was written. On
    /// PostgreSQL a concurrent delivery of the same event waits here until
    /// the first one's transaction ends, so only one of them ever applies it.
    pub async fn insert_webhook_event(
        &mut self,
        event: &NewWebhookEvent<'_>,
        now: DateTime<Utc>,
    ) -> Result<bool> {
        let sql = "INSERT INTO webhook_events (provider, event_id, event_type, sequence, \
            outcome, payload, received_at) VALUES ($1, $2, $3, $4, $5, $6, $7) \
            ON CONFLICT (provider, event_id) DO NOTHING";
        let n = on_tx!(self, conn => sqlx::query(sql)
            .bind(event.provider)
            .bind(event.event_id)
            .bind(event.event_type)
            .bind(event.sequence)
            .bind(RECEIVED)
            .bind(event.payload)
            .bind(DbTime(now))
            .execute(&mut *conn)
            .await?
            .rows_affected());
        Ok(n == 1)
    }

    /// Sets the outcome (and the matched payment) of an event inserted by
    /// this transaction.
    pub async fn record_webhook_outcome(
        &mut self,
        provider: &str,
        event_id: &str,
        outcome: WebhookOutcome,
        payment: Option<PaymentId>,
    ) -> Result<()> {
        let sql = "UPDATE webhook_events SET outcome = $3, payment_id = $4 \
            WHERE provider = $1 AND event_id = $2 AND outcome = $5";
        let n = on_tx!(self, conn => sqlx::query(sql)
            .bind(provider)
            .bind(event_id)
            .bind(outcome.as_str())
            .bind(payment.map(DbId::from))
            .bind(RECEIVED)
            .execute(&mut *conn)
            .await?
            .rows_affected());
        if n != 1 {
            return Err(StoreError::Corrupt(format!(
                "webhook event {provider}/{event_id} is not awaiting its outcome"
            )));
        }
        Ok(())
    }

    /// The attempts sent under `reference`. References are unique to one
    /// attempt (`{intent}/{attempt id}`); only attempts made before that
    /// (the bare intent name) can share one across accounts.
    pub async fn attempts_by_reference_any_account(
        &mut self,
        reference: &str,
    ) -> Result<Vec<AttemptRow>> {
        let sql = format!(
            "SELECT {ATTEMPT_COLUMNS} FROM attempts WHERE reference = $1 ORDER BY created_at, id"
        );
        Ok(on_tx!(self, conn => sqlx::query_as(&sql)
            .bind(reference)
            .fetch_all(&mut *conn)
            .await?))
    }

    /// The payment's unresolved captures and cancels (`held` included),
    /// newest first: the attempts a `captured` or `voided` event of its
    /// charge may be about once the authorisation is settled.
    pub async fn open_follow_ups_any_account(
        &mut self,
        payment: PaymentId,
    ) -> Result<Vec<AttemptRow>> {
        // Our own constants, never user text.
        let operations = crate::sql_names(
            [Operation::Capture, Operation::Cancel]
                .iter()
                .map(|o| o.as_str()),
        );
        let open = crate::sql_names(
            AttemptState::ALL
                .iter()
                .filter(|s| s.is_unresolved())
                .map(|s| s.as_str()),
        );
        let sql = format!(
            "SELECT {ATTEMPT_COLUMNS} FROM attempts \
             WHERE payment_id = $1 AND operation IN ({operations}) AND state IN ({open}) \
             ORDER BY created_at DESC, id DESC"
        );
        Ok(on_tx!(self, conn => sqlx::query_as(&sql)
            .bind(DbId::from(payment))
            .fetch_all(&mut *conn)
            .await?))
    }

    /// Raises the payment's provider sequence to `sequence` if it is lower:
    /// a compare-and-set, so of two events racing for one payment only the
    /// newer can win. `false`: what is recorded is already as new or newer.
    ///
    /// `updated_at` is left alone: the sequence is bookkeeping, not a change
    /// a merchant can see.
    pub async fn raise_provider_sequence(
        &mut self,
        payment: PaymentId,
        sequence: i64,
    ) -> Result<bool> {
        let sql = "UPDATE payments SET provider_sequence = $2 \
            WHERE id = $1 AND provider_sequence < $2";
        let n = on_tx!(self, conn => sqlx::query(sql)
            .bind(DbId::from(payment))
            .bind(sequence)
            .execute(&mut *conn)
            .await?
            .rows_affected());
        Ok(n == 1)
    }
}

impl Store {
    /// How many attempts were sent under `reference` (more than one only
    /// for attempts made before references were unique).
    pub async fn attempts_with_reference(&self, reference: &str) -> Result<i64> {
        let sql = "SELECT COUNT(*) FROM attempts WHERE reference = $1";
        Ok(on_pool!(self, pool => sqlx::query_scalar(sql)
            .bind(reference)
            .fetch_one(pool)
            .await?))
    }

    /// One stored event (ops and tests).
    pub async fn webhook_event(
        &self,
        provider: &str,
        event_id: &str,
    ) -> Result<Option<WebhookEventRow>> {
        let sql = format!(
            "SELECT {EVENT_COLUMNS} FROM webhook_events WHERE provider = $1 AND event_id = $2"
        );
        Ok(on_pool!(self, pool => sqlx::query_as(&sql)
            .bind(provider)
            .bind(event_id)
            .fetch_optional(pool)
            .await?))
    }
}
