//! The one error type at the HTTP edge, rendered as RFC 9457 problem+json.
//!
//! Every status code here is part of the contract (docs/http-api.md §9):
//! 409 means only "the same key is still in progress, retry with it"; every
//! refusal caused by a resource's state is a 422 with its own code. 5xx
//! bodies never carry internal detail; the cause is logged once, with its
//! chain.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use cobro_store::StoreError;
use serde::Serialize;
use serde_json::{Map, Value, json};

tokio::task_local! {
    /// The request id of the request being served, for problem bodies.
    pub(crate) static REQUEST_ID: String;
}

/// One invalid field of a request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct FieldError {
    /// The field: a body member (`amount`, `metadata.<key>`), `body` for the
    /// body as a whole, or a query parameter (`wait`, `limit`...).
    #[schema(example = "amount")]
    pub field: String,
    #[schema(example = "amount must be an integer from 1 to 99999999999")]
    pub message: String,
}

impl FieldError {
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            message: message.into(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("missing or invalid bearer token")]
    Unauthenticated,
    #[error("no such resource")]
    NotFound,
    #[error("the request is invalid")]
    Validation(Vec<FieldError>),
    #[error("the request body is larger than {limit} bytes")]
    BodyTooLarge { limit: usize },
    #[error("the Idempotency-Key header is required on every POST")]
    KeyMissing,
    #[error("the Idempotency-Key header must be one value of 1 to 255 visible ASCII characters")]
    KeyInvalid,
    #[error("this Idempotency-Key was used with a different request")]
    KeyReused { idempotency_key: String },
    #[error("a request with this Idempotency-Key is still in progress; retry with the same key")]
    InProgress { idempotency_key: String },
    /// `payment_id` is the order's active payment as the refused create's
    /// own transaction read it: an id, never empty (issue 53).
    #[error("the order already has a payment that is not declined, failed or canceled")]
    OrderHasActivePayment { payment_id: cobro_core::PaymentId },
    #[error("the payment is in state {status}; only an authorized payment can be captured")]
    NotCapturable { payment_id: String, status: String },
    #[error("the payment is in state {status} and cannot be canceled")]
    NotCancelable { payment_id: String, status: String },
    #[error("the payment is in state {status}; only a captured payment can be refunded")]
    NotRefundable { payment_id: String, status: String },
    #[error("the refund would take refunds above the captured amount")]
    RefundExceedsCaptured { payment_id: String },
    /// A refund with this `reference` exists for the payment (whatever
    /// the key): the merchant's identity of a refund is never reused.
    #[error("the payment already has a refund with this reference")]
    RefundReferenceExists {
        payment_id: String,
        refund_id: String,
    },
    /// An event endpoint URL that is well formed but may not be reached:
    /// plain http, localhost, or a host with a non-public address
    /// (`cobro_core::egress`). The reason names the host and the range,
    /// never anything of cobro's own.
    #[error("the endpoint URL is not allowed: {reason}")]
    EndpointUrlNotAllowed { reason: cobro_core::egress::Refusal },
    #[error(
        "the webhook signature is missing, does not match, or its timestamp is outside the tolerance"
    )]
    WebhookSignatureInvalid,
    #[error("too many requests")]
    RateLimited,
    #[error(
        "the request was not answered within {}s; if it began executing it still completes: retry with the same Idempotency-Key",
        limit.as_secs()
    )]
    RequestTimeout { limit: std::time::Duration },
    #[error("the service is temporarily unavailable")]
    Unavailable(#[source] Option<StoreError>),
    #[error("internal error")]
    Internal(#[source] Box<dyn std::error::Error + Send + Sync>),
}

impl ApiError {
    pub fn internal(e: impl std::error::Error + Send + Sync + 'static) -> Self {
        ApiError::Internal(Box::new(e))
    }

    /// The status and the stable `code` of each variant.
    pub fn status_and_code(&self) -> (StatusCode, &'static str) {
        use ApiError as E;
        match self {
            E::Unauthenticated => (StatusCode::UNAUTHORIZED, "unauthenticated"),
            E::NotFound => (StatusCode::NOT_FOUND, "not-found"),
            E::Validation(_) => (StatusCode::BAD_REQUEST, "validation-error"),
            E::BodyTooLarge { .. } => (StatusCode::PAYLOAD_TOO_LARGE, "body-too-large"),
            E::KeyMissing => (StatusCode::BAD_REQUEST, "idempotency-key-missing"),
            E::KeyInvalid => (StatusCode::BAD_REQUEST, "idempotency-key-invalid"),
            E::KeyReused { .. } => (StatusCode::UNPROCESSABLE_ENTITY, "idempotency-key-reused"),
            E::InProgress { .. } => (StatusCode::CONFLICT, "idempotency-request-in-progress"),
            E::OrderHasActivePayment { .. } => {
                (StatusCode::UNPROCESSABLE_ENTITY, "order-has-active-payment")
            }
            E::NotCapturable { .. } => (StatusCode::UNPROCESSABLE_ENTITY, "payment-not-capturable"),
            E::NotCancelable { .. } => (StatusCode::UNPROCESSABLE_ENTITY, "payment-not-cancelable"),
            E::NotRefundable { .. } => (StatusCode::UNPROCESSABLE_ENTITY, "payment-not-refundable"),
            E::RefundExceedsCaptured { .. } => {
                (StatusCode::UNPROCESSABLE_ENTITY, "refund-exceeds-captured")
            }
            E::RefundReferenceExists { .. } => (StatusCode::CONFLICT, "refund-reference-exists"),
            E::EndpointUrlNotAllowed { .. } => {
                (StatusCode::UNPROCESSABLE_ENTITY, "endpoint-url-not-allowed")
            }
            E::WebhookSignatureInvalid => (StatusCode::BAD_REQUEST, "webhook-signature-invalid"),
            E::RateLimited => (StatusCode::TOO_MANY_REQUESTS, "rate-limited"),
            E::RequestTimeout { .. } => (StatusCode::REQUEST_TIMEOUT, "request-timeout"),
            E::Unavailable(_) => (StatusCode::SERVICE_UNAVAILABLE, "service-unavailable"),
            E::Internal(_) => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
        }
    }

    fn title(&self) -> &'static str {
        use ApiError as E;
        match self {
            E::Unauthenticated => "Unauthenticated",
            E::NotFound => "Not found",
            E::Validation(_) => "Invalid request",
            E::BodyTooLarge { .. } => "Body too large",
            E::KeyMissing => "Idempotency-Key missing",
            E::KeyInvalid => "Idempotency-Key invalid",
            E::KeyReused { .. } => "Idempotency-Key reused with a different request",
            E::InProgress { .. } => "Request with this Idempotency-Key in progress",
            E::OrderHasActivePayment { .. } => "Order has an active payment",
            E::NotCapturable { .. } => "Payment not capturable",
            E::NotCancelable { .. } => "Payment not cancelable",
            E::NotRefundable { .. } => "Payment not refundable",
            E::RefundExceedsCaptured { .. } => "Refund exceeds the captured amount",
            E::RefundReferenceExists { .. } => "Refund reference exists",
            E::EndpointUrlNotAllowed { .. } => "Endpoint URL not allowed",
            E::WebhookSignatureInvalid => "Webhook signature invalid",
            E::RateLimited => "Rate limited",
            E::RequestTimeout { .. } => "Request timeout",
            E::Unavailable(_) => "Service unavailable",
            E::Internal(_) => "Internal error",
        }
    }

    /// The problem+json body (without `request_id`, which the response adds).
    pub fn problem(&self) -> Map<String, Value> {
        let (status, code) = self.status_and_code();
        let mut body = Map::new();
        body.insert("type".into(), json!(format!("/problems/{code}")));
        body.insert("title".into(), json!(self.title()));
        body.insert("status".into(), json!(status.as_u16()));
        // 5xx details stay in the log, never in the body.
        let detail = if status.is_server_error() {
            "The request could not be completed; it is safe to retry with the same Idempotency-Key."
                .to_owned()
        } else {
            self.to_string()
        };
        body.insert("detail".into(), json!(detail));
        body.insert("code".into(), json!(code));
        match self {
            ApiError::Validation(errors) => {
                body.insert("errors".into(), json!(errors));
            }
            // Shaped like a validation error's list, so a client that shows
            // `errors` next to the form's fields shows this one too.
            ApiError::EndpointUrlNotAllowed { reason } => {
                body.insert(
                    "errors".into(),
                    json!([FieldError::new("url", reason.to_string())]),
                );
            }
            ApiError::OrderHasActivePayment { payment_id } => {
                body.insert("payment_id".into(), json!(payment_id.to_string()));
            }
            ApiError::NotCapturable { payment_id, .. }
            | ApiError::NotCancelable { payment_id, .. }
            | ApiError::NotRefundable { payment_id, .. }
            | ApiError::RefundExceedsCaptured { payment_id } => {
                body.insert("payment_id".into(), json!(payment_id));
            }
            ApiError::RefundReferenceExists {
                payment_id,
                refund_id,
            } => {
                body.insert("payment_id".into(), json!(payment_id));
                body.insert("refund_id".into(), json!(refund_id));
            }
            // The key the client sent (valid, so short and visible ASCII);
            // an invalid key is never echoed, in the body or a header.
            ApiError::KeyReused { idempotency_key } | ApiError::InProgress { idempotency_key } => {
                body.insert("idempotency_key".into(), json!(idempotency_key));
            }
            _ => {}
        }
        body
    }

    /// The problem body as bytes, ready to be stored against a key.
    pub fn problem_bytes(&self) -> Vec<u8> {
        let mut body = self.problem();
        if let Ok(id) = REQUEST_ID.try_with(Clone::clone) {
            body.insert("request_id".into(), json!(id));
        }
        serde_json::to_vec(&body).unwrap_or_default()
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        match e {
            // A lock wait that timed out outside the key reservation (e.g. a
            // payment row held by a concurrent request with another key):
            // retryable, but not "this key is in progress", which is what
            // 409 must only ever mean. `keyed::begin` maps the reservation's
            // own timeout to 409.
            StoreError::Busy => ApiError::Unavailable(Some(e)),
            StoreError::Unavailable(_) => ApiError::Unavailable(Some(e)),
            other => ApiError::internal(other),
        }
    }
}

pub(crate) fn problem_response(status: StatusCode, body: Vec<u8>) -> Response {
    let mut response = (status, body).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    response
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, code) = self.status_and_code();
        if status.is_server_error() {
            // Log the cause once, with its chain; the body says nothing of it.
            let mut chain = String::new();
            let mut source = std::error::Error::source(&self);
            while let Some(s) = source {
                chain.push_str(": ");
                chain.push_str(&s.to_string());
                source = s.source();
            }
            tracing::error!(code, error = %self, cause = %chain, "request failed");
        }
        // Counted where every answer of these kinds is rendered.
        match self {
            ApiError::KeyReused { .. } => cobro_telemetry::metrics::key_reused(),
            ApiError::InProgress { .. } => cobro_telemetry::metrics::in_progress(),
            _ => {}
        }
        let mut response = problem_response(status, self.problem_bytes());
        if matches!(self, ApiError::Unauthenticated) {
            // The same challenge whatever was sent (RFC 6750 section 3),
            // so a 401 says nothing about the token.
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"cobro\""),
            );
        }
        if matches!(
            self,
            ApiError::InProgress { .. } | ApiError::Unavailable(_) | ApiError::RateLimited
        ) {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every variant's status and code, pinned: these are the contract.
    #[test]
    fn every_variant_has_its_documented_status_and_code() {
        let id = || "p".to_owned();
        let st = || "processing".to_owned();
        let table: Vec<(ApiError, u16, &str)> = vec![
            (ApiError::Unauthenticated, 401, "unauthenticated"),
            (ApiError::NotFound, 404, "not-found"),
            (ApiError::Validation(vec![]), 400, "validation-error"),
            (ApiError::BodyTooLarge { limit: 1 }, 413, "body-too-large"),
            (ApiError::KeyMissing, 400, "idempotency-key-missing"),
            (ApiError::KeyInvalid, 400, "idempotency-key-invalid"),
            (
                ApiError::KeyReused {
                    idempotency_key: "k".into(),
                },
                422,
                "idempotency-key-reused",
            ),
            (
                ApiError::InProgress {
                    idempotency_key: "k".into(),
                },
                409,
                "idempotency-request-in-progress",
            ),
            (
                ApiError::OrderHasActivePayment {
                    payment_id: cobro_core::PaymentId::new(),
                },
                422,
                "order-has-active-payment",
            ),
            (
                ApiError::NotCapturable {
                    payment_id: id(),
                    status: st(),
                },
                422,
                "payment-not-capturable",
            ),
            (
                ApiError::NotCancelable {
                    payment_id: id(),
                    status: st(),
                },
                422,
                "payment-not-cancelable",
            ),
            (
                ApiError::NotRefundable {
                    payment_id: id(),
                    status: st(),
                },
                422,
                "payment-not-refundable",
            ),
            (
                ApiError::RefundExceedsCaptured { payment_id: id() },
                422,
                "refund-exceeds-captured",
            ),
            (
                ApiError::RefundReferenceExists {
                    payment_id: id(),
                    refund_id: id(),
                },
                409,
                "refund-reference-exists",
            ),
            (
                ApiError::EndpointUrlNotAllowed {
                    reason: cobro_core::egress::Refusal::PlainHttp,
                },
                422,
                "endpoint-url-not-allowed",
            ),
            (
                ApiError::WebhookSignatureInvalid,
                400,
                "webhook-signature-invalid",
            ),
            (ApiError::RateLimited, 429, "rate-limited"),
            (
                ApiError::RequestTimeout {
                    limit: std::time::Duration::from_secs(1),
                },
                408,
                "request-timeout",
            ),
            (ApiError::Unavailable(None), 503, "service-unavailable"),
            (
                ApiError::internal(std::io::Error::other("secret detail")),
                500,
                "internal",
            ),
        ];
        for (error, status, code) in table {
            assert_eq!(
                error.status_and_code(),
                (StatusCode::from_u16(status).expect("status"), code)
            );
            let body = error.problem();
            assert_eq!(body["type"], json!(format!("/problems/{code}")));
            assert_eq!(body["code"], json!(code));
            assert_eq!(body["status"], json!(status));
        }
    }

    #[test]
    fn server_errors_carry_no_internal_detail() {
        let body = ApiError::internal(std::io::Error::other("password=hunter2")).problem();
        assert!(
            !serde_json::to_string(&body)
                .expect("json")
                .contains("hunter2")
        );
    }
}
