//! The store's behaviour, one suite run against both backends.

use chrono::Duration;
use cobro_core::{AccountId, Fingerprint, IdempotencyKey, Operation, PaymentId, PaymentStatus};
use cobro_store::idempotency::ResourceType;
use cobro_store::{KeyScope, NewAttempt, Reservation, SendMark, Store};
use cobro_test_support::{Backend, TestDb, new_payment, on_both_backends, t0};
use std::collections::BTreeMap;
use std::sync::Arc;
use tokio::sync::Barrier;

on_both_backends!(
    concurrent_reservations_of_one_key_have_exactly_one_winner,
    only_one_active_payment_per_order_even_under_concurrency,
    a_transition_from_a_stale_state_changes_nothing,
    the_provider_sequence_starts_over_only_for_another_charge,
    a_claim_leases_the_row_and_a_stale_token_writes_nothing,
    a_leased_row_is_not_claimed_again_until_its_lease_expires,
    a_claim_takes_at_most_its_limit_whatever_plan_the_statistics_choose,
    a_delivery_claim_takes_at_most_its_limit_whatever_plan_the_statistics_choose,
    compaction_keeps_scope_key_fingerprint_and_resource,
    the_same_key_in_another_account_is_another_record,
    a_token_is_refused_from_its_expiry_on_and_once_revoked,
    typed_columns_round_trip_and_an_unknown_stored_value_is_corrupt,
    an_account_name_is_taken_once_whatever_the_code_above_checked,
    migrating_a_database_with_shared_account_names_fails_naming_the_fix,
    an_unreadable_attempt_fails_only_itself_in_a_claim_and_in_a_candidate_page,
    attempts_read_for_an_account_are_empty_for_another_accounts_payment,
    opening_an_intent_writes_its_attempt_and_outbox_in_the_payments_account,
    a_payment_is_read_with_its_attempts_in_order_and_only_in_its_account,
    a_create_numbers_its_intent_with_no_other_create_of_the_order_in_between,
);

fn scope(account: AccountId, key: &str) -> KeyScope {
    KeyScope {
        account,
        operation: Operation::Authorize,
        key: IdempotencyKey::parse(key).expect("key"),
    }
}

fn fingerprint(amount: i64) -> Fingerprint {
    Fingerprint::compute("payment.authorize", &BTreeMap::new(), &amount).expect("fingerprint")
}

/// A payment with its attempt and outbox row, committed.
async fn seed_payment_with_attempt(store: &Store, account: AccountId, order: &str) -> PaymentId {
    let p = new_payment(account, order);
    let mut tx = store.begin().await.expect("begin");
    assert!(tx.insert_payment(&p, t0()).await.expect("insert").is_some());
    let intent = tx
        .insert_intent(account, p.id, None, Operation::Authorize, &p.intent, t0())
        .await
        .expect("intent");
    let id = cobro_core::AttemptId::new();
    let attempt = NewAttempt {
        id,
        intent,
        payment: p.id,
        refund: None,
        operation: Operation::Authorize,
        provider_key: uuid::Uuid::new_v4().to_string(),
        reference: cobro_core::attempt_reference(p.intent.as_str(), id),
    };
    tx.enqueue_attempt(&attempt, t0(), t0())
        .await
        .expect("attempt");
    tx.commit().await.expect("commit");
    p.id
}

async fn concurrent_reservations_of_one_key_have_exactly_one_winner(backend: Backend) {
    let db = TestDb::new(backend).await;
    let account = db.store.create_account("a", t0()).await.expect("account");
    const N: usize = 20;
    let barrier = Arc::new(Barrier::new(N));
    let mut tasks = Vec::new();
    for i in 0..N {
        let (store, barrier) = (db.store.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            let scope = scope(account, "same-key");
            let payment = new_payment(account, &format!("order-{i}"));
            let mut tx = store.begin().await.expect("begin");
            let outcome = tx
                .reserve_key(
                    &scope,
                    &fingerprint(1999),
                    (ResourceType::Payment, payment.id.as_uuid()),
                    t0(),
                )
                .await
                .expect("reserve");
            match outcome {
                Reservation::Reserved => {
                    assert!(
                        tx.insert_payment(&payment, t0())
                            .await
                            .expect("insert")
                            .is_some()
                    );
                    tx.complete_key(&scope, 201, format!("winner {i}").as_bytes())
                        .await
                        .expect("complete");
                    tx.commit().await.expect("commit");
                    Some(i)
                }
                Reservation::Taken(record) => {
                    let body = String::from_utf8(record.response_body.expect("full record"))
                        .expect("utf8");
                    assert!(
                        body.starts_with("winner "),
                        "saw the committed answer, got {body}"
                    );
                    assert_eq!(record.status_code, 201);
                    None
                }
            }
        }));
    }
    let mut winners = Vec::new();
    for t in tasks {
        if let Some(i) = t.await.expect("task") {
            winners.push(i);
        }
    }
    assert_eq!(winners.len(), 1, "exactly one reservation wins");
    let record = db
        .store
        .find_record(&scope(account, "same-key"))
        .await
        .expect("read")
        .expect("exists");
    assert_eq!(
        record.response_body.as_deref(),
        Some(format!("winner {}", winners[0]).as_bytes())
    );
    // Only the winner's business rows exist.
    let payments = db
        .store
        .payments_for_account(
            account,
            &cobro_store::PaymentFilter {
                limit: 100,
                ..Default::default()
            },
        )
        .await
        .expect("list");
    assert_eq!(payments.len(), 1);
}

async fn only_one_active_payment_per_order_even_under_concurrency(backend: Backend) {
    let db = TestDb::new(backend).await;
    let account = db.store.create_account("a", t0()).await.expect("account");
    const N: usize = 20;
    let barrier = Arc::new(Barrier::new(N));
    let mut tasks = Vec::new();
    for _ in 0..N {
        let (store, barrier) = (db.store.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            let mut tx = store.begin().await.expect("begin");
            let inserted = tx
                .insert_payment(&new_payment(account, "pedido-842"), t0())
                .await
                .expect("insert")
                .is_some();
            if inserted {
                tx.commit().await.expect("commit");
            }
            inserted
        }));
    }
    let mut wins = 0;
    for t in tasks {
        wins += usize::from(t.await.expect("task"));
    }
    assert_eq!(wins, 1);
    assert_eq!(
        db.store
            .count_order_payments_for_account(account, "pedido-842")
            .await
            .expect("count"),
        1
    );

    // A terminal failure frees the order for the next payment.
    let existing = db
        .store
        .payments_for_account(
            account,
            &cobro_store::PaymentFilter {
                limit: 1,
                ..Default::default()
            },
        )
        .await
        .expect("list")[0]
        .id;
    let mut tx = db.store.begin().await.expect("begin");
    assert!(
        tx.transition_payment(
            account,
            existing,
            PaymentStatus::Processing,
            PaymentStatus::Declined,
            t0()
        )
        .await
        .expect("decline")
        .is_some()
    );
    assert!(
        tx.insert_payment(&new_payment(account, "pedido-842"), t0())
            .await
            .expect("insert v2")
            .is_some()
    );
    tx.commit().await.expect("commit");
    assert_eq!(
        db.store
            .count_order_payments_for_account(account, "pedido-842")
            .await
            .expect("count"),
        2
    );
}

/// `open_intent` (on SQLite one command of three statements) writes the
/// intent, its attempt and its outbox row, every one in the payment's
/// account, with the same order ref in two accounts; an attempt the schema
/// refuses, or a refused second payment for the order, leaves nothing
/// behind once the caller rolls back.
async fn opening_an_intent_writes_its_attempt_and_outbox_in_the_payments_account(backend: Backend) {
    let db = TestDb::new(backend).await;
    let a = db.store.create_account("a", t0()).await.expect("a");
    let b = db.store.create_account("b", t0()).await.expect("b");
    let mut opened = Vec::new();
    for account in [a, b] {
        let p = new_payment(account, "pedido-842");
        let mut tx = db.store.begin().await.expect("begin");
        let row = tx
            .insert_payment(&p, t0())
            .await
            .expect("insert")
            .expect("the order's first payment");
        let attempt = tx
            .open_intent(account, p.id, None, Operation::Authorize, &p.intent, t0())
            .await
            .expect("open");
        tx.commit().await.expect("commit");
        assert_eq!(row.id, p.id);
        assert_eq!(attempt.payment_id, p.id);
        assert_eq!(attempt.state, cobro_core::AttemptState::Pending);
        assert_eq!(attempt.send_count, 0);
        assert!(attempt.reference.starts_with("pedido-842:authorize-v1/"));
        opened.push(attempt);
    }
    assert_ne!(opened[0].provider_key, opened[1].provider_key);
    for (account, attempt) in [a, b].into_iter().zip(&opened) {
        let id = attempt.id;
        let mine = format!("account_id = '{}'", account.as_uuid());
        assert_eq!(db.count(&format!("payments WHERE {mine}")).await, 1);
        assert_eq!(db.count(&format!("intents WHERE {mine}")).await, 1);
        assert_eq!(
            db.count(&format!("attempts WHERE {mine} AND id = '{id}'"))
                .await,
            1
        );
        let queued = format!("outbox WHERE {mine} AND attempt_id = '{id}' AND state = 'pending'");
        assert_eq!(db.count(&queued).await, 1);
    }

    // An intent whose attempt the schema refuses (the payment is under
    // review): an error, after the intent's INSERT ran in the same command
    // on SQLite; the caller rolls back and nothing is left.
    db.exec(&format!(
        "UPDATE payments SET status = 'needs_review' WHERE id = '{}'",
        opened[0].payment_id
    ))
    .await;
    let mut tx = db.store.begin().await.expect("begin");
    let capture = cobro_core::IntentName::new(
        &cobro_core::OrderRef::parse("pedido-842").expect("order"),
        Operation::Capture,
        1,
    );
    let payment = opened[0].payment_id;
    let blocked = tx
        .open_intent(a, payment, None, Operation::Capture, &capture, t0())
        .await;
    assert!(
        matches!(blocked, Err(cobro_store::StoreError::SendBlocked)),
        "{blocked:?}"
    );
    tx.rollback().await.expect("rollback");

    // A second active payment for the order: refused, and nothing written.
    // The refusal aborts nothing on either store: the same transaction
    // reads the payment that blocked it (issue 53) and can still commit.
    let mut tx = db.store.begin().await.expect("begin");
    let again = tx
        .insert_payment(&new_payment(a, "pedido-842"), t0())
        .await
        .expect("insert again");
    assert!(again.is_none(), "a second active payment for the order");
    let order = cobro_core::OrderRef::parse("pedido-842").expect("order");
    assert_eq!(
        tx.lock_active_payment_for_account(a, &order)
            .await
            .expect("the blocking payment, read in the same transaction"),
        Some(payment),
    );
    tx.commit().await.expect("commit");
    for table in ["payments", "intents", "attempts", "outbox"] {
        assert_eq!(db.count(table).await, 2, "{table}");
    }
}

/// GET's read (one joined statement): the payment with every attempt,
/// oldest first; a payment without attempts with none (not "not found");
/// another account's payment not at all.
async fn a_payment_is_read_with_its_attempts_in_order_and_only_in_its_account(backend: Backend) {
    let db = TestDb::new(backend).await;
    let a = db.store.create_account("a", t0()).await.expect("a");
    let b = db.store.create_account("b", t0()).await.expect("b");
    let with = seed_payment_with_attempt(&db.store, a, "pedido-842").await;
    let capture = cobro_core::IntentName::new(
        &cobro_core::OrderRef::parse("pedido-842").expect("order"),
        Operation::Capture,
        1,
    );
    let mut tx = db.store.begin().await.expect("begin");
    let later = tx
        .open_intent(
            a,
            with,
            None,
            Operation::Capture,
            &capture,
            t0() + Duration::seconds(1),
        )
        .await
        .expect("capture intent");
    let bare = new_payment(a, "pedido-843");
    assert!(
        tx.insert_payment(&bare, t0())
            .await
            .expect("insert")
            .is_some()
    );
    tx.commit().await.expect("commit");

    let (payment, attempts) = db
        .store
        .payment_with_attempts_for_account(a, with)
        .await
        .expect("read")
        .expect("found");
    assert_eq!(payment.id, with);
    let operations: Vec<_> = attempts.iter().map(|x| x.operation).collect();
    assert_eq!(operations, [Operation::Authorize, Operation::Capture]);
    assert_eq!(attempts[1].id, later.id);
    assert!(attempts.iter().all(|x| x.payment_id == with));

    let (payment, attempts) = db
        .store
        .payment_with_attempts_for_account(a, bare.id)
        .await
        .expect("read bare")
        .expect("a payment without attempts is found");
    assert_eq!((payment.id, attempts.len()), (bare.id, 0));

    for id in [with, bare.id] {
        let other = db.store.payment_with_attempts_for_account(b, id).await;
        assert!(matches!(other, Ok(None)), "{other:?}");
    }
}

async fn an_account_name_is_taken_once_whatever_the_code_above_checked(backend: Backend) {
    let db = TestDb::new(backend).await;
    db.store.create_account("acme", t0()).await.expect("first");
    let again = db.store.create_account("acme", t0()).await;
    assert!(
        matches!(again, Err(cobro_store::StoreError::UniqueViolation { .. })),
        "{again:?}"
    );
    assert_eq!(db.count("accounts WHERE name = 'acme'").await, 1);
}

/// The error and every cause under it, as one line.
fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        text = format!("{text}: {c}");
        cause = c.source();
    }
    text
}

async fn migrating_a_database_with_shared_account_names_fails_naming_the_fix(backend: Backend) {
    let db = TestDb::new(backend).await;
    // A database from before 0008, when only `cobro accounts create`'s own
    // look-up kept names apart (two concurrent creates could both pass).
    db.exec("DROP INDEX accounts_name_key").await;
    // And from before every later migration (0009's trigger, on PostgreSQL
    // only, is gone already: 0012 dropped it, and running them again
    // creates and drops it again; 0012 changes nothing else).
    // 0023's first: its trigger and view read columns older ones add.
    match backend {
        Backend::Postgres => {
            db.exec("DROP TRIGGER payments_rerouted ON payments").await;
            db.exec("DROP FUNCTION cobro_payment_rerouted()").await;
        }
        Backend::Sqlite => db.exec("DROP TRIGGER payments_rerouted").await,
    }
    for statement in [
        "DROP TABLE provider_circuits",
        "DROP TABLE provider_health",
        "DROP TABLE routing_changes",
        "DROP TABLE routing_rules",
        "DROP INDEX attempts_one_success_per_intent",
        "ALTER TABLE attempts DROP COLUMN sends_not_left",
    ] {
        db.exec(statement).await;
    }
    // 0011's index and columns, then 0010's columns, on both.
    db.exec("DROP INDEX attempts_one_unresolved_per_intent")
        .await;
    db.exec(
        "CREATE UNIQUE INDEX attempts_one_unresolved_per_intent ON attempts (intent_id) \
         WHERE state IN ('pending', 'unknown', 'reconciling', 'held')",
    )
    .await;
    for table in [
        "attempts",
        "outbox",
        "attempt_observations",
        "reconciliation_decisions",
        "evidence_conflicts",
    ] {
        db.exec(&format!("ALTER TABLE {table} DROP COLUMN account_id"))
            .await;
    }
    // 0021 and 0023 recreate the payments' event view with the columns
    // they add: a stand-in that does not read them, while they are dropped.
    let payment_stand_in = "payment_event_objects AS SELECT p.id, p.account_id, p.event_seq, \
                            p.updated_at, CAST('{}' AS TEXT) AS data FROM payments p";
    match backend {
        Backend::Postgres => {
            db.exec(&format!("CREATE OR REPLACE VIEW {payment_stand_in}"))
                .await;
        }
        Backend::Sqlite => {
            db.exec("DROP VIEW payment_event_objects").await;
            db.exec(&format!("CREATE VIEW {payment_stand_in}")).await;
        }
    }
    db.exec("ALTER TABLE payments DROP COLUMN route").await;
    for (table, column) in [
        ("accounts", "provider"),
        ("payments", "provider"),
        ("attempts", "provider"),
        ("attempts", "provider_request_id"),
        ("attempts", "provider_replayed"),
    ] {
        db.exec(&format!("ALTER TABLE {table} DROP COLUMN {column}"))
            .await;
    }
    for column in [
        "return_url",
        "next_action",
        "action_expires_at",
        "action_refreshed_at",
    ] {
        db.exec(&format!("ALTER TABLE payments DROP COLUMN {column}"))
            .await;
    }
    // 0016 to 0022's, newest first.
    for statement in [
        "DROP TABLE books_listed",
        "DROP TABLE books_runs",
        "DROP TABLE books_cursors",
        "DROP TABLE books_orphans",
        "DROP INDEX attempts_settled_by_send",
        "DROP INDEX payments_by_provider_ref",
        "DROP INDEX refunds_by_provider_ref",
        "DROP INDEX event_deliveries_payment_order",
        "ALTER TABLE event_deliveries DROP COLUMN payment_id",
        "ALTER TABLE event_deliveries DROP COLUMN sequence",
    ] {
        db.exec(statement).await;
    }
    // 0016 recreates the refunds' event view with the column it adds: a
    // stand-in that does not read it, while the column is dropped.
    let stand_in = "refund_event_objects AS SELECT r.id, r.account_id, r.payment_id, \
                    r.updated_at, CAST('{}' AS TEXT) AS data FROM refunds r";
    match backend {
        Backend::Postgres => {
            db.exec(&format!("CREATE OR REPLACE VIEW {stand_in}")).await;
        }
        Backend::Sqlite => {
            db.exec("DROP VIEW refund_event_objects").await;
            db.exec(&format!("CREATE VIEW {stand_in}")).await;
        }
    }
    db.exec("DROP INDEX refunds_one_per_reference").await;
    db.exec("ALTER TABLE refunds DROP COLUMN reference").await;
    db.exec("DELETE FROM _sqlx_migrations WHERE version >= 8")
        .await;
    // As `cobro accounts create` did before 0010.
    for _ in 0..2 {
        db.exec(&format!(
            "INSERT INTO accounts (id, name, created_at) \
             VALUES ('{}', 'acme', '2026-11-30T12:00:00.000000Z')",
            uuid::Uuid::now_v7()
        ))
        .await;
    }

    let refused = db
        .store
        .migrate()
        .await
        .expect_err("0008 must refuse shared names");
    let text = chain(&refused);
    assert!(text.contains("account names must be unique"), "{text}");
    assert!(text.contains("then run cobro migrate again"), "{text}");
    assert_eq!(
        db.store.schema_version().await.expect("version"),
        7,
        "nothing applied"
    );
    assert_eq!(
        db.count("accounts WHERE name = 'acme'").await,
        2,
        "nothing changed"
    );

    db.exec(
        "UPDATE accounts SET name = 'acme-2' WHERE id = \
         (SELECT id FROM accounts WHERE name = 'acme' ORDER BY id DESC LIMIT 1)",
    )
    .await;
    // A new process, as `cobro migrate` is: on PostgreSQL the failed run's
    // pooled connection still holds sqlx's migration advisory lock.
    db.store.close().await;
    let store = Store::connect(&cobro_store::StoreConfig::new(db.url.clone()))
        .await
        .expect("connect");
    store
        .migrate()
        .await
        .expect("0008 once the names are unique");
    assert!(store.create_account("acme", t0()).await.is_err());
}

async fn typed_columns_round_trip_and_an_unknown_stored_value_is_corrupt(backend: Backend) {
    let db = TestDb::new(backend).await;
    let account = db.store.create_account("a", t0()).await.expect("account");
    let id = seed_payment_with_attempt(&db.store, account, "o-1").await;
    let row = stored_payment(&db.store, account, id).await;
    assert_eq!(row.status, PaymentStatus::Processing);
    assert_eq!(row.currency.code(), "EUR");
    assert_eq!(row.capture_method, cobro_core::CaptureMethod::Automatic);
    let attempts = db
        .store
        .attempts_of_payment_any_account(id)
        .await
        .expect("attempts");
    assert_eq!(attempts[0].operation, Operation::Authorize);
    assert_eq!(attempts[0].state, cobro_core::AttemptState::Pending);

    // (`capture_method` has a CHECK, so no other value can be stored.)
    for (column, value) in [("status", "processing_v2"), ("currency", "eur")] {
        db.exec(&format!(
            "UPDATE payments SET {column} = '{value}' WHERE order_ref = 'o-1'"
        ))
        .await;
        let read = db.store.payment_for_account(account, id).await;
        assert!(
            matches!(read, Err(cobro_store::StoreError::Corrupt(_))),
            "{column} = {value:?} must not be read as a value: {read:?}"
        );
        db.exec("UPDATE payments SET status = 'processing', currency = 'EUR'")
            .await;
    }
    db.exec("UPDATE attempts SET state = 'limbo'").await;
    let read = db.store.attempts_of_payment_any_account(id).await;
    assert!(
        matches!(read, Err(cobro_store::StoreError::Corrupt(_))),
        "{read:?}"
    );
}

/// The payment as stored, which must exist.
async fn stored_payment(
    store: &Store,
    account: AccountId,
    id: PaymentId,
) -> cobro_store::PaymentRow {
    store
        .payment_for_account(account, id)
        .await
        .expect("read")
        .expect("exists")
}

async fn a_transition_from_a_stale_state_changes_nothing(backend: Backend) {
    let db = TestDb::new(backend).await;
    let account = db.store.create_account("a", t0()).await.expect("account");
    let id = seed_payment_with_attempt(&db.store, account, "o-1").await;
    let mut tx = db.store.begin().await.expect("begin");
    assert!(
        tx.transition_payment(
            account,
            id,
            PaymentStatus::Processing,
            PaymentStatus::Authorized,
            t0()
        )
        .await
        .expect("first")
        .is_some()
    );
    assert!(
        tx.transition_payment(
            account,
            id,
            PaymentStatus::Processing,
            PaymentStatus::Declined,
            t0()
        )
        .await
        .expect("stale")
        .is_none(),
        "a second decision from the old state must update zero rows"
    );
    tx.commit().await.expect("commit");
    let row = stored_payment(&db.store, account, id).await;
    assert_eq!(row.status, PaymentStatus::Authorized);

    // Another account cannot move it either.
    let other = db.store.create_account("b", t0()).await.expect("account");
    let mut tx = db.store.begin().await.expect("begin");
    assert!(
        tx.transition_payment(
            other,
            id,
            PaymentStatus::Authorized,
            PaymentStatus::Capturing,
            t0()
        )
        .await
        .expect("cross-account")
        .is_none()
    );
}

/// `provider_sequence` counts the events of the payment's charge
/// (`provider_ref`): an outcome that names that charge, or none, keeps it;
/// one that names another charge (an operator re-pointing the payment)
/// starts it over, so that charge's events are not stale by the old count.
async fn the_provider_sequence_starts_over_only_for_another_charge(backend: Backend) {
    use cobro_store::settle::PaymentOutcome;
    let db = TestDb::new(backend).await;
    let account = db.store.create_account("a", t0()).await.expect("account");
    let id = seed_payment_with_attempt(&db.store, account, "o-1").await;
    let charge = |name: &str| PaymentOutcome {
        provider_ref: Some(name.to_owned()),
        ..PaymentOutcome::default()
    };
    let steps = [
        (
            PaymentStatus::Processing,
            PaymentStatus::Authorized,
            charge("ch_a"),
            3,
        ),
        (
            PaymentStatus::Authorized,
            PaymentStatus::Capturing,
            PaymentOutcome::default(),
            3,
        ),
        (
            PaymentStatus::Capturing,
            PaymentStatus::Captured,
            charge("ch_a"),
            3,
        ),
        (
            PaymentStatus::Captured,
            PaymentStatus::NeedsReview,
            charge("ch_b"),
            0,
        ),
    ];
    let mut tx = db.store.begin().await.expect("begin");
    for (i, (from, to, outcome, sequence)) in steps.into_iter().enumerate() {
        let row = tx
            .settle_payment(id, from, to, &outcome, t0())
            .await
            .expect("settle")
            .expect("moved");
        if i == 0 {
            assert!(tx.raise_provider_sequence(id, 3).await.expect("raise"));
            continue;
        }
        assert_eq!(row.provider_sequence, sequence, "after {from} -> {to}");
    }
    tx.commit().await.expect("commit");
    let row = stored_payment(&db.store, account, id).await;
    assert_eq!(row.provider_ref.as_deref(), Some("ch_b"));
}

async fn a_claim_leases_the_row_and_a_stale_token_writes_nothing(backend: Backend) {
    let db = TestDb::new(backend).await;
    let account = db.store.create_account("a", t0()).await.expect("account");
    seed_payment_with_attempt(&db.store, account, "o-1").await;
    let lease = Duration::seconds(30);

    let first = db
        .store
        .claim_due("worker-a", t0(), t0() + lease, 10)
        .await
        .expect("claim")
        .claims;
    assert_eq!(first.len(), 1);
    let stale = first[0].clone();
    assert_eq!(stale.token, 1);
    assert_eq!(
        db.store.record_send(&stale, t0()).await.expect("send"),
        SendMark::Marked
    );

    // worker-a stalls; its lease expires; worker-b takes over with a new token.
    let later = t0() + lease + Duration::seconds(1);
    let second = db
        .store
        .claim_due("worker-b", later, later + lease, 10)
        .await
        .expect("claim")
        .claims;
    assert_eq!(second.len(), 1);
    let fresh = &second[0];
    assert_eq!(fresh.outbox_id, stale.outbox_id);
    assert_eq!(fresh.token, 2, "each claim increments the fencing token");
    assert_eq!(
        fresh.attempt.provider_key, stale.attempt.provider_key,
        "a retry reuses the provider key"
    );
    assert_eq!(fresh.attempt.send_count, 1);

    // Every write with the old token changes nothing.
    assert!(
        !db.store
            .renew_lease(stale.outbox_id, stale.token, later, later + lease)
            .await
            .expect("renew")
    );
    assert_eq!(
        db.store.record_send(&stale, later).await.expect("send"),
        SendMark::LeaseLost
    );
    let mut tx = db.store.begin().await.expect("begin");
    assert!(
        !tx.finish_outbox(stale.outbox_id, stale.token, later)
            .await
            .expect("finish")
    );
    tx.commit().await.expect("commit");
    let attempts = db
        .store
        .attempts_of_payment_any_account(fresh.attempt.payment_id)
        .await
        .expect("attempts");
    assert_eq!(attempts[0].send_count, 1, "the stale send was not recorded");

    // The new owner's writes land.
    assert!(
        db.store
            .renew_lease(fresh.outbox_id, fresh.token, later, later + lease)
            .await
            .expect("renew")
    );
    assert_eq!(
        db.store.record_send(fresh, later).await.expect("send"),
        SendMark::Marked
    );
    let mut tx = db.store.begin().await.expect("begin");
    assert!(
        tx.finish_outbox(fresh.outbox_id, fresh.token, later)
            .await
            .expect("finish")
    );
    tx.commit().await.expect("commit");
    let attempts = db
        .store
        .attempts_of_payment_any_account(fresh.attempt.payment_id)
        .await
        .expect("attempts");
    assert_eq!(attempts[0].send_count, 2);
    assert_eq!(attempts[0].first_send_at.map(|t| t.0), Some(t0()));
    // Done rows are never claimed again.
    let far = later + Duration::days(1);
    assert!(
        db.store
            .claim_due("worker-c", far, far + lease, 10)
            .await
            .expect("claim")
            .claims
            .is_empty()
    );
}

async fn a_leased_row_is_not_claimed_again_until_its_lease_expires(backend: Backend) {
    let db = TestDb::new(backend).await;
    let account = db.store.create_account("a", t0()).await.expect("account");
    for i in 0..5 {
        seed_payment_with_attempt(&db.store, account, &format!("o-{i}")).await;
    }
    let lease = Duration::seconds(30);
    let a = db
        .store
        .claim_due("worker-a", t0(), t0() + lease, 3)
        .await
        .expect("claim")
        .claims;
    let b = db
        .store
        .claim_due(
            "worker-b",
            t0(),
            t0() + lease + Duration::milliseconds(1),
            10,
        )
        .await
        .expect("claim")
        .claims;
    assert_eq!(a.len(), 3, "a claim takes at most its batch");
    assert_eq!(b.len(), 2, "a second claim takes only the rows still free");
    let mut ids: Vec<_> = a.iter().chain(&b).map(|c| c.outbox_id).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 5, "no row is leased twice");
    let just_before = t0() + lease - Duration::milliseconds(1);
    assert!(
        db.store
            .claim_due("worker-c", just_before, just_before + lease, 10)
            .await
            .expect("claim")
            .claims
            .is_empty()
    );
}

/// Found by the explorer (2026-12-02): with statistics taken while the
/// outbox held one row, PostgreSQL planned the claim as a nested loop with
/// the `LIMIT ... FOR UPDATE SKIP LOCKED` subquery on the inner side,
/// evaluated again for every outbox row, so one claim of limit 1 leased two
/// or three rows (a worker took more calls than its slots). Rows due at the
/// same instant, as after one clock jump, make it likely.
async fn a_claim_takes_at_most_its_limit_whatever_plan_the_statistics_choose(backend: Backend) {
    let db = TestDb::new(backend).await;
    let account = db.store.create_account("a", t0()).await.expect("account");
    seed_payment_with_attempt(&db.store, account, "o-0").await;
    db.exec("ANALYZE outbox").await;
    db.exec("ANALYZE attempts").await;
    for i in 1..6 {
        seed_payment_with_attempt(&db.store, account, &format!("o-{i}")).await;
    }
    let lease = Duration::seconds(30);
    let mut leased = Vec::new();
    for round in 0..6 {
        let claims = db
            .store
            .claim_due(&format!("worker-{round}"), t0(), t0() + lease, 1)
            .await
            .expect("claim")
            .claims;
        assert_eq!(
            claims.len(),
            1,
            "claim {round} of limit 1 took {}",
            claims.len()
        );
        leased.extend(claims.into_iter().map(|c| c.outbox_id));
    }
    leased.sort();
    leased.dedup();
    assert_eq!(leased.len(), 6, "six claims leased six distinct rows");
    let rest = db.store.claim_due("worker-z", t0(), t0() + lease, 1).await;
    assert!(rest.expect("claim").claims.is_empty(), "nothing is left");
}

/// The event-delivery claim has the outbox claim's shape (a `LIMIT ... FOR
/// UPDATE SKIP LOCKED` pick joined to an UPDATE) and the same hazard: with
/// statistics taken while one delivery was pending, PostgreSQL could re-run
/// the pick per row and lease every pending delivery.
async fn a_delivery_claim_takes_at_most_its_limit_whatever_plan_the_statistics_choose(
    backend: Backend,
) {
    let db = TestDb::new(backend).await;
    let account = db.store.create_account("a", t0()).await.expect("account");
    db.store
        .create_endpoint(account, "http://127.0.0.1:9/hook", "whsec_x", &[], t0())
        .await
        .expect("endpoint");
    // Each payment's creation writes one event, so one delivery.
    seed_payment_with_attempt(&db.store, account, "o-0").await;
    db.store.sequence_events(t0()).await.expect("sequence");
    for table in ["event_deliveries", "event_endpoints", "events"] {
        db.exec(&format!("ANALYZE {table}")).await;
    }
    for i in 1..6 {
        seed_payment_with_attempt(&db.store, account, &format!("o-{i}")).await;
    }
    db.store.sequence_events(t0()).await.expect("sequence");
    let lease = Duration::seconds(30);
    let mut leased = Vec::new();
    for round in 0..6 {
        let claims = db
            .store
            .claim_deliveries(&format!("dispatcher-{round}"), t0(), t0() + lease, 1, &[])
            .await
            .expect("claim");
        assert_eq!(
            claims.len(),
            1,
            "delivery claim {round} of limit 1 took {}",
            claims.len()
        );
        leased.extend(claims.into_iter().map(|c| c.event.id));
    }
    leased.sort();
    leased.dedup();
    assert_eq!(leased.len(), 6, "six claims leased six distinct deliveries");
    let rest = db
        .store
        .claim_deliveries("dispatcher-z", t0(), t0() + lease, 1, &[]);
    assert!(rest.await.expect("claim").is_empty(), "nothing is left");
}

async fn compaction_keeps_scope_key_fingerprint_and_resource(backend: Backend) {
    let db = TestDb::new(backend).await;
    let account = db.store.create_account("a", t0()).await.expect("account");
    let resource = PaymentId::new();
    let key = scope(account, "k-1");
    let mut tx = db.store.begin().await.expect("begin");
    assert!(matches!(
        tx.reserve_key(
            &key,
            &fingerprint(5),
            (ResourceType::Payment, resource.as_uuid()),
            t0()
        )
        .await
        .expect("reserve"),
        Reservation::Reserved
    ));
    tx.complete_key(&key, 201, b"{\"id\":1}")
        .await
        .expect("complete");
    tx.commit().await.expect("commit");

    // Not yet older than the cutoff: untouched.
    assert_eq!(
        db.store
            .compact_idempotency_records(t0(), 100)
            .await
            .expect("compact"),
        0
    );
    let cutoff = t0() + Duration::hours(24);
    assert_eq!(
        db.store
            .compact_idempotency_records(cutoff, 100)
            .await
            .expect("compact"),
        1
    );
    let tomb = db
        .store
        .find_record(&key)
        .await
        .expect("read")
        .expect("tombstone stays");
    assert_eq!(tomb.response_body, None);
    assert_eq!(tomb.fingerprint, fingerprint(5));
    assert_eq!(tomb.resource_id, resource.as_uuid());
    assert_eq!(tomb.status_code, 201);
    // Compaction is idempotent.
    assert_eq!(
        db.store
            .compact_idempotency_records(cutoff, 100)
            .await
            .expect("compact"),
        0
    );

    // A tombstone still holds the key.
    let mut tx = db.store.begin().await.expect("begin");
    assert!(matches!(
        tx.reserve_key(
            &key,
            &fingerprint(6),
            (ResourceType::Payment, PaymentId::new().as_uuid()),
            cutoff
        )
        .await
        .expect("reserve"),
        Reservation::Taken(_)
    ));
    tx.rollback().await.expect("rollback");

    assert_eq!(
        db.store
            .delete_expired_tombstones(t0(), 100)
            .await
            .expect("delete"),
        0
    );
    assert_eq!(
        db.store
            .delete_expired_tombstones(t0() + Duration::days(31), 100)
            .await
            .expect("delete"),
        1
    );
    assert!(
        db.store.find_record(&key).await.expect("read").is_none(),
        "after expiry the key is new again"
    );
}

async fn the_same_key_in_another_account_is_another_record(backend: Backend) {
    let db = TestDb::new(backend).await;
    let a = db.store.create_account("a", t0()).await.expect("account");
    let b = db.store.create_account("b", t0()).await.expect("account");
    for account in [a, b] {
        let mut tx = db.store.begin().await.expect("begin");
        assert!(matches!(
            tx.reserve_key(
                &scope(account, "shared"),
                &fingerprint(1),
                (ResourceType::Payment, PaymentId::new().as_uuid()),
                t0()
            )
            .await
            .expect("reserve"),
            Reservation::Reserved
        ));
        tx.complete_key(&scope(account, "shared"), 201, b"x")
            .await
            .expect("complete");
        tx.commit().await.expect("commit");
    }
    let ra = db
        .store
        .find_record(&scope(a, "shared"))
        .await
        .expect("read")
        .expect("a");
    let rb = db
        .store
        .find_record(&scope(b, "shared"))
        .await
        .expect("read")
        .expect("b");
    assert_ne!(ra.resource_id, rb.resource_id);
}

async fn a_token_is_refused_from_its_expiry_on_and_once_revoked(backend: Backend) {
    let db = TestDb::new(backend).await;
    let a = db.store.create_account("a", t0()).await.expect("account");
    let b = db.store.create_account("b", t0()).await.expect("account");
    let expires = t0() + Duration::hours(1);
    let token = cobro_store::accounts::NewTokenRow {
        label: "ci",
        token_hash: "hash-expiring",
        prefix: "cobro_1a2b3c4d",
        expires_at: Some(expires),
    };
    let expiring = db
        .store
        .create_token_expiring(a, &token, t0())
        .await
        .expect("token");
    let forever = db
        .store
        .create_token(b, "", "hash-forever", t0())
        .await
        .expect("token");
    let at = |hash: &'static str, when| db.store.account_for_token_at(hash, when);
    assert_eq!(at("hash-expiring", t0()).await.expect("lookup"), Some(a));
    let just_before = expires - Duration::microseconds(1);
    assert_eq!(
        at("hash-expiring", just_before).await.expect("lookup"),
        Some(a)
    );
    assert_eq!(
        at("hash-expiring", expires).await.expect("lookup"),
        None,
        "expired at expires_at"
    );
    let far = t0() + Duration::days(3650);
    assert_eq!(at("hash-forever", far).await.expect("lookup"), Some(b));

    let later = t0() + Duration::minutes(5);
    assert!(db.store.revoke_token(forever, later).await.expect("revoke"));
    assert!(
        !db.store.revoke_token(forever, far).await.expect("revoke"),
        "a second revocation changes nothing"
    );
    assert_eq!(at("hash-forever", later).await.expect("lookup"), None);
    assert!(
        !db.store
            .revoke_token(cobro_core::TokenId::new(), later)
            .await
            .expect("revoke")
    );

    let listed = db.store.list_tokens(None).await.expect("list");
    let ids: Vec<_> = listed.iter().map(|t| t.id).collect();
    assert_eq!(ids, vec![expiring, forever]);
    assert_eq!(listed[0].account_name, "a");
    assert_eq!(listed[0].prefix, "cobro_1a2b3c4d");
    assert_eq!(listed[1].prefix, "", "create_token stores no prefix");
    assert_eq!(listed[0].expires_at.map(|t| t.0), Some(expires));
    assert_eq!(listed[0].revoked_at, None);
    assert_eq!(
        listed[1].revoked_at.map(|t| t.0),
        Some(later),
        "the first revocation is kept"
    );
    let only_b = db.store.list_tokens(Some(b)).await.expect("list");
    assert_eq!(only_b.len(), 1);
    assert_eq!(only_b[0].id, forever);
}

async fn an_unreadable_attempt_fails_only_itself_in_a_claim_and_in_a_candidate_page(
    backend: Backend,
) {
    let db = TestDb::new(backend).await;
    let account = db.store.create_account("a", t0()).await.expect("account");
    let mut ids = Vec::new();
    for order in ["o-1", "o-2", "o-3"] {
        ids.push(seed_payment_with_attempt(&db.store, account, order).await);
    }
    db.corrupt_attempts_of("o-2", "state", "limbo").await;
    let lease = Duration::seconds(30);
    let claimed = db
        .store
        .claim_due("worker-a", t0(), t0() + lease, 10)
        .await
        .expect("one bad row does not fail the claim");
    let mut good: Vec<_> = claimed
        .claims
        .iter()
        .map(|c| c.attempt.payment_id)
        .collect();
    good.sort();
    assert_eq!(good, vec![ids[0], ids[2]]);
    let [bad] = claimed.unreadable.as_slice() else {
        panic!("one unreadable row: {:?}", claimed.unreadable)
    };
    assert_eq!(bad.attempt.payment_id, ids[1]);
    assert!(
        matches!(bad.attempt.error, cobro_store::StoreError::Corrupt(_)),
        "{bad:?}"
    );
    // It stays leased: no one claims it before its lease expires.
    let again = db
        .store
        .claim_due("worker-b", t0(), t0() + lease, 10)
        .await
        .expect("claim");
    assert_eq!(again.leased(), 0);

    // The reconciler's pages: the bad row takes its place (and the cursor
    // passes it), the rest read as usual.
    db.exec("UPDATE attempts SET state = 'reconciling'").await;
    db.corrupt_attempts_of("o-2", "operation", "limbo").await;
    let mut seen = Vec::new();
    let mut after = None;
    loop {
        let page = db
            .store
            .reconcile_candidates_any_account(t0(), None, after, 1)
            .await
            .expect("one bad row does not fail the page");
        let Some(row) = page.into_iter().next() else {
            break;
        };
        let (id, payment, readable) = match row {
            Ok(a) => (a.id, a.payment_id, true),
            Err(bad) => {
                assert!(matches!(bad.error, cobro_store::StoreError::Corrupt(_)));
                (bad.id, bad.payment_id, false)
            }
        };
        after = Some(id);
        seen.push((payment, readable));
    }
    assert_eq!(seen, vec![(ids[0], true), (ids[1], false), (ids[2], true)]);
    // Single-row and other reads stay strict.
    assert!(matches!(
        db.store.attempts_of_payment_any_account(ids[1]).await,
        Err(cobro_store::StoreError::Corrupt(_))
    ));
}

async fn attempts_read_for_an_account_are_empty_for_another_accounts_payment(backend: Backend) {
    let db = TestDb::new(backend).await;
    let a = db.store.create_account("a", t0()).await.expect("account");
    let b = db.store.create_account("b", t0()).await.expect("account");
    let id = seed_payment_with_attempt(&db.store, a, "o-1").await;
    db.exec("UPDATE attempts SET state = 'held'").await;
    let of = |account| {
        let store = db.store.clone();
        async move {
            let pooled = store
                .attempts_of_payment_for_account(account, id)
                .await
                .expect("attempts");
            let mut tx = store.begin().await.expect("begin");
            let in_tx = tx
                .attempts_of_payment_for_account(account, id)
                .await
                .expect("attempts");
            let held = tx
                .held_attempts_for_account(account, id)
                .await
                .expect("held");
            tx.rollback().await.expect("rollback");
            (pooled.len(), in_tx.len(), held.len())
        }
    };
    assert_eq!(of(a).await, (1, 1, 1));
    assert_eq!(of(b).await, (0, 0, 0), "another account's payment has none");
}

/// The HTTP API acts on a merchant's behalf: it reads through
/// `..._for_account` only, so no call order can leak another account's
/// rows. A source check, since no test of behaviour sees an order bug
/// before it ships.
#[test]
fn the_api_never_calls_an_any_account_read() {
    fn sources(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
        for entry in std::fs::read_dir(dir).expect("read dir") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                sources(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../crates/api/src");
    let mut files = Vec::new();
    sources(&root, &mut files);
    assert!(files.len() > 3, "found the API's sources at {root:?}");
    let mut calls = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file).expect("read");
        for (n, line) in text.lines().enumerate() {
            if let Some(at) = line.find("_any_account") {
                let name_start = line[..at]
                    .rfind(|c: char| !(c.is_alphanumeric() || c == '_'))
                    .map_or(0, |i| i + 1);
                let called = line[at + "_any_account".len()..]
                    .trim_start()
                    .starts_with('(')
                    || line[..name_start].ends_with('.')
                    || line[..name_start].ends_with("::");
                if called {
                    calls.push(format!("{}:{}: {}", file.display(), n + 1, line.trim()));
                }
            }
        }
    }
    assert!(
        calls.is_empty(),
        "the API calls _any_account reads:\n{}",
        calls.join("\n")
    );
}

/// A PostgreSQL store of one connection (acquire timeout 2 s, deadline
/// 300 ms) reached through a relay that can stop passing bytes
/// (`cobro_test_support::freeze`), answering.
async fn behind_a_relay() -> (TestDb, cobro_test_support::freeze::FreezingProxy, Store) {
    use cobro_test_support::freeze::{FreezingProxy, server_of};
    let db = TestDb::new(Backend::Postgres).await;
    let proxy = FreezingProxy::start(server_of(&db.url).await).await;
    let mut config = cobro_store::StoreConfig::new(proxy.url_through(&db.url));
    config.max_connections = 1;
    config.acquire_timeout = std::time::Duration::from_secs(2);
    config.deadline = std::time::Duration::from_millis(300);
    let store = Store::connect(&config).await.expect("connect");
    store.check_schema().await.expect("answers before");
    (db, proxy, store)
}

/// Lets the relay pass bytes again and waits until the store answers.
async fn thaw_and_serve(proxy: &cobro_test_support::freeze::FreezingProxy, store: &Store) {
    proxy.thaw();
    cobro_test_support::wait_for(
        "the pool serves again",
        std::time::Duration::from_secs(20),
        async || store.check_schema().await.ok(),
    )
    .await;
}

/// A `BEGIN` cut short by its deadline may still reach the server (the
/// bytes were on their way): the connection is then inside a transaction
/// that sqlx, which counts one only once its `BEGIN` was answered, does not
/// know of. Such a connection must never be reused: every autocommit write
/// on it would stay uncommitted, invisible to everyone, holding its locks.
/// Here the server answers again just after the deadline, and the pool (of
/// one connection) must serve the next call on a fresh connection, with no
/// session of the database left idle in a transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_begin_cut_short_by_its_deadline_never_leaves_a_transaction_behind() {
    let (db, proxy, store) = behind_a_relay().await;
    proxy.freeze();
    assert!(
        matches!(
            store.begin().await,
            Err(cobro_store::StoreError::Unavailable(_))
        ),
        "BEGIN met its deadline"
    );
    // The BEGIN (and anything sent after it) reaches the server now.
    thaw_and_serve(&proxy, &store).await;
    let direct = sqlx::PgPool::connect(&db.url).await.expect("direct");
    let database: String = sqlx::query_scalar("SELECT current_database()")
        .fetch_one(&direct)
        .await
        .expect("name");
    // The relay passes the cut BEGIN and then the closed socket: that
    // session ends at once. A connection reused in a transaction would sit
    // there until the server's idle-in-transaction timeout (60 s).
    cobro_test_support::wait_for(
        "no session of the database is left inside a transaction",
        std::time::Duration::from_secs(10),
        async || {
            let in_transaction: i64 = sqlx::query_scalar(
                "SELECT COUNT(*) FROM pg_stat_activity WHERE datname = $1 \
                 AND state LIKE 'idle in transaction%' AND pid <> pg_backend_pid()",
            )
            .bind(&database)
            .fetch_one(&direct)
            .await
            .expect("pg_stat_activity");
            (in_transaction == 0).then_some(())
        },
    )
    .await;
    direct.close().await;
}

/// A database that stops answering without closing anything (a frozen
/// primary; a partition with no router to cut the sessions): a `COMMIT`, a
/// read and a `BEGIN` each fail `Unavailable` once their deadline has
/// passed, instead of waiting for ever; and once the server answers again
/// the pool (of one connection, which a connection left hanging would
/// starve for good) serves again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_server_that_stops_answering_fails_each_call_by_its_deadline() {
    use cobro_store::StoreError;
    let (_db, proxy, store) = behind_a_relay().await;
    let tx = store.begin().await.expect("begin");
    proxy.freeze();
    // A call never given up on fails the test here instead of stalling it.
    let guard = std::time::Duration::from_secs(60);
    let hung = "a call to the silent server was never given up";
    let unavailable = |what: &str, got: Result<(), StoreError>| {
        assert!(
            matches!(got, Err(StoreError::Unavailable(_))),
            "{what}: {got:?}"
        );
    };
    unavailable(
        "commit",
        tokio::time::timeout(guard, tx.commit()).await.expect(hung),
    );
    for _ in 0..2 {
        let read = tokio::time::timeout(guard, store.schema_version()).await;
        unavailable("read", read.expect(hung).map(drop));
        let begin = tokio::time::timeout(guard, store.begin()).await;
        unavailable("begin", begin.expect(hung).map(drop));
    }
    thaw_and_serve(&proxy, &store).await;
}

/// cobro's PostgreSQL pool (crates/store/src/pg_pool.rs) sends nothing when
/// a connection in sync with the server goes back, unlike sqlx's pool,
/// which pings every connection it takes back. A transaction dropped open (a handler that returned early, a task
/// aborted) must still be rolled back when its connection goes back to the
/// pool, not when someone next uses that connection: until then its row
/// locks would stop every other writer of those rows. On a pool of one
/// connection, each round drops a transaction holding a row lock, takes the
/// connection back from the pool (sending nothing), and takes the same lock
/// from another session with NOWAIT. A cancelled statement's late answer must
/// not reach the next user either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_connection_given_back_mid_transaction_is_rolled_back_at_once() {
    use sqlx::Connection;
    let db = TestDb::new(Backend::Postgres).await;
    let options: sqlx::postgres::PgConnectOptions = db.url.parse().expect("url");
    let ten = std::time::Duration::from_secs(10);
    let pool = cobro_store::pg_pool::PgPool::connect(options, 1, ten, ten)
        .await
        .expect("pool");
    let mut other = sqlx::PgConnection::connect(&db.url)
        .await
        .expect("another session");
    sqlx::raw_sql("CREATE TABLE drained (v int PRIMARY KEY); INSERT INTO drained VALUES (1)")
        .execute(&pool)
        .await
        .expect("create");
    // The connection is back in the pool when the pool hands it out again.
    // Taking it sends nothing (no test before acquire), so the rollback
    // seen below was done on the way back, not by this use.
    let back = |pool: &cobro_store::pg_pool::PgPool| {
        let pool = pool.clone();
        async move {
            tokio::time::timeout(std::time::Duration::from_secs(10), pool.acquire())
                .await
                .expect("the connection never came back")
                .expect("acquire")
        }
    };
    for round in 0..3 {
        {
            let mut tx = pool.begin().await.expect("begin");
            sqlx::query("SELECT v FROM drained WHERE v = 1 FOR UPDATE")
                .execute(&mut tx)
                .await
                .expect("lock");
            sqlx::query("UPDATE drained SET v = 2 WHERE v = 1")
                .execute(&mut tx)
                .await
                .expect("update");
        }
        let held = back(&pool).await;
        let locked: Result<Option<i32>, _> =
            sqlx::query_scalar("SELECT v FROM drained WHERE v = 1 FOR UPDATE NOWAIT")
                .fetch_optional(&mut other)
                .await;
        assert_eq!(
            locked.expect("the row is free as soon as the connection is back in the pool"),
            Some(1),
            "round {round}: the dropped update was rolled back"
        );
        drop(held);
        // Cancelled while PostgreSQL is still sleeping.
        let slow = sqlx::query_scalar::<_, i32>("SELECT 1 FROM pg_sleep(0.3)").fetch_one(&pool);
        assert!(
            tokio::time::timeout(std::time::Duration::from_millis(30), slow)
                .await
                .is_err(),
            "the slow statement was cut off"
        );
        let next: i32 = sqlx::query_scalar("SELECT $1")
            .bind(round + 100)
            .fetch_one(&pool)
            .await
            .expect("the next statement");
        assert_eq!(next, round + 100, "the next user got its own answer");
    }
    other.close().await.expect("close");
    pool.close().await;
}

/// The worker's look-ups by key never scan a queue index (migration 0013).
/// These are copies of the store's statements; `plans.rs` checks the text
/// the store really sends, for the statements a payment's life reaches.
/// With statistics taken while the queue was empty, a partial index on the
/// queue looks like one empty page, cheaper than the primary key; a
/// statement that finds its row by key and names the queue state implied
/// the index's predicate, and a plan cached then read the whole backlog on
/// every look-up (ops/bench/results/bench.md). Here: 300 payments settled, their
/// outbox rows done, `VACUUM ANALYZE`; then a backlog of 200 pending
/// attempts; then the generic plan (as a pooled connection caches it) of
/// each of the worker's look-ups by key: none may use `outbox_due`,
/// `attempts_uncertain`, `attempts_one_unresolved_per_intent` or
/// `event_deliveries_due` (a delivery's look-up is the same shape). The claim,
/// the reconciler's sweep and the metrics' counts, which are meant to, still
/// use theirs.
#[tokio::test]
async fn postgres_a_look_up_by_key_is_never_planned_as_a_scan_of_the_queue() {
    use sqlx::Connection;
    let db = TestDb::new(Backend::Postgres).await;
    let account = db.store.create_account("a", t0()).await.expect("account");
    db.store
        .create_endpoint(account, "http://127.0.0.1:9/hook", "whsec_x", &[], t0())
        .await
        .expect("endpoint");
    for i in 0..300 {
        seed_payment_with_attempt(&db.store, account, &format!("settled-{i}")).await;
    }
    db.store.sequence_events(t0()).await.expect("sequence");
    db.exec("UPDATE outbox SET state = 'done'").await;
    db.exec("UPDATE attempts SET state = 'succeeded'").await;
    db.exec("UPDATE event_deliveries SET state = 'delivered'")
        .await;
    db.freeze_statistics(&["outbox", "attempts", "payments", "event_deliveries"])
        .await;
    for i in 0..200 {
        seed_payment_with_attempt(&db.store, account, &format!("waiting-{i}")).await;
    }
    db.store.sequence_events(t0()).await.expect("sequence");
    assert_eq!(
        db.count("event_deliveries WHERE state = 'pending'").await,
        200
    );
    let mut conn = sqlx::PgConnection::connect(&db.url).await.expect("connect");
    sqlx::raw_sql("SET plan_cache_mode = force_generic_plan")
        .execute(&mut conn)
        .await
        .expect("generic plans");
    let queue_indexes = [
        "outbox_due",
        "attempts_uncertain",
        "attempts_one_unresolved_per_intent",
        "event_deliveries_due",
    ];
    // (name, parameter types, statement as crates/store sends it, the
    // queue index it must use, if any).
    let statements: [(&str, &str, &str, Option<&str>); 11] = [
        (
            "finish_outbox",
            "uuid, bigint, timestamptz",
            "UPDATE outbox SET state = 'done', lease_owner = NULL, lease_expires_at = NULL, \
             updated_at = $3 WHERE id = $1 AND lease_token = $2 AND state = 'pending'",
            None,
        ),
        (
            "renew_lease",
            "uuid, bigint, timestamptz, timestamptz",
            "UPDATE outbox SET lease_expires_at = $3, due_at = $3, updated_at = $4 \
             WHERE id = $1 AND lease_token = $2 AND state = 'pending'",
            None,
        ),
        (
            "record_send",
            "uuid, uuid, timestamptz, bigint",
            "UPDATE attempts SET send_count = send_count + 1, \
             first_send_at = COALESCE(first_send_at, $3), last_send_at = $3, updated_at = $3 \
             WHERE id = $1 AND state IN ('pending', 'unknown') \
             AND EXISTS (SELECT 1 FROM outbox o WHERE o.attempt_id = $1 \
               AND o.id = $2 AND o.lease_token = $4 AND o.state = 'pending') \
             AND COALESCE((SELECT p.status FROM payments p WHERE p.id = attempts.payment_id FOR SHARE), '') \
               NOT IN ('requires_reconciliation', 'needs_review') \
             AND COALESCE((SELECT r.status FROM refunds r WHERE r.id = attempts.refund_id FOR SHARE), '') \
               NOT IN ('requires_reconciliation', 'needs_review')",
            None,
        ),
        (
            "resolve_attempt",
            "uuid, text, text, text, timestamptz",
            "UPDATE attempts SET state = $2, provider_ref = COALESCE($3, provider_ref), \
             last_error = COALESCE($4, last_error), updated_at = $5 \
             WHERE id = $1 AND state IN ('pending', 'unknown', 'reconciling')",
            None,
        ),
        (
            "release_held",
            "uuid, timestamptz",
            "UPDATE attempts SET state = 'pending', updated_at = $2 WHERE id = $1 AND state = 'held'",
            None,
        ),
        (
            "held_attempts",
            "uuid",
            "SELECT id FROM attempts WHERE payment_id = $1 AND state = 'held' ORDER BY created_at, id",
            None,
        ),
        (
            "delivered",
            "uuid, uuid, bigint, int, timestamptz, timestamptz",
            "UPDATE event_deliveries SET state = 'delivered', \
             attempts = attempts + 1, last_status = $4, last_error = NULL, \
             first_attempt_at = $5, delivered_at = $6, lease_owner = NULL, \
             lease_expires_at = NULL, updated_at = $6 \
             WHERE event_id = $1 AND endpoint_id = $2 AND lease_token = $3 \
             AND state = 'pending'",
            None,
        ),
        (
            "claim",
            "timestamptz, bigint",
            "SELECT id FROM outbox WHERE state = 'pending' AND due_at <= $1 \
             ORDER BY due_at LIMIT $2 FOR UPDATE SKIP LOCKED",
            Some("outbox_due"),
        ),
        (
            "reconcile_sweep",
            "timestamptz",
            "SELECT id FROM attempts WHERE state IN ('pending', 'unknown', 'reconciling') \
             AND created_at IS NOT NULL AND state IN ('unknown', 'pending') AND last_send_at < $1",
            Some("attempts_uncertain"),
        ),
        (
            "outbox_depth",
            "timestamptz",
            "SELECT COUNT(*), MIN(CASE WHEN due_at <= $1 THEN due_at END) \
             FROM outbox WHERE state = 'pending' AND due_at IS NOT NULL",
            Some("outbox_due"),
        ),
        (
            "unknown_attempts",
            "timestamptz",
            "SELECT COUNT(*) FROM attempts \
             WHERE state IN ('pending', 'unknown', 'reconciling') AND created_at IS NOT NULL \
             AND state IN ('unknown', 'reconciling') \
             AND COALESCE(first_send_at, created_at) > $1",
            Some("attempts_uncertain"),
        ),
    ];
    let mut wrong = Vec::new();
    for (name, types, sql, wanted) in statements {
        let nulls = vec!["NULL"; types.split(',').count()].join(", ");
        let (used, plan) =
            indexes_in_plan(&mut conn, (name, types, sql), &nulls, &queue_indexes).await;
        if used != wanted.into_iter().collect::<Vec<_>>() {
            wrong.push(format!("{name} uses {used:?}, wants {wanted:?}: {plan}"));
        }
    }
    assert!(wrong.is_empty(), "generic plans:\n{}", wrong.join("\n"));
}

/// Which of `candidates` the plan of `statement` (a name not yet prepared
/// on `conn`, parameter types, text), executed with `args`, reads, and the plan:
/// the generic plan or a custom one, as the connection's `plan_cache_mode`
/// says.
async fn indexes_in_plan<'a>(
    conn: &mut sqlx::PgConnection,
    (name, types, sql): (&str, &str, &str),
    args: &str,
    candidates: &[&'a str],
) -> (Vec<&'a str>, serde_json::Value) {
    let (types, args) = if types.is_empty() {
        (String::new(), String::new())
    } else {
        (format!("({types})"), format!("({args})"))
    };
    sqlx::raw_sql(&format!("PREPARE {name}{types} AS {sql}"))
        .execute(&mut *conn)
        .await
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let plan: serde_json::Value =
        sqlx::query_scalar(&format!("EXPLAIN (FORMAT JSON) EXECUTE {name}{args}"))
            .fetch_one(&mut *conn)
            .await
            .unwrap_or_else(|e| panic!("{name}: {e}"));
    let text = plan.to_string();
    let used = candidates
        .iter()
        .copied()
        .filter(|index| text.contains(&format!("\"Index Name\":\"{index}\"")))
        .collect();
    (used, plan)
}

/// The same trap for the indexes of the unsettled: `payments_unsettled`,
/// `refunds_unsettled` and `evidence_conflicts_open` are partial on the
/// states a payment, a refund or a conflict leaves, and statistics taken
/// while nothing was unsettled make each look like an empty page. A
/// look-up by key that states one of those states (a literal, or a bound
/// status that a custom plan sees) must still go through the key: through
/// the unsettled index it would read every payment (refund, conflict) in
/// that state, the whole backlog under load. Here: 300 payments, refunds
/// and conflicts settled, `VACUUM ANALYZE`; then 200 of each unsettled;
/// then each look-up's generic plan and its custom plan for a real row.
/// The queries meant to read those indexes (the metrics' counts, the open
/// conflicts' list, the check for a finding already open, the reconciler's
/// sweep) still do.
///
/// Copies again, with a custom plan for a real row each; `plans.rs` checks
/// the store's own text.
#[tokio::test]
async fn postgres_a_look_up_by_key_is_never_planned_as_a_scan_of_the_unsettled() {
    use sqlx::Connection;
    let db = TestDb::new(Backend::Postgres).await;
    let account = db.store.create_account("a", t0()).await.expect("account");
    // A refund and a conflict of each payment `of` selects, in `status`
    // and resolved at `resolved`.
    let refunds_and_conflicts = |status: &str, resolved: &str, of: &str| {
        [
            format!(
                "INSERT INTO refunds (id, account_id, payment_id, intent, amount, status, \
                   status_changed_at, created_at, updated_at) \
                 SELECT gen_random_uuid(), account_id, id, order_ref || ':refund-v1', 1, \
                   '{status}', created_at, created_at, created_at FROM payments WHERE {of}"
            ),
            format!(
                "INSERT INTO evidence_conflicts (id, payment_id, source, kind, detail, \
                   evidence, found_at, resolved_at, account_id) \
                 SELECT gen_random_uuid(), id, 'reconciler', 'contradicts_record', 'd', 'e', \
                   created_at, {resolved}, account_id FROM payments WHERE {of}"
            ),
        ]
    };
    for i in 0..300 {
        seed_payment_with_attempt(&db.store, account, &format!("settled-{i}")).await;
    }
    db.exec("UPDATE payments SET status = 'captured'").await;
    for sql in refunds_and_conflicts("succeeded", "created_at", "true") {
        db.exec(&sql).await;
    }
    db.freeze_statistics(&["payments", "refunds", "evidence_conflicts"])
        .await;
    for i in 0..200 {
        seed_payment_with_attempt(&db.store, account, &format!("open-{i}")).await;
    }
    db.exec("UPDATE payments SET status = 'needs_review' WHERE order_ref LIKE 'open-1%'")
        .await;
    for sql in refunds_and_conflicts("processing", "NULL", "status <> 'captured'") {
        db.exec(&sql).await;
    }
    assert_eq!(db.count("payments WHERE status = 'processing'").await, 89);
    // The id (`column`) of one row `from` selects, as a literal.
    let db = &db;
    let one = |column: &str, from: &str| {
        let sql = format!("SELECT CAST({column} AS TEXT) FROM {from} LIMIT 1");
        async move { format!("'{}'", db.scalar::<String>(&sql).await) }
    };
    let processing = one("id", "payments WHERE status = 'processing'").await;
    let review = one("id", "payments WHERE status = 'needs_review'").await;
    let refund = one("id", "refunds WHERE status = 'processing'").await;
    let open = one("payment_id", "evidence_conflicts WHERE resolved_at IS NULL").await;
    let account = format!("'{}'", account.as_uuid());
    let now = "'2026-01-01T00:00:00Z'";
    let unsettled = [
        "payments_unsettled",
        "refunds_unsettled",
        "evidence_conflicts_open",
    ];
    // (name, parameter types, the statement as crates/store sends it (an
    // UPDATE's SET list cut short), the arguments of a custom plan for a
    // real row, the index it must read, if any).
    let statements: [(&str, &str, &str, String, Option<&str>); 13] = [
        (
            "settle_payment",
            "uuid, text, text",
            "UPDATE payments SET status = $3 WHERE id = $1 AND status = $2",
            format!("{processing}, 'processing', 'captured'"),
            None,
        ),
        (
            "transition",
            "uuid, uuid, text, text",
            "UPDATE payments SET status = $4 WHERE id = $1 AND account_id = $2 AND status = $3",
            format!("{processing}, {account}, 'processing', 'canceling'"),
            None,
        ),
        (
            "set_review_reason",
            "uuid, text",
            "UPDATE payments SET review_reason = $2 WHERE id = $1 AND status = 'needs_review'",
            format!("{review}, 'why'"),
            None,
        ),
        (
            "settle_refund",
            "uuid, text, text",
            "UPDATE refunds SET status = $3 WHERE id = $1 AND status = $2",
            format!("{refund}, 'processing', 'succeeded'"),
            None,
        ),
        (
            "flag_refund",
            "uuid, timestamptz",
            "UPDATE refunds SET status = 'needs_review', status_changed_at = $2, \
             updated_at = $2 WHERE id = $1 AND status IN ('processing', 'requires_reconciliation')",
            format!("{refund}, {now}"),
            None,
        ),
        (
            "has_open_conflicts",
            "uuid",
            "SELECT COUNT(*) FROM evidence_conflicts WHERE payment_id = $1 \
             AND resolved_at IS NULL",
            open.clone(),
            None,
        ),
        (
            "resolve_conflicts",
            "uuid, timestamptz",
            "UPDATE evidence_conflicts SET resolved_at = $2 \
             WHERE payment_id = $1 AND resolved_at IS NULL",
            format!("{open}, {now}"),
            None,
        ),
        (
            "unsettled_counts",
            "",
            "SELECT status, COUNT(*), MIN(status_changed_at) FROM payments \
             WHERE status IN ('processing', 'requires_action', 'requires_reconciliation', \
             'needs_review', 'capturing', 'canceling') AND status_changed_at IS NOT NULL GROUP BY status",
            String::new(),
            Some("payments_unsettled"),
        ),
        (
            "refund_unsettled_counts",
            "",
            "SELECT status, COUNT(*), MIN(status_changed_at) FROM refunds \
             WHERE status IN ('processing', 'requires_reconciliation', 'needs_review') \
             AND status_changed_at IS NOT NULL GROUP BY status",
            String::new(),
            Some("refunds_unsettled"),
        ),
        (
            "open_conflicts",
            "bigint",
            "SELECT id FROM evidence_conflicts WHERE resolved_at IS NULL \
             AND found_at IS NOT NULL ORDER BY found_at LIMIT $1",
            "50".to_owned(),
            Some("evidence_conflicts_open"),
        ),
        (
            "conflict_is_open",
            "uuid, text, text",
            "SELECT COUNT(*) FROM evidence_conflicts WHERE attempt_id = $1 AND kind = $2 \
             AND detail = $3 AND resolved_at IS NULL AND found_at IS NOT NULL",
            format!("{processing}, 'contradicts_record', 'd'"),
            Some("evidence_conflicts_open"),
        ),
        (
            "sweep_payments",
            "timestamptz",
            "SELECT at.id FROM payments p JOIN attempts at ON at.payment_id = p.id \
             WHERE p.status IN ('capturing', 'canceling') AND p.status_changed_at < $1 \
             AND at.state IN ('pending', 'unknown', 'reconciling')",
            now.to_owned(),
            Some("payments_unsettled"),
        ),
        (
            "sweep_refunds",
            "timestamptz",
            "SELECT at.id FROM refunds r JOIN attempts at ON at.refund_id = r.id \
             WHERE r.status IN ('processing', 'requires_reconciliation', 'needs_review') \
             AND r.status_changed_at < $1 AND at.state IN ('pending', 'unknown', 'reconciling')",
            now.to_owned(),
            Some("refunds_unsettled"),
        ),
    ];
    let mut wrong = Vec::new();
    let mut conn = sqlx::PgConnection::connect(&db.url).await.expect("connect");
    for mode in ["generic", "custom"] {
        sqlx::raw_sql(&format!("SET plan_cache_mode = force_{mode}_plan"))
            .execute(&mut conn)
            .await
            .expect("plan cache mode");
        for (name, types, sql, args, wanted) in &statements {
            let name = format!("{name}_{mode}");
            let (used, plan) =
                indexes_in_plan(&mut conn, (&name, types, sql), args, &unsettled).await;
            if used != wanted.iter().copied().collect::<Vec<_>>() {
                wrong.push(format!("{name} uses {used:?}, wants {wanted:?}: {plan}"));
            }
        }
    }
    assert!(wrong.is_empty(), "plans:\n{}", wrong.join("\n"));
}

/// SQLite keeps its queue indexes and its indexes of the unsettled as they
/// were (its migrations 0013 and 0014 are no-ops): with statistics taken
/// while most rows are settled, the look-ups by key search the key, never
/// one of those indexes, and the queries meant for them (the claims, the
/// reconciler's sweep, the metrics' outbox depth and unsettled counts, the
/// open conflicts, as crates/store writes them, with PostgreSQL's
/// always-true terms) still search theirs.
#[tokio::test]
async fn sqlite_the_queue_queries_search_their_partial_indexes() {
    use sqlx::Connection;
    let db = TestDb::new(Backend::Sqlite).await;
    let account = db.store.create_account("a", t0()).await.expect("account");
    // As in production: most rows settled, a few queued.
    for i in 0..200 {
        seed_payment_with_attempt(&db.store, account, &format!("o-{i}")).await;
    }
    db.exec("UPDATE outbox SET state = 'done' WHERE rowid % 10 <> 0")
        .await;
    db.exec("UPDATE attempts SET state = 'succeeded' WHERE rowid % 10 <> 0")
        .await;
    db.exec("UPDATE payments SET status = 'captured' WHERE rowid % 10 <> 0")
        .await;
    db.exec("ANALYZE").await;
    let mut conn = sqlx::SqliteConnection::connect(&db.url)
        .await
        .expect("connect");
    let queue = [
        "outbox_due",
        "event_deliveries_due",
        "attempts_uncertain",
        "attempts_one_unresolved_per_intent",
        "payments_unsettled",
        "refunds_unsettled",
        "evidence_conflicts_open",
    ];
    // (name, statement, the index it must search, if any).
    let queries: [(&str, &str, Option<&str>); 11] = [
        (
            "outbox claim",
            "SELECT id FROM outbox WHERE state = 'pending' AND due_at <= $1 \
             ORDER BY due_at LIMIT 4",
            Some("outbox_due"),
        ),
        (
            "outbox depth",
            "SELECT COUNT(*), MIN(CASE WHEN due_at <= $1 THEN due_at END) \
             FROM outbox WHERE state = 'pending' AND due_at IS NOT NULL",
            Some("outbox_due"),
        ),
        (
            "delivery claim",
            "SELECT dd.event_id FROM event_deliveries dd \
             WHERE dd.state = 'pending' AND dd.due_at <= $1 \
             ORDER BY dd.due_at LIMIT 4",
            Some("event_deliveries_due"),
        ),
        (
            "sweep",
            "SELECT id FROM attempts WHERE state IN ('pending', 'unknown', 'reconciling') \
             AND created_at IS NOT NULL AND state = 'reconciling' AND created_at > $1",
            Some("attempts_uncertain"),
        ),
        (
            "finish_outbox",
            "UPDATE outbox SET state = 'done' WHERE id = $1 AND lease_token = 1 AND state = 'pending'",
            None,
        ),
        (
            "record_send",
            "UPDATE attempts SET send_count = send_count + 1 \
             WHERE id = $1 AND state IN ('pending', 'unknown')",
            None,
        ),
        (
            "held_attempts",
            "SELECT id FROM attempts WHERE payment_id = $1 AND state = 'held' ORDER BY created_at, id",
            None,
        ),
        (
            "unsettled counts",
            "SELECT status, COUNT(*), MIN(status_changed_at) FROM payments \
             WHERE status IN ('processing', 'requires_action', 'requires_reconciliation', \
             'needs_review', 'capturing', 'canceling') AND status_changed_at IS NOT NULL GROUP BY status",
            Some("payments_unsettled"),
        ),
        (
            "refund unsettled counts",
            "SELECT status, COUNT(*), MIN(status_changed_at) FROM refunds \
             WHERE status IN ('processing', 'requires_reconciliation', 'needs_review') \
             AND status_changed_at IS NOT NULL GROUP BY status",
            Some("refunds_unsettled"),
        ),
        (
            "open conflicts",
            "SELECT id FROM evidence_conflicts WHERE resolved_at IS NULL \
             AND found_at IS NOT NULL ORDER BY found_at LIMIT 50",
            Some("evidence_conflicts_open"),
        ),
        (
            "settle_payment",
            "UPDATE payments SET status = 'captured' WHERE id = $1 AND status = 'processing'",
            None,
        ),
    ];
    let mut wrong = Vec::new();
    for (name, sql, wanted) in queries {
        let plan: Vec<(i64, i64, i64, String)> =
            sqlx::query_as(&format!("EXPLAIN QUERY PLAN {sql}"))
                .bind("2026-12-01T00:00:00.000000Z")
                .fetch_all(&mut conn)
                .await
                .unwrap_or_else(|e| panic!("{name}: {e}"));
        let details: Vec<&str> = plan.iter().map(|row| row.3.as_str()).collect();
        let used: Vec<&str> = queue
            .into_iter()
            .filter(|index| {
                details
                    .iter()
                    .any(|d| d.contains(&format!("INDEX {index}")))
            })
            .collect();
        if used != wanted.into_iter().collect::<Vec<_>>() {
            wrong.push(format!(
                "{name} uses {used:?}, wants {wanted:?}: {details:?}"
            ));
        }
    }
    assert!(wrong.is_empty(), "SQLite plans:\n{}", wrong.join("\n"));
}

/// Begins a write transaction in a task of its own and returns once it
/// queues for SQLite's writer, as the `n`th in line.
async fn queued_begin(
    store: &Store,
    n: usize,
) -> tokio::task::JoinHandle<cobro_store::Result<cobro_store::WriteTx>> {
    let begin = tokio::spawn({
        let store = store.clone();
        async move { store.begin().await }
    });
    cobro_test_support::wait_for(
        &format!("{n} write transactions queue for the writer"),
        std::time::Duration::from_secs(10),
        async || (store.writers_queued() == n).then_some(()),
    )
    .await;
    begin
}

/// SQLite's group commit (crates/store/src/group.rs): transactions that
/// queued for the writer while one ran join its group and commit with it,
/// once; a rollback in the group undoes only its own work, and a
/// transaction that rolls back after reading the group's work not yet
/// committed hears back only once that work is committed.
#[tokio::test]
async fn sqlite_queued_transactions_commit_as_one_group_and_a_rollback_undoes_only_its_own() {
    let db = TestDb::new(Backend::Sqlite).await;
    let store = db.store.clone();
    let account = store.create_account("a", t0()).await.expect("account");
    let before = store.write_groups().expect("sqlite");
    let (pa, pb, pc) = (
        new_payment(account, "o-a"),
        new_payment(account, "o-b"),
        new_payment(account, "o-c"),
    );

    let mut a = store.begin().await.expect("begin a");
    assert!(a.insert_payment(&pa, t0()).await.expect("a").is_some());
    // B and C queue for the writer while A holds it.
    let b = queued_begin(&store, 1).await;
    let c = queued_begin(&store, 2).await;
    // A's commit releases its work into the group and waits for it.
    let a_commit = tokio::spawn(a.commit());

    let mut b = b.await.expect("task").expect("begin b");
    assert!(b.insert_payment(&pb, t0()).await.expect("b").is_some());
    // B read A's payment: not committed yet (the group waits for C).
    assert!(
        b.lock_payment_for_account(account, pa.id)
            .await
            .expect("read")
            .is_some()
    );
    assert!(
        store
            .payment_for_account(account, pa.id)
            .await
            .expect("read")
            .is_none(),
        "A's payment is not committed before its group"
    );
    let b_rollback = tokio::spawn(b.rollback());

    let mut c = c.await.expect("task").expect("begin c");
    // C holds the writer, so the group cannot have committed: B, which read
    // A's uncommitted work, must still be waiting.
    for _ in 0..20 {
        tokio::task::yield_now().await;
    }
    assert!(
        !b_rollback.is_finished(),
        "a rollback that read uncommitted work returned early"
    );
    assert!(
        !a_commit.is_finished(),
        "a commit returned before its group"
    );
    assert!(c.insert_payment(&pc, t0()).await.expect("c").is_some());
    c.commit().await.expect("commit c");
    a_commit.await.expect("task").expect("commit a");
    b_rollback.await.expect("task").expect("rollback b");

    let found = async |p: &cobro_store::NewPayment| {
        store
            .payment_for_account(account, p.id)
            .await
            .expect("read")
            .is_some()
    };
    assert!(found(&pa).await, "A committed");
    assert!(!found(&pb).await, "B rolled back");
    assert!(found(&pc).await, "C committed");
    let after = store.write_groups().expect("sqlite");
    assert_eq!(
        (after.groups - before.groups, after.members - before.members),
        (1, 2),
        "A and C in one group, B's rollback not counted"
    );
}

/// A write transaction dropped half-way (a cancelled request) in a group
/// takes only its own work with it: the group still commits the others.
#[tokio::test]
async fn sqlite_a_transaction_dropped_in_a_group_is_undone_and_the_group_still_commits() {
    let db = TestDb::new(Backend::Sqlite).await;
    let store = db.store.clone();
    let account = store.create_account("a", t0()).await.expect("account");
    let (pa, pb) = (new_payment(account, "o-a"), new_payment(account, "o-b"));

    let mut a = store.begin().await.expect("begin a");
    assert!(a.insert_payment(&pa, t0()).await.expect("a").is_some());
    let b = queued_begin(&store, 1).await;
    let a_commit = tokio::spawn(a.commit());
    let mut b = b.await.expect("task").expect("begin b");
    assert!(b.insert_payment(&pb, t0()).await.expect("b").is_some());
    drop(b);
    a_commit.await.expect("task").expect("commit a");

    assert!(
        store
            .payment_for_account(account, pa.id)
            .await
            .expect("read")
            .is_some()
    );
    assert!(
        store
            .payment_for_account(account, pb.id)
            .await
            .expect("read")
            .is_none()
    );
    // The writer is clean: the next transaction can use B's order again.
    let mut next = store.begin().await.expect("begin");
    assert!(
        next.insert_payment(&pb, t0())
            .await
            .expect("again")
            .is_some()
    );
    next.commit().await.expect("commit");
    assert!(
        store
            .payment_for_account(account, pb.id)
            .await
            .expect("read")
            .is_some()
    );
}

/// SQLite can roll a whole transaction back by itself after a statement
/// fails (SQLITE_FULL, IOERR; here a trigger's `RAISE(ROLLBACK)`), taking
/// the group's earlier work with it. Whatever each member was told must be
/// true: a write answered as committed is in the database, and one that is
/// not was answered with an error. (Without the rollback hook, the next
/// member's savepoint began a new transaction and the group "committed".)
#[tokio::test]
async fn sqlite_a_group_that_sqlite_rolled_back_fails_every_member_in_it() {
    let db = TestDb::new(Backend::Sqlite).await;
    let store = db.store.clone();
    let account = store.create_account("a", t0()).await.expect("account");
    db.exec(
        "CREATE TRIGGER boom BEFORE INSERT ON accounts WHEN NEW.name = 'boom' \
         BEGIN SELECT RAISE(ROLLBACK, 'boom'); END",
    )
    .await;
    let queue = async |n: usize| {
        cobro_test_support::wait_for(
            &format!("{n} writers queue"),
            std::time::Duration::from_secs(10),
            async || (store.writers_queued() == n).then_some(()),
        )
        .await
    };
    // A holder lines the others up behind it, then steps aside.
    let holder = store.begin().await.expect("begin");
    let first = tokio::spawn({
        let store = store.clone();
        async move { store.create_account("first", t0()).await }
    });
    queue(1).await;
    let boom = tokio::spawn({
        let store = store.clone();
        async move { store.create_account("boom", t0()).await }
    });
    queue(2).await;
    let last = queued_begin(&store, 3).await;
    holder.rollback().await.expect("rollback");

    assert!(boom.await.expect("task").is_err(), "the trigger refused it");
    let mut last = last.await.expect("task").expect("begin last");
    let p = new_payment(account, "o-last");
    assert!(
        last.insert_payment(&p, t0())
            .await
            .expect("insert")
            .is_some()
    );
    last.commit().await.expect("the next group commits");

    let named = async |name: &str| db.count(&format!("accounts WHERE name = '{name}'")).await;
    match first.await.expect("task") {
        Ok(_) => assert_eq!(named("first").await, 1, "told committed, and it is"),
        Err(_) => assert_eq!(named("first").await, 0, "told failed, and nothing is there"),
    }
    assert_eq!(named("boom").await, 0);
    assert!(
        store
            .payment_for_account(account, p.id)
            .await
            .expect("read")
            .is_some()
    );
}

/// A closer spawned on a runtime that is shut down before it runs must not
/// leave its group open for ever: the next member to hand the writer over,
/// on another runtime, sees no closer on its way and spawns one (tests and
/// embedders do make stores in one runtime and use them in another).
#[test]
fn sqlite_a_closer_lost_with_its_runtime_does_not_hang_the_next_commit() {
    let runtime = || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
    };
    let first = runtime();
    let (db, account, mut member) = first.block_on(async {
        let db = TestDb::new(Backend::Sqlite).await;
        let account = db.store.create_account("a", t0()).await.expect("account");
        let holder = db.store.begin().await.expect("begin");
        let next = queued_begin(&db.store, 1).await;
        // The holder's rollback spawns the group's closer, which queues
        // behind `next` and never gets its turn on this runtime.
        holder.rollback().await.expect("rollback");
        let member = next.await.expect("task").expect("begin next");
        (db, account, member)
    });
    drop(first);
    runtime().block_on(async move {
        let p = new_payment(account, "o");
        assert!(
            member
                .insert_payment(&p, t0())
                .await
                .expect("insert")
                .is_some()
        );
        tokio::time::timeout(std::time::Duration::from_secs(10), member.commit())
            .await
            .expect("the commit waits for a closer that is gone")
            .expect("commit");
        assert!(
            db.store
                .payment_for_account(account, p.id)
                .await
                .expect("read")
                .is_some()
        );
    });
}

/// One create as the API runs it: number the intent, insert, open it,
/// commit; its payment then fails at once (a card refused), which frees
/// the order. `None`: refused, the order had an active payment.
async fn create_and_fail(
    store: &Store,
    account: AccountId,
    order: &str,
) -> Option<cobro_core::IntentName> {
    let order_ref = cobro_core::OrderRef::parse(order).expect("order ref");
    let mut tx = store.begin().await.expect("begin");
    let n = tx
        .next_intent_sequence(account, &order_ref, Operation::Authorize)
        .await
        .expect("sequence");
    let mut p = new_payment(account, order);
    p.intent = cobro_core::IntentName::new(&order_ref, Operation::Authorize, n);
    if tx.insert_payment(&p, t0()).await.expect("insert").is_none() {
        tx.rollback().await.expect("rollback");
        return None;
    }
    tx.open_intent(account, p.id, None, Operation::Authorize, &p.intent, t0())
        .await
        .expect("the intent's name is free");
    tx.commit().await.expect("commit");
    let mut tx = store.begin().await.expect("begin");
    tx.transition_payment(
        account,
        p.id,
        PaymentStatus::Processing,
        PaymentStatus::Failed,
        t0(),
    )
    .await
    .expect("fail")
    .expect("processing");
    tx.commit().await.expect("commit");
    Some(p.intent)
}

/// Issue 53, task A: a create numbers its intent (`{order}:authorize-vN`,
/// from the order's payments) and inserts in a later statement. A whole
/// other create of the order, committed and failed in that gap, took the
/// same number, and the first create's intent then met the unique name:
/// a 500. Driven step by step: A numbers its intent; B, a whole create
/// and fail, runs until it either finishes (the gap was open: the bug) or
/// waits for A (PostgreSQL: the order's advisory lock, seen in pg_locks;
/// SQLite: the one writer); then A inserts and opens its intent.
async fn a_create_numbers_its_intent_with_no_other_create_of_the_order_in_between(
    backend: Backend,
) {
    let db = TestDb::new(backend).await;
    let account = db.store.create_account("a", t0()).await.expect("account");
    let order = cobro_core::OrderRef::parse("pedido-53").expect("order ref");

    let mut a = db.store.begin().await.expect("begin");
    let n = a
        .next_intent_sequence(account, &order, Operation::Authorize)
        .await
        .expect("sequence");
    assert_eq!(n, 1);

    let b = tokio::spawn({
        let store = db.store.clone();
        async move { create_and_fail(&store, account, "pedido-53").await }
    });
    let probe = match backend {
        Backend::Postgres => Some(sqlx::PgPool::connect(&db.url).await.expect("probe")),
        Backend::Sqlite => None,
    };
    cobro_test_support::wait_for(
        "B finishes or waits for A",
        std::time::Duration::from_secs(10),
        async || {
            let waiting = match &probe {
                Some(pool) => sqlx::query_scalar(
                    "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' \
                     AND NOT granted AND database = \
                     (SELECT oid FROM pg_database WHERE datname = current_database()))",
                )
                .fetch_one(pool)
                .await
                .expect("pg_locks"),
                None => db.store.writers_queued() == 1,
            };
            (waiting || b.is_finished()).then_some(())
        },
    )
    .await;

    let mut p = new_payment(account, "pedido-53");
    p.intent = cobro_core::IntentName::new(&order, Operation::Authorize, n);
    let inserted = a.insert_payment(&p, t0()).await.expect("insert");
    assert!(inserted.is_some(), "nothing else holds the order");
    a.open_intent(account, p.id, None, Operation::Authorize, &p.intent, t0())
        .await
        .expect("A's intent name is its own");
    a.commit().await.expect("commit");

    // B waited, numbered after A's commit and met A's active payment.
    assert_eq!(b.await.expect("B"), None);
    assert_eq!(
        db.store
            .count_order_payments_for_account(account, "pedido-53")
            .await
            .expect("count"),
        1
    );
    if let Some(pool) = probe {
        pool.close().await;
    }
}
