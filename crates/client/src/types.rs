//! The requests and answers of cobro's API, mirrored from `/openapi.json`
//! (schemas `CreatePaymentRequest`, `CreateRefundRequest`, `Payment`,
//! `Attempt`, `Refund`, `Failure`, `PaymentList`, and the string enums).
//!
//! Mirrored, not shared: the server's views live in `cobro-api`, which pulls
//! axum, sqlx's PostgreSQL driver and the whole server. `tests/contract.rs`
//! checks every type here against the served document (the same properties,
//! the same required ones, the same enum values) and round-trips real
//! answers through them, so a drift fails the build of the suite rather than
//! a merchant's checkout.
//!
//! Enums carry an `Other(String)` arm: a status a newer server adds reads as
//! `Other`, not as an error, so an old client keeps working.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

string_enum!(
    /// Schema `PaymentStatus`.
    PaymentStatus {
        Processing = "processing",
        /// The customer must authenticate (3-D Secure): send them to
        /// [`Payment::next_action`]; the payment ends by itself afterwards.
        RequiresAction = "requires_action",
        RequiresReconciliation = "requires_reconciliation",
        NeedsReview = "needs_review",
        Authorized = "authorized",
        Capturing = "capturing",
        Captured = "captured",
        Canceling = "canceling",
        Canceled = "canceled",
        Declined = "declined",
        Failed = "failed",
        PartiallyRefunded = "partially_refunded",
        Refunded = "refunded",
    }
);

impl PaymentStatus {
    /// Whether the authorisation's outcome is still being decided
    /// (`processing`): what [`crate::Client::wait_for_payment`] waits out.
    pub fn is_processing(&self) -> bool {
        *self == PaymentStatus::Processing
    }
}

string_enum!(
    /// Schema `RefundStatus`.
    RefundStatus {
        Processing = "processing",
        Succeeded = "succeeded",
        Failed = "failed",
        RequiresReconciliation = "requires_reconciliation",
        NeedsReview = "needs_review",
    }
);

string_enum!(
    /// Schema `AttemptState`.
    AttemptState {
        Held = "held",
        Pending = "pending",
        Unknown = "unknown",
        Reconciling = "reconciling",
        AwaitingCustomer = "awaiting_customer",
        Succeeded = "succeeded",
        Declined = "declined",
        Failed = "failed",
        NoEffect = "no_effect",
    }
);

string_enum!(
    /// Schema `CaptureMethod`.
    CaptureMethod {
        /// The money moves at authorisation.
        Automatic = "automatic",
        /// Authorise now; capture or cancel later.
        Manual = "manual",
    }
);

string_enum!(
    /// Schema `Operation`: the keyed operations, also the kinds of intent
    /// the journal records.
    Operation {
        /// `POST /v1/payments`.
        Authorize = "payment.authorize",
        /// `POST /v1/payments/{id}/capture`.
        Capture = "payment.capture",
        /// `POST /v1/payments/{id}/cancel`.
        Cancel = "payment.cancel",
        /// `POST /v1/payments/{id}/refunds`.
        Refund = "refund.create",
    }
);

/// Body of `POST /v1/payments` (schema `CreatePaymentRequest`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CreatePayment {
    /// The merchant's order: 1 to 128 of `[A-Za-z0-9._:-]`.
    pub order_ref: String,
    /// Integer minor units, 1 to 99 999 999 999 (`1999` is 19.99 EUR).
    pub amount: i64,
    /// ISO 4217 alpha-3.
    pub currency: String,
    /// The provider's payment method token.
    pub payment_method: String,
    /// `automatic` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capture_method: Option<CaptureMethod>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// At most 20 keys (`null` reads as none, as the API takes it).
    #[serde(
        default,
        deserialize_with = "null_as_empty",
        skip_serializing_if = "BTreeMap::is_empty"
    )]
    pub metadata: BTreeMap<String, String>,
    /// Where the provider sends the customer back after authenticating
    /// (3-D Secure): an absolute `https` (or `http`) URL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub return_url: Option<String>,
}

/// `null` is an empty map, as the API reads it.
fn null_as_empty<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<BTreeMap<String, String>, D::Error> {
    Ok(Option::<BTreeMap<String, String>>::deserialize(deserializer)?.unwrap_or_default())
}

impl CreatePayment {
    /// An automatic-capture payment with no description or metadata.
    pub fn new(
        order_ref: impl Into<String>,
        amount: i64,
        currency: impl Into<String>,
        payment_method: impl Into<String>,
    ) -> Self {
        Self {
            order_ref: order_ref.into(),
            amount,
            currency: currency.into(),
            payment_method: payment_method.into(),
            capture_method: None,
            description: None,
            metadata: BTreeMap::new(),
            return_url: None,
        }
    }

    /// Authorise only; [`crate::Client::capture`] or
    /// [`crate::Client::cancel`] later.
    pub fn manual(mut self) -> Self {
        self.capture_method = Some(CaptureMethod::Manual);
        self
    }

    /// Where the provider sends the customer back after authenticating
    /// (3-D Secure). A payment that asks for it answers
    /// [`PaymentStatus::RequiresAction`] with [`Payment::next_action`].
    pub fn return_url(mut self, url: impl Into<String>) -> Self {
        self.return_url = Some(url.into());
        self
    }

    pub fn description(mut self, text: impl Into<String>) -> Self {
        self.description = Some(text.into());
        self
    }

    pub fn metadata(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.metadata.insert(key.into(), value.into());
        self
    }
}

/// Body of `POST /v1/payments/{id}/refunds` (schema `CreateRefundRequest`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CreateRefund {
    /// Minor units; refunds that are not failed never exceed the captured amount.
    pub amount: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The refund's own identity, unique per payment for ever: a second
    /// refund with it is refused (409 `refund-reference-exists`), however
    /// late the retry and whatever its key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reference: Option<String>,
}

impl CreateRefund {
    pub fn new(amount: i64) -> Self {
        Self {
            amount,
            reason: None,
            reference: None,
        }
    }

    pub fn reason(mut self, reason: impl Into<String>) -> Self {
        self.reason = Some(reason.into());
        self
    }

    /// See [`CreateRefund::reference`](struct.CreateRefund.html#structfield.reference).
    pub fn reference(mut self, reference: impl Into<String>) -> Self {
        self.reference = Some(reference.into());
        self
    }
}

/// Why a payment or refund was declined or failed (schema `Failure`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Failure {
    /// The provider's (or cobro's) stable code, e.g. `card_declined`.
    pub code: String,
    pub message: Option<String>,
}

/// One provider attempt of a payment (schema `Attempt`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attempt {
    /// 1 for the first attempt, in creation order.
    pub number: u32,
    pub operation: Operation,
    /// The reference the provider saw: the intent name and the attempt's
    /// id (`pedido-842:authorize-v1/0193c0de-...`).
    pub reference: String,
    pub state: AttemptState,
    /// How many times cobro sent it (always under one provider key).
    pub sends: i32,
    #[serde(default, with = "micros::option")]
    pub first_send_at: Option<DateTime<Utc>>,
    #[serde(default, with = "micros::option")]
    pub last_send_at: Option<DateTime<Utc>>,
    /// The provider it was sent to.
    #[serde(default)]
    pub provider: Option<String>,
}

/// A payment (schema `Payment`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Payment {
    /// A UUID.
    pub id: String,
    /// `{order_ref}:authorize-v{n}`: the intent that created the payment,
    /// also the provider-side reference of its charge.
    pub intent: String,
    pub order_ref: String,
    pub amount: i64,
    pub currency: String,
    pub capture_method: CaptureMethod,
    pub status: PaymentStatus,
    pub amount_captured: i64,
    pub amount_refunded: i64,
    /// The provider's charge id, once known.
    pub provider_ref: Option<String>,
    pub failure: Option<Failure>,
    /// A cancel asked while the authorisation was unknown, carried out once
    /// it is known.
    pub cancel_requested: bool,
    pub description: Option<String>,
    pub metadata: BTreeMap<String, String>,
    #[serde(with = "micros")]
    pub created_at: DateTime<Utc>,
    #[serde(with = "micros")]
    pub updated_at: DateTime<Utc>,
    /// Where the customer comes back after authenticating, as given.
    #[serde(default)]
    pub return_url: Option<String>,
    /// While [`PaymentStatus::RequiresAction`]: what to do with the
    /// customer (not an error: the payment waits for them).
    #[serde(default)]
    pub next_action: Option<Box<NextAction>>,
    /// While [`PaymentStatus::RequiresAction`]: when the payment is
    /// canceled as abandoned.
    #[serde(default, with = "micros::option")]
    pub action_expires_at: Option<DateTime<Utc>>,
    /// The provider its current attempt goes to (the one that holds its
    /// charge once it has one).
    #[serde(default)]
    pub provider: Option<String>,
    /// How it was routed across providers.
    #[serde(default)]
    pub routing: Option<Routing>,
    /// Present on `GET /v1/payments/{id}` and on the 201 of a create;
    /// absent in lists and in capture and cancel answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempts: Option<Vec<Attempt>>,
}

/// How a payment was routed (schema `RoutingView`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Routing {
    /// The account's rule that matched; `None`: the default chain.
    pub rule: Option<String>,
    /// The providers the payment may go to, in order.
    pub chain: Vec<String>,
    pub reason: String,
    /// Each move to the next provider, with its proof of no effect.
    pub moves: Vec<RoutingMove>,
}

/// A payment's move to the next provider (schema `RoutingMoveView`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoutingMove {
    pub from: String,
    pub to: String,
    pub proof: String,
    pub attempt: String,
    pub at: String,
}

/// What the merchant's front end does with a customer who must
/// authenticate (3-D Secure): `redirect_to_url` (send them to
/// [`RedirectToUrl::url`]), or `use_stripe_sdk` (Stripe.js with the
/// `client_secret`).
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NextAction {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub redirect_to_url: Option<RedirectToUrl>,
    /// Stripe's PaymentIntent `client_secret`, for Stripe.js; never logged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_secret: Option<String>,
}

impl std::fmt::Debug for NextAction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NextAction")
            .field("kind", &self.kind)
            .field("redirect_to_url", &self.redirect_to_url)
            .field("client_secret", &self.client_secret.as_ref().map(|_| "***"))
            .finish()
    }
}

/// Where the customer authenticates, and where they come back.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RedirectToUrl {
    pub url: String,
    pub return_url: Option<String>,
}

/// A refund (schema `Refund`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Refund {
    pub id: String,
    pub payment_id: String,
    /// `{order_ref}:refund-v{n}`.
    pub intent: String,
    pub amount: i64,
    pub reason: Option<String>,
    pub status: RefundStatus,
    pub provider_ref: Option<String>,
    pub failure: Option<Failure>,
    #[serde(with = "micros")]
    pub created_at: DateTime<Utc>,
    #[serde(with = "micros")]
    pub updated_at: DateTime<Utc>,
    /// The merchant's reference for the refund, when it gave one.
    #[serde(default)]
    pub reference: Option<String>,
}

/// A page of `GET /v1/payments` (schema `PaymentList`), newest first.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PaymentList {
    pub data: Vec<Payment>,
    /// Pass as [`ListPayments::cursor`] for the next (older) page.
    pub next_cursor: Option<String>,
}

/// The filters of `GET /v1/payments`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ListPayments {
    pub order_ref: Option<String>,
    pub status: Option<PaymentStatus>,
    /// 1 to 100 (the server's default is 20).
    pub limit: Option<u32>,
    pub cursor: Option<String>,
}

impl ListPayments {
    pub(crate) fn query(&self) -> Vec<(&'static str, String)> {
        let mut query = Vec::new();
        if let Some(order_ref) = &self.order_ref {
            query.push(("order_ref", order_ref.clone()));
        }
        if let Some(status) = &self.status {
            query.push(("status", status.as_str().to_owned()));
        }
        if let Some(limit) = self.limit {
            query.push(("limit", limit.to_string()));
        }
        if let Some(cursor) = &self.cursor {
            query.push(("cursor", cursor.clone()));
        }
        query
    }
}

/// Timestamps as the server writes them: RFC 3339, UTC, microseconds, `Z`.
/// (chrono's default picks 3, 6 or 9 digits, so a re-serialised answer would
/// differ from the one received.)
pub(crate) mod micros {
    use chrono::{DateTime, SecondsFormat, Utc};
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(t: &DateTime<Utc>, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&t.to_rfc3339_opts(SecondsFormat::Micros, true))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<DateTime<Utc>, D::Error> {
        let text = String::deserialize(d)?;
        DateTime::parse_from_rfc3339(&text)
            .map(|t| t.with_timezone(&Utc))
            .map_err(serde::de::Error::custom)
    }

    pub mod option {
        use super::*;

        pub fn serialize<S: Serializer>(
            t: &Option<DateTime<Utc>>,
            s: S,
        ) -> Result<S::Ok, S::Error> {
            match t {
                Some(t) => super::serialize(t, s),
                None => s.serialize_none(),
            }
        }

        pub fn deserialize<'de, D: Deserializer<'de>>(
            d: D,
        ) -> Result<Option<DateTime<Utc>>, D::Error> {
            Option::<String>::deserialize(d)?
                .map(|text| {
                    DateTime::parse_from_rfc3339(&text)
                        .map(|t| t.with_timezone(&Utc))
                        .map_err(serde::de::Error::custom)
                })
                .transpose()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unknown_status_reads_as_other_and_writes_back_unchanged() {
        let status: PaymentStatus = serde_json::from_str("\"on_the_moon\"").expect("reads");
        assert_eq!(status, PaymentStatus::Other("on_the_moon".into()));
        assert_eq!(
            serde_json::to_string(&status).expect("writes"),
            "\"on_the_moon\""
        );
        let known: PaymentStatus = serde_json::from_str("\"captured\"").expect("reads");
        assert_eq!(known, PaymentStatus::Captured);
    }

    #[test]
    fn a_minimal_create_payment_serialises_only_what_was_set() {
        let body = serde_json::to_value(CreatePayment::new("o-1", 1999, "EUR", "pm_card_visa"))
            .expect("json");
        assert_eq!(
            body,
            serde_json::json!({"order_ref":"o-1","amount":1999,"currency":"EUR","payment_method":"pm_card_visa"})
        );
    }
}
