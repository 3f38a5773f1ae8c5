//! The example checkout killed with SIGKILL at every moment that matters,
//! restarted each time, against real processes: `cobro serve` (embedded
//! SQLite, and separately PostgreSQL) with its worker, and a `fake-provider`
//! process whose ledger is the judge. Every order must end charged exactly
//! once, under one key across all runs, with a final answer.
//!
//! The kill points are the checkout's test-only hook (`CHECKOUT_PAUSE_AT`,
//! see `src/bin/checkout/pause.rs`): the process announces `paused at POINT`
//! and stops dead; the test reads the line and sends SIGKILL. Plus kills at
//! an arbitrary moment (right after a `paid` line). Every wait is a line or
//! a condition with a deadline; nothing sleeps.
//!
//! Binaries: `checkout` is this package's own (Cargo builds it for this
//! test). `cobro` and `fake-provider` are other packages' binaries, found
//! next to it in `target/<profile>/`; `cargo nextest run --workspace`
//! (`ops/test.sh`) builds them, and a narrower run needs `cargo build -p
//! cobro -p fake-provider` first. The test refuses a binary older than any
//! source file in its Cargo dep-info (`target/<profile>/cobro.d`), so it
//! never judges stale code.
//!
//! PostgreSQL: `COBRO_TEST_PG_URL` (set by `ops/test.sh`) names the
//! throwaway cluster; without it the PostgreSQL case fails, never skips.

use cobro_client::{Client, ListPayments, MemoryJournal, PaymentStatus};
use cobro_test_support::{TestDb, wait_for};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use sqlx::{Connection, Row, SqliteConnection};
use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// How long a process may take to print a line it is due to print (a cold
/// debug binary on a busy 2-core machine, migrations included).
const DEADLINE: Duration = Duration::from_secs(30);
/// Enough that the arbitrary-moment kills, which may let a run pay a few
/// orders more before the signal lands, never use up the orders a later
/// pause needs.
const ORDERS: u64 = 16;

/// Where each run of the checkout is killed, in order; then one last run
/// must finish on its own. Counts are per process (resumed intents and
/// retries included), so each run starts where the previous one died.
const SCHEDULE: &[Kill] = &[
    Kill::At("before-send:1"),
    Kill::At("after-send:1"),
    Kill::At("after-commit:1"),
    Kill::At("after-answer:1"),
    Kill::AfterLine("paid "),
    Kill::At("before-send:2"),
    Kill::At("after-send:2"),
    Kill::At("after-commit:2"),
    Kill::At("after-answer:2"),
    Kill::AfterLine("paid "),
];

#[derive(Clone, Copy, Debug)]
enum Kill {
    /// `CHECKOUT_PAUSE_AT=...`, killed once it announces the pause.
    At(&'static str),
    /// No hook; killed as soon as a line starting with this appears.
    AfterLine(&'static str),
}

// ------------------------------------------------------------ binaries

/// `target/<profile>/NAME`, refused when older than its sources.
fn fresh_binary(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_BIN_EXE_checkout"))
        .parent()
        .expect("target/<profile>")
        .to_path_buf();
    let binary = dir.join(name);
    cobro_test_support::assert_fresh_binary(&binary);
    binary
}

// ------------------------------------------------------------ processes

/// A child process, its stdout lines read on a thread; SIGKILLed when
/// dropped, with the end of its stderr printed if the test is failing.
struct Proc {
    name: String,
    child: Child,
    stdout: mpsc::UnboundedReceiver<String>,
    seen: Vec<String>,
    stderr: Arc<Mutex<Vec<String>>>,
}

impl Proc {
    fn spawn(name: &str, mut command: Command) -> Self {
        let mut child = command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("{name} does not start: {e}"));
        let (send, stdout) = mpsc::unbounded_channel();
        let out = child.stdout.take().expect("piped stdout");
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if send.send(line).is_err() {
                    return;
                }
            }
        });
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let (err, sink) = (child.stderr.take().expect("piped stderr"), stderr.clone());
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                sink.lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push(line);
            }
        });
        Self {
            name: name.to_owned(),
            child,
            stdout,
            seen: Vec::new(),
            stderr,
        }
    }

    /// Reads stdout until a line starts with `prefix`; that whole line.
    async fn line(&mut self, prefix: &str) -> String {
        let deadline = tokio::time::Instant::now() + DEADLINE;
        loop {
            let line = match tokio::time::timeout_at(deadline, self.stdout.recv()).await {
                Ok(Some(line)) => line,
                Ok(None) => panic!(
                    "{}: stdout ended before a line `{prefix}...`: {:?}",
                    self.name, self.seen
                ),
                Err(_) => panic!(
                    "{}: no line `{prefix}...` within {DEADLINE:?}: {:?}",
                    self.name, self.seen
                ),
            };
            self.seen.push(line.clone());
            if line.starts_with(prefix) {
                return line;
            }
        }
    }

    /// Every stdout line up to the end of the stream.
    async fn rest(&mut self) {
        while let Ok(Some(line)) = tokio::time::timeout(DEADLINE, self.stdout.recv()).await {
            self.seen.push(line);
        }
    }

    /// `kill -9`; asserts the process was still running until then.
    fn kill9(&mut self) {
        let pid = Pid::from_raw(i32::try_from(self.child.id()).expect("pid"));
        kill(pid, Signal::SIGKILL).expect("SIGKILL delivered");
        let status = self.child.wait().expect("reap");
        assert_eq!(
            status.signal(),
            Some(Signal::SIGKILL as i32),
            "{} was running until killed: {status:?}; stdout {:?}",
            self.name,
            self.seen
        );
    }

    async fn exit(&mut self) -> ExitStatus {
        let what = format!("{} exits", self.name);
        let child = &mut self.child;
        wait_for(&what, DEADLINE, async || {
            child.try_wait().expect("try_wait")
        })
        .await
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
        if std::thread::panicking() {
            let lines = self
                .stderr
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone();
            let tail = &lines[lines.len().saturating_sub(30)..];
            eprintln!(
                "--- {} stderr (last lines) ---\n{}",
                self.name,
                tail.join("\n")
            );
        }
    }
}

/// `binary ARGS` with nothing of cobro's or the checkout's inherited from
/// whoever runs the tests.
fn command(binary: &Path, args: &[&str]) -> Command {
    let mut command = Command::new(binary);
    for (name, _) in std::env::vars() {
        if name.starts_with("COBRO_") || name.starts_with("CHECKOUT_") {
            command.env_remove(name);
        }
    }
    command.args(args);
    command
}

// ------------------------------------------------------------ the shop

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Database {
    EmbeddedSqlite,
    Postgres,
}

/// A fake provider process, a `cobro serve` process over a database with
/// its worker, and the checkout's journal file. Fields drop in order:
/// processes first, then the database and the directory.
struct Shop {
    _cobro: Proc,
    _provider: Proc,
    ledger: fake_provider::AdminClient,
    url: String,
    token: String,
    journal_file: PathBuf,
    _pg: Option<TestDb>,
    dir: tempfile::TempDir,
}

impl Shop {
    async fn open(database: Database) -> Self {
        let cobro_bin = fresh_binary("cobro");
        let provider_bin = fresh_binary("fake-provider");
        let dir = tempfile::tempdir().expect("temp dir");

        let mut provider = Proc::spawn(
            "fake-provider",
            command(&provider_bin, &["--port", "0", "--admin"]),
        );
        let provider_url = provider
            .line("fake-provider listening on ")
            .await
            .trim_start_matches("fake-provider listening on ")
            .to_owned();

        let env = |command: &mut Command| {
            command
                .current_dir(dir.path())
                .env("COBRO_DATA_DIR", dir.path().join("data"))
                .env("COBRO_PROVIDER_URL", &provider_url)
                .env("COBRO_LOG", "warn")
                .env("COBRO_WORKER_POLL", "100ms")
                .env("COBRO_DB_MAX_CONNECTIONS", "5");
        };
        let (pg, token) = match database {
            Database::EmbeddedSqlite => (None, None),
            Database::Postgres => {
                // A fresh, migrated database (dropped with the shop), then
                // the operator's commands for an account and its token.
                let db = TestDb::new(cobro_test_support::Backend::Postgres).await;
                let run = |args: &[&str]| {
                    let mut c = command(&cobro_bin, args);
                    env(&mut c);
                    let output = c
                        .env("COBRO_DATABASE_URL", &db.url)
                        .output()
                        .expect("cobro runs");
                    assert!(
                        output.status.success(),
                        "cobro {args:?}: {}",
                        String::from_utf8_lossy(&output.stderr)
                    );
                    String::from_utf8(output.stdout)
                        .expect("utf-8")
                        .trim()
                        .to_owned()
                };
                run(&["accounts", "create", "--name", "checkout"]);
                let token = run(&["tokens", "create", "--account", "checkout"]);
                (Some(db), Some(token))
            }
        };
        let mut serve = command(&cobro_bin, &["serve", "--listen", "127.0.0.1:0"]);
        env(&mut serve);
        if let Some(db) = &pg {
            serve.env("COBRO_DATABASE_URL", &db.url);
        }
        let mut cobro = Proc::spawn("cobro serve", serve);
        let token = match token {
            Some(token) => token,
            None => cobro
                .line("dev token: ")
                .await
                .trim_start_matches("dev token: ")
                .to_owned(),
        };
        let url = cobro
            .line("cobro listening on ")
            .await
            .trim_start_matches("cobro listening on ")
            .to_owned();
        Shop {
            _cobro: cobro,
            _provider: provider,
            ledger: fake_provider::AdminClient::new(provider_url),
            url,
            token,
            journal_file: dir.path().join("checkout.db"),
            _pg: pg,
            dir,
        }
    }

    fn checkout(&self, name: &str, pause: Option<&str>) -> Proc {
        let mut c = command(Path::new(env!("CARGO_BIN_EXE_checkout")), &[]);
        c.current_dir(self.dir.path())
            .env("COBRO_URL", &self.url)
            .env("COBRO_TOKEN", &self.token)
            .env("CHECKOUT_DB", &self.journal_file)
            .env("CHECKOUT_ORDERS", ORDERS.to_string())
            .env("CHECKOUT_WAIT_SECS", "20");
        if let Some(pause) = pause {
            c.env("CHECKOUT_PAUSE_AT", pause);
        }
        Proc::spawn(name, c)
    }

    /// A client for the test's own reads (never journals anything).
    fn reader(&self) -> Client<MemoryJournal> {
        Client::new(&self.url, &self.token, MemoryJournal::new()).expect("client")
    }

    async fn payments_of(&self, order: &str) -> Vec<cobro_client::Payment> {
        self.reader()
            .list_payments(&ListPayments {
                order_ref: Some(order.to_owned()),
                ..ListPayments::default()
            })
            .await
            .expect("list payments")
            .value
            .data
    }

    /// The journal row of intent `reference`: (key, answered status).
    async fn journaled(&self, reference: &str) -> Option<(String, Option<i64>)> {
        let mut db = self.journal_db().await;
        sqlx::query(
            "SELECT idempotency_key, answer_status FROM cobro_client_intents WHERE reference = ?1",
        )
        .bind(reference)
        .fetch_optional(&mut db)
        .await
        .expect("read the journal")
        .map(|row| (row.get(0), row.get(1)))
    }

    async fn journal_db(&self) -> SqliteConnection {
        SqliteConnection::connect(&format!("sqlite://{}", self.journal_file.display()))
            .await
            .expect("open the checkout's file")
    }
}

/// `key=K` in a line.
fn key_of(line: &str) -> Option<&str> {
    line.split_whitespace().find_map(|w| w.strip_prefix("key="))
}

/// Every (reference, key) the checkout printed: `sending REF key=K ...`
/// and `paid ORDER ... key=K`.
fn keys_in(lines: &[String]) -> Vec<(String, String)> {
    lines
        .iter()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            let reference = match words.next()? {
                "sending" => words.next()?.to_owned(),
                "paid" => format!("{}/pay", words.next()?),
                _ => return None,
            };
            Some((reference, key_of(line)?.to_owned()))
        })
        .collect()
}

async fn killed_at_every_moment_each_order_is_charged_exactly_once(database: Database) {
    let started = Instant::now();
    let shop = Shop::open(database).await;
    // reference -> every key printed for it, over all runs.
    let mut keys: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut replay_expected: BTreeSet<String> = BTreeSet::new();
    let mut all_lines = Vec::new();

    for (run, kill) in SCHEDULE.iter().enumerate() {
        let name = format!("checkout run {run} ({kill:?})");
        let (mut checkout, point) = match kill {
            Kill::At(pause) => (shop.checkout(&name, Some(pause)), Some(*pause)),
            Kill::AfterLine(_) => (shop.checkout(&name, None), None),
        };
        let line = match kill {
            Kill::At(_) => checkout.line("paused at ").await,
            Kill::AfterLine(prefix) => checkout.line(prefix).await,
        };
        checkout.kill9();
        checkout.rest().await;
        let printed = keys_in(&checkout.seen);
        for (reference, key) in &printed {
            keys.entry(reference.clone())
                .or_default()
                .insert(key.clone());
        }
        all_lines.extend(checkout.seen.clone());
        let Some(point) = point else { continue };

        // What the kill point claims, checked on both sides.
        let key = key_of(&line).expect("the pause names the key");
        let reference = printed
            .iter()
            .find(|(_, k)| k == key)
            .map(|(r, _)| r.clone())
            .unwrap_or_else(|| panic!("{name}: no `sending` line for {key}: {:?}", checkout.seen));
        let order = reference.trim_end_matches("/pay");
        let (journaled_key, answered) = shop
            .journaled(&reference)
            .await
            .unwrap_or_else(|| panic!("{name}: {reference} is not in the journal"));
        assert_eq!(journaled_key, key, "{name}: the journal holds the key sent");
        assert_eq!(
            answered, None,
            "{name}: killed before the answer was journaled"
        );
        let in_cobro = shop.payments_of(order).await.len();
        assert!(in_cobro <= 1, "{name}: {order} has {in_cobro} payments");
        let first_send = keys_in(&all_lines)
            .iter()
            .filter(|(r, _)| *r == reference)
            .count()
            == 1;
        if point.starts_with("before-send") && first_send {
            assert_eq!(in_cobro, 0, "{name}: nothing was sent for {order}");
        }
        if point.starts_with("after-commit") {
            assert_eq!(
                in_cobro, 1,
                "{name}: cobro committed {order} before answering"
            );
        }
        if point.starts_with("after-commit") || point.starts_with("after-answer") {
            replay_expected.insert(order.to_owned());
        }
    }

    // The last run finishes on its own.
    let mut last = shop.checkout("checkout, last run", None);
    let done = last.line("checkout done: ").await;
    let status = last.exit().await;
    last.rest().await;
    assert!(
        status.success(),
        "the last run exits 0: {status:?}; {:?}",
        last.seen
    );
    assert_eq!(
        done,
        format!("checkout done: {ORDERS}/{ORDERS} orders answered")
    );
    for (reference, key) in keys_in(&last.seen) {
        keys.entry(reference).or_default().insert(key);
    }
    all_lines.extend(last.seen.clone());

    // One key per intent, whatever the kills.
    assert_eq!(
        keys.len(),
        ORDERS as usize,
        "every order was sent: {keys:?}"
    );
    for (reference, found) in &keys {
        assert_eq!(
            found.len(),
            1,
            "{reference} was sent under one key only: {found:?}"
        );
    }
    // Answers lost to a kill after cobro's commit came back as replays.
    for order in &replay_expected {
        assert!(
            all_lines
                .iter()
                .any(|l| l.starts_with(&format!("paid {order} ")) && l.contains("replayed=true")),
            "{order}'s lost answer was recovered as a replay: {all_lines:#?}"
        );
    }

    // The journal and the shop's own orders: every intent answered, under
    // the key that was sent.
    let mut db = shop.journal_db().await;
    let intents =
        sqlx::query("SELECT reference, idempotency_key, answer_status FROM cobro_client_intents")
            .fetch_all(&mut db)
            .await
            .expect("intents");
    assert_eq!(intents.len(), ORDERS as usize);
    for row in &intents {
        let reference: String = row.get(0);
        let key: String = row.get(1);
        let status: Option<i64> = row.get(2);
        assert_eq!(status, Some(201), "{reference} is answered");
        assert!(
            keys[&reference].contains(&key),
            "{reference}: the journaled key was sent"
        );
    }
    let orders =
        sqlx::query("SELECT order_ref, answer, payment_id, status, amount FROM checkout_orders")
            .fetch_all(&mut db)
            .await
            .expect("orders");
    assert_eq!(orders.len(), ORDERS as usize);

    // cobro and the provider: one payment per order, captured, and exactly
    // one money-moving charge behind it.
    let ledger = shop.ledger.ledger().await.expect("ledger");
    assert!(
        ledger
            .double_charges(&["cobro_account", "cobro_intent"])
            .is_empty(),
        "double charges: {:?}",
        ledger.double_charges(&["cobro_account", "cobro_intent"])
    );
    let moving: Vec<_> = ledger
        .charges
        .iter()
        .filter(|c| c.status != "declined")
        .collect();
    assert_eq!(
        moving.len(),
        ORDERS as usize,
        "one charge per order, nothing else"
    );
    for row in &orders {
        let order: String = row.get(0);
        let answer: Option<String> = row.get(1);
        let payment_id: Option<String> = row.get(2);
        let settled: Option<String> = row.get(3);
        let amount: i64 = row.get(4);
        assert_eq!(answer.as_deref(), Some("paid"), "{order}");
        assert_eq!(settled.as_deref(), Some("captured"), "{order} settled");
        let payments = shop.payments_of(&order).await;
        assert_eq!(payments.len(), 1, "{order}: one payment in cobro");
        let payment = &payments[0];
        assert_eq!(Some(&payment.id), payment_id.as_ref(), "{order}");
        assert_eq!(payment.status, PaymentStatus::Captured, "{order}");
        let charges =
            ledger.charges_with_metadata("cobro_intent", &format!("{order}:authorize-v1"));
        let charges: Vec<_> = charges.iter().filter(|c| c.status != "declined").collect();
        assert_eq!(
            charges.len(),
            1,
            "{order}: one money-moving charge: {charges:?}"
        );
        assert_eq!(charges[0].amount, amount, "{order}: the order's amount");
        assert_eq!(charges[0].status, "captured", "{order}");
        assert_eq!(
            payment.provider_ref.as_deref(),
            Some(charges[0].id.as_str()),
            "{order}"
        );
    }
    eprintln!(
        "{database:?}: {} kills and a last run, {ORDERS} orders, in {:?}",
        SCHEDULE.len(),
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_embedded_sqlite_a_checkout_killed_at_every_moment_charges_each_order_exactly_once() {
    killed_at_every_moment_each_order_is_charged_exactly_once(Database::EmbeddedSqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_a_checkout_killed_at_every_moment_charges_each_order_exactly_once() {
    killed_at_every_moment_each_order_is_charged_exactly_once(Database::Postgres).await;
}
