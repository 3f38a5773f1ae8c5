//! The scheduled jobs of a long-running process: the purge (inside
//! `serve`) and the reconciler (inside `serve` and `cobro worker`). A run
//! still going when the next is due makes the next one skip rather than
//! pile up.

use crate::provider::ProviderHandle;
use crate::settings::{ReconcileSettings, RetentionSettings};
use anyhow::Context;
use cobro_core::Clock;
use cobro_store::Store;
use std::sync::Arc;
use tokio::sync::Mutex;
use tokio_cron_scheduler::{Job, JobScheduler};

/// A scheduler (not started) with the purge on `schedule`: the same
/// [`Store::purge`] as `cobro purge`.
pub async fn purge(
    store: &Store,
    clock: &Arc<dyn Clock>,
    retention: &RetentionSettings,
    batch: u32,
    schedule: &str,
) -> anyhow::Result<JobScheduler> {
    let scheduler = JobScheduler::new()
        .await
        .context("could not create the purge scheduler")?;
    let job = ScheduledPurge {
        store: store.clone(),
        clock: Arc::clone(clock),
        retention: retention.retention(),
        batch,
        running: Arc::new(Mutex::new(())),
    };
    let job = Job::new_async(schedule, move |_id, _scheduler| {
        let job = job.clone();
        Box::pin(async move { job.run().await })
    })
    // Already checked by `settings::parse_cron`.
    .context("could not create the purge job")?;
    scheduler
        .add(job)
        .await
        .context("could not schedule the purge")?;
    Ok(scheduler)
}

/// What one scheduled purge needs.
#[derive(Clone)]
struct ScheduledPurge {
    store: Store,
    clock: Arc<dyn Clock>,
    retention: cobro_store::purge::Retention,
    batch: u32,
    /// Held for the duration of a run, so runs never overlap.
    running: Arc<Mutex<()>>,
}

impl ScheduledPurge {
    async fn run(&self) {
        let Ok(_running) = self.running.try_lock() else {
            tracing::warn!("the previous purge is still running; skipping this one");
            return;
        };
        let now = self.clock.now();
        if let Err(error) = self.store.purge(&self.retention, now, self.batch).await {
            // The next scheduled run retries; nothing partial needs undoing
            // because every batch commits on its own.
            tracing::error!(error = %error, "scheduled purge failed");
        }
    }
}

/// The scheduled reconciliation on `scheduler`, one job per provider of
/// `handle`: the same [`cobro_reconciler::Reconciler`] as `cobro
/// reconcile`, every `schedule`, each asking its provider about the
/// attempts sent to it, with its search lag and request timeout. Runs of
/// one provider never overlap in this process; across processes its
/// compare-and-sets keep them from applying two decisions to one attempt.
pub async fn reconcilers(
    scheduler: &JobScheduler,
    store: &Store,
    clock: &Arc<dyn Clock>,
    handle: &ProviderHandle,
    settings: &ReconcileSettings,
    schedule: &str,
) -> anyhow::Result<()> {
    for (spec, client) in &handle.clients {
        let actor = format!("reconciler:{}", std::process::id());
        let config = settings.config(spec, handle.registry.scope(spec), actor);
        reconciler(scheduler, store, clock, client.clone(), config, schedule).await?;
    }
    Ok(())
}

async fn reconciler(
    scheduler: &JobScheduler,
    store: &Store,
    clock: &Arc<dyn Clock>,
    client: cobro_provider::Connector,
    config: cobro_reconciler::ReconcilerConfig,
    schedule: &str,
) -> anyhow::Result<()> {
    let reconciler = Arc::new(cobro_reconciler::Reconciler::new(
        store.clone(),
        Arc::new(client),
        Arc::clone(clock),
        config,
    ));
    let running = Arc::new(Mutex::new(()));
    let job = Job::new_async(schedule, move |_id, _scheduler| {
        let (reconciler, running) = (Arc::clone(&reconciler), Arc::clone(&running));
        Box::pin(async move {
            let Ok(_running) = running.try_lock() else {
                tracing::warn!("the previous reconciliation is still running; skipping this one");
                return;
            };
            let scope = cobro_reconciler::Scope::default();
            if let Err(error) = reconciler.run(&scope, false, "schedule", &|_, _| {}).await {
                tracing::error!(error = %error, "scheduled reconciliation failed");
            }
        })
    })
    .context("could not create the reconciliation job")?;
    scheduler
        .add(job)
        .await
        .context("could not schedule the reconciler")?;
    Ok(())
}
