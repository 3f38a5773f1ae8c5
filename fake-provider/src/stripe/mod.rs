//! The Stripe dialect: a subset of Stripe's API (version `2024-06-20`) as a
//! translation layer over the one engine. A request is parsed from Stripe's
//! form encoding into engine parameters, runs through the same pipeline
//! (faults, idempotency, virtual clock) and the same effects (ledger, search
//! lag), and the engine's result is rendered as Stripe's JSON.
//!
//! A PaymentIntent is this dialect's own record ([`Intent`]); its
//! confirmation is an engine charge (the PaymentIntent's `latest_charge`),
//! which is what the ledger counts. A PaymentIntent that never reached the
//! card (`requires_action`, `requires_confirmation`) has no charge and
//! moves nothing.
//!
//! # Layout
//! - this module: routes, [`StripeBook`] (PaymentIntents and their links to
//!   engine charges) and the effects of each route.
//! - `form`: form bodies and query strings into typed parameters.
//! - `objects`: PaymentIntent, Charge, Refund and Event JSON.
//! - `search`: `metadata['KEY']:'VALUE' AND ...` queries.
//! - `error`: Stripe's error object.

mod challenge;
mod error;
mod form;
mod objects;
mod search;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, RawQuery, State};
use axum::http::header::CONTENT_TYPE;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use axum::routing::{get, post};
use chrono::{DateTime, Utc};
use serde_json::{Value, json};

pub(crate) use error::StripeError;
use form::Form;
use objects::{Cause, charge_json, event_body, intent_json, intent_status, refund_json};
use search::Query;

use crate::config::WebhookDialect;
use crate::faults::Operation;
use crate::model::{Charge, ChargeParams, ChargeStatus, Created, RefundParams, StoredResponse};
use crate::pipeline::{Call, Dialect, Outcome, Subject, execute};
use crate::state::{
    Ctx, Page, Refused, Shared, State as ProviderState, Store, new_stored, resource,
};

/// The Stripe API version this dialect renders, whatever `Stripe-Version`
/// a request sends (it is recorded, see [`crate::SeenRequest`]).
pub const API_VERSION: &str = "2024-06-20";

/// Stripe's largest amount (eight digits of minor units).
const MAX_AMOUNT: i64 = 99_999_999;

/// Default and largest page of a list or search.
const DEFAULT_LIMIT: usize = 10;
const MAX_LIMIT: usize = 100;

type AppState = State<Arc<Shared>>;

/// The routes only Stripe has. `/v1/refunds` and `/v1/refunds/{id}` are
/// shared with the fake dialect and dispatched by [`speaks_stripe`] in
/// `api`.
pub(crate) fn routes() -> Router<Arc<Shared>> {
    Router::new()
        .route("/v1/payment_intents", post(create_intent).get(list_intents))
        .route("/v1/payment_intents/search", get(search_intents))
        .route("/v1/payment_intents/{id}", get(get_intent))
        .route("/v1/payment_intents/{id}/capture", post(capture_intent))
        .route("/v1/payment_intents/{id}/cancel", post(cancel_intent))
        .route("/v1/payment_intents/{id}/confirm", post(confirm_intent))
        .merge(challenge::routes())
}

/// Whether a request on a path both dialects serve speaks Stripe: it sends
/// a `Stripe-Version` header (Stripe's SDKs and cobro's connector always
/// do) or a form body (the fake's API is JSON only).
pub(crate) fn speaks_stripe(headers: &HeaderMap) -> bool {
    headers.contains_key("stripe-version")
        || headers
            .get(CONTENT_TYPE)
            .and_then(|value| value.to_str().ok())
            .is_some_and(|value| {
                value
                    .trim_start()
                    .starts_with("application/x-www-form-urlencoded")
            })
}

/// A test secret (or restricted) key: the only keys the fake takes, so a
/// live key can never be sent to it by mistake and "work".
pub(crate) fn is_test_key(token: &str) -> bool {
    ["sk_test_", "rk_test_"]
        .iter()
        .any(|prefix| token.len() > prefix.len() && token.starts_with(prefix))
}

/// What fault rules and the ledger call an object's reference in this
/// dialect, which has no reference field: its metadata as `key=value`
/// pairs in key order joined by `&`, unencoded (a string to match with
/// `reference_contains`, not to parse). Empty metadata gives `""`.
pub(crate) fn reference_of(metadata: &BTreeMap<String, String>) -> String {
    let pairs: Vec<String> = metadata
        .iter()
        .map(|(key, value)| format!("{key}={value}"))
        .collect();
    pairs.join("&")
}

/// What only this dialect knows, inside the engine's state.
#[derive(Debug, Default)]
pub(crate) struct StripeBook {
    intents: Store<Intent>,
    /// The PaymentIntent of each engine charge made by a confirmation.
    intent_of_charge: HashMap<String, String>,
    /// The `reason` given to each refund made through this dialect.
    refund_reasons: HashMap<String, &'static str>,
}

impl StripeBook {
    /// The PaymentIntent whose confirmation made engine charge `charge`.
    pub(crate) fn intent_of_charge(&self, charge: &str) -> Option<&str> {
        self.intent_of_charge.get(charge).map(String::as_str)
    }

    /// PaymentIntent id to the id of the engine charge it made, for the
    /// ledger.
    pub(crate) fn payment_intent_charges(&self) -> BTreeMap<String, String> {
        self.intent_of_charge
            .iter()
            .map(|(charge, intent)| (intent.clone(), charge.clone()))
            .collect()
    }

    /// The reference fault rules match for `caller`'s PaymentIntent `id`.
    pub(crate) fn intent_reference(&self, id: &str, caller: &str) -> Option<&str> {
        self.intents
            .get(id, caller)
            .map(|stored| stored.item.reference.as_str())
    }
}

/// A PaymentIntent as this dialect keeps it; its amounts and most of its
/// status come from its engine charge, if it has one.
#[derive(Debug, Clone)]
pub(crate) struct Intent {
    pub(crate) id: String,
    /// [`reference_of`] its metadata.
    pub(crate) reference: String,
    pub(crate) metadata: BTreeMap<String, String>,
    pub(crate) amount: i64,
    /// Lower case, as Stripe returns it.
    pub(crate) currency: String,
    /// `automatic`, `automatic_async` or `manual`, as sent.
    pub(crate) capture_method: &'static str,
    pub(crate) payment_method: Option<String>,
    pub(crate) payment_method_types: Vec<String>,
    pub(crate) created: DateTime<Utc>,
    /// The engine charge its confirmation made (`latest_charge`).
    pub(crate) charge: Option<String>,
    /// Its status while it has no charge.
    pub(crate) requires: Requires,
    pub(crate) canceled: Option<Canceled>,
    /// Where the challenge page sends the customer back (`return_url`).
    pub(crate) return_url: Option<String>,
    /// The challenge page of a PaymentIntent in `requires_action`, on this
    /// server (`http://<Host of the create>/challenge/<id>`).
    pub(crate) challenge_url: String,
    /// The customer failed the challenge: `requires_payment_method` with
    /// `payment_intent_authentication_failure` as its last error.
    pub(crate) authentication_failed: bool,
}

resource!(Intent);

/// What a PaymentIntent without a charge waits for (its status
/// `requires_...`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Requires {
    /// Created without a payment method.
    PaymentMethod,
    /// Created with a payment method, not confirmed.
    Confirmation,
    /// Confirmed with a card that needs authentication (3-D Secure).
    Action,
}

#[derive(Debug, Clone)]
pub(crate) struct Canceled {
    pub(crate) at: DateTime<Utc>,
    pub(crate) reason: Option<&'static str>,
}

/// The cards that always ask for authentication (3-D Secure): Stripe's
/// test payment methods of that name. Whether the customer completes the
/// challenge, fails it or abandons it is up to whoever opens the
/// challenge page (fake-provider/README.md).
pub(crate) const AUTHENTICATION_REQUIRED: &[&str] = &[
    "pm_card_authenticationRequired",
    "pm_card_threeDSecure2Required",
];

/// A form parsed for a route: its canonical text (what the key compares)
/// and its parameters, or the refusal they earned.
struct Parsed<P> {
    canonical: Option<String>,
    params: Result<P, StripeError>,
}

impl<P> Parsed<P> {
    fn body(
        headers: &HeaderMap,
        body: &[u8],
        read: impl FnOnce(Form) -> Result<P, StripeError>,
    ) -> Self {
        match Form::body(headers, body) {
            Ok(form) => Self {
                canonical: Some(form.canonical()),
                params: read(form),
            },
            Err(error) => Self {
                canonical: None,
                params: Err(error),
            },
        }
    }
}

/// What identifies a POST for faults and idempotency.
struct Post {
    operation: Operation,
    /// Method and path: part of the key's fingerprint, so one key cannot be
    /// reused for another PaymentIntent's capture.
    route: String,
    subject: Subject,
}

impl Post {
    /// `POST /v1/payment_intents/{id}/{verb}` as `operation`, about that
    /// PaymentIntent.
    fn on_intent(operation: Operation, id: &str, verb: &str) -> Self {
        Self {
            operation,
            route: format!("POST /v1/payment_intents/{id}/{verb}"),
            subject: Subject::Intent(id.to_owned()),
        }
    }
}

/// A Stripe POST: authenticate, fingerprint (only with a key), then run
/// the effect through the pipeline. Parameters that were refused go through
/// it too (faults see them; the key is reserved and then freed, since
/// Stripe saves nothing for a request that never began executing).
async fn mutate<P>(
    shared: &Shared,
    headers: &HeaderMap,
    body: &[u8],
    post: Post,
    parsed: Parsed<P>,
    effect: impl FnOnce(&mut ProviderState, P, Ctx<'_>) -> Outcome,
) -> Response {
    let Post {
        operation,
        route,
        subject,
    } = post;
    let fingerprint = || match &parsed.canonical {
        Some(canonical) => format!("{route}\n{canonical}"),
        None => format!("{route}\nraw:{}", String::from_utf8_lossy(body)),
    };
    let call = match Call::mutation(Dialect::Stripe, operation, headers, fingerprint) {
        Ok(call) => call,
        Err(refusal) => return *refusal,
    };
    execute(shared, call, subject, |state, ctx| match parsed.params {
        Ok(params) => effect(state, params, ctx),
        Err(error) => Outcome::Refused(error.into_stored()),
    })
    .await
}

/// A Stripe GET: authenticated, subject to faults, no key.
async fn read(
    shared: &Shared,
    headers: &HeaderMap,
    operation: Operation,
    subject: Subject,
    run: impl FnOnce(&ProviderState, Ctx<'_>) -> StoredResponse,
) -> Response {
    match Call::read(Dialect::Stripe, operation, headers) {
        Ok(call) => {
            execute(shared, call, subject, |state, ctx| {
                Outcome::Executed(run(state, ctx))
            })
            .await
        }
        Err(refusal) => *refusal,
    }
}

fn ok(value: &Value) -> StoredResponse {
    StoredResponse::json(StatusCode::OK, value)
}

// ---------------------------------------------------------------------------
// PaymentIntents

/// `POST /v1/payment_intents`.
struct IntentParams {
    amount: i64,
    currency: String,
    payment_method: Option<String>,
    confirm: bool,
    capture_method: &'static str,
    payment_method_types: Vec<String>,
    metadata: BTreeMap<String, String>,
    return_url: Option<String>,
}

impl IntentParams {
    fn read(mut form: Form) -> Result<Self, StripeError> {
        form.only(&[
            "amount",
            "currency",
            "payment_method",
            "confirm",
            "capture_method",
            "payment_method_types",
            "metadata",
            "return_url",
        ])?;
        let amount = form
            .positive("amount")?
            .ok_or_else(|| StripeError::missing_param("amount"))?;
        if amount > MAX_AMOUNT {
            let message = format!("Amount must be no more than {MAX_AMOUNT}");
            return Err(StripeError::refused("amount_too_large", message).with_param("amount"));
        }
        let currency = form.required("currency")?;
        if currency.len() != 3 || !currency.bytes().all(|b| b.is_ascii_alphabetic()) {
            let message = format!("Invalid currency: {currency}. Send a three-letter ISO code.");
            return Err(StripeError::invalid("currency", message));
        }
        let payment_method = form.non_empty("payment_method")?;
        if let Some(method) = &payment_method
            && (method.len() <= 3 || !method.starts_with("pm_"))
        {
            return Err(
                StripeError::no_such("PaymentMethod", method, "payment_method").into_bad_request(),
            );
        }
        let confirm = form.boolean("confirm")?.unwrap_or(false);
        if confirm && payment_method.is_none() {
            return Err(StripeError::missing_param("payment_method"));
        }
        let capture_method = form
            .one_of(
                "capture_method",
                &["automatic", "automatic_async", "manual"],
            )?
            // Stripe's default for new PaymentIntents since 2024-04-10.
            .unwrap_or("automatic_async");
        let payment_method_types = form
            .list("payment_method_types")?
            .unwrap_or_else(|| vec!["card".to_owned()]);
        let metadata = form.metadata()?;
        let return_url = form.non_empty("return_url")?;
        if let Some(url) = &return_url
            && url::Url::parse(url).is_err()
        {
            return Err(StripeError::invalid("return_url", "Not a valid URL"));
        }
        Ok(Self {
            return_url,
            amount,
            currency: currency.to_ascii_lowercase(),
            payment_method,
            confirm,
            capture_method,
            payment_method_types,
            metadata,
        })
    }
}

async fn create_intent(State(shared): AppState, headers: HeaderMap, body: Bytes) -> Response {
    let parsed = Parsed::body(&headers, &body, IntentParams::read);
    // The challenge page is on this server, as the caller reached it.
    let host = headers
        .get(axum::http::header::HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or("127.0.0.1")
        .to_owned();
    let reference = parsed
        .params
        .as_ref()
        .ok()
        .map(|params| reference_of(&params.metadata));
    let route = "POST /v1/payment_intents".to_owned();
    let subject = Subject::Reference(reference);
    mutate(
        &shared,
        &headers,
        &body,
        Post {
            operation: Operation::Charge,
            route,
            subject,
        },
        parsed,
        |state, params, ctx| Outcome::Executed(create_intent_effect(state, params, &host, ctx)),
    )
    .await
}

/// Creates the PaymentIntent and, when confirmed with a card that does not
/// ask for authentication, its engine charge. Search lag is drawn once and
/// applies to both.
fn create_intent_effect(
    state: &mut ProviderState,
    params: IntentParams,
    host: &str,
    ctx: Ctx<'_>,
) -> StoredResponse {
    let reference = reference_of(&params.metadata);
    let searchable_at = state.searchable_at(Operation::Charge, &reference, ctx.now);
    let id = state.new_id("pi_");
    let reaches_card = params.confirm
        && !params
            .payment_method
            .as_deref()
            .is_some_and(|method| AUTHENTICATION_REQUIRED.contains(&method));
    let requires = match (&params.payment_method, params.confirm) {
        (None, _) => Requires::PaymentMethod,
        (Some(_), false) => Requires::Confirmation,
        (Some(_), true) => Requires::Action,
    };
    let mut intent = Intent {
        id: id.clone(),
        reference: reference.clone(),
        metadata: params.metadata,
        amount: params.amount,
        currency: params.currency,
        capture_method: params.capture_method,
        payment_method: params.payment_method,
        payment_method_types: params.payment_method_types,
        created: ctx.now,
        charge: None,
        requires,
        canceled: None,
        return_url: params.return_url,
        challenge_url: format!("http://{host}/challenge/{id}"),
        authentication_failed: false,
    };
    let charge = reaches_card
        .then(|| confirm_charge(state, &mut intent, ctx, searchable_at))
        .flatten();
    let json = intent_json(&intent, charge.as_ref());
    let event = event_of_status(intent_status(&intent, charge.as_ref()), charge.is_some());
    if let Some(kind) = event {
        emit(state, kind, &intent.reference, &json, ctx);
    }
    state
        .stripe
        .intents
        .insert(new_stored(intent, ctx, searchable_at));
    confirmed(json, charge.as_ref())
}

/// The answer to a confirmation (at create or later): the PaymentIntent,
/// or Stripe's 402 with it when its charge was declined.
fn confirmed(json: Value, charge: Option<&Charge>) -> StoredResponse {
    match charge.and_then(|charge| charge.decline().map(|d| (d, &charge.id))) {
        Some((decline, charge)) => StripeError::declined(decline, charge, json).into_stored(),
        None => ok(&json),
    }
}

/// The engine charge of a PaymentIntent's confirmation (at create, or
/// once its customer completed the challenge): what the ledger counts.
pub(crate) fn confirm_charge(
    state: &mut ProviderState,
    intent: &mut Intent,
    ctx: Ctx<'_>,
    searchable_at: DateTime<Utc>,
) -> Option<Charge> {
    let method = intent.payment_method.clone()?;
    let charge = state.create_charge(
        ChargeParams {
            amount: intent.amount,
            currency: intent.currency.to_ascii_uppercase(),
            payment_method: method,
            capture: intent.capture_method != "manual",
            reference: intent.reference.clone(),
            metadata: intent.metadata.clone(),
        },
        ctx,
        searchable_at,
    );
    intent.charge = Some(charge.id.clone());
    state
        .stripe
        .intent_of_charge
        .insert(charge.id.clone(), intent.id.clone());
    Some(charge)
}

/// The event a PaymentIntent's status sends, if any.
pub(crate) fn event_of_status(status: &str, charged: bool) -> Option<&'static str> {
    match status {
        "requires_capture" => Some("payment_intent.amount_capturable_updated"),
        "succeeded" => Some("payment_intent.succeeded"),
        "requires_payment_method" if charged => Some("payment_intent.payment_failed"),
        "requires_action" => Some("payment_intent.requires_action"),
        "processing" => Some("payment_intent.processing"),
        _ => None,
    }
}

/// Queues a Stripe event about `object` if the target speaks Stripe.
fn emit(
    state: &mut ProviderState,
    kind: &'static str,
    reference: &str,
    object: &Value,
    ctx: Ctx<'_>,
) {
    if !state.emits(WebhookDialect::Stripe) {
        return;
    }
    let cause = Cause {
        request_id: ctx.request_id,
        idempotency_key: ctx.key,
    };
    state.emit(kind, reference, WebhookDialect::Stripe, |id| {
        event_body(id, kind, ctx.now, object, cause)
    });
}

/// A `processing` charge became final (see [`ProviderState::settle_due`]):
/// if a PaymentIntent's confirmation made it, its event goes out as Stripe
/// sends one when an asynchronous payment finishes, caused by no request.
pub(crate) fn settled(state: &mut ProviderState, charge: &Charge, caller: &str, at: DateTime<Utc>) {
    if !state.emits(WebhookDialect::Stripe) {
        return;
    }
    let Some(intent) = state.stripe.intent_of_charge(&charge.id).map(str::to_owned) else {
        return;
    };
    let Some(json) = intent_view(state, &intent, caller) else {
        return;
    };
    let kind = match json["status"].as_str().unwrap_or_default() {
        "requires_capture" => "payment_intent.amount_capturable_updated",
        "succeeded" => "payment_intent.succeeded",
        "requires_payment_method" => "payment_intent.payment_failed",
        _ => return,
    };
    let reference = state
        .stripe
        .intent_reference(&intent, caller)
        .unwrap_or_default()
        .to_owned();
    let cause = Cause {
        request_id: None,
        idempotency_key: None,
    };
    state.emit(kind, &reference, WebhookDialect::Stripe, |id| {
        event_body(id, kind, at, &json, cause)
    });
}

/// The caller's PaymentIntent `id` with its charge, rendered.
fn intent_view(state: &ProviderState, id: &str, caller: &str) -> Option<Value> {
    let intent = &state.stripe.intents.get(id, caller)?.item;
    let charge = intent
        .charge
        .as_deref()
        .and_then(|charge| state.charge(charge, caller));
    Some(intent_json(intent, charge))
}

fn no_such_intent(id: &str) -> StripeError {
    StripeError::no_such("payment_intent", id, "intent")
}

async fn get_intent(
    State(shared): AppState,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let subject = Subject::Intent(id.clone());
    read(
        &shared,
        &headers,
        Operation::Get,
        subject,
        |state, ctx| match intent_view(state, &id, ctx.caller) {
            Some(json) => ok(&json),
            None => no_such_intent(&id).into_stored(),
        },
    )
    .await
}

async fn capture_intent(
    State(shared): AppState,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let parsed = Parsed::body(&headers, &body, |mut form| {
        form.only(&["amount_to_capture"])?;
        form.positive("amount_to_capture")
    });
    mutate(
        &shared,
        &headers,
        &body,
        Post::on_intent(Operation::Capture, &id, "capture"),
        parsed,
        |state, amount, ctx| Outcome::Executed(capture_effect(state, &id, amount, ctx)),
    )
    .await
}

fn capture_effect(
    state: &mut ProviderState,
    id: &str,
    amount: Option<i64>,
    ctx: Ctx<'_>,
) -> StoredResponse {
    let Some(json) = intent_view(state, id, ctx.caller) else {
        return no_such_intent(id).into_stored();
    };
    let status = json["status"].as_str().unwrap_or_default();
    if status != "requires_capture" {
        let message = format!(
            "This PaymentIntent could not be captured because it has a status of {status}. \
             Only a PaymentIntent with one of the following statuses may be captured: \
             requires_capture."
        );
        return StripeError::unexpected_state(message, json).into_stored();
    }
    let capturable = json["amount_capturable"].as_i64().unwrap_or_default();
    if amount.is_some_and(|amount| amount > capturable) {
        let message = "The amount_to_capture must be less than or equal to amount_capturable.";
        return StripeError::refused("amount_too_large", message)
            .with_param("amount_to_capture")
            .into_stored();
    }
    let charge = json["latest_charge"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    match state.capture(&charge, amount, ctx) {
        Ok(_) => changed_intent(state, id, "payment_intent.succeeded", ctx),
        Err(refused) => engine_refusal(state, id, ctx, &refused),
    }
}

/// The engine refused although the PaymentIntent's status allowed it: only
/// possible if the two disagree, which they never should.
fn engine_refusal(
    state: &ProviderState,
    id: &str,
    ctx: Ctx<'_>,
    refused: &Refused,
) -> StoredResponse {
    let json = intent_view(state, id, ctx.caller).unwrap_or(Value::Null);
    let message = format!("This PaymentIntent's charge refused the change ({refused:?}).");
    StripeError::unexpected_state(message, json).into_stored()
}

/// The PaymentIntent after a change: emit `kind`, answer 200.
fn changed_intent(
    state: &mut ProviderState,
    id: &str,
    kind: &'static str,
    ctx: Ctx<'_>,
) -> StoredResponse {
    let json = intent_view(state, id, ctx.caller).unwrap_or(Value::Null);
    let reference = state
        .stripe
        .intent_reference(id, ctx.caller)
        .unwrap_or_default()
        .to_owned();
    emit(state, kind, &reference, &json, ctx);
    ok(&json)
}

/// `POST /v1/payment_intents/{id}/confirm`: what a customer's browser
/// does with Stripe.js and the PaymentIntent's client secret after a
/// failed try (here with the secret key: the fake takes no other). A
/// PaymentIntent that still waits for a payment method (a failed 3-D
/// Secure challenge, a declined card) or for its confirmation takes a new
/// `payment_method` and reaches the card as at create: a charge the ledger
/// counts, or a new challenge for a card that asks for one. A canceled or
/// charged PaymentIntent refuses it (`payment_intent_unexpected_state`):
/// that refusal is what keeps a PaymentIntent cobro gave up on from
/// charging beside the order's next payment.
async fn confirm_intent(
    State(shared): AppState,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let parsed = Parsed::body(&headers, &body, |mut form| {
        form.only(&["payment_method", "return_url", "client_secret"])?;
        let method = form.non_empty("payment_method")?;
        if let Some(method) = &method
            && (method.len() <= 3 || !method.starts_with("pm_"))
        {
            return Err(
                StripeError::no_such("PaymentMethod", method, "payment_method").into_bad_request(),
            );
        }
        Ok(method)
    });
    mutate(
        &shared,
        &headers,
        &body,
        Post::on_intent(Operation::Charge, &id, "confirm"),
        parsed,
        |state, method, ctx| Outcome::Executed(confirm_effect(state, &id, method, ctx)),
    )
    .await
}

fn confirm_effect(
    state: &mut ProviderState,
    id: &str,
    method: Option<String>,
    ctx: Ctx<'_>,
) -> StoredResponse {
    let Some(json) = intent_view(state, id, ctx.caller) else {
        return no_such_intent(id).into_stored();
    };
    let status = json["status"].as_str().unwrap_or_default();
    let confirmable = ["requires_payment_method", "requires_confirmation"];
    if !confirmable.contains(&status) {
        let message = format!(
            "You cannot confirm this PaymentIntent because it has a status of {status}. Only a \
             PaymentIntent with one of the following statuses may be confirmed: {}.",
            confirmable.join(", ")
        );
        return StripeError::unexpected_state(message, json).into_stored();
    }
    let Some(stored) = state.stripe.intents.get(id, ctx.caller) else {
        return no_such_intent(id).into_stored();
    };
    let mut intent = stored.item.clone();
    if method.is_some() {
        intent.payment_method = method;
    }
    let Some(method) = intent.payment_method.clone() else {
        return StripeError::missing_param("payment_method").into_stored();
    };
    intent.authentication_failed = false;
    intent.charge = None;
    let charge = if AUTHENTICATION_REQUIRED.contains(&method.as_str()) {
        intent.requires = Requires::Action;
        None
    } else {
        let searchable_at = state.searchable_at(Operation::Charge, &intent.reference, ctx.now);
        confirm_charge(state, &mut intent, ctx, searchable_at)
    };
    let json = intent_json(&intent, charge.as_ref());
    let event = event_of_status(intent_status(&intent, charge.as_ref()), charge.is_some());
    if let Some(kind) = event {
        emit(state, kind, &intent.reference, &json, ctx);
    }
    if let Some(stored) = state.stripe.intents.get_mut(id, ctx.caller) {
        stored.item = intent;
    }
    confirmed(json, charge.as_ref())
}

const CANCELLATION_REASONS: &[&str] = &[
    "duplicate",
    "fraudulent",
    "requested_by_customer",
    "abandoned",
];

async fn cancel_intent(
    State(shared): AppState,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let parsed = Parsed::body(&headers, &body, |mut form| {
        form.only(&["cancellation_reason"])?;
        form.one_of("cancellation_reason", CANCELLATION_REASONS)
    });
    mutate(
        &shared,
        &headers,
        &body,
        Post::on_intent(Operation::Void, &id, "cancel"),
        parsed,
        |state, reason, ctx| Outcome::Executed(cancel_effect(state, &id, reason, ctx)),
    )
    .await
}

/// Cancels a PaymentIntent that has not succeeded: an authorized one is
/// voided in the engine (the ledger counts a void); one that never reached
/// the card (or was declined) is only marked canceled.
fn cancel_effect(
    state: &mut ProviderState,
    id: &str,
    reason: Option<&'static str>,
    ctx: Ctx<'_>,
) -> StoredResponse {
    let Some(json) = intent_view(state, id, ctx.caller) else {
        return no_such_intent(id).into_stored();
    };
    let status = json["status"].as_str().unwrap_or_default();
    let cancelable = [
        "requires_payment_method",
        "requires_capture",
        "requires_confirmation",
        "requires_action",
    ];
    if !cancelable.contains(&status) {
        let message = format!(
            "You cannot cancel this PaymentIntent because it has a status of {status}. Only a \
             PaymentIntent with one of the following statuses may be canceled: {}.",
            cancelable.join(", ")
        );
        return StripeError::unexpected_state(message, json).into_stored();
    }
    if status == "requires_capture" {
        let charge = json["latest_charge"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        if let Err(refused) = state.void(&charge, ctx) {
            return engine_refusal(state, id, ctx, &refused);
        }
    }
    if let Some(stored) = state.stripe.intents.get_mut(id, ctx.caller) {
        stored.item.canceled = Some(Canceled {
            at: ctx.now,
            reason,
        });
    }
    changed_intent(state, id, "payment_intent.canceled", ctx)
}

/// How long Stripe leaves a PaymentIntent uncaptured before it cancels it
/// on its own (for cards: seven days).
pub(crate) const UNCAPTURED_LIFETIME: chrono::TimeDelta = chrono::TimeDelta::days(7);

/// Stripe cancels a PaymentIntent left uncaptured for
/// [`UNCAPTURED_LIFETIME`] (`cancellation_reason: automatic`): its
/// authorisation is released (the engine voids the charge, the ledger
/// counts a void) and `payment_intent.canceled` is sent, as a cancel asked
/// for would be. Run as virtual time passes ([`crate::Control::advance_clock`]);
/// counted from the PaymentIntent's creation. The fake's own API has no
/// such rule: its authorisations never expire.
pub(crate) fn expire_uncaptured(state: &mut ProviderState, now: DateTime<Utc>) {
    let due: Vec<(String, String)> = state
        .stripe
        .intents
        .all()
        .filter(|s| s.item.canceled.is_none() && s.item.created + UNCAPTURED_LIFETIME <= now)
        .map(|s| (s.item.id.clone(), s.caller.clone()))
        .collect();
    for (id, caller) in due {
        let ctx = Ctx {
            now,
            caller: &caller,
            key: None,
            request_id: None,
        };
        let Some(json) = intent_view(state, &id, &caller) else {
            continue;
        };
        if json["status"] != "requires_capture" {
            continue;
        }
        let charge = json["latest_charge"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        if state.void(&charge, ctx).is_err() {
            continue;
        }
        if let Some(stored) = state.stripe.intents.get_mut(&id, &caller) {
            stored.item.canceled = Some(Canceled {
                at: now,
                reason: Some("automatic"),
            });
        }
        changed_intent(state, &id, "payment_intent.canceled", ctx);
    }
}

/// Sends `refund.failed` for a refund that failed after it succeeded (its
/// status now `failed`), if this dialect's webhooks are on.
pub(crate) fn refund_failed(
    state: &mut ProviderState,
    refund: &crate::model::Refund,
    caller: &str,
    now: DateTime<Utc>,
) {
    if !state.emits(WebhookDialect::Stripe) {
        return;
    }
    let intent = state
        .stripe
        .intent_of_charge(&refund.charge)
        .map(str::to_owned);
    let reason = state.stripe.refund_reasons.get(&refund.id).copied();
    let json = refund_json(refund, intent.as_deref(), reason);
    let ctx = Ctx {
        now,
        caller,
        key: None,
        request_id: None,
    };
    emit(state, "refund.failed", &refund.reference, &json, ctx);
}

/// `GET /v1/payment_intents/search?query=...&limit=N&page=...`.
struct SearchParams {
    query: Query,
    limit: usize,
    /// How many results the `page` token skips.
    offset: usize,
}

impl SearchParams {
    fn read(raw: Option<&str>) -> Result<Self, StripeError> {
        let mut form = Form::parse(raw.unwrap_or_default().as_bytes())?;
        form.only(&["query", "limit", "page"])?;
        let query = Query::parse(&form.required("query")?)?;
        let limit = limit(&mut form)?;
        let offset = match form.non_empty("page")? {
            None => 0,
            Some(page) => page
                .strip_prefix("page_")
                .and_then(|offset| offset.parse().ok())
                .ok_or_else(|| StripeError::invalid("page", format!("Invalid page: {page}")))?,
        };
        Ok(Self {
            query,
            limit,
            offset,
        })
    }
}

/// `limit`: 1 to 100, default 10.
fn limit(form: &mut Form) -> Result<usize, StripeError> {
    match form.positive("limit")? {
        None => Ok(DEFAULT_LIMIT),
        Some(limit) => usize::try_from(limit)
            .ok()
            .filter(|limit| *limit <= MAX_LIMIT)
            .ok_or_else(|| {
                StripeError::invalid_integer(
                    "limit",
                    "This value must be less than or equal to 100.",
                )
            }),
    }
}

async fn search_intents(
    State(shared): AppState,
    headers: HeaderMap,
    RawQuery(raw): RawQuery,
) -> Response {
    let call = match Call::read(Dialect::Stripe, Operation::Search, &headers) {
        Ok(call) => call,
        Err(refusal) => return *refusal,
    };
    let params = match SearchParams::read(raw.as_deref()) {
        Ok(params) => params,
        Err(error) => return call.refuse(error.into_stored()),
    };
    let subject = Subject::Reference(Some(params.query.reference()));
    execute(&shared, call, subject, |state, ctx| {
        let found: Vec<&Intent> = state
            .stripe
            .intents
            .search(
                ctx.caller,
                None,
                params.query.first_clause(),
                ctx.now,
                |intent| params.query.matches(&intent.metadata),
            )
            .skip(params.offset)
            .take(params.limit + 1)
            .collect();
        let has_more = found.len() > params.limit;
        let data: Vec<Value> = found
            .iter()
            .take(params.limit)
            .filter_map(|intent| intent_view(state, &intent.id, ctx.caller))
            .collect();
        let next_page = has_more.then(|| format!("page_{}", params.offset + params.limit));
        Outcome::Executed(ok(&json!({
            "object": "search_result",
            "data": data,
            "has_more": has_more,
            "next_page": next_page,
            "url": "/v1/payment_intents/search",
        })))
    })
    .await
}

/// `GET /v1/payment_intents?created[...]=...&limit=N&starting_after=pi_...`.
struct IntentListParams {
    created: Created,
    limit: usize,
    starting_after: Option<String>,
}

impl IntentListParams {
    fn read(raw: Option<&str>) -> Result<Self, StripeError> {
        let mut form = Form::parse(raw.unwrap_or_default().as_bytes())?;
        form.only(&["created", "limit", "starting_after"])?;
        Ok(Self {
            created: form.created()?,
            limit: limit(&mut form)?,
            starting_after: form.non_empty("starting_after")?,
        })
    }
}

/// Stripe's PaymentIntent list: the caller's PaymentIntents, newest first,
/// strongly consistent (what search lag hides from search is listed).
async fn list_intents(
    State(shared): AppState,
    headers: HeaderMap,
    RawQuery(raw): RawQuery,
) -> Response {
    let call = match Call::read(Dialect::Stripe, Operation::List, &headers) {
        Ok(call) => call,
        Err(refusal) => return *refusal,
    };
    let params = match IntentListParams::read(raw.as_deref()) {
        Ok(params) => params,
        Err(error) => return call.refuse(error.into_stored()),
    };
    execute(&shared, call, Subject::Reference(None), |state, ctx| {
        let page = state.stripe.intents.page(
            ctx.caller,
            |_| true,
            params.starting_after.as_deref(),
            |intent| params.created.contains(intent.created),
            params.limit,
        );
        Outcome::Executed(list_page(
            page,
            ("payment_intent", "/v1/payment_intents"),
            params.starting_after.as_deref(),
            |intent| intent_view(state, &intent.id, ctx.caller),
        ))
    })
    .await
}

/// One page of a Stripe list, `{object: "list", data, has_more, url}`,
/// each object as `view` shows it (`what` its object name, `url` the
/// list's path); or 400 `resource_missing` for a `starting_after` that is
/// not in the list.
fn list_page<T>(
    page: Option<Page<'_, T>>,
    (what, url): (&str, &str),
    starting_after: Option<&str>,
    view: impl Fn(&T) -> Option<Value>,
) -> StoredResponse {
    let Some(page) = page else {
        return unknown_cursor(what, starting_after.unwrap_or_default());
    };
    let data: Vec<Value> = page.data.iter().filter_map(|object| view(object)).collect();
    ok(&json!({
        "object": "list",
        "data": data,
        "has_more": page.has_more,
        "url": url,
    }))
}

/// A `starting_after` that is not an object of the list: 400
/// `resource_missing` naming it, as Stripe answers.
fn unknown_cursor(what: &str, id: &str) -> StoredResponse {
    StripeError::no_such(what, id, "starting_after")
        .into_bad_request()
        .into_stored()
}

// ---------------------------------------------------------------------------
// Refunds

const REFUND_REASONS: &[&str] = &["duplicate", "fraudulent", "requested_by_customer"];

/// What a refund or a refund list is about.
enum Target {
    Intent(String),
    Charge(String),
}

impl Target {
    /// From `payment_intent` / `charge`: one of them (`required`), never
    /// both.
    fn read(form: &mut Form, required: bool) -> Result<Option<Self>, StripeError> {
        let intent = form.non_empty("payment_intent")?;
        let charge = form.non_empty("charge")?;
        match (intent, charge) {
            (Some(_), Some(_)) => Err(StripeError::invalid(
                "charge",
                "Give only one of payment_intent and charge.",
            )),
            (Some(intent), None) => Ok(Some(Target::Intent(intent))),
            (None, Some(charge)) => Ok(Some(Target::Charge(charge))),
            (None, None) if required => Err(StripeError::missing_param("payment_intent")),
            (None, None) => Ok(None),
        }
    }

    fn subject(&self) -> Subject {
        match self {
            Target::Intent(id) => Subject::Intent(id.clone()),
            Target::Charge(id) => Subject::Charge(id.clone()),
        }
    }

    /// The engine charge it names, or the refusal: 404 for an unknown (or
    /// another caller's) object, `charge_not_refundable` for a
    /// PaymentIntent that never reached the card.
    fn charge(&self, state: &ProviderState, caller: &str) -> Result<String, StripeError> {
        match self {
            Target::Intent(id) => {
                let Some(stored) = state.stripe.intents.get(id, caller) else {
                    return Err(StripeError::no_such("payment_intent", id, "payment_intent"));
                };
                stored.item.charge.clone().ok_or_else(|| {
                    StripeError::refused(
                        "charge_not_refundable",
                        format!(
                            "This PaymentIntent ({id}) does not have a successful charge to refund."
                        ),
                    )
                })
            }
            Target::Charge(id) => match state.charge(id, caller) {
                Some(charge) => Ok(charge.id.clone()),
                None => Err(StripeError::no_such("charge", id, "charge")),
            },
        }
    }
}

/// `POST /v1/refunds`.
struct RefundForm {
    target: Target,
    amount: Option<i64>,
    reason: Option<&'static str>,
    metadata: BTreeMap<String, String>,
}

impl RefundForm {
    fn read(mut form: Form) -> Result<Self, StripeError> {
        form.only(&["payment_intent", "charge", "amount", "reason", "metadata"])?;
        let target = Target::read(&mut form, true)?;
        let amount = form.positive("amount")?;
        let reason = form.one_of("reason", REFUND_REASONS)?;
        let metadata = form.metadata()?;
        match target {
            Some(target) => Ok(Self {
                target,
                amount,
                reason,
                metadata,
            }),
            None => Err(StripeError::missing_param("payment_intent")),
        }
    }
}

/// `POST /v1/refunds` in the Stripe dialect (dispatched from `api`).
pub(crate) async fn create_refund(shared: &Shared, headers: &HeaderMap, body: &[u8]) -> Response {
    let parsed = Parsed::body(headers, body, RefundForm::read);
    let reference = parsed
        .params
        .as_ref()
        .ok()
        .map(|params| reference_of(&params.metadata));
    let route = "POST /v1/refunds".to_owned();
    mutate(
        shared,
        headers,
        body,
        Post {
            operation: Operation::Refund,
            route,
            subject: Subject::Reference(reference),
        },
        parsed,
        |state, params, ctx| Outcome::Executed(refund_effect(state, params, ctx)),
    )
    .await
}

/// Refunds (by default all that is left of) the charge; the refusals are
/// Stripe's: `charge_not_refundable` (not captured), `charge_already_refunded`
/// (nothing left), `amount_too_large` (more than what is left).
fn refund_effect(state: &mut ProviderState, params: RefundForm, ctx: Ctx<'_>) -> StoredResponse {
    let charge_id = match params.target.charge(state, ctx.caller) {
        Ok(charge) => charge,
        Err(error) => return error.into_stored(),
    };
    let Some(charge) = state.charge(&charge_id, ctx.caller) else {
        return StripeError::no_such("charge", &charge_id, "charge").into_stored();
    };
    if charge.status != ChargeStatus::Captured {
        let message = format!(
            "Charge {charge_id} has not been captured (it is {}): cancel an uncaptured \
             PaymentIntent instead.",
            charge.status.as_str()
        );
        return StripeError::refused("charge_not_refundable", message).into_stored();
    }
    let refundable = charge.amount_captured - charge.amount_refunded;
    if refundable <= 0 {
        let message = format!("Charge {charge_id} has already been refunded.");
        return StripeError::refused("charge_already_refunded", message).into_stored();
    }
    let amount = params.amount.unwrap_or(refundable);
    if amount > refundable {
        let message = format!(
            "Refund amount ({amount}) is greater than unrefunded amount on charge ({refundable})"
        );
        return StripeError::refused("amount_too_large", message)
            .with_param("amount")
            .into_stored();
    }
    let reference = reference_of(&params.metadata);
    let searchable_at = state.searchable_at(Operation::Refund, &reference, ctx.now);
    let refund = state.refund(
        RefundParams {
            charge: charge_id.clone(),
            amount,
            reference: reference.clone(),
            metadata: params.metadata,
        },
        ctx,
        searchable_at,
    );
    let refund = match refund {
        Ok(refund) => refund,
        Err(refused) => {
            let message = format!("The charge refused the refund ({refused:?}).");
            return StripeError::refused("charge_not_refundable", message).into_stored();
        }
    };
    if let Some(reason) = params.reason {
        state
            .stripe
            .refund_reasons
            .insert(refund.id.clone(), reason);
    }
    let intent = state.stripe.intent_of_charge(&charge_id).map(str::to_owned);
    let json = refund_json(&refund, intent.as_deref(), params.reason);
    if state.emits(WebhookDialect::Stripe)
        && let Some(charge) = state.charge(&charge_id, ctx.caller)
    {
        let charge = charge_json(charge, intent.as_deref());
        let charge_reference = state
            .charge_reference(&charge_id, ctx.caller)
            .unwrap_or_default()
            .to_owned();
        emit(state, "charge.refunded", &charge_reference, &charge, ctx);
        emit(state, "refund.created", &reference, &json, ctx);
    }
    ok(&json)
}

/// A refund rendered for this dialect.
fn refund_view(state: &ProviderState, id: &str, caller: &str) -> Option<Value> {
    let refund = state.refund_of(id, caller)?;
    let intent = state.stripe.intent_of_charge(&refund.charge);
    let reason = state.stripe.refund_reasons.get(id).copied();
    Some(refund_json(refund, intent, reason))
}

/// `GET /v1/refunds/{id}` in the Stripe dialect.
pub(crate) async fn get_refund(shared: &Shared, headers: &HeaderMap, id: String) -> Response {
    let subject = Subject::Refund(id.clone());
    read(
        shared,
        headers,
        Operation::Get,
        subject,
        |state, ctx| match refund_view(state, &id, ctx.caller) {
            Some(json) => ok(&json),
            None => StripeError::no_such("refund", &id, "id").into_stored(),
        },
    )
    .await
}

/// `GET /v1/refunds?payment_intent=...|charge=...&created[...]=...&limit=N&starting_after=re_...`.
struct ListParams {
    target: Option<Target>,
    /// Stripe documents `created` on the refund list as on the others.
    created: Created,
    limit: usize,
    starting_after: Option<String>,
}

impl ListParams {
    fn read(raw: Option<&str>) -> Result<Self, StripeError> {
        let mut form = Form::parse(raw.unwrap_or_default().as_bytes())?;
        form.only(&[
            "payment_intent",
            "charge",
            "created",
            "limit",
            "starting_after",
        ])?;
        Ok(Self {
            target: Target::read(&mut form, false)?,
            created: form.created()?,
            limit: limit(&mut form)?,
            starting_after: form.non_empty("starting_after")?,
        })
    }
}

/// The refund list in the Stripe dialect: strongly consistent (no search
/// lag; Stripe has no refund search), newest first. Fault operation
/// `list`.
pub(crate) async fn list_refunds(
    shared: &Shared,
    headers: &HeaderMap,
    raw: Option<String>,
) -> Response {
    let call = match Call::read(Dialect::Stripe, Operation::List, headers) {
        Ok(call) => call,
        Err(refusal) => return *refusal,
    };
    let params = match ListParams::read(raw.as_deref()) {
        Ok(params) => params,
        Err(error) => return call.refuse(error.into_stored()),
    };
    let subject = match &params.target {
        Some(target) => target.subject(),
        None => Subject::Reference(None),
    };
    execute(shared, call, subject, |state, ctx| {
        let charge = match params.target.as_ref().map(|t| t.charge(state, ctx.caller)) {
            None => None,
            Some(Ok(charge)) => Some(charge),
            // A PaymentIntent without a charge has no refunds.
            Some(Err(error)) if error_is_not_refundable(&error) => Some(String::new()),
            Some(Err(error)) => return Outcome::Executed(error.into_stored()),
        };
        let page = state.refunds.page(
            ctx.caller,
            |refund| {
                charge
                    .as_ref()
                    .is_none_or(|charge| &refund.charge == charge)
            },
            params.starting_after.as_deref(),
            |refund| params.created.contains(refund.created),
            params.limit,
        );
        Outcome::Executed(list_page(
            page,
            ("refund", "/v1/refunds"),
            params.starting_after.as_deref(),
            |refund| refund_view(state, &refund.id, ctx.caller),
        ))
    })
    .await
}

fn error_is_not_refundable(error: &StripeError) -> bool {
    error.is_code("charge_not_refundable")
}
