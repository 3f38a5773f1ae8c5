//! [`SqliteJournal`]: the durable journal, one SQLite file the merchant
//! points at.
//!
//! Durability: the file runs in WAL mode with `synchronous=FULL`, so every
//! commit fsyncs the WAL before it returns: when [`Journal::record`] has
//! returned, the intent survives `kill -9` and a power cut, and the client
//! sends only after that. (`NORMAL`, SQLite's usual WAL setting, may lose the
//! last commits on power loss: exactly the intent whose request is about to
//! go out.)
//!
//! The table is `cobro_client_intents`; the merchant may keep its own tables
//! in the same file ([`SqliteJournal::pool`]), as the example checkout does.

use crate::journal::{Intent, Journal, JournalError, NewIntent, StoredAnswer};
use crate::types::Operation;
use chrono::{DateTime, SecondsFormat, Utc};
use sqlx::Row;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteRow,
    SqliteSynchronous,
};
use std::path::Path;
use std::time::Duration;

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS cobro_client_intents (
    reference        TEXT PRIMARY KEY,
    operation        TEXT NOT NULL,
    path             TEXT NOT NULL,
    body             BLOB NOT NULL,
    idempotency_key  TEXT NOT NULL UNIQUE,
    created_at       TEXT NOT NULL,
    -- NULL while pending; the rest of the answer is set with it.
    answer_status    INTEGER,
    answer_body      BLOB,
    answer_replayed  INTEGER,
    answer_request_id TEXT,
    answer_location  TEXT,
    answered_at      TEXT
);
CREATE INDEX IF NOT EXISTS cobro_client_intents_pending
    ON cobro_client_intents (created_at) WHERE answer_status IS NULL;
";

const COLUMNS: &str = "reference, operation, path, body, idempotency_key, created_at, \
     answer_status, answer_body, answer_replayed, answer_request_id, answer_location, answered_at";

/// The durable journal. Cheap to clone (a connection pool).
#[derive(Clone, Debug)]
pub struct SqliteJournal {
    pool: SqlitePool,
}

impl SqliteJournal {
    /// Opens (creating if missing) the journal file at `path`.
    pub async fn open(path: impl AsRef<Path>) -> Result<Self, JournalError> {
        let options = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            // Other processes (a second checkout, an operator's sqlite3) may
            // hold the write lock for a moment.
            .busy_timeout(Duration::from_secs(5));
        let pool = SqlitePoolOptions::new()
            .max_connections(4)
            .connect_with(options)
            .await?;
        sqlx::raw_sql(SCHEMA).execute(&pool).await?;
        Ok(Self { pool })
    }

    /// The pool over the journal's file, for the merchant's own tables.
    /// Its connections run with the same durability settings.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    async fn fetch(&self, reference: &str) -> Result<Option<Intent>, JournalError> {
        let row = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM cobro_client_intents WHERE reference = ?1"
        ))
        .bind(reference)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(intent_from_row).transpose()
    }
}

fn time(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Micros, true)
}

fn parse_time(text: &str) -> Result<DateTime<Utc>, JournalError> {
    DateTime::parse_from_rfc3339(text)
        .map(|t| t.with_timezone(&Utc))
        .map_err(|e| JournalError::Corrupt(format!("time `{text}`: {e}")))
}

fn intent_from_row(row: &SqliteRow) -> Result<Intent, JournalError> {
    let status: Option<i64> = row.try_get("answer_status")?;
    let answer = match status {
        None => None,
        Some(status) => Some(StoredAnswer {
            status: u16::try_from(status)
                .map_err(|_| JournalError::Corrupt(format!("status {status}")))?,
            body: row
                .try_get::<Option<Vec<u8>>, _>("answer_body")?
                .unwrap_or_default(),
            replayed: row.try_get::<Option<bool>, _>("answer_replayed")?,
            request_id: row.try_get("answer_request_id")?,
            location: row.try_get("answer_location")?,
            received_at: parse_time(
                &row.try_get::<Option<String>, _>("answered_at")?
                    .unwrap_or_default(),
            )?,
        }),
    };
    Ok(Intent {
        reference: row.try_get("reference")?,
        operation: Operation::from(row.try_get::<String, _>("operation")?),
        path: row.try_get("path")?,
        body: row.try_get("body")?,
        key: row.try_get("idempotency_key")?,
        created_at: parse_time(&row.try_get::<String, _>("created_at")?)?,
        answer,
    })
}

impl Journal for SqliteJournal {
    async fn record(&self, intent: NewIntent) -> Result<Intent, JournalError> {
        // One statement, committed (and fsynced) on its own; an existing
        // reference wins, so a second `record` of the same intent, even
        // from another process, returns the first one's key.
        sqlx::query(
            "INSERT INTO cobro_client_intents \
             (reference, operation, path, body, idempotency_key, created_at) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6) ON CONFLICT (reference) DO NOTHING",
        )
        .bind(&intent.reference)
        .bind(intent.operation.as_str())
        .bind(&intent.path)
        .bind(&intent.body)
        .bind(&intent.key)
        .bind(time(Utc::now()))
        .execute(&self.pool)
        .await?;
        self.fetch(&intent.reference)
            .await?
            .ok_or(JournalError::UnknownReference(intent.reference))
    }

    async fn complete(&self, reference: &str, answer: &StoredAnswer) -> Result<(), JournalError> {
        // Compare-and-set on "still pending": the first answer stays.
        let done = sqlx::query(
            "UPDATE cobro_client_intents SET answer_status = ?2, answer_body = ?3, \
             answer_replayed = ?4, answer_request_id = ?5, answer_location = ?6, answered_at = ?7 \
             WHERE reference = ?1 AND answer_status IS NULL",
        )
        .bind(reference)
        .bind(i64::from(answer.status))
        .bind(&answer.body)
        .bind(answer.replayed)
        .bind(&answer.request_id)
        .bind(&answer.location)
        .bind(time(answer.received_at))
        .execute(&self.pool)
        .await?;
        if done.rows_affected() == 0 && self.fetch(reference).await?.is_none() {
            return Err(JournalError::UnknownReference(reference.to_owned()));
        }
        Ok(())
    }

    async fn pending(&self) -> Result<Vec<Intent>, JournalError> {
        let rows = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM cobro_client_intents WHERE answer_status IS NULL \
             ORDER BY created_at, rowid"
        ))
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(intent_from_row).collect()
    }

    async fn get(&self, reference: &str) -> Result<Option<Intent>, JournalError> {
        self.fetch(reference).await
    }
}
