//! The `cobro` binary as an operator runs it: a real process in its own
//! temporary directory, on the embedded SQLite database, observed through
//! its stdout, stderr, exit status, HTTP answers and the database file.
//! (PostgreSQL runs of the same binary live in the workspace's tests crate.)

mod common;

use common::Server;
use nix::sys::signal::Signal;
use sha2::{Digest, Sha256};
use sqlx::{Connection, Row, SqliteConnection};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;
use tempfile::TempDir;

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

/// `cobro ARGS` in `workdir`, running, its stderr in the file `stderr`.
fn start_server(workdir: &Workdir, args: &[&str], stderr: &Path) -> Server {
    Server::spawn(workdir.cobro(args), stderr)
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
    let mut server = start_server(
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

/// Starts `cobro serve` on the embedded default; its dev token and URL.
fn serve_demo(workdir: &Workdir, name: &str) -> (Server, String, String) {
    let stderr_file = workdir.dir.path().join(format!("stderr-{name}.log"));
    let mut server = start_server(workdir, &["serve", "--listen", "127.0.0.1:0"], &stderr_file);
    let token = server.wait_for_line("dev token: ");
    let url = server.wait_for_line("cobro listening on ");
    (server, token, url)
}

fn stop(mut server: Server) {
    server.signal(Signal::SIGINT);
    assert!(server.wait_for_exit(SHUTDOWN_DEADLINE).success());
}

/// The status of `GET /v1/payments` with `token`.
fn list_status(url: &str, token: &str) -> u16 {
    reqwest::blocking::Client::new()
        .get(format!("{url}/v1/payments"))
        .bearer_auth(token)
        .send()
        .expect("answered")
        .status()
        .as_u16()
}

#[test]
fn the_embedded_demo_reuses_its_dev_token_across_restarts_until_it_is_revoked() {
    let workdir = Workdir::new();
    let (first, token, _) = serve_demo(&workdir, "first");
    stop(first);
    let (second, again, url) = serve_demo(&workdir, "second");
    assert_eq!(again, token, "the same dev token on the second start");
    assert_eq!(list_status(&url, &token), 200, "and it still works");
    stop(second);
    let accounts = workdir.run_ok(&["accounts", "list"]);
    assert_eq!(accounts.matches("\tdemo\t").count(), 1, "{accounts}");
    let tokens: serde_json::Value =
        serde_json::from_str(&workdir.run_ok(&["tokens", "list", "--json"])).expect("json");
    assert_eq!(
        tokens["tokens"].as_array().map(Vec::len),
        Some(1),
        "{tokens}"
    );
    let kept = workdir.data_dir().join("demo-token");
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(&kept).expect("kept").permissions(),
    );
    assert_eq!(mode & 0o077, 0, "only its owner reads the kept token");

    // Revoked (here by its text, as for a leaked token): the next start
    // issues a fresh one, and the revoked one is refused.
    workdir.run_ok(&["tokens", "revoke", &token]);
    let (third, fresh, url) = serve_demo(&workdir, "third");
    assert_ne!(fresh, token);
    assert_eq!(list_status(&url, &fresh), 200);
    assert_eq!(list_status(&url, &token), 401);
    stop(third);
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
        .env("COBRO_LOCK_TIMEOUT", "two seconds")
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

    // The dry run counts exactly what the purge then does, and changes nothing.
    let dry: serde_json::Value =
        serde_json::from_str(&workdir.run_ok(&["purge", "--dry-run", "--json"])).expect("json");
    assert_eq!(
        dry,
        serde_json::json!({"dry_run": true, "compacted": 3, "tombstones_deleted": 1, "webhook_events_deleted": 1})
    );
    let dry_text = workdir.run_ok(&["purge", "--dry-run"]);
    assert!(
        dry_text.starts_with("dry run, nothing changed"),
        "{dry_text}"
    );
    rt.block_on(async {
        let mut db = workdir.connect_db().await;
        let tombstones: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM idempotency_records WHERE state = 'tombstone'",
        )
        .fetch_one(&mut db)
        .await
        .expect("count");
        assert_eq!(tombstones, 2, "the dry run compacted nothing");
        let events: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM webhook_events")
            .fetch_one(&mut db)
            .await
            .expect("count");
        assert_eq!(events, 2, "the dry run deleted nothing");
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

fn json_of(stdout: &str) -> serde_json::Value {
    serde_json::from_str(stdout).unwrap_or_else(|e| panic!("not one JSON document ({e}): {stdout}"))
}

#[test]
fn tokens_expire_are_listed_without_their_secret_and_revoked_through_the_real_api() {
    let workdir = Workdir::new();
    workdir.migrated_with_account("acme");
    let create = |extra: &[&str]| {
        let mut args = vec!["tokens", "create", "--account", "acme", "--json"];
        args.extend_from_slice(extra);
        json_of(&workdir.run_ok(&args))
    };
    let forever = create(&["--label", "forever"]);
    let hour = create(&["--label", "hour", "--expires-in", "1h"]);
    // Expires at its creation instant: refused from the first request on,
    // which tests expiry through the API without waiting.
    let gone = create(&["--label", "gone", "--expires-in", "0s"]);
    assert!(forever["expires_at"].is_null());
    assert!(hour["expires_at"].is_string());
    let secret = |t: &serde_json::Value| t["token"].as_str().expect("token").to_owned();

    let listed = workdir.run_ok(&["tokens", "list", "--json"]);
    let table = workdir.run_ok(&["tokens", "list", "--account", "acme"]);
    for token in [&forever, &hour, &gone] {
        for text in [&listed, &table] {
            assert!(!text.contains(&secret(token)), "no secret listed: {text}");
            assert!(
                !text.contains(&sha256_hex(&secret(token))),
                "no hash listed"
            );
        }
    }
    let listed = json_of(&listed);
    let states: Vec<(&str, &str)> = listed["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .map(|t| {
            (
                t["label"].as_str().expect("label"),
                t["state"].as_str().expect("state"),
            )
        })
        .collect();
    assert_eq!(
        states,
        vec![("forever", "live"), ("hour", "live"), ("gone", "expired")]
    );
    let rows = listed["tokens"].as_array().expect("tokens");
    for (row, token) in rows.iter().zip([&forever, &hour, &gone]) {
        assert_eq!(row["id"], token["id"]);
        assert_eq!(
            row["prefix"],
            secret(token)[..14],
            "the prefix tells tokens apart"
        );
    }

    let stderr_file = workdir.dir.path().join("serve.log");
    let mut server = start_server(
        &workdir,
        // With no token cache a revocation takes effect on the next
        // request (the cache's bound is tested in tests/payments_api.rs).
        &[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--token-cache-ttl",
            "0s",
        ],
        &stderr_file,
    );
    let url = server.wait_for_line("cobro listening on ");
    assert_eq!(list_status(&url, &secret(&forever)), 200);
    assert_eq!(list_status(&url, &secret(&hour)), 200);
    assert_eq!(list_status(&url, &secret(&gone)), 401, "expired");

    let id = forever["id"].as_str().expect("id");
    let revoked = json_of(&workdir.run_ok(&["tokens", "revoke", id, "--json"]));
    assert_eq!(revoked["state"], "revoked");
    assert_eq!(revoked["already_revoked"], false);
    assert_eq!(list_status(&url, &secret(&forever)), 401, "revoked at once");
    assert_eq!(
        list_status(&url, &secret(&hour)),
        200,
        "the others still work"
    );
    let again = json_of(&workdir.run_ok(&["tokens", "revoke", id, "--json"]));
    assert_eq!(again["already_revoked"], true);
    assert_eq!(
        again["revoked_at"], revoked["revoked_at"],
        "the first time is kept"
    );
    let unknown = workdir.run(&["tokens", "revoke", "cobro_not_a_token"]);
    assert_eq!(unknown.status.code(), Some(1));
    stop(server);
}

#[test]
fn operator_commands_log_only_warnings_unless_verbose() {
    let workdir = Workdir::new();
    let quiet = workdir.run(&["migrate"]);
    assert!(quiet.status.success());
    assert_eq!(
        String::from_utf8_lossy(&quiet.stderr),
        "",
        "nothing on stderr"
    );
    let verbose = workdir.run(&["-v", "accounts", "list"]);
    assert!(String::from_utf8_lossy(&verbose.stderr).contains("database ready"));
    let rust_log = workdir
        .cobro(&["accounts", "list"])
        .env("RUST_LOG", "info")
        .output()
        .expect("runs");
    assert!(
        String::from_utf8_lossy(&rust_log.stderr).contains("database ready"),
        "RUST_LOG wins"
    );
}

#[test]
fn exit_codes_are_0_ok_1_error_2_usage_and_documented_in_the_help() {
    let workdir = Workdir::new();
    assert_eq!(workdir.run(&["migrate"]).status.code(), Some(0));
    assert_eq!(
        workdir
            .run(&["tokens", "create", "--account", "nobody"])
            .status
            .code(),
        Some(1)
    );
    assert_eq!(
        workdir
            .run(&["migrate", "--provider-timeout", "5s"])
            .status
            .code(),
        Some(2)
    );
    assert_eq!(
        workdir.run(&["payments", "list", "--status"]).status.code(),
        Some(2)
    );
    let help = workdir.run_ok(&["--help"]);
    for line in ["0  success", "1  error", "2  usage error", "3  reconcile"] {
        assert!(help.contains(line), "{line}: {help}");
    }
}

#[test]
fn database_passwords_never_reach_stderr_in_any_url_form() {
    let workdir = Workdir::new();
    for url in [
        "postgres://cobro:hunter2@127.0.0.1:1/cobro",
        "postgres://cobro@127.0.0.1:1/cobro?password=hunter2&sslmode=disable",
        "host=127.0.0.1 port=1 user=cobro password=hunter2",
    ] {
        let output = workdir
            .cobro(&["-vv", "migrate"])
            .env("COBRO_DATABASE_URL", url)
            .output()
            .expect("runs");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(1), "{url}: {stderr}");
        assert!(!stderr.contains("hunter2"), "{url}: {stderr}");
    }
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
        // The embedded demo allows plain http on this machine.
        "http://localhost:4242/cobro",
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

#[test]
fn events_endpoints_add_refuses_urls_into_the_network_unless_allowed() {
    let workdir = Workdir::new();
    workdir.migrated_with_account("acme");
    let add = |url: &str| {
        vec![
            "events".to_owned(),
            "endpoints".to_owned(),
            "add".to_owned(),
            "--account".to_owned(),
            "acme".to_owned(),
            "--url".to_owned(),
            url.to_owned(),
        ]
    };
    let args = |v: &[String]| v.iter().map(String::as_str).collect::<Vec<_>>().join(" ");
    // Even the embedded demo allows only this machine beyond public hosts.
    for url in [
        "http://169.254.169.254/latest/meta-data",
        "http://10.0.0.1:2375/containers/create",
        "http://192.168.1.1/",
    ] {
        let argv = add(url);
        let refused = workdir.run(&argv.iter().map(String::as_str).collect::<Vec<_>>());
        assert_eq!(refused.status.code(), Some(1), "{}", args(&argv));
        let stderr = String::from_utf8_lossy(&refused.stderr);
        assert!(
            stderr.contains("the endpoint URL is not allowed")
                && stderr.contains("which endpoints may not reach"),
            "{stderr}"
        );
    }
    assert_eq!(workdir.run_ok(&["events", "endpoints", "list"]), "");
    // The operator's allow-list, by flag or variable.
    let mut argv = add("http://10.0.0.1:2375/hook");
    argv.extend(["--events-allow".to_owned(), "10.0.0.0/8".to_owned()]);
    let allowed = workdir.run(&argv.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(allowed.status.success(), "{allowed:?}");
    let allowed = workdir
        .cobro(
            &add("http://192.168.1.1/")
                .iter()
                .map(String::as_str)
                .collect::<Vec<_>>(),
        )
        .env("COBRO_EVENTS_ALLOW", "192.168.0.0/16, hooks.internal")
        .output()
        .expect("runs");
    assert!(allowed.status.success(), "{allowed:?}");
    let listed = workdir.run_ok(&["events", "endpoints", "list"]);
    assert_eq!(listed.lines().count(), 2, "{listed}");
}

#[test]
fn an_empty_or_short_webhook_secret_stops_serve_at_start_by_flag_or_variable() {
    let workdir = Workdir::new();
    let serve = ["serve", "--listen", "127.0.0.1:0"];
    /// Flags, variables, and the start of the message expected.
    type Case<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)], &'a str);
    let cases: [Case; 5] = [
        (
            &["--webhook-secret", ""],
            &[],
            "COBRO_WEBHOOK_SECRET (--webhook-secret) is empty",
        ),
        (
            &[],
            &[("COBRO_WEBHOOK_SECRET", "")],
            "COBRO_WEBHOOK_SECRET (--webhook-secret) is empty",
        ),
        (
            &["--webhook-secret", "whsec_tooshort"],
            &[],
            "COBRO_WEBHOOK_SECRET (--webhook-secret) is 14 bytes long",
        ),
        (
            &[],
            &[("COBRO_WEBHOOK_SECRET", "whsec_tooshort")],
            "COBRO_WEBHOOK_SECRET (--webhook-secret) is 14 bytes long",
        ),
        (
            &[],
            &[
                ("COBRO_WEBHOOK_SECRET", "whsec_long_enough_for_cobro"),
                ("COBRO_WEBHOOK_SECRET_PREVIOUS", "whsec_tooshort"),
            ],
            "COBRO_WEBHOOK_SECRET_PREVIOUS (--webhook-secret-previous) is 14 bytes long",
        ),
    ];
    for (args, env, expected) in cases {
        let mut all = serve.to_vec();
        all.extend_from_slice(args);
        // An unreachable database: refused before it is opened (and a
        // build without the check fails here too, with another message,
        // rather than serving).
        let output = workdir
            .cobro(&all)
            .env("COBRO_DATABASE_URL", "postgres://cobro@127.0.0.1:1/cobro")
            .envs(env.iter().copied())
            .output()
            .expect("runs");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(1), "{args:?} {env:?}: {stderr}");
        assert!(stderr.contains(expected), "{args:?} {env:?}: {stderr}");
        assert!(
            stderr.contains("at least 16") || expected.ends_with("empty"),
            "{stderr}"
        );
        assert!(
            !stderr.contains("whsec_tooshort"),
            "never the value: {stderr}"
        );
        assert!(
            String::from_utf8_lossy(&output.stdout).is_empty(),
            "nothing served"
        );
    }
}
