//! The retention purge (spec section 8), shared by `cobro purge` and the
//! scheduled job inside `cobro serve`.
//!
//! Each kind of row is purged in batches of `batch` rows until a batch comes
//! back short, so no statement holds locks for long. The cutoffs are fixed
//! once at the start, so the loop ends even while new rows keep arriving, and
//! nothing younger than its retention is ever removed.

use crate::settings::RetentionSettings;
use anyhow::Context;
use chrono::{DateTime, Utc};
use cobro_store::Store;
use std::fmt;
use std::future::Future;
use std::time::Duration;

/// How many rows one purge changed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PurgeReport {
    /// Full idempotency records compacted to tombstones.
    pub compacted: u64,
    /// Tombstones deleted (their keys are new again).
    pub tombstones_deleted: u64,
    /// Processed webhook event ids deleted.
    pub webhook_events_deleted: u64,
}

impl fmt::Display for PurgeReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "compacted {} idempotency records, deleted {} tombstones, deleted {} webhook events",
            self.compacted, self.tombstones_deleted, self.webhook_events_deleted
        )
    }
}

/// The three cutoffs of one purge as of `now`, fixed once.
struct Cutoffs {
    compact_before: DateTime<Utc>,
    tombstones_before: DateTime<Utc>,
    events_before: DateTime<Utc>,
}

impl Cutoffs {
    fn new(retention: &RetentionSettings, now: DateTime<Utc>) -> anyhow::Result<Self> {
        Ok(Self {
            compact_before: cutoff(now, retention.idempotency_retention)?,
            // A tombstone keeps its record's creation time, so its age is
            // counted from the original request: both retentions together.
            tombstones_before: cutoff(
                now,
                retention
                    .idempotency_retention
                    .saturating_add(retention.tombstone_retention),
            )?,
            events_before: cutoff(now, retention.webhook_event_retention)?,
        })
    }
}

/// What [`run`] would change as of `now`, counted and not changed
/// (`cobro purge --dry-run`).
pub async fn count(
    store: &Store,
    retention: &RetentionSettings,
    now: DateTime<Utc>,
) -> anyhow::Result<PurgeReport> {
    let c = Cutoffs::new(retention, now)?;
    let (compacted, tombstones_deleted, webhook_events_deleted) = store
        .count_purgeable(c.compact_before, c.tombstones_before, c.events_before)
        .await
        .context("counting what the purge would change failed")?;
    Ok(PurgeReport {
        compacted,
        tombstones_deleted,
        webhook_events_deleted,
    })
}

/// Runs one full purge as of `now`.
#[tracing::instrument(name = "purge.run", skip_all, fields(batch = batch))]
pub async fn run(
    store: &Store,
    retention: &RetentionSettings,
    now: DateTime<Utc>,
    batch: u32,
) -> anyhow::Result<PurgeReport> {
    let Cutoffs {
        compact_before,
        tombstones_before,
        events_before,
    } = Cutoffs::new(retention, now)?;

    let report = PurgeReport {
        compacted: drain(batch, || {
            store.compact_idempotency_records(compact_before, batch)
        })
        .await
        .context("compacting idempotency records failed")?,
        tombstones_deleted: drain(batch, || {
            store.delete_expired_tombstones(tombstones_before, batch)
        })
        .await
        .context("deleting expired tombstones failed")?,
        webhook_events_deleted: drain(batch, || {
            store.delete_expired_webhook_events(events_before, batch)
        })
        .await
        .context("deleting expired webhook events failed")?,
    };
    tracing::info!(
        compacted = report.compacted,
        tombstones_deleted = report.tombstones_deleted,
        webhook_events_deleted = report.webhook_events_deleted,
        "purge finished"
    );
    Ok(report)
}

/// Repeats `step` until it changes fewer than `batch` rows; the total.
async fn drain<F, Fut>(batch: u32, mut step: F) -> cobro_store::Result<u64>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = cobro_store::Result<u64>>,
{
    let mut total = 0;
    loop {
        let changed = step().await?;
        total += changed;
        if changed < u64::from(batch) {
            return Ok(total);
        }
    }
}

/// `now - age`; a retention too long to represent is a configuration error.
fn cutoff(now: DateTime<Utc>, age: Duration) -> anyhow::Result<DateTime<Utc>> {
    chrono::Duration::from_std(age)
        .ok()
        .and_then(|age| now.checked_sub_signed(age))
        .with_context(|| format!("a retention of {age:?} is out of range"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    #[tokio::test]
    async fn drain_repeats_full_batches_and_stops_at_the_first_short_one() {
        let answers = RefCell::new(vec![3, 3, 3, 1, 3]);
        let total = drain(3, || {
            let next = answers.borrow_mut().remove(0);
            async move { Ok(next) }
        })
        .await
        .expect("drains");
        assert_eq!(total, 10);
        assert_eq!(*answers.borrow(), vec![3], "stopped after the short batch");
    }

    #[test]
    fn cutoffs_are_now_minus_the_retention_and_refuse_overflow() {
        let now = DateTime::parse_from_rfc3339("2026-11-30T12:00:00Z")
            .expect("valid")
            .with_timezone(&Utc);
        let day = cutoff(now, Duration::from_secs(86_400)).expect("in range");
        assert_eq!(day.to_rfc3339(), "2026-11-29T12:00:00+00:00");
        assert!(cutoff(now, Duration::MAX).is_err());
    }
}
