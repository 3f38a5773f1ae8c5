#![doc = include_str!("../README.md")]

mod connector;
mod http;
mod pages;
pub mod stripe;
pub mod webhook;

pub use connector::Connector;
pub use http::{HttpProvider, HttpProviderConfig};
pub use stripe::{
    StripeConfig, StripeConfigError, StripeProvider, StripeSecretKey, StripeWebhooks,
};
pub use webhook::{EventKind, FakeWebhooks, ProviderEvent, WebhookScheme, WebhookSecret};

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::future::Future;

/// A charge or refund as the provider reports it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProviderObject {
    /// The provider's id (`ch_...`, `re_...`).
    pub id: String,
    pub status: ProviderStatus,
    #[serde(default)]
    pub reference: Option<String>,
    #[serde(default)]
    pub amount: Option<i64>,
    #[serde(default)]
    pub amount_captured: Option<i64>,
    /// The provider's per-charge event sequence, when it reports one.
    #[serde(default)]
    pub sequence: Option<i64>,
    #[serde(default)]
    pub currency: Option<String>,
    /// `automatic` or `manual`, for charges.
    #[serde(default)]
    pub capture_method: Option<String>,
    /// The refunded charge, for refunds.
    #[serde(default)]
    pub charge: Option<String>,
    /// What cobro sent as metadata: its attempt identity
    /// ([`metadata`] keys), echoed by the provider.
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    /// What the customer must do before the charge can happen (3-D
    /// Secure), when the status is [`ProviderStatus::RequiresAction`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_action: Option<NextAction>,
    /// Why a [`ProviderStatus::Declined`] charge was declined, as the
    /// provider words it (`try_again_later`, `insufficient_funds`): what
    /// a read tells of a decline whose answer was lost, so that routing
    /// can tell a soft decline from the card's own (docs/routing.md §2).
    /// `None` when the provider gave no code, and on every other object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decline_code: Option<String>,
    /// A [`ProviderStatus::Declined`] object the provider still keeps open
    /// for another confirmation (Stripe's PaymentIntent left
    /// `requires_payment_method` by a failed try, which whoever holds its
    /// client secret may confirm again with another card): nothing is
    /// charged now, but something may be. A cancel of it has not happened
    /// while it is open. `false` on every other object.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub confirmable: bool,
}

/// Where the customer authenticates (3-D Secure), as the provider said:
/// the merchant's front end sends them to `redirect_url`, the provider
/// sends them back to the payment's `return_url`. Stripe also gives the
/// PaymentIntent's `client_secret`, for Stripe.js (`handleNextAction`).
///
/// The client secret is the merchant front end's to use, never a log's:
/// `Debug` hides it and serialising it (evidence, observations) leaves it
/// out; [`NextAction::for_merchant`] is the one place it is shown.
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NextAction {
    /// `None`: the provider gave no URL (Stripe's `use_stripe_sdk`, when
    /// no `return_url` was sent): only Stripe.js can run the challenge.
    #[serde(default)]
    pub redirect_url: Option<String>,
    #[serde(default, skip_serializing)]
    pub client_secret: Option<String>,
}

impl std::fmt::Debug for NextAction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NextAction")
            .field("redirect_url", &self.redirect_url)
            .field("client_secret", &self.client_secret.as_ref().map(|_| "***"))
            .finish()
    }
}

impl NextAction {
    /// The action as the API shows it to the merchant (and stores it):
    /// `{"type":"redirect_to_url","redirect_to_url":{"url","return_url"}}`,
    /// with `client_secret` when the provider gave one.
    pub fn for_merchant(&self, return_url: Option<&str>) -> serde_json::Value {
        let mut action = match &self.redirect_url {
            Some(url) => serde_json::json!({
                "type": "redirect_to_url",
                "redirect_to_url": {"url": url, "return_url": return_url},
            }),
            None => serde_json::json!({"type": "use_stripe_sdk"}),
        };
        if let Some(secret) = &self.client_secret {
            action["client_secret"] = serde_json::Value::String(secret.clone());
        }
        action
    }
}

/// A provider object's status. Charges are `authorized`, `captured`,
/// `declined` or `voided`; refunds `succeeded`, `failed` or `canceled`.
/// Anything else is kept as the provider spelled it (`Other`), proves
/// nothing, and is shown as it came.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "String", into = "String")]
pub enum ProviderStatus {
    Authorized,
    Captured,
    Declined,
    Voided,
    Succeeded,
    Failed,
    Canceled,
    /// A charge that waits for its customer to authenticate (3-D Secure):
    /// nothing charged yet, and nothing unknown about it.
    RequiresAction,
    /// A status cobro does not know (`pending`, a new one): never evidence.
    Other(String),
}

impl ProviderStatus {
    const KNOWN: [ProviderStatus; 8] = [
        ProviderStatus::Authorized,
        ProviderStatus::Captured,
        ProviderStatus::Declined,
        ProviderStatus::Voided,
        ProviderStatus::Succeeded,
        ProviderStatus::Failed,
        ProviderStatus::Canceled,
        ProviderStatus::RequiresAction,
    ];

    pub fn as_str(&self) -> &str {
        match self {
            ProviderStatus::Authorized => "authorized",
            ProviderStatus::Captured => "captured",
            ProviderStatus::Declined => "declined",
            ProviderStatus::Voided => "voided",
            ProviderStatus::Succeeded => "succeeded",
            ProviderStatus::Failed => "failed",
            ProviderStatus::Canceled => "canceled",
            ProviderStatus::RequiresAction => "requires_action",
            ProviderStatus::Other(raw) => raw,
        }
    }
}

impl From<String> for ProviderStatus {
    fn from(raw: String) -> Self {
        Self::KNOWN
            .into_iter()
            .find(|known| known.as_str() == raw)
            .unwrap_or(ProviderStatus::Other(raw))
    }
}

impl From<&str> for ProviderStatus {
    fn from(raw: &str) -> Self {
        ProviderStatus::from(raw.to_owned())
    }
}

impl From<ProviderStatus> for String {
    fn from(status: ProviderStatus) -> Self {
        match status {
            ProviderStatus::Other(raw) => raw,
            known => known.as_str().to_owned(),
        }
    }
}

impl std::fmt::Display for ProviderStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The metadata keys under which cobro sends an attempt's identity.
/// The HTTP client builder of a provider connector at `base_url`. A
/// plain-HTTP URL (the fake provider, a loopback emulator) never does a
/// TLS handshake, so its client loads no CA roots: reading the platform's
/// certificate store costs milliseconds of CPU per client, which a test
/// that makes clients by the thousand (the explorer: several per seed)
/// pays over and over. An `https` URL keeps the platform's verifier.
pub(crate) fn client_builder(base_url: &str) -> reqwest::ClientBuilder {
    let builder = reqwest::Client::builder();
    if base_url.starts_with("http://") {
        builder.tls_certs_only(std::iter::empty())
    } else {
        builder
    }
}

pub mod metadata {
    pub const ACCOUNT: &str = "cobro_account";
    pub const PAYMENT: &str = "cobro_payment";
    pub const INTENT: &str = "cobro_intent";
    pub const ATTEMPT: &str = "cobro_attempt";
    /// The attempt's reference (`{intent}/{attempt id}`), for providers
    /// that have no reference field of their own (Stripe): what recovery
    /// searches by.
    pub const REFERENCE: &str = "cobro_reference";
}

/// What one send proved. The classification is the heart of safe retries
/// (docs/recovery.md §2, Classification): only `NotSent` and `Unknown` may be
/// retried, and only with the same provider idempotency key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The provider answered success.
    Succeeded(ProviderObject),
    /// A definitive refusal by the card side (decline): terminal for the intent.
    Declined {
        code: String,
        message: String,
        object: Option<ProviderObject>,
    },
    /// A definitive refusal of the request itself (invalid, not capturable):
    /// terminal for the intent. `object`: the charge as it is now, when the
    /// provider sends it with the refusal (a void refused because the
    /// charge was captured says so).
    Failed {
        code: String,
        message: String,
        object: Option<ProviderObject>,
    },
    /// The provider said it did not execute (e.g. 429), or the request
    /// could not be built: retry the same attempt under the same key. Not
    /// proof that no earlier try under the key reached it (a retrying proxy
    /// between cobro and the provider may have forwarded one).
    NotSent(String),
    /// Nothing left cobro: no connection was made (refused, DNS, TLS,
    /// connect timeout), so this send reached no one. Retried like
    /// `NotSent`; the one answer routing may move a payment on
    /// (docs/routing.md §2), when every send of the attempt was this.
    NotConnected(String),
    /// The request may or may not have had an effect (timeout, reset after
    /// sending, 5xx, malformed answer, 409 in progress): retry with the same
    /// key inside the key window, else reconcile. Never a reason to charge
    /// with a new key.
    Unknown(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn provider_statuses_keep_their_spelling_and_unknown_ones_are_other() {
        for known in ProviderStatus::KNOWN {
            assert_eq!(ProviderStatus::from(known.as_str()), known);
        }
        let odd = ProviderStatus::from("pending");
        assert_eq!(odd, ProviderStatus::Other("pending".into()));
        assert_eq!(String::from(odd), "pending");
        // `Other` never swallows a known name.
        assert_eq!(ProviderStatus::from("voided"), ProviderStatus::Voided);
    }
}

impl Outcome {
    /// A short, log-safe name of the class.
    pub fn class(&self) -> &'static str {
        match self {
            Outcome::Succeeded(_) => "succeeded",
            Outcome::Declined { .. } => "declined",
            Outcome::Failed { .. } => "failed",
            Outcome::NotSent(_) | Outcome::NotConnected(_) => "not_sent",
            Outcome::Unknown(_) => "unknown",
        }
    }
}

/// An authorisation (and, with `capture`, a capture) request.
#[derive(Clone, Debug, Serialize)]
pub struct AuthorizeRequest {
    pub amount: i64,
    pub currency: String,
    pub payment_method: String,
    pub capture: bool,
    /// Unique to the attempt (`{intent}/{attempt id}`): how the reconciler
    /// finds the charge again, and never shared by two accounts.
    pub reference: String,
    /// The attempt's identity ([`metadata`] keys).
    pub metadata: BTreeMap<String, String>,
    /// Where the provider sends the customer back after authenticating
    /// (3-D Secure); `None`: the payment was created without one. Sent
    /// to Stripe only: the fake's own JSON dialect has no 3-D Secure (its
    /// Stripe dialect has) and refuses fields it does not know.
    #[serde(skip_serializing)]
    pub return_url: Option<String>,
}

#[derive(Clone, Debug, Serialize)]
pub struct RefundRequest {
    pub charge: String,
    pub amount: i64,
    pub reference: String,
    pub metadata: BTreeMap<String, String>,
}

/// A query to the provider failed: it proves nothing about any charge.
#[derive(Debug, thiserror::Error)]
#[error("provider query failed: {0}")]
pub struct QueryError(pub String);

/// What is known about one call itself, beyond what it proved: for the
/// attempt's record and for the provider's support.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CallInfo {
    /// The provider's id of the request (Stripe's `Request-Id`): what its
    /// support asks for when an answer needs explaining.
    #[serde(default)]
    pub request_id: Option<String>,
    /// The provider answered from its idempotency store (Stripe's
    /// `Idempotent-Replayed: true`): the effect, if any, was made by an
    /// earlier send under the same key, not by this one. Set only when the
    /// whole answer was read: the worker and the reconciler take a replayed
    /// unknown answer for a stored error that no resend can change, which a
    /// lost body (perhaps a stored success) is not.
    #[serde(default)]
    pub replayed: bool,
    /// The provider's own word on a retry with the same key (Stripe's
    /// `Stripe-Should-Retry`): `Some(false)` on an unknown outcome means a
    /// resend would only replay this answer, so the worker should hand the
    /// attempt to the reconciler rather than retry fast; `None`: not said.
    #[serde(default)]
    pub should_retry: Option<bool>,
}

/// One mutation, as [`Provider::send`] takes it.
#[derive(Clone, Copy, Debug)]
pub enum Mutation<'a> {
    Authorize(&'a AuthorizeRequest),
    /// Capture the charge with this provider id.
    Capture(&'a str),
    /// Void (cancel) the charge with this provider id.
    Void(&'a str),
    Refund(&'a RefundRequest),
}

/// What one send proved, and what is known about the call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sent {
    pub outcome: Outcome,
    /// `None` when no answer arrived, or the provider reports nothing of
    /// the kind.
    pub call: Option<CallInfo>,
}

/// A window of creation times at the provider, in whole unix seconds, both
/// ends included (`to: None`: up to now): what a consistent list must cover
/// to prove that an attempt made nothing (the ladder is in
/// docs/proof-of-absence.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Window {
    pub from: i64,
    pub to: Option<i64>,
}

/// Which of the provider's objects a ledger read lists (the books,
/// docs/books.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LedgerKind {
    /// Charges (the fake) or PaymentIntents (Stripe).
    Charges,
    Refunds,
}

impl LedgerKind {
    pub fn as_str(self) -> &'static str {
        match self {
            LedgerKind::Charges => "charge",
            LedgerKind::Refunds => "refund",
        }
    }
}

/// One page of a ledger read: every object of it, whatever its metadata,
/// and the cursor of the next page when more follow.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LedgerPage {
    pub objects: Vec<ProviderObject>,
    /// `None`: this was the last page.
    pub next: Option<String>,
}

/// Every call cobro makes to a payment provider. Mutations carry the
/// attempt's stored provider idempotency key; a retry passes the same key.
pub trait Provider: Send + Sync + 'static {
    /// The provider's name in spans and metrics.
    fn name(&self) -> &str {
        "provider"
    }
    fn authorize(
        &self,
        key: &str,
        request: &AuthorizeRequest,
    ) -> impl Future<Output = Outcome> + Send;
    fn capture(&self, key: &str, charge: &str) -> impl Future<Output = Outcome> + Send;
    fn void(&self, key: &str, charge: &str) -> impl Future<Output = Outcome> + Send;
    fn refund(&self, key: &str, request: &RefundRequest) -> impl Future<Output = Outcome> + Send;
    /// One mutation with what is known about the call ([`CallInfo`]: the
    /// provider's request id, whether the answer was replayed). The
    /// default sends through the four methods above and knows nothing of
    /// the call; a provider that reports such things (Stripe) overrides it.
    fn send(&self, key: &str, mutation: Mutation<'_>) -> impl Future<Output = Sent> + Send {
        async move {
            let outcome = match mutation {
                Mutation::Authorize(request) => self.authorize(key, request).await,
                Mutation::Capture(charge) => self.capture(key, charge).await,
                Mutation::Void(charge) => self.void(key, charge).await,
                Mutation::Refund(request) => self.refund(key, request).await,
            };
            Sent {
                outcome,
                call: None,
            }
        }
    }
    /// A charge by its provider id; `Ok(None)` when the provider says it does not exist.
    fn get_charge(
        &self,
        id: &str,
    ) -> impl Future<Output = Result<Option<ProviderObject>, QueryError>> + Send;
    /// Charges by merchant reference, subject to the provider's search lag.
    fn search_charges(
        &self,
        reference: &str,
    ) -> impl Future<Output = Result<Vec<ProviderObject>, QueryError>> + Send;
    /// Refunds by merchant reference, given the refunded charge when cobro
    /// knows it (the payment's `provider_ref`). A provider that searches
    /// refunds (the fake) ignores `charge` and is subject to its search
    /// lag; one that cannot (Stripe) lists the charge's refunds instead,
    /// and without the charge answers a [`QueryError`] (which proves
    /// nothing).
    fn search_refunds(
        &self,
        reference: &str,
        charge: Option<&str>,
    ) -> impl Future<Output = Result<Vec<ProviderObject>, QueryError>> + Send;
    /// The charges carrying `reference` among every charge created in
    /// `window`, from a list the provider documents as strongly consistent,
    /// paged to the end: the one read whose emptiness proves that no charge
    /// was made in the window. A provider that offers no such list answers
    /// a [`QueryError`] (the default), which proves nothing.
    fn list_charges(
        &self,
        reference: &str,
        window: Window,
    ) -> impl Future<Output = Result<Vec<ProviderObject>, QueryError>> + Send {
        let _ = (reference, window);
        async {
            Err(QueryError(
                "this provider offers no consistent list of charges".into(),
            ))
        }
    }
    /// The refunds carrying `reference` among every refund of `charge`, from
    /// a strongly consistent list, paged to the end; the default offers none.
    fn list_refunds(
        &self,
        reference: &str,
        charge: &str,
    ) -> impl Future<Output = Result<Vec<ProviderObject>, QueryError>> + Send {
        let _ = (reference, charge);
        async {
            Err(QueryError(
                "this provider offers no consistent list of refunds".into(),
            ))
        }
    }
    /// One page of every object of `kind` created in `window` (whoever
    /// made it, whatever its metadata), from the list the provider
    /// documents as strongly consistent, after the object `after`
    /// (`None`: the first page). The books read the ledger this way, page
    /// by page, so a window of any size is matched in bounded memory. A
    /// page that fails is read again before the read fails; a failed read
    /// proves nothing. The default offers none.
    fn ledger_page(
        &self,
        kind: LedgerKind,
        window: Window,
        after: Option<&str>,
    ) -> impl Future<Output = Result<LedgerPage, QueryError>> + Send {
        let _ = (kind, window, after);
        async {
            Err(QueryError(
                "this provider offers no consistent list of its ledger".into(),
            ))
        }
    }
    /// Asks once (at start-up) whether the provider accepts cobro's
    /// credentials, by the read proof of absence needs (the consistent
    /// list). The default knows nothing.
    fn check_credentials(&self) -> impl Future<Output = Credentials> + Send {
        async { Credentials::Unknown("this provider offers no check".into()) }
    }
}

/// What a provider said of cobro's credentials ([`Provider::check_credentials`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Credentials {
    /// The read was answered.
    Accepted,
    /// 401 or 403: the key is wrong, revoked, of the other mode, or lacks a
    /// permission. Every call would be refused for as long as it lasts, so
    /// a process that would send refuses to start instead.
    Refused(String),
    /// Nothing learnt (the provider unreachable, a 5xx, a 429): no reason
    /// not to start; sends wait as in any outage.
    Unknown(String),
}

impl Credentials {
    /// From the status of the check's read: 2xx accepted, 401/403 refused
    /// (`why` says what a refusal means for this provider), anything else
    /// unknown.
    pub(crate) fn from_status(status: u16, why: impl FnOnce(u16) -> String) -> Self {
        match status {
            200..=299 => Credentials::Accepted,
            401 | 403 => Credentials::Refused(why(status)),
            other => Credentials::Unknown(format!("the check answered {other}")),
        }
    }
}
