//! Shared helpers for cobro's integration tests: fresh databases on both
//! backends, dropped when the test ends (also when it panics).

use chrono::{DateTime, TimeZone, Utc};
use cobro_store::{Store, StoreConfig};
use sqlx::Connection;
use std::path::PathBuf;

/// Which backend a test runs against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Postgres,
    Sqlite,
}

/// A fresh, migrated database that disappears with this value.
pub struct TestDb {
    pub store: Store,
    pub url: String,
    cleanup: Cleanup,
}

enum Cleanup {
    Postgres {
        admin_url: String,
        name: String,
    },
    Sqlite {
        dir: PathBuf,
    },
    /// Lent by another `TestDb` ([`TestDb::lend`]), which owns the database.
    Lent,
}

/// The superuser URL of the throwaway cluster started by `ops/test.sh`.
/// PostgreSQL tests fail (never skip) without it: a suite that silently
/// skipped its production backend would prove nothing.
pub fn postgres_admin_url() -> String {
    std::env::var("COBRO_TEST_PG_URL").unwrap_or_else(|_| {
        panic!("COBRO_TEST_PG_URL is not set: run the suite with ops/test.sh, which starts a throwaway PostgreSQL")
    })
}

impl TestDb {
    pub async fn new(backend: Backend) -> Self {
        Self::with_config(backend, |_| {}).await
    }

    /// A fresh database whose store config `tweak` may adjust (pool size,
    /// lock timeout).
    pub async fn with_config(backend: Backend, tweak: impl FnOnce(&mut StoreConfig)) -> Self {
        let suffix = uuid::Uuid::new_v4().simple().to_string();
        let (url, cleanup) = match backend {
            Backend::Postgres => {
                let admin_url = postgres_admin_url();
                let name = format!("cobro_test_{suffix}");
                let mut admin = sqlx::PgConnection::connect(&admin_url)
                    .await
                    .expect("connect to the throwaway PostgreSQL");
                let template = postgres_template(&admin_url).await;
                sqlx::query(&format!("CREATE DATABASE {name} TEMPLATE {template}"))
                    .execute(&mut admin)
                    .await
                    .expect("create test database");
                let base = admin_url
                    .rsplit_once('/')
                    .map(|(b, _)| b)
                    .unwrap_or(&admin_url);
                (
                    format!("{base}/{name}"),
                    Cleanup::Postgres { admin_url, name },
                )
            }
            Backend::Sqlite => {
                let dir = std::env::temp_dir().join(format!("cobro-test-{suffix}"));
                std::fs::create_dir_all(&dir).expect("temp dir");
                std::fs::copy(sqlite_template().await, dir.join("cobro.db"))
                    .expect("copy the migrated SQLite template");
                (
                    format!("sqlite://{}", dir.join("cobro.db").display()),
                    Cleanup::Sqlite { dir },
                )
            }
        };
        let mut config = StoreConfig::new(url.clone());
        tweak(&mut config);
        let store = Store::connect(&config).await.expect("connect test store");
        // A copy of the template is already migrated: this only checks it
        // (sqlx refuses a template whose applied migrations differ).
        store.migrate().await.expect("migrate test store");
        TestDb {
            store,
            url,
            cleanup,
        }
    }
}

/// A fingerprint of one backend's migration files (names and contents):
/// the name of the template built from them, so a changed migration never
/// reuses a template built before it.
fn migrations_fingerprint(backend: &str) -> String {
    use std::hash::{Hash, Hasher};
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../migrations")
        .join(backend);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
        .map(|entry| entry.expect("migration entry").path())
        .collect();
    files.sort();
    // `DefaultHasher::new` has fixed keys: the same files give the same
    // name in every test process of this build.
    let mut hasher = std::hash::DefaultHasher::new();
    for file in files {
        file.file_name().hash(&mut hasher);
        std::fs::read(&file)
            .expect("read migration")
            .hash(&mut hasher);
    }
    format!("{:016x}", hasher.finish())
}

/// The migrated database every PostgreSQL test database is copied from
/// (`CREATE DATABASE ... TEMPLATE`, a file copy): migrating costs about
/// 0.3 s of server time, copying 0.03 s, and the explorer makes one
/// database per seed. Built once per cluster and schema by whichever test
/// process gets there first, under an advisory lock; it is migrated under
/// a temporary name and renamed when complete, so no process copies a
/// half-migrated template (and one that died building leaves only the
/// temporary name, dropped by the next builder).
async fn postgres_template(admin_url: &str) -> &'static str {
    static TEMPLATE: tokio::sync::OnceCell<String> = tokio::sync::OnceCell::const_new();
    TEMPLATE
        .get_or_init(|| async {
            let name = format!("cobro_template_{}", migrations_fingerprint("postgres"));
            let building = format!("{name}_building");
            let mut admin = sqlx::PgConnection::connect(admin_url)
                .await
                .expect("connect to the throwaway PostgreSQL");
            // Session-level: released when `admin` closes, also on a panic.
            sqlx::query("SELECT pg_advisory_lock(hashtext($1))")
                .bind(&name)
                .execute(&mut admin)
                .await
                .expect("template lock");
            let exists: bool =
                sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
                    .bind(&name)
                    .fetch_one(&mut admin)
                    .await
                    .expect("look up the template");
            if !exists {
                for sql in [
                    format!("DROP DATABASE IF EXISTS {building} WITH (FORCE)"),
                    format!("CREATE DATABASE {building}"),
                ] {
                    sqlx::query(&sql)
                        .execute(&mut admin)
                        .await
                        .expect("create the template");
                }
                let base = admin_url
                    .rsplit_once('/')
                    .map(|(b, _)| b)
                    .unwrap_or(admin_url);
                let store = Store::connect(&StoreConfig::new(format!("{base}/{building}")))
                    .await
                    .expect("connect the template");
                store.migrate().await.expect("migrate the template");
                store.close().await;
                // A closed pool's sessions end on the server a moment later,
                // and a database with a session cannot be renamed (nor
                // copied): end them and wait until they are gone.
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
                loop {
                    let sessions: i64 = sqlx::query_scalar(
                        "SELECT COUNT(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = $1",
                    )
                    .bind(&building)
                    .fetch_one(&mut admin)
                    .await
                    .expect("count the template's sessions");
                    if sessions == 0 {
                        break;
                    }
                    assert!(
                        std::time::Instant::now() < deadline,
                        "the template {building} still has {sessions} session(s) after 10 s"
                    );
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                }
                sqlx::query(&format!("ALTER DATABASE {building} RENAME TO {name}"))
                    .execute(&mut admin)
                    .await
                    .expect("name the template");
            }
            name
        })
        .await
}

/// The migrated SQLite file every SQLite test database is a copy of (see
/// [`postgres_template`]): migrated once per schema into a file of this
/// process, written out whole with `VACUUM INTO` and renamed into place
/// (atomic; two processes racing write the same schema).
async fn sqlite_template() -> &'static std::path::Path {
    static TEMPLATE: tokio::sync::OnceCell<PathBuf> = tokio::sync::OnceCell::const_new();
    TEMPLATE
        .get_or_init(|| async {
            let dir = std::env::temp_dir();
            let path = dir.join(format!(
                "cobro-template-{}.db",
                migrations_fingerprint("sqlite")
            ));
            if path.exists() {
                return path;
            }
            let scratch = dir.join(format!("cobro-template-build-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&scratch);
            std::fs::create_dir_all(&scratch).expect("template scratch dir");
            let store = Store::connect(&StoreConfig::new(format!(
                "sqlite://{}",
                scratch.join("build.db").display()
            )))
            .await
            .expect("connect the template");
            store.migrate().await.expect("migrate the template");
            store.close().await;
            let mut c = sqlx::SqliteConnection::connect(&format!(
                "sqlite://{}",
                scratch.join("build.db").display()
            ))
            .await
            .expect("open the built template");
            let whole = scratch.join("template.db");
            sqlx::query("VACUUM INTO ?")
                .bind(whole.display().to_string())
                .execute(&mut c)
                .await
                .expect("write the template out");
            c.close().await.expect("close the built template");
            std::fs::rename(&whole, &path).expect("put the template in place");
            let _ = std::fs::remove_dir_all(&scratch);
            path
        })
        .await
}

impl Drop for TestDb {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.keep_for_inspection();
            return;
        }
        match &self.cleanup {
            Cleanup::Lent => {}
            Cleanup::Sqlite { dir } => {
                let _ = std::fs::remove_dir_all(dir);
            }
            Cleanup::Postgres { admin_url, name } => {
                // Drop runs outside any runtime guarantee (and possibly while
                // panicking), so use a private thread and runtime.
                let (admin_url, name) = (admin_url.clone(), name.clone());
                let _ = std::thread::spawn(move || {
                    let rt = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .expect("runtime");
                    rt.block_on(async move {
                        if let Ok(mut admin) = sqlx::PgConnection::connect(&admin_url).await {
                            let _ = sqlx::query(&format!(
                                "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
                            ))
                            .execute(&mut admin)
                            .await;
                        }
                    });
                })
                .join();
            }
        }
    }
}

impl TestDb {
    /// A failing test keeps its database: SQLite's file is moved to
    /// `target/test-failures/<name>/`; a PostgreSQL database is dumped
    /// there with `pg_dump` (from `PG_BIN`, which ops/test.sh exports) and
    /// left in the throwaway cluster until the suite ends. The path is
    /// printed.
    fn keep_for_inspection(&self) {
        let dir = failure_dir();
        match &self.cleanup {
            Cleanup::Lent => {}
            Cleanup::Sqlite { dir: db } => {
                let name = db.file_name().map(|n| n.to_owned()).unwrap_or_default();
                let kept = dir.join(name);
                let moved = std::fs::rename(db, &kept).is_ok();
                eprintln!(
                    "test failed: its SQLite database is kept at {}",
                    if moved { kept.display() } else { db.display() }
                );
            }
            Cleanup::Postgres { name, .. } => {
                let dump = dir.join(format!("{name}.sql"));
                let pg_dump = std::env::var("PG_BIN")
                    .map(|bin| std::path::Path::new(&bin).join("pg_dump"))
                    .unwrap_or_else(|_| "pg_dump".into());
                let dumped = std::process::Command::new(pg_dump)
                    .arg("--dbname")
                    .arg(&self.url)
                    .arg("--file")
                    .arg(&dump)
                    .status()
                    .is_ok_and(|s| s.success());
                if dumped {
                    eprintln!(
                        "test failed: its PostgreSQL database {name} is dumped to {}",
                        dump.display()
                    );
                } else {
                    eprintln!(
                        "test failed: its PostgreSQL database {name} is kept ({})",
                        self.url
                    );
                }
            }
        }
    }
}

impl TestDb {
    /// A handle on this same database and its store (the same pool), for
    /// one short run of a test that runs many (the explorer's seeds):
    /// dropping it leaves the database to this owner, which
    /// [`wipe`](Self::wipe)s it for the next. Sharing the pool keeps its
    /// connections (and PostgreSQL's backends, with their parsed
    /// statements) from one run to the next; the borrower must end every
    /// task of its run before the wipe, so nothing of one run can write
    /// into the next.
    pub fn lend(&self) -> TestDb {
        TestDb {
            store: self.store.clone(),
            url: self.url.clone(),
            cleanup: Cleanup::Lent,
        }
    }

    /// Deletes every row of every table; the schema, its triggers and the
    /// migration history stay. Foreign keys and triggers are off for the
    /// deleting connection only (PostgreSQL: `session_replication_role`,
    /// the tests' superuser; SQLite: `foreign_keys`).
    pub async fn wipe(&self) {
        if self.url.starts_with("postgres") {
            let mut c = sqlx::PgConnection::connect(&self.url)
                .await
                .expect("connect");
            let tables: Vec<String> = sqlx::query_scalar(
                "SELECT tablename::text FROM pg_tables \
                 WHERE schemaname = current_schema() AND tablename <> '_sqlx_migrations'",
            )
            .fetch_all(&mut c)
            .await
            .expect("list tables");
            let mut sql = String::from("SET session_replication_role = replica;");
            for table in tables {
                sql.push_str(&format!("DELETE FROM {table};"));
            }
            sqlx::raw_sql(&sql).execute(&mut c).await.expect("wipe");
        } else {
            let mut c = sqlx::SqliteConnection::connect(&self.url)
                .await
                .expect("connect");
            let tables: Vec<String> = sqlx::query_scalar(
                "SELECT name FROM sqlite_master WHERE type = 'table' \
                 AND name NOT LIKE 'sqlite_%' AND name <> '_sqlx_migrations'",
            )
            .fetch_all(&mut c)
            .await
            .expect("list tables");
            let mut sql = String::from("PRAGMA foreign_keys = OFF; BEGIN;");
            for table in tables {
                sql.push_str(&format!("DELETE FROM {table};"));
            }
            sql.push_str("COMMIT;");
            sqlx::raw_sql(&sql).execute(&mut c).await.expect("wipe");
        }
    }
}

/// A client for the tests' own plain-HTTP servers: no CA roots loaded
/// (reading the platform's costs milliseconds per client, and the explorer
/// makes several clients per seed).
pub fn plain_http_client() -> reqwest::Client {
    reqwest::Client::builder()
        .tls_certs_only(std::iter::empty())
        .build()
        .expect("a reqwest client with no TLS roots always builds")
}

/// Where the tests' event endpoints are: plain http on 127.0.0.1, which
/// production refuses (`cobro_core::egress`). Every test app, dispatcher
/// and `Site` process allows exactly this, explicitly; a test of the
/// refusal itself serves the app with `ApiSettings::default()`.
pub fn local_endpoints() -> cobro_core::egress::EgressPolicy {
    cobro_core::egress::EgressPolicy {
        allow_http: true,
        allow: vec![cobro_core::egress::AllowEntry::Network(
            "127.0.0.1/32".parse().expect("a network"),
        )],
    }
}

/// The API settings of every test app: the defaults, with event
/// endpoints on 127.0.0.1 allowed ([`local_endpoints`]).
pub fn test_api_settings() -> cobro_api::ApiSettings {
    cobro_api::ApiSettings {
        event_endpoints: local_endpoints(),
        ..Default::default()
    }
}

/// A books window of every creation time a fake provider can have given
/// (its clock and a rig's are not the same clock).
pub const ALL_TIME: (i64, i64) = (0, 4_000_000_000);

/// A fixed starting instant for tests that drive a manual clock.
pub fn t0() -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2026, 11, 30, 12, 0, 0)
        .single()
        .expect("valid instant")
}

/// Generates one `#[tokio::test]` per backend for each listed async test
/// function taking a `Backend`: the conformance-suite pattern.
#[macro_export]
macro_rules! on_both_backends {
    ($($test:ident),+ $(,)?) => {
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $test() {
                    super::$test($crate::Backend::Postgres).await;
                }
            )+
        }
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $test() {
                    super::$test($crate::Backend::Sqlite).await;
                }
            )+
        }
    };
}

/// Generates one `#[tokio::test]` per backend and provider dialect for each
/// listed async test function taking a `Backend` and a `Dialect`:
/// `postgres::fake::<test>`, `postgres::stripe::<test>`, `sqlite::...`.
/// One body, both connectors: a behaviour the worker, the reconciler or
/// the webhooks prove on the fake's API is proven on the Stripe connector
/// too (against the fake's Stripe dialect, the same engine and ledger).
#[macro_export]
macro_rules! on_every_provider {
    ($($test:ident),+ $(,)?) => {
        $crate::on_every_provider!(@backend postgres, Postgres, $($test),+);
        $crate::on_every_provider!(@backend sqlite, Sqlite, $($test),+);
    };
    (@backend $module:ident, $backend:ident, $($test:ident),+) => {
        mod $module {
            $crate::on_every_provider!(@dialect fake, Fake, $backend, $($test),+);
            $crate::on_every_provider!(@dialect stripe, Stripe, $backend, $($test),+);
        }
    };
    (@dialect $module:ident, $dialect:ident, $backend:ident, $($test:ident),+) => {
        mod $module {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $test() {
                    super::super::$test($crate::Backend::$backend, $crate::Dialect::$dialect)
                        .await;
                }
            )+
        }
    };
}

/// Generates one `#[tokio::test]` per provider dialect for each listed
/// async test function taking a `Dialect`: `fake::<test>` and
/// `stripe::<test>`. For process-level tests whose store is fixed (the
/// crash tests, on PostgreSQL): a [`site::Site`] built with the dialect
/// gives its `cobro` processes the fake's own API or a providers file
/// naming a `stripe` provider at the fake's Stripe dialect.
#[macro_export]
macro_rules! on_every_dialect {
    ($($test:ident),+ $(,)?) => {
        $crate::on_every_dialect!(@dialect fake, Fake, $($test),+);
        $crate::on_every_dialect!(@dialect stripe, Stripe, $($test),+);
    };
    (@dialect $module:ident, $dialect:ident, $($test:ident),+) => {
        mod $module {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $test() {
                    super::$test($crate::Dialect::$dialect).await;
                }
            )+
        }
    };
}

impl TestDb {
    /// A new account named `name` and an API token for it, made at `now`.
    pub async fn new_account(
        &self,
        name: &str,
        now: DateTime<Utc>,
    ) -> (cobro_core::AccountId, String) {
        let account = self.store.create_account(name, now).await.expect("account");
        let token = format!("test_{}", uuid::Uuid::new_v4().simple());
        self.store
            .create_token(account, "test", &cobro_api::token_hash(&token), now)
            .await
            .expect("token");
        (account, token)
    }

    /// Runs one SQL statement directly, for arranging states the API has no
    /// endpoint for yet (a test's "given").
    pub async fn exec(&self, sql: &str) {
        if self.url.starts_with("postgres") {
            let mut c = sqlx::PgConnection::connect(&self.url)
                .await
                .expect("connect");
            sqlx::query(sql).execute(&mut c).await.expect("exec");
        } else {
            let mut c = sqlx::SqliteConnection::connect(&self.url)
                .await
                .expect("connect");
            sqlx::query(sql).execute(&mut c).await.expect("exec");
        }
    }

    /// PostgreSQL: `VACUUM ANALYZE` of `tables`, with autovacuum off on them
    /// first, so the statistics stay those of now while a test adds rows
    /// (plan tests: an autovacuum that analyzed the backlog made a count
    /// planned as a sequential scan, once in CI).
    pub async fn freeze_statistics(&self, tables: &[&str]) {
        for table in tables {
            self.exec(&format!(
                "ALTER TABLE {table} SET (autovacuum_enabled = false)"
            ))
            .await;
        }
        self.exec(&format!("VACUUM ANALYZE {}", tables.join(", ")))
            .await;
    }

    /// Stores `value`, which cobro never writes, in `column` of the attempts
    /// of the payment for `order_ref`: an attempt that cannot be read back.
    pub async fn corrupt_attempts_of(&self, order_ref: &str, column: &str, value: &str) {
        self.exec(&format!(
            "UPDATE attempts SET {column} = '{value}' \
             WHERE payment_id = (SELECT id FROM payments WHERE order_ref = '{order_ref}')"
        ))
        .await;
    }

    /// `SELECT COUNT(*) FROM <from_where>`: counting rows is how API tests
    /// assert effects before a provider is involved.
    pub async fn count(&self, from_where: &str) -> i64 {
        self.scalar(&format!("SELECT COUNT(*) FROM {from_where}"))
            .await
    }

    /// The one value `sql` selects (one row, one column), on either backend.
    /// Write SQL both dialects read: `CAST(x AS BIGINT)` for an `INTEGER`
    /// column read as `i64` (PostgreSQL's is 4 bytes), `CAST(x AS TEXT)`
    /// for ids and times, [`now_sql`](Self::now_sql) for the time now.
    pub async fn scalar<T: Scalar>(&self, sql: &str) -> T {
        if self.url.starts_with("postgres") {
            let mut c = sqlx::PgConnection::connect(&self.url)
                .await
                .expect("connect");
            sqlx::query_scalar(sql)
                .fetch_one(&mut c)
                .await
                .unwrap_or_else(|e| panic!("{sql}: {e}"))
        } else {
            let mut c = sqlx::SqliteConnection::connect(&self.url)
                .await
                .expect("connect");
            sqlx::query_scalar(sql)
                .fetch_one(&mut c)
                .await
                .unwrap_or_else(|e| panic!("{sql}: {e}"))
        }
    }

    /// The SQL for "now" comparable with the stored times of this backend
    /// (SQLite stores RFC 3339 text, compared as text to millisecond
    /// precision here).
    pub fn now_sql(&self) -> &'static str {
        if self.url.starts_with("postgres") {
            "now()"
        } else {
            "strftime('%Y-%m-%dT%H:%M:%fZ', 'now')"
        }
    }
}

/// A value [`TestDb::scalar`] can read from either backend.
pub trait Scalar:
    Send
    + Unpin
    + for<'r> sqlx::Decode<'r, sqlx::Postgres>
    + sqlx::Type<sqlx::Postgres>
    + for<'r> sqlx::Decode<'r, sqlx::Sqlite>
    + sqlx::Type<sqlx::Sqlite>
{
}

impl<T> Scalar for T where
    T: Send
        + Unpin
        + for<'r> sqlx::Decode<'r, sqlx::Postgres>
        + sqlx::Type<sqlx::Postgres>
        + for<'r> sqlx::Decode<'r, sqlx::Sqlite>
        + sqlx::Type<sqlx::Sqlite>
{
}

/// cobro's HTTP API served on a random port over a fresh database, with a
/// manual clock, one account and its token.
pub struct TestApp {
    pub url: String,
    pub client: reqwest::Client,
    pub token: String,
    pub account: cobro_core::AccountId,
    pub clock: cobro_core::ManualClock,
    pub db: TestDb,
    pub state: cobro_api::AppState,
    server: tokio::task::JoinHandle<()>,
}

/// Serves `router` the way `cobro serve` does (`cobro_api::server`, with its
/// default bounds) until the task is aborted.
async fn serve_api(listener: tokio::net::TcpListener, router: axum::Router) {
    let (_running, stop) = tokio::sync::watch::channel(false);
    cobro_api::server::serve(listener, router, cobro_api::server::Limits::default(), stop).await;
}

impl TestApp {
    pub async fn spawn(backend: Backend) -> Self {
        Self::spawn_on(TestDb::new(backend).await).await
    }

    /// The app over an existing database (e.g. one [`TestDb::lend`]s).
    pub async fn spawn_on(db: TestDb) -> Self {
        let clock = cobro_core::ManualClock::new(t0());
        let state = cobro_api::AppState::new(
            db.store.clone(),
            std::sync::Arc::new(clock.clone()),
            test_api_settings(),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        let router = cobro_api::router(state.clone());
        let server = tokio::spawn(serve_api(listener, router));
        let mut app = TestApp {
            url,
            client: plain_http_client(),
            token: String::new(),
            account: cobro_core::AccountId::new(),
            clock,
            db,
            state,
            server,
        };
        let (account, token) = app.new_account("merchant").await;
        app.account = account;
        app.token = token;
        app
    }

    /// A new account and a token for it.
    pub async fn new_account(&self, name: &str) -> (cobro_core::AccountId, String) {
        self.db.new_account(name, t0()).await
    }

    /// A POST with this app's token and the given key (None: no header).
    pub fn post(&self, path: &str, key: Option<&str>) -> reqwest::RequestBuilder {
        self.post_as(&self.token, path, key)
    }

    pub fn post_as(&self, token: &str, path: &str, key: Option<&str>) -> reqwest::RequestBuilder {
        let mut req = self
            .client
            .post(format!("{}{path}", self.url))
            .bearer_auth(token)
            .header("content-type", "application/json");
        if let Some(key) = key {
            req = req.header("idempotency-key", key);
        }
        req
    }

    pub fn get(&self, path: &str) -> reqwest::RequestBuilder {
        self.get_as(&self.token, path)
    }

    /// `GET path` as the account of `token`, as JSON.
    pub async fn get_json_as(&self, token: &str, path: &str) -> serde_json::Value {
        self.get_as(token, path)
            .send()
            .await
            .expect("get")
            .json()
            .await
            .expect("json")
    }

    pub fn get_as(&self, token: &str, path: &str) -> reqwest::RequestBuilder {
        self.client
            .get(format!("{}{path}", self.url))
            .bearer_auth(token)
    }
}

impl TestApp {
    /// Stops the server and waits until it has stopped. A request handler
    /// already running finishes on its own task (the API runs each on one):
    /// await every request first.
    pub async fn shutdown(mut self) {
        self.server.abort();
        let _ = (&mut self.server).await;
    }
}

impl Drop for TestApp {
    fn drop(&mut self) {
        self.server.abort();
    }
}

/// A payment for the store's own tests (1999 EUR, automatic capture).
/// One run of `reconciler` over every candidate, not a dry run.
pub async fn run_once<P: cobro_provider::Provider>(
    reconciler: &cobro_reconciler::Reconciler<P>,
) -> cobro_reconciler::Summary {
    reconciler
        .run(
            &cobro_reconciler::Scope::default(),
            false,
            "test",
            &|_, _| {},
        )
        .await
        .expect("reconcile")
}

pub fn new_payment(account: cobro_core::AccountId, order: &str) -> cobro_store::NewPayment {
    let order_ref = cobro_core::OrderRef::parse(order).expect("order ref");
    cobro_store::NewPayment {
        id: cobro_core::PaymentId::new(),
        account,
        intent: cobro_core::IntentName::new(&order_ref, cobro_core::Operation::Authorize, 1),
        order_ref,
        amount: 1999,
        currency: cobro_core::Currency::parse("EUR").expect("EUR"),
        capture_method: cobro_core::CaptureMethod::Automatic,
        payment_method: "pm_card_visa".into(),
        description: None,
        metadata: "{}".into(),
        return_url: None,
        provider: None,
        route: None,
    }
}

/// A valid create-payment body for `order_ref`.
pub fn payment_body(order_ref: &str) -> serde_json::Value {
    serde_json::json!({
        "order_ref": order_ref, "amount": 1999, "currency": "EUR",
        "payment_method": "pm_card_visa",
    })
}

/// Which of the fake provider's two APIs a [`Rig`] drives: its own
/// (`/v1/charges`, through [`cobro_provider::HttpProvider`]) or its Stripe
/// dialect (`/v1/payment_intents`, through
/// [`cobro_provider::StripeProvider`], the connector that drives Stripe).
/// Both reach the same engine, ledger, faults and clock, so one test body
/// proves a behaviour for both connectors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dialect {
    Fake,
    Stripe,
}

impl Dialect {
    /// The `{provider}` of `/v1/webhooks/{provider}` this dialect's events
    /// are delivered to.
    pub fn webhook_provider(self) -> &'static str {
        match self {
            Dialect::Fake => "fake",
            Dialect::Stripe => "stripe",
        }
    }

    /// How the provider's id of cobro's charge starts: the fake's charge
    /// (`ch_`) or Stripe's PaymentIntent (`pi_`).
    pub fn charge_prefix(self) -> &'static str {
        match self {
            Dialect::Fake => "ch_",
            Dialect::Stripe => "pi_",
        }
    }
}

/// The secret key the rig's connectors send (the fake's caller identity;
/// Stripe's key shape for the Stripe dialect).
pub const RIG_SECRET_KEY: &str = "sk_test_cobro";

/// How a [`Rig`] reaches its provider, whatever the dialect: what tests
/// adjust (a dead port, a short timeout).
#[derive(Clone, Debug)]
pub struct ProviderClient {
    /// The fake provider's URL (both dialects are served on it).
    pub base_url: String,
    /// After it the outcome of a call is unknown.
    pub request_timeout: std::time::Duration,
}

impl ProviderClient {
    /// The connector for `dialect` with these settings.
    pub fn connector(&self, dialect: Dialect) -> cobro_provider::Connector {
        match dialect {
            Dialect::Fake => {
                let mut config =
                    cobro_provider::HttpProviderConfig::new(&self.base_url, RIG_SECRET_KEY);
                config.request_timeout = self.request_timeout;
                cobro_provider::HttpProvider::new(config)
                    .expect("fake client")
                    .into()
            }
            Dialect::Stripe => {
                let mut config = cobro_provider::StripeConfig::new(
                    &self.base_url,
                    cobro_provider::StripeSecretKey::new(RIG_SECRET_KEY),
                );
                config.request_timeout = self.request_timeout;
                cobro_provider::StripeProvider::new(config)
                    .expect("stripe client")
                    .into()
            }
        }
    }
}

/// cobro's API and an outbox worker over one fresh database and one manual
/// clock, with the fake provider running in-process on a random port: the
/// provider's ledger is the judge. The worker (and [`Rig::reconciler`])
/// speak the rig's [`Dialect`].
pub struct Rig {
    pub app: TestApp,
    pub provider: fake_provider::Running,
    pub worker: std::sync::Arc<cobro_worker::Worker<cobro_provider::Connector>>,
    pub dialect: Dialect,
    /// Where and how the worker reaches its provider: a second worker or a
    /// reconciler of this rig goes to the same place.
    pub client: ProviderClient,
}

impl Rig {
    /// A rig of the fake's own API.
    pub async fn new(backend: Backend) -> Self {
        Self::with(backend, |_, _| {}).await
    }

    /// A rig speaking `dialect`.
    pub async fn new_in(backend: Backend, dialect: Dialect) -> Self {
        Self::with_in(backend, dialect, |_, _| {}).await
    }

    /// A rig (the fake's own API) whose provider client and worker
    /// settings `tweak` may adjust.
    pub async fn with(
        backend: Backend,
        tweak: impl FnOnce(&mut ProviderClient, &mut cobro_worker::WorkerConfig),
    ) -> Self {
        Self::with_in(backend, Dialect::Fake, tweak).await
    }

    /// A rig speaking `dialect` whose provider client and worker settings
    /// `tweak` may adjust.
    pub async fn with_in(
        backend: Backend,
        dialect: Dialect,
        tweak: impl FnOnce(&mut ProviderClient, &mut cobro_worker::WorkerConfig),
    ) -> Self {
        Self::on_in(TestApp::spawn(backend).await, dialect, tweak).await
    }

    /// A rig (the fake's own API) around an app already spawned (on a lent
    /// database, say).
    pub async fn on(
        app: TestApp,
        tweak: impl FnOnce(&mut ProviderClient, &mut cobro_worker::WorkerConfig),
    ) -> Self {
        Self::on_in(app, Dialect::Fake, tweak).await
    }

    /// A rig speaking `dialect` around an app already spawned.
    pub async fn on_in(
        app: TestApp,
        dialect: Dialect,
        tweak: impl FnOnce(&mut ProviderClient, &mut cobro_worker::WorkerConfig),
    ) -> Self {
        let provider = fake_provider::Config {
            admin: true,
            ..Default::default()
        };
        Self::on_provider(app, dialect, provider, tweak).await
    }

    /// A rig speaking `dialect` around an app already spawned, whose fake
    /// provider starts with `provider` (its key retention, say).
    pub async fn on_provider(
        app: TestApp,
        dialect: Dialect,
        provider: fake_provider::Config,
        tweak: impl FnOnce(&mut ProviderClient, &mut cobro_worker::WorkerConfig),
    ) -> Self {
        // The provider's clock starts where cobro's manual clock is, as
        // two real hosts' clocks agree (within the reconciler's skew).
        let provider = fake_provider::Config {
            clock_start: provider
                .clock_start
                .or_else(|| Some(cobro_core::Clock::now(&app.clock))),
            ..provider
        };
        let provider = fake_provider::start(provider)
            .await
            .expect("start fake provider");
        let mut client = ProviderClient {
            base_url: provider.url(),
            request_timeout: std::time::Duration::from_secs(2),
        };
        let mut config = cobro_worker::WorkerConfig {
            backoff_base: std::time::Duration::from_millis(100),
            backoff_cap: std::time::Duration::from_secs(1),
            ..Default::default()
        };
        tweak(&mut client, &mut config);
        let worker = std::sync::Arc::new(cobro_worker::Worker::new(
            app.db.store.clone(),
            std::sync::Arc::new(client.connector(dialect)),
            std::sync::Arc::new(app.clock.clone()),
            config,
            app.state.work_available.clone(),
        ));
        Rig {
            app,
            provider,
            worker,
            dialect,
            client,
        }
    }

    /// Stops the provider (its webhook delivery included) and the app, and
    /// waits for both.
    pub async fn shutdown(self) {
        let Rig { app, provider, .. } = self;
        provider.shutdown().await;
        app.shutdown().await;
    }

    /// A connector of this rig's dialect to where its worker sends, for a
    /// second worker or a reconciler.
    pub fn connector(&self) -> cobro_provider::Connector {
        self.client.connector(self.dialect)
    }

    /// The ledger's charge for cobro's `provider_ref` (a fake charge id, or
    /// a Stripe-dialect PaymentIntent id mapped to the charge its
    /// confirmation made).
    pub fn ledger_charge(&self, provider_ref: &str) -> Option<fake_provider::LedgerCharge> {
        let ledger = self.ledger();
        ledger
            .charge(provider_ref)
            .or_else(|| ledger.charge_of_payment_intent(provider_ref))
            .cloned()
    }

    pub fn ledger(&self) -> fake_provider::Ledger {
        self.provider.control().ledger()
    }

    /// The books of this rig's store as the scheduler builds them, listing
    /// through `connector` ([`Rig::connector`], or another provider's).
    pub fn books(
        &self,
        connector: cobro_provider::Connector,
    ) -> cobro_reconciler::books::Books<cobro_provider::Connector> {
        cobro_reconciler::books::Books::new(
            self.app.db.store.clone(),
            std::sync::Arc::new(connector),
            std::sync::Arc::new(self.app.clock.clone()),
            cobro_reconciler::books::BooksConfig {
                provider: "fake".into(),
                is_default: true,
                clock_skew: std::time::Duration::from_secs(10),
                request_timeout: std::time::Duration::from_secs(10),
                overlap: std::time::Duration::from_secs(600),
                settle_delay: std::time::Duration::from_secs(120),
                first_window: std::time::Duration::from_secs(24 * 3600),
                actor: "books:test".into(),
            },
        )
    }

    /// Runs the worker until no row is due now, at most `rounds` batches.
    pub async fn drain(&self, rounds: usize) -> Vec<cobro_worker::Step> {
        let mut steps = Vec::new();
        for _ in 0..rounds {
            let batch = self.worker.run_once().await.expect("worker round");
            if batch.is_empty() {
                break;
            }
            steps.extend(batch);
        }
        steps
    }

    /// POSTs `body` to `/v1/webhooks/fake` signed with `secret` at the
    /// app's clock, as the fake provider sends its events.
    pub async fn post_fake_event(
        &self,
        secret: &str,
        body: Vec<u8>,
    ) -> reqwest::Result<reqwest::Response> {
        let t = cobro_core::Clock::now(&self.app.clock).timestamp();
        self.app
            .client
            .post(format!("{}/v1/webhooks/fake", self.app.url))
            .header("content-type", "application/json")
            .header(
                fake_provider::SIGNATURE_HEADER,
                fake_provider::sign(secret, t, &body),
            )
            .body(body)
            .send()
            .await
    }

    /// Creates a payment through the API and returns its JSON.
    pub async fn create_payment(&self, key: &str, body: &serde_json::Value) -> serde_json::Value {
        let r = self
            .app
            .post("/v1/payments", Some(key))
            .json(body)
            .send()
            .await
            .expect("send");
        assert_eq!(r.status().as_u16(), 201, "create payment");
        r.json().await.expect("json")
    }

    /// POSTs `body` to `path` through the API under idempotency key `key`;
    /// the answer's JSON, which must be a success (2xx).
    pub async fn post_ok(
        &self,
        path: &str,
        key: &str,
        body: serde_json::Value,
    ) -> serde_json::Value {
        let r = self
            .app
            .post(path, Some(key))
            .json(&body)
            .send()
            .await
            .expect("send");
        assert!(r.status().is_success(), "{path}: {}", r.status());
        r.json().await.expect("json")
    }

    pub async fn payment(&self, id: &str) -> serde_json::Value {
        self.get_json(&format!("/v1/payments/{id}")).await
    }

    /// `GET path` with the rig's token, as JSON.
    pub async fn get_json(&self, path: &str) -> serde_json::Value {
        self.app.get_json_as(&self.app.token, path).await
    }

    /// Moves cobro's clock past the provider key window (23 h and a
    /// minute) and runs the worker, which hands the unknown attempts over
    /// to the reconciler.
    pub async fn pass_the_key_window(&self) {
        self.app
            .clock
            .advance(chrono::Duration::hours(23) + chrono::Duration::minutes(1));
        let steps = self.drain(3).await;
        assert!(steps.contains(&cobro_worker::Step::HandedOver), "{steps:?}");
    }
}

/// How many POSTs to `path` the fake provider received (of its last
/// requests kept).
pub fn posts_to(provider: &fake_provider::Running, path: &str) -> usize {
    provider
        .control()
        .requests()
        .iter()
        .filter(|r| r.method == "POST" && r.path == path)
        .count()
}

/// Polls `check` every 20 ms until it yields `Some`, and returns that; panics
/// naming `what` if `within` passes first. Tests that involve real time
/// (other processes, a real lease expiry) wait on a condition like this,
/// never on a sleep of a guessed length.
pub async fn wait_for<T>(
    what: &str,
    within: std::time::Duration,
    mut check: impl AsyncFnMut() -> Option<T>,
) -> T {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if let Some(found) = check().await {
            return found;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {within:?} waiting until {what}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

impl TestApp {
    /// Serves this app again, on a new port, with `settings` (e.g. webhook
    /// secrets): the database, the clock and the worker's wake-up stay.
    pub async fn serve_with(&mut self, settings: cobro_api::ApiSettings) {
        self.server.abort();
        let fresh = cobro_api::AppState::new(
            self.state.store.clone(),
            std::sync::Arc::clone(&self.state.clock),
            settings,
        );
        // What the settings decide is new; the wake-up the workers wait on
        // and the tokens read stay.
        self.state = cobro_api::AppState {
            rate_limiter: fresh.rate_limiter,
            settings: fresh.settings,
            routing: fresh.routing,
            ..self.state.clone()
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        self.url = format!("http://{}", listener.local_addr().expect("addr"));
        let router = cobro_api::router(self.state.clone());
        self.server = tokio::spawn(serve_api(listener, router));
    }
}

impl Rig {
    /// Makes the app accept webhooks of provider `fake` (Stripe dialect:
    /// `stripe`, `Stripe-Signature`) signed with `secret`, and aligns the app's manual clock with the provider's
    /// virtual one (which signs with its own time). With `deliver`, the
    /// provider also sends its webhooks to the app from now on.
    pub async fn accept_webhooks(&mut self, secret: &str, deliver: bool) {
        let mut settings = test_api_settings();
        let secret_value = cobro_provider::WebhookSecret::new(secret);
        let receiver = match self.dialect {
            Dialect::Fake => cobro_api::WebhookReceiver::fake(secret_value),
            Dialect::Stripe => cobro_api::WebhookReceiver::stripe(secret_value),
        };
        settings
            .webhooks
            .insert(self.dialect.webhook_provider().to_owned(), receiver);
        self.app.serve_with(settings).await;
        let control = self.provider.control();
        let gap = control.now() - cobro_core::Clock::now(&self.app.clock);
        // The provider's clock only moves forward, so move the one behind.
        match gap.to_std() {
            Ok(ahead) => self
                .app
                .clock
                .advance(chrono::Duration::from_std(ahead).expect("gap")),
            Err(_) => control.advance_clock((-gap).to_std().expect("gap")),
        }
        if deliver {
            self.point_webhooks(secret);
        }
    }

    /// Points the provider's webhooks at this app's `/v1/webhooks/fake`
    /// (Stripe dialect: Stripe's events at `/v1/webhooks/stripe`), signed
    /// with `secret` (a wrong one makes the app refuse them).
    pub fn point_webhooks(&self, secret: &str) {
        let control = self.provider.control();
        control.set_webhook_dialect(match self.dialect {
            Dialect::Fake => fake_provider::WebhookDialect::Fake,
            Dialect::Stripe => fake_provider::WebhookDialect::Stripe,
        });
        control.set_webhook(Some(fake_provider::WebhookTarget {
            url: format!(
                "{}/v1/webhooks/{}",
                self.app.url,
                self.dialect.webhook_provider()
            ),
            secret: secret.to_owned(),
        }));
    }
}

/// A valid create-payment body for `order_ref` with manual capture.
pub fn manual_payment_body(order_ref: &str) -> serde_json::Value {
    let mut body = payment_body(order_ref);
    body["capture_method"] = serde_json::json!("manual");
    body
}

/// The effects the provider made for one intent (`o-1:authorize-v1`) in
/// total: every attempt of it is sent under `{intent}/{attempt id}`, so this
/// sums those references (and the bare name, for attempts made before
/// references were unique). A Stripe-dialect object's reference in the
/// ledger is its metadata (`cobro_account=...&cobro_reference=...`): its
/// `cobro_reference` counts.
pub fn for_intent(ledger: &fake_provider::Ledger, intent: &str) -> fake_provider::Effects {
    let prefix = format!("{intent}/");
    let mut total = fake_provider::Effects::default();
    for (reference, e) in &ledger.by_reference {
        let reference = cobro_reference(reference);
        if reference == intent || reference.starts_with(&prefix) {
            total.charges += e.charges;
            total.declines += e.declines;
            total.captures += e.captures;
            total.voids += e.voids;
            total.refunds += e.refunds;
        }
    }
    total
}

/// The `cobro_reference` of a ledger reference: the reference itself (the
/// fake's API), or the value of `cobro_reference` in a Stripe-dialect
/// object's rendered metadata.
fn cobro_reference(reference: &str) -> &str {
    reference
        .split('&')
        .find_map(|pair| pair.strip_prefix("cobro_reference="))
        .unwrap_or(reference)
}

/// What cobro records as the `provider_ref` of the ledger's charge
/// `charge`: the charge's own id (the fake's API), or the Stripe dialect's
/// PaymentIntent whose confirmation made it.
pub fn provider_ref_of<'l>(ledger: &'l fake_provider::Ledger, charge: &'l str) -> &'l str {
    ledger
        .payment_intents
        .iter()
        .find(|(_, made)| *made == charge)
        .map_or(charge, |(intent, _)| intent.as_str())
}

/// The double charges the judge sees: more than one money-moving charge for
/// one intent of one account.
pub fn double_charges(ledger: &fake_provider::Ledger) -> Vec<Vec<String>> {
    ledger
        .double_charges(&["cobro_account", "cobro_intent"])
        .into_iter()
        .map(|group| group.into_iter().map(|c| c.id.clone()).collect())
        .collect()
}

impl Rig {
    /// Stops payment `id` in `needs_review` with a conflict on its first
    /// attempt, as evidence against it would: that attempt's id.
    pub async fn stop_the_line(&self, id: &str) -> cobro_core::AttemptId {
        let attempt = self.attempts(id).await.remove(0);
        let now = cobro_core::Clock::now(&self.app.clock);
        stop_the_line(&self.app.db.store, &attempt, now).await;
        assert_eq!(self.payment(id).await["status"], "needs_review");
        attempt.id
    }

    /// The attempts of a payment, oldest first.
    pub async fn attempts(&self, payment_id: &str) -> Vec<cobro_store::AttemptRow> {
        let id: cobro_core::PaymentId = payment_id.parse().expect("payment id");
        self.app
            .db
            .store
            .attempts_of_payment_any_account(id)
            .await
            .expect("attempts")
    }
}

impl Rig {
    /// A reconciler over this rig's store, provider (in the rig's dialect)
    /// and clock (actor `reconciler:test`, search lag 60 s, request timeout
    /// 2 s), adjusted by `tweak`.
    pub fn reconciler(
        &self,
        tweak: impl FnOnce(&mut cobro_reconciler::ReconcilerConfig),
    ) -> cobro_reconciler::Reconciler<cobro_provider::Connector> {
        let config = Self::reconciler_config(tweak);
        cobro_reconciler::Reconciler::new(
            self.app.db.store.clone(),
            std::sync::Arc::new(self.connector()),
            std::sync::Arc::new(self.app.clock.clone()),
            config,
        )
    }
}

impl Rig {
    /// Both clocks past the provider's search lag, then one reconciler run.
    pub async fn reconcile_past_the_search_lag(&self) {
        self.app.clock.advance(chrono::Duration::minutes(10));
        self.provider
            .control()
            .advance_clock(std::time::Duration::from_secs(600));
        self.reconcile_once().await;
    }

    /// One run of the tests' reconciler over every candidate.
    pub async fn reconcile_once(&self) -> cobro_reconciler::Summary {
        run_once(&self.reconciler(|_| {})).await
    }

    /// The tests' reconciler settings (a 2 s request timeout, the default
    /// 10 s clock skew), adjusted by `tweak`.
    pub fn reconciler_config(
        tweak: impl FnOnce(&mut cobro_reconciler::ReconcilerConfig),
    ) -> cobro_reconciler::ReconcilerConfig {
        let mut config = cobro_reconciler::ReconcilerConfig {
            actor: "reconciler:test".into(),
            request_timeout: std::time::Duration::from_secs(2),
            ..Default::default()
        };
        tweak(&mut config);
        config
    }
}

/// Fails unless `binary` exists and is newer than every source its Cargo
/// dep-info (`<binary>.d`) lists: process-level tests never run a stale
/// `cobro` (ops/test.sh builds the workspace first).
pub fn assert_fresh_binary(binary: &std::path::Path) {
    let build = "run `cargo build --workspace` first (ops/test.sh builds it)";
    assert!(binary.is_file(), "{} is missing: {build}", binary.display());
    let built = binary
        .metadata()
        .and_then(|m| m.modified())
        .unwrap_or_else(|e| panic!("{}: {e}", binary.display()));
    // Cargo writes the dep-info only for `cargo build`; a binary built for
    // tests alone has none, and then every source of the workspace counts.
    let sources = match std::fs::read_to_string(binary.with_extension("d")) {
        Ok(depinfo) => dep_info_prerequisites(&depinfo),
        Err(_) => workspace_sources(),
    };
    for source in sources {
        let changed = source
            .metadata()
            .and_then(|m| m.modified())
            .map_or(true, |at| at > built);
        assert!(
            !changed,
            "{} is older than its source {} (or the source is gone): {build}",
            binary.display(),
            source.display()
        );
    }
}

/// Every file under the workspace's source folders (crates, services, the
/// fake provider, migrations).
fn workspace_sources() -> Vec<std::path::PathBuf> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut pending: Vec<std::path::PathBuf> =
        ["crates", "services", "fake-provider", "migrations"]
            .iter()
            .map(|d| root.join(d))
            .collect();
    let mut files = Vec::new();
    while let Some(dir) = pending.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                pending.push(path);
            } else if path
                .extension()
                .is_some_and(|e| e == "rs" || e == "toml" || e == "sql")
            {
                files.push(path);
            }
        }
    }
    files
}

/// The prerequisites of the first rule of a Makefile-style dep-info file
/// (`target: a.rs b.rs`, spaces in names escaped as `\ `).
pub fn dep_info_prerequisites(depinfo: &str) -> Vec<std::path::PathBuf> {
    let first = depinfo.lines().next().unwrap_or_default();
    let Some((_, deps)) = first.split_once(": ") else {
        return Vec::new();
    };
    let mut paths = Vec::new();
    let mut current = String::new();
    let mut chars = deps.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => current.extend(chars.next()),
            ' ' => {
                if !current.is_empty() {
                    paths.push(std::path::PathBuf::from(std::mem::take(&mut current)));
                }
            }
            c => current.push(c),
        }
    }
    if !current.is_empty() {
        paths.push(std::path::PathBuf::from(current));
    }
    paths
}

/// Where a failing test keeps what it leaves behind (databases, logs):
/// `target/test-failures/`.
pub fn failure_dir() -> std::path::PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"));
    let dir = target.join("test-failures");
    let _ = std::fs::create_dir_all(&dir);
    dir
}

#[cfg(test)]
mod dep_info_tests {
    #[test]
    fn dep_info_lists_every_prerequisite_with_escaped_spaces() {
        assert_eq!(
            super::dep_info_prerequisites("/t/cobro: /a/b.rs /c/d\\ e.rs\n\n/a/b.rs:\n"),
            [
                std::path::PathBuf::from("/a/b.rs"),
                std::path::PathBuf::from("/c/d e.rs")
            ]
        );
    }
}
pub mod chaos;
pub mod fleet;
pub mod freeze;
pub mod process;
pub mod site;

/// `POST /v1/payments` with `key` and `body`, answered (any status).
pub async fn create(app: &TestApp, key: &str, body: &serde_json::Value) -> reqwest::Response {
    app.post("/v1/payments", Some(key))
        .json(body)
        .send()
        .await
        .expect("send")
}

/// Keeps a conflict on `attempt` and stops its payment's line
/// (`needs_review`), as evidence against it would.
pub async fn stop_the_line(
    store: &cobro_store::Store,
    attempt: &cobro_store::AttemptRow,
    now: chrono::DateTime<chrono::Utc>,
) {
    let mut tx = store.begin().await.expect("begin");
    cobro_settle::stop_the_line(
        &mut tx,
        Some(attempt),
        Some(attempt.payment_id),
        cobro_store::conflicts::ConflictKind::Unmatched,
        "a conflict for the operator",
        &cobro_settle::Source {
            name: "test",
            said: "{}",
        },
        now,
    )
    .await
    .expect("stop the line");
    tx.commit().await.expect("commit");
}
