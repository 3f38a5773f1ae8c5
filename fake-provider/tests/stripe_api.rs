//! The Stripe dialect's API: PaymentIntents (create and confirm, capture,
//! cancel, declines, authentication), refunds and their list, search by
//! metadata, callers as tenants, form encoding and parameter errors. Every
//! test checks what the ledger says was done.
#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

mod common;

use std::collections::BTreeMap;

use common::stripe::{SK, SK_B, form, intent_form};
use common::{EffectsExt, charge_body, charges, declines, provider, refunds};
use fake_provider::{Effects, FaultAction, FaultRule, Operation};
use serde_json::json;

const REFERENCE_1: &str = "cobro_account=acct_1&cobro_intent=o-1:authorize-v1";

#[tokio::test]
async fn an_automatic_intent_succeeds_and_is_one_captured_charge_in_the_ledger() {
    let p = provider().await;
    let reply = p
        .stripe_intent("automatic", "o-1:authorize-v1", Some("k-1"))
        .await;

    let pi = &reply.body;
    assert_eq!(pi["object"], "payment_intent");
    assert!(reply.id().starts_with("pi_"), "{pi}");
    assert_eq!(reply.status_of(), "succeeded");
    assert_eq!(
        (
            &pi["amount"],
            &pi["amount_received"],
            &pi["amount_capturable"]
        ),
        (&json!(1250), &json!(1250), &json!(0))
    );
    assert_eq!(pi["currency"], "eur");
    assert_eq!(pi["capture_method"], "automatic");
    assert_eq!(pi["livemode"], false);
    assert_eq!(pi["last_payment_error"], json!(null));
    assert_eq!(pi["payment_method_types"], json!(["card"]));
    assert_eq!(
        pi["metadata"],
        json!({"cobro_account": "acct_1", "cobro_intent": "o-1:authorize-v1"})
    );
    assert!(pi["created"].as_i64().unwrap() > 1_700_000_000);
    assert!(reply.request_id.as_deref().unwrap().starts_with("req_"));
    assert!(!reply.replayed);
    let seen = p.control.requests();
    let seen = seen.last().unwrap();
    assert_eq!(seen.stripe_version.as_deref(), Some("2024-06-20"));
    assert_eq!(seen.idempotency_key.as_deref(), Some("k-1"));

    let ledger = p.control.ledger();
    assert_eq!(ledger.totals, charges(1));
    assert_eq!(ledger.for_key("k-1"), charges(1));
    assert_eq!(ledger.for_reference(REFERENCE_1), charges(1));
    let charge = ledger.charge_of_payment_intent(reply.id()).unwrap();
    assert_eq!(pi["latest_charge"], json!(charge.id));
    assert_eq!(
        (
            charge.caller.as_str(),
            charge.status.as_str(),
            charge.amount,
            charge.amount_captured,
            charge.currency.as_str(),
            charge.capture_method.as_str(),
            charge.idempotency_key.as_deref(),
        ),
        (SK, "captured", 1250, 1250, "EUR", "automatic", Some("k-1"))
    );
    assert_eq!(charge.metadata["cobro_intent"], "o-1:authorize-v1");
    assert!(
        ledger
            .double_charges(&["cobro_account", "cobro_intent"])
            .is_empty()
    );
}

#[tokio::test]
async fn a_manual_intent_requires_capture_and_a_capture_makes_it_succeed() {
    let p = provider().await;
    let created = p.stripe_intent("manual", "o-2:authorize-v1", None).await;
    assert_eq!(created.status_of(), "requires_capture");
    assert_eq!(created.body["amount_capturable"], 1250);
    assert_eq!(created.body["amount_received"], 0);
    assert_eq!(p.totals(), charges(1));

    let path = format!("/v1/payment_intents/{}/capture", created.id());
    let captured = p
        .stripe_post(&path, Some("cap-1"), &[("amount_to_capture", "1000")])
        .await;

    assert_eq!(captured.status, 200, "{captured:?}");
    assert_eq!(captured.status_of(), "succeeded");
    assert_eq!(captured.body["amount_received"], 1000);
    assert_eq!(captured.body["amount_capturable"], 0);
    assert_eq!(
        captured.body["latest_charge"],
        created.body["latest_charge"]
    );
    let got = p
        .stripe_get(&format!("/v1/payment_intents/{}", created.id()))
        .await;
    assert_eq!((got.status, &got.body), (200, &captured.body));
    let ledger = p.control.ledger();
    assert_eq!(ledger.totals, charges(1).captures(1));
    assert_eq!(ledger.for_key("cap-1"), Effects::default().captures(1));
    let charge = ledger.charge_of_payment_intent(created.id()).unwrap();
    assert_eq!(
        (charge.status.as_str(), charge.amount_captured),
        ("captured", 1000)
    );
}

#[tokio::test]
async fn capture_beyond_the_capturable_amount_or_of_a_settled_intent_is_refused_with_the_intent() {
    let p = provider().await;
    let manual = p.stripe_intent("manual", "o-3:authorize-v1", None).await;
    let path = format!("/v1/payment_intents/{}/capture", manual.id());
    let too_much = p
        .stripe_post(&path, None, &[("amount_to_capture", "1251")])
        .await;
    assert_eq!(
        too_much.error(),
        (400, "invalid_request_error", "amount_too_large")
    );
    assert_eq!(too_much.param(), "amount_to_capture");

    let automatic = p.stripe_intent("automatic", "o-4:authorize-v1", None).await;
    let path = format!("/v1/payment_intents/{}/capture", automatic.id());
    let settled = p.stripe_post(&path, None, &[]).await;

    assert_eq!(
        settled.error(),
        (
            400,
            "invalid_request_error",
            "payment_intent_unexpected_state"
        )
    );
    assert_eq!(
        settled.body["error"]["payment_intent"]["id"],
        automatic.id()
    );
    assert_eq!(
        settled.body["error"]["payment_intent"]["status"],
        "succeeded"
    );
    assert_eq!(p.totals(), charges(2));
}

#[tokio::test]
async fn cancel_voids_an_authorization_and_a_succeeded_intent_cannot_be_canceled() {
    let p = provider().await;
    let manual = p.stripe_intent("manual", "o-5:authorize-v1", None).await;
    let path = format!("/v1/payment_intents/{}/cancel", manual.id());
    let canceled = p
        .stripe_post(
            &path,
            Some("cancel-1"),
            &[("cancellation_reason", "abandoned")],
        )
        .await;

    assert_eq!(canceled.status, 200, "{canceled:?}");
    assert_eq!(canceled.status_of(), "canceled");
    assert_eq!(canceled.body["cancellation_reason"], "abandoned");
    assert!(canceled.body["canceled_at"].as_i64().is_some());
    assert_eq!(canceled.body["amount_capturable"], 0);
    let again = p.stripe_post(&path, None, &[]).await;
    assert_eq!(
        again.error(),
        (
            400,
            "invalid_request_error",
            "payment_intent_unexpected_state"
        )
    );
    assert_eq!(again.body["error"]["payment_intent"]["status"], "canceled");
    let capture = format!("/v1/payment_intents/{}/capture", manual.id());
    let late_capture = p.stripe_post(&capture, None, &[]).await;
    assert_eq!(late_capture.error().2, "payment_intent_unexpected_state");

    let automatic = p.stripe_intent("automatic", "o-6:authorize-v1", None).await;
    let path = format!("/v1/payment_intents/{}/cancel", automatic.id());
    let refused = p.stripe_post(&path, None, &[]).await;
    assert_eq!(refused.error().2, "payment_intent_unexpected_state");
    assert_eq!(
        refused.body["error"]["payment_intent"]["status"],
        "succeeded"
    );

    let ledger = p.control.ledger();
    assert_eq!(ledger.totals, charges(2).voids(1));
    assert_eq!(ledger.for_key("cancel-1"), Effects::default().voids(1));
    let voided = ledger.charge_of_payment_intent(manual.id()).unwrap();
    assert_eq!(voided.status, "voided");
}

#[tokio::test]
async fn declining_cards_answer_402_with_the_failed_intent_and_count_declines() {
    let p = provider().await;
    let cases = [
        ("pm_card_chargeDeclined", "generic_decline"),
        (
            "pm_card_chargeDeclinedInsufficientFunds",
            "insufficient_funds",
        ),
        ("pm_card_declined", "generic_decline"),
        ("pm_insufficient_funds", "insufficient_funds"),
    ];
    for (method, decline_code) in cases {
        let mut pairs = intent_form("automatic", "o-7:authorize-v1");
        pairs[2] = ("payment_method", method);
        let reply = p.stripe_post("/v1/payment_intents", None, &pairs).await;

        assert_eq!(
            reply.error(),
            (402, "card_error", "card_declined"),
            "{method}"
        );
        let error = &reply.body["error"];
        assert_eq!(error["decline_code"], decline_code, "{method}");
        let pi = &error["payment_intent"];
        assert_eq!(pi["status"], "requires_payment_method");
        assert_eq!(pi["amount_received"], 0);
        assert_eq!(pi["last_payment_error"]["decline_code"], decline_code);
        assert_eq!(pi["last_payment_error"]["charge"], error["charge"]);
        assert_eq!(pi["latest_charge"], error["charge"]);
        let got = p
            .stripe_get(&format!(
                "/v1/payment_intents/{}",
                pi["id"].as_str().unwrap()
            ))
            .await;
        assert_eq!(&got.body, pi);
    }
    let ledger = p.control.ledger();
    assert_eq!(ledger.totals, declines(4));
    assert!(
        ledger
            .charges
            .iter()
            .all(|charge| charge.status == "declined")
    );
    assert!(ledger.double_charges(&["cobro_intent"]).is_empty());
}

#[tokio::test]
async fn a_card_that_needs_authentication_requires_action_and_charges_nothing() {
    let p = provider().await;
    let mut pairs = intent_form("automatic", "o-8:authorize-v1");
    pairs[2] = ("payment_method", "pm_card_authenticationRequired");
    let reply = p.stripe_post("/v1/payment_intents", None, &pairs).await;

    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(reply.status_of(), "requires_action");
    assert_eq!(reply.body["latest_charge"], json!(null));
    assert_eq!(reply.body["next_action"]["type"], "use_stripe_sdk");
    assert_eq!(p.totals(), Effects::default());
    assert!(p.control.ledger().charges.is_empty());

    let path = format!("/v1/payment_intents/{}/cancel", reply.id());
    let canceled = p.stripe_post(&path, None, &[]).await;
    assert_eq!(canceled.status_of(), "canceled");
    assert_eq!(p.totals(), Effects::default(), "nothing to void");
}

/// What a customer's browser can do with a PaymentIntent's client secret
/// after a failed try: confirm it again with another card. A declined
/// PaymentIntent takes it (a charge, counted once); a canceled one, or one
/// already charged, refuses it and the ledger does not move.
#[tokio::test]
async fn a_declined_intent_confirms_again_with_another_card_and_a_canceled_one_refuses() {
    let p = provider().await;
    let mut pairs = intent_form("automatic", "o-9:authorize-v1");
    pairs[2] = ("payment_method", "pm_card_chargeDeclined");
    let declined = p.stripe_post("/v1/payment_intents", None, &pairs).await;
    assert_eq!(declined.status, 402, "{declined:?}");
    let id = declined.body["error"]["payment_intent"]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let confirm = format!("/v1/payment_intents/{id}/confirm");
    let good = [("payment_method", "pm_card_visa")];
    let again = p.stripe_post(&confirm, Some("confirm-1"), &good).await;
    assert_eq!(again.status, 200, "{again:?}");
    assert_eq!(again.status_of(), "succeeded");
    assert_eq!(p.totals(), charges(1).declines(1));
    let twice = p.stripe_post(&confirm, None, &good).await;
    assert_eq!(twice.error().2, "payment_intent_unexpected_state");

    let mut pairs = intent_form("automatic", "o-10:authorize-v1");
    pairs[2] = ("payment_method", "pm_card_chargeDeclined");
    let declined = p.stripe_post("/v1/payment_intents", None, &pairs).await;
    let id = declined.body["error"]["payment_intent"]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let cancel = format!("/v1/payment_intents/{id}/cancel");
    assert_eq!(
        p.stripe_post(&cancel, None, &[]).await.status_of(),
        "canceled"
    );
    let confirm = format!("/v1/payment_intents/{id}/confirm");
    let refused = p.stripe_post(&confirm, None, &good).await;
    assert_eq!(
        refused.error(),
        (
            400,
            "invalid_request_error",
            "payment_intent_unexpected_state"
        )
    );
    assert_eq!(
        refused.body["error"]["payment_intent"]["status"],
        "canceled"
    );
    assert_eq!(p.totals(), charges(1).declines(2), "nothing more");
}

#[tokio::test]
async fn without_confirm_an_intent_waits_and_charges_nothing() {
    let p = provider().await;
    let with_method = [
        ("amount", "500"),
        ("currency", "usd"),
        ("payment_method", "pm_card_visa"),
    ];
    let waiting = p
        .stripe_post("/v1/payment_intents", None, &with_method)
        .await;
    let without_method = [("amount", "500"), ("currency", "usd")];
    let empty = p
        .stripe_post("/v1/payment_intents", None, &without_method)
        .await;

    assert_eq!(waiting.status_of(), "requires_confirmation");
    assert_eq!(empty.status_of(), "requires_payment_method");
    assert_eq!(empty.body["capture_method"], "automatic_async");
    assert_eq!(empty.body["last_payment_error"], json!(null));
    assert_eq!(p.totals(), Effects::default());
}

#[tokio::test]
async fn refunds_take_what_is_left_and_are_listed_by_payment_intent() {
    let p = provider().await;
    let pi = p.stripe_intent("automatic", "o-9:authorize-v1", None).await;
    let refund_pairs = |amount: Option<&'static str>| {
        let mut pairs = vec![
            ("payment_intent", pi.id()),
            ("metadata[cobro_intent]", "o-9:refund-v1"),
            ("reason", "requested_by_customer"),
        ];
        if let Some(amount) = amount {
            pairs.push(("amount", amount));
        }
        pairs
    };
    let first = p
        .stripe_post("/v1/refunds", Some("re-k-1"), &refund_pairs(Some("400")))
        .await;
    assert_eq!(first.status, 200, "{first:?}");
    assert_eq!(first.body["object"], "refund");
    assert!(first.id().starts_with("re_"));
    assert_eq!(
        (
            &first.body["amount"],
            &first.body["currency"],
            &first.body["status"],
            &first.body["payment_intent"],
            &first.body["charge"],
            &first.body["reason"],
        ),
        (
            &json!(400),
            &json!("eur"),
            &json!("succeeded"),
            &json!(pi.id()),
            &pi.body["latest_charge"],
            &json!("requested_by_customer"),
        )
    );
    let too_much = p
        .stripe_post("/v1/refunds", None, &refund_pairs(Some("851")))
        .await;
    assert_eq!(
        too_much.error(),
        (400, "invalid_request_error", "amount_too_large")
    );
    assert_eq!(too_much.param(), "amount");
    let rest = p
        .stripe_post("/v1/refunds", None, &refund_pairs(None))
        .await;
    assert_eq!(rest.body["amount"], 850, "{rest:?}");
    let nothing_left = p
        .stripe_post("/v1/refunds", None, &refund_pairs(None))
        .await;
    assert_eq!(
        nothing_left.error(),
        (400, "invalid_request_error", "charge_already_refunded")
    );

    let got = p.stripe_get(&format!("/v1/refunds/{}", first.id())).await;
    assert_eq!((got.status, &got.body), (200, &first.body));
    let list = p
        .stripe_get(&format!("/v1/refunds?payment_intent={}&limit=1", pi.id()))
        .await;
    assert_eq!(list.body["object"], "list");
    assert_eq!(list.body["url"], "/v1/refunds");
    assert_eq!(list.body["has_more"], true);
    assert_eq!(common::ids(&list.body["data"]), vec![rest.id().to_owned()]);
    let after = p
        .stripe_get(&format!(
            "/v1/refunds?payment_intent={}&limit=10&starting_after={}",
            pi.id(),
            rest.id()
        ))
        .await;
    assert_eq!(
        common::ids(&after.body["data"]),
        vec![first.id().to_owned()]
    );
    assert_eq!(after.body["has_more"], false);

    let ledger = p.control.ledger();
    assert_eq!(ledger.totals, charges(1).refunds(2));
    assert_eq!(ledger.for_key("re-k-1"), refunds(1));
    assert_eq!(
        ledger.for_reference("cobro_intent=o-9:refund-v1"),
        refunds(2)
    );
    let charge = ledger.charge_of_payment_intent(pi.id()).unwrap();
    assert_eq!(charge.amount_refunded, 1250);
    let made = ledger.refunds_of_charge(&charge.id);
    assert_eq!(
        made.iter().map(|r| r.amount).collect::<Vec<_>>(),
        [400, 850]
    );
    assert_eq!(made[0].metadata["cobro_intent"], "o-9:refund-v1");
}

#[tokio::test]
async fn an_intent_that_was_not_captured_cannot_be_refunded() {
    let p = provider().await;
    let manual = p.stripe_intent("manual", "o-10:authorize-v1", None).await;
    let mut pairs = intent_form("automatic", "o-10:authorize-v1");
    pairs[2] = ("payment_method", "pm_card_authenticationRequired");
    let no_charge = p.stripe_post("/v1/payment_intents", None, &pairs).await;

    for pi in [manual.id(), no_charge.id()] {
        let refused = p
            .stripe_post("/v1/refunds", None, &[("payment_intent", pi)])
            .await;
        assert_eq!(
            refused.error(),
            (400, "invalid_request_error", "charge_not_refundable"),
            "{refused:?}"
        );
        let list = p
            .stripe_get(&format!("/v1/refunds?payment_intent={pi}"))
            .await;
        assert_eq!(list.body["data"], json!([]), "{list:?}");
    }
    assert_eq!(p.totals(), charges(1));
}

#[tokio::test]
async fn search_finds_intents_by_every_metadata_clause_newest_first() {
    let p = provider().await;
    let a = p.stripe_intent("manual", "o-11:authorize-v1", None).await;
    let b = p
        .stripe_intent("automatic", "o-11:authorize-v1", None)
        .await;
    let other = p
        .stripe_intent("automatic", "o-12:authorize-v1", None)
        .await;

    let both = p
        .stripe_search_as(SK, "metadata['cobro_intent']:'o-11:authorize-v1'")
        .await;
    assert_eq!(both, [b.id(), a.id()]);
    let anded = p
        .stripe_search_as(
            SK,
            r#"metadata["cobro_account"]:"acct_1" AND metadata['cobro_intent']:'o-12:authorize-v1'"#,
        )
        .await;
    assert_eq!(anded, [other.id()]);
    let none = p
        .stripe_search_as(
            SK,
            "metadata['cobro_account']:'acct_2' AND metadata['cobro_intent']:'o-12:authorize-v1'",
        )
        .await;
    assert!(none.is_empty());

    let query = form(&[
        ("query", "metadata['cobro_account']:'acct_1'"),
        ("limit", "2"),
    ]);
    let page = p
        .stripe_get(&format!("/v1/payment_intents/search?{query}"))
        .await;
    assert_eq!(page.body["has_more"], true);
    assert_eq!(page.body["url"], "/v1/payment_intents/search");
    assert_eq!(common::ids(&page.body["data"]), [other.id(), b.id()]);
    let next = page.body["next_page"].as_str().unwrap();
    let query = form(&[
        ("query", "metadata['cobro_account']:'acct_1'"),
        ("limit", "2"),
        ("page", next),
    ]);
    let second = p
        .stripe_get(&format!("/v1/payment_intents/search?{query}"))
        .await;
    assert_eq!(common::ids(&second.body["data"]), [a.id()]);
    assert_eq!(second.body["next_page"], json!(null));

    for bad in [
        "metadata['cobro_intent']:'o-11' OR metadata['x']:'y'",
        "status:'succeeded'",
        "metadata['cobro_intent']:o-11",
        "",
    ] {
        let query = form(&[("query", bad)]);
        let refused = p
            .stripe_get(&format!("/v1/payment_intents/search?{query}"))
            .await;
        assert_eq!(refused.status, 400, "{bad:?}: {refused:?}");
        assert_eq!(refused.body["error"]["type"], "invalid_request_error");
        assert_eq!(refused.param(), "query", "{bad:?}");
    }
    let missing = p.stripe_get("/v1/payment_intents/search").await;
    assert_eq!(missing.error().2, "parameter_missing");
    assert_eq!(p.totals(), charges(3));
}

#[tokio::test]
async fn another_callers_intents_and_refunds_do_not_exist_for_it() {
    let p = provider().await;
    // Two merchants sharing every name they can: order, keys, metadata.
    let mine = p
        .stripe_intent("manual", "o-13:authorize-v1", Some("k-13"))
        .await;
    let theirs = p
        .stripe_post_as(
            SK_B,
            "/v1/payment_intents",
            Some("k-13"),
            &intent_form("automatic", "o-13:authorize-v1"),
        )
        .await;
    assert_eq!(theirs.status, 200);
    assert_ne!(theirs.id(), mine.id());
    let refund = p
        .stripe_post_as(
            SK_B,
            "/v1/refunds",
            None,
            &[("payment_intent", theirs.id())],
        )
        .await;
    assert_eq!(refund.status, 200);

    let get = p
        .stripe_get_as(SK_B, &format!("/v1/payment_intents/{}", mine.id()))
        .await;
    assert_eq!(
        get.error(),
        (404, "invalid_request_error", "resource_missing")
    );
    assert_eq!(get.param(), "intent");
    for action in ["capture", "cancel"] {
        let path = format!("/v1/payment_intents/{}/{action}", mine.id());
        let reply = p.stripe_post_as(SK_B, &path, None, &[]).await;
        assert_eq!(reply.error().2, "resource_missing", "{action}");
        assert_eq!(reply.status, 404);
    }
    let refund_mine = p
        .stripe_post_as(SK_B, "/v1/refunds", None, &[("payment_intent", mine.id())])
        .await;
    assert_eq!(
        refund_mine.error(),
        (404, "invalid_request_error", "resource_missing")
    );
    let their_refund = p.stripe_get(&format!("/v1/refunds/{}", refund.id())).await;
    assert_eq!(their_refund.error().2, "resource_missing");
    let listed = p
        .stripe_get(&format!("/v1/refunds?payment_intent={}", theirs.id()))
        .await;
    assert_eq!(listed.status, 404);
    let all_mine = p.stripe_get("/v1/refunds").await;
    assert_eq!(all_mine.body["data"], json!([]));
    let searched = p
        .stripe_search_as(SK, "metadata['cobro_intent']:'o-13:authorize-v1'")
        .await;
    assert_eq!(searched, [mine.id()]);

    let ledger = p.control.ledger();
    assert_eq!(ledger.totals, charges(2).refunds(1));
    let mine = ledger.charge_of_payment_intent(mine.id()).unwrap();
    assert_eq!(
        (mine.caller.as_str(), mine.status.as_str()),
        (SK, "authorized")
    );
    let theirs = ledger.charge_of_payment_intent(theirs.id()).unwrap();
    assert_eq!(
        (theirs.caller.as_str(), theirs.amount_refunded),
        (SK_B, 1250)
    );
    assert!(
        ledger
            .double_charges(&["cobro_account", "cobro_intent"])
            .is_empty()
    );
}

#[tokio::test]
async fn form_encoding_keeps_nested_keys_and_awkward_values_intact() {
    let p = provider().await;
    let awkward = "o'14: a&b=c + 50% ünïcødé ✓";
    // Brackets percent-encoded (as SDKs send them), `'`, `&`, `=`, `+`,
    // `%`, spaces and non-ASCII in values and keys.
    let encoded = form(&[
        ("amount", "700"),
        ("currency", "EUR"),
        ("payment_method", "pm_card_visa"),
        ("confirm", "true"),
        ("payment_method_types[0]", "card"),
        ("metadata[cobro_intent]", awkward),
        ("metadata[clé & co=1]", "x"),
        ("metadata[dropped]", ""),
    ]);
    let reply = p
        .stripe_post_raw(SK, "/v1/payment_intents", Some("k-14"), encoded)
        .await
        .unwrap();
    assert_eq!(reply.status, 200, "{reply:?}");
    let expected: BTreeMap<String, String> = [
        ("clé & co=1".to_owned(), "x".to_owned()),
        ("cobro_intent".to_owned(), awkward.to_owned()),
    ]
    .into();
    assert_eq!(reply.body["metadata"], json!(expected));
    assert_eq!(reply.body["currency"], "eur");

    // The same parameters written differently (literal brackets, `[]`
    // list, other order, `+` for spaces) are the same request: replayed.
    let literal = "metadata[clé%20%26%20co%3D1]=x&payment_method_types[]=card&amount=700\
        &metadata[cobro_intent]=o%2714%3A+a%26b%3Dc+%2B+50%25+%C3%BCn%C3%AFc%C3%B8d%C3%A9+%E2%9C%93\
        &currency=EUR&confirm=true&payment_method=pm_card_visa&metadata[dropped]=";
    let again = p
        .stripe_post_raw(SK, "/v1/payment_intents", Some("k-14"), literal.to_owned())
        .await
        .unwrap();
    assert_eq!((again.status, again.replayed), (200, true), "{again:?}");
    assert_eq!(again.body, reply.body);

    let found = p
        .stripe_search_as(
            SK,
            r"metadata['cobro_intent']:'o\'14: a&b=c + 50% ünïcødé ✓'",
        )
        .await;
    assert_eq!(found, [reply.id()]);
    let ledger = p.control.ledger();
    assert_eq!(ledger.totals, charges(1));
    let charge = ledger.charge_of_payment_intent(reply.id()).unwrap();
    assert_eq!(charge.metadata, expected);
}

/// A form, the error code it earns (`""`: none) and the `param` named.
type Refusal<'a> = (&'a [(&'a str, &'a str)], &'a str, &'a str);

#[tokio::test]
async fn bad_parameters_are_refused_with_stripe_codes_naming_the_param() {
    let p = provider().await;
    let cases: &[Refusal] = &[
        (&[("currency", "eur")], "parameter_missing", "amount"),
        (
            &[("amount", "12.5"), ("currency", "eur")],
            "parameter_invalid_integer",
            "amount",
        ),
        (
            &[("amount", "0"), ("currency", "eur")],
            "parameter_invalid_integer",
            "amount",
        ),
        (
            &[("amount", "100000000"), ("currency", "eur")],
            "amount_too_large",
            "amount",
        ),
        (
            &[("amount", "100"), ("currency", "")],
            "parameter_invalid_empty",
            "currency",
        ),
        (&[("amount", "100"), ("currency", "euro")], "", "currency"),
        (
            &[
                ("amount", "100"),
                ("currency", "eur"),
                ("expand[]", "latest_charge"),
            ],
            "parameter_unknown",
            "expand",
        ),
        (
            &[("amount", "100"), ("currency", "eur"), ("capture", "true")],
            "parameter_unknown",
            "capture",
        ),
        (
            &[
                ("amount", "100"),
                ("currency", "eur"),
                ("capture_method", "later"),
            ],
            "",
            "capture_method",
        ),
        (
            &[("amount", "100"), ("currency", "eur"), ("confirm", "yes")],
            "",
            "confirm",
        ),
        (
            &[("amount", "100"), ("currency", "eur"), ("confirm", "true")],
            "parameter_missing",
            "payment_method",
        ),
        (
            &[
                ("amount", "100"),
                ("currency", "eur"),
                ("payment_method", "card_x"),
            ],
            "resource_missing",
            "payment_method",
        ),
        (
            &[
                ("amount", "100"),
                ("currency", "eur"),
                ("payment_method_types", "card"),
            ],
            "",
            "payment_method_types",
        ),
        (
            &[("amount", "100"), ("amount", "200"), ("currency", "eur")],
            "",
            "amount",
        ),
        (
            &[
                ("amount", "100"),
                ("currency", "eur"),
                ("metadata[a_key_that_is_longer_than_forty_characters]", "v"),
            ],
            "",
            "metadata[a_key_that_is_longer_than_forty_characters]",
        ),
    ];
    for (pairs, code, param) in cases {
        let reply = p.stripe_post("/v1/payment_intents", None, pairs).await;
        assert_eq!(reply.status, 400, "{pairs:?}: {reply:?}");
        assert_eq!(reply.error().1, "invalid_request_error", "{pairs:?}");
        assert_eq!(reply.error().2, *code, "{pairs:?}: {reply:?}");
        assert_eq!(reply.param(), *param, "{pairs:?}");
        assert!(reply.request_id.is_some());
    }
    let json = p
        .http
        .post(format!("{}/v1/payment_intents", p.url))
        .bearer_auth(SK)
        .json(&json!({"amount": 100, "currency": "eur"}))
        .send()
        .await
        .unwrap();
    let json = common::stripe::reply(json).await.unwrap();
    assert_eq!(json.error(), (400, "invalid_request_error", ""));
    assert!(
        json.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("form")
    );
    let malformed = p
        .stripe_post_raw(SK, "/v1/payment_intents", None, "metadata[a=1".to_owned())
        .await
        .unwrap();
    assert_eq!(malformed.status, 400, "{malformed:?}");
    assert_eq!(p.totals(), Effects::default());
}

#[tokio::test]
async fn only_a_test_secret_key_authenticates() {
    let p = provider().await;
    for token in [
        None,
        Some("sk_live_real_money"),
        Some("sk_test_"),
        Some("pk_test_x"),
    ] {
        let mut request = p
            .http
            .post(format!("{}/v1/payment_intents", p.url))
            .header("Content-Type", "application/x-www-form-urlencoded")
            .body(form(&intent_form("automatic", "o-15:authorize-v1")));
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        let reply = common::stripe::reply(request.send().await.unwrap())
            .await
            .unwrap();
        assert_eq!(
            reply.error(),
            (401, "invalid_request_error", ""),
            "{token:?}"
        );
        assert!(reply.request_id.is_some());
    }
    let restricted = p
        .stripe_get_as("rk_test_reader", "/v1/payment_intents/pi_nope")
        .await;
    assert_eq!(restricted.status, 404);
    assert_eq!(p.totals(), Effects::default());
}

#[tokio::test]
async fn both_dialects_drive_one_engine_and_share_the_refund_paths() {
    let p = provider().await;
    let mut fake = charge_body("o-16:authorize-v1/a1");
    fake["capture"] = json!(true);
    fake["metadata"] = json!({"cobro_intent": "o-16:authorize-v1"});
    let fake_charge = p.post("/v1/charges", None, &fake).await.unwrap();
    assert_eq!(fake_charge.status, 201);
    let pi = p
        .stripe_intent("automatic", "o-16:authorize-v1", None)
        .await;

    // The fake's JSON refund and search on the shared paths, as before.
    let body = json!({"charge": fake_charge.id(), "amount": 100, "reference": "o-16:refund-v1"});
    let fake_refund = p.post("/v1/refunds", None, &body).await.unwrap();
    assert_eq!(fake_refund.status, 201, "{fake_refund:?}");
    assert_eq!(fake_refund.body["reference"], "o-16:refund-v1");
    let stripe_refund = p
        .stripe_post(
            "/v1/refunds",
            None,
            &[("payment_intent", pi.id()), ("amount", "200")],
        )
        .await;
    assert_eq!(stripe_refund.status, 200, "{stripe_refund:?}");
    // A Stripe refund of the fake's charge (by `charge`) works too.
    let by_charge = p
        .stripe_post(
            "/v1/refunds",
            None,
            &[("charge", fake_charge.id()), ("amount", "50")],
        )
        .await;
    assert_eq!(
        by_charge.body["payment_intent"],
        json!(null),
        "{by_charge:?}"
    );
    let fake_view = p.get(&format!("/v1/refunds/{}", stripe_refund.id())).await;
    assert_eq!(fake_view.body["sequence"], 2, "{fake_view:?}");
    let fake_search = p
        .search_as(
            common::CALLER,
            "charges",
            "metadata%5Bcobro_intent%5D=o-16%3Aauthorize-v1",
        )
        .await;
    assert_eq!(
        fake_search.len(),
        2,
        "the PaymentIntent's charge is a charge"
    );

    let ledger = p.control.ledger();
    assert_eq!(ledger.totals, charges(2).refunds(3));
    assert_eq!(
        ledger
            .charges_with_metadata("cobro_intent", "o-16:authorize-v1")
            .len(),
        2
    );
    assert_eq!(ledger.payment_intents.len(), 1);
}

/// A `soft_decline` rule declines a good card's confirmation with Stripe's
/// 402 `card_declined`, `decline_code: try_again_later`, exactly as a
/// declining card's: the PaymentIntent left `requires_payment_method` with
/// the decline as its `last_payment_error`, a decline (no charge) in the
/// ledger, and the 402 replayed under the key with nothing more counted.
#[tokio::test]
async fn soft_decline_declines_a_good_card_try_again_later_and_its_key_replays_it() {
    let p = provider().await;
    p.control.add_fault(
        FaultRule::new(Operation::Charge, FaultAction::SoftDecline).with_probability(1.0),
    );
    let pairs = intent_form("automatic", "o-s:authorize-v1");

    let reply = p
        .stripe_post("/v1/payment_intents", Some("pi-s"), &pairs)
        .await;

    assert_eq!(reply.error(), (402, "card_error", "card_declined"));
    let error = &reply.body["error"];
    assert_eq!(error["decline_code"], "try_again_later");
    let pi = &error["payment_intent"];
    assert_eq!(pi["status"], "requires_payment_method");
    assert_eq!(pi["payment_method"], "pm_card_visa");
    assert_eq!(pi["amount_received"], 0);
    assert_eq!(pi["last_payment_error"]["decline_code"], "try_again_later");
    assert_eq!(pi["last_payment_error"]["code"], "card_declined");
    assert_eq!(pi["latest_charge"], error["charge"]);
    let got = p
        .stripe_get(&format!(
            "/v1/payment_intents/{}",
            pi["id"].as_str().unwrap()
        ))
        .await;
    assert_eq!(&got.body, pi);
    assert_eq!(p.control.ledger().totals, declines(1));

    let replayed = p
        .stripe_post("/v1/payment_intents", Some("pi-s"), &pairs)
        .await;

    assert_eq!(
        (replayed.status, replayed.replayed, &replayed.body),
        (402, true, &reply.body)
    );
    let ledger = p.control.ledger();
    assert_eq!(ledger.totals, declines(1));
    assert_eq!(ledger.for_key("pi-s"), declines(1));
    assert_eq!(
        ledger
            .charge_of_payment_intent(pi["id"].as_str().unwrap())
            .unwrap()
            .status,
        "declined"
    );
}

/// Scoped to one payment's reference (its metadata), the rule declines that
/// payment's PaymentIntent only; another with the same card succeeds.
#[tokio::test]
async fn soft_decline_scoped_to_a_reference_declines_only_that_payment() {
    let p = provider().await;
    p.control.add_fault(
        FaultRule::new(Operation::Charge, FaultAction::SoftDecline)
            .with_reference("cobro_intent=o-x:"),
    );

    let hit = p
        .stripe_post(
            "/v1/payment_intents",
            None,
            &intent_form("automatic", "o-x:authorize-v1"),
        )
        .await;
    let other = p
        .stripe_post(
            "/v1/payment_intents",
            None,
            &intent_form("automatic", "o-y:authorize-v1"),
        )
        .await;

    assert_eq!(hit.error(), (402, "card_error", "card_declined"));
    assert_eq!(hit.body["error"]["decline_code"], "try_again_later");
    assert_eq!((other.status, other.status_of()), (200, "succeeded"));
    let ledger = p.control.ledger();
    let of =
        |order: &str| ledger.for_reference(&format!("cobro_account=acct_1&cobro_intent={order}"));
    assert_eq!(of("o-x:authorize-v1"), declines(1));
    assert_eq!(of("o-y:authorize-v1"), charges(1));
}

/// Under `processing` too, the forced decline is what the charge becomes
/// once final: the PaymentIntent answers `processing`, then reads
/// `requires_payment_method` with `try_again_later`, counted once.
#[tokio::test]
async fn a_processing_charge_under_soft_decline_settles_declined_try_again_later() {
    let p = provider().await;
    p.control
        .add_fault(FaultRule::new(Operation::Charge, FaultAction::Processing).with_lag_seconds(10));
    p.control
        .add_fault(FaultRule::new(Operation::Charge, FaultAction::SoftDecline));
    let pending = p
        .stripe_post(
            "/v1/payment_intents",
            None,
            &intent_form("automatic", "o-p:authorize-v1"),
        )
        .await;
    assert_eq!((pending.status, pending.status_of()), (200, "processing"));
    assert_eq!(p.control.ledger().totals, Effects::default());

    p.control.advance_clock(std::time::Duration::from_secs(10));

    let settled = p
        .stripe_get(&format!("/v1/payment_intents/{}", pending.id()))
        .await;
    assert_eq!(settled.status_of(), "requires_payment_method");
    assert_eq!(
        settled.body["last_payment_error"]["decline_code"],
        "try_again_later"
    );
    assert_eq!(p.control.ledger().totals, declines(1));
}
