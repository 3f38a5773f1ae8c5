//! `cobro serve`: builds the [`Application`], makes SIGTERM and SIGINT stop
//! it, prints its stdout lines (the embedded default's banner, then `cobro
//! listening on http://ADDR`, then the embedded provider's line), and runs
//! it until stopped.

use crate::app::Application;
use crate::output::say;
use crate::settings::{GlobalSettings, SenderSettings, ServeSettings};

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
    let app = Application::build(global, &args.settings, &args.sender).await?;
    // Before the listening line: a signal sent as soon as the server is
    // announced drains it.
    crate::shutdown::on_signals(app.stopper())?;
    if let Some((file, dev_token)) = app.demo() {
        crate::demo::print_banner(app.address(), file, dev_token)?;
    }
    say(format_args!("cobro listening on http://{}", app.address()))?;
    tracing::info!(address = %app.address(), "listening");
    if let Some(url) = app.embedded_provider_url() {
        say(format_args!(
            "embedded fake provider (no real money moves): {url} (faults, clock and ledger at {url}/__admin)"
        ))?;
    }
    app.run_until_stopped().await
}
