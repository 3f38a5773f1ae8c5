//! The journal of intents: what the client means to do, written down before
//! the first byte is sent, and the final answer once it has one.
//!
//! An intent is one money-moving request (operation, path, exact body) with
//! the `Idempotency-Key` generated for it, under a reference the merchant
//! chooses (`order-842/pay`). The key exists to make a retry of *that*
//! request safe, from any process, after any failure; so it must outlive
//! the process that generated it. A client that generated its key in memory
//! and died after sending would come back with a new key, and cobro would
//! rightly treat the retry as a new request: a second charge.
//!
//! [`SqliteJournal`](crate::SqliteJournal) is the durable one (a file, fsync
//! on every commit); [`MemoryJournal`] is for tests and for processes that
//! accept losing their pending intents when they die.

use crate::types::Operation;
use chrono::{DateTime, Utc};
use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};

/// An intent about to be journaled.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewIntent {
    /// The merchant's name for this intent, unique in the journal
    /// (`order-842/pay`, `order-842/refund-damaged`).
    pub reference: String,
    pub operation: Operation,
    /// The request path, e.g. `/v1/payments/{id}/capture`.
    pub path: String,
    /// The exact JSON body that is sent, every time.
    pub body: Vec<u8>,
    /// The `Idempotency-Key`: a random UUID made for this intent.
    pub key: String,
}

/// A journaled intent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Intent {
    pub reference: String,
    pub operation: Operation,
    pub path: String,
    pub body: Vec<u8>,
    pub key: String,
    pub created_at: DateTime<Utc>,
    /// The final answer, once there is one; `None` while pending.
    pub answer: Option<StoredAnswer>,
}

impl Intent {
    pub fn is_pending(&self) -> bool {
        self.answer.is_none()
    }
}

/// A final answer as received, kept so the same reference is answered again
/// without a request (and decodable later, even by a newer client).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredAnswer {
    pub status: u16,
    pub body: Vec<u8>,
    /// `Idempotent-Replayed` as the server sent it.
    pub replayed: Option<bool>,
    /// `X-Request-Id`.
    pub request_id: Option<String>,
    /// `Location` (201 answers).
    pub location: Option<String>,
    pub received_at: DateTime<Utc>,
}

#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error("the journal database failed: {0}")]
    Database(#[from] sqlx::Error),
    #[error("the journal holds a row this client cannot read: {0}")]
    Corrupt(String),
    #[error("no intent `{0}` in the journal")]
    UnknownReference(String),
}

/// Where intents are kept. Implementations must make [`Journal::record`]
/// durable before it returns: the client sends right after.
pub trait Journal: Send + Sync {
    /// Records `intent` and returns it; or, when the journal already has an
    /// intent under `intent.reference`, returns that one unchanged (its own
    /// key, operation, body and answer). Durable before it returns.
    fn record(
        &self,
        intent: NewIntent,
    ) -> impl Future<Output = Result<Intent, JournalError>> + Send;

    /// Completes the intent with its final answer. An intent that is
    /// already complete keeps its first answer (two processes resuming the
    /// same journal may both get one; they are the same answer replayed).
    fn complete(
        &self,
        reference: &str,
        answer: &StoredAnswer,
    ) -> impl Future<Output = Result<(), JournalError>> + Send;

    /// Every intent without a final answer, oldest first.
    fn pending(&self) -> impl Future<Output = Result<Vec<Intent>, JournalError>> + Send;

    /// The intent under `reference`, if any.
    fn get(
        &self,
        reference: &str,
    ) -> impl Future<Output = Result<Option<Intent>, JournalError>> + Send;
}

impl<J: Journal> Journal for Arc<J> {
    fn record(
        &self,
        intent: NewIntent,
    ) -> impl Future<Output = Result<Intent, JournalError>> + Send {
        (**self).record(intent)
    }

    fn complete(
        &self,
        reference: &str,
        answer: &StoredAnswer,
    ) -> impl Future<Output = Result<(), JournalError>> + Send {
        (**self).complete(reference, answer)
    }

    fn pending(&self) -> impl Future<Output = Result<Vec<Intent>, JournalError>> + Send {
        (**self).pending()
    }

    fn get(
        &self,
        reference: &str,
    ) -> impl Future<Output = Result<Option<Intent>, JournalError>> + Send {
        (**self).get(reference)
    }
}

/// A journal in memory: for tests, and for a process that may lose its
/// pending intents when it dies (then it is not crash-safe: a restart
/// cannot resume them). Clones share the same intents, so a test can drop
/// a client and "restart" with a new one over the same journal.
#[derive(Clone, Debug, Default)]
pub struct MemoryJournal {
    intents: Arc<Mutex<Vec<Intent>>>,
}

impl MemoryJournal {
    pub fn new() -> Self {
        Self::default()
    }

    /// Every intent, in the order journaled.
    pub fn all(&self) -> Vec<Intent> {
        self.lock().clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Intent>> {
        self.intents.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Journal for MemoryJournal {
    async fn record(&self, intent: NewIntent) -> Result<Intent, JournalError> {
        let mut intents = self.lock();
        if let Some(existing) = intents.iter().find(|i| i.reference == intent.reference) {
            return Ok(existing.clone());
        }
        let recorded = Intent {
            reference: intent.reference,
            operation: intent.operation,
            path: intent.path,
            body: intent.body,
            key: intent.key,
            created_at: Utc::now(),
            answer: None,
        };
        intents.push(recorded.clone());
        Ok(recorded)
    }

    async fn complete(&self, reference: &str, answer: &StoredAnswer) -> Result<(), JournalError> {
        let mut intents = self.lock();
        let intent = intents
            .iter_mut()
            .find(|i| i.reference == reference)
            .ok_or_else(|| JournalError::UnknownReference(reference.to_owned()))?;
        if intent.answer.is_none() {
            intent.answer = Some(answer.clone());
        }
        Ok(())
    }

    async fn pending(&self) -> Result<Vec<Intent>, JournalError> {
        Ok(self
            .lock()
            .iter()
            .filter(|i| i.is_pending())
            .cloned()
            .collect())
    }

    async fn get(&self, reference: &str) -> Result<Option<Intent>, JournalError> {
        Ok(self
            .lock()
            .iter()
            .find(|i| i.reference == reference)
            .cloned())
    }
}
