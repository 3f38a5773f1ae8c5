//! What observability reads from the database: the snapshot `GET /metrics`
//! renders at scrape time (refunds unsettled, the outbox, attempts whose
//! outcome is unknown, by age), and the trace context an outbox row keeps,
//! for the spans that link back to the request that enqueued it.
//!
//! Every query here is a read and cheap: counts through the partial indexes
//! (`refunds_unsettled`, `outbox_due`, `attempts_uncertain`); they repeat
//! the always-true `... IS NOT NULL` terms of PostgreSQL's migrations 0013
//! and 0014 (SQLite's indexes lack them, and its planner still uses them),
//! and the unknown attempts' count states `attempts_uncertain`'s whole
//! predicate, which SQLite needs to use the index. tests/plans.rs checks
//! every plan of these on both stores.

use crate::reconcile::UNCERTAIN;
use crate::{DbId, DbTime, Result, Store, WriteTx, on_pool, on_tx};
use chrono::{DateTime, Utc};
use cobro_core::{AttemptId, RefundStatus};

/// Refunds in one unsettled status.
#[derive(Clone, Debug, sqlx::FromRow)]
pub struct RefundCount {
    pub status: RefundStatus,
    pub count: i64,
    pub oldest: Option<DbTime>,
}

/// The outbox: rows waiting (leased or not), rows due now, and the oldest
/// due time among those due (how far behind the workers are).
#[derive(Clone, Debug, Default)]
pub struct OutboxDepth {
    pub pending: i64,
    pub due: i64,
    pub oldest_due: Option<DateTime<Utc>>,
}

/// The age buckets of attempts whose outcome is unknown (states `unknown`
/// and `reconciling`), by time since their first send: label, upper bound.
pub const UNKNOWN_AGE_BUCKETS: [(&str, chrono::TimeDelta); 4] = [
    ("0s-1m", chrono::TimeDelta::minutes(1)),
    ("1m-10m", chrono::TimeDelta::minutes(10)),
    ("10m-1h", chrono::TimeDelta::hours(1)),
    ("1h-24h", chrono::TimeDelta::hours(24)),
];
/// The bucket past the last bound.
pub const UNKNOWN_AGE_OVERFLOW: &str = "24h+";

/// Attempts whose outcome is unknown: how many in each age bucket (in the
/// order of [`UNKNOWN_AGE_BUCKETS`], then the overflow), and since when the
/// oldest is uncertain.
#[derive(Clone, Debug, Default)]
pub struct UnknownAttempts {
    pub by_age: Vec<(&'static str, i64)>,
    pub oldest: Option<DateTime<Utc>>,
}

/// An outbox row's stored trace context.
pub type TraceColumns = (Option<String>, Option<String>);

impl Store {
    /// Counts per unsettled refund status, through `refunds_unsettled`
    /// (the always-true term is the index's, migration 0014).
    pub async fn refund_unsettled_counts(&self) -> Result<Vec<RefundCount>> {
        let sql = format!(
            "SELECT status, COUNT(*) AS count, MIN(status_changed_at) AS oldest FROM refunds \
             WHERE status IN ({}) AND status_changed_at IS NOT NULL GROUP BY status",
            crate::sql_names(RefundStatus::UNSETTLED.iter().map(RefundStatus::as_str))
        );
        Ok(on_pool!(self, pool => sqlx::query_as(&sql).fetch_all(pool).await?))
    }

    pub async fn outbox_depth(&self, now: DateTime<Utc>) -> Result<OutboxDepth> {
        let sql = "SELECT COUNT(*), \
            COALESCE(SUM(CASE WHEN due_at <= $1 THEN 1 ELSE 0 END), 0), \
            MIN(CASE WHEN due_at <= $1 THEN due_at END) \
            FROM outbox WHERE state = 'pending' AND due_at IS NOT NULL";
        let (pending, due, oldest): (i64, i64, Option<DbTime>) = on_pool!(self, pool => sqlx::query_as(sql)
                .bind(DbTime(now))
                .fetch_one(pool)
                .await?);
        Ok(OutboxDepth {
            pending,
            due,
            oldest_due: oldest.map(|t| t.0),
        })
    }

    pub async fn unknown_attempts(&self, now: DateTime<Utc>) -> Result<UnknownAttempts> {
        // One pass: a row counts in the first bucket whose bound it is
        // younger than.
        let [b1, b2, b3, b4] = UNKNOWN_AGE_BUCKETS.map(|(_, bound)| DbTime(now - bound));
        // `UNCERTAIN` first, as the index states it: with only the two
        // states, SQLite read every attempt (tests/plans.rs).
        let sql = format!(
            "SELECT \
            COALESCE(SUM(CASE WHEN s > $1 THEN 1 ELSE 0 END), 0), \
            COALESCE(SUM(CASE WHEN s <= $1 AND s > $2 THEN 1 ELSE 0 END), 0), \
            COALESCE(SUM(CASE WHEN s <= $2 AND s > $3 THEN 1 ELSE 0 END), 0), \
            COALESCE(SUM(CASE WHEN s <= $3 AND s > $4 THEN 1 ELSE 0 END), 0), \
            COALESCE(SUM(CASE WHEN s <= $4 THEN 1 ELSE 0 END), 0), \
            MIN(s) \
            FROM (SELECT COALESCE(first_send_at, created_at) AS s FROM attempts \
                  WHERE {UNCERTAIN} AND state IN ('unknown', 'reconciling')) u"
        );
        let row: (i64, i64, i64, i64, i64, Option<DbTime>) = on_pool!(self, pool => sqlx::query_as(&sql)
                .bind(b1)
                .bind(b2)
                .bind(b3)
                .bind(b4)
                .fetch_one(pool)
                .await?);
        let labels = UNKNOWN_AGE_BUCKETS.map(|(label, _)| label);
        Ok(UnknownAttempts {
            by_age: vec![
                (labels[0], row.0),
                (labels[1], row.1),
                (labels[2], row.2),
                (labels[3], row.3),
                (UNKNOWN_AGE_OVERFLOW, row.4),
            ],
            oldest: row.5.map(|t| t.0),
        })
    }

    /// The trace context kept by the outbox row of an attempt (none for a
    /// held attempt, or when tracing was off).
    pub async fn trace_context_of(&self, attempt: AttemptId) -> Result<TraceColumns> {
        let sql = "SELECT traceparent, tracestate FROM outbox WHERE attempt_id = $1";
        let found: Option<TraceColumns> = on_pool!(self, pool => sqlx::query_as(sql)
            .bind(DbId::from(attempt))
            .fetch_optional(pool)
            .await?);
        Ok(found.unwrap_or_default())
    }
}

impl WriteTx {
    /// [`Store::trace_context_of`], inside this transaction.
    pub async fn trace_context_of(&mut self, attempt: AttemptId) -> Result<TraceColumns> {
        let sql = "SELECT traceparent, tracestate FROM outbox WHERE attempt_id = $1";
        let found: Option<TraceColumns> = on_tx!(self, conn => sqlx::query_as(sql)
            .bind(DbId::from(attempt))
            .fetch_optional(&mut *conn)
            .await?);
        Ok(found.unwrap_or_default())
    }
}
