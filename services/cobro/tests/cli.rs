//! The `cobro` binary as an operator runs it: a real process in its own
//! temporary directory, on the embedded SQLite database, observed through
//! its stdout, stderr, exit status, HTTP answers and the database file.
//! (PostgreSQL runs of the same binary live in the workspace's tests crate.)

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use sha2::{Digest, Sha256};
use sqlx::{Connection, Row, SqliteConnection};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::time::{Duration, Instant};
use tempfile::TempDir;

const STARTUP_DEADLINE: Duration = Duration::from_secs(60);
const SHUTDOWN_DEADLINE: Duration = Duration::from_secs(10);

/// A temporary working directory with the embedded data dir inside.
struct Workdir {
    dir: TempDir,
}

impl Workdir {
    fn new() -> Self {
        Self {
            dir: tempfile::tempdir().expect("temp dir"),
        }
    }

    fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn db_file(&self) -> PathBuf {
        self.data_dir().join("cobro.db")
    }

    /// `cobro ARGS` in this directory, with no configuration inherited
    /// from the environment of whoever runs the tests.
    fn cobro(&self, args: &[&str]) -> Command {
        let mut command = Command::new(env!("CARGO_BIN_EXE_cobro"));
        for (name, _) in std::env::vars() {
            if name.starts_with("COBRO_") {
                command.env_remove(name);
            }
        }
        command
            .args(args)
            .current_dir(self.dir.path())
            .env("COBRO_DATA_DIR", self.data_dir())
            .stdin(Stdio::null());
        command
    }

    /// Runs `cobro ARGS` to completion.
    fn run(&self, args: &[&str]) -> Output {
        self.cobro(args).output().expect("cobro runs")
    }

    /// Runs `cobro ARGS`, requires success, returns stdout.
    fn run_ok(&self, args: &[&str]) -> String {
        let output = self.run(args);
        assert!(
            output.status.success(),
            "cobro {args:?} failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8(output.stdout).expect("utf-8 stdout")
    }

    /// Migrates the embedded database and creates an account; its id.
    fn migrated_with_account(&self, name: &str) -> String {
        self.run_ok(&["migrate"]);
        let id = self.run_ok(&["accounts", "create", "--name", name]);
        let id = id.trim().to_owned();
        assert_eq!(id.len(), 36, "an account id: {id}");
        id
    }

    async fn connect_db(&self) -> SqliteConnection {
        let url = format!("sqlite://{}", self.db_file().display());
        SqliteConnection::connect(&url)
            .await
            .expect("open the SQLite file")
    }

    /// Every file SQLite may have written to (WAL mode), concatenated.
    fn db_bytes(&self) -> Vec<u8> {
        ["cobro.db", "cobro.db-wal", "cobro.db-shm"]
            .iter()
            .filter_map(|name| std::fs::read(self.data_dir().join(name)).ok())
            .flatten()
            .collect()
    }
}

/// A running `cobro serve`, its stdout read line by line on a thread.
struct Server {
    child: Child,
    lines: Receiver<String>,
    stdout: Vec<String>,
}

impl Server {
    fn start(workdir: &Workdir, args: &[&str], stderr: &Path) -> Self {
        let stderr = std::fs::File::create(stderr).expect("stderr file");
        let mut child = workdir
            .cobro(args)
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .expect("cobro serve starts");
        let stdout = child.stdout.take().expect("piped stdout");
        let (send, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if send.send(line).is_err() {
                    return;
                }
            }
        });
        Self {
            child,
            lines,
            stdout: Vec::new(),
        }
    }

    /// Reads stdout until a line starts with `prefix`; the rest of it.
    fn wait_for_line(&mut self, prefix: &str) -> String {
        let deadline = Instant::now() + STARTUP_DEADLINE;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.stdout.push(line.clone());
                    if let Some(rest) = line.strip_prefix(prefix) {
                        return rest.to_owned();
                    }
                }
                Err(e) => panic!(
                    "no line `{prefix}...` on stdout ({e}); saw {:?}",
                    self.stdout
                ),
            }
        }
    }

    fn signal(&self, signal: Signal) {
        let pid = Pid::from_raw(i32::try_from(self.child.id()).expect("pid fits"));
        kill(pid, signal).expect("signal delivered");
    }

    fn wait_for_exit(&mut self, deadline: Duration) -> ExitStatus {
        let deadline = Instant::now() + deadline;
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                return status;
            }
            assert!(Instant::now() < deadline, "cobro did not exit in time");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // Never leave a server behind when a test fails half-way.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn sha256_hex(text: &str) -> String {
    hex::encode(Sha256::digest(text.as_bytes()))
}

fn contains(haystack: &[u8], needle: &str) -> bool {
    haystack
        .windows(needle.len())
        .any(|window| window == needle.as_bytes())
}

#[test]
fn serve_on_the_embedded_default_prints_url_and_token_answers_health_and_exits_on_sigterm() {
    let workdir = Workdir::new();
    let stderr_file = workdir.dir.path().join("stderr.log");
    let mut server = Server::start(
        &workdir,
        &["serve", "--listen", "127.0.0.1:0"],
        &stderr_file,
    );

    let token = server.wait_for_line("dev token: ");
    let url = server.wait_for_line("cobro listening on ");
    assert!(
        token.starts_with("cobro_") && token.len() == 70,
        "token: {token}"
    );
    assert!(
        url.starts_with("http://127.0.0.1:") && !url.ends_with(":0"),
        "url: {url}"
    );
    assert!(
        server
            .stdout
            .iter()
            .any(|l| l.contains("EMBEDDED DEMO SETUP")),
        "the demo setup is announced: {:?}",
        server.stdout
    );

    let client = reqwest::blocking::Client::new();
    for path in ["/healthz", "/readyz"] {
        let response = client
            .get(format!("{url}{path}"))
            // A secret-looking header, to check below that it is never logged.
            .bearer_auth(&token)
            .header("x-request-id", "test-request-1")
            .send()
            .expect("request answered");
        assert_eq!(response.status(), 200, "{path}");
        assert_eq!(response.headers()["x-request-id"], "test-request-1");
    }
    let response = client
        .get(format!("{url}/healthz"))
        .send()
        .expect("request answered");
    let generated = response.headers()["x-request-id"].to_str().expect("ascii");
    assert_eq!(
        generated.len(),
        36,
        "a UUID request id is generated: {generated}"
    );

    server.signal(Signal::SIGTERM);
    let status = server.wait_for_exit(SHUTDOWN_DEADLINE);
    assert!(status.success(), "exit status after SIGTERM: {status:?}");

    let logs = std::fs::read(&stderr_file).expect("stderr captured");
    assert!(contains(&logs, "test-request-1"), "request ids are logged");
    assert!(
        !contains(&logs, &token),
        "the token never appears in the logs"
    );

    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let mut db = workdir.connect_db().await;
        let stored: String = sqlx::query_scalar(
            "SELECT t.token_hash FROM api_tokens t JOIN accounts a ON a.id = t.account_id \
             WHERE a.name = 'demo'",
        )
        .fetch_one(&mut db)
        .await
        .expect("the demo account has its dev token");
        assert_eq!(stored, sha256_hex(&token));
    });
}

#[test]
fn a_second_embedded_start_reuses_the_demo_account_with_a_fresh_token() {
    let workdir = Workdir::new();
    let mut tokens = Vec::new();
    for run in 0..2 {
        let stderr_file = workdir.dir.path().join(format!("stderr-{run}.log"));
        let mut server = Server::start(
            &workdir,
            &["serve", "--listen", "127.0.0.1:0"],
            &stderr_file,
        );
        tokens.push(server.wait_for_line("dev token: "));
        server.wait_for_line("cobro listening on ");
        server.signal(Signal::SIGINT);
        assert!(server.wait_for_exit(SHUTDOWN_DEADLINE).success());
    }
    assert_ne!(tokens[0], tokens[1]);
    let accounts = workdir.run_ok(&["accounts", "list"]);
    assert_eq!(accounts.matches("\tdemo\t").count(), 1, "{accounts}");
}

#[test]
fn migrate_with_an_unparsable_database_url_fails_with_a_clear_message_and_no_password() {
    let workdir = Workdir::new();
    let output = workdir
        .cobro(&["migrate"])
        .env(
            "COBRO_DATABASE_URL",
            "postgres://cobro:hunter2@db:notaport/cobro",
        )
        .output()
        .expect("cobro runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(stderr.contains("COBRO_DATABASE_URL"), "{stderr}");
    assert!(stderr.contains("not a valid URL"), "{stderr}");
    assert!(
        !stderr.contains("hunter2"),
        "the password is not echoed: {stderr}"
    );
}

#[test]
fn serve_with_an_unreachable_database_fails_at_start_naming_it() {
    let workdir = Workdir::new();
    let missing = workdir.dir.path().join("no-such-dir").join("cobro.db");
    let output = workdir
        .cobro(&["serve", "--listen", "127.0.0.1:0"])
        .env(
            "COBRO_DATABASE_URL",
            format!("sqlite://{}", missing.display()),
        )
        .output()
        .expect("cobro runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(
        stderr.contains("could not connect to the database"),
        "{stderr}"
    );
    assert!(!String::from_utf8_lossy(&output.stdout).contains("cobro listening on"));
}

#[test]
fn a_bad_duration_is_refused_before_anything_runs() {
    let workdir = Workdir::new();
    let output = workdir
        .cobro(&["migrate"])
        .env("COBRO_LOCK_TIMEOUT", "2 seconds")
        .output()
        .expect("cobro runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(stderr.contains("--lock-timeout"), "{stderr}");
    assert!(!workdir.db_file().exists(), "no database was created");
}

#[test]
fn serve_refuses_a_schema_newer_than_the_binary() {
    let workdir = Workdir::new();
    workdir.run_ok(&["migrate"]);
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let mut db = workdir.connect_db().await;
        sqlx::query(
            "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) \
             VALUES (99990101000000, 'from the future', TRUE, X'00', 0)",
        )
        .execute(&mut db)
        .await
        .expect("insert a future migration");
    });

    let output = workdir.run(&["serve", "--listen", "127.0.0.1:0"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(stderr.contains("newer than this binary"), "{stderr}");
    assert!(
        !String::from_utf8_lossy(&output.stdout).contains("cobro listening on"),
        "it never listened"
    );
}

#[test]
fn accounts_and_tokens_are_created_and_only_the_token_hash_is_stored() {
    let workdir = Workdir::new();
    let account_id = workdir.migrated_with_account("acme");
    let account_id = account_id.as_str();

    let duplicate = workdir.run(&["accounts", "create", "--name", "acme"]);
    assert!(!duplicate.status.success(), "account names are unique");

    let by_name = workdir.run_ok(&["tokens", "create", "--account", "acme", "--label", "ci"]);
    let by_id = workdir.run_ok(&["tokens", "create", "--account", account_id]);
    let by_name = by_name.trim();
    let by_id = by_id.trim();
    for token in [by_name, by_id] {
        assert!(
            token.starts_with("cobro_") && token.len() == 70,
            "token: {token}"
        );
    }
    assert_ne!(by_name, by_id);

    let unknown = workdir.run(&["tokens", "create", "--account", "nobody"]);
    assert!(!unknown.status.success());
    assert!(String::from_utf8_lossy(&unknown.stderr).contains("no account"));

    let listed = workdir.run_ok(&["accounts", "list"]);
    assert!(
        listed.contains(&format!("{account_id}\tacme\t")),
        "{listed}"
    );

    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let mut db = workdir.connect_db().await;
        let rows = sqlx::query(
            "SELECT account_id, token_hash, label FROM api_tokens ORDER BY created_at, id",
        )
        .fetch_all(&mut db)
        .await
        .expect("tokens");
        let mut stored: Vec<(String, String, String)> = rows
            .iter()
            .map(|r| (r.get("account_id"), r.get("token_hash"), r.get("label")))
            .collect();
        stored.sort_by(|a, b| a.2.cmp(&b.2));
        assert_eq!(
            stored,
            vec![
                (account_id.to_owned(), sha256_hex(by_id), String::new()),
                (account_id.to_owned(), sha256_hex(by_name), "ci".to_owned()),
            ]
        );
        db.close().await.expect("close");
    });

    let bytes = workdir.db_bytes();
    assert!(!bytes.is_empty());
    for token in [by_name, by_id] {
        assert!(
            !contains(&bytes, token),
            "the token text is not in the database files"
        );
        assert!(!contains(&bytes, &token["cobro_".len()..]));
    }
}

#[test]
fn purge_compacts_and_deletes_only_what_is_past_retention_batch_by_batch() {
    let workdir = Workdir::new();
    let account = workdir.migrated_with_account("acme");
    let account = account.as_str();
    let now = chrono::Utc::now();
    let at = |hours: i64| {
        (now - chrono::Duration::hours(hours))
            .format("%Y-%m-%dT%H:%M:%S%.6fZ")
            .to_string()
    };

    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let mut db = workdir.connect_db().await;
        // (key, state, age in hours): with 24h + 30d retention, `old-*` are
        // compacted, `fresh` stays, `ancient` (a tombstone older than 31 days)
        // goes, `recent-tomb` stays.
        let records = [
            ("old-1", "completed", 25),
            ("old-2", "completed", 48),
            ("old-3", "completed", 100),
            ("fresh", "completed", 1),
            ("ancient", "tombstone", 24 * 32),
            ("recent-tomb", "tombstone", 24 * 20),
        ];
        for (key, state, hours) in records {
            let body: Option<&[u8]> = (state == "completed").then_some(b"{}".as_slice());
            sqlx::query(
                "INSERT INTO idempotency_records (account_id, operation, idempotency_key, fingerprint, \
                 state, status_code, response_body, resource_type, resource_id, created_at) \
                 VALUES ($1, 'payment.authorize', $2, 'fp', $3, 201, $4, 'payment', $5, $6)",
            )
            .bind(account)
            .bind(key)
            .bind(state)
            .bind(body)
            .bind(uuid::Uuid::now_v7().to_string())
            .bind(at(hours))
            .execute(&mut db)
            .await
            .expect("insert record");
        }
        for (event, hours) in [("evt-old", 24 * 31), ("evt-new", 24 * 29)] {
            sqlx::query(
                "INSERT INTO webhook_events (provider, event_id, event_type, sequence, outcome, \
                 payload, received_at) VALUES ('fake', $1, 'charge.succeeded', 1, 'applied', '{}', $2)",
            )
            .bind(event)
            .bind(at(hours))
            .execute(&mut db)
            .await
            .expect("insert event");
        }
        db.close().await.expect("close");
    });

    // Batches of 2 over 3 compactable records: a full batch, then a short one.
    let report = workdir.run_ok(&["purge", "--batch", "2"]);
    assert_eq!(
        report.trim(),
        "compacted 3 idempotency records, deleted 1 tombstones, deleted 1 webhook events"
    );

    rt.block_on(async {
        let mut db = workdir.connect_db().await;
        let rows = sqlx::query(
            "SELECT idempotency_key, state, response_body IS NULL AS compacted \
             FROM idempotency_records ORDER BY idempotency_key",
        )
        .fetch_all(&mut db)
        .await
        .expect("records");
        let left: Vec<(String, String, bool)> = rows
            .iter()
            .map(|r| (r.get("idempotency_key"), r.get("state"), r.get("compacted")))
            .collect();
        let expected = [
            ("fresh", "completed", false),
            ("old-1", "tombstone", true),
            ("old-2", "tombstone", true),
            ("old-3", "tombstone", true),
            ("recent-tomb", "tombstone", true),
        ]
        .map(|(k, s, c)| (k.to_owned(), s.to_owned(), c));
        assert_eq!(left, expected);
        let events: Vec<String> = sqlx::query_scalar("SELECT event_id FROM webhook_events")
            .fetch_all(&mut db)
            .await
            .expect("events");
        assert_eq!(events, vec!["evt-new".to_owned()]);
    });

    let again = workdir.run_ok(&["purge"]);
    assert_eq!(
        again.trim(),
        "compacted 0 idempotency records, deleted 0 tombstones, deleted 0 webhook events",
        "a second purge finds nothing"
    );
}

#[test]
fn events_endpoints_are_managed_from_the_command_line_and_events_are_listed_and_resent() {
    let workdir = Workdir::new();
    workdir.migrated_with_account("acme");
    let added = workdir.run_ok(&[
        "events",
        "endpoints",
        "add",
        "--account",
        "acme",
        "--url",
        "https://shop.example/cobro",
        "--type",
        "payment.captured",
    ]);
    let (id, secret) = added.trim().split_once('\t').expect("id and secret");
    assert!(secret.starts_with("whsec_"), "{added}");
    let listed = workdir.run_ok(&["events", "endpoints", "list"]);
    assert!(
        listed.contains(id) && listed.contains("enabled"),
        "{listed}"
    );
    assert!(!listed.contains(secret), "a list never shows the secret");
    let rotated = workdir.run_ok(&["events", "endpoints", "rotate", id]);
    assert!(!rotated.contains(secret), "a new secret");
    let unknown = workdir.run(&[
        "events",
        "endpoints",
        "add",
        "--account",
        "acme",
        "--url",
        "https://x.example",
        "--type",
        "payment.nope",
    ]);
    assert!(!unknown.status.success());
    assert_eq!(workdir.run_ok(&["events", "list"]), "", "no events yet");
    let dead = workdir.run_ok(&["events", "resend", "--dead"]);
    assert_eq!(dead.trim(), "0 dead deliveries queued again");
    let missing = workdir.run(&["events", "resend", "0193a7c4-5f2e-7d41-9b7a-2c1d3e4f5a6b"]);
    assert!(!missing.status.success());
    workdir.run_ok(&["events", "endpoints", "remove", id]);
    assert_eq!(workdir.run_ok(&["events", "endpoints", "list"]), "");
}
