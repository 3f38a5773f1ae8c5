//! What Stripe answers (API version `2024-06-20`), read only as far as
//! cobro uses it, and its mapping onto [`ProviderObject`].
//!
//! Normalised on the way in, so that [`ProviderObject`] reads the same for
//! every provider and `cobro_settle::fit` compares like with like:
//! - currency upper-case (Stripe answers `eur`; cobro sends, stores and
//!   compares ISO `EUR`);
//! - amounts (`amount`, `amount_received`, a refund's `amount`) in cobro's
//!   minor units of that currency, by the one currency table
//!   ([`cobro_core::money::minor_from_stripe_wire`]): Stripe's ISK
//!   `500000` is cobro's ISK 5000. An amount that is not a whole number of
//!   cobro's minor units (fractional krónur), or of a currency cobro does
//!   not know, is absent: it is not what cobro sent, and `fit` never
//!   adopts a charge without an amount;
//! - `capture_method` `automatic_async` is `automatic` (both capture on
//!   confirmation; they differ only in when Stripe books the balance);
//! - the PaymentIntent status in cobro's words, by [`payment_intent_status`];
//!   the refund status by [`refund_status`]; anything else is `Other` and
//!   never evidence;
//! - the reference is the `cobro_reference` metadata entry cobro sent.

use crate::{NextAction, ProviderObject, ProviderStatus, metadata};
use serde::Deserialize;
use std::collections::BTreeMap;

/// A PaymentIntent (`pi_...`): cobro's charge on Stripe.
#[derive(Clone, Debug, Deserialize)]
pub struct PaymentIntent {
    pub id: String,
    #[serde(default)]
    pub object: Option<String>,
    pub status: String,
    #[serde(default)]
    pub amount: Option<i64>,
    #[serde(default)]
    pub amount_received: Option<i64>,
    #[serde(default)]
    pub currency: Option<String>,
    #[serde(default)]
    pub capture_method: Option<String>,
    #[serde(default)]
    pub metadata: Option<BTreeMap<String, String>>,
    /// Set when the last confirmation failed (with the PaymentIntent back
    /// in `requires_payment_method`).
    #[serde(default)]
    pub last_payment_error: Option<StripeError>,
    /// The latest charge (an id, or the object when expanded); null until
    /// a charge is made, so a PaymentIntent without one was never
    /// authorised.
    #[serde(default)]
    pub latest_charge: Option<serde_json::Value>,
    /// What the customer must do (`requires_action`): Stripe's
    /// `redirect_to_url` carries the URL of the challenge.
    #[serde(default)]
    pub next_action: Option<StripeNextAction>,
    /// For Stripe.js on the merchant's page; never logged.
    #[serde(default)]
    pub client_secret: Option<ClientSecret>,
}

/// A PaymentIntent's `client_secret`: its `Debug` never shows it.
#[derive(Clone, Deserialize)]
#[serde(transparent)]
pub struct ClientSecret(pub String);

impl std::fmt::Debug for ClientSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClientSecret(***)")
    }
}

/// Stripe's `next_action`, read as far as cobro uses it.
#[derive(Clone, Deserialize)]
pub struct StripeNextAction {
    #[serde(rename = "type", default)]
    pub kind: Option<String>,
    #[serde(default)]
    pub redirect_to_url: Option<RedirectToUrl>,
}

#[derive(Clone, Deserialize)]
pub struct RedirectToUrl {
    #[serde(default)]
    pub url: Option<String>,
}

impl std::fmt::Debug for StripeNextAction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StripeNextAction")
            .field("type", &self.kind)
            .finish_non_exhaustive()
    }
}

/// A Refund (`re_...`).
#[derive(Clone, Debug, Deserialize)]
pub struct Refund {
    pub id: String,
    #[serde(default)]
    pub object: Option<String>,
    /// Nullable in Stripe's schema.
    #[serde(default)]
    pub status: Option<String>,
    #[serde(default)]
    pub amount: Option<i64>,
    #[serde(default)]
    pub currency: Option<String>,
    #[serde(default)]
    pub payment_intent: Option<String>,
    #[serde(default)]
    pub metadata: Option<BTreeMap<String, String>>,
    #[serde(default)]
    pub failure_reason: Option<String>,
}

/// `{"error": {...}}`, Stripe's answer to every request it refuses.
#[derive(Clone, Debug, Deserialize)]
pub struct ErrorBody {
    pub error: StripeError,
}

/// Stripe's error object.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct StripeError {
    /// `api_error`, `card_error`, `idempotency_error` or
    /// `invalid_request_error`.
    #[serde(rename = "type", default)]
    pub kind: Option<String>,
    #[serde(default)]
    pub code: Option<String>,
    #[serde(default)]
    pub decline_code: Option<String>,
    #[serde(default)]
    pub message: Option<String>,
    /// The PaymentIntent as it is now, on errors about one.
    #[serde(default)]
    pub payment_intent: Option<Box<PaymentIntent>>,
}

impl StripeError {
    pub fn is(&self, kind: &str) -> bool {
        self.kind.as_deref() == Some(kind)
    }

    pub fn has_code(&self, code: &str) -> bool {
        self.code.as_deref() == Some(code)
    }

    /// A decline's code as cobro records it: the issuer's `decline_code`
    /// when there is one (`insufficient_funds`, `try_again_later`), else
    /// Stripe's `code` (`expired_card`).
    pub fn decline(&self) -> Option<&str> {
        self.decline_code.as_deref().or(self.code.as_deref())
    }
}

/// A page of a list (`GET /v1/refunds`) or of a search
/// (`GET /v1/payment_intents/search`).
#[derive(Clone, Debug, Deserialize)]
pub struct Page<T> {
    pub data: Vec<T>,
    #[serde(default)]
    pub has_more: bool,
    /// Search pages only: the cursor of the next page.
    #[serde(default)]
    pub next_page: Option<String>,
}

/// A PaymentIntent status in cobro's words.
///
/// `failed`: the last confirmation failed; `charged`: a charge was made.
/// A `canceled` PaymentIntent was voided (an authorisation released) only
/// when it was charged and that charge did not fail. Canceled before any
/// charge (waiting for a payment method or for the customer's
/// authentication) or after a declined one, it never held money: it is a
/// decline, no effect, and its `payment_intent.canceled` event agrees with
/// a payment cobro already failed instead of contradicting it.
pub fn payment_intent_status(status: &str, failed: bool, charged: bool) -> ProviderStatus {
    match status {
        "requires_capture" => ProviderStatus::Authorized,
        "succeeded" => ProviderStatus::Captured,
        "canceled" if charged && !failed => ProviderStatus::Voided,
        "canceled" => ProviderStatus::Declined,
        // A confirmation that failed leaves the PaymentIntent waiting for
        // another payment method; cobro never gives it one.
        "requires_payment_method" if failed => ProviderStatus::Declined,
        "requires_action" => ProviderStatus::RequiresAction,
        other => ProviderStatus::Other(other.to_owned()),
    }
}

/// A refund status in cobro's words (`pending` and `requires_action` are
/// not an outcome yet).
pub fn refund_status(status: Option<&str>) -> ProviderStatus {
    match status {
        Some("succeeded") => ProviderStatus::Succeeded,
        Some("failed") => ProviderStatus::Failed,
        Some("canceled") => ProviderStatus::Canceled,
        Some(other) => ProviderStatus::Other(other.to_owned()),
        None => ProviderStatus::Other("null".to_owned()),
    }
}

/// ISO 4217 as cobro spells it.
fn currency(code: Option<String>) -> Option<String> {
    code.map(|c| c.to_ascii_uppercase())
}

/// Stripe's `amount` of `currency` in cobro's minor units (see the module
/// doc); `None` when it cannot be stated in them.
pub fn cobro_amount(currency: Option<&str>, wire: Option<i64>) -> Option<i64> {
    let currency = cobro_core::Currency::parse(currency?).ok()?;
    cobro_core::money::minor_from_stripe_wire(currency, wire?).ok()
}

fn capture_method(method: Option<String>) -> Option<String> {
    method.map(|m| match m.as_str() {
        "automatic_async" => "automatic".to_owned(),
        _ => m,
    })
}

fn reference(metadata: &BTreeMap<String, String>) -> Option<String> {
    metadata
        .get(metadata::REFERENCE)
        .filter(|r| !r.is_empty())
        .cloned()
}

impl PaymentIntent {
    pub fn is_payment_intent(&self) -> bool {
        self.object.as_deref().is_none_or(|o| o == "payment_intent")
    }

    /// The PaymentIntents of a page that carry `reference` as cobro's
    /// reference, as cobro's objects.
    pub fn referenced(page: Vec<PaymentIntent>, reference: &str) -> Vec<ProviderObject> {
        page.into_iter()
            .filter(PaymentIntent::is_payment_intent)
            .map(PaymentIntent::into_object)
            .filter(|o| o.reference.as_deref() == Some(reference))
            .collect()
    }

    pub fn cobro_status(&self) -> ProviderStatus {
        let charged = self.latest_charge.as_ref().is_some_and(|c| !c.is_null());
        payment_intent_status(&self.status, self.last_payment_error.is_some(), charged)
    }

    pub fn into_object(self) -> ProviderObject {
        let status = self.cobro_status();
        let metadata = self.metadata.unwrap_or_default();
        let code = self.currency.as_deref();
        // Only a declined PaymentIntent's error says why it was declined.
        let decline_code = match (&status, &self.last_payment_error) {
            (ProviderStatus::Declined, Some(error)) => error.decline().map(str::to_owned),
            _ => None,
        };
        // Stripe keeps a PaymentIntent whose confirmation failed open for
        // another one, until it is canceled.
        let confirmable = status == ProviderStatus::Declined && self.status != "canceled";
        let next_action = (status == ProviderStatus::RequiresAction).then(|| NextAction {
            redirect_url: self
                .next_action
                .and_then(|action| action.redirect_to_url)
                .and_then(|redirect| redirect.url),
            client_secret: self.client_secret.map(|secret| secret.0),
        });
        ProviderObject {
            id: self.id,
            status,
            reference: reference(&metadata),
            amount: cobro_amount(code, self.amount),
            amount_captured: cobro_amount(code, self.amount_received),
            sequence: None,
            currency: currency(self.currency),
            capture_method: capture_method(self.capture_method),
            charge: None,
            metadata,
            next_action,
            decline_code,
            confirmable,
        }
    }
}

impl Refund {
    pub fn is_refund(&self) -> bool {
        self.object.as_deref().is_none_or(|o| o == "refund")
    }

    pub fn reference(&self) -> Option<String> {
        self.metadata.as_ref().and_then(reference)
    }

    pub fn into_object(self) -> ProviderObject {
        let metadata = self.metadata.unwrap_or_default();
        ProviderObject {
            id: self.id,
            status: refund_status(self.status.as_deref()),
            reference: reference(&metadata),
            amount: cobro_amount(self.currency.as_deref(), self.amount),
            amount_captured: None,
            sequence: None,
            currency: currency(self.currency),
            capture_method: None,
            // cobro's charge on Stripe is the PaymentIntent (its
            // `provider_ref`), not the Charge under it.
            charge: self.payment_intent,
            metadata,
            next_action: None,
            decline_code: None,
            confirmable: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn intent(status: &str, failed: bool) -> PaymentIntent {
        let error = if failed {
            r#","last_payment_error":{"type":"card_error","code":"card_declined","decline_code":"generic_decline"}"#
        } else {
            r#","last_payment_error":null"#
        };
        serde_json::from_str(&format!(
            r#"{{"id":"pi_1","object":"payment_intent","status":"{status}","amount":1999,"amount_received":0,
               "currency":"eur","capture_method":"automatic_async",
               "latest_charge":"ch_1",
               "metadata":{{"cobro_reference":"o-1:authorize-v1/a","cobro_attempt":"a"}}{error}}}"#
        ))
        .expect("a PaymentIntent")
    }

    #[test]
    fn payment_intent_statuses_map_onto_cobros_and_the_rest_proves_nothing() {
        use ProviderStatus as S;
        let cases = [
            ("requires_capture", false, S::Authorized),
            ("succeeded", false, S::Captured),
            ("canceled", false, S::Voided),
            ("canceled", true, S::Declined),
            ("requires_payment_method", true, S::Declined),
            (
                "requires_payment_method",
                false,
                S::Other("requires_payment_method".into()),
            ),
            ("requires_action", false, S::RequiresAction),
            (
                "requires_confirmation",
                false,
                S::Other("requires_confirmation".into()),
            ),
            ("processing", false, S::Other("processing".into())),
            ("something_new", false, S::Other("something_new".into())),
        ];
        for (status, failed, expected) in cases {
            assert_eq!(intent(status, failed).cobro_status(), expected, "{status}");
        }
    }

    #[test]
    fn a_payment_intent_canceled_before_any_charge_never_held_money() {
        for latest_charge in [None, Some(serde_json::Value::Null)] {
            let mut never_charged = intent("canceled", false);
            never_charged.latest_charge = latest_charge;
            assert_eq!(never_charged.cobro_status(), ProviderStatus::Declined);
        }
        let mut expanded = intent("canceled", false);
        expanded.latest_charge = Some(serde_json::json!({"id": "ch_1", "object": "charge"}));
        assert_eq!(expanded.cobro_status(), ProviderStatus::Voided);
    }

    #[test]
    fn a_payment_intent_reads_as_cobro_compares_it() {
        let object = intent("requires_capture", false).into_object();
        assert_eq!(object.id, "pi_1");
        assert_eq!(object.currency.as_deref(), Some("EUR"));
        assert_eq!(object.capture_method.as_deref(), Some("automatic"));
        assert_eq!(object.reference.as_deref(), Some("o-1:authorize-v1/a"));
        assert_eq!(object.amount, Some(1999));
        assert_eq!(object.amount_captured, Some(0));
        assert_eq!(
            object.metadata.get("cobro_attempt").map(String::as_str),
            Some("a")
        );
    }

    #[test]
    fn a_declined_payment_intent_carries_its_decline_code_and_nothing_else_does() {
        // The issuer's decline_code first, Stripe's code without one.
        let declined = intent("requires_payment_method", true).into_object();
        assert_eq!(declined.status, ProviderStatus::Declined);
        assert_eq!(declined.decline_code.as_deref(), Some("generic_decline"));
        let mut soft = intent("requires_payment_method", true);
        if let Some(error) = soft.last_payment_error.as_mut() {
            error.decline_code = Some("try_again_later".into());
        }
        assert_eq!(
            soft.into_object().decline_code.as_deref(),
            Some("try_again_later")
        );
        let mut coded = intent("canceled", true);
        if let Some(error) = coded.last_payment_error.as_mut() {
            error.decline_code = None;
            error.code = Some("expired_card".into());
        }
        assert_eq!(
            coded.into_object().decline_code.as_deref(),
            Some("expired_card")
        );
        // Canceled before any charge: declined, and no code to tell.
        let mut abandoned = intent("canceled", false);
        abandoned.latest_charge = None;
        let abandoned = abandoned.into_object();
        assert_eq!(
            (abandoned.status, abandoned.decline_code),
            (ProviderStatus::Declined, None)
        );
        // A stale error on a PaymentIntent that is not declined says nothing.
        let mut captured = intent("succeeded", true);
        captured.latest_charge = Some(serde_json::json!("ch_1"));
        assert_eq!(captured.into_object().decline_code, None);
    }

    fn intent_in(currency: &str, amount: i64, received: i64) -> PaymentIntent {
        let mut pi = intent("succeeded", false);
        pi.currency = Some(currency.to_owned());
        pi.amount = Some(amount);
        pi.amount_received = Some(received);
        pi
    }

    #[test]
    fn isk_amounts_are_read_back_in_whole_kronur() {
        let object = intent_in("isk", 500_000, 500_000).into_object();
        assert_eq!(object.currency.as_deref(), Some("ISK"));
        assert_eq!(object.amount, Some(5000));
        assert_eq!(object.amount_captured, Some(5000));
        let refund: Refund = serde_json::from_str(
            r#"{"id":"re_1","object":"refund","amount":120000,"currency":"isk",
                "payment_intent":"pi_1","status":"succeeded"}"#,
        )
        .expect("a refund");
        assert_eq!(refund.into_object().amount, Some(1200));
    }

    #[test]
    fn amounts_of_the_other_rules_are_read_back_by_the_same_table() {
        let read = |currency: &str, wire: i64| intent_in(currency, wire, 0).into_object().amount;
        assert_eq!(read("jpy", 500), Some(500));
        assert_eq!(read("ugx", 3_700_000), Some(37_000));
        assert_eq!(read("huf", 1045), Some(1045));
        assert_eq!(read("kwd", 5120), Some(5120));
        assert_eq!(read("mga", 5000), Some(500_000));
    }

    #[test]
    fn an_amount_cobro_cannot_state_in_its_minor_units_is_absent() {
        // Fractional krónur: never what cobro sent.
        let object = intent_in("isk", 500_050, 0).into_object();
        assert_eq!(object.amount, None);
        assert_eq!(object.amount_captured, Some(0));
        // A currency cobro does not know has no minor units of cobro's.
        let object = intent_in("xyz", 1999, 1999).into_object();
        assert_eq!(object.currency.as_deref(), Some("XYZ"));
        assert_eq!((object.amount, object.amount_captured), (None, None));
        assert_eq!(cobro_amount(None, Some(5)), None);
        assert_eq!(cobro_amount(Some("eur"), None), None);
    }

    #[test]
    fn refund_statuses_map_onto_cobros_and_pending_proves_nothing() {
        use ProviderStatus as S;
        assert_eq!(refund_status(Some("succeeded")), S::Succeeded);
        assert_eq!(refund_status(Some("failed")), S::Failed);
        assert_eq!(refund_status(Some("canceled")), S::Canceled);
        assert_eq!(refund_status(Some("pending")), S::Other("pending".into()));
        assert_eq!(
            refund_status(Some("requires_action")),
            S::Other("requires_action".into())
        );
        assert_eq!(refund_status(None), S::Other("null".into()));
    }

    #[test]
    fn a_refund_names_the_payment_intent_as_its_charge() {
        let refund: Refund = serde_json::from_str(
            r#"{"id":"re_1","object":"refund","amount":500,"charge":"ch_1","currency":"eur",
                "payment_intent":"pi_1","status":"succeeded","metadata":{"cobro_reference":"r/1"}}"#,
        )
        .expect("a refund");
        let object = refund.into_object();
        assert_eq!(object.charge.as_deref(), Some("pi_1"));
        assert_eq!(object.reference.as_deref(), Some("r/1"));
        assert_eq!(object.currency.as_deref(), Some("EUR"));
        assert_eq!(object.status, ProviderStatus::Succeeded);
    }
}
