//! The audit trail of decisions about uncertain outcomes: reconciler runs,
//! webhook proofs and operators' manual resolutions all write here, in the
//! same transaction as the decision itself.

use crate::{DbId, DbTime, Result, Store, WriteTx, on_pool, on_tx, on_write_pool};
use chrono::{DateTime, Utc};
use cobro_core::{AttemptId, Decision, PaymentId, RefundId, RunId};

/// One decision, as written to `reconciliation_decisions`.
#[derive(Clone, Debug)]
pub struct NewDecision {
    /// The reconciler run, when a run decided (webhooks and operators: None).
    pub run_id: Option<RunId>,
    pub payment: PaymentId,
    pub refund: Option<RefundId>,
    pub attempt: Option<AttemptId>,
    pub state_before: String,
    pub state_after: String,
    /// What the provider said (JSON text), or what the operator asserted.
    pub provider_said: String,
    pub decision: Decision,
    /// `reconciler:<owner>`, `webhook:<provider>`, `operator:<name>`.
    pub actor: String,
    pub reason: Option<String>,
}

/// A decision read back (CLI `payments show`).
#[derive(Clone, Debug, sqlx::FromRow)]
pub struct DecisionRow {
    pub run_id: Option<RunId>,
    pub attempt_id: Option<AttemptId>,
    pub state_before: String,
    pub state_after: String,
    pub provider_said: String,
    pub decision: Decision,
    pub actor: String,
    pub reason: Option<String>,
    pub decided_at: DbTime,
}

impl WriteTx {
    pub async fn record_decision(&mut self, d: &NewDecision, now: DateTime<Utc>) -> Result<()> {
        let sql = "INSERT INTO reconciliation_decisions (id, run_id, payment_id, refund_id, \
            attempt_id, state_before, state_after, provider_said, decision, actor, reason, \
            decided_at, account_id) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, \
            (SELECT account_id FROM payments WHERE id = $3))";
        on_tx!(self, conn => sqlx::query(sql)
            .bind(DbId(uuid::Uuid::now_v7()))
            .bind(d.run_id.map(DbId::from))
            .bind(DbId::from(d.payment))
            .bind(d.refund.map(DbId::from))
            .bind(d.attempt.map(DbId::from))
            .bind(&d.state_before)
            .bind(&d.state_after)
            .bind(&d.provider_said)
            .bind(d.decision)
            .bind(&d.actor)
            .bind(&d.reason)
            .bind(DbTime(now))
            .execute(&mut *conn)
            .await?
            .rows_affected());
        Ok(())
    }
}

impl Store {
    /// The decisions about one payment, oldest first.
    pub async fn decisions_of_payment_any_account(
        &self,
        payment: PaymentId,
    ) -> Result<Vec<DecisionRow>> {
        let sql = "SELECT run_id, attempt_id, state_before, state_after, provider_said, decision, \
            actor, reason, decided_at FROM reconciliation_decisions WHERE payment_id = $1 \
            ORDER BY decided_at, id";
        Ok(on_pool!(self, pool => sqlx::query_as(sql)
            .bind(DbId::from(payment))
            .fetch_all(pool)
            .await?))
    }

    /// Opens a reconciler run; its decisions name it.
    pub async fn start_run(
        &self,
        trigger: &str,
        actor: &str,
        dry_run: bool,
        now: DateTime<Utc>,
    ) -> Result<RunId> {
        let id = RunId::new();
        let sql = "INSERT INTO reconciliation_runs (id, trigger, actor, dry_run, started_at) \
            VALUES ($1, $2, $3, $4, $5)";
        on_write_pool!(self, pool => sqlx::query(sql)
            .bind(DbId::from(id))
            .bind(trigger)
            .bind(actor)
            .bind(dry_run)
            .bind(DbTime(now))
            .execute(pool)
            .await?
            .rows_affected());
        Ok(id)
    }

    /// Closes a run with its summary (JSON text).
    pub async fn finish_run(&self, id: RunId, summary: &str, now: DateTime<Utc>) -> Result<()> {
        let sql = "UPDATE reconciliation_runs SET finished_at = $2, summary = $3 WHERE id = $1";
        on_write_pool!(self, pool => sqlx::query(sql)
            .bind(DbId::from(id))
            .bind(DbTime(now))
            .bind(summary)
            .execute(pool)
            .await?
            .rows_affected());
        Ok(())
    }
}
