//! SQLite's group commit: the write transactions of one process share one
//! SQLite transaction, and so one COMMIT and one `fdatasync`.
//!
//! SQLite has one writer, and on the embedded default it was the serial
//! resource: each write transaction paid its own COMMIT, which appends every
//! page it changed to the WAL and syncs it (ops/bench/results/bench.md, "where the
//! writer's time goes"). A new payment and the worker's claim, send mark and
//! settle are four such commits, each rewriting the same few pages at the
//! right-hand end of the tables and indexes (ids are UUIDv7).
//!
//! Here the one writer connection holds a *group*: a transaction opened with
//! `BEGIN IMMEDIATE` that the write transactions of this process join in
//! turn, each inside a savepoint of its own:
//!
//! - **join** ([`GroupWriter::begin`]): wait for the writer (first come,
//!   first served, bounded by the lock timeout), open a group if none is
//!   open, and open a savepoint. The member has the connection to itself
//!   until it ends.
//! - **commit**: leave the member's work in the group, hand the writer to
//!   the next member, and wait until the group's COMMIT is durable. Only
//!   then does the caller hear "committed", so nothing is ever answered,
//!   sent or acted on before it is on disk. (The next member releases the
//!   savepoint in its first command, saving one hand-off per member.)
//! - **rollback**, or a member dropped half-way (a cancelled request):
//!   `ROLLBACK TO` and `RELEASE` the savepoint (for a dropped one, the next
//!   user of the writer does it). The rest of the group is untouched.
//! - **close**: the first member to hand the writer over spawns a closer,
//!   which queues for the writer like any member and commits the group when
//!   its turn comes. Every member already waiting when the closer queued is
//!   in the group; later arrivals open the next group once it has synced.
//!
//! A single statement outside a transaction ([`GroupWriter::begin_statement`],
//! `on_write_pool!`) joins without a savepoint: SQLite undoes a failed
//! statement by itself, and nothing else.
//!
//! What members see of each other: a member reads the work of the members
//! before it in its group, which is not committed yet. Nothing that reads it
//! may act on it before the group commits: a member that ends with commit
//! waits for the group anyway, and one that ends with rollback waits for it
//! too whenever an earlier member released work into the group (the
//! idempotency reservation that finds a record answers from it only after
//! its rollback). A dropped member (no commit, no rollback) is for error
//! paths only: its caller is not told whether what it read was committed.
//!
//! When the group fails, every member in it fails, as a whole, and none of
//! them has been answered: a COMMIT that fails, a savepoint that cannot be
//! opened or undone, and a statement after which SQLite rolled back the
//! whole transaction by itself (SQLITE_FULL, IOERR, NOMEM: seen by the
//! connection's rollback hook, so that no later statement or savepoint can
//! run in a transaction that is not the group's). A member waits for its
//! group's outcome as long as it takes, as it would for a COMMIT of its
//! own, so it is never told "failed" for work that then commits; every lock
//! timeout it checks that a closer is on its way.

use crate::{Result, StoreError};
use sqlx::Executor;
use sqlx::pool::PoolConnection;
use sqlx::sqlite::{Sqlite, SqliteConnection, SqlitePool};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;
use tokio::sync::{Mutex, OwnedMappedMutexGuard, OwnedMutexGuard, watch};

const BEGIN: &str = "BEGIN IMMEDIATE";
const BEGIN_AND_SAVEPOINT: &str = "BEGIN IMMEDIATE; SAVEPOINT cobro_member";
const SAVEPOINT: &str = "SAVEPOINT cobro_member";
/// The last member committed into the group and left its savepoint open:
/// released here, before this member's opens, so that SQLite's sub-journal
/// (the pages a savepoint may have to restore) is emptied at every member
/// instead of growing with the group.
const RELEASE_AND_SAVEPOINT: &str = "RELEASE SAVEPOINT cobro_member; SAVEPOINT cobro_member";
/// A savepoint rolled back stays on SQLite's stack until released.
const UNDO: &str = "ROLLBACK TO SAVEPOINT cobro_member; RELEASE SAVEPOINT cobro_member";

/// How a group ended: `None` while it is open.
type Outcome = Option<std::result::Result<(), String>>;

/// One open SQLite transaction and the members in it. BEGIN, COMMIT and
/// ROLLBACK are sent as plain statements, never through sqlx's
/// `Transaction`: after SQLite rolls back by itself, sqlx's own ROLLBACK
/// would fail and leave its bookkeeping saying "in a transaction" for the
/// life of the connection.
struct Group {
    conn: PoolConnection<Sqlite>,
    /// The writer's count of whole-transaction rollbacks when this group
    /// began: any change means its transaction is gone.
    rollbacks_at_begin: u64,
    /// Members that committed into this group.
    released: u64,
    /// A single statement ran in this group: its work stays whether its
    /// caller committed or was dropped mid-statement.
    statement_ran: bool,
    /// A member's savepoint is open: it is running, or it was dropped
    /// without ending and the next user of the writer must undo it.
    member_open: bool,
    /// The innermost savepoint is a committed member's, not released yet.
    release_pending: bool,
    /// A closer has been spawned for this group.
    closing: bool,
    /// Why this group can no longer commit: it is rolled back and its
    /// members fail.
    poisoned: Option<String>,
    outcome: watch::Sender<Outcome>,
}

/// The one writer connection of a SQLite store, shared by group commit.
pub(crate) struct GroupWriter {
    /// The pool of exactly one connection that groups are opened on (and
    /// that migrations use directly, before anything else runs).
    pool: SqlitePool,
    /// The writer: the open group, if any. Whoever holds this lock may use
    /// the connection.
    slot: Arc<Mutex<Option<Group>>>,
    /// How long a member waits for the writer (the lock timeout), and how
    /// often a member waiting for its group's commit checks on the closer.
    wait: Duration,
    /// Whole-transaction rollbacks of the writer connection, counted by its
    /// rollback hook (set when the pool connects, see [`rollback_counter`]).
    rollbacks: Arc<AtomicU64>,
    /// Closers spawned that have not yet had their turn.
    closers: Arc<AtomicUsize>,
    /// Members waiting for the writer now (for tests that line members up).
    queued: AtomicUsize,
    /// Groups committed, and members committed in them, since start.
    groups: AtomicU64,
    members: AtomicU64,
}

impl std::fmt::Debug for GroupWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupWriter")
            .field("pool", &self.pool)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

/// How much grouping happened: `members` committed in `groups` commits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GroupStats {
    pub groups: u64,
    pub members: u64,
}

/// A write transaction (or statement) that has joined a group: the SQLite
/// side of [`crate::WriteTx`].
pub(crate) struct Member {
    guard: OwnedMappedMutexGuard<Option<Group>, Group>,
    outcome: watch::Receiver<Outcome>,
    writer: Arc<GroupWriter>,
    /// The group held work of earlier members when this one joined: what
    /// it read may not be committed yet.
    saw_others: bool,
    /// A savepoint of its own (a transaction), or none (one statement).
    savepoint: bool,
    /// Spawns a closer if this member is dropped without ending.
    on_drop: CloseOnDrop,
}

/// The counter a writer pool's `after_connect` hands to
/// [`count_rollbacks`], and [`GroupWriter::new`] reads.
pub(crate) fn rollback_counter() -> Arc<AtomicU64> {
    Arc::new(AtomicU64::new(0))
}

/// Sets the writer connection's rollback hook: SQLite calls it whenever a
/// whole transaction is rolled back (never for `ROLLBACK TO` a savepoint or
/// a failed statement alone), on the thread that runs the statement,
/// before the statement that caused it returns.
pub(crate) async fn count_rollbacks(
    conn: &mut SqliteConnection,
    rollbacks: Arc<AtomicU64>,
) -> std::result::Result<(), sqlx::Error> {
    conn.lock_handle().await?.set_rollback_hook(move || {
        rollbacks.fetch_add(1, Ordering::SeqCst);
    });
    Ok(())
}

impl GroupWriter {
    pub(crate) fn new(pool: SqlitePool, wait: Duration, rollbacks: Arc<AtomicU64>) -> Arc<Self> {
        Arc::new(Self {
            pool,
            slot: Arc::new(Mutex::new(None)),
            wait,
            rollbacks,
            closers: Arc::new(AtomicUsize::new(0)),
            queued: AtomicUsize::new(0),
            groups: AtomicU64::new(0),
            members: AtomicU64::new(0),
        })
    }

    /// The writer's pool, for what must not run inside a group (migrations,
    /// which manage their own transactions) and for closing.
    pub(crate) fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    pub(crate) fn stats(&self) -> GroupStats {
        GroupStats {
            groups: self.groups.load(Ordering::Relaxed),
            members: self.members.load(Ordering::Relaxed),
        }
    }

    pub(crate) fn queued(&self) -> usize {
        self.queued.load(Ordering::SeqCst)
    }

    /// Joins the open group (or opens one) with a savepoint of its own, for
    /// a transaction of several statements.
    pub(crate) async fn begin(self: &Arc<Self>) -> Result<Member> {
        self.begin_as(true).await
    }

    /// Joins the open group (or opens one) for one statement.
    pub(crate) async fn begin_statement(self: &Arc<Self>) -> Result<Member> {
        self.begin_as(false).await
    }

    /// Joins in a task of its own: a caller cancelled while it waits cannot
    /// leave the writer half-taken; the member the task made is then
    /// dropped, and undone.
    async fn begin_as(self: &Arc<Self>, savepoint: bool) -> Result<Member> {
        let me = Arc::clone(self);
        tokio::spawn(async move { me.join(savepoint).await })
            .await
            .map_err(|_| StoreError::Corrupt("the BEGIN task was lost".into()))?
    }

    async fn join(self: Arc<Self>, savepoint: bool) -> Result<Member> {
        // In a task of its own (see `begin_as`): never cancelled between
        // the two counts.
        self.queued.fetch_add(1, Ordering::SeqCst);
        let locked = tokio::time::timeout(self.wait, Arc::clone(&self.slot).lock_owned()).await;
        self.queued.fetch_sub(1, Ordering::SeqCst);
        // As long as sqlx's pool would have let it wait for the connection.
        let mut guard = locked.map_err(|_| StoreError::Unavailable(sqlx::Error::PoolTimedOut))?;
        self.tidy(&mut guard).await;
        // The first command: open the group and the savepoint together, or
        // release the last member's savepoint and open this one's together.
        let first = match guard.as_ref() {
            None => {
                *guard = Some(self.open(savepoint).await?);
                None
            }
            Some(_) if !savepoint => None,
            Some(group) if group.release_pending => Some(RELEASE_AND_SAVEPOINT),
            Some(_) => Some(SAVEPOINT),
        };
        let Ok(mut group) = OwnedMutexGuard::try_map(guard, Option::as_mut) else {
            return Err(StoreError::Corrupt("no group after opening one".into()));
        };
        let outcome = group.outcome.subscribe();
        let saw_others = group.released > 0 || group.statement_ran;
        group.statement_ran |= !savepoint;
        // From here the member owns its savepoint: dropped, it is undone.
        group.member_open = savepoint;
        let mut member = Member {
            guard: group,
            outcome,
            writer: Arc::clone(&self),
            saw_others,
            savepoint,
            on_drop: CloseOnDrop {
                writer: Some(Arc::clone(&self)),
            },
        };
        if let Some(first) = first {
            if let Err(e) = run(&mut member.guard.conn, first).await {
                member.guard.poisoned = Some(format!("opening a savepoint failed: {e}"));
                member.guard.member_open = false;
                return Err(e.into());
            }
            member.guard.release_pending = false;
        }
        Ok(member)
    }

    /// Opens a group on the writer connection.
    async fn open(&self, savepoint: bool) -> Result<Group> {
        let mut conn = self.pool.acquire().await?;
        let begin = if savepoint {
            BEGIN_AND_SAVEPOINT
        } else {
            BEGIN
        };
        if let Err(e) = run(&mut conn, begin).await {
            // The BEGIN may have run and the SAVEPOINT not.
            end_transaction(&mut conn, None).await;
            return Err(e.into());
        }
        Ok(Group {
            conn,
            rollbacks_at_begin: self.rollbacks.load(Ordering::SeqCst),
            released: 0,
            statement_ran: false,
            member_open: false,
            release_pending: false,
            closing: false,
            poisoned: None,
            outcome: watch::Sender::new(None),
        })
    }

    /// Marks the group failed if SQLite rolled its transaction back.
    fn check_alive(&self, group: &mut Group) {
        if group.poisoned.is_none()
            && self.rollbacks.load(Ordering::SeqCst) != group.rollbacks_at_begin
        {
            group.poisoned =
                Some("SQLite rolled the transaction back after a statement failed".into());
        }
    }

    /// Undoes what a dropped member left and fails a lost or poisoned
    /// group, so that the holder of the writer finds either no group or an
    /// open group, alive, with every earlier member ended.
    async fn tidy(&self, slot: &mut Option<Group>) {
        let Some(group) = slot.as_mut() else { return };
        self.check_alive(group);
        if group.member_open && group.poisoned.is_none() {
            match run(&mut group.conn, UNDO).await {
                Ok(()) => group.member_open = false,
                Err(e) => group.poisoned = Some(format!("undoing a dropped member failed: {e}")),
            }
            self.check_alive(group);
        }
        if let Some(why) = group.poisoned.clone()
            && let Some(group) = slot.take()
        {
            tracing::error!(reason = %why, members = group.released, "a SQLite write group was rolled back; its members fail");
            let Group {
                mut conn, outcome, ..
            } = group;
            end_transaction(&mut conn, None).await;
            outcome.send_replace(Some(Err(why)));
        }
    }

    /// Spawns a closer on the current runtime. It counts as alive until it
    /// has had its turn, or until its task is dropped unrun (its runtime
    /// shut down), so that a group never waits for a closer that is gone.
    fn spawn_closer(self: &Arc<Self>) {
        let turn = CloserTurn::new(&self.closers);
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(Arc::clone(self).close(turn));
        }
    }

    /// Commits the open group, if any: the closer's turn at the writer.
    async fn close(self: Arc<Self>, turn: CloserTurn) {
        let mut guard = self.slot.lock().await;
        // Counted out while it holds the writer: a member handing over
        // after this sees no closer for its group and spawns one.
        drop(turn);
        self.tidy(&mut guard).await;
        let Some(group) = guard.take() else { return };
        let Group {
            mut conn,
            outcome,
            released,
            ..
        } = group;
        let committed = run(&mut conn, "COMMIT").await;
        let result = match committed {
            Ok(()) => Ok(()),
            Err(e) => {
                // A COMMIT that failed may leave the transaction open.
                end_transaction(&mut conn, Some(&e)).await;
                tracing::error!(error = %e, members = released, "a SQLite write group failed to commit; its members fail");
                Err(e.to_string())
            }
        };
        if result.is_ok() {
            self.groups.fetch_add(1, Ordering::Relaxed);
            self.members.fetch_add(released, Ordering::Relaxed);
        }
        outcome.send_replace(Some(result));
    }
}

impl Member {
    /// The connection, inside this member's savepoint.
    pub(crate) fn conn(&mut self) -> &mut SqliteConnection {
        &mut self.guard.conn
    }

    /// Leaves this member's work in its group, hands the writer on and
    /// waits until the group is committed. Nothing is sent to SQLite here
    /// (the next member releases the savepoint), so there is no await
    /// before the hand-over: a caller cancelled before this was polled has
    /// a dropped member, undone; once polled, it has committed into the
    /// group.
    pub(crate) async fn commit(self) -> Result<()> {
        let Member {
            mut guard,
            mut outcome,
            writer,
            savepoint,
            on_drop,
            ..
        } = self;
        writer.check_alive(&mut guard);
        guard.member_open = false;
        guard.release_pending |= savepoint;
        guard.released += 1;
        hand_over(guard, on_drop);
        writer.wait_for(&mut outcome).await
    }

    /// Undoes this member's work. If it may have read work of earlier
    /// members that is not committed yet, also waits for their group, and
    /// fails if it failed: what it read must not be acted on otherwise.
    /// The undo runs in a task of its own (a caller cancelled half-way
    /// cannot leave it half-done).
    pub(crate) async fn rollback(self) -> Result<()> {
        let Member {
            mut guard,
            mut outcome,
            writer,
            saw_others,
            savepoint,
            on_drop,
        } = self;
        let undone = tokio::spawn(async move {
            let undone = if savepoint && guard.poisoned.is_none() {
                run(&mut guard.conn, UNDO).await
            } else {
                Ok(())
            };
            guard.member_open = false;
            if let Err(e) = &undone {
                // The savepoint's state is unknown: nothing of this group
                // may commit.
                guard.poisoned = Some(format!("undoing a member failed: {e}"));
            }
            if let Some(writer) = &on_drop.writer {
                writer.check_alive(&mut guard);
            }
            hand_over(guard, on_drop);
            undone
        });
        undone
            .await
            .map_err(|_| StoreError::Corrupt("the rollback task was lost".into()))??;
        if saw_others {
            writer.wait_for(&mut outcome).await?;
        }
        Ok(())
    }
}

/// Hands the writer on, spawning a closer unless one is already on its way
/// for this group.
fn hand_over(mut guard: OwnedMappedMutexGuard<Option<Group>, Group>, mut on_drop: CloseOnDrop) {
    let Some(writer) = on_drop.writer.take() else {
        return;
    };
    let closer_needed = !guard.closing || writer.closers.load(Ordering::SeqCst) == 0;
    guard.closing = true;
    drop(guard);
    if closer_needed {
        writer.spawn_closer();
    }
}

impl GroupWriter {
    /// Waits for the group's outcome, for as long as it takes, as a COMMIT
    /// of its own would have: a member is never told "failed" while its
    /// group may still commit. Every lock timeout it checks that a closer
    /// is still on its way, and spawns one if not (one lost with its
    /// runtime, or never spawned outside a runtime).
    async fn wait_for(self: &Arc<Self>, outcome: &mut watch::Receiver<Outcome>) -> Result<()> {
        let failed = |why: String| {
            StoreError::Unavailable(sqlx::Error::Io(std::io::Error::other(format!(
                "the SQLite write group this transaction joined did not commit: {why}"
            ))))
        };
        loop {
            match tokio::time::timeout(self.wait, outcome.wait_for(Option::is_some)).await {
                Ok(Ok(ended)) => {
                    return match ended.as_ref() {
                        Some(Ok(())) => Ok(()),
                        Some(Err(why)) => Err(failed(why.clone())),
                        None => Err(failed("no outcome".into())),
                    };
                }
                Ok(Err(_)) => return Err(failed("the group was abandoned".into())),
                Err(_) => {
                    if self.closers.load(Ordering::SeqCst) == 0 {
                        tracing::warn!(
                            "a SQLite write group had no closer on its way; spawning one"
                        );
                        self.spawn_closer();
                    }
                }
            }
        }
    }
}

/// Ends whatever transaction the connection is in (after a failed BEGIN,
/// COMMIT or a lost group). "No transaction is active" is fine; any other
/// failure leaves the connection in a state nobody knows, so it is closed
/// instead of going back to the pool.
async fn end_transaction(conn: &mut PoolConnection<Sqlite>, why: Option<&sqlx::Error>) {
    if let Err(e) = run(conn, "ROLLBACK").await
        && !e.to_string().contains("no transaction is active")
    {
        tracing::error!(error = %e, cause = ?why.map(ToString::to_string), "the SQLite writer connection could not roll back; it is closed");
        conn.close_on_drop();
    }
}

/// Runs a statement (or two) of the group's own on the writer connection.
async fn run(
    conn: &mut SqliteConnection,
    sql: &'static str,
) -> std::result::Result<(), sqlx::Error> {
    conn.execute(sql).await.map(|_| ())
}

/// Spawns a closer when dropped while armed (`writer` set): a member
/// dropped half-way makes sure its group still commits (the closer undoes
/// the dropped savepoint first). A spare closer is harmless: it commits
/// whatever group is open when its turn comes, which is always between
/// members.
struct CloseOnDrop {
    writer: Option<Arc<GroupWriter>>,
}

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        if let Some(writer) = self.writer.take() {
            writer.spawn_closer();
        }
    }
}

/// A closer counted as on its way, until dropped.
struct CloserTurn(Arc<AtomicUsize>);

impl CloserTurn {
    fn new(closers: &Arc<AtomicUsize>) -> Self {
        closers.fetch_add(1, Ordering::SeqCst);
        Self(Arc::clone(closers))
    }
}

impl Drop for CloserTurn {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}
