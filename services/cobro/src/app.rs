//! The whole `cobro serve` process as a value: [`Application::build`] does
//! every start-up step that can fail, up to and including binding the
//! port, and [`Application::run_until_stopped`] serves until asked to stop,
//! then drains. `serve` (the command) adds only signals and its stdout
//! lines; tests build one in-process the same way (services/cobro/tests).
//!
//! Start-up order, so that every failure is reported before anything is
//! served: store (migrate or check the schema) -> embedded demo setup (only
//! without a database URL) -> purge schedule -> bind -> API state ->
//! worker (unless `--no-worker`; the embedded fake provider without a
//! provider URL) -> event dispatcher -> scheduled reconciler -> the
//! embedded provider's webhooks pointed at the bound address.
//!
//! Stop: the [`Stopper`] (SIGTERM/SIGINT in `serve`) stops accepting
//! connections and lets in-flight requests finish; after
//! `COBRO_SHUTDOWN_GRACE` it returns anyway.

use crate::database::{self, SchemaPolicy};
use crate::provider::Registry;
use crate::settings::{GlobalSettings, SenderSettings, ServeSettings};
use crate::shutdown::{Stopper, stopped};
use crate::{demo, schedule};
use anyhow::Context;
use axum::Router;
use cobro_api::{ApiSettings, AppState};
use cobro_core::{Clock, SystemClock};
use cobro_provider::WebhookSecret;
use cobro_store::Store;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_cron_scheduler::JobScheduler;

/// A built, bound, not yet serving `cobro serve`.
pub struct Application {
    address: SocketAddr,
    listener: TcpListener,
    router: Router,
    limits: cobro_api::server::Limits,
    grace: Duration,
    stopper: Stopper,
    stopping: watch::Receiver<bool>,
    store: Store,
    scheduler: JobScheduler,
    worker: Option<JoinHandle<()>>,
    _dispatcher: Option<JoinHandle<()>>,
    provider: Option<crate::provider::ProviderHandle>,
    demo: Option<(PathBuf, String)>,
}

impl Application {
    /// Runs every start-up step (see the module docs); the port is bound
    /// when this returns (`--listen` with port 0 picks a free one).
    pub async fn build(
        global: &GlobalSettings,
        settings: &ServeSettings,
        sender: &SenderSettings,
    ) -> anyhow::Result<Self> {
        let SenderSettings {
            provider,
            key_window,
            reconcile,
        } = sender;
        // Before anything is opened: a weak secret is a setting to fix.
        settings.check_webhook_secrets()?;
        let reconciler_only;
        let policy = if settings.no_migrate {
            SchemaPolicy::Require
        } else {
            SchemaPolicy::Migrate
        };
        let (store, target) = database::open(global, policy).await?;
        let clock: Arc<dyn Clock> = Arc::new(SystemClock);
        let demo = match target.embedded_file() {
            Some(file) => Some((file, demo::prepare(&store, global, clock.now()).await?)),
            None => None,
        };
        let scheduler = schedule::purge(
            &store,
            &clock,
            &settings.retention,
            settings.purge_batch,
            &settings.purge_schedule,
        )
        .await?;
        let listener = TcpListener::bind(settings.listen)
            .await
            .with_context(|| format!("could not listen on {}", settings.listen))?;
        let address = listener
            .local_addr()
            .context("could not read the bound address")?;
        let (stopper, stopping) = Stopper::new();

        let mut registry = Registry::load(provider, Some(key_window), Some(reconcile))?;
        // Only the processes that send start the embedded fake provider
        // (the environment's provider without a URL).
        let embedded_provider = !settings.no_worker && registry.wants_embedded();
        match registry.env_provider_mut() {
            // The environment's provider: COBRO_WEBHOOK_SECRET, or for the
            // embedded fake provider a secret made here (and given to it).
            Some(spec) => {
                spec.webhook_secret = settings
                    .webhook_secret
                    .clone()
                    .or_else(|| embedded_provider.then(generated_webhook_secret));
                spec.webhook_secret_previous = settings.webhook_secret_previous.clone();
            }
            None if settings.webhook_secret.is_some() => anyhow::bail!(
                "COBRO_WEBHOOK_SECRET is set with COBRO_PROVIDERS_FILE: give each provider its webhook_secret_env or webhook_secret_file in the file"
            ),
            None => {}
        }
        let webhook_secret = registry
            .env_provider_mut()
            .and_then(|spec| spec.webhook_secret.clone());
        let mut api = ApiSettings {
            idempotency_retention: settings.retention.idempotency_retention,
            tombstone_retention: settings.retention.tombstone_retention,
            webhook_tolerance: settings.webhook_tolerance,
            rate_limit: cobro_api::rate_limit::RateLimit {
                per_second: settings.rate_limit,
                burst: settings.rate_limit_burst,
            },
            token_cache_ttl: settings.token_cache_ttl,
            request_timeout: settings.http.http_request_timeout,
            test_hold: settings.test_hold.clone(),
            event_endpoints: settings.dispatcher.endpoints.policy(demo.is_some()),
            ..ApiSettings::default()
        };
        if let Some(hold) = &api.test_hold {
            tracing::warn!(
                ?hold.point,
                "COBRO_TEST_HOLD is set: requests with keys of its prefix will never be answered (a crash test's hook)"
            );
        }
        // Each provider's webhooks at /v1/webhooks/{name}, with its kind's
        // signature scheme; a provider without a signing secret: 404.
        for spec in registry.providers() {
            if let Some(receiver) = crate::provider::webhook_receiver(spec) {
                api.webhooks.insert(spec.name.clone(), receiver);
            }
        }
        // New payments of accounts that name no provider go to the default,
        // written on the payment when it is created.
        api.default_provider = Some(registry.default_name().to_owned());
        // Routing across the providers (docs/routing.md): every account's
        // stored rules must still name providers this file defines.
        crate::routing::check_stored_rules(&store, &registry).await?;
        api.routing = registry.routing_settings(settings.token_cache_ttl);
        api.breaker = registry.routing().breaker.clone();
        let state = AppState::new(store.clone(), Arc::clone(&clock), api);
        // The workers (one per provider) run in this process unless told
        // otherwise; the API wakes them in memory after every commit that
        // enqueued work.
        let (provider_handle, worker) = if settings.no_worker {
            database::require_pool(global, &store, 1, "the long polls")?;
            (None, None)
        } else {
            let configs = crate::worker::worker_configs(&registry, &settings.worker)?;
            database::check_clock(&store, registry.clock_bound()).await?;
            database::require_pool(
                global,
                &store,
                1 + configs.len(),
                "the long polls and the workers (one per provider)",
            )?;
            let handle = crate::provider::connect(registry.clone(), true).await?;
            let circuits = Arc::new(cobro_settle::routing::Circuits::new(
                store.clone(),
                Arc::clone(&clock),
                registry.routing().breaker.clone(),
            ));
            let task = crate::worker::spawn(
                store.clone(),
                &handle,
                Arc::clone(&clock),
                (configs, circuits),
                Arc::clone(&state.work_available),
                stopping.clone(),
                settings.shutdown_grace,
            )?;
            (Some(handle), Some(task))
        };
        // Events go out from every process unless told otherwise.
        let dispatcher = crate::events::spawn_dispatcher(
            &store,
            &clock,
            &settings.dispatcher,
            demo.is_some(),
            stopping.clone(),
        )?;
        // The reconcilers (one per provider) run on a schedule in every
        // process that has providers (with or without its workers), each
        // asking its provider about the attempts sent to it, unless told not to.
        let reconciler_providers = match &provider_handle {
            Some(handle) => Some(handle),
            None if !registry.wants_embedded() => {
                reconciler_only = Some(crate::provider::connect(registry, false).await?);
                reconciler_only.as_ref()
            }
            None => None,
        };
        match reconciler_providers {
            Some(handle) if !settings.schedule.no_reconciler => {
                schedule::reconcilers(
                    &scheduler,
                    &store,
                    &clock,
                    handle,
                    reconcile,
                    &settings.schedule.reconcile_schedule,
                )
                .await?;
            }
            Some(_) => tracing::warn!("no scheduled reconciler in this process (--no-reconciler)"),
            None => tracing::warn!(
                "no provider configured: no scheduled reconciler in this process; set COBRO_PROVIDER_URL or COBRO_PROVIDERS_FILE"
            ),
        }
        if let (Some(fake), Some(secret)) = (
            provider_handle.as_ref().and_then(|h| h.embedded.as_ref()),
            &webhook_secret,
        ) {
            // Bound above, so the URL is final; a wildcard address is
            // reached over loopback.
            let host = if address.ip().is_unspecified() {
                SocketAddr::new(std::net::Ipv4Addr::LOCALHOST.into(), address.port())
            } else {
                address
            };
            fake.control()
                .set_webhook(Some(fake_provider::WebhookTarget {
                    url: format!("http://{host}/v1/webhooks/fake"),
                    secret: secret.expose().to_owned(),
                }));
        }
        Ok(Self {
            address,
            listener,
            // The router carries its own request ids, request span and key echo.
            router: cobro_api::router(state),
            limits: settings.http.limits(),
            grace: settings.shutdown_grace,
            stopper,
            stopping,
            store,
            scheduler,
            worker,
            _dispatcher: dispatcher,
            provider: provider_handle,
            demo,
        })
    }

    /// The bound address.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// The bound port.
    pub fn port(&self) -> u16 {
        self.address.port()
    }

    /// Asks the running application to stop (after [`run_until_stopped`]
    /// began, or before: then it drains at once).
    ///
    /// [`run_until_stopped`]: Self::run_until_stopped
    pub fn stopper(&self) -> Stopper {
        self.stopper.clone()
    }

    /// The embedded default's database file and dev token, for the banner.
    pub fn demo(&self) -> Option<(&std::path::Path, &str)> {
        self.demo.as_ref().map(|(f, t)| (f.as_path(), t.as_str()))
    }

    /// The embedded fake provider's URL, when this process started one.
    pub fn embedded_provider_url(&self) -> Option<String> {
        self.provider
            .as_ref()
            .and_then(|h| h.embedded.as_ref())
            .map(|fake| fake.url())
    }

    /// Serves until stopped, then drains for at most the grace period
    /// (connections with no request running close at once; see
    /// `cobro_api::server`), stops the worker and the schedules, and closes
    /// the store when every connection finished.
    pub async fn run_until_stopped(self) -> anyhow::Result<()> {
        let Self {
            listener,
            router,
            limits,
            grace,
            stopping,
            store,
            mut scheduler,
            worker,
            ..
        } = self;
        scheduler
            .start()
            .await
            .context("could not start the purge schedule")?;
        let server = cobro_api::server::serve(listener, router, limits, stopping.clone());
        let grace_over = async {
            stopped(stopping).await;
            tokio::time::sleep(grace).await;
        };
        let drained = tokio::select! {
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
        };
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
}

/// A fresh webhook secret for the embedded fake provider: 122 random bits,
/// never printed (the provider gets it in memory).
fn generated_webhook_secret() -> WebhookSecret {
    WebhookSecret::new(format!("whsec_{}", uuid::Uuid::new_v4().simple()))
}
