//! Payment, refund and attempt state machines as pure transition functions.
//!
//! The store applies a transition with a compare-and-set on the state read
//! here, so two incompatible decisions can never both commit: the second one
//! finds the state changed and updates zero rows.

use crate::stored::string_enum;

string_enum!(
    /// When the money moves: at authorisation, or on an explicit capture.
    CaptureMethod { Automatic => "automatic", Manual => "manual" }
);

string_enum!(
    /// The merchant-visible state of a payment.
    PaymentStatus {
        Processing => "processing",
        /// The provider asked the customer to act (3-D Secure): the
        /// merchant sends them to `next_action`; cobro knows exactly where
        /// the attempt stands, and the payment ends by proof (a webhook,
        /// the reconciler's read, the merchant's GET) or by its expiry.
        RequiresAction => "requires_action",
        Authorized => "authorized",
        Captured => "captured",
        Declined => "declined",
        Failed => "failed",
        RequiresReconciliation => "requires_reconciliation",
        NeedsReview => "needs_review",
        Capturing => "capturing",
        Canceling => "canceling",
        Canceled => "canceled",
        PartiallyRefunded => "partially_refunded",
        Refunded => "refunded",
    }
);

string_enum!(
    /// The state of a refund.
    RefundStatus {
        Processing => "processing",
        Succeeded => "succeeded",
        Failed => "failed",
        RequiresReconciliation => "requires_reconciliation",
        NeedsReview => "needs_review",
    }
);

string_enum!(
    /// The state of one attempt (one provider idempotency key).
    AttemptState {
        /// Created, not yet answered; the outbox drives it.
        Pending => "pending",
        /// Answered: the provider waits for the customer to authenticate
        /// (3-D Secure). Not unknown: never resent, never a new key, no
        /// outbox row; it ends by proof of the object's outcome.
        AwaitingCustomer => "awaiting_customer",
        /// Sent at least once without a definitive answer; retried with the same key.
        Unknown => "unknown",
        /// Handed to the reconciler; the worker no longer sends it.
        Reconciling => "reconciling",
        /// Waiting for another outcome before it may be sent: a cancel asked
        /// for while the authorisation is unknown. It has no outbox row
        /// until it is released (`pending`) or ended (`failed`).
        Held => "held",
        Succeeded => "succeeded",
        Declined => "declined",
        Failed => "failed",
        /// Proven by the provider to have had no effect; a new attempt may follow.
        NoEffect => "no_effect",
    }
);

/// What happened to a payment, as reported by the worker, the reconciler, a
/// webhook, the API or an operator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PaymentEvent {
    /// The provider holds an authorisation (manual capture).
    Authorized,
    /// The provider captured the money (automatic capture, or a capture).
    Captured,
    /// The provider refused definitively.
    Declined,
    /// The request can never succeed (invalid at the provider, or proven no
    /// effect with retries disabled).
    Failed,
    /// The provider answered that the customer must act (3-D Secure).
    ActionRequired,
    /// A payment left waiting for its customer past its expiry: its
    /// PaymentIntent is canceled at the provider through the outbox.
    ActionExpired,
    /// The provider declined an authorisation whose customer was asked to
    /// act (a failed 3-D Secure challenge, or a card declined after it):
    /// the PaymentIntent stays open and the merchant's front end holds its
    /// client secret, so it is canceled through the outbox before the
    /// payment may end `declined` (docs/recovery.md).
    DeclinedWhileOpen,
    /// The cancel of a declined authorisation's PaymentIntent
    /// ([`PaymentEvent::DeclinedWhileOpen`]) is proven: nothing can charge
    /// under it any more.
    DeclineClosed,
    /// A send ended without a provable outcome and the worker gave up on it.
    OutcomeUnknown,
    /// The reconciler's escalation horizon passed.
    Escalated,
    /// The provider proved the previous attempt had no effect; a new attempt
    /// with a new provider key is scheduled.
    RetryScheduled,
    CaptureRequested,
    CaptureRefused,
    CancelRequested,
    Voided,
    VoidRefused,
    /// The provider released an authorisation on its own, with no capture
    /// or cancel of cobro's in flight (Stripe cancels a PaymentIntent left
    /// uncaptured for seven days).
    VoidedByProvider,
    /// A refund succeeded; `fully` when refunds now equal the captured amount.
    Refunded {
        fully: bool,
    },
}

/// A transition that the state machine does not allow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("payment in state {from} cannot take event {event:?}")]
pub struct IllegalTransition {
    pub from: PaymentStatus,
    pub event: PaymentEvent,
}

impl PaymentStatus {
    /// The statuses whose outcome is not settled yet: what the reconciler
    /// and operators watch, and the partial index `payments_unsettled`
    /// (migration 0001; a test checks that its predicate is this list).
    pub const UNSETTLED: &'static [PaymentStatus] = &[
        PaymentStatus::Processing,
        PaymentStatus::RequiresAction,
        PaymentStatus::RequiresReconciliation,
        PaymentStatus::NeedsReview,
        PaymentStatus::Capturing,
        PaymentStatus::Canceling,
    ];

    /// Where `event` takes a payment in this state, or why it cannot.
    pub fn apply(self, event: PaymentEvent) -> Result<PaymentStatus, IllegalTransition> {
        use PaymentEvent as E;
        use PaymentStatus as S;
        let awaiting_authorisation = matches!(
            self,
            S::Processing | S::RequiresAction | S::RequiresReconciliation | S::NeedsReview
        );
        let next = match (self, event) {
            (_, E::Authorized | E::Declined | E::Failed) if awaiting_authorisation => match event {
                E::Authorized => S::Authorized,
                E::Declined => S::Declined,
                _ => S::Failed,
            },
            (_, E::Captured) if awaiting_authorisation => S::Captured,
            (_, E::DeclinedWhileOpen) if awaiting_authorisation => S::Canceling,
            (S::Canceling | S::NeedsReview, E::DeclineClosed) => S::Declined,
            (S::Processing, E::OutcomeUnknown) => S::RequiresReconciliation,
            // The answer (or the reconciler's read) shows the customer must act.
            (S::Processing | S::RequiresReconciliation, E::ActionRequired) => S::RequiresAction,
            // Abandoned: the cancel of the PaymentIntent is on its way; the
            // evidence of a late completion still wins (Canceling + Captured).
            (S::RequiresAction, E::ActionExpired) => S::Canceling,
            (S::RequiresReconciliation, E::Escalated) => S::NeedsReview,
            // An attempt sent and never recorded, with no worker left to
            // finish it, unresolved past the horizon.
            (S::Processing, E::Escalated) => S::NeedsReview,
            (S::RequiresReconciliation, E::RetryScheduled) => S::Processing,
            (S::Authorized, E::CaptureRequested) => S::Capturing,
            (S::Capturing | S::Canceling, E::Captured) => S::Captured,
            (S::Capturing | S::Canceling, E::Voided) => S::Canceled,
            (S::Capturing, E::CaptureRefused) => S::Authorized,
            (S::Authorized, E::CancelRequested) => S::Canceling,
            (S::Canceling, E::VoidRefused) => S::Authorized,
            (S::Authorized, E::VoidedByProvider) => S::Canceled,
            // A capture or void the reconciler could not settle in time.
            (S::Capturing | S::Canceling, E::Escalated) => S::NeedsReview,
            // What the provider proves about a capture or void that was
            // under review (the charge's own status is the truth).
            (S::NeedsReview, E::Voided) => S::Canceled,
            (S::NeedsReview, E::CaptureRefused | E::VoidRefused) => S::Authorized,
            (S::Captured | S::PartiallyRefunded, E::Refunded { fully }) => {
                if fully {
                    S::Refunded
                } else {
                    S::PartiallyRefunded
                }
            }
            _ => return Err(IllegalTransition { from: self, event }),
        };
        Ok(next)
    }

    /// `declined`, `failed` and `canceled` free the order for a new payment;
    /// the partial unique index on payments uses exactly this list.
    pub fn is_terminal_failure(self) -> bool {
        matches!(
            self,
            PaymentStatus::Declined | PaymentStatus::Failed | PaymentStatus::Canceled
        )
    }

    /// The authorisation outcome is not known yet: no new charge may be made,
    /// and a cancel is recorded to be carried out once it is known.
    pub fn authorisation_pending(self) -> bool {
        matches!(
            self,
            PaymentStatus::Processing
                | PaymentStatus::RequiresAction
                | PaymentStatus::RequiresReconciliation
                | PaymentStatus::NeedsReview
        )
    }
}

impl RefundStatus {
    /// The statuses of a refund whose outcome is not settled yet (the
    /// partial index `refunds_unsettled`, migration 0001).
    pub const UNSETTLED: &'static [RefundStatus] = &[
        RefundStatus::Processing,
        RefundStatus::RequiresReconciliation,
        RefundStatus::NeedsReview,
    ];
}

impl AttemptState {
    /// An attempt that still may have (or get) an effect at the provider. At
    /// most one per intent exists (a partial unique index).
    pub fn is_unresolved(self) -> bool {
        matches!(
            self,
            AttemptState::Pending
                | AttemptState::Unknown
                | AttemptState::Reconciling
                | AttemptState::Held
                | AttemptState::AwaitingCustomer
        )
    }

    /// The states from which an attempt may move to `to`, for the
    /// compare-and-set that moves it (`WHERE state IN (...)`).
    pub fn sources_of(to: AttemptState) -> Vec<AttemptState> {
        AttemptState::ALL
            .iter()
            .copied()
            .filter(|from| from.can_become(to))
            .collect()
    }

    /// Whether an attempt in this state recorded that the provider moved no
    /// money for it: evidence of an effect then contradicts the record.
    pub fn recorded_no_money(self) -> bool {
        matches!(
            self,
            AttemptState::NoEffect | AttemptState::Declined | AttemptState::Failed
        )
    }

    /// Whether an attempt may move from this state to `to`.
    pub fn can_become(self, to: AttemptState) -> bool {
        use AttemptState as A;
        match self {
            // Every send of a pending attempt proven never to have left
            // (or none made): it had no effect, and may move on to the
            // next provider (docs/routing.md). An unknown one needs the
            // reconciler's read.
            A::Pending if to == A::NoEffect => true,
            A::Pending | A::Unknown => matches!(
                to,
                A::Unknown
                    | A::Reconciling
                    | A::AwaitingCustomer
                    | A::Succeeded
                    | A::Declined
                    | A::Failed
            ),
            A::Reconciling => matches!(
                to,
                A::AwaitingCustomer | A::Succeeded | A::Declined | A::Failed | A::NoEffect
            ),
            A::AwaitingCustomer => matches!(to, A::Succeeded | A::Declined | A::Failed),
            A::Held => matches!(to, A::Pending | A::Failed),
            A::Succeeded | A::Declined | A::Failed | A::NoEffect => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use PaymentEvent as E;
    use PaymentStatus as S;

    const EVENTS: &[PaymentEvent] = &[
        E::Authorized,
        E::Captured,
        E::Declined,
        E::Failed,
        E::ActionRequired,
        E::ActionExpired,
        E::DeclinedWhileOpen,
        E::DeclineClosed,
        E::OutcomeUnknown,
        E::Escalated,
        E::RetryScheduled,
        E::CaptureRequested,
        E::CaptureRefused,
        E::CancelRequested,
        E::Voided,
        E::VoidRefused,
        E::VoidedByProvider,
        E::Refunded { fully: false },
        E::Refunded { fully: true },
    ];

    /// The whole legal table, written out independently of `apply`.
    const LEGAL: &[(PaymentStatus, PaymentEvent, PaymentStatus)] = &[
        (S::Processing, E::Authorized, S::Authorized),
        (S::Processing, E::Captured, S::Captured),
        (S::Processing, E::Declined, S::Declined),
        (S::Processing, E::Failed, S::Failed),
        (S::Processing, E::OutcomeUnknown, S::RequiresReconciliation),
        (S::Processing, E::Escalated, S::NeedsReview),
        (S::Processing, E::ActionRequired, S::RequiresAction),
        (
            S::RequiresReconciliation,
            E::ActionRequired,
            S::RequiresAction,
        ),
        (S::RequiresAction, E::Authorized, S::Authorized),
        (S::RequiresAction, E::Captured, S::Captured),
        (S::RequiresAction, E::Declined, S::Declined),
        (S::RequiresAction, E::Failed, S::Failed),
        (S::RequiresAction, E::ActionExpired, S::Canceling),
        (S::Processing, E::DeclinedWhileOpen, S::Canceling),
        (S::RequiresAction, E::DeclinedWhileOpen, S::Canceling),
        (
            S::RequiresReconciliation,
            E::DeclinedWhileOpen,
            S::Canceling,
        ),
        (S::NeedsReview, E::DeclinedWhileOpen, S::Canceling),
        (S::Canceling, E::DeclineClosed, S::Declined),
        (S::NeedsReview, E::DeclineClosed, S::Declined),
        (S::RequiresReconciliation, E::Authorized, S::Authorized),
        (S::RequiresReconciliation, E::Captured, S::Captured),
        (S::RequiresReconciliation, E::Declined, S::Declined),
        (S::RequiresReconciliation, E::Failed, S::Failed),
        (S::RequiresReconciliation, E::Escalated, S::NeedsReview),
        (S::RequiresReconciliation, E::RetryScheduled, S::Processing),
        (S::NeedsReview, E::Authorized, S::Authorized),
        (S::NeedsReview, E::Captured, S::Captured),
        (S::NeedsReview, E::Declined, S::Declined),
        (S::NeedsReview, E::Failed, S::Failed),
        (S::Authorized, E::CaptureRequested, S::Capturing),
        (S::Authorized, E::CancelRequested, S::Canceling),
        (S::Capturing, E::Captured, S::Captured),
        (S::Capturing, E::Voided, S::Canceled),
        (S::Capturing, E::CaptureRefused, S::Authorized),
        (S::Capturing, E::Escalated, S::NeedsReview),
        (S::Canceling, E::Voided, S::Canceled),
        (S::Canceling, E::Captured, S::Captured),
        (S::Canceling, E::VoidRefused, S::Authorized),
        (S::Canceling, E::Escalated, S::NeedsReview),
        (S::Authorized, E::VoidedByProvider, S::Canceled),
        (S::NeedsReview, E::Voided, S::Canceled),
        (S::NeedsReview, E::CaptureRefused, S::Authorized),
        (S::NeedsReview, E::VoidRefused, S::Authorized),
        (
            S::Captured,
            E::Refunded { fully: false },
            S::PartiallyRefunded,
        ),
        (S::Captured, E::Refunded { fully: true }, S::Refunded),
        (
            S::PartiallyRefunded,
            E::Refunded { fully: false },
            S::PartiallyRefunded,
        ),
        (
            S::PartiallyRefunded,
            E::Refunded { fully: true },
            S::Refunded,
        ),
    ];

    #[test]
    fn every_legal_transition_lands_where_the_table_says() {
        for &(from, event, to) in LEGAL {
            assert_eq!(from.apply(event), Ok(to), "{from} + {event:?}");
        }
    }

    #[test]
    fn every_other_transition_is_refused() {
        for &from in PaymentStatus::ALL {
            for &event in EVENTS {
                if LEGAL.iter().any(|&(f, e, _)| f == from && e == event) {
                    continue;
                }
                assert_eq!(
                    from.apply(event),
                    Err(IllegalTransition { from, event }),
                    "{from} + {event:?} must be illegal"
                );
            }
        }
    }

    #[test]
    fn nothing_moves_a_settled_payment_backwards_to_processing() {
        for &from in PaymentStatus::ALL {
            if from == S::RequiresReconciliation {
                continue;
            }
            for &event in EVENTS {
                assert_ne!(from.apply(event), Ok(S::Processing), "{from} + {event:?}");
            }
        }
    }

    #[test]
    fn terminal_failures_are_exactly_declined_failed_and_canceled() {
        let terminal: Vec<_> = PaymentStatus::ALL
            .iter()
            .filter(|s| s.is_terminal_failure())
            .collect();
        assert_eq!(terminal, [&S::Declined, &S::Failed, &S::Canceled]);
    }

    #[test]
    fn attempt_transitions_only_move_forward() {
        use AttemptState as A;
        let legal = [
            (A::Pending, A::Unknown),
            (A::Pending, A::Reconciling),
            (A::Pending, A::AwaitingCustomer),
            (A::Unknown, A::AwaitingCustomer),
            (A::Reconciling, A::AwaitingCustomer),
            (A::AwaitingCustomer, A::Succeeded),
            (A::AwaitingCustomer, A::Declined),
            (A::AwaitingCustomer, A::Failed),
            (A::Pending, A::Succeeded),
            (A::Pending, A::Declined),
            (A::Pending, A::Failed),
            (A::Pending, A::NoEffect),
            (A::Unknown, A::Unknown),
            (A::Unknown, A::Reconciling),
            (A::Unknown, A::Succeeded),
            (A::Unknown, A::Declined),
            (A::Unknown, A::Failed),
            (A::Reconciling, A::Succeeded),
            (A::Reconciling, A::Declined),
            (A::Reconciling, A::Failed),
            (A::Reconciling, A::NoEffect),
            (A::Held, A::Pending),
            (A::Held, A::Failed),
        ];
        for &from in AttemptState::ALL {
            for &to in AttemptState::ALL {
                assert_eq!(
                    from.can_become(to),
                    legal.contains(&(from, to)),
                    "{from} -> {to}"
                );
            }
        }
        // No effect is proven by the reconciler for an attempt handed to it,
        // or by the worker for a pending attempt whose every send provably
        // never left (routing, docs/routing.md); never from `unknown`.
        assert!(!A::Unknown.can_become(A::NoEffect));
        assert_eq!(A::sources_of(A::NoEffect), [A::Pending, A::Reconciling]);
        assert_eq!(A::sources_of(A::Pending), [A::Held]);
    }

    #[test]
    fn status_names_round_trip() {
        for s in PaymentStatus::ALL {
            assert_eq!(PaymentStatus::parse(s.as_str()), Some(*s));
        }
        for s in AttemptState::ALL {
            assert_eq!(AttemptState::parse(s.as_str()), Some(*s));
        }
    }
}
