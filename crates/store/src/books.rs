//! The books' tables (docs/books.md): runs with their counts, a checkpoint
//! per provider, and the orphans an operator resolves. The matching itself
//! lives in `cobro-reconciler` (`books`).

use crate::audit::NewDecision;
use crate::conflicts::ConflictKind;
use crate::payments::ATTEMPT_COLUMNS;
use crate::{
    AttemptRow, DbId, DbTime, Result, Store, StoreError, WriteTx, on_pool, on_tx, on_write_pool,
};
use chrono::{DateTime, Utc};
use cobro_core::{
    AccountId, AttemptId, CaptureMethod, Decision, Operation, PaymentId, PaymentStatus, RefundId,
};

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
    /// The payment an operator adopted it into (`cobro books adopt`).
    pub adopted_payment: Option<String>,
}

const ORPHAN_COLUMNS: &str = "id, provider, object_id, kind, account_id, payment_id, intent, \
    attempt_id, reference, charge, amount, amount_captured, currency, status, found_at, state, \
    resolved_by, reason, resolved_at, adopted_payment";

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

    /// Records that run `run` listed `objects` (the provider's ids of one
    /// page) and returns those it had not listed before: a page boundary
    /// that moved under a concurrent create may show an object twice.
    pub async fn books_listed(&self, run: DbId, objects: &[&str]) -> Result<Vec<String>> {
        if objects.is_empty() {
            return Ok(Vec::new());
        }
        let values: Vec<String> = (0..objects.len())
            .map(|i| format!("($1, ${})", i + 2))
            .collect();
        let sql = format!(
            "INSERT INTO books_listed (run_id, object_id) VALUES {} \
             ON CONFLICT DO NOTHING RETURNING object_id",
            values.join(", ")
        );
        Ok(on_write_pool!(self, pool => {
            let mut query = sqlx::query_scalar(&sql).bind(run);
            for object in objects {
                query = query.bind(*object);
            }
            query.fetch_all(pool).await?
        }))
    }

    /// Forgets what run `run` listed (its end), and what any run listed
    /// that finished, or started before `stale_before` (a run whose
    /// process died).
    pub async fn books_forget_listed(&self, run: DbId, stale_before: DateTime<Utc>) -> Result<()> {
        let sql = "DELETE FROM books_listed WHERE run_id = $1 OR run_id IN \
            (SELECT id FROM books_runs WHERE finished_at IS NOT NULL OR started_at < $2)";
        on_write_pool!(self, pool => sqlx::query(sql)
            .bind(run)
            .bind(DbTime(stale_before))
            .execute(pool)
            .await?
            .rows_affected());
        Ok(())
    }

    /// One orphan by its id.
    pub async fn orphan(&self, id: DbId) -> Result<Option<OrphanRow>> {
        let sql = format!("SELECT {ORPHAN_COLUMNS} FROM books_orphans WHERE id = $1");
        Ok(on_pool!(self, pool => sqlx::query_as(&sql)
            .bind(id)
            .fetch_optional(pool)
            .await?))
    }

    /// The open refund orphans of `provider`'s charge `charge`, oldest
    /// first: what an adoption of that charge takes with it.
    pub async fn open_refund_orphans_of(
        &self,
        provider: &str,
        charge: &str,
    ) -> Result<Vec<OrphanRow>> {
        let sql = format!(
            "SELECT {ORPHAN_COLUMNS} FROM books_orphans WHERE provider = $1 AND charge = $2 \
             AND kind = 'refund' AND state = 'open' ORDER BY found_at, id"
        );
        Ok(on_pool!(self, pool => sqlx::query_as(&sql)
            .bind(provider)
            .bind(charge)
            .fetch_all(pool)
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
        unlisted_by: Option<DbId>,
    ) -> Result<Vec<AttemptRow>> {
        let unnamed = if include_unnamed {
            " OR provider IS NULL"
        } else {
            ""
        };
        // Only those whose object run `unlisted_by` did not list.
        let unlisted = if unlisted_by.is_some() {
            " AND NOT EXISTS (SELECT 1 FROM books_listed l WHERE l.run_id = $7 \
             AND l.object_id = attempts.provider_ref)"
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
             AND (first_send_at > $4 OR (first_send_at = $4 AND id > $5)){unlisted} \
             ORDER BY first_send_at, id LIMIT $6"
        );
        let (after_at, after_id) = after.unwrap_or((from, DbId(uuid::Uuid::nil())));
        Ok(on_pool!(self, pool => {
            let query = sqlx::query_as(&sql)
                .bind(provider)
                .bind(DbTime(from))
                .bind(DbTime(to))
                .bind(DbTime(after_at))
                .bind(after_id)
                .bind(i64::from(limit));
            match unlisted_by {
                Some(run) => query.bind(run).fetch_all(pool).await?,
                None => query.fetch_all(pool).await?,
            }
        }))
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

/// An orphan's payment as an operator adopts it (`cobro books adopt`):
/// everything is what the provider showed, read again by id just before.
#[derive(Clone, Debug)]
pub struct Adoption<'a> {
    pub orphan: DbId,
    pub provider: &'a str,
    pub account: AccountId,
    pub payment: PaymentId,
    pub order_ref: &'a str,
    pub intent: &'a str,
    pub attempt: AttemptId,
    pub reference: &'a str,
    /// The provider's charge (or PaymentIntent) id.
    pub charge: &'a str,
    pub amount: i64,
    pub amount_captured: i64,
    pub currency: &'a str,
    pub capture_method: CaptureMethod,
    /// `authorized` or `captured`: refunds are adopted after, each moving
    /// the payment as a refund does.
    pub status: PaymentStatus,
    pub actor: &'a str,
    pub reason: &'a str,
    /// The charge as the provider showed it (JSON), for the decision.
    pub provider_said: &'a str,
}

/// An adopted intent with its one succeeded attempt.
#[derive(Clone, Debug)]
pub struct AdoptedAttempt<'a> {
    pub provider: &'a str,
    pub account: AccountId,
    pub payment: PaymentId,
    pub refund: Option<RefundId>,
    pub operation: Operation,
    pub intent: &'a str,
    pub attempt: AttemptId,
    pub reference: &'a str,
    /// The provider's id of the object the attempt made.
    pub object: &'a str,
}

/// Why an adoption wrote nothing.
#[derive(Debug, thiserror::Error)]
pub enum AdoptRefused {
    #[error("the orphan is no longer open: someone resolved it first")]
    NotOpen,
    #[error("account {0} does not exist in this database")]
    NoAccount(AccountId),
    #[error(
        "order {order_ref} of this account already has payment {payment} ({status}); this \
         orphan is another charge for the same order: refund or void it at the provider, then \
         acknowledge it"
    )]
    OrderTaken {
        order_ref: String,
        payment: String,
        status: String,
    },
    #[error("{0} is recorded already (intent, payment or attempt): run the books again")]
    AlreadyRecorded(String),
    #[error(
        "payment {0} already holds this charge: the object's metadata names another payment \
         (edited at the provider?); an operator must look"
    )]
    ChargeHeld(String),
    #[error(
        "its intent {intent} would leave a gap after the order's {existing} intent(s) of this \
         operation (one lost before it), and cobro numbers the next intent after the count: \
         refund or void it at the provider, then acknowledge it"
    )]
    SequenceGap { intent: String, existing: i64 },
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl Store {
    /// Records a charge orphan again in one transaction: its payment (as
    /// the provider shows it, with the merchant's event its status
    /// writes), the authorisation's intent and succeeded attempt under the
    /// ids its metadata carries, the decision (who, why, what the provider
    /// said), and the orphan resolved. Refused, with nothing written, when
    /// the orphan is no longer open, the account is unknown, or the order
    /// already has an active payment (the merchant paid again after the
    /// loss: two charges, which an operator must undo at the provider).
    pub async fn adopt_orphan(
        &self,
        a: &Adoption<'_>,
        now: DateTime<Utc>,
    ) -> std::result::Result<(), AdoptRefused> {
        let mut tx = self.begin().await?;
        if !tx
            .resolve_orphan_adopted(a.orphan, a.actor, a.reason, a.payment, now)
            .await?
        {
            return Err(AdoptRefused::NotOpen);
        }
        if !tx.account_exists(a.account).await? {
            return Err(AdoptRefused::NoAccount(a.account));
        }
        if let Some((payment, status)) = tx.active_payment_of_order(a.account, a.order_ref).await? {
            return Err(AdoptRefused::OrderTaken {
                order_ref: a.order_ref.to_owned(),
                payment: payment.0.to_string(),
                status,
            });
        }
        if let Some(holder) = tx.payment_holding_charge(a.charge).await? {
            return Err(AdoptRefused::ChargeHeld(holder.0.to_string()));
        }
        let existing = tx
            .intents_of_order(a.account, a.order_ref, Operation::Authorize)
            .await?;
        if intent_number(a.intent) != Some(existing + 1) {
            return Err(AdoptRefused::SequenceGap {
                intent: a.intent.to_owned(),
                existing,
            });
        }
        let inserted = tx.insert_adopted_payment(a, now).await;
        let attempt = AdoptedAttempt {
            provider: a.provider,
            account: a.account,
            payment: a.payment,
            refund: None,
            operation: Operation::Authorize,
            intent: a.intent,
            attempt: a.attempt,
            reference: a.reference,
            object: a.charge,
        };
        let inserted = match inserted {
            Ok(()) => tx.insert_adopted_attempt(&attempt, now).await,
            Err(e) => Err(e),
        };
        inserted.map_err(|e| match e {
            StoreError::UniqueViolation { what } => AdoptRefused::AlreadyRecorded(what),
            e => AdoptRefused::Store(e),
        })?;
        tx.record_decision(
            &NewDecision {
                run_id: None,
                payment: a.payment,
                refund: None,
                attempt: Some(a.attempt),
                state_before: "orphan".into(),
                state_after: a.status.as_str().into(),
                provider_said: a.provider_said.into(),
                decision: Decision::BooksAdopted,
                actor: a.actor.into(),
                reason: Some(a.reason.into()),
            },
            now,
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }
}

impl WriteTx {
    /// Resolves the open orphan `id` as adopted into `payment`; `false`
    /// when it is not open (unknown, or resolved by someone else first).
    pub async fn resolve_orphan_adopted(
        &mut self,
        id: DbId,
        actor: &str,
        reason: &str,
        payment: PaymentId,
        now: DateTime<Utc>,
    ) -> Result<bool> {
        let n = on_tx!(self, conn => sqlx::query(
            "UPDATE books_orphans SET state = 'acknowledged', resolved_by = $2, reason = $3, \
             resolved_at = $4, adopted_payment = $5 WHERE id = $1 AND state = 'open'")
            .bind(id)
            .bind(actor)
            .bind(reason)
            .bind(DbTime(now))
            .bind(payment.to_string())
            .execute(&mut *conn)
            .await?
            .rows_affected());
        Ok(n == 1)
    }

    async fn account_exists(&mut self, account: AccountId) -> Result<bool> {
        let found: Option<DbId> = on_tx!(self, conn => sqlx::query_scalar(
            "SELECT id FROM accounts WHERE id = $1")
            .bind(DbId::from(account))
            .fetch_optional(&mut *conn)
            .await?);
        Ok(found.is_some())
    }

    /// The payment of `order_ref` that is not a terminal failure, if any
    /// (at most one: `payments_one_active_per_order`), with its status.
    async fn active_payment_of_order(
        &mut self,
        account: AccountId,
        order_ref: &str,
    ) -> Result<Option<(DbId, String)>> {
        Ok(on_tx!(self, conn => sqlx::query_as(
            "SELECT id, status FROM payments WHERE account_id = $1 AND order_ref = $2 \
             AND status NOT IN ('declined', 'failed', 'canceled')")
            .bind(DbId::from(account))
            .bind(order_ref)
            .fetch_optional(&mut *conn)
            .await?))
    }

    /// The payment whose charge is `charge`, if any.
    async fn payment_holding_charge(&mut self, charge: &str) -> Result<Option<DbId>> {
        Ok(on_tx!(self, conn => sqlx::query_scalar(
            "SELECT id FROM payments WHERE provider_ref = $1 LIMIT 1")
            .bind(charge)
            .fetch_optional(&mut *conn)
            .await?))
    }

    /// How many intents of `operation` the order has: what the next one's
    /// number follows (`next_intent_sequence`; authorisations count the
    /// order's payments, one intent each).
    pub async fn intents_of_order(
        &mut self,
        account: AccountId,
        order_ref: &str,
        operation: Operation,
    ) -> Result<i64> {
        let sql = "SELECT COUNT(*) FROM intents i JOIN payments p ON p.id = i.payment_id \
            WHERE p.account_id = $1 AND p.order_ref = $2 AND i.operation = $3";
        Ok(on_tx!(self, conn => sqlx::query_scalar(sql)
            .bind(DbId::from(account))
            .bind(order_ref)
            .bind(operation)
            .fetch_one(&mut *conn)
            .await?))
    }

    /// The adopted payment, inserted `processing` and then moved to its
    /// status, so its merchant hears `payment.created` and then the
    /// status's own event (`payment.captured`), as for any payment.
    async fn insert_adopted_payment(&mut self, a: &Adoption<'_>, now: DateTime<Utc>) -> Result<()> {
        on_tx!(self, conn => sqlx::query(
            "INSERT INTO payments (id, account_id, order_ref, intent, amount, currency, \
             capture_method, payment_method, metadata, status, provider_ref, provider, \
             status_changed_at, created_at, updated_at) VALUES ($1, $2, $3, $4, $5, $6, $7, \
             'unknown', '{}', 'processing', $8, $9, $10, $10, $10)")
            .bind(DbId::from(a.payment))
            .bind(DbId::from(a.account))
            .bind(a.order_ref)
            .bind(a.intent)
            .bind(a.amount)
            .bind(a.currency)
            .bind(a.capture_method.as_str())
            .bind(a.charge)
            .bind(a.provider)
            .bind(DbTime(now))
            .execute(&mut *conn)
            .await?
            .rows_affected());
        on_tx!(self, conn => sqlx::query(
            "UPDATE payments SET status = $2, amount_captured = $3 WHERE id = $1")
            .bind(DbId::from(a.payment))
            .bind(a.status.as_str())
            .bind(a.amount_captured)
            .execute(&mut *conn)
            .await?
            .rows_affected());
        Ok(())
    }

    /// An adopted intent and its one succeeded attempt. The provider key
    /// is a stand-in that names the object (the key cobro sent was lost
    /// with the row; nothing is ever sent under an adopted attempt), and
    /// no send is recorded (cobro has no record of one), so the books
    /// never count an adopted attempt missing.
    pub async fn insert_adopted_attempt(
        &mut self,
        one: &AdoptedAttempt<'_>,
        now: DateTime<Utc>,
    ) -> Result<()> {
        let intent = DbId(uuid::Uuid::now_v7());
        let refund = one.refund.map(DbId::from);
        on_tx!(self, conn => sqlx::query(
            "INSERT INTO intents (id, account_id, payment_id, refund_id, operation, name, \
             created_at) VALUES ($1, $2, $3, $4, $5, $6, $7)")
            .bind(intent)
            .bind(DbId::from(one.account))
            .bind(DbId::from(one.payment))
            .bind(refund)
            .bind(one.operation.as_str())
            .bind(one.intent)
            .bind(DbTime(now))
            .execute(&mut *conn)
            .await?
            .rows_affected());
        on_tx!(self, conn => sqlx::query(
            "INSERT INTO attempts (id, intent_id, payment_id, refund_id, operation, provider_key, \
             reference, state, provider_ref, created_at, updated_at, provider, account_id) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, 'succeeded', $8, $9, $9, $10, $11)")
            .bind(DbId::from(one.attempt))
            .bind(intent)
            .bind(DbId::from(one.payment))
            .bind(refund)
            .bind(one.operation.as_str())
            .bind(format!("adopted:{}:{}", one.provider, one.object))
            .bind(one.reference)
            .bind(one.object)
            .bind(DbTime(now))
            .bind(one.provider)
            .bind(DbId::from(one.account))
            .execute(&mut *conn)
            .await?
            .rows_affected());
        Ok(())
    }
}

/// `n` of an intent named `{order_ref}:{verb}-v{n}`.
pub fn intent_number(intent: &str) -> Option<i64> {
    let (_, verb) = intent.rsplit_once(':')?;
    let (_, n) = verb.rsplit_once("-v")?;
    n.parse().ok().filter(|n| *n > 0)
}
