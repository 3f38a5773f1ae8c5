//! The Stripe connector against a Stripe emulator nobody here wrote:
//! localstripe (PyPI, pinned in ops/localstripe.sh), which ops/test.sh
//! starts and names in `COBRO_TEST_LOCALSTRIPE_URL`. cobro's API, worker
//! and webhook endpoint run as in the other tests (a [`Rig`] whose worker
//! speaks Stripe to localstripe); localstripe has no ledger, so each test
//! reads the PaymentIntent and refunds back from localstripe itself and
//! compares them with the payment cobro recorded.
//!
//! localstripe implements create and confirm, manual capture, cancel,
//! refunds and signed webhooks; it has no idempotency keys and no search
//! (those are proven on the fake's Stripe dialect, tests/worker.rs and
//! tests/reconciler.rs). Where it differs from Stripe's documented
//! behaviour the connector follows Stripe (crates/provider/README.md,
//! "localstripe").
//!
//! localstripe's state is shared by every test of the run (and its
//! webhooks go to every endpoint registered with it), so each test only
//! reads the objects its own payment made.

use cobro_core::Clock;
use cobro_test_support::{
    Backend, Dialect, Rig, manual_payment_body, on_both_backends, payment_body, wait_for,
};
use cobro_worker::Step;
use serde_json::{Value, json};
use std::time::Duration;

on_both_backends!(
    an_automatic_payment_is_created_and_confirmed_at_localstripe,
    a_manual_payment_is_authorized_then_captured_at_localstripe,
    a_cancel_cancels_the_payment_intent_at_localstripe,
    refunds_are_made_at_localstripe_and_listed_by_payment_intent,
    a_declined_card_at_localstripe_charges_nothing,
    a_webhook_signed_and_delivered_by_localstripe_is_verified_and_matched,
);

/// localstripe's URL. The tests fail (never skip) without it: a suite that
/// silently skipped its only outside Stripe would prove nothing.
fn localstripe_url() -> String {
    std::env::var("COBRO_TEST_LOCALSTRIPE_URL").unwrap_or_else(|_| {
        panic!(
            "COBRO_TEST_LOCALSTRIPE_URL is not set: run the suite with ops/test.sh, which installs and starts localstripe (ops/localstripe.sh)"
        )
    })
}

/// A rig whose worker speaks Stripe to localstripe.
async fn rig(backend: Backend) -> Rig {
    Rig::with_in(backend, Dialect::Stripe, |client, _| {
        client.base_url = localstripe_url();
        client.request_timeout = Duration::from_secs(10);
    })
    .await
}

/// `GET {localstripe}{path}` with the rig's key: localstripe's own view.
async fn read(rig: &Rig, path: &str) -> Value {
    let response = rig
        .app
        .client
        .get(format!("{}{path}", localstripe_url()))
        .bearer_auth(cobro_test_support::RIG_SECRET_KEY)
        .send()
        .await
        .expect("localstripe answers");
    assert!(response.status().is_success(), "GET {path}: {response:?}");
    response.json().await.expect("json")
}

/// The PaymentIntent localstripe holds for cobro's payment.
async fn payment_intent(rig: &Rig, payment: &Value) -> Value {
    let pi = payment["provider_ref"].as_str().expect("provider ref");
    assert!(pi.starts_with("pi_"), "{pi}");
    read(rig, &format!("/v1/payment_intents/{pi}")).await
}

/// The bare UUID of cobro's payment id (`cobro_payment` metadata, the
/// store's column).
fn payment_uuid(id: &str) -> String {
    let payment: cobro_core::PaymentId = id.parse().expect("payment id");
    uuid::Uuid::from(payment).to_string()
}

async fn an_automatic_payment_is_created_and_confirmed_at_localstripe(backend: Backend) {
    let rig = rig(backend).await;
    let p = rig.create_payment("k-1", &payment_body("o-1")).await;
    assert_eq!(
        rig.drain(3).await,
        vec![Step::Recorded { class: "succeeded" }]
    );
    let p = rig.payment(p["id"].as_str().expect("id")).await;
    assert_eq!(p["status"], "captured");
    assert_eq!(p["amount_captured"], 1999);
    let pi = payment_intent(&rig, &p).await;
    assert_eq!(pi["status"], "succeeded");
    assert_eq!(pi["amount"], 1999);
    assert_eq!(pi["currency"], "eur");
    assert_eq!(pi["payment_method"], "pm_card_visa");
    let reference = pi["metadata"]["cobro_reference"]
        .as_str()
        .expect("cobro's reference travels as metadata");
    assert!(reference.starts_with("o-1:authorize-v1/"), "{reference}");
    assert_eq!(pi["metadata"]["cobro_intent"], "o-1:authorize-v1");
}

async fn a_manual_payment_is_authorized_then_captured_at_localstripe(backend: Backend) {
    let rig = rig(backend).await;
    let p = rig.create_payment("k-1", &manual_payment_body("o-1")).await;
    let id = p["id"].as_str().expect("id");
    rig.drain(3).await;
    let p = rig.payment(id).await;
    assert_eq!(p["status"], "authorized");
    let pi = payment_intent(&rig, &p).await;
    assert_eq!(pi["status"], "requires_capture");
    assert_eq!(pi["capture_method"], "manual");

    rig.post_ok(&format!("/v1/payments/{id}/capture"), "cap-1", json!({}))
        .await;
    assert_eq!(
        rig.drain(3).await,
        vec![Step::Recorded { class: "succeeded" }]
    );
    let p = rig.payment(id).await;
    assert_eq!(p["status"], "captured");
    assert_eq!(p["amount_captured"], 1999);
    let pi = payment_intent(&rig, &p).await;
    assert_eq!(pi["status"], "succeeded");
    assert_eq!(pi["amount"], 1999);
}

async fn a_cancel_cancels_the_payment_intent_at_localstripe(backend: Backend) {
    let rig = rig(backend).await;
    let p = rig.create_payment("k-1", &manual_payment_body("o-1")).await;
    let id = p["id"].as_str().expect("id");
    rig.drain(3).await;
    assert_eq!(rig.payment(id).await["status"], "authorized");
    rig.post_ok(&format!("/v1/payments/{id}/cancel"), "c-1", json!({}))
        .await;
    assert_eq!(
        rig.drain(3).await,
        vec![Step::Recorded { class: "succeeded" }]
    );
    let p = rig.payment(id).await;
    assert_eq!(p["status"], "canceled");
    let pi = payment_intent(&rig, &p).await;
    assert_eq!(pi["status"], "canceled");
}

async fn refunds_are_made_at_localstripe_and_listed_by_payment_intent(backend: Backend) {
    let rig = rig(backend).await;
    let mut body = payment_body("o-1");
    body["amount"] = json!(1000);
    let p = rig.create_payment("k-1", &body).await;
    let id = p["id"].as_str().expect("id");
    rig.drain(3).await;
    for (key, amount) in [("r-1", 600), ("r-2", 400)] {
        rig.post_ok(
            &format!("/v1/payments/{id}/refunds"),
            key,
            json!({"amount": amount}),
        )
        .await;
    }
    rig.drain(3).await;
    let p = rig.payment(id).await;
    assert_eq!(p["status"], "refunded");
    assert_eq!(p["amount_refunded"], 1000);

    // localstripe's own list of the PaymentIntent's refunds (the listing
    // cobro's reconciler reads): two, each with its attempt's reference.
    let pi = p["provider_ref"].as_str().expect("provider ref");
    let listed = read(&rig, &format!("/v1/refunds?payment_intent={pi}&limit=100")).await;
    let mut refunds: Vec<(i64, String, String)> = listed["data"]
        .as_array()
        .expect("data")
        .iter()
        .map(|r| {
            (
                r["amount"].as_i64().expect("amount"),
                r["status"].as_str().expect("status").to_owned(),
                r["metadata"]["cobro_intent"]
                    .as_str()
                    .expect("cobro_intent")
                    .to_owned(),
            )
        })
        .collect();
    refunds.sort();
    assert_eq!(
        refunds,
        [
            (400, "succeeded".into(), "o-1:refund-v2".into()),
            (600, "succeeded".into(), "o-1:refund-v1".into()),
        ]
    );
    // The connector's own listing (recovery's) finds each refund by the
    // reference of the attempt that made it.
    let connector = rig.connector();
    for refund in listed["data"].as_array().expect("data") {
        let reference = refund["metadata"]["cobro_reference"]
            .as_str()
            .expect("reference");
        let found = cobro_provider::Provider::search_refunds(&connector, reference, Some(pi))
            .await
            .expect("listing");
        assert_eq!(found.len(), 1, "{reference}");
        assert_eq!(found[0].id, refund["id"].as_str().expect("id"));
    }
}

/// localstripe answers a card its issuer refuses with a 402 of type
/// `invalid_request_error` where Stripe answers `card_error` (with a
/// `decline_code`): the connector follows Stripe's table, so localstripe's
/// decline is `failed` in cobro, not `declined`. Either way nothing was
/// charged, and the PaymentIntent waits for another payment method.
async fn a_declined_card_at_localstripe_charges_nothing(backend: Backend) {
    let rig = rig(backend).await;
    let mut body = payment_body("o-1");
    body["payment_method"] = json!("pm_card_chargeCustomerFail");
    let p = rig.create_payment("k-1", &body).await;
    let id = p["id"].as_str().expect("id");
    assert_eq!(rig.drain(3).await, vec![Step::Recorded { class: "failed" }]);
    let p = rig.payment(id).await;
    assert_eq!(p["status"], "failed");
    assert_eq!(p["amount_captured"], 0);
    // localstripe's answer named no PaymentIntent, so cobro holds none;
    // its listing shows the one it made, waiting for a payment method.
    let uuid = payment_uuid(id);
    let intents = read(&rig, "/v1/payment_intents?limit=100").await;
    let ours: Vec<&Value> = intents["data"]
        .as_array()
        .expect("data")
        .iter()
        .filter(|pi| pi["metadata"]["cobro_payment"] == uuid.as_str())
        .collect();
    assert_eq!(ours.len(), 1, "{intents}");
    assert_eq!(ours[0]["status"], "requires_payment_method");
    assert_eq!(ours[0]["last_payment_error"]["code"], "card_declined");
}

/// localstripe signs its events with `Stripe-Signature` (`t=` its event's
/// `created`, `v1=` HMAC-SHA256) and delivers them about a second after
/// the effect. Its `payment_intent.succeeded` reaches cobro's
/// `/v1/webhooks/stripe`, passes the signature and is tied to the payment
/// (by the PaymentIntent's `cobro_reference`), which the worker's answer
/// had already settled: `duplicate_effect`.
async fn a_webhook_signed_and_delivered_by_localstripe_is_verified_and_matched(backend: Backend) {
    let mut rig = rig(backend).await;
    let secret = format!("whsec_{}", uuid::Uuid::new_v4().simple());
    let mut settings = cobro_api::ApiSettings::default();
    settings.webhooks.insert(
        "stripe".to_owned(),
        cobro_api::WebhookReceiver::stripe(cobro_provider::WebhookSecret::new(&secret)),
    );
    rig.app.serve_with(settings).await;
    // localstripe signs with the real time; cobro checks the tolerance
    // against its (manual) clock.
    let behind = chrono::Utc::now() - rig.app.clock.now();
    rig.app.clock.advance(behind);
    let endpoint = uuid::Uuid::new_v4().simple().to_string();
    let registered = rig
        .app
        .client
        .post(format!("{}/_config/webhooks/{endpoint}", localstripe_url()))
        // localstripe reads a JSON body as readily as a form.
        .json(&json!({
            "url": format!("{}/v1/webhooks/stripe", rig.app.url),
            "secret": secret,
            "events": ["payment_intent.succeeded"],
        }))
        .send()
        .await
        .expect("configure localstripe's webhook");
    assert!(registered.status().is_success(), "{registered:?}");

    let p = rig.create_payment("k-1", &payment_body("o-1")).await;
    let id = p["id"].as_str().expect("id").to_owned();
    assert_eq!(
        rig.drain(3).await,
        vec![Step::Recorded { class: "succeeded" }]
    );
    let uuid = payment_uuid(&id);
    let outcome = wait_for(
        "localstripe's payment_intent.succeeded is stored",
        Duration::from_secs(10),
        async || {
            let n = rig
                .app
                .db
                .count(&format!(
                    "webhook_events WHERE provider = 'stripe' \
                     AND event_type = 'payment_intent.succeeded' \
                     AND payment_id = '{uuid}' AND outcome = 'duplicate_effect'"
                ))
                .await;
            (n > 0).then_some(n)
        },
    )
    .await;
    assert_eq!(outcome, 1);
    let p = rig.payment(&id).await;
    assert_eq!(p["status"], "captured");
    assert_eq!(payment_intent(&rig, &p).await["status"], "succeeded");
}
