//! The provider API itself: authentication, validation, the charge
//! lifecycle, refunds, reads and search, and shutdown.
#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

mod common;

use common::{EffectsExt, charge_body, charges, declines, provider, refunds};
use fake_provider::Effects;
use serde_json::{Value, json};

#[tokio::test]
async fn a_request_without_a_bearer_key_is_rejected_with_401_and_no_effect() {
    let p = provider().await;
    let no_auth = p
        .http
        .post(format!("{}/v1/charges", p.url))
        .json(&charge_body("pedido-1"))
        .send()
        .await
        .unwrap();
    let empty = p
        .http
        .post(format!("{}/v1/charges", p.url))
        .header("Authorization", "Bearer ")
        .json(&charge_body("pedido-1"))
        .send()
        .await
        .unwrap();
    let get = p
        .http
        .get(format!("{}/v1/charges/ch_x", p.url))
        .send()
        .await
        .unwrap();

    assert_eq!(
        (
            no_auth.status().as_u16(),
            empty.status().as_u16(),
            get.status().as_u16()
        ),
        (401, 401, 401)
    );
    assert_eq!(p.totals(), Effects::default());
}

#[tokio::test]
async fn invalid_bodies_are_rejected_with_400_and_a_code() {
    let p = provider().await;
    let valid = charge_body("pedido-2");
    let with = |field: &str, value: Value| {
        let mut body = valid.clone();
        body[field] = value;
        body
    };
    let mut missing = valid.clone();
    missing.as_object_mut().unwrap().remove("currency");
    let cases = [
        (with("amount", json!(0)), "parameter_invalid"),
        (with("amount", json!(-5)), "parameter_invalid"),
        (with("amount", json!("12")), "parameter_invalid"),
        (with("currency", json!("eur")), "parameter_invalid"),
        (with("currency", json!("EURO")), "parameter_invalid"),
        (with("payment_method", json!("card")), "parameter_invalid"),
        (with("reference", json!("")), "parameter_invalid"),
        (with("surprise", json!(1)), "parameter_unknown"),
        (missing, "parameter_missing"),
    ];
    for (body, code) in cases {
        let answer = p.post("/v1/charges", None, &body).await.unwrap();
        assert_eq!(answer.error(), (400, code), "{body}");
        assert_eq!(answer.body["error"]["type"], "invalid_request_error");
    }
    let garbage = p
        .http
        .post(format!("{}/v1/charges", p.url))
        .bearer_auth("k")
        .body("{not json")
        .send()
        .await
        .unwrap();
    let garbage = common::answer(garbage).await.unwrap();
    assert_eq!(garbage.error(), (400, "invalid_json"));
    assert_eq!(p.totals(), Effects::default());
}

#[tokio::test]
async fn a_charge_is_authorized_captured_partially_and_refunded_with_its_sequence_bumped() {
    let p = provider().await;
    let charge = p.charge(None, "pedido-3:authorize-v1").await;
    assert_eq!(charge.status, 201);
    assert!(
        charge.id().starts_with("ch_") && charge.id().len() == 35,
        "{}",
        charge.id()
    );
    assert_eq!(charge.body["object"], "charge");
    assert_eq!(
        (
            charge.body["status"].as_str(),
            charge.body["sequence"].as_u64()
        ),
        (Some("authorized"), Some(1))
    );

    let capture = p.capture(charge.id(), None, json!({"amount": 1000})).await;
    assert_eq!(
        (capture.status, capture.body["status"].as_str()),
        (200, Some("captured"))
    );
    assert_eq!(
        (
            capture.body["amount_captured"].as_i64(),
            capture.body["sequence"].as_u64()
        ),
        (Some(1000), Some(2))
    );

    let refund_body =
        json!({"charge": charge.id(), "amount": 600, "reference": "pedido-3:refund-v1"});
    let refund = p.post("/v1/refunds", None, &refund_body).await.unwrap();
    assert_eq!(refund.status, 201);
    assert!(refund.id().starts_with("re_"));
    assert_eq!(
        (
            refund.body["object"].as_str(),
            refund.body["status"].as_str()
        ),
        (Some("refund"), Some("succeeded"))
    );
    assert_eq!(refund.body["sequence"].as_u64(), Some(3));

    let stored = p.get(&format!("/v1/charges/{}", charge.id())).await;
    assert_eq!(
        (
            stored.body["amount_refunded"].as_i64(),
            stored.body["sequence"].as_u64()
        ),
        (Some(600), Some(3))
    );
    assert_eq!(
        p.get(&format!("/v1/refunds/{}", refund.id())).await.body,
        refund.body
    );
    let ledger = p.control.ledger();
    assert_eq!(
        ledger.for_reference("pedido-3:authorize-v1"),
        charges(1).captures(1)
    );
    assert_eq!(ledger.for_reference("pedido-3:refund-v1"), refunds(1));
}

#[tokio::test]
async fn a_captured_charge_can_be_neither_captured_again_nor_voided() {
    let p = provider().await;
    let mut body = charge_body("pedido-4:authorize-v1");
    body["capture"] = json!(true);
    let charge = p.post("/v1/charges", None, &body).await.unwrap();
    assert_eq!(
        (
            charge.body["status"].as_str(),
            charge.body["amount_captured"].as_i64()
        ),
        (Some("captured"), Some(1250))
    );

    let capture = p.capture(charge.id(), None, json!({})).await;
    let void = p.void(charge.id()).await;

    assert_eq!(capture.error(), (400, "charge_not_capturable"));
    assert_eq!(void.error(), (400, "charge_not_voidable"));
    assert_eq!(p.totals(), charges(1));
}

#[tokio::test]
async fn a_voided_authorization_cannot_be_captured_voided_again_or_refunded() {
    let p = provider().await;
    let charge = p.charge(None, "pedido-5:authorize-v1").await;
    let void_path = format!("/v1/charges/{}/void", charge.id());
    // A void with no body at all is accepted, like `{}`.
    let void = p
        .http
        .post(format!("{}{void_path}", p.url))
        .bearer_auth(common::CALLER)
        .send()
        .await
        .unwrap();
    let void = common::answer(void).await.unwrap();
    assert_eq!(
        (
            void.status,
            void.body["status"].as_str(),
            void.body["sequence"].as_u64()
        ),
        (200, Some("voided"), Some(2))
    );

    let again = p.post(&void_path, None, &json!({})).await.unwrap();
    let capture = p.capture(charge.id(), None, json!({})).await;
    let refund = p.refund(charge.id(), 1, "pedido-5:refund-v1").await;

    assert_eq!(again.error(), (400, "charge_not_voidable"));
    assert_eq!(capture.error(), (400, "charge_not_capturable"));
    assert_eq!(refund.error(), (400, "refund_exceeds_captured"));
    assert_eq!(p.totals(), charges(1).voids(1));
}

#[tokio::test]
async fn a_declined_charge_is_stored_and_searchable_but_not_voidable() {
    let p = provider().await;
    let mut body = charge_body("pedido-6:authorize-v1");
    body["payment_method"] = json!("pm_card_declined");
    let declined = p.post("/v1/charges", None, &body).await.unwrap();
    let id = declined.body["charge"]["id"].as_str().unwrap().to_owned();

    assert_eq!(
        p.get(&format!("/v1/charges/{id}")).await.body["status"],
        "declined"
    );
    assert_eq!(
        p.search("charges", "pedido-6:authorize-v1").await,
        vec![id.clone()]
    );
    let void = p.void(&id).await;
    assert_eq!(void.error(), (400, "charge_not_voidable"));
    assert_eq!(p.totals(), declines(1));
}

#[tokio::test]
async fn capturing_more_than_authorized_is_refused() {
    let p = provider().await;
    let charge = p.charge(None, "pedido-7:authorize-v1").await;
    let capture = p.capture(charge.id(), None, json!({"amount": 1251})).await;

    assert_eq!(capture.error(), (400, "parameter_invalid"));
    assert_eq!(
        p.get(&format!("/v1/charges/{}", charge.id())).await.body["status"],
        "authorized"
    );
    assert_eq!(p.totals(), charges(1));
}

#[tokio::test]
async fn concurrent_refunds_with_different_keys_never_exceed_the_captured_amount() {
    let p = provider().await;
    let mut body = charge_body("pedido-8:authorize-v1");
    body["amount"] = json!(1000);
    body["capture"] = json!(true);
    let charge = p.post("/v1/charges", None, &body).await.unwrap();
    let refunds = (0..10).map(|i| {
        let body = json!({"charge": charge.id(), "amount": 300, "reference": format!("pedido-8:refund-{i}")});
        let (http, url) = (p.http.clone(), p.url.clone());
        tokio::spawn(async move {
            let response = http
                .post(format!("{url}/v1/refunds"))
                .bearer_auth(common::CALLER)
                .header("Idempotency-Key", format!("refund-{i}"))
                .json(&body)
                .send()
                .await
                .unwrap();
            common::answer(response).await.unwrap()
        })
    });
    let mut statuses = Vec::new();
    for refund in refunds.collect::<Vec<_>>() {
        let answer = refund.await.unwrap();
        if answer.status == 400 {
            assert_eq!(answer.code(), "refund_exceeds_captured");
        }
        statuses.push(answer.status);
    }

    assert_eq!(
        statuses.iter().filter(|&&s| s == 201).count(),
        3,
        "{statuses:?}"
    );
    assert_eq!(
        p.get(&format!("/v1/charges/{}", charge.id())).await.body["amount_refunded"],
        900
    );
    assert_eq!(p.totals(), charges(1).refunds(3));
}

#[tokio::test]
async fn unknown_ids_are_404_resource_missing() {
    let p = provider().await;
    let charge = p.get("/v1/charges/ch_missing").await;
    let refund = p.get("/v1/refunds/re_missing").await;
    let capture = p
        .post("/v1/charges/ch_missing/capture", None, &json!({}))
        .await
        .unwrap();
    let refund_of_missing = p
        .post(
            "/v1/refunds",
            None,
            &json!({"charge": "ch_missing", "amount": 1, "reference": "r"}),
        )
        .await
        .unwrap();

    for answer in [charge, refund, capture, refund_of_missing] {
        assert_eq!(answer.error(), (404, "resource_missing"), "{answer:?}");
    }
    assert_eq!(p.totals(), Effects::default());
}

#[tokio::test]
async fn search_lists_charges_of_a_reference_newest_first() {
    let p = provider().await;
    let older = p.charge(None, "pedido-9:authorize-v1").await;
    let newer = p.charge(None, "pedido-9:authorize-v1").await;
    p.charge(None, "pedido-90:authorize-v1").await;

    let found = p.get("/v1/charges?reference=pedido-9:authorize-v1").await;
    assert_eq!(found.body["object"], "list");
    assert_eq!(
        p.search("charges", "pedido-9:authorize-v1").await,
        vec![newer.id().to_owned(), older.id().to_owned()]
    );
    assert!(p.search("charges", "nothing-here").await.is_empty());
    let without = p.get("/v1/charges").await;
    assert_eq!(without.error(), (400, "parameter_missing"));
    let ledger = p.control.ledger();
    assert_eq!(
        ledger.duplicate_charge_references,
        vec!["pedido-9:authorize-v1".to_owned()]
    );
    assert_eq!(ledger.totals.charges, 3);
}

#[tokio::test]
async fn the_admin_api_is_absent_unless_enabled() {
    let p = provider().await;
    let ledger = p
        .http
        .get(format!("{}/__admin/ledger", p.url))
        .send()
        .await
        .unwrap();
    let fault = p
        .http
        .post(format!("{}/__admin/faults", p.url))
        .json(&json!({}))
        .send()
        .await
        .unwrap();

    assert_eq!(
        (ledger.status().as_u16(), fault.status().as_u16()),
        (404, 404)
    );
    assert!(p.control.faults().is_empty());
}

#[tokio::test]
async fn shutdown_stops_serving() {
    let p = provider().await;
    p.charge(None, "pedido-10").await;
    let url = p.url.clone();
    p.running.shutdown().await;

    let after = p
        .http
        .get(format!("{url}/v1/charges/ch_x"))
        .bearer_auth("k")
        .send()
        .await;
    assert!(after.is_err_and(|error| error.is_connect()));
    assert_eq!(p.control.ledger().totals.charges, 1);
}
