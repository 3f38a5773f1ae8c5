//! Provider webhooks, end to end on both backends: the fake provider sends
//! real, signed webhooks (with its delivery faults) to cobro's API while the
//! worker talks to it, and the provider's ledger counts the effects. The
//! delivery tests run in both dialects: the fake's events (`charge.*`,
//! `Fake-Signature`, to `/v1/webhooks/fake`) while the worker speaks the
//! fake's API, and Stripe's (`payment_intent.*`, `refund.created`,
//! `Stripe-Signature`, to `/v1/webhooks/stripe`) while the worker speaks
//! Stripe's through the Stripe connector.
//!
//! Waits are on conditions with a deadline (the provider's delivery log,
//! the database), never a sleep of a guessed length.

use cobro_core::Clock;
use cobro_test_support::{
    Backend, Dialect, Rig, manual_payment_body, on_both_backends, on_every_provider, payment_body,
    wait_for,
};
use cobro_worker::Step;
use fake_provider::{FaultAction, FaultRule, Operation as FOp, WebhookDelivery};
use serde_json::{Value, json};
use std::time::Duration;

mod delivered {
    use super::*;
    on_every_provider!(
        duplicate_deliveries_are_applied_once,
        reordered_events_never_move_a_payment_backwards,
        a_delivery_refused_once_and_redelivered_is_applied_once,
        a_webhook_before_the_workers_answer_and_an_answer_before_the_webhook_end_alike,
        a_refund_event_settles_the_refund_it_names,
    );
}

// Events written and signed by hand in the fake's own shape (fake
// dialect), and in Stripe's (`Stripe-Signature: t=..,v1=..[,v1=..]`, the
// PaymentIntent as the fake's Stripe dialect holds it) at
// `/v1/webhooks/stripe`. Stripe's scheme is also unit-tested in
// cobro-provider's `stripe::webhooks`, and delivered end to end by the
// tests above and tests/localstripe.rs.
on_both_backends!(
    a_bad_signature_an_old_timestamp_and_a_malformed_body_change_nothing,
    event_ids_are_kept_for_their_retention_and_no_longer,
    stripe_signatures_outside_the_rules_change_nothing_and_one_valid_v1_of_two_is_enough,
    hand_signed_stripe_events_duplicated_and_reordered_apply_once_and_never_move_backwards,
);

const SECRET: &str = "whsec_test_cobro";
const PATIENCE: Duration = Duration::from_secs(10);

/// A rig whose provider sends its webhooks to the app.
async fn rig_with_webhooks(backend: Backend, dialect: Dialect) -> Rig {
    let mut rig = Rig::new_in(backend, dialect).await;
    rig.accept_webhooks(SECRET, true).await;
    rig
}

/// The rig's dialect's name for the fake's event `fake`: the Stripe event
/// the Stripe dialect sends for the same effect.
fn event(rig: &Rig, fake: &'static str) -> &'static str {
    match (rig.dialect, fake) {
        (Dialect::Fake, _) => fake,
        (Dialect::Stripe, "charge.authorized") => "payment_intent.amount_capturable_updated",
        (Dialect::Stripe, "charge.captured") => "payment_intent.succeeded",
        (Dialect::Stripe, "charge.voided") => "payment_intent.canceled",
        (Dialect::Stripe, "refund.succeeded") => "refund.created",
        (Dialect::Stripe, other) => panic!("no Stripe event named for {other}"),
    }
}

/// `(event, outcome)` with the rig's dialect's name for the fake's event.
fn row(rig: &Rig, fake: &'static str, outcome: &str) -> (String, String) {
    (event(rig, fake).to_owned(), outcome.to_owned())
}

/// The provider's acknowledged deliveries of events of `event_type`, in
/// the order they were made.
fn acked(rig: &Rig, event_type: &str) -> Vec<WebhookDelivery> {
    rig.provider
        .control()
        .webhook_deliveries()
        .into_iter()
        .filter(|d| d.event_type == event_type && d.acknowledged())
        .collect()
}

/// Waits until `n` deliveries of `event_type` were acknowledged.
async fn wait_acked(rig: &Rig, event_type: &str, n: usize) -> Vec<WebhookDelivery> {
    wait_for(
        &format!("{n} deliveries of {event_type} are acknowledged"),
        PATIENCE,
        async || {
            let found = acked(rig, event_type);
            (found.len() >= n).then_some(found)
        },
    )
    .await
}

/// `(event_type, outcome)` of every stored event, sorted.
async fn stored_events(rig: &Rig) -> Vec<(String, String)> {
    use sqlx::Connection;
    let sql = "SELECT event_type, outcome FROM webhook_events ORDER BY event_type, outcome";
    let url = &rig.app.db.url;
    if url.starts_with("postgres") {
        let mut c = sqlx::PgConnection::connect(url).await.expect("connect");
        sqlx::query_as(sql).fetch_all(&mut c).await.expect("events")
    } else {
        let mut c = sqlx::SqliteConnection::connect(url).await.expect("connect");
        sqlx::query_as(sql).fetch_all(&mut c).await.expect("events")
    }
}

async fn webhook_decisions(rig: &Rig) -> i64 {
    rig.app
        .db
        .count(&format!(
            "reconciliation_decisions WHERE actor = 'webhook:{}' AND run_id IS NULL",
            rig.dialect.webhook_provider()
        ))
        .await
}

async fn duplicate_deliveries_are_applied_once(backend: Backend, dialect: Dialect) {
    let rig = rig_with_webhooks(backend, dialect).await;
    let control = rig.provider.control();
    // The worker's answer is lost, so the webhook is what settles the
    // payment; every event is delivered twice.
    control
        .add_fault(FaultRule::new(FOp::Charge, FaultAction::DropResponseAfterEffect).with_next(1));
    control.add_fault(FaultRule::new(FOp::Webhook, FaultAction::Duplicate));
    let p = rig.create_payment("k-1", &payment_body("o-1")).await;
    let id = p["id"].as_str().expect("id");
    assert_eq!(
        rig.drain(1).await,
        vec![Step::Rescheduled { class: "unknown" }]
    );

    let deliveries = wait_acked(&rig, event(&rig, "charge.captured"), 2).await;
    assert_eq!(
        deliveries[0].event_id, deliveries[1].event_id,
        "the same event, twice"
    );
    assert_eq!(
        stored_events(&rig).await,
        vec![row(&rig, "charge.captured", "applied")],
        "one row per event id"
    );
    assert_eq!(webhook_decisions(&rig).await, 1, "one audit row");
    let p = rig.payment(id).await;
    assert_eq!(p["status"], "captured");
    assert_eq!(p["amount_captured"], 1999);
    assert_eq!(p["attempts"][0]["state"], "succeeded");
    assert!(
        p["provider_ref"]
            .as_str()
            .expect("ref")
            .starts_with(dialect.charge_prefix())
    );

    // The worker's retry finds the attempt settled and sends nothing.
    rig.app.clock.advance(chrono::Duration::seconds(5));
    assert_eq!(rig.drain(2).await, vec![Step::Skipped]);
    assert_eq!(rig.payment(id).await["attempts"][0]["sends"], 1);
    let ledger = rig.ledger();
    assert_eq!(ledger.totals.charges, 1);
    assert!(ledger.duplicate_charge_references.is_empty());
}

async fn reordered_events_never_move_a_payment_backwards(backend: Backend, dialect: Dialect) {
    let rig = rig_with_webhooks(backend, dialect).await;
    let control = rig.provider.control();
    // `charge.authorized` is held back until the next event of the charge
    // (`charge.captured`) has been sent; the capture's answer is lost, so
    // that event is what settles the capture.
    control.add_fault(FaultRule::new(FOp::Webhook, FaultAction::Reorder).with_next(1));
    control
        .add_fault(FaultRule::new(FOp::Capture, FaultAction::DropResponseAfterEffect).with_next(1));
    let p = rig.create_payment("k-1", &manual_payment_body("o-1")).await;
    let id = p["id"].as_str().expect("id");
    rig.drain(1).await;
    assert_eq!(rig.payment(id).await["status"], "authorized");
    let r = rig
        .app
        .post(&format!("/v1/payments/{id}/capture"), Some("cap-1"))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status().as_u16(), 202);
    assert_eq!(
        rig.drain(1).await,
        vec![Step::Rescheduled { class: "unknown" }]
    );

    wait_acked(&rig, event(&rig, "charge.authorized"), 1).await;
    let order: Vec<String> = control
        .webhook_deliveries()
        .into_iter()
        .filter(WebhookDelivery::acknowledged)
        .map(|d| d.event_type)
        .collect();
    assert_eq!(
        order,
        [
            event(&rig, "charge.captured"),
            event(&rig, "charge.authorized")
        ],
        "delivered out of order"
    );
    let mut expected = vec![
        row(&rig, "charge.authorized", "ignored_stale"),
        row(&rig, "charge.captured", "applied"),
    ];
    expected.sort();
    assert_eq!(stored_events(&rig).await, expected);
    let p = rig.payment(id).await;
    assert_eq!(p["status"], "captured", "never back to authorized");
    assert_eq!(p["amount_captured"], 1999);
    assert_eq!(webhook_decisions(&rig).await, 1);
    // The fake's charge counts its events (the capture is its second);
    // Stripe's sequence is derived, a terminal state ranking 2 (its
    // `created` below 10^10).
    let latest = match dialect {
        Dialect::Fake => "provider_sequence = 2",
        Dialect::Stripe => "provider_sequence >= 20000000000",
    };
    assert_eq!(
        rig.app.db.count(&format!("payments WHERE {latest}")).await,
        1
    );

    rig.app.clock.advance(chrono::Duration::seconds(5));
    assert_eq!(rig.drain(2).await, vec![Step::Skipped]);
    assert_eq!(rig.payment(id).await["status"], "captured");
    let ledger = rig.ledger();
    assert_eq!((ledger.totals.charges, ledger.totals.captures), (1, 1));
}

async fn a_delivery_refused_once_and_redelivered_is_applied_once(
    backend: Backend,
    dialect: Dialect,
) {
    let mut rig = Rig::new_in(backend, dialect).await;
    rig.accept_webhooks(SECRET, false).await;
    let control = rig.provider.control();
    control.add_fault(FaultRule::new(
        FOp::Charge,
        FaultAction::DropResponseAfterEffect,
    ));

    // o-1: the provider signs with a secret cobro does not accept, so
    // cobro answers 400 and stores nothing; the provider retries, and once
    // it signs with the right secret the event is applied, once.
    rig.point_webhooks("whsec_wrong");
    let one = rig.create_payment("k-1", &payment_body("o-1")).await;
    rig.drain(1).await;
    let refused = wait_for("a delivery is refused", PATIENCE, async || {
        control
            .webhook_deliveries()
            .into_iter()
            .find(|d| d.status == Some(400))
    })
    .await;
    assert_eq!(rig.app.db.count("webhook_events").await, 0);
    assert_eq!(
        rig.payment(one["id"].as_str().expect("id")).await["status"],
        "processing"
    );
    rig.point_webhooks(SECRET);
    let accepted = wait_acked(&rig, event(&rig, "charge.captured"), 1).await;
    assert_eq!(accepted[0].event_id, refused.event_id);
    assert!(accepted[0].attempt > 1, "a redelivery");

    // o-2: the first delivery is dropped by the provider and redelivered.
    control.add_fault(FaultRule::new(FOp::Webhook, FaultAction::DropThenRedeliver).with_next(1));
    let two = rig.create_payment("k-2", &payment_body("o-2")).await;
    rig.drain(1).await;
    wait_acked(&rig, event(&rig, "charge.captured"), 2).await;
    assert!(
        control
            .webhook_deliveries()
            .iter()
            .any(|d| d.error.as_deref() == Some("dropped by fault"))
    );

    for p in [&one, &two] {
        let p = rig.payment(p["id"].as_str().expect("id")).await;
        assert_eq!(p["status"], "captured");
        assert_eq!(p["attempts"][0]["state"], "succeeded");
    }
    assert_eq!(
        stored_events(&rig).await,
        vec![row(&rig, "charge.captured", "applied"); 2]
    );
    assert_eq!(webhook_decisions(&rig).await, 2);
    let ledger = rig.ledger();
    assert_eq!(ledger.totals.charges, 2);
    assert!(ledger.duplicate_charge_references.is_empty());
}

async fn a_webhook_before_the_workers_answer_and_an_answer_before_the_webhook_end_alike(
    backend: Backend,
    dialect: Dialect,
) {
    let mut rig = Rig::with_in(backend, dialect, |client, _| {
        client.request_timeout = Duration::from_secs(10);
    })
    .await;
    rig.accept_webhooks(SECRET, true).await;
    let control = rig.provider.control();
    // o-1: the provider holds its answer back; the webhook comes first.
    control.add_fault(
        FaultRule::new(FOp::Charge, FaultAction::DelayAfterEffect)
            .with_reference("o-1:")
            .with_delay(Duration::from_millis(3000))
            .with_next(1),
    );
    // o-2: the webhook is held back; the worker's answer comes first.
    control.add_fault(
        FaultRule::new(FOp::Webhook, FaultAction::Latency)
            .with_reference("o-2:")
            .with_delay(Duration::from_millis(500))
            .with_next(1),
    );

    let first = rig.create_payment("k-1", &payment_body("o-1")).await;
    let first_id = first["id"].as_str().expect("id").to_owned();
    let worker = rig.worker.clone();
    let answer = tokio::spawn(async move { worker.run_once().await });
    let settled_by_webhook = wait_for("the webhook settled o-1", PATIENCE, async || {
        let p = rig.payment(&first_id).await;
        (p["status"] == "captured").then_some(p)
    })
    .await;
    assert!(
        !answer.is_finished(),
        "the worker's answer is still held back"
    );
    assert_eq!(
        answer.await.expect("join").expect("worker"),
        vec![Step::Recorded { class: "succeeded" }],
        "the late answer is recorded as what it is, and changes nothing"
    );
    assert_eq!(rig.payment(&first_id).await, settled_by_webhook);

    let second = rig.create_payment("k-2", &payment_body("o-2")).await;
    let second_id = second["id"].as_str().expect("id").to_owned();
    assert_eq!(
        rig.drain(1).await,
        vec![Step::Recorded { class: "succeeded" }]
    );
    let settled_by_worker = rig.payment(&second_id).await;
    assert_eq!(settled_by_worker["status"], "captured");
    wait_acked(&rig, event(&rig, "charge.captured"), 2).await;
    assert_eq!(rig.payment(&second_id).await, settled_by_worker);

    // One single state, whoever came first.
    let shape = |p: &Value| {
        json!({
            "status": p["status"],
            "amount_captured": p["amount_captured"],
            "has_ref": p["provider_ref"].is_string(),
            "attempts": p["attempts"].as_array().map(|a| a.iter().map(|a| a["state"].clone()).collect::<Vec<_>>()),
        })
    };
    assert_eq!(shape(&settled_by_webhook), shape(&settled_by_worker));
    assert_eq!(
        stored_events(&rig).await,
        [
            row(&rig, "charge.captured", "applied"),
            row(&rig, "charge.captured", "duplicate_effect"),
        ]
    );
    assert_eq!(webhook_decisions(&rig).await, 1, "only the applied one");
    let ledger = rig.ledger();
    assert_eq!(
        cobro_test_support::for_intent(&ledger, "o-1:authorize-v1").charges,
        1
    );
    assert_eq!(
        cobro_test_support::for_intent(&ledger, "o-2:authorize-v1").charges,
        1
    );
    assert_eq!(ledger.totals.charges, 2);
}

async fn a_refund_event_settles_the_refund_it_names(backend: Backend, dialect: Dialect) {
    let rig = rig_with_webhooks(backend, dialect).await;
    let control = rig.provider.control();
    control
        .add_fault(FaultRule::new(FOp::Refund, FaultAction::DropResponseAfterEffect).with_next(1));
    let mut body = payment_body("o-1");
    body["amount"] = json!(1000);
    let p = rig.create_payment("k-1", &body).await;
    let id = p["id"].as_str().expect("id");
    rig.drain(1).await;
    wait_acked(&rig, event(&rig, "charge.captured"), 1).await;
    let r = rig
        .app
        .post(&format!("/v1/payments/{id}/refunds"), Some("r-1"))
        .json(&json!({"amount": 400}))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status().as_u16(), 201);
    assert_eq!(
        rig.drain(1).await,
        vec![Step::Rescheduled { class: "unknown" }]
    );
    wait_acked(&rig, event(&rig, "refund.succeeded"), 1).await;
    let p = rig.payment(id).await;
    assert_eq!(p["status"], "partially_refunded");
    assert_eq!(p["amount_refunded"], 400);
    let refund: Value = rig
        .app
        .get(&format!(
            "/v1/payments/{id}/refunds/{}",
            r.json::<Value>().await.expect("json")["id"]
                .as_str()
                .expect("refund id")
        ))
        .send()
        .await
        .expect("get")
        .json()
        .await
        .expect("json");
    assert_eq!(refund["status"], "succeeded");
    // The charge's event may come before or after the worker's answer
    // (the provider emits it before it answers); either way it is one row.
    // Stripe also sends `charge.refunded` (the Charge, which names no
    // refund of cobro's): stored as unmatched, proving nothing.
    let mut events = stored_events(&rig).await;
    if dialect == Dialect::Stripe {
        let refunded = ("charge.refunded".to_owned(), "unmatched".to_owned());
        assert!(events.contains(&refunded), "{events:?}");
        events.retain(|e| *e != refunded);
    }
    assert_eq!(events.len(), 2, "{events:?}");
    let (captured, refunded) = (&events[0], &events[1]);
    assert_eq!(captured.0, event(&rig, "charge.captured"));
    assert!(["applied", "duplicate_effect"].contains(&captured.1.as_str()));
    assert_eq!(*refunded, row(&rig, "refund.succeeded", "applied"));
    assert_eq!(
        rig.app
            .db
            .count(&format!(
                "reconciliation_decisions WHERE actor = 'webhook:{}' AND refund_id IS NOT NULL",
                dialect.webhook_provider()
            ))
            .await,
        1
    );
    let ledger = rig.ledger();
    assert_eq!((ledger.totals.charges, ledger.totals.refunds), (1, 1));
}

/// A `charge.captured` event for `reference`, as the provider would send it.
fn captured_event(event_id: &str, reference: &str, sequence: i64) -> Value {
    json!({
        "id": event_id, "type": "charge.captured", "created": "2026-11-30T12:00:00Z",
        "sequence": sequence,
        "data": {"id": "ch_test", "object": "charge", "amount": 1999, "currency": "EUR",
                 "payment_method": "pm_card_visa", "reference": reference, "status": "captured",
                 "amount_captured": 1999, "amount_refunded": 0,
                 "created": "2026-11-30T12:00:00Z", "sequence": sequence},
    })
}

/// POSTs `body` to the webhook endpoint of `provider` with `signature`
/// (as `Stripe-Signature` to `stripe`, else `Fake-Signature`).
async fn post_webhook(
    rig: &Rig,
    provider: &str,
    body: &[u8],
    signature: Option<String>,
) -> (u16, Value) {
    let mut request = rig
        .app
        .client
        .post(format!("{}/v1/webhooks/{provider}", rig.app.url))
        .header("content-type", "application/json")
        .body(body.to_vec());
    if let Some(signature) = signature {
        let header = match provider {
            "stripe" => fake_provider::STRIPE_SIGNATURE_HEADER,
            _ => fake_provider::SIGNATURE_HEADER,
        };
        request = request.header(header, signature);
    }
    let response = request.send().await.expect("send");
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

/// A request the endpoint must refuse: (case, provider, body, signature,
/// status, problem code).
type Refused<'a> = (&'a str, &'a str, Vec<u8>, Option<String>, u16, &'a str);

/// Posts every refused delivery, each answered with its status and problem
/// code, then checks that none of them stored an event, made a decision or
/// moved the payment.
async fn assert_refused_and_unchanged(
    rig: &Rig,
    cases: Vec<Refused<'_>>,
    id: &str,
    before: &Value,
) {
    for (case, provider, body, signature, status, code) in cases {
        let (got, problem) = post_webhook(rig, provider, &body, signature).await;
        assert_eq!(got, status, "{case}: {problem}");
        assert_eq!(problem["code"], code, "{case}");
    }
    assert_eq!(
        rig.app.db.count("webhook_events").await,
        0,
        "nothing stored"
    );
    assert_eq!(webhook_decisions(rig).await, 0);
    assert_eq!(&rig.payment(id).await, before, "payment unchanged");
}

async fn a_bad_signature_an_old_timestamp_and_a_malformed_body_change_nothing(backend: Backend) {
    // The provider sends no webhooks here: the test sends them by hand.
    let mut rig = Rig::new(backend).await;
    rig.accept_webhooks(SECRET, false).await;
    rig.provider.control().add_fault(FaultRule::new(
        FOp::Charge,
        FaultAction::DropResponseAfterEffect,
    ));
    let p = rig.create_payment("k-1", &payment_body("o-1")).await;
    let id = p["id"].as_str().expect("id");
    rig.drain(1).await;
    let before = rig.payment(id).await;
    assert_eq!(before["status"], "processing");

    let now = rig.app.clock.now().timestamp();
    let event = serde_json::to_vec(&captured_event("evt_1", "o-1:authorize-v1", 1)).expect("json");
    let sign = |secret: &str, t: i64, body: &[u8]| Some(fake_provider::sign(secret, t, body));
    let too_big = vec![b' '; 64 * 1024 + 1];
    let cases: Vec<Refused> = vec![
        (
            "wrong secret",
            "fake",
            event.clone(),
            sign("whsec_other", now, &event),
            400,
            "webhook-signature-invalid",
        ),
        (
            "old timestamp",
            "fake",
            event.clone(),
            sign(SECRET, now - 301, &event),
            400,
            "webhook-signature-invalid",
        ),
        (
            "future timestamp",
            "fake",
            event.clone(),
            sign(SECRET, now + 301, &event),
            400,
            "webhook-signature-invalid",
        ),
        (
            "no signature",
            "fake",
            event.clone(),
            None,
            400,
            "webhook-signature-invalid",
        ),
        (
            "body changed after signing",
            "fake",
            event.clone(),
            sign(SECRET, now, b"{}"),
            400,
            "webhook-signature-invalid",
        ),
        (
            "malformed JSON",
            "fake",
            b"{not json".to_vec(),
            sign(SECRET, now, b"{not json"),
            400,
            "validation-error",
        ),
        (
            "missing fields",
            "fake",
            br#"{"id":"evt_2","type":"charge.captured"}"#.to_vec(),
            sign(SECRET, now, br#"{"id":"evt_2","type":"charge.captured"}"#),
            400,
            "validation-error",
        ),
        (
            "unknown provider",
            "other",
            event.clone(),
            sign(SECRET, now, &event),
            404,
            "not-found",
        ),
        (
            "over 64 KiB",
            "fake",
            too_big.clone(),
            sign(SECRET, now, &too_big),
            413,
            "body-too-large",
        ),
    ];
    assert_refused_and_unchanged(&rig, cases, id, &before).await;

    // The same event, correctly signed (and padded past the 16 KiB limit of
    // merchant requests), passes the checks above and is stored. It names
    // a charge the provider never made under a reference that is no
    // attempt of cobro's (attempts are sent as `{intent}/{attempt id}`):
    // kept as an unmatched conflict, never adopted.
    let mut padded = captured_event("evt_1", "o-1:authorize-v1", 1);
    padded["padding"] = json!("x".repeat(20 * 1024));
    let padded = serde_json::to_vec(&padded).expect("json");
    let (status, receipt) =
        post_webhook(&rig, "fake", &padded, sign(SECRET, now - 299, &padded)).await;
    assert_eq!(status, 200);
    assert_eq!(
        receipt,
        json!({"event_id": "evt_1", "outcome": "unmatched"})
    );
    let (status, receipt) = post_webhook(&rig, "fake", &padded, sign(SECRET, now, &padded)).await;
    assert_eq!(status, 200);
    assert_eq!(receipt["outcome"], "duplicate_delivery");
    assert_eq!(rig.payment(id).await, before, "nothing adopted");
    assert_eq!(rig.app.db.count("webhook_events").await, 1);
    assert_eq!(
        rig.app
            .db
            .count("evidence_conflicts WHERE kind = 'unmatched'")
            .await,
        1,
        "reported"
    );
    assert_eq!(rig.ledger().totals.charges, 1);
}

async fn event_ids_are_kept_for_their_retention_and_no_longer(backend: Backend) {
    let mut rig = Rig::new(backend).await;
    rig.accept_webhooks(SECRET, false).await;
    let send = async |event_id: &str| {
        let body = serde_json::to_vec(&captured_event(event_id, "o-unknown:authorize-v1", 1))
            .expect("json");
        let t = rig.app.clock.now().timestamp();
        let (status, receipt) = post_webhook(
            &rig,
            "fake",
            &body,
            Some(fake_provider::sign(SECRET, t, &body)),
        )
        .await;
        assert_eq!(status, 200);
        receipt["outcome"].as_str().expect("outcome").to_owned()
    };
    // An event cobro cannot match is kept (for the reconciler) all the same.
    assert_eq!(send("evt_old").await, "unmatched");
    rig.app.clock.advance(chrono::Duration::days(2));
    assert_eq!(send("evt_young").await, "unmatched");
    rig.app.clock.advance(chrono::Duration::days(29));

    // 30 days of retention: the first is 31 days old, the second 29.
    let cutoff = rig.app.clock.now_minus(chrono::Duration::days(30));
    let store = &rig.app.db.store;
    assert_eq!(
        store
            .delete_expired_webhook_events(cutoff, 100)
            .await
            .expect("purge"),
        1
    );
    assert!(
        store
            .webhook_event("fake", "evt_old")
            .await
            .expect("read")
            .is_none()
    );
    let young = store
        .webhook_event("fake", "evt_young")
        .await
        .expect("read")
        .expect("kept");
    assert_eq!(young.outcome, cobro_core::WebhookOutcome::Unmatched);
    assert!(young.payment_id.is_none());
    // Within its retention, a redelivery is still recognised.
    assert_eq!(send("evt_young").await, "duplicate_delivery");
    assert_eq!(rig.ledger().totals.charges, 0);
}

/// A Stripe event of type `kind` about `object`, created at `created`
/// (unix seconds), as Stripe sends it.
fn stripe_event(event_id: &str, kind: &str, created: i64, object: &Value) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "id": event_id, "object": "event", "api_version": fake_provider::STRIPE_API_VERSION,
        "created": created, "data": {"object": object}, "livemode": false,
        "pending_webhooks": 1, "request": {"id": null, "idempotency_key": null}, "type": kind,
    }))
    .expect("json")
}

/// The PaymentIntent `id` as the fake's Stripe dialect holds it now.
async fn payment_intent_at_stripe(rig: &Rig, id: &str) -> Value {
    rig.app
        .client
        .get(format!("{}/v1/payment_intents/{id}", rig.provider.url()))
        .bearer_auth(cobro_test_support::RIG_SECRET_KEY)
        .header("stripe-version", fake_provider::STRIPE_API_VERSION)
        .send()
        .await
        .expect("GET the PaymentIntent")
        .json()
        .await
        .expect("json")
}

/// The hex of the `v1=` of a `Stripe-Signature` made with `secret`.
fn v1(secret: &str, t: i64, body: &[u8]) -> String {
    let signature = fake_provider::sign(secret, t, body);
    let (_, hex) = signature.split_once(",v1=").expect("t=..,v1=..");
    hex.to_owned()
}

/// `Stripe-Signature` as Stripe documents it: `t` and one or more `v1`
/// (HMAC-SHA256 of `t.body`), compared in constant time, `t` within 300 s
/// of cobro's clock. Every refusal is a 400 that stores nothing and moves
/// nothing; a header with two `v1` of which one is right (a rotating
/// secret) is accepted at the edge of the tolerance, and the event settles
/// the payment the worker could not: one charge.
async fn stripe_signatures_outside_the_rules_change_nothing_and_one_valid_v1_of_two_is_enough(
    backend: Backend,
) {
    let mut rig = Rig::new_in(backend, Dialect::Stripe).await;
    rig.accept_webhooks(SECRET, false).await;
    rig.provider.control().add_fault(FaultRule::new(
        FOp::Charge,
        FaultAction::DropResponseAfterEffect,
    ));
    let p = rig.create_payment("k-1", &payment_body("o-1")).await;
    let id = p["id"].as_str().expect("id");
    rig.drain(1).await;
    let before = rig.payment(id).await;
    assert_eq!(before["status"], "processing");
    let ledger = rig.ledger();
    let [(intent, _)] = ledger.payment_intents.iter().collect::<Vec<_>>()[..] else {
        panic!("one PaymentIntent charged: {ledger:?}");
    };
    let object = payment_intent_at_stripe(&rig, intent).await;
    assert_eq!(object["status"], "succeeded", "{object}");

    let now = rig.app.clock.now().timestamp();
    let event = stripe_event("evt_1", "payment_intent.succeeded", now, &object);
    let sign = |secret: &str, t: i64, body: &[u8]| Some(fake_provider::sign(secret, t, body));
    let refused = |case, signature| {
        (
            case,
            "stripe",
            event.clone(),
            signature,
            400,
            "webhook-signature-invalid",
        )
    };
    let cases: Vec<Refused> = vec![
        refused("another secret", sign("whsec_other", now, &event)),
        refused(
            "two v1, neither ours",
            Some(format!(
                "t={now},v1={},v1={}",
                v1("whsec_other", now, &event),
                v1("whsec_older", now, &event)
            )),
        ),
        refused("older than the tolerance", sign(SECRET, now - 301, &event)),
        refused("newer than the tolerance", sign(SECRET, now + 301, &event)),
        refused("signed over another body", sign(SECRET, now, b"{}")),
        refused(
            "a right v1 under another t",
            Some(format!("t={},v1={}", now - 1, v1(SECRET, now, &event))),
        ),
        refused("no t", Some(format!("v1={}", v1(SECRET, now, &event)))),
        // Stripe's test-mode `v0` is not a signature cobro accepts.
        refused(
            "only a v0",
            Some(format!("t={now},v0={}", v1(SECRET, now, &event))),
        ),
        refused("no signature", None),
    ];
    assert_refused_and_unchanged(&rig, cases, id, &before).await;
    let ledger = rig.ledger();
    assert_eq!((ledger.totals.charges, ledger.totals.captures), (1, 0));

    // Two v1, the first of another secret, the second ours, 299 s old.
    let t = now - 299;
    let two = format!(
        "t={t},v1={},v1={}",
        v1("whsec_other", t, &event),
        v1(SECRET, t, &event)
    );
    let (status, receipt) = post_webhook(&rig, "stripe", &event, Some(two)).await;
    assert_eq!(status, 200, "{receipt}");
    assert_eq!(receipt, json!({"event_id": "evt_1", "outcome": "applied"}));
    let p = rig.payment(id).await;
    assert_eq!(p["status"], "captured");
    assert_eq!(p["provider_ref"], intent.as_str());
    assert_eq!(p["amount_captured"], 1999);
    assert_eq!(
        stored_events(&rig).await,
        [("payment_intent.succeeded".to_owned(), "applied".to_owned())]
    );
    // The worker's retry finds it settled: still one send, one charge.
    rig.app.clock.advance(chrono::Duration::seconds(5));
    assert_eq!(rig.drain(2).await, vec![Step::Skipped]);
    assert_eq!(rig.payment(id).await["attempts"][0]["sends"], 1);
    let ledger = rig.ledger();
    assert_eq!(ledger.totals.charges, 1);
    assert!(cobro_test_support::double_charges(&ledger).is_empty());
    let charge = ledger.charge_of_payment_intent(intent).expect("its charge");
    assert_eq!(
        (charge.status.as_str(), charge.amount_captured),
        ("captured", 1999)
    );
}

/// Stripe's events carry no sequence; cobro derives one from the
/// PaymentIntent's state order and `created`. Hand-signed here, both in
/// the same second: the capture's `payment_intent.succeeded` first (it
/// settles the capture whose answer was lost), then the older
/// `payment_intent.amount_capturable_updated` (stale: never back to
/// authorized), then each again (duplicates: the same id, stored once).
async fn hand_signed_stripe_events_duplicated_and_reordered_apply_once_and_never_move_backwards(
    backend: Backend,
) {
    let mut rig = Rig::new_in(backend, Dialect::Stripe).await;
    rig.accept_webhooks(SECRET, false).await;
    rig.provider
        .control()
        .add_fault(FaultRule::new(FOp::Capture, FaultAction::DropResponseAfterEffect).with_next(1));
    let p = rig.create_payment("k-1", &manual_payment_body("o-1")).await;
    let id = p["id"].as_str().expect("id");
    assert_eq!(
        rig.drain(1).await,
        vec![Step::Recorded { class: "succeeded" }]
    );
    let authorized = rig.payment(id).await;
    assert_eq!(authorized["status"], "authorized");
    let intent = authorized["provider_ref"]
        .as_str()
        .expect("intent")
        .to_owned();
    let requires_capture = payment_intent_at_stripe(&rig, &intent).await;
    assert_eq!(requires_capture["status"], "requires_capture");
    let r = rig
        .app
        .post(&format!("/v1/payments/{id}/capture"), Some("cap-1"))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status().as_u16(), 202);
    assert_eq!(
        rig.drain(1).await,
        vec![Step::Rescheduled { class: "unknown" }]
    );
    assert_eq!(rig.payment(id).await["status"], "capturing");
    let succeeded = payment_intent_at_stripe(&rig, &intent).await;
    assert_eq!(succeeded["status"], "succeeded");

    let now = rig.app.clock.now().timestamp();
    let capturable = stripe_event(
        "evt_capturable",
        "payment_intent.amount_capturable_updated",
        now,
        &requires_capture,
    );
    let captured = stripe_event("evt_succeeded", "payment_intent.succeeded", now, &succeeded);
    let deliveries = [
        (&captured, "applied"),
        (&capturable, "ignored_stale"),
        (&captured, "duplicate_delivery"),
        (&capturable, "duplicate_delivery"),
    ];
    for (body, outcome) in deliveries {
        let signature = fake_provider::sign(SECRET, now, body);
        let (status, receipt) = post_webhook(&rig, "stripe", body, Some(signature)).await;
        assert_eq!(status, 200, "{receipt}");
        assert_eq!(receipt["outcome"], outcome, "{receipt}");
        let p = rig.payment(id).await;
        assert_eq!(p["status"], "captured", "never backwards: {p}");
        assert_eq!(p["amount_captured"], 1999);
    }
    assert_eq!(
        stored_events(&rig).await,
        [
            (
                "payment_intent.amount_capturable_updated".to_owned(),
                "ignored_stale".to_owned()
            ),
            ("payment_intent.succeeded".to_owned(), "applied".to_owned()),
        ]
    );
    assert_eq!(webhook_decisions(&rig).await, 1, "one audit row");
    assert_eq!(
        rig.app
            .db
            .count(&format!(
                "payments WHERE provider_sequence = {}",
                2 * 10_000_000_000i64 + now
            ))
            .await,
        1,
        "the derived sequence of the terminal state"
    );
    // The capture's retry finds it settled and sends nothing more.
    rig.app.clock.advance(chrono::Duration::seconds(5));
    assert_eq!(rig.drain(2).await, vec![Step::Skipped]);
    let ledger = rig.ledger();
    assert_eq!((ledger.totals.charges, ledger.totals.captures), (1, 1));
    let charge = ledger
        .charge_of_payment_intent(&intent)
        .expect("its charge");
    assert_eq!(
        (charge.status.as_str(), charge.amount_captured),
        ("captured", 1999)
    );
    assert!(cobro_test_support::double_charges(&ledger).is_empty());
}
