//! `cobro serve`: the HTTP API (request ids and request logs come with the
//! router), the
//! scheduled purge, and a graceful shutdown bounded by a grace period.
//!
//! Start-up order, so that every failure is reported before the port opens:
//! store (migrate or check the schema) -> embedded demo setup (only without a
//! database URL) -> purge schedule -> signal handlers -> bind -> stdout
//! lines (banner, then `cobro listening on http://ADDR`) -> serve.
//!
//! Shutdown: SIGTERM or SIGINT stops accepting connections and lets in-flight
//! requests finish; after `COBRO_SHUTDOWN_GRACE` the process exits anyway.

use crate::database::{self, SchemaPolicy};
use crate::output::say;
use crate::settings::{
    GlobalSettings, ProviderSettings, ReconcileSettings, RetentionSettings, SenderSettings,
    ServeSettings,
};
use crate::{demo, purge};
use anyhow::Context;
use axum::Router;
use cobro_api::{ApiSettings, AppState, WebhookReceiver};
use cobro_core::{Clock, SystemClock};
use cobro_provider::WebhookSecret;
use cobro_store::Store;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::{Mutex, watch};
use tokio_cron_scheduler::{Job, JobScheduler};

/// The arguments of `cobro serve`: the server's own, and those of the
/// worker and reconciler it runs.
#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub settings: ServeSettings,
    #[command(flatten)]
    pub sender: SenderSettings,
}

/// Runs the server until a shutdown signal.
pub async fn run(global: &GlobalSettings, args: &ServeArgs) -> anyhow::Result<()> {
    let settings = &args.settings;
    let SenderSettings {
        provider,
        key_window,
        reconcile,
    } = &args.sender;
    let policy = if settings.no_migrate {
        SchemaPolicy::Require
    } else {
        SchemaPolicy::Migrate
    };
    let (store, target) = database::open(global, policy).await?;
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);

    let demo_setup = match target.embedded_file() {
        Some(file) => Some((file, demo::prepare(&store, global, clock.now()).await?)),
        None => None,
    };

    let mut scheduler = purge_scheduler(&store, &clock, settings).await?;

    let shutdown = watch_shutdown_signals()?;
    let listener = TcpListener::bind(settings.listen)
        .await
        .with_context(|| format!("could not listen on {}", settings.listen))?;
    let address = listener
        .local_addr()
        .context("could not read the bound address")?;
    if let Some((file, dev_token)) = demo_setup {
        demo::print_banner(address, &file, &dev_token)?;
    }
    say(format_args!("cobro listening on http://{address}"))?;
    tracing::info!(%address, "listening");

    scheduler
        .start()
        .await
        .context("could not start the purge schedule")?;

    // The embedded fake provider (started below when no provider URL is
    // set) signs its webhooks with a secret made here, unless one is set.
    let embedded_provider = !settings.no_worker && provider.provider_url.is_none();
    let webhook_secret = settings
        .webhook_secret
        .clone()
        .or_else(|| embedded_provider.then(generated_webhook_secret));
    let mut api = ApiSettings {
        idempotency_retention: settings.retention.idempotency_retention,
        tombstone_retention: settings.retention.tombstone_retention,
        webhook_tolerance: settings.webhook_tolerance,
        rate_limit: cobro_api::rate_limit::RateLimit {
            per_second: settings.rate_limit,
            burst: settings.rate_limit_burst,
        },
        request_timeout: settings.http.http_request_timeout,
        ..ApiSettings::default()
    };
    if let Some(secret) = &webhook_secret {
        let receiver = WebhookReceiver {
            previous: settings.webhook_secret_previous.clone(),
            ..WebhookReceiver::fake(secret.clone())
        };
        api.webhooks.insert("fake".to_owned(), receiver);
    }
    let state = AppState::new(store.clone(), Arc::clone(&clock), api);
    // The worker runs in this process unless told otherwise; the API wakes
    // it in memory after every commit that enqueued work.
    let (provider_handle, worker) = if settings.no_worker {
        (None, None)
    } else {
        let config = crate::worker::worker_config(key_window, &settings.worker)?;
        let handle = crate::worker::provider(provider, Some(key_window)).await?;
        let task = crate::worker::spawn(
            store.clone(),
            handle.client.clone(),
            Arc::clone(&clock),
            config,
            Arc::clone(&state.work_available),
            shutdown.clone(),
            settings.shutdown_grace,
        );
        (Some(handle), Some(task))
    };
    // Events go out from every process unless told otherwise.
    let _dispatcher =
        crate::events::spawn_dispatcher(&store, &clock, &settings.dispatcher, shutdown.clone())?;
    // The reconciler runs on a schedule in every process that has a
    // provider (with or without its worker), asking the provider the
    // worker calls, unless told not to.
    let reconciler_provider = match &provider_handle {
        Some(handle) => Some(handle.client.clone()),
        None if provider.provider_url.is_some() => {
            Some(crate::worker::provider(provider, None).await?.client)
        }
        None => None,
    };
    match reconciler_provider {
        Some(client) if !settings.schedule.no_reconciler => {
            schedule_reconciler(
                &scheduler,
                &store,
                &clock,
                client,
                reconcile,
                provider,
                &settings.schedule.reconcile_schedule,
            )
            .await?;
        }
        Some(_) => tracing::warn!("no scheduled reconciler in this process (--no-reconciler)"),
        None => tracing::warn!(
            "no provider configured: no scheduled reconciler in this process; set COBRO_PROVIDER_URL"
        ),
    }
    if let Some(fake) = provider_handle.as_ref().and_then(|h| h.embedded.as_ref()) {
        if let Some(secret) = webhook_secret {
            // Bound above, so the URL is final; a wildcard address is
            // reached over loopback.
            let host = if address.ip().is_unspecified() {
                std::net::SocketAddr::new(std::net::Ipv4Addr::LOCALHOST.into(), address.port())
            } else {
                address
            };
            fake.control()
                .set_webhook(Some(fake_provider::WebhookTarget {
                    url: format!("http://{host}/v1/webhooks/fake"),
                    secret: secret.expose().to_owned(),
                }));
        }
        say(format_args!(
            "embedded fake provider (no real money moves): {url} (faults, clock and ledger at {url}/__admin)",
            url = fake.url()
        ))?;
    }
    // The router carries its own request ids, request span and key echo.
    let app = cobro_api::router(state);
    let limits = settings.http.limits();
    let drained =
        serve_until_shutdown(listener, app, limits, shutdown, settings.shutdown_grace).await;

    if let Some(worker) = worker
        && let Err(error) = worker.await
    {
        tracing::warn!(error = %error, "the worker task failed");
    }
    if let Err(error) = scheduler.shutdown().await {
        tracing::warn!(error = %error, "the purge schedule did not stop cleanly");
    }
    // Closing waits for every pooled connection; requests cut off by the
    // grace period may still hold one, so only close after a full drain.
    if drained {
        store.close().await;
    }
    tracing::info!(drained, "stopped");
    Ok(())
}

/// A fresh webhook secret for the embedded fake provider: 122 random bits,
/// never printed (the provider gets it in memory).
fn generated_webhook_secret() -> WebhookSecret {
    WebhookSecret::new(format!("whsec_{}", uuid::Uuid::new_v4().simple()))
}

/// Serves until `shutdown` fires, then drains for at most `grace`
/// (connections with no request running close at once; see
/// `cobro_api::server`). Returns whether every connection finished within
/// the grace period.
async fn serve_until_shutdown(
    listener: TcpListener,
    app: Router,
    limits: cobro_api::server::Limits,
    shutdown: watch::Receiver<bool>,
    grace: Duration,
) -> bool {
    let server = cobro_api::server::serve(listener, app, limits, shutdown.clone());
    let grace_over = async {
        stopped(shutdown).await;
        tokio::time::sleep(grace).await;
    };
    tokio::select! {
        served = server => {
            if served.refused > 0 {
                tracing::info!(refused = served.refused, "connections refused over the cap while serving");
            }
            true
        }
        () = grace_over => {
            tracing::warn!(grace = ?grace, "grace period over: exiting with requests in flight");
            false
        }
    }
}

/// Watches SIGTERM and SIGINT from now on; the receiver turns `true` at
/// the first. Installed before the listening line is printed, so a signal
/// sent as soon as the server is announced is never lost to the default
/// action (which would kill the process without draining).
pub fn watch_shutdown_signals() -> anyhow::Result<watch::Receiver<bool>> {
    let mut terminate = signal(SignalKind::terminate()).context("could not watch SIGTERM")?;
    let mut interrupt = signal(SignalKind::interrupt()).context("could not watch SIGINT")?;
    let (stop, stopping) = watch::channel(false);
    tokio::spawn(async move {
        let name = tokio::select! {
            _ = terminate.recv() => "SIGTERM",
            _ = interrupt.recv() => "SIGINT",
        };
        tracing::info!(signal = name, "shutting down: draining in-flight requests");
        // No receiver left means the server already stopped.
        let _ = stop.send(true);
    });
    Ok(stopping)
}

/// Completes once shutdown was asked for (or can no longer be asked for).
async fn stopped(mut stopping: watch::Receiver<bool>) {
    let _ = stopping.wait_for(|stop| *stop).await;
}

/// The scheduled purge: the same [`purge::run`] as `cobro purge`, on
/// `COBRO_PURGE_SCHEDULE`. A run still going when the next is due makes the
/// next one skip rather than pile up.
async fn purge_scheduler(
    store: &Store,
    clock: &Arc<dyn Clock>,
    settings: &ServeSettings,
) -> anyhow::Result<JobScheduler> {
    let scheduler = JobScheduler::new()
        .await
        .context("could not create the purge scheduler")?;
    let job = ScheduledPurge {
        store: store.clone(),
        clock: Arc::clone(clock),
        retention: settings.retention.clone(),
        batch: settings.purge_batch,
        running: Arc::new(Mutex::new(())),
    };
    let job = Job::new_async(settings.purge_schedule.as_str(), move |_id, _scheduler| {
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
    retention: RetentionSettings,
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
        if let Err(error) = purge::run(&self.store, &self.retention, now, self.batch).await {
            // The next scheduled run retries; nothing partial needs undoing
            // because every batch commits on its own.
            tracing::error!(error = format!("{error:#}"), "scheduled purge failed");
        }
    }
}

/// The scheduled reconciliation: the same [`cobro_reconciler::Reconciler`]
/// as `cobro reconcile`, every `schedule`. Runs never overlap in this
/// process; across processes its compare-and-sets keep them from applying
/// two decisions to one attempt.
pub(crate) async fn schedule_reconciler(
    scheduler: &JobScheduler,
    store: &Store,
    clock: &Arc<dyn Clock>,
    client: cobro_provider::HttpProvider,
    settings: &ReconcileSettings,
    provider: &ProviderSettings,
    schedule: &str,
) -> anyhow::Result<()> {
    let actor = format!("reconciler:{}", std::process::id());
    let reconciler = Arc::new(cobro_reconciler::Reconciler::new(
        store.clone(),
        Arc::new(client),
        Arc::clone(clock),
        crate::reconcile::reconciler_config(settings, provider, actor),
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
