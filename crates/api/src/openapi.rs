//! `/openapi.json`: the machine-readable contract (payments-api.md), an
//! OpenAPI 3.1 document generated with utoipa from the code.
//!
//! Layout:
//! - [`ApiDoc`]: the derive that collects the paths, the schemas and the tags.
//! - `paths`: one documentation stub per route with its `#[utoipa::path]`:
//!   method, path, parameters, request body and success answers. The
//!   handlers themselves live in `payments.rs` and `health.rs`.
//! - `schemas`: request bodies and shapes that exist in the code only as
//!   parsing logic (the API reads bodies field by field to report every
//!   invalid field at once), plus named schemas built from the domain's own
//!   lists (`PaymentStatus::ALL`, the known currencies, `Amount::MAX`).
//! - [`Contract`]: what every operation shares, added in one place so no
//!   operation can forget it: the bearer scheme, `X-Request-Id`, the
//!   `Idempotency-Key` parameter and its response headers, and the problem
//!   answers of each operation built from [`ApiError`] itself (status, code,
//!   title and an example body all come from `ApiError::problem`).
//!
//! The base document is built once; each request only fills in the
//! retention the server actually runs with.

use crate::error::{ApiError, FieldError};
use crate::{ApiSettings, AppState};
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use axum::{Json, Router};
use cobro_core::{
    Amount, AttemptState, CaptureMethod, Currency, IdempotencyKey, Operation, PaymentStatus,
    RefundStatus,
};
use serde_json::{Value, json};
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::OnceLock;
use std::time::Duration;
use utoipa::openapi::example::ExampleBuilder;
use utoipa::openapi::header::{Header, HeaderBuilder};
use utoipa::openapi::path::{Operation as PathOperation, ParameterBuilder, ParameterIn};
use utoipa::openapi::response::ResponseBuilder;
use utoipa::openapi::schema::{AllOfBuilder, ObjectBuilder, Schema, Type};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityRequirement, SecurityScheme};
use utoipa::openapi::{Components, Content, OpenApi as Document, Ref, RefOr, Required};
use utoipa::{Modify, OpenApi};

pub(crate) fn routes() -> Router<AppState> {
    Router::new().route("/openapi.json", get(serve))
}

async fn serve(State(state): State<AppState>) -> Json<Document> {
    Json(document(&state.settings))
}

/// The document as served by a server running with `settings` (the
/// retention is part of the contract).
pub fn document(settings: &ApiSettings) -> Document {
    static BASE: OnceLock<Document> = OnceLock::new();
    let mut document = BASE.get_or_init(ApiDoc::openapi).clone();
    document.info.description = Some(info_description(settings));
    document
}

#[derive(OpenApi)]
#[openapi(
    info(
        title = "cobro payments API",
        description = "Set at runtime from `info_description`.",
    ),
    paths(
        paths::create_payment,
        paths::list_payments,
        paths::get_payment,
        paths::capture_payment,
        paths::cancel_payment,
        paths::create_refund,
        paths::get_refund,
        paths::healthz,
        paths::readyz,
        paths::metrics,
        paths::openapi_json,
        paths::receive_webhook,
        paths::list_events,
        paths::get_event,
        paths::create_event_endpoint,
        paths::list_event_endpoints,
        paths::delete_event_endpoint,
        paths::rotate_event_endpoint_secret,
    ),
    components(schemas(
        schemas::CreatePaymentRequest,
        schemas::CreateRefundRequest,
        schemas::EmptyBody,
        schemas::PaymentList,
        schemas::Problem,
        schemas::HealthStatus,
        schemas::WebhookEvent,
        schemas::WebhookReceipt,
        schemas::Event,
        schemas::EventList,
        schemas::EventEndpoint,
        schemas::EventEndpointList,
        schemas::CreateEventEndpointRequest,
        EventTypeSchema,
        crate::views::PaymentView,
        crate::views::RefundView,
        crate::views::AttemptView,
        crate::views::Failure,
        FieldError,
        PaymentStatusSchema,
        RefundStatusSchema,
        AttemptStateSchema,
        CaptureMethodSchema,
        OperationSchema,
        CurrencySchema,
        CurrencyInputSchema,
        EndpointUrlSchema,
        AmountSchema,
        ProblemCodeSchema,
    )),
    tags(
        (name = "payments", description = "Authorise, read, list, capture and cancel payments."),
        (name = "refunds", description = "Refund captured payments."),
        (name = "operations", description = "Health, readiness and this document: no authentication, no idempotency."),
        (name = "webhooks", description = "Events from the payment provider: authenticated by their signature, deduplicated by event id."),
        (name = "events", description = "Events to merchants. Every status change of a payment or refund (and conflicting evidence found about a payment) is an `Event`, written in the transaction of the change. They are pushed to the account's endpoints (POST, JSON body = the `Event`, at least once: deduplicate by `id`, apply by `sequence`) with the header `Cobro-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, \"<t>.<raw body>\")>` (one `v1` per valid secret while a secret is rotated; refuse a `t` more than 5 minutes away), plus `Cobro-Event-Id` and `Cobro-Event-Type`. Any 2xx within 10 s is delivered; anything else is retried with capped exponential backoff and jitter for 3 days from the first attempt, then the delivery is dead (operators replay it). An endpoint failing every attempt for 3 days is disabled with a reason. They can also be pulled: `GET /v1/events?after=<position>` yields every later event, with no gap, from any position. Events are kept at least as long as deliveries are retried (today: not purged)."),
    ),
    modifiers(&Contract),
)]
struct ApiDoc;

/// `info.description`: the idempotency contract and the retention, with the
/// retention this server actually applies.
fn info_description(settings: &ApiSettings) -> String {
    let retention = human(settings.idempotency_retention);
    let tombstones = human(settings.tombstone_retention);
    format!(
        "cobro is a payment orchestration service. Every money-moving request is a POST \
that carries an `Idempotency-Key`, so a client can retry it after any failure (timeout, \
lost connection, 409, 5xx) without moving money twice.

## Authentication

`Authorization: Bearer <token>` on every `/v1` endpoint. A missing or unknown token \
answers 401 `unauthenticated`, the same whether or not the resource exists. A payment \
of another account answers 404, exactly like one that does not exist.

## The Idempotency-Key

- Required on every POST (400 `idempotency-key-missing` without it).
- 1 to {max_key} visible ASCII characters (`%x21-7E`). The bare form (`abc-123`, as \
Stripe clients send it) and the structured-field string form (`\"abc-123\"`) are the same \
key. More than one header line or any other value: 400 `idempotency-key-invalid`.
- Generate a random UUID when the intent is created (the user clicks pay, the job \
creates the charge), persist it with the intent before the first send, and reuse it for \
every retry of that intent. Keys made only of a time, a client id or an attempt number \
are a client bug: two different intents would share a key, or one intent would get two.
- Keys are scoped by (account, operation, key): the same key under another account or \
for another operation is unrelated.

## Fingerprint

The key is bound to a SHA-256 fingerprint of the operation, the contract version, the \
path parameters and every accepted body field after validation and normalisation \
(defaults applied, currency upper-cased). JSON property order and whitespace do not \
change it; headers (User-Agent, X-Request-Id, traceparent...) are never part of it. \
Unknown body fields are refused (400), so they can never differ silently.

## What a POST with a key answers

| state of (account, operation, key) | answer |
|---|---|
| new | executed in one transaction (key + business rows + outbox + stored answer), committed, then answered with `Idempotent-Replayed: false` |
| held by a request whose transaction has not committed | wait up to about 2 s; then the committed answer, or execution if it rolled back, or 409 `idempotency-request-in-progress` with `Retry-After: 1` |
| completed, same fingerprint | the stored status and body, byte for byte, with `Idempotent-Replayed: true` |
| completed or tombstone, different fingerprint | 422 `idempotency-key-reused`; nothing executed or changed (never 409: SDKs retry 409) |
| tombstone, same fingerprint, 2xx | the original status with the resource's current representation, `Idempotent-Replayed: true` |
| tombstone, same fingerprint, refusal | the original status with a `refusal-compacted` problem, `Idempotent-Replayed: true` |

Every answer to a POST that carried exactly one `Idempotency-Key` line echoes it.

Stored against the key: 2xx answers and the final refusals decided inside the \
transaction (`payment-not-capturable`, `payment-not-cancelable`, \
`payment-not-refundable`, `refund-exceeds-captured`). Not stored, so the key stays free \
to correct and retry: `order-has-active-payment`, 401, 400, 404, 413, 409, 503, 500 and \
every transaction that rolled back.

## Retention

Full records (with the stored answer) are kept {retention}, then compacted to \
tombstones (scope, key, fingerprint, status, resource id) kept a further {tombstones}; \
after that the key is new again (the one-active-payment-per-order rule still holds). \
The purge runs on a schedule, in small batches, and never removes a record younger than \
its retention.

## Errors

`application/problem+json` (RFC 9457) with `type` `/problems/<code>`, `title`, \
`status`, `detail`, `code`, `request_id`, and `payment_id` / `errors` / `idempotency_key` \
where relevant. \
409 only ever means \"this same key is still in progress: retry with it\"; every refusal \
caused by a resource's state is a 422 with its own code. 5xx bodies carry no internal \
detail. Each account has a request rate limit (per process); over it the answer is \
429 `rate-limited` with `Retry-After`, decided before anything else and never stored against a key.",
        max_key = IdempotencyKey::MAX_LEN,
    )
}

/// `86400s` -> `24 h`, `30 days` for whole days above two, else seconds.
fn human(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        _ if s >= 2 * 86_400 && s.is_multiple_of(86_400) => format!("{} days", s / 86_400),
        _ if s >= 3_600 && s.is_multiple_of(3_600) => format!("{} h", s / 3_600),
        _ if s >= 60 && s.is_multiple_of(60) => format!("{} min", s / 60),
        _ => format!("{s} s"),
    }
}

/// Documentation stubs: one per route, describing exactly what the handler
/// in `payments.rs` / `health.rs` does. Never called.
#[allow(dead_code)]
mod paths {
    use super::schemas::{
        CreateEventEndpointRequest, CreatePaymentRequest, CreateRefundRequest, EmptyBody, Event,
        EventEndpoint, EventEndpointList, EventList, HealthStatus, PaymentList, WebhookEvent,
        WebhookReceipt,
    };
    use super::{EventTypeSchema, PaymentStatusSchema};
    use crate::views::{PaymentView, RefundView};

    /// Create (authorise) a payment
    ///
    /// Operation `payment.authorize`. Creates the payment in `processing`, its
    /// intent `{order_ref}:authorize-v{n}` and the first provider attempt, in
    /// one transaction with the idempotency record; the provider is called
    /// afterwards, by the worker. At most one payment per order that is not
    /// `declined`, `failed` or `canceled`.
    #[utoipa::path(
        post,
        path = "/v1/payments",
        operation_id = "createPayment",
        tag = "payments",
        request_body(
            content = CreatePaymentRequest,
            content_type = "application/json",
            description = "At most 16 KiB. Unknown fields are refused.",
        ),
        responses(
            (status = 201, description = "Created: the payment in `processing` (with its first attempt). Replays answer the same status; a replay of a tombstone answers the payment as it is now.",
                body = PaymentView,
                headers(("Location" = String, description = "`/v1/payments/{id}` of the payment, on the first answer and on replays."))),
        ),
    )]
    pub fn create_payment() {}

    /// List payments
    ///
    /// Newest first, cursor pagination. List answers omit `attempts` (one
    /// query per page, not per payment).
    #[utoipa::path(
        get,
        path = "/v1/payments",
        operation_id = "listPayments",
        tag = "payments",
        params(
            ("order_ref" = Option<String>, Query, pattern = r"^[^\u0000]*$", description = "Only payments of this order (exact match); no U+0000."),
            ("status" = Option<PaymentStatusSchema>, Query, description = "Only payments in this status."),
            ("limit" = Option<u32>, Query, minimum = 1, maximum = 100, description = "Page size, 1 to 100; default 20."),
            ("cursor" = Option<String>, Query, format = Uuid, description = "`next_cursor` of the previous page: answers the next (older) page."),
        ),
        responses(
            (status = 200, description = "A page of payments, newest first.", body = PaymentList),
        ),
    )]
    pub fn list_payments() {}

    /// Read a payment
    ///
    /// With `?wait=N` the answer is held until the payment leaves
    /// `processing` or N seconds pass, whichever is first; then the payment
    /// as it is (possibly still `processing`).
    #[utoipa::path(
        get,
        path = "/v1/payments/{id}",
        operation_id = "getPayment",
        tag = "payments",
        params(
            ("id" = String, Path, format = Uuid, description = "The payment id. An id that is not a UUID, or of another account, answers 404."),
            ("wait" = Option<u64>, Query, minimum = 0, maximum = 30, description = "Long poll: seconds (0 to 30) to wait for the payment to leave `processing`."),
        ),
        responses(
            (status = 200, description = "The payment, with its attempts.", body = PaymentView),
        ),
    )]
    pub fn get_payment() {}

    /// Capture an authorised payment
    ///
    /// Operation `payment.capture`, for `manual` capture payments in
    /// `authorized`: moves it to `capturing` and enqueues the capture
    /// attempt (intent `{order_ref}:capture-v{n}`). Captures the whole
    /// authorised amount.
    #[utoipa::path(
        post,
        path = "/v1/payments/{id}/capture",
        operation_id = "capturePayment",
        tag = "payments",
        params(("id" = String, Path, format = Uuid, description = "The payment id.")),
        request_body(content = EmptyBody, content_type = "application/json",
            description = "Empty, or `{}`. Any field is refused."),
        responses(
            (status = 202, description = "Accepted: the payment in `capturing`, without `attempts`.", body = PaymentView),
        ),
    )]
    pub fn capture_payment() {}

    /// Cancel (void) a payment
    ///
    /// Operation `payment.cancel`, for `manual` capture payments only. An
    /// `authorized` payment moves to `canceling` and a void attempt is
    /// enqueued (intent `{order_ref}:cancel-v{n}`). A payment whose
    /// authorisation outcome is not known yet (`processing`,
    /// `requires_reconciliation`, `needs_review`) keeps its status: the
    /// request is recorded (`cancel_requested: true`) and carried out once
    /// the outcome is known, never as a second incompatible decision.
    /// Automatic-capture payments move money at authorisation: they are
    /// refused with 422 `payment-not-cancelable`; refund them instead.
    #[utoipa::path(
        post,
        path = "/v1/payments/{id}/cancel",
        operation_id = "cancelPayment",
        tag = "payments",
        params(("id" = String, Path, format = Uuid, description = "The payment id.")),
        request_body(content = EmptyBody, content_type = "application/json",
            description = "Empty, or `{}`. Any field is refused."),
        responses(
            (status = 202, description = "Accepted: the payment in `canceling`, or in its pending status with `cancel_requested: true`; without `attempts`.", body = PaymentView),
        ),
    )]
    pub fn cancel_payment() {}

    /// Refund a captured payment
    ///
    /// Operation `refund.create`, for payments in `captured` or
    /// `partially_refunded`. Creates the refund in `processing` (intent
    /// `{order_ref}:refund-v{n}`) and its attempt. The sum of refunds that
    /// are not failed never exceeds the captured amount, also under
    /// concurrent refunds with different keys.
    #[utoipa::path(
        post,
        path = "/v1/payments/{id}/refunds",
        operation_id = "createRefund",
        tag = "refunds",
        params(("id" = String, Path, format = Uuid, description = "The payment id.")),
        request_body(content = CreateRefundRequest, content_type = "application/json",
            description = "At most 16 KiB. Unknown fields are refused."),
        responses(
            (status = 201, description = "Created: the refund in `processing`. A replay of a tombstone answers the refund as it is now.",
                body = RefundView,
                headers(("Location" = String, description = "`/v1/payments/{id}/refunds/{refund_id}`. Sent on the first answer only: replays of a refund do not carry it."))),
        ),
    )]
    pub fn create_refund() {}

    /// Read a refund
    #[utoipa::path(
        get,
        path = "/v1/payments/{id}/refunds/{refund_id}",
        operation_id = "getRefund",
        tag = "refunds",
        params(
            ("id" = String, Path, format = Uuid, description = "The payment id."),
            ("refund_id" = String, Path, format = Uuid, description = "The refund id; a refund of another payment answers 404."),
        ),
        responses((status = 200, description = "The refund.", body = RefundView)),
    )]
    pub fn get_refund() {}

    /// Liveness
    ///
    /// The process is up; says nothing about its dependencies.
    #[utoipa::path(
        get,
        path = "/healthz",
        operation_id = "healthz",
        tag = "operations",
        responses((status = 200, description = "Up.", body = HealthStatus,
            example = json!({"status": "ok"}))),
    )]
    pub fn healthz() {}

    /// Readiness
    ///
    /// Ready to serve: the database answers. Fails while it is unreachable,
    /// so a load balancer stops sending traffic that could not be recorded.
    #[utoipa::path(
        get,
        path = "/readyz",
        operation_id = "readyz",
        tag = "operations",
        responses(
            (status = 200, description = "Ready.", body = HealthStatus,
                example = json!({"status": "ready"})),
            (status = 503, description = "The database is unreachable.", body = HealthStatus,
                example = json!({"status": "unavailable", "database": "unreachable"})),
        ),
    )]
    pub fn readyz() {}

    /// Metrics
    ///
    /// Prometheus text: payments per unsettled status
    /// (`cobro_payments_unsettled{status}`) and the age of the oldest one in
    /// each (`cobro_payments_oldest_unsettled_seconds{status}`). No token.
    #[utoipa::path(
        get,
        path = "/metrics",
        operation_id = "metrics",
        tag = "operations",
        responses(
            (status = 200, description = "Prometheus text exposition format.", content_type = "text/plain", body = String),
            (status = 503, description = "The database is unreachable.", content_type = "text/plain", body = String),
        ),
    )]
    pub fn metrics() {}

    /// This document
    #[utoipa::path(
        get,
        path = "/openapi.json",
        operation_id = "openapi",
        tag = "operations",
        responses((status = 200, description = "The OpenAPI 3.1 document of this API.",
            content_type = "application/json", body = Object)),
    )]
    pub fn openapi_json() {}

    /// Receive a provider event
    ///
    /// For the payment provider, not for merchants: no bearer token and no
    /// `Idempotency-Key`; the `Fake-Signature` header authenticates the
    /// request (`t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>.<raw
    /// body>")>`, compared in constant time; a timestamp more than the
    /// tolerance, 300 s by default, from the server's clock is refused).
    /// The event id is the deduplication key: the event, its effect and its
    /// outcome commit in one transaction and only then is 200 answered; a
    /// redelivery answers 200 `duplicate_delivery` and changes nothing. A
    /// charge event older than what is recorded for its charge (by
    /// `sequence`) is stored as `ignored_stale` and never moves a payment
    /// backwards.
    #[utoipa::path(
        post,
        path = "/v1/webhooks/{provider}",
        operation_id = "receiveWebhook",
        tag = "webhooks",
        params(
            ("provider" = String, Path, description = "The provider's name as configured (`fake`); any other answers 404."),
            ("Fake-Signature" = String, Header, description = "`t=<unix seconds>,v1=<hex HMAC-SHA256(secret, \"<t>.<raw body>\")>`; several `v1` values may be sent."),
        ),
        request_body(content = WebhookEvent, content_type = "application/json",
            description = "At most 64 KiB, signed as received (the raw bytes)."),
        responses(
            (status = 200, description = "Stored (and applied where it proves something new), or a redelivery of an event already stored.",
                body = WebhookReceipt),
        ),
    )]
    pub fn receive_webhook() {}

    /// List events
    ///
    /// The account's events in feed order (`position`, dense and
    /// increasing), oldest first. A position becomes visible only once
    /// every smaller one is: paging with `after` = the previous page's
    /// `next_after` from any position yields every later event, with no
    /// gap and no repeat.
    #[utoipa::path(
        get,
        path = "/v1/events",
        operation_id = "listEvents",
        tag = "events",
        params(
            ("after" = Option<i64>, Query, minimum = 0, description = "Only events after this position; default 0 (from the start)."),
            ("type" = Option<EventTypeSchema>, Query, description = "Only events of this type."),
            ("object" = Option<String>, Query, format = Uuid, description = "Only events about this payment (its refunds' included) or refund."),
            ("limit" = Option<u32>, Query, minimum = 1, maximum = 200, description = "Page size, 1 to 200; default 50."),
        ),
        responses((status = 200, description = "A page of events, oldest first.", body = EventList)),
    )]
    pub fn list_events() {}

    /// Read an event
    #[utoipa::path(
        get,
        path = "/v1/events/{id}",
        operation_id = "getEvent",
        tag = "events",
        params(("id" = String, Path, format = Uuid, description = "The event id. Not a UUID, or another account's: 404.")),
        responses((status = 200, description = "The event.", body = Event)),
    )]
    pub fn get_event() {}

    /// Create an event endpoint
    ///
    /// Not money-moving, so no `Idempotency-Key`: a repeated request makes
    /// a second endpoint (delete it). The answer carries the signing
    /// `secret`, shown only here and in a rotation's answer. The endpoint
    /// receives the events written from its creation on.
    #[utoipa::path(
        post,
        path = "/v1/event_endpoints",
        operation_id = "createEventEndpoint",
        tag = "events",
        request_body(content = CreateEventEndpointRequest, content_type = "application/json"),
        responses((status = 201, description = "Created, with its secret.", body = EventEndpoint)),
    )]
    pub fn create_event_endpoint() {}

    /// List event endpoints
    #[utoipa::path(
        get,
        path = "/v1/event_endpoints",
        operation_id = "listEventEndpoints",
        tag = "events",
        responses((status = 200, description = "The account's endpoints, without secrets.", body = EventEndpointList)),
    )]
    pub fn list_event_endpoints() {}

    /// Delete an event endpoint
    ///
    /// Its pending deliveries are dropped; the events stay in the feed.
    #[utoipa::path(
        delete,
        path = "/v1/event_endpoints/{id}",
        operation_id = "deleteEventEndpoint",
        tag = "events",
        params(("id" = String, Path, format = Uuid, description = "The endpoint id.")),
        responses((status = 204, description = "Deleted.")),
    )]
    pub fn delete_event_endpoint() {}

    /// Rotate an endpoint's secret
    ///
    /// A new secret signs from now on; the previous one also signs (a
    /// second `v1`) for 24 h, so a receiver can switch at its own pace.
    #[utoipa::path(
        post,
        path = "/v1/event_endpoints/{id}/rotate_secret",
        operation_id = "rotateEventEndpointSecret",
        tag = "events",
        params(("id" = String, Path, format = Uuid, description = "The endpoint id.")),
        responses((status = 200, description = "The endpoint with its new secret.", body = EventEndpoint)),
    )]
    pub fn rotate_event_endpoint_secret() {}
}

/// Shapes that the code parses field by field (or builds as a JSON map),
/// written down for the document. The integration test `openapi` compares
/// them with real answers.
#[allow(dead_code)]
pub(crate) mod schemas {
    use super::{
        AmountSchema, CaptureMethodSchema, CurrencyInputSchema, EndpointUrlSchema,
        ProblemCodeSchema,
    };
    use crate::error::FieldError;
    use crate::views::PaymentView;
    use serde::Deserialize;
    use std::collections::BTreeMap;
    use utoipa::ToSchema;

    /// Body of `POST /v1/payments`. `null` reads as absent.
    #[derive(Deserialize, ToSchema)]
    #[serde(deny_unknown_fields)]
    pub struct CreatePaymentRequest {
        /// The merchant's own identity of the order: 1 to 128 of `[A-Za-z0-9._:-]`.
        #[schema(
            min_length = 1,
            max_length = 128,
            pattern = r"^[A-Za-z0-9._:-]{1,128}$",
            example = "pedido-842"
        )]
        pub order_ref: String,
        #[schema(value_type = AmountSchema)]
        pub amount: i64,
        /// ISO 4217 alpha-3 code that cobro knows (see `Currency`), in any
        /// case: `eur` is `EUR`. Answers carry it upper-cased.
        #[schema(value_type = CurrencyInputSchema, example = "EUR")]
        pub currency: String,
        /// The provider's payment method token: 1 to 128 visible ASCII characters.
        #[schema(
            min_length = 1,
            max_length = 128,
            pattern = "^[!-~]{1,128}$",
            example = "pm_card_visa"
        )]
        pub payment_method: String,
        /// `automatic` (default): the money moves at authorisation.
        /// `manual`: authorise now, capture later (or cancel).
        #[schema(value_type = Option<CaptureMethodSchema>, default = "automatic")]
        pub capture_method: Option<String>,
        /// Free text for the merchant, at most 1000 characters, without
        /// U+0000.
        #[schema(max_length = 1000, pattern = "^[^\\u0000]*$")]
        pub description: Option<String>,
        /// At most 20 keys; keys 1 to 40 characters, values strings of at most 500.
        #[schema(schema_with = super::metadata_schema)]
        pub metadata: Option<BTreeMap<String, String>>,
    }

    /// Body of `POST /v1/payments/{id}/refunds`. `null` reads as absent.
    #[derive(Deserialize, ToSchema)]
    #[serde(deny_unknown_fields)]
    pub struct CreateRefundRequest {
        /// Minor units to refund; the sum of refunds that are not failed may
        /// not exceed the captured amount.
        #[schema(value_type = AmountSchema)]
        pub amount: i64,
        /// Free text, at most 500 characters, without U+0000.
        #[schema(max_length = 500, pattern = "^[^\\u0000]*$")]
        pub reason: Option<String>,
    }

    /// Capture and cancel take no fields: an empty body (or only
    /// whitespace) or `{}`.
    #[derive(Deserialize, ToSchema)]
    #[serde(deny_unknown_fields)]
    pub struct EmptyBody {}

    /// A page of payments, newest first.
    #[derive(ToSchema)]
    pub struct PaymentList {
        /// The payments of this page, without `attempts`.
        pub data: Vec<PaymentView>,
        /// Pass as `cursor` for the next (older) page; `null` when this page
        /// is not full. A full last page still carries a cursor, whose page
        /// is empty.
        pub next_cursor: Option<String>,
    }

    /// An RFC 9457 problem (`application/problem+json`).
    #[derive(ToSchema)]
    pub struct Problem {
        /// `/problems/<code>`, a URI reference.
        #[schema(
            rename = "type",
            format = "uri-reference",
            example = "/problems/payment-not-capturable"
        )]
        pub kind: String,
        /// Short, fixed per code.
        pub title: String,
        /// The HTTP status of the answer.
        #[schema(minimum = 400, maximum = 599)]
        pub status: u16,
        /// What happened, for a human. 5xx details never carry internal detail.
        pub detail: String,
        #[schema(value_type = ProblemCodeSchema)]
        pub code: String,
        /// The id of the request that produced this body (echoed in
        /// `X-Request-Id`). A replayed refusal carries the id of the first
        /// request; `refusal-compacted` bodies carry none.
        #[schema(nullable = false)]
        pub request_id: Option<String>,
        /// The payment a state refusal is about (for
        /// `order-has-active-payment`: the order's active payment).
        #[schema(nullable = false, format = Uuid)]
        pub payment_id: Option<String>,
        /// Every invalid field (`validation-error` only).
        #[schema(nullable = false)]
        pub errors: Option<Vec<FieldError>>,
        /// The key the request carried (`idempotency-key-reused` and
        /// `idempotency-request-in-progress`). An invalid key is never
        /// echoed, here or in a header.
        #[schema(nullable = false)]
        pub idempotency_key: Option<String>,
    }

    /// Answer of `/healthz` and `/readyz`.
    #[derive(ToSchema)]
    pub struct HealthStatus {
        /// `ok` (healthz), `ready` or `unavailable` (readyz).
        pub status: String,
        /// `unreachable` when readyz fails.
        #[schema(nullable = false)]
        pub database: Option<String>,
    }

    /// A provider event. Other members are allowed and kept as received.
    #[derive(ToSchema)]
    pub struct WebhookEvent {
        /// The provider's event id: the deduplication key.
        #[schema(example = "evt_4f1c2d")]
        pub id: String,
        /// `charge.authorized`, `charge.captured`, `charge.declined`,
        /// `charge.voided` or `refund.succeeded`; other types are stored as
        /// `unmatched`.
        #[schema(rename = "type", example = "charge.captured")]
        pub kind: String,
        /// When the provider made the effect.
        #[schema(nullable = false, format = DateTime)]
        pub created: Option<String>,
        /// The charge's sequence after the effect (per charge, growing).
        #[schema(minimum = 0, example = 2)]
        pub sequence: i64,
        /// The charge (`id`, `reference` = the authorisation's intent name,
        /// `amount`, `currency`, ...) or the refund (`id`, `charge`,
        /// `reference` = the refund's intent name, ...).
        #[schema(value_type = Object)]
        pub data: serde_json::Value,
    }

    /// An event: what changed, about which object, and the object after
    /// the change.
    #[derive(serde::Serialize, ToSchema)]
    pub struct Event {
        /// Stable across redeliveries: deduplicate by it.
        #[schema(format = Uuid)]
        pub id: String,
        #[serde(rename = "type")]
        #[schema(value_type = super::EventTypeSchema)]
        pub event_type: String,
        /// The account's feed position: dense, increasing.
        #[schema(minimum = 1)]
        pub position: i64,
        /// Strictly increasing per payment (its refunds share it): an event
        /// with a sequence not above the last applied to its object is
        /// older and must not overwrite it.
        #[schema(minimum = 1)]
        pub sequence: i64,
        /// `payment` or `refund`.
        pub object_type: String,
        #[schema(format = Uuid)]
        pub object_id: String,
        #[schema(format = Uuid)]
        pub payment_id: String,
        #[schema(format = DateTime)]
        pub created_at: String,
        /// The `Payment` (without `attempts`) or `Refund` after the change.
        #[schema(value_type = Object)]
        pub data: serde_json::Value,
    }

    /// A page of events.
    #[derive(ToSchema)]
    pub struct EventList {
        pub data: Vec<Event>,
        /// Pass as `after` for the next page.
        pub next_after: i64,
        /// More events were already there when this page was read.
        pub has_more: bool,
    }

    /// Where events are pushed.
    #[derive(ToSchema)]
    pub struct EventEndpoint {
        #[schema(format = Uuid)]
        pub id: String,
        pub url: String,
        /// `["*"]` for every type.
        pub event_types: Vec<String>,
        /// `false` once it failed every attempt for 3 days.
        pub enabled: bool,
        pub disabled_reason: Option<String>,
        #[schema(format = DateTime)]
        pub created_at: String,
        /// The signing secret: only in the answers that create or rotate it.
        #[schema(nullable = false)]
        pub secret: Option<String>,
    }

    #[derive(ToSchema)]
    pub struct EventEndpointList {
        pub data: Vec<EventEndpoint>,
    }

    /// Body of `POST /v1/event_endpoints`.
    #[derive(Deserialize, ToSchema)]
    #[serde(deny_unknown_fields)]
    pub struct CreateEventEndpointRequest {
        /// `http://` or `https://` with a host name or IPv4 address (no
        /// IPv6 literal, user, query or fragment), at most 2048 characters.
        #[schema(value_type = EndpointUrlSchema)]
        pub url: String,
        /// Event types to send; absent or `["*"]`: all.
        #[schema(value_type = Option<Vec<super::EventTypeSchema>>)]
        pub event_types: Option<Vec<String>>,
    }

    /// The answer to a delivered event.
    #[derive(ToSchema)]
    pub struct WebhookReceipt {
        pub event_id: String,
        /// `applied`, `ignored_stale`, `duplicate_effect`, `unmatched`, or
        /// `duplicate_delivery` for an event id already stored.
        #[schema(example = "applied")]
        pub outcome: String,
    }
}

/// Declares a named schema built at runtime from the domain's own lists.
/// Uninhabited: these types exist only to name a schema.
macro_rules! runtime_schema {
    ($(#[$doc:meta])* $ty:ident = $name:literal, $build:expr) => {
        $(#[$doc])*
        pub(crate) enum $ty {}

        impl utoipa::PartialSchema for $ty {
            fn schema() -> RefOr<Schema> {
                $build
            }
        }

        impl utoipa::ToSchema for $ty {
            fn name() -> Cow<'static, str> {
                Cow::Borrowed($name)
            }
        }
    };
}

fn string_enum<'a>(values: impl IntoIterator<Item = &'a str>, description: &str) -> RefOr<Schema> {
    ObjectBuilder::new()
        .schema_type(Type::String)
        .enum_values(Some(values))
        .description(Some(description))
        .into()
}

runtime_schema!(
    /// `PaymentStatus::ALL`.
    PaymentStatusSchema = "PaymentStatus",
    string_enum(
        PaymentStatus::ALL.iter().map(PaymentStatus::as_str),
        "processing -> authorized (manual capture) | captured (automatic) | declined | failed | requires_reconciliation; \
requires_reconciliation -> any outcome the provider proves, or needs_review; authorized -> capturing -> captured; \
authorized -> canceling -> canceled; captured -> partially_refunded | refunded. \
declined, failed and canceled free the order for a new payment.",
    )
);

runtime_schema!(
    /// `crate::events::event_types()`.
    EventTypeSchema = "EventType",
    {
        let types = crate::events::event_types();
        string_enum(
            types.iter().map(String::as_str),
            "payment.created, then payment.<status> for every status it moves to, payment.conflict_found \
when evidence contradicting the record is kept (the payment goes to needs_review with its own event); \
refund.created, then refund.<status>.",
        )
    }
);

runtime_schema!(
    /// `RefundStatus::ALL`.
    RefundStatusSchema = "RefundStatus",
    string_enum(
        RefundStatus::ALL.iter().map(RefundStatus::as_str),
        "processing -> succeeded | failed | requires_reconciliation (-> an outcome the provider proves, or needs_review).",
    )
);

runtime_schema!(
    /// `AttemptState::ALL`.
    AttemptStateSchema = "AttemptState",
    string_enum(
        AttemptState::ALL.iter().map(AttemptState::as_str),
        "pending: not answered yet; unknown: sent without a definitive answer, retried with the same provider key; \
reconciling: handed to the reconciler; succeeded | declined | failed; no_effect: proven to have had no effect.",
    )
);

runtime_schema!(
    /// `CaptureMethod::ALL`.
    CaptureMethodSchema = "CaptureMethod",
    string_enum(
        CaptureMethod::ALL.iter().map(CaptureMethod::as_str),
        "automatic: the money moves at authorisation. manual: authorise, then capture or cancel.",
    )
);

runtime_schema!(
    /// `Operation::ALL`.
    OperationSchema = "Operation",
    string_enum(
        Operation::ALL.iter().map(Operation::as_str),
        "The keyed operation an attempt belongs to.",
    )
);

runtime_schema!(
    /// Every code a problem body can carry.
    ProblemCodeSchema = "ProblemCode",
    string_enum(
        every_error()
            .iter()
            .map(|e| e.status_and_code().1)
            .chain([COMPACTED]),
        "The stable code of a problem; `type` is `/problems/<code>`.",
    )
);

runtime_schema!(
    /// The currencies `Currency::parse` accepts, upper case.
    CurrencySchema = "Currency",
    string_enum(
        known_currencies().iter().map(String::as_str),
        "ISO 4217 alpha-3, upper case. Requests may use any case.",
    )
);

runtime_schema!(
    /// `crate::events::ENDPOINT_URL_PATTERN`.
    EndpointUrlSchema = "EndpointUrl",
    ObjectBuilder::new()
        .schema_type(Type::String)
        .max_length(Some(2048))
        .pattern(Some(crate::events::ENDPOINT_URL_PATTERN))
        .examples([json!("https://shop.example/cobro")])
        .into()
);

runtime_schema!(
    /// What a request may send as a currency: a known code in any case.
    CurrencyInputSchema = "CurrencyInput",
    ObjectBuilder::new()
        .schema_type(Type::String)
        .pattern(Some(any_case_alternation(&known_currencies())))
        .description(Some(
            "A currency cobro knows (see `Currency`), in any case: `eur`, `Eur` and `EUR` are `EUR`.",
        ))
        .into()
);

/// `^(?:[Ee][Uu][Rr]|...)$`: the codes, each letter in either case (JSON
/// Schema patterns have no case-insensitive flag).
fn any_case_alternation(codes: &[String]) -> String {
    let alternatives: Vec<String> = codes
        .iter()
        .map(|code| {
            code.chars()
                .map(|c| format!("[{}{}]", c.to_ascii_uppercase(), c.to_ascii_lowercase()))
                .collect()
        })
        .collect();
    format!("^(?:{})$", alternatives.join("|"))
}

/// Text PostgreSQL can store (no U+0000); refused with 400 otherwise.
const NO_NUL: &str = "^[^\\u0000]*$";

runtime_schema!(
    /// `Amount::MIN..=Amount::MAX`.
    AmountSchema = "Amount",
    ObjectBuilder::new()
        .schema_type(Type::Integer)
        .format(Some(utoipa::openapi::SchemaFormat::KnownFormat(
            utoipa::openapi::KnownFormat::Int64
        )))
        .minimum(Some(Amount::MIN))
        .maximum(Some(Amount::MAX))
        .description(Some(
            "Integer minor units (1999 is 19.99 EUR; JPY has none): a JSON integer, never 19.99 or 1.999e3.",
        ))
        .examples([1999])
        .into()
);

/// The codes `Currency::parse` knows: the domain's table is private, and
/// asking it is the only way the document cannot drift from it.
fn known_currencies() -> Vec<String> {
    let letters = b'A'..=b'Z';
    let mut known = Vec::new();
    for a in letters.clone() {
        for b in letters.clone() {
            for c in letters.clone() {
                let code = String::from_utf8_lossy(&[a, b, c]).into_owned();
                if Currency::parse(&code).is_ok() {
                    known.push(code);
                }
            }
        }
    }
    known
}

/// `metadata`: a string map with its limits.
pub(crate) fn metadata_schema() -> Schema {
    let key = ObjectBuilder::new()
        .schema_type(Type::String)
        .min_length(Some(1))
        .max_length(Some(40))
        .pattern(Some(NO_NUL));
    let value = ObjectBuilder::new()
        .schema_type(Type::String)
        .max_length(Some(500))
        .pattern(Some(NO_NUL));
    ObjectBuilder::new()
        .schema_type(utoipa::openapi::schema::SchemaType::from_iter([
            Type::Object,
            Type::Null,
        ]))
        .property_names(Some(key))
        .additional_properties(Some(value))
        .max_properties(Some(20))
        .description(Some(
            "A string map: at most 20 keys, keys 1 to 40 characters, values strings of at most 500, none holding U+0000. `null` is the same as leaving it out.",
        ))
        .examples([json!({"channel": "web"})])
        .into()
}

/// The code of the body a tombstoned refusal replays (built in `keyed.rs`).
const COMPACTED: &str = "refusal-compacted";

const EXAMPLE_PAYMENT: &str = "0193a7c4-5f2e-7d41-9b7a-2c1d3e4f5a6b";
const EXAMPLE_REQUEST: &str = "0193a7c4-6a00-7c3e-8f11-9d2e4b6c8a01";

/// One of each [`ApiError`] variant, as documentation examples. A new
/// variant is a compile error in [`explain`] until it is documented; the
/// unit test below checks it is listed here too.
fn every_error() -> Vec<ApiError> {
    let id = || EXAMPLE_PAYMENT.to_owned();
    vec![
        ApiError::Unauthenticated,
        ApiError::NotFound,
        ApiError::Validation(vec![FieldError::new(
            "amount",
            cobro_core::AmountError::OutOfRange.to_string(),
        )]),
        ApiError::BodyTooLarge {
            limit: crate::extract::BODY_LIMIT,
        },
        ApiError::KeyMissing,
        ApiError::KeyInvalid,
        ApiError::KeyReused {
            idempotency_key: "5f0c9a52-8d7e-4f44-9d0e-3b1f2a6c7d10".into(),
        },
        ApiError::InProgress {
            idempotency_key: "5f0c9a52-8d7e-4f44-9d0e-3b1f2a6c7d10".into(),
        },
        ApiError::OrderHasActivePayment { payment_id: id() },
        ApiError::NotCapturable {
            payment_id: id(),
            status: "processing".into(),
        },
        ApiError::NotCancelable {
            payment_id: id(),
            status: "captured".into(),
        },
        ApiError::NotRefundable {
            payment_id: id(),
            status: "authorized".into(),
        },
        ApiError::RefundExceedsCaptured { payment_id: id() },
        ApiError::WebhookSignatureInvalid,
        ApiError::RateLimited,
        ApiError::RequestTimeout {
            limit: ApiSettings::default().request_timeout,
        },
        ApiError::Unavailable(None),
        ApiError::internal(std::io::Error::other("example")),
    ]
}

/// When each problem happens and what the client does about it.
pub(crate) fn explain(error: &ApiError) -> &'static str {
    use ApiError as E;
    match error {
        E::Unauthenticated => {
            "The bearer token is missing or not valid. The same answer whether or not the resource exists."
        }
        E::NotFound => {
            "No such payment or refund in this account; an id of another account, or one that is not a UUID, answers the same."
        }
        E::Validation(_) => {
            "The body, a field or a query parameter is invalid; `errors` lists every invalid field, unknown fields included. Correct it and retry, with the same key if you like."
        }
        E::BodyTooLarge { .. } => {
            "The body is larger than 16 KiB (16384 bytes); 64 KiB (65536 bytes) for webhooks."
        }
        E::KeyMissing => "A POST without an `Idempotency-Key` header.",
        E::KeyInvalid => {
            "More than one `Idempotency-Key` line, or a value that is not 1 to 255 visible ASCII characters (bare, or one structured-field string)."
        }
        E::KeyReused { .. } => {
            "This key was already used in this account for this operation with a different request. Nothing was executed or changed; a new request needs a new key."
        }
        E::InProgress { .. } => {
            "A request with this same key is still in progress (its transaction has not committed within the bounded wait, about 2 s). Retry with the same key after `Retry-After`."
        }
        E::OrderHasActivePayment { .. } => {
            "The order already has a payment that is not declined, failed or canceled; `payment_id` names it. Not stored against the key."
        }
        E::NotCapturable { .. } => {
            "Only an `authorized` (manual capture) payment can be captured. Stored against the key."
        }
        E::NotCancelable { .. } => {
            "Only manual-capture payments that are `authorized` or still awaiting their authorisation outcome can be canceled; automatic-capture payments are refunded instead. Stored against the key."
        }
        E::NotRefundable { .. } => {
            "Only a `captured` or `partially_refunded` payment can be refunded. Stored against the key."
        }
        E::RefundExceedsCaptured { .. } => {
            "Refunds that are not failed would exceed the captured amount. Stored against the key."
        }
        E::WebhookSignatureInvalid => {
            "The `Fake-Signature` header is missing or malformed, no `v1` signature matches the body with the provider's secret, or its timestamp is outside the tolerance. Nothing was stored."
        }
        E::RateLimited => {
            "The account sent more requests per second than its limit (per process; `COBRO_RATE_LIMIT`). Nothing was stored against the key: retry the same request after `Retry-After`."
        }
        E::RequestTimeout { .. } => {
            "The request was not answered within the request timeout (`COBRO_HTTP_REQUEST_TIMEOUT`, from the end of its headers, body included): typically a body that never arrived. The connection is closed. If the request began executing it still completes and its answer is stored against the key: retry with the same key."
        }
        E::Unavailable(_) => {
            "The database is unreachable; nothing was stored. Retry with the same key after `Retry-After`."
        }
        E::Internal(_) => {
            "An unexpected error; the body carries no detail (the cause is logged under the request id). Retry with the same key."
        }
    }
}

/// A problem an operation can answer.
enum Refusal {
    Api(ApiError),
    /// A stored refusal replayed after compaction to a tombstone.
    Compacted,
}

impl Refusal {
    fn status(&self) -> StatusCode {
        match self {
            Refusal::Api(e) => e.status_and_code().0,
            Refusal::Compacted => StatusCode::UNPROCESSABLE_ENTITY,
        }
    }

    fn code(&self) -> &'static str {
        match self {
            Refusal::Api(e) => e.status_and_code().1,
            Refusal::Compacted => COMPACTED,
        }
    }

    fn explain(&self) -> &'static str {
        match self {
            Refusal::Api(e) => explain(e),
            Refusal::Compacted => {
                "A refusal stored against this key was compacted to a tombstone: its original status, without the original body."
            }
        }
    }

    fn example(&self) -> (String, Value) {
        match self {
            Refusal::Api(e) => {
                let mut body = e.problem();
                body.insert("request_id".into(), json!(EXAMPLE_REQUEST));
                let title = body
                    .get("title")
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                (title.to_owned(), Value::Object(body))
            }
            Refusal::Compacted => (
                "Refusal compacted".into(),
                json!({
                    "type": "/problems/refusal-compacted",
                    "title": "Refusal compacted",
                    "status": 422,
                    "detail": "this key was refused earlier; the refusal is older than the idempotency retention and its body is no longer stored",
                    "code": "refusal-compacted",
                }),
            ),
        }
    }

    /// Stored against the key: answered by `keyed::build`, with
    /// `Idempotent-Replayed`.
    fn is_stored(&self) -> bool {
        matches!(
            self,
            Refusal::Compacted
                | Refusal::Api(
                    ApiError::NotCapturable { .. }
                        | ApiError::NotCancelable { .. }
                        | ApiError::NotRefundable { .. }
                        | ApiError::RefundExceedsCaptured { .. }
                )
        )
    }
}

/// The problems each operation answers, in the order the handler checks:
/// token, key header, body, key state, then the resource.
fn refusals(operation_id: &str) -> Vec<Refusal> {
    let pick = |codes: &[&str]| -> Vec<Refusal> {
        let mut picked: Vec<Refusal> = every_error()
            .into_iter()
            .filter(|e| codes.contains(&e.status_and_code().1))
            .map(Refusal::Api)
            .collect();
        if codes.contains(&COMPACTED) {
            picked.push(Refusal::Compacted);
        }
        picked
    };
    const READ: &[&str] = &[
        "unauthenticated",
        "rate-limited",
        "request-timeout",
        "service-unavailable",
        "internal",
    ];
    const KEYED: &[&str] = &[
        "unauthenticated",
        "rate-limited",
        "idempotency-key-missing",
        "idempotency-key-invalid",
        "body-too-large",
        "validation-error",
        "idempotency-request-in-progress",
        "idempotency-key-reused",
        "request-timeout",
        "service-unavailable",
        "internal",
    ];
    let with = |base: &[&str], more: &[&str]| pick(&[base, more].concat());
    match operation_id {
        "createPayment" => with(KEYED, &["order-has-active-payment"]),
        "listPayments" => with(READ, &["validation-error"]),
        "getPayment" => with(READ, &["validation-error", "not-found"]),
        "capturePayment" => with(KEYED, &["not-found", "payment-not-capturable", COMPACTED]),
        "cancelPayment" => with(KEYED, &["not-found", "payment-not-cancelable", COMPACTED]),
        "createRefund" => with(
            KEYED,
            &[
                "not-found",
                "payment-not-refundable",
                "refund-exceeds-captured",
                COMPACTED,
            ],
        ),
        "getRefund" => with(READ, &["not-found"]),
        "listEvents" => with(READ, &["validation-error"]),
        "getEvent" | "deleteEventEndpoint" | "rotateEventEndpointSecret" => {
            with(READ, &["not-found"])
        }
        "listEventEndpoints" => with(READ, &[]),
        "createEventEndpoint" => with(READ, &["body-too-large", "validation-error"]),
        "receiveWebhook" => pick(&[
            "not-found",
            "body-too-large",
            "webhook-signature-invalid",
            "validation-error",
            "rate-limited",
            "request-timeout",
            "service-unavailable",
            "internal",
        ]),
        _ => Vec::new(),
    }
}

const H_REQUEST_ID: &str = "X-Request-Id";
const H_KEY: &str = "Idempotency-Key";
const H_REPLAYED: &str = "Idempotent-Replayed";
const H_RETRY_AFTER: &str = "Retry-After";

fn header_ref(name: &str) -> RefOr<Header> {
    RefOr::Ref(Ref::new(format!("#/components/headers/{name}")))
}

fn string_schema() -> ObjectBuilder {
    ObjectBuilder::new().schema_type(Type::String)
}

/// The `Idempotency-Key` syntax: bare, or one structured-field string
/// (no `"` or `\` inside).
fn key_pattern() -> String {
    let n = IdempotencyKey::MAX_LEN;
    format!(r#"^(?:[!-~]{{1,{n}}}|"[!#-\[\]-~]{{1,{n}}}")$"#)
}

/// Adds what every operation shares; see the module docs.
struct Contract;

impl Modify for Contract {
    fn modify(&self, openapi: &mut Document) {
        let components = openapi.components.get_or_insert_with(Components::new);
        add_shared_components(components);
        for (path, item) in openapi.paths.paths.iter_mut() {
            // Every `/v1` handler takes the `Account` extractor; the
            // operations routes take none. Webhooks are the provider's:
            // their signature authenticates them, their event id dedups.
            let webhook = path.starts_with("/v1/webhooks/");
            let secured = path.starts_with("/v1/") && !webhook;
            // Only money-moving POSTs take a key: managing event endpoints
            // moves no money.
            let keyed = !webhook && !path.starts_with("/v1/event_endpoints");
            // The router serves GET and POST, and DELETE of an endpoint.
            if let Some(operation) = item.get.as_mut() {
                complete_operation(operation, false, secured);
            }
            if let Some(operation) = item.post.as_mut() {
                complete_operation(operation, keyed, secured);
            }
            if let Some(operation) = item.delete.as_mut() {
                complete_operation(operation, false, secured);
            }
        }
    }
}

fn add_shared_components(components: &mut Components) {
    components.security_schemes.insert(
        "bearer".into(),
        RefOr::T(SecurityScheme::Http(
            HttpBuilder::new()
                .scheme(HttpAuthScheme::Bearer)
                .description(Some(
                    "`Authorization: Bearer <token>`. Tokens are created by the ops CLI (`cobro token`), shown once and stored only as a SHA-256 hash.",
                ))
                .build(),
        )),
    );
    let headers: [(&str, Header); 4] = [
        (
            H_REQUEST_ID,
            HeaderBuilder::new()
                .schema(Some(string_schema()))
                .description(Some(
                    "The request id: the client's `X-Request-Id` when it sent one of 1 to 128 visible ASCII characters, else a new UUID. Also in problem bodies and log lines.",
                ))
                .build(),
        ),
        (
            H_KEY,
            HeaderBuilder::new()
                .schema(Some(string_schema()))
                .description(Some(
                    "The request's `Idempotency-Key`, echoed as sent, on every answer to a POST that carried exactly one `Idempotency-Key` line.",
                ))
                .build(),
        ),
        (
            H_REPLAYED,
            HeaderBuilder::new()
                .schema(Some(string_schema().enum_values(Some(["true", "false"]))))
                .description(Some(
                    "`false` on the answer of the execution itself, `true` on a replay of a stored answer or of a tombstone. Sent on answers stored against the key (2xx and the final 422 refusals), not on other problems.",
                ))
                .build(),
        ),
        (
            H_RETRY_AFTER,
            HeaderBuilder::new()
                .schema(Some(ObjectBuilder::new().schema_type(Type::Integer).minimum(Some(0))))
                .description(Some("Seconds to wait before retrying with the same key: `1`."))
                .example(Some(json!("1")))
                .build(),
        ),
    ];
    for (name, header) in headers {
        components.headers.insert(name.into(), RefOr::T(header));
    }
    components.parameters.insert(
        "IdempotencyKey".into(),
        RefOr::T(
            ParameterBuilder::new()
                .name(H_KEY)
                .parameter_in(ParameterIn::Header)
                .required(Required::True)
                .description(Some(format!(
                    "1 to {} visible ASCII characters (`%x21-7E`); the bare form and the structured-field string form (`\"...\"`) are the same key. Use a random UUID generated when the intent is created and persisted before the first send; reuse it for every retry of that intent. Scoped by (account, operation, key).",
                    IdempotencyKey::MAX_LEN
                )))
                .schema(Some(string_schema().pattern(Some(key_pattern()))))
                .example(Some(json!("8e03978e-40d5-43e8-bc93-6894a57f9324")))
                .build(),
        ),
    );
    components.parameters.insert(
        "RequestId".into(),
        RefOr::T(
            ParameterBuilder::new()
                .name(H_REQUEST_ID)
                .parameter_in(ParameterIn::Header)
                .required(Required::False)
                .description(Some(
                    "Optional correlation id. Used (and echoed) when it is 1 to 128 visible ASCII characters (`^[!-~]{1,128}$`); any other value is not refused but replaced by a new UUID, which is echoed instead. Never part of the fingerprint.",
                ))
                .schema(Some(string_schema()))
                .build(),
        ),
    );
}

/// `is_post`: a keyed POST (the `Idempotency-Key` parameter and its echo).
fn complete_operation(operation: &mut PathOperation, is_post: bool, secured: bool) {
    if secured {
        operation.security = Some(vec![SecurityRequirement::new(
            "bearer",
            Vec::<String>::new(),
        )]);
    }
    let parameters = operation.parameters.get_or_insert_with(Vec::new);
    if is_post {
        parameters.insert(
            0,
            RefOr::Ref(Ref::new("#/components/parameters/IdempotencyKey")),
        );
    }
    parameters.push(RefOr::Ref(Ref::new("#/components/parameters/RequestId")));

    // The success answers the stubs declared.
    for response in operation.responses.responses.values_mut() {
        if let RefOr::T(response) = response {
            response
                .headers
                .insert(H_REQUEST_ID.into(), header_ref(H_REQUEST_ID));
            if is_post {
                response.headers.insert(H_KEY.into(), header_ref(H_KEY));
                response
                    .headers
                    .insert(H_REPLAYED.into(), header_ref(H_REPLAYED));
            }
        }
    }

    let operation_id = operation.operation_id.clone().unwrap_or_default();
    // Capture and cancel read an absent body as `{}`; utoipa marks a
    // declared body required.
    if matches!(operation_id.as_str(), "capturePayment" | "cancelPayment")
        && let Some(RefOr::T(body)) = operation.request_body.as_mut()
    {
        body.required = Some(Required::False);
    }
    let mut by_status: BTreeMap<u16, Vec<Refusal>> = BTreeMap::new();
    for refusal in refusals(&operation_id) {
        by_status
            .entry(refusal.status().as_u16())
            .or_default()
            .push(refusal);
    }
    for (status, refusals) in by_status {
        let codes: Vec<&str> = refusals.iter().map(Refusal::code).collect();
        let schema = AllOfBuilder::new()
            .item(Ref::from_schema_name("Problem"))
            .item(
                ObjectBuilder::new()
                    .property(
                        "code",
                        string_schema().enum_values(Some(codes.iter().copied())),
                    )
                    .property(
                        "status",
                        ObjectBuilder::new()
                            .schema_type(Type::Integer)
                            .enum_values(Some([status])),
                    ),
            )
            .build();
        let mut content = Content::new(Some(RefOr::T(Schema::AllOf(schema))));
        for refusal in &refusals {
            let (summary, value) = refusal.example();
            content.examples.insert(
                refusal.code().into(),
                RefOr::T(
                    ExampleBuilder::new()
                        .summary(summary)
                        .value(Some(value))
                        .build(),
                ),
            );
        }
        let mut description = refusals
            .iter()
            .map(|r| format!("- `{}`: {}", r.code(), r.explain()))
            .collect::<Vec<_>>()
            .join("\n");
        let mut response = ResponseBuilder::new()
            .content("application/problem+json", content)
            .build();
        // axum's `Query` extractor answers an undecodable query string
        // (e.g. a repeated parameter) itself, before the handler runs.
        if status == 400 && matches!(operation_id.as_str(), "listPayments" | "getPayment") {
            description.push_str(
                "\n- `text/plain`: a query string that cannot be decoded at all (e.g. a repeated parameter) is refused by the framework with a plain-text message, not a problem.",
            );
            response.content.insert(
                "text/plain".into(),
                RefOr::T(Content::new(Some(string_schema()))),
            );
        }
        response.description = description;
        response
            .headers
            .insert(H_REQUEST_ID.into(), header_ref(H_REQUEST_ID));
        if is_post {
            response.headers.insert(H_KEY.into(), header_ref(H_KEY));
            if refusals.iter().any(Refusal::is_stored) {
                response
                    .headers
                    .insert(H_REPLAYED.into(), header_ref(H_REPLAYED));
            }
        }
        if status == 409 || status == 429 || status == 503 {
            response
                .headers
                .insert(H_RETRY_AFTER.into(), header_ref(H_RETRY_AFTER));
        }
        operation
            .responses
            .responses
            .insert(status.to_string(), RefOr::T(response));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_variant_is_explained_and_has_a_distinct_code() {
        let errors = every_error();
        let mut codes: Vec<&str> = errors.iter().map(|e| e.status_and_code().1).collect();
        codes.sort_unstable();
        codes.dedup();
        assert_eq!(codes.len(), errors.len());
        assert!(errors.iter().all(|e| !explain(e).is_empty()));
    }

    #[test]
    fn the_currency_input_pattern_is_every_known_code_in_any_case() {
        let pattern = any_case_alternation(&["EUR".to_owned(), "JPY".to_owned()]);
        assert_eq!(pattern, "^(?:[Ee][Uu][Rr]|[Jj][Pp][Yy])$");
        // Every code the domain knows is in the served pattern.
        let served = any_case_alternation(&known_currencies());
        assert!(known_currencies().iter().all(|code| {
            let alternative: String = code
                .chars()
                .map(|c| format!("[{}{}]", c, c.to_ascii_lowercase()))
                .collect();
            served.contains(&alternative)
        }));
    }

    #[test]
    fn the_key_pattern_admits_both_forms() {
        // Spot-check the pattern text; the integration test checks real keys.
        assert!(key_pattern().contains("{1,255}"));
    }

    #[test]
    fn known_currencies_are_the_domains() {
        let known = known_currencies();
        assert!(known.iter().any(|c| c == "EUR"));
        assert!(known.iter().all(|c| Currency::parse(c).is_ok()));
    }

    #[test]
    fn retention_reads_as_people_write_it() {
        assert_eq!(human(Duration::from_secs(24 * 3600)), "24 h");
        assert_eq!(human(Duration::from_secs(30 * 86_400)), "30 days");
        assert_eq!(human(Duration::from_secs(90)), "90 s");
    }
}
