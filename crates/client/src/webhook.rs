//! Receiving cobro's events: verify, deduplicate, apply in order.
//!
//! cobro delivers every event at least once, so a receiver sees duplicates
//! (same `id`). One endpoint receives each payment's events in `sequence`
//! order (the next is sent once the previous is delivered or dead), but a
//! redelivery (an operator's resend, a replay of dead deliveries, a retry
//! after a lost answer) can still bring an old event after a newer one, and
//! two endpoints of one merchant are not ordered with each other. Two
//! contracts, two checks:
//! - **identity**: an event id already applied is a duplicate (answer 2xx,
//!   change nothing);
//! - **order**: `sequence` increases with every change of a payment (its
//!   refunds share it); an event whose sequence is not above the last one
//!   applied to the same object is stale and never overwrites the newer
//!   state.
//!
//! [`EventInbox`] keeps both in the merchant's own SQLite (tables
//! `cobro_client_events` and `cobro_client_objects`) and runs the
//! merchant's change in the SAME transaction as the bookkeeping, so a crash
//! can never record an event as applied without its effect, or the reverse.
//!
//! A runnable round trip (an event signed as cobro signs it, received
//! twice, then an older one):
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use cobro_client::webhook::{Decision, EventInbox, verify_event};
//! let pool = sqlx::sqlite::SqlitePoolOptions::new().max_connections(1)
//!     .connect("sqlite::memory:").await?;
//! let inbox = EventInbox::open(pool).await?;
//! let event = |id: &str, sequence: i64, status: &str| serde_json::json!({
//!     "id": id, "type": format!("payment.{status}"), "position": sequence,
//!     "sequence": sequence, "object_type": "payment", "object_id": "p-1",
//!     "payment_id": "p-1", "created_at": "2026-12-01T12:00:00.000000Z",
//!     "data": {"id": "p-1", "status": status},
//! }).to_string();
//! let now = chrono::Utc::now();
//! let receive = async |body: String| -> Result<Decision, Box<dyn std::error::Error>> {
//!     // What cobro's dispatcher sends in the `Cobro-Signature` header.
//!     let header = cobro_core::signature::sign(&["whsec_test"], now.timestamp(), body.as_bytes());
//!     let event = verify_event(&header, body.as_bytes(), &["whsec_test"], now,
//!         std::time::Duration::from_secs(300))?;
//!     Ok(inbox.apply(&event, async |_tx, _event| Ok(())).await?)
//! };
//! assert_eq!(receive(event("e-2", 2, "captured")).await?, Decision::Applied);
//! assert_eq!(receive(event("e-2", 2, "captured")).await?, Decision::Duplicate);
//! assert_eq!(receive(event("e-1", 1, "processing")).await?, Decision::Stale);
//! assert_eq!(inbox.applied_sequence("p-1").await?, Some(2));
//! # Ok(())
//! # }
//! ```
//!
//! With the Standard Webhooks headers instead (the same secret, as cobro
//! shows it):
//!
//! ```
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use cobro_client::webhook::verify_standard_event;
//! let secret = "whsec_0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
//! let body = br#"{"id":"e-1","type":"payment.created","position":1,"sequence":1,"object_type":"payment","object_id":"p-1","payment_id":"p-1","created_at":"2026-12-01T12:00:00.000000Z","data":{}}"#;
//! let now = chrono::Utc::now();
//! // What cobro's dispatcher sends in `webhook-signature`.
//! let signature = cobro_core::standard_webhooks::sign(&[secret], "e-1", now.timestamp(), body);
//! let event = verify_standard_event("e-1", &now.timestamp().to_string(), &signature, body,
//!     &[secret], now, std::time::Duration::from_secs(300))?;
//! assert_eq!(event.sequence, 1);
//! # Ok(()) }
//! ```
//!
//! In a handler:
//!
//! ```no_run
//! # async fn handler(headers: &std::collections::HashMap<String, String>, body: &[u8]) -> Result<(), Box<dyn std::error::Error>> {
//! use cobro_client::webhook::{EventInbox, verify_event};
//! let pool = sqlx::SqlitePool::connect("sqlite:///var/lib/shop/shop.db").await?;
//! let inbox = EventInbox::open(pool).await?;
//! let event = verify_event(&headers["cobro-signature"], body, &["whsec_..."],
//!     chrono::Utc::now(), std::time::Duration::from_secs(300))?;
//! inbox.apply(&event, async |tx, event| {
//!     sqlx::query("UPDATE orders SET payment_status = ? WHERE payment_id = ?")
//!         .bind(event.data["status"].as_str()).bind(&event.payment_id)
//!         .execute(&mut *tx).await.map(|_| ())
//! }).await?; // then answer 200, also for a duplicate or a stale event
//! # Ok(()) }
//! ```

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use sqlx::SqlitePool;
use std::time::Duration;

pub use cobro_core::signature::SignatureError;

/// The header cobro signs its events with: `t=<unix seconds>,v1=<hex>`,
/// one `v1` per valid secret while one is being rotated.
pub const SIGNATURE_HEADER: &str = "cobro-signature";

/// The Standard Webhooks headers cobro also sends
/// (<https://www.standardwebhooks.com/>): the event id, the unix seconds of
/// the send, and space-separated `v1,<base64>` signatures of
/// `"{id}.{timestamp}.{body}"`, one per valid secret. The endpoint secret
/// as cobro shows it (`whsec_...`) is the Standard Webhooks secret:
/// give it unchanged to any of the specification's libraries, or to
/// [`verify_standard_event`].
pub use cobro_core::standard_webhooks::{
    ID_HEADER as STANDARD_ID_HEADER, SIGNATURE_HEADER as STANDARD_SIGNATURE_HEADER,
    TIMESTAMP_HEADER as STANDARD_TIMESTAMP_HEADER,
};

/// One event, as cobro sends it (and `GET /v1/events` lists it).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WebhookEvent {
    /// Stable across redeliveries: deduplicate by it.
    pub id: String,
    /// `payment.captured`, `refund.succeeded`, ...
    #[serde(rename = "type")]
    pub event_type: String,
    /// The account's feed position (`GET /v1/events?after=`).
    pub position: i64,
    /// Strictly increasing per payment; apply by it.
    pub sequence: i64,
    /// `payment` or `refund`.
    pub object_type: String,
    pub object_id: String,
    pub payment_id: String,
    pub created_at: String,
    /// The object after the change (a `Payment` or a `Refund`).
    pub data: serde_json::Value,
}

#[derive(Debug, thiserror::Error)]
pub enum WebhookError {
    #[error("signature refused: {0}")]
    Signature(#[from] SignatureError),
    #[error("the body is not an event: {0}")]
    Body(#[from] serde_json::Error),
    #[error("the inbox could not be read or written: {0}")]
    Store(#[from] sqlx::Error),
}

/// Checks the `Cobro-Signature` header of `body` against any of `secrets`
/// (within `tolerance` of `now`, compared in constant time) and decodes the
/// event. Answer 400 (or just not 2xx) when this fails: cobro retries.
pub fn verify_event(
    signature: &str,
    body: &[u8],
    secrets: &[&str],
    now: DateTime<Utc>,
    tolerance: Duration,
) -> Result<WebhookEvent, WebhookError> {
    cobro_core::signature::verify(
        signature,
        body,
        secrets,
        now.timestamp(),
        tolerance.as_secs(),
    )?;
    Ok(serde_json::from_slice(body)?)
}

/// Checks the Standard Webhooks headers of `body` (`webhook-id`,
/// `webhook-timestamp`, `webhook-signature`: pass their values) against
/// any of `secrets` (each `whsec_...` as cobro showed it), within
/// `tolerance` of `now`, in constant time, and decodes the event. The
/// same check as [`verify_event`], by the specification's scheme.
pub fn verify_standard_event(
    id: &str,
    timestamp: &str,
    signature: &str,
    body: &[u8],
    secrets: &[&str],
    now: DateTime<Utc>,
    tolerance: Duration,
) -> Result<WebhookEvent, WebhookError> {
    cobro_core::standard_webhooks::verify(
        id,
        timestamp,
        signature,
        body,
        secrets,
        now.timestamp(),
        tolerance.as_secs(),
    )?;
    Ok(serde_json::from_slice(body)?)
}

/// What the inbox did with an event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// New and newer than anything applied to its object: applied.
    Applied,
    /// This event id was already received: nothing done.
    Duplicate,
    /// Older than (or as old as) what its object already shows: recorded
    /// as received, not applied.
    Stale,
}

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS cobro_client_events (
    event_id     TEXT PRIMARY KEY,
    object_id    TEXT NOT NULL,
    sequence     INTEGER NOT NULL,
    decision     TEXT NOT NULL,
    received_at  TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS cobro_client_objects (
    object_id    TEXT PRIMARY KEY,
    sequence     INTEGER NOT NULL
);
";

/// Deduplication by id and ordering by sequence, in the merchant's SQLite.
#[derive(Clone, Debug)]
pub struct EventInbox {
    pool: SqlitePool,
}

impl EventInbox {
    /// Creates the inbox's tables if needed, in the merchant's database.
    pub async fn open(pool: SqlitePool) -> Result<Self, WebhookError> {
        sqlx::raw_sql(SCHEMA).execute(&pool).await?;
        Ok(Self { pool })
    }

    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// Runs `apply` for `event` unless it is a duplicate or stale, in one
    /// transaction with the inbox's own bookkeeping: if `apply` fails,
    /// nothing is recorded and the event is applied when redelivered.
    ///
    /// Call it where it cannot be cancelled half-way (in a task of its own,
    /// `tokio::spawn`): HTTP servers drop a handler's future when the client
    /// disconnects (cobro gives up after its timeout), and a future dropped
    /// inside a transaction can leave a pooled SQLite connection holding
    /// it (a known sqlx 0.8 hazard), which stalls the next deliveries.
    pub async fn apply<F>(&self, event: &WebhookEvent, apply: F) -> Result<Decision, WebhookError>
    where
        F: AsyncFnOnce(&mut sqlx::SqliteConnection, &WebhookEvent) -> Result<(), sqlx::Error>,
    {
        // BEGIN IMMEDIATE: two deliveries of one event at once serialise
        // here instead of both reading "not seen".
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let received_at = Utc::now().to_rfc3339();
        let seen: Option<String> =
            sqlx::query_scalar("SELECT decision FROM cobro_client_events WHERE event_id = ?")
                .bind(&event.id)
                .fetch_optional(&mut *tx)
                .await?;
        if seen.is_some() {
            return Ok(Decision::Duplicate);
        }
        let newest: Option<i64> =
            sqlx::query_scalar("SELECT sequence FROM cobro_client_objects WHERE object_id = ?")
                .bind(&event.object_id)
                .fetch_optional(&mut *tx)
                .await?;
        let decision = if newest.is_some_and(|n| n >= event.sequence) {
            Decision::Stale
        } else {
            apply(&mut tx, event).await?;
            sqlx::query(
                "INSERT INTO cobro_client_objects (object_id, sequence) VALUES (?, ?) \
                 ON CONFLICT (object_id) DO UPDATE SET sequence = excluded.sequence",
            )
            .bind(&event.object_id)
            .bind(event.sequence)
            .execute(&mut *tx)
            .await?;
            Decision::Applied
        };
        sqlx::query(
            "INSERT INTO cobro_client_events (event_id, object_id, sequence, decision, received_at) \
             VALUES (?, ?, ?, ?, ?)",
        )
        .bind(&event.id)
        .bind(&event.object_id)
        .bind(event.sequence)
        .bind(match decision {
            Decision::Applied => "applied",
            Decision::Stale => "stale",
            Decision::Duplicate => "duplicate",
        })
        .bind(received_at)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(decision)
    }

    /// The newest sequence applied to an object, if any.
    pub async fn applied_sequence(&self, object_id: &str) -> Result<Option<i64>, WebhookError> {
        Ok(
            sqlx::query_scalar("SELECT sequence FROM cobro_client_objects WHERE object_id = ?")
                .bind(object_id)
                .fetch_optional(&self.pool)
                .await?,
        )
    }
}
