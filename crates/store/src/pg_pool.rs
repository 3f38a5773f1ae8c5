//! PostgreSQL's connection pool: `deadpool` managing sqlx's own
//! `PgConnection`s, and the transactions opened on them.
//!
//! **Why not sqlx's pool.** sqlx 0.8's pool pings every connection it takes
//! back (`sqlx-core` `pool/connection.rs`, `return_to_pool`; not
//! configurable): one more round trip per checkout, a `Sync` and its
//! `ReadyForQuery`, on every GET, replay and new payment, and four times
//! per attempt in the worker. Side by side, that ping cost about a quarter
//! of GET throughput (ops/bench/results/bench.md). Here a connection that
//! is in sync with its server goes back at once and nothing is sent when it
//! is taken out again (as with sqlx's `test_before_acquire(false)`): a
//! statement is one round trip, as in pgbench.
//!
//! **What the ping was for, kept.** Its other purpose is to settle a
//! connection left mid-exchange before anyone else gets it: above all a
//! transaction dropped open, whose `ROLLBACK` sqlx only queues. A
//! [`PgConn`] knows whether it is in sync: it is after a statement run
//! through the pool ([`PgPool`] as an `Executor`) read its answer to the
//! end, and after a transaction's `COMMIT` or `ROLLBACK` did; any other use
//! of the connection (`DerefMut`), a cancelled statement, a statement that
//! failed or a transaction still open leaves it unsettled. An unsettled
//! connection is not handed back as it is: a task queues the `ROLLBACK` of
//! a transaction still open, then sends `Sync` and reads up to its
//! `ReadyForQuery` (sqlx's `ping`), which sends what is queued and drains
//! any late answer; only then does the connection go back to the pool. So
//! a dropped transaction ends, and its row locks go, before the pool hands
//! the connection out again, never when someone next uses it; and a
//! cancelled statement's late answer is never read as the next one's
//! (sqlx also drains it before every statement). A connection whose ping
//! fails, or that is dropped where no runtime can settle it, is closed and
//! leaves the pool. Proven by
//! `store_conformance::postgres_a_connection_given_back_mid_transaction_is_rolled_back_at_once`.
//!
//! **What it does not do.** Nothing proves an idle connection alive before
//! use: a connection whose server went away while it sat in the pool fails
//! its next statement, which cobro reports as `Unavailable` (503,
//! retryable), and is then closed on its way back (its ping fails).
//!
//! **Nothing waits for ever on a dead socket.** sqlx 0.8 sets no TCP
//! keepalive and no read timeout on its sockets, and offers no way to: a
//! server that stops answering without closing the connection (a frozen
//! primary, a partition, a failover behind a moved address) would leave a
//! statement waiting until the kernel gives up, which on a read with nothing
//! in flight is never. So every round trip this module makes (each
//! statement run through the pool or a [`PgTx`], each `BEGIN`, `COMMIT`,
//! `ROLLBACK` and settling ping) has a deadline, [`PgPool::deadline`]: past
//! it the caller gets an I/O error (`TimedOut`, which cobro answers 503,
//! retryable) and the connection is closed, never pinged or reused: what
//! it had sent may still reach the server, and sqlx would not know its
//! state (a `BEGIN` cut short reaches the server, and sqlx, which counts a
//! transaction only once its `BEGIN` was answered, would hand out a
//! connection inside a transaction). A `BEGIN` that fails for any reason
//! closes its connection likewise. Connecting is bounded by the acquire
//! timeout. A `COMMIT` cut by its deadline has an unknown
//! outcome, like one whose connection died: the caller must treat it as
//! such (cobro's API answers 503 and the same key replays or executes
//! once). The deadline is the client's alone (`StoreConfig::deadline`):
//! closing the socket leaves the server's work as it is, and in particular
//! never cuts short a `COMMIT`'s wait for its synchronous standby.

use deadpool::managed::{self, Metrics, Object, PoolError, RecycleError, RecycleResult};
use futures_core::future::BoxFuture;
use futures_core::stream::BoxStream;
use futures_util::TryStreamExt;
use sqlx::postgres::{
    PgConnectOptions, PgConnection, PgQueryResult, PgRow, PgStatement, PgTypeInfo,
};
use sqlx::{
    ConnectOptions, Connection, Database, Describe, Either, Execute, Executor, Postgres,
    TransactionManager as _,
};
use std::future::Future;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::time::Duration;

type TransactionManager = <Postgres as Database>::TransactionManager;

/// sqlx's pool's defaults, kept: a connection lives at most 30 minutes, and
/// one not taken out for 10 minutes is replaced when next taken.
const MAX_LIFETIME: Duration = Duration::from_secs(30 * 60);
const IDLE_TIMEOUT: Duration = Duration::from_secs(10 * 60);

/// Makes connections with cobro's options; takes them back as they are.
#[derive(Debug)]
struct Manager {
    options: PgConnectOptions,
}

impl managed::Manager for Manager {
    type Type = PgConnection;
    type Error = sqlx::Error;

    async fn create(&self) -> Result<PgConnection, sqlx::Error> {
        self.options.connect().await
    }

    /// No round trip: a connection is settled before it goes back (module
    /// doc). Only its age is checked, as sqlx's pool did by default (cobro
    /// set neither): one older than [`MAX_LIFETIME`], or not taken out for
    /// [`IDLE_TIMEOUT`], is closed and another one taken or opened.
    async fn recycle(&self, _: &mut PgConnection, metrics: &Metrics) -> RecycleResult<sqlx::Error> {
        if metrics.age() > MAX_LIFETIME || metrics.last_used() > IDLE_TIMEOUT {
            return Err(RecycleError::message("too old or idle too long"));
        }
        Ok(())
    }
}

/// A pool of PostgreSQL connections (module doc). Cheap to clone. Runs
/// statements as sqlx's pool does (`.execute(&pool)`, `.fetch_one(&pool)`).
#[derive(Clone)]
pub struct PgPool {
    inner: managed::Pool<Manager>,
    acquire_timeout: Duration,
    deadline: Duration,
    /// `true` once [`PgPool::close`] was called.
    closed: Arc<tokio::sync::watch::Sender<bool>>,
}

impl std::fmt::Debug for PgPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgPool")
            .field("status", &self.inner.status())
            .field("acquire_timeout", &self.acquire_timeout)
            .field("deadline", &self.deadline)
            .finish()
    }
}

impl PgPool {
    /// A pool of at most `max_connections`, none opened yet. Taking a
    /// connection (waiting for one to be free, or opening one) gives up
    /// after `acquire_timeout` with `sqlx::Error::PoolTimedOut`; each round
    /// trip on a connection after `deadline` (module doc).
    pub fn new(
        options: PgConnectOptions,
        max_connections: u32,
        acquire_timeout: Duration,
        deadline: Duration,
    ) -> Self {
        let inner = managed::Pool::builder(Manager { options })
            .max_size(max_connections as usize)
            .build()
            .expect("a pool without a runtime-bound timeout always builds");
        Self {
            inner,
            acquire_timeout,
            deadline,
            closed: Arc::new(tokio::sync::watch::Sender::new(false)),
        }
    }

    /// Like [`PgPool::new`], and opens one connection now, so that a bad URL
    /// or an unreachable server fails here.
    pub async fn connect(
        options: PgConnectOptions,
        max_connections: u32,
        acquire_timeout: Duration,
        deadline: Duration,
    ) -> Result<Self, sqlx::Error> {
        let pool = Self::new(options, max_connections, acquire_timeout, deadline);
        pool.acquire().await?;
        Ok(pool)
    }

    /// The longest any one round trip on this pool's connections may take.
    pub fn deadline(&self) -> Duration {
        self.deadline
    }

    /// The options every connection is opened with.
    pub fn connect_options(&self) -> &PgConnectOptions {
        &self.inner.manager().options
    }

    /// Takes a connection: an idle one as it is (nothing sent), or a new
    /// one while the pool is below its size.
    pub async fn acquire(&self) -> Result<PgConn, sqlx::Error> {
        let object = match tokio::time::timeout(self.acquire_timeout, self.inner.get()).await {
            Err(_) => return Err(sqlx::Error::PoolTimedOut),
            Ok(Err(PoolError::Backend(e))) => return Err(e),
            Ok(Err(PoolError::Timeout(_))) => return Err(sqlx::Error::PoolTimedOut),
            Ok(Err(_)) => return Err(sqlx::Error::PoolClosed),
            Ok(Ok(object)) => object,
        };
        Ok(PgConn {
            object: Some(object),
            settled: true,
            broken: false,
            deadline: self.deadline,
        })
    }

    /// Opens a transaction (`BEGIN`) on a connection of its own. A
    /// connection whose `BEGIN` failed is closed, never reused (module doc).
    pub async fn begin(&self) -> Result<PgTx, sqlx::Error> {
        let mut conn = self.acquire().await?;
        let begun = within(self.deadline, TransactionManager::begin(&mut *conn, None)).await;
        conn.broken |= begun.is_err();
        begun?;
        Ok(PgTx { conn })
    }

    /// Closes the idle connections (with PostgreSQL's `Terminate`) and
    /// refuses new checkouts; a connection in use is closed when it comes
    /// back.
    pub async fn close(&self) {
        self.closed.send_replace(true);
        let idle = self.inner.retain(|_, _| false).removed;
        self.inner.close();
        for conn in idle {
            let _ = conn.close().await;
        }
    }

    pub fn is_closed(&self) -> bool {
        *self.closed.borrow()
    }

    /// Resolves once [`PgPool::close`] has been called.
    pub async fn close_event(&self) {
        let mut closed = self.closed.subscribe();
        let _ = closed.wait_for(|closed| *closed).await;
    }
}

/// A connection taken from a [`PgPool`]. Dropped, it goes back to the pool
/// at once if it is settled, and otherwise once settled (module doc).
pub struct PgConn {
    object: Option<Object<Manager>>,
    /// In sync with the server and outside any transaction, as far as this
    /// module has seen.
    settled: bool,
    /// Given up on (a deadline passed, a `BEGIN` failed): closed when
    /// dropped, never settled or reused.
    broken: bool,
    /// The pool's [`PgPool::deadline`].
    deadline: Duration,
}

impl PgConn {
    /// Notes a round trip's result: one that met its deadline leaves the
    /// connection given up on.
    fn note<T>(&mut self, result: &Result<T, sqlx::Error>) {
        self.broken |= matches!(result, Err(e) if met_deadline(e));
    }
}

/// The error [`within`] gives when its deadline passed (or the kernel's
/// own timeout, which means as much).
fn met_deadline(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Io(io) if io.kind() == std::io::ErrorKind::TimedOut)
}

impl Deref for PgConn {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        self.object.as_ref().expect("a connection until dropped")
    }
}

impl DerefMut for PgConn {
    /// Any use may leave the connection mid-exchange: it is settled again
    /// only by this module, once it has seen the use end.
    fn deref_mut(&mut self) -> &mut PgConnection {
        self.settled = false;
        self.object.as_mut().expect("a connection until dropped")
    }
}

impl Drop for PgConn {
    fn drop(&mut self) {
        let Some(mut object) = self.object.take() else {
            return;
        };
        if self.broken {
            drop(Object::take(object));
            return;
        }
        if object.is_in_transaction() {
            // Queues the ROLLBACK (sent below): as sqlx's `Transaction` does.
            TransactionManager::start_rollback(&mut *object);
            self.settled = false;
        }
        if self.settled {
            return; // back to the pool, nothing sent
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            // Nobody can settle it: it must not be handed out as it is.
            drop(Object::take(object));
            return;
        };
        let deadline = self.deadline;
        runtime.spawn(async move {
            // Sends what is queued, then reads up to the last ReadyForQuery;
            // a server that does not answer in time is given up on.
            if within(deadline, object.ping()).await.is_err() {
                drop(Object::take(object));
            }
        });
    }
}

/// An open transaction on a connection of its own. Dropped without
/// [`PgTx::commit`] or [`PgTx::rollback`], it is rolled back before its
/// connection goes back to the pool. Statements run on it as on sqlx's
/// connection (`.execute(&mut tx)`), each within the pool's deadline.
pub struct PgTx {
    conn: PgConn,
}

impl std::fmt::Debug for PgTx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgTx").finish_non_exhaustive()
    }
}

impl PgTx {
    /// A `COMMIT` past the deadline fails with an unknown outcome: it may
    /// have committed (module doc).
    pub async fn commit(mut self) -> Result<(), sqlx::Error> {
        within(
            self.conn.deadline,
            TransactionManager::commit(&mut *self.conn),
        )
        .await?;
        self.conn.settled = true;
        Ok(())
    }

    pub async fn rollback(mut self) -> Result<(), sqlx::Error> {
        within(
            self.conn.deadline,
            TransactionManager::rollback(&mut *self.conn),
        )
        .await?;
        self.conn.settled = true;
        Ok(())
    }
}

/// `work`'s result, or an I/O `TimedOut` error once `deadline` has passed
/// without it (module doc).
pub(crate) async fn within<T>(
    deadline: Duration,
    work: impl Future<Output = Result<T, sqlx::Error>>,
) -> Result<T, sqlx::Error> {
    match tokio::time::timeout(deadline, work).await {
        Ok(result) => result,
        Err(_) => Err(sqlx::Error::Io(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("no answer from PostgreSQL within {deadline:?}"),
        ))),
    }
}

/// Every answer of `query` on `conn`, each awaited within the deadline
/// (a connection that met it is given up on).
fn answers_within<'e, 'q: 'e, E>(
    conn: &'e mut PgConn,
    query: E,
) -> BoxStream<'e, Result<Either<PgQueryResult, PgRow>, sqlx::Error>>
where
    E: 'q + Execute<'q, Postgres>,
{
    Box::pin(async_stream::try_stream! {
        let deadline = conn.deadline;
        let mut failed = None;
        {
            let mut answers = (&mut **conn).fetch_many(query);
            loop {
                match within(deadline, answers.try_next()).await {
                    Ok(Some(answer)) => yield answer,
                    Ok(None) => break,
                    Err(e) => {
                        failed = Some(e);
                        break;
                    }
                }
            }
        }
        if let Some(e) = failed {
            conn.broken |= met_deadline(&e);
            Err(e)?;
        }
    })
}

/// `work` (a round trip on `conn`) within `conn`'s deadline, noting on
/// `conn` whether it met it.
macro_rules! on_conn {
    ($conn:expr, $work:ident ( $($arg:expr),* )) => {{
        let deadline = $conn.deadline;
        let done = within(deadline, (&mut *$conn).$work($($arg),*)).await;
        $conn.note(&done);
        done
    }};
}

/// One statement in the transaction, as on sqlx's own connection, within
/// the deadline. A statement that fails or times out leaves the
/// connection unsettled: it is settled (or closed) when the transaction
/// is dropped.
impl<'c> Executor<'c> for &'c mut PgTx {
    type Database = Postgres;

    fn fetch_many<'e, 'q: 'e, E>(
        self,
        query: E,
    ) -> BoxStream<'e, Result<Either<PgQueryResult, PgRow>, sqlx::Error>>
    where
        'c: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        answers_within(&mut self.conn, query)
    }

    fn fetch_optional<'e, 'q: 'e, E>(
        self,
        query: E,
    ) -> BoxFuture<'e, Result<Option<PgRow>, sqlx::Error>>
    where
        'c: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        Box::pin(async move { on_conn!(self.conn, fetch_optional(query)) })
    }

    fn prepare_with<'e, 'q: 'e>(
        self,
        sql: &'q str,
        parameters: &'e [PgTypeInfo],
    ) -> BoxFuture<'e, Result<PgStatement<'q>, sqlx::Error>>
    where
        'c: 'e,
    {
        Box::pin(async move { on_conn!(self.conn, prepare_with(sql, parameters)) })
    }

    fn describe<'e, 'q: 'e>(
        self,
        sql: &'q str,
    ) -> BoxFuture<'e, Result<Describe<Postgres>, sqlx::Error>>
    where
        'c: 'e,
    {
        Box::pin(async move { on_conn!(self.conn, describe(sql)) })
    }
}

/// One statement on a connection of the pool, which goes back settled
/// once the statement's answer has been read to the end (sqlx's
/// `impl Executor for &Pool`, with [`PgConn`] in place of sqlx's
/// pooled connection).
impl<'p> Executor<'p> for &'_ PgPool {
    type Database = Postgres;

    fn fetch_many<'e, 'q: 'e, E>(
        self,
        query: E,
    ) -> BoxStream<'e, Result<Either<PgQueryResult, PgRow>, sqlx::Error>>
    where
        E: 'q + Execute<'q, Postgres>,
    {
        let pool = self.clone();
        Box::pin(async_stream::try_stream! {
            let mut conn = pool.acquire().await?;
            {
                let mut answers = answers_within(&mut conn, query);
                while let Some(answer) = answers.try_next().await? {
                    yield answer;
                }
            }
            conn.settled = true;
        })
    }

    fn fetch_optional<'e, 'q: 'e, E>(
        self,
        query: E,
    ) -> BoxFuture<'e, Result<Option<PgRow>, sqlx::Error>>
    where
        E: 'q + Execute<'q, Postgres>,
    {
        let pool = self.clone();
        Box::pin(async move {
            let mut conn = pool.acquire().await?;
            let row = on_conn!(conn, fetch_optional(query))?;
            conn.settled = true;
            Ok(row)
        })
    }

    fn prepare_with<'e, 'q: 'e>(
        self,
        sql: &'q str,
        parameters: &'e [PgTypeInfo],
    ) -> BoxFuture<'e, Result<PgStatement<'q>, sqlx::Error>> {
        let pool = self.clone();
        Box::pin(async move {
            let mut conn = pool.acquire().await?;
            let statement = on_conn!(conn, prepare_with(sql, parameters))?;
            conn.settled = true;
            Ok(statement)
        })
    }

    fn describe<'e, 'q: 'e>(
        self,
        sql: &'q str,
    ) -> BoxFuture<'e, Result<Describe<Postgres>, sqlx::Error>> {
        let pool = self.clone();
        Box::pin(async move {
            let mut conn = pool.acquire().await?;
            let described = on_conn!(conn, describe(sql))?;
            conn.settled = true;
            Ok(described)
        })
    }
}
