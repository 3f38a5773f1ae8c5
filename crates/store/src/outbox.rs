//! The outbox: attempts waiting for the worker, leases and fencing tokens.
//!
//! A claim is one statement that takes due rows, bumps each row's
//! `lease_token` (the fencing token) and pushes `due_at` to the lease expiry.
//! Every later write by the worker names that token; a write with an older
//! token updates zero rows, which is how a worker learns it lost its lease.

use crate::payments::ATTEMPT_COLUMNS;
use crate::{AttemptRow, Backend, DbId, DbTime, Result, Store, WriteTx, on_pool, on_tx};
use chrono::{DateTime, Utc};
use cobro_core::{AttemptId, IntentId, Operation, OutboxId, PaymentId, RefundId};

/// An attempt to create with its outbox row, in the caller's transaction.
#[derive(Clone, Debug)]
pub struct NewAttempt {
    pub intent: IntentId,
    pub payment: PaymentId,
    pub refund: Option<RefundId>,
    pub operation: Operation,
    /// The provider idempotency key, generated before the first send and
    /// reused by every retry of this attempt.
    pub provider_key: String,
    /// The intent name, sent as the provider's merchant reference.
    pub reference: String,
}

/// A leased outbox row and the attempt it drives.
#[derive(Clone, Debug)]
pub struct Claim {
    pub outbox_id: OutboxId,
    /// The fencing token: every write for this claim is conditional on it.
    pub token: i64,
    pub lease_expires_at: DateTime<Utc>,
    pub attempt: AttemptRow,
}

#[derive(sqlx::FromRow)]
struct ClaimRow {
    outbox_id: DbId,
    lease_token: i64,
    lease_expires_at: DbTime,
    #[sqlx(flatten)]
    attempt: AttemptRow,
}

impl WriteTx {
    /// Inserts the attempt and its outbox row, due at `due_at`.
    pub async fn enqueue_attempt(
        &mut self,
        a: &NewAttempt,
        now: DateTime<Utc>,
        due_at: DateTime<Utc>,
    ) -> Result<AttemptRow> {
        let id = AttemptId::new();
        let attempt = format!(
            "INSERT INTO attempts (id, intent_id, payment_id, refund_id, operation, \
             provider_key, reference, state, created_at, updated_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, 'pending', $8, $8) RETURNING {ATTEMPT_COLUMNS}"
        );
        let row = on_tx!(self, conn => sqlx::query_as(&attempt)
            .bind(DbId::from(id))
            .bind(DbId::from(a.intent))
            .bind(DbId::from(a.payment))
            .bind(a.refund.map(DbId::from))
            .bind(a.operation.as_str())
            .bind(&a.provider_key)
            .bind(&a.reference)
            .bind(DbTime(now))
            .fetch_one(&mut *conn)
            .await?);
        let outbox = "INSERT INTO outbox (id, attempt_id, state, due_at, created_at, updated_at) \
            VALUES ($1, $2, 'pending', $3, $4, $4)";
        on_tx!(self, conn => sqlx::query(outbox)
            .bind(DbId::from(OutboxId::new()))
            .bind(DbId::from(id))
            .bind(DbTime(due_at))
            .bind(DbTime(now))
            .execute(&mut *conn)
            .await?
            .rows_affected());
        Ok(row)
    }

    /// Marks a claimed row done, fenced by its token. `false`: the lease was
    /// lost and nothing was written.
    pub async fn finish_outbox(
        &mut self,
        outbox: OutboxId,
        token: i64,
        now: DateTime<Utc>,
    ) -> Result<bool> {
        let sql = "UPDATE outbox SET state = 'done', lease_owner = NULL, lease_expires_at = NULL, \
            updated_at = $3 WHERE id = $1 AND lease_token = $2 AND state = 'pending'";
        let n = on_tx!(self, conn => sqlx::query(sql)
            .bind(DbId::from(outbox))
            .bind(token)
            .bind(DbTime(now))
            .execute(&mut *conn)
            .await?
            .rows_affected());
        Ok(n == 1)
    }
}

impl Store {
    /// Claims up to `limit` due rows for `owner` until `lease_until`.
    pub async fn claim_due(
        &self,
        owner: &str,
        now: DateTime<Utc>,
        lease_until: DateTime<Utc>,
        limit: u32,
    ) -> Result<Vec<Claim>> {
        let claimed = match &self.backend {
            // SKIP LOCKED: concurrent workers take disjoint rows without waiting.
            Backend::Postgres(pool) => sqlx::query(
                "UPDATE outbox o SET lease_owner = $1, lease_token = o.lease_token + 1, \
                 lease_expires_at = $3, due_at = $3, updated_at = $2 \
                 FROM (SELECT id FROM outbox WHERE state = 'pending' AND due_at <= $2 \
                       ORDER BY due_at LIMIT $4 FOR UPDATE SKIP LOCKED) due \
                 WHERE o.id = due.id",
            )
            .bind(owner)
            .bind(DbTime(now))
            .bind(DbTime(lease_until))
            .bind(i64::from(limit))
            .execute(pool)
            .await?
            .rows_affected(),
            // SQLite has one writer: the single UPDATE is the claim.
            Backend::Sqlite(pool) => sqlx::query(
                "UPDATE outbox SET lease_owner = $1, lease_token = lease_token + 1, \
                 lease_expires_at = $3, due_at = $3, updated_at = $2 \
                 WHERE id IN (SELECT id FROM outbox WHERE state = 'pending' AND due_at <= $2 \
                              ORDER BY due_at LIMIT $4)",
            )
            .bind(owner)
            .bind(DbTime(now))
            .bind(DbTime(lease_until))
            .bind(i64::from(limit))
            .execute(pool)
            .await?
            .rows_affected(),
        };
        if claimed == 0 {
            return Ok(Vec::new());
        }
        // The rows this claim leased are exactly those with this owner and
        // this lease expiry; reading them back joins the attempt, which the
        // UPDATE's RETURNING could not do on SQLite.
        let columns = ATTEMPT_COLUMNS
            .split(", ")
            .map(|c| format!("a.{c}"))
            .collect::<Vec<_>>()
            .join(", ");
        let sql = format!(
            "SELECT o.id AS outbox_id, o.lease_token, o.lease_expires_at, {columns} \
             FROM outbox o JOIN attempts a ON a.id = o.attempt_id \
             WHERE o.lease_owner = $1 AND o.lease_expires_at = $2 AND o.state = 'pending'"
        );
        let rows: Vec<ClaimRow> = on_pool!(self, pool => sqlx::query_as(&sql)
            .bind(owner)
            .bind(DbTime(lease_until))
            .fetch_all(pool)
            .await?);
        Ok(rows
            .into_iter()
            .map(|r| Claim {
                outbox_id: OutboxId::from_uuid(r.outbox_id.0),
                token: r.lease_token,
                lease_expires_at: r.lease_expires_at.0,
                attempt: r.attempt,
            })
            .collect())
    }

    /// Extends a lease (the heartbeat). `false`: the lease was lost (another
    /// worker claimed the row, or it is done); the worker must not send.
    pub async fn renew_lease(
        &self,
        outbox: OutboxId,
        token: i64,
        now: DateTime<Utc>,
        lease_until: DateTime<Utc>,
    ) -> Result<bool> {
        let sql = "UPDATE outbox SET lease_expires_at = $3, due_at = $3, updated_at = $4 \
            WHERE id = $1 AND lease_token = $2 AND state = 'pending'";
        let n = on_pool!(self, pool => sqlx::query(sql)
            .bind(DbId::from(outbox))
            .bind(token)
            .bind(DbTime(lease_until))
            .bind(DbTime(now))
            .execute(pool)
            .await?
            .rows_affected());
        Ok(n == 1)
    }

    /// Records one send of a claimed attempt, fenced by the token: the send
    /// count and the first/last send times drive the retention window.
    pub async fn record_send(&self, claim: &Claim, now: DateTime<Utc>) -> Result<bool> {
        let sql = "UPDATE attempts SET send_count = send_count + 1, \
            first_send_at = COALESCE(first_send_at, $3), last_send_at = $3, updated_at = $3 \
            WHERE id = $1 AND EXISTS (SELECT 1 FROM outbox o WHERE o.attempt_id = $1 \
              AND o.id = $2 AND o.lease_token = $4 AND o.state = 'pending')";
        let n = on_pool!(self, pool => sqlx::query(sql)
            .bind(claim.attempt.id)
            .bind(DbId::from(claim.outbox_id))
            .bind(DbTime(now))
            .bind(claim.token)
            .execute(pool)
            .await?
            .rows_affected());
        Ok(n == 1)
    }

    /// Keeps what a stale lease owner learned, for the reconciler.
    pub async fn record_observation(
        &self,
        attempt: AttemptId,
        token: i64,
        outcome: &str,
        detail: &str,
        now: DateTime<Utc>,
    ) -> Result<()> {
        let sql = "INSERT INTO attempt_observations (id, attempt_id, lease_token, outcome, detail, \
            observed_at) VALUES ($1, $2, $3, $4, $5, $6)";
        on_pool!(self, pool => sqlx::query(sql)
            .bind(DbId(uuid::Uuid::now_v7()))
            .bind(DbId::from(attempt))
            .bind(token)
            .bind(outcome)
            .bind(detail)
            .bind(DbTime(now))
            .execute(pool)
            .await?
            .rows_affected());
        Ok(())
    }

    pub async fn observations_for(&self, attempt: AttemptId) -> Result<Vec<(i64, String)>> {
        let sql = "SELECT lease_token, outcome FROM attempt_observations WHERE attempt_id = $1 \
            ORDER BY observed_at";
        Ok(on_pool!(self, pool => sqlx::query_as(sql)
            .bind(DbId::from(attempt))
            .fetch_all(pool)
            .await?))
    }
}
