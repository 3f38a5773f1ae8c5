//! Events to merchants: the feed, the endpoints and the deliveries.
//!
//! Layout:
//! - events are WRITTEN by the schema (migration `0006_events`): a trigger
//!   on every status change of a payment or refund, and on conflicting
//!   evidence, inserts the event in the changing statement, with the
//!   payment's next `sequence`. Nothing here writes one.
//! - [`Store::sequence_events`] gives committed events their
//!   `feed_position`, one sequencer at a time (a transaction-scoped advisory
//!   lock on PostgreSQL, the one writer on SQLite), and creates their
//!   deliveries to the account's endpoints. Positions therefore become
//!   visible in increasing order with no gap: a reader that has seen
//!   position `n` can never later find an unseen event below `n`.
//! - reads: [`Store::list_events`] (after a position), [`Store::event`].
//! - endpoints: create, list, delete, rotate the secret, re-enable.
//! - deliveries: [`Store::claim_deliveries`] (lease + fencing token, SKIP
//!   LOCKED on PostgreSQL; a payment's next delivery to an endpoint only
//!   once the previous is delivered or dead), [`Store::record_delivery`]
//!   (fenced; `410 Gone` disables the endpoint), [`Store::release_delivery`],
//!   [`Store::resend_event`], [`Store::replay_dead_deliveries`].

use crate::{Backend, DbId, DbTime, Result, Store, on_pool, on_tx, on_write_pool};
use chrono::{DateTime, Utc};
use cobro_core::{AccountId, DeliveryState, EndpointId, EventId, PaymentId};
use serde_json::{Value, json};

/// A stored event.
#[derive(Clone, Debug, sqlx::FromRow)]
pub struct EventRow {
    pub id: EventId,
    pub account_id: AccountId,
    /// The feed cursor; `None` until sequenced (never shown then).
    pub feed_position: Option<i64>,
    #[sqlx(rename = "type")]
    pub event_type: String,
    pub object_type: String,
    pub object_id: DbId,
    pub payment_id: PaymentId,
    /// Strictly increasing per payment (its refunds share it).
    pub sequence: i64,
    /// The object's representation after the change, as JSON text.
    pub data: String,
    pub created_at: DbTime,
}

const EVENT_COLUMNS: &str = "id, account_id, feed_position, type, object_type, object_id, \
    payment_id, sequence, data, created_at";

impl EventRow {
    /// The event as merchants receive it (pushed and pulled alike).
    pub fn to_json(&self) -> Value {
        let data: Value = serde_json::from_str(&self.data).unwrap_or(Value::Null);
        json!({
            "id": self.id.to_string(),
            "type": self.event_type,
            "position": self.feed_position,
            "sequence": self.sequence,
            "object_type": self.object_type,
            "object_id": self.object_id.0.to_string(),
            "payment_id": self.payment_id.to_string(),
            "created_at": self.created_at.0.to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
            "data": data,
        })
    }
}

/// Filters and page of the feed, oldest first.
#[derive(Clone, Debug, Default)]
pub struct EventFilter {
    /// Only events after this position (0: from the start).
    pub after: i64,
    pub event_type: Option<String>,
    /// The payment or refund the event is about; a payment also matches
    /// its refunds' events.
    pub object: Option<uuid::Uuid>,
    pub limit: u32,
}

/// A merchant's endpoint, as stored (the secrets included: only for the
/// dispatcher and the one answer that creates or rotates them).
#[derive(Clone, sqlx::FromRow)]
pub struct EndpointRow {
    pub id: EndpointId,
    pub account_id: AccountId,
    pub url: String,
    pub secret: String,
    pub previous_secret: Option<String>,
    pub previous_secret_expires_at: Option<DbTime>,
    /// `*` or comma-separated event types.
    pub event_types: String,
    pub enabled: bool,
    pub disabled_reason: Option<String>,
    pub failing_since: Option<DbTime>,
    pub created_at: DbTime,
    pub updated_at: DbTime,
}

impl std::fmt::Debug for EndpointRow {
    // Secrets never reach a log line through `{:?}`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EndpointRow")
            .field("id", &self.id)
            .field("url", &self.url)
            .field("event_types", &self.event_types)
            .field("enabled", &self.enabled)
            .finish_non_exhaustive()
    }
}

impl EndpointRow {
    /// The secrets that sign at `now`: the current one, and the previous
    /// one until it expires.
    pub fn signing_secrets(&self, now: DateTime<Utc>) -> Vec<&str> {
        let mut secrets = vec![self.secret.as_str()];
        if let (Some(previous), Some(until)) =
            (&self.previous_secret, self.previous_secret_expires_at)
            && now < until.0
        {
            secrets.push(previous);
        }
        secrets
    }

    pub fn types(&self) -> Vec<String> {
        self.event_types.split(',').map(str::to_owned).collect()
    }
}

const ENDPOINT_COLUMNS: &str = "id, account_id, url, secret, previous_secret, \
    previous_secret_expires_at, event_types, enabled, disabled_reason, failing_since, \
    created_at, updated_at";

/// A leased delivery: the event, where it goes, and the fencing token.
#[derive(Clone, Debug)]
pub struct DeliveryClaim {
    pub event: EventRow,
    pub endpoint: EndpointRow,
    pub token: i64,
    /// When the lease ends: a POST that could outlive it is not started
    /// (another dispatcher may send this event by then, and the next one
    /// of its payment after it).
    pub lease_until: DateTime<Utc>,
    /// Attempts made before this one.
    pub attempts: i32,
    pub first_attempt_at: Option<DateTime<Utc>>,
}

/// What one attempt to deliver came to.
#[derive(Clone, Debug)]
pub enum DeliveryResult {
    /// The endpoint answered 2xx.
    Delivered { status: u16 },
    /// Anything else: retried at `retry_at`, or dead when `None`. `status`
    /// is the answer's, if there was one. `disable_before`: disable the
    /// endpoint if it has been failing since before this instant.
    Failed {
        status: Option<u16>,
        error: String,
        retry_at: Option<DateTime<Utc>>,
        disable_before: DateTime<Utc>,
    },
    /// The endpoint answered `410 Gone`: it says it is gone for good, so
    /// it is disabled at once with that reason (no retry period), and this
    /// delivery waits, with a fresh retry period, until it is enabled
    /// again.
    Gone,
}

/// What recording an attempt did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Recorded {
    /// Written under this claim's token.
    Written { endpoint_disabled: bool },
    /// Another dispatcher holds the delivery now: nothing written.
    LeaseLost,
}

/// One row of the deliveries of an event (for operators and tests).
#[derive(Clone, Debug, sqlx::FromRow)]
pub struct DeliveryRow {
    pub event_id: EventId,
    pub endpoint_id: EndpointId,
    pub state: DeliveryState,
    pub attempts: i32,
    pub last_status: Option<i32>,
    pub last_error: Option<String>,
    pub due_at: DbTime,
}

/// A delivery's error after its endpoint answered `410 Gone`.
pub const GONE_ERROR: &str = "answered 410 Gone: the endpoint is disabled";

/// The claim's ordering rule, in SQL (both stores): no delivery of the
/// same payment to the same endpoint with a lower sequence is still
/// pending. One probe of `event_deliveries_payment_order` (migration
/// 0017), whose predicate `sequence IS NOT NULL` this states.
const ORDERED: &str = "NOT EXISTS (SELECT 1 FROM event_deliveries earlier \
    WHERE earlier.endpoint_id = dd.endpoint_id AND earlier.payment_id = dd.payment_id \
    AND earlier.state = 'pending' AND earlier.sequence IS NOT NULL \
    AND earlier.sequence < dd.sequence)";

/// A lock id of cobro's own: the sequencer's (PostgreSQL advisory lock).
const SEQUENCER_LOCK: i64 = 0x636f_6272_6f18;

/// How many events one sequencer transaction takes.
const SEQUENCE_BATCH: i64 = 500;

/// The statement that makes a pending delivery (due at `$2`) of each event
/// `filter` selects (alias `e`, `$1` its parameter) to each endpoint (alias
/// `ep`) of the event's account that takes the event's type.
///
/// On PostgreSQL each endpoint row is locked (`FOR KEY SHARE`) as it is
/// read. An endpoint that another transaction deletes meanwhile is then
/// skipped once that transaction commits, instead of failing the insert's
/// foreign key check (a 500 from `GET /v1/events`, which sequences, while a
/// merchant deleted an endpoint); and one deleted afterwards waits for this
/// commit and takes these deliveries with it (`ON DELETE CASCADE`). SQLite's
/// one writer cannot interleave the two.
fn insert_deliveries(tx: &crate::WriteTx, filter: &str) -> String {
    let lock = match tx.inner {
        crate::TxInner::Postgres(_) => " FOR KEY SHARE OF ep",
        crate::TxInner::Sqlite(_) => "",
    };
    format!(
        "INSERT INTO event_deliveries (event_id, endpoint_id, account_id, \
         payment_id, sequence, state, due_at, created_at, updated_at) \
         SELECT e.id, ep.id, e.account_id, e.payment_id, e.sequence, 'pending', $2, $2, $2 \
         FROM events e JOIN event_endpoints ep ON ep.account_id = e.account_id \
         WHERE {filter} \
         AND (ep.event_types = '*' OR (',' || ep.event_types || ',') LIKE ('%,' || e.type || ',%')) \
         {lock} ON CONFLICT DO NOTHING"
    )
}

impl Store {
    /// Gives committed events their feed positions and creates their
    /// deliveries; returns how many it sequenced. Cheap when there is
    /// nothing to do (one indexed read, no write transaction).
    pub async fn sequence_events(&self, now: DateTime<Utc>) -> Result<u64> {
        let mut total = 0;
        loop {
            let pending = "SELECT COUNT(*) FROM (SELECT 1 FROM events \
                WHERE feed_position IS NULL LIMIT 1) x";
            let waiting: i64 =
                on_pool!(self, pool => sqlx::query_scalar(pending).fetch_one(pool).await?);
            if waiting == 0 {
                return Ok(total);
            }
            let mut tx = self.begin().await?;
            if let crate::TxInner::Postgres(t) = &mut tx.inner {
                // Held until COMMIT: the next sequencer reads MAX below only
                // after this one's positions are committed.
                sqlx::query("SELECT pg_advisory_xact_lock($1)")
                    .bind(SEQUENCER_LOCK)
                    .execute(&mut *t)
                    .await?;
            }
            let base_sql = "SELECT COALESCE(MAX(feed_position), 0) FROM events";
            let base: i64 = on_tx!(tx, conn => sqlx::query_scalar(base_sql)
                .fetch_one(&mut *conn)
                .await?);
            // Insertion order within the batch: one payment's events are
            // written one transaction at a time (its row lock), so they
            // keep their sequence order in the feed.
            let assign = "UPDATE events SET feed_position = $1 + t.rn FROM \
                (SELECT id, row_number() OVER (ORDER BY written) AS rn FROM \
                  (SELECT id, written FROM events WHERE feed_position IS NULL \
                   ORDER BY written LIMIT $2) x) t \
                WHERE events.id = t.id";
            let n = on_tx!(tx, conn => sqlx::query(assign)
                .bind(base)
                .bind(SEQUENCE_BATCH)
                .execute(&mut *conn)
                .await?
                .rows_affected());
            // Disabled endpoints get their deliveries too: they wait
            // (the claim takes only enabled endpoints' rows) and go out once
            // the endpoint is enabled, instead of being stranded.
            let deliveries = insert_deliveries(&tx, "e.feed_position > $1");
            on_tx!(tx, conn => sqlx::query(&deliveries)
                .bind(base)
                .bind(DbTime(now))
                .execute(&mut *conn)
                .await?
                .rows_affected());
            tx.commit().await?;
            total += n;
            if n < SEQUENCE_BATCH as u64 {
                return Ok(total);
            }
        }
    }

    /// The account's sequenced events after `f.after`, oldest first.
    pub async fn events_for_account(
        &self,
        account: AccountId,
        f: &EventFilter,
    ) -> Result<Vec<EventRow>> {
        let sql = format!(
            "SELECT {EVENT_COLUMNS} FROM events WHERE account_id = $1 \
             AND feed_position IS NOT NULL AND feed_position > $2 \
             AND ($3 IS NULL OR type = $3) \
             AND ($4 IS NULL OR object_id = $4 OR payment_id = $4) \
             ORDER BY feed_position LIMIT $5"
        );
        Ok(on_pool!(self, pool => sqlx::query_as(&sql)
            .bind(DbId::from(account))
            .bind(f.after)
            .bind(f.event_type.as_deref())
            .bind(f.object.map(DbId))
            .bind(i64::from(f.limit))
            .fetch_all(pool)
            .await?))
    }

    /// One sequenced event of the account.
    pub async fn event_for_account(
        &self,
        account: AccountId,
        id: EventId,
    ) -> Result<Option<EventRow>> {
        let sql = format!(
            "SELECT {EVENT_COLUMNS} FROM events WHERE id = $1 AND account_id = $2 \
             AND feed_position IS NOT NULL"
        );
        Ok(on_pool!(self, pool => sqlx::query_as(&sql)
            .bind(DbId::from(id))
            .bind(DbId::from(account))
            .fetch_optional(pool)
            .await?))
    }

    /// Every event of a payment (and its refunds), by sequence, sequenced
    /// or not: for operators and tests.
    pub async fn events_of_payment_any_account(&self, payment: PaymentId) -> Result<Vec<EventRow>> {
        let sql =
            format!("SELECT {EVENT_COLUMNS} FROM events WHERE payment_id = $1 ORDER BY sequence");
        Ok(on_pool!(self, pool => sqlx::query_as(&sql)
            .bind(DbId::from(payment))
            .fetch_all(pool)
            .await?))
    }

    /// Events of every account (operators: `cobro events list`), after a
    /// position, oldest first.
    pub async fn events_any_account(&self, after: i64, limit: u32) -> Result<Vec<EventRow>> {
        let sql = format!(
            "SELECT {EVENT_COLUMNS} FROM events WHERE feed_position > $1 \
             ORDER BY feed_position LIMIT $2"
        );
        Ok(on_pool!(self, pool => sqlx::query_as(&sql)
            .bind(after)
            .bind(i64::from(limit))
            .fetch_all(pool)
            .await?))
    }

    pub async fn create_endpoint(
        &self,
        account: AccountId,
        url: &str,
        secret: &str,
        event_types: &[String],
        now: DateTime<Utc>,
    ) -> Result<EndpointRow> {
        let types = if event_types.is_empty() {
            "*".to_owned()
        } else {
            event_types.join(",")
        };
        let sql = format!(
            "INSERT INTO event_endpoints (id, account_id, url, secret, event_types, enabled, \
             created_at, updated_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $7) \
             RETURNING {ENDPOINT_COLUMNS}"
        );
        Ok(on_write_pool!(self, pool => sqlx::query_as(&sql)
            .bind(DbId::from(EndpointId::new()))
            .bind(DbId::from(account))
            .bind(url)
            .bind(secret)
            .bind(types)
            .bind(true)
            .bind(DbTime(now))
            .fetch_one(pool)
            .await?))
    }

    /// Endpoints of an account, or of every account (`None`), oldest first.
    pub async fn list_endpoints(&self, account: Option<AccountId>) -> Result<Vec<EndpointRow>> {
        let sql = format!(
            "SELECT {ENDPOINT_COLUMNS} FROM event_endpoints \
             WHERE ($1 IS NULL OR account_id = $1) ORDER BY created_at, id"
        );
        Ok(on_pool!(self, pool => sqlx::query_as(&sql)
            .bind(account.map(DbId::from))
            .fetch_all(pool)
            .await?))
    }

    /// Deletes an endpoint and its deliveries. `false`: no such endpoint
    /// in this account (`None`: any account).
    pub async fn delete_endpoint(
        &self,
        account: Option<AccountId>,
        id: EndpointId,
    ) -> Result<bool> {
        // One statement: the endpoint's row first, then its deliveries by
        // the foreign key's ON DELETE CASCADE. The same order as whoever
        // makes or records deliveries (the endpoint locked first:
        // `insert_deliveries`, `record_delivery`), so they never deadlock;
        // deleting the deliveries first did, against a resend that found
        // one of them (PostgreSQL).
        let endpoint =
            "DELETE FROM event_endpoints WHERE id = $1 AND ($2 IS NULL OR account_id = $2)";
        let n = on_write_pool!(self, pool => sqlx::query(endpoint)
            .bind(DbId::from(id))
            .bind(account.map(DbId::from))
            .execute(pool)
            .await?
            .rows_affected());
        Ok(n == 1)
    }

    /// Replaces the signing secret; the previous one keeps signing until
    /// `previous_valid_until` (both are sent meanwhile).
    pub async fn rotate_endpoint_secret(
        &self,
        account: Option<AccountId>,
        id: EndpointId,
        secret: &str,
        previous_valid_until: DateTime<Utc>,
        now: DateTime<Utc>,
    ) -> Result<Option<EndpointRow>> {
        let sql = format!(
            "UPDATE event_endpoints SET previous_secret = secret, secret = $3, \
             previous_secret_expires_at = $4, updated_at = $5 \
             WHERE id = $1 AND ($2 IS NULL OR account_id = $2) RETURNING {ENDPOINT_COLUMNS}"
        );
        Ok(on_write_pool!(self, pool => sqlx::query_as(&sql)
            .bind(DbId::from(id))
            .bind(account.map(DbId::from))
            .bind(secret)
            .bind(DbTime(previous_valid_until))
            .bind(DbTime(now))
            .fetch_optional(pool)
            .await?))
    }

    /// Enables an endpoint again (after an operator fixed it).
    pub async fn enable_endpoint(
        &self,
        account: Option<AccountId>,
        id: EndpointId,
        now: DateTime<Utc>,
    ) -> Result<bool> {
        let sql = "UPDATE event_endpoints SET enabled = $3, disabled_reason = NULL, \
            failing_since = NULL, updated_at = $4 WHERE id = $1 AND ($2 IS NULL OR account_id = $2)";
        let n = on_write_pool!(self, pool => sqlx::query(sql)
            .bind(DbId::from(id))
            .bind(account.map(DbId::from))
            .bind(true)
            .bind(DbTime(now))
            .execute(pool)
            .await?
            .rows_affected());
        Ok(n == 1)
    }

    /// Claims up to `limit` due deliveries to enabled endpoints for `owner`
    /// until `lease_until`, bumping each one's fencing token. One short
    /// statement, then one read: no transaction stays open.
    ///
    /// In each payment's order: a delivery is claimed only when no
    /// delivery of the same payment to the same endpoint with a lower
    /// sequence is still `pending` (waiting, retrying or leased by anyone),
    /// so the next event waits until the previous one is delivered or
    /// dead, across every dispatcher on this database, while other
    /// payments' deliveries go ahead ([`ORDERED`]). `skip`: endpoints this
    /// dispatcher is already sending as much as it may to (nothing is
    /// claimed for them).
    #[tracing::instrument(
        name = "events.claim",
        skip_all,
        fields(owner, limit, claimed = tracing::field::Empty)
    )]
    pub async fn claim_deliveries(
        &self,
        owner: &str,
        now: DateTime<Utc>,
        lease_until: DateTime<Utc>,
        limit: u32,
        skip: &[EndpointId],
    ) -> Result<Vec<DeliveryClaim>> {
        let skip: Vec<uuid::Uuid> = skip.iter().map(|id| id.as_uuid()).collect();
        let leased: Vec<(DbId, DbId, i64)> = match &self.backend {
            // SKIP LOCKED: concurrent dispatchers take disjoint rows. `due`
            // is MATERIALIZED so that it runs once, never again per row of a
            // nested loop (see `Store::claim_due_for`). A delivery leased by
            // another dispatcher is still `pending`, so the next one of its
            // payment stays out of reach until that one is recorded.
            Backend::Postgres(pool) => {
                let sql = format!(
                    "WITH due AS MATERIALIZED (SELECT dd.event_id, dd.endpoint_id \
                           FROM event_deliveries dd \
                           JOIN event_endpoints ep ON ep.id = dd.endpoint_id AND ep.enabled \
                           WHERE dd.state = 'pending' AND dd.due_at <= $2 \
                           AND NOT (dd.endpoint_id = ANY($5)) AND {ORDERED} \
                           ORDER BY dd.due_at LIMIT $4 FOR UPDATE OF dd SKIP LOCKED) \
                     UPDATE event_deliveries d SET lease_owner = $1, \
                     lease_token = d.lease_token + 1, lease_expires_at = $3, due_at = $3, \
                     updated_at = $2 \
                     FROM due WHERE d.event_id = due.event_id AND d.endpoint_id = due.endpoint_id \
                     RETURNING d.event_id, d.endpoint_id, d.lease_token"
                );
                sqlx::query_as(&sql)
                    .bind(owner)
                    .bind(DbTime(now))
                    .bind(DbTime(lease_until))
                    .bind(i64::from(limit))
                    .bind(skip)
                    .fetch_all(pool)
                    .await?
            }
            // One writer: the single UPDATE is the claim, a write
            // transaction of its own in the writer's group.
            Backend::Sqlite(pools) => {
                let mut member = pools.writer.begin_statement().await?;
                let pool = member.conn();
                let sql = format!(
                    "UPDATE event_deliveries SET lease_owner = $1, \
                     lease_token = lease_token + 1, lease_expires_at = $3, due_at = $3, \
                     updated_at = $2 \
                     WHERE (event_id, endpoint_id) IN (SELECT dd.event_id, dd.endpoint_id \
                           FROM event_deliveries dd \
                           JOIN event_endpoints ep ON ep.id = dd.endpoint_id AND ep.enabled \
                           WHERE dd.state = 'pending' AND dd.due_at <= $2 \
                           AND dd.endpoint_id NOT IN (SELECT value FROM json_each($5)) \
                           AND {ORDERED} \
                           ORDER BY dd.due_at LIMIT $4) \
                     RETURNING event_id, endpoint_id, lease_token"
                );
                let skip: Vec<String> = skip.iter().map(uuid::Uuid::to_string).collect();
                let skip = serde_json::to_string(&skip)
                    .map_err(|e| crate::StoreError::Corrupt(e.to_string()))?;
                let leased = sqlx::query_as(&sql)
                    .bind(owner)
                    .bind(DbTime(now))
                    .bind(DbTime(lease_until))
                    .bind(i64::from(limit))
                    .bind(skip)
                    .fetch_all(pool)
                    .await?;
                member.commit().await?;
                leased
            }
        };
        tracing::Span::current().record("claimed", leased.len());
        if leased.is_empty() {
            return Ok(Vec::new());
        }
        let pairs = (0..leased.len())
            .map(|i| {
                format!(
                    "(d.event_id = ${} AND d.endpoint_id = ${})",
                    2 * i + 1,
                    2 * i + 2
                )
            })
            .collect::<Vec<_>>()
            .join(" OR ");
        let event_columns = EVENT_COLUMNS
            .split(", ")
            .map(|c| format!("e.{c}"))
            .collect::<Vec<_>>()
            .join(", ");
        // The endpoint shares column names with the event (id, account,
        // creation time): it is read by id below, one small read per claim.
        let sql = format!(
            "SELECT d.lease_token, d.attempts, d.first_attempt_at, d.endpoint_id, {event_columns} \
             FROM event_deliveries d JOIN events e ON e.id = d.event_id \
             WHERE ({pairs}) AND d.state = 'pending'"
        );
        #[derive(sqlx::FromRow)]
        struct Row {
            lease_token: i64,
            attempts: i32,
            first_attempt_at: Option<DbTime>,
            endpoint_id: DbId,
            #[sqlx(flatten)]
            event: EventRow,
        }
        let rows: Vec<Row> = on_pool!(self, pool => {
            let mut q = sqlx::query_as(&sql);
            for (event, endpoint, _) in &leased {
                q = q.bind(*event).bind(*endpoint);
            }
            q.fetch_all(pool).await?
        });
        let mut claims = Vec::with_capacity(rows.len());
        let endpoint_sql = format!("SELECT {ENDPOINT_COLUMNS} FROM event_endpoints WHERE id = $1");
        for row in rows {
            // Only the token this claim set: a row claimed again since is
            // not ours.
            if !leased.contains(&(DbId::from(row.event.id), row.endpoint_id, row.lease_token)) {
                continue;
            }
            let endpoint: Option<EndpointRow> = on_pool!(self, pool => sqlx::query_as(&endpoint_sql)
                .bind(row.endpoint_id)
                .fetch_optional(pool)
                .await?);
            let Some(endpoint) = endpoint else { continue };
            claims.push(DeliveryClaim {
                event: row.event,
                endpoint,
                token: row.lease_token,
                lease_until,
                attempts: row.attempts,
                first_attempt_at: row.first_attempt_at.map(|t| t.0),
            });
        }
        Ok(claims)
    }

    /// Records one attempt of a claimed delivery, fenced by its token, and
    /// the endpoint's health with it (one short transaction).
    pub async fn record_delivery(
        &self,
        claim: &DeliveryClaim,
        result: &DeliveryResult,
        now: DateTime<Utc>,
    ) -> Result<Recorded> {
        let mut tx = self.begin().await?;
        let (event, endpoint) = (claim.event.id, claim.endpoint.id);
        // The endpoint before its delivery, as every transaction here takes
        // them (`insert_deliveries`; `delete_endpoint`, whose cascade takes
        // the deliveries after the endpoint): this one updates the delivery
        // and then the endpoint, and without this lock a delete in between
        // would deadlock with it (PostgreSQL). KEY SHARE waits only for a
        // delete; other recordings and the endpoint's updates go on.
        if matches!(tx.inner, crate::TxInner::Postgres(_)) {
            let lock = "SELECT 1 FROM event_endpoints WHERE id = $1 FOR KEY SHARE";
            on_tx!(tx, conn => sqlx::query(lock)
                .bind(endpoint)
                .execute(&mut *conn)
                .await?
                .rows_affected());
        }
        let first = claim.first_attempt_at.unwrap_or(now);
        let mut endpoint_disabled = false;
        let n = match result {
            DeliveryResult::Delivered { status } => {
                let sql = "UPDATE event_deliveries SET state = 'delivered', \
                    attempts = attempts + 1, last_status = $4, last_error = NULL, \
                    first_attempt_at = $5, delivered_at = $6, lease_owner = NULL, \
                    lease_expires_at = NULL, updated_at = $6 \
                    WHERE event_id = $1 AND endpoint_id = $2 AND lease_token = $3 \
                    AND state = 'pending'";
                on_tx!(tx, conn => sqlx::query(sql)
                    .bind(event)
                    .bind(endpoint)
                    .bind(claim.token)
                    .bind(i32::from(*status))
                    .bind(DbTime(first))
                    .bind(DbTime(now))
                    .execute(&mut *conn)
                    .await?
                    .rows_affected())
            }
            DeliveryResult::Gone => {
                let sql = "UPDATE event_deliveries SET due_at = $4, attempts = attempts + 1, \
                    last_status = 410, last_error = $5, first_attempt_at = NULL, \
                    lease_owner = NULL, lease_expires_at = NULL, updated_at = $4 \
                    WHERE event_id = $1 AND endpoint_id = $2 AND lease_token = $3 \
                    AND state = 'pending'";
                on_tx!(tx, conn => sqlx::query(sql)
                    .bind(event)
                    .bind(endpoint)
                    .bind(claim.token)
                    .bind(DbTime(now))
                    .bind(GONE_ERROR)
                    .execute(&mut *conn)
                    .await?
                    .rows_affected())
            }
            DeliveryResult::Failed {
                status,
                error,
                retry_at,
                ..
            } => {
                let sql = "UPDATE event_deliveries SET \
                    state = CASE WHEN $4 IS NULL THEN 'dead' ELSE 'pending' END, \
                    due_at = COALESCE($4, due_at), attempts = attempts + 1, \
                    last_status = $5, last_error = $6, first_attempt_at = $7, \
                    lease_owner = NULL, lease_expires_at = NULL, updated_at = $8 \
                    WHERE event_id = $1 AND endpoint_id = $2 AND lease_token = $3 \
                    AND state = 'pending'";
                on_tx!(tx, conn => sqlx::query(sql)
                    .bind(event)
                    .bind(endpoint)
                    .bind(claim.token)
                    .bind(retry_at.map(DbTime))
                    .bind(status.map(i32::from))
                    .bind(error.as_str())
                    .bind(DbTime(first))
                    .bind(DbTime(now))
                    .execute(&mut *conn)
                    .await?
                    .rows_affected())
            }
        };
        if n != 1 {
            tx.rollback().await?;
            return Ok(Recorded::LeaseLost);
        }
        match result {
            DeliveryResult::Delivered { .. } => {
                let sql = "UPDATE event_endpoints SET failing_since = NULL, updated_at = $2 \
                    WHERE id = $1 AND failing_since IS NOT NULL";
                on_tx!(tx, conn => sqlx::query(sql)
                    .bind(endpoint)
                    .bind(DbTime(now))
                    .execute(&mut *conn)
                    .await?
                    .rows_affected());
            }
            DeliveryResult::Gone => {
                let disable = "UPDATE event_endpoints SET enabled = $2, disabled_reason = $3, \
                    updated_at = $4 WHERE id = $1 AND enabled";
                let reason = format!(
                    "the endpoint answered 410 Gone at {} (event {}): disabled until enabled again",
                    now.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
                    claim.event.id
                );
                endpoint_disabled = on_tx!(tx, conn => sqlx::query(disable)
                    .bind(endpoint)
                    .bind(false)
                    .bind(reason)
                    .bind(DbTime(now))
                    .execute(&mut *conn)
                    .await?
                    .rows_affected())
                    == 1;
            }
            DeliveryResult::Failed {
                error,
                disable_before,
                ..
            } => {
                let failing = "UPDATE event_endpoints SET \
                    failing_since = COALESCE(failing_since, $2) WHERE id = $1";
                on_tx!(tx, conn => sqlx::query(failing)
                    .bind(endpoint)
                    .bind(DbTime(now))
                    .execute(&mut *conn)
                    .await?
                    .rows_affected());
                let disable = "UPDATE event_endpoints SET enabled = $3, disabled_reason = $4, \
                    updated_at = $5 WHERE id = $1 AND enabled AND failing_since <= $2";
                let reason = format!(
                    "every delivery failed since {}; last error: {error}",
                    claim
                        .endpoint
                        .failing_since
                        .map_or(now, |t| t.0)
                        .to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
                );
                endpoint_disabled = on_tx!(tx, conn => sqlx::query(disable)
                    .bind(endpoint)
                    .bind(DbTime(*disable_before))
                    .bind(false)
                    .bind(reason)
                    .bind(DbTime(now))
                    .execute(&mut *conn)
                    .await?
                    .rows_affected())
                    == 1;
            }
        }
        tx.commit().await?;
        Ok(Recorded::Written { endpoint_disabled })
    }

    /// Gives a claimed delivery back unsent (fenced by its token): due now,
    /// for any dispatcher. `false`: the lease was no longer ours.
    pub async fn release_delivery(
        &self,
        claim: &DeliveryClaim,
        now: DateTime<Utc>,
    ) -> Result<bool> {
        let sql = "UPDATE event_deliveries SET due_at = $4, lease_owner = NULL, \
            lease_expires_at = NULL, updated_at = $4 \
            WHERE event_id = $1 AND endpoint_id = $2 AND lease_token = $3 AND state = 'pending'";
        let n = on_write_pool!(self, pool => sqlx::query(sql)
            .bind(claim.event.id)
            .bind(claim.endpoint.id)
            .bind(claim.token)
            .bind(DbTime(now))
            .execute(pool)
            .await?
            .rows_affected());
        Ok(n == 1)
    }

    /// Sends an event again to every enabled endpoint of its account that
    /// takes its type (a delivery that was delivered or dead starts over,
    /// with a fresh retry period). Returns how many deliveries are pending.
    pub async fn resend_event(
        &self,
        account: Option<AccountId>,
        id: EventId,
        now: DateTime<Utc>,
    ) -> Result<Option<u64>> {
        let mut tx = self.begin().await?;
        let exists = "SELECT COUNT(*) FROM events WHERE id = $1 AND feed_position IS NOT NULL \
            AND ($2 IS NULL OR account_id = $2)";
        let found: i64 = on_tx!(tx, conn => sqlx::query_scalar(exists)
            .bind(DbId::from(id))
            .bind(account.map(DbId::from))
            .fetch_one(&mut *conn)
            .await?);
        if found == 0 {
            tx.rollback().await?;
            return Ok(None);
        }
        let create = insert_deliveries(&tx, "e.id = $1 AND ep.enabled");
        on_tx!(tx, conn => sqlx::query(&create)
            .bind(DbId::from(id))
            .bind(DbTime(now))
            .execute(&mut *conn)
            .await?
            .rows_affected());
        let restart = "UPDATE event_deliveries SET state = 'pending', due_at = $2, attempts = 0, \
            first_attempt_at = NULL, last_error = NULL, updated_at = $2 WHERE event_id = $1";
        let n = on_tx!(tx, conn => sqlx::query(restart)
            .bind(DbId::from(id))
            .bind(DbTime(now))
            .execute(&mut *conn)
            .await?
            .rows_affected());
        tx.commit().await?;
        Ok(Some(n))
    }

    /// Puts every dead delivery (of one account, or all) back in the queue
    /// with a fresh retry period; returns how many.
    pub async fn replay_dead_deliveries(
        &self,
        account: Option<AccountId>,
        now: DateTime<Utc>,
    ) -> Result<u64> {
        let sql = "UPDATE event_deliveries SET state = 'pending', due_at = $2, attempts = 0, \
            first_attempt_at = NULL, last_error = NULL, updated_at = $2 \
            WHERE state = 'dead' AND ($1 IS NULL OR account_id = $1)";
        Ok(on_write_pool!(self, pool => sqlx::query(sql)
            .bind(account.map(DbId::from))
            .bind(DbTime(now))
            .execute(pool)
            .await?
            .rows_affected()))
    }

    /// The deliveries of an event, for operators and tests.
    pub async fn deliveries_of_event_any_account(
        &self,
        event: EventId,
    ) -> Result<Vec<DeliveryRow>> {
        let sql = "SELECT event_id, endpoint_id, state, attempts, last_status, last_error, due_at \
            FROM event_deliveries WHERE event_id = $1 ORDER BY endpoint_id";
        Ok(on_pool!(self, pool => sqlx::query_as(sql)
            .bind(DbId::from(event))
            .fetch_all(pool)
            .await?))
    }

    /// Deliveries per state, all accounts.
    pub async fn delivery_counts(&self) -> Result<Vec<(DeliveryState, i64)>> {
        let sql = "SELECT state, COUNT(*) FROM event_deliveries GROUP BY state ORDER BY state";
        Ok(on_pool!(self, pool => sqlx::query_as(sql).fetch_all(pool).await?))
    }
}
