//! Provider resources, request bodies and error bodies, as they go on the wire.

use axum::body::Bytes;
use axum::http::StatusCode;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

/// Lifecycle of a charge.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ChargeStatus {
    /// Funds held, not yet captured.
    Authorized,
    /// Funds taken (fully or partly, see `amount_captured`).
    Captured,
    /// Refused by the payment method; no money moved.
    Declined,
    /// Authorisation released.
    Voided,
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
    /// The merchant's reference; what search and the ledger key on.
    pub reference: String,
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
}

/// Lifecycle of a refund; this provider's refunds succeed at once.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum RefundStatus {
    /// Money returned.
    Succeeded,
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
    /// The merchant's reference of this refund.
    pub reference: String,
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
        validate_reference(&self.reference)
    }

    fn fingerprint(&self) -> String {
        format!(
            "{}\u{1f}{}\u{1f}{}\u{1f}{}\u{1f}{}",
            self.amount, self.currency, self.payment_method, self.capture, self.reference
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
}

impl NewResource for RefundParams {
    fn validate(&self) -> Result<(), ApiError> {
        if self.amount <= 0 {
            return Err(ApiError::invalid(
                "amount",
                "amount must be a positive integer of minor units",
            ));
        }
        validate_reference(&self.reference)
    }

    fn fingerprint(&self) -> String {
        format!(
            "{}\u{1f}{}\u{1f}{}",
            self.charge, self.amount, self.reference
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

    /// The error body, optionally carrying the charge (402 declines do).
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
}

impl StoredResponse {
    pub(crate) fn json(status: StatusCode, value: &impl Serialize) -> Self {
        // Serialising these plain structs cannot fail; an empty object is a
        // safe fallback rather than a panic on the request path.
        let body = serde_json::to_vec(value).unwrap_or_else(|_| b"{}".to_vec());
        Self {
            status,
            body: Bytes::from(body),
        }
    }

    pub(crate) fn is_server_error(&self) -> bool {
        self.status.is_server_error()
    }
}

/// `{"object":"list","data":[...]}`.
#[derive(Serialize)]
pub(crate) struct List<'a, T> {
    pub(crate) object: &'static str,
    pub(crate) data: Vec<&'a T>,
}
