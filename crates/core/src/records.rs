//! What the audit tables say, by name: the kinds of evidence kept
//! (`evidence_conflicts.kind`), what receiving a webhook did
//! (`webhook_events.outcome`) and where a delivery of an event to a
//! merchant stands (`event_deliveries.state`). Read back typed, so an
//! operator's tools and the tests match on variants, never on spellings.

use crate::stored::string_enum;

string_enum!(
    /// What kind of evidence was kept but not adopted (docs/evidence.md §7.2).
    ConflictKind {
        /// An effect found for an attempt recorded as having moved no money
        /// (`no_effect`, `declined`, `failed`).
        EffectAfterNoEffect => "effect_after_no_effect",
        /// Another provider object than the one recorded for the attempt.
        OtherObject => "other_object",
        /// An object under the attempt's identity whose amount, currency or
        /// capture mode differ from what cobro asked for.
        Mismatch => "mismatch",
        /// More than one object under one attempt's identity.
        SeveralObjects => "several_objects",
        /// Evidence that names no attempt of cobro's.
        Unmatched => "unmatched",
        /// The books: a success cobro holds that the provider's ledger does
        /// not have in a window that covers its whole send (critical).
        MissingAtProvider => "missing_at_provider",
        /// The books: the provider's object differs from cobro's record in a
        /// way no provider move explains (docs/books.md).
        BooksDrift => "books_drift",
    }
);

string_enum!(
    /// What receiving a webhook event did.
    WebhookOutcome {
        /// The event settled an unresolved attempt (and moved its payment or
        /// refund as far as the state machine allows).
        Applied => "applied",
        /// Older than what is already recorded for its charge: kept, not
        /// applied.
        IgnoredStale => "ignored_stale",
        /// What it proves was already recorded (by the worker, the
        /// reconciler or an earlier event): nothing changed.
        DuplicateEffect => "duplicate_effect",
        /// No attempt of cobro's matches it: kept, and reported as an
        /// `unmatched` conflict.
        Unmatched => "unmatched",
        /// It contradicts what is recorded, or carries an attempt's identity
        /// with other terms: kept as a conflict, the payment in
        /// `needs_review`.
        Conflict => "conflict",
    }
);

string_enum!(
    /// Where one delivery of an event to one endpoint stands.
    DeliveryState {
        /// Due (now or at its retry time), or being sent under a lease.
        Pending => "pending",
        /// The endpoint answered 2xx.
        Delivered => "delivered",
        /// Out of retries, or the endpoint is gone: waits for an operator's
        /// replay.
        Dead => "dead",
    }
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for &k in ConflictKind::ALL {
            assert_eq!(ConflictKind::parse(k.as_str()), Some(k));
        }
        for &o in WebhookOutcome::ALL {
            assert_eq!(WebhookOutcome::parse(o.as_str()), Some(o));
        }
        for &s in DeliveryState::ALL {
            assert_eq!(DeliveryState::parse(s.as_str()), Some(s));
        }
        assert_eq!(DeliveryState::parse("gone"), None);
    }
}
