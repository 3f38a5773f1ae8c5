//! What the reconciler looks at. Each query starts from a partial index
//! whose size follows the uncertain items (attempts `unknown`/`reconciling`,
//! payments `capturing`/`canceling`/`requires_reconciliation`/`needs_review`,
//! refunds not settled), never from the whole payments table.

use crate::payments::{ATTEMPT_COLUMNS, PAYMENT_COLUMNS};
use crate::{AttemptRow, DbId, DbTime, PaymentRow, Result, Store, on_pool};
use chrono::{DateTime, Utc};
use cobro_core::{AttemptId, PaymentId};

impl Store {
    /// Attempts whose outcome the reconciler should establish:
    /// - every attempt handed over (`reconciling`);
    /// - `unknown` attempts not sent since `stuck_before`, and `pending`
    ///   ones sent before it and never recorded (a worker killed after the
    ///   call, its lease expired, maybe no worker left);
    /// - unresolved attempts of captures, voids and refunds whose payment or
    ///   refund has been waiting since before `stuck_before`.
    ///
    /// One page of at most `limit`, in id order after `after` (ids are
    /// time-ordered), so a caller can page through every candidate.
    /// `only_payment` narrows to one payment (`cobro reconcile --payment`).
    pub async fn reconcile_candidates(
        &self,
        stuck_before: DateTime<Utc>,
        only_payment: Option<PaymentId>,
        after: Option<AttemptId>,
        limit: u32,
    ) -> Result<Vec<AttemptRow>> {
        let columns = ATTEMPT_COLUMNS
            .split(", ")
            .map(|c| format!("a.{c}"))
            .collect::<Vec<_>>()
            .join(", ");
        let sql = format!(
            "SELECT {columns} FROM attempts a WHERE a.id IN ( \
                SELECT id FROM attempts WHERE state = 'reconciling' \
                UNION SELECT id FROM attempts WHERE state IN ('unknown', 'pending') AND last_send_at < $1 \
                UNION SELECT at.id FROM payments p JOIN attempts at ON at.payment_id = p.id \
                    WHERE p.status IN ('capturing', 'canceling') AND p.status_changed_at < $1 \
                    AND at.state IN ('pending', 'unknown', 'reconciling') \
                UNION SELECT at.id FROM refunds r JOIN attempts at ON at.refund_id = r.id \
                    WHERE r.status IN ('processing', 'requires_reconciliation', 'needs_review') \
                    AND r.status_changed_at < $1 AND at.state IN ('pending', 'unknown', 'reconciling') \
             ) AND ($2 IS NULL OR a.payment_id = $2) AND ($4 IS NULL OR a.id > $4) \
             ORDER BY a.id LIMIT $3"
        );
        Ok(on_pool!(self, pool => sqlx::query_as(&sql)
            .bind(DbTime(stuck_before))
            .bind(only_payment.map(DbId::from))
            .bind(i64::from(limit))
            .bind(after.map(DbId::from))
            .fetch_all(pool)
            .await?))
    }

    /// Payments in the given states that changed state before `before`,
    /// oldest first (the operators' view of what is uncertain and how old).
    pub async fn payments_in_states(
        &self,
        states: &[&str],
        before: DateTime<Utc>,
        limit: u32,
    ) -> Result<Vec<PaymentRow>> {
        // States are our own constants, never user text: the placeholders
        // are generated, the values bound.
        let placeholders = (0..states.len())
            .map(|i| format!("${}", i + 3))
            .collect::<Vec<_>>()
            .join(", ");
        let sql = format!(
            "SELECT {PAYMENT_COLUMNS} FROM payments WHERE status IN ({placeholders}) \
             AND status_changed_at < $1 ORDER BY status_changed_at LIMIT $2"
        );
        on_pool!(self, pool => {
            let mut q = sqlx::query_as(&sql).bind(DbTime(before)).bind(i64::from(limit));
            for s in states {
                q = q.bind(*s);
            }
            Ok(q.fetch_all(pool).await?)
        })
    }
}

/// How many payments sit in an unsettled status, and since when the oldest
/// one does (the figures an operator alerts on).
#[derive(Clone, Debug, sqlx::FromRow)]
pub struct UnsettledCount {
    pub status: String,
    pub count: i64,
    pub oldest: Option<DbTime>,
}

impl Store {
    /// Counts per unsettled status, read through the partial index
    /// `payments_unsettled` (cheap however large the table grows).
    pub async fn unsettled_counts(&self) -> Result<Vec<UnsettledCount>> {
        let sql = "SELECT status, COUNT(*) AS count, MIN(status_changed_at) AS oldest FROM payments \
            WHERE status IN ('processing', 'requires_reconciliation', 'needs_review', 'capturing', 'canceling') \
            GROUP BY status";
        Ok(on_pool!(self, pool => sqlx::query_as(sql).fetch_all(pool).await?))
    }
}
