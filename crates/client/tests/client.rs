//! The client's behaviour: journal before send, what is retried (and with
//! which key), what is final, what stays pending, resume after a lost
//! answer, and the typed operations and `wait`.
//!
//! Two kinds of server: cobro's real API in-process (SQLite, with its worker
//! and the fake provider where money moves), and, for answers a real cobro
//! cannot be made to give on demand (a 503 then a 409 then a 429, a hang
//! past the client's timeout), a scripted HTTP server that answers from a
//! list and records every request it received.

use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use cobro_client::{
    Client, CreatePayment, CreateRefund, Error, Event, Journal, ListPayments, MemoryJournal,
    NewIntent, Operation, PaymentStatus, ProblemCode, RefundStatus, Resource, RetryPolicy,
    SqliteJournal,
};
use cobro_test_support::{Backend, Rig, TestApp};
use serde_json::{Value, json};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// A fast policy: these tests are about which answers are retried, not how
/// long the backoff is (the unit tests pin that).
fn quick() -> RetryPolicy {
    RetryPolicy {
        max_attempts: 6,
        base: Duration::from_millis(10),
        cap: Duration::from_millis(40),
        max_retry_after: Duration::from_secs(5),
    }
}

fn order(order_ref: &str) -> CreatePayment {
    CreatePayment::new(order_ref, 1999, "EUR", "pm_card_visa")
}

// ---------------------------------------------------------------- scripted

/// One scripted answer.
#[derive(Clone)]
struct Scripted {
    status: u16,
    headers: Vec<(&'static str, &'static str)>,
    body: Value,
    /// Held this long before answering (a hang past the client's timeout).
    delay: Duration,
}

fn answer(status: u16, body: Value) -> Scripted {
    Scripted {
        status,
        headers: Vec::new(),
        body,
        delay: Duration::ZERO,
    }
}

fn problem(status: u16, code: &str) -> Scripted {
    answer(
        status,
        json!({"type": format!("/problems/{code}"), "title": "t", "status": status,
               "detail": "d", "code": code, "request_id": "req"}),
    )
}

fn payment_json(id: &str) -> Value {
    json!({"id": id, "intent": "o-1:authorize-v1", "order_ref": "o-1", "amount": 1999,
           "currency": "EUR", "capture_method": "automatic", "status": "processing",
           "amount_captured": 0, "amount_refunded": 0, "provider_ref": null, "failure": null,
           "cancel_requested": false, "description": null, "metadata": {},
           "created_at": "2026-11-30T12:00:00.000000Z", "updated_at": "2026-11-30T12:00:00.000000Z"})
}

/// What the scripted server received.
#[derive(Clone, Debug)]
struct Received {
    key: Option<String>,
    body: Vec<u8>,
    at: Instant,
    /// Whether the journal file had this key, pending, when the request
    /// arrived (only when the server was given a journal to look into).
    journaled: Option<bool>,
}

#[derive(Default)]
struct Script {
    answers: Mutex<VecDeque<Scripted>>,
    received: Mutex<Vec<Received>>,
    journal: Mutex<Option<SqliteJournal>>,
}

impl Script {
    fn received(&self) -> Vec<Received> {
        self.received
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

async fn scripted(answers: Vec<Scripted>) -> (String, Arc<Script>) {
    let script = Arc::new(Script {
        answers: Mutex::new(answers.into()),
        ..Script::default()
    });
    let state = Arc::clone(&script);
    let app = axum::Router::new().fallback(move |headers: HeaderMap, body: Bytes| {
        let script = Arc::clone(&state);
        async move { respond(&script, &headers, &body).await }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(async move {
        axum::serve(listener, app).await.expect("serve");
    });
    (url, script)
}

async fn respond(script: &Script, headers: &HeaderMap, body: &Bytes) -> Response {
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let journal = script
        .journal
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clone();
    // Read through the journal's own file, as a restarted process would.
    let journaled = match (&journal, &key) {
        (Some(journal), Some(key)) => Some(
            journal
                .pending()
                .await
                .expect("read the journal")
                .iter()
                .any(|i| &i.key == key),
        ),
        _ => None,
    };
    script
        .received
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .push(Received {
            key,
            body: body.to_vec(),
            at: Instant::now(),
            journaled,
        });
    let next = script
        .answers
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .pop_front();
    let Some(next) = next else {
        return (StatusCode::IM_A_TEAPOT, "script exhausted").into_response();
    };
    if !next.delay.is_zero() {
        tokio::time::sleep(next.delay).await;
    }
    let mut response = (
        StatusCode::from_u16(next.status).expect("status"),
        next.body.to_string(),
    )
        .into_response();
    for (name, value) in next.headers {
        response
            .headers_mut()
            .insert(name, value.parse().expect("header value"));
    }
    response
}

#[tokio::test]
async fn in_progress_rate_limited_and_server_errors_are_retried_with_the_same_key_and_body() {
    let mut unavailable = problem(503, "service-unavailable");
    unavailable.headers.push(("retry-after", "1"));
    let mut created = answer(201, payment_json("p-1"));
    created.headers.push(("idempotent-replayed", "true"));
    let (url, script) = scripted(vec![
        unavailable,
        problem(409, "idempotency-request-in-progress"),
        problem(429, "rate-limited"),
        problem(500, "internal"),
        created,
    ])
    .await;
    let journal = MemoryJournal::new();
    let client = Client::new(&url, "t", journal.clone())
        .expect("client")
        .with_retry(quick());

    let payment = client
        .create_payment("o-1/pay", &order("o-1"))
        .await
        .expect("created after four retries");
    assert_eq!(payment.value.id, "p-1");
    assert!(payment.was_replayed());

    let received = script.received();
    assert_eq!(received.len(), 5);
    let key = journal.all()[0].key.clone();
    for r in &received {
        assert_eq!(
            r.key.as_deref(),
            Some(key.as_str()),
            "every try sends the journaled key"
        );
        assert_eq!(r.body, received[0].body, "and the same body");
    }
    let gap = received[1].at - received[0].at;
    assert!(
        gap >= Duration::from_secs(1),
        "Retry-After: 1 honoured: {gap:?}"
    );
    assert!(!journal.all()[0].is_pending(), "complete with the 201");
}

#[tokio::test]
async fn final_refusals_are_not_retried_and_complete_the_intent() {
    for (status, code) in [
        (400, "validation-error"),
        (404, "not-found"),
        (422, "payment-not-capturable"),
    ] {
        let (url, script) = scripted(vec![problem(status, code)]).await;
        let journal = MemoryJournal::new();
        let client = Client::new(&url, "t", journal.clone())
            .expect("client")
            .with_retry(quick());
        let error = client
            .capture("o-1/capture", "p-1")
            .await
            .expect_err("refused");
        let Error::Problem(found) = &error else {
            panic!("{status}: {error:?}");
        };
        assert_eq!((found.status, found.code().as_str()), (status, code));
        assert_eq!(script.received().len(), 1, "{status} is never retried");
        assert!(!journal.all()[0].is_pending(), "{status} is final");

        // The same intent again: the same refusal, from the journal.
        let again = client
            .capture("o-1/capture", "p-1")
            .await
            .expect_err("refused");
        assert_eq!(again.code().map(|c| c.as_str()), Some(code));
        assert_eq!(script.received().len(), 1, "answered from the journal");
    }
}

#[tokio::test]
async fn idempotency_key_reused_is_surfaced_as_a_client_bug() {
    let (url, script) = scripted(vec![problem(422, "idempotency-key-reused")]).await;
    let client = Client::new(&url, "t", MemoryJournal::new())
        .expect("client")
        .with_retry(quick());
    let error = client
        .create_payment("o-1/pay", &order("o-1"))
        .await
        .expect_err("refused");
    assert!(
        matches!(&error, Error::KeyReused(p) if p.status == 422),
        "{error:?}"
    );
    assert_eq!(error.code(), Some(&ProblemCode::IdempotencyKeyReused));
    assert_eq!(script.received().len(), 1);
}

#[tokio::test]
async fn a_try_that_hangs_past_the_timeout_is_retried_with_the_same_key() {
    let mut hang = answer(201, payment_json("p-late"));
    hang.delay = Duration::from_secs(2);
    let (url, script) = scripted(vec![hang, answer(201, payment_json("p-1"))]).await;
    let http = reqwest::Client::builder()
        .timeout(Duration::from_millis(300))
        .build()
        .expect("http");
    let client = Client::new(&url, "t", MemoryJournal::new())
        .expect("client")
        .with_http(http)
        .with_retry(quick());
    let payment = client
        .create_payment("o-1/pay", &order("o-1"))
        .await
        .expect("created");
    assert_eq!(payment.value.id, "p-1");
    let received = script.received();
    assert_eq!(received.len(), 2);
    assert_eq!(received[0].key, received[1].key);
}

#[tokio::test]
async fn a_give_up_leaves_the_intent_pending_and_resume_sends_it_with_its_key() {
    // A port nobody listens on: connection refused on every try.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let dead = format!("http://{}", closed.local_addr().expect("addr"));
    drop(closed);
    let journal = MemoryJournal::new();
    let client = Client::new(&dead, "t", journal.clone())
        .expect("client")
        .with_retry(RetryPolicy {
            max_attempts: 3,
            ..quick()
        });
    let error = client
        .create_payment("o-1/pay", &order("o-1"))
        .await
        .expect_err("nobody answers");
    let Error::GaveUp { attempts, last } = &error else {
        panic!("{error:?}");
    };
    assert_eq!(*attempts, 3);
    assert!(matches!(**last, Error::Transport(_)), "{last:?}");
    let pending = journal.pending().await.expect("pending");
    assert_eq!(pending.len(), 1, "the intent stays pending");

    // The process comes back with cobro reachable.
    let (url, script) = scripted(vec![answer(201, payment_json("p-1"))]).await;
    let client = Client::new(&url, "t", journal.clone()).expect("client");
    let resumed = client.resume_pending().await.expect("resume");
    assert_eq!(resumed.len(), 1);
    assert!(matches!(&resumed[0].outcome, Ok(Resource::Payment(p)) if p.value.id == "p-1"));
    assert_eq!(
        script.received()[0].key.as_deref(),
        Some(pending[0].key.as_str())
    );
    assert!(journal.pending().await.expect("pending").is_empty());
}

#[tokio::test]
async fn the_intent_is_in_the_journal_file_before_the_request_arrives() {
    let dir = tempfile::tempdir().expect("dir");
    let journal = SqliteJournal::open(dir.path().join("j.db"))
        .await
        .expect("open");
    let (url, script) = scripted(vec![answer(201, payment_json("p-1"))]).await;
    // The server looks into the file through its own pool when the request
    // arrives.
    let reader = SqliteJournal::open(dir.path().join("j.db"))
        .await
        .expect("second handle");
    *script
        .journal
        .lock()
        .unwrap_or_else(PoisonError::into_inner) = Some(reader);
    let events = Arc::new(Mutex::new(Vec::new()));
    let seen = Arc::clone(&events);
    let client = Client::new(&url, "t", journal.clone())
        .expect("client")
        .with_observer(move |event| {
            let name = match event {
                Event::Recorded(_) => "recorded",
                Event::Sending { .. } => "sending",
                Event::Answered { .. } => "answered",
                Event::Completed { .. } => "completed",
                _ => "other",
            };
            seen.lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(name);
        });
    client
        .create_payment("o-1/pay", &order("o-1"))
        .await
        .expect("created");
    assert_eq!(
        script.received()[0].journaled,
        Some(true),
        "the request's key was already pending in the journal file"
    );
    assert_eq!(
        *events.lock().unwrap_or_else(PoisonError::into_inner),
        ["recorded", "sending", "answered", "completed"]
    );
    assert!(journal.pending().await.expect("pending").is_empty());
}

// --------------------------------------------------------------- real cobro

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_answer_is_recovered_by_resume_as_a_replay_of_the_same_payment() {
    let app = TestApp::spawn(Backend::Sqlite).await;
    let journal = MemoryJournal::new();
    // A previous process journaled the intent and sent it; it died before
    // the answer arrived.
    let body = serde_json::to_vec(&order("lost-1")).expect("json");
    let intent = journal
        .record(NewIntent {
            reference: "lost-1/pay".into(),
            operation: Operation::Authorize,
            path: "/v1/payments".into(),
            body: body.clone(),
            key: uuid::Uuid::new_v4().to_string(),
        })
        .await
        .expect("record");
    let first = app
        .post("/v1/payments", Some(&intent.key))
        .body(body)
        .send()
        .await
        .expect("send");
    assert_eq!(first.status().as_u16(), 201);
    let first: Value = first.json().await.expect("json");

    let client = Client::new(&app.url, &app.token, journal.clone()).expect("client");
    let resumed = client.resume_pending().await.expect("resume");
    let Ok(Resource::Payment(payment)) = &resumed[0].outcome else {
        panic!("{resumed:?}");
    };
    assert!(
        payment.was_replayed(),
        "cobro replays, it does not execute again"
    );
    assert_eq!(payment.value.id, first["id"].as_str().expect("id"));
    assert_eq!(
        payment.idempotency_key.as_deref(),
        Some(intent.key.as_str())
    );

    let again = client
        .create_payment("lost-1/pay", &order("lost-1"))
        .await
        .expect("answered");
    assert!(again.from_journal);
    assert_eq!(again.value.id, payment.value.id);
    assert_eq!(
        app.db.count("payments WHERE order_ref = 'lost-1'").await,
        1,
        "one payment"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_cobro_holds_for_another_request_is_a_key_reused_error_from_the_real_server() {
    let app = TestApp::spawn(Backend::Sqlite).await;
    let key = uuid::Uuid::new_v4().to_string();
    let sent = app
        .post("/v1/payments", Some(&key))
        .json(&json!({"order_ref":"reuse-1","amount":1999,"currency":"EUR","payment_method":"pm_card_visa"}))
        .send()
        .await
        .expect("send");
    assert_eq!(sent.status().as_u16(), 201);
    // A journal that (wrongly) holds the same key for another amount.
    let journal = MemoryJournal::new();
    journal
        .record(NewIntent {
            reference: "reuse-1/pay".into(),
            operation: Operation::Authorize,
            path: "/v1/payments".into(),
            body: serde_json::to_vec(&CreatePayment::new("reuse-1", 2500, "EUR", "pm_card_visa"))
                .expect("json"),
            key,
        })
        .await
        .expect("record");
    let client = Client::new(&app.url, &app.token, journal).expect("client");
    let resumed = client.resume_pending().await.expect("resume");
    let error = resumed[0].outcome.as_ref().expect_err("refused");
    assert!(matches!(error, Error::KeyReused(_)), "{error:?}");
    assert_eq!(
        app.db.count("payments WHERE order_ref = 'reuse-1'").await,
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_token_leaves_the_intent_pending_until_resumed_with_the_right_one() {
    let app = TestApp::spawn(Backend::Sqlite).await;
    let journal = MemoryJournal::new();
    let wrong = Client::new(&app.url, "not-a-token", journal.clone()).expect("client");
    let error = wrong
        .create_payment("tok-1/pay", &order("tok-1"))
        .await
        .expect_err("401");
    assert_eq!(error.code(), Some(&ProblemCode::Unauthenticated));
    assert_eq!(journal.pending().await.expect("pending").len(), 1);

    let right = Client::new(&app.url, &app.token, journal.clone()).expect("client");
    let resumed = right.resume_pending().await.expect("resume");
    assert!(
        matches!(&resumed[0].outcome, Ok(Resource::Payment(p)) if p.status == 201 && !p.was_replayed())
    );
    assert!(journal.pending().await.expect("pending").is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capture_refund_cancel_list_and_wait_through_the_client_move_real_money_once() {
    let rig = Rig::new(Backend::Sqlite).await;
    let client = Client::new(&rig.app.url, &rig.app.token, MemoryJournal::new()).expect("client");

    let created = client
        .create_payment("m-1/pay", &order("m-1").manual())
        .await
        .expect("created");
    assert_eq!(created.status, 201);
    assert_eq!(created.replayed, Some(false));
    assert!(created.location.is_some());
    let id = created.value.id.clone();

    // `wait` returns as soon as the worker has the provider's answer.
    let waiter = {
        let client = client.clone();
        let id = id.clone();
        tokio::spawn(async move { client.wait_for_payment(&id, Duration::from_secs(20)).await })
    };
    rig.drain(10).await;
    let authorized = waiter.await.expect("join").expect("waited");
    assert_eq!(authorized.value.status, PaymentStatus::Authorized);

    let capturing = client.capture("m-1/capture", &id).await.expect("capture");
    assert_eq!(capturing.status, 202);
    rig.drain(10).await;
    let refund = client
        .refund("m-1/refund", &id, &CreateRefund::new(500).reason("damaged"))
        .await
        .expect("refund");
    assert_eq!(refund.status, 201);
    rig.drain(10).await;
    let refunded = client
        .get_refund(&id, &refund.value.id)
        .await
        .expect("get refund");
    assert_eq!(refunded.value.status, RefundStatus::Succeeded);
    let payment = client.payment(&id).await.expect("get");
    assert_eq!(payment.value.status, PaymentStatus::PartiallyRefunded);
    assert_eq!(payment.value.amount_refunded, 500);

    // Cancel of an automatic payment: a stored refusal, typed.
    let auto = client
        .create_payment("a-1/pay", &order("a-1"))
        .await
        .expect("created");
    let refused = client
        .cancel("a-1/cancel", &auto.value.id)
        .await
        .expect_err("automatic payments are refunded, not canceled");
    assert_eq!(refused.code(), Some(&ProblemCode::PaymentNotCancelable));
    assert_eq!(refused.problem().and_then(|p| p.replayed), Some(false));

    let page = client
        .list_payments(&ListPayments {
            order_ref: Some("m-1".into()),
            ..ListPayments::default()
        })
        .await
        .expect("list");
    assert_eq!(page.value.data.len(), 1);

    // `wait` with nothing happening returns the payment still processing.
    let started = Instant::now();
    let still = client
        .wait_for_payment(&auto.value.id, Duration::from_secs(1))
        .await
        .expect("waited");
    assert_eq!(still.value.status, PaymentStatus::Processing);
    assert!(started.elapsed() >= Duration::from_secs(1));

    let ledger = rig.ledger();
    assert!(cobro_test_support::double_charges(&ledger).is_empty());
    let charge = &ledger.charges_with_metadata("cobro_intent", "m-1:authorize-v1");
    assert_eq!(charge.len(), 1);
    assert_eq!(charge[0].amount_captured, 1999);
    assert_eq!(charge[0].amount_refunded, 500);
}
