//! Stripe's error object: `{"error": {"type", "code", "decline_code",
//! "message", "param", "doc_url", "charge", "payment_intent"}}`, with only
//! the fields that apply to each error.

use axum::http::StatusCode;
use serde::Serialize;
use serde_json::Value;

use crate::model::{Decline, StoredResponse};

/// One Stripe error answer, built by the constructors below (boxed: errors
/// are rare and `Result`s carrying them stay small).
#[derive(Debug, Clone)]
pub(crate) struct StripeError(Box<Detail>);

#[derive(Debug, Clone)]
struct Detail {
    status: StatusCode,
    kind: &'static str,
    code: Option<&'static str>,
    decline_code: Option<&'static str>,
    message: String,
    param: Option<String>,
    charge: Option<String>,
    payment_intent: Option<Value>,
}

#[derive(Serialize)]
struct Envelope<'a> {
    error: Body<'a>,
}

#[derive(Serialize)]
struct Body<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    code: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    decline_code: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    doc_url: Option<String>,
    message: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    param: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    charge: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    payment_intent: Option<&'a Value>,
}

impl StripeError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self(Box::new(Detail {
            status,
            kind,
            code: None,
            decline_code: None,
            message: message.into(),
            param: None,
            charge: None,
            payment_intent: None,
        }))
    }

    fn invalid_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    fn code(mut self, code: &'static str) -> Self {
        self.0.code = Some(code);
        self
    }

    fn param(mut self, param: impl Into<String>) -> Self {
        self.0.param = Some(param.into());
        self
    }

    /// The error carries the PaymentIntent as it is now (declines and
    /// refusals by the PaymentIntent's status do).
    pub(crate) fn with_intent(mut self, intent: Value) -> Self {
        self.0.payment_intent = Some(intent);
        self
    }

    /// 401 for a missing or non-test key. Stripe types it
    /// `invalid_request_error`; the status says it is about authentication.
    pub(crate) fn unauthenticated() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            "Invalid API Key provided. Send a test secret key: Authorization: Bearer sk_test_...",
        )
    }

    pub(crate) fn invalid_idempotency_key() -> Self {
        Self::invalid_request(
            "Keys for idempotent requests must be 1 to 255 characters long (visible ASCII).",
        )
    }

    /// A 500, nothing internal said.
    pub(crate) fn api_error(message: &str) -> Self {
        let message = format!("An unknown error occurred ({message}).");
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "api_error", message)
    }

    pub(crate) fn key_in_use() -> Self {
        Self::new(
            StatusCode::CONFLICT,
            "invalid_request_error",
            "There is currently another in-progress request using this idempotency key. \
             Please try again later.",
        )
        .code("idempotency_key_in_use")
    }

    /// Same key, other parameters. Stripe sends no `code` with it: the
    /// `type` is the signal.
    pub(crate) fn key_mismatch(key: &str) -> Self {
        let message = format!(
            "Keys for idempotent requests can only be used with the same parameters they were \
             first used with. Try using a key other than '{key}' if you meant to execute a \
             different request."
        );
        Self::new(StatusCode::BAD_REQUEST, "idempotency_error", message)
    }

    pub(crate) fn rate_limited() -> Self {
        Self::new(
            StatusCode::TOO_MANY_REQUESTS,
            "invalid_request_error",
            "Request rate limit exceeded (injected fault: rate_limit).",
        )
        .code("rate_limit")
    }

    pub(crate) fn missing_param(param: &str) -> Self {
        Self::invalid_request(format!("Missing required param: {param}."))
            .code("parameter_missing")
            .param(param)
    }

    pub(crate) fn unknown_param(param: &str) -> Self {
        Self::invalid_request(format!("Received unknown parameter: {param}"))
            .code("parameter_unknown")
            .param(param)
    }

    pub(crate) fn invalid_integer(param: &str, message: impl Into<String>) -> Self {
        Self::invalid_request(message)
            .code("parameter_invalid_integer")
            .param(param)
    }

    pub(crate) fn empty_string(param: &str) -> Self {
        let message = format!(
            "You passed an empty string for '{param}'. We assume empty values are an attempt to \
             unset a parameter; however '{param}' cannot be unset. You should remove '{param}' \
             from your request or supply a non-empty value."
        );
        Self::invalid_request(message)
            .code("parameter_invalid_empty")
            .param(param)
    }

    /// A bad value Stripe names no code for: the `param` says which.
    pub(crate) fn invalid(param: &str, message: impl Into<String>) -> Self {
        Self::invalid_request(message).param(param)
    }

    /// A body or query that is not a form at all.
    pub(crate) fn malformed(message: impl Into<String>) -> Self {
        Self::invalid_request(message)
    }

    /// `No such <what>: '<id>'`: 404 for the object of the path, and for
    /// the object a parameter names.
    pub(crate) fn no_such(what: &str, id: &str, param: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("No such {what}: '{id}'"),
        )
        .code("resource_missing")
        .param(param)
    }

    /// 400 with one of Stripe's codes (`amount_too_large`,
    /// `charge_already_refunded`, ...).
    pub(crate) fn refused(code: &'static str, message: impl Into<String>) -> Self {
        Self::invalid_request(message).code(code)
    }

    /// 400 `payment_intent_unexpected_state`, carrying the PaymentIntent.
    pub(crate) fn unexpected_state(message: impl Into<String>, intent: Value) -> Self {
        Self::invalid_request(message)
            .code("payment_intent_unexpected_state")
            .with_intent(intent)
    }

    /// 402 `card_error` / `card_declined` with the decline code, the failed
    /// charge and the PaymentIntent.
    pub(crate) fn declined(decline: Decline, charge: &str, intent: Value) -> Self {
        let mut error = Self::new(StatusCode::PAYMENT_REQUIRED, "card_error", decline.message)
            .code("card_declined")
            .with_intent(intent);
        error.0.decline_code = Some(decline.decline_code);
        error.0.charge = Some(charge.to_owned());
        error
    }

    pub(crate) fn with_param(self, param: &str) -> Self {
        self.param(param)
    }

    /// The same error as a 400 (a parameter naming an object the fake has
    /// no such thing as, e.g. a payment method that is not `pm_...`).
    pub(crate) fn into_bad_request(mut self) -> Self {
        self.0.status = StatusCode::BAD_REQUEST;
        self
    }

    pub(crate) fn is_code(&self, code: &str) -> bool {
        self.0.code == Some(code)
    }

    pub(crate) fn into_stored(self) -> StoredResponse {
        let detail = *self.0;
        let envelope = Envelope {
            error: Body {
                kind: detail.kind,
                code: detail.code,
                decline_code: detail.decline_code,
                doc_url: detail.code.map(|code| {
                    format!(
                        "https://stripe.com/docs/error-codes/{}",
                        code.replace('_', "-")
                    )
                }),
                message: &detail.message,
                param: detail.param.as_deref(),
                charge: detail.charge.as_deref(),
                payment_intent: detail.payment_intent.as_ref(),
            },
        };
        StoredResponse::json(detail.status, &envelope)
    }
}
