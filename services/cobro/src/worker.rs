//! `cobro worker`: the outbox worker alone (it also runs inside `serve` by
//! default), with the scheduled reconciler, the event dispatcher and,
//! optionally, its own `/metrics`.

use crate::database::{self, SchemaPolicy};
use crate::output::say;
use crate::provider::{ProviderHandle, Registry};
use crate::settings::{
    GlobalSettings, ReconcileSchedule, SenderSettings, WorkerSettings, parse_duration,
};
use anyhow::Context;
use cobro_core::{Clock, SystemClock};
use cobro_settle::routing::Circuits;
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

/// The configuration of every provider's worker, checked before anything
/// starts: each claims only its provider's attempts, with that provider's
/// key window. With one provider the lease owner is as it always was;
/// with several, each worker's owner ends in its provider's name.
pub fn worker_configs(
    registry: &Registry,
    worker: &WorkerSettings,
) -> anyhow::Result<Vec<(String, WorkerConfig)>> {
    if worker.worker_heartbeat >= worker.worker_lease {
        anyhow::bail!("the worker heartbeat must be shorter than its lease (2-3x shorter)");
    }
    let owner = WorkerConfig::default().owner;
    let several = registry.providers().len() > 1;
    registry
        .providers()
        .iter()
        .map(|spec| {
            let contract = &spec.contract;
            if contract.key_safety_margin >= contract.key_retention {
                anyhow::bail!(
                    "the provider key safety margin must be shorter than the key retention (provider `{}`)",
                    spec.name
                );
            }
            let config = WorkerConfig {
                owner: if several {
                    format!("{owner}-{}", spec.name)
                } else {
                    owner.clone()
                },
                lease: worker.worker_lease,
                heartbeat: worker.worker_heartbeat,
                max_in_flight: worker.worker_max_in_flight as usize,
                poll_interval: worker.worker_poll,
                action_expiry: worker.action_expiry,
                key_retention: contract.key_retention,
                safety_margin: contract.key_safety_margin,
                provider: Some(registry.scope(spec)),
                ..Default::default()
            };
            Ok((spec.name.clone(), config))
        })
        .collect()
}

/// Starts one worker per provider of `handle` (configs from
/// [`worker_configs`]), each with its own client, key window and retry
/// budget; every wake-up on `wake` reaches all of them. The task ends when
/// every worker stopped (after `shutdown` turns true).
pub fn spawn(
    store: Store,
    handle: &ProviderHandle,
    clock: Arc<dyn Clock>,
    (configs, circuits): (Vec<(String, WorkerConfig)>, Arc<Circuits>),
    wake: Arc<Notify>,
    shutdown: watch::Receiver<bool>,
    grace: Duration,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let mut workers = tokio::task::JoinSet::new();
    let mut wakes = Vec::new();
    for (name, config) in configs {
        let client = handle
            .client(&name)
            .with_context(|| format!("no client for the provider `{name}`"))?
            .clone();
        let own_wake = Arc::new(Notify::new());
        wakes.push(Arc::clone(&own_wake));
        let worker = Arc::new(
            Worker::new(
                store.clone(),
                Arc::new(client),
                Arc::clone(&clock),
                config,
                own_wake,
            )
            .with_circuits(Arc::clone(&circuits)),
        );
        workers.spawn(worker.run(shutdown.clone(), grace));
    }
    // The API signals one `Notify`; each worker waits on its own, so the
    // signal is passed to all (the one whose provider has the work claims it).
    let relay = tokio::spawn(async move {
        loop {
            wake.notified().await;
            for each in &wakes {
                each.notify_one();
            }
        }
    });
    Ok(tokio::spawn(async move {
        while let Some(done) = workers.join_next().await {
            if let Err(error) = done {
                tracing::warn!(error = %error, "a worker task failed");
            }
        }
        relay.abort();
    }))
}

/// `cobro worker`: the worker alone, until SIGTERM or SIGINT.
pub async fn run_alone(global: &GlobalSettings, args: &WorkerArgs) -> anyhow::Result<()> {
    let reconcile = &args.sender.reconcile;
    let registry = Registry::load(
        &args.sender.provider,
        Some(&args.sender.key_window),
        Some(reconcile),
    )?;
    let configs = worker_configs(&registry, &args.worker)?;
    let (store, target) = database::open(global, SchemaPolicy::Require).await?;
    database::check_clock(&store, registry.clock_bound()).await?;
    // The workers move payments along their routes: every provider a
    // route may still name must be here.
    crate::routing::check_stored_rules(&store, &registry).await?;
    database::require_pool(
        global,
        &store,
        configs.len(),
        "the workers (one per provider)",
    )?;
    let breaker = registry.routing().breaker.clone();
    let handle = crate::provider::connect(registry, false).await?;
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let circuits = Arc::new(Circuits::new(store.clone(), Arc::clone(&clock), breaker));
    let mut scheduler = JobScheduler::new()
        .await
        .context("could not create the scheduler")?;
    if args.schedule.no_reconciler {
        tracing::warn!("no scheduled reconciler in this process (--no-reconciler)");
    } else {
        crate::schedule::reconcilers(
            &scheduler,
            &store,
            &clock,
            &handle,
            reconcile,
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
    let _dispatcher = crate::events::spawn_dispatcher(
        &store,
        &clock,
        &args.dispatcher,
        target.embedded_file().is_some(),
        shutdown.clone(),
    )?;
    for (_, config) in &configs {
        say(format_args!("cobro worker running as {}", config.owner))?;
    }
    let task = spawn(
        store.clone(),
        &handle,
        clock,
        (configs, circuits),
        Arc::new(Notify::new()),
        shutdown,
        args.shutdown_grace,
    )?;
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
