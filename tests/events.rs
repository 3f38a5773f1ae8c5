//! Events to merchants (issue #18), on both backends: every status change
//! writes its event in its own transaction (and a rolled-back one writes
//! none), sequences increase per payment, the feed has no gaps from any
//! cursor under concurrent writers, and the dispatcher delivers every event
//! at least once to a real, misbehaving HTTP endpoint, whose state (applied
//! by sequence, deduplicated by id with `cobro-client`) ends equal to
//! cobro's and the provider's.

use chrono::Duration;
use cobro_core::{PaymentId, PaymentStatus};
use cobro_reconciler::Scope;
use cobro_store::Store;
use cobro_store::events::EventFilter;
use cobro_test_support::{
    Backend, Rig, TestDb, manual_payment_body, new_payment, on_both_backends, payment_body, t0,
};
use fake_provider::{FaultAction, FaultRule, Operation as FOp};
use serde_json::{Value, json};
use std::collections::BTreeMap;

on_both_backends!(
    every_status_change_has_its_event_and_the_last_event_is_the_final_state,
    a_rolled_back_change_and_a_lost_compare_and_set_write_no_event,
    the_feed_has_no_gaps_from_any_cursor_under_concurrent_writers,
);

/// The payment as `GET /v1/payments/{id}` shows it, without `attempts`
/// (events carry the representation of list answers).
fn without_attempts(mut payment: Value) -> Value {
    if let Some(map) = payment.as_object_mut() {
        map.remove("attempts");
    }
    payment
}

/// Checks every event of `payment_id`: sequences 1..n with no hole, a
/// payment event whenever its status changed, and the last payment event
/// (and each refund's last event) equal to what the API shows now.
async fn assert_events_match(rig: &Rig, payment_id: &str) -> Vec<String> {
    let id: PaymentId = payment_id.parse().expect("id");
    let events = rig
        .app
        .db
        .store
        .events_of_payment(id)
        .await
        .expect("events");
    let sequences: Vec<i64> = events.iter().map(|e| e.sequence).collect();
    let expected: Vec<i64> = (1..=events.len() as i64).collect();
    assert_eq!(sequences, expected, "sequences of {payment_id}");
    let payment = without_attempts(rig.payment(payment_id).await);
    let last_payment = events
        .iter()
        .rev()
        .find(|e| e.object_type == "payment")
        .expect("a payment event");
    let data: Value = serde_json::from_str(&last_payment.data).expect("json");
    assert_eq!(data, payment, "last payment event of {payment_id}");
    let mut last_refund: BTreeMap<String, Value> = BTreeMap::new();
    for e in events.iter().filter(|e| e.object_type == "refund") {
        last_refund.insert(
            e.object_id.0.to_string(),
            serde_json::from_str(&e.data).expect("json"),
        );
    }
    for (refund_id, data) in last_refund {
        let shown: Value = rig
            .app
            .get(&format!("/v1/payments/{payment_id}/refunds/{refund_id}"))
            .send()
            .await
            .expect("get refund")
            .json()
            .await
            .expect("json");
        assert_eq!(data, shown, "last event of refund {refund_id}");
    }
    // Consecutive payment events are status changes (or conflicts).
    let mut previous: Option<String> = None;
    for e in events.iter().filter(|e| e.object_type == "payment") {
        let data: Value = serde_json::from_str(&e.data).expect("json");
        let status = data["status"].as_str().expect("status").to_owned();
        if e.event_type != "payment.conflict_found" {
            if let Some(before) = &previous {
                assert_ne!(
                    before, &status,
                    "{}: an event without a change",
                    e.event_type
                );
            }
            if e.event_type != "payment.created" {
                assert_eq!(e.event_type, format!("payment.{status}"));
            }
        }
        previous = Some(status);
    }
    events.iter().map(|e| e.event_type.clone()).collect()
}

/// Every way a payment changes status here (the API, the worker's answers,
/// the reconciler's decision after a lost answer) leaves an event stream
/// whose last element is the state the API shows, with no missing
/// sequence; a path that changed a status without an event would fail the
/// comparison or the consecutive-change check.
async fn every_status_change_has_its_event_and_the_last_event_is_the_final_state(backend: Backend) {
    let rig = Rig::new(backend).await;
    let control = rig.provider.control();
    // A lost answer: the worker hands the payment to the reconciler.
    control.add_fault(
        FaultRule::new(FOp::Charge, FaultAction::FailAfterEffect).with_reference("o-6:"),
    );
    let auto = rig.create_payment("k-1", &payment_body("o-1")).await;
    let mut declined_body = payment_body("o-2");
    declined_body["payment_method"] = json!("pm_card_declined");
    let declined = rig.create_payment("k-2", &declined_body).await;
    let manual = rig.create_payment("k-3", &manual_payment_body("o-3")).await;
    let canceled = rig.create_payment("k-4", &manual_payment_body("o-4")).await;
    let lost = rig.create_payment("k-6", &payment_body("o-6")).await;
    rig.drain(5).await;
    let id = |p: &Value| p["id"].as_str().expect("id").to_owned();
    let (auto, declined, manual, canceled, lost) = (
        id(&auto),
        id(&declined),
        id(&manual),
        id(&canceled),
        id(&lost),
    );
    let ok = |s: u16| assert!((200..300).contains(&s), "status {s}");
    let r = rig
        .app
        .post(&format!("/v1/payments/{manual}/capture"), Some("cap-1"))
        .send()
        .await
        .expect("capture");
    ok(r.status().as_u16());
    let r = rig
        .app
        .post(&format!("/v1/payments/{canceled}/cancel"), Some("can-1"))
        .send()
        .await
        .expect("cancel");
    ok(r.status().as_u16());
    rig.drain(5).await;
    for (key, amount) in [("r-1", 500), ("r-2", 1499)] {
        let r = rig
            .app
            .post(&format!("/v1/payments/{manual}/refunds"), Some(key))
            .json(&json!({"amount": amount}))
            .send()
            .await
            .expect("refund");
        ok(r.status().as_u16());
        rig.drain(5).await;
    }
    // The lost answer: past the key window, then the reconciler adopts it.
    rig.app
        .clock
        .advance(Duration::hours(23) + Duration::minutes(1));
    rig.drain(3).await;
    assert_eq!(
        rig.payment(&lost).await["status"],
        "requires_reconciliation"
    );
    rig.app.clock.advance(Duration::minutes(10));
    control.advance_clock(std::time::Duration::from_secs(600));
    rig.reconciler(|_| {})
        .run(&Scope::default(), false, "test", &|_, _| {})
        .await
        .expect("reconcile");

    assert_eq!(
        assert_events_match(&rig, &auto).await,
        ["payment.created", "payment.captured"]
    );
    assert_eq!(
        assert_events_match(&rig, &declined).await,
        ["payment.created", "payment.declined"]
    );
    assert_eq!(
        assert_events_match(&rig, &manual).await,
        [
            "payment.created",
            "payment.authorized",
            "payment.capturing",
            "payment.captured",
            "refund.created",
            "refund.succeeded",
            "payment.partially_refunded",
            "refund.created",
            "refund.succeeded",
            "payment.refunded",
        ]
    );
    assert_eq!(
        assert_events_match(&rig, &canceled).await,
        [
            "payment.created",
            "payment.authorized",
            "payment.canceling",
            "payment.canceled"
        ]
    );
    assert_eq!(
        assert_events_match(&rig, &lost).await,
        [
            "payment.created",
            "payment.requires_reconciliation",
            "payment.captured"
        ]
    );
    // The judge: the provider's ledger holds exactly what the events say.
    let ledger = rig.ledger();
    for (payment, status) in [
        (&auto, "captured"),
        (&manual, "refunded"),
        (&lost, "captured"),
    ] {
        let p = rig.payment(payment).await;
        assert_eq!(p["status"], status);
        let charge = ledger
            .charges
            .iter()
            .find(|c| Some(c.id.as_str()) == p["provider_ref"].as_str())
            .expect("its charge");
        assert_eq!(
            charge.amount_captured,
            p["amount_captured"].as_i64().expect("n")
        );
        assert_eq!(
            charge.amount_refunded,
            p["amount_refunded"].as_i64().expect("n")
        );
    }
}

async fn event_count(store: &Store, payment: PaymentId) -> usize {
    store
        .events_of_payment(payment)
        .await
        .expect("events")
        .len()
}

/// No event without its change: a transaction that changed a status and
/// rolled back leaves no event, and a compare-and-set that loses (zero
/// rows) writes none either.
async fn a_rolled_back_change_and_a_lost_compare_and_set_write_no_event(backend: Backend) {
    let db = TestDb::new(backend).await;
    let store = &db.store;
    let account = store.create_account("acme", t0()).await.expect("account");
    let p = new_payment(account, "o-1");
    let mut tx = store.begin().await.expect("begin");
    tx.insert_payment(&p, t0())
        .await
        .expect("insert")
        .expect("row");
    tx.commit().await.expect("commit");
    assert_eq!(event_count(store, p.id).await, 1);

    let mut tx = store.begin().await.expect("begin");
    let moved = tx
        .transition_payment(
            account,
            p.id,
            PaymentStatus::Processing,
            PaymentStatus::Failed,
            t0(),
        )
        .await
        .expect("transition");
    assert!(moved.is_some());
    tx.rollback().await.expect("rollback");
    assert_eq!(
        event_count(store, p.id).await,
        1,
        "the rolled-back change has no event"
    );

    // A rolled-back creation leaves nothing at all.
    let q = new_payment(account, "o-2");
    let mut tx = store.begin().await.expect("begin");
    tx.insert_payment(&q, t0())
        .await
        .expect("insert")
        .expect("row");
    drop(tx);
    assert_eq!(event_count(store, q.id).await, 0);

    // The compare-and-set that loses writes nothing.
    let mut tx = store.begin().await.expect("begin");
    let lost = tx
        .transition_payment(
            account,
            p.id,
            PaymentStatus::Authorized,
            PaymentStatus::Captured,
            t0(),
        )
        .await
        .expect("transition");
    assert!(lost.is_none());
    tx.commit().await.expect("commit");
    assert_eq!(event_count(store, p.id).await, 1);

    // And the feed shows only the committed one.
    store.sequence_events(t0()).await.expect("sequence");
    let feed = store
        .list_events(
            account,
            &EventFilter {
                limit: 100,
                ..Default::default()
            },
        )
        .await
        .expect("feed");
    assert_eq!(feed.len(), 1);
    assert_eq!(feed[0].payment_id.0, p.id.as_uuid());
}

/// Writers commit in an order unrelated to the order they wrote in (each
/// holds its transaction open a random while after writing its event),
/// and a reader pages through the feed meanwhile, each page from the last
/// position it saw. It must see every event exactly once, and positions
/// 1, 2, 3... with no hole: an event that committed late never appears
/// below a position the reader already passed.
async fn the_feed_has_no_gaps_from_any_cursor_under_concurrent_writers(backend: Backend) {
    let db = TestDb::with_config(backend, |c| {
        c.max_connections = 12;
        c.lock_timeout = std::time::Duration::from_secs(10);
    })
    .await;
    let store = db.store.clone();
    let account = store.create_account("acme", t0()).await.expect("account");
    const WRITERS: usize = 6;
    const EACH: usize = 15;
    let mut writers = Vec::new();
    for w in 0..WRITERS {
        let store = store.clone();
        writers.push(tokio::spawn(async move {
            for i in 0..EACH {
                let p = new_payment(account, &format!("o-{w}-{i}"));
                let mut tx = store.begin().await.expect("begin");
                tx.insert_payment(&p, t0())
                    .await
                    .expect("insert")
                    .expect("row");
                tx.transition_payment(
                    account,
                    p.id,
                    PaymentStatus::Processing,
                    PaymentStatus::Captured,
                    t0(),
                )
                .await
                .expect("transition")
                .expect("moved");
                let hold = rand::random::<u64>() % 15;
                tokio::time::sleep(std::time::Duration::from_millis(hold)).await;
                tx.commit().await.expect("commit");
            }
        }));
    }
    let reader = {
        let store = store.clone();
        tokio::spawn(async move {
            let mut seen: Vec<(i64, uuid::Uuid)> = Vec::new();
            let mut after = 0;
            let total = WRITERS * EACH * 2;
            let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(60);
            while seen.len() < total {
                assert!(tokio::time::Instant::now() < deadline, "reader timed out");
                store.sequence_events(t0()).await.expect("sequence");
                let page = store
                    .list_events(
                        account,
                        &EventFilter {
                            after,
                            limit: 7,
                            ..Default::default()
                        },
                    )
                    .await
                    .expect("page");
                for e in &page {
                    let position = e.feed_position.expect("sequenced");
                    assert_eq!(position, after + 1, "a gap after position {after}");
                    after = position;
                    seen.push((position, e.id.0));
                }
                if page.is_empty() {
                    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                }
            }
            seen
        })
    };
    for w in writers {
        w.await.expect("writer");
    }
    let seen = reader.await.expect("reader");
    let all = store
        .list_events(
            account,
            &EventFilter {
                limit: 1000,
                ..Default::default()
            },
        )
        .await
        .expect("all");
    assert_eq!(all.len(), WRITERS * EACH * 2);
    let all: Vec<(i64, uuid::Uuid)> = all
        .iter()
        .map(|e| (e.feed_position.expect("pos"), e.id.0))
        .collect();
    assert_eq!(seen, all, "the reader saw exactly the feed, in order");
    // Per payment, the feed keeps the sequence order.
    let mut last: BTreeMap<uuid::Uuid, i64> = BTreeMap::new();
    for e in store
        .list_events(
            account,
            &EventFilter {
                limit: 1000,
                ..Default::default()
            },
        )
        .await
        .expect("all")
    {
        let before = last.insert(e.payment_id.0, e.sequence).unwrap_or(0);
        assert!(e.sequence > before, "sequence order kept in the feed");
    }
}
