//! Each fault action, rule matching, search lag under the virtual clock, and
//! seeded determinism.
#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

mod common;

use std::time::{Duration, Instant};

use common::{EffectsExt, charge_body, charges, declines, provider, provider_with, refunds};
use fake_provider::{Config, Effects, FaultAction, FaultRule, Operation};
use serde_json::json;

#[tokio::test]
async fn drop_response_after_effect_closes_the_connection_after_making_the_charge() {
    let p = provider().await;
    p.control.add_fault(
        FaultRule::new(Operation::Charge, FaultAction::DropResponseAfterEffect).with_next(1),
    );

    let lost = p
        .post(
            "/v1/charges",
            Some("key-1"),
            &charge_body("pedido-1:authorize-v1"),
        )
        .await;

    let error = lost.expect_err("no HTTP answer at all");
    assert!(
        error.status().is_none(),
        "a connection error, not a status: {error:?}"
    );
    assert!(
        !error.is_connect(),
        "the request was sent; the answer was lost: {error:?}"
    );
    assert_eq!(p.effects_of("pedido-1:authorize-v1"), charges(1));

    let retried = p.charge(Some("key-1"), "pedido-1:authorize-v1").await;
    assert_eq!((retried.status, retried.replayed), (201, true));
    assert_eq!(p.totals(), charges(1));
}

/// A request the provider's queue lets through late: nothing is made and
/// nothing answered; the key stays in progress (a retry under it makes
/// nothing), search shows nothing; released, the effect is made once,
/// under the original key and reference, and the key replays it.
#[tokio::test]
async fn hold_effect_makes_the_charge_only_when_released_under_its_key() {
    let p = admin_provider().await;
    p.control
        .add_fault(FaultRule::new(Operation::Charge, FaultAction::HoldEffect).with_next(1));
    let body = charge_body("pedido-h:authorize-v1");

    let lost = p.post("/v1/charges", Some("key-h"), &body).await;

    let error = lost.expect_err("no HTTP answer at all");
    assert!(error.status().is_none(), "{error:?}");
    assert_eq!(p.totals(), Effects::default());
    assert_eq!(p.control.held(), 1);
    let retried = p.charge(Some("key-h"), "pedido-h:authorize-v1").await;
    assert_eq!(retried.error(), (409, "idempotency_in_progress"));
    assert!(
        p.search("charges", "pedido-h:authorize-v1")
            .await
            .is_empty()
    );
    assert_eq!(p.totals(), Effects::default());

    let admin = fake_provider::AdminClient::new(&p.url);
    assert_eq!(admin.held().await.unwrap(), 1);
    assert_eq!(admin.release_held().await.unwrap(), 1);

    assert_eq!((p.control.held(), p.totals()), (0, charges(1)));
    let ledger = p.control.ledger();
    let [charge] = ledger.charges.as_slice() else {
        panic!("one charge: {ledger:?}")
    };
    assert_eq!(charge.idempotency_key.as_deref(), Some("key-h"));
    assert_eq!(charge.reference, "pedido-h:authorize-v1");
    // A hold drawn by a retry under a key already answered holds nothing:
    // the key replays its answer, marked as a replay.
    p.control
        .add_fault(FaultRule::new(Operation::Charge, FaultAction::HoldEffect).with_next(1));
    let replayed = p.charge(Some("key-h"), "pedido-h:authorize-v1").await;
    assert_eq!(
        (replayed.status, replayed.replayed, replayed.id()),
        (201, true, charge.id.as_str())
    );
    assert_eq!(p.control.held(), 0);
    assert_eq!(admin.release_held().await.unwrap(), 0);
    assert_eq!(p.totals(), charges(1));
}

async fn admin_provider() -> common::Provider {
    provider_with(Config {
        admin: true,
        ..Config::default()
    })
    .await
}

/// Only the creation of a charge or refund can be held.
#[tokio::test]
async fn hold_effect_is_refused_for_what_cannot_be_held() {
    let p = admin_provider().await;
    let admin = fake_provider::AdminClient::new(&p.url);
    for operation in [Operation::Capture, Operation::Void, Operation::Any] {
        let refused = admin
            .add_fault(FaultRule::new(operation, FaultAction::HoldEffect))
            .await
            .expect_err("refused");
        assert!(refused.to_string().contains("hold_effect"), "{refused}");
    }
    // Given in process anyway, such a rule never fires.
    p.control
        .add_fault(FaultRule::new(Operation::Capture, FaultAction::HoldEffect));
    let charge = p.charge(None, "pedido-i:authorize-v1").await;
    let captured = p.capture(charge.id(), None, json!({})).await;
    assert_eq!((captured.status, p.control.held()), (200, 0));
}

#[tokio::test]
async fn delay_after_effect_answers_after_the_client_gave_up_with_the_charge_made() {
    let p = provider().await;
    p.control.add_fault(
        FaultRule::new(Operation::Charge, FaultAction::DelayAfterEffect)
            .with_next(1)
            .with_delay(Duration::from_secs(3)),
    );
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap();

    let timed_out = p
        .post_with(
            &impatient,
            "sk_test_cobro",
            "/v1/charges",
            Some("key-2"),
            &charge_body("pedido-2:authorize-v1"),
        )
        .await
        .expect_err("the client times out");

    assert!(timed_out.is_timeout(), "{timed_out:?}");
    assert_eq!(p.totals(), charges(1));
    let retried = p.charge(Some("key-2"), "pedido-2:authorize-v1").await;
    assert_eq!((retried.status, retried.replayed), (201, true));
    assert_eq!(p.totals(), charges(1));
}

#[tokio::test]
async fn latency_delays_the_answer_but_not_the_outcome() {
    let p = provider().await;
    p.control.add_fault(
        FaultRule::new(Operation::Charge, FaultAction::Latency)
            .with_next(1)
            .with_delay(Duration::from_millis(300)),
    );
    let started = Instant::now();
    let answer = p.charge(Some("key-3"), "pedido-3:authorize-v1").await;

    assert!(started.elapsed() >= Duration::from_millis(300));
    assert_eq!(answer.status, 201);
    assert_eq!(p.totals(), charges(1));
}

#[tokio::test]
async fn in_progress_fault_answers_409_and_makes_nothing() {
    let p = provider().await;
    p.control
        .add_fault(FaultRule::new(Operation::Charge, FaultAction::InProgress).with_next(1));
    let busy = p.charge(Some("key-4"), "pedido-4:authorize-v1").await;
    assert_eq!(busy.error(), (409, "idempotency_in_progress"));
    assert_eq!(p.totals(), Effects::default());

    let retried = p.charge(Some("key-4"), "pedido-4:authorize-v1").await;
    assert_eq!((retried.status, retried.replayed), (201, false));
    assert_eq!(p.totals(), charges(1));
}

#[tokio::test]
async fn rules_match_the_reference_and_expire_after_next_n() {
    let p = provider().await;
    p.control.add_fault(
        FaultRule::new(Operation::Charge, FaultAction::FailBeforeEffect)
            .with_reference("pedido-5")
            .with_next(2),
    );
    let other = p.charge(None, "pedido-6:authorize-v1").await;
    let first = p.charge(None, "pedido-5:authorize-v1").await;
    let second = p.charge(None, "pedido-5:authorize-v1").await;
    let third = p.charge(None, "pedido-5:authorize-v1").await;

    assert_eq!(
        (other.status, first.status, second.status, third.status),
        (201, 503, 503, 201)
    );
    assert!(p.control.faults().is_empty(), "the rule is spent");
    let ledger = p.control.ledger();
    assert_eq!(ledger.for_reference("pedido-5:authorize-v1"), charges(1));
    assert_eq!(ledger.for_reference("pedido-6:authorize-v1"), charges(1));
}

#[tokio::test]
async fn capture_faults_match_the_charge_reference_and_leave_it_authorized() {
    let p = provider().await;
    let charge = p.charge(Some("auth"), "pedido-7:authorize-v1").await;
    p.control.add_fault(
        FaultRule::new(Operation::Capture, FaultAction::FailBeforeEffect)
            .with_reference("pedido-7"),
    );
    let path = format!("/v1/charges/{}/capture", charge.id());

    let failed = p.post(&path, Some("cap"), &json!({})).await.unwrap();

    assert_eq!(failed.status, 503);
    let stored = p.get(&format!("/v1/charges/{}", charge.id())).await;
    assert_eq!(stored.body["status"], "authorized");
    p.control.clear_faults();
    let captured = p.post(&path, Some("cap"), &json!({})).await.unwrap();
    assert_eq!(
        (captured.status, captured.body["status"].as_str()),
        (200, Some("captured"))
    );
    assert_eq!(p.totals(), charges(1).captures(1));
}

#[tokio::test]
async fn any_matches_reads_as_well_as_mutations() {
    let p = provider().await;
    let charge = p.charge(None, "pedido-8:authorize-v1").await;
    p.control
        .add_fault(FaultRule::new(Operation::Any, FaultAction::FailAfterEffect).with_next(3));

    let get = p.get(&format!("/v1/charges/{}", charge.id())).await;
    let search = p.get("/v1/charges?reference=pedido-8:authorize-v1").await;
    let refund = p.refund(charge.id(), 1, "pedido-8:refund-v1").await;

    assert_eq!((get.status, search.status, refund.status), (500, 500, 500));
    // The refund ran (and was refused: nothing captured) before the 500.
    assert_eq!(p.totals(), charges(1));
}

#[tokio::test]
async fn search_lag_hides_new_charges_until_virtual_time_passes() {
    let p = provider().await;
    p.control
        .add_fault(FaultRule::new(Operation::Search, FaultAction::SearchLag).with_lag_seconds(30));
    let reference = "pedido-9:authorize-v1";
    let charge = p.charge(Some("key-9"), reference).await;

    assert!(
        p.search("charges", reference).await.is_empty(),
        "invisible to search"
    );
    assert_eq!(
        p.get(&format!("/v1/charges/{}", charge.id())).await.status,
        200,
        "GET by id finds it"
    );
    p.control.advance_clock(Duration::from_secs(29));
    assert!(p.search("charges", reference).await.is_empty());
    p.control.advance_clock(Duration::from_secs(1));
    assert_eq!(
        p.search("charges", reference).await,
        vec![charge.id().to_owned()]
    );
    assert_eq!(p.totals(), charges(1));
}

#[tokio::test]
async fn search_lag_applies_only_to_what_is_created_while_the_rule_is_active() {
    let p = provider().await;
    let reference = "pedido-10:authorize-v1";
    let before = p.charge(None, reference).await;
    p.control
        .add_fault(FaultRule::new(Operation::Charge, FaultAction::SearchLag).with_next(1));
    let lagged = p.charge(None, reference).await;
    let after = p.charge(None, reference).await;

    assert_eq!(
        p.search("charges", reference).await,
        vec![after.id().to_owned(), before.id().to_owned()]
    );
    p.control.advance_clock(Duration::from_secs(60));
    let newest_first = vec![
        after.id().to_owned(),
        lagged.id().to_owned(),
        before.id().to_owned(),
    ];
    assert_eq!(p.search("charges", reference).await, newest_first);
    assert_eq!(p.effects_of(reference), charges(3));
}

#[tokio::test]
async fn search_lag_hides_refunds_too() {
    let p = provider().await;
    let mut body = charge_body("pedido-11:authorize-v1");
    body["capture"] = json!(true);
    let charge = p.post("/v1/charges", None, &body).await.unwrap();
    p.control
        .add_fault(FaultRule::new(Operation::Refund, FaultAction::SearchLag).with_lag_seconds(10));
    let refund = p.refund(charge.id(), 100, "pedido-11:refund-v1").await;

    assert!(p.search("refunds", "pedido-11:refund-v1").await.is_empty());
    assert_eq!(
        p.get(&format!("/v1/refunds/{}", refund.id())).await.status,
        200
    );
    p.control.advance_clock(Duration::from_secs(10));
    assert_eq!(
        p.search("refunds", "pedido-11:refund-v1").await,
        vec![refund.id().to_owned()]
    );
    assert_eq!(p.effects_of("pedido-11:refund-v1"), refunds(1));
}

/// Statuses of 40 sequential charges under a coin-flip 503 and a coin-flip
/// lost answer, on a fresh provider with `seed`.
async fn chaos_run(seed: u64) -> (Vec<u16>, Effects) {
    let p = provider_with(Config {
        seed,
        ..Config::default()
    })
    .await;
    p.control.add_fault(
        FaultRule::new(Operation::Charge, FaultAction::FailBeforeEffect).with_probability(0.5),
    );
    p.control.add_fault(
        FaultRule::new(Operation::Charge, FaultAction::FailAfterEffect).with_probability(0.5),
    );
    let mut statuses = Vec::new();
    for i in 0..40 {
        statuses.push(
            p.charge(
                Some(&format!("key-{i}")),
                &format!("pedido-{i}:authorize-v1"),
            )
            .await
            .status,
        );
    }
    (statuses, p.totals())
}

#[tokio::test]
async fn the_same_seed_and_request_order_give_the_same_faults() {
    let (first, first_effects) = chaos_run(42).await;
    let (second, second_effects) = chaos_run(42).await;
    let (other_seed, _) = chaos_run(7).await;

    assert_eq!(first, second);
    assert_eq!(first_effects, second_effects);
    assert!(
        first.contains(&503) && first.contains(&500) && first.contains(&201),
        "{first:?}"
    );
    assert_ne!(first, other_seed, "a different seed draws differently");
    let made = first.iter().filter(|&&status| status != 503).count() as u64;
    assert_eq!(
        first_effects,
        charges(made),
        "every non-503 made exactly one charge"
    );
}

/// A `soft_decline` rule, installed as JSON over the admin API, declines a
/// good card's charge `try_again_later` exactly as a declining card's
/// charge is declined: a declined charge in a 402, a decline (no charge) in
/// the ledger, and the 402 saved under the key, so a replay returns it and
/// counts nothing more.
#[tokio::test]
async fn soft_decline_declines_a_good_card_try_again_later_and_its_key_replays_the_decline() {
    let p = admin_provider().await;
    let installed = p
        .http
        .post(format!("{}/__admin/faults", p.url))
        .json(&json!({"operation": "charge", "action": "soft_decline", "probability": 1.0}))
        .send()
        .await
        .unwrap();
    assert_eq!(installed.status(), 200);
    let reference = "pedido-s:authorize-v1";

    let declined = p.charge(Some("key-s"), reference).await;

    assert_eq!(declined.error(), (402, "try_again_later"));
    assert_eq!(declined.body["error"]["type"], "card_error");
    let charge = &declined.body["charge"];
    assert_eq!(
        (&charge["status"], &charge["payment_method"]),
        (&json!("declined"), &json!("pm_card_visa"))
    );
    assert_eq!(p.totals(), declines(1));
    let replayed = p.charge(Some("key-s"), reference).await;
    assert_eq!(
        (replayed.status, replayed.replayed, &replayed.body),
        (402, true, &declined.body)
    );
    assert_eq!(p.totals(), declines(1));
    let ledger = p.control.ledger();
    assert_eq!(ledger.for_key("key-s"), declines(1));
    let [stored] = ledger.charges.as_slice() else {
        panic!("one charge: {ledger:?}")
    };
    assert_eq!(
        (stored.status.as_str(), stored.amount_captured),
        ("declined", 0)
    );
    let read = p
        .get(&format!("/v1/charges/{}", charge["id"].as_str().unwrap()))
        .await;
    assert_eq!(&read.body, charge);
}

/// A declined charge carries the code it was declined with on every read
/// of it, as its 402 did: a GET, a search, a list and a replay under its
/// key show `decline_code` (`try_again_later` under a `soft_decline` rule,
/// the card's own code otherwise), so a client that lost the 402 can still
/// tell a soft decline from the card's. Other charges carry none, and a
/// `processing` charge gets its code when it settles declined.
#[tokio::test]
async fn a_declined_charge_carries_its_decline_code_on_every_read() {
    let p = provider().await;
    p.control.add_fault(
        FaultRule::new(Operation::Charge, FaultAction::SoftDecline).with_reference("pedido-s"),
    );
    p.control.add_fault(
        FaultRule::new(Operation::Charge, FaultAction::Processing)
            .with_reference("pedido-sp")
            .with_lag_seconds(10),
    );
    let soft = p.charge(Some("key-s"), "pedido-s:authorize-v1").await;
    let mut hard = charge_body("pedido-h:authorize-v1");
    hard["payment_method"] = json!("pm_insufficient_funds");
    let hard = p.post("/v1/charges", None, &hard).await.unwrap();
    let fine = p.charge(None, "pedido-f:authorize-v1").await;
    let pending = p.charge(None, "pedido-sp:authorize-v1").await;

    assert_eq!(soft.error(), (402, "try_again_later"));
    assert_eq!(soft.body["charge"]["decline_code"], "try_again_later");
    assert_eq!(hard.error(), (402, "insufficient_funds"));
    assert_eq!(hard.body["charge"]["decline_code"], "insufficient_funds");
    assert_eq!(fine.status, 201);
    assert!(fine.body.get("decline_code").is_none(), "{:?}", fine.body);
    assert_eq!(pending.body["status"], "processing");
    assert!(pending.body.get("decline_code").is_none());

    let charge = &soft.body["charge"];
    let id = charge["id"].as_str().unwrap();
    assert_eq!(&p.get(&format!("/v1/charges/{id}")).await.body, charge);
    let found = p.get("/v1/charges?reference=pedido-s:authorize-v1").await;
    assert_eq!(&found.body["data"][0], charge);
    let listed = p.get("/v1/charges?limit=100").await;
    let listed = listed.body["data"].as_array().unwrap().clone();
    assert!(listed.contains(charge), "{listed:?}");
    let replayed = p.charge(Some("key-s"), "pedido-s:authorize-v1").await;
    assert_eq!((replayed.replayed, &replayed.body), (true, &soft.body));
    let ledger = p.control.ledger();
    assert_eq!(
        ledger.charge(id).unwrap().decline_code.as_deref(),
        Some("try_again_later")
    );
    assert_eq!(ledger.charge(fine.id()).unwrap().decline_code, None);

    p.control.advance_clock(Duration::from_secs(10));
    let settled = p.get(&format!("/v1/charges/{}", pending.id())).await;
    assert_eq!(
        (&settled.body["status"], &settled.body["decline_code"]),
        (&json!("declined"), &json!("try_again_later"))
    );
}

/// A rule scoped to one reference declines only that reference's charges,
/// replaces a declining card's own (hard) decline, and under `any` touches
/// nothing but charge creation.
#[tokio::test]
async fn soft_decline_hits_only_its_reference_and_only_charge_creation() {
    let p = provider().await;
    let authorized = p.charge(None, "pedido-c:authorize-v1").await;
    p.control.add_fault(
        FaultRule::new(Operation::Charge, FaultAction::SoftDecline).with_reference("pedido-a"),
    );
    p.control.add_fault(
        FaultRule::new(Operation::Any, FaultAction::SoftDecline).with_reference("pedido-c"),
    );

    let hit = p.charge(None, "pedido-a:authorize-v1").await;
    let other = p.charge(None, "pedido-b:authorize-v1").await;
    let mut hard = charge_body("pedido-a:authorize-v2");
    hard["payment_method"] = json!("pm_card_declined");
    let replaced = p.post("/v1/charges", None, &hard).await.unwrap();
    let mut unhit_hard = charge_body("pedido-b:authorize-v2");
    unhit_hard["payment_method"] = json!("pm_card_declined");
    let own = p.post("/v1/charges", None, &unhit_hard).await.unwrap();
    let captured = p.capture(authorized.id(), None, json!({})).await;
    let any_hit = p.charge(None, "pedido-c:authorize-v2").await;

    assert_eq!(hit.error(), (402, "try_again_later"));
    assert_eq!(other.status, 201);
    assert_eq!(replaced.error(), (402, "try_again_later"));
    assert_eq!(own.error(), (402, "card_declined"));
    assert_eq!(captured.status, 200, "{captured:?}");
    assert_eq!(any_hit.error(), (402, "try_again_later"));
    let ledger = p.control.ledger();
    assert_eq!(ledger.for_reference("pedido-a:authorize-v1"), declines(1));
    assert_eq!(ledger.for_reference("pedido-b:authorize-v1"), charges(1));
    assert_eq!(ledger.totals, charges(2).declines(4).captures(1));
}

/// `soft_decline` declines a charge being created: on any other operation
/// it could never fire, and the admin API refuses it with its usual 400.
#[tokio::test]
async fn soft_decline_is_refused_where_no_charge_is_created() {
    let p = admin_provider().await;
    let admin = fake_provider::AdminClient::new(&p.url);
    for operation in [
        Operation::Capture,
        Operation::Void,
        Operation::Refund,
        Operation::Get,
        Operation::Search,
        Operation::List,
        Operation::Webhook,
    ] {
        let refused = admin
            .add_fault(FaultRule::new(operation, FaultAction::SoftDecline))
            .await
            .expect_err("refused");
        let message = refused.to_string();
        assert!(
            message.contains("400") && message.contains("soft_decline applies to charge only"),
            "{operation:?}: {message}"
        );
    }
    let refused = p
        .http
        .post(format!("{}/__admin/faults", p.url))
        .json(&json!({"operation": "refund", "action": "soft_decline"}))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 400);
    let body: serde_json::Value = refused.json().await.unwrap();
    assert_eq!(body["error"]["code"], "parameter_invalid");
    for operation in [Operation::Charge, Operation::Any] {
        admin
            .add_fault(FaultRule::new(operation, FaultAction::SoftDecline))
            .await
            .unwrap();
    }
    assert!(p.control.faults().len() == 2);
}
