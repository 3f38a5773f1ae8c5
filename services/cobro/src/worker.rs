//! `cobro worker`: the outbox worker alone (it also runs inside `serve` by
//! default), with the scheduled reconciler, the event dispatcher and,
//! optionally, its own `/metrics`.

use crate::database::{self, SchemaPolicy};
use crate::output::say;
use crate::settings::{
    GlobalSettings, KeyWindowSettings, ReconcileSchedule, SenderSettings, WorkerSettings,
    parse_duration,
};
use anyhow::Context;
use cobro_core::{Clock, SystemClock};
use cobro_provider::HttpProvider;
use cobro_store::Store;
use cobro_worker::{Worker, WorkerConfig};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{Notify, watch};
use tokio_cron_scheduler::JobScheduler;

/// The arguments of `cobro worker`.
#[derive(Debug, clap::Args)]
pub struct WorkerArgs {
    #[command(flatten)]
    pub worker: WorkerSettings,

    #[command(flatten)]
    pub sender: SenderSettings,

    #[command(flatten)]
    pub schedule: ReconcileSchedule,

    #[command(flatten)]
    pub dispatcher: crate::settings::DispatcherSettings,

    /// After SIGTERM or SIGINT, how long in-flight calls may run.
    #[arg(long, env = "COBRO_SHUTDOWN_GRACE", default_value = "10s",
          value_parser = parse_duration)]
    pub shutdown_grace: Duration,

    /// Serve `GET /metrics` (this worker's provider calls, retries and
    /// leases, and the database's view) on this address; port 0 picks one.
    /// Without it a lone worker's counters are not exposed.
    #[arg(long, env = "COBRO_METRICS_LISTEN")]
    pub metrics_listen: Option<std::net::SocketAddr>,
}

pub fn worker_config(
    provider: &KeyWindowSettings,
    worker: &WorkerSettings,
) -> anyhow::Result<WorkerConfig> {
    if worker.worker_heartbeat >= worker.worker_lease {
        anyhow::bail!("the worker heartbeat must be shorter than its lease (2-3x shorter)");
    }
    if provider.provider_key_safety_margin >= provider.provider_key_retention {
        anyhow::bail!("the provider key safety margin must be shorter than the key retention");
    }
    Ok(WorkerConfig {
        lease: worker.worker_lease,
        heartbeat: worker.worker_heartbeat,
        max_in_flight: worker.worker_max_in_flight as usize,
        poll_interval: worker.worker_poll,
        key_retention: provider.provider_key_retention,
        safety_margin: provider.provider_key_safety_margin,
        ..Default::default()
    })
}

/// Starts the worker loop as a task; it stops when `shutdown` turns true.
pub fn spawn(
    store: Store,
    client: HttpProvider,
    clock: Arc<dyn Clock>,
    config: WorkerConfig,
    wake: Arc<Notify>,
    shutdown: watch::Receiver<bool>,
    grace: Duration,
) -> tokio::task::JoinHandle<()> {
    let worker = Arc::new(Worker::new(store, Arc::new(client), clock, config, wake));
    tokio::spawn(worker.run(shutdown, grace))
}

/// `cobro worker`: the worker alone, until SIGTERM or SIGINT.
pub async fn run_alone(global: &GlobalSettings, args: &WorkerArgs) -> anyhow::Result<()> {
    let (provider_settings, reconcile) = (&args.sender.provider, &args.sender.reconcile);
    let config = worker_config(&args.sender.key_window, &args.worker)?;
    let (store, _) = database::open(global, SchemaPolicy::Require).await?;
    let handle = crate::provider::connect(provider_settings, None).await?;
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let mut scheduler = JobScheduler::new()
        .await
        .context("could not create the scheduler")?;
    if args.schedule.no_reconciler {
        tracing::warn!("no scheduled reconciler in this process (--no-reconciler)");
    } else {
        crate::schedule::reconciler(
            &scheduler,
            &store,
            &clock,
            handle.client.clone(),
            reconcile,
            provider_settings,
            &args.schedule.reconcile_schedule,
        )
        .await?;
        scheduler
            .start()
            .await
            .context("could not start the reconciler schedule")?;
    }
    let shutdown = crate::shutdown::watch_signals()?;
    if let Some(address) = args.metrics_listen {
        serve_metrics(address, &store, &clock, shutdown.clone()).await?;
    }
    let _dispatcher =
        crate::events::spawn_dispatcher(&store, &clock, &args.dispatcher, shutdown.clone())?;
    say(format_args!("cobro worker running as {}", config.owner))?;
    let task = spawn(
        store.clone(),
        handle.client,
        clock,
        config,
        Arc::new(Notify::new()),
        shutdown,
        args.shutdown_grace,
    );
    task.await.context("the worker task failed")?;
    let _ = scheduler.shutdown().await;
    store.close().await;
    Ok(())
}

/// `GET /metrics` of a lone worker, until shutdown.
async fn serve_metrics(
    address: std::net::SocketAddr,
    store: &Store,
    clock: &Arc<dyn Clock>,
    shutdown: watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(address)
        .await
        .with_context(|| format!("could not listen on {address} for metrics"))?;
    let bound = listener
        .local_addr()
        .context("could not read the bound address")?;
    let state = cobro_api::AppState::new(
        store.clone(),
        Arc::clone(clock),
        cobro_api::ApiSettings::default(),
    );
    let app = cobro_api::metrics_router(state);
    // Bounded like the API (idle, header timeouts, connection cap): a
    // scraper that stalls holds nothing.
    tokio::spawn(cobro_api::server::serve(
        listener,
        app,
        cobro_api::server::Limits::default(),
        shutdown,
    ));
    say(format_args!(
        "cobro worker metrics on http://{bound}/metrics"
    ))?;
    Ok(())
}
