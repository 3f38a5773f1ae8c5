//! Retention (docs/http-api.md §8), shared by `cobro purge` and the scheduled
//! purge inside `cobro serve`: full idempotency records become tombstones
//! after `idempotency`, tombstones disappear after `idempotency +
//! tombstone`, processed webhook event ids after their own retention.
//!
//! Each kind of row is purged in batches of `batch` rows until a batch comes
//! back short, so no statement holds locks for long. The cutoffs are fixed
//! once at the start, so the loop ends even while new rows keep arriving, and
//! nothing younger than its retention is ever removed.

use crate::{DbTime, Result, Store, StoreError, on_pool, on_write_pool};
use chrono::{DateTime, Utc};
use std::fmt;
use std::future::Future;
use std::time::Duration;

/// The retention contract (docs/http-api.md §8).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Retention {
    /// How long a full idempotency record (stored response) is kept before
    /// it is compacted to a tombstone.
    pub idempotency: Duration,
    /// How long a tombstone is kept after that; then the key is new again.
    pub tombstone: Duration,
    /// How long processed provider webhook event ids are kept.
    pub webhook_event: Duration,
}

/// Why a purge did not run to its end.
#[derive(Debug, thiserror::Error)]
pub enum PurgeError {
    #[error("a retention of {0:?} is out of range")]
    RetentionOutOfRange(Duration),
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl Store {
    /// Compacts up to `batch` completed records created before `cutoff` into
    /// tombstones (scope, key, fingerprint, status and resource id are kept;
    /// the stored body goes). Returns how many it compacted.
    pub async fn compact_idempotency_records(
        &self,
        cutoff: DateTime<Utc>,
        batch: u32,
    ) -> Result<u64> {
        self.purge_idempotency(
            "completed",
            "UPDATE idempotency_records SET state = 'tombstone', response_body = NULL",
            cutoff,
            batch,
        )
        .await
    }

    /// Deletes up to `batch` tombstones created before `cutoff`.
    pub async fn delete_expired_tombstones(
        &self,
        cutoff: DateTime<Utc>,
        batch: u32,
    ) -> Result<u64> {
        self.purge_idempotency(
            "tombstone",
            "DELETE FROM idempotency_records",
            cutoff,
            batch,
        )
        .await
    }

    /// `action` (an UPDATE or DELETE of idempotency_records) on the oldest
    /// `batch` records in `state` created before `cutoff`.
    async fn purge_idempotency(
        &self,
        state: &str,
        action: &str,
        cutoff: DateTime<Utc>,
        batch: u32,
    ) -> Result<u64> {
        let sql = format!(
            "{action} WHERE (account_id, operation, idempotency_key) IN \
             (SELECT account_id, operation, idempotency_key FROM idempotency_records \
              WHERE state = '{state}' AND created_at < $1 ORDER BY created_at LIMIT $2)"
        );
        self.purge_batch(&sql, cutoff, batch).await
    }

    /// Deletes up to `batch` processed webhook event ids received before `cutoff`.
    pub async fn delete_expired_webhook_events(
        &self,
        cutoff: DateTime<Utc>,
        batch: u32,
    ) -> Result<u64> {
        let sql = "DELETE FROM webhook_events WHERE (provider, event_id) IN \
            (SELECT provider, event_id FROM webhook_events WHERE received_at < $1 \
             ORDER BY received_at LIMIT $2)";
        self.purge_batch(sql, cutoff, batch).await
    }

    /// What the three purges, run in order, would change now: (records to
    /// compact, tombstones to delete, webhook events to delete). A record
    /// past both cutoffs is compacted and then deleted by the same purge, so
    /// it counts in both. Reads only.
    pub async fn count_purgeable(
        &self,
        compact_before: DateTime<Utc>,
        tombstones_before: DateTime<Utc>,
        events_before: DateTime<Utc>,
    ) -> Result<(u64, u64, u64)> {
        let sql = "SELECT \
            (SELECT COUNT(*) FROM idempotency_records WHERE state = 'completed' AND created_at < $1), \
            (SELECT COUNT(*) FROM idempotency_records WHERE created_at < $2), \
            (SELECT COUNT(*) FROM webhook_events WHERE received_at < $3)";
        let (a, b, c): (i64, i64, i64) = on_pool!(self, pool => sqlx::query_as(sql)
            .bind(DbTime(compact_before))
            .bind(DbTime(tombstones_before))
            .bind(DbTime(events_before))
            .fetch_one(pool)
            .await?);
        let n = |v: i64| u64::try_from(v).unwrap_or_default();
        Ok((n(a), n(b), n(c)))
    }

    async fn purge_batch(&self, sql: &str, cutoff: DateTime<Utc>, batch: u32) -> Result<u64> {
        Ok(on_write_pool!(self, pool => sqlx::query(sql)
            .bind(DbTime(cutoff))
            .bind(i64::from(batch))
            .execute(pool)
            .await?
            .rows_affected()))
    }
}

/// How many rows one purge changed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PurgeReport {
    /// Full idempotency records compacted to tombstones.
    pub compacted: u64,
    /// Tombstones deleted (their keys are new again).
    pub tombstones_deleted: u64,
    /// Processed webhook event ids deleted.
    pub webhook_events_deleted: u64,
}

impl fmt::Display for PurgeReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "compacted {} idempotency records, deleted {} tombstones, deleted {} webhook events",
            self.compacted, self.tombstones_deleted, self.webhook_events_deleted
        )
    }
}

/// The three cutoffs of one purge as of `now`, fixed once.
struct Cutoffs {
    compact_before: DateTime<Utc>,
    tombstones_before: DateTime<Utc>,
    events_before: DateTime<Utc>,
}

impl Cutoffs {
    fn new(retention: &Retention, now: DateTime<Utc>) -> Result<Self, PurgeError> {
        Ok(Self {
            compact_before: cutoff(now, retention.idempotency)?,
            // A tombstone keeps its record's creation time, so its age is
            // counted from the original request: both retentions together.
            tombstones_before: cutoff(
                now,
                retention.idempotency.saturating_add(retention.tombstone),
            )?,
            events_before: cutoff(now, retention.webhook_event)?,
        })
    }
}

impl Store {
    /// What [`Store::purge`] would change as of `now`, counted and not
    /// changed (`cobro purge --dry-run`).
    pub async fn purge_count(
        &self,
        retention: &Retention,
        now: DateTime<Utc>,
    ) -> Result<PurgeReport, PurgeError> {
        let c = Cutoffs::new(retention, now)?;
        let (compacted, tombstones_deleted, webhook_events_deleted) = self
            .count_purgeable(c.compact_before, c.tombstones_before, c.events_before)
            .await?;
        Ok(PurgeReport {
            compacted,
            tombstones_deleted,
            webhook_events_deleted,
        })
    }

    /// Runs one full purge as of `now`, `batch` rows per statement.
    #[tracing::instrument(name = "purge.run", skip_all, fields(batch = batch))]
    pub async fn purge(
        &self,
        retention: &Retention,
        now: DateTime<Utc>,
        batch: u32,
    ) -> Result<PurgeReport, PurgeError> {
        let Cutoffs {
            compact_before,
            tombstones_before,
            events_before,
        } = Cutoffs::new(retention, now)?;
        let report = PurgeReport {
            compacted: drain(batch, || {
                self.compact_idempotency_records(compact_before, batch)
            })
            .await?,
            tombstones_deleted: drain(batch, || {
                self.delete_expired_tombstones(tombstones_before, batch)
            })
            .await?,
            webhook_events_deleted: drain(batch, || {
                self.delete_expired_webhook_events(events_before, batch)
            })
            .await?,
        };
        tracing::info!(
            compacted = report.compacted,
            tombstones_deleted = report.tombstones_deleted,
            webhook_events_deleted = report.webhook_events_deleted,
            "purge finished"
        );
        Ok(report)
    }
}

/// Repeats `step` until it changes fewer than `batch` rows; the total.
async fn drain<F, Fut>(batch: u32, mut step: F) -> Result<u64>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<u64>>,
{
    let mut total = 0;
    loop {
        let changed = step().await?;
        total += changed;
        if changed < u64::from(batch) {
            return Ok(total);
        }
    }
}

/// `now - age`; a retention too long to represent is a configuration error.
fn cutoff(now: DateTime<Utc>, age: Duration) -> Result<DateTime<Utc>, PurgeError> {
    chrono::Duration::from_std(age)
        .ok()
        .and_then(|age| now.checked_sub_signed(age))
        .ok_or(PurgeError::RetentionOutOfRange(age))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    #[tokio::test]
    async fn drain_repeats_full_batches_and_stops_at_the_first_short_one() {
        let answers = RefCell::new(vec![3, 3, 3, 1, 3]);
        let total = drain(3, || {
            let next = answers.borrow_mut().remove(0);
            async move { Ok(next) }
        })
        .await
        .expect("drains");
        assert_eq!(total, 10);
        assert_eq!(*answers.borrow(), vec![3], "stopped after the short batch");
    }

    #[test]
    fn cutoffs_are_now_minus_the_retention_and_refuse_overflow() {
        let now = DateTime::parse_from_rfc3339("2026-11-30T12:00:00Z")
            .expect("valid")
            .with_timezone(&Utc);
        let day = cutoff(now, Duration::from_secs(86_400)).expect("in range");
        assert_eq!(day.to_rfc3339(), "2026-11-29T12:00:00+00:00");
        assert!(cutoff(now, Duration::MAX).is_err());
    }
}
