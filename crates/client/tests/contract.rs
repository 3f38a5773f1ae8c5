//! The client's mirrored types against the server: the served
//! `/openapi.json` (same properties, required ones enough, nullable ones
//! optional, JSON types, enum values) and real answers of every shape,
//! which must survive a decode and re-encode unchanged (nothing dropped,
//! nothing renamed). Run against cobro's API in-process on SQLite (the
//! document does not depend on the backend), with its worker and the fake
//! provider so answers carry attempts, provider references and failures.

use cobro_client::{
    Attempt, AttemptState, CaptureMethod, CreatePayment, CreateRefund, Failure, FieldError,
    Operation, Payment, PaymentList, PaymentStatus, Problem, ProblemCode, Refund, RefundStatus,
    Routing, RoutingMove,
};
use cobro_test_support::{Backend, Rig, manual_payment_body, payment_body};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use std::collections::{BTreeMap, BTreeSet};

async fn document(rig: &Rig) -> Value {
    let response = rig
        .app
        .client
        .get(format!("{}/openapi.json", rig.app.url))
        .send()
        .await
        .expect("send");
    assert_eq!(response.status().as_u16(), 200);
    response.json().await.expect("json")
}

fn resolve<'a>(doc: &'a Value, value: &'a Value) -> &'a Value {
    match value["$ref"].as_str() {
        Some(reference) => doc
            .pointer(reference.trim_start_matches('#'))
            .unwrap_or_else(|| panic!("dangling {reference}")),
        None => value,
    }
}

fn schema<'a>(doc: &'a Value, name: &str) -> &'a Value {
    let found = &doc["components"]["schemas"][name];
    assert!(found.is_object(), "the document has no schema {name}");
    found
}

/// The JSON types a property schema admits (`$ref` and `oneOf` followed).
fn admitted_types(doc: &Value, property: &Value) -> BTreeSet<String> {
    let property = resolve(doc, property);
    let mut types = BTreeSet::new();
    match &property["type"] {
        Value::String(t) => {
            types.insert(t.clone());
        }
        Value::Array(list) => {
            types.extend(list.iter().filter_map(|t| t.as_str()).map(str::to_owned))
        }
        _ => {}
    }
    for alternative in property["oneOf"].as_array().into_iter().flatten() {
        types.extend(admitted_types(doc, alternative));
    }
    types
}

fn json_type(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_i64() || n.is_u64() => "integer",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// `sample` has every field set. Its members must be exactly the schema's
/// properties, each of a type the schema admits; leaving out any property
/// the schema does not require, or nulling any nullable one, must still
/// decode.
fn assert_mirrors<T: Serialize + DeserializeOwned>(doc: &Value, name: &str, sample: &T) {
    let schema = schema(doc, name);
    let properties = schema["properties"].as_object().expect("properties");
    let required: BTreeSet<&str> = schema["required"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    let value = serde_json::to_value(sample).expect("serialise");
    let members = value.as_object().expect("an object");
    let ours: BTreeSet<&String> = members.keys().collect();
    let theirs: BTreeSet<&String> = properties.keys().collect();
    assert_eq!(
        ours, theirs,
        "{name}: this client's fields vs the document's properties"
    );
    for (key, member) in members {
        let admitted = admitted_types(doc, &properties[key]);
        assert!(
            admitted.contains(json_type(member)),
            "{name}.{key}: the client writes {} but the document admits {admitted:?}",
            json_type(member)
        );
        let mut reduced = value.clone();
        if !required.contains(key.as_str()) {
            reduced.as_object_mut().expect("object").remove(key);
            serde_json::from_value::<T>(reduced.clone()).unwrap_or_else(|e| {
                panic!(
                    "{name}: `{key}` is optional in the document but the client requires it: {e}"
                )
            });
        }
        if admitted.contains("null") {
            let mut nulled = value.clone();
            nulled[key] = Value::Null;
            serde_json::from_value::<T>(nulled).unwrap_or_else(|e| {
                panic!(
                    "{name}: `{key}` may be null in the document but the client refuses null: {e}"
                )
            });
        }
    }
}

fn assert_enum(doc: &Value, name: &str, known: &[&str]) {
    let documented: BTreeSet<&str> = schema(doc, name)["enum"]
        .as_array()
        .unwrap_or_else(|| panic!("{name} is an enum"))
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let ours: BTreeSet<&str> = known.iter().copied().collect();
    assert_eq!(
        ours, documented,
        "{name}: this client's values vs the document's"
    );
}

fn time() -> chrono::DateTime<chrono::Utc> {
    cobro_test_support::t0()
}

fn full_attempt() -> Attempt {
    Attempt {
        number: 1,
        operation: Operation::Authorize,
        reference: "o-1:authorize-v1".into(),
        state: AttemptState::Succeeded,
        sends: 1,
        first_send_at: Some(time()),
        last_send_at: Some(time()),
        provider: Some("fake".into()),
    }
}

fn full_routing() -> Routing {
    Routing {
        rule: Some("eur-cards".into()),
        chain: vec!["fake".into(), "stripe".into()],
        reason: "rule eur-cards".into(),
        moves: vec![full_move()],
    }
}

fn full_move() -> RoutingMove {
    RoutingMove {
        from: "fake".into(),
        to: "stripe".into(),
        proof: "soft_decline: try_again_later".into(),
        attempt: "0193a7c4-5f2e-7d41-9b7a-2c1d3e4f5a6b".into(),
        at: "2026-01-01T00:00:00.000000Z".into(),
    }
}

fn full_payment() -> Payment {
    Payment {
        id: "0193a7c4-5f2e-7d41-9b7a-2c1d3e4f5a6b".into(),
        intent: "o-1:authorize-v1".into(),
        order_ref: "o-1".into(),
        amount: 1999,
        currency: "EUR".into(),
        capture_method: CaptureMethod::Automatic,
        status: PaymentStatus::Declined,
        amount_captured: 0,
        amount_refunded: 0,
        provider_ref: Some("ch_1".into()),
        failure: Some(Failure {
            code: "card_declined".into(),
            message: Some("declined".into()),
        }),
        cancel_requested: false,
        description: Some("d".into()),
        metadata: BTreeMap::from([("k".to_owned(), "v".to_owned())]),
        created_at: time(),
        updated_at: time(),
        return_url: Some("https://shop.example/back".into()),
        next_action: Some(Box::new(cobro_client::NextAction {
            kind: "redirect_to_url".into(),
            redirect_to_url: Some(cobro_client::RedirectToUrl {
                url: "https://provider.example/challenge".into(),
                return_url: Some("https://shop.example/back".into()),
            }),
            client_secret: Some("pi_1_secret_x".into()),
        })),
        action_expires_at: Some(time()),
        provider: Some("stripe".into()),
        routing: Some(full_routing()),
        attempts: Some(vec![full_attempt()]),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_mirrored_type_has_exactly_the_documented_properties_and_enum_values() {
    let rig = Rig::new(Backend::Sqlite).await;
    let doc = document(&rig).await;

    assert_mirrors(&doc, "Payment", &full_payment());
    assert_mirrors(&doc, "Attempt", &full_attempt());
    assert_mirrors(&doc, "RoutingView", &full_routing());
    assert_mirrors(&doc, "RoutingMoveView", &full_move());
    assert_mirrors(
        &doc,
        "Failure",
        &Failure {
            code: "c".into(),
            message: Some("m".into()),
        },
    );
    assert_mirrors(
        &doc,
        "Refund",
        &Refund {
            id: "r".into(),
            payment_id: "p".into(),
            intent: "o-1:refund-v1".into(),
            amount: 1,
            reason: Some("r".into()),
            status: RefundStatus::Failed,
            provider_ref: Some("re_1".into()),
            failure: Some(Failure {
                code: "c".into(),
                message: None,
            }),
            created_at: time(),
            updated_at: time(),
            reference: Some("rf-1".into()),
        },
    );
    assert_mirrors(
        &doc,
        "PaymentList",
        &PaymentList {
            data: vec![full_payment()],
            next_cursor: Some("c".into()),
        },
    );
    assert_mirrors(
        &doc,
        "Problem",
        &Problem {
            kind: "/problems/validation-error".into(),
            title: "t".into(),
            status: 400,
            detail: "d".into(),
            code: ProblemCode::ValidationError,
            request_id: Some("r".into()),
            payment_id: Some("p".into()),
            errors: Some(vec![FieldError {
                field: "amount".into(),
                message: "m".into(),
            }]),
            idempotency_key: Some("k".into()),
        },
    );
    assert_mirrors(
        &doc,
        "FieldError",
        &FieldError {
            field: "f".into(),
            message: "m".into(),
        },
    );
    assert_mirrors(
        &doc,
        "CreatePaymentRequest",
        &CreatePayment::new("o-1", 1999, "EUR", "pm_card_visa")
            .manual()
            .description("d")
            .metadata("k", "v")
            .return_url("https://shop.example/back"),
    );
    assert_mirrors(
        &doc,
        "CreateRefundRequest",
        &CreateRefund::new(1).reason("r").reference("rf-1"),
    );

    assert_enum(&doc, "PaymentStatus", PaymentStatus::KNOWN);
    assert_enum(&doc, "RefundStatus", RefundStatus::KNOWN);
    assert_enum(&doc, "AttemptState", AttemptState::KNOWN);
    assert_enum(&doc, "CaptureMethod", CaptureMethod::KNOWN);
    assert_enum(&doc, "Operation", Operation::KNOWN);
    assert_enum(&doc, "ProblemCode", ProblemCode::KNOWN);
}

/// Decodes `raw` as `T`, encodes it again and requires the same JSON.
fn assert_round_trips<T: Serialize + DeserializeOwned>(what: &str, raw: &Value) -> T {
    let typed: T = serde_json::from_value(raw.clone())
        .unwrap_or_else(|e| panic!("{what} does not decode: {e}\n{raw:#}"));
    let again = serde_json::to_value(&typed).expect("serialise");
    assert_eq!(&again, raw, "{what} changes in a decode and re-encode");
    typed
}

async fn post(rig: &Rig, path: &str, body: &Value) -> (u16, Value) {
    let key = uuid::Uuid::new_v4().to_string();
    let response = rig
        .app
        .post(path, Some(&key))
        .json(body)
        .send()
        .await
        .expect("send");
    let status = response.status().as_u16();
    (status, response.json().await.expect("json"))
}

async fn get(rig: &Rig, path: &str) -> (u16, Value) {
    let response = rig.app.get(path).send().await.expect("send");
    let status = response.status().as_u16();
    (status, response.json().await.expect("json"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_answers_of_every_shape_round_trip_through_the_mirrored_types() {
    let rig = Rig::new(Backend::Sqlite).await;

    // A manual payment: created, authorised, captured, refunded.
    let (status, created) = post(&rig, "/v1/payments", &manual_payment_body("rt-1")).await;
    assert_eq!(status, 201);
    let payment: Payment = assert_round_trips("the 201 of a create", &created);
    rig.drain(10).await;
    let path = format!("/v1/payments/{}", payment.id);
    let (_, authorized) = get(&rig, &path).await;
    let authorized: Payment = assert_round_trips("an authorised payment", &authorized);
    assert_eq!(authorized.status, PaymentStatus::Authorized);
    assert!(authorized.provider_ref.is_some());
    let attempts = authorized.attempts.expect("GET carries attempts");
    assert!(attempts[0].first_send_at.is_some(), "{attempts:?}");

    let (status, capturing) = post(&rig, &format!("{path}/capture"), &json!({})).await;
    assert_eq!(status, 202);
    let capturing: Payment = assert_round_trips("the 202 of a capture", &capturing);
    assert!(capturing.attempts.is_none());
    rig.drain(10).await;

    let (status, refund) = post(
        &rig,
        &format!("{path}/refunds"),
        &json!({"amount": 500, "reason": "damaged"}),
    )
    .await;
    assert_eq!(status, 201);
    let refund: Refund = assert_round_trips("the 201 of a refund", &refund);
    rig.drain(10).await;
    let (_, refunded) = get(&rig, &format!("{path}/refunds/{}", refund.id)).await;
    let refunded: Refund = assert_round_trips("a succeeded refund", &refunded);
    assert_eq!(refunded.status, RefundStatus::Succeeded);
    let (_, partially) = get(&rig, &path).await;
    let partially: Payment = assert_round_trips("a partially refunded payment", &partially);
    assert_eq!(partially.status, PaymentStatus::PartiallyRefunded);

    // A declined payment carries its failure.
    let mut declined_body = payment_body("rt-2");
    declined_body["payment_method"] = json!("pm_card_declined");
    declined_body["description"] = json!("a card that declines");
    declined_body["metadata"] = json!({"shop": "x"});
    let (_, declined) = post(&rig, "/v1/payments", &declined_body).await;
    rig.drain(10).await;
    let declined_id = declined["id"].as_str().expect("id").to_owned();
    let (_, declined) = get(&rig, &format!("/v1/payments/{declined_id}")).await;
    let declined: Payment = assert_round_trips("a declined payment", &declined);
    assert_eq!(declined.status, PaymentStatus::Declined);
    assert!(declined.failure.is_some());

    let (_, list) = get(&rig, "/v1/payments?limit=1").await;
    let list: PaymentList = assert_round_trips("a page of payments", &list);
    assert!(list.next_cursor.is_some());

    // Problems: with errors, with a payment id, bare.
    let (status, invalid) = post(&rig, "/v1/payments", &json!({"amount": 19.99})).await;
    assert_eq!(status, 400);
    let invalid: Problem = assert_round_trips("a validation problem", &invalid);
    assert_eq!(invalid.code, ProblemCode::ValidationError);
    assert!(invalid.errors.is_some_and(|e| !e.is_empty()));
    let (status, refused) = post(&rig, &format!("{path}/capture"), &json!({})).await;
    assert_eq!(status, 422);
    let refused: Problem = assert_round_trips("a stored refusal", &refused);
    assert_eq!(refused.code, ProblemCode::PaymentNotCapturable);
    assert_eq!(refused.payment_id.as_deref(), Some(payment.id.as_str()));
    let (status, active) = post(&rig, "/v1/payments", &manual_payment_body("rt-1")).await;
    assert_eq!(status, 422);
    let active: Problem = assert_round_trips("order-has-active-payment", &active);
    assert_eq!(active.code, ProblemCode::OrderHasActivePayment);
    let (status, missing) = get(&rig, "/v1/payments/0193a7c4-5f2e-7d41-9b7a-2c1d3e4f5a6b").await;
    assert_eq!(status, 404);
    let missing: Problem = assert_round_trips("not-found", &missing);
    assert_eq!(missing.code, ProblemCode::NotFound);
}
