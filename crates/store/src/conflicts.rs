//! Evidence cobro kept but did not adopt, and the `needs_review` flag it
//! raises (docs/evidence.md §7.2).
//!
//! A conflict is provider evidence that contradicts what cobro recorded (a
//! charge for an attempt recorded as having had no effect, another charge
//! id, another amount), or that does not match the attempt it names, or
//! that matches nothing of cobro's. It is stored here, the payment (when
//! there is one) goes to `needs_review` with the reason, and every new send
//! for it is then refused by the schema until an operator resolves it.

use crate::payments::PAYMENT_COLUMNS;
use crate::{DbId, DbTime, PaymentRow, Result, Store, WriteTx, on_pool, on_tx};
use chrono::{DateTime, Utc};
use cobro_core::{AttemptId, PaymentId, RefundId};

pub use cobro_core::ConflictKind;

/// One piece of evidence to keep.
#[derive(Clone, Debug)]
pub struct NewConflict<'a> {
    pub payment: Option<PaymentId>,
    pub refund: Option<RefundId>,
    pub attempt: Option<AttemptId>,
    /// `worker`, `reconciler`, `webhook:<provider>`.
    pub source: &'a str,
    pub kind: ConflictKind,
    /// A sentence for the operator.
    pub detail: &'a str,
    /// What the provider said, as received (JSON).
    pub evidence: &'a str,
}

/// A stored conflict, read back.
#[derive(Clone, Debug, sqlx::FromRow)]
pub struct ConflictRow {
    pub id: DbId,
    pub payment_id: Option<PaymentId>,
    pub refund_id: Option<RefundId>,
    pub attempt_id: Option<AttemptId>,
    pub source: String,
    pub kind: ConflictKind,
    pub detail: String,
    pub evidence: String,
    pub found_at: DbTime,
    pub resolved_at: Option<DbTime>,
}

const CONFLICT_COLUMNS: &str = "id, payment_id, refund_id, attempt_id, source, kind, detail, \
    evidence, found_at, resolved_at";

/// The oldest open conflict of one kind ($2) kept on one attempt ($1), or,
/// for a refund's attempt, on any attempt of its refund: money the
/// provider showed for one attempt of a refund is that refund's, whichever
/// attempt is decided next.
fn open_of_attempt_sql() -> String {
    format!(
        "SELECT {CONFLICT_COLUMNS} FROM evidence_conflicts WHERE kind = $2 \
         AND resolved_at IS NULL AND found_at IS NOT NULL \
         AND attempt_id IN (SELECT s.id FROM attempts s WHERE s.id = $1 \
           OR s.refund_id = (SELECT a.refund_id FROM attempts a WHERE a.id = $1)) \
         ORDER BY found_at LIMIT 1"
    )
}

impl WriteTx {
    pub async fn record_conflict(&mut self, c: &NewConflict<'_>, now: DateTime<Utc>) -> Result<()> {
        // The account is the payment's; evidence that names no payment has none.
        let sql = "INSERT INTO evidence_conflicts (id, payment_id, refund_id, attempt_id, source, \
            kind, detail, evidence, found_at, account_id) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, \
            $9, (SELECT account_id FROM payments WHERE id = $2))";
        on_tx!(self, conn => sqlx::query(sql)
            .bind(DbId(uuid::Uuid::now_v7()))
            .bind(c.payment.map(DbId::from))
            .bind(c.refund.map(DbId::from))
            .bind(c.attempt.map(DbId::from))
            .bind(c.source)
            .bind(c.kind.as_str())
            .bind(c.detail)
            .bind(c.evidence)
            .bind(DbTime(now))
            .execute(&mut *conn)
            .await?
            .rows_affected());
        Ok(())
    }

    /// Moves a payment to `needs_review` with `reason`, from whatever state
    /// it is in, and a refund in flight with it. Returns the payment as it
    /// was before, or `None` when it already was in review (the reason is
    /// then kept) or when it is a terminal failure whose order another
    /// payment now holds (it stays as it is; the conflict row is what the
    /// operator sees).
    pub async fn flag_for_review(
        &mut self,
        payment: PaymentId,
        refund: Option<RefundId>,
        reason: &str,
        now: DateTime<Utc>,
    ) -> Result<Option<PaymentRow>> {
        let before = self.lock_payment_any_account(payment).await?;
        let Some(before) = before else {
            return Ok(None);
        };
        let sql = format!(
            "UPDATE payments SET status = 'needs_review', review_reason = $2, review_from = status, \
             status_changed_at = $3, updated_at = $3 \
             WHERE id = $1 AND status = $4 AND (status NOT IN ('declined', 'failed', 'canceled') \
               OR NOT EXISTS (SELECT 1 FROM payments o WHERE o.account_id = payments.account_id \
                 AND o.order_ref = payments.order_ref AND o.id <> payments.id \
                 AND o.status NOT IN ('declined', 'failed', 'canceled'))) \
             RETURNING {PAYMENT_COLUMNS}"
        );
        let moved: Option<PaymentRow> = if before.status == cobro_core::PaymentStatus::NeedsReview {
            None
        } else {
            on_tx!(self, conn => sqlx::query_as(&sql)
                .bind(DbId::from(payment))
                .bind(reason)
                .bind(DbTime(now))
                .bind(before.status)
                .fetch_optional(&mut *conn)
                .await?)
        };
        if let Some(refund) = refund {
            let sql = "UPDATE refunds SET status = 'needs_review', status_changed_at = $2, \
                updated_at = $2 WHERE id = $1 AND status IN ('processing', 'requires_reconciliation')";
            on_tx!(self, conn => sqlx::query(sql)
                .bind(DbId::from(refund))
                .bind(DbTime(now))
                .execute(&mut *conn)
                .await?
                .rows_affected());
        }
        Ok(self.noting_move(moved).map(|_| before))
    }

    /// Whether the payment has conflicts no operator has resolved yet.
    pub async fn has_open_conflicts(&mut self, payment: PaymentId) -> Result<bool> {
        let sql = "SELECT COUNT(*) FROM evidence_conflicts WHERE payment_id = $1 \
            AND resolved_at IS NULL";
        let n: i64 = on_tx!(self, conn => sqlx::query_scalar(sql)
            .bind(DbId::from(payment))
            .fetch_one(&mut *conn)
            .await?);
        Ok(n > 0)
    }

    /// Whether this exact finding is already kept and open (so a
    /// reconciler that sees it again on every run writes it once).
    pub async fn conflict_is_open(
        &mut self,
        attempt: AttemptId,
        kind: ConflictKind,
        detail: &str,
    ) -> Result<bool> {
        // Through `evidence_conflicts_open` (its always-true term, migration
        // 0014): no index has the attempt, and the open ones are few.
        let sql = "SELECT COUNT(*) FROM evidence_conflicts WHERE attempt_id = $1 AND kind = $2 \
            AND detail = $3 AND resolved_at IS NULL AND found_at IS NOT NULL";
        let n: i64 = on_tx!(self, conn => sqlx::query_scalar(sql)
            .bind(DbId::from(attempt))
            .bind(kind.as_str())
            .bind(detail)
            .fetch_one(&mut *conn)
            .await?);
        Ok(n > 0)
    }

    /// [`Store::open_conflict_of_attempt`], read in this transaction.
    pub async fn open_conflict_of_attempt(
        &mut self,
        attempt: AttemptId,
        kind: ConflictKind,
    ) -> Result<Option<ConflictRow>> {
        let sql = open_of_attempt_sql();
        Ok(on_tx!(self, conn => sqlx::query_as(&sql)
            .bind(DbId::from(attempt))
            .bind(kind.as_str())
            .fetch_optional(&mut *conn)
            .await?))
    }

    /// Marks a payment's open conflicts resolved (an operator decided).
    pub async fn resolve_conflicts(
        &mut self,
        payment: PaymentId,
        now: DateTime<Utc>,
    ) -> Result<u64> {
        let sql = "UPDATE evidence_conflicts SET resolved_at = $2 \
            WHERE payment_id = $1 AND resolved_at IS NULL";
        Ok(on_tx!(self, conn => sqlx::query(sql)
            .bind(DbId::from(payment))
            .bind(DbTime(now))
            .execute(&mut *conn)
            .await?
            .rows_affected()))
    }
}

impl Store {
    /// Conflicts not yet resolved, oldest first (the operators' list),
    /// through `evidence_conflicts_open` (with its always-true term,
    /// migration 0014, as the counts below).
    pub async fn open_conflicts_any_account(&self, limit: u32) -> Result<Vec<ConflictRow>> {
        let sql = format!(
            "SELECT {CONFLICT_COLUMNS} FROM evidence_conflicts WHERE resolved_at IS NULL \
             AND found_at IS NOT NULL ORDER BY found_at LIMIT $1"
        );
        Ok(on_pool!(self, pool => sqlx::query_as(&sql)
            .bind(i64::from(limit))
            .fetch_all(pool)
            .await?))
    }

    /// The oldest open conflict of `kind` kept on `attempt` (or, for a
    /// refund's attempt, on any attempt of its refund), if any.
    pub async fn open_conflict_of_attempt(
        &self,
        attempt: AttemptId,
        kind: ConflictKind,
    ) -> Result<Option<ConflictRow>> {
        let sql = open_of_attempt_sql();
        Ok(on_pool!(self, pool => sqlx::query_as(&sql)
            .bind(DbId::from(attempt))
            .bind(kind.as_str())
            .fetch_optional(pool)
            .await?))
    }

    /// Every conflict of one payment, oldest first.
    pub async fn conflicts_of_payment_any_account(
        &self,
        payment: PaymentId,
    ) -> Result<Vec<ConflictRow>> {
        let sql = format!(
            "SELECT {CONFLICT_COLUMNS} FROM evidence_conflicts WHERE payment_id = $1 \
             ORDER BY found_at"
        );
        Ok(on_pool!(self, pool => sqlx::query_as(&sql)
            .bind(DbId::from(payment))
            .fetch_all(pool)
            .await?))
    }

    /// Open conflicts per kind (for metrics).
    pub async fn open_conflict_counts(&self) -> Result<Vec<(String, i64)>> {
        let sql = "SELECT kind, COUNT(*) FROM evidence_conflicts WHERE resolved_at IS NULL \
            AND found_at IS NOT NULL GROUP BY kind ORDER BY kind";
        Ok(on_pool!(self, pool => sqlx::query_as(sql).fetch_all(pool).await?))
    }
}
