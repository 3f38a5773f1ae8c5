//! Provider resources, request bodies and error bodies, as they go on the wire.

use std::collections::BTreeMap;

use axum::body::Bytes;
use axum::http::StatusCode;
use chrono::{DateTime, Utc};
use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::Value;

/// At most this many metadata keys per object.
pub const METADATA_MAX_KEYS: usize = 50;
/// A metadata key is 1 to this many characters.
pub const METADATA_MAX_KEY_CHARS: usize = 40;
/// A metadata value is at most this many characters.
pub const METADATA_MAX_VALUE_CHARS: usize = 500;

/// Lifecycle of a charge.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ChargeStatus {
    /// Made, its effect still pending (a `processing` fault): it becomes
    /// `authorized`, `captured` or `declined` later, and no money has
    /// moved until it does.
    Processing,
    /// Funds held, not yet captured.
    Authorized,
    /// Funds taken (fully or partly, see `amount_captured`).
    Captured,
    /// Refused by the payment method; no money moved.
    Declined,
    /// Authorisation released.
    Voided,
}

impl ChargeStatus {
    /// The wire name: `processing`, `authorized`, `captured`, `declined` or
    /// `voided`.
    pub fn as_str(self) -> &'static str {
        match self {
            ChargeStatus::Processing => "processing",
            ChargeStatus::Authorized => "authorized",
            ChargeStatus::Captured => "captured",
            ChargeStatus::Declined => "declined",
            ChargeStatus::Voided => "voided",
        }
    }
}

/// How a charge is captured, fixed at creation by its `capture` parameter.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum CaptureMethod {
    /// Created with `capture: true`: captured at once.
    Automatic,
    /// Created with `capture: false`: authorised, captured (or voided) later.
    Manual,
}

impl CaptureMethod {
    /// `capture: true` is automatic, `capture: false` manual.
    pub fn from_capture(capture: bool) -> Self {
        if capture {
            CaptureMethod::Automatic
        } else {
            CaptureMethod::Manual
        }
    }

    /// The wire name: `automatic` or `manual`.
    pub fn as_str(self) -> &'static str {
        match self {
            CaptureMethod::Automatic => "automatic",
            CaptureMethod::Manual => "manual",
        }
    }
}

/// A charge as the provider returns it.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Charge {
    /// `ch_` followed by a simple UUID.
    pub id: String,
    /// Always `"charge"`.
    pub object: String,
    /// Authorised amount in minor units.
    pub amount: i64,
    /// ISO 4217 code, three upper-case letters.
    pub currency: String,
    /// The payment method charged (`pm_...`).
    pub payment_method: String,
    /// `automatic` when created with `capture: true`, else `manual`.
    pub capture_method: CaptureMethod,
    /// The merchant's reference; what search and the ledger key on.
    pub reference: String,
    /// The merchant's metadata, keys sorted; `{}` when none was sent.
    pub metadata: BTreeMap<String, String>,
    /// Where the charge is in its lifecycle.
    pub status: ChargeStatus,
    /// Minor units captured so far.
    pub amount_captured: i64,
    /// Minor units refunded so far (never above `amount_captured`).
    pub amount_refunded: i64,
    /// Virtual time of creation.
    pub created: DateTime<Utc>,
    /// Bumped by every mutation of this charge or its refunds, so a webhook
    /// consumer can tell an old event from a new one.
    pub sequence: u64,
    /// Why it was declined, the code its 402 carried (`card_declined`,
    /// `insufficient_funds`, `try_again_later`): set when it becomes
    /// `declined`, shown on every rendering of it since (GET, search,
    /// list, a replayed 402, events), absent on any other charge.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decline_code: Option<String>,
    /// The decline a `soft_decline` fault forced on it when it was made,
    /// in place of its payment method's own (see [`Charge::decline`]). Not
    /// on the wire: the decline shows in the answers and events that carry
    /// one.
    #[serde(skip)]
    pub(crate) forced_decline: Option<Decline>,
}

impl Charge {
    /// What this charge declines with once final: the decline a
    /// `soft_decline` fault forced on it, else its payment method's own.
    pub(crate) fn decline_cause(&self) -> Option<Decline> {
        self.forced_decline
            .or_else(|| Decline::of(&self.payment_method))
    }

    /// Why this charge was declined; none unless it is `declined`. The one
    /// source of every rendering of a decline, in both dialects.
    pub(crate) fn decline(&self) -> Option<Decline> {
        self.decline_cause()
            .filter(|_| self.status == ChargeStatus::Declined)
    }

    /// Makes a new (or `processing`) charge what its effect makes it:
    /// declined, with its decline code, when it has a decline (its payment
    /// method's, or one a `soft_decline` fault forced), else captured or
    /// authorized by its capture method.
    pub(crate) fn make_final(&mut self) {
        self.status = match (self.decline_cause(), self.capture_method) {
            (Some(_), _) => ChargeStatus::Declined,
            (None, CaptureMethod::Automatic) => ChargeStatus::Captured,
            (None, CaptureMethod::Manual) => ChargeStatus::Authorized,
        };
        self.decline_code = self.decline().map(|d| d.code.to_owned());
        if self.status == ChargeStatus::Captured {
            self.amount_captured = self.amount;
        }
    }
}

/// Lifecycle of a refund: this provider's refunds succeed at once, and
/// one may fail later ([`crate::Control::fail_refund`]), as a card
/// network's can when the card's account was closed.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum RefundStatus {
    /// Money returned.
    Succeeded,
    /// Failed after it succeeded: the money went back to the merchant.
    Failed,
}

impl RefundStatus {
    /// The wire name: `succeeded` or `failed`.
    pub fn as_str(self) -> &'static str {
        match self {
            RefundStatus::Succeeded => "succeeded",
            RefundStatus::Failed => "failed",
        }
    }
}

/// A refund as the provider returns it.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Refund {
    /// `re_` followed by a simple UUID.
    pub id: String,
    /// Always `"refund"`.
    pub object: String,
    /// The refunded charge's id.
    pub charge: String,
    /// Refunded minor units.
    pub amount: i64,
    /// The refunded charge's currency.
    pub currency: String,
    /// The merchant's reference of this refund.
    pub reference: String,
    /// The merchant's metadata of this refund, keys sorted; `{}` when none.
    pub metadata: BTreeMap<String, String>,
    /// Always `succeeded`.
    pub status: RefundStatus,
    /// Virtual time of creation.
    pub created: DateTime<Utc>,
    /// The charge's sequence after this refund.
    pub sequence: u64,
}

/// Body of `POST /v1/charges`.
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub(crate) struct ChargeParams {
    pub(crate) amount: i64,
    pub(crate) currency: String,
    pub(crate) payment_method: String,
    pub(crate) capture: bool,
    pub(crate) reference: String,
    #[serde(default, deserialize_with = "metadata")]
    pub(crate) metadata: BTreeMap<String, String>,
}

/// A body that creates a resource (charge or refund): validated after
/// parsing, fingerprinted for its idempotency key, matched by its reference.
pub(crate) trait NewResource: serde::de::DeserializeOwned {
    fn validate(&self) -> Result<(), ApiError>;
    /// The parameters in a fixed order: the parsed struct is already the
    /// canonical form, so no JSON canonicalisation is needed.
    fn fingerprint(&self) -> String;
    fn reference(&self) -> &str;
}

impl NewResource for ChargeParams {
    fn validate(&self) -> Result<(), ApiError> {
        if self.amount <= 0 {
            return Err(ApiError::invalid(
                "amount",
                "amount must be a positive integer of minor units",
            ));
        }
        let currency_ok =
            self.currency.len() == 3 && self.currency.bytes().all(|b| b.is_ascii_uppercase());
        if !currency_ok {
            return Err(ApiError::invalid(
                "currency",
                "currency must be three upper-case letters",
            ));
        }
        if self.payment_method.len() <= 3 || !self.payment_method.starts_with("pm_") {
            return Err(ApiError::invalid(
                "payment_method",
                "payment_method must look like pm_...",
            ));
        }
        validate_reference(&self.reference)?;
        validate_metadata(&self.metadata)
    }

    /// Strings are `Debug`-quoted, so no value can forge a separator.
    fn fingerprint(&self) -> String {
        format!(
            "{}\u{1f}{:?}\u{1f}{:?}\u{1f}{}\u{1f}{:?}\u{1f}{:?}",
            self.amount,
            self.currency,
            self.payment_method,
            self.capture,
            self.reference,
            self.metadata
        )
    }

    fn reference(&self) -> &str {
        &self.reference
    }
}

/// Body of `POST /v1/charges/{id}/capture` (may be empty).
#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
pub(crate) struct CaptureParams {
    pub(crate) amount: Option<i64>,
}

/// Body of `POST /v1/charges/{id}/void` (may be empty).
#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
pub(crate) struct VoidParams {}

/// Body of `POST /v1/refunds`.
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub(crate) struct RefundParams {
    pub(crate) charge: String,
    pub(crate) amount: i64,
    pub(crate) reference: String,
    #[serde(default, deserialize_with = "metadata")]
    pub(crate) metadata: BTreeMap<String, String>,
}

impl NewResource for RefundParams {
    fn validate(&self) -> Result<(), ApiError> {
        if self.amount <= 0 {
            return Err(ApiError::invalid(
                "amount",
                "amount must be a positive integer of minor units",
            ));
        }
        validate_reference(&self.reference)?;
        validate_metadata(&self.metadata)
    }

    /// Strings are `Debug`-quoted, so no value can forge a separator.
    fn fingerprint(&self) -> String {
        format!(
            "{:?}\u{1f}{}\u{1f}{:?}\u{1f}{:?}",
            self.charge, self.amount, self.reference, self.metadata
        )
    }

    fn reference(&self) -> &str {
        &self.reference
    }
}

fn validate_reference(reference: &str) -> Result<(), ApiError> {
    if reference.is_empty() || reference.len() > 255 {
        return Err(ApiError::invalid(
            "reference",
            "reference must be 1 to 255 bytes",
        ));
    }
    Ok(())
}

/// Reads `metadata`: absent or `null` is empty; anything but an object of
/// string values is refused with a message naming `metadata` (serde's own
/// "invalid type" message would not say which field).
fn metadata<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<BTreeMap<String, String>, D::Error> {
    let object = match Option::<Value>::deserialize(deserializer)? {
        None | Some(Value::Null) => return Ok(BTreeMap::new()),
        Some(Value::Object(object)) => object,
        Some(_) => {
            return Err(D::Error::custom(
                "metadata: must be an object of string values",
            ));
        }
    };
    object
        .into_iter()
        .map(|(key, value)| match value {
            Value::String(value) => Ok((key, value)),
            _ => Err(D::Error::custom(format!(
                "metadata: the value of {key:?} must be a string"
            ))),
        })
        .collect()
}

/// At most [`METADATA_MAX_KEYS`] keys, each entry valid.
fn validate_metadata(metadata: &BTreeMap<String, String>) -> Result<(), ApiError> {
    if metadata.len() > METADATA_MAX_KEYS {
        let message = format!("at most {METADATA_MAX_KEYS} keys");
        return Err(ApiError::invalid("metadata", &message));
    }
    metadata
        .iter()
        .try_for_each(|(key, value)| validate_metadata_entry(key, value))
}

/// A key of 1 to [`METADATA_MAX_KEY_CHARS`] characters and a value of at
/// most [`METADATA_MAX_VALUE_CHARS`]; characters, not bytes.
fn validate_metadata_entry(key: &str, value: &str) -> Result<(), ApiError> {
    let key_chars = key.chars().count();
    if key_chars == 0 || key_chars > METADATA_MAX_KEY_CHARS {
        let message = format!("keys must be 1 to {METADATA_MAX_KEY_CHARS} characters");
        return Err(ApiError::invalid("metadata", &message));
    }
    if value.chars().count() > METADATA_MAX_VALUE_CHARS {
        let message = format!("the value of {key:?} is over {METADATA_MAX_VALUE_CHARS} characters");
        return Err(ApiError::invalid("metadata", &message));
    }
    Ok(())
}

/// A page of a list holds 1 to this many objects; 10 unless `limit` says.
pub(crate) const MAX_LIST_LIMIT: usize = 100;
const DEFAULT_LIST_LIMIT: usize = 10;

/// What `GET /v1/charges` or `GET /v1/refunds` lists.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Listed {
    Charges,
    Refunds,
}

impl Listed {
    /// The parameters that make the query a list rather than a search.
    fn list_params(self) -> &'static [&'static str] {
        match self {
            Listed::Charges => &["created[gte]", "created[lte]", "limit", "starting_after"],
            Listed::Refunds => &[
                "charge",
                "created[gte]",
                "created[lte]",
                "limit",
                "starting_after",
            ],
        }
    }
}

/// The query of `GET /v1/charges` or `GET /v1/refunds`: an eventually
/// consistent search (subject to search lag) or a strongly consistent list,
/// never both, so a caller always knows which answer it got.
#[derive(Debug)]
pub(crate) enum Lookup {
    Search(SearchFilter),
    List(ListQuery),
}

impl Lookup {
    /// Parses a raw (percent-encoded) query string. Unknown parameters are
    /// refused like unknown body fields; an empty query is a search without
    /// a filter, refused as before lists existed.
    pub(crate) fn parse(query: Option<&str>, listed: Listed) -> Result<Self, ApiError> {
        let mut filter = SearchFilter::default();
        let mut list = ListQuery::default();
        let mut first_list_param = None;
        let pairs = url::form_urlencoded::parse(query.unwrap_or_default().as_bytes());
        for (name, value) in pairs {
            match listed.list_params().iter().find(|param| **param == name) {
                Some(param) => {
                    first_list_param.get_or_insert(*param);
                    list.add(param, value.into_owned())?;
                }
                None => filter.add(&name, value.into_owned())?,
            }
        }
        let searching = filter.reference.is_some() || !filter.metadata.is_empty();
        match (first_list_param, searching) {
            (Some(param), true) => Err(ApiError::invalid(
                param,
                &format!(
                    "{} ask for a list (strongly consistent), which cannot be combined with \
                     reference or metadata[KEY] (a search, subject to search lag): send one or \
                     the other",
                    listed.list_params().join(", ")
                ),
            )),
            // The refunds of one charge, or every refund created in a
            // window (the books read the whole ledger by creation time).
            (Some(_), false)
                if listed == Listed::Refunds
                    && list.charge.is_none()
                    && list.created == Created::default() =>
            {
                Err(ApiError::new(
                    StatusCode::BAD_REQUEST,
                    "invalid_request_error",
                    "parameter_missing",
                    "charge or created[gte]/created[lte]: the refund list is the refunds of one \
                     charge (charge=ch_...) or of a window of creation times",
                ))
            }
            (Some(_), false) => Ok(Lookup::List(list)),
            (None, true) => Ok(Lookup::Search(filter)),
            (None, false) => Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "parameter_missing",
                "reference or metadata[KEY]: at least one filter is required",
            )),
        }
    }
}

/// A strongly consistent list: every stored object of the caller (whatever
/// search lag hides), newest first, paged.
#[derive(Debug, Default)]
pub(crate) struct ListQuery {
    /// `created[gte]` / `created[lte]` (charges; refunds without `charge`).
    pub(crate) created: Created,
    /// `charge=ch_...` (refunds): whose refunds.
    pub(crate) charge: Option<String>,
    /// `limit`, 1 to [`MAX_LIST_LIMIT`]; see [`ListQuery::limit`].
    limit: Option<usize>,
    /// `starting_after`: the page starts after this object.
    pub(crate) starting_after: Option<String>,
}

impl ListQuery {
    /// The largest page asked for (10 unless `limit` said).
    pub(crate) fn limit(&self) -> usize {
        self.limit.unwrap_or(DEFAULT_LIST_LIMIT)
    }

    /// Adds one list parameter; each may be given once.
    fn add(&mut self, param: &str, value: String) -> Result<(), ApiError> {
        let once = || ApiError::invalid(param, "give it at most once");
        let seconds = || {
            value
                .parse::<i64>()
                .map_err(|_| ApiError::invalid(param, "must be an integer (unix seconds)"))
        };
        match param {
            "created[gte]" if self.created.gte.is_some() => return Err(once()),
            "created[gte]" => self.created.gte = Some(seconds()?),
            "created[lte]" if self.created.lte.is_some() => return Err(once()),
            "created[lte]" => self.created.lte = Some(seconds()?),
            "limit" if self.limit.is_some() => return Err(once()),
            "limit" => {
                let limit = value
                    .parse::<usize>()
                    .ok()
                    .filter(|limit| (1..=MAX_LIST_LIMIT).contains(limit))
                    .ok_or_else(|| {
                        let message = format!("must be an integer from 1 to {MAX_LIST_LIMIT}");
                        ApiError::invalid(param, &message)
                    })?;
                self.limit = Some(limit);
            }
            "starting_after" if self.starting_after.is_some() => return Err(once()),
            "starting_after" if value.is_empty() => {
                return Err(ApiError::invalid(param, "must be an id of the list"));
            }
            "starting_after" => self.starting_after = Some(value),
            "charge" if self.charge.is_some() => return Err(once()),
            "charge" if value.is_empty() => {
                return Err(ApiError::invalid(param, "must be a charge id"));
            }
            "charge" => self.charge = Some(value),
            _ => return Err(ApiError::invalid(param, "not a list parameter")),
        }
        Ok(())
    }
}

/// Inclusive bounds on an object's `created`, compared in whole unix
/// seconds (the sub-second part is ignored).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Created {
    pub(crate) gte: Option<i64>,
    pub(crate) lte: Option<i64>,
}

impl Created {
    pub(crate) fn contains(self, created: DateTime<Utc>) -> bool {
        let seconds = created.timestamp();
        self.gte.is_none_or(|gte| seconds >= gte) && self.lte.is_none_or(|lte| seconds <= lte)
    }
}

/// The query of a search by reference and/or metadata: every filter given
/// must hold.
#[derive(Debug, Default)]
pub(crate) struct SearchFilter {
    /// `reference=R`, at most once.
    pub(crate) reference: Option<String>,
    /// `metadata[KEY]=VALUE`, any number (a key given twice must match both).
    pub(crate) metadata: Vec<(String, String)>,
}

impl SearchFilter {
    /// Adds one decoded query parameter.
    fn add(&mut self, name: &str, value: String) -> Result<(), ApiError> {
        if name == "reference" {
            if self.reference.is_some() {
                return Err(ApiError::invalid("reference", "give it at most once"));
            }
            self.reference = Some(value);
            return Ok(());
        }
        let Some(rest) = name.strip_prefix("metadata") else {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "parameter_unknown",
                format!("{name}: unknown query parameter"),
            ));
        };
        let Some(key) = rest.strip_prefix('[').and_then(|r| r.strip_suffix(']')) else {
            return Err(ApiError::invalid(
                "metadata",
                "filter as metadata[KEY]=VALUE",
            ));
        };
        validate_metadata_entry(key, &value)?;
        self.metadata.push((key.to_owned(), value));
        Ok(())
    }

    /// One metadata filter (the first), for the store's metadata index.
    pub(crate) fn first_metadata(&self) -> Option<(&str, &str)> {
        self.metadata
            .first()
            .map(|(key, value)| (key.as_str(), value.as_str()))
    }

    /// Whether an object with this reference and metadata passes every filter.
    pub(crate) fn matches(&self, reference: &str, metadata: &BTreeMap<String, String>) -> bool {
        self.reference.as_deref().is_none_or(|r| r == reference)
            && self
                .metadata
                .iter()
                .all(|(key, value)| metadata.get(key) == Some(value))
    }
}

/// An error answer: `{"error":{"type","code","message"}}` with its status.
#[derive(Debug, Clone)]
pub(crate) struct ApiError {
    pub(crate) status: StatusCode,
    pub(crate) kind: &'static str,
    pub(crate) code: &'static str,
    pub(crate) message: String,
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    code: &'static str,
    message: &'a str,
}

#[derive(Serialize)]
struct ErrorEnvelope<'a> {
    error: ErrorBody<'a>,
    #[serde(skip_serializing_if = "Option::is_none")]
    charge: Option<&'a Charge>,
}

impl ApiError {
    pub(crate) fn new(
        status: StatusCode,
        kind: &'static str,
        code: &'static str,
        message: impl Into<String>,
    ) -> Self {
        Self {
            status,
            kind,
            code,
            message: message.into(),
        }
    }

    pub(crate) fn invalid(param: &str, message: &str) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "parameter_invalid",
            format!("{param}: {message}"),
        )
    }

    pub(crate) fn missing(what: &str, id: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "resource_missing",
            format!("no such {what}: {id}"),
        )
    }

    /// Maps a body that failed to parse to the parameter error it reports.
    pub(crate) fn from_json(error: &serde_json::Error) -> Self {
        let message = error.to_string();
        let code = if message.starts_with("unknown field") {
            "parameter_unknown"
        } else if message.starts_with("missing field") {
            "parameter_missing"
        } else if error.is_data() {
            "parameter_invalid"
        } else {
            "invalid_json"
        };
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            code,
            message,
        )
    }

    pub(crate) fn into_stored(self) -> StoredResponse {
        self.into_stored_with(None)
    }

    /// The error body, optionally carrying the charge (402 declines and
    /// refusals by the charge's state do).
    pub(crate) fn into_stored_with(self, charge: Option<&Charge>) -> StoredResponse {
        let envelope = ErrorEnvelope {
            error: ErrorBody {
                kind: self.kind,
                code: self.code,
                message: &self.message,
            },
            charge,
        };
        StoredResponse::json(self.status, &envelope)
    }
}

/// A complete answer, kept as bytes so that a replay is byte-for-byte the
/// first answer and costs no serialisation.
#[derive(Debug, Clone)]
pub(crate) struct StoredResponse {
    pub(crate) status: StatusCode,
    pub(crate) body: Bytes,
    /// What the answer tells the client about retrying it (Stripe's
    /// `Stripe-Should-Retry`); `None` says nothing. The fake dialect never
    /// sends it.
    pub(crate) retry: Option<bool>,
}

impl StoredResponse {
    pub(crate) fn json(status: StatusCode, value: &impl Serialize) -> Self {
        // Serialising these plain structs cannot fail; an empty object is a
        // safe fallback rather than a panic on the request path.
        let body = serde_json::to_vec(value).unwrap_or_else(|_| b"{}".to_vec());
        Self {
            status,
            body: Bytes::from(body),
            retry: None,
        }
    }

    /// The same answer with a retry hint.
    pub(crate) fn with_retry(mut self, retry: bool) -> Self {
        self.retry = Some(retry);
        self
    }

    pub(crate) fn is_server_error(&self) -> bool {
        self.status.is_server_error()
    }
}

/// Why a payment method declines: one table for both dialects, so the same
/// test card behaves the same whichever API charges it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Decline {
    /// The fake dialect's error code.
    pub(crate) code: &'static str,
    /// Stripe's `decline_code` (its error `code` is always `card_declined`).
    pub(crate) decline_code: &'static str,
    pub(crate) message: &'static str,
}

impl Decline {
    /// The soft decline a `soft_decline` fault forces: the processor could
    /// not handle the charge now; another one (or a later try) may.
    pub(crate) const TRY_AGAIN_LATER: Decline = Decline {
        code: "try_again_later",
        decline_code: "try_again_later",
        message: "The card was declined for an unknown reason; try again or use another processor.",
    };

    /// The decline a payment method always causes, if any: the fake's own
    /// test methods and Stripe's.
    pub(crate) fn of(payment_method: &str) -> Option<Self> {
        let generic = Decline {
            code: "card_declined",
            decline_code: "generic_decline",
            message: "Your card was declined.",
        };
        let insufficient = Decline {
            code: "insufficient_funds",
            decline_code: "insufficient_funds",
            message: "Your card has insufficient funds.",
        };
        match payment_method {
            "pm_card_declined" | "pm_card_chargeDeclined" => Some(generic),
            "pm_insufficient_funds" | "pm_card_chargeDeclinedInsufficientFunds" => {
                Some(insufficient)
            }
            _ => None,
        }
    }
}

/// `{"object":"list","data":[...]}`: what a search found.
#[derive(Serialize)]
pub(crate) struct List<'a, T> {
    pub(crate) object: &'static str,
    pub(crate) data: Vec<&'a T>,
}

/// `{"object":"list","data":[...],"has_more":bool}`: one page of a list.
#[derive(Serialize)]
pub(crate) struct ListPage<'a, T> {
    pub(crate) object: &'static str,
    pub(crate) data: Vec<&'a T>,
    pub(crate) has_more: bool,
}
