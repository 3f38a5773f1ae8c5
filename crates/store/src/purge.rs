//! Retention: full idempotency records become tombstones after
//! `retention`, tombstones disappear after `retention + tombstone_retention`,
//! processed webhook event ids after their own retention. Small batches, so
//! the purge never holds long locks; never a record younger than its cutoff.

use crate::{Backend, DbTime, Result, Store};
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
