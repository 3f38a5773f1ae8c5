//! The outbox worker against the fake provider (a real HTTP server) on both
//! backends and through both connectors: the fake's own API and the Stripe
//! connector against the fake's Stripe dialect (the same engine). The
//! provider's ledger counts the effects.

use chrono::Duration;
use cobro_test_support::{Backend, Dialect, Rig, on_every_provider, payment_body};
use cobro_worker::Step;
use fake_provider::{FaultAction, FaultRule, Operation as FOp};
use serde_json::{Value, json};

on_every_provider!(
    a_successful_automatic_charge_ends_captured_with_the_provider_ref,
    a_manual_payment_ends_authorized_and_a_capture_goes_through_the_same_path,
    a_decline_is_terminal_and_stored_with_its_code,
    a_provider_5xx_before_the_effect_is_retried_with_the_same_key,
    a_lost_answer_after_the_effect_is_one_charge,
    a_refused_connection_is_not_sent_and_retried,
    the_window_boundary_hands_an_unknown_attempt_to_reconciliation_without_sending,
    a_stale_owners_late_answer_changes_nothing,
    a_cancel_recorded_while_unknown_voids_once_authorized,
    refunds_settle_and_release_what_failed,
    a_long_poll_wakes_when_the_payment_settles_not_on_a_tick,
    an_unreadable_attempt_is_reported_not_sent_and_its_batch_still_charges_once,
);

fn manual(order: &str) -> Value {
    let mut body = payment_body(order);
    body["capture_method"] = json!("manual");
    body
}

async fn a_successful_automatic_charge_ends_captured_with_the_provider_ref(
    backend: Backend,
    dialect: Dialect,
) {
    let rig = Rig::new_in(backend, dialect).await;
    let p = rig.create_payment("k-1", &payment_body("o-1")).await;
    assert_eq!(
        rig.drain(3).await,
        vec![Step::Recorded { class: "succeeded" }]
    );
    let p = rig.payment(p["id"].as_str().expect("id")).await;
    assert_eq!(p["status"], "captured");
    assert_eq!(p["amount_captured"], 1999);
    assert!(
        p["provider_ref"]
            .as_str()
            .expect("provider ref")
            .starts_with(dialect.charge_prefix())
    );
    assert_eq!(p["attempts"][0]["state"], "succeeded");
    assert_eq!(p["attempts"][0]["sends"], 1);
    let ledger = rig.ledger();
    assert_eq!(
        cobro_test_support::for_intent(&ledger, "o-1:authorize-v1").charges,
        1
    );
    assert_eq!(ledger.totals.charges, 1);
}

async fn a_manual_payment_ends_authorized_and_a_capture_goes_through_the_same_path(
    backend: Backend,
    dialect: Dialect,
) {
    let rig = Rig::new_in(backend, dialect).await;
    let p = rig.create_payment("k-1", &manual("o-1")).await;
    let id = p["id"].as_str().expect("id");
    rig.drain(3).await;
    assert_eq!(rig.payment(id).await["status"], "authorized");
    let r = rig
        .app
        .post(&format!("/v1/payments/{id}/capture"), Some("cap-1"))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status().as_u16(), 202);
    assert_eq!(
        rig.drain(3).await,
        vec![Step::Recorded { class: "succeeded" }]
    );
    let p = rig.payment(id).await;
    assert_eq!(p["status"], "captured");
    assert_eq!(p["amount_captured"], 1999);
    let ledger = rig.ledger();
    assert_eq!(ledger.totals.charges, 1);
    assert_eq!(ledger.totals.captures, 1);
}

async fn a_decline_is_terminal_and_stored_with_its_code(backend: Backend, dialect: Dialect) {
    let rig = Rig::new_in(backend, dialect).await;
    let mut body = payment_body("o-1");
    body["payment_method"] = json!("pm_card_declined");
    let p = rig.create_payment("k-1", &body).await;
    assert_eq!(
        rig.drain(3).await,
        vec![Step::Recorded { class: "declined" }]
    );
    let p = rig.payment(p["id"].as_str().expect("id")).await;
    assert_eq!(p["status"], "declined");
    // Stripe's `code` is `card_declined` for every decline; the connector
    // keeps the issuer's reason, its `decline_code`.
    let code = match dialect {
        Dialect::Fake => "card_declined",
        Dialect::Stripe => "generic_decline",
    };
    assert_eq!(p["failure"]["code"], code);
    let ledger = rig.ledger();
    assert_eq!(ledger.totals.charges, 0);
    assert_eq!(ledger.totals.declines, 1);
    // The order is free again: a new key makes authorize-v2.
    let again = rig.create_payment("k-2", &payment_body("o-1")).await;
    assert_eq!(again["intent"], "o-1:authorize-v2");
}

async fn a_provider_5xx_before_the_effect_is_retried_with_the_same_key(
    backend: Backend,
    dialect: Dialect,
) {
    let rig = Rig::new_in(backend, dialect).await;
    rig.provider
        .control()
        .add_fault(FaultRule::new(FOp::Charge, FaultAction::FailBeforeEffect).with_next(2));
    let p = rig.create_payment("k-1", &payment_body("o-1")).await;
    let id = p["id"].as_str().expect("id");
    assert_eq!(
        rig.drain(1).await,
        vec![Step::Rescheduled { class: "unknown" }]
    );
    assert_eq!(rig.payment(id).await["attempts"][0]["state"], "unknown");
    // Nothing is due before the backoff passes.
    assert!(rig.drain(1).await.is_empty());
    for _ in 0..2 {
        rig.app.clock.advance(Duration::seconds(2));
        rig.drain(1).await;
    }
    let p = rig.payment(id).await;
    assert_eq!(p["status"], "captured");
    assert_eq!(
        p["attempts"].as_array().expect("attempts").len(),
        1,
        "one attempt, one key"
    );
    assert_eq!(p["attempts"][0]["sends"], 3);
    assert_eq!(rig.ledger().totals.charges, 1);
}

async fn a_lost_answer_after_the_effect_is_one_charge(backend: Backend, dialect: Dialect) {
    let rig = Rig::with_in(backend, dialect, |client, _| {
        client.request_timeout = std::time::Duration::from_millis(500)
    })
    .await;
    let control = rig.provider.control();
    control.add_fault(
        FaultRule::new(FOp::Charge, FaultAction::DropResponseAfterEffect)
            .with_reference("o-1:")
            .with_next(1),
    );
    control.add_fault(
        FaultRule::new(FOp::Charge, FaultAction::DelayAfterEffect)
            .with_reference("o-2:")
            .with_delay(std::time::Duration::from_millis(3000))
            .with_next(1),
    );
    control.add_fault(
        FaultRule::new(FOp::Charge, FaultAction::FailAfterEffect)
            .with_reference("o-3:")
            .with_next(1),
    );
    let mut ids = Vec::new();
    for order in ["o-1", "o-2", "o-3"] {
        ids.push(
            rig.create_payment(&format!("k-{order}"), &manual(order))
                .await["id"]
                .as_str()
                .expect("id")
                .to_owned(),
        );
    }
    let first = rig.drain(1).await;
    assert_eq!(first.len(), 3);
    assert!(
        first
            .iter()
            .all(|s| *s == Step::Rescheduled { class: "unknown" }),
        "{first:?}"
    );
    rig.app.clock.advance(Duration::seconds(2));
    rig.drain(2).await;
    for (id, order) in ids.iter().zip(["o-1", "o-2", "o-3"]) {
        let p = rig.payment(id).await;
        assert_eq!(p["attempts"][0]["sends"], 2);
        if dialect == Dialect::Stripe && order == "o-3" {
            // Stripe's idempotency layer saves a 500 as the key's answer:
            // the resend replays it, so only a read (the reconciler) can
            // tell that the charge exists, and the replay hands the attempt
            // to it at once. Still one charge.
            assert_eq!(p["status"], "requires_reconciliation", "{order}");
            assert_eq!(p["attempts"][0]["state"], "reconciling", "{order}");
        } else {
            assert_eq!(p["status"], "authorized", "{order}");
            assert!(p["provider_ref"].is_string());
        }
        assert_eq!(
            cobro_test_support::for_intent(&rig.ledger(), &format!("{order}:authorize-v1")).charges,
            1,
            "{order}"
        );
    }
    let ledger = rig.ledger();
    assert_eq!(ledger.totals.charges, 3);
    assert!(ledger.duplicate_charge_references.is_empty());
}

async fn a_refused_connection_is_not_sent_and_retried(backend: Backend, dialect: Dialect) {
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr");
    let rig = Rig::with_in(backend, dialect, |client, _| {
        client.base_url = format!("http://{dead}")
    })
    .await;
    let p = rig.create_payment("k-1", &payment_body("o-1")).await;
    assert_eq!(
        rig.drain(1).await,
        vec![Step::Rescheduled { class: "not_sent" }]
    );
    let p = rig.payment(p["id"].as_str().expect("id")).await;
    assert_eq!(p["status"], "processing");
    assert_eq!(p["attempts"][0]["state"], "pending");
    assert_eq!(rig.ledger().totals.charges, 0);
}

async fn the_window_boundary_hands_an_unknown_attempt_to_reconciliation_without_sending(
    backend: Backend,
    dialect: Dialect,
) {
    let rig = Rig::new_in(backend, dialect).await;
    rig.provider
        .control()
        .add_fault(FaultRule::new(FOp::Charge, FaultAction::FailAfterEffect));
    let p = rig.create_payment("k-1", &payment_body("o-1")).await;
    let id = p["id"].as_str().expect("id");
    assert_eq!(
        rig.drain(1).await,
        vec![Step::Rescheduled { class: "unknown" }]
    );
    // Time passes to within the safety margin of the provider's key window
    // (24 h retention, 1 h margin): sending again could create a new charge.
    rig.app
        .clock
        .advance(Duration::hours(23) + Duration::minutes(1));
    assert_eq!(rig.drain(1).await, vec![Step::HandedOver]);
    let p = rig.payment(id).await;
    assert_eq!(p["status"], "requires_reconciliation");
    assert_eq!(p["attempts"][0]["state"], "reconciling");
    assert_eq!(p["attempts"][0]["sends"], 1, "not sent again");
    rig.app.clock.advance(Duration::hours(2));
    assert!(
        rig.drain(1).await.is_empty(),
        "the worker never touches it again"
    );
    assert_eq!(rig.ledger().totals.charges, 1);
}

async fn a_stale_owners_late_answer_changes_nothing(backend: Backend, dialect: Dialect) {
    // Worker A sends; its answer is held back by the provider. Its lease
    // expires, worker B claims the row with a new token, sends the same key,
    // gets the provider's replay and records it. A's answer then arrives.
    let rig = Rig::with_in(backend, dialect, |client, config| {
        client.request_timeout = std::time::Duration::from_secs(10);
        config.heartbeat = std::time::Duration::from_secs(3600);
    })
    .await;
    rig.provider.control().add_fault(
        FaultRule::new(FOp::Charge, FaultAction::DelayAfterEffect)
            .with_delay(std::time::Duration::from_millis(1500))
            .with_next(1),
    );
    let p = rig.create_payment("k-1", &manual("o-1")).await;
    let id = p["id"].as_str().expect("id").to_owned();
    let worker_a = rig.worker.clone();
    let a = tokio::spawn(async move { worker_a.run_once().await });
    // Wait (on a condition, with a deadline) until A's charge exists.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while rig.ledger().totals.charges == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "A's charge never happened"
        );
        tokio::task::yield_now().await;
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    rig.app.clock.advance(Duration::seconds(31));
    let b = cobro_worker::Worker::new(
        rig.app.db.store.clone(),
        std::sync::Arc::new(rig.connector()),
        std::sync::Arc::new(rig.app.clock.clone()),
        cobro_worker::WorkerConfig {
            owner: "worker-b".into(),
            ..Default::default()
        },
        rig.app.state.work_available.clone(),
    );
    let b = std::sync::Arc::new(b);
    assert_eq!(
        b.run_once().await.expect("b"),
        vec![Step::Recorded { class: "succeeded" }]
    );
    let recorded_by_b = rig.payment(&id).await;
    assert_eq!(recorded_by_b["status"], "authorized");
    assert_eq!(a.await.expect("join").expect("a"), vec![Step::LeaseLost]);
    let after = rig.payment(&id).await;
    assert_eq!(after, recorded_by_b, "nothing overwritten");
    assert_eq!(
        rig.app
            .db
            .count("attempt_observations WHERE lease_token = 1")
            .await,
        1,
        "A's answer kept for the reconciler"
    );
    assert_eq!(rig.ledger().totals.charges, 1);
}

async fn a_cancel_recorded_while_unknown_voids_once_authorized(backend: Backend, dialect: Dialect) {
    let rig = Rig::new_in(backend, dialect).await;
    rig.provider
        .control()
        .add_fault(FaultRule::new(FOp::Charge, FaultAction::FailBeforeEffect).with_next(1));
    let p = rig.create_payment("k-1", &manual("o-1")).await;
    let id = p["id"].as_str().expect("id");
    rig.drain(1).await;
    let r = rig
        .app
        .post(&format!("/v1/payments/{id}/cancel"), Some("c-1"))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status().as_u16(), 202);
    assert_eq!(rig.ledger().totals.voids, 0);
    rig.app.clock.advance(Duration::seconds(2));
    rig.drain(3).await; // the authorisation, then the void it triggers
    let p = rig.payment(id).await;
    assert_eq!(p["status"], "canceled");
    let ledger = rig.ledger();
    assert_eq!(
        (
            ledger.totals.charges,
            ledger.totals.voids,
            ledger.totals.captures
        ),
        (1, 1, 0)
    );
}

async fn refunds_settle_and_release_what_failed(backend: Backend, dialect: Dialect) {
    let rig = Rig::new_in(backend, dialect).await;
    let mut body = payment_body("o-1");
    body["amount"] = json!(1000);
    let p = rig.create_payment("k-1", &body).await;
    let id = p["id"].as_str().expect("id");
    rig.drain(2).await;
    for (key, amount) in [("r-1", 600), ("r-2", 400)] {
        let r = rig
            .app
            .post(&format!("/v1/payments/{id}/refunds"), Some(key))
            .json(&json!({"amount": amount}))
            .send()
            .await
            .expect("send");
        assert_eq!(r.status().as_u16(), 201);
    }
    rig.drain(2).await;
    let p = rig.payment(id).await;
    assert_eq!(p["status"], "refunded");
    assert_eq!(p["amount_refunded"], 1000);
    assert_eq!(rig.ledger().totals.refunds, 2);
}

/// `?wait=` ends when the worker settles the payment, woken by the store,
/// not by re-reading: the fallback re-read is an hour away and the wait 25
/// s, so only the notification can answer before the test's deadline. On
/// PostgreSQL a second payment is settled by a statement on a connection of
/// its own, as a worker in another process would: only LISTEN
/// `cobro_payment_settled` (migration 0009) can wake that poll.
async fn a_long_poll_wakes_when_the_payment_settles_not_on_a_tick(
    backend: Backend,
    dialect: Dialect,
) {
    let mut rig = Rig::new_in(backend, dialect).await;
    let settings = cobro_api::ApiSettings {
        long_poll_fallback: std::time::Duration::from_secs(3600),
        ..cobro_api::ApiSettings::default()
    };
    rig.app.serve_with(settings).await;
    let deadline = std::time::Duration::from_secs(15);
    let store = rig.app.db.store.clone();
    let waiting = |n: usize| {
        let store = store.clone();
        async move {
            tokio::time::timeout(std::time::Duration::from_secs(10), async {
                while store.payment_move_waiters() < n {
                    tokio::task::yield_now().await;
                }
            })
            .await
            .expect("the long poll is waiting");
        }
    };
    let p = rig.create_payment("k-1", &payment_body("o-1")).await;
    let id = p["id"].as_str().expect("id").to_owned();
    let poll = rig.app.get(&format!("/v1/payments/{id}?wait=25")).send();
    let poll = tokio::spawn(poll);
    waiting(1).await;
    assert_eq!(
        rig.drain(3).await,
        vec![Step::Recorded { class: "succeeded" }]
    );
    let answer = tokio::time::timeout(deadline, poll)
        .await
        .expect("woken before the deadline")
        .expect("task")
        .expect("answered");
    let answer: Value = answer.json().await.expect("json");
    assert_eq!(answer["status"], "captured");
    assert_eq!(rig.ledger().totals.charges, 1);

    if backend == Backend::Postgres {
        let q = rig.create_payment("k-2", &payment_body("o-2")).await;
        let id = q["id"].as_str().expect("id").to_owned();
        let poll = tokio::spawn(rig.app.get(&format!("/v1/payments/{id}?wait=25")).send());
        waiting(1).await;
        // Another process settles it: a store of its own (its own pool
        // and its own notifications, sent after its commit).
        let other = cobro_store::Store::connect(&cobro_store::StoreConfig::new(&rig.app.db.url))
            .await
            .expect("a store of its own");
        let mut tx = other.begin().await.expect("begin");
        let moved = tx
            .transition_payment(
                rig.app.account,
                id.parse().expect("payment id"),
                cobro_core::PaymentStatus::Processing,
                cobro_core::PaymentStatus::Failed,
                cobro_core::Clock::now(&rig.app.clock),
            )
            .await
            .expect("settled elsewhere");
        assert!(moved.is_some(), "it was processing");
        tx.commit().await.expect("commit");
        let answer = tokio::time::timeout(deadline, poll)
            .await
            .expect("woken by LISTEN before the deadline")
            .expect("task")
            .expect("answered");
        let answer: Value = answer.json().await.expect("json");
        assert_eq!(answer["status"], "failed");
    }
}

async fn an_unreadable_attempt_is_reported_not_sent_and_its_batch_still_charges_once(
    backend: Backend,
    dialect: Dialect,
) {
    let rig = Rig::new_in(backend, dialect).await;
    for order in ["o-1", "o-2", "o-3"] {
        rig.create_payment(&format!("k-{order}"), &payment_body(order))
            .await;
    }
    // A state cobro never writes: the row cannot be read back.
    rig.app
        .db
        .corrupt_attempts_of("o-2", "state", "limbo")
        .await;
    let mut steps = rig.drain(3).await;
    steps.sort_by_key(|s| format!("{s:?}"));
    assert_eq!(
        steps,
        vec![
            Step::Recorded { class: "succeeded" },
            Step::Recorded { class: "succeeded" },
            Step::Unreadable,
        ]
    );
    // Left leased, not sent: it comes back once its lease expires, and is
    // reported again, never sent.
    assert_eq!(
        rig.app
            .db
            .count("outbox WHERE state = 'pending' AND lease_owner IS NOT NULL")
            .await,
        1
    );
    rig.app.clock.advance(Duration::seconds(31));
    assert_eq!(rig.drain(3).await, vec![Step::Unreadable]);
    let ledger = rig.ledger();
    for (order, charges) in [("o-1", 1), ("o-2", 0), ("o-3", 1)] {
        assert_eq!(
            cobro_test_support::for_intent(&ledger, &format!("{order}:authorize-v1")).charges,
            charges,
            "{order}"
        );
    }
    assert_eq!(ledger.totals.charges, 2);
}
