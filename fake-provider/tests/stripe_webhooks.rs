//! Webhooks in Stripe's shape: `Stripe-Signature` (checked here with our own
//! HMAC), Stripe's event envelope and types, the delivery faults in this
//! dialect, and how the dialect is chosen (Config, Control, admin API, CLI).
#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

mod common;

use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use common::stripe::{SK, form, intent_form};
use common::{EffectsExt, Provider, charge_body, charges, provider_with, wait_until};
use fake_provider::{
    AdminClient, Config, FaultAction, FaultRule, Operation, WebhookDialect, WebhookTarget,
};
use hmac::{Hmac, KeyInit, Mac};
use serde_json::{Value, json};
use sha2::Sha256;
use tokio::io::{AsyncBufReadExt, BufReader};

const SECRET: &str = "whsec_stripe_test";

/// One delivery as received.
#[derive(Clone, Debug)]
struct Received {
    headers: HeaderMap,
    body: Bytes,
    event: Value,
}

impl Received {
    fn kind(&self) -> &str {
        self.event["type"].as_str().unwrap()
    }

    fn object(&self) -> &Value {
        &self.event["data"]["object"]
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

#[derive(Clone, Default)]
struct Receiver {
    received: Arc<Mutex<Vec<Received>>>,
}

impl Receiver {
    async fn start() -> (Self, String) {
        let receiver = Self::default();
        let app = Router::new()
            .route("/v1/webhooks/stripe", post(receive))
            .with_state(receiver.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!(
            "http://{}/v1/webhooks/stripe",
            listener.local_addr().unwrap()
        );
        tokio::spawn(async move { axum::serve(listener, app).await });
        (receiver, url)
    }

    fn events(&self) -> Vec<Received> {
        self.received.lock().unwrap().clone()
    }

    fn kinds(&self) -> Vec<String> {
        self.events().iter().map(|r| r.kind().to_owned()).collect()
    }

    async fn wait_for(&self, count: usize) -> Vec<Received> {
        wait_until(&format!("{count} events"), || async {
            self.events().len() >= count
        })
        .await;
        self.events()
    }
}

async fn receive(State(receiver): State<Receiver>, headers: HeaderMap, body: Bytes) -> StatusCode {
    let event = serde_json::from_slice(&body).unwrap_or(Value::Null);
    receiver.received.lock().unwrap().push(Received {
        headers,
        body,
        event,
    });
    StatusCode::OK
}

fn target(url: &str) -> Option<WebhookTarget> {
    Some(WebhookTarget {
        url: url.to_owned(),
        secret: SECRET.to_owned(),
    })
}

async fn stripe_provider(url: &str) -> Provider {
    provider_with(Config {
        webhook: target(url),
        webhook_dialect: WebhookDialect::Stripe,
        webhook_retry_base: Duration::from_millis(20),
        ..Config::default()
    })
    .await
}

/// Stripe's check, written here from its documentation rather than with the
/// provider's `sign`: `t=<unix>,v1=<hex HMAC-SHA256(secret, "<t>.<body>")>`,
/// any of several `v1`s may match; returns `t`.
fn verify_stripe_signature(header: &str, body: &[u8], secret: &str) -> Option<i64> {
    let mut timestamp = None;
    let mut signatures = Vec::new();
    for part in header.split(',') {
        match part.split_once('=')? {
            ("t", t) => timestamp = Some(t.to_owned()),
            ("v1", v1) => signatures.push(hex::decode(v1).ok()?),
            _ => {}
        }
    }
    let timestamp = timestamp?;
    let valid = signatures.iter().any(|signature| {
        let mut mac = Hmac::<Sha256>::new_from_slice(secret.as_bytes()).unwrap();
        mac.update(timestamp.as_bytes());
        mac.update(b".");
        mac.update(body);
        mac.verify_slice(signature).is_ok()
    });
    valid.then(|| timestamp.parse().ok()).flatten()
}

#[tokio::test]
async fn stripe_events_are_signed_in_stripe_signature_and_shaped_like_stripe_events() {
    let (receiver, url) = Receiver::start().await;
    let p = stripe_provider(&url).await;
    let created = p
        .stripe_intent("manual", "o-1:authorize-v1", Some("k-1"))
        .await;
    let captured = p
        .stripe_post(
            &format!("/v1/payment_intents/{}/capture", created.id()),
            Some("cap-1"),
            &[],
        )
        .await;
    let refund = p
        .stripe_post(
            "/v1/refunds",
            Some("re-1"),
            &[
                ("payment_intent", created.id()),
                ("amount", "250"),
                ("metadata[cobro_intent]", "o-1:refund-v1"),
            ],
        )
        .await;
    assert_eq!(refund.status, 200, "{refund:?}");

    let events = receiver.wait_for(4).await;
    assert_eq!(
        receiver.kinds(),
        [
            "payment_intent.amount_capturable_updated",
            "payment_intent.succeeded",
            "charge.refunded",
            "refund.created",
        ]
    );
    let causes = [
        (&created, "k-1"),
        (&captured, "cap-1"),
        (&refund, "re-1"),
        (&refund, "re-1"),
    ];
    let now = p.control.now().timestamp();
    for (event, (reply, key)) in events.iter().zip(causes) {
        let header = event.header("stripe-signature").expect("Stripe-Signature");
        let t = verify_stripe_signature(header, &event.body, SECRET)
            .unwrap_or_else(|| panic!("signature verifies: {header}"));
        assert!((now - 5..=now).contains(&t), "t={t} now={now}");
        assert_eq!(
            verify_stripe_signature(header, &event.body, "whsec_other"),
            None
        );
        let mut tampered = event.body.to_vec();
        tampered.push(b' ');
        assert_eq!(verify_stripe_signature(header, &tampered, SECRET), None);
        assert_eq!(event.header("fake-signature"), None);
        assert!(
            event
                .header("content-type")
                .unwrap()
                .starts_with("application/json")
        );
        let e = &event.event;
        assert!(e["id"].as_str().unwrap().starts_with("evt_"));
        assert_eq!(
            (
                &e["object"],
                &e["api_version"],
                &e["livemode"],
                &e["pending_webhooks"]
            ),
            (
                &json!("event"),
                &json!("2024-06-20"),
                &json!(false),
                &json!(1)
            )
        );
        assert!(e["created"].as_i64().unwrap() <= t);
        assert_eq!(
            e["request"]["id"],
            json!(reply.request_id),
            "{}",
            event.kind()
        );
        assert_eq!(e["request"]["idempotency_key"], key);
        let raw = std::str::from_utf8(&event.body).unwrap();
        assert!(
            !raw.contains("sequence"),
            "Stripe events carry no sequence: {raw}"
        );
    }
    assert_eq!(events[0].object()["status"], "requires_capture");
    assert_eq!(events[0].object()["amount_capturable"], 1250);
    assert_eq!(events[1].object(), &captured.body);
    let charge = events[2].object();
    assert_eq!(
        (&charge["object"], &charge["id"], &charge["payment_intent"]),
        (
            &json!("charge"),
            &created.body["latest_charge"],
            &json!(created.id())
        )
    );
    assert_eq!(
        (
            &charge["amount_refunded"],
            &charge["refunded"],
            &charge["captured"]
        ),
        (&json!(250), &json!(false), &json!(true))
    );
    assert_eq!(events[3].object(), &refund.body);
    assert_eq!(p.totals(), charges(1).captures(1).refunds(1));
}

#[tokio::test]
async fn declines_authentication_and_cancels_emit_their_payment_intent_events() {
    let (receiver, url) = Receiver::start().await;
    let p = stripe_provider(&url).await;
    let mut declined = intent_form("automatic", "o-2:authorize-v1");
    declined[2] = ("payment_method", "pm_card_chargeDeclinedInsufficientFunds");
    let decline = p.stripe_post("/v1/payment_intents", None, &declined).await;
    assert_eq!(decline.status, 402);
    let mut three_ds = intent_form("automatic", "o-3:authorize-v1");
    three_ds[2] = ("payment_method", "pm_card_authenticationRequired");
    p.stripe_post("/v1/payment_intents", None, &three_ds).await;
    let manual = p.stripe_intent("manual", "o-4:authorize-v1", None).await;
    p.stripe_post(
        &format!("/v1/payment_intents/{}/cancel", manual.id()),
        None,
        &[],
    )
    .await;
    // Not confirmed: Stripe would send payment_intent.created; the fake
    // sends nothing for it.
    p.stripe_post(
        "/v1/payment_intents",
        None,
        &[("amount", "100"), ("currency", "eur")],
    )
    .await;
    p.stripe_intent("automatic", "o-5:authorize-v1", None).await;

    let events = receiver.wait_for(5).await;
    assert_eq!(
        receiver.kinds(),
        [
            "payment_intent.payment_failed",
            "payment_intent.requires_action",
            "payment_intent.amount_capturable_updated",
            "payment_intent.canceled",
            "payment_intent.succeeded",
        ]
    );
    let failed = events[0].object();
    assert_eq!(failed["status"], "requires_payment_method");
    assert_eq!(
        failed["last_payment_error"]["decline_code"],
        "insufficient_funds"
    );
    assert_eq!(failed, &decline.body["error"]["payment_intent"]);
    assert_eq!(events[3].object()["status"], "canceled");
    assert_eq!(p.totals(), charges(2).declines(1).voids(1));
}

#[tokio::test]
async fn duplicate_and_reorder_faults_apply_to_stripe_events() {
    let (receiver, url) = Receiver::start().await;
    let p = stripe_provider(&url).await;
    p.control.add_fault(
        FaultRule::new(Operation::Webhook, FaultAction::Duplicate)
            .with_reference("o-6:")
            .with_next(1),
    );
    p.control.add_fault(
        FaultRule::new(Operation::Webhook, FaultAction::Reorder)
            .with_reference("o-7:")
            .with_next(1),
    );
    let duplicated = p.stripe_intent("automatic", "o-6:authorize-v1", None).await;
    receiver.wait_for(2).await;
    let held = p.stripe_intent("automatic", "o-7:authorize-v1", None).await;
    let after = p.stripe_intent("automatic", "o-8:authorize-v1", None).await;

    let events = receiver.wait_for(4).await;
    assert_eq!(events[0].body, events[1].body, "the same bytes twice");
    assert_eq!(events[0].object()["id"], duplicated.id());
    assert_eq!(events[0].event["id"], events[1].event["id"]);
    let order: Vec<&Value> = events[2..].iter().map(|e| &e.object()["id"]).collect();
    assert_eq!(
        order,
        [&json!(after.id()), &json!(held.id())],
        "held back behind the next"
    );
    for event in &events {
        let header = event.header("stripe-signature").unwrap();
        assert!(verify_stripe_signature(header, &event.body, SECRET).is_some());
    }
    assert!(p.control.faults().is_empty());
    assert_eq!(p.totals(), charges(3));
}

#[tokio::test]
async fn a_dropped_stripe_event_is_redelivered_after_the_backoff() {
    let (receiver, url) = Receiver::start().await;
    let p = stripe_provider(&url).await;
    p.control
        .add_fault(FaultRule::new(Operation::Webhook, FaultAction::DropThenRedeliver).with_next(1));
    let pi = p.stripe_intent("automatic", "o-9:authorize-v1", None).await;

    let events = receiver.wait_for(1).await;
    assert_eq!(events[0].object()["id"], pi.id());
    // The receiver has the redelivery before the provider has recorded its
    // acknowledgement.
    let control = p.control.clone();
    common::wait_until("the redelivery is recorded", || async {
        control.webhook_deliveries().len() >= 2
    })
    .await;
    let deliveries = p.control.webhook_deliveries();
    assert_eq!(deliveries[0].error.as_deref(), Some("dropped by fault"));
    assert_eq!(deliveries[0].event_type, "payment_intent.succeeded");
    assert!(deliveries[1].acknowledged());
    assert_eq!(p.totals(), charges(1));
}

#[tokio::test]
async fn the_dialect_follows_control_and_the_admin_api_and_each_dialect_gets_its_events() {
    let (receiver, url) = Receiver::start().await;
    let p = provider_with(Config {
        admin: true,
        webhook: target(&url),
        ..Config::default()
    })
    .await;
    assert_eq!(p.control.webhook_dialect(), WebhookDialect::Fake);
    // Fake target: every engine effect, a Stripe PaymentIntent's charge too.
    p.stripe_intent("automatic", "o-10:authorize-v1", None)
        .await;
    let fake = receiver.wait_for(1).await;
    assert_eq!(fake[0].kind(), "charge.captured");
    assert!(fake[0].header("fake-signature").is_some());

    p.control.set_webhook_dialect(WebhookDialect::Stripe);
    // Stripe target: what the Stripe dialect made, nothing for the fake's.
    let fake_charge = p
        .post("/v1/charges", None, &charge_body("o-11:authorize-v1"))
        .await
        .unwrap();
    assert_eq!(fake_charge.status, 201);
    p.stripe_intent("automatic", "o-12:authorize-v1", None)
        .await;
    let events = receiver.wait_for(2).await;
    assert_eq!(events[1].kind(), "payment_intent.succeeded");
    assert!(events[1].header("stripe-signature").is_some());

    let admin = AdminClient::new(&p.url);
    admin
        .set_webhook_dialect(WebhookDialect::Fake)
        .await
        .unwrap();
    assert_eq!(admin.webhook_dialect().await.unwrap(), WebhookDialect::Fake);
    let put = p
        .http
        .put(format!("{}/__admin/webhooks", p.url))
        .json(&json!({"url": url, "secret": SECRET, "dialect": "stripe"}))
        .send()
        .await
        .unwrap();
    assert_eq!(put.status(), 204);
    assert_eq!(p.control.webhook_dialect(), WebhookDialect::Stripe);
    admin.set_webhook(target(&url)).await.unwrap();
    assert_eq!(
        p.control.webhook_dialect(),
        WebhookDialect::Stripe,
        "a target without a dialect keeps the current one"
    );
    let bad = p
        .http
        .put(format!("{}/__admin/webhooks/dialect", p.url))
        .json(&json!({"dialect": "paypal"}))
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);
    p.stripe_intent("manual", "o-13:authorize-v1", None).await;
    let events = receiver.wait_for(3).await;
    assert_eq!(events[2].kind(), "payment_intent.amount_capturable_updated");
    assert_eq!(
        receiver.events().len(),
        3,
        "the fake's own charge sent nothing"
    );
    assert_eq!(p.totals(), charges(4));
}

#[tokio::test]
async fn the_binary_sends_stripe_events_with_the_webhook_dialect_flag() {
    let (receiver, url) = Receiver::start().await;
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_fake-provider"))
        .args(["--port", "0", "--admin", "--webhook-dialect", "stripe"])
        .args(["--webhook-url", &url, "--webhook-secret", SECRET])
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut first = String::new();
    tokio::time::timeout(Duration::from_secs(10), stdout.read_line(&mut first))
        .await
        .unwrap()
        .unwrap();
    let base = first
        .trim()
        .strip_prefix("fake-provider listening on ")
        .unwrap()
        .to_owned();
    let http = reqwest::Client::new();
    let response = http
        .post(format!("{base}/v1/payment_intents"))
        .bearer_auth(SK)
        .header("Content-Type", "application/x-www-form-urlencoded")
        .body(form(&intent_form("automatic", "o-14:authorize-v1")))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);

    let events = receiver.wait_for(1).await;
    assert_eq!(events[0].kind(), "payment_intent.succeeded");
    let header = events[0].header("stripe-signature").unwrap();
    assert!(verify_stripe_signature(header, &events[0].body, SECRET).is_some());
    let admin = AdminClient::new(&base);
    assert_eq!(
        admin.webhook_dialect().await.unwrap(),
        WebhookDialect::Stripe
    );
    assert_eq!(admin.ledger().await.unwrap().totals, charges(1));
    child.kill().await.unwrap();

    let refused = tokio::process::Command::new(env!("CARGO_BIN_EXE_fake-provider"))
        .args(["--port", "0", "--webhook-dialect", "paypal"])
        .stderr(Stdio::null())
        .status()
        .await
        .unwrap();
    assert!(!refused.success(), "an unknown dialect is refused");
}

/// A confirmation a `soft_decline` rule declines sends
/// `payment_intent.payment_failed`, as a declining card's does, its
/// `last_payment_error` saying `try_again_later`.
#[tokio::test]
async fn a_soft_declined_confirmation_emits_payment_failed_with_try_again_later() {
    let (receiver, url) = Receiver::start().await;
    let p = stripe_provider(&url).await;
    p.control
        .add_fault(FaultRule::new(Operation::Charge, FaultAction::SoftDecline));
    let pairs = intent_form("automatic", "o-s:authorize-v1");
    let decline = p.stripe_post("/v1/payment_intents", None, &pairs).await;
    assert_eq!(decline.status, 402);

    let events = receiver.wait_for(1).await;
    assert_eq!(receiver.kinds(), ["payment_intent.payment_failed"]);
    let failed = events[0].object();
    assert_eq!(
        failed["last_payment_error"]["decline_code"],
        "try_again_later"
    );
    assert_eq!(failed, &decline.body["error"]["payment_intent"]);
    assert_eq!(p.totals(), charges(0).declines(1));
}
