//! Crash tests on PostgreSQL: real `cobro` processes over a real
//! PostgreSQL, killed with SIGKILL (or stopped with SIGTERM) at the moments
//! that matter, with the fake provider's ledger as the judge: a crash
//! before commit while the transaction waits on a lock (seen in pg_locks),
//! two worker processes on one database, SIGTERM during a provider call,
//! a worker's own reconciliation schedule, two merchants on one order ref,
//! a webhook killed while it waits on the payment's row, a dispatcher
//! killed mid-delivery and the events chaos run.
//!
//! The scenarios of docs/recovery.md §6 run on both stores
//! in tests/scenarios.rs (scenario 7's killed workers and scenario 14's
//! chaos run moved there from here).
//!
//! Layout: [`Cobro`] (tests/support/process.rs) is one child process (its
//! stdout lines, its stderr, a SIGKILL when the test ends or fails);
//! [`Site`] (tests/support/site.rs) is what the processes of one test share
//! (a fresh database with an account and its token, the fake provider
//! running in this test process, the environment); here it is always
//! PostgreSQL, and `site.pg()` makes the checks only PostgreSQL can.
//!
//! The binary: `target/<profile>/cobro`, refused when older than its
//! sources (see `cobro_test_support::process`).
//!
//! Time: the processes use the system clock, so a lease expiry is a real wait.
//! Leases are 2 s (heartbeat 500 ms) and every wait is a condition polled
//! with a deadline.

use cobro_test_support::process::Cobro;
use cobro_test_support::site::{SETTLE, Site, assert_captured_once, id_of};
use cobro_test_support::{
    Backend, Dialect, on_every_dialect, payment_body, provider_ref_of, wait_for,
};
use fake_provider::{FaultAction, FaultRule, Operation as FOp};
use futures::{StreamExt, stream};
use serde_json::Value;
use sqlx::{Connection, PgConnection};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};
use uuid::Uuid;

// The crash tests where the provider's API matters, on both: the fake's
// own API (the environment's provider) and a providers file naming a
// `stripe` provider at the fake's Stripe dialect (`cobro serve`, `worker`
// and `reconcile` reading COBRO_PROVIDERS_FILE). The ledger judges both.
on_every_dialect!(
    two_worker_processes_charge_a_thousand_payments_exactly_once,
    a_crash_before_commit_records_nothing_and_the_retry_executes_once,
    sigterm_lets_an_in_flight_provider_call_finish,
    a_worker_process_reconciles_on_its_own_schedule,
    cobro_reconcile_never_binds_one_merchants_payment_to_anothers_charge,
);

async fn two_worker_processes_charge_a_thousand_payments_exactly_once(dialect: Dialect) {
    const PAYMENTS: usize = 1000;
    let site = Site::new_in(Backend::Postgres, dialect).await;
    let (_api, url) = site.serve("serve", &["--no-worker"], &[]).await;
    // Each worker logs one `provider.call` line per send: proof that both
    // processes took part.
    let calls = [("COBRO_LOG", "warn,cobro_worker=info")];
    let (w1, owner_1) = site.worker("worker 1", &calls).await;
    let (w2, owner_2) = site.worker("worker 2", &calls).await;
    assert_ne!(owner_1, owner_2);

    let started = Instant::now();
    let created: Vec<Value> = stream::iter(0..PAYMENTS)
        .map(|i| {
            let (site, url) = (&site, &url);
            async move {
                site.create_payment(url, &format!("k-{i}"), &payment_body(&format!("o-{i}")))
                    .await
            }
        })
        .buffer_unordered(32)
        .collect()
        .await;
    let created_in = started.elapsed();
    assert_eq!(created.len(), PAYMENTS);

    wait_for(
        "every payment has left processing",
        Duration::from_secs(60),
        async || {
            let (total, processing): (i64, i64) = sqlx::query_as(
                "SELECT COUNT(*), COUNT(*) FILTER (WHERE status = 'processing') FROM payments",
            )
            .fetch_one(site.pg())
            .await
            .expect("counts");
            (total == PAYMENTS as i64 && processing == 0).then_some(())
        },
    )
    .await;
    eprintln!(
        "{PAYMENTS} payments: created in {created_in:?}, all settled after {:?}",
        started.elapsed()
    );

    // What cobro answers, page by page.
    let mut listed: BTreeMap<String, Value> = BTreeMap::new();
    let mut cursor: Option<String> = None;
    loop {
        let after = cursor.take().map(|c| format!("&cursor={c}"));
        let response = site
            .http
            .get(format!(
                "{url}/v1/payments?limit=100{}",
                after.unwrap_or_default()
            ))
            .bearer_auth(&site.token)
            .send()
            .await
            .expect("list");
        assert_eq!(response.status().as_u16(), 200);
        let page: Value = response.json().await.expect("json");
        for payment in page["data"].as_array().expect("data") {
            listed.insert(id_of(payment), payment.clone());
        }
        match page["next_cursor"].as_str() {
            Some(next) => cursor = Some(next.to_owned()),
            None => break,
        }
    }
    assert_eq!(listed.len(), PAYMENTS);
    for payment in &created {
        let id = id_of(payment);
        assert_eq!(listed[&id]["status"], "captured", "{}", listed[&id]);
    }

    // What the provider did: one charge per reference, and it is the
    // charge cobro recorded.
    let ledger = site.ledger();
    assert_eq!(ledger.totals.charges, PAYMENTS as u64);
    assert!(
        ledger.duplicate_charge_references.is_empty(),
        "{:?}",
        ledger.duplicate_charge_references
    );
    assert_eq!(ledger.by_reference.len(), PAYMENTS);
    assert!(ledger.by_reference.values().all(|e| e.charges == 1));
    let site = &site;
    let mismatched: Vec<String> = stream::iter(listed.values())
        .map(|payment| async move {
            let reference = payment["intent"].as_str().expect("intent");
            let charges = site.provider_charges(reference).await;
            let matches = charges.len() == 1 && payment["provider_ref"] == charges[0].as_str();
            (!matches).then(|| format!("{reference}: {charges:?} vs {payment}"))
        })
        .buffer_unordered(32)
        .filter_map(|mismatch| async move { mismatch })
        .collect()
        .await;
    assert!(mismatched.is_empty(), "{mismatched:?}");
    assert_eq!(
        cobro_test_support::double_charges(&ledger),
        Vec::<Vec<String>>::new()
    );
    for payment in listed.values() {
        site.own_charge(&ledger, payment);
    }

    // Every attempt succeeded; every outbox row is done.
    assert_eq!(
        site.count("attempts WHERE state = 'succeeded'").await,
        PAYMENTS as i64
    );
    assert_eq!(site.count("attempts").await, PAYMENTS as i64);
    assert_eq!(
        site.count("outbox WHERE state = 'done'").await,
        PAYMENTS as i64
    );
    let sends = |w: &Cobro| {
        w.stderr()
            .iter()
            .filter(|l| l.contains("provider.call"))
            .count()
    };
    let (sends_1, sends_2) = (sends(&w1), sends(&w2));
    assert!(
        sends_1 > 0 && sends_2 > 0 && sends_1 + sends_2 >= PAYMENTS,
        "both workers sent: {sends_1} + {sends_2}"
    );
    eprintln!("worker 1 sent {sends_1}, worker 2 sent {sends_2}");
}

async fn a_crash_before_commit_records_nothing_and_the_retry_executes_once(dialect: Dialect) {
    let site = Site::new_in(Backend::Postgres, dialect).await;
    let body = payment_body("o-1");
    // An uncommitted payment for the same order: cobro's INSERT of its
    // payment waits on the partial unique index, after it reserved the key
    // in the same transaction.
    let mut blocker = PgConnection::connect(&site.db.url).await.expect("connect");
    let mut blocking = blocker.begin().await.expect("begin");
    sqlx::query(
        "INSERT INTO payments (id, account_id, order_ref, intent, amount, currency, \
         capture_method, payment_method, status, status_changed_at, created_at, updated_at) \
         VALUES ($1, $2, 'o-1', 'o-1:authorize-v1', 1999, 'EUR', 'automatic', 'pm_card_visa', \
         'processing', now(), now(), now())",
    )
    .bind(Uuid::new_v4())
    .bind(site.account)
    .execute(&mut *blocking)
    .await
    .expect("the blocking insert");

    let (mut a, url_a) = site
        .serve(
            "serve A",
            &["--no-worker"],
            &[("COBRO_LOCK_TIMEOUT", "60s")],
        )
        .await;
    let post = tokio::spawn(site.post_payment(&url_a, "k-1", &body).send());
    let backend: i32 = wait_for(
        "cobro's INSERT INTO payments waits on a lock",
        SETTLE,
        async || {
            sqlx::query_scalar(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() \
                 AND wait_event_type = 'Lock' AND query LIKE 'INSERT INTO payments %'",
            )
            .fetch_optional(site.pg())
            .await
            .expect("pg_stat_activity")
        },
    )
    .await;
    let holds_key_lock: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_locks l JOIN pg_class c ON c.oid = l.relation \
         WHERE l.pid = $1 AND c.relname = 'idempotency_records' AND l.mode = 'RowExclusiveLock')",
    )
    .bind(backend)
    .fetch_one(site.pg())
    .await
    .expect("pg_locks");
    assert!(
        holds_key_lock,
        "the key was reserved in the waiting transaction"
    );

    a.kill9();
    let answer = post.await.expect("the request task");
    assert!(answer.is_err(), "the client got no answer: {answer:?}");
    blocking.rollback().await.expect("rollback");
    // With its client gone, the backend ends and its transaction with it.
    backend_ends(&site, backend).await;
    for table in [
        "idempotency_records",
        "payments",
        "intents",
        "attempts",
        "outbox",
    ] {
        assert_eq!(site.count(table).await, 0, "nothing recorded in {table}");
    }

    // The retry, on a new process with a worker: a first execution.
    let (_b, url_b) = site.serve("serve B", &[], &[]).await;
    let created = site.create_payment(&url_b, "k-1", &body).await;
    assert_eq!(created["intent"], "o-1:authorize-v1");
    let payment = site.settled_payment(&url_b, &id_of(&created)).await;
    assert_captured_once(&site, &payment, 1).await;
    assert_eq!(site.count("payments").await, 1);
    assert_eq!(site.count("idempotency_records").await, 1);
}

async fn sigterm_lets_an_in_flight_provider_call_finish(dialect: Dialect) {
    // COBRO_SHUTDOWN_GRACE below.
    const GRACE: Duration = Duration::from_secs(10);
    let site = Site::new_in(Backend::Postgres, dialect).await;
    site.hold_next_charge_answer(Duration::from_secs(1));
    let (_api, url) = site.serve("serve", &["--no-worker"], &[]).await;
    let created = site.create_payment(&url, "k-1", &payment_body("o-1")).await;
    let id = id_of(&created);
    let (mut worker, _) = site
        .worker(
            "worker",
            &[
                ("COBRO_PROVIDER_TIMEOUT", "5s"),
                ("COBRO_SHUTDOWN_GRACE", "10s"),
                // For the line saying how many calls were in flight.
                ("COBRO_LOG", "warn,cobro_worker=info"),
            ],
        )
        .await;
    site.charged("o-1:authorize-v1").await;
    assert_eq!(
        site.count("attempts WHERE state = 'pending' AND send_count = 1")
            .await,
        1,
        "the answer is still on its way"
    );
    let stopped_at = Instant::now();
    worker.sigterm();
    let status = worker.exit_within(GRACE).await;
    let stopped_in = stopped_at.elapsed();
    assert!(status.success(), "exit status after SIGTERM: {status:?}");
    let stderr = worker.stderr();
    assert!(
        stderr
            .iter()
            .any(|l| l.contains("letting in-flight calls finish") && l.contains("in_flight=1")),
        "the call was in flight when the signal came: {stderr:?}"
    );
    assert!(
        !stderr.iter().any(|l| l.contains("grace period over")),
        "{stderr:?}"
    );
    eprintln!("the worker stopped {stopped_in:?} after SIGTERM");

    let payment = site.payment(&url, &id).await;
    assert_captured_once(&site, &payment, 1).await;
    assert_eq!(site.count("outbox WHERE state = 'done'").await, 1);
}

/// Point 7: `cobro worker` (and `serve --no-worker`) run the scheduled
/// reconciler. The provider drops every answer, the short key window
/// closes, the worker hands the attempt over; only a reconciler can settle
/// it, and no `cobro reconcile` is run.
async fn a_worker_process_reconciles_on_its_own_schedule(dialect: Dialect) {
    let site = Site::new_in(Backend::Postgres, dialect).await;
    site.provider.control().add_fault(FaultRule::new(
        FOp::Charge,
        FaultAction::DropResponseAfterEffect,
    ));
    let (_api, url) = site
        .serve("serve", &["--no-worker", "--no-reconciler"], &[])
        .await;
    let created = site.create_payment(&url, "k-1", &payment_body("o-1")).await;
    let id = id_of(&created);
    let window = [
        ("COBRO_PROVIDER_KEY_RETENTION", "3s"),
        ("COBRO_PROVIDER_KEY_SAFETY_MARGIN", "1s"),
        ("COBRO_PROVIDER_TIMEOUT", "1s"),
        ("COBRO_PROVIDER_SEARCH_LAG", "1s"),
        ("COBRO_RECONCILE_SCHEDULE", "* * * * * *"),
    ];
    let (_worker, _) = site.worker("worker", &window).await;
    let payment = wait_for(
        "the worker's reconciler settles it",
        SETTLE * 2,
        async || {
            let p = site.payment(&url, &id).await;
            (p["status"] == "captured").then_some(p)
        },
    )
    .await;
    let decided: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM reconciliation_decisions WHERE decision = 'adopt_succeeded' \
         AND actor LIKE 'reconciler:%'",
    )
    .fetch_one(site.pg())
    .await
    .expect("audit");
    assert_eq!(decided, 1, "decided by the worker process's reconciler");
    let ledger = site.ledger();
    assert_eq!(ledger.totals.charges, 1);
    let charge = site.own_charge(&ledger, &payment);
    assert_eq!(charge.status, "captured");
}

/// Point 1, as it was reproduced: two merchants, one order ref, one
/// provider API key. B is captured; A's attempt goes unknown; `cobro
/// reconcile --payment A --older-than 0s` must not bind A to B's charge.
// The fake dialect only: the event is hand-made in the fake's shape.
#[tokio::test]
async fn a_webhook_killed_while_it_waits_on_the_payment_keeps_nothing_and_its_redelivery_stops_the_line_postgres_fake()
 {
    a_webhook_killed_while_it_waits_on_the_payment_keeps_nothing_and_its_redelivery_stops_the_line(
    )
    .await;
}

async fn cobro_reconcile_never_binds_one_merchants_payment_to_anothers_charge(dialect: Dialect) {
    let site = Site::new_in(Backend::Postgres, dialect).await;
    let now = chrono::Utc::now();
    let b = site
        .db
        .store
        .create_account("merchant-b", now)
        .await
        .expect("account");
    let token_b = format!("test_{}", Uuid::new_v4().simple());
    site.db
        .store
        .create_token(b, "b", &cobro_api::token_hash(&token_b), now)
        .await
        .expect("token");
    let (_api, url) = site.serve("serve", &[], &[]).await;
    let created_b: Value = site
        .http
        .post(format!("{url}/v1/payments"))
        .bearer_auth(&token_b)
        .header("idempotency-key", "b-1")
        .json(&payment_body("ord-1"))
        .send()
        .await
        .expect("answer")
        .json()
        .await
        .expect("json");
    site.charged("ord-1:authorize-v1").await;
    let ledger = site.ledger();
    let b_charge = provider_ref_of(&ledger, &ledger.charges[0].id).to_owned();
    site.provider
        .control()
        .add_fault(FaultRule::new(FOp::Charge, FaultAction::FailBeforeEffect));
    let created_a = site
        .create_payment(&url, "a-1", &payment_body("ord-1"))
        .await;
    let a = id_of(&created_a);
    // The worker has sent A's charge (and lost it to the fault): only a
    // sent attempt is the reconciler's to examine.
    wait_for("A's charge was sent and failed", SETTLE, async || {
        let fired: u64 = site
            .provider
            .control()
            .faults_fired()
            .iter()
            .map(|f| f.count)
            .sum();
        (fired > 0).then_some(())
    })
    .await;
    // A run that starts just before the worker resends (its backoff is
    // 200 ms) finds A's last send newer than itself and examines nothing:
    // ask again until a run examined A.
    let (code, summary) = wait_for("cobro reconcile examines A", SETTLE, async || {
        let (code, summary) = site
            .reconcile(&["--payment", &a, "--older-than", "0s"], &[])
            .await;
        (summary["examined"] == 1).then_some((code, summary))
    })
    .await;
    assert_ne!(code, Some(0), "nothing is proven for A: {summary}");
    assert_eq!(summary["resolved"], serde_json::json!({}), "{summary}");
    let a_now = site.payment(&url, &a).await;
    assert_eq!(a_now["status"], "processing", "{a_now}");
    assert_eq!(a_now["provider_ref"], Value::Null);
    // The provider recovers: A is charged under its own identity.
    site.provider.control().clear_faults();
    let a_now = site.settled_payment(&url, &a).await;
    assert_eq!(a_now["status"], "captured");
    assert_ne!(a_now["provider_ref"], b_charge.as_str());
    let ledger = site.ledger();
    assert_eq!(ledger.totals.charges, 2);
    assert!(cobro_test_support::double_charges(&ledger).is_empty());
    let b_id = created_b["id"].as_str().expect("id");
    site.own_charge(&ledger, &a_now);
    let b_now: Value = site
        .http
        .get(format!("{url}/v1/payments/{b_id}"))
        .bearer_auth(&token_b)
        .send()
        .await
        .expect("answer")
        .json()
        .await
        .expect("json");
    assert_eq!(b_now["provider_ref"], b_charge.as_str());
    let b_own = ledger
        .charges_with_metadata("cobro_payment", b_id)
        .into_iter()
        .map(|c| provider_ref_of(&ledger, &c.id))
        .collect::<Vec<_>>();
    assert_eq!(b_own, [b_charge.as_str()], "B's one charge is its own");
}

/// Waits until PostgreSQL backend `pid`, orphaned by a killed process,
/// has ended, and its transaction with it.
async fn backend_ends(site: &Site, pid: i32) {
    wait_for("the killed process's backend ends", SETTLE, async || {
        let alive: bool =
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1)")
                .bind(pid)
                .fetch_one(site.pg())
                .await
                .expect("pg_stat_activity");
        (!alive).then_some(())
    })
    .await;
}

/// A hand-made `charge.captured` event of the fake dialect for charge `id`
/// (1999 EUR), naming the attempt `reference`, with its signature header
/// for `secret` at the system clock's now.
fn signed_charge_event(
    secret: &str,
    event_id: &str,
    id: &str,
    reference: &str,
    sequence: i64,
) -> (Vec<u8>, String) {
    let now = chrono::Utc::now();
    let event = serde_json::json!({
        "id": event_id, "type": "charge.captured", "created": now, "sequence": sequence,
        "data": {"id": id, "object": "charge", "amount": 1999, "currency": "EUR",
                 "payment_method": "pm_card_visa", "reference": reference,
                 "status": "captured", "amount_captured": 1999, "amount_refunded": 0,
                 "created": now, "sequence": sequence},
    });
    let body = serde_json::to_vec(&event).expect("json");
    let signature = fake_provider::sign(secret, now.timestamp(), &body);
    (body, signature)
}

/// The webhook transaction killed half-way, on the evidence the per-charge
/// ordering is about. Merchants A and B both pay order o-1; A's payment is
/// captured with charge X, whose event is recorded (A's provider sequence
/// is 1). Then an event of another charge Y, sequence 1 of its own, names
/// A's authorisation: a charge A's record denies. A `serve --no-worker`
/// takes it, keeps its receipt and waits on A's payment row (held by
/// another transaction, seen in pg_stat_activity), and is SIGKILLed there.
/// Nothing of it is kept: no receipt, no conflict, A still captured. The
/// redelivery to another process is a conflict that stops the line, once;
/// B's payment is untouched, and the provider made one charge per merchant.
async fn a_webhook_killed_while_it_waits_on_the_payment_keeps_nothing_and_its_redelivery_stops_the_line()
 {
    const SECRET: &str = "whsec_crash_test_secret";
    let site = Site::new_in(Backend::Postgres, Dialect::Fake).await;
    let env = [("COBRO_WEBHOOK_SECRET", SECRET)];
    let (_api, url) = site.serve("serve", &[], &env).await;
    let token_b = site.new_account("merchant-b").await;
    let answer = site
        .post_as(&token_b, &url, "/v1/payments", "b-1", &payment_body("o-1"))
        .send()
        .await
        .expect("answer");
    assert_eq!(answer.status().as_u16(), 201);
    let b = id_of(&answer.json().await.expect("json"));
    let created = site.create_payment(&url, "a-1", &payment_body("o-1")).await;
    let a = id_of(&created);
    let a_now = site.settled_payment(&url, &a).await;
    assert_eq!(a_now["status"], "captured");
    let x = a_now["provider_ref"]
        .as_str()
        .expect("A's charge")
        .to_owned();
    let ledger = site.ledger();
    let reference = ledger
        .charges
        .iter()
        .find(|c| c.id == x)
        .expect("X in the ledger")
        .reference
        .clone();
    // B's payment settles on its own time (the worker may take it after
    // A's): waited for, not assumed.
    let b_before = wait_for("B's payment is captured", SETTLE, async || {
        let b_now = site
            .get_as(&token_b, &url, &format!("/v1/payments/{b}"))
            .await;
        (b_now.1["status"] == "captured").then_some(b_now)
    })
    .await;
    let deliver = |base: &str, (body, signature): (Vec<u8>, String)| {
        site.http
            .post(site.webhook_url(base))
            .header("content-type", "application/json")
            .header(fake_provider::SIGNATURE_HEADER, signature)
            .body(body)
            .send()
    };
    let outcome = async |answer: reqwest::Result<reqwest::Response>| {
        let receipt: Value = answer.expect("answer").json().await.expect("receipt");
        receipt["outcome"].as_str().unwrap_or_default().to_owned()
    };
    let x_event = signed_charge_event(SECRET, "evt_x1", &x, &reference, 1);
    assert_eq!(
        outcome(deliver(&url, x_event).await).await,
        "duplicate_effect"
    );

    // A's payment row is held; serve B takes Y's event and waits on it.
    let mut blocker = PgConnection::connect(&site.db.url).await.expect("connect");
    let mut blocking = blocker.begin().await.expect("begin");
    sqlx::query("SELECT 1 FROM payments WHERE id = $1 FOR UPDATE")
        .bind(Uuid::parse_str(&a).expect("uuid"))
        .execute(&mut *blocking)
        .await
        .expect("lock A's payment");
    let (mut killed, url_b) = site
        .serve(
            "serve B",
            &["--no-worker"],
            &[env[0], ("COBRO_LOCK_TIMEOUT", "60s")],
        )
        .await;
    let y_event = || signed_charge_event(SECRET, "evt_y1", "ch_other", &reference, 1);
    let in_flight = tokio::spawn(deliver(&url_b, y_event()));
    let backend: i32 = wait_for("the webhook waits on A's payment", SETTLE, async || {
        sqlx::query_scalar(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() \
             AND wait_event_type = 'Lock'",
        )
        .fetch_optional(site.pg())
        .await
        .expect("pg_stat_activity")
    })
    .await;
    killed.kill9();
    assert!(in_flight.await.expect("task").is_err(), "no answer");
    blocking.rollback().await.expect("rollback");
    backend_ends(&site, backend).await;
    assert_eq!(
        site.count("webhook_events WHERE event_id = 'evt_y1'").await,
        0
    );
    assert_eq!(site.count("evidence_conflicts").await, 0);
    assert_eq!(site.payment(&url, &a).await["status"], "captured");

    // The provider redelivers, to the process still running.
    assert_eq!(outcome(deliver(&url, y_event()).await).await, "conflict");
    assert_eq!(
        outcome(deliver(&url, y_event()).await).await,
        "duplicate_delivery"
    );
    assert_eq!(site.count("evidence_conflicts").await, 1);
    assert_eq!(site.payment(&url, &a).await["status"], "needs_review");
    let b_after = site
        .get_as(&token_b, &url, &format!("/v1/payments/{b}"))
        .await;
    assert_eq!(b_after, b_before, "B's payment is untouched");
    let ledger = site.ledger();
    assert_eq!(ledger.totals.charges, 2, "one charge per merchant");
    assert!(cobro_test_support::double_charges(&ledger).is_empty());
}

/// A merchant endpoint for the dispatcher's crash test: it records every
/// delivery (the event id and body) and holds the FIRST one forever, so a
/// dispatcher can be killed while its POST is in flight.
async fn holding_endpoint() -> (String, Arc<Mutex<Vec<Value>>>) {
    let received: Arc<Mutex<Vec<Value>>> = Arc::default();
    let seen = received.clone();
    let app = axum::Router::new().route(
        "/events",
        axum::routing::post(move |body: axum::body::Bytes| {
            let seen = seen.clone();
            async move {
                let event: Value = serde_json::from_slice(&body).expect("an event");
                let first = {
                    let mut seen = seen.lock().unwrap_or_else(PoisonError::into_inner);
                    seen.push(event);
                    seen.len() == 1
                };
                if first {
                    std::future::pending::<()>().await;
                }
                axum::http::StatusCode::OK
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}/events", listener.local_addr().expect("addr"));
    tokio::spawn(async move { axum::serve(listener, app).await.expect("serve") });
    (url, received)
}

/// A dispatcher (`cobro worker`) SIGKILLed while its POST of an event is in
/// flight leaves a lease that expires; another `cobro worker` sends the
/// same event (same id, same body) again, and every event of the payment
/// reaches the endpoint, in sequence order per payment once deduplicated.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dispatcher_killed_mid_delivery_is_finished_by_another_with_the_same_event_id() {
    let site = Site::new(Backend::Postgres).await;
    let (endpoint, received) = holding_endpoint().await;
    let (_api, url) = site.serve("serve", &["--no-dispatcher"], &[]).await;
    let created = site
        .http
        .post(format!("{url}/v1/event_endpoints"))
        .bearer_auth(&site.token)
        .json(&serde_json::json!({"url": endpoint}))
        .send()
        .await
        .expect("endpoint");
    assert_eq!(created.status().as_u16(), 201);
    let payment = site.create_payment(&url, "k-1", &payment_body("o-1")).await;
    let payment = site.settled_payment(&url, &id_of(&payment)).await;
    assert_eq!(payment["status"], "captured");
    let dispatcher_env = [
        ("COBRO_EVENTS_TIMEOUT", "2s"),
        ("COBRO_EVENTS_POLL", "100ms"),
        ("COBRO_NO_RECONCILER", "true"),
    ];

    let (mut a, _) = site.worker("dispatcher A", &dispatcher_env).await;
    let held = wait_for("the endpoint holds A's first POST", SETTLE, async || {
        let seen = received.lock().unwrap_or_else(PoisonError::into_inner);
        seen.first().cloned()
    })
    .await;
    a.kill9();
    let (_b, _) = site.worker("dispatcher B", &dispatcher_env).await;
    let events = site.count("events").await as usize;
    assert_eq!(events, 2, "payment.created and payment.captured");
    wait_for("every delivery is delivered", SETTLE, async || {
        (site
            .count("event_deliveries WHERE state = 'delivered'")
            .await as usize
            == events)
            .then_some(())
    })
    .await;
    let seen = received
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clone();
    let copies = seen.iter().filter(|e| e["id"] == held["id"]).count();
    assert!(copies >= 2, "the held event was sent again: {seen:?}");
    assert!(
        seen.iter()
            .filter(|e| e["id"] == held["id"])
            .all(|e| *e == held),
        "every copy is the same event"
    );
    let mut ids: Vec<&str> = seen.iter().map(|e| e["id"].as_str().expect("id")).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), events, "every event arrived");
    // Deduplicated, the last applied state is the payment's.
    let last = seen
        .iter()
        .max_by_key(|e| e["sequence"].as_i64().expect("sequence"))
        .expect("an event");
    let mut shown = payment.clone();
    shown.as_object_mut().expect("object").remove("attempts");
    assert_eq!(last["data"], shown);
    assert_eq!(
        cobro_test_support::for_intent(&site.ledger(), "o-1:authorize-v1").charges,
        1,
        "one charge at the provider"
    );
}

use crate::merchant;

/// The "done when" at process level: a chaos run (provider faults,
/// an 8 s key window, workers SIGKILLed and restarted, each with its
/// dispatcher) with a merchant endpoint that misbehaves and is down for a
/// while in the middle. Once quiet, the endpoint holds exactly cobro's
/// final state for every payment (applied by sequence, deduplicated by id
/// with `cobro-client`), which is the provider's; every event reached it,
/// and the feed from its start has every event with no gap.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chaos_with_a_merchant_endpoint_down_for_a_while_ends_with_the_endpoint_equal_to_cobro() {
    const PAYMENTS: usize = 150;
    let site = Site::with_provider(
        Backend::Postgres,
        fake_provider::Config {
            admin: true,
            seed: 18,
            retention: Duration::from_secs(8),
            ..Default::default()
        },
    )
    .await;
    let control = site.provider.control();
    let chance = |op, action, p: f64| FaultRule::new(op, action).with_probability(p);
    for rule in [
        chance(FOp::Charge, FaultAction::FailBeforeEffect, 0.05),
        chance(FOp::Charge, FaultAction::FailAfterEffect, 0.05),
        chance(FOp::Charge, FaultAction::DropResponseAfterEffect, 0.05),
        chance(FOp::Charge, FaultAction::SearchLag, 0.2).with_lag_seconds(2),
    ] {
        control.add_fault(rule);
    }
    let env: &[(&str, &str)] = &[
        ("COBRO_PROVIDER_TIMEOUT", "1s"),
        ("COBRO_PROVIDER_KEY_RETENTION", "8s"),
        ("COBRO_PROVIDER_KEY_SAFETY_MARGIN", "4s"),
        ("COBRO_PROVIDER_SEARCH_LAG", "3s"),
        ("COBRO_RECONCILE_STUCK_AFTER", "5s"),
        ("COBRO_EVENTS_TIMEOUT", "1s"),
        ("COBRO_EVENTS_POLL", "100ms"),
        ("COBRO_EVENTS_BACKOFF_BASE", "100ms"),
        ("COBRO_EVENTS_BACKOFF_CAP", "1s"),
    ];
    let merchant = merchant::Merchant::start(
        Arc::new(cobro_core::SystemClock),
        Duration::from_millis(1500),
    )
    .await;
    merchant.script(&[
        merchant::Answer::Fail500,
        merchant::Answer::Hang,
        merchant::Answer::Close,
        merchant::Answer::Slow,
        merchant::Answer::Slow,
    ]);
    let (_api, url) = site
        .serve("api", &["--no-worker", "--no-dispatcher"], env)
        .await;
    let endpoint: Value = site
        .http
        .post(format!("{url}/v1/event_endpoints"))
        .bearer_auth(&site.token)
        .json(&serde_json::json!({"url": merchant.url}))
        .send()
        .await
        .expect("endpoint")
        .json()
        .await
        .expect("json");
    merchant
        .secrets
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .push(endpoint["secret"].as_str().expect("secret").to_owned());
    let mut workers = Vec::new();
    for i in 0..2 {
        workers.push(site.worker(&format!("worker {i}"), env).await.0);
    }

    let mut created = Vec::new();
    for i in 0..PAYMENTS {
        let mut body = payment_body(&format!("chaos-{i}"));
        if i % 10 == 0 {
            body["payment_method"] = "pm_card_declined".into();
        }
        created.push(
            site.create_payment(&url, &format!("chaos-key-{i}"), &body)
                .await,
        );
        match i {
            // Down for a while, with workers killed while it is.
            50 => merchant.go_down(),
            75 | 100 => {
                let victim = i % 2;
                workers[victim].kill9();
                workers[victim] = site.worker(&format!("worker {victim} again"), env).await.0;
            }
            110 => merchant.come_back().await,
            _ => {}
        }
    }

    site.reconcile_until_settled(env).await;
    let events = wait_for(
        "every event is delivered",
        Duration::from_secs(60),
        async || {
            let events = site.count("events").await;
            let delivered = site
                .count("event_deliveries WHERE state = 'delivered'")
                .await;
            (events > 0 && delivered == events).then_some(events)
        },
    )
    .await;
    assert_eq!(site.count("event_deliveries WHERE state = 'dead'").await, 0);
    assert!(
        site.count("event_deliveries WHERE attempts > 1").await > 0,
        "the endpoint's faults and its downtime caused retries"
    );

    // Every event reached the endpoint; copies are the same event.
    let feed: Vec<(i64, String)> =
        sqlx::query_as("SELECT feed_position, id::text FROM events ORDER BY feed_position")
            .fetch_all(site.pg())
            .await
            .expect("feed");
    assert_eq!(
        feed.iter().map(|(p, _)| *p).collect::<Vec<_>>(),
        (1..=events).collect::<Vec<_>>(),
        "the feed is dense"
    );
    let mut got: BTreeMap<String, Vec<Vec<u8>>> = BTreeMap::new();
    for r in merchant
        .received
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .iter()
    {
        got.entry(r.event.id.clone())
            .or_default()
            .push(r.raw.to_vec());
    }
    assert_eq!(
        got.keys().cloned().collect::<Vec<_>>(),
        {
            let mut ids: Vec<String> = feed.iter().map(|(_, id)| id.clone()).collect();
            ids.sort();
            ids
        },
        "every event, and only cobro's"
    );
    assert!(got.values().all(|c| c.windows(2).all(|w| w[0] == w[1])));
    for (object, sequences) in &merchant.applied().await {
        assert!(
            sequences.windows(2).all(|w| w[0] < w[1]),
            "{object}: {sequences:?}"
        );
    }

    // The endpoint's state is cobro's, and cobro's is the provider's.
    control.clear_faults();
    let state = merchant.state().await;
    let ledger = site.ledger();
    for first in &created {
        let mut payment = site.payment(&url, &id_of(first)).await;
        payment.as_object_mut().expect("object").remove("attempts");
        let id = id_of(&payment);
        assert_eq!(
            state.get(&id),
            Some(&payment),
            "the endpoint's view of {id}"
        );
        let reference = payment["intent"].as_str().expect("intent");
        let effects = cobro_test_support::for_intent(&ledger, reference);
        match payment["status"].as_str() {
            Some("captured") => {
                assert_eq!(effects.charges, 1, "{reference}");
                let charge = ledger
                    .charges
                    .iter()
                    .find(|c| payment["provider_ref"] == c.id.as_str())
                    .expect("its charge");
                assert_eq!(
                    charge.amount_captured,
                    payment["amount_captured"].as_i64().expect("n")
                );
            }
            Some("declined") => assert_eq!(effects.charges, 0, "{reference}"),
            other => panic!("{reference}: {other:?}"),
        }
    }
}

/// Scenario 14's chaos run (tests/support/chaos.rs; every fault, worker
/// and API kills, reconcilers racing throughout and two at the end,
/// duplicated and reordered webhooks) with every `cobro` process reading a
/// providers file that names a `stripe` provider at the fake's Stripe
/// dialect, which sends Stripe's webhooks to `/v1/webhooks/stripe`.
/// PostgreSQL, 500 orders per account as on the fake's dialect: the same
/// faults must each fire and the same kills happen, and each payment must
/// equal its own PaymentIntent with no intent charged twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chaos_on_the_stripe_dialect_every_fault_and_kills_then_each_payment_equals_its_own_payment_intent()
 {
    cobro_test_support::chaos::chaos_run(Backend::Postgres, Dialect::Stripe).await;
}

/// `cobro worker` and `cobro serve` on PostgreSQL refuse at start a pool
/// that their LISTEN connections would fill (each worker's for new work,
/// the long polls' for settled payments), naming the setting and the
/// smallest size that works; nothing is charged. The smallest size does
/// work: a worker with a pool of 2 charges a payment exactly once. SQLite
/// holds no connection for LISTEN, so a pool of 1 is enough there.
#[tokio::test]
async fn a_pool_the_listeners_would_fill_is_refused_at_start_and_the_smallest_that_works_charges_once()
 {
    let refused = |site: &Site, args: &'static [&'static str], pool: &'static str| {
        let mut command = site.command(args, &[("COBRO_DB_MAX_CONNECTIONS", pool)]);
        async move {
            tokio::task::spawn_blocking(move || command.output())
                .await
                .expect("join")
                .expect("cobro runs")
        }
    };
    let site = Site::new(Backend::Postgres).await;
    // A payment waits in the outbox while the refused processes start.
    let (_api, url) = site.serve("serve", &["--no-worker"], &[]).await;
    let created = site
        .create_payment(&url, "pool-2", &payment_body("pedido-pool"))
        .await;
    for (args, pool, least) in [
        (&["worker"][..], "1", "at least 2"),
        (
            &["serve", "--listen", "127.0.0.1:0", "--no-worker"][..],
            "1",
            "at least 2",
        ),
        (&["serve", "--listen", "127.0.0.1:0"][..], "2", "at least 3"),
    ] {
        let output = refused(&site, args, pool).await;
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(
            output.status.code(),
            Some(1),
            "{args:?} with {pool}: {stderr}"
        );
        assert!(
            stderr.contains("COBRO_DB_MAX_CONNECTIONS") && stderr.contains(least),
            "{args:?} with {pool}: {stderr}"
        );
        assert!(!String::from_utf8_lossy(&output.stdout).contains("running as"));
    }
    // None of them sent the waiting payment: the provider made nothing.
    assert_eq!(site.ledger().totals.charges, 0);
    assert_eq!(
        site.payment(&url, &id_of(&created)).await["status"],
        "processing"
    );

    let (_worker, _) = site
        .worker("worker (pool 2)", &[("COBRO_DB_MAX_CONNECTIONS", "2")])
        .await;
    let payment = site.payment_in(&url, &id_of(&created), "captured").await;
    assert_captured_once(&site, &payment, 1).await;

    let site = Site::new(Backend::Sqlite).await;
    let (_api, url) = site.serve("serve", &["--no-worker"], &[]).await;
    let created = site
        .create_payment(&url, "pool-1", &payment_body("pedido-pool"))
        .await;
    let (_worker, _) = site
        .worker(
            "worker (pool 1, SQLite)",
            &[("COBRO_DB_MAX_CONNECTIONS", "1")],
        )
        .await;
    let payment = site.payment_in(&url, &id_of(&created), "captured").await;
    assert_captured_once(&site, &payment, 1).await;
}

/// 3-D Secure (issue 49): a worker process is SIGKILLed while a payment
/// waits for its customer. Nothing about the waiting attempt depends on
/// that process: a new worker and a `cobro reconcile` run resend nothing
/// (one create at the provider, under the attempt's key) and leave it
/// waiting; once the customer completes the challenge, the reconciler's
/// read of the PaymentIntent by its id captures it, with one charge.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_killed_while_a_payment_waits_for_its_customer_resends_nothing() {
    let site = Site::new_in(Backend::Postgres, Dialect::Stripe).await;
    let (_api, url) = site
        .serve("serve", &["--no-worker", "--no-reconciler"], &[])
        .await;
    let (mut w1, _) = site.worker("worker 1", &[]).await;
    let mut body = payment_body("pedido-842");
    body["payment_method"] = serde_json::json!("pm_card_authenticationRequired");
    body["return_url"] = serde_json::json!("https://shop.example/vuelta");
    let created = site.create_payment(&url, "k-3ds", &body).await;
    let id = id_of(&created);
    let waiting = wait_for("the payment waits for its customer", SETTLE, async || {
        let payment = site.payment(&url, &id).await;
        (payment["status"] == "requires_action").then_some(payment)
    })
    .await;
    w1.kill9();
    let creates = || cobro_test_support::posts_to(&site.provider, "/v1/payment_intents");
    assert_eq!(creates(), 1);

    let (_w2, _) = site.worker("worker 2", &[]).await;
    let stuck_now = [("COBRO_RECONCILE_STUCK_AFTER", "0s")];
    let (code, summary) = site.reconcile(&[], &stuck_now).await;
    assert_eq!(code, Some(0), "{summary}");
    assert_eq!(
        summary["examined"], 0,
        "not the unknown-outcome path: {summary}"
    );
    assert_eq!(site.payment(&url, &id).await["status"], "requires_action");
    assert_eq!(creates(), 1, "never resent, never a new key");
    assert_eq!(site.provider.control().ledger().totals.charges, 0);

    let challenge = waiting["next_action"]["redirect_to_url"]["url"]
        .as_str()
        .expect("the challenge")
        .to_owned();
    let answer = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .expect("client")
        .post(format!("{challenge}/complete"))
        .send()
        .await
        .expect("complete");
    assert_eq!(answer.status().as_u16(), 303);
    let (code, summary) = site.reconcile(&[], &stuck_now).await;
    assert_eq!(code, Some(0), "{summary}");
    let payment = site.payment(&url, &id).await;
    assert_eq!(payment["status"], "captured", "{payment}");
    let ledger = site.provider.control().ledger();
    assert_eq!(ledger.totals.charges, 1, "{ledger:?}");
    assert_eq!(creates(), 1);
    assert_eq!(site.db.count("evidence_conflicts").await, 0);
}

/// The database stops answering without closing anything (a frozen
/// primary; a partition with no router in between to cut the sessions).
/// `cobro serve` (API, worker and reconciler in one process) answers 503
/// instead of holding requests: its own deadline (`COBRO_DB_DEADLINE`)
/// gives each call up, long before the HTTP request timeout would. Once the
/// database answers again, the same key sent by two merchants that share it
/// and the order ref executes once for each, the worker (never restarted)
/// charges each payment once, and the provider's ledger holds exactly those
/// charges.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_database_that_stops_answering_gets_503s_not_hangs_and_the_retries_charge_once() {
    use cobro_test_support::freeze::{FreezingProxy, server_of};
    let site = Site::new(Backend::Postgres).await;
    let other = site.new_account("other").await;
    let proxy = FreezingProxy::start(server_of(&site.db.url).await).await;
    let through = proxy.url_through(&site.db.url);
    let (_serve, api) = site
        .serve(
            "serve",
            &[],
            &[
                ("COBRO_DATABASE_URL", through.as_str()),
                ("COBRO_DB_DEADLINE", "1s"),
                ("COBRO_HTTP_REQUEST_TIMEOUT", "300s"),
            ],
        )
        .await;
    let first = site.create_payment(&api, "k-1", &payment_body("o-1")).await;
    site.payment_in(&api, &id_of(&first), "captured").await;

    proxy.freeze();
    // A request cobro never gave up on fails the test here, not at the
    // suite's timeout.
    let guard = Duration::from_secs(120);
    let body = payment_body("o-2");
    for token in [&site.token, &other] {
        let answer = tokio::time::timeout(
            guard,
            site.post_as(token, &api, "/v1/payments", "k-2", &body)
                .send(),
        )
        .await
        .expect("cobro held the request while the database was silent")
        .expect("an answer");
        assert_eq!(answer.status().as_u16(), 503);
        let problem: Value = answer.json().await.expect("problem+json");
        assert!(
            problem["type"]
                .as_str()
                .is_some_and(|t| t.ends_with("service-unavailable")),
            "{problem}"
        );
    }

    proxy.thaw();
    let mut created = Vec::new();
    for token in [&site.token, &other] {
        // The same key again, as a client must after a 503, until stored.
        let payment: Value = wait_for("the retry is answered 201", SETTLE, async || {
            let answer = site
                .post_as(token, &api, "/v1/payments", "k-2", &body)
                .send()
                .await
                .expect("an answer");
            match answer.status().as_u16() {
                201 => Some(answer.json().await.expect("json")),
                503 => None,
                other => panic!("k-2 answered {other}"),
            }
        })
        .await;
        created.push(payment);
    }
    assert_ne!(created[0]["id"], created[1]["id"], "one payment each");
    for (token, payment) in [&site.token, &other].into_iter().zip(&created) {
        let id = id_of(payment);
        let captured = wait_for(&format!("{id} is captured"), SETTLE, async || {
            let (_, now) = site
                .get_as(token, &api, &format!("/v1/payments/{id}"))
                .await;
            (now["status"] == "captured").then_some(now)
        })
        .await;
        assert_eq!(captured["attempts"].as_array().map(Vec::len), Some(1));
    }
    assert_eq!(site.count("payments").await, 3);
    let ledger = site.ledger();
    assert_eq!(ledger.totals.charges, 3, "one charge per payment");
    assert!(ledger.duplicate_charge_references.is_empty());
}
