//! Events to merchants (issue #18), on both backends: every status change
//! writes its event in its own transaction (and a rolled-back one writes
//! none), sequences increase per payment, the feed has no gaps from any
//! cursor under concurrent writers, and the dispatcher delivers every event
//! at least once to a real, misbehaving HTTP endpoint, whose state (applied
//! by sequence, deduplicated by id with `cobro-client`) ends equal to
//! cobro's and the provider's.

use chrono::Duration;
use cobro_core::{AccountId, DeliveryState, PaymentId, PaymentStatus};
use cobro_store::Store;
use cobro_store::events::{EventFilter, EventRow};
use cobro_test_support::{
    Backend, Rig, TestDb, manual_payment_body, new_payment, on_both_backends, payment_body, t0,
};
use fake_provider::{FaultAction, FaultRule, Operation as FOp};
use serde_json::{Value, json};
use std::collections::{BTreeMap, HashMap};

on_both_backends!(
    every_status_change_has_its_event_and_the_last_event_is_the_final_state,
    a_rolled_back_change_and_a_lost_compare_and_set_write_no_event,
    the_feed_has_no_gaps_from_any_cursor_under_concurrent_writers,
    every_event_reaches_a_misbehaving_endpoint_and_its_state_ends_equal_to_cobros,
    a_delivery_failing_for_the_whole_period_is_dead_and_the_endpoint_disabled_until_replayed,
    the_feed_filters_by_type_and_object_and_never_shows_another_accounts_events,
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
        .events_of_payment_any_account(id)
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
        let shown: Value = get_json(
            rig,
            &format!("/v1/payments/{payment_id}/refunds/{refund_id}"),
        )
        .await;
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
    rig.reconcile_past_the_search_lag().await;

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

/// A new payment (order `o-1`) inserted and committed, with its first event.
async fn committed_payment(store: &Store, account: AccountId) -> cobro_store::NewPayment {
    let p = new_payment(account, "o-1");
    let mut tx = store.begin().await.expect("begin");
    tx.insert_payment(&p, t0())
        .await
        .expect("insert")
        .expect("row");
    tx.commit().await.expect("commit");
    p
}

/// The account's whole feed as the store reads it (up to 1 000 events).
async fn store_feed(store: &Store, account: AccountId) -> Vec<EventRow> {
    store
        .events_for_account(
            account,
            &EventFilter {
                limit: 1000,
                ..Default::default()
            },
        )
        .await
        .expect("feed")
}

async fn event_count(store: &Store, payment: PaymentId) -> usize {
    store
        .events_of_payment_any_account(payment)
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
    let p = committed_payment(store, account).await;
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
    let feed = store_feed(store, account).await;
    assert_eq!(feed.len(), 1);
    assert_eq!(feed[0].payment_id, p.id);
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
        // SQLite's writers queue for its one writer connection (bounded by
        // the lock timeout above); the reader's pool stays generous.
        c.acquire_timeout = std::time::Duration::from_secs(30);
    })
    .await;
    let store = db.store.clone();
    let account = store.create_account("acme", t0()).await.expect("account");
    // More writers than SQLite's pool would only queue for a connection.
    let writers_n = if backend == Backend::Postgres { 6 } else { 3 };
    const EACH: usize = 15;
    let mut writers = Vec::new();
    for w in 0..writers_n {
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
            let mut seen: Vec<(i64, cobro_core::EventId)> = Vec::new();
            let mut after = 0;
            let total = writers_n * EACH * 2;
            let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(60);
            while seen.len() < total {
                assert!(tokio::time::Instant::now() < deadline, "reader timed out");
                store.sequence_events(t0()).await.expect("sequence");
                let page = store
                    .events_for_account(
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
                    seen.push((position, e.id));
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
    let all = store_feed(&store, account).await;
    assert_eq!(all.len(), writers_n * EACH * 2);
    let all: Vec<(i64, cobro_core::EventId)> = all
        .iter()
        .map(|e| (e.feed_position.expect("pos"), e.id))
        .collect();
    assert_eq!(seen, all, "the reader saw exactly the feed, in order");
    // Per payment, the feed keeps the sequence order.
    let mut last: BTreeMap<PaymentId, i64> = BTreeMap::new();
    for e in store_feed(&store, account).await {
        let before = last.insert(e.payment_id, e.sequence).unwrap_or(0);
        assert!(e.sequence > before, "sequence order kept in the feed");
    }
}

use crate::merchant;

use merchant::{Answer, Merchant};

/// Registers an endpoint through the API; returns its id and secret.
pub(crate) async fn register(rig: &Rig, url: &str) -> (String, String) {
    let r = rig
        .app
        .post("/v1/event_endpoints", None)
        .json(&json!({"url": url}))
        .send()
        .await
        .expect("create endpoint");
    assert_eq!(r.status().as_u16(), 201);
    let body: Value = r.json().await.expect("json");
    (
        body["id"].as_str().expect("id").to_owned(),
        body["secret"].as_str().expect("secret").to_owned(),
    )
}

/// Rotates an endpoint's secret through the API; returns the new one.
pub(crate) async fn rotate_secret(rig: &Rig, endpoint: &str) -> String {
    let rotated: Value = rig
        .app
        .post(
            &format!("/v1/event_endpoints/{endpoint}/rotate_secret"),
            None,
        )
        .send()
        .await
        .expect("rotate")
        .json()
        .await
        .expect("json");
    rotated["secret"].as_str().expect("secret").to_owned()
}

pub(crate) fn dispatcher(
    rig: &Rig,
    name: &str,
    tweak: impl FnOnce(&mut cobro_worker::DispatcherConfig),
) -> cobro_worker::Dispatcher {
    let mut config = cobro_worker::DispatcherConfig {
        owner: name.to_owned(),
        request_timeout: std::time::Duration::from_millis(400),
        backoff_base: std::time::Duration::from_secs(1),
        backoff_cap: std::time::Duration::from_secs(60),
        egress: cobro_test_support::local_endpoints(),
        ..Default::default()
    };
    tweak(&mut config);
    cobro_worker::Dispatcher::new(
        rig.app.db.store.clone(),
        std::sync::Arc::new(rig.app.clock.clone()),
        config,
    )
    .expect("dispatcher")
}

/// How many deliveries are in each state.
pub(crate) async fn deliveries(rig: &Rig) -> HashMap<DeliveryState, i64> {
    rig.app
        .db
        .store
        .delivery_counts()
        .await
        .expect("counts")
        .into_iter()
        .collect()
}

/// Rounds of every dispatcher at once, cobro's clock moving `step` after
/// each, until no delivery is pending (bounded in real time).
/// One dispatcher round. `Busy` (on SQLite, the one write lock held past
/// its timeout by a concurrent round on a loaded machine) is a round that
/// wrote nothing, which the dispatcher's own loop simply runs again.
pub(crate) async fn round(dispatcher: &cobro_worker::Dispatcher) {
    match dispatcher.run_once().await {
        Ok(_) | Err(cobro_store::StoreError::Busy) => {}
        Err(e) => panic!("round: {e:?}"),
    }
}

pub(crate) async fn dispatch_until_settled(
    rig: &Rig,
    dispatchers: &[cobro_worker::Dispatcher],
    step: Duration,
) {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(90);
    loop {
        futures::future::join_all(dispatchers.iter().map(round)).await;
        rig.app
            .db
            .store
            .sequence_events(rig.app.clock.now())
            .await
            .expect("sequence");
        if deliveries(rig)
            .await
            .get(&DeliveryState::Pending)
            .copied()
            .unwrap_or(0)
            == 0
        {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "deliveries never settled"
        );
        rig.app.clock.advance(step);
    }
}

/// `GET path` with the rig's token, as JSON.
pub(crate) async fn get_json(rig: &Rig, path: &str) -> Value {
    let r = rig.app.get(path).send().await.expect("get");
    r.json().await.expect("json")
}

/// Every event of the account, paging the feed from position 0.
async fn whole_feed(rig: &Rig, after: i64) -> Vec<Value> {
    let mut all = Vec::new();
    let mut after = after;
    loop {
        let page: Value = get_json(rig, &format!("/v1/events?after={after}&limit=7")).await;
        let data = page["data"].as_array().expect("data").clone();
        after = page["next_after"].as_i64().expect("next_after");
        let more = page["has_more"].as_bool().expect("has_more");
        all.extend(data);
        if !more {
            return all;
        }
    }
}

use cobro_core::Clock;

/// The "done when": a merchant endpoint that answers 500, hangs
/// past the timeout, closes the connection, answers slowly twice, and is
/// down for ten (simulated) minutes while payments move, served by two
/// dispatchers at once, with provider faults (a lost answer retried, an
/// unknown outcome settled by the reconciler a day later), ends with exactly cobro's state for every payment
/// and refund (applied by sequence, deduplicated by id), which is also the
/// provider's; every event reached it at least once, copies of one event
/// are byte-identical, and the feed from any cursor has every later event.
async fn every_event_reaches_a_misbehaving_endpoint_and_its_state_ends_equal_to_cobros(
    backend: Backend,
) {
    let rig = Rig::new(backend).await;
    let merchant = Merchant::start(
        std::sync::Arc::new(rig.app.clock.clone()),
        std::time::Duration::from_millis(800),
    )
    .await;
    let (_, secret) = register(&rig, &merchant.url).await;
    merchant.secrets.lock().expect("lock").push(secret);
    merchant.script(&[
        Answer::Fail500,
        Answer::Hang,
        Answer::Close,
        Answer::Slow,
        Answer::Slow,
    ]);
    let dispatchers = [
        dispatcher(&rig, "d-1", |_| {}),
        dispatcher(&rig, "d-2", |_| {}),
    ];

    let mut declined = payment_body("o-2");
    declined["payment_method"] = json!("pm_card_declined");
    let auto = rig.create_payment("k-1", &payment_body("o-1")).await;
    rig.create_payment("k-2", &declined).await;
    let manual = rig.create_payment("k-3", &manual_payment_body("o-3")).await;
    // Provider faults too: o-1's answer is lost once (the worker retries
    // under the same key), o-5's outcome stays unknown until the
    // reconciler adopts the charge, a day later.
    let control = rig.provider.control();
    control.add_fault(
        FaultRule::new(FOp::Charge, FaultAction::DropResponseAfterEffect)
            .with_reference("o-1:")
            .with_next(1),
    );
    control.add_fault(
        FaultRule::new(FOp::Charge, FaultAction::FailAfterEffect).with_reference("o-5:"),
    );
    rig.create_payment("k-5", &payment_body("o-5")).await;
    rig.drain(5).await;
    dispatch_until_settled(&rig, &dispatchers, Duration::seconds(30)).await;
    rig.app
        .clock
        .advance(Duration::hours(23) + Duration::minutes(1));
    rig.drain(5).await;
    rig.reconcile_past_the_search_lag().await;
    dispatch_until_settled(&rig, &dispatchers, Duration::seconds(30)).await;

    // Down for ten minutes while payments move.
    merchant.go_down();
    let (auto, manual) = (
        auto["id"].as_str().expect("id").to_owned(),
        manual["id"].as_str().expect("id").to_owned(),
    );
    rig.post_ok(
        &format!("/v1/payments/{manual}/capture"),
        "cap-1",
        json!({}),
    )
    .await;
    rig.drain(5).await;
    rig.post_ok(
        &format!("/v1/payments/{manual}/refunds"),
        "r-1",
        json!({"amount": 500}),
    )
    .await;
    rig.post_ok(
        &format!("/v1/payments/{auto}/refunds"),
        "r-2",
        json!({"amount": 1999}),
    )
    .await;
    rig.create_payment("k-4", &payment_body("o-4")).await;
    rig.drain(5).await;
    let received_before = merchant.received.lock().expect("lock").len();
    for _ in 0..10 {
        for d in &dispatchers {
            round(d).await;
        }
        rig.app.clock.advance(Duration::minutes(1));
    }
    assert_eq!(
        merchant.received.lock().expect("lock").len(),
        received_before,
        "nothing reaches an endpoint that is down"
    );
    assert!(
        deliveries(&rig)
            .await
            .get(&DeliveryState::Pending)
            .copied()
            .unwrap_or(0)
            > 0
    );
    merchant.come_back().await;
    dispatch_until_settled(&rig, &dispatchers, Duration::minutes(1)).await;
    assert_eq!(
        deliveries(&rig).await.get(&DeliveryState::Dead),
        None,
        "nothing died"
    );

    // At least once, and nothing that is not an event of cobro's.
    let feed = whole_feed(&rig, 0).await;
    let feed_ids: std::collections::BTreeSet<String> = feed
        .iter()
        .map(|e| e["id"].as_str().expect("id").to_owned())
        .collect();
    let mut copies: BTreeMap<String, Vec<Vec<u8>>> = BTreeMap::new();
    for r in merchant.received.lock().expect("lock").iter() {
        copies
            .entry(r.event.id.clone())
            .or_default()
            .push(r.raw.to_vec());
    }
    assert_eq!(
        copies
            .keys()
            .cloned()
            .collect::<std::collections::BTreeSet<_>>(),
        feed_ids,
        "every event reached the endpoint, and only events of cobro's"
    );
    assert!(
        copies.values().any(|c| c.len() > 1),
        "the faults caused redeliveries"
    );
    for (id, c) in &copies {
        // The signature header differs per send; the body is the event.
        assert!(c.windows(2).all(|w| w[0] == w[1]), "copies of {id} differ");
    }
    for (object, sequences) in &merchant.applied().await {
        assert!(
            sequences.windows(2).all(|w| w[0] < w[1]),
            "{object} applied out of order: {sequences:?}"
        );
    }

    // The merchant's state is cobro's, and cobro's is the provider's.
    let state = merchant.state().await;
    let ledger = rig.ledger();
    let payments: Vec<Value> = get_json(&rig, "/v1/payments?limit=100").await["data"]
        .as_array()
        .expect("data")
        .clone();
    assert_eq!(payments.len(), 5);
    for p in &payments {
        let id = p["id"].as_str().expect("id");
        assert_eq!(state.get(id), Some(p), "the merchant's view of {id}");
        if let Some(charge_id) = p["provider_ref"].as_str() {
            let charge = ledger
                .charges
                .iter()
                .find(|c| c.id == charge_id)
                .expect("charge");
            assert_eq!(
                charge.amount_captured,
                p["amount_captured"].as_i64().expect("n")
            );
            assert_eq!(
                charge.amount_refunded,
                p["amount_refunded"].as_i64().expect("n")
            );
        } else {
            assert_eq!(p["status"], "declined");
        }
        for refund in rig
            .app
            .db
            .store
            .refunds_of_payment_any_account(id.parse().expect("id"))
            .await
            .expect("refunds")
        {
            let rid = refund.id.to_string();
            let shown: Value = get_json(&rig, &format!("/v1/payments/{id}/refunds/{rid}")).await;
            assert_eq!(
                state.get(&rid),
                Some(&shown),
                "the merchant's view of refund {rid}"
            );
            assert_eq!(shown["status"], "succeeded");
        }
    }
    assert_eq!(ledger.refunds.len(), 2);

    // From any cursor, every later event and nothing else.
    let n = feed.len() as i64;
    for cursor in 0..=n {
        let later: Vec<i64> = whole_feed(&rig, cursor)
            .await
            .iter()
            .map(|e| e["position"].as_i64().expect("position"))
            .collect();
        assert_eq!(later, ((cursor + 1)..=n).collect::<Vec<_>>());
    }
}

/// A delivery retried for the whole retry period is dead; an endpoint that
/// failed for the whole disable period is disabled with its reason and
/// nothing is claimed for it (the payment's next event, which waited for
/// the first in order, waits for the endpoint now); an operator enables it
/// and replays the dead delivery, and everything arrives. A rotated secret
/// signs alongside the old one: a receiver that knows either accepts.
async fn a_delivery_failing_for_the_whole_period_is_dead_and_the_endpoint_disabled_until_replayed(
    backend: Backend,
) {
    let rig = Rig::new(backend).await;
    let merchant = Merchant::start(
        std::sync::Arc::new(rig.app.clock.clone()),
        std::time::Duration::from_millis(800),
    )
    .await;
    let (endpoint, old_secret) = register(&rig, &merchant.url).await;
    merchant.go_down();
    let d = [dispatcher(&rig, "d-1", |c| {
        c.retry_period = std::time::Duration::from_secs(3600);
        c.disable_after = std::time::Duration::from_secs(3600);
    })];
    let p = rig.create_payment("k-1", &payment_body("o-1")).await;
    rig.drain(5).await;
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(60);
    while !deliveries(&rig).await.contains_key(&DeliveryState::Dead) {
        assert!(tokio::time::Instant::now() < deadline, "never dead");
        round(&d[0]).await;
        rig.app.clock.advance(Duration::minutes(10));
    }
    assert_eq!(
        deliveries(&rig).await,
        HashMap::from([(DeliveryState::Dead, 1), (DeliveryState::Pending, 1)]),
        "created is dead; captured waited for it, then for the endpoint"
    );
    let endpoints: Value = get_json(&rig, "/v1/event_endpoints").await;
    let listed = &endpoints["data"][0];
    assert_eq!(listed["enabled"], false);
    assert!(
        listed["disabled_reason"]
            .as_str()
            .expect("reason")
            .contains("failed"),
        "{listed}"
    );
    assert!(
        listed.get("secret").is_none(),
        "a list never shows the secret"
    );
    // Events written while it is disabled wait for it (never stranded).
    let q = rig.create_payment("k-2", &payment_body("o-2")).await;
    rig.drain(5).await;
    rig.app
        .db
        .store
        .sequence_events(rig.app.clock.now())
        .await
        .expect("sequence");
    assert_eq!(
        deliveries(&rig).await.get(&DeliveryState::Pending),
        Some(&3),
        "o-1's captured, o-2's created and captured wait for the endpoint"
    );

    // Rotated: the old secret still signs for a day.
    let new_secret = rotate_secret(&rig, &endpoint).await;
    assert_ne!(new_secret, old_secret);
    merchant.secrets.lock().expect("lock").push(old_secret);

    merchant.come_back().await;
    let id: cobro_core::EndpointId = endpoint.parse().expect("id");
    assert!(
        rig.app
            .db
            .store
            .enable_endpoint(None, id, rig.app.clock.now())
            .await
            .expect("enable")
    );
    assert_eq!(
        rig.app
            .db
            .store
            .replay_dead_deliveries(None, rig.app.clock.now())
            .await
            .expect("replay"),
        1
    );
    dispatch_until_settled(&rig, &d, Duration::seconds(30)).await;
    assert_eq!(
        deliveries(&rig).await.get(&DeliveryState::Delivered),
        Some(&4),
        "o-1's created replayed, the three that waited"
    );
    for payment in [&p, &q] {
        let id = payment["id"].as_str().expect("id");
        assert_eq!(
            merchant.state().await.get(id),
            Some(&without_attempts(rig.payment(id).await))
        );
    }

    // A receiver that knows only the new secret accepts a resend too.
    *merchant.secrets.lock().expect("lock") = vec![new_secret];
    let event = whole_feed(&rig, 0).await[0]["id"]
        .as_str()
        .expect("id")
        .to_owned();
    let resent = rig
        .app
        .db
        .store
        .resend_event(None, event.parse().expect("id"), rig.app.clock.now())
        .await
        .expect("resend");
    assert_eq!(resent, Some(1));
    let before = merchant.received.lock().expect("lock").len();
    dispatch_until_settled(&rig, &d, Duration::seconds(30)).await;
    let received = merchant.received.lock().expect("lock");
    assert_eq!(received.len(), before + 1);
    assert_eq!(received[before].event.id, event);
    assert_eq!(
        received[before].decision,
        Some(cobro_client::webhook::Decision::Duplicate)
    );
}

/// `GET /v1/events` filters by type and by object (a payment's filter also
/// yields its refunds' events), `GET /v1/events/{id}` answers one, and
/// another account sees none of them (404, empty feed), even with the
/// same order refs.
async fn the_feed_filters_by_type_and_object_and_never_shows_another_accounts_events(
    backend: Backend,
) {
    let rig = Rig::new(backend).await;
    let a = rig.create_payment("k-1", &payment_body("o-1")).await;
    rig.create_payment("k-2", &payment_body("o-2")).await;
    rig.drain(5).await;
    let a = a["id"].as_str().expect("id");
    rig.post_ok(
        &format!("/v1/payments/{a}/refunds"),
        "r-1",
        json!({"amount": 100}),
    )
    .await;

    let get = |path: String| {
        let rig = &rig;
        async move {
            let r = rig.app.get(&path).send().await.expect("get");
            (
                r.status().as_u16(),
                r.json::<Value>().await.unwrap_or(Value::Null),
            )
        }
    };
    let (_, captured) = get("/v1/events?type=payment.captured".into()).await;
    assert_eq!(captured["data"].as_array().expect("data").len(), 2);
    let (_, of_a) = get(format!("/v1/events?object={a}")).await;
    let types: Vec<&str> = of_a["data"]
        .as_array()
        .expect("data")
        .iter()
        .map(|e| e["type"].as_str().expect("type"))
        .collect();
    assert_eq!(
        types,
        ["payment.created", "payment.captured", "refund.created"]
    );
    let first = of_a["data"][0].clone();
    let (status, one) = get(format!("/v1/events/{}", first["id"].as_str().expect("id"))).await;
    assert_eq!(status, 200);
    assert_eq!(one, first);
    let (status, bad) = get("/v1/events?type=payment.nope&limit=0".into()).await;
    assert_eq!(status, 400);
    assert_eq!(bad["code"], "validation-error");

    // Another account with the same order ref sees nothing of these.
    let (_, other_token) = rig.app.new_account("other").await;
    let r = rig
        .app
        .client
        .get(format!(
            "{}/v1/events/{}",
            rig.app.url,
            first["id"].as_str().expect("id")
        ))
        .bearer_auth(&other_token)
        .send()
        .await
        .expect("get");
    assert_eq!(r.status().as_u16(), 404);
    let feed: Value = rig
        .app
        .client
        .get(format!("{}/v1/events", rig.app.url))
        .bearer_auth(&other_token)
        .send()
        .await
        .expect("get")
        .json()
        .await
        .expect("json");
    assert_eq!(feed["data"], json!([]));
}

/// The merchant deletes an endpoint while cobro makes deliveries for it
/// (sequencing, which every `GET /v1/events` runs; a resend; a resend of
/// an event the endpoint already has a delivery of). The delete, the one
/// statement `Store::delete_endpoint` runs (its deliveries go by the
/// foreign key's cascade), is held open here until the delivery maker
/// waits for it; then it commits. The delivery maker must neither fail (a
/// foreign key violation was a 500 under the fuzzer's concurrent runs) nor
/// leave a delivery to the deleted endpoint, and the event is still
/// sequenced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_an_endpoint_deleted_while_its_deliveries_are_made_fails_nothing() {
    use sqlx::Connection;
    let db = TestDb::new(Backend::Postgres).await;
    let store = db.store.clone();
    let account = store.create_account("acme", t0()).await.expect("account");
    let mut deleter = sqlx::PgConnection::connect(&db.url).await.expect("connect");
    let p = committed_payment(&store, account).await;
    let event = store
        .events_of_payment_any_account(p.id)
        .await
        .expect("events")[0]
        .id;

    // Sequencing first, then resends of the sequenced event.
    for round in ["sequence", "resend", "resend over a delivery"] {
        let endpoint = store
            .create_endpoint(account, "https://shop.example/hooks", "whsec_x", &[], t0())
            .await
            .expect("endpoint");
        if round == "resend over a delivery" {
            store
                .resend_event(Some(account), event, t0())
                .await
                .expect("resend");
            assert_eq!(
                store
                    .deliveries_of_event_any_account(event)
                    .await
                    .expect("deliveries")
                    .len(),
                1
            );
        }
        let mut delete = deleter.begin().await.expect("begin");
        sqlx::query("DELETE FROM event_endpoints WHERE id = $1")
            .bind(endpoint.id.as_uuid())
            .execute(&mut *delete)
            .await
            .expect("delete");
        let maker = {
            let store = store.clone();
            tokio::spawn(async move {
                match round {
                    "sequence" => store.sequence_events(t0()).await.map(|n| n as i64),
                    _ => store
                        .resend_event(Some(account), event, t0())
                        .await
                        .map(|n| n.expect("the event exists") as i64),
                }
            })
        };
        cobro_test_support::wait_for(
            "the delivery maker waits for the delete",
            std::time::Duration::from_secs(10),
            async || {
                let waiting = db
                    .count(
                        "pg_stat_activity WHERE datname = current_database() \
                         AND wait_event_type = 'Lock'",
                    )
                    .await;
                (waiting > 0).then_some(())
            },
        )
        .await;
        delete.commit().await.expect("the delete commits");
        let made = maker.await.expect("task");
        assert!(
            made.is_ok(),
            "{round}: a concurrently deleted endpoint failed it: {made:?}"
        );
        let deliveries = store
            .deliveries_of_event_any_account(event)
            .await
            .expect("deliveries");
        assert!(
            deliveries.is_empty(),
            "{round}: a delivery to the deleted endpoint: {deliveries:?}"
        );
    }
    let feed = store_feed(&store, account).await;
    assert_eq!(feed.len(), 1, "the event is in the feed");
}
