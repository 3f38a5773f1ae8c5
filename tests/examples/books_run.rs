//! The books bench (ops/bench/books.sh runs it): what one books run costs
//! per 10 000 objects, and the memory it holds. `PAYMENTS` automatic
//! payments are made through the API and captured by the worker (one
//! charge each at the fake provider, with cobro's metadata), then the
//! books list and match every charge of the window, page by page over the
//! fake's HTTP API, `ROUNDS` times. It prints, per round, the objects
//! classed, the seconds, the seconds per 10 000 objects, and the peak
//! resident memory of the process during the run (the kernel's VmHWM,
//! reset before each run through /proc/self/clear_refs), against the
//! resident memory before it.
//!
//! `STORE`: `sqlite` (default) or `postgres` (then `COBRO_TEST_PG_URL`,
//! as `ops/throwaway-postgres.sh` sets it). A benchmark, not a test: it
//! asserts no speed, only that every object matched.

use cobro_reconciler::books::{Books, BooksConfig};
use cobro_test_support::{Backend, Rig, payment_body};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn setting(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A field of /proc/self/status in kB (`VmRSS`, `VmHWM`).
fn status_kb(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let backend = match std::env::var("STORE").as_deref() {
        Ok("postgres") => Backend::Postgres,
        _ => Backend::Sqlite,
    };
    let (payments, rounds) = (setting("PAYMENTS", 10_000), setting("ROUNDS", 3));
    let rig = Rig::new(backend).await;
    let made = Instant::now();
    let keys: Vec<u64> = (0..payments).collect();
    // The API's rate limit (200/s, a burst of 400) runs on the rig's
    // manual clock: two seconds of it per chunk.
    for chunk in keys.chunks(256) {
        rig.app.clock.advance(chrono::Duration::seconds(2));
        futures::future::join_all(chunk.iter().map(|i| {
            let rig = &rig;
            async move {
                let body = payment_body(&format!("order-{i}"));
                rig.create_payment(&format!("k-{i}"), &body).await
            }
        }))
        .await;
        while !rig.drain(64).await.is_empty() {}
    }
    let ledger = rig.ledger();
    assert_eq!(ledger.totals.charges, payments, "one charge per payment");
    eprintln!(
        "books bench: {payments} payments made and captured in {:.1} s",
        made.elapsed().as_secs_f64()
    );

    let books = Books::new(
        rig.app.db.store.clone(),
        Arc::new(rig.connector()),
        Arc::new(rig.app.clock.clone()),
        BooksConfig {
            provider: "fake".into(),
            is_default: true,
            clock_skew: Duration::from_secs(10),
            request_timeout: Duration::from_secs(10),
            overlap: Duration::from_secs(600),
            settle_delay: Duration::from_secs(120),
            first_window: Duration::from_secs(24 * 3600),
            actor: "books:bench".into(),
        },
    );
    println!("store objects seconds s_per_10k rss_before_kb peak_rss_kb");
    for _ in 0..rounds {
        std::fs::write("/proc/self/clear_refs", "5").expect("reset VmHWM");
        let before = status_kb("VmRSS");
        let started = Instant::now();
        let report = books
            .run((0, 4_000_000_000), false, "bench")
            .await
            .expect("books run");
        let seconds = started.elapsed().as_secs_f64();
        let peak = status_kb("VmHWM");
        let c = report.counts;
        assert_eq!((c.objects, c.matched), (payments, payments), "{c:?}");
        println!(
            "{} {} {:.2} {:.2} {} {}",
            if backend == Backend::Postgres {
                "postgres"
            } else {
                "sqlite"
            },
            c.objects,
            seconds,
            seconds * 10_000.0 / c.objects as f64,
            before,
            peak
        );
    }
    rig.shutdown().await;
}
