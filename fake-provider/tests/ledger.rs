//! The ledger as a judge: every charge and refund with its caller, amounts,
//! metadata and current state, and "one intent charged twice".
#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

mod common;

use std::collections::BTreeMap;

use common::{Answer, Provider, charge_body, provider, provider_with};
use fake_provider::ledger::{LedgerCharge, LedgerRefund};
use fake_provider::{AdminClient, Config, Ledger};
use serde_json::{Value, json};

const A: &str = "sk_merchant_a";
const B: &str = "sk_merchant_b";
const INTENT: [&str; 2] = ["cobro_account", "cobro_intent"];

/// `{"k": "v", ...}` as a metadata map.
fn metadata(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

/// The `created` of a charge or refund answer.
fn created(body: &Value) -> chrono::DateTime<chrono::Utc> {
    serde_json::from_value(body["created"].clone()).unwrap()
}

/// An attempt of `intent` of `account` by `caller`: reference
/// `{intent}/{attempt}` and cobro's four metadata keys.
async fn attempt(
    p: &Provider,
    caller: &str,
    account: &str,
    intent: &str,
    attempt: &str,
    payment_method: &str,
) -> Answer {
    let mut body = charge_body(&format!("{intent}/{attempt}"));
    body["payment_method"] = json!(payment_method);
    body["metadata"] = json!({"cobro_account": account, "cobro_payment": "pay_1", "cobro_intent": intent, "cobro_attempt": attempt});
    p.post_as(caller, "/v1/charges", None, &body).await.unwrap()
}

/// The ids of each group.
fn ids(groups: &[Vec<&LedgerCharge>]) -> Vec<Vec<String>> {
    groups
        .iter()
        .map(|group| group.iter().map(|charge| charge.id.clone()).collect())
        .collect()
}

#[tokio::test]
async fn the_ledger_lists_each_charge_and_refund_with_caller_amounts_metadata_and_current_state() {
    let p = provider().await;
    let mut body = charge_body("pedido-1:authorize-v1/a1");
    body["metadata"] = json!({"cobro_intent": "pedido-1:authorize-v1"});
    let first = p
        .post_as(A, "/v1/charges", Some("k-1"), &body)
        .await
        .unwrap();
    let capture = format!("/v1/charges/{}/capture", first.id());
    p.post_as(A, &capture, None, &json!({"amount": 1000}))
        .await
        .unwrap();
    let refund_body = json!({"charge": first.id(), "amount": 400, "reference": "pedido-1:refund-v1/r1", "metadata": {"cobro_refund": "rf-1"}});
    let refund = p
        .post_as(A, "/v1/refunds", Some("r-1"), &refund_body)
        .await
        .unwrap();
    let mut automatic = charge_body("pedido-2:authorize-v1/a1");
    automatic["capture"] = json!(true);
    automatic["currency"] = json!("USD");
    automatic["amount"] = json!(700);
    let second = p.post_as(B, "/v1/charges", None, &automatic).await.unwrap();
    let mut declined = charge_body("pedido-3:authorize-v1/a1");
    declined["payment_method"] = json!("pm_card_declined");
    let third = p.post_as(A, "/v1/charges", None, &declined).await.unwrap();
    let fourth = p
        .post_as(
            A,
            "/v1/charges",
            None,
            &charge_body("pedido-4:authorize-v1/a1"),
        )
        .await
        .unwrap();
    let void = format!("/v1/charges/{}/void", fourth.id());
    p.post_as(A, &void, None, &json!({})).await.unwrap();
    // Replays and refusals add nothing and change nothing.
    p.post_as(A, "/v1/charges", Some("k-1"), &body)
        .await
        .unwrap();
    p.post_as(A, &capture, None, &json!({})).await.unwrap();

    let ledger = p.control.ledger();
    assert_eq!(
        ledger.charges[0],
        LedgerCharge {
            id: first.id().to_owned(),
            caller: A.to_owned(),
            reference: "pedido-1:authorize-v1/a1".to_owned(),
            metadata: metadata(&[("cobro_intent", "pedido-1:authorize-v1")]),
            amount: 1250,
            currency: "EUR".to_owned(),
            capture_method: "manual".to_owned(),
            status: "captured".to_owned(),
            decline_code: None,
            amount_captured: 1000,
            amount_refunded: 400,
            idempotency_key: Some("k-1".to_owned()),
            created: created(&first.body),
        }
    );
    let second_id = second.id().to_owned();
    let third_id = third.body["charge"]["id"].as_str().unwrap().to_owned();
    let summary: Vec<_> = ledger
        .charges
        .iter()
        .map(|c| {
            (
                c.id.clone(),
                c.caller.as_str(),
                c.capture_method.as_str(),
                c.status.as_str(),
            )
        })
        .collect();
    assert_eq!(
        summary,
        [
            (first.id().to_owned(), A, "manual", "captured"),
            (second_id.clone(), B, "automatic", "captured"),
            (third_id, A, "manual", "declined"),
            (fourth.id().to_owned(), A, "manual", "voided"),
        ]
    );
    let automatic = ledger.charge(&second_id).unwrap();
    assert_eq!(
        (
            automatic.currency.as_str(),
            automatic.amount_captured,
            &automatic.idempotency_key
        ),
        ("USD", 700, &None)
    );
    assert_eq!(
        ledger.refunds,
        [LedgerRefund {
            id: refund.id().to_owned(),
            caller: A.to_owned(),
            charge: first.id().to_owned(),
            reference: "pedido-1:refund-v1/r1".to_owned(),
            metadata: metadata(&[("cobro_refund", "rf-1")]),
            amount: 400,
            currency: "EUR".to_owned(),
            status: "succeeded".to_owned(),
            idempotency_key: Some("r-1".to_owned()),
            created: created(&refund.body),
        }]
    );
    assert!(ledger.charge("ch_missing").is_none());
    assert_eq!(
        ledger.charges_with_metadata("cobro_intent", "pedido-1:authorize-v1"),
        [&ledger.charges[0]]
    );
    assert!(
        ledger
            .charges_with_metadata("cobro_intent", "pedido-1")
            .is_empty()
    );
    assert_eq!(
        ledger.refunds_with_metadata("cobro_refund", "rf-1"),
        [&ledger.refunds[0]]
    );
    assert_eq!(ledger.refunds_of_charge(first.id()), [&ledger.refunds[0]]);
    assert!(ledger.refunds_of_charge(&second_id).is_empty());
    assert_eq!((ledger.totals.charges, ledger.totals.declines), (3, 1));
}

#[tokio::test]
async fn double_charges_is_one_intent_charged_twice_by_one_caller() {
    let p = provider().await;
    let twice_a = attempt(&p, A, "acct-1", "pedido-5", "a1", "pm_card_visa").await;
    let twice_b = attempt(&p, A, "acct-1", "pedido-5", "a2", "pm_card_visa").await;
    // A decline moves no money.
    attempt(&p, A, "acct-1", "pedido-6", "a1", "pm_card_declined").await;
    attempt(&p, A, "acct-1", "pedido-6", "a2", "pm_card_visa").await;
    // Two merchants under one reference are not a double charge.
    attempt(&p, A, "acct-1", "pedido-7", "a1", "pm_card_visa").await;
    attempt(&p, B, "acct-1", "pedido-7", "a1", "pm_card_visa").await;
    // Another account of the same caller.
    attempt(&p, A, "acct-2", "pedido-5", "a3", "pm_card_visa").await;
    // A voided authorisation was still a charge.
    let voided = attempt(&p, A, "acct-1", "pedido-8", "a1", "pm_card_visa").await;
    let void = format!("/v1/charges/{}/void", voided.id());
    p.post_as(A, &void, None, &json!({})).await.unwrap();
    let retried = attempt(&p, A, "acct-1", "pedido-8", "a2", "pm_card_visa").await;
    // Without the keys a charge is left out.
    let mut bare = charge_body("pedido-5/a4");
    bare["metadata"] = json!({"cobro_intent": "pedido-5"});
    p.post_as(A, "/v1/charges", None, &bare).await.unwrap();

    let ledger = p.control.ledger();
    assert_eq!(
        ids(&ledger.double_charges(&INTENT)),
        [
            vec![twice_a.id().to_owned(), twice_b.id().to_owned()],
            vec![voided.id().to_owned(), retried.id().to_owned()],
        ]
    );
    assert_eq!(
        ledger.duplicate_charge_references,
        ["pedido-7/a1"],
        "references are counted across callers"
    );
    let by_caller = ledger.double_charges(&[]);
    assert_eq!(
        by_caller.iter().map(Vec::len).collect::<Vec<_>>(),
        [8],
        "no keys: every money-moving charge of A; B has one"
    );
}

#[tokio::test]
async fn the_admin_api_serves_the_same_ledger_and_older_snapshots_still_parse() {
    let p = provider_with(Config {
        admin: true,
        ..Config::default()
    })
    .await;
    let charge = attempt(&p, A, "acct-1", "pedido-9", "a1", "pm_card_visa").await;
    let capture = format!("/v1/charges/{}/capture", charge.id());
    p.post_as(A, &capture, None, &json!({})).await.unwrap();
    let refund = json!({"charge": charge.id(), "amount": 10, "reference": "pedido-9/r1", "metadata": {"cobro_refund": "rf-9"}});
    p.post_as(A, "/v1/refunds", Some("r-9"), &refund)
        .await
        .unwrap();

    let over_http = AdminClient::new(&p.url).ledger().await.unwrap();
    let in_process = p.control.ledger();
    assert_eq!(
        (&over_http.charges, &over_http.refunds),
        (&in_process.charges, &in_process.refunds)
    );
    assert_eq!(over_http.charges.len(), 1);
    assert_eq!(over_http.refunds.len(), 1);

    let older = json!({"totals": {"charges": 0, "declines": 0, "captures": 0, "voids": 0, "refunds": 0},
        "by_reference": {}, "by_key": {}, "duplicate_charge_references": []});
    let older: Ledger = serde_json::from_value(older).unwrap();
    assert!(older.charges.is_empty() && older.refunds.is_empty());
}
