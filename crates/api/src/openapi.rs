//! `/openapi.json`: the machine-readable contract (docs/http-api.md), an
//! OpenAPI 3.1 document generated with utoipa from the handlers themselves.
//!
//! Layout:
//! - [`ApiDoc`]: what is not an operation: the info, the server, the tags
//!   and the schemas only the shared contract refers to. The operations are
//!   the router's own: every route is registered through utoipa-axum's
//!   `routes!` with the `#[utoipa::path]` on its real handler (`payments`,
//!   `events`, `health`, `webhooks` and [`serve`] here), so a route cannot
//!   exist undocumented; `crate::router` splits the router from its
//!   document and [`complete`] finishes the document.
//! - `info.description` is `docs/api.md` (also part of the crate docs),
//!   then the retention this server actually runs with.
//! - [`refusals!`]: the problems each handler answers, declared next to it
//!   as a small typed list (`ApiError` variants) and listed in its
//!   `responses(...)`; their examples are [`ApiError::problem`] itself.
//! - `schemas`: the shapes that are built as JSON maps (problems, the
//!   provider's events and their receipt, merchant events), plus named
//!   schemas built from the domain's own lists (`PaymentStatus::ALL`, the
//!   known currencies, `Amount::MAX`).
//! - [`Contract`]: what every operation shares, added in one place so no
//!   operation can forget it: the bearer scheme, `X-Request-Id`, the
//!   `Idempotency-Key` parameter and its response headers.

use crate::error::{ApiError, FieldError};
use crate::{ApiSettings, AppState};
use axum::extract::State;
use axum::http::StatusCode;
use axum::{Extension, Json};
use cobro_core::{
    Amount, AttemptState, CaptureMethod, Currency, IdempotencyKey, Operation, PaymentStatus,
    RefundStatus,
};
use serde_json::{Value, json};
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use utoipa::openapi::example::ExampleBuilder;
use utoipa::openapi::header::{Header, HeaderBuilder};
use utoipa::openapi::path::{Operation as PathOperation, ParameterBuilder, ParameterIn};
use utoipa::openapi::response::{Response, ResponseBuilder};
use utoipa::openapi::schema::{AllOfBuilder, ObjectBuilder, Schema, Type};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityRequirement, SecurityScheme};
use utoipa::openapi::{Components, Content, OpenApi as Document, Ref, RefOr, Required};
use utoipa::{Modify, OpenApi};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

pub(crate) fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(serve))
}

/// The finished document of the router being served ([`complete`]), put
/// in the request extensions by `crate::router`.
#[derive(Clone)]
pub(crate) struct Served(pub(crate) Arc<Document>);

/// This document
#[utoipa::path(
    get,
    path = "/openapi.json",
    operation_id = "openapi",
    tag = "operations",
    responses((status = 200, description = "The OpenAPI 3.1 document of this API.",
        content_type = "application/json", body = Object)),
)]
async fn serve(
    State(state): State<AppState>,
    Extension(Served(document)): Extension<Served>,
) -> Json<Document> {
    Json(with_settings(&document, &state.settings))
}

/// The base every router's document starts from: `OpenApiRouter::with_openapi`.
pub(crate) fn base() -> Document {
    ApiDoc::openapi()
}

/// The router's own document (its operations) with what every operation
/// shares; built once per router.
pub(crate) fn complete(mut document: Document) -> Document {
    Contract.modify(&mut document);
    document
}

/// The document as served by a server running with `settings` (the
/// retention is part of the contract).
fn with_settings(document: &Document, settings: &ApiSettings) -> Document {
    let mut document = document.clone();
    document.info.description = Some(info_description(settings));
    document
}

#[derive(OpenApi)]
#[openapi(
    info(
        title = "cobro payments API",
        description = "Set at runtime from `info_description`.",
    ),
    servers((url = "/", description = "This server: every path is relative to the address the document was fetched from.")),
    components(schemas(
        schemas::Problem,
        FieldError,
        ProblemCodeSchema,
        PaymentStatusSchema,
        RefundStatusSchema,
        AttemptStateSchema,
        CaptureMethodSchema,
        OperationSchema,
        CurrencySchema,
        CurrencyInputSchema,
        EndpointUrlSchema,
        AmountSchema,
        EventTypeSchema,
    )),
    tags(
        (name = "payments", description = "Authorise, read, list, capture and cancel payments."),
        (name = "refunds", description = "Refund captured payments."),
        (name = "operations", description = "Health, readiness and this document: no authentication, no idempotency."),
        (name = "webhooks", description = "Events from the payment provider: authenticated by their signature, deduplicated by event id."),
        (name = "events", description = "Events to merchants. Every status change of a payment or refund (and conflicting evidence found about a payment) is an `Event`, written in the transaction of the change. They are pushed to the account's endpoints (POST, JSON body = the `Event`, at least once: deduplicate by `id`, apply by `sequence`) with the header `Cobro-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, \"<t>.<raw body>\")>` (one `v1` per valid secret while a secret is rotated; refuse a `t` more than 5 minutes away), plus `Cobro-Event-Id` and `Cobro-Event-Type`. Any 2xx within 10 s is delivered; anything else is retried with capped exponential backoff and jitter for 3 days from the first attempt, then the delivery is dead (operators replay it). An endpoint failing every attempt for 3 days is disabled with a reason. They can also be pulled: `GET /v1/events?after=<position>` yields every later event, with no gap, from any position. Events are kept at least as long as deliveries are retried (today: not purged)."),
    ),
)]
struct ApiDoc;

/// The contract prose, written once: `info.description` and the crate docs.
const DESCRIPTION: &str = include_str!("../docs/api.md");

/// `info.description`: [`DESCRIPTION`], then the retention this server
/// actually applies.
fn info_description(settings: &ApiSettings) -> String {
    format!(
        "{DESCRIPTION}\n## This server\n\nFull records are kept {}, then tombstones a further {}.\n",
        human(settings.idempotency_retention),
        human(settings.tombstone_retention),
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

/// Shapes the code builds as JSON maps (a problem from `ApiError::problem`,
/// a merchant event from the store's row) or reads as one (a provider's
/// event, parsed field by field in `webhooks`), written down for the
/// document. Never constructed: the integration test `openapi` compares them
/// with real answers.
#[allow(dead_code)]
pub(crate) mod schemas {
    use super::ProblemCodeSchema;
    use crate::error::FieldError;
    use utoipa::ToSchema;

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
        "processing -> authorized (manual capture) | captured (automatic) | declined | failed | requires_action | requires_reconciliation; \
requires_action: the customer must authenticate (3-D Secure) at `next_action`; it ends by proof (authorized, captured, declined, failed) \
or, abandoned past `action_expires_at`, canceling -> canceled; \
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
reconciling: handed to the reconciler; awaiting_customer: answered, the customer must authenticate (never resent); \
held: a cancel waiting for the authorisation's outcome; succeeded | declined | failed; no_effect: proven to have had no effect.",
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
        .description(Some(
            "The grammar; beyond it the URL must be `https://` and its host a public address (a name: every address it resolves to), unless the operator allows plain http or lists the network or host: else 422 `endpoint-url-not-allowed`.",
        ))
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
        ApiError::OrderHasActivePayment {
            payment_id: EXAMPLE_PAYMENT
                .parse()
                .expect("the example payment id is a UUID"),
        },
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
        ApiError::RefundReferenceExists {
            payment_id: id(),
            refund_id: id(),
        },
        ApiError::EndpointUrlNotAllowed {
            reason: cobro_core::egress::Refusal::Address {
                host: "internal.shop.example".into(),
                ip: std::net::Ipv4Addr::new(10, 0, 0, 1).into(),
                range: "private",
            },
        },
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
        E::RefundReferenceExists { .. } => {
            "The payment already has a refund with this `reference` (under any key, however long ago): a late retry of a refund never refunds twice. `refund_id` names the existing refund. Stored against the key."
        }
        E::EndpointUrlNotAllowed { .. } => {
            "The event endpoint URL is well formed but events may not go there: it is not `https://` (plain http only where the operator allows it, `COBRO_EVENTS_ALLOW_HTTP`), its host is `localhost` or a `.localhost` name, or its host is, or resolves to, an address that is not public unicast (loopback, private, link-local, unique-local, multicast, CGNAT, documentation, benchmarking, reserved) and not in the operator's allow-list (`COBRO_EVENTS_ALLOW`). `errors` says which. Nothing was created."
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
            "The database is unreachable or cannot serve now (a failover). If the connection died during the commit the request may have been stored: retry with the same key after `Retry-After`, which replays it or executes it once."
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
                        | ApiError::RefundReferenceExists { .. }
                )
        )
    }
}

const H_REQUEST_ID: &str = "X-Request-Id";
const H_KEY: &str = "Idempotency-Key";
const H_REPLAYED: &str = "Idempotent-Replayed";
const H_RETRY_AFTER: &str = "Retry-After";
const H_AUTHENTICATE: &str = "WWW-Authenticate";

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
            if let Some(operation) = item.post.as_mut() {
                complete_operation(operation, keyed, secured);
            }
            let others = [
                &mut item.get,
                &mut item.put,
                &mut item.patch,
                &mut item.delete,
            ];
            for operation in others.into_iter().filter_map(Option::as_mut) {
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
    let headers: [(&str, Header); 5] = [
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
        (
            H_AUTHENTICATE,
            HeaderBuilder::new()
                .schema(Some(string_schema().enum_values(Some([r#"Bearer realm="cobro""#]))))
                .description(Some(
                    "On every 401: the same challenge, whatever was sent (RFC 6750).",
                ))
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
    for (status, response) in operation.responses.responses.iter_mut() {
        if let RefOr::T(response) = response {
            response
                .headers
                .insert(H_REQUEST_ID.into(), header_ref(H_REQUEST_ID));
            if is_post {
                response.headers.insert(H_KEY.into(), header_ref(H_KEY));
                // Every success is stored against the key; which problems
                // are, `problem_responses` says.
                if status.starts_with('2') {
                    response
                        .headers
                        .insert(H_REPLAYED.into(), header_ref(H_REPLAYED));
                }
            }
        }
    }
    // An `EmptyBody` may be left out (read as `{}`); utoipa marks every
    // declared body required.
    let empty = Ref::from_schema_name(<crate::payments::EmptyBody as utoipa::ToSchema>::name());
    if let Some(RefOr::T(body)) = operation.request_body.as_mut()
        && body
            .content
            .values()
            .any(|content| matches!(content, RefOr::T(Content { schema: Some(RefOr::Ref(r)), .. }) if *r == empty))
    {
        body.required = Some(Required::False);
    }
}

/// Declares the problems a handler answers as a type to list in its
/// `#[utoipa::path(responses(...))]`: a typed list of [`ApiError`]
/// variants (a misspelt one does not compile), grouped by status with one
/// example each ([`problem_responses`]).
///
/// - `keyed [...]`: a money-moving POST; the checks every such handler
///   runs (token, rate limit, key header, body, key state, the request
///   timeout, the database) plus its own.
/// - `read [...]`: an authenticated request without a key; token, rate
///   limit, request timeout, database, plus its own.
/// - `[...]`: exactly these.
macro_rules! refusals {
    ($(#[$doc:meta])* $name:ident = keyed [$($variant:ident),* $(,)?]) => {
        $crate::openapi::refusals!(@list $(#[$doc])* $name, Unauthenticated, RateLimited,
            KeyMissing, KeyInvalid, BodyTooLarge, Validation, InProgress, KeyReused,
            RequestTimeout, Unavailable, Internal $(, $variant)*);
    };
    ($(#[$doc:meta])* $name:ident = read [$($variant:ident),* $(,)?]) => {
        $crate::openapi::refusals!(@list $(#[$doc])* $name, Unauthenticated, RateLimited,
            RequestTimeout, Unavailable, Internal $(, $variant)*);
    };
    ($(#[$doc:meta])* $name:ident = [$($variant:ident),+ $(,)?]) => {
        $crate::openapi::refusals!(@list $(#[$doc])* $name $(, $variant)+);
    };
    (@list $(#[$doc:meta])* $name:ident $(, $variant:ident)+) => {
        $(#[$doc])*
        pub(crate) struct $name;

        impl utoipa::IntoResponses for $name {
            fn responses() -> std::collections::BTreeMap<
                String,
                utoipa::openapi::RefOr<utoipa::openapi::response::Response>,
            > {
                $crate::openapi::problem_responses(|error| {
                    matches!(error, $($crate::error::ApiError::$variant { .. })|+)
                })
            }
        }
    };
}
pub(crate) use refusals;

/// The problem answers of the [`ApiError`] variants `answers` selects, one
/// response per status, each code with its example and explanation; the
/// replay of a compacted refusal too when one of them is stored against
/// the key.
pub(crate) fn problem_responses(
    answers: impl Fn(&ApiError) -> bool,
) -> BTreeMap<String, RefOr<Response>> {
    let mut refusals: Vec<Refusal> = every_error()
        .into_iter()
        .filter(|e| answers(e))
        .map(Refusal::Api)
        .collect();
    if refusals.iter().any(Refusal::is_stored) {
        refusals.push(Refusal::Compacted);
    }
    let mut by_status: BTreeMap<u16, Vec<Refusal>> = BTreeMap::new();
    for refusal in refusals {
        by_status
            .entry(refusal.status().as_u16())
            .or_default()
            .push(refusal);
    }
    let mut responses = BTreeMap::new();
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
        let description = refusals
            .iter()
            .map(|r| format!("- `{}`: {}", r.code(), r.explain()))
            .collect::<Vec<_>>()
            .join("\n");
        let mut response = ResponseBuilder::new()
            .description(description)
            .content("application/problem+json", content)
            .build();
        if refusals.iter().any(Refusal::is_stored) {
            response
                .headers
                .insert(H_REPLAYED.into(), header_ref(H_REPLAYED));
        }
        if status == 401 {
            response
                .headers
                .insert(H_AUTHENTICATE.into(), header_ref(H_AUTHENTICATE));
        }
        if status == 409 || status == 429 || status == 503 {
            response
                .headers
                .insert(H_RETRY_AFTER.into(), header_ref(H_RETRY_AFTER));
        }
        responses.insert(status.to_string(), RefOr::T(response));
    }
    responses
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
