//! The scheduled jobs of a long-running process: the purge (inside
//! `serve`), the reconciler and the books (inside `serve` and `cobro
//! worker`). A run
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
        if settings.books.no_books {
            continue;
        }
        let actor = format!("books:{}", std::process::id());
        let config = settings
            .books
            .config(spec, &handle.registry.scope(spec), actor);
        books(
            scheduler,
            store,
            clock,
            client.clone(),
            config,
            &settings.books.books_schedule,
        )
        .await?;
    }
    if settings.books.no_books {
        tracing::warn!("no scheduled books in this process (--no-books)");
    }
    Ok(())
}

/// The scheduled books of one provider: the same
/// [`cobro_reconciler::books::Books`] as `cobro books`, from the
/// provider's checkpoint. Runs never overlap in this process; across
/// processes every write is idempotent (orphans once per object, moves
/// and refunds under the payment's lock, conflicts once while open), so
/// two processes reading one window at once record each thing once.
async fn books(
    scheduler: &JobScheduler,
    store: &Store,
    clock: &Arc<dyn Clock>,
    client: cobro_provider::Connector,
    config: cobro_reconciler::books::BooksConfig,
    schedule: &str,
) -> anyhow::Result<()> {
    let books = Arc::new(cobro_reconciler::books::Books::new(
        store.clone(),
        Arc::new(client),
        Arc::clone(clock),
        config,
    ));
    exclusive(scheduler, schedule, "books", move || {
        let books = Arc::clone(&books);
        async move {
            if let Err(error) = books.run_due("schedule").await {
                tracing::error!(error = %error, "scheduled books run failed");
            }
        }
    })
    .await
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
    exclusive(scheduler, schedule, "reconciliation", move || {
        let reconciler = Arc::clone(&reconciler);
        async move {
            let scope = cobro_reconciler::Scope::default();
            if let Err(error) = reconciler.run(&scope, false, "schedule", &|_, _| {}).await {
                tracing::error!(error = %error, "scheduled reconciliation failed");
            }
        }
    })
    .await
}

/// Adds `run` to `scheduler` on `schedule`; a run still going when the
/// next is due makes the next one skip rather than pile up.
async fn exclusive<F, Fut>(
    scheduler: &JobScheduler,
    schedule: &str,
    what: &'static str,
    run: F,
) -> anyhow::Result<()>
where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let run = Arc::new(run);
    let running = Arc::new(Mutex::new(()));
    let job = Job::new_async(schedule, move |_id, _scheduler| {
        let (run, running) = (Arc::clone(&run), Arc::clone(&running));
        Box::pin(async move {
            let Ok(_running) = running.try_lock() else {
                tracing::warn!(
                    job = what,
                    "the previous run is still running; skipping this one"
                );
                return;
            };
            run().await;
        })
    })
    .with_context(|| format!("could not create the {what} job"))?;
    scheduler
        .add(job)
        .await
        .with_context(|| format!("could not schedule the {what}"))?;
    Ok(())
}
