//! Retention: full idempotency records become tombstones after
//! `retention`, tombstones disappear after `retention + tombstone_retention`,
//! processed webhook event ids after their own retention. Small batches, so
//! the purge never holds long locks; never a record younger than its cutoff.

use crate::{Backend, DbTime, Result, Store, on_pool};
use chrono::{DateTime, Utc};

impl Store {
    /// Compacts up to `batch` completed records created before `cutoff` into
    /// tombstones (scope, key, fingerprint, status and resource id are kept;
    /// the stored body goes). Returns how many it compacted.
    pub async fn compact_idempotency_records(
        &self,
        cutoff: DateTime<Utc>,
        batch: u32,
    ) -> Result<u64> {
        let pick = "SELECT account_id, operation, idempotency_key FROM idempotency_records \
            WHERE state = 'completed' AND created_at < $1 ORDER BY created_at LIMIT $2";
        self.purge_batch(
            &format!(
                "UPDATE idempotency_records SET state = 'tombstone', response_body = NULL \
                 WHERE (account_id, operation, idempotency_key) IN ({pick})"
            ),
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
        let pick = "SELECT account_id, operation, idempotency_key FROM idempotency_records \
            WHERE state = 'tombstone' AND created_at < $1 ORDER BY created_at LIMIT $2";
        self.purge_batch(
            &format!(
                "DELETE FROM idempotency_records \
                 WHERE (account_id, operation, idempotency_key) IN ({pick})"
            ),
            cutoff,
            batch,
        )
        .await
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
        let n = match &self.backend {
            Backend::Postgres(pool) => sqlx::query(sql)
                .bind(DbTime(cutoff))
                .bind(i64::from(batch))
                .execute(pool)
                .await?
                .rows_affected(),
            Backend::Sqlite(pool) => sqlx::query(sql)
                .bind(DbTime(cutoff))
                .bind(i64::from(batch))
                .execute(pool)
                .await?
                .rows_affected(),
        };
        Ok(n)
    }
}
