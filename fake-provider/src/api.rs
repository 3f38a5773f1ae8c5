//! The provider's HTTP API and the one path every request takes through
//! faults and idempotency.
//!
//! Order of a request: authenticate; under the lock pick its faults and claim
//! its idempotency key (both in one critical section, so "the latency rule has
//! fired" implies "the key is reserved", which tests rely on); sleep a latency
//! fault; run the effect under the lock and store the real answer; then
//! sabotage what the caller receives if an after-effect fault fired.

use std::sync::Arc;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, RawQuery, State};
use axum::http::header::{AUTHORIZATION, CONTENT_TYPE};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::de::DeserializeOwned;

use crate::faults::{FaultAction, Operation, Picked};
use crate::idempotency::Claim;
use crate::model::{
    ApiError, CaptureParams, NewResource, SearchFilter, StoredResponse, VoidParams,
};
use crate::server::drop_connection;
use crate::state::{Ctx, Shared, State as ProviderState};

/// Header set on answers replayed from an idempotency key.
pub const REPLAYED_HEADER: &str = "Idempotent-Replayed";

type AppState = State<Arc<Shared>>;

/// The provider API routes.
pub(crate) fn routes() -> Router<Arc<Shared>> {
    Router::new()
        .route("/v1/charges", post(create_charge).get(search_charges))
        .route("/v1/charges/{id}", get(get_charge))
        .route("/v1/charges/{id}/capture", post(capture_charge))
        .route("/v1/charges/{id}/void", post(void_charge))
        .route("/v1/refunds", post(create_refund).get(search_refunds))
        .route("/v1/refunds/{id}", get(get_refund))
}

async fn create_charge(State(shared): AppState, headers: HeaderMap, body: Bytes) -> Response {
    let route = "POST /v1/charges";
    create(
        &shared,
        &headers,
        &body,
        Operation::Charge,
        route,
        ProviderState::create_charge,
    )
    .await
}

async fn create_refund(State(shared): AppState, headers: HeaderMap, body: Bytes) -> Response {
    let route = "POST /v1/refunds";
    create(
        &shared,
        &headers,
        &body,
        Operation::Refund,
        route,
        ProviderState::refund,
    )
    .await
}

/// POST of a new charge or refund: the body's reference is what fault rules
/// match on.
async fn create<P: NewResource>(
    shared: &Shared,
    headers: &HeaderMap,
    body: &[u8],
    operation: Operation,
    route: &str,
    effect: fn(&mut ProviderState, P, Ctx<'_>) -> StoredResponse,
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
    let effect = |state: &mut ProviderState, params, ctx: Ctx<'_>| state.capture(&id, params, ctx);
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
    let effect = |state: &mut ProviderState, _, ctx: Ctx<'_>| state.void(&id, ctx);
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
async fn mutate<P>(
    shared: &Shared,
    headers: &HeaderMap,
    body: &[u8],
    post: Post,
    params: Result<P, ApiError>,
    canonical: impl FnOnce(&P) -> String,
    effect: impl FnOnce(&mut ProviderState, P, Ctx<'_>) -> StoredResponse,
) -> Response {
    let fingerprint = || fingerprint(&post.route, params.as_ref().map(canonical), body);
    let call = match Call::mutation(post.operation, headers, fingerprint) {
        Ok(call) => call,
        Err(error) => return error.into_response(),
    };
    execute(shared, call, post.subject, |state, ctx| match params {
        Ok(params) => effect(state, params, ctx),
        Err(error) => error.into_stored(),
    })
    .await
}

async fn get_charge(
    State(shared): AppState,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let subject = Subject::Charge(id.clone());
    read(&shared, &headers, Operation::Get, subject, |state, ctx| {
        state.get_charge(&id, ctx)
    })
    .await
}

async fn get_refund(
    State(shared): AppState,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let subject = Subject::Refund(id.clone());
    read(&shared, &headers, Operation::Get, subject, |state, ctx| {
        state.get_refund(&id, ctx)
    })
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
    match Call::read(operation, headers) {
        Ok(call) => execute(shared, call, subject, |state, ctx| run(state, ctx)).await,
        Err(error) => error.into_response(),
    }
}

async fn search_charges(
    State(shared): AppState,
    headers: HeaderMap,
    RawQuery(query): RawQuery,
) -> Response {
    search(&shared, &headers, query, ProviderState::search_charges).await
}

async fn search_refunds(
    State(shared): AppState,
    headers: HeaderMap,
    RawQuery(query): RawQuery,
) -> Response {
    search(&shared, &headers, query, ProviderState::search_refunds).await
}

/// `reference=R` and/or `metadata[KEY]=VALUE` filters, parsed from the raw
/// query (axum's `Query` cannot read `metadata[KEY]` into a map). Fault rules
/// match the `reference` filter; a metadata-only search has no reference.
async fn search(
    shared: &Shared,
    headers: &HeaderMap,
    query: Option<String>,
    run: fn(&ProviderState, &SearchFilter, Ctx<'_>) -> StoredResponse,
) -> Response {
    let call = match Call::read(Operation::Search, headers) {
        Ok(call) => call,
        Err(error) => return error.into_response(),
    };
    let filter = match SearchFilter::parse(query.as_deref()) {
        Ok(filter) => filter,
        Err(error) => return error.into_response(),
    };
    let subject = Subject::Reference(filter.reference.clone());
    execute(shared, call, subject, |state, ctx| run(state, &filter, ctx)).await
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

/// Who is calling and with which key.
struct Call<'h> {
    operation: Operation,
    /// The bearer token, borrowed from the request headers.
    caller: &'h str,
    key: Option<IdempotencyKey>,
}

struct IdempotencyKey {
    /// `caller \n key`: keys are private to their caller.
    scope: String,
    /// The key alone, for the ledger.
    key: String,
    fingerprint: String,
}

impl<'h> Call<'h> {
    fn read(operation: Operation, headers: &'h HeaderMap) -> Result<Self, ApiError> {
        Ok(Self {
            operation,
            caller: caller(headers)?,
            key: None,
        })
    }

    /// `fingerprint` runs only when the request carries a key.
    fn mutation(
        operation: Operation,
        headers: &'h HeaderMap,
        fingerprint: impl FnOnce() -> String,
    ) -> Result<Self, ApiError> {
        let caller = caller(headers)?;
        let Some(key) = headers.get("idempotency-key") else {
            return Ok(Self {
                operation,
                caller,
                key: None,
            });
        };
        let key = match key.to_str() {
            Ok(key) if !key.is_empty() && key.len() <= 255 => key,
            _ => {
                let error = ApiError::invalid(
                    "Idempotency-Key",
                    "must be 1 to 255 visible ASCII characters",
                );
                return Err(error);
            }
        };
        let scope = format!("{caller}\n{key}");
        Ok(Self {
            operation,
            caller,
            key: Some(IdempotencyKey {
                scope,
                key: key.to_owned(),
                fingerprint: fingerprint(),
            }),
        })
    }
}

/// `Authorization: Bearer <non-empty>`; the token is the caller's identity.
fn caller(headers: &HeaderMap) -> Result<&str, ApiError> {
    headers
        .get(AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.strip_prefix("Bearer "))
        .map(str::trim)
        .filter(|token| !token.is_empty())
        .ok_or_else(|| {
            ApiError::new(
                StatusCode::UNAUTHORIZED,
                "authentication_error",
                "unauthorized",
                "send Authorization: Bearer <key>",
            )
        })
}

/// What fault rules match on for this request. Owned, because the effect
/// closure takes the parsed parameters the reference comes from.
enum Subject {
    Reference(Option<String>),
    Charge(String),
    Refund(String),
}

impl Subject {
    /// For an id: the reference of `caller`'s object, none for another
    /// caller's (exactly as for an id that does not exist).
    fn reference<'s>(&'s self, state: &'s ProviderState, caller: &str) -> Option<&'s str> {
        match self {
            Subject::Reference(reference) => reference.as_deref(),
            Subject::Charge(id) => state.charge_reference(id, caller),
            Subject::Refund(id) => state.refund_reference(id, caller),
        }
    }
}

/// What the first critical section decided.
enum Next {
    /// Answer now (fault, idempotency conflict or replay).
    Answer(StoredResponse, bool),
    /// Run the effect (after the latency fault, if any).
    Effect,
    /// The effect already ran in the first critical section.
    Done(StoredResponse),
}

/// Frees a reserved key if the request ends without storing an answer (the
/// client went away during a latency fault), so the key does not stay "in
/// progress" forever.
struct Reservation<'a> {
    shared: &'a Shared,
    scope: Option<String>,
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if let Some(scope) = self.scope.take() {
            self.shared.lock().keys.release(&scope);
        }
    }
}

async fn execute(
    shared: &Shared,
    call: Call<'_>,
    subject: Subject,
    effect: impl FnOnce(&mut ProviderState, Ctx<'_>) -> StoredResponse,
) -> Response {
    let now = shared.clock.now();
    let ctx = Ctx {
        now,
        caller: call.caller,
        key: call.key.as_ref().map(|k| k.key.as_str()),
    };
    let mut reservation = Reservation {
        shared,
        scope: None,
    };
    let mut effect = Some(effect);
    let (picked, next) = {
        let mut guard = shared.lock();
        let state = &mut *guard;
        let picked = if state.faults.is_empty() {
            Picked::default()
        } else {
            let reference = subject.reference(state, call.caller).map(str::to_owned);
            state
                .faults
                .pick(call.operation, reference.as_deref(), &mut state.fault_rng)
        };
        let next = match (picked.outcome, &call.key) {
            (Some((FaultAction::FailBeforeEffect, _)), _) => Next::Answer(unavailable(), false),
            (Some((FaultAction::InProgress, _)), _) => Next::Answer(in_progress(), false),
            (_, Some(key)) => match state.keys.claim(&key.scope, &key.fingerprint, now) {
                Claim::Replay(response) => Next::Answer(response, true),
                Claim::Mismatch => Next::Answer(key_mismatch(), false),
                Claim::Busy => Next::Answer(in_progress(), false),
                Claim::Reserved => {
                    reservation.scope = Some(key.scope.clone());
                    Next::Effect
                }
            },
            (_, None) => Next::Effect,
        };
        // Fast path: no latency, so the effect runs in the same critical
        // section as the claim (one lock per request).
        let next = match (next, picked.latency, effect.take()) {
            (Next::Effect, None, Some(run)) => {
                Next::Done(run_effect(state, &mut reservation, ctx, run))
            }
            (next, _, unused) => {
                effect = unused;
                next
            }
        };
        (picked, next)
    };
    if let Some(latency) = picked.latency {
        tokio::time::sleep(latency).await;
    }
    let (response, replayed) = match next {
        Next::Answer(response, replayed) => {
            // Faults that stop the request before its effect are final.
            if matches!(
                picked.outcome,
                Some((FaultAction::FailBeforeEffect | FaultAction::InProgress, _))
            ) {
                return respond(response, false);
            }
            (response, replayed)
        }
        Next::Done(response) => (response, false),
        Next::Effect => match effect.take() {
            Some(run) => (
                run_effect(&mut shared.lock(), &mut reservation, ctx, run),
                false,
            ),
            None => (unavailable(), false),
        },
    };
    match picked.outcome {
        Some((FaultAction::FailAfterEffect, _)) => respond(internal_error(), false),
        Some((FaultAction::DropResponseAfterEffect, _)) => drop_connection(),
        Some((FaultAction::DelayAfterEffect, delay)) => {
            tokio::time::sleep(delay).await;
            respond(response, replayed)
        }
        _ => respond(response, replayed),
    }
}

/// Runs the effect and stores its real answer under the reserved key.
fn run_effect(
    state: &mut ProviderState,
    reservation: &mut Reservation<'_>,
    ctx: Ctx<'_>,
    run: impl FnOnce(&mut ProviderState, Ctx<'_>) -> StoredResponse,
) -> StoredResponse {
    let response = run(state, ctx);
    if let Some(scope) = reservation.scope.take() {
        state.keys.complete(&scope, &response, ctx.now);
    }
    response
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        respond(self.into_stored(), false)
    }
}

fn respond(response: StoredResponse, replayed: bool) -> Response {
    let mut http = (response.status, Body::from(response.body)).into_response();
    let headers = http.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    if replayed {
        headers.insert(REPLAYED_HEADER, HeaderValue::from_static("true"));
    }
    http
}

fn unavailable() -> StoredResponse {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "api_error",
        "service_unavailable",
        "injected fault: fail_before_effect",
    )
    .into_stored()
}

fn internal_error() -> StoredResponse {
    ApiError::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "api_error",
        "internal_error",
        "injected fault: fail_after_effect",
    )
    .into_stored()
}

fn in_progress() -> StoredResponse {
    ApiError::new(
        StatusCode::CONFLICT,
        "idempotency_error",
        "idempotency_in_progress",
        "a request with this idempotency key is still being processed",
    )
    .into_stored()
}

fn key_mismatch() -> StoredResponse {
    ApiError::new(
        StatusCode::BAD_REQUEST,
        "idempotency_error",
        "idempotency_error",
        "this idempotency key was used with different parameters",
    )
    .into_stored()
}
