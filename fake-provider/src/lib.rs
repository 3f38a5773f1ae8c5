#![doc = include_str!("../README.md")]
//!
//! # Layout
//! - [`config`]: [`Config`], [`WebhookTarget`] and [`WebhookDialect`].
//! - `pipeline`: the single request path of both dialects (faults, then
//!   idempotency, then the effect, then sabotage of the answer).
//! - `api`: the fake dialect's routes (its own JSON API).
//! - `stripe`: the Stripe dialect's routes, a translation of Stripe's API
//!   onto the same engine.
//! - `state`: all data behind one mutex, and the effects on it (the
//!   engine both dialects drive).
//! - `idempotency`: key reservation, replay and retention.
//! - [`faults`]: rules and their seeded matching.
//! - [`ledger`]: the effects actually made, the tests' ground truth.
//! - [`trace`]: the trace context (`traceparent`) every API request carried.
//! - [`webhooks`]: signed at-least-once delivery with its own faults.
//! - `server`: the hyper accept loop that can close a connection unanswered.
//! - `admin` / [`Control`] / [`AdminClient`]: the control API over HTTP,
//!   in-process, and as a client.

mod admin;
mod api;
mod client;
mod clock;
pub mod config;
mod control;
pub mod faults;
mod idempotency;
pub mod ledger;
pub mod model;
mod pipeline;
mod server;
mod state;
mod stripe;
pub mod trace;
pub mod webhooks;

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

pub use client::{AdminClient, AdminError};
pub use config::{Config, WebhookDialect, WebhookTarget};
pub use control::{ActiveFault, Control};
pub use faults::{FaultAction, FaultRule, FiredCount, Operation};
pub use ledger::{Effects, Ledger, LedgerCharge, LedgerRefund};
pub use model::{CaptureMethod, Charge, ChargeStatus, Refund, RefundStatus};
pub use pipeline::{REPLAYED_HEADER, REQUEST_ID_HEADER, SHOULD_RETRY_HEADER};
pub use stripe::API_VERSION as STRIPE_API_VERSION;
pub use trace::SeenRequest;
pub use webhooks::{SIGNATURE_HEADER, STRIPE_SIGNATURE_HEADER, WebhookDelivery, sign};

/// A provider serving on a local port. Dropping it stops the server too (the
/// shutdown signal's sender goes away); [`Running::shutdown`] also waits.
#[derive(Debug)]
pub struct Running {
    addr: SocketAddr,
    control: Control,
    shutdown: watch::Sender<bool>,
    server: JoinHandle<()>,
    dispatcher: JoinHandle<()>,
}

/// Starts a provider on `127.0.0.1` with a free port.
pub async fn start(config: Config) -> std::io::Result<Running> {
    start_on(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)), config).await
}

/// Starts a provider on `addr` (port 0 picks a free one).
pub async fn start_on(addr: SocketAddr, config: Config) -> std::io::Result<Running> {
    let listener = TcpListener::bind(addr).await?;
    let mut addr = listener.local_addr()?;
    if addr.ip().is_unspecified() {
        // Bound to every interface: loopback is the address callers can use.
        addr.set_ip(Ipv4Addr::LOCALHOST.into());
    }
    let (events_tx, events_rx) = mpsc::unbounded_channel();
    let shared = Arc::new(state::Shared::new(&config, events_tx));
    let (shutdown, shutdown_rx) = watch::channel(false);
    let mut router = api::routes().layer(axum::middleware::from_fn_with_state(
        shared.clone(),
        trace::record,
    ));
    if config.admin {
        router = router.merge(admin::routes());
    }
    let router = router.with_state(shared.clone());
    let server = tokio::spawn(server::serve(listener, router, shutdown_rx.clone()));
    let dispatcher = tokio::spawn(webhooks::dispatch(
        shared.clone(),
        events_rx,
        shutdown_rx,
        config.webhook_concurrency,
    ));
    Ok(Running {
        addr,
        control: Control::new(shared),
        shutdown,
        server,
        dispatcher,
    })
}

impl Running {
    /// `http://127.0.0.1:PORT`, without a trailing slash.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// A handle with the powers of `/__admin` (whether or not it is served).
    pub fn control(&self) -> Control {
        self.control.clone()
    }

    /// Stops accepting, lets in-flight answers finish (up to a short grace
    /// period) and stops webhook delivery, including pending retries.
    pub async fn shutdown(self) {
        let _ = self.shutdown.send(true);
        let _ = self.server.await;
        let _ = self.dispatcher.await;
    }
}
