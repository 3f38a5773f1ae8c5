//! The 3-D Secure challenge a customer's browser opens (the
//! `redirect_to_url.url` of a PaymentIntent in `requires_action`): a plain
//! HTML page with two buttons that POST, "Complete" and "Fail", then a
//! `303` to the PaymentIntent's `return_url` with Stripe's query
//! (`payment_intent`, `payment_intent_client_secret`, `redirect_status`).
//!
//! - Complete: the confirmation reaches the card now: the engine charge is
//!   made (the ledger counts it once, here and only here) and
//!   `payment_intent.succeeded` (or `amount_capturable_updated`) is sent.
//! - Fail: no charge; the PaymentIntent goes back to
//!   `requires_payment_method` with `payment_intent_authentication_failure`
//!   and `payment_intent.payment_failed` is sent.
//! - Abandoned: nobody posts; the PaymentIntent stays in `requires_action`
//!   until it is canceled.
//!
//! A second POST (a double click, a reload) finds the PaymentIntent no
//! longer waiting and changes nothing: it only redirects again. Like the
//! rest of the fake, no faults apply to these pages: they are the
//! customer's, not cobro's, requests.

use std::sync::Arc;

use axum::Router;
use axum::extract::{Path, State};
use axum::http::{StatusCode, header};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};

use super::objects::{client_secret, intent_json, intent_status};
use super::{confirm_charge, emit, event_of_status};
use crate::faults::Operation;
use crate::state::{Ctx, Shared};

pub(crate) fn routes() -> Router<Arc<Shared>> {
    Router::new()
        .route("/challenge/{id}", get(page))
        .route("/challenge/{id}/complete", post(complete))
        .route("/challenge/{id}/fail", post(fail))
}

/// What the customer chose.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Choice {
    Complete,
    Fail,
}

/// Only what a PaymentIntent id is made of reaches the page or a URL.
fn plausible(id: &str) -> bool {
    id.starts_with("pi_")
        && id.len() <= 64
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

async fn page(State(shared): State<Arc<Shared>>, Path(id): Path<String>) -> Response {
    if !plausible(&id) {
        return (StatusCode::NOT_FOUND, "no such challenge").into_response();
    }
    let mut state = shared.lock();
    let Some(stored) = state.stripe.intents.get_any_mut(&id) else {
        return (StatusCode::NOT_FOUND, "no such challenge").into_response();
    };
    let intent = &stored.item;
    if intent_status(intent, None) != "requires_action" || intent.charge.is_some() {
        return (
            StatusCode::CONFLICT,
            Html(format!(
                "<!doctype html><title>3-D Secure</title><p id=\"done\">PaymentIntent {id} no longer waits for authentication.</p>"
            )),
        )
            .into_response();
    }
    let amount = format!("{} {}", intent.amount, intent.currency.to_ascii_uppercase());
    Html(format!(
        "<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>3-D Secure</title></head><body>\n\
         <h1>Authenticate this payment</h1>\n<p id=\"amount\">{amount} (minor units)</p>\n\
         <form method=\"post\" action=\"/challenge/{id}/complete\"><button id=\"complete\" type=\"submit\">Complete</button></form>\n\
         <form method=\"post\" action=\"/challenge/{id}/fail\"><button id=\"fail\" type=\"submit\">Fail</button></form>\n\
         </body></html>"
    ))
    .into_response()
}

async fn complete(shared: State<Arc<Shared>>, id: Path<String>) -> Response {
    decide(shared, id, Choice::Complete).await
}

async fn fail(shared: State<Arc<Shared>>, id: Path<String>) -> Response {
    decide(shared, id, Choice::Fail).await
}

async fn decide(
    State(shared): State<Arc<Shared>>,
    Path(id): Path<String>,
    choice: Choice,
) -> Response {
    if !plausible(&id) {
        return (StatusCode::NOT_FOUND, "no such challenge").into_response();
    }
    let now = shared.clock.now();
    let mut state = shared.lock();
    let Some(stored) = state.stripe.intents.get_any_mut(&id) else {
        return (StatusCode::NOT_FOUND, "no such challenge").into_response();
    };
    let caller = stored.caller.clone();
    let mut intent = stored.item.clone();
    let waiting = intent_status(&intent, None) == "requires_action" && intent.charge.is_none();
    let redirect_status = if waiting {
        let ctx = Ctx {
            now,
            caller: &caller,
            key: None,
            request_id: None,
        };
        let (charge, status) = match choice {
            Choice::Complete => {
                let searchable_at = state.searchable_at(Operation::Charge, &intent.reference, now);
                let charge = confirm_charge(&mut state, &mut intent, ctx, searchable_at);
                let status = intent_status(&intent, charge.as_ref());
                (charge, status)
            }
            Choice::Fail => {
                intent.requires = super::Requires::PaymentMethod;
                intent.authentication_failed = true;
                (None, "requires_payment_method")
            }
        };
        let json = intent_json(&intent, charge.as_ref());
        // The failed challenge sends payment_failed although nothing was
        // charged, as Stripe does.
        let event = match choice {
            Choice::Fail => Some("payment_intent.payment_failed"),
            Choice::Complete => event_of_status(status, charge.is_some()),
        };
        if let Some(kind) = event {
            emit(&mut state, kind, &intent.reference, &json, ctx);
        }
        let redirect = match status {
            "succeeded" | "requires_capture" | "processing" => "succeeded",
            _ => "failed",
        };
        if let Some(stored) = state.stripe.intents.get_any_mut(&id) {
            stored.item = intent.clone();
        }
        redirect
    } else {
        match intent_json(&intent, None)["status"].as_str() {
            Some("requires_payment_method" | "canceled") => "failed",
            _ => "succeeded",
        }
    };
    drop(state);
    back(&intent.return_url, &id, redirect_status)
}

/// `303` to the return URL with Stripe's query, or a page that says what
/// happened when the PaymentIntent has none.
fn back(return_url: &Option<String>, id: &str, redirect_status: &str) -> Response {
    let Some(Ok(mut url)) = return_url.as_deref().map(url::Url::parse) else {
        return Html(format!(
            "<!doctype html><title>3-D Secure</title><p id=\"done\">{redirect_status}</p>"
        ))
        .into_response();
    };
    url.query_pairs_mut()
        .append_pair("payment_intent", id)
        .append_pair("payment_intent_client_secret", &client_secret(id))
        .append_pair("redirect_status", redirect_status);
    (StatusCode::SEE_OTHER, [(header::LOCATION, url.to_string())]).into_response()
}
