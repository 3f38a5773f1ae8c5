//! A refund's business identity: the merchant's `reference`, unique per
//! payment under any key, so a late retry never refunds twice. On both
//! backends, with two accounts sharing order refs and refund references;
//! each test counts the provider's refunds.

use cobro_test_support::{Backend, Rig, on_both_backends, payment_body};
use serde_json::{Value, json};

on_both_backends!(
    a_refund_retried_under_a_new_key_with_its_reference_refunds_once,
    a_refund_reference_is_validated_and_a_bad_one_changes_nothing,
);

/// POST a refund of `amount` with `body`'s extra fields, as `token`.
async fn refund(rig: &Rig, token: &str, payment: &str, key: &str, body: Value) -> (u16, Value) {
    let r = rig
        .app
        .post_as(token, &format!("/v1/payments/{payment}/refunds"), Some(key))
        .json(&body)
        .send()
        .await
        .expect("send");
    (r.status().as_u16(), r.json().await.expect("json"))
}

/// A captured payment of `order_ref` for the account of `token`: its id.
async fn captured(rig: &Rig, token: &str, key: &str, order_ref: &str) -> String {
    let r = rig
        .app
        .post_as(token, "/v1/payments", Some(key))
        .json(&payment_body(order_ref))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status().as_u16(), 201);
    let p: Value = r.json().await.expect("json");
    rig.drain(2).await;
    p["id"].as_str().expect("id").to_owned()
}

/// The client refunds 500 with reference `rf-1`; its key's record is long
/// gone (a new key stands for it), and it retries: refused, naming the
/// first refund, and the provider refunded once. Another account's
/// payment for the same order ref takes a refund with the same reference.
async fn a_refund_retried_under_a_new_key_with_its_reference_refunds_once(backend: Backend) {
    let rig = Rig::new(backend).await;
    let token = rig.app.token.clone();
    let id = captured(&rig, &token, "p-1", "o-1").await;
    let body = json!({ "amount": 500, "reference": "rf-1" });
    let (status, first) = refund(&rig, &token, &id, "r-1", body.clone()).await;
    assert_eq!(status, 201, "{first}");
    assert_eq!(first["reference"], "rf-1");
    rig.drain(2).await;

    let (status, again) = refund(&rig, &token, &id, "r-1-much-later", body.clone()).await;
    assert_eq!(status, 409, "{again}");
    assert_eq!(again["code"], "refund-reference-exists");
    assert_eq!(again["refund_id"], first["id"]);
    // Stored against its key: the same answer again.
    let (status, replayed) = refund(&rig, &token, &id, "r-1-much-later", body.clone()).await;
    assert_eq!((status, &replayed["refund_id"]), (409, &first["id"]));
    // Another reference is another refund.
    let (status, other) = refund(
        &rig,
        &token,
        &id,
        "r-2",
        json!({ "amount": 500, "reference": "rf-2" }),
    )
    .await;
    assert_eq!(status, 201, "{other}");

    let (_, token_b) = rig.app.new_account("merchant-b").await;
    let b = captured(&rig, &token_b, "p-b", "o-1").await;
    let (status, theirs) = refund(&rig, &token_b, &b, "r-b", body).await;
    assert_eq!(status, 201, "{theirs}");
    rig.drain(3).await;
    let ledger = rig.ledger();
    assert_eq!(ledger.totals.charges, 2);
    assert_eq!(ledger.totals.refunds, 3, "rf-1 and rf-2 of A, rf-1 of B");
    assert_eq!(rig.payment(&id).await["amount_refunded"], 1000);
}

/// A malformed reference is a 400 listing the field, and nothing is
/// refunded or reserved.
async fn a_refund_reference_is_validated_and_a_bad_one_changes_nothing(backend: Backend) {
    let rig = Rig::new(backend).await;
    let token = rig.app.token.clone();
    let id = captured(&rig, &token, "p-1", "o-2").await;
    for bad in [
        json!(""),
        json!("has space"),
        json!("x".repeat(129)),
        json!(7),
    ] {
        let (status, problem) = refund(
            &rig,
            &token,
            &id,
            "r-bad",
            json!({ "amount": 1999, "reference": bad }),
        )
        .await;
        assert_eq!(status, 400, "{problem}");
        assert_eq!(problem["errors"][0]["field"], "reference", "{problem}");
    }
    let (status, full) = refund(&rig, &token, &id, "r-ok", json!({ "amount": 1999 })).await;
    assert_eq!(status, 201, "nothing was reserved: {full}");
    rig.drain(2).await;
    assert_eq!(rig.ledger().totals.refunds, 1);
}
