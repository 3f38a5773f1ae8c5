//! Routing across providers (migration 0023, docs/routing.md): accounts'
//! rules, the health every process reports about each provider, each
//! provider's circuit, and the move of a payment to the next provider.

use crate::{DbId, DbTime, Result, Store, WriteTx, on_pool, on_tx, on_write_pool};
use chrono::{DateTime, Utc};
use cobro_core::{AccountId, AttemptId, PaymentId};
use uuid::Uuid;

/// What routing needs of an account: the provider it names (migration
/// 0010) and its rules, if it has any.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RoutingProfile {
    pub provider: Option<String>,
    /// The rule set (JSON text) and its version.
    pub rules: Option<(String, i64)>,
}

/// A provider's circuit as stored.
#[derive(Clone, Debug, PartialEq, Eq, sqlx::FromRow)]
pub struct CircuitRow {
    pub provider: String,
    /// `closed` or `open`.
    pub state: String,
    pub opened_at: Option<DbTime>,
    pub closed_at: Option<DbTime>,
    pub reason: Option<String>,
    pub updated_at: DbTime,
}

/// The calls of a provider over a window, every process's together.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HealthWindow {
    pub calls: i64,
    pub errors: i64,
    pub latency_ms: i64,
}

impl Store {
    /// The account's provider and rules, in one read.
    pub async fn routing_profile(&self, account: AccountId) -> Result<RoutingProfile> {
        let sql = "SELECT a.provider, r.rules, r.version FROM accounts a \
            LEFT JOIN routing_rules r ON r.account_id = a.id WHERE a.id = $1";
        let row: Option<(Option<String>, Option<String>, Option<i64>)> = on_pool!(self, pool =>
            sqlx::query_as(sql).bind(DbId::from(account)).fetch_optional(pool).await?);
        Ok(match row {
            Some((provider, rules, version)) => RoutingProfile {
                provider,
                rules: rules.zip(version),
            },
            None => RoutingProfile::default(),
        })
    }

    /// Every account's rules (JSON text), to validate at start.
    pub async fn all_routing_rules(&self) -> Result<Vec<(AccountId, String)>> {
        let sql = "SELECT account_id, rules FROM routing_rules ORDER BY account_id";
        let rows: Vec<(DbId, String)> =
            on_pool!(self, pool => sqlx::query_as(sql).fetch_all(pool).await?);
        Ok(rows
            .into_iter()
            .map(|(id, rules)| (AccountId::from_uuid(id.0), rules))
            .collect())
    }

    /// Sets (or, with `None`, removes) an account's rules, already
    /// validated, with the change's audit row in the same transaction.
    /// Answers the new version.
    pub async fn set_routing_rules(
        &self,
        account: AccountId,
        rules: Option<&str>,
        actor: &str,
        now: DateTime<Utc>,
    ) -> Result<i64> {
        let mut tx = self.begin().await?;
        let current: Option<i64> = on_tx!(tx, conn => sqlx::query_scalar(
                "SELECT version FROM routing_rules WHERE account_id = $1")
            .bind(DbId::from(account))
            .fetch_optional(&mut *conn)
            .await?);
        let version = current.unwrap_or(0) + 1;
        match rules {
            Some(rules) => {
                let sql = "INSERT INTO routing_rules (account_id, rules, version, updated_by, updated_at) \
                    VALUES ($1, $2, $3, $4, $5) ON CONFLICT (account_id) DO UPDATE SET \
                    rules = excluded.rules, version = excluded.version, \
                    updated_by = excluded.updated_by, updated_at = excluded.updated_at";
                on_tx!(tx, conn => sqlx::query(sql)
                    .bind(DbId::from(account))
                    .bind(rules)
                    .bind(version)
                    .bind(actor)
                    .bind(DbTime(now))
                    .execute(&mut *conn)
                    .await?
                    .rows_affected());
            }
            None => {
                on_tx!(tx, conn => sqlx::query("DELETE FROM routing_rules WHERE account_id = $1")
                    .bind(DbId::from(account))
                    .execute(&mut *conn)
                    .await?
                    .rows_affected());
            }
        }
        let sql = "INSERT INTO routing_changes (id, account_id, version, rules, actor, at) \
            VALUES ($1, $2, $3, $4, $5, $6)";
        on_tx!(tx, conn => sqlx::query(sql)
            .bind(DbId(uuid::Uuid::new_v4()))
            .bind(DbId::from(account))
            .bind(version)
            .bind(rules)
            .bind(actor)
            .bind(DbTime(now))
            .execute(&mut *conn)
            .await?
            .rows_affected());
        tx.commit().await?;
        Ok(version)
    }

    /// The changes of an account's rules, oldest first: (version, rules or
    /// `None` when removed, actor, when).
    pub async fn routing_changes(
        &self,
        account: AccountId,
    ) -> Result<Vec<(i64, Option<String>, String, DbTime)>> {
        let sql = "SELECT version, rules, actor, at FROM routing_changes \
            WHERE account_id = $1 ORDER BY version";
        Ok(on_pool!(self, pool => sqlx::query_as(sql)
            .bind(DbId::from(account))
            .fetch_all(pool)
            .await?))
    }

    /// Counts one call to `provider` in `owner`'s row of `bucket`: one
    /// statement, on a row no other process writes.
    pub async fn record_provider_call(
        &self,
        provider: &str,
        bucket: i64,
        owner: &str,
        error: bool,
        latency_ms: i64,
    ) -> Result<()> {
        let sql = "INSERT INTO provider_health (provider, bucket, owner, calls, errors, latency_ms) \
            VALUES ($1, $2, $3, 1, $4, $5) ON CONFLICT (provider, bucket, owner) DO UPDATE SET \
            calls = provider_health.calls + 1, errors = provider_health.errors + excluded.errors, \
            latency_ms = provider_health.latency_ms + excluded.latency_ms";
        on_write_pool!(self, pool => sqlx::query(sql)
            .bind(provider)
            .bind(bucket)
            .bind(owner)
            .bind(i64::from(error))
            .bind(latency_ms)
            .execute(pool)
            .await?
            .rows_affected());
        Ok(())
    }

    /// The calls of `provider` in buckets `from..` (every process's).
    pub async fn provider_window(&self, provider: &str, from: i64) -> Result<HealthWindow> {
        // PostgreSQL sums BIGINTs as NUMERIC: cast back.
        let sql = "SELECT CAST(COALESCE(SUM(calls), 0) AS BIGINT), \
            CAST(COALESCE(SUM(errors), 0) AS BIGINT), CAST(COALESCE(SUM(latency_ms), 0) AS BIGINT) \
            FROM provider_health WHERE provider = $1 AND bucket >= $2";
        let (calls, errors, latency_ms): (i64, i64, i64) = on_pool!(self, pool =>
            sqlx::query_as(sql).bind(provider).bind(from).fetch_one(pool).await?);
        Ok(HealthWindow {
            calls,
            errors,
            latency_ms,
        })
    }

    /// Forgets health buckets before `before` (a window never reaches
    /// back that far).
    pub async fn purge_provider_health(&self, before: i64) -> Result<u64> {
        let sql = "DELETE FROM provider_health WHERE bucket < $1";
        Ok(on_write_pool!(self, pool => sqlx::query(sql)
            .bind(before)
            .execute(pool)
            .await?
            .rows_affected()))
    }

    /// The provider and route of every payment that may still move (its
    /// status `processing`, or `requires_reconciliation`: the reconciler
    /// moves one on a soft decline or a proven no effect): what a start
    /// checks against the providers file. Read through
    /// `payments_unsettled` (hence the time condition, true of every row).
    pub async fn movable_routes(&self) -> Result<Vec<(Uuid, Option<String>, String)>> {
        let sql = "SELECT id, provider, route FROM payments \
            WHERE status IN ('processing', 'requires_reconciliation') \
            AND status_changed_at IS NOT NULL AND route IS NOT NULL";
        let rows: Vec<(DbId, Option<String>, String)> =
            on_pool!(self, pool => sqlx::query_as(sql).fetch_all(pool).await?);
        Ok(rows.into_iter().map(|(id, p, r)| (id.0, p, r)).collect())
    }

    /// Every circuit that was ever opened.
    pub async fn circuits(&self) -> Result<Vec<CircuitRow>> {
        let sql = "SELECT provider, state, opened_at, closed_at, reason, updated_at \
            FROM provider_circuits ORDER BY provider";
        Ok(on_pool!(self, pool => sqlx::query_as(sql).fetch_all(pool).await?))
    }

    /// Opens `provider`'s circuit if it is closed (or was never opened);
    /// `false`: it was open already (another process opened it first).
    pub async fn open_circuit(
        &self,
        provider: &str,
        reason: &str,
        now: DateTime<Utc>,
    ) -> Result<bool> {
        let sql = "INSERT INTO provider_circuits (provider, state, opened_at, reason, updated_at) \
            VALUES ($1, 'open', $2, $3, $2) ON CONFLICT (provider) DO UPDATE SET \
            state = 'open', opened_at = excluded.opened_at, reason = excluded.reason, \
            updated_at = excluded.updated_at WHERE provider_circuits.state = 'closed'";
        let n = on_write_pool!(self, pool => sqlx::query(sql)
            .bind(provider)
            .bind(DbTime(now))
            .bind(reason)
            .execute(pool)
            .await?
            .rows_affected());
        Ok(n == 1)
    }

    /// Opens again a circuit whose cool-down had passed (`opened_at` at or
    /// before `cooled`): a half-open probe failed. `false`: someone else
    /// decided first.
    pub async fn reopen_circuit(
        &self,
        provider: &str,
        reason: &str,
        cooled: DateTime<Utc>,
        now: DateTime<Utc>,
    ) -> Result<bool> {
        let sql = "UPDATE provider_circuits SET opened_at = $2, reason = $3, updated_at = $2 \
            WHERE provider = $1 AND state = 'open' AND opened_at <= $4";
        let n = on_write_pool!(self, pool => sqlx::query(sql)
            .bind(provider)
            .bind(DbTime(now))
            .bind(reason)
            .bind(DbTime(cooled))
            .execute(pool)
            .await?
            .rows_affected());
        Ok(n == 1)
    }

    /// Closes an open circuit (a call succeeded): the next opening counts
    /// only calls from now on. `false`: it was not open.
    pub async fn close_circuit(&self, provider: &str, now: DateTime<Utc>) -> Result<bool> {
        let sql = "UPDATE provider_circuits SET state = 'closed', closed_at = $2, \
            reason = NULL, updated_at = $2 WHERE provider = $1 AND state = 'open'";
        let n = on_write_pool!(self, pool => sqlx::query(sql)
            .bind(provider)
            .bind(DbTime(now))
            .execute(pool)
            .await?
            .rows_affected());
        Ok(n == 1)
    }
}

impl WriteTx {
    /// Counts a send of `attempt` that provably never left cobro (no
    /// connection was made).
    pub async fn count_send_not_left(&mut self, attempt: AttemptId) -> Result<()> {
        let sql = "UPDATE attempts SET sends_not_left = sends_not_left + 1 WHERE id = $1";
        on_tx!(self, conn => sqlx::query(sql)
            .bind(DbId::from(attempt))
            .execute(&mut *conn)
            .await?
            .rows_affected());
        Ok(())
    }

    /// Records `attempt` without effect because none of its sends ever
    /// left cobro (or it was never sent): one compare-and-set on both, so
    /// a send counted meanwhile by another worker (its `send_count` is
    /// raised before it sends) makes it `false` and changes nothing.
    pub async fn resolve_never_left(
        &mut self,
        attempt: AttemptId,
        note: &str,
        now: DateTime<Utc>,
    ) -> Result<bool> {
        let sql = "UPDATE attempts SET state = 'no_effect', last_error = $2, updated_at = $3 \
            WHERE id = $1 AND state = 'pending' AND send_count = sends_not_left";
        let n = on_tx!(self, conn => sqlx::query(sql)
            .bind(DbId::from(attempt))
            .bind(note)
            .bind(DbTime(now))
            .execute(&mut *conn)
            .await?
            .rows_affected());
        Ok(n == 1)
    }

    /// Moves a payment from provider `from` to `to` with its route (JSON),
    /// compare-and-set on `from` (call it with the payment locked). The
    /// trigger of migration 0023 writes `payment.rerouted`; its held
    /// attempts (a cancel waiting for the authorisation) move with it.
    /// `false`: the payment is not at `from` any more, and nothing
    /// changed.
    pub async fn move_to_provider(
        &mut self,
        payment: PaymentId,
        from: &str,
        to: &str,
        route: &str,
        now: DateTime<Utc>,
    ) -> Result<bool> {
        let sql = "UPDATE payments SET provider = $3, route = $4, updated_at = $5 \
            WHERE id = $1 AND provider = $2";
        let n = on_tx!(self, conn => sqlx::query(sql)
            .bind(DbId::from(payment))
            .bind(from)
            .bind(to)
            .bind(route)
            .bind(DbTime(now))
            .execute(&mut *conn)
            .await?
            .rows_affected());
        if n != 1 {
            return Ok(false);
        }
        // A cancel held for the authorisation's outcome goes where the
        // charge will be.
        let sql = "UPDATE attempts SET provider = $2, updated_at = $3 \
            WHERE payment_id = $1 AND state = 'held'";
        on_tx!(self, conn => sqlx::query(sql)
            .bind(DbId::from(payment))
            .bind(to)
            .bind(DbTime(now))
            .execute(&mut *conn)
            .await?
            .rows_affected());
        Ok(true)
    }
}
