//! Stripe's idempotency semantics on the Stripe dialect (a result is saved
//! once execution began; other parameters are an `idempotency_error`; 409
//! while in flight; 429 before the idempotency layer; keys forgotten after
//! retention) and every fault action on Stripe routes, with Stripe's error
//! bodies and headers. Every test checks the ledger.
#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

mod common;

use std::time::Duration;

use common::stripe::{SK, SK_B, form, intent_form};
use common::{EffectsExt, charges, declines, provider, provider_with, refunds};
use fake_provider::{Config, Effects, FaultAction, FaultRule, Operation};

const INTENTS: &str = "/v1/payment_intents";

#[tokio::test]
async fn the_same_key_and_parameters_replay_the_first_answer_and_charge_once() {
    let p = provider().await;
    let first = p
        .stripe_intent("automatic", "o-1:authorize-v1", Some("k-1"))
        .await;
    let second = p
        .stripe_intent("automatic", "o-1:authorize-v1", Some("k-1"))
        .await;

    assert!(!first.replayed);
    assert!(second.replayed);
    assert_eq!(second.body, first.body);
    assert_ne!(
        second.request_id, first.request_id,
        "each request has its own id"
    );
    let ledger = p.control.ledger();
    assert_eq!(ledger.totals, charges(1));
    assert_eq!(ledger.for_key("k-1"), charges(1));
}

#[tokio::test]
async fn a_decline_is_saved_and_replayed_with_idempotent_replayed() {
    let p = provider().await;
    let mut pairs = intent_form("automatic", "o-2:authorize-v1");
    pairs[2] = ("payment_method", "pm_card_chargeDeclined");
    let first = p.stripe_post(INTENTS, Some("k-2"), &pairs).await;
    let second = p.stripe_post(INTENTS, Some("k-2"), &pairs).await;

    assert_eq!(first.error(), (402, "card_error", "card_declined"));
    assert!(!first.replayed);
    assert_eq!((second.status, second.replayed), (402, true));
    assert_eq!(second.body, first.body);
    assert_eq!(p.totals(), declines(1));
}

#[tokio::test]
async fn a_refusal_after_execution_began_is_saved_too() {
    let p = provider().await;
    let automatic = p.stripe_intent("automatic", "o-3:authorize-v1", None).await;
    let path = format!("{INTENTS}/{}/capture", automatic.id());
    let first = p.stripe_post(&path, Some("cap-3"), &[]).await;
    let second = p.stripe_post(&path, Some("cap-3"), &[]).await;

    assert_eq!(first.error().2, "payment_intent_unexpected_state");
    assert_eq!((second.status, second.replayed), (400, true));
    let missing = format!("{INTENTS}/pi_missing/cancel");
    let gone = p.stripe_post(&missing, Some("cancel-3"), &[]).await;
    let gone_again = p.stripe_post(&missing, Some("cancel-3"), &[]).await;
    assert_eq!(gone.error().2, "resource_missing");
    assert_eq!((gone_again.status, gone_again.replayed), (404, true));
    assert_eq!(p.totals(), charges(1));
}

#[tokio::test]
async fn the_same_key_with_other_parameters_is_an_idempotency_error_not_to_retry() {
    let p = provider().await;
    p.stripe_intent("automatic", "o-4:authorize-v1", Some("k-4"))
        .await;
    let mut other = intent_form("automatic", "o-4:authorize-v1");
    other[0] = ("amount", "9999");
    let reused = p.stripe_post(INTENTS, Some("k-4"), &other).await;
    let elsewhere = p
        .stripe_post(&format!("{INTENTS}/pi_other/cancel"), Some("k-4"), &[])
        .await;

    for reply in [&reused, &elsewhere] {
        assert_eq!(reply.status, 400, "{reply:?}");
        assert_eq!(reply.body["error"]["type"], "idempotency_error");
        assert_eq!(reply.body["error"]["code"], serde_json::Value::Null);
        assert!(
            reply.body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("k-4")
        );
        assert_eq!(reply.should_retry.as_deref(), Some("false"));
        assert!(!reply.replayed);
    }
    assert_eq!(p.totals(), charges(1));
}

#[tokio::test]
async fn a_request_refused_before_execution_saves_nothing_under_its_key() {
    let p = provider().await;
    let mut invalid = intent_form("automatic", "o-5:authorize-v1");
    invalid[0] = ("amount", "twelve");
    let refused = p.stripe_post(INTENTS, Some("k-5"), &invalid).await;
    let refused_again = p.stripe_post(INTENTS, Some("k-5"), &invalid).await;
    let fixed = p
        .stripe_intent("automatic", "o-5:authorize-v1", Some("k-5"))
        .await;

    assert_eq!(refused.error().2, "parameter_invalid_integer");
    assert!(!refused_again.replayed, "not saved, so not replayed");
    assert!(
        !fixed.replayed,
        "the key was free: the fixed request executes"
    );
    assert_eq!(fixed.status_of(), "succeeded");
    let replay = p
        .stripe_intent("automatic", "o-5:authorize-v1", Some("k-5"))
        .await;
    assert!(replay.replayed);
    assert_eq!(p.control.ledger().for_key("k-5"), charges(1));
}

#[tokio::test]
async fn a_key_longer_than_255_characters_is_refused_before_anything_runs() {
    let p = provider().await;
    let key = "k".repeat(256);
    let reply = p
        .stripe_post(
            INTENTS,
            Some(&key),
            &intent_form("automatic", "o-6:authorize-v1"),
        )
        .await;
    assert_eq!(reply.error(), (400, "invalid_request_error", ""));
    assert!(reply.request_id.is_some());
    let longest = "k".repeat(255);
    let ok = p
        .stripe_intent("automatic", "o-6:authorize-v1", Some(&longest))
        .await;
    assert_eq!(ok.status_of(), "succeeded");
    assert_eq!(p.totals(), charges(1));
}

#[tokio::test]
async fn the_same_key_while_the_first_request_runs_gets_409_key_in_use() {
    let p = provider().await;
    // Holds the first request after it reserved its key.
    p.control.add_fault(
        FaultRule::new(Operation::Charge, FaultAction::Latency)
            .with_next(1)
            .with_delay(Duration::from_millis(1500)),
    );
    let body = form(&intent_form("manual", "o-7:authorize-v1"));
    let first = {
        let (http, url, body) = (p.http.clone(), p.url.clone(), body.clone());
        tokio::spawn(async move {
            let response = http
                .post(format!("{url}{INTENTS}"))
                .bearer_auth(SK)
                .header("Content-Type", "application/x-www-form-urlencoded")
                .header("Idempotency-Key", "k-7")
                .body(body)
                .send()
                .await
                .unwrap();
            common::stripe::reply(response).await.unwrap()
        })
    };
    let control = p.control.clone();
    common::wait_until("the first request to take the latency rule", || {
        let control = control.clone();
        async move { control.faults().is_empty() }
    })
    .await;

    let concurrent = p
        .stripe_post_raw(SK, INTENTS, Some("k-7"), body.clone())
        .await
        .unwrap();
    assert_eq!(
        concurrent.error(),
        (409, "invalid_request_error", "idempotency_key_in_use")
    );
    assert_eq!(concurrent.should_retry.as_deref(), Some("true"));
    assert_eq!(
        p.totals(),
        Effects::default(),
        "nothing made while the first runs"
    );

    let first = first.await.unwrap();
    assert_eq!(first.status_of(), "requires_capture");
    let after = p
        .stripe_post_raw(SK, INTENTS, Some("k-7"), body)
        .await
        .unwrap();
    assert_eq!((after.id(), after.replayed), (first.id(), true));
    assert_eq!(p.control.ledger().for_key("k-7"), charges(1));
}

#[tokio::test]
async fn a_rate_limited_request_saves_nothing_and_its_retry_executes_once() {
    let p = provider().await;
    p.control
        .add_fault(FaultRule::new(Operation::Charge, FaultAction::RateLimit).with_next(1));
    let limited = p
        .stripe_post(
            INTENTS,
            Some("k-8"),
            &intent_form("automatic", "o-8:authorize-v1"),
        )
        .await;

    assert_eq!(
        limited.error(),
        (429, "invalid_request_error", "rate_limit")
    );
    assert!(limited.request_id.is_some());
    assert_eq!(p.totals(), Effects::default());
    let retried = p
        .stripe_intent("automatic", "o-8:authorize-v1", Some("k-8"))
        .await;
    assert!(!retried.replayed, "the 429 was not saved: the retry runs");
    let replayed = p
        .stripe_intent("automatic", "o-8:authorize-v1", Some("k-8"))
        .await;
    assert!(replayed.replayed);
    assert_eq!(replayed.id(), retried.id());
    assert_eq!(p.control.ledger().for_key("k-8"), charges(1));
}

#[tokio::test]
async fn a_rate_limit_rule_limits_the_fake_dialect_too() {
    let p = provider().await;
    p.control
        .add_fault(FaultRule::new(Operation::Any, FaultAction::RateLimit).with_next(1));
    let limited = p
        .post(
            "/v1/charges",
            Some("k-9"),
            &common::charge_body("o-9:authorize-v1"),
        )
        .await
        .unwrap();
    assert_eq!(limited.error(), (429, "rate_limit"));
    let retried = p.charge(Some("k-9"), "o-9:authorize-v1").await;
    assert_eq!((retried.status, retried.replayed), (201, false));
    assert_eq!(p.totals(), charges(1));
}

#[tokio::test]
async fn after_retention_the_same_key_and_parameters_charge_again() {
    let p = provider_with(Config {
        retention: Duration::from_secs(24 * 60 * 60),
        ..Config::default()
    })
    .await;
    let first = p
        .stripe_intent("automatic", "o-10:authorize-v1", Some("k-10"))
        .await;
    p.control.advance_clock(Duration::from_secs(23 * 60 * 60));
    let within = p
        .stripe_intent("automatic", "o-10:authorize-v1", Some("k-10"))
        .await;
    assert_eq!((within.id(), within.replayed), (first.id(), true));

    p.control.advance_clock(Duration::from_secs(60 * 60));
    let after = p
        .stripe_intent("automatic", "o-10:authorize-v1", Some("k-10"))
        .await;

    assert!(!after.replayed, "the key was forgotten");
    assert_ne!(after.id(), first.id());
    let ledger = p.control.ledger();
    assert_eq!(ledger.for_key("k-10"), charges(2));
    let doubles = ledger.double_charges(&["cobro_account", "cobro_intent"]);
    assert_eq!(doubles.len(), 1, "one intent charged twice: {doubles:?}");
    let twice: Vec<_> = doubles[0].iter().map(|charge| charge.id.as_str()).collect();
    let expected = [
        ledger.payment_intents[first.id()].as_str(),
        ledger.payment_intents[after.id()].as_str(),
    ];
    assert_eq!(twice, expected);
}

#[tokio::test]
async fn keys_are_per_caller_so_two_merchants_sharing_a_key_make_two_charges() {
    let p = provider().await;
    let pairs = intent_form("automatic", "o-11:authorize-v1");
    let a = p.stripe_post_as(SK, INTENTS, Some("shared"), &pairs).await;
    let b = p
        .stripe_post_as(SK_B, INTENTS, Some("shared"), &pairs)
        .await;

    assert_eq!((a.status, b.status), (200, 200));
    assert!(!b.replayed);
    assert_ne!(a.id(), b.id());
    let ledger = p.control.ledger();
    assert_eq!(ledger.for_key("shared"), charges(2));
    assert!(
        ledger
            .double_charges(&["cobro_account", "cobro_intent"])
            .is_empty()
    );
}

// ---------------------------------------------------------------------------
// Fault actions on Stripe routes

#[tokio::test]
async fn fail_before_effect_is_a_500_api_error_to_retry_and_makes_nothing() {
    let p = provider().await;
    p.control.add_fault(
        FaultRule::new(Operation::Charge, FaultAction::FailBeforeEffect)
            .with_reference("o-12:")
            .with_next(1),
    );
    let failed = p
        .stripe_post(
            INTENTS,
            Some("k-12"),
            &intent_form("automatic", "o-12:authorize-v1"),
        )
        .await;

    assert_eq!(failed.error(), (500, "api_error", ""));
    assert_eq!(failed.should_retry.as_deref(), Some("true"));
    assert_eq!(p.totals(), Effects::default());
    let retried = p
        .stripe_intent("automatic", "o-12:authorize-v1", Some("k-12"))
        .await;
    assert!(!retried.replayed);
    assert_eq!(p.totals(), charges(1));
}

#[tokio::test]
async fn fail_after_effect_captures_and_the_key_replays_the_500_as_stripe_does() {
    let p = provider().await;
    let pi = p.stripe_intent("manual", "o-13:authorize-v1", None).await;
    p.control
        .add_fault(FaultRule::new(Operation::Capture, FaultAction::FailAfterEffect).with_next(1));
    let path = format!("{INTENTS}/{}/capture", pi.id());
    let failed = p.stripe_post(&path, Some("cap-13"), &[]).await;

    assert_eq!(failed.error(), (500, "api_error", ""));
    assert_eq!(
        failed.should_retry, None,
        "a retry with the key gets the same 500"
    );
    assert_eq!(p.totals(), charges(1).captures(1), "the capture was made");
    let retried = p.stripe_post(&path, Some("cap-13"), &[]).await;
    assert_eq!((retried.status, retried.replayed), (500, true));
    assert_eq!(retried.body, failed.body);
    let read = p.stripe_get(&format!("{INTENTS}/{}", pi.id())).await;
    assert_eq!(read.status_of(), "succeeded", "only a read tells");
    assert_eq!(p.totals(), charges(1).captures(1));
}

#[tokio::test]
async fn a_dropped_answer_after_the_charge_is_replayed_to_the_retry() {
    let p = provider().await;
    p.control.add_fault(
        FaultRule::new(Operation::Charge, FaultAction::DropResponseAfterEffect).with_next(1),
    );
    let lost = p
        .stripe_post_raw(
            SK,
            INTENTS,
            Some("k-14"),
            form(&intent_form("automatic", "o-14:authorize-v1")),
        )
        .await;

    let error = lost.expect_err("no HTTP answer at all");
    assert!(error.status().is_none() && !error.is_connect(), "{error:?}");
    assert_eq!(p.totals(), charges(1));
    let retried = p
        .stripe_intent("automatic", "o-14:authorize-v1", Some("k-14"))
        .await;
    assert!(retried.replayed);
    let ledger = p.control.ledger();
    assert_eq!(
        ledger.payment_intents.keys().collect::<Vec<_>>(),
        [retried.id()]
    );
    assert_eq!(ledger.totals, charges(1));
}

#[tokio::test]
async fn a_refund_answered_after_the_client_gave_up_is_made_and_replayed() {
    let p = provider().await;
    let pi = p
        .stripe_intent("automatic", "o-15:authorize-v1", None)
        .await;
    p.control.add_fault(
        FaultRule::new(Operation::Refund, FaultAction::DelayAfterEffect)
            .with_next(1)
            .with_delay(Duration::from_secs(3)),
    );
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let body = form(&[("payment_intent", pi.id()), ("amount", "300")]);
    let timed_out = p
        .stripe_post_with(&impatient, SK, "/v1/refunds", Some("re-15"), body.clone())
        .await
        .expect_err("the client times out");

    assert!(timed_out.is_timeout(), "{timed_out:?}");
    assert_eq!(p.totals(), charges(1).refunds(1));
    let retried = p
        .stripe_post_raw(SK, "/v1/refunds", Some("re-15"), body)
        .await
        .unwrap();
    assert_eq!((retried.status, retried.replayed), (200, true));
    assert_eq!(p.control.ledger().for_key("re-15"), refunds(1));
}

#[tokio::test]
async fn an_in_progress_fault_on_cancel_is_409_key_in_use_and_voids_nothing() {
    let p = provider().await;
    let pi = p.stripe_intent("manual", "o-16:authorize-v1", None).await;
    p.control
        .add_fault(FaultRule::new(Operation::Void, FaultAction::InProgress).with_next(1));
    let path = format!("{INTENTS}/{}/cancel", pi.id());
    let busy = p.stripe_post(&path, Some("cancel-16"), &[]).await;

    assert_eq!(
        busy.error(),
        (409, "invalid_request_error", "idempotency_key_in_use")
    );
    assert_eq!(busy.should_retry.as_deref(), Some("true"));
    assert_eq!(p.totals(), charges(1));
    let retried = p.stripe_post(&path, Some("cancel-16"), &[]).await;
    assert_eq!((retried.status_of(), retried.replayed), ("canceled", false));
    assert_eq!(p.totals(), charges(1).voids(1));
}

#[tokio::test]
async fn latency_delays_a_stripe_read_but_not_its_answer() {
    let p = provider().await;
    let pi = p
        .stripe_intent("automatic", "o-17:authorize-v1", None)
        .await;
    p.control.add_fault(
        FaultRule::new(Operation::Get, FaultAction::Latency)
            .with_next(1)
            .with_delay(Duration::from_millis(200)),
    );
    let started = std::time::Instant::now();
    let read = p.stripe_get(&format!("{INTENTS}/{}", pi.id())).await;
    assert!(started.elapsed() >= Duration::from_millis(200));
    assert_eq!(read.body, pi.body);
    assert_eq!(p.totals(), charges(1));
}

#[tokio::test]
async fn search_lag_hides_a_new_intent_from_search_until_virtual_time_passes() {
    let p = provider().await;
    p.control.add_fault(
        FaultRule::new(Operation::Charge, FaultAction::SearchLag)
            .with_reference("o-18:")
            .with_lag_seconds(60),
    );
    let lagging = p
        .stripe_intent("automatic", "o-18:authorize-v1", None)
        .await;
    let query = "metadata['cobro_intent']:'o-18:authorize-v1'";

    assert!(
        p.stripe_search_as(SK, query).await.is_empty(),
        "not yet searchable"
    );
    let read = p.stripe_get(&format!("{INTENTS}/{}", lagging.id())).await;
    assert_eq!(read.status, 200, "a read by id sees it at once");
    p.control.advance_clock(Duration::from_secs(61));
    assert_eq!(p.stripe_search_as(SK, query).await, [lagging.id()]);
    // Listing refunds is strongly consistent: no lag, even under the rule.
    p.control
        .add_fault(FaultRule::new(Operation::Refund, FaultAction::SearchLag).with_lag_seconds(60));
    let refund = p
        .stripe_post("/v1/refunds", None, &[("payment_intent", lagging.id())])
        .await;
    let list = p
        .stripe_get(&format!("/v1/refunds?payment_intent={}", lagging.id()))
        .await;
    assert_eq!(common::ids(&list.body["data"]), [refund.id()]);
    assert_eq!(p.totals(), charges(1).refunds(1));
}

#[tokio::test]
async fn search_and_list_faults_hit_the_lookups_recovery_uses() {
    let p = provider().await;
    let pi = p
        .stripe_intent("automatic", "o-19:authorize-v1", None)
        .await;
    // The search is `search`, the refund list (strongly consistent) `list`.
    for operation in [Operation::Search, Operation::List] {
        p.control.add_fault(
            FaultRule::new(operation, FaultAction::FailBeforeEffect)
                .with_reference("cobro_intent=o-19:")
                .with_next(1),
        );
    }
    let query = form(&[("query", "metadata['cobro_intent']:'o-19:authorize-v1'")]);
    let search = p.stripe_get(&format!("{INTENTS}/search?{query}")).await;
    let list = p
        .stripe_get(&format!("/v1/refunds?payment_intent={}", pi.id()))
        .await;
    let other = p
        .stripe_get(&format!(
            "{INTENTS}/search?{}",
            form(&[("query", "metadata['cobro_intent']:'o-20:authorize-v1'")])
        ))
        .await;

    assert_eq!(search.error(), (500, "api_error", ""));
    assert_eq!(list.error(), (500, "api_error", ""));
    assert_eq!(other.status, 200, "the rule matches o-19's lookups only");
    assert!(p.control.faults().is_empty());
    assert_eq!(p.totals(), charges(1));
}
