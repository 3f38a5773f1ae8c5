//! The fake dialect: the provider's own JSON API, a translation of the
//! engine (`state`) to and from JSON through the one request path
//! (`pipeline`).
//!
//! `/v1/refunds` and `/v1/refunds/{id}` are Stripe's paths too: a request
//! there that speaks Stripe (see [`stripe::speaks_stripe`]) is handed to the
//! Stripe dialect; everything else on them is answered here, as before.

use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::de::DeserializeOwned;

use crate::faults::Operation;
use crate::model::{
    ApiError, CaptureParams, Charge, ChargeParams, List, ListPage, Listed, Lookup, NewResource,
    RefundParams, StoredResponse, VoidParams,
};
use crate::pipeline::{Call, Dialect, Outcome, Subject, execute, execute_holding};
use crate::state::{Ctx, Page, RefundRefused, Refused, Shared, State as ProviderState};
use crate::stripe;

type AppState = State<Arc<Shared>>;

/// The provider API routes (the fake's, plus the Stripe dialect's).
pub(crate) fn routes() -> Router<Arc<Shared>> {
    Router::new()
        .route("/v1/charges", post(create_charge).get(search_charges))
        .route("/v1/charges/{id}", get(get_charge))
        .route("/v1/charges/{id}/capture", post(capture_charge))
        .route("/v1/charges/{id}/void", post(void_charge))
        .route("/v1/refunds", post(create_refund).get(search_refunds))
        .route("/v1/refunds/{id}", get(get_refund))
        .merge(stripe::routes())
}

async fn create_charge(State(shared): AppState, headers: HeaderMap, body: Bytes) -> Response {
    let effect = |state: &mut ProviderState, params: ChargeParams, ctx: Ctx<'_>| {
        let at = state.searchable_at(Operation::Charge, &params.reference, ctx.now);
        charge_created(state.create_charge(params, ctx, at))
    };
    create(
        &shared,
        &headers,
        &body,
        Operation::Charge,
        "POST /v1/charges",
        effect,
    )
    .await
}

async fn create_refund(State(shared): AppState, headers: HeaderMap, body: Bytes) -> Response {
    if stripe::speaks_stripe(&headers) {
        return stripe::create_refund(&shared, &headers, &body).await;
    }
    let effect = |state: &mut ProviderState, params: RefundParams, ctx: Ctx<'_>| {
        let at = state.searchable_at(Operation::Refund, &params.reference, ctx.now);
        let (charge, amount) = (params.charge.clone(), params.amount);
        match state.refund(params, ctx, at) {
            Ok(refund) => StoredResponse::json(StatusCode::CREATED, &refund),
            Err(RefundRefused::Missing) => ApiError::missing("charge", &charge).into_stored(),
            Err(RefundRefused::Exceeds { refundable }) => {
                let message = format!(
                    "refund of {amount} exceeds the {refundable} captured and not yet refunded"
                );
                ApiError::new(
                    StatusCode::BAD_REQUEST,
                    "invalid_request_error",
                    "refund_exceeds_captured",
                    message,
                )
                .into_stored()
            }
        }
    };
    create(
        &shared,
        &headers,
        &body,
        Operation::Refund,
        "POST /v1/refunds",
        effect,
    )
    .await
}

/// A new charge as the fake answers it: 201 (`processing` included: its
/// outcome is not known yet), or 402 carrying the declined charge.
fn charge_created(charge: Charge) -> StoredResponse {
    match charge.decline() {
        None => StoredResponse::json(StatusCode::CREATED, &charge),
        Some(decline) => ApiError::new(
            StatusCode::PAYMENT_REQUIRED,
            "card_error",
            decline.code,
            decline.message,
        )
        .into_stored_with(Some(&charge)),
    }
}

/// POST of a new charge or refund: the body's reference is what fault rules
/// match on.
async fn create<P: NewResource + Send + 'static>(
    shared: &Shared,
    headers: &HeaderMap,
    body: &[u8],
    operation: Operation,
    route: &str,
    effect: impl FnOnce(&mut ProviderState, P, Ctx<'_>) -> StoredResponse + Send + 'static,
) -> Response {
    let params = parse_body(body).and_then(|p: P| p.validate().map(|()| p));
    let reference = params.as_ref().ok().map(|p| p.reference().to_owned());
    let post = Post {
        operation,
        route: route.to_owned(),
        subject: Subject::Reference(reference),
    };
    mutate(shared, headers, body, post, params, P::fingerprint, effect).await
}

async fn capture_charge(
    State(shared): AppState,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let post = Post {
        operation: Operation::Capture,
        route: format!("POST /v1/charges/{id}/capture"),
        subject: Subject::Charge(id.clone()),
    };
    let canonical = |p: &CaptureParams| format!("{:?}", p.amount);
    let effect = move |state: &mut ProviderState, params: CaptureParams, ctx: Ctx<'_>| {
        changed(
            &id,
            "charge_not_capturable",
            state.capture(&id, params.amount, ctx),
        )
    };
    mutate(
        &shared,
        &headers,
        &body,
        post,
        parse_optional_body(&body),
        canonical,
        effect,
    )
    .await
}

async fn void_charge(
    State(shared): AppState,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let post = Post {
        operation: Operation::Void,
        route: format!("POST /v1/charges/{id}/void"),
        subject: Subject::Charge(id.clone()),
    };
    let params: Result<VoidParams, _> = parse_optional_body(&body);
    let effect = move |state: &mut ProviderState, _, ctx: Ctx<'_>| {
        changed(&id, "charge_not_voidable", state.void(&id, ctx))
    };
    mutate(
        &shared,
        &headers,
        &body,
        post,
        params,
        |_| String::new(),
        effect,
    )
    .await
}

/// A capture or void as the fake answers it: 200 with the charge, or the
/// refusal (carrying the charge when its state is the reason).
fn changed(id: &str, not_allowed: &'static str, result: Result<Charge, Refused>) -> StoredResponse {
    match result {
        Ok(charge) => StoredResponse::json(StatusCode::OK, &charge),
        Err(Refused::Missing) => ApiError::missing("charge", id).into_stored(),
        Err(Refused::Amount) => ApiError::invalid(
            "amount",
            "capture amount must be positive and at most the authorized amount",
        )
        .into_stored(),
        Err(Refused::State(charge)) => {
            let message = format!("charge {} is {}", charge.id, charge.status.as_str());
            ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                not_allowed,
                message,
            )
            .into_stored_with(Some(&*charge))
        }
    }
}

/// What identifies a POST for faults and idempotency.
struct Post {
    operation: Operation,
    /// Method and path: part of the key's fingerprint, so one key cannot be
    /// reused for another charge's capture.
    route: String,
    subject: Subject,
}

/// The shape every POST shares: fingerprint the parameters (only when a key
/// is sent), authenticate, then run the effect through [`execute`]. A body
/// that failed to parse or validate still goes through `execute`, so its 400
/// is stored under the key and replayed like any other 4xx.
async fn mutate<P: Send + 'static>(
    shared: &Shared,
    headers: &HeaderMap,
    body: &[u8],
    post: Post,
    params: Result<P, ApiError>,
    canonical: impl FnOnce(&P) -> String,
    effect: impl FnOnce(&mut ProviderState, P, Ctx<'_>) -> StoredResponse + Send + 'static,
) -> Response {
    let fingerprint = || fingerprint(&post.route, params.as_ref().map(canonical), body);
    let call = match Call::mutation(Dialect::Fake, post.operation, headers, fingerprint) {
        Ok(call) => call,
        Err(refusal) => return *refusal,
    };
    execute_holding(shared, call, post.subject, move |state, ctx| match params {
        Ok(params) => Outcome::Executed(effect(state, params, ctx)),
        Err(error) => Outcome::Refused(error.into_stored()),
    })
    .await
}

async fn get_charge(
    State(shared): AppState,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let subject = Subject::Charge(id.clone());
    read(
        &shared,
        &headers,
        Operation::Get,
        subject,
        |state, ctx| match state.charge(&id, ctx.caller) {
            Some(charge) => StoredResponse::json(StatusCode::OK, charge),
            None => ApiError::missing("charge", &id).into_stored(),
        },
    )
    .await
}

async fn get_refund(
    State(shared): AppState,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    if stripe::speaks_stripe(&headers) {
        return stripe::get_refund(&shared, &headers, id).await;
    }
    let subject = Subject::Refund(id.clone());
    read(
        &shared,
        &headers,
        Operation::Get,
        subject,
        |state, ctx| match state.refund_of(&id, ctx.caller) {
            Some(refund) => StoredResponse::json(StatusCode::OK, refund),
            None => ApiError::missing("refund", &id).into_stored(),
        },
    )
    .await
}

/// A GET: authenticated, subject to faults, no idempotency key.
async fn read(
    shared: &Shared,
    headers: &HeaderMap,
    operation: Operation,
    subject: Subject,
    run: impl FnOnce(&ProviderState, Ctx<'_>) -> StoredResponse,
) -> Response {
    match Call::read(Dialect::Fake, operation, headers) {
        Ok(call) => {
            execute(shared, call, subject, |state, ctx| {
                Outcome::Executed(run(state, ctx))
            })
            .await
        }
        Err(refusal) => *refusal,
    }
}

async fn search_charges(
    State(shared): AppState,
    headers: HeaderMap,
    RawQuery(query): RawQuery,
) -> Response {
    let lookup = Lookup::parse(query.as_deref(), Listed::Charges);
    lookup_objects(
        &shared,
        &headers,
        lookup,
        |state, lookup, ctx| match lookup {
            Lookup::Search(filter) => {
                let found = state.charges.search(
                    ctx.caller,
                    filter.reference.as_deref(),
                    filter.first_metadata(),
                    ctx.now,
                    |charge| filter.matches(&charge.reference, &charge.metadata),
                );
                list(found)
            }
            Lookup::List(query) => {
                let page = state.charges.page(
                    ctx.caller,
                    |_| true,
                    query.starting_after.as_deref(),
                    |charge| query.created.contains(charge.created),
                    query.limit(),
                );
                list_page(page, "charge", query.starting_after.as_deref())
            }
        },
    )
    .await
}

async fn search_refunds(
    State(shared): AppState,
    headers: HeaderMap,
    RawQuery(query): RawQuery,
) -> Response {
    if stripe::speaks_stripe(&headers) {
        return stripe::list_refunds(&shared, &headers, query).await;
    }
    let lookup = Lookup::parse(query.as_deref(), Listed::Refunds);
    lookup_objects(
        &shared,
        &headers,
        lookup,
        |state, lookup, ctx| match lookup {
            Lookup::Search(filter) => {
                let found = state.refunds.search(
                    ctx.caller,
                    filter.reference.as_deref(),
                    filter.first_metadata(),
                    ctx.now,
                    |refund| filter.matches(&refund.reference, &refund.metadata),
                );
                list(found)
            }
            Lookup::List(query) => {
                let charge = query.charge.as_deref();
                if let Some(charge) = charge
                    && state.charge(charge, ctx.caller).is_none()
                {
                    return ApiError::missing("charge", charge).into_stored();
                }
                let page = state.refunds.page(
                    ctx.caller,
                    |refund| charge.is_none_or(|charge| refund.charge == charge),
                    query.starting_after.as_deref(),
                    |refund| query.created.contains(refund.created),
                    query.limit(),
                );
                list_page(page, "refund", query.starting_after.as_deref())
            }
        },
    )
    .await
}

/// `{"object":"list","data":[...]}` of what a search found.
fn list<'a, T: serde::Serialize + 'a>(found: impl Iterator<Item = &'a T>) -> StoredResponse {
    let list = List {
        object: "list",
        data: found.collect(),
    };
    StoredResponse::json(StatusCode::OK, &list)
}

/// `{"object":"list","data":[...],"has_more":...}`, or 400
/// `resource_missing` for a `starting_after` that is not in the list.
fn list_page<T: serde::Serialize>(
    page: Option<Page<'_, T>>,
    what: &str,
    starting_after: Option<&str>,
) -> StoredResponse {
    match page {
        Some(page) => StoredResponse::json(
            StatusCode::OK,
            &ListPage {
                object: "list",
                data: page.data,
                has_more: page.has_more,
            },
        ),
        None => ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "resource_missing",
            format!(
                "starting_after: no such {what} in this list: {}",
                starting_after.unwrap_or_default()
            ),
        )
        .into_stored(),
    }
}

/// A search (`reference=R` and/or `metadata[KEY]=VALUE`, operation
/// `search`, subject to search lag) or a list (operation `list`, strongly
/// consistent), parsed from the raw query (axum's `Query` cannot read
/// `metadata[KEY]` into a map). Fault rules match the `reference` filter
/// of a search (a metadata-only search has none) and the charge of a
/// refund list; a charge list has no reference.
async fn lookup_objects(
    shared: &Shared,
    headers: &HeaderMap,
    lookup: Result<Lookup, ApiError>,
    run: impl FnOnce(&ProviderState, &Lookup, Ctx<'_>) -> StoredResponse,
) -> Response {
    let operation = match &lookup {
        Ok(Lookup::List(_)) => Operation::List,
        _ => Operation::Search,
    };
    // Authentication first: a bad query of an unknown caller is a 401.
    let call = match Call::read(Dialect::Fake, operation, headers) {
        Ok(call) => call,
        Err(refusal) => return *refusal,
    };
    let lookup = match lookup {
        Ok(lookup) => lookup,
        Err(error) => return error.into_response(),
    };
    let subject = match &lookup {
        Lookup::Search(filter) => Subject::Reference(filter.reference.clone()),
        Lookup::List(query) => match &query.charge {
            Some(charge) => Subject::Charge(charge.clone()),
            None => Subject::Reference(None),
        },
    };
    execute(shared, call, subject, |state, ctx| {
        Outcome::Executed(run(state, &lookup, ctx))
    })
    .await
}

/// Parses a JSON body.
fn parse_body<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|error| ApiError::from_json(&error))
}

/// Parses a body that may be absent: a bodiless capture or void means `{}`.
fn parse_optional_body<T: DeserializeOwned + Default>(body: &[u8]) -> Result<T, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    parse_body(body)
}

/// What the key remembers about a request: the operation and path, plus the
/// parsed parameters in fixed order, or the raw body when it did not parse.
fn fingerprint(route: &str, canonical: Result<String, &ApiError>, raw: &[u8]) -> String {
    match canonical {
        Ok(canonical) => format!("{route}\n{canonical}"),
        Err(_) => format!("{route}\nraw:{}", String::from_utf8_lossy(raw)),
    }
}
