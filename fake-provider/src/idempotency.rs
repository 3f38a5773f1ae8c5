//! Idempotency keys: who may run, what gets replayed, and when a key is
//! forgotten.
//!
//! A key is scoped to its caller. The slot is reserved before the effect runs
//! (so a concurrent retry sees 409 instead of running twice) and then holds the
//! answer the dialect saves (see `pipeline`): usually the real one, even when
//! the caller is going to receive a sabotaged one, which is how a real
//! provider lets a retry converge.

use std::collections::HashMap;

use chrono::{DateTime, TimeDelta, Utc};

use crate::model::StoredResponse;

/// One remembered key.
#[derive(Debug)]
enum Slot {
    /// The first request with this key is still running.
    InProgress { fingerprint: String },
    /// The first request finished; its answer is replayed until expiry.
    Done {
        fingerprint: String,
        first_used: DateTime<Utc>,
        response: StoredResponse,
    },
}

/// What a request may do with its key.
#[derive(Debug)]
pub(crate) enum Claim {
    /// The key was free (or expired) and is now reserved for this request.
    Reserved,
    /// Same parameters as the first use: answer with this.
    Replay(StoredResponse),
    /// Same key, different parameters.
    Mismatch,
    /// The first request with this key has not finished.
    Busy,
}

/// All keys of all callers; the map key is `caller \n idempotency key`.
#[derive(Debug)]
pub(crate) struct KeyStore {
    slots: HashMap<String, Slot>,
    retention: TimeDelta,
}

impl KeyStore {
    pub(crate) fn new(retention: TimeDelta) -> Self {
        Self {
            slots: HashMap::new(),
            retention,
        }
    }

    pub(crate) fn claim(&mut self, scope: &str, fingerprint: &str, now: DateTime<Utc>) -> Claim {
        match self.slots.get(scope) {
            Some(Slot::InProgress { fingerprint: first }) => {
                if first == fingerprint {
                    Claim::Busy
                } else {
                    Claim::Mismatch
                }
            }
            Some(Slot::Done {
                fingerprint: first,
                first_used,
                response,
            }) if now - *first_used < self.retention => {
                if first == fingerprint {
                    Claim::Replay(response.clone())
                } else {
                    Claim::Mismatch
                }
            }
            // Free, or past retention: forgotten, exactly like a real provider
            // that has purged the key, so a retry makes a new effect.
            _ => {
                let slot = Slot::InProgress {
                    fingerprint: fingerprint.to_owned(),
                };
                self.slots.insert(scope.to_owned(), slot);
                Claim::Reserved
            }
        }
    }

    /// Stores the answer of a reserved key. Which answers are saved (and
    /// which free the key instead) is the request path's decision.
    pub(crate) fn complete(
        &mut self,
        scope: &str,
        response: &StoredResponse,
        first_used: DateTime<Utc>,
    ) {
        if let Some(slot) = self.slots.get_mut(scope)
            && let Slot::InProgress { fingerprint } = slot
        {
            let fingerprint = std::mem::take(fingerprint);
            *slot = Slot::Done {
                fingerprint,
                first_used,
                response: response.clone(),
            };
        }
    }

    /// How long a key is remembered after its first use.
    pub(crate) fn retention(&self) -> TimeDelta {
        self.retention
    }

    /// Frees a reservation whose request ended without an effect.
    pub(crate) fn release(&mut self, scope: &str) {
        if matches!(self.slots.get(scope), Some(Slot::InProgress { .. })) {
            self.slots.remove(scope);
        }
    }

    /// Drops keys past retention; run when the clock jumps, which is when many
    /// keys expire at once.
    pub(crate) fn forget_expired(&mut self, now: DateTime<Utc>) {
        let retention = self.retention;
        self.slots.retain(|_, slot| match slot {
            Slot::InProgress { .. } => true,
            Slot::Done { first_used, .. } => now - *first_used < retention,
        });
    }
}
