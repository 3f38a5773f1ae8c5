//! The journal's contract, one suite run on both implementations, plus what
//! only the SQLite one promises: durability settings and surviving a
//! reopen (a restarted process).

use cobro_client::{Journal, MemoryJournal, NewIntent, Operation, SqliteJournal, StoredAnswer};

fn intent(reference: &str, key: &str) -> NewIntent {
    NewIntent {
        reference: reference.to_owned(),
        operation: Operation::Authorize,
        path: "/v1/payments".to_owned(),
        body: br#"{"order_ref":"o-1","amount":1999}"#.to_vec(),
        key: key.to_owned(),
    }
}

fn answer(status: u16, body: &str) -> StoredAnswer {
    StoredAnswer {
        status,
        body: body.as_bytes().to_vec(),
        replayed: Some(false),
        request_id: Some("req-1".to_owned()),
        location: Some("/v1/payments/p".to_owned()),
        received_at: cobro_test_support::t0(),
    }
}

async fn journal_contract(journal: impl Journal) {
    let first = journal
        .record(intent("o-1/pay", "key-1"))
        .await
        .expect("record");
    assert_eq!(first.key, "key-1");
    assert!(first.is_pending());

    // The same reference again (a retry, a restart) keeps the first key.
    let again = journal
        .record(intent("o-1/pay", "key-2"))
        .await
        .expect("record");
    assert_eq!(again.key, "key-1", "a reference keeps its first key");
    assert_eq!(again.body, first.body);

    journal
        .record(intent("o-2/pay", "key-3"))
        .await
        .expect("record");
    let pending: Vec<String> = journal
        .pending()
        .await
        .expect("pending")
        .into_iter()
        .map(|i| i.reference)
        .collect();
    assert_eq!(pending, ["o-1/pay", "o-2/pay"], "oldest first");

    journal
        .complete("o-1/pay", &answer(201, "{\"id\":\"p\"}"))
        .await
        .expect("complete");
    // A second answer (another process resumed it too) does not replace it.
    journal
        .complete("o-1/pay", &answer(500, "late"))
        .await
        .expect("complete again");
    let done = journal.get("o-1/pay").await.expect("get").expect("exists");
    assert_eq!(done.answer, Some(answer(201, "{\"id\":\"p\"}")));
    let recorded = journal
        .record(intent("o-1/pay", "key-4"))
        .await
        .expect("record");
    assert_eq!(
        recorded.answer, done.answer,
        "record returns the completed intent"
    );

    let pending: Vec<String> = journal
        .pending()
        .await
        .expect("pending")
        .into_iter()
        .map(|i| i.reference)
        .collect();
    assert_eq!(pending, ["o-2/pay"]);
    assert!(journal.get("nope").await.expect("get").is_none());
    assert!(
        journal.complete("nope", &answer(201, "{}")).await.is_err(),
        "completing an unknown intent is an error"
    );
}

#[tokio::test]
async fn the_memory_journal_keeps_the_journal_contract() {
    journal_contract(MemoryJournal::new()).await;
}

#[tokio::test]
async fn the_sqlite_journal_keeps_the_journal_contract() {
    let dir = tempfile::tempdir().expect("dir");
    journal_contract(
        SqliteJournal::open(dir.path().join("j.db"))
            .await
            .expect("open"),
    )
    .await;
}

#[tokio::test]
async fn the_sqlite_journal_fsyncs_every_commit_and_survives_a_reopen() {
    let dir = tempfile::tempdir().expect("dir");
    let file = dir.path().join("j.db");
    let journal = SqliteJournal::open(&file).await.expect("open");
    let synchronous: i64 = sqlx::query_scalar("PRAGMA synchronous")
        .fetch_one(journal.pool())
        .await
        .expect("pragma");
    assert_eq!(
        synchronous, 2,
        "synchronous=FULL: a commit is fsynced before it returns"
    );
    let mode: String = sqlx::query_scalar("PRAGMA journal_mode")
        .fetch_one(journal.pool())
        .await
        .expect("pragma");
    assert_eq!(mode, "wal");
    journal
        .record(intent("o-1/pay", "key-1"))
        .await
        .expect("record");
    journal.pool().close().await;
    drop(journal);

    let reopened = SqliteJournal::open(&file).await.expect("reopen");
    let pending = reopened.pending().await.expect("pending");
    assert_eq!(pending.len(), 1);
    assert_eq!(pending[0].key, "key-1");
    assert_eq!(pending[0].operation, Operation::Authorize);
    assert_eq!(pending[0].body, intent("o-1/pay", "").body);
}
