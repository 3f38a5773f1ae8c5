//! Newtype ids. Every id is a UUID v7: time-ordered, so primary-key indexes stay
//! append-mostly and "newest first" is an index scan.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;
use uuid::Uuid;

macro_rules! id_type {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(Uuid);

        impl $name {
            /// A fresh, time-ordered id.
            pub fn new() -> Self {
                Self(Uuid::now_v7())
            }
            pub const fn from_uuid(uuid: Uuid) -> Self {
                Self(uuid)
            }
            pub const fn as_uuid(&self) -> Uuid {
                self.0
            }
        }

        impl Default for $name {
            fn default() -> Self {
                Self::new()
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.fmt(f)
            }
        }

        impl FromStr for $name {
            type Err = uuid::Error;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                Uuid::parse_str(s).map(Self)
            }
        }

        impl From<$name> for Uuid {
            fn from(id: $name) -> Self {
                id.0
            }
        }

        impl From<Uuid> for $name {
            fn from(uuid: Uuid) -> Self {
                Self(uuid)
            }
        }

        crate::stored::sqlx_uuid!($name);
    };
}

id_type!(
    /// A merchant (tenant); every token and every record belongs to one.
    AccountId
);
id_type!(
    /// An API token (the secret itself is never stored, only its hash).
    TokenId
);
id_type!(
    /// A payment: the merchant-visible resource.
    PaymentId
);
id_type!(
    /// A refund of a captured payment.
    RefundId
);
id_type!(
    /// One intended mutation (`pedido-842:authorize-v1`).
    IntentId
);
id_type!(
    /// One provider call series under one provider idempotency key.
    AttemptId
);
id_type!(
    /// One unit of work for the outbox worker.
    OutboxId
);
id_type!(
    /// One reconciler run, the unit of its audit trail.
    RunId
);
id_type!(
    /// An event of a payment or refund, delivered to merchants: its id is
    /// what a receiver deduplicates by. Written by the schema (v4).
    EventId
);
id_type!(
    /// A merchant's event endpoint (URL, secret, event types).
    EndpointId
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_time_ordered_and_round_trip_through_text() {
        let a = PaymentId::new();
        let b = PaymentId::new();
        assert!(a < b, "v7 ids sort by creation time");
        assert_eq!(a.to_string().parse::<PaymentId>().expect("parses"), a);
    }
}
