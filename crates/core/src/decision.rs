//! The names of the decisions in the audit trail
//! (`reconciliation_decisions.decision`), written by the reconciler,
//! webhooks and operators.

use crate::stored::string_enum;

string_enum!(
    /// What was decided about an uncertain outcome.
    Decision {
        /// Evidence proved the attempt succeeded; cobro adopted it.
        AdoptSucceeded => "adopt_succeeded",
        /// Evidence proved a decline; cobro adopted it.
        AdoptDeclined => "adopt_declined",
        /// Evidence proved a definitive failure; cobro adopted it.
        AdoptFailed => "adopt_failed",
        /// Evidence contradicted what cobro had recorded; kept, not adopted.
        Conflict => "conflict",
        /// Proven no effect while the payment or refund is under review:
        /// recorded, nothing new sent.
        NoEffectInReview => "no_effect_in_review",
        /// Proven no effect; a new attempt was scheduled.
        NoEffectRetry => "no_effect_retry",
        /// Proven no effect; not retried by policy, so it failed.
        NoEffectFail => "no_effect_fail",
        /// Unresolved past the horizon: handed to a person.
        Escalate => "escalate",
        /// An operator resolved it by hand.
        ManualResolve => "manual_resolve",
        /// The provider voided an authorisation cobro had not asked it to
        /// void (Stripe cancels a PaymentIntent uncaptured for seven days):
        /// the payment is `canceled`.
        ProviderVoided => "provider_voided",
        /// The provider failed a refund it had reported succeeded (the
        /// card account closed, say): the refund is `failed` and its amount
        /// is refundable again.
        ProviderFailedRefund => "provider_failed_refund",
        /// The books found a refund made at the provider without cobro
        /// (in its dashboard) of a charge cobro holds: recorded as a
        /// succeeded refund of the payment, with its event.
        ProviderRefunded => "provider_refunded",
        /// An operator adopted an orphan of the books (an object at the
        /// provider carrying cobro's metadata, whose payment the database
        /// had lost): the payment, its intent and its attempt are recorded
        /// again as the provider shows them, checked at the provider first.
        BooksAdopted => "books_adopted",
    }
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decision_names_round_trip() {
        for &d in Decision::ALL {
            assert_eq!(Decision::parse(d.as_str()), Some(d));
        }
        assert_eq!(Decision::parse("adopt"), None);
    }
}
