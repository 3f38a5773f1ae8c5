//! Webhook events: signatures, sequences, at-least-once redelivery and the
//! delivery faults, against a real receiver on port 0.
#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

mod common;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use common::{EffectsExt, Provider, charge_body, charges, provider_with, wait_until};
use fake_provider::{Config, Effects, FaultAction, FaultRule, Operation, WebhookTarget};
use hmac::{Hmac, KeyInit, Mac};
use serde_json::{Value, json};
use sha2::Sha256;

const SECRET: &str = "whsec_test";

/// What the receiver got.
#[derive(Clone, Debug)]
struct Received {
    signature: String,
    body: Bytes,
    event: Value,
}

/// A webhook receiver that answers 500 to its first `failures` requests.
#[derive(Clone, Default)]
struct Receiver {
    received: Arc<Mutex<Vec<Received>>>,
    failures: Arc<AtomicU32>,
}

impl Receiver {
    async fn start(failures: u32) -> (Self, String) {
        let receiver = Self {
            failures: Arc::new(AtomicU32::new(failures)),
            ..Self::default()
        };
        let url = serve_hooks(post(receive).with_state(receiver.clone())).await;
        (receiver, url)
    }

    fn events(&self) -> Vec<Received> {
        self.received.lock().unwrap().clone()
    }

    /// `(type, sequence)` of each received event, in arrival order.
    fn kinds_and_sequences(&self) -> Vec<(String, u64)> {
        let kind_and_sequence = |r: &Received| {
            let kind = r.event["type"].as_str().unwrap().to_owned();
            (kind, r.event["sequence"].as_u64().unwrap())
        };
        self.events().iter().map(kind_and_sequence).collect()
    }

    fn event_ids(&self) -> Vec<String> {
        self.events()
            .iter()
            .map(|r| r.event["id"].as_str().unwrap().to_owned())
            .collect()
    }

    async fn wait_for(&self, count: usize) {
        wait_until(&format!("{count} acknowledged events"), || async {
            self.events().len() >= count
        })
        .await;
    }
}

/// Serves `hooks` at `/hooks` on a free port; returns its URL.
async fn serve_hooks(hooks: axum::routing::MethodRouter) -> String {
    let app = Router::new().route("/hooks", hooks);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hooks", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}

async fn receive(State(receiver): State<Receiver>, headers: HeaderMap, body: Bytes) -> StatusCode {
    let failing = receiver
        .failures
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok();
    if failing {
        return StatusCode::INTERNAL_SERVER_ERROR;
    }
    let signature = headers
        .get("fake-signature")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let event = serde_json::from_slice(&body).unwrap_or(Value::Null);
    receiver.received.lock().unwrap().push(Received {
        signature,
        body,
        event,
    });
    StatusCode::OK
}

/// Waits until the provider has recorded `count` acknowledged deliveries (the
/// receiver stores an event before the provider sees its answer).
async fn wait_acknowledged(p: &Provider, count: usize) {
    wait_until(&format!("{count} acknowledged deliveries"), || async {
        p.control
            .webhook_deliveries()
            .iter()
            .filter(|d| d.acknowledged())
            .count()
            >= count
    })
    .await;
}

async fn provider_sending_to(url: &str) -> Provider {
    let webhook = Some(WebhookTarget {
        url: url.to_owned(),
        secret: SECRET.to_owned(),
    });
    provider_with(Config {
        webhook,
        webhook_retry_base: Duration::from_millis(20),
        ..Config::default()
    })
    .await
}

/// An independent check of the `Fake-Signature` scheme (not via `sign`).
fn signature_is_valid(header: &str, body: &[u8], secret: &str) -> bool {
    let Some((t, v1)) = header
        .strip_prefix("t=")
        .and_then(|rest| rest.split_once(",v1="))
    else {
        return false;
    };
    let mut mac = Hmac::<Sha256>::new_from_slice(secret.as_bytes()).unwrap();
    mac.update(format!("{t}.").as_bytes());
    mac.update(body);
    mac.verify_slice(&hex::decode(v1).unwrap_or_default())
        .is_ok()
}

#[tokio::test]
async fn events_are_signed_with_the_secret_over_timestamp_and_raw_body() {
    let (receiver, url) = Receiver::start(0).await;
    let p = provider_sending_to(&url).await;
    let charge = p.charge(Some("key-1"), "pedido-1:authorize-v1").await;
    receiver.wait_for(1).await;

    let got = &receiver.events()[0];
    assert!(
        signature_is_valid(&got.signature, &got.body, SECRET),
        "{}",
        got.signature
    );
    assert!(!signature_is_valid(
        &got.signature,
        &got.body,
        "wrong secret"
    ));
    let t: i64 = got.signature[2..]
        .split(',')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        (t - p.control.now().timestamp()).abs() <= 5,
        "t is the virtual now"
    );
    assert_eq!(fake_provider::sign(SECRET, t, &got.body), got.signature);
    assert!(got.event["id"].as_str().unwrap().starts_with("evt_"));
    assert_eq!(got.event["type"], "charge.authorized");
    assert_eq!(got.event["data"], charge.body);
    assert_eq!(p.totals(), charges(1));
}

#[tokio::test]
async fn each_effect_emits_one_event_carrying_the_charge_sequence() {
    let (receiver, url) = Receiver::start(0).await;
    let p = provider_sending_to(&url).await;
    let charge = p.charge(None, "pedido-2:authorize-v1").await;
    p.capture(charge.id(), None, json!({})).await;
    let refund = json!({"charge": charge.id(), "amount": 50, "reference": "pedido-2:refund-v1"});
    p.post("/v1/refunds", None, &refund).await.unwrap();
    let mut declined = charge_body("pedido-3:authorize-v1");
    declined["payment_method"] = json!("pm_card_declined");
    p.post("/v1/charges", None, &declined).await.unwrap();
    let voided = p.charge(None, "pedido-4:authorize-v1").await;
    p.void(voided.id()).await;
    receiver.wait_for(6).await;

    let seen: Vec<(String, u64)> = receiver.kinds_and_sequences();
    let expected = [
        ("charge.authorized", 1),
        ("charge.captured", 2),
        ("refund.succeeded", 3),
        ("charge.declined", 1),
        ("charge.authorized", 1),
        ("charge.voided", 2),
    ];
    assert_eq!(
        seen,
        expected.map(|(kind, sequence)| (kind.to_owned(), sequence))
    );
    let totals = p.totals();
    assert_eq!(
        totals,
        Effects {
            charges: 2,
            declines: 1,
            captures: 1,
            voids: 1,
            refunds: 1,
            refund_failures: 0,
        }
    );
}

#[tokio::test]
async fn a_receiver_error_is_retried_with_backoff_until_acknowledged() {
    let (receiver, url) = Receiver::start(2).await;
    let p = provider_sending_to(&url).await;
    p.charge(None, "pedido-5:authorize-v1").await;
    wait_acknowledged(&p, 1).await;

    let attempts: Vec<(u32, Option<u16>)> = p
        .control
        .webhook_deliveries()
        .iter()
        .map(|d| (d.attempt, d.status))
        .collect();
    assert_eq!(
        attempts,
        vec![(1, Some(500)), (2, Some(500)), (3, Some(200))]
    );
    assert_eq!(receiver.events().len(), 1);
    assert_eq!(p.totals().charges, 1);
}

#[tokio::test]
async fn an_unreachable_receiver_is_retried_and_a_new_target_gets_the_event() {
    // Nothing listens on the first target: every attempt is a transport error.
    let unused = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let dead_url = format!("http://{}/hooks", unused.local_addr().unwrap());
    drop(unused);
    let p = provider_sending_to(&dead_url).await;
    p.charge(None, "pedido-6:authorize-v1").await;
    let control = p.control.clone();
    wait_until("two failed attempts", || async {
        control.webhook_deliveries().len() >= 2
    })
    .await;
    assert!(
        control
            .webhook_deliveries()
            .iter()
            .all(|d| d.status.is_none() && d.error.is_some())
    );

    let (receiver, url) = Receiver::start(0).await;
    control.set_webhook(Some(WebhookTarget {
        url,
        secret: SECRET.to_owned(),
    }));
    receiver.wait_for(1).await;
    assert_eq!(receiver.events()[0].event["type"], "charge.authorized");
    assert_eq!(control.ledger().totals.charges, 1);
}

#[tokio::test]
async fn duplicate_delivers_the_same_event_twice() {
    let (receiver, url) = Receiver::start(0).await;
    let p = provider_sending_to(&url).await;
    p.control
        .add_fault(FaultRule::new(Operation::Webhook, FaultAction::Duplicate).with_next(1));
    p.charge(None, "pedido-7:authorize-v1").await;
    receiver.wait_for(2).await;

    let events = receiver.events();
    assert_eq!(events[0].event["id"], events[1].event["id"]);
    assert_eq!(events[0].body, events[1].body);
    assert_eq!(p.totals().charges, 1, "one effect, two deliveries");
}

#[tokio::test]
async fn reorder_sends_the_event_after_the_next_one() {
    let (receiver, url) = Receiver::start(0).await;
    let p = provider_sending_to(&url).await;
    p.control
        .add_fault(FaultRule::new(Operation::Webhook, FaultAction::Reorder).with_next(1));
    let charge = p.charge(None, "pedido-8:authorize-v1").await;
    p.capture(charge.id(), None, json!({})).await;
    receiver.wait_for(2).await;

    let order: Vec<(String, u64)> = receiver.kinds_and_sequences();
    assert_eq!(
        order,
        vec![
            ("charge.captured".to_owned(), 2),
            ("charge.authorized".to_owned(), 1)
        ]
    );
    assert_eq!(p.totals(), charges(1).captures(1));
}

#[tokio::test]
async fn a_reordered_event_is_still_delivered_when_no_other_event_follows() {
    let (receiver, url) = Receiver::start(0).await;
    let p = provider_sending_to(&url).await;
    p.control
        .add_fault(FaultRule::new(Operation::Webhook, FaultAction::Reorder).with_next(1));
    p.charge(None, "pedido-9:authorize-v1").await;
    receiver.wait_for(1).await;

    assert_eq!(receiver.events()[0].event["type"], "charge.authorized");
    assert_eq!(p.totals().charges, 1);
}

#[tokio::test]
async fn drop_then_redeliver_skips_the_first_delivery_and_redelivers_it() {
    let (receiver, url) = Receiver::start(0).await;
    let p = provider_sending_to(&url).await;
    p.control
        .add_fault(FaultRule::new(Operation::Webhook, FaultAction::DropThenRedeliver).with_next(1));
    p.charge(None, "pedido-10:authorize-v1").await;
    wait_acknowledged(&p, 1).await;

    let deliveries = p.control.webhook_deliveries();
    assert_eq!(deliveries.len(), 2);
    assert_eq!(
        (
            deliveries[0].attempt,
            deliveries[0].status,
            deliveries[0].error.as_deref()
        ),
        (1, None, Some("dropped by fault"))
    );
    assert_eq!(
        (deliveries[1].attempt, deliveries[1].status),
        (2, Some(200))
    );
    assert_eq!(
        receiver.events().len(),
        1,
        "the dropped attempt never reached the receiver"
    );
    assert_eq!(p.totals().charges, 1);
}

#[tokio::test]
async fn webhook_rules_match_the_reference_of_the_event() {
    let (receiver, url) = Receiver::start(0).await;
    let p = provider_sending_to(&url).await;
    p.control.add_fault(
        FaultRule::new(Operation::Webhook, FaultAction::Duplicate).with_reference("pedido-12"),
    );
    p.charge(None, "pedido-11:authorize-v1").await;
    p.charge(None, "pedido-12:authorize-v1").await;
    receiver.wait_for(3).await;

    let ids = receiver.event_ids();
    assert_ne!(ids[0], ids[1]);
    assert_eq!(ids[1], ids[2]);
    assert_eq!(p.totals().charges, 2);
}

#[tokio::test]
async fn no_events_are_emitted_without_a_target() {
    let (receiver, url) = Receiver::start(0).await;
    let p = common::provider().await;
    p.charge(None, "pedido-13:authorize-v1").await;
    p.control.set_webhook(Some(WebhookTarget {
        url,
        secret: SECRET.to_owned(),
    }));
    p.charge(None, "pedido-14:authorize-v1").await;
    receiver.wait_for(1).await;

    assert_eq!(receiver.events().len(), 1);
    assert_eq!(
        receiver.events()[0].event["data"]["reference"],
        "pedido-14:authorize-v1"
    );
    assert_eq!(p.totals().charges, 2);
}

/// A receiver that holds every event of references starting with `slow-`
/// until `open` is set, and notes `(type, reference)` of each event as it
/// arrives, before any wait.
#[derive(Clone)]
struct GatedReceiver {
    arrived: Arc<Mutex<Vec<(String, String)>>>,
    open: tokio::sync::watch::Receiver<bool>,
}

impl GatedReceiver {
    fn arrived(&self) -> Vec<(String, String)> {
        self.arrived.lock().unwrap().clone()
    }
}

async fn gated_receive(State(receiver): State<GatedReceiver>, body: Bytes) -> StatusCode {
    let event: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let reference = event["data"]["reference"].as_str().unwrap_or_default();
    receiver.arrived.lock().unwrap().push((
        event["type"].as_str().unwrap_or_default().to_owned(),
        reference.to_owned(),
    ));
    if reference.starts_with("slow-") {
        let _ = receiver.open.clone().wait_for(|open| *open).await;
    }
    StatusCode::OK
}

#[tokio::test]
async fn with_several_lanes_a_slow_charge_holds_back_only_its_own_later_events() {
    let (gate, open) = tokio::sync::watch::channel(false);
    let receiver = GatedReceiver {
        arrived: Arc::default(),
        open,
    };
    let url = serve_hooks(post(gated_receive).with_state(receiver.clone())).await;
    let p = provider_with(Config {
        webhook: Some(WebhookTarget {
            url,
            secret: SECRET.to_owned(),
        }),
        webhook_concurrency: 8,
        ..Config::default()
    })
    .await;

    // The slow charge's first event is held by the receiver; its capture's
    // event queues behind it in the same lane. The two references take
    // lanes 1 and 5 of 8 (the first 8 bytes of their SHA-256, modulo 8).
    let slow = p.charge(None, "slow-1:authorize-v1").await;
    p.capture(slow.id(), None, json!({})).await;
    p.charge(None, "fast-2:authorize-v1").await;
    // With one lane this never happens: the fast event waits for the slow.
    wait_until("the fast charge's event beside the held one", || async {
        receiver.arrived().len() >= 2
    })
    .await;
    let event = |kind: &str, reference: &str| (kind.to_owned(), reference.to_owned());
    assert_eq!(
        receiver.arrived(),
        [
            event("charge.authorized", "slow-1:authorize-v1"),
            event("charge.authorized", "fast-2:authorize-v1"),
        ],
        "the held charge's capture must not overtake its authorisation"
    );

    gate.send_replace(true);
    wait_acknowledged(&p, 3).await;
    assert_eq!(
        receiver.arrived()[2],
        event("charge.captured", "slow-1:authorize-v1")
    );
    assert_eq!(receiver.arrived().len(), 3);
    assert_eq!(p.totals().charges, 2);
    assert_eq!(p.totals().captures, 1);
}

/// A charge a `soft_decline` rule declines sends `charge.declined`, as a
/// declining card's does, carrying the declined charge.
#[tokio::test]
async fn a_soft_declined_charge_emits_charge_declined() {
    let (receiver, url) = Receiver::start(0).await;
    let p = provider_sending_to(&url).await;
    p.control
        .add_fault(FaultRule::new(Operation::Charge, FaultAction::SoftDecline));
    let declined = p.charge(Some("key-s"), "pedido-s:authorize-v1").await;
    assert_eq!(declined.error(), (402, "try_again_later"));
    receiver.wait_for(1).await;

    assert_eq!(
        receiver.kinds_and_sequences(),
        [("charge.declined".to_owned(), 1)]
    );
    assert_eq!(receiver.events()[0].event["data"], declined.body["charge"]);
    assert_eq!(p.totals(), Effects::default().declines(1));
}
