//! Payments, refunds, intents and attempts: the business rows.
//!
//! Every state change is a compare-and-set on the current state; a `false`
//! (zero rows) tells the caller that someone else moved first.

use crate::{DbId, DbTime, Result, Store, StoreError, WriteTx, on_pool, on_tx};
use chrono::{DateTime, Utc};
use cobro_core::AttemptId;
use cobro_core::{
    AccountId, AttemptState, CaptureMethod, Currency, IntentId, IntentName, Operation, OrderRef,
    PaymentId, PaymentStatus, RefundId, RefundStatus,
};

/// The columns of a payment, as stored.
#[derive(Clone, Debug, sqlx::FromRow)]
pub struct PaymentRow {
    pub id: PaymentId,
    pub account_id: AccountId,
    pub order_ref: String,
    pub intent: String,
    pub amount: i64,
    pub currency: Currency,
    pub capture_method: CaptureMethod,
    pub payment_method: String,
    pub description: Option<String>,
    pub metadata: String,
    pub status: PaymentStatus,
    pub amount_captured: i64,
    pub amount_refund_reserved: i64,
    pub amount_refunded: i64,
    pub provider_ref: Option<String>,
    pub provider_sequence: i64,
    pub failure_code: Option<String>,
    pub failure_message: Option<String>,
    pub cancel_requested_at: Option<DbTime>,
    pub status_changed_at: DbTime,
    pub created_at: DbTime,
    pub updated_at: DbTime,
    /// Why the payment is in `needs_review` (cleared when it leaves).
    pub review_reason: Option<String>,
    /// The status it had when conflicting evidence stopped it.
    pub review_from: Option<PaymentStatus>,
    /// The provider its attempts go to, fixed at creation; `None`: the
    /// default provider (a payment older than migration 0010).
    pub provider: Option<String>,
    /// Where the provider sends the customer back after authenticating
    /// (3-D Secure), as the merchant gave it.
    pub return_url: Option<String>,
    /// What the customer must do, as the API shows it (JSON text); set
    /// when the payment moves to `requires_action`.
    pub next_action: Option<String>,
    /// When a payment left in `requires_action` is canceled as abandoned.
    pub action_expires_at: Option<DbTime>,
    /// The last time a GET asked the provider about it.
    pub action_refreshed_at: Option<DbTime>,
    /// Its routing decision and moves (`cobro_core::routing::Route`, JSON
    /// text); `None`: created before migration 0023.
    pub route: Option<String>,
}

pub(crate) const PAYMENT_COLUMNS: &str = "id, account_id, order_ref, intent, amount, currency, \
    capture_method, payment_method, description, metadata, status, amount_captured, \
    amount_refund_reserved, amount_refunded, provider_ref, provider_sequence, failure_code, \
    failure_message, cancel_requested_at, status_changed_at, created_at, updated_at, review_reason, review_from, \
    provider, return_url, next_action, action_expires_at, action_refreshed_at, route";

#[derive(Clone, Debug, sqlx::FromRow)]
pub struct RefundRow {
    pub id: RefundId,
    pub account_id: AccountId,
    pub payment_id: PaymentId,
    pub intent: String,
    pub amount: i64,
    pub reason: Option<String>,
    pub status: RefundStatus,
    pub provider_ref: Option<String>,
    pub failure_code: Option<String>,
    pub failure_message: Option<String>,
    pub status_changed_at: DbTime,
    pub created_at: DbTime,
    pub updated_at: DbTime,
    /// The merchant's reference for the refund, unique per payment.
    pub reference: Option<String>,
}

pub(crate) const REFUND_COLUMNS: &str = "id, account_id, payment_id, intent, amount, reason, status, \
    provider_ref, failure_code, failure_message, status_changed_at, created_at, updated_at, \
    reference";

#[derive(Clone, Debug, sqlx::FromRow)]
pub struct AttemptRow {
    pub id: AttemptId,
    pub intent_id: IntentId,
    pub payment_id: PaymentId,
    pub refund_id: Option<RefundId>,
    pub operation: Operation,
    /// The provider's idempotency key: sent to the provider, never shown to
    /// merchants or written to logs.
    pub provider_key: String,
    pub reference: String,
    pub state: AttemptState,
    pub send_count: i32,
    pub first_send_at: Option<DbTime>,
    pub last_send_at: Option<DbTime>,
    pub provider_ref: Option<String>,
    pub last_error: Option<String>,
    pub created_at: DbTime,
    pub updated_at: DbTime,
    /// The provider it is sent to (its payment's); `None`: the default
    /// provider (an attempt older than migration 0010).
    pub provider: Option<String>,
    /// The provider's id of the last call that answered (Stripe's
    /// `Request-Id`), for its support.
    pub provider_request_id: Option<String>,
    /// The last answer came from the provider's idempotency store: the
    /// effect, if any, was made by an earlier send of this attempt.
    pub provider_replayed: bool,
}

impl AttemptRow {
    /// The intent's name, as its reference carries it
    /// (`{intent}/{attempt id}`, [`cobro_core::attempt_reference`]).
    pub fn intent_name(&self) -> &str {
        self.reference
            .rsplit_once('/')
            .map_or(self.reference.as_str(), |(intent, _)| intent)
    }
}

pub(crate) const ATTEMPT_COLUMNS: &str = "id, intent_id, payment_id, refund_id, operation, \
    provider_key, reference, state, send_count, first_send_at, last_send_at, provider_ref, \
    last_error, created_at, updated_at, provider, provider_request_id, provider_replayed";

/// `c1, c2` as `t.c1, t.c2`, for a query that joins or names its table.
pub(crate) fn qualified(columns: &str, table: &str) -> String {
    columns
        .split(", ")
        .map(|c| format!("{table}.{c}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// `c1, c2` of `table` as `table.c1 AS {prefix}c1, ...`: a joined read's
/// columns of its second table, named apart from the first's.
fn prefixed(columns: &str, table: &str, prefix: &str) -> String {
    columns
        .split(", ")
        .map(|c| format!("{table}.{c} AS {prefix}{c}"))
        .collect::<Vec<_>>()
        .join(", ")
}

const ATTEMPT_PREFIX: &str = "a_";

/// One row of a payment joined with one of its attempts.
#[derive(sqlx::FromRow)]
struct PaymentWithAttempt {
    #[sqlx(flatten)]
    payment: PaymentRow,
    #[sqlx(flatten)]
    attempt: PrefixedAttempt,
}

/// [`AttemptRow`] read from columns named `a_{column}` (`ATTEMPT_PREFIX`).
#[derive(sqlx::FromRow)]
struct PrefixedAttempt {
    a_id: AttemptId,
    a_intent_id: IntentId,
    a_payment_id: PaymentId,
    a_refund_id: Option<RefundId>,
    a_operation: Operation,
    a_provider_key: String,
    a_reference: String,
    a_state: AttemptState,
    a_send_count: i32,
    a_first_send_at: Option<DbTime>,
    a_last_send_at: Option<DbTime>,
    a_provider_ref: Option<String>,
    a_last_error: Option<String>,
    a_created_at: DbTime,
    a_updated_at: DbTime,
    a_provider: Option<String>,
    a_provider_request_id: Option<String>,
    a_provider_replayed: bool,
}

impl From<PrefixedAttempt> for AttemptRow {
    fn from(a: PrefixedAttempt) -> Self {
        Self {
            id: a.a_id,
            intent_id: a.a_intent_id,
            payment_id: a.a_payment_id,
            refund_id: a.a_refund_id,
            operation: a.a_operation,
            provider_key: a.a_provider_key,
            reference: a.a_reference,
            state: a.a_state,
            send_count: a.a_send_count,
            first_send_at: a.a_first_send_at,
            last_send_at: a.a_last_send_at,
            provider_ref: a.a_provider_ref,
            last_error: a.a_last_error,
            created_at: a.a_created_at,
            updated_at: a.a_updated_at,
            provider: a.a_provider,
            provider_request_id: a.a_provider_request_id,
            provider_replayed: a.a_provider_replayed,
        }
    }
}

/// Whose rows a read may return: the named account's (`$2`), or any
/// account's (the worker, the reconciler and operators).
#[derive(Clone, Copy)]
pub(crate) enum Scope {
    ForAccount,
    AnyAccount,
}

impl Scope {
    fn clause(self) -> &'static str {
        match self {
            Scope::ForAccount => " AND account_id = $2",
            Scope::AnyAccount => "",
        }
    }
}

/// The one SELECT of a payment by id (`$1`); `lock` is
/// [`WriteTx::lock_clause`] or empty.
pub(crate) fn payment_by_id(scope: Scope, lock: &str) -> String {
    let scope = scope.clause();
    format!("SELECT {PAYMENT_COLUMNS} FROM payments WHERE id = $1{scope}{lock}")
}

/// The one SELECT of a refund by id (`$1`).
pub(crate) fn refund_by_id(scope: Scope) -> String {
    let scope = scope.clause();
    format!("SELECT {REFUND_COLUMNS} FROM refunds WHERE id = $1{scope}")
}

/// Every attempt of a payment (`$1`) in `state` (`None`: any), oldest
/// first. Attempts carry no account of their own: for one account (`$2`)
/// the payment must be that account's, checked by the same statement.
pub(crate) fn attempts_of_payment(scope: Scope, state: Option<AttemptState>) -> String {
    let scope = match scope {
        Scope::ForAccount => {
            " AND EXISTS (SELECT 1 FROM payments p WHERE p.id = $1 AND p.account_id = $2)"
        }
        Scope::AnyAccount => "",
    };
    let state = state.map_or(String::new(), |s| format!(" AND state = '{}'", s.as_str()));
    format!(
        "SELECT {ATTEMPT_COLUMNS} FROM attempts WHERE payment_id = $1{state}{scope} \
         ORDER BY created_at, id"
    )
}

/// A payment about to be created (validated by the caller).
#[derive(Clone, Debug)]
pub struct NewPayment {
    pub id: PaymentId,
    pub account: AccountId,
    pub order_ref: OrderRef,
    pub intent: IntentName,
    pub amount: i64,
    pub currency: Currency,
    pub capture_method: CaptureMethod,
    pub payment_method: String,
    pub description: Option<String>,
    /// Canonical JSON text of the metadata map.
    pub metadata: String,
    /// Where the customer comes back after authenticating (3-D Secure).
    pub return_url: Option<String>,
    /// The provider of its first attempt, as routing chose it; `None`:
    /// the account's provider, else the default one.
    pub provider: Option<String>,
    /// The routing decision (`cobro_core::routing::Route`, JSON text).
    pub route: Option<String>,
}

#[derive(Clone, Debug)]
pub struct NewRefund {
    pub id: RefundId,
    pub account: AccountId,
    pub payment: PaymentId,
    pub intent: IntentName,
    pub amount: i64,
    pub reason: Option<String>,
    /// The merchant's reference, unique per payment.
    pub reference: Option<String>,
}

/// Filters and page for listing payments, newest first.
#[derive(Clone, Debug, Default)]
pub struct PaymentFilter {
    pub order_ref: Option<String>,
    pub status: Option<PaymentStatus>,
    /// Only payments with an id below this one (the previous page's last).
    pub before: Option<PaymentId>,
    pub limit: u32,
}

/// Why a refund could not reserve its amount.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RefundRefusal {
    NotFound,
    NotRefundable,
    ExceedsCaptured,
}

impl WriteTx {
    /// [`insert_payment_for`](Self::insert_payment_for) with no default
    /// provider named: the payment goes to its account's provider, or
    /// (NULL) to whichever provider is the default.
    pub async fn insert_payment(
        &mut self,
        p: &NewPayment,
        now: DateTime<Utc>,
    ) -> Result<Option<PaymentRow>> {
        self.insert_payment_for(p, None, now).await
    }

    /// Inserts a payment in `processing`, its provider fixed by the same
    /// statement: the account's, else `default_provider`. A second payment
    /// that is not a terminal failure for the same order is refused by the
    /// partial unique index, whatever the code above did: `Ok(None)`, and
    /// nothing inserted. The statement names that index as its conflict
    /// target (`ON CONFLICT ... DO NOTHING`), so the refusal aborts nothing:
    /// the transaction stays usable, and the caller reads the blocking
    /// payment in it ([`lock_active_payment_for_account`]) instead of after
    /// a rollback, when it may have failed already and named nobody
    /// (issue 53). Any other unique violation (an id taken) is an error.
    ///
    /// [`lock_active_payment_for_account`]: Self::lock_active_payment_for_account
    pub async fn insert_payment_for(
        &mut self,
        p: &NewPayment,
        default_provider: Option<&str>,
        now: DateTime<Utc>,
    ) -> Result<Option<PaymentRow>> {
        let sql = format!(
            "INSERT INTO payments (id, account_id, order_ref, intent, amount, currency, \
            capture_method, payment_method, description, metadata, status, status_changed_at, \
            created_at, updated_at, provider, return_url, route) \
            VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, 'processing', $11, $11, $11, \
            COALESCE($14, (SELECT provider FROM accounts WHERE id = $2), $12), $13, $15) \
            ON CONFLICT (account_id, order_ref) \
            WHERE status NOT IN ('declined', 'failed', 'canceled') DO NOTHING \
            RETURNING {PAYMENT_COLUMNS}"
        );
        let done: Option<PaymentRow> = on_tx!(self, conn => sqlx::query_as(&sql)
            .bind(DbId::from(p.id))
            .bind(DbId::from(p.account))
            .bind(p.order_ref.as_str())
            .bind(p.intent.as_str())
            .bind(p.amount)
            .bind(p.currency)
            .bind(p.capture_method)
            .bind(&p.payment_method)
            .bind(&p.description)
            .bind(&p.metadata)
            .bind(DbTime(now))
            .bind(default_provider)
            .bind(&p.return_url)
            .bind(&p.provider)
            .bind(&p.route)
            .fetch_optional(&mut *conn)
            .await?);
        Ok(done)
    }

    /// The next `n` for `{order_ref}:{verb}-v{n}` in this account. For
    /// capture, cancel and refund, call it after the payment row lock that
    /// serialises the operation. For authorize it serialises the order
    /// itself: nothing locks an order before its payment is inserted, and
    /// the count and the insert are two statements, so another create of
    /// the order could commit and fail in between, take the same `n`, and
    /// this create's intent then met the unique name (issue 53, a 500). On
    /// PostgreSQL a transaction-scoped advisory lock on (account, order),
    /// taken in a statement of its own so that the count's snapshot is
    /// taken after it, holds every other create of the order until this
    /// transaction ends (one round trip more per create; a hash collision
    /// of two orders only makes them wait for each other; two `int4` keys,
    /// a key space apart from the sequencer's single `int8` key). On
    /// SQLite the transaction holds the one write lock already.
    pub async fn next_intent_sequence(
        &mut self,
        account: AccountId,
        order_ref: &OrderRef,
        operation: Operation,
    ) -> Result<u32> {
        let count: i64 = if operation == Operation::Authorize {
            if let crate::TxInner::Postgres(t) = &mut self.inner {
                sqlx::query("SELECT pg_advisory_xact_lock(hashtext($1::text), hashtext($2))")
                    .bind(DbId::from(account))
                    .bind(order_ref.as_str())
                    .execute(&mut *t)
                    .await?;
            }
            let sql = "SELECT COUNT(*) FROM payments WHERE account_id = $1 AND order_ref = $2";
            on_tx!(self, conn => sqlx::query_scalar(sql)
                .bind(DbId::from(account))
                .bind(order_ref.as_str())
                .fetch_one(&mut *conn)
                .await?)
        } else {
            self.intents_of_order(account, order_ref.as_str(), operation)
                .await?
        };
        u32::try_from(count + 1).map_err(|_| StoreError::Corrupt("intent count".into()))
    }

    /// `{order_ref}:{verb}-v{n}` for the next intent of `operation` on an
    /// order. Call it after the statement that locked the payment row, so
    /// two concurrent intents cannot get the same number.
    pub async fn next_intent_name(
        &mut self,
        account: AccountId,
        order_ref: &str,
        operation: Operation,
    ) -> Result<IntentName> {
        let order_ref = OrderRef::parse(order_ref)
            .map_err(|_| StoreError::Corrupt(format!("order_ref {order_ref}")))?;
        let sequence = self
            .next_intent_sequence(account, &order_ref, operation)
            .await?;
        Ok(IntentName::new(&order_ref, operation, sequence))
    }

    /// Opens an intent with its first attempt (a fresh provider idempotency
    /// key, stored before any send) and the outbox row, due now.
    pub async fn open_intent(
        &mut self,
        account: AccountId,
        payment: PaymentId,
        refund: Option<RefundId>,
        operation: Operation,
        name: &IntentName,
        now: DateTime<Utc>,
    ) -> Result<crate::AttemptRow> {
        let provider_key = uuid::Uuid::new_v4().to_string();
        let attempt_id = cobro_core::AttemptId::new();
        let reference = cobro_core::attempt_reference(name.as_str(), attempt_id);
        let sql = match &self.inner {
            // One round trip instead of three on the hot path: PostgreSQL
            // runs the three INSERTs of one statement in order, and they
            // commit or roll back with the transaction like any other.
            crate::TxInner::Postgres(_) => format!(
                "WITH i AS (INSERT INTO intents (id, account_id, payment_id, refund_id, operation, \
                     name, created_at) VALUES ($1, $2, $3, $4, $5, $6, $7) RETURNING id), \
                 a AS (INSERT INTO attempts (id, intent_id, payment_id, refund_id, operation, \
                     provider_key, reference, state, created_at, updated_at, account_id, provider) \
                     SELECT $8, i.id, $3, $4, $5, $9, $11, 'pending', $7, $7, $2, \
                     (SELECT provider FROM payments WHERE id = $3) FROM i \
                     RETURNING *), \
                 o AS (INSERT INTO outbox (id, attempt_id, state, due_at, created_at, updated_at, \
                     traceparent, tracestate, account_id) \
                     SELECT $10, a.id, 'pending', $7, $7, $7, $12, $13, $2 FROM a) \
                 SELECT {} FROM a",
                qualified(ATTEMPT_COLUMNS, "a")
            ),
            // SQLite has no data-modifying CTEs: three statements in one
            // query text, which sqlx sends to the connection's thread as one
            // command (it runs every statement of the text, binding `$n` in
            // each). Every hand-off holds the one writer of the process:
            // one instead of three won in 9 of 9 alternated pairs, by 14%
            // (median) of new payments/s (ops/bench/results/bench.md, "fewer
            // hand-offs on SQLite's writer"). Only the attempt's INSERT
            // returns a row. The attempt's and the outbox row's account are
            // the payment's, as `enqueue_attempt` copies them.
            crate::TxInner::Sqlite(_) => format!(
                "INSERT INTO intents (id, account_id, payment_id, refund_id, operation, name, \
                     created_at) VALUES ($1, $2, $3, $4, $5, $6, $7); \
                 INSERT INTO attempts (id, intent_id, payment_id, refund_id, operation, \
                     provider_key, reference, state, created_at, updated_at, account_id, provider) \
                     VALUES ($8, $1, $3, $4, $5, $9, $11, 'pending', $7, $7, \
                     (SELECT account_id FROM payments WHERE id = $3), \
                     (SELECT provider FROM payments WHERE id = $3)) RETURNING {ATTEMPT_COLUMNS}; \
                 INSERT INTO outbox (id, attempt_id, state, due_at, created_at, updated_at, \
                     traceparent, tracestate, account_id) \
                     VALUES ($10, $8, 'pending', $7, $7, $7, $12, $13, \
                     (SELECT account_id FROM attempts WHERE id = $8))"
            ),
        };
        // The outbox row keeps the creating request's trace context.
        let trace = cobro_telemetry::current_context();
        // `fetch_all`, never `fetch_one`: on SQLite a query asked for one
        // row stops at that row, and the outbox INSERT after it would not run.
        let mut rows: Vec<crate::AttemptRow> = on_tx!(self, conn => sqlx::query_as(&sql)
            .bind(DbId::from(IntentId::new()))
            .bind(DbId::from(account))
            .bind(DbId::from(payment))
            .bind(refund.map(DbId::from))
            .bind(operation)
            .bind(name.as_str())
            .bind(DbTime(now))
            .bind(DbId::from(attempt_id))
            .bind(&provider_key)
            .bind(DbId::from(cobro_core::OutboxId::new()))
            .bind(&reference)
            .bind(trace.as_ref().map(|t| t.traceparent.as_str()))
            .bind(trace.as_ref().and_then(|t| t.tracestate.as_deref()))
            .fetch_all(&mut *conn)
            .await?);
        let (Some(attempt), None) = (rows.pop(), rows.pop()) else {
            return Err(StoreError::Corrupt(
                "opening an intent made no single attempt".into(),
            ));
        };
        self.note_enqueued();
        Ok(attempt)
    }

    pub async fn insert_intent(
        &mut self,
        account: AccountId,
        payment: PaymentId,
        refund: Option<RefundId>,
        operation: Operation,
        name: &IntentName,
        now: DateTime<Utc>,
    ) -> Result<IntentId> {
        let id = IntentId::new();
        let sql = "INSERT INTO intents (id, account_id, payment_id, refund_id, operation, name, \
            created_at) VALUES ($1, $2, $3, $4, $5, $6, $7)";
        on_tx!(self, conn => sqlx::query(sql)
            .bind(DbId::from(id))
            .bind(DbId::from(account))
            .bind(DbId::from(payment))
            .bind(refund.map(DbId::from))
            .bind(operation)
            .bind(name.as_str())
            .bind(DbTime(now))
            .execute(&mut *conn)
            .await?
            .rows_affected());
        Ok(id)
    }

    /// Compare-and-set of a payment's status within its account, returning
    /// the updated row. `None` means the payment is not in `from` (or not
    /// this account's): someone else moved first.
    pub async fn transition_payment(
        &mut self,
        account: AccountId,
        payment: PaymentId,
        from: PaymentStatus,
        to: PaymentStatus,
        now: DateTime<Utc>,
    ) -> Result<Option<PaymentRow>> {
        let sql = format!(
            "UPDATE payments SET status = $4, status_changed_at = $5, updated_at = $5 \
             WHERE id = $1 AND account_id = $2 AND status = $3 RETURNING {PAYMENT_COLUMNS}"
        );
        let moved: Option<PaymentRow> = on_tx!(self, conn => sqlx::query_as(&sql)
            .bind(DbId::from(payment))
            .bind(DbId::from(account))
            .bind(from)
            .bind(to)
            .bind(DbTime(now))
            .fetch_optional(&mut *conn)
            .await?);
        Ok(self.noting_move(moved))
    }

    /// Records that the merchant asked to cancel while the authorisation
    /// outcome is unknown; the worker voids once it is known. Compare-and-set
    /// on the status so it cannot race an outcome being recorded.
    pub async fn request_cancel(
        &mut self,
        account: AccountId,
        payment: PaymentId,
        while_in: PaymentStatus,
        now: DateTime<Utc>,
    ) -> Result<Option<PaymentRow>> {
        let sql = format!(
            "UPDATE payments SET cancel_requested_at = COALESCE(cancel_requested_at, $4), \
             updated_at = $4 WHERE id = $1 AND account_id = $2 AND status = $3 \
             RETURNING {PAYMENT_COLUMNS}"
        );
        Ok(on_tx!(self, conn => sqlx::query_as(&sql)
            .bind(DbId::from(payment))
            .bind(DbId::from(account))
            .bind(while_in)
            .bind(DbTime(now))
            .fetch_optional(&mut *conn)
            .await?))
    }

    /// Reserves `amount` of the captured money for a new refund, atomically:
    /// the conditional UPDATE takes the payment's row lock, so concurrent
    /// refunds with different keys serialise here and the sum of refunds that
    /// are not failed can never pass the captured amount.
    pub async fn reserve_refund(
        &mut self,
        account: AccountId,
        payment: PaymentId,
        amount: i64,
        now: DateTime<Utc>,
    ) -> Result<Result<(), RefundRefusal>> {
        let sql = "UPDATE payments SET amount_refund_reserved = amount_refund_reserved + $3, \
            updated_at = $4 WHERE id = $1 AND account_id = $2 \
            AND status IN ('captured', 'partially_refunded') \
            AND amount_refund_reserved + $3 <= amount_captured";
        let n = on_tx!(self, conn => sqlx::query(sql)
            .bind(DbId::from(payment))
            .bind(DbId::from(account))
            .bind(amount)
            .bind(DbTime(now))
            .execute(&mut *conn)
            .await?
            .rows_affected());
        if n == 1 {
            return Ok(Ok(()));
        }
        let status_sql = "SELECT status FROM payments WHERE id = $1 AND account_id = $2";
        let status: Option<PaymentStatus> = on_tx!(self, conn => sqlx::query_scalar(status_sql)
            .bind(DbId::from(payment))
            .bind(DbId::from(account))
            .fetch_optional(&mut *conn)
            .await?);
        Ok(Err(match status {
            None => RefundRefusal::NotFound,
            Some(PaymentStatus::Captured | PaymentStatus::PartiallyRefunded) => {
                RefundRefusal::ExceedsCaptured
            }
            Some(_) => RefundRefusal::NotRefundable,
        }))
    }

    pub async fn insert_refund(&mut self, r: &NewRefund, now: DateTime<Utc>) -> Result<RefundRow> {
        let sql = format!(
            "INSERT INTO refunds (id, account_id, payment_id, intent, amount, reason, \
             status, status_changed_at, created_at, updated_at, reference) \
             VALUES ($1, $2, $3, $4, $5, $6, 'processing', $7, $7, $7, $8) RETURNING {REFUND_COLUMNS}"
        );
        Ok(on_tx!(self, conn => sqlx::query_as(&sql)
            .bind(DbId::from(r.id))
            .bind(DbId::from(r.account))
            .bind(DbId::from(r.payment))
            .bind(r.intent.as_str())
            .bind(r.amount)
            .bind(&r.reason)
            .bind(DbTime(now))
            .bind(&r.reference)
            .fetch_one(&mut *conn)
            .await?))
    }

    /// The refund of `payment` that carries the merchant's `reference`,
    /// read under the payment's lock (the caller holds it), so a concurrent
    /// refund with the same reference waits and then finds this one.
    pub async fn refund_by_reference(
        &mut self,
        account: AccountId,
        payment: PaymentId,
        reference: &str,
    ) -> Result<Option<RefundRow>> {
        let sql = format!(
            "SELECT {REFUND_COLUMNS} FROM refunds \
             WHERE account_id = $1 AND payment_id = $2 AND reference = $3"
        );
        Ok(on_tx!(self, conn => sqlx::query_as(&sql)
            .bind(DbId::from(account))
            .bind(DbId::from(payment))
            .bind(reference)
            .fetch_optional(&mut *conn)
            .await?))
    }

    /// A payment of this account, locked until the transaction ends
    /// (PostgreSQL `FOR UPDATE`; on SQLite the transaction already holds
    /// the one write lock). Handlers decide from this row, so a refusal
    /// stored against a key is never based on a read a concurrent worker
    /// has already overtaken.
    pub async fn lock_payment_for_account(
        &mut self,
        account: AccountId,
        id: PaymentId,
    ) -> Result<Option<PaymentRow>> {
        let sql = payment_by_id(Scope::ForAccount, self.lock_clause());
        Ok(on_tx!(self, conn => sqlx::query_as(&sql)
            .bind(DbId::from(id))
            .bind(DbId::from(account))
            .fetch_optional(&mut *conn)
            .await?))
    }

    /// The payment that holds an order (the one that is not a terminal
    /// failure, if any), read in this transaction and held until it ends:
    /// `FOR SHARE` on PostgreSQL, so the payment cannot leave the active
    /// statuses (a worker recording a decline waits) while the caller
    /// answers from it, and a payment being moved is read as it ends up
    /// (read committed re-checks the row after the mover commits); on
    /// SQLite the transaction holds the one write lock already. `None`: no
    /// payment of the order is active any more.
    pub async fn lock_active_payment_for_account(
        &mut self,
        account: AccountId,
        order_ref: &OrderRef,
    ) -> Result<Option<PaymentId>> {
        let lock = match &self.inner {
            crate::TxInner::Postgres(_) => " FOR SHARE",
            crate::TxInner::Sqlite(_) => "",
        };
        let sql = format!(
            "SELECT id FROM payments WHERE account_id = $1 AND order_ref = $2 \
             AND status NOT IN ('declined', 'failed', 'canceled'){lock}"
        );
        let id: Option<DbId> = on_tx!(self, conn => sqlx::query_scalar(&sql)
            .bind(DbId::from(account))
            .bind(order_ref.as_str())
            .fetch_optional(&mut *conn)
            .await?);
        Ok(id.map(|id| PaymentId::from_uuid(id.0)))
    }
}

impl Store {
    /// A payment of this account; another account's payment is `None`,
    /// exactly like one that does not exist.
    pub async fn payment_for_account(
        &self,
        account: AccountId,
        id: PaymentId,
    ) -> Result<Option<PaymentRow>> {
        let sql = payment_by_id(Scope::ForAccount, "");
        Ok(on_pool!(self, pool => sqlx::query_as(&sql)
            .bind(DbId::from(id))
            .bind(DbId::from(account))
            .fetch_optional(pool)
            .await?))
    }

    /// A payment of this account with its attempts (oldest first), read by
    /// one statement: one round trip, and one snapshot of the payment and
    /// its attempts (two statements could show a payment already moved by
    /// an attempt they do not show yet). `None`: no such payment in this
    /// account. A payment without attempts (none is made so; the join
    /// returns no row for it) is read again on its own.
    pub async fn payment_with_attempts_for_account(
        &self,
        account: AccountId,
        id: PaymentId,
    ) -> Result<Option<(PaymentRow, Vec<AttemptRow>)>> {
        // Every GET of a payment runs it: its 43 columns are spelled out
        // once per process, not once per request.
        static SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
            format!(
                "SELECT {}, {} FROM payments p JOIN attempts a ON a.payment_id = p.id \
                 WHERE p.id = $1 AND p.account_id = $2 ORDER BY a.created_at, a.id",
                qualified(PAYMENT_COLUMNS, "p"),
                prefixed(ATTEMPT_COLUMNS, "a", ATTEMPT_PREFIX),
            )
        });
        let rows: Vec<PaymentWithAttempt> = on_pool!(self, pool => sqlx::query_as(SQL.as_str())
            .bind(DbId::from(id))
            .bind(DbId::from(account))
            .fetch_all(pool)
            .await?);
        let mut rows = rows.into_iter();
        let Some(first) = rows.next() else {
            let alone = self.payment_for_account(account, id).await?;
            return Ok(alone.map(|payment| (payment, Vec::new())));
        };
        let mut attempts = vec![first.attempt.into()];
        attempts.extend(rows.map(|row| AttemptRow::from(row.attempt)));
        Ok(Some((first.payment, attempts)))
    }

    /// Payments of an account, newest first (ids are time-ordered).
    pub async fn payments_for_account(
        &self,
        account: AccountId,
        f: &PaymentFilter,
    ) -> Result<Vec<PaymentRow>> {
        let sql = format!(
            "SELECT {PAYMENT_COLUMNS} FROM payments WHERE account_id = $1 \
             AND ($2 IS NULL OR order_ref = $2) AND ($3 IS NULL OR status = $3) \
             AND ($4 IS NULL OR id < $4) ORDER BY id DESC LIMIT $5"
        );
        Ok(on_pool!(self, pool => sqlx::query_as(&sql)
            .bind(DbId::from(account))
            .bind(f.order_ref.as_deref())
            .bind(f.status)
            .bind(f.before.map(DbId::from))
            .bind(i64::from(f.limit))
            .fetch_all(pool)
            .await?))
    }

    /// How many payments an account has for one order, in any state.
    pub async fn count_order_payments_for_account(
        &self,
        account: AccountId,
        order_ref: &str,
    ) -> Result<i64> {
        let sql = "SELECT COUNT(*) FROM payments WHERE account_id = $1 AND order_ref = $2";
        Ok(on_pool!(self, pool => sqlx::query_scalar(sql)
            .bind(DbId::from(account))
            .bind(order_ref)
            .fetch_one(pool)
            .await?))
    }

    pub async fn attempts_of_payment_any_account(
        &self,
        payment: PaymentId,
    ) -> Result<Vec<AttemptRow>> {
        let sql = attempts_of_payment(Scope::AnyAccount, None);
        Ok(on_pool!(self, pool => sqlx::query_as(&sql)
            .bind(DbId::from(payment))
            .fetch_all(pool)
            .await?))
    }

    /// Every attempt of a payment of this account, oldest first; another
    /// account's payment has none, exactly like one that does not exist.
    pub async fn attempts_of_payment_for_account(
        &self,
        account: AccountId,
        payment: PaymentId,
    ) -> Result<Vec<AttemptRow>> {
        let sql = attempts_of_payment(Scope::ForAccount, None);
        Ok(on_pool!(self, pool => sqlx::query_as(&sql)
            .bind(DbId::from(payment))
            .bind(DbId::from(account))
            .fetch_all(pool)
            .await?))
    }

    /// A refund of this account by its id; another account's refund is
    /// `None`, exactly like one that does not exist.
    pub async fn refund_for_account(
        &self,
        account: AccountId,
        refund: RefundId,
    ) -> Result<Option<RefundRow>> {
        let sql = refund_by_id(Scope::ForAccount);
        Ok(on_pool!(self, pool => sqlx::query_as(&sql)
            .bind(DbId::from(refund))
            .bind(DbId::from(account))
            .fetch_optional(pool)
            .await?))
    }

    pub async fn refunds_of_payment_any_account(
        &self,
        payment: PaymentId,
    ) -> Result<Vec<RefundRow>> {
        let sql = format!("SELECT {REFUND_COLUMNS} FROM refunds WHERE payment_id = $1 ORDER BY id");
        Ok(on_pool!(self, pool => sqlx::query_as(&sql)
            .bind(DbId::from(payment))
            .fetch_all(pool)
            .await?))
    }
}
