//! Operations, order references and intent names (`pedido-842:authorize-v1`).

use crate::stored::string_enum;
use serde::{Deserialize, Serialize};
use std::fmt;

string_enum!(
    /// A keyed, money-moving operation. Its name scopes idempotency records
    /// and enters the fingerprint.
    Operation {
        Authorize => "payment.authorize",
        Capture => "payment.capture",
        Cancel => "payment.cancel",
        Refund => "refund.create",
    }
);

impl Operation {
    /// The verb used in intent names (`authorize`).
    pub fn verb(&self) -> &'static str {
        match self {
            Operation::Authorize => "authorize",
            Operation::Capture => "capture",
            Operation::Cancel => "cancel",
            Operation::Refund => "refund",
        }
    }
}

/// The merchant's own identity of an order: 1 to 128 of `[A-Za-z0-9._:-]`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct OrderRef(String);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OrderRefError {
    #[error("order_ref must be 1 to 128 characters from A-Z a-z 0-9 . _ : -")]
    Invalid,
}

impl OrderRef {
    pub fn parse(raw: &str) -> Result<Self, OrderRefError> {
        let ok = |b: u8| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-');
        if raw.is_empty() || raw.len() > 128 || !raw.bytes().all(ok) {
            return Err(OrderRefError::Invalid);
        }
        Ok(Self(raw.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for OrderRef {
    type Error = OrderRefError;
    fn try_from(value: String) -> Result<Self, Self::Error> {
        OrderRef::parse(&value)
    }
}

impl From<OrderRef> for String {
    fn from(o: OrderRef) -> Self {
        o.0
    }
}

/// `{order_ref}:{verb}-v{n}`: the name of one intended mutation. It is also the
/// merchant reference sent to the provider, which is how the reconciler finds
/// a charge whose answer was lost.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct IntentName(String);

impl IntentName {
    /// `sequence` counts the intents of this operation for this order in this
    /// account, starting at 1.
    pub fn new(order_ref: &OrderRef, operation: Operation, sequence: u32) -> Self {
        Self(format!(
            "{}:{}-v{}",
            order_ref.as_str(),
            operation.verb(),
            sequence
        ))
    }

    pub fn from_stored(name: String) -> Self {
        Self(name)
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// The merchant reference one attempt is sent under:
/// `{intent name}/{attempt id}`. Unique across accounts and attempts (the
/// intent name alone is unique only within one account, and every account
/// shares cobro's provider credentials), still readable by a person.
pub fn attempt_reference(intent: &str, attempt: crate::AttemptId) -> String {
    format!("{intent}/{attempt}")
}

impl fmt::Display for IntentName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn intent_names_follow_the_documented_form() {
        let order = OrderRef::parse("pedido-842").expect("valid");
        assert_eq!(
            IntentName::new(&order, Operation::Authorize, 1).as_str(),
            "pedido-842:authorize-v1"
        );
        assert_eq!(
            IntentName::new(&order, Operation::Refund, 3).as_str(),
            "pedido-842:refund-v3"
        );
    }

    #[test]
    fn attempt_references_are_the_intent_and_the_attempt() {
        let id = crate::AttemptId::new();
        let reference = attempt_reference("pedido-842:authorize-v1", id);
        assert_eq!(reference, format!("pedido-842:authorize-v1/{id}"));
        // The order_ref alphabet has no '/', so the split is unambiguous.
        assert_eq!(
            reference.rsplit_once('/').map(|(i, _)| i),
            Some("pedido-842:authorize-v1")
        );
    }

    #[test]
    fn order_refs_accept_only_the_documented_alphabet() {
        assert!(OrderRef::parse("A.b_c:d-9").is_ok());
        assert!(OrderRef::parse(&"x".repeat(128)).is_ok());
        for bad in ["", "has space", "slash/", "ñ", &"x".repeat(129)] {
            assert!(OrderRef::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn operation_names_round_trip() {
        for &op in Operation::ALL {
            assert_eq!(Operation::parse(op.as_str()), Some(op));
        }
        assert_eq!(Operation::parse("payment.delete"), None);
    }
}
