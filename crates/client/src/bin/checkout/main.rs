//! `checkout`: an example merchant that pays its orders through cobro and
//! survives `kill -9` at any moment.
//!
//! It keeps its orders and the client's journal in one SQLite file. On every
//! start it first resumes the journal's pending intents (same keys, same
//! bodies), then pays every order that has no final answer yet, each as the
//! intent `{order}/pay`, then waits for each payment to leave `processing`.
//! Killed anywhere, it is simply started again; cobro executes each order's
//! payment exactly once.
//!
//! Configuration (environment):
//!
//! | variable | default | meaning |
//! |---|---|---|
//! | `COBRO_URL` | `http://127.0.0.1:8080` | cobro's base URL |
//! | `COBRO_TOKEN` | (required) | the merchant's API token |
//! | `CHECKOUT_DB` | `checkout.db` | the SQLite file (orders + journal) |
//! | `CHECKOUT_ORDERS` | `5` | orders `{prefix}-1` .. `{prefix}-N`, created on first start (amount 1000 + i EUR cents) |
//! | `CHECKOUT_ORDER_PREFIX` | `order` | |
//! | `CHECKOUT_WAIT_SECS` | `30` | how long to wait for each payment to settle |
//! | `CHECKOUT_PAUSE_AT` | (unset) | **test-only** crash hook, see `pause.rs`: `before-send:N`, `after-send:N`, `after-commit:N` or `after-answer:N` |
//!
//! Stdout, one line per event (tests read it): `sending REF key=K attempt=N`,
//! `paid ORDER payment=ID status=S replayed=B from_journal=B key=K`,
//! `refused ORDER code=C`, `settled ORDER status=S`, `paused at POINT ...`,
//! and last `checkout done: A/N orders answered`. Exit 0 when every order
//! has a final answer.

mod pause;

use cobro_client::{Client, CreatePayment, Error, Event, SqliteJournal};
use sqlx::Row;
use std::process::ExitCode;
use std::time::Duration;

#[tokio::main]
async fn main() -> ExitCode {
    match run().await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("checkout: {e}");
            ExitCode::from(2)
        }
    }
}

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

fn env_number(name: &str, default: u64) -> Result<u64, String> {
    match std::env::var(name) {
        Ok(text) => text
            .parse()
            .map_err(|_| format!("{name}={text} is not a number")),
        Err(_) => Ok(default),
    }
}

async fn run() -> Result<bool, Box<dyn std::error::Error>> {
    let mut url = env_or("COBRO_URL", "http://127.0.0.1:8080");
    let token = std::env::var("COBRO_TOKEN").map_err(|_| "COBRO_TOKEN is not set")?;
    let db = env_or("CHECKOUT_DB", "checkout.db");
    let orders = env_number("CHECKOUT_ORDERS", 5)?;
    let prefix = env_or("CHECKOUT_ORDER_PREFIX", "order");
    let settle = Duration::from_secs(env_number("CHECKOUT_WAIT_SECS", 30)?);
    let pause = pause::Pause::from_env()?;
    if let Some(pause) = &pause {
        // The points on the wire need the request to pass through a relay
        // of this process; the others are client events.
        if let Some(relayed) = pause.relay(&url).await? {
            url = relayed;
        }
    }

    let journal = SqliteJournal::open(&db).await?;
    create_orders(&journal, &prefix, orders).await?;
    let client = Client::new(&url, &token, journal.clone())?.with_observer(move |event| {
        if let Event::Sending { intent, attempt } = event {
            println!(
                "sending {} key={} attempt={attempt}",
                intent.reference, intent.key
            );
        }
        if let Some(pause) = &pause {
            pause.on_event(event);
        }
    });

    // 1. Whatever a previous run journaled and never saw answered.
    for resumed in client.resume_pending().await? {
        if let Err(e) = &resumed.outcome {
            println!("resume of {} failed: {e}", resumed.intent.reference);
        }
    }

    // 2. Pay every order without a final answer. An order whose intent was
    // completed by the resume above is answered from the journal.
    let unanswered = sqlx::query(
        "SELECT order_ref, amount FROM checkout_orders WHERE answer IS NULL ORDER BY seq",
    )
    .fetch_all(journal.pool())
    .await?;
    for row in unanswered {
        let order: String = row.get("order_ref");
        let amount: i64 = row.get("amount");
        let request = CreatePayment::new(&order, amount, "EUR", "pm_card_visa")
            .metadata("shop", "checkout-example");
        match client
            .create_payment(&format!("{order}/pay"), &request)
            .await
        {
            Ok(payment) => {
                println!(
                    "paid {order} payment={} status={} replayed={} from_journal={} key={}",
                    payment.value.id,
                    payment.value.status,
                    payment.was_replayed(),
                    payment.from_journal,
                    payment.idempotency_key.as_deref().unwrap_or("")
                );
                sqlx::query(
                    "UPDATE checkout_orders SET answer = 'paid', payment_id = ?2, status = ?3 \
                     WHERE order_ref = ?1",
                )
                .bind(&order)
                .bind(&payment.value.id)
                .bind(payment.value.status.as_str())
                .execute(journal.pool())
                .await?;
            }
            Err(e @ (Error::Problem(_) | Error::KeyReused(_))) => {
                let code = e.code().map(|c| c.to_string()).unwrap_or_default();
                println!("refused {order} code={code}");
                sqlx::query("UPDATE checkout_orders SET answer = ?2 WHERE order_ref = ?1")
                    .bind(&order)
                    .bind(format!("refused:{code}"))
                    .execute(journal.pool())
                    .await?;
            }
            // Pending in the journal: the next start resumes it.
            Err(e) => println!("unanswered {order}: {e}"),
        }
    }

    // 3. Wait for each payment to leave `processing`.
    let processing = sqlx::query(
        "SELECT order_ref, payment_id FROM checkout_orders WHERE status = 'processing' ORDER BY seq",
    )
    .fetch_all(journal.pool())
    .await?;
    for row in processing {
        let order: String = row.get("order_ref");
        let id: String = row.get("payment_id");
        let payment = client.wait_for_payment(&id, settle).await?;
        println!("settled {order} status={}", payment.value.status);
        sqlx::query("UPDATE checkout_orders SET status = ?2 WHERE order_ref = ?1")
            .bind(&order)
            .bind(payment.value.status.as_str())
            .execute(journal.pool())
            .await?;
    }

    let (answered, total): (i64, i64) =
        sqlx::query_as("SELECT COUNT(answer), COUNT(*) FROM checkout_orders")
            .fetch_one(journal.pool())
            .await?;
    println!("checkout done: {answered}/{total} orders answered");
    Ok(answered == total)
}

/// The shop's orders, created once (a restart finds them).
async fn create_orders(
    journal: &SqliteJournal,
    prefix: &str,
    count: u64,
) -> Result<(), sqlx::Error> {
    let pool = journal.pool();
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS checkout_orders (
            order_ref  TEXT PRIMARY KEY,
            seq        INTEGER NOT NULL,
            amount     INTEGER NOT NULL,
            answer     TEXT,     -- NULL until the payment request has a final answer
            payment_id TEXT,
            status     TEXT
        )",
    )
    .execute(pool)
    .await?;
    let mut tx = pool.begin().await?;
    for i in 1..=count {
        sqlx::query(
            "INSERT INTO checkout_orders (order_ref, seq, amount) VALUES (?1, ?2, ?3) \
             ON CONFLICT (order_ref) DO NOTHING",
        )
        .bind(format!("{prefix}-{i}"))
        .bind(i64::try_from(i).unwrap_or(i64::MAX))
        .bind(1000 + i64::try_from(i).unwrap_or(0))
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await
}
