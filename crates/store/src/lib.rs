#![doc = include_str!("../README.md")]

pub mod accounts;
pub mod audit;
pub mod books;
pub mod conflicts;
mod db_types;
pub mod events;
mod group;
pub mod idempotency;
pub mod observe;
pub mod outbox;
pub mod payments;
pub mod pg_pool;
pub mod purge;
pub mod reconcile;
pub mod routing;
pub mod settle;
pub mod webhooks;

pub use db_types::{DbId, DbTime};
pub use group::GroupStats;
pub use idempotency::{KeyScope, Reservation, StoredRecord};
pub use outbox::{Claim, Claimed, NewAttempt, ProviderScope, SendMark, UnreadableClaim};
pub use payments::{AttemptRow, NewPayment, NewRefund, PaymentFilter, PaymentRow, RefundRow};

use pg_pool::{PgPool, PgTx};
use sqlx::migrate::Migrator;
use sqlx::postgres::PgConnectOptions;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

static POSTGRES_MIGRATIONS: Migrator = sqlx::migrate!("../../migrations/postgres");
static SQLITE_MIGRATIONS: Migrator = sqlx::migrate!("../../migrations/sqlite");

/// Everything that can go wrong in the store, in terms its callers act on.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// A lock (PostgreSQL `lock_timeout`) or the SQLite write lock (busy
    /// timeout) was not granted in time: someone else holds the row or the
    /// database. Nothing was written; retrying later is safe.
    #[error("timed out waiting for a lock held by a concurrent transaction")]
    Busy,
    /// The database could not be reached or gave no connection in time.
    #[error("the database is unavailable")]
    Unavailable(#[source] sqlx::Error),
    /// A unique constraint refused a write. `what` names the constraint
    /// (PostgreSQL) or the columns (SQLite).
    #[error("unique constraint violated: {what}")]
    UniqueViolation { what: String },
    /// The schema refused to make an attempt sendable because its payment
    /// or refund is `requires_reconciliation` or `needs_review`
    /// (`cobro_send_blocked`). The refused statement wrote nothing; what
    /// the transaction wrote before it stays until the caller rolls back
    /// (on SQLite that includes the intent `open_intent` inserts in the
    /// same command as the refused attempt).
    #[error("no new send while the payment is under reconciliation or review")]
    SendBlocked,
    /// The schema in the database is newer than this binary knows.
    #[error(
        "the database schema is at version {found}, newer than this binary's {known}; run a newer cobro"
    )]
    SchemaNewer { found: i64, known: i64 },
    /// The database has not been migrated to this binary's schema.
    #[error(
        "the database schema is at version {found}, this binary needs {known}: run `cobro migrate`"
    )]
    SchemaBehind { found: i64, known: i64 },
    #[error("invalid database URL: {0}")]
    InvalidUrl(String),
    #[error("a stored value could not be read back: {0}")]
    Corrupt(String),
    #[error("migration failed")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("database error")]
    Database(#[source] sqlx::Error),
}

impl From<sqlx::Error> for StoreError {
    fn from(e: sqlx::Error) -> Self {
        use sqlx::error::ErrorKind;
        match &e {
            sqlx::Error::Database(db) => {
                let code = db.code().unwrap_or_default();
                // 55P03 lock_not_available (lock_timeout); SQLite BUSY (5) and
                // LOCKED (6) with every extended code of theirs (the low
                // byte: BUSY_RECOVERY 261, BUSY_SNAPSHOT 517, BUSY_TIMEOUT
                // 773, LOCKED_SHAREDCACHE 262...).
                let sqlite_busy = code.parse::<i64>().is_ok_and(|c| matches!(c & 0xff, 5 | 6));
                if code == "55P03" || sqlite_busy {
                    return StoreError::Busy;
                }
                if server_unavailable(&code) {
                    return StoreError::Unavailable(e);
                }
                if code == "CB001" || db.message().contains("cobro_send_blocked") {
                    return StoreError::SendBlocked;
                }
                if db.kind() == ErrorKind::UniqueViolation {
                    let what = db
                        .constraint()
                        .map(str::to_owned)
                        .unwrap_or_else(|| db.message().to_owned());
                    return StoreError::UniqueViolation { what };
                }
                StoreError::Database(e)
            }
            sqlx::Error::PoolTimedOut
            | sqlx::Error::PoolClosed
            | sqlx::Error::Io(_)
            | sqlx::Error::Tls(_)
            | sqlx::Error::Protocol(_) => StoreError::Unavailable(e),
            // A stored value that is no known variant (a status cobro never
            // writes): the row is unreadable, never read as a default.
            sqlx::Error::ColumnDecode { .. } => StoreError::Corrupt(e.to_string()),
            _ => StoreError::Database(e),
        }
    }
}

/// SQLSTATEs by which a PostgreSQL server says it cannot serve this
/// connection now, not that the statement was wrong: what a failover
/// answers (ops/ha/README.md). The statement's transaction is rolled back
/// (or, for a COMMIT the server never answered, unknown, as with a cut
/// connection); a retry with the same key replays or executes once.
/// - `08...` connection exception;
/// - `57P01` admin_shutdown: a switchover's fast shutdown, or
///   `pg_terminate_backend`, ends the connection;
/// - `57P02` crash_shutdown: another backend crashed (the postmaster's
///   SIGKILL recovery);
/// - `57P03` cannot_connect_now: the server is starting or stopping;
/// - `25006` read_only_sql_transaction: the connection reached a standby
///   (a demoted primary, or a router that has not noticed yet);
/// - `53300` too_many_connections.
///
/// Before this, all of them were `Database` and answered 500.
fn server_unavailable(code: &str) -> bool {
    // 25P03: the server ended a session left idle in a transaction
    // (IDLE_IN_TRANSACTION_TIMEOUT), a process that froze mid-transaction.
    code.starts_with("08")
        || matches!(
            code,
            "57P01" | "57P02" | "57P03" | "25006" | "25P03" | "53300"
        )
}

pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// An attempt that a multi-row read found but could not decode (a stored
/// value that is no known variant): its plain columns still name it, so the
/// caller can report it and go on with the other rows. One bad row fails
/// only itself, never its batch or page.
#[derive(Debug)]
pub struct UnreadableAttempt {
    pub id: cobro_core::AttemptId,
    pub payment_id: cobro_core::PaymentId,
    /// Why it could not be read (`Corrupt`).
    pub error: StoreError,
}

/// Decodes one attempt-shaped row (`T` flattens the attempt's columns),
/// turning a decode failure into an [`UnreadableAttempt`]. Its `id` and
/// `payment_id` must still decode: without them the row cannot even be
/// named, and the whole read fails strictly.
pub(crate) fn decode_attempt<'r, R, T>(row: &'r R) -> Result<Result<T, UnreadableAttempt>>
where
    R: sqlx::Row,
    T: sqlx::FromRow<'r, R>,
    cobro_core::AttemptId: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    cobro_core::PaymentId: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    &'static str: sqlx::ColumnIndex<R>,
{
    match T::from_row(row) {
        Ok(decoded) => Ok(Ok(decoded)),
        Err(e) => Ok(Err(UnreadableAttempt {
            id: row.try_get("id")?,
            payment_id: row.try_get("payment_id")?,
            error: e.into(),
        })),
    }
}

/// `'a', 'b'` for a `WHERE ... IN (...)` over the domain's own names (the
/// constants of `cobro_core`, never user text), so a list such as
/// `PaymentStatus::UNSETTLED` is written once and the SQL literal matches
/// the partial index's predicate, which PostgreSQL needs to use the index.
pub(crate) fn sql_names<'a>(names: impl IntoIterator<Item = &'a str>) -> String {
    names
        .into_iter()
        .map(|n| format!("'{n}'"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// How to reach the database.
#[derive(Clone, Debug)]
pub struct StoreConfig {
    /// `postgres://...` or `sqlite://path` (created if missing).
    pub url: String,
    /// Pool size. PostgreSQL on 2 cores peaks around 8 to 16 connections.
    pub max_connections: u32,
    /// How long a transaction waits for a lock held by another (the
    /// idempotency decision table bounds this at about 2 s).
    pub lock_timeout: Duration,
    /// How long a request waits for a pooled connection (PostgreSQL:
    /// connecting included).
    pub acquire_timeout: Duration,
    /// PostgreSQL: the longest cobro waits for any one answer of the
    /// server (a statement's, a `COMMIT`'s, connecting aside), so that a
    /// server that stops answering without closing the connection (a frozen
    /// primary, a partition) fails a request instead of holding it for ever
    /// (src/pg_pool.rs). Client-side only: the server is never asked to
    /// cancel anything (no `statement_timeout`), because a cancelled
    /// `COMMIT` that waits for its synchronous standby commits locally,
    /// unreplicated, and is then seen by everyone (docs/high-availability.md).
    /// Migrations run without it.
    pub deadline: Duration,
}

/// PostgreSQL's `idle_in_transaction_session_timeout` on cobro's
/// connections: cobro never holds a transaction open across anything slow
/// (no network call inside one), so a session idle in a transaction this
/// long belongs to a process that froze or lost its network while holding
/// row locks. The server ends it and the locks go.
pub const IDLE_IN_TRANSACTION_TIMEOUT: Duration = Duration::from_secs(60);

impl StoreConfig {
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            max_connections: 10,
            lock_timeout: Duration::from_secs(2),
            acquire_timeout: Duration::from_secs(5),
            deadline: Duration::from_secs(10),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    Postgres,
    Sqlite,
}

#[derive(Clone, Debug)]
enum Backend {
    Postgres(PgPool),
    Sqlite(SqlitePools),
}

/// SQLite's connections: readers beside one writer.
///
/// SQLite has one write lock per database. With every connection free to
/// write, the writers of one process met at that lock and the losers
/// waited in SQLite's busy handler, which polls with sleeps growing to
/// 100 ms: a waiter could sleep through many releases while newcomers took
/// the lock, so under load some requests waited a second or more (p99
/// 1.1 s at 16 clients, ops/bench/results/bench.md) and the lock sat idle while
/// its waiters slept. Here every write (each `begin`, and the few
/// single-statement writes, through [`on_write_pool!`]) goes through one
/// connection, first come, first served, and the write transactions of
/// this process commit together ([`group`]: one COMMIT and one sync for
/// all the transactions that queued while the last group ran). The busy
/// timeout still bounds the wait for another process's writer (several
/// processes may share one file). Reads (WAL snapshots) never wait for the
/// writer.
#[derive(Clone, Debug)]
struct SqlitePools {
    read: SqlitePool,
    writer: Arc<group::GroupWriter>,
}

/// The one storage API of cobro. Cheap to clone (it holds a pool).
#[derive(Clone, Debug)]
pub struct Store {
    backend: Backend,
    /// Bumped when a payment may have left `processing`: after a commit of
    /// this process that moved a payment, and (PostgreSQL) on
    /// `cobro_payment_settled` from any process. Shared by every clone.
    payment_moves: Arc<PaymentMoves>,
    /// The cross-process wake-ups this process sends after its commits.
    doorbells: Arc<Doorbells>,
}

/// Runs `$body` with `$pool` bound to the backend's pool. The body is
/// compiled once per backend, so the same SQL text serves both where the
/// dialects agree (`$n` placeholders, `RETURNING`, `ON CONFLICT`, partial
/// indexes) and each arm can differ where they do not.
///
/// A statement that writes uses [`on_write_pool!`] instead (on SQLite this
/// one is the readers' pool).
macro_rules! on_pool {
    ($store:expr, $pool:ident => $body:expr) => {
        $crate::on_pool_of!($store, read, $pool => $body)
    };
}

/// Like [`on_pool!`], for one statement that writes outside a transaction.
/// On SQLite the statement joins the writer's group (see [`SqlitePools`])
/// without a savepoint of its own: `$pool` is the writer's connection, and
/// the value is returned once the group has committed. `$body` runs one
/// statement: a second would not be undone with the first. Never while
/// this task holds a [`WriteTx`] open (on SQLite that transaction holds the
/// writer, so the statement would wait for it).
macro_rules! on_write_pool {
    ($store:expr, $pool:ident => $body:expr) => {
        match &$store.backend {
            $crate::Backend::Postgres($pool) => $body,
            $crate::Backend::Sqlite(pools) => {
                let mut member = pools.writer.begin_statement().await?;
                let value = {
                    let $pool = member.conn();
                    $body
                };
                member.commit().await?;
                value
            }
        }
    };
}

/// [`on_pool!`]: PostgreSQL's one pool, or the SQLite pool named by
/// `$which`.
macro_rules! on_pool_of {
    ($store:expr, $which:ident, $pool:ident => $body:expr) => {
        match &$store.backend {
            $crate::Backend::Postgres($pool) => $body,
            $crate::Backend::Sqlite(pools) => {
                let $pool = &pools.$which;
                $body
            }
        }
    };
}

/// Like [`on_pool!`], for an open write transaction: `$conn` is the
/// transaction's connection.
macro_rules! on_tx {
    ($tx:expr, $conn:ident => $body:expr) => {
        match &mut $tx.inner {
            $crate::TxInner::Postgres(t) => {
                let $conn = &mut *t;
                $body
            }
            $crate::TxInner::Sqlite(t) => {
                let $conn = t.conn();
                $body
            }
        }
    };
}
pub(crate) use {on_pool, on_pool_of, on_tx, on_write_pool};

enum TxInner {
    Postgres(PgTx),
    Sqlite(group::Member),
}

/// An open write transaction. Dropping it without [`WriteTx::commit`] rolls
/// it back. Hold it only for local work: never across a network call.
pub struct WriteTx {
    inner: TxInner,
    payment_moves: Arc<PaymentMoves>,
    doorbells: Arc<Doorbells>,
    /// A statement of this transaction moved a payment's status.
    moved_payment: bool,
    /// A statement of this transaction inserted an outbox row.
    enqueued_work: bool,
    /// What to do once this transaction has committed ([`WriteTx::after_commit`]).
    committed: Vec<Box<dyn FnOnce() + Send>>,
}

impl WriteTx {
    /// Commits, then wakes whoever waits for what it wrote (long polls,
    /// other processes' workers). Both run in a task of its own: a caller
    /// cancelled half-way (a client that left, a task aborted at shutdown)
    /// can never leave the connection between a COMMIT sent and its answer
    /// read, nor skip the wake-ups of a commit that happened. On SQLite it
    /// returns once the group this transaction joined is committed
    /// ([`group`]).
    pub async fn commit(self) -> Result<()> {
        let WriteTx {
            inner,
            payment_moves,
            doorbells,
            moved_payment,
            enqueued_work,
            committed,
        } = self;
        tokio::spawn(async move {
            match inner {
                TxInner::Postgres(t) => t.commit().await?,
                TxInner::Sqlite(member) => member.commit().await?,
            }
            for then in committed {
                then();
            }
            if moved_payment {
                payment_moves.bump();
                doorbells.settled.ring();
            }
            if enqueued_work {
                doorbells.outbox.ring();
            }
            Ok(())
        })
        .await
        .map_err(|_| StoreError::Corrupt("the commit task was lost".into()))?
    }

    /// Runs `then` once this transaction has committed, and never if it
    /// rolls back or fails: for what counts or logs a change as made (a
    /// metric of moves), which must not count one that was undone. It runs
    /// in the span that was current when it was registered, so its log
    /// lines keep the caller's context.
    pub fn after_commit(&mut self, then: impl FnOnce() + Send + 'static) {
        let span = tracing::Span::current();
        self.committed.push(Box::new(move || span.in_scope(then)));
    }

    /// Notes that this transaction inserted an outbox row, so that workers
    /// of other processes are woken once it commits.
    pub(crate) fn note_enqueued(&mut self) {
        self.enqueued_work = true;
    }

    /// Passes on what a status update returned, noting a moved payment so
    /// that long polls wake once this transaction commits.
    pub(crate) fn noting_move(&mut self, moved: Option<PaymentRow>) -> Option<PaymentRow> {
        self.moved_payment |= moved.is_some();
        moved
    }

    /// Rolls back. On SQLite, a transaction that may have read work of
    /// others in its group not yet committed also waits for that group,
    /// and fails if it did not commit: whatever the caller read is then
    /// safe to answer from ([`group`]).
    pub async fn rollback(self) -> Result<()> {
        match self.inner {
            TxInner::Postgres(t) => t.rollback().await?,
            TxInner::Sqlite(member) => member.rollback().await?,
        }
        Ok(())
    }

    pub fn backend(&self) -> BackendKind {
        match self.inner {
            TxInner::Postgres(_) => BackendKind::Postgres,
            TxInner::Sqlite(_) => BackendKind::Sqlite,
        }
    }

    /// ` FOR UPDATE` on PostgreSQL; nothing on SQLite, whose write
    /// transactions (`BEGIN IMMEDIATE`) already exclude every other writer.
    pub(crate) fn lock_clause(&self) -> &'static str {
        match self.inner {
            TxInner::Postgres(_) => " FOR UPDATE",
            TxInner::Sqlite(_) => "",
        }
    }
}

impl Store {
    /// Connects without touching the schema.
    pub async fn connect(config: &StoreConfig) -> Result<Self> {
        let url = config.url.as_str();
        let backend = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            let millis = |d: Duration| format!("{}ms", d.as_millis());
            let options = PgConnectOptions::from_str(url)
                .map_err(|e| StoreError::InvalidUrl(e.to_string()))?
                // On the connection, not per transaction: no extra round trip
                // on the hot path. No statement of cobro should ever wait
                // longer than the first for a lock; the second frees a
                // frozen process's row locks.
                .options([
                    ("lock_timeout", millis(config.lock_timeout)),
                    (
                        "idle_in_transaction_session_timeout",
                        millis(IDLE_IN_TRANSACTION_TIMEOUT),
                    ),
                ]);
            // deadpool over sqlx's connections, not sqlx's pool: no round
            // trip when a connection goes back or is taken out (src/pg_pool.rs).
            // A connection that died fails its first statement instead,
            // which surfaces as `Unavailable` (503, retryable), and is not
            // reused.
            let pool = PgPool::connect(
                options,
                config.max_connections,
                config.acquire_timeout,
                config.deadline,
            )
            .await?;
            Backend::Postgres(pool)
        } else if url.starts_with("sqlite:") {
            let options = SqliteConnectOptions::from_str(url)
                .map_err(|e| StoreError::InvalidUrl(e.to_string()))?
                .create_if_missing(true)
                .journal_mode(SqliteJournalMode::Wal)
                .foreign_keys(true)
                // Write transactions start with BEGIN IMMEDIATE, so this is
                // the bounded wait for another process's writer.
                .busy_timeout(config.lock_timeout);
            // No ping before a checkout (as on PostgreSQL): a hop to the
            // connection's thread and back on every statement.
            let read = SqlitePoolOptions::new()
                .max_connections(config.max_connections.min(4))
                .test_before_acquire(false)
                .acquire_timeout(config.acquire_timeout)
                .connect_with(options.clone())
                .await?;
            // This process's writers queue for the one writer connection
            // no longer than they would wait for SQLite's lock.
            // Its rollback hook tells group commit when SQLite rolled a
            // whole transaction back by itself.
            let rollbacks = group::rollback_counter();
            let counter = Arc::clone(&rollbacks);
            let write = SqlitePoolOptions::new()
                .max_connections(1)
                .test_before_acquire(false)
                .acquire_timeout(config.lock_timeout)
                .after_connect(move |conn, _| {
                    let counter = Arc::clone(&counter);
                    Box::pin(async move { group::count_rollbacks(conn, counter).await })
                })
                .connect_with(options)
                .await?;
            let writer = group::GroupWriter::new(write, config.lock_timeout, rollbacks);
            Backend::Sqlite(SqlitePools { read, writer })
        } else {
            return Err(StoreError::InvalidUrl(
                "expected postgres://... or sqlite://...".to_owned(),
            ));
        };
        let doorbells = Arc::new(Doorbells::new(&backend));
        Ok(Self {
            backend,
            payment_moves: Arc::new(PaymentMoves::default()),
            doorbells,
        })
    }

    pub fn backend(&self) -> BackendKind {
        match self.backend {
            Backend::Postgres(_) => BackendKind::Postgres,
            Backend::Sqlite(_) => BackendKind::Sqlite,
        }
    }

    /// The database's clock now: PostgreSQL's `clock_timestamp()`; for
    /// SQLite, embedded in this process, this host's own clock. The one
    /// clock every host's send times and "no effect" judgements are
    /// bounded against (docs/proof-of-absence.md, "Times").
    pub async fn database_now(&self) -> Result<chrono::DateTime<chrono::Utc>> {
        match &self.backend {
            Backend::Postgres(pool) => {
                let (now,): (DbTime,) = sqlx::query_as("SELECT clock_timestamp()")
                    .fetch_one(pool)
                    .await?;
                Ok(now.0)
            }
            Backend::Sqlite(_) => Ok(chrono::Utc::now()),
        }
    }

    fn migrator(&self) -> &'static Migrator {
        match self.backend {
            Backend::Postgres(_) => &POSTGRES_MIGRATIONS,
            Backend::Sqlite(_) => &SQLITE_MIGRATIONS,
        }
    }

    /// Applies the embedded migrations. Refuses a schema newer than this binary.
    pub async fn migrate(&self) -> Result<()> {
        self.check_not_newer().await?;
        // Migrations manage their own transactions: on SQLite they run on
        // the writer's pool directly, never inside a group.
        match &self.backend {
            // A connection taken as it is, statements run on it directly:
            // the pool's deadline does not bound a migration (one may build
            // an index over a large table); `lock_timeout` still does.
            Backend::Postgres(pool) => self.migrator().run(&mut *pool.acquire().await?).await?,
            Backend::Sqlite(pools) => self.migrator().run(pools.writer.pool()).await?,
        }
        Ok(())
    }

    /// The newest migration applied to the database (0 for an empty one).
    pub async fn schema_version(&self) -> Result<i64> {
        let sql = "SELECT COALESCE(MAX(version), 0) FROM _sqlx_migrations WHERE success";
        let found: Result<i64, sqlx::Error> =
            on_pool!(self, pool => sqlx::query_scalar(sql).fetch_one(pool).await);
        match found {
            Ok(v) => Ok(v),
            // No migrations table: a database cobro has never touched.
            Err(sqlx::Error::Database(e)) if e.message().contains("_sqlx_migrations") => Ok(0),
            Err(e) => Err(e.into()),
        }
    }

    pub fn known_schema_version(&self) -> i64 {
        self.migrator().iter().map(|m| m.version).max().unwrap_or(0)
    }

    async fn check_not_newer(&self) -> Result<i64> {
        let found = self.schema_version().await?;
        let known = self.known_schema_version();
        if found > known {
            return Err(StoreError::SchemaNewer { found, known });
        }
        Ok(found)
    }

    /// Fails unless the database is exactly at this binary's schema.
    pub async fn check_schema(&self) -> Result<()> {
        let found = self.check_not_newer().await?;
        let known = self.known_schema_version();
        if found < known {
            return Err(StoreError::SchemaBehind { found, known });
        }
        Ok(())
    }

    /// A cheap round trip, for readiness.
    pub async fn ping(&self) -> Result<()> {
        on_pool!(self, pool => sqlx::query("SELECT 1").execute(pool).await?
            .rows_affected());
        Ok(())
    }

    /// Opens a write transaction. On SQLite it joins the writer's group
    /// ([`group`]), whose transaction is `BEGIN IMMEDIATE`: the write lock
    /// is taken up front (bounded by the busy timeout), so two writers
    /// never deadlock upgrading a read lock.
    ///
    /// The BEGIN runs in a task of its own, so a caller cancelled while it
    /// waits (for a connection, for SQLite's write lock) cannot leave a
    /// pooled connection inside a transaction nobody owns (a known sqlx 0.8
    /// hazard: the BEGIN went out, the `Transaction` was never made, and the
    /// connection went back to the pool holding, on SQLite, the one write
    /// lock). The task always finishes: the transaction it made is either
    /// handed over or dropped, which rolls it back.
    pub async fn begin(&self) -> Result<WriteTx> {
        let lost = |_| StoreError::Corrupt("the BEGIN task was lost".into());
        let inner = match &self.backend {
            Backend::Postgres(pool) => {
                let pool = pool.clone();
                TxInner::Postgres(
                    tokio::spawn(async move { pool.begin().await })
                        .await
                        .map_err(lost)??,
                )
            }
            Backend::Sqlite(pools) => TxInner::Sqlite(pools.writer.begin().await?),
        };
        Ok(WriteTx {
            inner,
            payment_moves: Arc::clone(&self.payment_moves),
            doorbells: Arc::clone(&self.doorbells),
            moved_payment: false,
            enqueued_work: false,
            committed: Vec::new(),
        })
    }

    /// How many write transactions SQLite's group commit has committed in
    /// how many groups since this store was opened (`None` on PostgreSQL).
    pub fn write_groups(&self) -> Option<GroupStats> {
        match &self.backend {
            Backend::Postgres(_) => None,
            Backend::Sqlite(pools) => Some(pools.writer.stats()),
        }
    }

    /// How many write transactions are waiting for SQLite's writer now
    /// (`0` on PostgreSQL): lets a test line transactions up into one group.
    #[doc(hidden)]
    pub fn writers_queued(&self) -> usize {
        match &self.backend {
            Backend::Postgres(_) => 0,
            Backend::Sqlite(pools) => pools.writer.queued(),
        }
    }

    pub async fn close(&self) {
        match &self.backend {
            Backend::Postgres(pool) => pool.close().await,
            Backend::Sqlite(pools) => {
                pools.read.close().await;
                pools.writer.pool().close().await;
            }
        }
    }
}

/// Wake-ups for the outbox worker from other processes (PostgreSQL
/// `LISTEN cobro_outbox`). SQLite has none: its worker shares the API's
/// process and is woken in memory.
pub struct WorkSignal {
    listener: sqlx::postgres::PgListener,
    deadline: Duration,
}

impl WorkSignal {
    /// Waits for the next notification. An error means the listening
    /// connection broke (or stopped answering); the caller falls back to
    /// polling and may listen again.
    pub async fn recv(&mut self) -> Result<()> {
        next_notification(&mut self.listener, self.deadline).await?;
        Ok(())
    }
}

/// How long a listener waits for a notification before it asks its server
/// whether it is still there.
const LISTEN_PROBE: Duration = Duration::from_secs(30);

/// Waits for the next notification on `listener`. A listener's connection
/// only ever reads, so a server that froze or vanished without closing it
/// (a partition, a failover behind a moved address) would leave it waiting
/// for ever: after [`LISTEN_PROBE`] without a notification it sends a
/// `SELECT 1`, which must be answered within `deadline`, or this fails and
/// the caller listens anew on a fresh connection.
async fn next_notification(
    listener: &mut sqlx::postgres::PgListener,
    deadline: Duration,
) -> std::result::Result<(), sqlx::Error> {
    loop {
        if let Ok(received) = tokio::time::timeout(LISTEN_PROBE, listener.recv()).await {
            return received.map(drop);
        }
        pg_pool::within(deadline, sqlx::query("SELECT 1").execute(&mut *listener)).await?;
    }
}

/// PostgreSQL notifications to other processes, sent after the commits
/// that call for them and never inside a transaction: `cobro_outbox` wakes
/// the workers of other processes (LISTEN, `Store::listen_for_work`),
/// `cobro_payment_settled` the long polls of other API processes.
///
/// A NOTIFY inside the request's transaction (the triggers of migrations
/// 0002 and 0009, dropped by 0012) made every commit take PostgreSQL 15's
/// database-wide notify lock from pre-commit until the commit record was
/// flushed: with `synchronous_commit` on, those commits were serialised,
/// one WAL flush each, and group commit could not batch them. Here each
/// channel has one task per process that sends `SELECT pg_notify(...)` on
/// its own, at most one at a time and then no sooner than [`NOTIFY_GAP`]
/// after the last: any number of commits in between ring once. A listener
/// is woken at most one round trip plus [`NOTIFY_GAP`] after the commit
/// (workers and long polls also re-read now and then, so a notification
/// lost with a broken connection delays, never loses, work).
#[derive(Debug)]
struct Doorbells {
    outbox: Doorbell,
    settled: Doorbell,
}

/// The shortest time between two notifications of one channel from one
/// process.
const NOTIFY_GAP: Duration = Duration::from_millis(2);

impl Doorbells {
    fn new(backend: &Backend) -> Self {
        let pool = match backend {
            Backend::Postgres(pool) => Some(pool.clone()),
            // SQLite's worker shares the API's process and is woken in
            // memory; nobody else listens.
            Backend::Sqlite(_) => None,
        };
        Self {
            outbox: Doorbell::new("cobro_outbox", pool.clone()),
            settled: Doorbell::new("cobro_payment_settled", pool),
        }
    }
}

#[derive(Debug)]
struct Doorbell {
    channel: &'static str,
    pool: Option<PgPool>,
    pressed: Arc<tokio::sync::Notify>,
    started: std::sync::Once,
}

impl Doorbell {
    fn new(channel: &'static str, pool: Option<PgPool>) -> Self {
        Self {
            channel,
            pool,
            pressed: Arc::new(tokio::sync::Notify::new()),
            started: std::sync::Once::new(),
        }
    }

    /// Asks for one notification soon; rings since the last one fold into
    /// it (`Notify` keeps one permit).
    fn ring(&self) {
        let Some(pool) = &self.pool else { return };
        self.started.call_once(|| {
            let (pool, pressed, channel) = (pool.clone(), Arc::clone(&self.pressed), self.channel);
            tokio::spawn(async move {
                loop {
                    pressed.notified().await;
                    if pool.is_closed() {
                        return;
                    }
                    let sent = sqlx::query("SELECT pg_notify($1, '')")
                        .bind(channel)
                        .execute(&pool)
                        .await;
                    if let Err(e) = sent {
                        tracing::warn!(channel, error = %e, "could not notify other processes; they will poll");
                    }
                    tokio::time::sleep(NOTIFY_GAP).await;
                }
            });
        });
        self.pressed.notify_one();
    }
}

/// Wake-ups for long polls waiting for a payment to leave `processing`.
#[derive(Debug)]
struct PaymentMoves {
    generation: tokio::sync::watch::Sender<u64>,
    /// The PostgreSQL listener task has been started (once per store).
    listening: std::sync::Once,
}

impl Default for PaymentMoves {
    fn default() -> Self {
        Self {
            generation: tokio::sync::watch::Sender::new(0),
            listening: std::sync::Once::new(),
        }
    }
}

impl PaymentMoves {
    fn bump(&self) {
        self.generation.send_modify(|g| *g = g.wrapping_add(1));
    }
}

impl Store {
    /// A receiver that changes whenever a payment may have left
    /// `processing`: after a commit of this process that moved a payment,
    /// and, on PostgreSQL, when any process's commit did (LISTEN
    /// `cobro_payment_settled`, migration 0009; the listener starts with the
    /// first call and reconnects after a second when it breaks). A change
    /// says only "read again": the caller re-reads what it waits for, and
    /// still polls now and then in case the listener is down.
    pub fn payment_moves(&self) -> tokio::sync::watch::Receiver<u64> {
        if let Backend::Postgres(pool) = &self.backend {
            let (pool, moves) = (pool.clone(), Arc::clone(&self.payment_moves));
            self.payment_moves.listening.call_once(|| {
                tokio::spawn(listen_for_payment_moves(pool, moves));
            });
        }
        self.payment_moves.generation.subscribe()
    }

    /// How many long polls (receivers of [`Store::payment_moves`]) are
    /// waiting now.
    pub fn payment_move_waiters(&self) -> usize {
        self.payment_moves.generation.receiver_count()
    }

    /// Subscribes to work notifications, where the backend has them.
    pub async fn listen_for_work(&self) -> Result<Option<WorkSignal>> {
        match &self.backend {
            Backend::Postgres(pool) => {
                let mut listener =
                    sqlx::postgres::PgListener::connect_with(&listening_pool(pool)).await?;
                pg_pool::within(pool.deadline(), listener.listen("cobro_outbox")).await?;
                Ok(Some(WorkSignal {
                    listener,
                    deadline: pool.deadline(),
                }))
            }
            Backend::Sqlite(_) => Ok(None),
        }
    }
}

/// A pool of one connection of its own for a LISTEN, with the request
/// pool's settings. A listener never borrows a request connection: sqlx's
/// listener hands its connection back to the pool it came from when it is
/// dropped (after `UNLISTEN *`, in a background task), and a notification
/// already on its way then reached a request reading that connection
/// ("unexpected message: NotificationResponse", 17 requests in a failover
/// run, ops/ha/README.md).
fn listening_pool(pool: &PgPool) -> sqlx::PgPool {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect_lazy_with(pool.connect_options().clone())
}

/// Bumps `moves` on every `cobro_payment_settled` notification, for as long
/// as anyone may wait (the task ends when the pool is closed).
async fn listen_for_payment_moves(pool: PgPool, moves: Arc<PaymentMoves>) {
    while !pool.is_closed() {
        // A pool of its own each time: a listener dropped on a silent
        // server keeps its connection (sqlx's `UNLISTEN *` on drop has no
        // deadline), which must not lock the next one out.
        let own = listening_pool(&pool);
        let listening = async {
            let mut listener = sqlx::postgres::PgListener::connect_with(&own).await?;
            pg_pool::within(pool.deadline(), listener.listen("cobro_payment_settled")).await?;
            loop {
                next_notification(&mut listener, pool.deadline()).await?;
                moves.bump();
            }
        };
        let broke: std::result::Result<(), sqlx::Error> = tokio::select! {
            broke = listening => broke,
            () = pool.close_event() => break,
        };
        if let Err(e) = broke {
            tracing::warn!(error = %e, "long-poll listener lost; polling until it is back");
        }
        // Whatever was missed while reconnecting is caught by a re-read.
        moves.bump();
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    }
}
