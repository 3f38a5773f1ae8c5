//! Idempotency records: one per (account, operation, key).
//!
//! The reservation is an INSERT inside the request's transaction. A second
//! request with the same scope blocks on the primary key until the first
//! transaction ends (bounded by the lock/busy timeout, which surfaces as
//! [`StoreError::Busy`]); if the first committed, the INSERT does nothing and
//! the committed record is read back; if it rolled back, the INSERT wins.

use crate::{DbId, DbTime, Result, StoreError, WriteTx, on_tx};
use chrono::{DateTime, Utc};
use cobro_core::{AccountId, Fingerprint, IdempotencyKey, Operation};
use uuid::Uuid;

/// The scope of a key: the same key under another account or operation is
/// an unrelated record.
#[derive(Clone, Debug)]
pub struct KeyScope {
    pub account: AccountId,
    pub operation: Operation,
    pub key: IdempotencyKey,
}

/// What a key points at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResourceType {
    Payment,
    Refund,
}

impl ResourceType {
    fn as_str(self) -> &'static str {
        match self {
            ResourceType::Payment => "payment",
            ResourceType::Refund => "refund",
        }
    }
}

/// A committed record, as a replay needs it.
#[derive(Clone, Debug)]
pub struct StoredRecord {
    pub fingerprint: Fingerprint,
    pub status_code: u16,
    /// The stored body, byte for byte; `None` once compacted to a tombstone.
    pub response_body: Option<Vec<u8>>,
    pub resource_type: ResourceType,
    pub resource_id: Uuid,
    pub created_at: DateTime<Utc>,
}

#[derive(Debug)]
pub enum Reservation {
    /// The key is ours for the rest of this transaction.
    Reserved,
    /// A committed record holds the key.
    Taken(StoredRecord),
}

/// A key's reservation: the record with a placeholder answer (status 0,
/// empty body), visible only to its transaction until `complete_key`.
const INSERT_RECORD: &str = "INSERT INTO idempotency_records \
    (account_id, operation, idempotency_key, fingerprint, state, status_code, \
     response_body, resource_type, resource_id, created_at) \
    VALUES ($1, $2, $3, $4, 'completed', 0, $5, $6, $7, $8) \
    ON CONFLICT (account_id, operation, idempotency_key) DO NOTHING";
const SELECT_RECORD: &str = "SELECT fingerprint, status_code, response_body, resource_type, resource_id, \
    created_at FROM idempotency_records \
    WHERE account_id = $1 AND operation = $2 AND idempotency_key = $3";

#[derive(sqlx::FromRow)]
struct RecordRow {
    fingerprint: String,
    status_code: i32,
    response_body: Option<Vec<u8>>,
    resource_type: String,
    resource_id: DbId,
    created_at: DbTime,
}

impl TryFrom<RecordRow> for StoredRecord {
    type Error = StoreError;
    fn try_from(row: RecordRow) -> Result<Self> {
        let resource_type = match row.resource_type.as_str() {
            "payment" => ResourceType::Payment,
            "refund" => ResourceType::Refund,
            other => return Err(StoreError::Corrupt(format!("resource_type {other}"))),
        };
        Ok(StoredRecord {
            fingerprint: Fingerprint::from_stored(row.fingerprint),
            status_code: u16::try_from(row.status_code)
                .map_err(|_| StoreError::Corrupt(format!("status_code {}", row.status_code)))?,
            response_body: row.response_body,
            resource_type,
            resource_id: row.resource_id.0,
            created_at: row.created_at.0,
        })
    }
}

impl WriteTx {
    /// Takes the key for this transaction, or returns the committed record
    /// that holds it. `resource` is the id the request will create or act on,
    /// decided before the transaction so the reservation is one statement.
    pub async fn reserve_key(
        &mut self,
        scope: &KeyScope,
        fingerprint: &Fingerprint,
        resource: (ResourceType, Uuid),
        now: DateTime<Utc>,
    ) -> Result<Reservation> {
        // The reservation's values, in the order of `INSERT_RECORD`'s placeholders.
        macro_rules! bind_reservation {
            ($query:expr) => {
                $query
                    .bind(DbId::from(scope.account))
                    .bind(scope.operation.as_str())
                    .bind(scope.key.as_str())
                    .bind(fingerprint.as_str())
                    .bind(Vec::<u8>::new())
                    .bind(resource.0.as_str())
                    .bind(DbId(resource.1))
                    .bind(DbTime(now))
            };
        }
        let found: Option<RecordRow> = match &mut self.inner {
            crate::TxInner::Postgres(tx) => {
                // One round trip for a replay too: the INSERT and the read
                // of the record that refused it are one statement. The
                // read sees the statement's snapshot, never the INSERT's
                // own row, so it finds a record committed before the
                // statement began. `reserved` says the INSERT won.
                // Spelled once per process: every create and replay runs it.
                static SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
                    format!(
                        "WITH ins AS ({INSERT_RECORD} RETURNING 1) \
                         SELECT EXISTS (SELECT 1 FROM ins) AS reserved, r.* FROM (SELECT 1) AS one \
                         LEFT JOIN ({SELECT_RECORD}) AS r ON true"
                    )
                });
                let row = bind_reservation!(sqlx::query(SQL.as_str()))
                    .fetch_one(&mut *tx)
                    .await?;
                if sqlx::Row::try_get::<bool, _>(&row, "reserved")? {
                    return Ok(Reservation::Reserved);
                }
                // NULL columns: the record that refused the INSERT was
                // committed by a concurrent holder the INSERT waited for,
                // after this statement's snapshot; read it again below.
                let fingerprint: Option<String> = sqlx::Row::try_get(&row, "fingerprint")?;
                match fingerprint {
                    Some(_) => Some(sqlx::FromRow::from_row(&row)?),
                    None => None,
                }
            }
            crate::TxInner::Sqlite(member) => {
                let inserted = bind_reservation!(sqlx::query(INSERT_RECORD))
                    .execute(member.conn())
                    .await?
                    .rows_affected();
                if inserted == 1 {
                    return Ok(Reservation::Reserved);
                }
                None
            }
        };
        let row = match found {
            Some(row) => row,
            None => on_tx!(self, conn => sqlx::query_as(SELECT_RECORD)
                .bind(DbId::from(scope.account))
                .bind(scope.operation.as_str())
                .bind(scope.key.as_str())
                .fetch_one(&mut *conn)
                .await?),
        };
        Ok(Reservation::Taken(row.try_into()?))
    }

    /// Stores the answer for a reserved key; commits with the transaction.
    pub async fn complete_key(&mut self, scope: &KeyScope, status: u16, body: &[u8]) -> Result<()> {
        let sql = "UPDATE idempotency_records SET status_code = $4, response_body = $5 \
            WHERE account_id = $1 AND operation = $2 AND idempotency_key = $3";
        let updated = on_tx!(self, conn => sqlx::query(sql)
            .bind(DbId::from(scope.account))
            .bind(scope.operation.as_str())
            .bind(scope.key.as_str())
            .bind(i32::from(status))
            .bind(body)
            .execute(&mut *conn)
            .await?
            .rows_affected());
        if updated != 1 {
            return Err(StoreError::Corrupt(
                "completing a key that was not reserved".into(),
            ));
        }
        Ok(())
    }
}

impl crate::Store {
    /// Reads the committed record of a key, if any (tests and operators).
    pub async fn find_record(&self, scope: &KeyScope) -> Result<Option<StoredRecord>> {
        let row: Option<RecordRow> = crate::on_pool!(self, pool => sqlx::query_as(SELECT_RECORD)
            .bind(DbId::from(scope.account))
            .bind(scope.operation.as_str())
            .bind(scope.key.as_str())
            .fetch_optional(pool)
            .await?);
        row.map(StoredRecord::try_from).transpose()
    }
}
