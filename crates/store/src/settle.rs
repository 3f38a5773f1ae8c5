//! The writes that record what the provider proved: attempt states, payment
//! and refund outcomes. All compare-and-set; `None`/`false` means someone
//! (another worker, the reconciler, a webhook) recorded first.

use crate::payments::{
    ATTEMPT_COLUMNS, PAYMENT_COLUMNS, REFUND_COLUMNS, Scope, attempts_of_payment, payment_by_id,
    refund_by_id,
};
use crate::{
    AttemptRow, DbId, DbTime, PaymentRow, RefundRow, Result, Store, WriteTx, on_pool, on_tx,
};
use chrono::{DateTime, Utc};
use cobro_core::{
    AccountId, AttemptId, AttemptState, OutboxId, PaymentId, PaymentStatus, RefundId, RefundStatus,
};

/// The fields an outcome may set on a payment besides its status.
#[derive(Clone, Debug, Default)]
pub struct PaymentOutcome {
    pub provider_ref: Option<String>,
    /// The captured amount, when the outcome captured money.
    pub amount_captured: Option<i64>,
    /// Code and message of a decline or failure (cleared when `None`).
    pub failure: Option<(String, String)>,
}

impl WriteTx {
    /// A payment by id, inside this transaction (workers and the reconciler
    /// act across accounts), locked until the transaction ends: a decision
    /// made from it cannot be overtaken by a concurrent change.
    pub async fn lock_payment_any_account(&mut self, id: PaymentId) -> Result<Option<PaymentRow>> {
        let sql = payment_by_id(Scope::AnyAccount, self.lock_clause());
        Ok(on_tx!(self, conn => sqlx::query_as(&sql)
            .bind(DbId::from(id))
            .fetch_optional(&mut *conn)
            .await?))
    }

    pub async fn refund_any_account(&mut self, id: RefundId) -> Result<Option<RefundRow>> {
        let sql = refund_by_id(Scope::AnyAccount);
        Ok(on_tx!(self, conn => sqlx::query_as(&sql)
            .bind(DbId::from(id))
            .fetch_optional(&mut *conn)
            .await?))
    }

    pub async fn attempt_any_account(&mut self, id: AttemptId) -> Result<Option<AttemptRow>> {
        let sql = format!("SELECT {ATTEMPT_COLUMNS} FROM attempts WHERE id = $1");
        Ok(on_tx!(self, conn => sqlx::query_as(&sql)
            .bind(DbId::from(id))
            .fetch_optional(&mut *conn)
            .await?))
    }

    /// Moves an attempt to `to` from any state the attempt state machine
    /// allows (`AttemptState::can_become`). `false`: it was in none of them
    /// (someone else settled it first).
    pub async fn resolve_attempt(
        &mut self,
        id: AttemptId,
        to: AttemptState,
        provider_ref: Option<&str>,
        note: Option<&str>,
        now: DateTime<Utc>,
    ) -> Result<bool> {
        let sources = AttemptState::sources_of(to);
        if sources.is_empty() {
            return Ok(false);
        }
        // The states are our own constants, never user text.
        let from = crate::sql_names(sources.iter().map(AttemptState::as_str));
        let sql = format!(
            "UPDATE attempts SET state = $2, provider_ref = COALESCE($3, provider_ref), \
             last_error = COALESCE($4, last_error), updated_at = $5 \
             WHERE id = $1 AND state IN ({from})"
        );
        let n = on_tx!(self, conn => sqlx::query(&sql)
            .bind(DbId::from(id))
            .bind(to)
            .bind(provider_ref)
            .bind(note)
            .bind(DbTime(now))
            .execute(&mut *conn)
            .await?
            .rows_affected());
        Ok(n == 1)
    }

    /// Records "no effect" for an attempt, pinned to exactly what the
    /// reconciler read: still `reconciling` and last sent at `last_send_at`
    /// (a send in between, or another decision, changes nothing: `false`).
    pub async fn resolve_no_effect(
        &mut self,
        id: AttemptId,
        last_send_at: Option<DateTime<Utc>>,
        now: DateTime<Utc>,
    ) -> Result<bool> {
        let sql = "UPDATE attempts SET state = 'no_effect', \
            last_error = 'proven no effect at the provider', updated_at = $3 \
            WHERE id = $1 AND state = 'reconciling' \
            AND ((last_send_at IS NULL AND $2 IS NULL) OR last_send_at = $2)";
        let n = on_tx!(self, conn => sqlx::query(sql)
            .bind(DbId::from(id))
            .bind(last_send_at.map(DbTime))
            .bind(DbTime(now))
            .execute(&mut *conn)
            .await?
            .rows_affected());
        Ok(n == 1)
    }

    /// Compare-and-set of a payment's status with the outcome's fields.
    pub async fn settle_payment(
        &mut self,
        id: PaymentId,
        from: PaymentStatus,
        to: PaymentStatus,
        outcome: &PaymentOutcome,
        now: DateTime<Utc>,
    ) -> Result<Option<PaymentRow>> {
        let (code, message) = match &outcome.failure {
            Some((c, m)) => (Some(c.as_str()), Some(m.as_str())),
            None => (None, None),
        };
        let sql = format!(
            "UPDATE payments SET status = $3, provider_ref = COALESCE($4, provider_ref), \
             provider_sequence = CASE WHEN $4 IS NOT NULL AND provider_ref IS NOT NULL \
               AND $4 <> provider_ref THEN 0 ELSE provider_sequence END, \
             amount_captured = COALESCE($5, amount_captured), failure_code = $6, \
             failure_message = $7, status_changed_at = $8, updated_at = $8, \
             review_reason = CASE WHEN $3 = 'needs_review' THEN review_reason END \
             WHERE id = $1 AND status = $2 RETURNING {PAYMENT_COLUMNS}"
        );
        let moved: Option<PaymentRow> = on_tx!(self, conn => sqlx::query_as(&sql)
            .bind(DbId::from(id))
            .bind(from)
            .bind(to)
            .bind(outcome.provider_ref.as_deref())
            .bind(outcome.amount_captured)
            .bind(code)
            .bind(message)
            .bind(DbTime(now))
            .fetch_optional(&mut *conn)
            .await?);
        Ok(self.noting_move(moved))
    }

    /// Compare-and-set of a payment from `from` to `requires_action`, with
    /// its provider object, the action as the API shows it (JSON text) and
    /// when it expires, in the one statement whose trigger writes the
    /// `payment.requires_action` event (so the event carries the action).
    pub async fn require_action(
        &mut self,
        id: PaymentId,
        from: PaymentStatus,
        provider_ref: &str,
        next_action: &str,
        expires_at: DateTime<Utc>,
        now: DateTime<Utc>,
    ) -> Result<Option<PaymentRow>> {
        let sql = format!(
            "UPDATE payments SET status = 'requires_action', provider_ref = $3, \
             next_action = $4, action_expires_at = $5, status_changed_at = $6, updated_at = $6 \
             WHERE id = $1 AND status = $2 RETURNING {PAYMENT_COLUMNS}"
        );
        let moved: Option<PaymentRow> = on_tx!(self, conn => sqlx::query_as(&sql)
            .bind(DbId::from(id))
            .bind(from)
            .bind(provider_ref)
            .bind(next_action)
            .bind(DbTime(expires_at))
            .bind(DbTime(now))
            .fetch_optional(&mut *conn)
            .await?);
        Ok(self.noting_move(moved))
    }

    /// Compare-and-set of a refund's status; on success the payment's
    /// refunded amount grows (and its status follows, unless the payment is
    /// under review), on failure the reserved amount is released for other
    /// refunds. `from == to` is refused (`None`): it would count the same
    /// refund twice.
    pub async fn settle_refund(
        &mut self,
        id: RefundId,
        from: RefundStatus,
        to: RefundStatus,
        provider_ref: Option<&str>,
        failure: Option<(&str, &str)>,
        now: DateTime<Utc>,
    ) -> Result<Option<RefundRow>> {
        if from == to {
            return Ok(None);
        }
        let sql = format!(
            "UPDATE refunds SET status = $3, provider_ref = COALESCE($4, provider_ref), \
             failure_code = $5, failure_message = $6, status_changed_at = $7, updated_at = $7 \
             WHERE id = $1 AND status = $2 RETURNING {REFUND_COLUMNS}"
        );
        let row: Option<RefundRow> = on_tx!(self, conn => sqlx::query_as(&sql)
            .bind(DbId::from(id))
            .bind(from)
            .bind(to)
            .bind(provider_ref)
            .bind(failure.map(|f| f.0))
            .bind(failure.map(|f| f.1))
            .bind(DbTime(now))
            .fetch_optional(&mut *conn)
            .await?);
        let Some(refund) = row else { return Ok(None) };
        let payment_sql = match to {
            RefundStatus::Succeeded => Some(
                "UPDATE payments SET amount_refunded = amount_refunded + $2, \
                 status = CASE WHEN status NOT IN ('captured', 'partially_refunded') THEN status \
                               WHEN amount_refunded + $2 >= amount_captured THEN 'refunded' \
                               ELSE 'partially_refunded' END, \
                 status_changed_at = $3, updated_at = $3 \
                 WHERE id = $1",
            ),
            RefundStatus::Failed => Some(
                "UPDATE payments SET amount_refund_reserved = amount_refund_reserved - $2, \
                 updated_at = $3 WHERE id = $1",
            ),
            _ => None,
        };
        if let Some(sql) = payment_sql {
            on_tx!(self, conn => sqlx::query(sql)
                .bind(refund.payment_id)
                .bind(refund.amount)
                .bind(DbTime(now))
                .execute(&mut *conn)
                .await?
                .rows_affected());
        }
        Ok(Some(refund))
    }

    /// A refund the provider failed after it had succeeded: `succeeded` to
    /// `failed` (compare-and-set), its amount taken out of the payment's
    /// refunded and reserved amounts (refundable again), and a `refunded`
    /// or `partially_refunded` payment back to what is still refunded
    /// (`captured` when nothing is). `None` when the refund is not
    /// `succeeded` (any more).
    pub async fn fail_succeeded_refund(
        &mut self,
        id: RefundId,
        failure: (&str, &str),
        now: DateTime<Utc>,
    ) -> Result<Option<RefundRow>> {
        let sql = format!(
            "UPDATE refunds SET status = 'failed', failure_code = $2, failure_message = $3, \
             status_changed_at = $4, updated_at = $4 \
             WHERE id = $1 AND status = 'succeeded' RETURNING {REFUND_COLUMNS}"
        );
        let row: Option<RefundRow> = on_tx!(self, conn => sqlx::query_as(&sql)
            .bind(DbId::from(id))
            .bind(failure.0)
            .bind(failure.1)
            .bind(DbTime(now))
            .fetch_optional(&mut *conn)
            .await?);
        let Some(refund) = row else { return Ok(None) };
        let sql = "UPDATE payments SET amount_refunded = amount_refunded - $2, \
             amount_refund_reserved = amount_refund_reserved - $2, \
             status = CASE WHEN status NOT IN ('refunded', 'partially_refunded') THEN status \
                           WHEN amount_refunded - $2 > 0 THEN 'partially_refunded' \
                           ELSE 'captured' END, \
             status_changed_at = CASE WHEN status IN ('refunded', 'partially_refunded') \
                                      THEN $3 ELSE status_changed_at END, \
             updated_at = $3 \
             WHERE id = $1";
        on_tx!(self, conn => sqlx::query(sql)
            .bind(refund.payment_id)
            .bind(refund.amount)
            .bind(DbTime(now))
            .execute(&mut *conn)
            .await?
            .rows_affected());
        // Its payment's amounts (and maybe status) moved: wake what waits.
        self.moved_payment = true;
        Ok(Some(refund))
    }

    /// The reason shown with a payment in `needs_review`.
    pub async fn set_review_reason(&mut self, id: PaymentId, reason: &str) -> Result<()> {
        let sql =
            "UPDATE payments SET review_reason = $2 WHERE id = $1 AND status = 'needs_review'";
        on_tx!(self, conn => sqlx::query(sql)
            .bind(DbId::from(id))
            .bind(reason)
            .execute(&mut *conn)
            .await?
            .rows_affected());
        Ok(())
    }

    /// Every attempt of a payment, oldest first, inside this transaction.
    pub async fn attempts_of_payment_any_account(
        &mut self,
        payment: PaymentId,
    ) -> Result<Vec<AttemptRow>> {
        let sql = attempts_of_payment(Scope::AnyAccount, None);
        Ok(on_tx!(self, conn => sqlx::query_as(&sql)
            .bind(DbId::from(payment))
            .fetch_all(&mut *conn)
            .await?))
    }

    /// Every attempt of a payment of this account, oldest first, inside
    /// this transaction; another account's payment has none.
    pub async fn attempts_of_payment_for_account(
        &mut self,
        account: AccountId,
        payment: PaymentId,
    ) -> Result<Vec<AttemptRow>> {
        let sql = attempts_of_payment(Scope::ForAccount, None);
        Ok(on_tx!(self, conn => sqlx::query_as(&sql)
            .bind(DbId::from(payment))
            .bind(DbId::from(account))
            .fetch_all(&mut *conn)
            .await?))
    }

    /// Puts a claimed row back in the queue at `due_at`, fenced by the token.
    pub async fn reschedule_outbox(
        &mut self,
        outbox: OutboxId,
        token: i64,
        due_at: DateTime<Utc>,
        now: DateTime<Utc>,
    ) -> Result<bool> {
        let sql = "UPDATE outbox SET due_at = $3, lease_owner = NULL, lease_expires_at = NULL, \
            updated_at = $4 WHERE id = $1 AND lease_token = $2 AND state = 'pending'";
        let n = on_tx!(self, conn => sqlx::query(sql)
            .bind(DbId::from(outbox))
            .bind(token)
            .bind(DbTime(due_at))
            .bind(DbTime(now))
            .execute(&mut *conn)
            .await?
            .rows_affected());
        Ok(n == 1)
    }
}

impl Store {
    /// A payment by id across accounts: for the worker and the reconciler
    /// only, never for a merchant-facing read.
    pub async fn payment_any_account(&self, id: PaymentId) -> Result<Option<PaymentRow>> {
        let sql = payment_by_id(Scope::AnyAccount, "");
        Ok(on_pool!(self, pool => sqlx::query_as(&sql)
            .bind(DbId::from(id))
            .fetch_optional(pool)
            .await?))
    }

    /// A refund by id across accounts: for the worker and the reconciler only.
    pub async fn refund_any_account(&self, id: RefundId) -> Result<Option<RefundRow>> {
        let sql = refund_by_id(Scope::AnyAccount);
        Ok(on_pool!(self, pool => sqlx::query_as(&sql)
            .bind(DbId::from(id))
            .fetch_optional(pool)
            .await?))
    }
}
