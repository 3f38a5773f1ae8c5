//! Crash tests: real `cobro` processes over a real PostgreSQL, killed with
//! SIGKILL (or stopped with SIGTERM) at the moments that matter, with the fake
//! provider's ledger as the judge (provider-and-recovery spec, section 6:
//! crash before commit, crash after commit, a worker killed between the
//! charge and its record, several worker processes on one database, and the
//! chaos run: every fault at once with repeated worker kills).
//!
//! Layout: [`Cobro`] is one child process (its stdout lines, its stderr, a
//! SIGKILL when the test ends or fails); [`Site`] is what the processes of one
//! test share (a fresh database with an account and its token, the fake
//! provider running in this test process, the environment); then the tests.
//!
//! The binary: `cobro` is not a dependency of this crate, so Cargo sets no
//! `CARGO_BIN_EXE_cobro` here. The tests run `target/<profile>/cobro`, next to
//! the directory of this test binary (`target/<profile>/deps/crash-*`).
//! `ops/test.sh` (`cargo nextest run --workspace`) builds it; a binary older
//! than any source in its dep-info is refused (`assert_fresh_binary`), so a
//! narrower run (`-p cobro-tests`) never tests a stale `cobro`.
//!
//! Time: the processes use the system clock, so a lease expiry is a real wait.
//! Leases are 2 s (heartbeat 500 ms) and every wait is a condition polled
//! with a deadline.

use cobro_test_support::{Backend, TestDb, payment_body, wait_for};
use fake_provider::{FaultAction, FaultRule, Ledger, Operation as FOp};
use futures::{StreamExt, stream};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::Value;
use sqlx::postgres::{PgPool, PgPoolOptions};
use sqlx::{Connection, PgConnection};
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use uuid::Uuid;

/// How long a process may take to print its ready line (a cold debug
/// binary on a busy 2-core machine, migrations included).
const STARTUP: Duration = Duration::from_secs(30);
/// How long anything a test waits for may take once it is due.
const SETTLE: Duration = Duration::from_secs(15);
/// The worker lease the processes run with: an expired lease is this far away.
const LEASE: &str = "2s";
const HEARTBEAT: &str = "500ms";

/// `target/<profile>/cobro`, found from this test binary's path (see the
/// module docs for who builds it).
fn cobro_binary() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("the test binary lives in target/<profile>/deps");
    let binary = profile_dir.join(format!("cobro{}", std::env::consts::EXE_SUFFIX));
    cobro_test_support::assert_fresh_binary(&binary);
    binary
}

/// One running `cobro` process. Dropping it SIGKILLs the process if it is
/// still running (so a failing test leaves nothing behind) and, when the
/// test is failing, prints the end of its stderr.
struct Cobro {
    name: String,
    child: Child,
    stdout: mpsc::UnboundedReceiver<String>,
    stdout_seen: Vec<String>,
    stderr: Arc<Mutex<Vec<String>>>,
}

impl Cobro {
    fn spawn(name: &str, mut command: Command) -> Self {
        let mut child = command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("{name}: cobro does not start: {e}"));
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
            stdout_seen: Vec::new(),
            stderr,
        }
    }

    /// Reads stdout until a line starts with `prefix`; the rest of that line.
    async fn line(&mut self, prefix: &str) -> String {
        let deadline = tokio::time::Instant::now() + STARTUP;
        loop {
            let line = match tokio::time::timeout_at(deadline, self.stdout.recv()).await {
                Ok(Some(line)) => line,
                Ok(None) => panic!(
                    "{}: stdout ended before a line `{prefix}...`; stdout {:?}",
                    self.name, self.stdout_seen
                ),
                Err(_) => panic!(
                    "{}: no line `{prefix}...` within {STARTUP:?}; stdout {:?}",
                    self.name, self.stdout_seen
                ),
            };
            self.stdout_seen.push(line.clone());
            if let Some(rest) = line.strip_prefix(prefix) {
                return rest.to_owned();
            }
        }
    }

    fn pid(&self) -> Pid {
        Pid::from_raw(i32::try_from(self.child.id()).expect("a pid fits in i32"))
    }

    /// `kill -9` and reap; asserts the process was running until then.
    fn kill9(&mut self) {
        kill(self.pid(), Signal::SIGKILL).expect("SIGKILL delivered");
        let status = self.child.wait().expect("reap");
        assert_eq!(
            status.signal(),
            Some(Signal::SIGKILL as i32),
            "{} was still running when killed: {status:?}",
            self.name
        );
    }

    fn sigterm(&self) {
        kill(self.pid(), Signal::SIGTERM).expect("SIGTERM delivered");
    }

    async fn exit_within(&mut self, within: Duration) -> ExitStatus {
        let what = format!("{} exits", self.name);
        let child = &mut self.child;
        wait_for(&what, within, async || child.try_wait().expect("try_wait")).await
    }

    fn stderr(&self) -> Vec<String> {
        self.stderr
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

impl Drop for Cobro {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
        if std::thread::panicking() {
            let lines = self.stderr();
            let tail = &lines[lines.len().saturating_sub(40)..];
            let kept = cobro_test_support::failure_dir().join(format!(
                "{}-{}.stderr",
                self.name.replace(' ', "-"),
                self.child.id()
            ));
            let _ = std::fs::write(&kept, lines.join("\n"));
            eprintln!(
                "--- {} stderr (last lines; all of it in {}) ---\n{}",
                self.name,
                kept.display(),
                tail.join("\n")
            );
        }
    }
}

/// What the processes of one test share: a fresh PostgreSQL database with
/// one account and its API token, and the fake provider in this process.
/// Declare processes after the site, so they are killed before its
/// database is dropped.
struct Site {
    db: TestDb,
    pg: PgPool,
    account: Uuid,
    token: String,
    provider: fake_provider::Running,
    http: reqwest::Client,
}

impl Site {
    async fn new() -> Self {
        Self::with_provider(fake_provider::Config {
            admin: true,
            ..Default::default()
        })
        .await
    }

    /// A site whose fake provider runs with `config` (retention, seed).
    async fn with_provider(config: fake_provider::Config) -> Self {
        let db = TestDb::new(Backend::Postgres).await;
        let now = chrono::Utc::now();
        let account = db
            .store
            .create_account("merchant", now)
            .await
            .expect("account");
        let token = format!("test_{}", Uuid::new_v4().simple());
        db.store
            .create_token(account, "crash", &cobro_api::token_hash(&token), now)
            .await
            .expect("token");
        let pg = PgPoolOptions::new()
            .max_connections(4)
            .connect(&db.url)
            .await
            .expect("connect to the test database");
        let provider = fake_provider::start(config)
            .await
            .expect("start the fake provider");
        Self {
            db,
            pg,
            account: account.as_uuid(),
            token,
            provider,
            http: reqwest::Client::new(),
        }
    }

    /// `cobro ARGS` against this site, with nothing inherited from the
    /// environment of whoever runs the tests; `env` comes last and wins.
    fn command(&self, args: &[&str], env: &[(&str, &str)]) -> Command {
        let mut command = Command::new(cobro_binary());
        for (name, _) in std::env::vars() {
            if name.starts_with("COBRO_") {
                command.env_remove(name);
            }
        }
        command
            .args(args)
            .env("COBRO_DATABASE_URL", &self.db.url)
            .env("COBRO_PROVIDER_URL", self.provider.url())
            .env("COBRO_LOG", "warn")
            .env("COBRO_DB_MAX_CONNECTIONS", "5")
            .env("COBRO_WORKER_LEASE", LEASE)
            .env("COBRO_WORKER_HEARTBEAT", HEARTBEAT)
            .env("COBRO_WORKER_POLL", "100ms")
            // These tests load one account far above a merchant's rate.
            .env("COBRO_RATE_LIMIT", "0")
            .envs(env.iter().copied());
        command
    }

    /// `cobro serve --listen 127.0.0.1:0 ARGS`, ready; and its base URL.
    async fn serve(&self, name: &str, args: &[&str], env: &[(&str, &str)]) -> (Cobro, String) {
        let mut all = vec!["serve", "--listen", "127.0.0.1:0"];
        all.extend_from_slice(args);
        let mut process = Cobro::spawn(name, self.command(&all, env));
        let url = process.line("cobro listening on ").await;
        (process, url)
    }

    /// `cobro worker`, running; and its lease owner name.
    async fn worker(&self, name: &str, env: &[(&str, &str)]) -> (Cobro, String) {
        let mut process = Cobro::spawn(name, self.command(&["worker"], env));
        let owner = process.line("cobro worker running as ").await;
        (process, owner)
    }

    fn post_payment(&self, base: &str, key: &str, body: &Value) -> reqwest::RequestBuilder {
        self.http
            .post(format!("{base}/v1/payments"))
            .bearer_auth(&self.token)
            .header("idempotency-key", key)
            .json(body)
    }

    /// A first execution: 201, not replayed; the payment's JSON.
    async fn create_payment(&self, base: &str, key: &str, body: &Value) -> Value {
        let response = self
            .post_payment(base, key, body)
            .send()
            .await
            .expect("an answer");
        assert_eq!(response.status().as_u16(), 201, "create {key}");
        assert_eq!(replayed(&response), "false", "create {key}");
        response.json().await.expect("json")
    }

    async fn payment(&self, base: &str, id: &str) -> Value {
        let response = self
            .http
            .get(format!("{base}/v1/payments/{id}"))
            .bearer_auth(&self.token)
            .send()
            .await
            .expect("an answer");
        assert_eq!(response.status().as_u16(), 200, "GET payment {id}");
        response.json().await.expect("json")
    }

    /// The payment once it has left `processing`, through the API.
    async fn settled_payment(&self, base: &str, id: &str) -> Value {
        wait_for(
            &format!("payment {id} leaves processing"),
            SETTLE,
            async || {
                let payment = self.payment(base, id).await;
                (payment["status"] != "processing").then_some(payment)
            },
        )
        .await
    }

    /// The provider makes the next charge, then holds its answer for `hold`
    /// (real time) before sending it.
    fn hold_next_charge_answer(&self, hold: Duration) {
        self.provider.control().add_fault(
            FaultRule::new(FOp::Charge, FaultAction::DelayAfterEffect)
                .with_delay(hold)
                .with_next(1),
        );
    }

    fn ledger(&self) -> Ledger {
        self.provider.control().ledger()
    }

    /// Waits until the provider has made the charge for `reference`.
    async fn charged(&self, reference: &str) {
        wait_for(
            &format!("the provider charged {reference}"),
            SETTLE,
            async || {
                (cobro_test_support::for_intent(&self.ledger(), reference).charges > 0)
                    .then_some(())
            },
        )
        .await;
    }

    /// The ids of the charges the provider holds for `reference`, asked
    /// through its own search API.
    async fn provider_charges(&self, reference: &str) -> Vec<String> {
        let found: Value = self
            .http
            // Intent names are `{order}:{verb}-v{n}`: nothing to escape.
            .get(format!(
                "{}/v1/charges?metadata[cobro_intent]={reference}",
                self.provider.url()
            ))
            .bearer_auth("sk_test_cobro")
            .send()
            .await
            .expect("provider search")
            .json()
            .await
            .expect("json");
        found["data"]
            .as_array()
            .expect("a list")
            .iter()
            .map(|charge| charge["id"].as_str().expect("charge id").to_owned())
            .collect()
    }

    async fn count(&self, from_where: &str) -> i64 {
        sqlx::query_scalar(&format!("SELECT COUNT(*) FROM {from_where}"))
            .fetch_one(&self.pg)
            .await
            .expect("count")
    }
}

impl Site {
    /// Runs `cobro reconcile` until no payment is processing, unknown or
    /// in flight (at most 2 minutes).
    async fn reconcile_until_settled(&self, env: &[(&str, &str)]) {
        let unsettled = "payments WHERE status IN ('processing', 'requires_reconciliation', 'needs_review', 'capturing', 'canceling')";
        wait_for(
            "every payment is settled",
            Duration::from_secs(120),
            async || {
                let reconcile = self
                    .command(&["reconcile", "--json"], env)
                    .output()
                    .expect("cobro reconcile runs");
                assert!(
                    matches!(reconcile.status.code(), Some(0 | 3)),
                    "reconcile failed: {}",
                    String::from_utf8_lossy(&reconcile.stderr)
                );
                (self.count(unsettled).await == 0).then_some(())
            },
        )
        .await;
    }
}

fn replayed(response: &reqwest::Response) -> &str {
    response
        .headers()
        .get("idempotent-replayed")
        .expect("an Idempotent-Replayed header")
        .to_str()
        .expect("ascii")
}

fn id_of(payment: &Value) -> String {
    payment["id"].as_str().expect("payment id").to_owned()
}

/// Asserts a payment the worker finished: captured, with the provider's one
/// charge for its reference as provider_ref, one attempt sent `sends` times.
async fn assert_captured_once(site: &Site, payment: &Value, sends: u64) {
    let reference = payment["intent"].as_str().expect("intent");
    assert_eq!(payment["status"], "captured", "{payment}");
    assert_eq!(payment["amount_captured"], 1999);
    let attempts = payment["attempts"].as_array().expect("attempts");
    assert_eq!(
        attempts.len(),
        1,
        "one attempt, one provider key: {payment}"
    );
    assert_eq!(attempts[0]["state"], "succeeded");
    assert_eq!(attempts[0]["sends"], sends, "{payment}");
    let charges = site.provider_charges(reference).await;
    assert_eq!(charges.len(), 1, "{reference}: {charges:?}");
    assert_eq!(payment["provider_ref"], charges[0].as_str());
    let ledger = site.ledger();
    assert_eq!(
        cobro_test_support::for_intent(&ledger, reference).charges,
        1,
        "{reference}"
    );
    assert_eq!(ledger.totals.charges, 1);
    assert!(ledger.duplicate_charge_references.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn worker_killed_after_the_charge_and_before_recording_it_is_finished_by_another_worker() {
    let site = Site::new().await;
    // Far longer than the test lasts: worker A dies knowing nothing.
    site.hold_next_charge_answer(Duration::from_secs(30));
    let (_api, url) = site.serve("serve", &["--no-worker"], &[]).await;
    let created = site.create_payment(&url, "k-1", &payment_body("o-1")).await;
    let id = id_of(&created);

    let (mut a, owner_a) = site.worker("worker A", &[]).await;
    site.charged("o-1:authorize-v1").await;
    let (owner, state, sends): (Option<String>, String, i32) = sqlx::query_as(
        "SELECT o.lease_owner, a.state, a.send_count FROM outbox o \
         JOIN attempts a ON a.id = o.attempt_id",
    )
    .fetch_one(&site.pg)
    .await
    .expect("the outbox row");
    assert_eq!(
        (owner.as_deref(), state.as_str(), sends),
        (Some(owner_a.as_str()), "pending", 1),
        "A holds the lease, has sent once and recorded nothing"
    );
    a.kill9();
    assert_eq!(site.payment(&url, &id).await["status"], "processing");

    // B takes the row once A's lease expires and resends under the same
    // provider key: the provider replays the charge it already made.
    let (_b, owner_b) = site.worker("worker B", &[]).await;
    assert_ne!(owner_a, owner_b);
    let payment = site.settled_payment(&url, &id).await;
    assert_captured_once(&site, &payment, 2).await;
    let (state, token): (String, i64) = sqlx::query_as("SELECT state, lease_token FROM outbox")
        .fetch_one(&site.pg)
        .await
        .expect("the outbox row");
    assert_eq!(
        (state.as_str(), token),
        ("done", 2),
        "claimed by A, then once by B"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_worker_processes_charge_a_thousand_payments_exactly_once() {
    const PAYMENTS: usize = 1000;
    let site = Site::new().await;
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
            .fetch_one(&site.pg)
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

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_crash_before_commit_records_nothing_and_the_retry_executes_once() {
    let site = Site::new().await;
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
            .fetch_optional(&site.pg)
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
    .fetch_one(&site.pg)
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
    wait_for("cobro's orphaned backend ends", SETTLE, async || {
        let alive: bool =
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1)")
                .bind(backend)
                .fetch_one(&site.pg)
                .await
                .expect("pg_stat_activity");
        (!alive).then_some(())
    })
    .await;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_crash_after_commit_replays_on_retry() {
    let site = Site::new().await;
    let body = payment_body("o-1");
    let (mut a, url_a) = site.serve("serve A", &["--no-worker"], &[]).await;
    let post = tokio::spawn(site.post_payment(&url_a, "k-1", &body).send());
    // The record is visible to others only once the transaction committed.
    let committed: Uuid = wait_for(
        "the create-payment transaction commits",
        SETTLE,
        async || {
            sqlx::query_scalar(
                "SELECT resource_id FROM idempotency_records WHERE idempotency_key = 'k-1'",
            )
            .fetch_optional(&site.pg)
            .await
            .expect("the record")
        },
    )
    .await;
    // The client never uses an answer, and A dies.
    post.abort();
    a.kill9();
    assert_eq!(site.count("payments").await, 1);
    assert_eq!(
        site.count("attempts WHERE state = 'pending' AND send_count = 0")
            .await,
        1
    );
    assert_eq!(site.ledger().totals.charges, 0, "A ran no worker");

    let (_b, url_b) = site.serve("serve B", &[], &[]).await;
    let response = site
        .post_payment(&url_b, "k-1", &body)
        .send()
        .await
        .expect("an answer");
    assert_eq!(response.status().as_u16(), 201);
    assert_eq!(replayed(&response), "true");
    let location = response.headers().get("location").cloned();
    let replay: Value = response.json().await.expect("json");
    assert_eq!(id_of(&replay), committed.to_string());
    assert_eq!(
        location.as_ref().and_then(|l| l.to_str().ok()),
        Some(format!("/v1/payments/{committed}").as_str())
    );
    let payment = site.settled_payment(&url_b, &id_of(&replay)).await;
    assert_captured_once(&site, &payment, 1).await;
    assert_eq!(site.count("payments").await, 1);
    assert_eq!(site.count("attempts").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigterm_lets_an_in_flight_provider_call_finish() {
    // COBRO_SHUTDOWN_GRACE below.
    const GRACE: Duration = Duration::from_secs(10);
    let site = Site::new().await;
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

/// The chaos run (spec section 6, item 14): thousands of payments under
/// random faults of every kind (seeded), with worker processes SIGKILLed and
/// restarted over and over, a provider that forgets idempotency keys after
/// a few seconds and whose search lags; then reconcile until quiet. The
/// provider must hold no reference with more than one charge, every
/// payment's final state must be the provider's, and nothing may be lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chaos_many_payments_every_fault_and_repeated_worker_kills_end_with_one_charge_each() {
    const PAYMENTS: usize = 2000;
    const SEED: u64 = 14;
    // The provider forgets a key 8 s after its first use; cobro is told so
    // and sends no attempt later than 8 s - 4 s after its first send, then
    // hands it to the reconciler. Real time, so the window really closes
    // during the run.
    let site = Site::with_provider(fake_provider::Config {
        admin: true,
        seed: SEED,
        retention: Duration::from_secs(8),
        ..Default::default()
    })
    .await;
    let control = site.provider.control();
    let chance = |op, action, p: f64| FaultRule::new(op, action).with_probability(p);
    for rule in [
        chance(FOp::Any, FaultAction::Latency, 0.05).with_delay(Duration::from_millis(150)),
        chance(FOp::Charge, FaultAction::FailBeforeEffect, 0.05),
        chance(FOp::Charge, FaultAction::FailAfterEffect, 0.05),
        chance(FOp::Charge, FaultAction::DropResponseAfterEffect, 0.05),
        chance(FOp::Charge, FaultAction::DelayAfterEffect, 0.03).with_delay(Duration::from_secs(2)),
        chance(FOp::Charge, FaultAction::InProgress, 0.03),
        chance(FOp::Charge, FaultAction::SearchLag, 0.2).with_lag_seconds(2),
        chance(FOp::Search, FaultAction::FailBeforeEffect, 0.1),
    ] {
        control.add_fault(rule);
    }
    let env: &[(&str, &str)] = &[
        ("COBRO_PROVIDER_TIMEOUT", "1s"),
        ("COBRO_PROVIDER_KEY_RETENTION", "8s"),
        ("COBRO_PROVIDER_KEY_SAFETY_MARGIN", "4s"),
        ("COBRO_PROVIDER_SEARCH_LAG", "3s"),
        ("COBRO_RECONCILE_STUCK_AFTER", "5s"),
    ];
    let (_api, url) = site.serve("api", &["--no-worker"], env).await;
    let mut workers = Vec::new();
    for i in 0..2 {
        workers.push(site.worker(&format!("worker {i}"), env).await.0);
    }

    // The payments: automatic captures, manual authorisations, declines.
    let bodies: Vec<(String, Value)> = (0..PAYMENTS)
        .map(|i| {
            let mut body = payment_body(&format!("chaos-{i}"));
            match i % 10 {
                0 => body["payment_method"] = "pm_card_declined".into(),
                1 => body["capture_method"] = "manual".into(),
                _ => {}
            }
            (format!("chaos-key-{i}"), body)
        })
        .collect();
    let creating = {
        let (http, token, url) = (site.http.clone(), site.token.clone(), url.clone());
        let bodies = bodies.clone();
        tokio::spawn(async move {
            stream::iter(bodies)
                .map(|(key, body)| {
                    let (http, token, url) = (http.clone(), token.clone(), url.clone());
                    async move {
                        // A client retries its own request until it gets an
                        // answer that is not "in progress" or "unavailable".
                        loop {
                            let r = http
                                .post(format!("{url}/v1/payments"))
                                .bearer_auth(&token)
                                .header("idempotency-key", &key)
                                .json(&body)
                                .send()
                                .await
                                .expect("the API answers");
                            match r.status().as_u16() {
                                201 => return r.json::<Value>().await.expect("json"),
                                409 | 503 => tokio::task::yield_now().await,
                                other => panic!("create {key}: {other}"),
                            }
                        }
                    }
                })
                .buffer_unordered(16)
                .collect::<Vec<Value>>()
                .await
        })
    };

    // Kill a worker, start a new one, again and again while payments flow.
    for round in 0..8usize {
        let ledger_before = site.ledger().totals.charges;
        wait_for("the provider keeps charging", SETTLE, async || {
            (site.ledger().totals.charges >= ledger_before + 40 || creating.is_finished())
                .then_some(())
        })
        .await;
        let victim = round % workers.len();
        workers[victim].kill9();
        workers[victim] = site
            .worker(&format!("worker {victim} (restart {round})"), env)
            .await
            .0;
    }
    let created = creating.await.expect("creating task");
    assert_eq!(created.len(), PAYMENTS);

    // Reconcile until quiet: nothing processing, unknown or in flight.
    site.reconcile_until_settled(env).await;

    // Ground truth: the provider's ledger, and its own search API (faults
    // off, so that a failing search does not read as a mismatch).
    control.clear_faults();
    let ledger = site.ledger();
    assert!(
        ledger.duplicate_charge_references.is_empty(),
        "references charged more than once: {:?}",
        ledger.duplicate_charge_references
    );
    // Nothing lost: every 201 is a payment, and every payment's state is
    // the provider's.
    assert_eq!(site.count("payments").await, PAYMENTS as i64);
    let (site, url, ledger) = (&site, &url, &ledger);
    let wrong: Vec<String> = stream::iter(created.iter())
        .map(|first| async move {
            let payment = site.payment(url, &id_of(first)).await;
            let reference = payment["intent"].as_str().expect("intent").to_owned();
            let charges = site.provider_charges(&reference).await;
            let effects = cobro_test_support::for_intent(ledger, &reference);
            let ok = match payment["status"].as_str() {
                Some("captured") | Some("authorized") => {
                    effects.charges == 1
                        && charges.len() == 1
                        && payment["provider_ref"] == charges[0].as_str()
                }
                Some("declined") => effects.charges == 0,
                _ => false,
            };
            (!ok).then(|| {
                format!(
                    "{reference}: {} {:?} charges {charges:?} effects {effects:?}",
                    payment["status"], payment["provider_ref"]
                )
            })
        })
        .buffer_unordered(32)
        .filter_map(|mismatch| async move { mismatch })
        .collect()
        .await;
    assert!(
        wrong.is_empty(),
        "{} payments disagree with the provider: {:?}",
        wrong.len(),
        &wrong[..wrong.len().min(10)]
    );
    let declined = created
        .iter()
        .filter(|p| p["order_ref"].as_str().is_some_and(|o| o.ends_with('0')))
        .count();
    assert_eq!(
        ledger.totals.charges as usize,
        PAYMENTS - declined,
        "one charge per payment that was not declined"
    );
    eprintln!(
        "chaos: {} charges, {} declines, {} reconciler decisions, {} attempts retried with a new key",
        ledger.totals.charges,
        ledger.totals.declines,
        site.count("reconciliation_decisions").await,
        site.count("attempts WHERE state = 'no_effect'").await,
    );
}

/// Runs `cobro ARGS` to its end against the site; its exit code and stdout.
async fn run_cli(site: &Site, args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String) {
    let mut command = site.command(args, env);
    let output = tokio::task::spawn_blocking(move || command.output())
        .await
        .expect("join")
        .expect("cobro runs");
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
    )
}

/// "Proof, not resemblance" point 10: a lone `cobro worker` makes the charge
/// (its answer held past its timeout) and is killed; no worker is left.
/// `cobro reconcile` must still see the attempt, find the charge by its own
/// identity and adopt it: exit 0, one charge.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_charge_left_by_a_killed_lone_worker_is_adopted_by_cobro_reconcile() {
    let site = Site::new().await;
    site.hold_next_charge_answer(Duration::from_secs(60));
    let (_api, url) = site
        .serve("serve", &["--no-worker", "--no-reconciler"], &[])
        .await;
    let created = site.create_payment(&url, "k-1", &payment_body("o-1")).await;
    let id = id_of(&created);
    let (mut worker, _) = site
        .worker("lone worker", &[("COBRO_NO_RECONCILER", "true")])
        .await;
    site.charged("o-1:authorize-v1").await;
    worker.kill9();
    // Its lease expires; nobody takes the row.
    wait_for("the dead worker's lease expires", SETTLE, async || {
        let expired: bool = sqlx::query_scalar("SELECT lease_expires_at < now() FROM outbox")
            .fetch_one(&site.pg)
            .await
            .expect("outbox");
        expired.then_some(())
    })
    .await;
    let (code, out) = run_cli(
        &site,
        &["reconcile", "--all", "--older-than", "0s", "--json"],
        &[],
    )
    .await;
    assert_eq!(code, Some(0), "nothing left: {out}");
    let summary: Value = serde_json::from_str(&out).expect("json");
    assert_eq!(summary["examined"], 1, "{summary}");
    assert_eq!(summary["resolved"]["succeeded"], 1, "{summary}");
    let payment = site.payment(&url, &id).await;
    assert_eq!(payment["status"], "captured");
    let ledger = site.ledger();
    assert_eq!(ledger.totals.charges, 1);
    assert_eq!(payment["provider_ref"], ledger.charges[0].id.as_str());
}

/// Point 7: `cobro worker` (and `serve --no-worker`) run the scheduled
/// reconciler. The provider drops every answer, the short key window
/// closes, the worker hands the attempt over; only a reconciler can settle
/// it, and no `cobro reconcile` is run.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_process_reconciles_on_its_own_schedule() {
    let site = Site::new().await;
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
    .fetch_one(&site.pg)
    .await
    .expect("audit");
    assert_eq!(decided, 1, "decided by the worker process's reconciler");
    let ledger = site.ledger();
    assert_eq!(ledger.totals.charges, 1);
    assert_eq!(payment["provider_ref"], ledger.charges[0].id.as_str());
}

/// Point 1, as it was reproduced: two merchants, one order ref, one
/// provider API key. B is captured; A's attempt goes unknown; `cobro
/// reconcile --payment A --older-than 0s` must not bind A to B's charge.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cobro_reconcile_never_binds_one_merchants_payment_to_anothers_charge() {
    let site = Site::new().await;
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
    let b_charge = site.ledger().charges[0].id.clone();
    site.provider
        .control()
        .add_fault(FaultRule::new(FOp::Charge, FaultAction::FailBeforeEffect));
    let created_a = site
        .create_payment(&url, "a-1", &payment_body("ord-1"))
        .await;
    let a = id_of(&created_a);
    let (code, out) = run_cli(
        &site,
        &["reconcile", "--payment", &a, "--older-than", "0s", "--json"],
        &[],
    )
    .await;
    assert_ne!(code, Some(0), "nothing is proven for A: {out}");
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
    let site = Site::new().await;
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

#[path = "merchant.rs"]
mod merchant;

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
    let site = Site::with_provider(fake_provider::Config {
        admin: true,
        seed: 18,
        retention: Duration::from_secs(8),
        ..Default::default()
    })
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
            .fetch_all(&site.pg)
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
