//! The payments endpoints (docs/http-api.md §6).

use crate::error::ApiError;
use crate::extract::{Account, Fields, JsonObject, KeyHeader, Params};
use crate::keyed::{self, Begun, Keyed};
use crate::{AppState, views};
use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use cobro_core::{
    AccountId, Amount, CaptureMethod, Currency, IntentName, Operation, OrderRef, PaymentId,
    PaymentStatus, RefundId,
};
use cobro_settle::hold_cancel;
use cobro_store::idempotency::ResourceType;
use cobro_store::payments::RefundRefusal;
use cobro_store::{NewPayment, NewRefund, PaymentFilter, WriteTx};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::time::Duration;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

pub(crate) fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(create_payment, list_payments))
        .routes(routes!(get_payment))
        .routes(routes!(capture_payment))
        .routes(routes!(cancel_payment))
        .routes(routes!(create_refund))
        .routes(routes!(get_refund))
}

/// Body of `POST /v1/payments`. `null` reads as absent.
// In the code: the request after validation and normalisation (defaults
// applied, currency upper-cased), exactly what the fingerprint covers. It
// is read field by field (`parse_create`) so that every invalid field is
// reported at once; its schema states the request a client sends.
#[derive(Serialize, Debug, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = CreatePaymentRequest)]
struct CreatePayment {
    /// The merchant's own identity of the order: 1 to 128 of `[A-Za-z0-9._:-]`.
    #[schema(
        value_type = String,
        min_length = 1,
        max_length = 128,
        pattern = r"^[A-Za-z0-9._:-]{1,128}$",
        example = "pedido-842"
    )]
    order_ref: OrderRef,
    #[schema(value_type = crate::openapi::AmountSchema)]
    amount: i64,
    /// ISO 4217 alpha-3 code that cobro knows (see `Currency`), in any
    /// case: `eur` is `EUR`. Answers carry it upper-cased.
    #[schema(value_type = crate::openapi::CurrencyInputSchema, example = "EUR")]
    currency: Currency,
    /// The provider's payment method token: 1 to 128 visible ASCII characters.
    #[schema(
        min_length = 1,
        max_length = 128,
        pattern = "^[!-~]{1,128}$",
        example = "pm_card_visa"
    )]
    payment_method: String,
    /// `automatic` (default): the money moves at authorisation.
    /// `manual`: authorise now, capture later (or cancel).
    #[schema(value_type = Option<crate::openapi::CaptureMethodSchema>, default = "automatic")]
    capture_method: CaptureMethod,
    /// Free text for the merchant, at most 1000 characters, without
    /// U+0000.
    #[schema(max_length = 1000, pattern = "^[^\\u0000]*$")]
    description: Option<String>,
    /// At most 20 keys; keys 1 to 40 characters, values strings of at most 500.
    #[schema(schema_with = crate::openapi::metadata_schema, required = false)]
    metadata: BTreeMap<String, String>,
    /// Where the provider sends the customer back after authenticating
    /// (3-D Secure): an absolute `https` (or `http`) URL of at most 2048
    /// characters, without credentials. Part of the request: a replay of
    /// the key with another `return_url` is refused.
    #[schema(
        format = "uri",
        max_length = 2048,
        example = "https://shop.example/pedido-842/vuelta"
    )]
    #[serde(skip_serializing_if = "Option::is_none")]
    return_url: Option<String>,
}

/// Capture and cancel take no fields: an empty body (or only
/// whitespace) or `{}`.
// In the code: what their fingerprint covers of the body. The document
// marks every request body of this schema optional.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct EmptyBody {}

const CREATE_FIELDS: &[&str] = &[
    "order_ref",
    "amount",
    "currency",
    "payment_method",
    "capture_method",
    "description",
    "metadata",
    "return_url",
];

fn parse_create(body: JsonObject) -> Result<CreatePayment, ApiError> {
    let mut f = Fields::new(body.0, CREATE_FIELDS);
    let order_ref = f.string("order_ref", true).and_then(|s| {
        OrderRef::parse(&s)
            .map_err(|e| f.error("order_ref", e.to_string()))
            .ok()
    });
    let amount = f.integer("amount", true).and_then(|n| {
        Amount::new(n)
            .map_err(|e| f.error("amount", e.to_string()))
            .ok()
    });
    let currency = f.string("currency", true).and_then(|s| {
        Currency::parse(&s)
            .map_err(|e| f.error("currency", e.to_string()))
            .ok()
    });
    let payment_method = f.string("payment_method", true).and_then(|s| {
        let ok = (1..=128).contains(&s.len()) && s.bytes().all(|b| (0x21..=0x7e).contains(&b));
        if !ok {
            f.error(
                "payment_method",
                "must be 1 to 128 visible ASCII characters",
            );
        }
        ok.then_some(s)
    });
    let capture_method = match f.string("capture_method", false).as_deref() {
        None | Some("automatic") => Some(CaptureMethod::Automatic),
        Some("manual") => Some(CaptureMethod::Manual),
        Some(_) => {
            f.error("capture_method", "must be \"automatic\" or \"manual\"");
            None
        }
    };
    let description = f.string("description", false);
    if description
        .as_ref()
        .is_some_and(|d| d.chars().count() > 1000)
    {
        f.error("description", "must be at most 1000 characters");
    }
    let mut metadata = BTreeMap::new();
    if let Some(map) = f.object("metadata") {
        if map.len() > 20 {
            f.error("metadata", "at most 20 keys");
        }
        for (k, v) in map {
            match v {
                serde_json::Value::String(s)
                    if (1..=40).contains(&k.chars().count()) && s.chars().count() <= 500 =>
                {
                    metadata.insert(k, s);
                }
                _ => f.error(
                    &format!("metadata.{k}"),
                    "keys are 1 to 40 characters, values strings of at most 500",
                ),
            }
        }
    }
    let return_url = f.string("return_url", false);
    if let Some(url) = &return_url
        && let Err(why) = check_return_url(url)
    {
        f.error("return_url", why);
    }
    let parsed = (order_ref, amount, currency, payment_method, capture_method);
    f.finish()?;
    match parsed {
        (
            Some(order_ref),
            Some(amount),
            Some(currency),
            Some(payment_method),
            Some(capture_method),
        ) => Ok(CreatePayment {
            order_ref,
            amount: amount.minor_units(),
            currency,
            payment_method,
            capture_method,
            description,
            metadata,
            return_url,
        }),
        _ => Err(ApiError::Validation(vec![])),
    }
}

/// The longest `return_url` taken (browsers and providers handle far
/// longer; a redirect target has no need to).
const RETURN_URL_MAX: usize = 2048;

/// A `return_url` the provider can send a customer's browser to: absolute,
/// `https` or `http`, with a host, without credentials, at most
/// [`RETURN_URL_MAX`] characters.
fn check_return_url(raw: &str) -> Result<(), &'static str> {
    const WHAT: &str = "must be an absolute https or http URL with a host, without credentials, \
                        of at most 2048 characters";
    if raw.len() > RETURN_URL_MAX || raw.trim() != raw {
        return Err(WHAT);
    }
    let url = url::Url::parse(raw).map_err(|_| WHAT)?;
    let ok = matches!(url.scheme(), "https" | "http")
        && url.host_str().is_some_and(|h| !h.is_empty())
        && url.username().is_empty()
        && url.password().is_none();
    if ok { Ok(()) } else { Err(WHAT) }
}

/// Commits a keyed success that enqueued provider work (its answer stored
/// against the key), then wakes the in-process worker.
async fn commit_and_wake(
    state: &AppState,
    tx: WriteTx,
    keyed: &Keyed,
    status: StatusCode,
    body: &impl Serialize,
    location: Option<String>,
) -> Result<Response, ApiError> {
    let response = keyed::commit(
        tx,
        keyed,
        (status, to_json(body)?, "application/json"),
        location,
        state.settings.test_hold.as_ref(),
    )
    .await?;
    state.work_available.notify_one();
    Ok(response)
}

/// Names the payment, intent and attempt a handler opened on its span.
fn record_intent(
    payment: &PaymentId,
    intent: &impl std::fmt::Display,
    attempt: &cobro_store::AttemptRow,
) {
    let span = tracing::Span::current();
    span.record("payment_id", tracing::field::display(payment));
    span.record("intent", tracing::field::display(intent));
    span.record("attempt_id", tracing::field::display(attempt.id));
}

fn to_json(value: &impl Serialize) -> Result<Vec<u8>, ApiError> {
    serde_json::to_vec(value).map_err(ApiError::internal)
}

fn parse_payment_id(raw: &str) -> Result<PaymentId, ApiError> {
    // An id that cannot exist is simply not found.
    raw.parse().map_err(|_| ApiError::NotFound)
}

/// How many times a create tries its insert when the payment that blocked
/// it is no longer active by the time it is read.
const CREATE_ROUNDS: u32 = 3;

crate::openapi::refusals!(
    /// What `create_payment` refuses.
    CreatePaymentRefusals = keyed [OrderHasActivePayment]
);

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
        content = CreatePayment,
        content_type = "application/json",
        description = "At most 16 KiB. Unknown fields are refused.",
    ),
    responses(
        (status = 201, description = "Created: the payment in `processing` (with its first attempt). Replays answer the same status; a replay of a tombstone answers the payment as it is now.",
            body = views::PaymentView,
            headers(("Location" = String, description = "`/v1/payments/{id}` of the payment, on the first answer and on replays."))),
        CreatePaymentRefusals,
    ),
)]
#[tracing::instrument(
    name = "payment.create",
    skip_all,
    fields(payment_id = tracing::field::Empty, intent = tracing::field::Empty, attempt_id = tracing::field::Empty)
)]
async fn create_payment(
    State(state): State<AppState>,
    account: Account,
    KeyHeader(key): KeyHeader,
    body: JsonObject,
) -> Result<Response, ApiError> {
    let request = parse_create(body)?;
    let keyed = Keyed::new(
        account,
        Operation::Authorize,
        key,
        &BTreeMap::new(),
        &request,
    )?;
    let payment_id = PaymentId::new();
    // Decided before the transaction, from rules and circuits read at
    // most every few seconds: the hot path gains no statement.
    let facts = cobro_core::routing::Facts {
        amount: request.amount,
        currency: request.currency.code(),
        capture_method: request.capture_method,
        payment_method: &request.payment_method,
    };
    let route = state
        .routing
        .route(&state, account.0, payment_id, &facts)
        .await?;
    let (provider, route) = match route {
        Some((provider, route)) => (Some(provider), Some(route.to_json())),
        None => (None, None),
    };
    let mut tx = match keyed::begin(
        &state,
        &keyed,
        (ResourceType::Payment, payment_id.as_uuid()),
    )
    .await?
    {
        Begun::Answered(response) => return Ok(response),
        Begun::Fresh(tx) => tx,
    };
    let now = state.clock.now();
    let default_provider = state.settings.default_provider.as_deref();
    let mut round = 0;
    let (row, intent) = loop {
        round += 1;
        let sequence = tx
            .next_intent_sequence(account.0, &request.order_ref, Operation::Authorize)
            .await?;
        let intent = IntentName::new(&request.order_ref, Operation::Authorize, sequence);
        let new = NewPayment {
            id: payment_id,
            account: account.0,
            order_ref: request.order_ref.clone(),
            intent: intent.clone(),
            amount: request.amount,
            currency: request.currency,
            capture_method: request.capture_method,
            payment_method: request.payment_method.clone(),
            description: request.description.clone(),
            metadata: serde_json::to_string(&request.metadata).map_err(ApiError::internal)?,
            return_url: request.return_url.clone(),
            provider: provider.clone(),
            route: route.clone(),
        };
        if let Some(row) = tx.insert_payment_for(&new, default_provider, now).await? {
            break (row, intent);
        }
        // The order has an active payment: named as this transaction reads
        // it, held until the answer (never looked up after a rollback, when
        // it may have failed and the refusal would name nobody). Not stored
        // against the key: the client may use it again once that payment
        // fails.
        if let Some(blocking) = tx
            .lock_active_payment_for_account(account.0, &request.order_ref)
            .await?
        {
            tx.rollback().await?;
            return Err(ApiError::OrderHasActivePayment {
                payment_id: blocking,
            });
        }
        // The payment that blocked the insert has left the active statuses
        // since: the order is free, and the create goes ahead in the same
        // transaction, its key still reserved. Bounded: the first round's
        // `next_intent_sequence` holds every other create of the order
        // until this transaction ends, so a second round meets no new
        // payment; the bound stays as a guard.
        if round == CREATE_ROUNDS {
            tx.rollback().await?;
            tracing::warn!(
                rounds = round,
                "the order's active payment changed under every round of the create; answering 503"
            );
            return Err(ApiError::Unavailable(None));
        }
    };
    let attempt = tx
        .open_intent(account.0, row.id, None, Operation::Authorize, &intent, now)
        .await?;
    record_intent(&payment_id, &intent, &attempt);
    let response = commit_and_wake(
        &state,
        tx,
        &keyed,
        StatusCode::CREATED,
        &views::payment(&row, Some(&[attempt])),
        Some(format!("/v1/payments/{payment_id}")),
    )
    .await?;
    tracing::info!(payment_id = %payment_id, intent = %intent, "payment created");
    Ok(response)
}

/// A payment with its attempts, as GET answers it.
pub(crate) async fn load_payment(
    state: &AppState,
    account: AccountId,
    id: PaymentId,
) -> Result<Option<views::PaymentView>, ApiError> {
    Ok(state
        .store
        .payment_with_attempts_for_account(account, id)
        .await?
        .map(|(row, attempts)| views::payment(&row, Some(&attempts))))
}

pub(crate) async fn load_refund_by_id(
    state: &AppState,
    account: AccountId,
    id: RefundId,
) -> Result<Option<views::RefundView>, ApiError> {
    Ok(state
        .store
        .refund_for_account(account, id)
        .await?
        .map(|r| views::refund(&r)))
}

#[derive(Deserialize)]
struct WaitQuery {
    wait: Option<String>,
}

/// The longest `?wait=` a client may ask for.
const MAX_WAIT_SECONDS: u64 = 30;

crate::openapi::refusals!(
    /// What `get_payment` refuses.
    GetPaymentRefusals = read [Validation, NotFound]
);

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
        (status = 200, description = "The payment, with its attempts.", body = views::PaymentView),
        GetPaymentRefusals,
    ),
)]
async fn get_payment(
    State(state): State<AppState>,
    account: Account,
    Path(id): Path<String>,
    Params(query): Params<WaitQuery>,
) -> Result<Response, ApiError> {
    let id = parse_payment_id(&id)?;
    let wait = match query.wait.as_deref() {
        None => 0,
        Some(raw) => match raw.parse::<u64>() {
            Ok(n) if n <= MAX_WAIT_SECONDS => n,
            _ => {
                return Err(ApiError::Validation(vec![crate::error::FieldError::new(
                    "wait",
                    format!("must be a whole number of seconds from 0 to {MAX_WAIT_SECONDS}"),
                )]));
            }
        },
    };
    // Long poll: re-read whenever the store says a payment may have left
    // `processing` (a commit of this process, or any process's on
    // PostgreSQL), until this one has or the wait ends. The re-read every
    // `long_poll_fallback` covers a broken listener.
    // Always answered before the request timeout would cut it off.
    let wait = Duration::from_secs(wait).min(
        state
            .settings
            .request_timeout
            .saturating_sub(Duration::from_secs(1)),
    );
    let deadline = tokio::time::Instant::now() + wait;
    // Subscribed before the first read, so a move between the read and the
    // wait is not missed.
    let mut moves = state.store.payment_moves();
    loop {
        let view = load_payment(&state, account.0, id)
            .await?
            .ok_or(ApiError::NotFound)?;
        if view.status != PaymentStatus::Processing.as_str()
            || tokio::time::Instant::now() >= deadline
        {
            return Ok(Json(view).into_response());
        }
        let next_poll =
            deadline.min(tokio::time::Instant::now() + state.settings.long_poll_fallback);
        tokio::select! {
            // An error means the store is gone: the re-read will say so.
            _ = moves.changed() => {}
            () = tokio::time::sleep_until(next_poll) => {}
        }
    }
}

#[derive(Deserialize)]
struct ListQuery {
    order_ref: Option<String>,
    status: Option<String>,
    limit: Option<String>,
    cursor: Option<String>,
}

/// A page of payments, newest first.
#[derive(Serialize, ToSchema)]
struct PaymentList {
    /// The payments of this page, without `attempts`.
    data: Vec<views::PaymentView>,
    /// Pass as `cursor` for the next (older) page; `null` when this page
    /// is not full. A full last page still carries a cursor, whose page
    /// is empty.
    next_cursor: Option<String>,
}

crate::openapi::refusals!(
    /// What `list_payments` refuses.
    ListPaymentsRefusals = read [Validation]
);

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
        ("status" = Option<crate::openapi::PaymentStatusSchema>, Query, description = "Only payments in this status."),
        ("limit" = Option<u32>, Query, minimum = 1, maximum = 100, description = "Page size, 1 to 100; default 20."),
        ("cursor" = Option<String>, Query, format = Uuid, description = "`next_cursor` of the previous page: answers the next (older) page."),
    ),
    responses(
        (status = 200, description = "A page of payments, newest first.", body = PaymentList),
        ListPaymentsRefusals,
    ),
)]
async fn list_payments(
    State(state): State<AppState>,
    account: Account,
    Params(q): Params<ListQuery>,
) -> Result<Json<PaymentList>, ApiError> {
    let mut errors = Vec::new();
    let mut bad =
        |field: &str, message: &str| errors.push(crate::error::FieldError::new(field, message));
    let status = q.status.as_deref().and_then(|s| {
        let parsed = PaymentStatus::parse(s);
        if parsed.is_none() {
            bad("status", "unknown payment status");
        }
        parsed
    });
    let limit = match q.limit.as_deref().map(str::parse::<u32>) {
        None => 20,
        Some(Ok(n)) if (1..=100).contains(&n) => n,
        Some(_) => {
            bad("limit", "must be from 1 to 100");
            20
        }
    };
    let before = q.cursor.as_deref().and_then(|c| {
        let parsed = c.parse::<PaymentId>().ok();
        if parsed.is_none() {
            bad("cursor", "is not a cursor this API returned");
        }
        parsed
    });
    if !errors.is_empty() {
        return Err(ApiError::Validation(errors));
    }
    let filter = PaymentFilter {
        order_ref: q.order_ref,
        status,
        before,
        limit,
    };
    let rows = state.store.payments_for_account(account.0, &filter).await?;
    let next_cursor = (rows.len() == limit as usize)
        .then(|| rows.last().map(|r| r.id.to_string()))
        .flatten();
    Ok(Json(PaymentList {
        data: rows.iter().map(|r| views::payment(r, None)).collect(),
        next_cursor,
    }))
}

/// How a capture or cancel starts.
enum Start {
    /// The key's stored answer (a replay, or a refusal of the key).
    Answered(Response),
    Fresh(Box<Operating>),
}

/// A capture or cancel under way: its key, the payment as this
/// transaction locked it, the time it is decided at.
struct Operating {
    keyed: Keyed,
    id: PaymentId,
    tx: WriteTx,
    current: cobro_store::PaymentRow,
    now: chrono::DateTime<chrono::Utc>,
}

/// The common start of capture and cancel: the key, the fingerprint over
/// the payment id and the (empty) body, the transaction, and the payment
/// locked in it. Decided from the row this transaction holds: a refusal
/// stored against the key must never rest on a read a worker has already
/// overtaken.
async fn begin_payment_operation(
    state: &AppState,
    account: Account,
    key: cobro_core::IdempotencyKey,
    id: &str,
    operation: Operation,
    body: JsonObject,
) -> Result<Start, ApiError> {
    let id = parse_payment_id(id)?;
    Fields::new(body.0, &[]).finish()?;
    let mut path = BTreeMap::new();
    path.insert("payment_id", id.to_string());
    let keyed = Keyed::new(account, operation, key, &path, &EmptyBody {})?;
    let mut tx = match keyed::begin(state, &keyed, (ResourceType::Payment, id.as_uuid())).await? {
        Begun::Answered(response) => return Ok(Start::Answered(response)),
        Begun::Fresh(tx) => tx,
    };
    let now = state.clock.now();
    let Some(current) = tx.lock_payment_for_account(account.0, id).await? else {
        return Err(ApiError::NotFound);
    };
    Ok(Start::Fresh(Box::new(Operating {
        keyed,
        id,
        tx,
        current,
        now,
    })))
}

/// Commits a capture or cancel accepted with the payment as `row` (202).
async fn accepted(
    state: &AppState,
    tx: WriteTx,
    keyed: &Keyed,
    row: &cobro_store::PaymentRow,
) -> Result<Response, ApiError> {
    commit_and_wake(
        state,
        tx,
        keyed,
        StatusCode::ACCEPTED,
        &views::payment(row, None),
        None,
    )
    .await
}

crate::openapi::refusals!(
    /// What `capture_payment` refuses.
    CapturePaymentRefusals = keyed [NotFound, NotCapturable]
);

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
        (status = 202, description = "Accepted: the payment in `capturing`, without `attempts`.", body = views::PaymentView),
        CapturePaymentRefusals,
    ),
)]
#[tracing::instrument(
    name = "payment.capture",
    skip_all,
    fields(payment_id = tracing::field::Empty, intent = tracing::field::Empty, attempt_id = tracing::field::Empty)
)]
async fn capture_payment(
    State(state): State<AppState>,
    account: Account,
    KeyHeader(key): KeyHeader,
    Path(id): Path<String>,
    body: JsonObject,
) -> Result<Response, ApiError> {
    let Operating {
        keyed,
        id,
        mut tx,
        current,
        now,
    } = match begin_payment_operation(&state, account, key, &id, Operation::Capture, body).await? {
        Start::Answered(response) => return Ok(response),
        Start::Fresh(operating) => *operating,
    };
    let moved = if current.status == PaymentStatus::Authorized {
        tx.transition_payment(
            account.0,
            id,
            PaymentStatus::Authorized,
            PaymentStatus::Capturing,
            now,
        )
        .await?
    } else {
        None
    };
    let Some(row) = moved else {
        let refusal = ApiError::NotCapturable {
            payment_id: id.to_string(),
            status: current.status.to_string(),
        };
        return keyed::commit_refusal(tx, &keyed, refusal).await;
    };
    let intent = tx
        .next_intent_name(account.0, &row.order_ref, Operation::Capture)
        .await?;
    let attempt = tx
        .open_intent(account.0, row.id, None, Operation::Capture, &intent, now)
        .await?;
    record_intent(&id, &intent, &attempt);
    accepted(&state, tx, &keyed, &row).await
}

crate::openapi::refusals!(
    /// What `cancel_payment` refuses.
    CancelPaymentRefusals = keyed [NotFound, NotCancelable]
);

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
        (status = 202, description = "Accepted: the payment in `canceling`, or in its pending status with `cancel_requested: true`; without `attempts`.", body = views::PaymentView),
        CancelPaymentRefusals,
    ),
)]
#[tracing::instrument(
    name = "payment.cancel",
    skip_all,
    fields(payment_id = tracing::field::Empty, intent = tracing::field::Empty, attempt_id = tracing::field::Empty)
)]
async fn cancel_payment(
    State(state): State<AppState>,
    account: Account,
    KeyHeader(key): KeyHeader,
    Path(id): Path<String>,
    body: JsonObject,
) -> Result<Response, ApiError> {
    let Operating {
        keyed,
        id,
        mut tx,
        current,
        now,
    } = match begin_payment_operation(&state, account, key, &id, Operation::Cancel, body).await? {
        Start::Answered(response) => return Ok(response),
        Start::Fresh(operating) => *operating,
    };
    let status = current.status;
    let manual = current.capture_method == CaptureMethod::Manual;
    let refusal = || ApiError::NotCancelable {
        payment_id: id.to_string(),
        status: current.status.to_string(),
    };
    let row = if status == PaymentStatus::Authorized {
        let Some(row) = tx
            .transition_payment(
                account.0,
                id,
                PaymentStatus::Authorized,
                PaymentStatus::Canceling,
                now,
            )
            .await?
        else {
            return Err(ApiError::internal(cobro_store::StoreError::Corrupt(
                "the locked payment moved".into(),
            )));
        };
        // A cancel already held (asked while the authorisation was
        // unknown) is the one that runs: one cancel intent, not two.
        let held = tx.held_attempts_for_account(account.0, id).await?;
        match held.iter().find(|a| a.operation == Operation::Cancel) {
            Some(attempt) => {
                tx.release_held(attempt.id, now).await?;
            }
            None => {
                let intent = tx
                    .next_intent_name(account.0, &row.order_ref, Operation::Cancel)
                    .await?;
                tx.open_intent(account.0, row.id, None, Operation::Cancel, &intent, now)
                    .await?;
            }
        }
        row
    } else if status.authorisation_pending()
        && manual
        && authorisation_open(&mut tx, account.0, id).await?
    {
        // The authorisation outcome is not known yet: the cancel becomes an
        // intent of its own, its attempt `held` until the authorisation is
        // proven; then it runs once, or ends with the payment's truth
        // (cobro_settle::apply). A second request finds it already held.
        let held = tx.held_attempts_for_account(account.0, id).await?;
        if !held.iter().any(|a| a.operation == Operation::Cancel) {
            hold_cancel(&mut tx, account.0, &current, now).await?;
        }
        match tx.request_cancel(account.0, id, status, now).await? {
            Some(row) => row,
            None => {
                return Err(ApiError::internal(cobro_store::StoreError::Corrupt(
                    "the locked payment moved".into(),
                )));
            }
        }
    } else {
        // Automatic-capture payments move money at authorisation: they are
        // refunded, not canceled.
        return keyed::commit_refusal(tx, &keyed, refusal()).await;
    };
    accepted(&state, tx, &keyed, &row).await
}

/// Whether the payment's authorisation outcome is still unknown (its
/// authorize attempt unresolved): only then is a cancel held. A payment in
/// `needs_review` for another reason (a capture escalated, a conflict)
/// refuses the cancel instead of holding it forever.
async fn authorisation_open(
    tx: &mut WriteTx,
    account: AccountId,
    payment: PaymentId,
) -> Result<bool, ApiError> {
    Ok(tx
        .attempts_of_payment_for_account(account, payment)
        .await?
        .iter()
        .any(|a| a.operation == Operation::Authorize && a.state.is_unresolved()))
}

/// Body of `POST /v1/payments/{id}/refunds`. `null` reads as absent.
// In the code: the request after validation, what the fingerprint covers.
#[derive(Serialize, Debug, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = CreateRefundRequest)]
struct CreateRefund {
    /// Minor units to refund; the sum of refunds that are not failed may
    /// not exceed the captured amount.
    #[schema(value_type = crate::openapi::AmountSchema)]
    amount: i64,
    /// Free text, at most 500 characters, without U+0000.
    #[schema(max_length = 500, pattern = "^[^\\u0000]*$")]
    reason: Option<String>,
    /// The merchant's own identity of this refund, unique per payment:
    /// 1 to 128 of `A-Z a-z 0-9 . _ : -`. A second refund with the same
    /// reference is refused (409 `refund-reference-exists`) under any key,
    /// however late, so a retry after the key's record expired never
    /// refunds twice.
    #[schema(min_length = 1, max_length = 128, pattern = "^[A-Za-z0-9._:-]+$")]
    #[serde(skip_serializing_if = "Option::is_none")]
    reference: Option<String>,
}

crate::openapi::refusals!(
    /// What `create_refund` refuses.
    CreateRefundRefusals = keyed [NotFound, NotRefundable, RefundExceedsCaptured, RefundReferenceExists]
);

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
    request_body(content = CreateRefund, content_type = "application/json",
        description = "At most 16 KiB. Unknown fields are refused."),
    responses(
        (status = 201, description = "Created: the refund in `processing`. A replay of a tombstone answers the refund as it is now.",
            body = views::RefundView,
            headers(("Location" = String, description = "`/v1/payments/{id}/refunds/{refund_id}`. Sent on the first answer only: replays of a refund do not carry it."))),
        CreateRefundRefusals,
    ),
)]
#[tracing::instrument(
    name = "refund.create",
    skip_all,
    fields(payment_id = tracing::field::Empty, intent = tracing::field::Empty, attempt_id = tracing::field::Empty)
)]
async fn create_refund(
    State(state): State<AppState>,
    account: Account,
    KeyHeader(key): KeyHeader,
    Path(id): Path<String>,
    body: JsonObject,
) -> Result<Response, ApiError> {
    let id = parse_payment_id(&id)?;
    let mut f = Fields::new(body.0, &["amount", "reason", "reference"]);
    let amount = f.integer("amount", true).and_then(|n| {
        Amount::new(n)
            .map_err(|e| f.error("amount", e.to_string()))
            .ok()
    });
    let reason = f.string("reason", false);
    if reason.as_ref().is_some_and(|r| r.chars().count() > 500) {
        f.error("reason", "must be at most 500 characters");
    }
    let reference = f.string("reference", false);
    if reference
        .as_deref()
        .is_some_and(|r| OrderRef::parse(r).is_err())
    {
        f.error(
            "reference",
            "must be 1 to 128 characters from A-Z a-z 0-9 . _ : -",
        );
    }
    f.finish()?;
    let request = CreateRefund {
        amount: amount.map(|a| a.minor_units()).unwrap_or_default(),
        reason,
        reference,
    };
    let mut path = BTreeMap::new();
    path.insert("payment_id", id.to_string());
    let keyed = Keyed::new(account, Operation::Refund, key, &path, &request)?;
    let refund_id = RefundId::new();
    let mut tx =
        match keyed::begin(&state, &keyed, (ResourceType::Refund, refund_id.as_uuid())).await? {
            Begun::Answered(response) => return Ok(response),
            Begun::Fresh(tx) => tx,
        };
    let now = state.clock.now();
    // Locked first: the decision and the intent count below are made from
    // the row this transaction holds, serialised with concurrent refunds.
    if tx.lock_payment_for_account(account.0, id).await?.is_none() {
        return Err(ApiError::NotFound);
    }
    if let Some(reference) = &request.reference
        && let Some(existing) = tx.refund_by_reference(account.0, id, reference).await?
    {
        let error = ApiError::RefundReferenceExists {
            payment_id: id.to_string(),
            refund_id: existing.id.to_string(),
        };
        return keyed::commit_refusal(tx, &keyed, error).await;
    }
    match tx
        .reserve_refund(account.0, id, request.amount, now)
        .await?
    {
        Ok(()) => {}
        Err(RefundRefusal::NotFound) => return Err(ApiError::NotFound),
        Err(refusal) => {
            let current = tx
                .lock_payment_for_account(account.0, id)
                .await?
                .ok_or(ApiError::NotFound)?;
            let error = if refusal == RefundRefusal::ExceedsCaptured {
                ApiError::RefundExceedsCaptured {
                    payment_id: id.to_string(),
                }
            } else {
                ApiError::NotRefundable {
                    payment_id: id.to_string(),
                    status: current.status.to_string(),
                }
            };
            return keyed::commit_refusal(tx, &keyed, error).await;
        }
    }
    let payment = tx
        .lock_payment_for_account(account.0, id)
        .await?
        .ok_or(ApiError::NotFound)?;
    let intent = tx
        .next_intent_name(account.0, &payment.order_ref, Operation::Refund)
        .await?;
    let refund = tx
        .insert_refund(
            &NewRefund {
                id: refund_id,
                account: account.0,
                payment: id,
                intent: intent.clone(),
                amount: request.amount,
                reason: request.reason.clone(),
                reference: request.reference.clone(),
            },
            now,
        )
        .await?;
    let attempt = tx
        .open_intent(
            account.0,
            payment.id,
            Some(refund_id),
            Operation::Refund,
            &intent,
            now,
        )
        .await?;
    record_intent(&id, &intent, &attempt);
    let response = commit_and_wake(
        &state,
        tx,
        &keyed,
        StatusCode::CREATED,
        &views::refund(&refund),
        Some(format!("/v1/payments/{id}/refunds/{refund_id}")),
    )
    .await?;
    Ok(response)
}

crate::openapi::refusals!(
    /// What `get_refund` refuses.
    GetRefundRefusals = read [NotFound]
);

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
    responses(
        (status = 200, description = "The refund.", body = views::RefundView),
        GetRefundRefusals,
    ),
)]
async fn get_refund(
    State(state): State<AppState>,
    account: Account,
    Path((id, refund_id)): Path<(String, String)>,
) -> Result<Json<views::RefundView>, ApiError> {
    let id = parse_payment_id(&id)?;
    let refund_id: RefundId = refund_id.parse().map_err(|_| ApiError::NotFound)?;
    let row = state
        .store
        .refund_for_account(account.0, refund_id)
        .await?
        // A refund of another of the account's payments is not found here.
        .filter(|r| r.payment_id == id)
        .ok_or(ApiError::NotFound)?;
    Ok(Json(views::refund(&row)))
}
