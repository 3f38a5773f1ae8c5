//! The outbox: attempts waiting for the worker, leases and fencing tokens.
//!
//! A claim is one statement that takes due rows, bumps each row's
//! `lease_token` (the fencing token) and pushes `due_at` to the lease expiry.
//! Every later write by the worker names that token; a write with an older
//! token updates zero rows, which is how a worker learns it lost its lease.

use crate::payments::{ATTEMPT_COLUMNS, Scope, attempts_of_payment};
use crate::{
    AttemptRow, Backend, DbId, DbTime, Result, Store, UnreadableAttempt, WriteTx, decode_attempt,
    on_pool, on_tx, on_write_pool,
};
use chrono::{DateTime, Utc};
use cobro_core::{
    AccountId, AttemptId, AttemptState, IntentId, Operation, OutboxId, PaymentId, RefundId,
};
use sqlx::Row;

/// An attempt to create with its outbox row, in the caller's transaction.
#[derive(Clone, Debug)]
pub struct NewAttempt {
    /// Chosen by the caller: the attempt's reference embeds it.
    pub id: AttemptId,
    pub intent: IntentId,
    pub payment: PaymentId,
    pub refund: Option<RefundId>,
    pub operation: Operation,
    /// The provider idempotency key, generated before the first send and
    /// reused by every retry of this attempt.
    pub provider_key: String,
    /// The provider's merchant reference,
    /// [`cobro_core::attempt_reference`] of the intent name and `id`.
    pub reference: String,
}

/// What the fenced "sent" mark found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SendMark {
    /// Recorded: the call may go out.
    Marked,
    /// Another worker holds the row now: do not send.
    LeaseLost,
    /// The attempt was settled meanwhile (reconciler, webhook): do not send.
    Settled,
    /// Its payment or refund is `requires_reconciliation` or `needs_review`:
    /// no new send until that is resolved.
    Blocked,
}

/// A leased outbox row and the attempt it drives.
#[derive(Clone, Debug)]
pub struct Claim {
    pub outbox_id: OutboxId,
    /// The fencing token: every write for this claim is conditional on it.
    pub token: i64,
    pub lease_expires_at: DateTime<Utc>,
    pub attempt: AttemptRow,
    /// The W3C trace context of whatever enqueued the row (`traceparent`,
    /// `tracestate`), for the worker's span; `None` when tracing was off.
    pub traceparent: Option<String>,
    pub tracestate: Option<String>,
}

/// What one claim took: the rows it leased and could read, and those it
/// leased but could not decode. An unreadable row stays leased (it is
/// never sent) and comes back when its lease expires, to be reported again.
#[derive(Debug, Default)]
pub struct Claimed {
    pub claims: Vec<Claim>,
    pub unreadable: Vec<UnreadableClaim>,
}

impl Claimed {
    /// Every row the claim leased, readable or not.
    pub fn leased(&self) -> usize {
        self.claims.len() + self.unreadable.len()
    }

    /// Adds one leased row (its outbox columns and its attempt's): a
    /// claim, or an unreadable one when the attempt does not decode.
    fn push<'r, R>(&mut self, row: &'r R) -> Result<()>
    where
        R: sqlx::Row,
        ClaimRow: sqlx::FromRow<'r, R>,
        OutboxId: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
        AttemptId: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
        PaymentId: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
        i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
        &'static str: sqlx::ColumnIndex<R>,
    {
        match decode_attempt::<_, ClaimRow>(row)? {
            Ok(r) => self.claims.push(Claim {
                outbox_id: r.outbox_id,
                token: r.lease_token,
                lease_expires_at: r.lease_expires_at.0,
                attempt: r.attempt,
                traceparent: r.traceparent,
                tracestate: r.tracestate,
            }),
            Err(attempt) => self.unreadable.push(UnreadableClaim {
                outbox_id: row.try_get("outbox_id")?,
                token: row.try_get("lease_token")?,
                attempt,
            }),
        }
        Ok(())
    }
}

/// A row leased by a claim whose attempt could not be decoded.
#[derive(Debug)]
pub struct UnreadableClaim {
    pub outbox_id: OutboxId,
    pub token: i64,
    pub attempt: UnreadableAttempt,
}

#[derive(sqlx::FromRow)]
struct ClaimRow {
    outbox_id: OutboxId,
    lease_token: i64,
    lease_expires_at: DbTime,
    traceparent: Option<String>,
    tracestate: Option<String>,
    #[sqlx(flatten)]
    attempt: AttemptRow,
}

impl WriteTx {
    /// A pending outbox row for `attempt`, due at `due_at`, carrying the
    /// current trace context (so the worker's span continues the request's
    /// trace).
    async fn insert_outbox_row(
        &mut self,
        attempt: AttemptId,
        due_at: DateTime<Utc>,
        now: DateTime<Utc>,
    ) -> Result<()> {
        let outbox = "INSERT INTO outbox (id, attempt_id, state, due_at, created_at, updated_at, \
            traceparent, tracestate, account_id) VALUES ($1, $2, 'pending', $3, $4, $4, $5, $6, \
            (SELECT account_id FROM attempts WHERE id = $2))";
        let trace = cobro_telemetry::current_context();
        on_tx!(self, conn => sqlx::query(outbox)
            .bind(DbId::from(OutboxId::new()))
            .bind(DbId::from(attempt))
            .bind(DbTime(due_at))
            .bind(DbTime(now))
            .bind(trace.as_ref().map(|t| t.traceparent.as_str()))
            .bind(trace.as_ref().and_then(|t| t.tracestate.as_deref()))
            .execute(&mut *conn)
            .await?
            .rows_affected());
        self.note_enqueued();
        Ok(())
    }

    /// Inserts the attempt and its outbox row, due at `due_at`.
    pub async fn enqueue_attempt(
        &mut self,
        a: &NewAttempt,
        now: DateTime<Utc>,
        due_at: DateTime<Utc>,
    ) -> Result<AttemptRow> {
        let id = a.id;
        let row = self.insert_attempt(a, AttemptState::Pending, now).await?;
        self.insert_outbox_row(id, due_at, now).await?;
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

impl WriteTx {
    /// Inserts an attempt that may not be sent yet (`held`), without an
    /// outbox row: a cancel asked for while the authorisation is unknown.
    pub async fn hold_attempt(&mut self, a: &NewAttempt, now: DateTime<Utc>) -> Result<AttemptRow> {
        self.insert_attempt(a, AttemptState::Held, now).await
    }

    async fn insert_attempt(
        &mut self,
        a: &NewAttempt,
        state: AttemptState,
        now: DateTime<Utc>,
    ) -> Result<AttemptRow> {
        // The provider (and the account) are the payment's, copied by the
        // statement itself: whatever the caller knows, a capture, void,
        // refund or retry goes where its payment went.
        let sql = format!(
            "INSERT INTO attempts (id, intent_id, payment_id, refund_id, operation, \
             provider_key, reference, state, created_at, updated_at, provider, account_id) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $9, \
             (SELECT provider FROM payments WHERE id = $3), \
             (SELECT account_id FROM payments WHERE id = $3)) RETURNING {ATTEMPT_COLUMNS}"
        );
        Ok(on_tx!(self, conn => sqlx::query_as(&sql)
            .bind(DbId::from(a.id))
            .bind(DbId::from(a.intent))
            .bind(DbId::from(a.payment))
            .bind(a.refund.map(DbId::from))
            .bind(a.operation.as_str())
            .bind(&a.provider_key)
            .bind(&a.reference)
            .bind(state.as_str())
            .bind(DbTime(now))
            .fetch_one(&mut *conn)
            .await?))
    }

    /// The held attempts of a payment (at most one per intent).
    pub async fn held_attempts_any_account(
        &mut self,
        payment: PaymentId,
    ) -> Result<Vec<AttemptRow>> {
        let sql = attempts_of_payment(Scope::AnyAccount, Some(AttemptState::Held));
        Ok(on_tx!(self, conn => sqlx::query_as(&sql)
            .bind(DbId::from(payment))
            .fetch_all(&mut *conn)
            .await?))
    }

    /// The held attempts of a payment of this account; another account's
    /// payment has none.
    pub async fn held_attempts_for_account(
        &mut self,
        account: AccountId,
        payment: PaymentId,
    ) -> Result<Vec<AttemptRow>> {
        let sql = attempts_of_payment(Scope::ForAccount, Some(AttemptState::Held));
        Ok(on_tx!(self, conn => sqlx::query_as(&sql)
            .bind(DbId::from(payment))
            .bind(DbId::from(account))
            .fetch_all(&mut *conn)
            .await?))
    }

    /// Makes a held attempt sendable: `pending` with its outbox row, due
    /// now. `false`: it was no longer held.
    pub async fn release_held(&mut self, attempt: AttemptId, now: DateTime<Utc>) -> Result<bool> {
        let sql = "UPDATE attempts SET state = 'pending', updated_at = $2 \
            WHERE id = $1 AND state = 'held'";
        let n = on_tx!(self, conn => sqlx::query(sql)
            .bind(DbId::from(attempt))
            .bind(DbTime(now))
            .execute(&mut *conn)
            .await?
            .rows_affected());
        if n != 1 {
            return Ok(false);
        }
        self.insert_outbox_row(attempt, now, now).await?;
        Ok(true)
    }

    /// Closes the outbox row of an attempt someone other than its worker
    /// settled (the reconciler, a webhook, an operator): a worker that
    /// claims it later finds nothing to do. No fencing token: the attempt
    /// is settled whoever holds the row.
    pub async fn close_outbox_of(&mut self, attempt: AttemptId, now: DateTime<Utc>) -> Result<()> {
        let sql = "UPDATE outbox SET state = 'done', lease_owner = NULL, lease_expires_at = NULL, \
            updated_at = $2 WHERE attempt_id = $1 AND state = 'pending'";
        on_tx!(self, conn => sqlx::query(sql)
            .bind(DbId::from(attempt))
            .bind(DbTime(now))
            .execute(&mut *conn)
            .await?
            .rows_affected());
        Ok(())
    }
}

impl WriteTx {
    /// Records what the provider said about the last call of `attempt`
    /// (its request id, whether the answer was replayed). Call it in the
    /// transaction whose fenced write records the outcome, so both land or
    /// neither does.
    pub async fn record_call(
        &mut self,
        attempt: AttemptId,
        request_id: Option<&str>,
        replayed: bool,
    ) -> Result<()> {
        let sql = "UPDATE attempts SET provider_request_id = COALESCE($2, provider_request_id), \
            provider_replayed = $3 WHERE id = $1";
        on_tx!(self, conn => sqlx::query(sql)
            .bind(DbId::from(attempt))
            .bind(request_id)
            .bind(replayed)
            .execute(&mut *conn)
            .await?
            .rows_affected());
        Ok(())
    }
}

/// Which provider's attempts a worker claims or a reconciler examines:
/// those naming `name` and, for the default provider, those naming none
/// (rows older than migration 0010, or payments created without a default).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProviderScope {
    pub name: String,
    pub is_default: bool,
}

/// `(a.provider = $name OR (a.provider IS NULL AND $is_default))`, or
/// anything when `$name` is NULL: the SQL of [`ProviderScope`] over an
/// attempts table aliased `a`, with its two placeholders.
pub(crate) fn provider_clause(name: usize, is_default: usize) -> String {
    format!("(${name} IS NULL OR a.provider = ${name} OR (a.provider IS NULL AND ${is_default}))")
}

impl Store {
    /// Claims up to `limit` due rows of any provider for `owner` until
    /// `lease_until`.
    pub async fn claim_due(
        &self,
        owner: &str,
        now: DateTime<Utc>,
        lease_until: DateTime<Utc>,
        limit: u32,
    ) -> Result<Claimed> {
        self.claim_due_for(owner, now, lease_until, limit, None)
            .await
    }

    /// Claims up to `limit` due rows for `owner` until `lease_until`: only
    /// `provider`'s attempts when one is given (each provider has its own
    /// worker, key window and retry budget), still in one statement.
    #[tracing::instrument(
        name = "outbox.claim",
        skip_all,
        fields(owner, limit, claimed = tracing::field::Empty)
    )]
    pub async fn claim_due_for(
        &self,
        owner: &str,
        now: DateTime<Utc>,
        lease_until: DateTime<Utc>,
        limit: u32,
        provider: Option<&ProviderScope>,
    ) -> Result<Claimed> {
        let of_provider = format!(
            "EXISTS (SELECT 1 FROM attempts a WHERE a.id = outbox.attempt_id AND {})",
            provider_clause(5, 6)
        );
        let columns = ATTEMPT_COLUMNS
            .split(", ")
            .map(|c| format!("a.{c}"))
            .collect::<Vec<_>>()
            .join(", ");
        let mut claimed = Claimed::default();
        let pool = match &self.backend {
            // One statement: the claim (SKIP LOCKED: concurrent workers take
            // disjoint rows without waiting) and, joined to the rows it
            // leased, their attempts. The outbox rows are the versions this
            // statement wrote, so they are ours by construction; the
            // attempts are read in the statement's snapshot, from just
            // before the rows were locked (reading them back afterwards saw
            // a moment later; neither is a lock). Whether a send may happen
            // is decided by `record_send`, which re-reads the attempt's
            // state and its payment's under the lease. What the worker
            // takes from this read alone is `send_count` and
            // `first_send_at`: a stale owner's send mark committing during
            // this statement shows as one send fewer (the retry budget and
            // backoff count it late; the key window moves by at most this
            // statement's duration). One round trip and one pool checkout
            // fewer per claim than reading the claim back.
            //
            // `due` is MATERIALIZED: evaluated once. As a subquery in FROM,
            // PostgreSQL may put it on the inner side of a nested loop (it
            // did with statistics taken while the outbox held one row) and
            // run it again for each outbox row; each run skips the rows the
            // last one locked and updated, so a claim of limit 1 leased every
            // due row (`store_conformance`, `a_claim_takes_at_most_its_limit_...`).
            Backend::Postgres(pool) => pool,
            Backend::Sqlite(_) => {
                let shape = (of_provider.as_str(), columns.as_str());
                return self
                    .claim_due_sqlite(owner, now, lease_until, limit, provider, shape)
                    .await;
            }
        };
        let sql = format!(
            "WITH due AS MATERIALIZED (SELECT id FROM outbox WHERE state = 'pending' \
             AND due_at <= $2 AND {of_provider} \
             ORDER BY due_at LIMIT $4 FOR UPDATE SKIP LOCKED), \
             leased AS (UPDATE outbox o SET lease_owner = $1, lease_token = o.lease_token + 1, \
             lease_expires_at = $3, due_at = $3, updated_at = $2 \
             FROM due WHERE o.id = due.id \
             RETURNING o.id, o.lease_token, o.lease_expires_at, o.traceparent, o.tracestate, o.attempt_id) \
             SELECT l.id AS outbox_id, l.lease_token, l.lease_expires_at, l.traceparent, \
             l.tracestate, {columns} FROM leased l JOIN attempts a ON a.id = l.attempt_id"
        );
        let rows = sqlx::query(&sql)
            .bind(owner)
            .bind(DbTime(now))
            .bind(DbTime(lease_until))
            .bind(i64::from(limit))
            .bind(provider.map(|p| p.name.as_str()))
            .bind(provider.is_some_and(|p| p.is_default))
            .fetch_all(pool)
            .await?;
        tracing::Span::current().record("claimed", rows.len());
        // Row by row: one attempt that does not decode fails only itself,
        // never the batch this claim has already leased.
        for row in rows {
            claimed.push(&row)?;
        }
        Ok(claimed)
    }

    /// SQLite's claim (`of_provider` and `columns` as in
    /// [`Store::claim_due_for`]): one writer, so the single UPDATE is the
    /// claim; the rows it leased are then read back by their (row, fencing token)
    /// pairs, never by owner and expiry (two claims in one instant would
    /// share those). SQLite has no data-modifying CTE to do it in one.
    async fn claim_due_sqlite(
        &self,
        owner: &str,
        now: DateTime<Utc>,
        lease_until: DateTime<Utc>,
        limit: u32,
        provider: Option<&ProviderScope>,
        (of_provider, columns): (&str, &str),
    ) -> Result<Claimed> {
        let sql = format!(
            "UPDATE outbox SET lease_owner = $1, lease_token = lease_token + 1, \
             lease_expires_at = $3, due_at = $3, updated_at = $2 \
             WHERE id IN (SELECT id FROM outbox WHERE state = 'pending' AND due_at <= $2 \
                          AND {of_provider} \
                          ORDER BY due_at LIMIT $4) RETURNING id, lease_token"
        );
        let leased: Vec<(DbId, i64)> = on_write_pool!(self, pool => sqlx::query_as(&sql)
            .bind(owner)
            .bind(DbTime(now))
            .bind(DbTime(lease_until))
            .bind(i64::from(limit))
            .bind(provider.map(|p| p.name.as_str()))
            .bind(provider.is_some_and(|p| p.is_default))
            .fetch_all(pool)
            .await?);
        tracing::Span::current().record("claimed", leased.len());
        if leased.is_empty() {
            return Ok(Claimed::default());
        }
        let placeholders = (1..=leased.len())
            .map(|i| format!("${i}"))
            .collect::<Vec<_>>()
            .join(", ");
        let sql = format!(
            "SELECT o.id AS outbox_id, o.lease_token, o.lease_expires_at, o.traceparent, \
             o.tracestate, {columns} \
             FROM outbox o JOIN attempts a ON a.id = o.attempt_id \
             WHERE o.id IN ({placeholders}) AND o.state = 'pending'"
        );
        let mut claimed = Claimed::default();
        on_pool!(self, pool => {
            let mut q = sqlx::query(&sql);
            for (id, _) in &leased {
                q = q.bind(*id);
            }
            for row in q.fetch_all(pool).await? {
                let outbox_id: DbId = row.try_get("outbox_id")?;
                let token: i64 = row.try_get("lease_token")?;
                // Only the token this claim set: a row claimed again since
                // (its lease already lost) is not ours.
                if leased.contains(&(outbox_id, token)) {
                    claimed.push(&row)?;
                }
            }
        });
        Ok(claimed)
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
        let n = on_write_pool!(self, pool => sqlx::query(sql)
            .bind(DbId::from(outbox))
            .bind(token)
            .bind(DbTime(lease_until))
            .bind(DbTime(now))
            .execute(pool)
            .await?
            .rows_affected());
        Ok(n == 1)
    }

    /// Records the reconciler's replay of an attempt's own key as a send,
    /// before it is made: only while the attempt is `reconciling`, its
    /// payment (and refund) not in `needs_review`, and its send count still
    /// `sends_read`, the count of the row the reconciler's read covered.
    /// Returns the attempt as it now is, or `None` when it was settled (or
    /// put in review) or sent again meanwhile and must not be replayed on
    /// that read: another reconciler's replay in between may have made the
    /// key's first effect, which the read, taken before it, cannot show.
    pub async fn record_replay(
        &self,
        id: AttemptId,
        sends_read: i32,
        now: DateTime<Utc>,
    ) -> Result<Option<AttemptRow>> {
        let sql = format!(
            "UPDATE attempts SET send_count = send_count + 1, \
            first_send_at = COALESCE(first_send_at, $2), last_send_at = $2, updated_at = $2 \
            WHERE id = $1 AND state = 'reconciling' AND send_count = $3 \
            AND COALESCE((SELECT p.status FROM payments p WHERE p.id = attempts.payment_id), '') \
              <> 'needs_review' \
            AND COALESCE((SELECT r.status FROM refunds r WHERE r.id = attempts.refund_id), '') \
              <> 'needs_review' \
            RETURNING {ATTEMPT_COLUMNS}"
        );
        Ok(on_write_pool!(self, pool => sqlx::query_as(&sql)
            .bind(DbId::from(id))
            .bind(DbTime(now))
            .bind(sends_read)
            .fetch_optional(pool)
            .await?))
    }

    /// Records one send of a claimed attempt, fenced by the token: the send
    /// count and the first/last send times drive the retention window. It
    /// is the last gate before the provider call, so it also refuses an
    /// attempt that is no longer sendable (settled by the reconciler or a
    /// webhook meanwhile) and one whose payment or refund is
    /// `requires_reconciliation` or `needs_review`.
    pub async fn record_send(&self, claim: &Claim, now: DateTime<Utc>) -> Result<SendMark> {
        // The payment's (and refund's) status is read with a share lock on
        // PostgreSQL: a transaction that is moving it to needs_review right
        // now is waited for, and its status seen, instead of read past.
        let lock = match self.backend {
            Backend::Postgres(_) => " FOR SHARE",
            Backend::Sqlite(_) => "",
        };
        let sql = format!(
            "UPDATE attempts SET send_count = send_count + 1, \
            first_send_at = COALESCE(first_send_at, $3), last_send_at = $3, updated_at = $3 \
            WHERE id = $1 AND state IN ('pending', 'unknown') \
            AND EXISTS (SELECT 1 FROM outbox o WHERE o.attempt_id = $1 \
              AND o.id = $2 AND o.lease_token = $4 AND o.state = 'pending') \
            AND COALESCE((SELECT p.status FROM payments p WHERE p.id = attempts.payment_id{lock}), '') \
              NOT IN ('requires_reconciliation', 'needs_review') \
            AND COALESCE((SELECT r.status FROM refunds r WHERE r.id = attempts.refund_id{lock}), '') \
              NOT IN ('requires_reconciliation', 'needs_review')"
        );
        let n = on_write_pool!(self, pool => sqlx::query(&sql)
            .bind(claim.attempt.id)
            .bind(DbId::from(claim.outbox_id))
            .bind(DbTime(now))
            .bind(claim.token)
            .execute(pool)
            .await?
            .rows_affected());
        if n == 1 {
            return Ok(SendMark::Marked);
        }
        // Why not (the rare path): lease first, then the attempt, then the block.
        let why = "SELECT \
            (SELECT COUNT(*) FROM outbox o WHERE o.id = $2 AND o.lease_token = $3 \
               AND o.state = 'pending'), \
            (SELECT COUNT(*) FROM attempts a WHERE a.id = $1 AND a.state IN ('pending', 'unknown'))";
        let (leased, sendable): (i64, i64) = on_pool!(self, pool => sqlx::query_as(why)
            .bind(claim.attempt.id)
            .bind(DbId::from(claim.outbox_id))
            .bind(claim.token)
            .fetch_one(pool)
            .await?);
        Ok(match (leased, sendable) {
            (0, _) => SendMark::LeaseLost,
            (_, 0) => SendMark::Settled,
            _ => SendMark::Blocked,
        })
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
            observed_at, account_id) VALUES ($1, $2, $3, $4, $5, $6, \
            (SELECT account_id FROM attempts WHERE id = $2))";
        on_write_pool!(self, pool => sqlx::query(sql)
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

    /// `(lease_token, outcome class, detail)` of every observation, oldest
    /// first. A `succeeded`/`declined` observation's detail is the
    /// provider's object as JSON.
    pub async fn observations_of_attempt_any_account(
        &self,
        attempt: AttemptId,
    ) -> Result<Vec<(i64, String, String)>> {
        let sql = "SELECT lease_token, outcome, detail FROM attempt_observations \
            WHERE attempt_id = $1 ORDER BY observed_at";
        Ok(on_pool!(self, pool => sqlx::query_as(sql)
            .bind(DbId::from(attempt))
            .fetch_all(pool)
            .await?))
    }
}
