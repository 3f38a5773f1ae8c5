//! What the reconciler looks at. Each query starts from a partial index
//! whose size follows the uncertain items (attempts `unknown`/`reconciling`,
//! payments `capturing`/`canceling`/`requires_reconciliation`/`needs_review`,
//! refunds not settled), never from the whole payments table.

use crate::payments::{ATTEMPT_COLUMNS, PAYMENT_COLUMNS};
use crate::{
    AttemptRow, DbId, DbTime, PaymentRow, Result, Store, UnreadableAttempt, decode_attempt, on_pool,
};
use chrono::{DateTime, Utc};
use cobro_core::{AttemptId, PaymentId, PaymentStatus, RefundStatus};

/// The predicate of the partial index `attempts_uncertain` as PostgreSQL's
/// migration 0013 writes it. Its always-true `created_at IS NOT NULL` is
/// what a look-up by key never says, so only the queries that repeat it
/// can use the index (the migration says why). SQLite's index keeps 0004's
/// predicate without the term, which this one still implies. SQLite uses a
/// partial index only for a query that states its predicate, so a query
/// that wants some of those states states all of this and then narrows
/// (the unknown attempts' count in observe.rs).
pub(crate) const UNCERTAIN: &str =
    "state IN ('pending', 'unknown', 'reconciling') AND created_at IS NOT NULL";

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
    /// Each row is decoded on its own: one that does not decode is an
    /// [`UnreadableAttempt`] in its place, so the caller reports it and the
    /// page (and its cursor) goes on past it.
    pub async fn reconcile_candidates_any_account(
        &self,
        stuck_before: DateTime<Utc>,
        only_payment: Option<PaymentId>,
        after: Option<AttemptId>,
        limit: u32,
    ) -> Result<Vec<Result<AttemptRow, UnreadableAttempt>>> {
        self.reconcile_candidates_of(stuck_before, only_payment, after, limit, None)
            .await
    }

    /// [`reconcile_candidates_any_account`](Self::reconcile_candidates_any_account)
    /// of one provider's attempts only (`None`: every provider's): each
    /// provider's reconciler asks the provider that got the calls.
    pub async fn reconcile_candidates_of(
        &self,
        stuck_before: DateTime<Utc>,
        only_payment: Option<PaymentId>,
        after: Option<AttemptId>,
        limit: u32,
        provider: Option<&crate::ProviderScope>,
    ) -> Result<Vec<Result<AttemptRow, UnreadableAttempt>>> {
        let columns = crate::payments::qualified(ATTEMPT_COLUMNS, "a");
        // The first two arms repeat the predicate of the partial index
        // `attempts_uncertain` word for word: SQLite uses a partial index
        // only when the query's WHERE has its predicate as a term (it does
        // not infer it from `state = 'reconciling'`), and without it scans
        // every attempt (ops/bench/flat.sh); PostgreSQL needs no such help.
        let sql = format!(
            "SELECT {columns} FROM attempts a WHERE a.id IN ( \
                SELECT id FROM attempts WHERE {UNCERTAIN} AND state = 'reconciling' \
                UNION SELECT id FROM attempts WHERE {UNCERTAIN} \
                    AND state IN ('unknown', 'pending') AND last_send_at < $1 \
                UNION SELECT at.id FROM payments p JOIN attempts at ON at.payment_id = p.id \
                    WHERE p.status IN ('capturing', 'canceling') AND p.status_changed_at < $1 \
                    AND at.state IN ('pending', 'unknown', 'reconciling') \
                UNION SELECT at.id FROM refunds r JOIN attempts at ON at.refund_id = r.id \
                    WHERE r.status IN ({refunds_unsettled}) \
                    AND r.status_changed_at < $1 AND at.state IN ('pending', 'unknown', 'reconciling') \
             ) AND ($2 IS NULL OR a.payment_id = $2) AND ($4 IS NULL OR a.id > $4) \
             AND {of_provider} ORDER BY a.id LIMIT $3",
            refunds_unsettled =
                crate::sql_names(RefundStatus::UNSETTLED.iter().map(RefundStatus::as_str)),
            of_provider = crate::outbox::provider_clause(5, 6),
        );
        on_pool!(self, pool => sqlx::query(&sql)
            .bind(DbTime(stuck_before))
            .bind(only_payment.map(DbId::from))
            .bind(i64::from(limit))
            .bind(after.map(DbId::from))
            .bind(provider.map(|p| p.name.as_str()))
            .bind(provider.is_some_and(|p| p.is_default))
            .fetch_all(pool)
            .await?
            .iter()
            .map(decode_attempt)
            .collect())
    }

    /// The operators' view (`cobro payments list`): payments matching
    /// `query`, longest in their status first. With no status filter it
    /// reads the whole table (bounded by the time filters and the limit);
    /// with the unsettled statuses it starts from their partial index.
    pub async fn payments_any_account(&self, query: &OperatorQuery<'_>) -> Result<Vec<PaymentRow>> {
        // Statuses are checked names, never free text: the placeholders
        // are generated, the values bound.
        let status_clause = match query.statuses {
            Some(states) => {
                let placeholders = (0..states.len())
                    .map(|i| format!("${}", i + 5))
                    .collect::<Vec<_>>()
                    .join(", ");
                // The always-true term is `payments_unsettled`'s (migration
                // 0014): the list by status may read that index.
                format!("status IN ({placeholders}) AND status_changed_at IS NOT NULL AND ")
            }
            None => String::new(),
        };
        let sql = format!(
            "SELECT {PAYMENT_COLUMNS} FROM payments WHERE {status_clause}\
             ($1 IS NULL OR created_at >= $1) AND ($2 IS NULL OR created_at < $2) \
             AND ($3 IS NULL OR status_changed_at < $3) \
             ORDER BY status_changed_at, id LIMIT $4"
        );
        on_pool!(self, pool => {
            let mut q = sqlx::query_as(&sql)
                .bind(query.created_from.map(DbTime))
                .bind(query.created_until.map(DbTime))
                .bind(query.in_status_before.map(DbTime))
                .bind(i64::from(query.limit));
            for s in query.statuses.unwrap_or_default() {
                q = q.bind(*s);
            }
            Ok(q.fetch_all(pool).await?)
        })
    }
}

/// What `cobro payments list` asks for.
#[derive(Clone, Debug, Default)]
pub struct OperatorQuery<'a> {
    /// Only these statuses; `None`: every status.
    pub statuses: Option<&'a [PaymentStatus]>,
    /// Created at or after this.
    pub created_from: Option<DateTime<Utc>>,
    /// Created before this.
    pub created_until: Option<DateTime<Utc>>,
    /// In their current status since before this.
    pub in_status_before: Option<DateTime<Utc>>,
    pub limit: u32,
}

/// How many payments sit in an unsettled status, and since when the oldest
/// one does (the figures an operator alerts on).
#[derive(Clone, Debug, sqlx::FromRow)]
pub struct UnsettledCount {
    pub status: PaymentStatus,
    pub count: i64,
    pub oldest: Option<DbTime>,
}

impl Store {
    /// Counts per unsettled status, read through the partial index
    /// `payments_unsettled` (cheap however large the table grows; the
    /// always-true term is the index's, migration 0014).
    pub async fn unsettled_counts(&self) -> Result<Vec<UnsettledCount>> {
        let sql = format!(
            "SELECT status, COUNT(*) AS count, MIN(status_changed_at) AS oldest FROM payments \
             WHERE status IN ({}) AND status_changed_at IS NOT NULL GROUP BY status",
            crate::sql_names(PaymentStatus::UNSETTLED.iter().map(PaymentStatus::as_str))
        );
        Ok(on_pool!(self, pool => sqlx::query_as(&sql).fetch_all(pool).await?))
    }
}

impl Store {
    /// Authorisations waiting for their customer (3-D Secure) that the
    /// reconciler reads by their provider id: the attempt
    /// (`awaiting_customer`) of each payment in `requires_action` whose
    /// status is older than `changed_before` (the webhook's chance first),
    /// oldest first, at most `limit`, of `provider`'s attempts only (all
    /// when `None`). Read through `payments_unsettled`.
    pub async fn waiting_for_customers(
        &self,
        changed_before: DateTime<Utc>,
        limit: u32,
        provider: Option<&crate::ProviderScope>,
    ) -> Result<Vec<AttemptRow>> {
        // The payments first, through `payments_unsettled` (SQLite uses a
        // partial index only when the WHERE repeats its predicate word for
        // word), then their attempts by `attempts_by_payment`: never a scan
        // of either table.
        let sql = format!(
            "SELECT {} FROM attempts a WHERE a.payment_id IN ( \
                SELECT id FROM payments WHERE status IN ({}) \
                AND status_changed_at IS NOT NULL AND status = 'requires_action' \
                AND status_changed_at < $1 ORDER BY status_changed_at, id LIMIT $2 \
             ) AND a.state = 'awaiting_customer' AND {} ORDER BY a.payment_id",
            crate::payments::qualified(ATTEMPT_COLUMNS, "a"),
            crate::sql_names(PaymentStatus::UNSETTLED.iter().map(PaymentStatus::as_str)),
            crate::outbox::provider_clause(3, 4),
        );
        Ok(on_pool!(self, pool => sqlx::query_as(&sql)
            .bind(DbTime(changed_before))
            .bind(i64::from(limit))
            .bind(provider.map(|p| p.name.as_str()))
            .bind(provider.is_some_and(|p| p.is_default))
            .fetch_all(pool)
            .await?))
    }
}
