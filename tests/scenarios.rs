//! The 14 scenarios of docs/recovery.md §6, each at process
//! level on both stores: real `cobro serve`, `cobro worker` and `cobro
//! reconcile` processes over a fresh PostgreSQL database or SQLite file
//! ([`Site`], tests/support/site.rs), SIGKILLed (or SIGSTOPped) where the
//! scenario kills, the fake provider in this test process. Every test
//! asserts the HTTP answers and the provider's ledger: the charges,
//! captures and refunds it actually made, per payment (its own charge,
//! found by cobro's attempt metadata) and per intent.
//!
//! Layout: one test per scenario, in the order of §6, then the helpers
//! they share. The tests start the fewest processes they need: one `cobro
//! serve` with its worker unless the scenario kills or stops a worker, or
//! spreads requests over two servers.
//!
//! Time: the processes use the system clock. Real time is spent only where
//! a lease (2 s), a retention or a provider timeout forces it; every wait
//! is a condition with a deadline ([`wait_for`]).

use cobro_test_support::process::Cobro;
use cobro_test_support::site::{SETTLE, Site, assert_captured_once, id_of, replayed};
use cobro_test_support::{
    Backend, Dialect, double_charges, for_intent, manual_payment_body, on_both_backends,
    payment_body, wait_for,
};
use fake_provider::{FaultAction, FaultRule, Operation as FOp, WebhookDelivery, WebhookTarget};
use serde_json::{Value, json};
use sqlx::Connection;
use sqlx::sqlite::{SqliteConnectOptions, SqliteConnection};
use std::collections::BTreeSet;
use std::str::FromStr;
use std::time::Duration;

on_both_backends!(
    s01_same_key_and_body_in_sequence_is_one_payment_one_charge_and_identical_answers,
    s02_one_key_sent_concurrently_to_two_servers_is_one_payment_and_one_charge,
    s03_same_key_with_another_body_is_422_and_changes_nothing,
    s04_a_crash_before_commit_records_nothing_and_the_retry_executes_once,
    s05_a_crash_after_commit_before_the_answer_replays_on_retry_with_one_charge,
    s06_a_lost_or_late_answer_after_the_charge_is_one_charge_with_its_provider_ref,
    s07_a_worker_killed_between_charge_and_record_is_finished_by_another_or_by_cobro_reconcile,
    s08_a_stale_lease_owners_late_answer_overwrites_nothing,
    s09_an_expired_provider_key_is_looked_up_not_charged_again_even_while_the_search_lags,
    s10_compacted_and_expired_keys_replay_refuse_and_expire_while_the_order_rule_holds,
    s11_duplicated_and_reordered_webhooks_apply_once_and_never_move_a_payment_backwards,
    s12_concurrent_refunds_with_different_keys_over_two_servers_never_exceed_the_capture,
    s13_one_key_and_order_under_two_accounts_is_two_payments_two_charges_neither_visible,
    s14_chaos_every_fault_and_kills_then_each_payment_equals_its_own_charge,
);

/// The rows a keyed create writes, in one transaction.
const CREATE_WRITES: [&str; 5] = [
    "idempotency_records",
    "payments",
    "intents",
    "attempts",
    "outbox",
];

/// Scenario 1: the second answer is the first, byte for byte (status,
/// Location, body), though the payment moved on in between; one payment,
/// one charge.
async fn s01_same_key_and_body_in_sequence_is_one_payment_one_charge_and_identical_answers(
    backend: Backend,
) {
    let site = Site::new(backend).await;
    let (_api, url) = site.serve("serve", &[], &[]).await;
    let body = payment_body("o-1");
    let answer = async || {
        let r = site.send_payment(&url, "k-1", &body).await;
        let head = (
            r.status().as_u16(),
            replayed(&r).to_owned(),
            header(&r, "location"),
        );
        (head, r.bytes().await.expect("body"))
    };
    let (first_head, first) = answer().await;
    assert_eq!(first_head.0, 201);
    assert_eq!(first_head.1, "false");
    let created: Value = serde_json::from_slice(&first).expect("json");
    let id = id_of(&created);
    assert_eq!(first_head.2, Some(format!("/v1/payments/{id}")));
    let payment = site.payment_in(&url, &id, "captured").await;
    for _ in 0..2 {
        let (head, again) = answer().await;
        assert_eq!((head.0, head.1.as_str()), (201, "true"));
        assert_eq!(head.2, first_head.2, "the same Location");
        assert_eq!(again, first, "the stored answer, byte for byte");
    }
    assert_captured_once(&site, &payment, 1).await;
    assert_rows(&site, 1).await;
}

/// Scenario 2: 24 requests with one key at once, alternating between two
/// `cobro serve` processes: exactly one execution, every 201 the stored
/// answer, the rest 409 in progress; one payment and, once the worker
/// drained it, one charge.
async fn s02_one_key_sent_concurrently_to_two_servers_is_one_payment_and_one_charge(
    backend: Backend,
) {
    const N: usize = 24;
    let site = Site::new(backend).await;
    let (_a, url_a) = site.serve("serve A", &[], &[]).await;
    let (_b, url_b) = site.serve("serve B", &["--no-worker"], &[]).await;
    let body = payment_body("o-1");
    let answers = futures::future::join_all((0..N).map(|i| {
        let url = if i % 2 == 0 { &url_a } else { &url_b };
        site.post_payment(url, "the-key", &body).send()
    }))
    .await;
    let (mut fresh, mut in_progress, mut stored) = (0, 0, BTreeSet::new());
    for answer in answers {
        let r = answer.expect("an answer");
        match r.status().as_u16() {
            201 => {
                fresh += usize::from(replayed(&r) == "false");
                stored.insert(r.bytes().await.expect("body"));
            }
            409 => {
                assert_eq!(header(&r, "retry-after").as_deref(), Some("1"));
                assert_problem(r, 409, "idempotency-request-in-progress").await;
                in_progress += 1;
            }
            other => panic!("{other}: {}", r.text().await.unwrap_or_default()),
        }
    }
    assert_eq!(fresh, 1, "exactly one execution");
    assert_eq!(stored.len(), 1, "every 201 is the stored answer");
    assert!(in_progress < N, "{in_progress} of {N} in progress");
    let created: Value = serde_json::from_slice(stored.first().expect("a 201")).expect("json");
    let payment = site.payment_in(&url_b, &id_of(&created), "captured").await;
    assert_captured_once(&site, &payment, 1).await;
    assert_rows(&site, 1).await;
    eprintln!("{N} requests: 1 executed, {in_progress} in progress, the rest replayed");
}

/// Scenario 3: the key of a settled payment sent with another amount, then
/// for another order: 422 `idempotency-key-reused` each time, no row
/// written, nothing sent to the provider, and the key still answers its
/// own request with the stored answer.
async fn s03_same_key_with_another_body_is_422_and_changes_nothing(backend: Backend) {
    let site = Site::new(backend).await;
    let (_api, url) = site.serve("serve", &[], &[]).await;
    let body = payment_body("o-1");
    let first = site.send_payment(&url, "k-1", &body).await;
    assert_eq!(first.status().as_u16(), 201);
    let first = first.bytes().await.expect("body");
    let created: Value = serde_json::from_slice(&first).expect("json");
    let payment = site.payment_in(&url, &id_of(&created), "captured").await;
    let rows_before = rows(&site).await;
    let ledger_before = site.ledger();

    let mut other_amount = body.clone();
    other_amount["amount"] = json!(1);
    for changed in [other_amount, payment_body("o-2")] {
        let r = site.send_payment(&url, "k-1", &changed).await;
        let problem = assert_problem(r, 422, "idempotency-key-reused").await;
        assert_eq!(problem["idempotency_key"], "k-1");
    }
    assert_eq!(rows(&site).await, rows_before, "no row written");
    assert_eq!(site.payment(&url, &id_of(&created)).await, payment);
    let again = site.send_payment(&url, "k-1", &body).await;
    assert_eq!(replayed(&again), "true");
    assert_eq!(again.bytes().await.expect("body"), first);
    let ledger = site.ledger();
    assert_eq!(
        serde_json::to_value(&ledger.totals).expect("json"),
        serde_json::to_value(&ledger_before.totals).expect("json"),
        "the provider saw nothing new"
    );
    assert_eq!(for_intent(&ledger, "o-2:authorize-v1").charges, 0);
    assert_captured_once(&site, &payment, 1).await;
}

/// Scenario 4: `cobro serve` is SIGKILLed while the create's transaction is
/// open (the key reserved, the payment, intent, attempt and outbox rows
/// written, held by `COBRO_TEST_HOLD=before-commit:`): nothing is recorded,
/// and the retry on a new process is a first execution with one charge.
async fn s04_a_crash_before_commit_records_nothing_and_the_retry_executes_once(backend: Backend) {
    let site = Site::new(backend).await;
    let body = payment_body("o-1");
    let held = Held::at(&site, "before-commit", &body).await;
    assert!(
        write_transaction_open(&site).await,
        "the create's transaction is open"
    );
    held.kill().await;
    // With its client gone the transaction ends (PostgreSQL's backend
    // sees the closed socket; SQLite's lock went with the process).
    wait_for("the killed server's transaction ends", SETTLE, async || {
        (!write_transaction_open(&site).await).then_some(())
    })
    .await;
    assert_rows(&site, 0).await;
    assert_eq!(site.ledger().totals.charges, 0);

    let (_b, url_b) = site.serve("serve B", &[], &[]).await;
    let created = site.create_payment(&url_b, "crash-k-1", &body).await;
    assert_eq!(created["intent"], "o-1:authorize-v1");
    let payment = site.payment_in(&url_b, &id_of(&created), "captured").await;
    assert_captured_once(&site, &payment, 1).await;
    assert_rows(&site, 1).await;
}

/// Scenario 5: `cobro serve` is SIGKILLed after the create committed and
/// before it answered (`COBRO_TEST_HOLD=after-commit:`): the record is
/// there, the client got nothing, and the retry on a new process replays
/// the stored answer (same payment, same Location); one charge.
async fn s05_a_crash_after_commit_before_the_answer_replays_on_retry_with_one_charge(
    backend: Backend,
) {
    let site = Site::new(backend).await;
    let body = payment_body("o-1");
    let held = Held::at(&site, "after-commit", &body).await;
    assert!(
        !write_transaction_open(&site).await,
        "the create's transaction committed"
    );
    held.kill().await;
    assert_rows(&site, 1).await;
    let committed: String = site
        .db
        .scalar("SELECT CAST(resource_id AS TEXT) FROM idempotency_records")
        .await;
    assert_eq!(site.ledger().totals.charges, 0, "A ran no worker");

    let (_b, url_b) = site.serve("serve B", &[], &[]).await;
    let response = site.send_payment(&url_b, "crash-k-1", &body).await;
    assert_eq!(response.status().as_u16(), 201);
    assert_eq!(replayed(&response), "true");
    assert_eq!(
        header(&response, "location"),
        Some(format!("/v1/payments/{committed}"))
    );
    let replay: Value = response.json().await.expect("json");
    assert_eq!(id_of(&replay), committed);
    assert_eq!(replay["status"], "processing", "the answer A never sent");
    let payment = site.payment_in(&url_b, &committed, "captured").await;
    assert_captured_once(&site, &payment, 1).await;
    assert_rows(&site, 1).await;
}

/// Scenario 6: the provider makes the charge and the answer is lost (the
/// connection dropped: o-1, automatic capture) or comes after cobro's 1 s
/// timeout (o-2, manual capture): the worker resends under the same
/// provider key and the provider replays; one charge each, and each payment
/// ends as its charge with its id as provider_ref.
async fn s06_a_lost_or_late_answer_after_the_charge_is_one_charge_with_its_provider_ref(
    backend: Backend,
) {
    let site = Site::new(backend).await;
    site.fault(
        FaultRule::new(FOp::Charge, FaultAction::DropResponseAfterEffect)
            .with_reference("o-1:")
            .with_next(1),
    );
    site.fault(
        FaultRule::new(FOp::Charge, FaultAction::DelayAfterEffect)
            .with_reference("o-2:")
            .with_delay(Duration::from_secs(3))
            .with_next(1),
    );
    let (_api, url) = site
        .serve("serve", &[], &[("COBRO_PROVIDER_TIMEOUT", "1s")])
        .await;
    let lost = site.create_payment(&url, "k-1", &payment_body("o-1")).await;
    let late = site
        .create_payment(&url, "k-2", &manual_payment_body("o-2"))
        .await;
    let lost = site.payment_in(&url, &id_of(&lost), "captured").await;
    let late = site.payment_in(&url, &id_of(&late), "authorized").await;
    assert_eq!(
        site.fired(FOp::Charge, FaultAction::DropResponseAfterEffect),
        1
    );
    assert_eq!(site.fired(FOp::Charge, FaultAction::DelayAfterEffect), 1);

    let ledger = site.ledger();
    for (payment, status, captured) in [(&lost, "captured", 1999), (&late, "authorized", 0)] {
        let charge = site.own_charge(&ledger, payment);
        assert_eq!(
            (charge.status.as_str(), charge.amount_captured),
            (status, captured)
        );
        assert_eq!(payment["amount_captured"], captured);
        let attempts = payment["attempts"].as_array().expect("attempts");
        assert_eq!(attempts.len(), 1, "one provider key: {payment}");
        assert_eq!(attempts[0]["state"], "succeeded");
        assert!(
            attempts[0]["sends"].as_u64() >= Some(2),
            "resent: {payment}"
        );
        let intent = payment["intent"].as_str().expect("intent");
        assert_eq!(for_intent(&ledger, intent).charges, 1, "{intent}");
    }
    assert_eq!(ledger.totals.charges, 2);
    assert!(double_charges(&ledger).is_empty());
}

/// Scenario 7: worker A is SIGKILLed after the provider made the charge and
/// before A recorded it (the answer held back); once A's lease expires
/// worker B resends under the same key and records the replayed charge.
/// Then B is SIGKILLed the same way over a second payment, no worker is
/// left, and `cobro reconcile` finds that charge by the attempt's identity
/// and adopts it. One charge each.
async fn s07_a_worker_killed_between_charge_and_record_is_finished_by_another_or_by_cobro_reconcile(
    backend: Backend,
) {
    let site = Site::new(backend).await;
    let alone = [("COBRO_NO_RECONCILER", "true")];
    let (_api, url) = site
        .serve("serve", &["--no-worker", "--no-reconciler"], &[])
        .await;
    // Far longer than the test lasts: A dies knowing nothing.
    site.hold_next_charge_answer(Duration::from_secs(60));
    let first = site.create_payment(&url, "k-1", &payment_body("o-1")).await;
    let (mut a, owner_a) = site.worker("worker A", &alone).await;
    site.charged("o-1:authorize-v1").await;
    let held: String = site
        .db
        .scalar(
            "SELECT COALESCE(o.lease_owner, '-') || ' ' || a.state || ' ' \
             || CAST(a.send_count AS TEXT) FROM outbox o JOIN attempts a ON a.id = o.attempt_id",
        )
        .await;
    assert_eq!(
        held,
        format!("{owner_a} pending 1"),
        "A holds the lease, has sent once and recorded nothing"
    );
    a.kill9();
    assert_eq!(
        site.payment(&url, &id_of(&first)).await["status"],
        "processing"
    );

    let (mut b, owner_b) = site.worker("worker B", &alone).await;
    assert_ne!(owner_a, owner_b);
    let first = site.payment_in(&url, &id_of(&first), "captured").await;
    assert_captured_once(&site, &first, 2).await;
    let row: String = site
        .db
        .scalar("SELECT state || ' ' || CAST(lease_token AS TEXT) FROM outbox")
        .await;
    assert_eq!(row, "done 2", "claimed by A, then once by B");

    // B dies the same way over o-2; no worker is left.
    site.hold_next_charge_answer(Duration::from_secs(60));
    let second = site.create_payment(&url, "k-2", &payment_body("o-2")).await;
    site.charged("o-2:authorize-v1").await;
    b.kill9();
    let expired = format!(
        "outbox WHERE state = 'pending' AND lease_expires_at < {}",
        site.db.now_sql()
    );
    wait_for("B's lease expires", SETTLE, async || {
        (site.count(&expired).await == 1).then_some(())
    })
    .await;
    let (code, summary) = site.reconcile(&["--all", "--older-than", "0s"], &[]).await;
    assert_eq!(code, Some(0), "nothing left: {summary}");
    assert_eq!(summary["examined"], 1, "{summary}");
    assert_eq!(summary["resolved"]["succeeded"], 1, "{summary}");
    let second = site.payment(&url, &id_of(&second)).await;
    assert_eq!(second["status"], "captured");
    let ledger = site.ledger();
    let charge = site.own_charge(&ledger, &second);
    assert_eq!(charge.status, "captured");
    assert_eq!(for_intent(&ledger, "o-2:authorize-v1").charges, 1);
    assert_eq!(ledger.totals.charges, 2);
    assert!(double_charges(&ledger).is_empty());
}

/// Scenario 8, with a stale owner for real: worker A sends the charge (its
/// answer held 4 s) and is SIGSTOPped right after a heartbeat, so its
/// lease runs out while it is alive and holds the call; worker B takes the
/// row, resends, and records the replayed charge. Then A is SIGCONTed and
/// its answer arrives: its fenced record changes nothing (the payment and
/// B's outbox row are exactly as B left them) and what it learned is kept
/// as an observation under its old lease token. One charge.
async fn s08_a_stale_lease_owners_late_answer_overwrites_nothing(backend: Backend) {
    let site = Site::new(backend).await;
    // No event dispatcher in A or B: a stopped process that holds a write
    // (a dispatcher's claim or record, about once a second) holds SQLite's
    // one write lock for every other process, which is not what this
    // scenario is about (under load it stopped B for good).
    let env = [
        ("COBRO_NO_RECONCILER", "true"),
        ("COBRO_NO_DISPATCHER", "true"),
        ("COBRO_PROVIDER_TIMEOUT", "30s"),
    ];
    let (_api, url) = site
        .serve("serve", &["--no-worker", "--no-reconciler"], &[])
        .await;
    site.hold_next_charge_answer(Duration::from_secs(4));
    let created = site.create_payment(&url, "k-1", &payment_body("o-1")).await;
    let id = id_of(&created);
    let (a, owner_a) = site.worker("worker A", &env).await;
    site.charged("o-1:authorize-v1").await;
    // Stopped just after a renewal, A is in the middle of no write (a stop
    // inside one would hold the row's lock, or SQLite's, for B to wait on).
    let lease = "SELECT COALESCE(CAST(lease_expires_at AS TEXT), '') FROM outbox";
    let renewed: String = site.db.scalar(lease).await;
    wait_for("A renews its lease", SETTLE, async || {
        (site.db.scalar::<String>(lease).await != renewed).then_some(())
    })
    .await;
    a.stop();

    let (_b, owner_b) = site.worker("worker B", &env).await;
    let by_b = site.payment_in(&url, &id, "captured").await;
    let outbox = "SELECT state || ' ' || CAST(lease_token AS TEXT) || ' ' \
                  || COALESCE(lease_owner, '-') || ' ' || CAST(updated_at AS TEXT) FROM outbox";
    let row_by_b: String = site.db.scalar(outbox).await;
    assert!(
        row_by_b.starts_with("done 2 "),
        "B took the row with token 2 and finished it: {row_by_b}"
    );
    assert!(!row_by_b.contains(&owner_a), "{row_by_b} ({owner_b})");

    a.resume();
    wait_for(
        "A keeps its late answer as an observation",
        SETTLE,
        async || (site.count("attempt_observations").await > 0).then_some(()),
    )
    .await;
    a.wait_for_stderr("lease lost before recording").await;
    let observed: String = site
        .db
        .scalar("SELECT CAST(lease_token AS TEXT) || ' ' || outcome FROM attempt_observations")
        .await;
    assert_eq!(observed, "1 succeeded", "A's answer, under A's token");
    assert_eq!(site.db.scalar::<String>(outbox).await, row_by_b, "B's row");
    assert_eq!(site.payment(&url, &id).await, by_b, "B's record");
    assert_captured_once(&site, &by_b, 2).await;
    assert_eq!(
        site.ledger().charges[0].id,
        by_b["provider_ref"].as_str().expect("ref")
    );
}

/// Scenario 9: every answer to o-1's and o-2's charges is lost (500 after
/// the effect) until cobro's 1 s send window closes and the worker hands
/// both attempts to the reconciler; then the provider forgets the keys (its
/// clock moved past its 4 s retention), so a resend would charge again.
/// `cobro reconcile` looks instead: o-2's charge is hidden from the
/// provider's search for an hour, but its consistent list shows both, and
/// both are adopted at once. One charge each, and no charge request after
/// the hand-over.
async fn s09_an_expired_provider_key_is_looked_up_not_charged_again_even_while_the_search_lags(
    backend: Backend,
) {
    let site = Site::with_provider(
        backend,
        fake_provider::Config {
            admin: true,
            retention: Duration::from_secs(4),
            ..Default::default()
        },
    )
    .await;
    let env = [
        ("COBRO_NO_RECONCILER", "true"),
        ("COBRO_PROVIDER_TIMEOUT", "1s"),
        ("COBRO_PROVIDER_KEY_RETENTION", "3s"),
        ("COBRO_PROVIDER_KEY_SAFETY_MARGIN", "2s"),
        ("COBRO_PROVIDER_SEARCH_LAG", "1h"),
    ];
    site.fault(FaultRule::new(FOp::Charge, FaultAction::FailAfterEffect));
    site.fault(
        FaultRule::new(FOp::Charge, FaultAction::SearchLag)
            .with_reference("o-2:")
            .with_lag_seconds(3600),
    );
    let (_api, url) = site.serve("serve", &[], &env).await;
    let found = site.create_payment(&url, "k-1", &payment_body("o-1")).await;
    let lagging = site.create_payment(&url, "k-2", &payment_body("o-2")).await;
    for p in [&found, &lagging] {
        site.payment_in(&url, &id_of(p), "requires_reconciliation")
            .await;
    }
    let control = site.provider.control();
    control.advance_clock(Duration::from_secs(5));
    let charge_requests = || {
        control
            .requests()
            .iter()
            .filter(|r| r.method == "POST" && r.path == "/v1/charges")
            .count()
    };
    let sent = charge_requests();
    assert!(sent >= 4, "each sent and resent: {sent}");

    // The provider's list shows both charges at once, whatever its search
    // lag (an hour here): both are adopted, neither is charged again.
    let (code, summary) = site.reconcile(&["--all", "--older-than", "0s"], &env).await;
    assert_eq!(code, Some(0), "{summary}");
    assert_eq!(summary["examined"], 2, "{summary}");
    assert_eq!(summary["resolved"]["succeeded"], 2, "{summary}");
    let o2 = id_of(&lagging);
    let found = site.payment(&url, &id_of(&found)).await;
    assert_eq!(found["status"], "captured");
    let adopted = site.payment(&url, &o2).await;
    assert_eq!(adopted["status"], "captured");
    assert_eq!(charge_requests(), sent, "searched, never charged again");
    let ledger = site.ledger();
    for payment in [&found, &adopted] {
        assert_eq!(site.own_charge(&ledger, payment).status, "captured");
        let intent = payment["intent"].as_str().expect("intent");
        assert_eq!(for_intent(&ledger, intent).charges, 1, "{intent}");
        assert_eq!(payment["attempts"].as_array().map(Vec::len), Some(1));
    }
    assert_eq!(ledger.totals.charges, 2);
    assert_eq!(
        site.count("reconciliation_decisions WHERE decision = 'adopt_succeeded'")
            .await,
        2
    );
}

/// Scenario 10, with `cobro serve` purging every second (records compacted
/// after 1 s, tombstones kept 4 s more): after compaction the key replays
/// the payment as it is now and refuses another body; after full expiry
/// the same request is a new key again, yet the order rule refuses a
/// second active payment (422 `order-has-active-payment`, not stored), and
/// the key then makes a payment for another order.
async fn s10_compacted_and_expired_keys_replay_refuse_and_expire_while_the_order_rule_holds(
    backend: Backend,
) {
    let site = Site::new(backend).await;
    let env = [
        ("COBRO_PURGE_SCHEDULE", "* * * * * *"),
        ("COBRO_IDEMPOTENCY_RETENTION", "1s"),
        ("COBRO_TOMBSTONE_RETENTION", "4s"),
    ];
    let (_api, url) = site.serve("serve", &[], &env).await;
    let body = payment_body("o-1");
    let first = site.send_payment(&url, "k-1", &body).await;
    let location = header(&first, "location");
    let first: Value = first.json().await.expect("json");
    let id = id_of(&first);
    assert_eq!(first["status"], "processing");
    let settled = site.payment_in(&url, &id, "captured").await;

    wait_for("the record is compacted", SETTLE, async || {
        (site
            .count("idempotency_records WHERE state = 'tombstone' AND response_body IS NULL")
            .await
            == 1)
            .then_some(())
    })
    .await;
    let replay = site.send_payment(&url, "k-1", &body).await;
    assert_eq!(replay.status().as_u16(), 201, "the original status");
    assert_eq!(replayed(&replay), "true");
    assert_eq!(header(&replay, "location"), location);
    let current: Value = replay.json().await.expect("json");
    assert_eq!(current, settled, "the payment as it is now");
    let mut changed = body.clone();
    changed["amount"] = json!(1);
    let r = site.send_payment(&url, "k-1", &changed).await;
    assert_problem(r, 422, "idempotency-key-reused").await;

    wait_for("the tombstone expires", SETTLE, async || {
        (site.count("idempotency_records").await == 0).then_some(())
    })
    .await;
    let r = site.send_payment(&url, "k-1", &body).await;
    assert_ne!(header(&r, "idempotent-replayed").as_deref(), Some("true"));
    let problem = assert_problem(r, 422, "order-has-active-payment").await;
    assert_eq!(problem["payment_id"], id.as_str());
    assert_eq!(site.count("idempotency_records").await, 0, "not stored");
    assert_eq!(site.count("payments").await, 1);
    let other = site.create_payment(&url, "k-1", &payment_body("o-2")).await;
    let other = site.payment_in(&url, &id_of(&other), "captured").await;

    let ledger = site.ledger();
    for payment in [&settled, &other] {
        site.own_charge(&ledger, payment);
        let intent = payment["intent"].as_str().expect("intent");
        assert_eq!(for_intent(&ledger, intent).charges, 1, "{intent}");
    }
    assert_eq!(ledger.totals.charges, 2);
}

/// Scenario 11: the provider delivers its webhooks to `cobro serve`'s
/// `/v1/webhooks/fake`. o-1: every event twice, and the worker's answer
/// held 3 s, so the webhook settles the payment; o-2 (manual): its
/// `charge.authorized` held back until after `charge.captured`, and the
/// capture's answer held 3 s. Each event is stored once and applied at
/// most once, the late `charge.authorized` is ignored as stale, the held
/// answers change nothing, and each payment's event feed has each status
/// change once, in order.
async fn s11_duplicated_and_reordered_webhooks_apply_once_and_never_move_a_payment_backwards(
    backend: Backend,
) {
    const SECRET: &str = "whsec_scenarios_test_secret";
    let site = Site::new(backend).await;
    let hold = |op| {
        FaultRule::new(op, FaultAction::DelayAfterEffect)
            .with_delay(Duration::from_secs(3))
            .with_next(1)
    };
    site.fault(hold(FOp::Charge).with_reference("o-1:"));
    site.fault(hold(FOp::Capture).with_reference("o-2:"));
    site.fault(FaultRule::new(FOp::Webhook, FaultAction::Duplicate).with_reference("o-1:"));
    site.fault(
        FaultRule::new(FOp::Webhook, FaultAction::Reorder)
            .with_reference("o-2:")
            .with_next(1),
    );
    let (_api, url) = site
        .serve("serve", &[], &[("COBRO_WEBHOOK_SECRET", SECRET)])
        .await;
    let control = site.provider.control();
    control.set_webhook(Some(WebhookTarget {
        url: format!("{url}/v1/webhooks/fake"),
        secret: SECRET.to_owned(),
    }));

    let duplicated = site.create_payment(&url, "k-1", &payment_body("o-1")).await;
    let one = id_of(&duplicated);
    let by_webhook = site.payment_in(&url, &one, "captured").await;
    // Only now o-2: a reordered event is sent after the provider's next
    // event, whichever charge that is, so o-1's must all be out.
    let reordered = site
        .create_payment(&url, "k-2", &manual_payment_body("o-2"))
        .await;
    let two = id_of(&reordered);
    site.payment_in(&url, &two, "authorized").await;
    let r = site
        .post_as(
            &site.token,
            &url,
            &format!("/v1/payments/{two}/capture"),
            "cap-1",
            &json!({}),
        )
        .send()
        .await
        .expect("answer");
    assert_eq!(r.status().as_u16(), 202);
    wait_for("the held answers are recorded", SETTLE, async || {
        (site.count("outbox WHERE state = 'pending'").await == 0
            && site.fired(FOp::Webhook, FaultAction::Reorder) == 1
            && acked(&control, "charge.authorized").len() == 1
            && acked(&control, "charge.captured").len() >= 3)
            .then_some(())
    })
    .await;

    // o-1: one event, delivered twice, stored and applied once (by the
    // webhook: the worker's answer came later and changed nothing).
    let applied = |outcome: &str, id: &str| {
        format!("webhook_events WHERE payment_id = '{id}' AND outcome = '{outcome}'")
    };
    assert_eq!(
        site.count(&format!("webhook_events WHERE payment_id = '{one}'"))
            .await,
        1
    );
    assert_eq!(site.count(&applied("applied", &one)).await, 1);
    let event_one: String = site
        .db
        .scalar(&format!(
            "SELECT event_id FROM webhook_events WHERE payment_id = '{one}'"
        ))
        .await;
    let copies = acked(&control, "charge.captured")
        .iter()
        .filter(|d| d.event_id == event_one)
        .count();
    assert_eq!(copies, 2, "the same event, twice");
    assert_eq!(
        site.payment(&url, &one).await,
        by_webhook,
        "the late answer changed nothing"
    );
    assert_eq!(
        feed(&site, &url, &one).await,
        ["payment.created", "payment.captured"]
    );

    // o-2: captured first, then the stale authorization, which is ignored.
    let order: Vec<String> = control
        .webhook_deliveries()
        .into_iter()
        .filter(|d| d.acknowledged() && d.event_id != event_one)
        .map(|d| d.event_type)
        .collect();
    assert_eq!(
        order,
        ["charge.captured", "charge.authorized"],
        "delivered out of order"
    );
    assert_eq!(site.count(&applied("applied", &two)).await, 1);
    assert_eq!(site.count(&applied("ignored_stale", &two)).await, 1);
    let captured = site.payment(&url, &two).await;
    assert_eq!(captured["status"], "captured", "never back to authorized");
    assert_eq!(captured["amount_captured"], 1999);
    assert_eq!(
        feed(&site, &url, &two).await,
        [
            "payment.created",
            "payment.authorized",
            "payment.capturing",
            "payment.captured"
        ]
    );

    let ledger = site.ledger();
    let charge = site.own_charge(&ledger, &by_webhook);
    assert_eq!(
        (charge.status.as_str(), charge.amount_captured),
        ("captured", 1999)
    );
    let charge = site.own_charge(&ledger, &captured);
    assert_eq!(
        (charge.status.as_str(), charge.amount_captured),
        ("captured", 1999)
    );
    assert_eq!((ledger.totals.charges, ledger.totals.captures), (2, 1));
    assert!(double_charges(&ledger).is_empty());
}

/// Scenario 12: a captured payment of 1000; ten refunds of 300 with ten
/// keys at once over two `cobro serve` processes, then four of 60: exactly
/// what fits is accepted (three, then one), every other answer is 422
/// `refund-exceeds-captured` (never 409: the keys differ), and the worker
/// makes exactly those refunds at the provider, on the payment's charge,
/// 960 in all.
async fn s12_concurrent_refunds_with_different_keys_over_two_servers_never_exceed_the_capture(
    backend: Backend,
) {
    let site = Site::new(backend).await;
    let (_a, url_a) = site.serve("serve A", &[], &[]).await;
    let (_b, url_b) = site.serve("serve B", &["--no-worker"], &[]).await;
    let mut body = payment_body("o-1");
    body["amount"] = json!(1000);
    let created = site.create_payment(&url_a, "k-1", &body).await;
    let id = id_of(&created);
    site.payment_in(&url_a, &id, "captured").await;

    let mut refunds = Vec::new();
    for (round, (n, amount, fits)) in [(10, 300, 3), (4, 60, 1)].into_iter().enumerate() {
        let answers = futures::future::join_all((0..n).map(|i| {
            let url = if i % 2 == 0 { &url_a } else { &url_b };
            site.post_as(
                &site.token,
                url,
                &format!("/v1/payments/{id}/refunds"),
                &format!("r-{round}-{i}"),
                &json!({"amount": amount}),
            )
            .send()
        }))
        .await;
        let mut accepted = 0;
        for answer in answers {
            let r = answer.expect("an answer");
            match r.status().as_u16() {
                201 => {
                    accepted += 1;
                    let refund: Value = r.json().await.expect("json");
                    refunds.push(refund["id"].as_str().expect("refund id").to_owned());
                }
                _ => {
                    assert_problem(r, 422, "refund-exceeds-captured").await;
                }
            }
        }
        assert_eq!(accepted, fits, "{n} refunds of {amount}");
    }

    let payment = wait_for("every refund is made", SETTLE, async || {
        let p = site.payment(&url_b, &id).await;
        (p["amount_refunded"] == 960).then_some(p)
    })
    .await;
    assert_eq!(payment["status"], "partially_refunded");
    let ledger = site.ledger();
    let charge = site.own_charge(&ledger, &payment);
    let made = ledger.refunds_of_charge(&charge.id);
    let mut amounts: Vec<i64> = made.iter().map(|r| r.amount).collect();
    amounts.sort_unstable();
    assert_eq!(amounts, [60, 300, 300, 300], "exactly what fits");
    assert_eq!(charge.amount_refunded, 960);
    assert_eq!(ledger.totals.refunds, 4);
    for refund_id in &refunds {
        let (status, refund) = site
            .get_as(
                &site.token,
                &url_a,
                &format!("/v1/payments/{id}/refunds/{refund_id}"),
            )
            .await;
        assert_eq!(
            (status, refund["status"].as_str()),
            (200, Some("succeeded"))
        );
        assert_eq!(
            made.iter()
                .filter(|r| refund["provider_ref"] == r.id.as_str())
                .count(),
            1,
            "{refund}"
        );
    }
    assert_eq!(site.count("refunds").await, 4);
}

/// Scenario 13: two merchants send the same key for the same order ref:
/// two payments and two charges, each its own; neither sees the other's
/// payment (404 on GET, capture and refund, absent from its list); each
/// refunds its own under one shared refund key, and each refund lands on
/// its own charge.
async fn s13_one_key_and_order_under_two_accounts_is_two_payments_two_charges_neither_visible(
    backend: Backend,
) {
    let site = Site::new(backend).await;
    let token_b = site.new_account("merchant-b").await;
    let (_api, url) = site.serve("serve", &[], &[]).await;
    let tokens = [site.token.clone(), token_b];
    let mut ids = Vec::new();
    for token in &tokens {
        let r = site
            .post_as(
                token,
                &url,
                "/v1/payments",
                "shared-key",
                &payment_body("o-1"),
            )
            .send()
            .await
            .expect("answer");
        assert_eq!(r.status().as_u16(), 201);
        assert_eq!(replayed(&r), "false", "not the other account's record");
        ids.push(id_of(&r.json::<Value>().await.expect("json")));
    }
    assert_ne!(ids[0], ids[1]);
    let mut payments = Vec::new();
    for (token, id) in tokens.iter().zip(&ids) {
        payments.push(
            wait_for(&format!("{id} is captured"), SETTLE, async || {
                let (_, p) = site
                    .get_as(token, &url, &format!("/v1/payments/{id}"))
                    .await;
                (p["status"] == "captured").then_some(p)
            })
            .await,
        );
    }
    for (mine, theirs) in [(0, 1), (1, 0)] {
        let (token, other) = (&tokens[mine], &ids[theirs]);
        let (status, body) = site
            .get_as(token, &url, &format!("/v1/payments/{other}"))
            .await;
        assert_eq!((status, body["code"].as_str()), (404, Some("not-found")));
        for (path, payload) in [("capture", json!({})), ("refunds", json!({"amount": 1}))] {
            let r = site
                .post_as(
                    token,
                    &url,
                    &format!("/v1/payments/{other}/{path}"),
                    "x-1",
                    &payload,
                )
                .send()
                .await
                .expect("answer");
            assert_problem(r, 404, "not-found").await;
        }
        let (status, list) = site.get_as(token, &url, "/v1/payments?order_ref=o-1").await;
        assert_eq!(status, 200);
        let listed: Vec<&str> = list["data"]
            .as_array()
            .expect("data")
            .iter()
            .map(|p| p["id"].as_str().expect("id"))
            .collect();
        assert_eq!(listed, [ids[mine].as_str()], "only its own");
    }

    for ((token, id), amount) in tokens.iter().zip(&ids).zip([500, 700]) {
        let r = site
            .post_as(
                token,
                &url,
                &format!("/v1/payments/{id}/refunds"),
                "r-1",
                &json!({"amount": amount}),
            )
            .send()
            .await
            .expect("answer");
        assert_eq!(r.status().as_u16(), 201);
        assert_eq!(replayed(&r), "false");
    }
    let ledger = wait_for("both refunds are made", SETTLE, async || {
        let ledger = site.ledger();
        (ledger.totals.refunds == 2).then_some(ledger)
    })
    .await;
    let mut charges = BTreeSet::new();
    for ((token, payment), amount) in tokens.iter().zip(&payments).zip([500, 700]) {
        let id = id_of(payment);
        let payment = wait_for(&format!("{id} is partially refunded"), SETTLE, async || {
            let (_, p) = site
                .get_as(token, &url, &format!("/v1/payments/{id}"))
                .await;
            (p["status"] == "partially_refunded").then_some(p)
        })
        .await;
        assert_eq!(payment["amount_refunded"], amount);
        let charge = site.own_charge(&ledger, &payment);
        assert_eq!(charge.status, "captured");
        let refunds: Vec<i64> = ledger
            .refunds_of_charge(&charge.id)
            .iter()
            .map(|r| r.amount)
            .collect();
        assert_eq!(refunds, [amount], "{id}'s refund on its own charge");
        charges.insert(charge.id);
    }
    assert_eq!(charges.len(), 2, "two charges, one each");
    assert_eq!(ledger.totals.charges, 2);
    assert!(double_charges(&ledger).is_empty());
}

/// Scenario 14: the chaos run (tests/support/chaos.rs), on each store.
async fn s14_chaos_every_fault_and_kills_then_each_payment_equals_its_own_charge(backend: Backend) {
    cobro_test_support::chaos::chaos_run(backend, Dialect::Fake).await;
}

// --- helpers -------------------------------------------------------------

/// A `cobro serve` (no worker) holding the create of key `crash-k-1`
/// forever at one point of its commit (`COBRO_TEST_HOLD`), and the
/// client's request still waiting for its answer.
struct Held {
    server: Cobro,
    request: tokio::task::JoinHandle<reqwest::Result<reqwest::Response>>,
}

impl Held {
    /// Once the server logged that it holds the request (`point`:
    /// `before-commit` or `after-commit`).
    async fn at(site: &Site, point: &str, body: &Value) -> Self {
        let hold = format!("{point}:crash-");
        let (server, url) = site
            .serve(
                &format!("serve A ({point})"),
                &["--no-worker", "--no-reconciler"],
                &[("COBRO_TEST_HOLD", &hold)],
            )
            .await;
        let request = tokio::spawn(site.post_payment(&url, "crash-k-1", body).send());
        server
            .wait_for_stderr("COBRO_TEST_HOLD: holding this request")
            .await;
        Self { server, request }
    }

    /// SIGKILLs the server; the client gets no answer.
    async fn kill(mut self) {
        self.server.kill9();
        let answer = self.request.await.expect("the request task");
        assert!(answer.is_err(), "the client got no answer: {answer:?}");
    }
}

/// Every table a create writes has `n` rows.
async fn assert_rows(site: &Site, n: i64) {
    for table in CREATE_WRITES {
        assert_eq!(site.count(table).await, n, "rows in {table}");
    }
}

fn header(response: &reqwest::Response, name: &str) -> Option<String> {
    response
        .headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

/// Asserts a problem answer of `status` and `code`; its body.
async fn assert_problem(response: reqwest::Response, status: u16, code: &str) -> Value {
    assert_eq!(
        header(&response, "content-type").as_deref(),
        Some("application/problem+json")
    );
    let got = response.status().as_u16();
    let problem: Value = response.json().await.expect("problem json");
    assert_eq!(
        (got, problem["code"].as_str()),
        (status, Some(code)),
        "{problem}"
    );
    problem
}

/// The row counts of every table a request or the worker writes.
async fn rows(site: &Site) -> Vec<i64> {
    let mut counts = Vec::new();
    for table in CREATE_WRITES
        .iter()
        .chain(&["refunds", "events", "reconciliation_decisions"])
    {
        counts.push(site.count(table).await);
    }
    counts
}

/// Whether another connection holds a write transaction open on the test
/// database: on PostgreSQL a backend idle in transaction; on SQLite the
/// write lock (an immediate transaction cannot begin at once).
async fn write_transaction_open(site: &Site) -> bool {
    if site.db.url.starts_with("postgres") {
        let open: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM pg_stat_activity WHERE datname = current_database() \
             AND pid <> pg_backend_pid() AND state LIKE 'idle in transaction%'",
        )
        .fetch_one(site.pg())
        .await
        .expect("pg_stat_activity");
        return open > 0;
    }
    let options = SqliteConnectOptions::from_str(&site.db.url)
        .expect("a SQLite URL")
        .busy_timeout(Duration::ZERO);
    let mut c = SqliteConnection::connect_with(&options)
        .await
        .expect("connect");
    sqlx::raw_sql("BEGIN IMMEDIATE; ROLLBACK;")
        .execute(&mut c)
        .await
        .is_err()
}

/// The provider's acknowledged deliveries of events of `event_type`.
fn acked(control: &fake_provider::Control, event_type: &str) -> Vec<WebhookDelivery> {
    control
        .webhook_deliveries()
        .into_iter()
        .filter(|d| d.event_type == event_type && d.acknowledged())
        .collect()
}

/// The types of a payment's events in its feed, in sequence order; the
/// sequences are 1, 2, 3...
async fn feed(site: &Site, url: &str, payment: &str) -> Vec<String> {
    let (status, page) = site
        .get_as(&site.token, url, &format!("/v1/events?object={payment}"))
        .await;
    assert_eq!(status, 200, "{page}");
    let events = page["data"].as_array().expect("data");
    let sequences: Vec<i64> = events
        .iter()
        .map(|e| e["sequence"].as_i64().expect("sequence"))
        .collect();
    assert_eq!(sequences, (1..=events.len() as i64).collect::<Vec<_>>());
    events
        .iter()
        .map(|e| e["type"].as_str().expect("type").to_owned())
        .collect()
}
