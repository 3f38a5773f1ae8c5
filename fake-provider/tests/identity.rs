//! What identifies a charge or refund: callers as tenants, metadata, the
//! capture method, refusals carrying the charge, and search by metadata.
#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

mod common;

use std::time::Duration;

use common::{CALLER, EffectsExt, charge_body, charges, provider, query};
use fake_provider::{Effects, FaultAction, FaultRule, Operation};
use serde_json::{Map, Value, json};

const A: &str = "sk_merchant_a";
const B: &str = "sk_merchant_b";

/// A charge body for `reference` with `metadata`.
fn with_metadata(reference: &str, metadata: Value) -> Value {
    let mut body = charge_body(reference);
    body["metadata"] = metadata;
    body
}

/// The 404 body of an id that does not exist.
fn missing(what: &str, id: &str) -> Value {
    json!({"error": {"type": "invalid_request_error", "code": "resource_missing", "message": format!("no such {what}: {id}")}})
}

/// The raw text of an answer, for checks on key order.
async fn raw(request: reqwest::RequestBuilder) -> String {
    request
        .bearer_auth(CALLER)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

#[tokio::test]
async fn another_callers_charge_is_missing_to_get_capture_void_and_refund() {
    let p = provider().await;
    let authorized = p
        .post_as(A, "/v1/charges", None, &charge_body("pedido-1/att-1"))
        .await
        .unwrap();
    let mut body = charge_body("pedido-1/att-2");
    body["capture"] = json!(true);
    let captured = p.post_as(A, "/v1/charges", None, &body).await.unwrap();
    let id = authorized.id();

    let unknown = p.get_as(B, "/v1/charges/ch_unknown").await;
    let get = p.get_as(B, &format!("/v1/charges/{id}")).await;
    let capture = p
        .post_as(
            B,
            &format!("/v1/charges/{id}/capture"),
            Some("b-1"),
            &json!({}),
        )
        .await
        .unwrap();
    let void = p
        .post_as(
            B,
            &format!("/v1/charges/{id}/void"),
            Some("b-2"),
            &json!({}),
        )
        .await
        .unwrap();
    let refund_body =
        json!({"charge": captured.id(), "amount": 100, "reference": "pedido-1/refund"});
    let refund = p
        .post_as(B, "/v1/refunds", Some("b-3"), &refund_body)
        .await
        .unwrap();

    assert_eq!(
        (unknown.status, &unknown.body),
        (404, &missing("charge", "ch_unknown"))
    );
    for (answer, id) in [
        (get, id),
        (capture, id),
        (void, id),
        (refund, captured.id()),
    ] {
        assert_eq!((answer.status, &answer.body), (404, &missing("charge", id)));
    }
    assert_eq!(
        p.get_as(A, &format!("/v1/charges/{id}")).await.body,
        authorized.body,
        "untouched"
    );
    let ledger = p.control.ledger();
    assert_eq!(ledger.totals, charges(2), "nothing recorded for B");
    assert!(ledger.by_key.is_empty() && ledger.refunds.is_empty());
}

#[tokio::test]
async fn fault_rules_do_not_see_the_reference_of_another_callers_charge() {
    let p = provider().await;
    let charge = p
        .post_as(
            A,
            "/v1/charges",
            None,
            &charge_body("pedido-2:authorize-v1"),
        )
        .await
        .unwrap();
    let rule = FaultRule::new(Operation::Capture, FaultAction::FailBeforeEffect)
        .with_reference("pedido-2")
        .with_next(1);
    p.control.add_fault(rule);
    let path = format!("/v1/charges/{}/capture", charge.id());

    let by_b = p.post_as(B, &path, None, &json!({})).await.unwrap();
    assert_eq!(by_b.error(), (404, "resource_missing"));
    assert_eq!(p.control.faults().len(), 1, "the rule did not fire");
    let by_a = p.post_as(A, &path, None, &json!({})).await.unwrap();
    assert_eq!(by_a.error(), (503, "service_unavailable"));
    assert_eq!(p.totals(), charges(1));
}

#[tokio::test]
async fn another_callers_refund_is_missing_and_searches_list_only_the_callers_own() {
    let p = provider().await;
    let reference = "pedido-3:authorize-v1";
    let metadata = json!({"cobro_intent": "pedido-3"});
    let mut body = with_metadata(reference, metadata.clone());
    body["capture"] = json!(true);
    let of_a = p.post_as(A, "/v1/charges", None, &body).await.unwrap();
    let of_b = p.post_as(B, "/v1/charges", None, &body).await.unwrap();
    let refund_body = json!({"charge": of_a.id(), "amount": 100, "reference": "pedido-3:refund-v1", "metadata": metadata});
    let refund = p
        .post_as(A, "/v1/refunds", None, &refund_body)
        .await
        .unwrap();
    let by_reference = query(&[("reference", reference)]);
    let by_metadata = query(&[("metadata[cobro_intent]", "pedido-3")]);
    let refund_by_reference = query(&[("reference", "pedido-3:refund-v1")]);

    for (caller, own) in [(A, of_a.id()), (B, of_b.id())] {
        assert_eq!(p.search_as(caller, "charges", &by_reference).await, [own]);
        assert_eq!(p.search_as(caller, "charges", &by_metadata).await, [own]);
    }
    assert!(
        p.search_as("sk_c", "charges", &by_metadata)
            .await
            .is_empty()
    );
    assert_eq!(
        p.search_as(A, "refunds", &refund_by_reference).await,
        [refund.id()]
    );
    assert!(
        p.search_as(B, "refunds", &refund_by_reference)
            .await
            .is_empty()
    );
    assert!(p.search_as(B, "refunds", &by_metadata).await.is_empty());
    let get = p.get_as(B, &format!("/v1/refunds/{}", refund.id())).await;
    assert_eq!(
        (get.status, &get.body),
        (404, &missing("refund", refund.id()))
    );
    assert_eq!(
        p.get_as(A, &format!("/v1/refunds/{}", refund.id()))
            .await
            .body,
        refund.body
    );
}

#[tokio::test]
async fn metadata_is_returned_sorted_on_every_representation_and_defaults_to_empty() {
    let p = provider().await;
    let metadata = json!({"cobro_payment": "pay_1", "cobro_account": "acct_1", "cobro_intent": "pedido-4:authorize-v1", "cobro_attempt": "0193c0de"});
    let sorted = r#""metadata":{"cobro_account":"acct_1","cobro_attempt":"0193c0de","cobro_intent":"pedido-4:authorize-v1","cobro_payment":"pay_1"}"#;
    let body = with_metadata("pedido-4:authorize-v1/0193c0de", metadata.clone());
    let created = raw(p.http.post(format!("{}/v1/charges", p.url)).json(&body)).await;
    let charge: Value = serde_json::from_str(&created).unwrap();
    let id = charge["id"].as_str().unwrap();
    let get = raw(p.http.get(format!("{}/v1/charges/{id}", p.url))).await;
    let search = raw(p.http.get(format!(
        "{}/v1/charges?{}",
        p.url,
        query(&[("metadata[cobro_payment]", "pay_1")])
    )))
    .await;
    for text in [&created, &get, &search] {
        assert!(text.contains(sorted), "{text}");
    }
    let capture = p.capture(id, None, json!({})).await;
    assert_eq!(capture.body["metadata"], metadata);

    let refund_metadata = json!({"cobro_refund": "rf-1"});
    let refund_body = json!({"charge": id, "amount": 100, "reference": "pedido-4:refund-v1", "metadata": refund_metadata});
    let refund = p.post("/v1/refunds", None, &refund_body).await.unwrap();
    assert_eq!(refund.body["metadata"], refund_metadata);
    let stored = p.get(&format!("/v1/refunds/{}", refund.id())).await;
    assert_eq!(stored.body["metadata"], refund_metadata);

    let plain = raw(p
        .http
        .post(format!("{}/v1/charges", p.url))
        .json(&charge_body("pedido-4b")))
    .await;
    assert!(plain.contains(r#""metadata":{}"#), "{plain}");
    let null = p
        .post(
            "/v1/charges",
            None,
            &with_metadata("pedido-4c", Value::Null),
        )
        .await
        .unwrap();
    assert_eq!((null.status, &null.body["metadata"]), (201, &json!({})));
    let plain_refund = p.refund(id, 1, "pedido-4:refund-v2").await;
    assert_eq!(plain_refund.body["metadata"], json!({}));
}

#[tokio::test]
async fn invalid_metadata_is_refused_with_400_naming_metadata() {
    let p = provider().await;
    let keys = |n: usize| -> Value {
        let map: Map<String, Value> = (0..n).map(|i| (format!("k{i}"), json!("v"))).collect();
        Value::Object(map)
    };
    let invalid = [
        json!("x"),
        json!([1]),
        json!(5),
        json!({"k": 1}),
        json!({"k": null}),
        json!({"k": {"nested": "v"}}),
        keys(51),
        json!({"": "v"}),
        json!({"k".repeat(41): "v"}),
        json!({"k": "v".repeat(501)}),
    ];
    for metadata in invalid {
        let charge = with_metadata("pedido-5", metadata.clone());
        let refund = json!({"charge": "ch_x", "amount": 1, "reference": "r", "metadata": metadata});
        for (path, body) in [("/v1/charges", charge), ("/v1/refunds", refund)] {
            let answer = p.post(path, None, &body).await.unwrap();
            assert_eq!(answer.error(), (400, "parameter_invalid"), "{path} {body}");
            let message = answer.body["error"]["message"].as_str().unwrap();
            assert!(message.starts_with("metadata"), "{message}");
        }
    }
    assert_eq!(p.totals(), Effects::default());

    // The limits themselves are fine, counted in characters, not bytes.
    let at_limits = [
        keys(50),
        json!({"é".repeat(40): "é".repeat(500)}),
        json!({"k": ""}),
    ];
    for metadata in at_limits {
        let answer = p
            .post("/v1/charges", None, &with_metadata("pedido-5", metadata))
            .await
            .unwrap();
        assert_eq!(answer.status, 201, "{answer:?}");
    }
    assert_eq!(p.totals(), charges(3));
}

#[tokio::test]
async fn metadata_is_part_of_the_idempotency_fingerprint() {
    let p = provider().await;
    let body = |attempt: &str| with_metadata("pedido-6", json!({"cobro_attempt": attempt}));
    let first = p
        .post("/v1/charges", Some("k-6"), &body("a1"))
        .await
        .unwrap();
    let same = p
        .post("/v1/charges", Some("k-6"), &body("a1"))
        .await
        .unwrap();
    let other = p
        .post("/v1/charges", Some("k-6"), &body("a2"))
        .await
        .unwrap();
    let none = p
        .post("/v1/charges", Some("k-6"), &charge_body("pedido-6"))
        .await
        .unwrap();
    assert_eq!(
        (first.status, same.replayed, &same.body),
        (201, true, &first.body)
    );
    for answer in [other, none] {
        assert_eq!(answer.error(), (400, "idempotency_error"));
    }

    p.capture(first.id(), None, json!({})).await;
    let refund = |attempt: &str| json!({"charge": first.id(), "amount": 10, "reference": "pedido-6:refund", "metadata": {"cobro_attempt": attempt}});
    let refunded = p
        .post("/v1/refunds", Some("r-6"), &refund("r1"))
        .await
        .unwrap();
    let again = p
        .post("/v1/refunds", Some("r-6"), &refund("r1"))
        .await
        .unwrap();
    let changed = p
        .post("/v1/refunds", Some("r-6"), &refund("r2"))
        .await
        .unwrap();
    assert_eq!((refunded.status, again.replayed), (201, true));
    assert_eq!(changed.error(), (400, "idempotency_error"));
    assert_eq!(p.totals(), charges(1).captures(1).refunds(1));
}

#[tokio::test]
async fn charges_carry_their_capture_method_and_refunds_their_currency() {
    let p = provider().await;
    let manual = p.charge(None, "pedido-7/manual").await;
    let mut body = charge_body("pedido-7/automatic");
    body["capture"] = json!(true);
    body["currency"] = json!("USD");
    let automatic = p.post("/v1/charges", None, &body).await.unwrap();
    body["payment_method"] = json!("pm_card_declined");
    let declined = p.post("/v1/charges", None, &body).await.unwrap();

    assert_eq!(manual.body["capture_method"], "manual");
    let captured = p.capture(manual.id(), None, json!({})).await;
    assert_eq!(
        (
            captured.body["status"].as_str(),
            captured.body["capture_method"].as_str()
        ),
        (Some("captured"), Some("manual"))
    );
    assert_eq!(automatic.body["capture_method"], "automatic");
    assert_eq!(declined.body["charge"]["capture_method"], "automatic");

    let refund = p.refund(automatic.id(), 100, "pedido-7/refund").await;
    assert_eq!(refund.body["currency"], "USD");
    let stored = p.get(&format!("/v1/refunds/{}", refund.id())).await;
    assert_eq!(stored.body["currency"], "USD");
}

#[tokio::test]
async fn refused_captures_and_voids_carry_the_current_charge_and_replay_as_first_answered() {
    let p = provider().await;
    let mut body = charge_body("pedido-8/automatic");
    body["capture"] = json!(true);
    let captured = p.post("/v1/charges", None, &body).await.unwrap();
    let void_path = format!("/v1/charges/{}/void", captured.id());

    let capture = p.capture(captured.id(), Some("cap-8"), json!({})).await;
    let void = p
        .post(&void_path, Some("void-8"), &json!({}))
        .await
        .unwrap();
    let current = p.get(&format!("/v1/charges/{}", captured.id())).await.body;
    assert_eq!(capture.error(), (400, "charge_not_capturable"));
    assert_eq!(void.error(), (400, "charge_not_voidable"));
    assert_eq!(capture.body["error"]["type"], "invalid_request_error");
    assert_eq!(
        (&capture.body["charge"], &void.body["charge"]),
        (&current, &current)
    );

    // The charge moves on; the refusal is replayed as first answered.
    p.refund(captured.id(), 100, "pedido-8/refund").await;
    let replay = p.capture(captured.id(), Some("cap-8"), json!({})).await;
    assert_eq!((replay.replayed, &replay.body), (true, &capture.body));
    assert_eq!(replay.body["charge"]["sequence"], 1);

    let voided = p.charge(None, "pedido-8/manual").await;
    p.void(voided.id()).await;
    let capture = p.capture(voided.id(), None, json!({})).await;
    assert_eq!(capture.error(), (400, "charge_not_capturable"));
    assert_eq!(
        (
            capture.body["charge"]["status"].as_str(),
            capture.body["charge"]["sequence"].as_u64()
        ),
        (Some("voided"), Some(2))
    );

    // A bad parameter is not a refusal by state: no charge attached.
    let authorized = p.charge(None, "pedido-8/authorized").await;
    let too_much = p
        .capture(authorized.id(), None, json!({"amount": 5000}))
        .await;
    assert_eq!(too_much.error(), (400, "parameter_invalid"));
    assert!(too_much.body.get("charge").is_none());
    assert_eq!(p.totals(), charges(3).voids(1).refunds(1));
}

#[tokio::test]
async fn search_by_metadata_ands_every_filter_newest_first() {
    let p = &provider().await;
    let charge = |reference: &str, intent: &str, attempt: &str| {
        let body = with_metadata(
            reference,
            json!({"cobro_intent": intent, "cobro_attempt": attempt, "note": "a/b c&d=e"}),
        );
        async move { p.post("/v1/charges", None, &body).await.unwrap() }
    };
    let first = charge("pedido-9/a1", "pedido-9", "a1").await;
    let second = charge("pedido-9/a2", "pedido-9", "a2").await;
    let other = charge("pedido-90/a1", "pedido-90", "a1").await;
    let search = |pairs: &[(&str, &str)]| {
        let query = query(pairs);
        async move { p.search_as(CALLER, "charges", &query).await }
    };

    assert_eq!(
        search(&[("metadata[cobro_intent]", "pedido-9")]).await,
        [second.id(), first.id()]
    );
    assert_eq!(
        search(&[("metadata[cobro_attempt]", "a1")]).await,
        [other.id(), first.id()]
    );
    assert_eq!(
        search(&[
            ("metadata[cobro_intent]", "pedido-9"),
            ("metadata[cobro_attempt]", "a1")
        ])
        .await,
        [first.id()]
    );
    assert_eq!(
        search(&[
            ("reference", "pedido-9/a2"),
            ("metadata[cobro_intent]", "pedido-9")
        ])
        .await,
        [second.id()]
    );
    assert!(
        search(&[
            ("reference", "pedido-9/a2"),
            ("metadata[cobro_attempt]", "a1")
        ])
        .await
        .is_empty()
    );
    assert!(
        search(&[
            ("metadata[cobro_intent]", "pedido-9"),
            ("metadata[cobro_intent]", "pedido-90")
        ])
        .await
        .is_empty()
    );
    assert_eq!(
        search(&[
            ("metadata[note]", "a/b c&d=e"),
            ("metadata[cobro_intent]", "pedido-90")
        ])
        .await,
        [other.id()],
        "values are form-decoded"
    );
    assert!(search(&[("metadata[missing]", "x")]).await.is_empty());
    let encoded = p
        .search_as(CALLER, "charges", "metadata%5Bcobro_intent%5D=pedido-90")
        .await;
    assert_eq!(encoded, [other.id()]);

    p.capture(first.id(), None, json!({})).await;
    let refund = json!({"charge": first.id(), "amount": 10, "reference": "pedido-9/refund", "metadata": {"cobro_intent": "pedido-9"}});
    let refund = p.post("/v1/refunds", None, &refund).await.unwrap();
    assert_eq!(
        p.search_as(
            CALLER,
            "refunds",
            &query(&[("metadata[cobro_intent]", "pedido-9")])
        )
        .await,
        [refund.id()]
    );
}

#[tokio::test]
async fn search_needs_a_filter_and_refuses_unknown_or_malformed_parameters() {
    let p = provider().await;
    let cases = [
        ("/v1/charges", "parameter_missing"),
        ("/v1/charges?", "parameter_missing"),
        ("/v1/refunds", "parameter_missing"),
        ("/v1/charges?offset=10", "parameter_unknown"),
        ("/v1/refunds?reference=r&page=1", "parameter_unknown"),
        ("/v1/charges?metadata=x", "parameter_invalid"),
        ("/v1/charges?metadata[]=x", "parameter_invalid"),
        ("/v1/charges?metadata[k=x", "parameter_invalid"),
        ("/v1/charges?reference=a&reference=b", "parameter_invalid"),
    ];
    for (path, code) in cases {
        let answer = p.get(path).await;
        assert_eq!(answer.error(), (400, code), "{path}");
    }
    let answer = p.get("/v1/charges?metadata[]=x").await;
    let message = answer.body["error"]["message"].as_str().unwrap();
    assert!(message.starts_with("metadata"), "{message}");
}

#[tokio::test]
async fn search_by_metadata_is_subject_to_search_lag() {
    let p = provider().await;
    p.control
        .add_fault(FaultRule::new(Operation::Charge, FaultAction::SearchLag).with_lag_seconds(30));
    let body = with_metadata("pedido-10/a1", json!({"cobro_intent": "pedido-10"}));
    let charge = p.post("/v1/charges", None, &body).await.unwrap();
    let by_metadata = query(&[("metadata[cobro_intent]", "pedido-10")]);

    assert!(
        p.search_as(CALLER, "charges", &by_metadata)
            .await
            .is_empty()
    );
    assert_eq!(
        p.get(&format!("/v1/charges/{}", charge.id())).await.status,
        200
    );
    p.control.advance_clock(Duration::from_secs(30));
    assert_eq!(
        p.search_as(CALLER, "charges", &by_metadata).await,
        [charge.id()]
    );
}
