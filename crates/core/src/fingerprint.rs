//! The canonical request fingerprint that binds an idempotency key to one request.

use serde::Serialize;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::fmt;

/// Bumped when the meaning of an accepted request changes, so that a stored
/// record can never be replayed for a request the new code would read
/// differently.
pub const CONTRACT_VERSION: &str = "2026-11-30";

/// SHA-256 (hex) over the RFC 8785 (JCS) encoding of
/// `{operation, contract_version, path, body}`, where `body` is the request
/// after validation and normalisation (defaults applied, currency upper-cased).
///
/// Because it is computed from the *parsed* request, JSON property order,
/// whitespace and escapes never change it; headers never enter it.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub struct Fingerprint(String);

#[derive(Serialize)]
struct Canonical<'a, B: Serialize> {
    operation: &'a str,
    contract_version: &'a str,
    path: &'a BTreeMap<&'a str, String>,
    body: &'a B,
}

impl Fingerprint {
    /// `body` must be the normalised request (a typed struct or a JSON value).
    pub fn compute<B: Serialize>(
        operation: &str,
        path: &BTreeMap<&str, String>,
        body: &B,
    ) -> Result<Self, serde_json::Error> {
        let canonical = serde_json_canonicalizer::to_vec(&Canonical {
            operation,
            contract_version: CONTRACT_VERSION,
            path,
            body,
        })?;
        Ok(Self(hex::encode(Sha256::digest(&canonical))))
    }

    /// Rebuilds a fingerprint read back from storage.
    pub fn from_stored(hex: String) -> Self {
        Self(hex)
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::{Value, json};

    fn fp(body: &Value) -> Fingerprint {
        Fingerprint::compute("payment.authorize", &BTreeMap::new(), body).expect("serialises")
    }

    fn body(order_ref: &str, amount: i64, currency: &str, pm: &str, manual: bool) -> Value {
        json!({
            "order_ref": order_ref, "amount": amount, "currency": currency,
            "payment_method": pm, "capture_method": if manual { "manual" } else { "automatic" },
            "metadata": {"a": "1", "b": "2"},
        })
    }

    /// Re-serialises a JSON object with its keys in reverse order and extra
    /// whitespace, which is what a different client library might send.
    fn reorder_and_pad(value: &Value) -> String {
        match value {
            Value::Object(map) => {
                let parts: Vec<String> = map
                    .iter()
                    .rev()
                    .map(|(k, v)| {
                        format!("\n  {} :  {}", Value::String(k.clone()), reorder_and_pad(v))
                    })
                    .collect();
                format!("{{ {} }}", parts.join(" ,"))
            }
            other => other.to_string(),
        }
    }

    #[test]
    fn operation_and_path_are_part_of_the_fingerprint() {
        let b = json!({"amount": 100});
        let mut path = BTreeMap::new();
        path.insert("payment_id", "p1".to_owned());
        let capture = Fingerprint::compute("payment.capture", &path, &b).expect("ok");
        let refund = Fingerprint::compute("refund.create", &path, &b).expect("ok");
        path.insert("payment_id", "p2".to_owned());
        let other_payment = Fingerprint::compute("payment.capture", &path, &b).expect("ok");
        assert_ne!(capture, refund);
        assert_ne!(capture, other_payment);
    }

    proptest! {
        #[test]
        fn key_order_and_whitespace_do_not_change_it(
            order_ref in "[a-z0-9-]{1,20}", amount in 1i64..99_999_999_999,
            currency in "(EUR|USD|JPY)", pm in "pm_[a-z]{1,10}", manual: bool,
        ) {
            let original = body(&order_ref, amount, &currency, &pm, manual);
            let respelled: Value = serde_json::from_str(&reorder_and_pad(&original)).expect("valid json");
            prop_assert_eq!(fp(&original), fp(&respelled));
        }

        #[test]
        fn any_changed_field_changes_it(
            order_ref in "[a-z0-9-]{1,20}", amount in 1i64..99_999_999_998,
            pm in "pm_[a-z]{1,10}", manual: bool, which in 0usize..5,
        ) {
            let original = body(&order_ref, amount, "EUR", &pm, manual);
            let changed = match which {
                0 => body(&format!("{order_ref}x"), amount, "EUR", &pm, manual),
                1 => body(&order_ref, amount + 1, "EUR", &pm, manual),
                2 => body(&order_ref, amount, "USD", &pm, manual),
                3 => body(&order_ref, amount, "EUR", &format!("{pm}x"), manual),
                _ => body(&order_ref, amount, "EUR", &pm, !manual),
            };
            prop_assert_ne!(fp(&original), fp(&changed));
        }
    }
}
