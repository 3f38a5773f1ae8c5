//! `fake-provider`: the fake card provider as a process.
//!
//! Prints `fake-provider listening on http://127.0.0.1:PORT` as its first
//! stdout line (tests spawn it and read that line), then serves until
//! SIGINT/SIGTERM.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use clap::Parser;
use fake_provider::{Config, WebhookDialect, WebhookTarget};
use humantime::parse_duration;
use tokio::signal::unix::{SignalKind, signal};

#[derive(Parser)]
#[command(
    version,
    about = "A fake card provider with the faults that make payments hard"
)]
struct Args {
    /// Port to listen on (0 picks a free one).
    #[arg(long, default_value_t = 8089)]
    port: u16,
    /// Address to bind.
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// Idempotency key retention in virtual time (ms, s, m, h, d).
    #[arg(long, default_value = "24h", value_parser = parse_duration)]
    retention: Duration,
    /// Seed of the fault RNG.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Serve the /__admin control API (never in a production-like setup).
    #[arg(long)]
    admin: bool,
    /// Webhook target URL (needs --webhook-secret).
    #[arg(long, requires = "webhook_secret")]
    webhook_url: Option<String>,
    /// Webhook signing secret.
    #[arg(long, requires = "webhook_url")]
    webhook_secret: Option<String>,
    /// Which API's events the webhook target receives: `fake` (signed in
    /// Fake-Signature) or `stripe` (Stripe's events, signed in
    /// Stripe-Signature).
    #[arg(long, default_value = "fake")]
    webhook_dialect: WebhookDialect,
    /// First webhook retry delay.
    #[arg(long, default_value = "50ms", value_parser = parse_duration)]
    webhook_retry_base: Duration,
    /// How many webhook events are delivered at once (events with the same
    /// reference stay in order); 1 sends every event in order.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=1024))]
    webhook_concurrency: u16,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .init();
    let args = Args::parse();
    let webhook = args
        .webhook_url
        .zip(args.webhook_secret)
        .map(|(url, secret)| WebhookTarget { url, secret });
    let config = Config {
        retention: args.retention,
        seed: args.seed,
        admin: args.admin,
        webhook,
        webhook_dialect: args.webhook_dialect,
        webhook_retry_base: args.webhook_retry_base,
        webhook_concurrency: args.webhook_concurrency.into(),
        clock_start: None,
    };
    let running = fake_provider::start_on(SocketAddr::new(args.host, args.port), config).await?;
    println!("fake-provider listening on {}", running.url());
    let (mut terminate, mut interrupt) = (
        signal(SignalKind::terminate())?,
        signal(SignalKind::interrupt())?,
    );
    tokio::select! { _ = terminate.recv() => {}, _ = interrupt.recv() => {} }
    running.shutdown().await;
    Ok(())
}
