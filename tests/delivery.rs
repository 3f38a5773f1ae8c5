//! Pushed events in each payment's order, with every endpoint isolated
//! from the others (issue #48, items 5 and 7), on both backends: a
//! payment's next event waits until the previous one is delivered or dead
//! while other payments' events flow; `410 Gone` disables an endpoint with
//! its reason until it is enabled again; a hanging endpoint does not delay
//! a healthy one; the Standard Webhooks headers verify with the
//! specification computed by hand here; and a load of a few hundred
//! endpoints, a fifth of them failing, slow or hanging, ends with every
//! delivery delivered or dead with its reason, in order everywhere, and the
//! healthy endpoints served at the first attempt.
//!
//! The endpoints are real HTTP servers (`cobro_test_support::fleet`).
//! Nothing here waits for time to pass: conditions are polled, with a
//! bound, and cobro's clock is moved by hand.

use crate::events::{
    deliveries, dispatch_until_settled, dispatcher, get_json, register, rotate_secret, round,
};
use base64::Engine;
use chrono::Duration;
use cobro_core::{Clock, DeliveryState, PaymentId};
use cobro_store::events::{DeliveryRow, GONE_ERROR};
use cobro_test_support::fleet::{Behaviour, Endpoint};
use cobro_test_support::{Backend, Rig, on_both_backends, payment_body};
use hmac::{KeyInit, Mac};
use serde_json::Value;
use std::collections::BTreeMap;
use std::sync::Arc;

on_both_backends!(
    a_deleted_endpoint_takes_its_deliveries_and_gets_nothing_more,
    a_payments_next_event_waits_until_the_previous_is_delivered_or_dead,
    an_endpoint_that_answers_410_gone_is_disabled_with_its_reason_until_enabled_again,
    a_hanging_endpoint_does_not_delay_a_healthy_one,
    the_standard_webhooks_signature_verifies_as_the_specification_computes_it,
    a_few_hundred_endpoints_a_fifth_misbehaving_get_every_event_in_order_and_the_rest_at_once,
);

/// Creates `n` payments (captured at once: two events each) and lets the
/// worker write their events; returns their ids.
async fn captured_payments(rig: &Rig, n: usize) -> Vec<String> {
    let mut ids = Vec::new();
    for i in 0..n {
        let p = rig
            .create_payment(&format!("k-{i}"), &payment_body(&format!("o-{i}")))
            .await;
        ids.push(p["id"].as_str().expect("id").to_owned());
    }
    rig.drain(5).await;
    ids
}

/// The deliveries of each of a payment's events, by sequence.
async fn deliveries_of(rig: &Rig, payment: &str) -> Vec<Vec<DeliveryRow>> {
    let store = &rig.app.db.store;
    let id: PaymentId = payment.parse().expect("id");
    let mut all = Vec::new();
    for event in store
        .events_of_payment_any_account(id)
        .await
        .expect("events")
    {
        let event_id = event.id.to_string().parse().expect("id");
        all.push(
            store
                .deliveries_of_event_any_account(event_id)
                .await
                .expect("deliveries"),
        );
    }
    all
}

/// Polls `done` (every 20 ms of real time, at most `bound_secs`),
/// moving cobro's clock by `step` between polls.
async fn poll_until<F>(rig: &Rig, step: Duration, bound_secs: u64, what: &str, mut done: F)
where
    F: AsyncFnMut() -> bool,
{
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(bound_secs);
    while !done().await {
        assert!(tokio::time::Instant::now() < deadline, "never: {what}");
        rig.app.clock.advance(step);
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// p's first event fails at every attempt: its second is not sent until
/// the first is dead, while q's two events go through at once. Without
/// the claim's ordering, p's second event would arrive first.
async fn a_payments_next_event_waits_until_the_previous_is_delivered_or_dead(backend: Backend) {
    let rig = Rig::new(backend).await;
    let endpoint = Endpoint::start(Behaviour::Healthy).await;
    register(&rig, &endpoint.url).await;
    let d = dispatcher(&rig, "d-1", |c| {
        c.retry_period = std::time::Duration::from_secs(3600);
        c.disable_after = std::time::Duration::from_secs(30 * 24 * 3600);
    });
    let ids = captured_payments(&rig, 2).await;
    let (p, q) = (&ids[0], &ids[1]);
    endpoint.fail_event(p, 1);
    // Three rounds at one instant: nothing of p is due again (backoff),
    // q's second event is claimable as soon as its first is delivered.
    for _ in 0..3 {
        round(&d).await;
    }
    let sequences = endpoint.sequences();
    assert_eq!(sequences[q], [1, 2], "q is not held back by p");
    assert_eq!(sequences[p], [1], "p's second waits for its first");
    let p_rows = deliveries_of(&rig, p).await;
    assert_eq!(p_rows[0][0].state, DeliveryState::Pending);
    assert_eq!(p_rows[0][0].last_status, Some(503));
    assert_eq!(
        (p_rows[1][0].state, p_rows[1][0].attempts),
        (DeliveryState::Pending, 0)
    );

    dispatch_until_settled(&rig, &[d], Duration::minutes(20)).await;
    let sent = &endpoint.sequences()[p];
    let (last, before) = sent.split_last().expect("sent");
    assert_eq!(*last, 2, "p's second came last: {sent:?}");
    assert!(
        before.len() >= 3 && before.iter().all(|s| *s == 1),
        "{sent:?}"
    );
    let p_rows = deliveries_of(&rig, p).await;
    let first = &p_rows[0][0];
    assert_eq!(
        first.state,
        DeliveryState::Dead,
        "the first died with its reason"
    );
    assert_eq!(first.last_status, Some(503));
    assert_eq!(first.last_error.as_deref(), Some("answered 503"));
    let second = &p_rows[1][0];
    assert_eq!(
        (second.state, second.attempts),
        (DeliveryState::Delivered, 1)
    );
}

/// `DELETE /v1/event_endpoints/{id}`: another account's is a 404 that
/// changes nothing; the owner's is a 204 that takes the endpoint's pending
/// deliveries with it (the other endpoint's stay), after which nothing is
/// sent to it; a second one is a 404.
async fn a_deleted_endpoint_takes_its_deliveries_and_gets_nothing_more(backend: Backend) {
    let rig = Rig::new(backend).await;
    let gone = Endpoint::start(Behaviour::Healthy).await;
    let kept = Endpoint::start(Behaviour::Healthy).await;
    let (id, _) = register(&rig, &gone.url).await;
    register(&rig, &kept.url).await;
    captured_payments(&rig, 2).await;
    let store = &rig.app.db.store;
    store
        .sequence_events(rig.app.clock.now())
        .await
        .expect("sequence");
    let deliveries = rig.app.db.count("event_deliveries").await;
    assert!(deliveries >= 4, "{deliveries}");
    let delete = |token: &str| {
        rig.app
            .client
            .delete(format!("{}/v1/event_endpoints/{id}", rig.app.url))
            .bearer_auth(token.to_owned())
            .send()
    };

    let (_, other) = rig.app.new_account("merchant-b").await;
    let r = delete(&other).await.expect("delete");
    assert_eq!(r.status().as_u16(), 404);
    assert_eq!(rig.app.db.count("event_endpoints").await, 2);
    assert_eq!(rig.app.db.count("event_deliveries").await, deliveries);

    let r = delete(&rig.app.token).await.expect("delete");
    assert_eq!(r.status().as_u16(), 204);
    assert_eq!(rig.app.db.count("event_endpoints").await, 1);
    assert_eq!(
        rig.app.db.count("event_deliveries").await * 2,
        deliveries,
        "the other endpoint's deliveries stay"
    );
    let again = delete(&rig.app.token).await.expect("delete");
    assert_eq!(again.status().as_u16(), 404);

    let d = dispatcher(&rig, "d-1", |_| {});
    dispatch_until_settled(&rig, &[d], Duration::seconds(30)).await;
    assert!(gone.received().is_empty(), "nothing sent to it");
    assert_eq!(kept.acknowledged().len() as i64 * 2, deliveries);
    assert_eq!(rig.ledger().totals.charges, 2);
}

/// The endpoint answers 410 Gone: it is disabled at once, its reason is
/// shown by the API, nothing more is sent to it however long it waits,
/// and the delivery waits (not dead); enabled again, it gets the payment's
/// events in order.
async fn an_endpoint_that_answers_410_gone_is_disabled_with_its_reason_until_enabled_again(
    backend: Backend,
) {
    let rig = Rig::new(backend).await;
    let endpoint = Endpoint::start(Behaviour::Gone).await;
    let (id, _) = register(&rig, &endpoint.url).await;
    let d = dispatcher(&rig, "d-1", |_| {});
    let ids = captured_payments(&rig, 1).await;
    let p = &ids[0];
    round(&d).await;
    let listed: Value = get_json(&rig, "/v1/event_endpoints").await;
    let listed = &listed["data"][0];
    assert_eq!(listed["enabled"], false, "{listed}");
    let reason = listed["disabled_reason"].as_str().expect("reason");
    assert!(reason.contains("410 Gone"), "{reason}");
    let rows = deliveries_of(&rig, p).await;
    assert_eq!(
        rows[0][0].state,
        DeliveryState::Pending,
        "it waits, it is not dead"
    );
    assert_eq!(rows[0][0].last_status, Some(410));
    assert_eq!(rows[0][0].last_error.as_deref(), Some(GONE_ERROR));
    for _ in 0..5 {
        rig.app.clock.advance(Duration::days(1));
        round(&d).await;
    }
    assert_eq!(endpoint.received().len(), 1, "nothing more is sent");

    endpoint.set(Behaviour::Healthy);
    let endpoint_id: cobro_core::EndpointId = id.parse().expect("id");
    let store = &rig.app.db.store;
    assert!(
        store
            .enable_endpoint(None, endpoint_id, rig.app.clock.now())
            .await
            .expect("enable")
    );
    dispatch_until_settled(&rig, &[d], Duration::seconds(30)).await;
    assert_eq!(endpoint.sequences()[p], [1, 1, 2]);
    assert_eq!(endpoint.acknowledged().len(), 2);
    let listed: Value = get_json(&rig, "/v1/event_endpoints").await;
    assert_eq!(listed["data"][0]["enabled"], true);
    assert_eq!(listed["data"][0]["disabled_reason"], Value::Null);
}

/// One endpoint never answers (and the timeout is an hour): the
/// dispatcher's loop still delivers every event, in order, to the other
/// endpoint of the account, while the first holds its requests open.
async fn a_hanging_endpoint_does_not_delay_a_healthy_one(backend: Backend) {
    let rig = Rig::new(backend).await;
    let hanging = Endpoint::start(Behaviour::Hang).await;
    let healthy = Endpoint::start(Behaviour::Healthy).await;
    register(&rig, &hanging.url).await;
    register(&rig, &healthy.url).await;
    let ids = captured_payments(&rig, 3).await;
    let d = Arc::new(dispatcher(&rig, "d-1", |c| {
        c.request_timeout = std::time::Duration::from_secs(3600);
        c.lease = std::time::Duration::from_secs(7200);
        c.poll_interval = std::time::Duration::from_millis(20);
    }));
    let (_stop, stopped) = tokio::sync::watch::channel(false);
    let running = tokio::spawn(Arc::clone(&d).run(stopped));
    poll_until(
        &rig,
        Duration::zero(),
        30,
        "the healthy endpoint has every event",
        async || healthy.acknowledged().len() == 6,
    )
    .await;
    for p in &ids {
        assert_eq!(healthy.sequences()[p], [1, 2], "in order");
    }
    let held = hanging.received();
    assert!(!held.is_empty(), "the hanging endpoint was sent to");
    assert!(
        held.iter()
            .all(|r| r.acknowledged.is_none() && r.sequence == 1),
        "it answered nothing, so nothing after a first event went to it"
    );
    running.abort();
}

/// The headers of the Standard Webhooks specification, checked by a
/// verifier written here from the specification alone (the key is the
/// base64 after `whsec_`; the signature is `v1,` and the base64 of
/// HMAC-SHA256 over `{id}.{timestamp}.{body}`), and by `cobro-client`;
/// during a rotation both secrets sign.
async fn the_standard_webhooks_signature_verifies_as_the_specification_computes_it(
    backend: Backend,
) {
    let rig = Rig::new(backend).await;
    let endpoint = Endpoint::start(Behaviour::Healthy).await;
    let (id, secret) = register(&rig, &endpoint.url).await;
    let d = dispatcher(&rig, "d-1", |_| {});
    let ids = captured_payments(&rig, 1).await;
    round(&d).await;
    let by_hand = |secret: &str, id: &str, timestamp: &str, body: &[u8]| {
        let b64 = base64::engine::general_purpose::STANDARD;
        let key = b64
            .decode(secret.strip_prefix("whsec_").expect("whsec_"))
            .expect("base64");
        let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(&key).expect("key");
        mac.update(format!("{id}.{timestamp}.").as_bytes());
        mac.update(body);
        format!("v1,{}", b64.encode(mac.finalize().into_bytes()))
    };
    let header = |r: &cobro_test_support::fleet::Request, name: &str| {
        r.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .expect(name)
            .to_owned()
    };
    let first = &endpoint.received()[0];
    let (webhook_id, timestamp, signature) = (
        header(first, "webhook-id"),
        header(first, "webhook-timestamp"),
        header(first, "webhook-signature"),
    );
    assert_eq!(webhook_id, first.event_id);
    assert_eq!(timestamp, rig.app.clock.now().timestamp().to_string());
    assert_eq!(
        signature,
        by_hand(&secret, &webhook_id, &timestamp, &first.body)
    );
    let event = cobro_client::webhook::verify_standard_event(
        &webhook_id,
        &timestamp,
        &signature,
        &first.body,
        &[&secret],
        rig.app.clock.now(),
        std::time::Duration::from_secs(300),
    )
    .expect("cobro-client verifies it");
    assert_eq!(event.payment_id, ids[0]);
    assert!(
        cobro_client::webhook::verify_standard_event(
            &webhook_id,
            &timestamp,
            &signature,
            b"{}",
            &[&secret],
            rig.app.clock.now(),
            std::time::Duration::from_secs(300),
        )
        .is_err(),
        "another body does not verify"
    );

    // Rotated: two signatures, one per secret, each as the spec makes it.
    let new_secret = rotate_secret(&rig, &id).await;
    let event_id = first.event_id.parse().expect("id");
    rig.app
        .db
        .store
        .resend_event(None, event_id, rig.app.clock.now())
        .await
        .expect("resend");
    dispatch_until_settled(&rig, &[d], Duration::seconds(30)).await;
    let again = endpoint
        .received()
        .into_iter()
        .rfind(|r| r.event_id == first.event_id)
        .expect("resent");
    let timestamp = header(&again, "webhook-timestamp");
    let signatures: Vec<String> = header(&again, "webhook-signature")
        .split(' ')
        .map(str::to_owned)
        .collect();
    assert_eq!(
        signatures,
        [
            by_hand(&new_secret, &first.event_id, &timestamp, &again.body),
            by_hand(&secret, &first.event_id, &timestamp, &again.body),
        ]
    );
}

/// Item 7: 200 endpoints of one account, every fifth one failing (503),
/// slow (a pause under the timeout) or hanging (past it), two dispatchers
/// running their loops, ten payments (twenty events, 4 000 deliveries).
/// Every delivery ends delivered or dead with its reason; at no endpoint
/// did a payment's event arrive after a later one; every healthy endpoint
/// got every event at the first attempt. Not a timed test: the figures of
/// latency are the bench's (`examples/delivery_latency.rs`).
async fn a_few_hundred_endpoints_a_fifth_misbehaving_get_every_event_in_order_and_the_rest_at_once(
    backend: Backend,
) {
    let rig = Rig::new(backend).await;
    let misbehaviours = [
        Behaviour::Failing,
        Behaviour::Slow(std::time::Duration::from_millis(300)),
        Behaviour::Hang,
    ];
    let mut fleet = Vec::new();
    for i in 0..200 {
        let behaviour = if i % 5 == 0 {
            misbehaviours[(i / 5) % 3]
        } else {
            Behaviour::Healthy
        };
        let endpoint = Endpoint::start(behaviour).await;
        let (id, _) = register(&rig, &endpoint.url).await;
        fleet.push((id, endpoint));
    }
    let payments = captured_payments(&rig, 10).await;
    let tweak = |c: &mut cobro_worker::DispatcherConfig| {
        c.request_timeout = std::time::Duration::from_millis(500);
        // cobro's clock runs fast here; no dispatcher dies.
        c.lease = std::time::Duration::from_secs(24 * 3600);
        c.retry_period = std::time::Duration::from_secs(600);
        c.disable_after = std::time::Duration::from_secs(365 * 24 * 3600);
        c.poll_interval = std::time::Duration::from_millis(20);
    };
    let (_stop, stopped) = tokio::sync::watch::channel(false);
    let running: Vec<_> = ["d-1", "d-2"]
        .into_iter()
        .map(|name| {
            let d = Arc::new(dispatcher(&rig, name, tweak));
            tokio::spawn(d.run(stopped.clone()))
        })
        .collect();
    poll_until(
        &rig,
        Duration::minutes(1),
        55,
        "no delivery pending",
        async || {
            let counts = deliveries(&rig).await;
            !counts.contains_key(&DeliveryState::Pending)
                && counts.values().sum::<i64>() == 200 * 20
        },
    )
    .await;
    for r in &running {
        r.abort();
    }

    let mut rows: BTreeMap<String, Vec<DeliveryRow>> = BTreeMap::new();
    for p in &payments {
        for event in deliveries_of(&rig, p).await {
            for row in event {
                rows.entry(row.endpoint_id.to_string())
                    .or_default()
                    .push(row);
            }
        }
    }
    for (id, endpoint) in &fleet {
        let behaviour = endpoint.behaviour();
        let mine = &rows[id];
        assert_eq!(mine.len(), 20, "{id}: every event has its delivery");
        for (payment, sent) in endpoint.sequences() {
            assert!(
                sent.windows(2).all(|w| w[0] <= w[1]),
                "{behaviour:?} endpoint {id}: {payment} arrived out of order: {sent:?}"
            );
        }
        for row in mine {
            let outcome = (row.state, row.last_status, row.last_error.as_deref());
            match behaviour {
                Behaviour::Healthy => {
                    assert_eq!(outcome, (DeliveryState::Delivered, Some(200), None), "{id}");
                    assert_eq!(
                        row.attempts, 1,
                        "{id}: a healthy endpoint is served at once"
                    );
                }
                Behaviour::Slow(_) => assert_eq!(outcome.0, DeliveryState::Delivered, "{id}"),
                Behaviour::Failing => {
                    assert_eq!(
                        outcome,
                        (DeliveryState::Dead, Some(503), Some("answered 503")),
                        "{id}"
                    )
                }
                Behaviour::Hang => {
                    assert_eq!(
                        outcome,
                        (DeliveryState::Dead, None, Some("timed out")),
                        "{id}"
                    )
                }
                Behaviour::Gone => unreachable!("none here"),
            }
        }
        if matches!(behaviour, Behaviour::Healthy | Behaviour::Slow(_)) {
            assert_eq!(endpoint.acknowledged().len(), 20, "{id}");
        }
    }
}
