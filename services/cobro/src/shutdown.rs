//! Stopping: who asks for it (SIGTERM, SIGINT, or a test through a
//! [`Stopper`]) and how a running part waits for it (a `watch` channel
//! that turns `true` once).

use anyhow::Context;
use std::sync::Arc;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::watch;

/// Asks every part watching its channel to stop; cheap to clone.
#[derive(Clone, Debug)]
pub struct Stopper(Arc<watch::Sender<bool>>);

impl Stopper {
    /// A stopper and the receiver the running parts watch.
    pub fn new() -> (Self, watch::Receiver<bool>) {
        let (stop, stopping) = watch::channel(false);
        (Self(Arc::new(stop)), stopping)
    }

    /// Asks for the stop (again is harmless).
    pub fn stop(&self) {
        self.0.send_replace(true);
    }
}

/// Calls `stopper` at the first SIGTERM or SIGINT from now on. Installed
/// before the listening line is printed, so a signal sent as soon as the
/// server is announced is never lost to the default action (which would
/// kill the process without draining).
pub fn on_signals(stopper: Stopper) -> anyhow::Result<()> {
    let mut terminate = signal(SignalKind::terminate()).context("could not watch SIGTERM")?;
    let mut interrupt = signal(SignalKind::interrupt()).context("could not watch SIGINT")?;
    tokio::spawn(async move {
        let name = tokio::select! {
            _ = terminate.recv() => "SIGTERM",
            _ = interrupt.recv() => "SIGINT",
        };
        tracing::info!(signal = name, "shutting down: draining in-flight requests");
        stopper.stop();
    });
    Ok(())
}

/// A receiver that turns `true` at the first SIGTERM or SIGINT.
pub fn watch_signals() -> anyhow::Result<watch::Receiver<bool>> {
    let (stopper, stopping) = Stopper::new();
    on_signals(stopper)?;
    Ok(stopping)
}

/// Completes once a stop was asked for (or can no longer be asked for).
pub async fn stopped(mut stopping: watch::Receiver<bool>) {
    let _ = stopping.wait_for(|stop| *stop).await;
}
