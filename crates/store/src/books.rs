//! The books' tables (docs/books.md): runs with their counts, a checkpoint
//! per provider, and the orphans an operator resolves. The matching itself
//! lives in `cobro-reconciler` (`books`).

use crate::conflicts::ConflictKind;
use crate::payments::ATTEMPT_COLUMNS;
use crate::{AttemptRow, DbId, DbTime, Result, Store, WriteTx, on_pool, on_tx, on_write_pool};
use chrono::{DateTime, Utc};
use cobro_core::{Operation, PaymentId};

/// A books run as it starts.
#[derive(Clone, Debug)]
pub struct NewBooksRun<'a> {
    pub provider: &'a str,
    /// `schedule` or `cli`.
    pub trigger: &'a str,
    pub actor: &'a str,
    pub dry_run: bool,
    /// The creation times listed, unix seconds, both included.
    pub window: (i64, i64),
}

/// The counts a run ends with, one per class.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BooksCounts {
    /// Provider objects listed.
    pub objects: i64,
    pub matched: i64,
    pub orphans: i64,
    pub foreign: i64,
    pub drifted: i64,
    pub missing: i64,
}

/// A run read back (`cobro books runs`).
#[derive(Clone, Debug, sqlx::FromRow)]
pub struct BooksRunRow {
    pub id: DbId,
    pub provider: String,
    pub trigger: String,
    pub actor: String,
    pub dry_run: bool,
    pub window_from: i64,
    pub window_to: i64,
    pub started_at: DbTime,
    pub finished_at: Option<DbTime>,
    pub objects: i64,
    pub matched: i64,
    pub orphans: i64,
    pub foreign_objects: i64,
    pub drifted: i64,
    pub missing: i64,
    pub error: Option<String>,
}

/// An object at the provider that carries cobro's metadata and no attempt
/// of cobro's: what its metadata says, as the provider echoed it.
#[derive(Clone, Debug)]
pub struct NewOrphan<'a> {
    pub provider: &'a str,
    pub object_id: &'a str,
    /// `charge` or `refund`.
    pub kind: &'a str,
    pub account_id: Option<&'a str>,
    pub payment_id: Option<&'a str>,
    pub intent: Option<&'a str>,
    pub attempt_id: Option<&'a str>,
    pub reference: Option<&'a str>,
    /// The refunded charge, for a refund.
    pub charge: Option<&'a str>,
    pub amount: Option<i64>,
    pub amount_captured: Option<i64>,
    pub currency: Option<&'a str>,
    pub status: &'a str,
    /// The object as listed (JSON text).
    pub provider_said: &'a str,
    pub run: DbId,
}

/// A stored orphan.
#[derive(Clone, Debug, sqlx::FromRow)]
pub struct OrphanRow {
    pub id: DbId,
    pub provider: String,
    pub object_id: String,
    pub kind: String,
    pub account_id: Option<String>,
    pub payment_id: Option<String>,
    pub intent: Option<String>,
    pub attempt_id: Option<String>,
    pub reference: Option<String>,
    pub charge: Option<String>,
    pub amount: Option<i64>,
    pub amount_captured: Option<i64>,
    pub currency: Option<String>,
    pub status: String,
    pub found_at: DbTime,
    /// `open` or `acknowledged`.
    pub state: String,
    pub resolved_by: Option<String>,
    pub reason: Option<String>,
    pub resolved_at: Option<DbTime>,
}

const ORPHAN_COLUMNS: &str = "id, provider, object_id, kind, account_id, payment_id, intent, \
    attempt_id, reference, charge, amount, amount_captured, currency, status, found_at, state, \
    resolved_by, reason, resolved_at";

const RUN_COLUMNS: &str = "id, provider, trigger, actor, dry_run, window_from, window_to, \
    started_at, finished_at, objects, matched, orphans, foreign_objects, drifted, missing, error";

impl WriteTx {
    /// Whether `payment` has a refund recorded under the provider's id
    /// `provider_ref`.
    pub async fn refund_by_provider_ref(
        &mut self,
        payment: PaymentId,
        provider_ref: &str,
    ) -> Result<bool> {
        let sql = "SELECT COUNT(*) FROM refunds WHERE provider_ref = $1 AND payment_id = $2";
        let n: i64 = on_tx!(self, conn => sqlx::query_scalar(sql)
            .bind(provider_ref)
            .bind(DbId::from(payment))
            .fetch_one(&mut *conn)
            .await?);
        Ok(n > 0)
    }

    /// Whether this exact finding about `payment` (no attempt) is kept and
    /// open.
    pub async fn conflict_is_open_for_payment(
        &mut self,
        payment: PaymentId,
        kind: ConflictKind,
        detail: &str,
    ) -> Result<bool> {
        let sql = "SELECT COUNT(*) FROM evidence_conflicts WHERE payment_id = $1 AND kind = $2 \
            AND detail = $3 AND resolved_at IS NULL";
        let n: i64 = on_tx!(self, conn => sqlx::query_scalar(sql)
            .bind(DbId::from(payment))
            .bind(kind.as_str())
            .bind(detail)
            .fetch_one(&mut *conn)
            .await?);
        Ok(n > 0)
    }
}

impl Store {
    /// How far `provider`'s ledger has been read (unix seconds), if ever.
    pub async fn books_checkpoint(&self, provider: &str) -> Result<Option<i64>> {
        let sql = "SELECT listed_to FROM books_cursors WHERE provider = $1";
        Ok(on_pool!(self, pool => sqlx::query_scalar(sql)
            .bind(provider)
            .fetch_optional(pool)
            .await?))
    }

    /// Moves `provider`'s checkpoint forward to `listed_to`; never back (a
    /// slower run over an older window leaves a newer checkpoint alone).
    pub async fn advance_books_checkpoint(
        &self,
        provider: &str,
        listed_to: i64,
        now: DateTime<Utc>,
    ) -> Result<()> {
        let sql = "INSERT INTO books_cursors (provider, listed_to, updated_at) \
            VALUES ($1, $2, $3) ON CONFLICT (provider) DO UPDATE \
            SET listed_to = excluded.listed_to, updated_at = excluded.updated_at \
            WHERE books_cursors.listed_to < excluded.listed_to";
        on_write_pool!(self, pool => sqlx::query(sql)
            .bind(provider)
            .bind(listed_to)
            .bind(DbTime(now))
            .execute(pool)
            .await?
            .rows_affected());
        Ok(())
    }

    /// Opens a books run.
    pub async fn start_books_run(&self, run: &NewBooksRun<'_>, now: DateTime<Utc>) -> Result<DbId> {
        let id = DbId(uuid::Uuid::now_v7());
        let sql = "INSERT INTO books_runs (id, provider, trigger, actor, dry_run, window_from, \
            window_to, started_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)";
        on_write_pool!(self, pool => sqlx::query(sql)
            .bind(id)
            .bind(run.provider)
            .bind(run.trigger)
            .bind(run.actor)
            .bind(run.dry_run)
            .bind(run.window.0)
            .bind(run.window.1)
            .bind(DbTime(now))
            .execute(pool)
            .await?
            .rows_affected());
        Ok(id)
    }

    /// Closes a run with its counts, its report (JSON text) and, when it
    /// could not finish, why.
    pub async fn finish_books_run(
        &self,
        id: DbId,
        counts: &BooksCounts,
        report: &str,
        error: Option<&str>,
        now: DateTime<Utc>,
    ) -> Result<()> {
        let sql = "UPDATE books_runs SET finished_at = $2, objects = $3, matched = $4, \
            orphans = $5, foreign_objects = $6, drifted = $7, missing = $8, error = $9, \
            report = $10 WHERE id = $1";
        on_write_pool!(self, pool => sqlx::query(sql)
            .bind(id)
            .bind(DbTime(now))
            .bind(counts.objects)
            .bind(counts.matched)
            .bind(counts.orphans)
            .bind(counts.foreign)
            .bind(counts.drifted)
            .bind(counts.missing)
            .bind(error)
            .bind(report)
            .execute(pool)
            .await?
            .rows_affected());
        Ok(())
    }

    /// The latest runs, newest first.
    pub async fn books_runs(&self, limit: u32) -> Result<Vec<BooksRunRow>> {
        let sql = format!(
            "SELECT {RUN_COLUMNS} FROM books_runs ORDER BY started_at DESC, id DESC LIMIT $1"
        );
        Ok(on_pool!(self, pool => sqlx::query_as(&sql)
            .bind(i64::from(limit))
            .fetch_all(pool)
            .await?))
    }

    /// Keeps an orphan; `false` when it was already kept (a second run over
    /// the same window changes nothing).
    pub async fn record_orphan(&self, o: &NewOrphan<'_>, now: DateTime<Utc>) -> Result<bool> {
        let sql = "INSERT INTO books_orphans (id, provider, object_id, kind, account_id, \
            payment_id, intent, attempt_id, reference, charge, amount, amount_captured, \
            currency, status, provider_said, found_run, found_at, state) VALUES ($1, $2, $3, \
            $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, 'open') \
            ON CONFLICT (provider, object_id) DO NOTHING";
        let n = on_write_pool!(self, pool => sqlx::query(sql)
            .bind(DbId(uuid::Uuid::now_v7()))
            .bind(o.provider)
            .bind(o.object_id)
            .bind(o.kind)
            .bind(o.account_id)
            .bind(o.payment_id)
            .bind(o.intent)
            .bind(o.attempt_id)
            .bind(o.reference)
            .bind(o.charge)
            .bind(o.amount)
            .bind(o.amount_captured)
            .bind(o.currency)
            .bind(o.status)
            .bind(o.provider_said)
            .bind(o.run)
            .bind(DbTime(now))
            .execute(pool)
            .await?
            .rows_affected());
        Ok(n == 1)
    }

    /// The orphan kept for `provider`'s object `object_id`, if any.
    pub async fn orphan_of_object(
        &self,
        provider: &str,
        object_id: &str,
    ) -> Result<Option<OrphanRow>> {
        let sql = format!(
            "SELECT {ORPHAN_COLUMNS} FROM books_orphans WHERE provider = $1 AND object_id = $2"
        );
        Ok(on_pool!(self, pool => sqlx::query_as(&sql)
            .bind(provider)
            .bind(object_id)
            .fetch_optional(pool)
            .await?))
    }

    /// Orphans, oldest first; only the open ones unless `all`.
    pub async fn orphans(&self, all: bool, limit: u32) -> Result<Vec<OrphanRow>> {
        let only_open = if all { "" } else { " WHERE state = 'open'" };
        let sql = format!(
            "SELECT {ORPHAN_COLUMNS} FROM books_orphans{only_open} \
             ORDER BY found_at, id LIMIT $1"
        );
        Ok(on_pool!(self, pool => sqlx::query_as(&sql)
            .bind(i64::from(limit))
            .fetch_all(pool)
            .await?))
    }

    /// How many orphans no operator has resolved (the gauge
    /// `cobro_books_orphans_open`), through `books_orphans_open`.
    pub async fn open_orphan_count(&self) -> Result<i64> {
        let sql = "SELECT COUNT(*) FROM books_orphans WHERE state = 'open'";
        Ok(on_pool!(self, pool => sqlx::query_scalar(sql)
            .fetch_one(pool)
            .await?))
    }

    /// An operator's acknowledgement of an open orphan, with who and why
    /// (the audit). `false`: no such open orphan (unknown, or resolved by
    /// someone else first).
    pub async fn acknowledge_orphan(
        &self,
        id: DbId,
        actor: &str,
        reason: &str,
        now: DateTime<Utc>,
    ) -> Result<bool> {
        let sql = "UPDATE books_orphans SET state = 'acknowledged', resolved_by = $2, \
            reason = $3, resolved_at = $4 WHERE id = $1 AND state = 'open'";
        let n = on_write_pool!(self, pool => sqlx::query(sql)
            .bind(id)
            .bind(actor)
            .bind(reason)
            .bind(DbTime(now))
            .execute(pool)
            .await?
            .rows_affected());
        Ok(n == 1)
    }

    /// A page of the successful authorisations and refunds sent to
    /// `provider` (`None` also reads attempts recorded before providers
    /// were named, when `provider` is the default) whose first send is in
    /// `[from, to)`, after the attempt `after` in (first send, id) order:
    /// the books' side of cobro, read by the `attempts_settled_by_send`
    /// index, never all at once.
    pub async fn settled_attempts_sent_within(
        &self,
        provider: &str,
        include_unnamed: bool,
        (from, to): (DateTime<Utc>, DateTime<Utc>),
        after: Option<(DateTime<Utc>, DbId)>,
        limit: u32,
    ) -> Result<Vec<AttemptRow>> {
        let unnamed = if include_unnamed {
            " OR provider IS NULL"
        } else {
            ""
        };
        // The operations are literals, not parameters, so that the query
        // planner can use the partial index `attempts_settled_by_send`,
        // whose predicate names them the same way (migration 0019).
        let (authorize, refund) = (Operation::Authorize.as_str(), Operation::Refund.as_str());
        let sql = format!(
            "SELECT {ATTEMPT_COLUMNS} FROM attempts WHERE state = 'succeeded' \
             AND operation IN ('{authorize}', '{refund}') AND first_send_at >= $2 \
             AND first_send_at < $3 AND (provider = $1{unnamed}) \
             AND (first_send_at > $4 OR (first_send_at = $4 AND id > $5)) \
             ORDER BY first_send_at, id LIMIT $6"
        );
        let (after_at, after_id) = after.unwrap_or((from, DbId(uuid::Uuid::nil())));
        Ok(on_pool!(self, pool => sqlx::query_as(&sql)
            .bind(provider)
            .bind(DbTime(from))
            .bind(DbTime(to))
            .bind(DbTime(after_at))
            .bind(after_id)
            .bind(i64::from(limit))
            .fetch_all(pool)
            .await?))
    }

    /// An attempt by id, across accounts (the books match an object's
    /// `cobro_attempt` metadata to it).
    pub async fn attempt_any_account(&self, id: DbId) -> Result<Option<AttemptRow>> {
        let sql = format!("SELECT {ATTEMPT_COLUMNS} FROM attempts WHERE id = $1");
        Ok(on_pool!(self, pool => sqlx::query_as(&sql)
            .bind(id)
            .fetch_optional(pool)
            .await?))
    }

    /// The payment whose adopted charge is `charge` at `provider`, across
    /// accounts: what a refund made without cobro's metadata refunds.
    pub async fn payment_by_charge_any_account(
        &self,
        charge: &str,
    ) -> Result<Option<crate::PaymentRow>> {
        let sql = format!(
            "SELECT {} FROM payments WHERE provider_ref = $1 LIMIT 1",
            crate::payments::PAYMENT_COLUMNS
        );
        Ok(on_pool!(self, pool => sqlx::query_as(&sql)
            .bind(charge)
            .fetch_optional(pool)
            .await?))
    }

    /// The refund cobro recorded under `provider_ref`, across accounts.
    pub async fn refund_by_provider_ref_any_account(
        &self,
        provider_ref: &str,
    ) -> Result<Option<crate::RefundRow>> {
        let sql = format!(
            "SELECT {} FROM refunds WHERE provider_ref = $1 LIMIT 1",
            crate::payments::REFUND_COLUMNS
        );
        Ok(on_pool!(self, pool => sqlx::query_as(&sql)
            .bind(provider_ref)
            .fetch_optional(pool)
            .await?))
    }
}
