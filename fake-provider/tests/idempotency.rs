//! Provider idempotency semantics: replay, conflicts, in-progress, scoping
//! per caller, and forgetting keys after retention (virtual time).
#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

mod common;

use std::time::Duration;

use common::{EffectsExt, charge_body, charges, declines, provider, provider_with, refunds};
use fake_provider::{Config, Effects, FaultAction, FaultRule, Operation};
use serde_json::json;

#[tokio::test]
async fn same_key_and_body_replays_the_first_answer_and_charges_once() {
    let p = provider().await;
    let first = p.charge(Some("key-1"), "pedido-1:authorize-v1").await;
    let second = p.charge(Some("key-1"), "pedido-1:authorize-v1").await;

    assert_eq!(first.status, 201);
    assert_eq!(first.body["status"], "authorized");
    assert!(!first.replayed);
    assert_eq!((second.status, &second.body), (201, &first.body));
    assert!(second.replayed);
    let ledger = p.control.ledger();
    assert_eq!(ledger.for_reference("pedido-1:authorize-v1"), charges(1));
    assert_eq!(ledger.for_key("key-1"), charges(1));
    assert!(ledger.duplicate_charge_references.is_empty());
}

#[tokio::test]
async fn a_decline_is_replayed_and_counted_once_as_a_decline() {
    let p = provider().await;
    let mut body = charge_body("pedido-2:authorize-v1");
    body["payment_method"] = json!("pm_card_declined");
    let first = p.post("/v1/charges", Some("key-2"), &body).await.unwrap();
    let second = p.post("/v1/charges", Some("key-2"), &body).await.unwrap();

    assert_eq!(first.status, 402);
    assert_eq!(first.code(), "card_declined");
    assert_eq!(first.body["error"]["type"], "card_error");
    assert_eq!(first.body["charge"]["status"], "declined");
    assert_eq!(
        (second.status, &second.body, second.replayed),
        (402, &first.body, true)
    );
    let effects = p.effects_of("pedido-2:authorize-v1");
    assert_eq!(effects, declines(1));
}

#[tokio::test]
async fn insufficient_funds_declines_with_its_own_code() {
    let p = provider().await;
    let mut body = charge_body("pedido-3:authorize-v1");
    body["payment_method"] = json!("pm_insufficient_funds");
    let answer = p.post("/v1/charges", Some("key-3"), &body).await.unwrap();

    assert_eq!(answer.error(), (402, "insufficient_funds"));
    assert_eq!(p.totals(), declines(1));
}

#[tokio::test]
async fn an_invalid_request_is_stored_and_replayed_under_its_key() {
    let p = provider().await;
    let mut body = charge_body("pedido-4:authorize-v1");
    body["amount"] = json!(0);
    let first = p.post("/v1/charges", Some("key-4"), &body).await.unwrap();
    let second = p.post("/v1/charges", Some("key-4"), &body).await.unwrap();

    assert_eq!(first.error(), (400, "parameter_invalid"));
    assert_eq!(
        (second.status, &second.body, second.replayed),
        (400, &first.body, true)
    );
    assert_eq!(p.totals(), Effects::default());
}

#[tokio::test]
async fn same_key_with_different_parameters_is_an_idempotency_error() {
    let p = provider().await;
    p.charge(Some("key-5"), "pedido-5:authorize-v1").await;
    let mut other = charge_body("pedido-5:authorize-v1");
    other["amount"] = json!(9999);
    let reused = p.post("/v1/charges", Some("key-5"), &other).await.unwrap();
    let capture_path = p
        .post("/v1/charges/ch_nope/capture", Some("key-5"), &json!({}))
        .await
        .unwrap();

    assert_eq!(reused.error(), (400, "idempotency_error"));
    assert_eq!(reused.body["error"]["type"], "idempotency_error");
    assert_eq!(capture_path.error(), (400, "idempotency_error"));
    assert_eq!(p.totals(), charges(1));
}

#[tokio::test]
async fn same_key_while_the_first_request_runs_gets_409_in_progress() {
    let p = provider().await;
    // Holds the first request after it reserved its key.
    p.control.add_fault(
        FaultRule::new(Operation::Charge, FaultAction::Latency)
            .with_next(1)
            .with_delay(Duration::from_millis(1500)),
    );
    let body = charge_body("pedido-6:authorize-v1");
    let first = {
        let (http, url, body) = (p.http.clone(), p.url.clone(), body.clone());
        tokio::spawn(async move {
            let response = http
                .post(format!("{url}/v1/charges"))
                .bearer_auth("sk_test_cobro")
                .header("Idempotency-Key", "key-6")
                .json(&body)
                .send()
                .await
                .unwrap();
            common::answer(response).await.unwrap()
        })
    };
    // The rule is spent in the same critical section that reserves the key.
    let control = p.control.clone();
    common::wait_until("the first request to take the latency rule", || {
        let control = control.clone();
        async move { control.faults().is_empty() }
    })
    .await;

    let concurrent = p.post("/v1/charges", Some("key-6"), &body).await.unwrap();
    assert_eq!(concurrent.error(), (409, "idempotency_in_progress"));
    assert_eq!(concurrent.body["error"]["type"], "idempotency_error");
    assert_eq!(
        p.totals(),
        Effects::default(),
        "nothing made while the first still runs"
    );

    let first = first.await.unwrap();
    assert_eq!(first.status, 201);
    let after = p.post("/v1/charges", Some("key-6"), &body).await.unwrap();
    assert_eq!(
        (after.status, after.id(), after.replayed),
        (201, first.id(), true)
    );
    assert_eq!(p.control.ledger().for_key("key-6"), charges(1));
}

#[tokio::test]
async fn the_same_key_from_two_callers_makes_two_charges() {
    let p = provider().await;
    let body = charge_body("pedido-7:authorize-v1");
    let a = p
        .post_as("sk_merchant_a", "/v1/charges", Some("shared-key"), &body)
        .await
        .unwrap();
    let b = p
        .post_as("sk_merchant_b", "/v1/charges", Some("shared-key"), &body)
        .await
        .unwrap();

    assert_eq!((a.status, b.status), (201, 201));
    assert_ne!(a.id(), b.id());
    assert!(!b.replayed);
    let ledger = p.control.ledger();
    assert_eq!(
        ledger.for_key("shared-key"),
        charges(2),
        "by_key ignores the caller"
    );
    assert_eq!(
        ledger.duplicate_charge_references,
        vec!["pedido-7:authorize-v1".to_owned()]
    );
}

#[tokio::test]
async fn after_retention_the_same_key_creates_a_new_charge() {
    let p = provider().await;
    let first = p.charge(Some("key-8"), "pedido-8:authorize-v1").await;
    p.control.advance_clock(Duration::from_secs(24 * 3600 - 60));
    let within = p.charge(Some("key-8"), "pedido-8:authorize-v1").await;
    assert_eq!((within.id(), within.replayed), (first.id(), true));
    assert_eq!(p.totals(), charges(1));

    p.control.advance_clock(Duration::from_secs(61));
    let after = p.charge(Some("key-8"), "pedido-8:authorize-v1").await;

    assert_eq!(after.status, 201);
    assert!(!after.replayed);
    assert_ne!(
        after.id(),
        first.id(),
        "the forgotten key made a second charge"
    );
    let ledger = p.control.ledger();
    assert_eq!(ledger.for_reference("pedido-8:authorize-v1"), charges(2));
    assert_eq!(
        ledger.duplicate_charge_references,
        vec!["pedido-8:authorize-v1".to_owned()]
    );
}

#[tokio::test]
async fn retention_is_configurable() {
    let p = provider_with(Config {
        retention: Duration::from_secs(60),
        ..Config::default()
    })
    .await;
    let first = p.charge(Some("key-9"), "pedido-9:authorize-v1").await;
    p.control.advance_clock(Duration::from_secs(60));
    let after = p.charge(Some("key-9"), "pedido-9:authorize-v1").await;

    assert_ne!(after.id(), first.id());
    assert_eq!(p.totals(), charges(2));
}

#[tokio::test]
async fn requests_without_a_key_are_not_deduplicated() {
    let p = provider().await;
    let a = p.charge(None, "pedido-10:authorize-v1").await;
    let b = p.charge(None, "pedido-10:authorize-v1").await;

    assert_ne!(a.id(), b.id());
    let ledger = p.control.ledger();
    assert_eq!(ledger.totals, charges(2));
    assert!(ledger.by_key.is_empty());
}

#[tokio::test]
async fn a_failure_before_the_effect_leaves_the_key_free() {
    let p = provider().await;
    p.control
        .add_fault(FaultRule::new(Operation::Charge, FaultAction::FailBeforeEffect).with_next(1));
    let failed = p.charge(Some("key-11"), "pedido-11:authorize-v1").await;
    assert_eq!(failed.error(), (503, "service_unavailable"));
    assert_eq!(p.totals(), Effects::default());

    let retried = p.charge(Some("key-11"), "pedido-11:authorize-v1").await;
    assert_eq!(retried.status, 201);
    assert!(!retried.replayed, "the 503 was not stored");
    assert_eq!(p.control.ledger().for_key("key-11"), charges(1));
}

#[tokio::test]
async fn a_failure_after_the_effect_stores_the_real_answer_for_the_retry() {
    let p = provider().await;
    p.control
        .add_fault(FaultRule::new(Operation::Charge, FaultAction::FailAfterEffect).with_next(1));
    let failed = p.charge(Some("key-12"), "pedido-12:authorize-v1").await;
    assert_eq!(failed.error(), (500, "internal_error"));
    assert_eq!(
        p.totals(),
        charges(1),
        "the charge was made despite the 500"
    );

    let retried = p.charge(Some("key-12"), "pedido-12:authorize-v1").await;
    assert_eq!((retried.status, retried.replayed), (201, true));
    assert_eq!(
        p.get(&format!("/v1/charges/{}", retried.id())).await.status,
        200
    );
    assert_eq!(p.totals(), charges(1));
}

#[tokio::test]
async fn capture_void_and_refund_replay_under_their_keys() {
    let p = provider().await;
    let charge = p.charge(Some("auth"), "pedido-13:authorize-v1").await;
    let capture_path = format!("/v1/charges/{}/capture", charge.id());
    let capture = p
        .post(&capture_path, Some("cap"), &json!({"amount": 1000}))
        .await
        .unwrap();
    let capture_again = p
        .post(&capture_path, Some("cap"), &json!({"amount": 1000}))
        .await
        .unwrap();
    let refund_body =
        json!({"charge": charge.id(), "amount": 400, "reference": "pedido-13:refund-v1"});
    let refund = p
        .post("/v1/refunds", Some("ref"), &refund_body)
        .await
        .unwrap();
    let refund_again = p
        .post("/v1/refunds", Some("ref"), &refund_body)
        .await
        .unwrap();

    assert_eq!(
        (capture.status, capture_again.status, capture_again.replayed),
        (200, 200, true)
    );
    assert_eq!(capture_again.body, capture.body);
    assert_eq!(
        (refund.status, refund_again.status, refund_again.replayed),
        (201, 201, true)
    );
    assert_eq!(refund_again.id(), refund.id());
    let ledger = p.control.ledger();
    assert_eq!(
        ledger.for_reference("pedido-13:authorize-v1"),
        charges(1).captures(1)
    );
    assert_eq!(ledger.for_reference("pedido-13:refund-v1"), refunds(1));
    let stored = p.get(&format!("/v1/charges/{}", charge.id())).await;
    assert_eq!(
        (
            stored.body["amount_captured"].as_i64(),
            stored.body["amount_refunded"].as_i64()
        ),
        (Some(1000), Some(400))
    );
}
