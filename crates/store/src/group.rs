//! SQLite's group commit: the write transactions of one process share one
//! SQLite transaction, and so one COMMIT and one `fdatasync`.
//!
//! SQLite has one writer, and on the embedded default it was the serial
//! resource: each write transaction paid its own COMMIT, which appends every
//! page it changed to the WAL and syncs it (ops/bench/README.md, "where the
//! writer's time goes"). A new payment and the worker's claim, send mark and
//! settle are four such commits, each rewriting the same few pages at the
//! right-hand end of the tables and indexes (ids are UUIDv7).
//!
//! Here the one writer connection holds a *group*: a transaction opened with
//! `BEGIN IMMEDIATE` that several write transactions of this process join in
//! turn, each inside a savepoint:
//!
//! - **join** ([`GroupWriter::begin`]): wait for the writer (first come,
//!   first served, bounded by the lock timeout), open a group if none is
//!   open, then `SAVEPOINT`. The member has the connection to itself until
//!   it ends.
//! - **commit**: `RELEASE` the savepoint (the member's work is now part of
//!   the group), hand the writer to the next member, and wait until the
//!   group's COMMIT is durable. Only then does the caller hear "committed",
//!   so nothing is ever answered, sent or acted on before it is on disk.
//! - **rollback**, or a member dropped half-way (a cancelled request):
//!   `ROLLBACK TO` and `RELEASE` the savepoint. The rest of the group is
//!   untouched.
//! - **close**: the first member to hand the writer over spawns a closer,
//!   which queues for the writer like any member and commits the group when
//!   its turn comes. Every member already waiting when the closer queued is
//!   in the group; later arrivals open the next one while this one syncs.
//!
//! What members see of each other: a member reads the work of the members
//! before it in its group, which is not committed yet. Nothing that reads it
//! may act on it before the group commits: a member that ends with commit
//! waits for the group anyway, and one that ends with rollback waits for it
//! too whenever an earlier member released work into the group (the
//! idempotency reservation that finds a record answers from it only after
//! its rollback). If the group's COMMIT fails, every member that released
//! work into it fails with it, as a whole; none of them was answered.
//!
//! A dropped member (no commit, no rollback) is for error paths only: its
//! savepoint is undone by the next user of the writer, but its caller is
//! not told whether what it read was committed.

use crate::{Result, StoreError};
use sqlx::sqlite::{Sqlite, SqliteConnection, SqlitePool};
use sqlx::{Executor, Transaction};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;
use tokio::sync::{Mutex, OwnedMappedMutexGuard, OwnedMutexGuard, watch};

const SAVEPOINT: &str = "SAVEPOINT cobro_member";
const RELEASE: &str = "RELEASE SAVEPOINT cobro_member";
/// A savepoint rolled back stays on SQLite's stack until released; both,
/// so that the stack is empty again when the group commits.
const UNDO: &str = "ROLLBACK TO SAVEPOINT cobro_member; RELEASE SAVEPOINT cobro_member";

/// How a group ended: `None` while it is open.
type Outcome = Option<std::result::Result<(), String>>;

/// One open SQLite transaction and the members in it.
struct Group {
    tx: Transaction<'static, Sqlite>,
    /// Members that released their work into this group.
    released: u64,
    /// A member's savepoint is open: it is running, or it was dropped
    /// without ending and the next user of the writer must undo it.
    member_open: bool,
    /// A closer has been spawned for this group.
    closing: bool,
    /// Why this group can no longer commit (a savepoint that could not be
    /// released or undone): it is rolled back and its members fail.
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
    /// How long a member waits for the writer (the lock timeout).
    wait: Duration,
    /// Members waiting for the writer now (for tests that line members up).
    queued: AtomicUsize,
    /// Groups committed, and members released into them, since start.
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

/// How much grouping happened: `members` released into `groups` commits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GroupStats {
    pub groups: u64,
    pub members: u64,
}

/// A write transaction that has joined a group: the SQLite side of
/// [`crate::WriteTx`].
pub(crate) struct Member {
    guard: OwnedMappedMutexGuard<Option<Group>, Group>,
    outcome: watch::Receiver<Outcome>,
    /// The group held released work of earlier members when this one
    /// joined: what it read may not be committed yet.
    saw_others: bool,
    /// Spawns a closer if this member is dropped without ending.
    on_drop: CloseOnDrop,
}

impl GroupWriter {
    pub(crate) fn new(pool: SqlitePool, wait: Duration) -> Arc<Self> {
        Arc::new(Self {
            pool,
            slot: Arc::new(Mutex::new(None)),
            wait,
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

    /// Joins the open group (or opens one), in a task of its own: a caller
    /// cancelled while it waits cannot leave the writer half-taken; the
    /// member the task made is then dropped, and undone.
    pub(crate) async fn begin(self: &Arc<Self>) -> Result<Member> {
        let me = Arc::clone(self);
        tokio::spawn(async move { me.join().await })
            .await
            .map_err(|_| StoreError::Corrupt("the BEGIN task was lost".into()))?
    }

    async fn join(self: Arc<Self>) -> Result<Member> {
        // In a task of its own (see `begin`): never cancelled between the
        // two counts.
        self.queued.fetch_add(1, Ordering::SeqCst);
        let locked = tokio::time::timeout(self.wait, Arc::clone(&self.slot).lock_owned()).await;
        self.queued.fetch_sub(1, Ordering::SeqCst);
        // As long as sqlx's pool would have let it wait for the connection.
        let mut guard = locked.map_err(|_| StoreError::Unavailable(sqlx::Error::PoolTimedOut))?;
        self.tidy(&mut guard).await;
        if guard.is_none() {
            let tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
            *guard = Some(Group {
                tx,
                released: 0,
                member_open: false,
                closing: false,
                poisoned: None,
                outcome: watch::Sender::new(None),
            });
        }
        let Ok(mut group) = OwnedMutexGuard::try_map(guard, Option::as_mut) else {
            return Err(StoreError::Corrupt("no group after opening one".into()));
        };
        let outcome = group.outcome.subscribe();
        let saw_others = group.released > 0;
        // From here the member owns the savepoint: dropped, it is undone.
        group.member_open = true;
        let mut member = Member {
            guard: group,
            outcome,
            saw_others,
            on_drop: CloseOnDrop {
                writer: Some(Arc::clone(&self)),
            },
        };
        if let Err(e) = run(&mut member.guard.tx, SAVEPOINT).await {
            member.guard.poisoned = Some(format!("SAVEPOINT failed: {e}"));
            member.guard.member_open = false;
            return Err(e.into());
        }
        Ok(member)
    }

    /// Undoes what a dropped member left and fails a poisoned group, so
    /// that the holder of the writer finds it clean: either no group, or an
    /// open group with every earlier member ended.
    async fn tidy(&self, slot: &mut Option<Group>) {
        if let Some(group) = slot.as_mut()
            && group.member_open
        {
            match run(&mut group.tx, UNDO).await {
                Ok(_) => group.member_open = false,
                Err(e) => group.poisoned = Some(format!("undoing a dropped member failed: {e}")),
            }
        }
        if let Some(why) = slot.as_ref().and_then(|g| g.poisoned.clone())
            && let Some(group) = slot.take()
        {
            tracing::error!(reason = %why, "a SQLite write group was rolled back; its members fail");
            // Dropping the transaction rolls it back.
            let Group { tx, outcome, .. } = group;
            drop(tx);
            outcome.send_replace(Some(Err(why)));
        }
    }

    /// Commits the open group, if any: the closer's turn at the writer.
    async fn close(self: Arc<Self>) {
        let mut guard = self.slot.lock().await;
        self.tidy(&mut guard).await;
        let Some(group) = guard.take() else { return };
        let Group {
            tx,
            outcome,
            released,
            ..
        } = group;
        let result = tx.commit().await.map_err(|e| e.to_string());
        if result.is_ok() {
            self.groups.fetch_add(1, Ordering::Relaxed);
            self.members.fetch_add(released, Ordering::Relaxed);
        } else if let Err(why) = &result {
            tracing::error!(error = %why, members = released, "a SQLite write group failed to commit; its members fail");
        }
        outcome.send_replace(Some(result));
    }
}

impl Member {
    /// The connection, inside this member's savepoint.
    pub(crate) fn conn(&mut self) -> &mut SqliteConnection {
        &mut self.guard.tx
    }

    /// Releases this member's work into its group and waits until the
    /// group is committed. The release runs in a task of its own (a caller
    /// cancelled half-way cannot leave it half-done); the wait does not
    /// need to.
    pub(crate) async fn commit(self) -> Result<()> {
        let Member {
            guard,
            mut outcome,
            on_drop,
            ..
        } = self;
        tokio::spawn(async move { end(guard, on_drop, RELEASE).await })
            .await
            .map_err(|_| StoreError::Corrupt("the commit task was lost".into()))??;
        wait_for(&mut outcome).await
    }

    /// Undoes this member's work. If it may have read work of earlier
    /// members that is not committed yet, also waits for their group, and
    /// fails if it failed: what it read must not be acted on otherwise.
    pub(crate) async fn rollback(self) -> Result<()> {
        let Member {
            guard,
            mut outcome,
            on_drop,
            saw_others,
            ..
        } = self;
        tokio::spawn(async move { end(guard, on_drop, UNDO).await })
            .await
            .map_err(|_| StoreError::Corrupt("the rollback task was lost".into()))??;
        if saw_others {
            wait_for(&mut outcome).await?;
        }
        Ok(())
    }
}

/// Ends a member's savepoint with `sql` (release or undo) and hands the
/// writer on, spawning the group's closer if it has none yet.
async fn end(
    mut guard: OwnedMappedMutexGuard<Option<Group>, Group>,
    mut on_drop: CloseOnDrop,
    sql: &'static str,
) -> Result<()> {
    let ended = run(&mut guard.tx, sql).await;
    match &ended {
        Ok(_) => {
            guard.member_open = false;
            if sql == RELEASE {
                guard.released += 1;
            }
        }
        // The savepoint's state is unknown: nothing of this group may
        // commit.
        Err(e) => {
            guard.member_open = false;
            guard.poisoned = Some(format!("ending a member failed: {e}"));
        }
    }
    let spawn_closer = !std::mem::replace(&mut guard.closing, true);
    drop(guard);
    if !spawn_closer {
        on_drop.writer = None;
    }
    drop(on_drop);
    ended.map_err(Into::into)
}

/// Runs a savepoint statement (or two) on the writer's connection.
async fn run(
    conn: &mut SqliteConnection,
    sql: &'static str,
) -> std::result::Result<(), sqlx::Error> {
    conn.execute(sql).await.map(|_| ())
}

/// Waits for the group's outcome.
async fn wait_for(outcome: &mut watch::Receiver<Outcome>) -> Result<()> {
    let failed = |why: String| {
        StoreError::Unavailable(sqlx::Error::Io(std::io::Error::other(format!(
            "the SQLite write group this transaction joined did not commit: {why}"
        ))))
    };
    match outcome.wait_for(Option::is_some).await {
        Ok(ended) => match ended.as_ref() {
            Some(Ok(())) => Ok(()),
            Some(Err(why)) => Err(failed(why.clone())),
            None => Err(failed("no outcome".into())),
        },
        Err(_) => Err(failed("the group was abandoned".into())),
    }
}

/// Spawns a closer when dropped while armed (`writer` set): a member that
/// ended hands the writer on this way, and a member dropped half-way makes
/// sure its group still commits (the closer undoes the dropped savepoint
/// first). A spare closer is harmless: it commits whatever group is open
/// when its turn comes, which is always between members.
struct CloseOnDrop {
    writer: Option<Arc<GroupWriter>>,
}

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        if let Some(writer) = self.writer.take()
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            runtime.spawn(writer.close());
        }
    }
}
