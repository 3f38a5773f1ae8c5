//! The one path every API request takes through faults and idempotency,
//! whichever dialect it speaks.
//!
//! Order of a request: authenticate; under the lock pick its faults and claim
//! its idempotency key (both in one critical section, so "the latency rule has
//! fired" implies "the key is reserved", which tests rely on); sleep a latency
//! fault; run the effect under the lock and store the answer under the key;
//! then sabotage what the caller receives if an after-effect fault fired.
//!
//! A [`Dialect`] only decides how the pipeline's own answers look (401, the
//! fault answers, 409, the idempotency error, 429), which headers go on every
//! answer, and two documented differences in what a key saves: the fake saves
//! refusals of a request that never reached its effect (bad parameters),
//! Stripe does not ("results are only saved if an API endpoint started
//! executing"); and on `fail_after_effect` the fake saves the real answer
//! while Stripe saves the 500 it sent, as Stripe's idempotency layer does.

use axum::body::Body;
use axum::http::header::{AUTHORIZATION, CONTENT_TYPE};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

use crate::faults::{FaultAction, Operation, Picked};
use crate::idempotency::Claim;
use crate::model::{ApiError, StoredResponse};
use crate::server::drop_connection;
use crate::state::{Ctx, Shared, State as ProviderState};
use crate::stripe::{self, StripeError};
use chrono::{DateTime, Utc};

/// Header set on answers replayed from an idempotency key.
pub const REPLAYED_HEADER: &str = "Idempotent-Replayed";

/// Header carrying the request's id (`req_...`) on every Stripe answer.
pub const REQUEST_ID_HEADER: &str = "Request-Id";

/// Header telling a Stripe client whether to retry (`true`/`false`), where
/// Stripe sends it.
pub const SHOULD_RETRY_HEADER: &str = "Stripe-Should-Retry";

/// Which API a request speaks: how the pipeline's own answers look.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Dialect {
    /// The fake provider's own JSON API.
    Fake,
    /// Stripe's form-encoded API.
    Stripe,
}

impl Dialect {
    /// Whether a key saves the refusal of a request that never reached its
    /// effect (it failed to parse or validate).
    fn saves_refusals(self) -> bool {
        self == Dialect::Fake
    }

    /// What a key saves when a `fail_after_effect` fault sends a 500 after
    /// the effect: the fake saves the real answer (so a retry converges),
    /// Stripe the 500 itself (its layer caches 500s; a retry with the same
    /// key gets the same 500, and only a read can tell what happened).
    fn saved_after_failure(self, real: StoredResponse, no_retry: bool) -> StoredResponse {
        match self {
            Dialect::Fake => real,
            Dialect::Stripe => self.fail_after_effect(no_retry),
        }
    }

    fn unauthenticated(self) -> StoredResponse {
        match self {
            Dialect::Fake => ApiError::new(
                StatusCode::UNAUTHORIZED,
                "authentication_error",
                "unauthorized",
                "send Authorization: Bearer <key>",
            )
            .into_stored(),
            Dialect::Stripe => StripeError::unauthenticated().into_stored(),
        }
    }

    fn invalid_key(self) -> StoredResponse {
        match self {
            Dialect::Fake => ApiError::invalid(
                "Idempotency-Key",
                "must be 1 to 255 visible ASCII characters",
            )
            .into_stored(),
            Dialect::Stripe => StripeError::invalid_idempotency_key().into_stored(),
        }
    }

    fn fail_before_effect(self) -> StoredResponse {
        match self {
            Dialect::Fake => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "api_error",
                "service_unavailable",
                "injected fault: fail_before_effect",
            )
            .into_stored(),
            // Nothing ran and nothing was saved: retrying is safe and useful.
            Dialect::Stripe => StripeError::api_error("injected fault: fail_before_effect")
                .into_stored()
                .with_retry(true),
        }
    }

    /// The 500 of a `fail_after_effect` fault; `no_retry` (the
    /// `fail_after_effect_no_retry` fault): in Stripe's dialect it says
    /// `Stripe-Should-Retry: false`.
    fn fail_after_effect(self, no_retry: bool) -> StoredResponse {
        match self {
            Dialect::Fake => ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "api_error",
                "internal_error",
                "injected fault: fail_after_effect",
            )
            .into_stored(),
            // No retry hint: the key replays this same 500.
            Dialect::Stripe if !no_retry => {
                StripeError::api_error("injected fault: fail_after_effect").into_stored()
            }
            Dialect::Stripe => StripeError::api_error("injected fault: fail_after_effect_no_retry")
                .into_stored()
                .with_retry(false),
        }
    }

    fn in_progress(self) -> StoredResponse {
        match self {
            Dialect::Fake => ApiError::new(
                StatusCode::CONFLICT,
                "idempotency_error",
                "idempotency_in_progress",
                "a request with this idempotency key is still being processed",
            )
            .into_stored(),
            Dialect::Stripe => StripeError::key_in_use().into_stored().with_retry(true),
        }
    }

    fn key_mismatch(self, key: &str) -> StoredResponse {
        match self {
            Dialect::Fake => ApiError::new(
                StatusCode::BAD_REQUEST,
                "idempotency_error",
                "idempotency_error",
                "this idempotency key was used with different parameters",
            )
            .into_stored(),
            Dialect::Stripe => StripeError::key_mismatch(key)
                .into_stored()
                .with_retry(false),
        }
    }

    fn rate_limited(self) -> StoredResponse {
        match self {
            Dialect::Fake => ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "invalid_request_error",
                "rate_limit",
                "injected fault: rate_limit",
            )
            .into_stored(),
            Dialect::Stripe => StripeError::rate_limited().into_stored(),
        }
    }

    /// `Authorization: Bearer <token>`; the token is the caller's identity.
    /// The fake takes any non-empty token, Stripe a test secret key
    /// (`sk_test_...`), so a live key can never reach the fake.
    fn caller(self, headers: &HeaderMap) -> Option<&str> {
        let token = headers
            .get(AUTHORIZATION)
            .and_then(|value| value.to_str().ok())
            .and_then(|value| value.strip_prefix("Bearer "))
            .map(str::trim)
            .filter(|token| !token.is_empty())?;
        match self {
            Dialect::Fake => Some(token),
            Dialect::Stripe => stripe::is_test_key(token).then_some(token),
        }
    }
}

/// Who is calling, with which key, in which dialect.
pub(crate) struct Call<'h> {
    dialect: Dialect,
    operation: Operation,
    /// The bearer token, borrowed from the request headers.
    caller: &'h str,
    key: Option<IdempotencyKey>,
    /// Stripe's `Request-Id` of this request (none in the fake dialect).
    request_id: Option<String>,
    /// A `hold_effect` fault may hold this request (see [`execute_holding`]).
    holdable: bool,
}

struct IdempotencyKey {
    /// `caller \n key`: keys are private to their caller.
    scope: String,
    /// The key alone, for the ledger.
    key: String,
    fingerprint: String,
}

impl<'h> Call<'h> {
    /// A GET: no idempotency key (Stripe ignores one on GETs, and so does
    /// the fake). A refusal is the whole answer (boxed: it is large and
    /// rare).
    pub(crate) fn read(
        dialect: Dialect,
        operation: Operation,
        headers: &'h HeaderMap,
    ) -> Result<Self, Box<Response>> {
        let request_id = new_request_id(dialect);
        let Some(caller) = dialect.caller(headers) else {
            let refusal = respond(dialect, dialect.unauthenticated(), false, request_id);
            return Err(Box::new(refusal));
        };
        Ok(Self {
            dialect,
            operation,
            caller,
            key: None,
            request_id,
            holdable: false,
        })
    }

    /// A POST; `fingerprint` runs only when the request carries a key.
    pub(crate) fn mutation(
        dialect: Dialect,
        operation: Operation,
        headers: &'h HeaderMap,
        fingerprint: impl FnOnce() -> String,
    ) -> Result<Self, Box<Response>> {
        let mut call = Self::read(dialect, operation, headers)?;
        let Some(key) = headers.get("idempotency-key") else {
            return Ok(call);
        };
        let key = match key.to_str() {
            Ok(key) if !key.is_empty() && key.len() <= 255 => key,
            _ => {
                let refusal = dialect.invalid_key();
                return Err(Box::new(respond(dialect, refusal, false, call.request_id)));
            }
        };
        call.key = Some(IdempotencyKey {
            scope: format!("{}\n{key}", call.caller),
            key: key.to_owned(),
            fingerprint: fingerprint(),
        });
        Ok(call)
    }

    /// Answers `response` now, outside the pipeline (e.g. a query that does
    /// not parse), with this dialect's headers.
    pub(crate) fn refuse(self, response: StoredResponse) -> Response {
        respond(self.dialect, response, false, self.request_id)
    }
}

/// A request id, `req_` and 14 random alphanumerics, for Stripe answers.
/// Not drawn from the seeded streams: ids of objects stay reproducible
/// whatever the number of requests.
fn new_request_id(dialect: Dialect) -> Option<String> {
    (dialect == Dialect::Stripe).then(|| {
        let uuid = uuid::Uuid::new_v4().simple().to_string();
        format!("req_{}", &uuid[..14])
    })
}

/// What fault rules match on for this request. Owned, because the effect
/// closure takes the parsed parameters the reference comes from.
pub(crate) enum Subject {
    Reference(Option<String>),
    Charge(String),
    Refund(String),
    /// A Stripe PaymentIntent: its reference.
    Intent(String),
}

impl Subject {
    /// For an id: the reference of `caller`'s object, none for another
    /// caller's (exactly as for an id that does not exist).
    fn reference<'s>(&'s self, state: &'s ProviderState, caller: &str) -> Option<&'s str> {
        match self {
            Subject::Reference(reference) => reference.as_deref(),
            Subject::Charge(id) => state.charge_reference(id, caller),
            Subject::Refund(id) => state.refund_reference(id, caller),
            Subject::Intent(id) => state.stripe.intent_reference(id, caller),
        }
    }
}

/// What an effect did.
pub(crate) enum Outcome {
    /// The request reached its effect (which may still refuse: a decline, a
    /// state that forbids it, an unknown id). Saved under the key.
    Executed(StoredResponse),
    /// The request was refused before any effect (its parameters did not
    /// parse or validate). Saved under the key in the fake dialect only.
    Refused(StoredResponse),
}

/// What the first critical section decided.
enum Next {
    /// Answer now (fault, idempotency conflict or replay).
    Answer(StoredResponse, bool),
    /// Run the effect (after the latency fault, if any).
    Effect,
    /// The effect already ran in the first critical section.
    Done(StoredResponse),
    /// A `hold_effect` fault: the effect waits for its release.
    Hold,
}

/// The effect of a request held by a `hold_effect` fault.
pub(crate) type HeldEffect = Box<dyn FnOnce(&mut ProviderState, Ctx<'_>) -> Outcome + Send>;

/// The key a held request reserved, if it carried one: its scope
/// (`caller \n key`) and the key.
type HeldKey = Option<(String, String)>;

/// A request held by a `hold_effect` fault: its key stays reserved until
/// its effect is made ([`release`]) or the request outlives the provider's
/// key retention and is abandoned ([`abandon_expired`]).
pub(crate) struct Held {
    caller: String,
    key: HeldKey,
    run: HeldEffect,
    /// When the request arrived (the provider's clock).
    arrived: DateTime<Utc>,
}

impl std::fmt::Debug for Held {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Held")
            .field("key", &self.key.as_ref().map(|(_, key)| key))
            .finish_non_exhaustive()
    }
}

/// Drops, without an effect, every held request that arrived a key
/// retention or more before `now`, and frees the key each reserved. No
/// provider acts on a request after it has forgotten the request's key:
/// its idempotency promise could no longer hold (a retry under the key
/// would make a second effect). That bound is what makes a consistent read
/// taken past it a proof of absence (docs/proof-of-absence.md, "How long a
/// request lives"). Says how many were dropped.
pub(crate) fn abandon_expired(state: &mut ProviderState, now: DateTime<Utc>) -> usize {
    let retention = state.keys.retention();
    let (expired, kept): (Vec<Held>, Vec<Held>) = std::mem::take(&mut state.held)
        .into_iter()
        .partition(|h| now - h.arrived >= retention);
    state.held = kept;
    for held in &expired {
        if let Some((scope, _)) = &held.key {
            state.keys.release(scope);
        }
    }
    expired.len()
}

/// Makes a held request's effect now, as if it had just arrived, and saves
/// its answer under the key it reserved (no one is there to receive it).
pub(crate) fn release(shared: &Shared, held: Held) {
    let Held {
        caller, key, run, ..
    } = held;
    let (scope, key) = key.unzip();
    let mut reservation = Reservation { shared, scope };
    let ctx = Ctx {
        now: shared.clock.now(),
        caller: &caller,
        key: key.as_deref(),
        request_id: None,
    };
    let mut state = shared.lock();
    state.settle_due(ctx.now);
    run_effect(
        &mut state,
        &mut reservation,
        ctx,
        Dialect::Fake,
        Picked::default(),
        run,
    );
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

/// Runs `effect` for `call` through faults and idempotency and answers.
pub(crate) async fn execute(
    shared: &Shared,
    call: Call<'_>,
    subject: Subject,
    effect: impl FnOnce(&mut ProviderState, Ctx<'_>) -> Outcome,
) -> Response {
    run_call(shared, call, subject, effect).await.0
}

/// [`execute`] for a request that a `hold_effect` fault may hold: then its
/// effect is kept for [`release`] and the caller's connection is closed
/// without an answer.
pub(crate) async fn execute_holding(
    shared: &Shared,
    mut call: Call<'_>,
    subject: Subject,
    effect: impl FnOnce(&mut ProviderState, Ctx<'_>) -> Outcome + Send + 'static,
) -> Response {
    call.holdable = true;
    let caller = call.caller.to_owned();
    let (response, held) = run_call(shared, call, subject, effect).await;
    if let Some((run, key)) = held {
        let held = Held {
            caller,
            key,
            run: Box::new(run),
            arrived: shared.clock.now(),
        };
        shared.lock().held.push(held);
    }
    response
}

/// The pipeline; with the effect given back, unrun, and the key it holds
/// reserved, when a `hold_effect` fault held the request.
async fn run_call<F: FnOnce(&mut ProviderState, Ctx<'_>) -> Outcome>(
    shared: &Shared,
    call: Call<'_>,
    subject: Subject,
    effect: F,
) -> (Response, Option<(F, HeldKey)>) {
    let dialect = call.dialect;
    let now = shared.clock.now();
    let ctx = Ctx {
        now,
        caller: call.caller,
        key: call.key.as_ref().map(|k| k.key.as_str()),
        request_id: call.request_id.as_deref(),
    };
    let mut reservation = Reservation {
        shared,
        scope: None,
    };
    let mut effect = Some(effect);
    let (picked, next) = {
        let mut guard = shared.lock();
        let state = &mut *guard;
        // Whatever this request reads or changes, `processing` charges
        // whose time has come are final before it.
        state.settle_due(now);
        let picked = if state.faults.is_empty() {
            Picked::default()
        } else {
            let reference = subject.reference(state, call.caller).map(str::to_owned);
            state
                .faults
                .pick(call.operation, reference.as_deref(), &mut state.fault_rng)
        };
        let next = match (picked.outcome, &call.key) {
            (Some((FaultAction::RateLimit, _)), _) => Next::Answer(dialect.rate_limited(), false),
            (Some((FaultAction::FailBeforeEffect, _)), _) => {
                Next::Answer(dialect.fail_before_effect(), false)
            }
            (Some((FaultAction::HoldEffect, _)), _) if !call.holdable => {
                Next::Answer(dialect.fail_before_effect(), false)
            }
            (Some((FaultAction::HoldEffect, _)), None) => Next::Hold,
            // Stripe saves the 500 of an endpoint that began executing; the
            // fake saves no 5xx.
            (Some((FaultAction::FailSavedBeforeEffect, _)), Some(key))
                if dialect == Dialect::Stripe =>
            {
                match state.keys.claim(&key.scope, &key.fingerprint, now) {
                    Claim::Replay(response) => Next::Answer(response, true),
                    Claim::Mismatch => Next::Answer(dialect.key_mismatch(&key.key), false),
                    Claim::Busy => Next::Answer(dialect.in_progress(), false),
                    Claim::Reserved => {
                        let failed =
                            StripeError::api_error("injected fault: fail_saved_before_effect")
                                .into_stored()
                                .with_retry(false);
                        state.keys.complete(&key.scope, &failed, now);
                        Next::Answer(failed, false)
                    }
                }
            }
            (Some((FaultAction::FailSavedBeforeEffect, _)), _) => {
                Next::Answer(dialect.fail_before_effect(), false)
            }
            (Some((FaultAction::InProgress, _)), _) => Next::Answer(dialect.in_progress(), false),
            (_, Some(key)) => match state.keys.claim(&key.scope, &key.fingerprint, now) {
                Claim::Replay(response) => Next::Answer(response, true),
                Claim::Mismatch => Next::Answer(dialect.key_mismatch(&key.key), false),
                Claim::Busy => Next::Answer(dialect.in_progress(), false),
                Claim::Reserved => {
                    reservation.scope = Some(key.scope.clone());
                    if matches!(picked.outcome, Some((FaultAction::HoldEffect, _))) {
                        Next::Hold
                    } else {
                        Next::Effect
                    }
                }
            },
            (_, None) => Next::Effect,
        };
        // Fast path: no latency, so the effect runs in the same critical
        // section as the claim (one lock per request).
        let next = match (next, picked.latency, effect.take()) {
            (Next::Effect, None, Some(run)) => Next::Done(run_effect(
                state,
                &mut reservation,
                ctx,
                dialect,
                picked,
                run,
            )),
            (next, _, unused) => {
                effect = unused;
                next
            }
        };
        (picked, next)
    };
    let request_id = call.request_id.clone();
    if let Some(latency) = picked.latency {
        tokio::time::sleep(latency).await;
    }
    let (response, replayed) = match next {
        Next::Answer(response, replayed) => {
            // Faults that stop the request before its effect are final.
            if matches!(
                picked.outcome,
                Some((
                    FaultAction::FailBeforeEffect
                        | FaultAction::FailSavedBeforeEffect
                        | FaultAction::InProgress
                        | FaultAction::RateLimit,
                    _
                ))
            ) {
                return (respond(dialect, response, replayed, request_id), None);
            }
            (response, replayed)
        }
        Next::Done(response) => (response, false),
        Next::Hold => {
            // The key stays reserved until the effect is released.
            let key = reservation
                .scope
                .take()
                .zip(call.key.as_ref().map(|k| k.key.clone()));
            return (drop_connection(), effect.take().map(|run| (run, key)));
        }
        Next::Effect => match effect.take() {
            Some(run) => (
                run_effect(
                    &mut shared.lock(),
                    &mut reservation,
                    ctx,
                    dialect,
                    picked,
                    run,
                ),
                false,
            ),
            None => (dialect.fail_before_effect(), false),
        },
    };
    let response = match picked.outcome {
        Some((
            action @ (FaultAction::FailAfterEffect | FaultAction::FailAfterEffectNoRetry),
            _,
        )) => {
            let no_retry = action == FaultAction::FailAfterEffectNoRetry;
            respond(
                dialect,
                dialect.fail_after_effect(no_retry),
                false,
                request_id,
            )
        }
        Some((FaultAction::DropResponseAfterEffect, _)) => drop_connection(),
        Some((FaultAction::DelayAfterEffect, delay)) => {
            tokio::time::sleep(delay).await;
            respond(dialect, response, replayed, request_id)
        }
        _ => respond(dialect, response, replayed, request_id),
    };
    (response, None)
}

/// Runs the effect and saves what the dialect saves under the reserved key
/// (or frees the key); returns the effect's real answer.
fn run_effect(
    state: &mut ProviderState,
    reservation: &mut Reservation<'_>,
    ctx: Ctx<'_>,
    dialect: Dialect,
    picked: Picked,
    run: impl FnOnce(&mut ProviderState, Ctx<'_>) -> Outcome,
) -> StoredResponse {
    let (response, saved) = match run(state, ctx) {
        Outcome::Executed(response) => (response, true),
        Outcome::Refused(response) => (response, dialect.saves_refusals()),
    };
    if let Some(scope) = reservation.scope.take() {
        let (failed_after, no_retry) = match picked.outcome {
            Some((FaultAction::FailAfterEffect, _)) => (true, false),
            Some((FaultAction::FailAfterEffectNoRetry, _)) => (true, true),
            _ => (false, false),
        };
        let kept = if failed_after && saved {
            dialect.saved_after_failure(response.clone(), no_retry)
        } else {
            response.clone()
        };
        // A 5xx of the effect itself means nothing was done: free the key
        // for a retry. The sabotage 500 Stripe keeps is saved on purpose.
        if saved && (failed_after || !response.is_server_error()) {
            state.keys.complete(&scope, &kept, ctx.now);
        } else {
            state.keys.release(&scope);
        }
    }
    response
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        respond(Dialect::Fake, self.into_stored(), false, None)
    }
}

/// The stored answer as an HTTP response with the dialect's headers.
pub(crate) fn respond(
    dialect: Dialect,
    response: StoredResponse,
    replayed: bool,
    request_id: Option<String>,
) -> Response {
    let retry = response.retry;
    let mut http = (response.status, Body::from(response.body)).into_response();
    let headers = http.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    if replayed {
        headers.insert(REPLAYED_HEADER, HeaderValue::from_static("true"));
    }
    if dialect == Dialect::Stripe {
        if let Some(value) = request_id.and_then(|id| HeaderValue::from_str(&id).ok()) {
            headers.insert(HeaderName::from_static("request-id"), value);
        }
        headers.insert(
            HeaderName::from_static("stripe-version"),
            HeaderValue::from_static(stripe::API_VERSION),
        );
        if let Some(retry) = retry {
            let value = HeaderValue::from_static(if retry { "true" } else { "false" });
            headers.insert(HeaderName::from_static("stripe-should-retry"), value);
        }
    }
    http
}
